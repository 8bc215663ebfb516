"""Bad input, one table: every row is refused before any byte moves, with its message asserted.

Layouts and plans, buffers, the executor's agreement on real ranks, checkpoints, run configs and
task data. ``python tests/test_bad_inputs.py`` prints the table as docs/reliability.md shows it.

Executor rows run on the module's 4-rank ``LocalWorld`` (every rank must raise and leave its
destination untouched); the others run in this process (``move(..., dry_run=True)`` checks the
layouts and the buffers exactly as a real move does, and plans rank 0).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch

import rank_jobs
from catalogue import CONFIGS, TINY_LLAMA, named_layouts
from test_loop_inputs import config
from rlhf_switch.vps import ADAM_FIELDS, PARAM, Box, Layout, ParallelConfig, StateKey, build_layout, \
    llama_spec, plan_rank
from rlhf_switch.vps.layout import BufferSpec
from rlhf_switch.vps.materialize import allocate

REPO = Path(__file__).resolve().parents[1]
SPEC = llama_spec(TINY_LLAMA, name="tiny-llama")
L = named_layouts(SPEC)
UP0 = "model.layers.0.mlp.up_proj.weight"


# --------------------------------------------------------------------------- helpers


def _edit(layout: Layout, rank: int, frags=None, bufs=None, name: str = "edited") -> Layout:
    """``layout`` with rank ``rank``'s fragments and/or buffers replaced by ``frags(old)`` / ``bufs(old)``."""
    fl = [tuple(layout.fragments(r)) for r in range(layout.world_size)]
    bl = [dict(layout.buffers(r)) for r in range(layout.world_size)]
    if frags:
        fl[rank] = tuple(frags(fl[rank]))
    if bufs:
        bl[rank] = bufs(bl[rank])
    return Layout(layout.spec, fl, bl, name)


def _first_of(layout: Layout, rank: int, tensor: str):
    return next(i for i, f in enumerate(layout.fragments(rank)) if f.key.tensor == tensor)


def _replace_frag(layout: Layout, rank: int, tensor: str, **changes) -> Layout:
    i = _first_of(layout, rank, tensor)
    return _edit(layout, rank, lambda fs: fs[:i] + (fs[i]._replace(**changes),) + fs[i + 1:])


def dry(src: Layout, dst: Layout, src_bufs=None, dst_bufs=None, **kw):
    from rlhf_switch.routing import move

    src_bufs = allocate(src, 0) if src_bufs is None else src_bufs
    dst_bufs = allocate(dst, 0) if dst_bufs is None else dst_bufs
    return move(src, dst, src_bufs, dst_bufs, dry_run=True, **kw)


def on_world(ctx, job, *args) -> list[str]:
    """Run ``job`` on every rank of the 4-rank world; every rank must refuse and write nothing."""
    results = ctx.world4.run(job, *args)
    for r, res in enumerate(results):
        assert res["error"] is not None, f"rank {r} moved"
        assert res["untouched"], f"rank {r} wrote into its destination"
    return [res["error"] for res in results]


def fit(cfg: dict) -> list[str]:
    """The pre-start checks' problems (exactly what a run refuses with, before Ray)."""
    from rlhf_switch.problems import run_problems
    from rlhf_switch.rl.config import load_config

    return run_problems(load_config(cfg))


loop = fit  # the engines' refusals are pre-start checks too


def devices(cfg: dict, cuda_available: bool) -> list[str]:
    """The device checks before Ray, where the actors would (not) see a GPU."""
    from rlhf_switch.problems import device_problems
    from rlhf_switch.rl.config import load_config

    return device_problems(load_config(cfg), cuda_available)


def without(module: str, run: Callable):
    """``run()`` as if ``module`` were not installed (``find_spec`` and ``import`` find none)."""
    import sys
    from unittest import mock

    with mock.patch.dict(sys.modules, {module: None}):
        return run()


def load(cfg: dict) -> None:
    from rlhf_switch.rl.config import load_config

    load_config(cfg)


HF = config()["model"]["hf_config"]  # the shipped tiny model (2 layers, hidden 128)


def _hf_spec(hf: dict):
    return llama_spec(hf, name="tiny")


def _weights(hf: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {t.name: torch.randn(t.shape, generator=g) for t in _hf_spec(hf).tensors}


def _checkpoint(ctx, hf: dict, name: str, complete: bool = True) -> Path:
    from rlhf_switch.engines.full_state import FullState

    path = ctx.tmp / name
    FullState(_hf_spec(hf), _weights(hf), scalars={"step": 3}).save_dir(path)
    if not complete:
        (path / "COMPLETE").unlink()
    return path


def _model_dir(ctx, hf_config: dict, weights_of: dict, name: str) -> Path:
    """A ``model.path`` directory: ``config.json`` says ``hf_config``, the weights are ``weights_of``'s."""
    from safetensors.torch import save_file

    path = ctx.tmp / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps(hf_config))
    save_file(_weights(weights_of), str(path / "model.safetensors"))
    return path


def _load_weights(ctx, hf_config: dict, weights_of: dict, name: str):
    from rlhf_switch.engines.full_state import FullState

    return FullState.load_dir(_model_dir(ctx, hf_config, weights_of, name), _hf_spec(hf_config), weights_only=True)


def _model_path_config(ctx, hf_config: dict, weights_of: dict, name: str) -> dict:
    cfg = config()
    cfg["model"] = {"path": str(_model_dir(ctx, hf_config, weights_of, name))}
    return cfg


def _noncontiguous(layout: Layout, name: str):
    bufs = allocate(layout, 0)
    n = bufs[name].numel()
    bufs[name] = torch.zeros(2 * n, dtype=bufs[name].dtype)[::2]
    return bufs


def _inside_source(src: Layout, dst: Layout):
    """Rank 0's smallest destination weight buffer placed inside its largest source buffer."""
    sb, db = allocate(src, 0), allocate(dst, 0)
    name = min(db, key=lambda n: db[n].numel())
    host = max(sb.values(), key=lambda t: t.numel())
    db[name] = host.view(-1)[3:3 + db[name].numel()]
    return sb, db


def _reward_model_dir(ctx, name: str, hf_config: dict = HF, tokenizer: str | None = "char", head: str = "value") -> Path:
    """A reward model directory as ``rlhf-switch rm`` writes one (``head="value"``: the value model,
    its ``reward_model.json`` naming the character tokenizer) — or a causal LM's (``head="lm"``),
    a BPE tokenizer's files instead (``tokenizer="bpe"``) or none (``None``)."""
    from rlhf_switch.models import causal_lm, value_model
    from rlhf_switch.rl.reward_model import REWARD_MODEL_FILE, tokenizer_identity
    from rlhf_switch.rl.tasks import CharTokenizer

    path = ctx.tmp / name
    model = value_model(hf_config, 0) if head == "value" else causal_lm(hf_config, 0)
    model.save_pretrained(str(path))
    if tokenizer == "char":
        (path / REWARD_MODEL_FILE).write_text(json.dumps({"tokenizer": tokenizer_identity(CharTokenizer())}))
    elif tokenizer == "bpe":
        from rlhf_switch.testing.bpe_tokenizer import build_bpe_tokenizer

        build_bpe_tokenizer(path)
    return path


def _reward_config(ctx, model_path) -> dict:
    return config("ppo_tiny.yaml", reward={"model_path": str(model_path), "engine": "fsdp2", "dp": 2})


def _rm_run(**data) -> list[str]:
    """The pre-start problems of the shipped ``rlhf-switch rm`` config with ``data`` changed."""
    import yaml

    from rlhf_switch.problems import reward_training_problems
    from rlhf_switch.rl.reward_model import load_rm_config

    cfg = yaml.safe_load((REPO / "configs" / "rm_tiny.yaml").read_text())
    cfg["data"].update(train_files=[str(REPO / f) for f in cfg["data"]["train_files"]],
                       heldout_files=[str(REPO / f) for f in cfg["data"]["heldout_files"]], **data)
    return reward_training_problems(load_rm_config(cfg))


LESS_LAYERS = {**HF, "num_hidden_layers": 1}
WIDER = {**HF, "intermediate_size": 512}
TP3 = ParallelConfig(tp=3)


@dataclass
class Bad:
    id: str
    what: str  # the input, as docs/reliability.md's table says it
    run: Callable  # run(ctx) -> error text(s), or raises
    message: str  # must appear in the error (in every rank's error for world rows)
    exc: type | None = Exception  # what run raises (None: run returns the problems)


CASES = [
    # ---- layouts and plans
    Bad("overlapping-boxes", "destination layout: two overlapping boxes of one tensor on one rank",
        lambda ctx: dry(L["zero3"], _edit(L["tp2"], 0, lambda fs: fs + (fs[_first_of(L["tp2"], 0, UP0)],),
                                          name="overlap")),
        f"layout overlap is invalid: rank 0: overlapping boxes of {UP0}"),
    Bad("uncovered", "destination layout that leaves part of a tensor on no rank",
        lambda ctx: dry(L["zero3"], _edit(L["tp2xpp2"], 1, lambda fs: tuple(f for f in fs if f.key.tensor != UP0),
                                          name="holey")),
        f"{UP0}: ranks hold 3072 of its 6144 elements (the layout does not cover the tensor)"),
    Bad("unknown-tensor", "a fragment of a tensor the model does not have",
        lambda ctx: dry(L["zero3"], _replace_frag(L["fsdp"], 0, UP0, key=StateKey("model.layers.9.mlp.up_proj.weight"))),
        "rank 0: unknown tensor 'model.layers.9.mlp.up_proj.weight' (not in model 'tiny-llama')"),
    Bad("box-outside", "a box reaching outside its tensor's shape",
        lambda ctx: dry(L["zero3"], _replace_frag(L["replicated"], 0, UP0, box=Box((0, 0), (97, 64)))),
        f"rank 0: box [0:97,0:64] of {UP0} is outside shape (96, 64)"),
    Bad("undeclared-buffer", "a fragment in a buffer the layout does not declare",
        lambda ctx: dry(L["zero3"], _replace_frag(L["replicated"], 0, UP0, buffer="param/nowhere")),
        f"rank 0: {UP0} points at undeclared buffer 'param/nowhere'"),
    Bad("view-past-buffer", "a fragment's view running past the end of its buffer",
        lambda ctx: dry(L["zero3"], _edit(L["replicated"], 0, bufs=lambda b: {
            **b, f"param/{UP0}": BufferSpec(6000, "float32")})),
        f"rank 0: {UP0} [0:96,0:64] spans [0, 6144) of buffer 'param/{UP0}' which has 6000 elements"),
    Bad("tp-not-dividing", "Megatron TP=3 of a model with 8 heads, 4 KV heads, vocab 250",
        lambda ctx: build_layout(SPEC, TP3),
        "TP=3 does not divide num_attention_heads=8, num_key_value_heads=4, model.embed_tokens.weight vocab=250 "
        "(pass vocab_divisible_by to pad it)"),
    Bad("vllm-tp-not-dividing", "vLLM TP=3 of the same model",
        lambda ctx: __import__("rlhf_switch.vps.layouts.vllm", fromlist=["x"]).vllm_layout(SPEC, 3),
        "vLLM cannot run 'tiny-llama' at TP=3: it does not divide num_attention_heads=8, num_key_value_heads=4, "
        "model.embed_tokens.weight padded vocab=256"),
    Bad("vllm-dtype", "vLLM layout with an engine dtype that does not exist",
        lambda ctx: __import__("rlhf_switch.vps.layouts.vllm", fromlist=["x"]).vllm_layout(SPEC, 2, dtype="float8"),
        "vLLM layout of 'tiny-llama': unknown engine dtype 'float8'"),
    Bad("pp-too-deep", "PP=4 of a 3-layer model", lambda ctx: build_layout(SPEC, ParallelConfig(pp=4)),
        "PP=4 is larger than the model's 3 layers"),
    Bad("other-model", "source and destination layouts of different models",
        lambda ctx: dry(L["fsdp"], build_layout(llama_spec({**TINY_LLAMA, "intermediate_size": 64}, name="other"),
                                                CONFIGS["replicated"]), {}, {}),
        "cannot move DP4[fsdp] (model 'tiny-llama') into DP4 (model 'other'): the layouts describe different models"),
    Bad("world-mismatch-layouts", "a 4-rank source into a 2-rank destination",
        lambda ctx: dry(L["fsdp"], build_layout(SPEC, ParallelConfig(dp=2)), {}, {}),
        "DP4[fsdp] is for 4 ranks and DP2 for 2; this process group has 4"),
    Bad("world-mismatch-group", "2-rank layouts moved on a 4-rank process group (every rank)",
        lambda ctx: ctx.world4.run(rank_jobs.move_and_check, *(2 * [build_layout(SPEC, ParallelConfig(tp=2))])),
        "this process group has 4"),
    Bad("missing-fields", "a destination wanting Adam state from a weights-only source",
        lambda ctx: dry(L["fsdp"], build_layout(SPEC, ParallelConfig(dp=4), (PARAM,) + ADAM_FIELDS), {}, {}),
        "DP4 wants fields ['exp_avg', 'exp_avg_sq', 'master'] that DP4[fsdp] does not hold"),
    Bad("rank-outside", "planning rank 4 of a 4-rank world", lambda ctx: plan_rank(L["fsdp"], L["tp4"], 4),
        "rank 4 is outside a world of 4"),
    Bad("budget-below-element", "a staging budget of 4 B for fp32 (one element each way needs 8 B)",
        lambda ctx: dry(L["fsdp"], L["tp4"], budget_bytes=4),
        "a staging budget of 4 B cannot hold one element in each direction (needs >= 8 B)"),
    # ---- buffers (rank 0; the same checks on every rank of a real move)
    Bad("missing-buffer", "a destination buffer the layout declares, not given",
        lambda ctx: dry(L["zero3"], L["tp4"], None, {k: v for k, v in allocate(L["tp4"], 0).items()
                                                    if k != "param/lm_head.weight"}),
        "destination buffers of rank 0 do not match TP4: missing 'param/lm_head.weight'"),
    Bad("engine-dtype", "trainer (fp32) into a bf16 engine layout whose buffers were allocated fp32",
        lambda ctx: dry(L["fsdp"], ctx.vllm_bf16, None, allocate(ctx.vllm_bf16, 0) | {
            "param/model.norm.weight": torch.zeros(64)}),
        "destination buffers of rank 0 do not match vLLM-TP4: 'param/model.norm.weight' is torch.float32, "
        "layout says bfloat16"),
    Bad("buffer-not-a-tensor", "the buffers' declarations (a LocalState's .buffers) passed instead of its tensors",
        lambda ctx: dry(L["replicated"], L["tp4"], dict(L["replicated"].buffers(0)), None),
        "source buffers of rank 0 do not match DP4: 'param/model.embed_tokens.weight' is a BufferSpec, not a tensor"),
    Bad("buffer-too-small", "a source buffer with fewer elements than its layout needs",
        lambda ctx: dry(L["replicated"], L["tp4"], allocate(L["replicated"], 0) | {f"param/{UP0}": torch.zeros(6143)}),
        f"source buffers of rank 0 do not match DP4: 'param/{UP0}' has 6143 elements, layout needs 6144"),
    Bad("buffer-strided", "a non-contiguous buffer",
        lambda ctx: dry(L["replicated"], L["tp4"], None, _noncontiguous(L["tp4"], "param/model.norm.weight")),
        "destination buffers of rank 0 do not match TP4: 'param/model.norm.weight' is not contiguous"),
    Bad("dst-in-src", "a destination buffer inside a source buffer's memory",
        lambda ctx: dry(L["fsdp"], L["tp2xpp2"], *_inside_source(L["fsdp"], L["tp2xpp2"])),
        "share memory; a move needs separate buffers (copy one side first)"),
    # ---- the executor's agreement, on 4 real ranks: every rank refuses
    Bad("missing-buffer-one-rank", "a missing destination buffer on rank 2 only (every rank refuses)",
        lambda ctx: on_world(ctx, rank_jobs.move_with_bad_buffer_on, 2, L["zero3"], L["tp2xpp2"]),
        "move DP4[zero3] -> TP2·PP2 refused before any data moved: rank 2: ValueError: destination buffers of "
        "rank 2 do not match TP2·PP2: missing 'param/lm_head.weight'"),
    Bad("dst-in-src-one-rank", "a destination in source memory on rank 1 only (every rank refuses)",
        lambda ctx: on_world(ctx, rank_jobs.move_into_source_memory_on, 1, L["fsdp"], L["tp2xpp2"]),
        "move DP4[fsdp] -> TP2·PP2 refused before any data moved: rank 1: ValueError: rank 1: source buffer"),
    Bad("plan-digest", "rank 3 given another destination layout (every rank refuses)",
        lambda ctx: on_world(ctx, rank_jobs.move_with_different_dst_on, 3, L["zero3"], L["tp2xpp2"], L["tp2"]),
        "plan digest mismatch, refusing to move DP4[zero3] -> "),
    Bad("pair-digest", "one per-peer digest tampered on rank 1, plan digests equal (every rank refuses)",
        lambda ctx: on_world(ctx, rank_jobs.move_with_tampered_pair_digest_on, 1, L["fsdp"], L["tp2xpp2"]),
        "disagree on the transfers between them"),
    # ---- checkpoints and model directories
    Bad("checkpoint-other-model", "a checkpoint loaded for another model (FullState.load_dir)",
        lambda ctx: __import__("rlhf_switch.engines.full_state", fromlist=["x"]).FullState.load_dir(
            _checkpoint(ctx, HF, "ckpt_other"), _hf_spec(WIDER)),
        "ckpt_other holds another model (spec digest"),
    Bad("checkpoint-incomplete", "a checkpoint whose save died half-way",
        lambda ctx: __import__("rlhf_switch.engines.full_state", fromlist=["x"]).FullState.load_dir(
            _checkpoint(ctx, HF, "ckpt_half", complete=False), _hf_spec(HF)),
        "ckpt_half is an incomplete checkpoint (no COMPLETE marker)"),
    Bad("weights-shape", "model weights of another MLP width than their config.json (load_dir)",
        lambda ctx: _load_weights(ctx, HF, WIDER, "w_wider"),
        "w_wider/model.safetensors does not hold model 'tiny': model.layers.0.mlp.gate_proj.weight has shape "
        "[512, 128], the model's is [256, 128]"),
    Bad("weights-extra", "model weights with a layer more than their config.json (load_dir)",
        lambda ctx: _load_weights(ctx, LESS_LAYERS, HF, "w_deeper"),
        "unexpected tensors not in the model: model.layers.1.input_layernorm.weight"),
    Bad("weights-missing", "model weights with a layer fewer than their config.json (load_dir)",
        lambda ctx: _load_weights(ctx, HF, LESS_LAYERS, "w_shallower"),
        "model.layers.1.self_attn.q_proj.weight [128, 128] is missing"),
    Bad("model-path-weights", "`model.path` whose weights are not its config.json's model (before Ray)",
        lambda ctx: fit(_model_path_config(ctx, HF, WIDER, "p_wider")),
        "p_wider/model.safetensors has model.layers.0.mlp.gate_proj.weight of shape [512, 128], "
        "config.json implies [256, 128]", None),
    # ---- run configs: batch divisibility (each its own message)
    Bad("micro-per-dp-rank", "micro_batch_size 32 with a per-DP-rank mini batch of 16 (mini 32, train dp 2)",
        lambda ctx: fit(config(**{"algorithm.micro_batch_size": 32})),
        "algorithm.micro_batch_size=32 does not divide the per-rank mini batch 32/2 = 16", None),
    Bad("train-dp", "mini_batch_size 3 on train dp 2",
        lambda ctx: fit(config(**{"algorithm.prompts_per_iteration": 3, "algorithm.mini_batch_size": 3})),
        "train: dp=2 does not divide algorithm.mini_batch_size=3", None),
    Bad("reference-dp", "a rollout batch of 9 (3 prompts × 3) on reference dp 2",
        lambda ctx: fit(config(**{"algorithm.prompts_per_iteration": 3, "algorithm.group_size": 3,
                                  "algorithm.mini_batch_size": None, "algorithm.micro_batch_size": 1,
                                  "train": {"engine": "torch_tp", "tp": 2}})),
        "reference: dp=2 does not divide the rollout batch 9", None),
    Bad("critic-dp-equal", "PPO: critic dp 2 beside train dp 1",
        lambda ctx: loop(config("ppo_tiny.yaml", **{"train": {"engine": "torch_tp", "tp": 2}})),
        "critic: dp=2 must equal train.dp=1 (the critic and the actor take the same share of each batch)", None),
    Bad("rollout-dp", "3 prompts per iteration on rollout dp 2",
        lambda ctx: fit(config(**{"algorithm.prompts_per_iteration": 3, "algorithm.mini_batch_size": 24,
                                  "rollout": {"engine": "torch", "dp": 2}})),
        "rollout: dp=2 does not divide algorithm.prompts_per_iteration=3 (each replica takes whole groups of "
        "prompts)", None),
    Bad("mini-batch", "mini_batch_size 48 of a rollout batch of 128",
        lambda ctx: fit(config(**{"algorithm.mini_batch_size": 48})),
        "algorithm.mini_batch_size=48 does not divide the rollout batch prompts_per_iteration·group_size = 128",
        None),
    Bad("eval-dp", "eval.num_prompts 199 on rollout dp 2",
        lambda ctx: fit(config(**{"eval.num_prompts": 199, "rollout": {"engine": "torch", "dp": 2}})),
        "eval.num_prompts=199 is not divisible by rollout.dp=2", None),
    Bad("sft-dp", "sft.batch_size 31 on train dp 2", lambda ctx: fit(config(**{"sft.batch_size": 31})),
        "sft: batch_size=31 is not divisible by train.dp=2", None),
    Bad("top-p", "algorithm.top_p 0.9 (the rollout engines would ignore it)",
        lambda ctx: fit(config(**{"algorithm.top_p": 0.9})),
        "algorithm.top_p: 0.9 — the rollout engines sample from the whole distribution; only top_p 1.0 runs", None),
    # ---- run configs: layouts, engines, fields
    Bad("phase-world", "rollout tp·pp·dp = 3 on a world of 2",
        lambda ctx: fit(config(**{"rollout.tp": 3, "rollout.dp": 1})),
        "rollout: tp·pp·dp = 3·1·1 = 3, but world_size = 2", None),
    Bad("train-kv", "train TP 4 of a model with 2 KV heads",
        lambda ctx: fit(config(**{"world_size": 4, "train": {"engine": "torch_tp", "tp": 4},
                                  "reference": {"engine": "torch_tp", "tp": 4}, "rollout.tp": 4})),
        "train: tp=4 does not divide num_key_value_heads=2", None),
    Bad("unknown-train-engine", "train.engine: megatron", lambda ctx: loop(config(**{"train.engine": "megatron"})),
        "train.engine: unknown training engine 'megatron' (registered: deepspeed, fsdp2, torch_pp, torch_tp; or "
        "give your own as 'module:Class')", None),
    Bad("unknown-rollout-engine", "rollout.engine: sglang", lambda ctx: loop(config(**{"rollout.engine": "sglang"})),
        "rollout.engine: unknown rollout engine 'sglang' (registered: torch, vllm; or give your own as "
        "'module:Class')", None),
    Bad("engine-layout", "reference on DeepSpeed with zero_stage 0",
        lambda ctx: loop(config(**{"reference": {"engine": "deepspeed", "zero_stage": 0, "dp": 2}})),
        "reference: engine deepspeed needs zero_stage 1, 2 or 3, got 0", None),
    Bad("model-dtype", "model.dtype bfloat16 (the CPU loop trains in fp32)",
        lambda ctx: loop(config(**{"model.dtype": "bfloat16"})),
        "model.dtype: bfloat16 — the CPU loop trains in float32", None),
    Bad("handoff-ipc-in-process", "rollout.handoff: ipc with the torch rollout engine (in the trainer's processes)",
        lambda ctx: loop(config(**{"rollout.engine": "torch", "rollout.handoff": "ipc"})),
        "rollout.handoff: ipc hands buckets to rollout workers in processes of their own; engine 'torch' runs "
        "inside the trainer's processes (use p2p or auto)", None),
    Bad("device-cuda", "device: cuda where no GPU is visible",
        lambda ctx: devices(config(device="cuda"), cuda_available=False),
        "device: cuda, but no GPU is visible here (torch.cuda.is_available() is False", None),
    Bad("unknown-field", "a misspelt field (algorithm.group_sise)",
        lambda ctx: load(config(**{"algorithm.group_sise": 4})),
        "algorithm.group_sise: unknown field in algorithm; did you mean 'group_size'?"),
    # ---- task data
    Bad("prompt-too-long", "max_position_embeddings 8 for prompts of 7 tokens + 8 new",
        lambda ctx: fit(config(**{"model.hf_config.max_position_embeddings": 8})),
        "model: the task's longest prompt is 7 tokens; with max_new_tokens=8 that is 15 > max_position_embeddings=8",
        None),
    Bad("vocab-too-small", "vocab_size 32 for the tokenizer's 47 ids",
        lambda ctx: fit(config(**{"model.hf_config.vocab_size": 32})),
        "model: vocab_size=32 is smaller than the tokenizer's 47 ids", None),
    Bad("task-space", "20000 + 200 prompts from a 2-digit addition task", lambda ctx: fit(config(**{"task.num_train": 20000})),
        "task: addition with max_len=2 has 10000 distinct prompts; num_train + num_heldout = 20200", None),
    # ---- reward models (docs/reward-models.md)
    Bad("reward-model-missing", "reward.model_path: a directory that does not exist",
        lambda ctx: fit(_reward_config(ctx, ctx.tmp / "no_rm_here")),
        "reward.model_path: no such directory: ", None),
    Bad("reward-model-causal-lm", "reward.model_path: a causal LM instead of a reward model",
        lambda ctx: fit(_reward_config(ctx, _reward_model_dir(ctx, "rm_lm", head="lm"))),
        "rm_lm is a causal LM (lm_head.weight), not a reward model: it has no score.weight", None),
    Bad("reward-model-vocab-size", "a reward model of vocab_size 32 for a policy of vocab_size 64",
        lambda ctx: fit(_reward_config(ctx, _reward_model_dir(ctx, "rm_32", {**HF, "vocab_size": 32}))),
        "reward.model_path: vocab_size=32, but the policy generates ids up to 63 (its vocab_size=64): the reward "
        "model's vocabulary must be the policy's", None),
    Bad("reward-model-tokenizer", "a reward model of a BPE tokenizer for a policy of the character tokenizer",
        lambda ctx: fit(_reward_config(ctx, _reward_model_dir(ctx, "rm_bpe", tokenizer="bpe"))),
        "does not read the policy's token ids: it was made with a Hugging Face tokenizer, the policy uses the "
        "character tokenizer", None),
    Bad("preference-key", "rlhf-switch rm: preference files without the chosen_key it names (`better`)",
        lambda ctx: _rm_run(chosen_key="better"),
        "data/prefs_tiny/train.jsonl: no key 'better' (keys: chosen, prompt, rejected)", None),
    Bad("reward-missing", "task.reward_fn in a module that does not exist",
        lambda ctx: fit(config(**{"task.reward_fn": "no_such_module_xyz:score"})),
        "task.reward_fn: reward function 'no_such_module_xyz:score': no module named 'no_such_module_xyz'", None),
    Bad("reward-raises", "a reward function that raises (on the check's held-out sample, in its worker process)",
        lambda ctx: fit(config(**{"task.reward_fn": "test_loop_inputs:raising_reward"})),
        "task.reward_fn: reward function test_loop_inputs:raising_reward on sample 0 (prompt='37+32=', "
        "response='69', answer='69') raised KeyError: 'no such answer table'", None),
    Bad("reward-timeout", "a reward function that sleeps past task.reward_timeout_s 2",
        lambda ctx: fit(config(**{"task.reward_fn": "test_loop_inputs:sleeping_reward", "task.reward_timeout_s": 2})),
        "task.reward_fn: reward function test_loop_inputs:sleeping_reward: its call on sample 0 (prompt='37+32=', "
        "response='69', answer='69') did not return within 2 s (reward_timeout_s); its worker process was stopped",
        None),
    Bad("logging-not-installed", "logging: [wandb] where wandb is not installed",
        lambda ctx: without("wandb", lambda: fit(config(logging=["tensorboard", "wandb"]))),
        "logging: wandb needs the wandb extra (wandb not installed): pip install 'rlhf-switch[wandb]', or leave "
        "wandb out of logging", None),
]


class Ctx:
    def __init__(self, request, tmp: Path):
        self.request, self.tmp = request, tmp

    @property
    def world4(self):
        return self.request.getfixturevalue("world4")

    @property
    def vllm_bf16(self):
        from rlhf_switch.vps.layouts.vllm import vllm_layout

        return vllm_layout(SPEC, 4, dtype="bfloat16")


HEAVY_CASES = {"world-mismatch-group"}  # left out of `make test-fast` (a 4-rank world of its own)


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id, marks=pytest.mark.heavy if c.id in HEAVY_CASES else ())
                                  for c in CASES])
def test_bad_input_is_refused_with_its_message(case, request, tmp_path):
    ctx = Ctx(request, tmp_path)
    if case.exc is None:  # the problems list of a config check
        problems = case.run(ctx)
        assert any(case.message in p for p in problems), (case.message, problems)
        return
    try:
        out = case.run(ctx)
    except case.exc as e:
        assert case.message in str(e), (case.message, str(e))
        return
    if isinstance(out, list) and out and all(isinstance(x, str) for x in out):  # every rank's error
        for r, err in enumerate(out):
            assert case.message in err, (r, case.message, err)
        return
    pytest.fail(f"{case.id}: accepted ({out!r})")


def test_the_table_has_twenty_rows_or_more():
    assert len(CASES) >= 20 and len({c.id for c in CASES}) == len(CASES)


def table() -> str:
    rows = ["| input | refused with (message contains) |", "|---|---|"]
    rows += [f"| {c.what} | `{c.message.replace('|', '/')}` |" for c in CASES]
    return "\n".join(rows)


if __name__ == "__main__":
    print(table())


def test_rollout_options_are_the_engines_own():
    """``rollout.options``: what the engine declares it takes (``RolloutEngine.options``), else refused
    before the run with the option named."""
    from rlhf_switch.engines.base import phase_engine_problems
    from rlhf_switch.rl.config import RolloutLayout

    ok = RolloutLayout(engine="vllm", tp=1, options={"cpu_kernels": "vllm", "processed_weights": "loader"})
    assert phase_engine_problems("rollout", ok, None) == []
    bad = RolloutLayout(engine="vllm", tp=1, options={"cpu_kernels": "amx", "prefix": 1})
    assert phase_engine_problems("rollout", bad, None) == [
        "rollout.options.cpu_kernels: 'amx' — one of plain, vllm",
        "rollout.options.prefix: not an option of this engine (it takes: cpu_kernels, processed_weights)"]
    torch_engine = RolloutLayout(engine="torch", tp=1, options={"cpu_kernels": "plain"})
    assert phase_engine_problems("rollout", torch_engine, None) == [
        "rollout.options.cpu_kernels: not an option of this engine (it takes: none)"]
