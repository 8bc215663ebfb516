"""The pre-start checks (``rlhf_switch/problems.py``), rule by rule: each rule on the inputs at its
boundary, with the exact words of every problem it finds (a problem is what a user reads; the
bad-input table, ``test_bad_inputs.py``, checks one message per rule through ``run_problems``).

Seconds: configs are loaded, no process group, model or Ray; the reward check runs its function
in this process."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from rlhf_switch import problems as P
from rlhf_switch.rl.config import ConfigError, ModelDims, RolloutLayout, TrainLayout, load_config
from rlhf_switch.rl.data import load_splits

from test_loop_inputs import config  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


raw = config  # a shipped config as data, with changes (dotted paths) applied


def cfg(name: str = "grpo_tiny_fsdp.yaml", **changes):
    return load_config(raw(name, **changes))


def dims(heads=8, kv=4, inter=96, layers=3, moe=None, vocab=64, context=64, special=None) -> ModelDims:
    return ModelDims(hidden_size=64, num_layers=layers, num_heads=heads, num_kv_heads=kv, intermediate_size=inter,
                     vocab_size=vocab, max_context=context, special_ids=special or {}, moe_intermediate_size=moe)


def train(tp=1, pp=1, dp=1):
    return TrainLayout(engine="fsdp2", tp=tp, pp=pp, dp=dp)


def rollout(tp=1, pp=1, dp=1):
    return RolloutLayout(engine="vllm", tp=tp, pp=pp, dp=dp)


# ------------------------------------------------------------------------ the registry itself

def test_the_checks_run_in_registration_order_and_a_name_registers_once():
    assert list(P.CHECKS) == ["model", "elastic", "layouts", "batch", "algorithm", "off_policy", "rebalance", "lend",
                              "sampling", "agent", "prompts", "engines", "device", "lora", "reward", "logging",
                              "reward_model"]
    with pytest.raises(ValueError, match=r"^a check named 'batch' is registered already$"):
        P.check("batch")(lambda c, f: [])
    assert list(P.CHECKS)[3] == "batch" and P.CHECKS["batch"] is P._batch


def test_run_problems_refuses_unknown_skips_and_skips_what_it_is_told():
    c = cfg(**{"algorithm.top_p": 0.5, "algorithm.micro_batch_size": 32})
    with pytest.raises(ValueError, match=r"^no such checks: nope, zzz; known: model, elastic, layouts, batch, "):
        P.run_problems(c, skip=("zzz", "batch", "nope"))
    top_p = "algorithm.top_p: 0.5 — the rollout engines sample from the whole distribution; only top_p 1.0 runs"
    micro = "algorithm.micro_batch_size=32 does not divide the per-rank mini batch 32/2 = 16"
    assert P.run_problems(c, cuda_available=False) == [micro, top_p]  # registration order: batch before sampling
    assert P.run_problems(c, cuda_available=False, skip=("batch",)) == [top_p]
    assert P.run_problems(c, cuda_available=False, skip=("batch", "sampling")) == []


def test_a_model_config_that_does_not_read_is_reported_once_and_the_rules_needing_it_wait(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 128}))
    data = raw()
    data["model"] = {"path": str(tmp_path), "dtype": "float32"}
    found = P.run_problems(load_config(data), cuda_available=False)
    assert found[0] == (f"model.path: {tmp_path / 'config.json'} lacks num_hidden_layers, num_attention_heads, "
                        f"intermediate_size, vocab_size")
    assert not any(p.startswith("model: ") for p in found), found  # the family and fit checks waited


def test_check_run_says_how_many_problems():
    one = cfg(**{"algorithm.top_p": 0.5})
    with pytest.raises(ConfigError) as e:
        P.check_run(one, cuda_available=False)
    assert str(e.value).splitlines()[0] == "the config cannot run on world_size=2: 1 problem"
    assert e.value.problems == P._sampling(one, None)
    two = cfg(**{"algorithm.top_p": 0.5, "sft.batch_size": 31})
    with pytest.raises(ConfigError) as e:
        P.check_run(two, cuda_available=False)
    assert str(e.value).splitlines()[0] == "the config cannot run on world_size=2: 2 problems"
    P.check_run(cfg(), cuda_available=False)  # the shipped config runs


def test_the_local_machine_is_asked_unless_the_run_joins_a_cluster(monkeypatch):
    """``cuda_available`` left to ``LOCAL``: this machine's answer, or None (not known before Ray)
    for a run that joins a cluster at ``ray_address``."""
    import rlhf_switch.device as device

    seen = []
    monkeypatch.setattr(P, "CHECKS", {"probe": lambda c, facts: seen.append(facts.cuda_available) or []})
    monkeypatch.setattr(device, "cuda_available", lambda: "this machine's answer")
    P.run_problems(cfg())
    P.run_problems(cfg(ray_address="10.0.0.1:6379"))
    P.run_problems(cfg(), cuda_available=True)
    assert seen == ["this machine's answer", None, True]


# ----------------------------------------------------------------------------- layouts and model

def test_every_phase_covers_the_world():
    assert P.layout_problems("train", train(tp=2, pp=1, dp=3), 6) == []
    assert P.layout_problems("reference", train(tp=2, pp=1, dp=3), 4) == [
        "reference: tp·pp·dp = 2·1·3 = 6, but world_size = 4 (every phase is colocated on all devices)"]


def test_tp_must_split_heads_kv_heads_and_mlp_and_pp_needs_a_layer_per_stage():
    d = dims(heads=8, kv=4, inter=96, layers=3)
    assert P.model_split_problems("train", train(tp=4, pp=3), d) == []
    assert P.model_split_problems("train", train(tp=3, pp=4), d) == [
        "train: tp=3 does not divide num_attention_heads=8",
        "train: tp=3 does not divide num_key_value_heads=4",
        "train: pp=4 is more stages than num_hidden_layers=3"]
    assert P.model_split_problems("train", train(tp=8), d) == ["train: tp=8 does not divide num_key_value_heads=4"]
    assert P.model_split_problems("critic", train(tp=2), dims(heads=8, kv=4, inter=95)) == [
        "critic: tp=2 does not divide intermediate_size=95"]
    # MoE experts' width split like the MLP's
    assert P.model_split_problems("train", train(tp=4), dims(moe=40)) == []
    assert P.model_split_problems("train", train(tp=4), dims(moe=42)) == [
        "train: tp=4 does not divide moe_intermediate_size=42"]


def test_a_rollout_above_the_kv_heads_replicates_them_in_whole_copies():
    d = dims(heads=8, kv=2, inter=96)
    assert P.model_split_problems("rollout", rollout(tp=8), d) == []  # 4 copies of each KV head
    assert P.model_split_problems("rollout", rollout(tp=2), d) == []
    assert P.model_split_problems("rollout", rollout(tp=8), dims(heads=20, kv=3, inter=96)) == [
        "rollout: tp=8 does not divide num_attention_heads=20",
        "rollout: tp=8 is above num_key_value_heads=3 and must then be a multiple of it"]
    assert P.model_split_problems("rollout", rollout(tp=6), dims(heads=12, kv=4, inter=96)) == [
        "rollout: tp=6 is above num_key_value_heads=4 and must then be a multiple of it"]
    # a training phase never replicates them
    assert P.model_split_problems("train", train(tp=8), d) == ["train: tp=8 does not divide num_key_value_heads=2"]


# --------------------------------------------------------------------------------------- batches

def test_each_batch_rule_at_its_boundary():
    ok = cfg()  # 16 prompts x 8 = 128, mini 32 on train dp 2 (16 each), micro 16, rollout dp 2
    assert P.batch_problems(ok) == []
    assert P.batch_problems(cfg(**{"algorithm.prompts_per_iteration": 15, "algorithm.mini_batch_size": 24})) == [
        "rollout: dp=2 does not divide algorithm.prompts_per_iteration=15 (each replica takes whole groups of "
        "prompts)",
        "algorithm.micro_batch_size=16 does not divide the per-rank mini batch 24/2 = 12"]
    assert P.batch_problems(cfg(**{"algorithm.mini_batch_size": 48})) == [
        "algorithm.mini_batch_size=48 does not divide the rollout batch prompts_per_iteration·group_size = 128",
        "algorithm.micro_batch_size=16 does not divide the per-rank mini batch 48/2 = 24"]
    # train dp not dividing the mini batch: the micro batch rule is not asked then
    assert P.batch_problems(cfg(**{"algorithm.prompts_per_iteration": 3, "algorithm.group_size": 3,
                                   "algorithm.mini_batch_size": 3, "algorithm.micro_batch_size": 1,
                                   "rollout.dp": 1, "rollout.tp": 2, "eval.num_prompts": 100})) == [
        "train: dp=2 does not divide algorithm.mini_batch_size=3",
        "reference: dp=2 does not divide the rollout batch 9"]
    assert P.batch_problems(cfg(**{"eval.num_prompts": 199})) == [
        "eval.num_prompts=199 is not divisible by rollout.dp=2"]
    assert P.batch_problems(cfg(**{"eval.num_prompts": 202})) == [
        "eval.num_prompts=202 is more than task.num_heldout=200"]
    assert P.batch_problems(cfg(**{"sft.batch_size": 31})) == ["sft: batch_size=31 is not divisible by train.dp=2"]
    assert P.batch_problems(cfg(**{"sft.batch_size": 2, "eval.num_prompts": 200})) == []


def test_eval_split_all_counts_the_train_prompts_too():
    # grpo_tiny_fsdp: 200 held-out and 2000 train prompts
    assert P.batch_problems(cfg(**{"eval.split": "all", "eval.num_prompts": 2200})) == []
    assert P.batch_problems(cfg(**{"eval.split": "all", "eval.num_prompts": 2202})) == [
        "eval.num_prompts=2202 is more than task.num_heldout + num_train = 2200 (eval.split: all)"]
    c = cfg(**{"eval.split": "all", "eval.num_prompts": 5, "task.num_train": 4, "task.num_heldout": 2})
    splits = load_splits(c)[0]
    assert c.eval.samples(splits) == [*splits.heldout, *splits.train[:3]]
    assert cfg(**{"eval.num_prompts": 2, "task.num_heldout": 3}).eval.samples(splits) == list(splits.heldout)


def test_an_agent_runs_evaluation_is_any_number_of_episodes():
    # episodes' turns go to the replicas in batches of any size: no divisibility by rollout.dp
    assert P.batch_problems(cfg("agent_guess_tiny.yaml", **{"eval.num_prompts": 15})) == []
    assert P.batch_problems(cfg("agent_guess_tiny.yaml", **{"eval.num_prompts": 63, "eval.split": "all"})) == []


def test_the_critic_takes_the_actors_share():
    assert P.batch_problems(cfg("ppo_tiny.yaml")) == []
    c = cfg("ppo_tiny.yaml", **{"train": {"engine": "torch_tp", "tp": 2}})
    assert P.batch_problems(c) == [
        "critic: dp=2 must equal train.dp=1 (the critic and the actor take the same share of each batch)"]


def test_every_world_of_an_elastic_schedule_is_checked_with_its_prefix():
    """The run's own world, then each ``elastic.schedule`` entry's, each entry's problems prefixed."""
    grown = {"iteration": 3, "world_size": 4, "train": {"engine": "fsdp2", "dp": 4},
             "rollout": {"engine": "torch", "dp": 4}, "reference": {"engine": "fsdp2", "dp": 4}}
    c = cfg(**{"elastic": {"schedule": [grown]}, "eval.num_prompts": 198})
    micro = "elastic.schedule[0]: algorithm.micro_batch_size=16 does not divide the per-rank mini batch 32/4 = 8"
    assert P._batch(c, None) == [micro, "elastic.schedule[0]: eval.num_prompts=198 is not divisible by rollout.dp=4"]
    c = cfg(**{"elastic": {"schedule": [grown, {**grown, "iteration": 5, "world_size": 3,
                                                 "train": {"engine": "fsdp2", "dp": 3},
                                                 "rollout": {"engine": "torch", "dp": 3},
                                                 "reference": {"engine": "fsdp2", "dp": 3}}]}})
    assert P._batch(c, None) == [
        micro,
        "elastic.schedule[1]: rollout: dp=3 does not divide algorithm.prompts_per_iteration=16 (each replica takes "
        "whole groups of prompts)",
        "elastic.schedule[1]: train: dp=3 does not divide algorithm.mini_batch_size=32",
        "elastic.schedule[1]: reference: dp=3 does not divide the rollout batch 128",
        "elastic.schedule[1]: eval.num_prompts=200 is not divisible by rollout.dp=3",
        "elastic.schedule[1]: sft: batch_size=32 is not divisible by train.dp=3"]
    assert P._layouts(c, P.Facts(dims(heads=4, kv=2, inter=256, layers=2), None)) == []


# ------------------------------------------------------------------------------------ sampling

def test_only_top_p_1_runs():
    assert P._sampling(cfg(), None) == []
    assert P._sampling(cfg(**{"algorithm.top_p": 0.999}), None) == [
        "algorithm.top_p: 0.999 — the rollout engines sample from the whole distribution; only top_p 1.0 runs"]


# ----------------------------------------------------------------------------- model weights

def _write_safetensors(path: Path, shapes: dict, metadata: bool = True) -> Path:
    """A ``.safetensors`` file of zeros with these tensor shapes (the format: an 8-byte little-endian
    header length, the JSON header, the data)."""
    header, offset = {}, 0
    for name, shape in shapes.items():
        n = 4
        for s in shape:
            n *= s
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    if metadata:
        header["__metadata__"] = {"format": "pt"}
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + bytes(offset))
    return path


def test_safetensors_shapes_reads_only_the_header(tmp_path):
    f = _write_safetensors(tmp_path / "w.safetensors", {"a": (2, 3), "b": (5,), "c": ()})
    assert P.safetensors_shapes(f) == {"a": (2, 3), "b": (5,), "c": ()}


HF = raw()["model"]["hf_config"]  # the shipped tiny Llama: 2 layers, hidden 128, vocab 64
LM = {"model.embed_tokens.weight": (64, 128), "model.norm.weight": (128,), "lm_head.weight": (64, 128)} | {
    f"model.layers.{i}.{n}": s for i in range(2) for n, s in [
        ("self_attn.q_proj.weight", (128, 128)), ("self_attn.k_proj.weight", (64, 128)),
        ("self_attn.v_proj.weight", (64, 128)), ("self_attn.o_proj.weight", (128, 128)),
        ("mlp.gate_proj.weight", (256, 128)), ("mlp.up_proj.weight", (256, 128)),
        ("mlp.down_proj.weight", (128, 256)), ("input_layernorm.weight", (128,)),
        ("post_attention_layernorm.weight", (128,))]}
VALUE = {n: s for n, s in LM.items() if n != "lm_head.weight"} | {"score.weight": (1, 128), "score.bias": (1,)}


def model_dir(root: Path, shapes: dict | None, hf: dict | None = None, file: str = "model.safetensors") -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(HF if hf is None else hf))
    if shapes is not None:
        _write_safetensors(root / file, shapes)
    return root


def path_model(root: Path):
    data = raw()
    data["model"] = {"path": str(root), "dtype": "float32"}
    return load_config(data).model


def test_model_path_weights_are_the_model_config_json_describes(tmp_path):
    assert P.weights_problems(cfg().model) == []  # an inline config: no weights to compare
    assert P.weights_problems(path_model(model_dir(tmp_path / "none", None))) == []  # starts from the seeded model
    assert P.weights_problems(path_model(model_dir(tmp_path / "same", LM))) == []
    rotary = dict(LM) | {"model.layers.0.self_attn.rotary_emb.inv_freq": (16,)}  # old checkpoints carry it
    assert P.weights_problems(path_model(model_dir(tmp_path / "rotary", rotary))) == []
    unknown = model_dir(tmp_path / "gpt9", {"x": (1,)}, {**HF, "model_type": "gpt9"})
    assert P.weights_problems(path_model(unknown)) == []  # family_problems_of says why
    w = tmp_path / "bad" / "model.safetensors"
    shapes = {n: s for n, s in LM.items() if n != "lm_head.weight"} | {"model.embed_tokens.weight": (65, 128)}
    shapes |= {f"extra.{c}": (1,) for c in "gfedcba"}
    assert P.weights_problems(path_model(model_dir(tmp_path / "bad", shapes))) == [
        f"model.path: {w} has model.embed_tokens.weight of shape [65, 128], config.json implies [64, 128]",
        f"model.path: {w} lacks lm_head.weight [64, 128] that config.json implies",
        f"model.path: {w} holds tensors config.json does not describe: extra.a, extra.b, extra.c, extra.d, "
        f"extra.e (and 2 more)"]
    shapes = dict(LM) | {"extra.b": (1,), "extra.a": (2,)}
    w = tmp_path / "two" / "model.safetensors"
    assert P.weights_problems(path_model(model_dir(tmp_path / "two", shapes))) == [
        f"model.path: {w} holds tensors config.json does not describe: extra.a, extra.b"]
    for n, more in ((5, ""), (6, " (and 1 more)")):  # five are named, the rest counted
        shapes = dict(LM) | {f"extra.{c}": (1,) for c in "abcdef"[:n]}
        w = tmp_path / f"x{n}" / "model.safetensors"
        assert P.weights_problems(path_model(model_dir(tmp_path / f"x{n}", shapes))) == [
            f"model.path: {w} holds tensors config.json does not describe: extra.a, extra.b, extra.c, extra.d, "
            f"extra.e{more}"]
    root = model_dir(tmp_path / "garbage", None)
    (root / "model.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{nope")
    found = P.weights_problems(path_model(root))
    assert len(found) == 1 and found[0].startswith(
        f"model.path: {root / 'model.safetensors'} is not a readable safetensors file ("), found


def test_a_reward_models_starting_weights_hold_the_trunk(tmp_path):
    from rlhf_switch.rl.config import ModelConfig

    def model(root):
        return ModelConfig(path=str(root), dtype="float32")

    assert P.trunk_problems(ModelConfig(hf_config=HF)) == []
    assert P.trunk_problems(model(model_dir(tmp_path / "none", None))) == []  # no weights: a seeded trunk
    assert P.trunk_problems(model(model_dir(tmp_path / "lm", LM))) == []  # a causal LM's trunk
    assert P.trunk_problems(model(model_dir(tmp_path / "value", VALUE, file="a.safetensors"))) == []
    assert P.trunk_problems(model(model_dir(tmp_path / "gpt9", {"x": (1,)}, {**HF, "model_type": "gpt9"}))) == []
    root = model_dir(tmp_path / "bad", {n: s for n, s in LM.items() if n != "model.norm.weight"}
                     | {"model.layers.1.input_layernorm.weight": (127,)})
    assert P.trunk_problems(model(root)) == [
        f"model.path: {root} has model.layers.1.input_layernorm.weight of shape [127], config.json implies [128]",
        f"model.path: {root} lacks model.norm.weight [128] that config.json implies"]
    # at most ten, in the trunk's order
    root = model_dir(tmp_path / "empty", {"lm_head.weight": (64, 128)})
    trunk = [n for n in VALUE if n.startswith("model.")]
    order = ["model.embed_tokens.weight"] + [n for n in trunk if n.startswith("model.layers.")]
    assert P.trunk_problems(model(root)) == [
        f"model.path: {root} lacks {n} {list(LM[n])} that config.json implies" for n in order[:10]]
    root = model_dir(tmp_path / "garbage", None)
    (root / "w.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{]")
    found = P.trunk_problems(model(root))
    assert len(found) == 1 and found[0].startswith(f"model.path: {root / 'w.safetensors'} is not a readable "
                                                   f"safetensors file ("), found


def test_a_reward_model_directory(tmp_path):
    f = "reward.model_path"
    d = tmp_path / "nowhere"
    assert P.reward_model_dir_problems(f, str(d)) == ([f"{f}: no such directory: {d}"], None)
    d.mkdir()
    assert P.reward_model_dir_problems(f, str(d)) == (
        [f"{f}: {d} has no config.json (a reward model directory holds config.json and *.safetensors weights)"], None)
    (d / "config.json").write_text("{not json")
    problems, hf = P.reward_model_dir_problems(f, str(d))
    assert hf is None and len(problems) == 1 and problems[0].startswith(f"{f}: {d / 'config.json'} is not JSON (")
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8, "vocab_size": 4}))
    assert P.reward_model_dir_problems(f, str(d)) == (
        [f"{f}: {d / 'config.json'} lacks num_hidden_layers, num_attention_heads, intermediate_size"], None)
    gpt9 = {**HF, "model_type": "gpt9"}
    d = model_dir(tmp_path / "gpt9", None, gpt9)
    assert P.reward_model_dir_problems(f, str(d)) == ([
        f"{f}: model_type 'gpt9' is not supported (known: " + ", ".join(__import__(
            "rlhf_switch.families", fromlist=["x"]).FAMILIES) + ")",
        f"{f}: {d} holds no *.safetensors weights"], gpt9)
    d = model_dir(tmp_path / "empty", None)
    assert P.reward_model_dir_problems(f, str(d)) == ([f"{f}: {d} holds no *.safetensors weights"], HF)
    d = model_dir(tmp_path / "ok", VALUE)
    assert P.reward_model_dir_problems(f, str(d)) == ([], HF)
    # weights in two files; a ...ForSequenceClassification has no score.bias
    d = model_dir(tmp_path / "split", {n: s for n, s in VALUE.items() if n.startswith("model.layers.")},
                  file="b.safetensors")
    _write_safetensors(d / "a.safetensors", {n: s for n, s in VALUE.items()
                                             if not n.startswith("model.layers.") and n != "score.bias"})
    assert P.reward_model_dir_problems(f, str(d)) == ([], HF)
    d = model_dir(tmp_path / "lm", LM)
    assert P.reward_model_dir_problems(f, str(d)) == ([
        f"{f}: {d} is a causal LM (lm_head.weight), not a reward model: it has no score.weight (a reward model is "
        f"the family's …ForTokenClassification or …ForSequenceClassification with num_labels 1)"], HF)
    d = model_dir(tmp_path / "trunk", {n: s for n, s in VALUE.items() if not n.startswith("score.")})
    assert P.reward_model_dir_problems(f, str(d))[0] == [
        f"{f}: {d} is no value head, not a reward model: it has no score.weight (a reward model is the family's "
        f"…ForTokenClassification or …ForSequenceClassification with num_labels 1)"]
    shapes = {n: s for n, s in VALUE.items() if n != "model.norm.weight"} | {
        "score.weight": (2, 128), "model.embed_tokens.weight": (64, 129), "zz.extra": (1,), "aa.extra": (1,),
        "model.layers.0.self_attn.rotary_emb.inv_freq": (16,)}
    d = model_dir(tmp_path / "bad", shapes)
    assert P.reward_model_dir_problems(f, str(d)) == ([
        f"{f}: {d} has model.embed_tokens.weight of shape [64, 129], its config.json implies [64, 128]",
        f"{f}: {d} lacks model.norm.weight [128] that its config.json implies",
        f"{f}: {d} has score.weight of shape [2, 128], its config.json implies [1, 128] (a reward model has "
        f"num_labels 1)",
        f"{f}: {d} holds tensors its config.json does not describe: aa.extra, zz.extra"], HF)
    d = model_dir(tmp_path / "six", VALUE | {f"extra.{c}": (1,) for c in "fedcba"})
    assert P.reward_model_dir_problems(f, str(d)) == ([
        f"{f}: {d} holds tensors its config.json does not describe: extra.a, extra.b, extra.c, extra.d, extra.e"],
        HF)
    d = model_dir(tmp_path / "garbage", None)
    (d / "w.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{]")
    problems, hf = P.reward_model_dir_problems(f, str(d))
    assert hf == HF and len(problems) == 1 and problems[0].startswith(
        f"{f}: {d / 'w.safetensors'} is not a readable safetensors file ("), problems


# ------------------------------------------------------------- devices that move between phases

ASYNC = "grpo_tiny_async.yaml"  # vLLM replicas of their own devices (rollout.mode: disaggregated), one step off


def sync(**changes):
    """The async config's replicas with the synchronous loop (no batch in flight)."""
    return cfg(ASYNC, **{"algorithm.off_policy": None, **changes})


OFF1 = {"algorithm.off_policy": {"max_staleness": 1}}


def test_replicas_of_their_own_devices():
    assert P._replicas_of_their_own(cfg(ASYNC)) is True
    assert P._replicas_of_their_own(cfg(ASYNC, **{"rollout.mode": "colocated"})) is False
    assert P._replicas_of_their_own(cfg()) is False  # the torch engine lives in the trainer's actors
    # an engine the registry does not know counts as one (the engines check names it)
    assert P._replicas_of_their_own(cfg(ASYNC, **{"rollout.engine": "no_such_module:Engine"})) is True


def test_a_batch_in_flight_needs_replicas_of_their_own_a_fixed_world_and_no_dynamic_sampling():
    assert P._off_policy(sync(), None) == []
    assert P._off_policy(cfg(ASYNC, **{"algorithm.off_policy": {"max_staleness": 0}}), None) == []
    assert P._off_policy(cfg(ASYNC), None) == []
    assert P._off_policy(cfg(**OFF1), None) == [
        "algorithm.off_policy.max_staleness: 1 — generation overlaps training only on rollout replicas of their own "
        "devices: rollout.mode: disaggregated with a replica engine (vllm); this run's rollout is torch, colocated"]
    found = P._off_policy(cfg(ASYNC, **OFF1, **{"elastic": {"redundancy": "none"},
                                                 "algorithm.name": "dapo", "algorithm.dynamic_sampling": {}}), None)
    assert found == [
        "algorithm.off_policy: an elastic run does not carry a batch in flight across a resize yet; set "
        "max_staleness: 0 or remove the elastic block",
        "algorithm.off_policy: dynamic sampling draws its extra rounds synchronously; with a batch in flight they "
        "would queue behind it — use one of the two"]


def test_lending_devices_needs_idle_devices_to_lend():
    assert P._rebalance(cfg(ASYNC), None) == [] and P._lend(cfg(ASYNC), None) == []
    assert P._rebalance(cfg(ASYNC, elastic={"rebalance": "off"}), None) == []
    assert P._lend(cfg(ASYNC, elastic={"lend": "off"}), None) == []
    assert P._lend(sync(elastic={"lend": "rollout"}), None) == []
    assert P._lend(cfg(elastic={"lend": "auto"}), None) == [
        "elastic.lend: auto — lends the trainer's devices to rollout replicas of their own devices: rollout.mode: "
        "disaggregated with a replica engine (vllm); this run's rollout is torch, colocated"]
    assert P._lend(cfg(ASYNC, elastic={"lend": "rollout"}, **OFF1), None) == [
        "elastic.lend: the trainer trains while the replicas generate (off_policy.max_staleness: 1): its devices "
        "are not idle to lend"]
    assert P._rebalance(cfg(elastic={"rebalance": "update"}, **OFF1), None) == [
        "elastic.rebalance: update — lends the rollout replicas' own devices to the update: rollout.mode: "
        "disaggregated with a replica engine (vllm); this run's rollout is torch, colocated",
        "elastic.rebalance: the replicas generate while the trainer trains (off_policy.max_staleness: 1): their "
        "devices are not idle to lend"]


def test_a_rebalanced_update_moves_the_engines_state_in_a_grown_world_that_passes_every_check():
    c = sync(elastic={"rebalance": "update"}, **{"train.offload": "all"})
    assert P._rebalance(c, P.Facts(None, False)) == [
        "elastic.rebalance: the state moves between worlds from the engines' buffers; train.offload: all parks it "
        "in host memory — use offload: none"]
    assert P._rebalance(sync(elastic={"rebalance": "auto"}, **{"algorithm.micro_batch_size": 8}),
                        P.Facts(None, False)) == []
    assert P._rebalance(sync(elastic={"rebalance": "auto"}), P.Facts(None, False)) == [
        "elastic.rebalance: the grown world of 4 devices: algorithm.micro_batch_size=16 does not divide the per-rank "
        "mini batch 32/4 = 8"]
    # the grown world (2 + 2 replicas' devices = 4, every layout scaled along DP): 18 prompts split over 2
    # replicas, not over 4; a per-rank mini batch of 36/2 = 18 over micro batches of 2, not 36/4 = 9
    c = sync(elastic={"rebalance": "update"}, **{"algorithm.prompts_per_iteration": 18,
                                                 "algorithm.mini_batch_size": 36,
                                                 "algorithm.micro_batch_size": 2, "eval.num_prompts": 100})
    assert P.run_problems(c, cuda_available=False, skip=("reward",)) == [
        "elastic.rebalance: the grown world of 4 devices: rollout: dp=4 does not divide "
        "algorithm.prompts_per_iteration=18 (each replica takes whole groups of prompts)",
        "elastic.rebalance: the grown world of 4 devices: algorithm.micro_batch_size=2 does not divide the per-rank "
        "mini batch 36/4 = 9"]


def test_a_lora_run_is_not_rebalanced_yet():
    c = cfg("grpo_tiny_lora.yaml", elastic={"rebalance": "update"},
            rollout={"engine": "vllm", "dp": 2, "mode": "disaggregated"})
    assert P._rebalance(c, P.Facts(None, False)) == [
        "elastic.rebalance: a LoRA run's adapters are not moved between worlds yet"]


# --------------------------------------------------------------------------------------- engines

def test_what_the_engines_cannot_do():
    assert P.engine_problems(cfg()) == [] and P.engine_problems(cfg(ASYNC)) == []
    assert P.engine_problems(cfg(**{"train": {"engine": "fsdp2", "dp": 2, "offload": "all"}})) == []
    tp = {"train": {"engine": "torch_tp", "tp": 2, "offload": "optimizer"}, "reference": {"engine": "torch_tp", "tp": 2}}
    assert P.engine_problems(cfg(**tp)) == [
        "train.offload: optimizer — engine torch_tp cannot park its state in host memory (engines that can: deepspeed, "
        "fsdp2); use offload: none"]
    assert P.engine_problems(cfg(**{"rollout.handoff": "ipc"})) == [
        "rollout.handoff: ipc hands buckets to rollout workers in processes of their own; engine 'torch' runs "
        "inside the trainer's processes (use p2p or auto)"]
    assert P.engine_problems(cfg(ASYNC, **{"rollout.handoff": "ipc"})) == []
    assert P.engine_problems(cfg(**{"rollout.mode": "disaggregated"})) == [
        "rollout.colocate: false needs a rollout engine of its own actors (placement 'replica', e.g. vllm); engine "
        "torch runs inside the trainer's processes, on their devices"]
    # work stealing: rollout replicas only, and a batch collected as soon as it is submitted
    assert P.engine_problems(cfg(**{"rollout.pull_prompts": 4})) == [
        "rollout.pull_prompts: 4 — work stealing hands chunks of a generation to rollout replicas (placement "
        "'replica', e.g. vllm); engine torch generates in the trainer's processes, each rank its share (use 0)"]
    assert P.engine_problems(cfg(ASYNC, **{"rollout.pull_prompts": 4})) == [
        "rollout.pull_prompts: 4 — a batch generated one step ahead is collected an iteration later, and chunks "
        "are handed out only while a generation is collected: it would keep fixed shares (use 0, or "
        "max_staleness: 0; an agent run's rounds are pulled)"]
    assert P.engine_problems(cfg(ASYNC, **{"rollout.pull_prompts": 4, "algorithm.off_policy.max_staleness": 0})) == []
    agent = raw("agent_guess_tiny.yaml", **{"rollout.pull_prompts": 4})
    agent.update(rollout={**agent["rollout"], "engine": "vllm", "mode": "disaggregated"},
                 algorithm={**agent["algorithm"], "off_policy": {"max_staleness": 1}})
    assert P.engine_problems(load_config(agent)) == []
    agent["algorithm"]["off_policy"] = {"max_staleness": 4}  # K >= 2 batches in flight: agent runs
    assert P._off_policy(load_config(agent), None) == []
    unknown = P.engine_problems(cfg(**{"rollout.engine": "no_such_module:Engine", "rollout.handoff": "ipc",
                                       "train.engine": "no_such_module:Trainer", "train.offload": "all"}))
    assert len(unknown) == 2 and all("no_such_module" in p for p in unknown), unknown  # named once each


# -------------------------------------------------------------------------------------- logging

def test_a_logging_backend_must_be_installed(monkeypatch):
    import sys

    assert P._logging(cfg(logging=["tensorboard", "wandb", "mlflow"]), None) == []
    monkeypatch.setitem(sys.modules, "wandb", None)  # find_spec finds none
    monkeypatch.setitem(sys.modules, "alembic", None)
    assert P._logging(cfg(logging=["wandb", "tensorboard", "mlflow"]), None) == [
        "logging: wandb needs the wandb extra (wandb not installed): pip install 'rlhf-switch[wandb]', or leave "
        "wandb out of logging",
        "logging: mlflow needs the mlflow extra (alembic not installed): pip install 'rlhf-switch[mlflow]', or leave "
        "mlflow out of logging"]
    monkeypatch.setitem(sys.modules, "sqlalchemy", None)
    assert P._logging(cfg(logging=["mlflow"]), None) == [
        "logging: mlflow needs the mlflow extra (sqlalchemy, alembic not installed): pip install "
        "'rlhf-switch[mlflow]', or leave mlflow out of logging"]


# --------------------------------------------------------------------------------------- devices

def test_the_device_and_dtype_where_the_actors_run():
    cpu = cfg()
    assert P.device_problems(cpu, False) == [] and P.device_problems(cpu, True) == []
    assert P.device_problems(cpu, None) == []  # auto, not known before Ray: the actors decide
    assert P.device_problems(cfg(device="cpu"), None) == []
    assert P.device_problems(cfg(device="cuda"), None) == []  # taken at its word
    assert P.device_problems(cfg(device="cuda"), False) == [
        "device: cuda, but no GPU is visible here (torch.cuda.is_available() is False: a CPU-only torch, no driver, "
        "or CUDA_VISIBLE_DEVICES empty); use device: auto or device: cpu"]
    assert P.device_problems(cfg(**{"model.dtype": "bfloat16"}), False) == [
        "model.dtype: bfloat16 — the CPU loop trains in float32"]
    assert P.device_problems(cfg(device="cpu", **{"model.dtype": "bfloat16"}), True) == [
        "model.dtype: bfloat16 — the CPU loop trains in float32"]
    # on CUDA each engine says what it computes in: the torch rollout only float32, vLLM also fp16
    assert P.device_problems(cfg(**{"model.dtype": "bfloat16"}), True) == [
        "rollout: engine torch computes in float32, not bfloat16 (model.dtype); set model.dtype: float32 or use an "
        "engine that does"]
    half = cfg(ASYNC, **{"model.dtype": "float16"})
    assert P.device_problems(half, True) == [
        f"{phase}: engine fsdp2 computes in float32/bfloat16, not float16 (model.dtype); set model.dtype: float32 "
        f"or use an engine that does" for phase in ("train", "reference")]
    default = cfg(ASYNC)
    default.model.dtype = None
    assert P.device_problems(default, True) == []  # cuda's default compute dtype, bf16, runs on fsdp2 and vllm
    tp = cfg(**{"train": {"engine": "torch_tp", "tp": 2}, "reference": {"engine": "torch_tp", "tp": 2},
                "rollout.engine": "no_such_module:Engine"})
    tp.model.dtype = None
    assert P.device_problems(tp, True) == [
        f"{phase}: engine torch_tp computes in float32, not bfloat16 (model.dtype unset: device cuda's default); "
        f"set model.dtype: float32 or use an engine that does" for phase in ("train", "reference")]


def test_the_worlds_device_is_resolved_once_where_the_actors_run():
    assert P.world_device(cfg(), False).kind == "cpu"
    with pytest.raises(ConfigError) as e:
        P.world_device(cfg(device="cuda"), False)
    assert str(e.value).splitlines()[0] == "device" and e.value.problems == P.device_problems(cfg(device="cuda"), False)
    with pytest.raises(ConfigError) as e:
        P.world_device(cfg(**{"model.dtype": "bfloat16"}), True)
    assert str(e.value).splitlines()[0] == "the config cannot run on cuda"
    assert e.value.problems == P.device_problems(cfg(**{"model.dtype": "bfloat16"}), True)
    assert P.world_device(cfg(ASYNC), True).compute_dtype == "float32"


# ------------------------------------------------------------------------------ algorithm, LoRA

def test_the_algorithm_resolves_and_has_its_critic():
    assert P._algorithm(cfg(), None) == [] and P._algorithm(cfg("ppo_tiny.yaml"), None) == []
    assert P._algorithm(cfg(**{"algorithm.advantage": "user_pkg.estimators:CriticBaseline"}), None) == [
        "critic: grpo's estimator (user_pkg.estimators:CriticBaseline) uses a critic: give a critic block (engine "
        "and layout of the value model)"]
    assert P._algorithm(cfg(**{"algorithm.advantage": "no_such_module:Estimator"}), None) == [
        "algorithm.advantage 'no_such_module:Estimator' cannot be imported: ModuleNotFoundError: No module named "
        "'no_such_module'"]


LORA = "grpo_tiny_lora.yaml"


def test_lora_needs_engines_that_train_and_take_adapters_and_modules_the_model_has():
    assert P.lora_problems(cfg()) == [] and P.lora_problems(cfg(LORA)) == []
    tp = {"train": {"engine": "torch_tp", "tp": 2}, "reference": {"engine": "torch_tp", "tp": 2}}
    assert P.lora_problems(cfg(LORA, **tp)) == [
        "model.lora: engine torch_tp does not train LoRA adapters (engines that do: deepspeed, fsdp2)"]
    assert P.lora_problems(cfg(LORA, **{"model.lora.target_modules": ["q_proj", "w_pack", "c_attn"]})) == [
        "model.lora.target_modules: w_pack, c_attn — model_type llama has no such linear module in its decoder "
        "layers (it has down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj)"]
    # the rollout replicates the 2 KV heads at tp 4: k/v adapters only with q, k and v all targeted
    wide = {"world_size": 4, "train.dp": 4, "reference.dp": 4, "rollout.tp": 4, "rollout.dp": 1}
    assert P.lora_problems(cfg(LORA, **wide)) == []
    assert P.lora_problems(cfg(LORA, **wide, **{"model.lora.target_modules": ["o_proj", "gate_proj"]})) == []
    assert P.lora_problems(cfg(LORA, **wide, **{"model.lora.target_modules": ["v_proj", "q_proj", "o_proj"]})) == [
        "model.lora.target_modules: at rollout tp=4 above the 2 KV heads, v_proj adapters need q_proj, k_proj and "
        "v_proj all targeted (their lora_B is then split with qkv_proj's replicated KV heads)"]
    assert P.lora_problems(cfg(LORA, **wide, **{"model.lora.target_modules": ["v_proj", "k_proj"]})) == [
        "model.lora.target_modules: at rollout tp=4 above the 2 KV heads, k_proj/v_proj adapters need q_proj, "
        "k_proj and v_proj all targeted (their lora_B is then split with qkv_proj's replicated KV heads)"]
    two = {"world_size": 2, "rollout.tp": 2, "rollout.dp": 1}
    assert P.lora_problems(cfg(LORA, **two, **{"model.lora.target_modules": ["v_proj"]})) == []  # tp 2 = kv heads
    # a model whose config does not read: only the engines are asked
    assert P.lora_problems(cfg(LORA, **tp), P.Facts(None, False)) == [
        "model.lora: engine torch_tp does not train LoRA adapters (engines that do: deepspeed, fsdp2)"]


# ------------------------------------------------------------------------------- task prompts

def test_a_generated_task_fits_its_space_the_answer_room_and_the_model():
    """addition, 1-2 digits: 10000 distinct prompts; the longest prompt '99+99=' is 7 tokens with
    <bos>, the longest answer '198' 4 with <eos>; the character tokenizer has 47 ids, pad 0 bos 1 eos 2."""
    ok = dims(heads=4, kv=2, inter=256, layers=2, vocab=47, context=15,
              special={"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2})
    at_edge = cfg(**{"task.num_train": 9800, "algorithm.max_new_tokens": 8})
    assert P.task_problems(at_edge, ok) == []
    assert P.task_problems(cfg(**{"task.num_train": 9801, "algorithm.max_new_tokens": 4}), ok) == [
        "task: addition with max_len=2 has 10000 distinct prompts; num_train + num_heldout = 10001"]
    assert P.task_problems(cfg(**{"algorithm.max_new_tokens": 3}), None) == [
        "algorithm.max_new_tokens=3 cannot hold the task's longest answer (4 tokens with <eos>)"]
    small = dims(heads=4, kv=2, inter=256, layers=2, vocab=46, context=14,
                 special={"pad_token_id": 0, "bos_token_id": 3, "eos_token_id": 2})
    assert P.task_problems(at_edge, small) == [
        "model: the task's longest prompt is 7 tokens; with max_new_tokens=8 that is 15 > max_position_embeddings=14",
        "model: vocab_size=46 is smaller than the tokenizer's 47 ids",
        "model: bos_token_id=3, but the tokenizer's is 1"]
    no_specials = dims(heads=4, kv=2, inter=256, layers=2, vocab=47, context=15, special={})
    assert P.task_problems(at_edge, no_specials) == []


# --------------------------------------------------------------------------------- data prompts

DATA = REPO / "data" / "gsm8k_tiny"


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> Path:
    """The shipped BPE tokenizer (384 ids, eos 3 '<|im_end|>', a chat template) in a directory."""
    from rlhf_switch.testing.bpe_tokenizer import build_bpe_tokenizer

    out = tmp_path_factory.mktemp("bpe")
    build_bpe_tokenizer(out)
    return out


def data_raw(tokenizer: Path, new_tokens: int = 24, **data) -> dict:
    """A data run over the shipped gsm8k-like files with ``tokenizer`` (a chat template by default)."""
    c = raw(**{"algorithm.max_new_tokens": new_tokens, "eval.num_prompts": 16, "sft": None})
    del c["task"]
    c["model"]["tokenizer"] = str(tokenizer)
    c["data"] = {"train_files": [str(DATA / "train.jsonl")], "heldout_files": [str(DATA / "test.jsonl")],
                 "chat_template": True, **data}
    return c


def data_cfg(tokenizer: Path, new_tokens: int = 24, **data):
    return load_config(data_raw(tokenizer, new_tokens, **data))


def agent_data_cfg(tokenizer: Path, new_tokens: int = 24, env: str = "guess", **agent):
    """``data_raw``'s run as an agent run of ``env``, three turns at most."""
    return load_config({**data_raw(tokenizer, new_tokens), "agent": {"env": env, "max_turns": 3, **agent}})


def bpe_dims(vocab=384, context=512, eos=3):
    return dims(heads=4, kv=2, inter=256, layers=2, vocab=vocab, context=context, special={"eos_token_id": eos})


def test_a_data_runs_tokenizer_fits_the_model(bpe, tmp_path):
    assert P.data_problems(data_cfg(bpe), bpe_dims()) == []
    assert P.data_problems(data_cfg(bpe), bpe_dims(vocab=383, eos=1)) == [
        f"model: vocab_size=383 is smaller than the tokenizer's 384 ids ({bpe})",
        "model: eos_token_id=1 in the model's config, but the tokenizer's eos is 3 ('<|im_end|>'): responses would "
        "not stop where answers end"]
    assert P.data_problems(data_cfg(bpe), None) == []  # the model's config does not read: only the data
    found = P.data_problems(data_cfg(tmp_path), bpe_dims())
    assert len(found) == 1 and found[0].startswith("model.tokenizer: "), found
    plain = without_chat_template(bpe, tmp_path / "plain")
    assert P.data_problems(data_cfg(plain), bpe_dims()) == [
        f"data.chat_template: the tokenizer at {plain} has no chat template"]
    assert P.data_problems(data_cfg(plain, chat_template=False), bpe_dims()) == []


def without_chat_template(bpe: Path, plain: Path) -> Path:
    """A copy of the BPE tokenizer at ``plain`` without its chat template."""
    plain.mkdir()
    for f in bpe.iterdir():
        if f.name != "chat_template.jinja":
            (plain / f.name).write_bytes(f.read_bytes())
    cfg_json = json.loads((plain / "tokenizer_config.json").read_text())
    cfg_json.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(cfg_json))
    return plain


def test_a_data_run_without_model_tokenizer_names_model_path_for_its_tokenizer(tmp_path):
    c = data_raw(tmp_path, chat_template=False)
    c["model"].pop("hf_config")
    c["model"].pop("tokenizer")
    c["model"]["path"] = str(tmp_path)
    assert P.data_problems(load_config(c), bpe_dims()) == [
        f"model.path: no tokenizer in {tmp_path} (no tokenizer.json / tokenizer_config.json)"]


def test_an_agent_data_runs_prompts_are_measured_as_its_first_turn_renders_them(bpe):
    """An agent run with a chat template starts each episode from the template's first turn with
    ``agent.system`` and the tools: the length check counts all of it. A long system message leaves
    no prompt within 36 tokens; without it they fit."""
    room = 512 - 36
    assert P.data_problems(agent_data_cfg(bpe, room, "agent_envs:ChatCalc"), bpe_dims()) == []
    assert P.data_problems(agent_data_cfg(bpe, room, "agent_envs:ChatCalc", system="You add numbers. " * 10),
                           bpe_dims()) == [
        "data.train_files: all 2000 prompts are longer than 36 tokens after rendering and tokenizing "
        "(data.max_prompt_tokens, or the context minus algorithm.max_new_tokens)"]


def test_every_data_file_reads_and_some_prompts_fit(bpe, tmp_path):
    nokey, empty = tmp_path / "nokey.jsonl", tmp_path / "empty.jsonl"
    nokey.write_text('{"prompt": "a", "answer": "1"}\n')
    empty.write_text("")
    c = data_cfg(bpe, train_files=[str(DATA / "train.jsonl"), str(nokey)], heldout_files=[str(empty)])
    assert P.data_problems(c, bpe_dims()) == [
        f"data.train_files[1]: {nokey}: no key 'question' (keys: prompt, answer)",
        f"data.heldout_files[0]: {empty}: the file is empty"]
    # the room the context leaves a prompt: 512 - 512 = 0 tokens
    assert P.data_problems(data_cfg(bpe, new_tokens=512), bpe_dims()) == [
        "algorithm.max_new_tokens=512 leaves no room for a prompt in the model's context of 512 tokens"]
    from rlhf_switch.families import DEFAULT_CONTEXT

    assert P.data_problems(data_cfg(bpe, new_tokens=DEFAULT_CONTEXT), None) == [
        f"algorithm.max_new_tokens={DEFAULT_CONTEXT} leaves no room for a prompt in the model's context of "
        f"{DEFAULT_CONTEXT} tokens"]
    assert P.data_problems(data_cfg(bpe, new_tokens=511), bpe_dims()) == [  # room for 1 token: none fits
        "data.train_files: all 2000 prompts are longer than 1 tokens after rendering and tokenizing "
        "(data.max_prompt_tokens, or the context minus algorithm.max_new_tokens)"]
    assert P.data_problems(data_cfg(bpe, num_heldout=16), bpe_dims()) == []
    assert P.data_problems(data_cfg(bpe, num_heldout=15), bpe_dims()) == [
        "eval.num_prompts=16 is more than the 15 held-out prompts data.heldout_files give"]
    with_train = data_cfg(bpe, num_heldout=15)
    with_train.eval.split = "all"
    assert P.data_problems(with_train, bpe_dims()) == []
    with_train.eval.num_prompts = 2016
    assert P.data_problems(with_train, bpe_dims()) == [
        "eval.num_prompts=2016 is more than the 2015 held-out and train prompts data.heldout_files and "
        "train_files give"]


# ------------------------------------------------------------------ rlhf-switch rm's own config

PREFS = REPO / "data" / "prefs_tiny"


def rm(**changes):
    """configs/rm_tiny.yaml (the character tokenizer, the shipped preference pairs) with changes."""
    from rlhf_switch.rl.reward_model import load_rm_config

    c = raw("rm_tiny.yaml", **changes)
    c["data"]["train_files"] = [str(REPO / f) if not Path(f).is_absolute() else f for f in c["data"]["train_files"]]
    c["data"]["heldout_files"] = [str(REPO / f) if not Path(f).is_absolute() else f
                                  for f in c["data"]["heldout_files"]]
    return load_rm_config(c)


def test_a_reward_model_run_fits_its_world_batch_device_and_data(tmp_path):
    assert P.reward_training_problems(rm(), cuda_available=False) == []
    assert P.reward_training_problems(rm(**{"train.dp": 4, "training.batch_size": 30}), cuda_available=False) == [
        "train: tp·pp·dp = 1·1·4 = 4, but world_size = 2 (every phase is colocated on all devices)",
        "train: dp=4 does not divide training.batch_size=30"]
    assert P.reward_training_problems(rm(**{"train.tp": 3, "train.dp": 1, "world_size": 3}),
                                      cuda_available=False) == [
        "train: tp=3 does not divide num_attention_heads=4",
        "train: tp=3 does not divide num_key_value_heads=2",
        "train: tp=3 does not divide intermediate_size=256",
        "train: engine fsdp2 runs tp=1 only (got tp=3; for tp > 1 use engine torch_tp)"]  # the engine's own rule
    assert P.reward_training_problems(rm(**{"training.micro_batch_size": 12}), cuda_available=False) == [
        "training.micro_batch_size=12 does not divide the per-rank batch 32/2 = 16 pairs"]
    assert P.reward_training_problems(rm(**{"training.micro_batch_size": 8}), cuda_available=False) == []
    assert P.reward_training_problems(rm(**{"model.dtype": "bfloat16"}), cuda_available=False) == [
        "model.dtype: bfloat16 — on CPU a reward model trains in float32"]
    assert P.reward_training_problems(rm(**{"model.dtype": "bfloat16"}), cuda_available=True) == []
    assert P.reward_training_problems(rm(device="cuda"), cuda_available=False) == [
        "device: cuda, but no GPU is visible here (torch.cuda.is_available() is False: a CPU-only torch, no driver, "
        "or CUDA_VISIBLE_DEVICES empty); use device: auto or device: cpu"]
    # not known before Ray (a cluster): device auto waits, device cuda is taken at its word
    assert P.reward_training_problems(rm(**{"model.dtype": "bfloat16"}), cuda_available=None) == []
    assert P.reward_training_problems(rm(device="cuda"), cuda_available=None) == []
    assert P.reward_training_problems(rm(device="cpu", **{"model.dtype": "bfloat16"}), cuda_available=None) == [
        "model.dtype: bfloat16 — on CPU a reward model trains in float32"]


def test_a_reward_model_runs_tokenizer_and_preference_files(tmp_path, bpe):
    assert P.reward_training_problems(rm(**{"model.hf_config.eos_token_id": 5, "model.hf_config.vocab_size": 40,
                                           "data.chat_template": True}), cuda_available=False) == [
        "model: vocab_size=40 is smaller than the tokenizer's 47 ids",
        "model: eos_token_id=5, but the character tokenizer's is 2",
        "data.chat_template: the character tokenizer has no chat template"]
    found = P.reward_training_problems(rm(**{"model.tokenizer": str(tmp_path), "train.dp": 3}), cuda_available=False)
    assert found[:2] == ["train: tp·pp·dp = 1·1·3 = 3, but world_size = 2 (every phase is colocated on all devices)",
                         "train: dp=3 does not divide training.batch_size=32"]
    assert len(found) == 3 and found[2].startswith("model.tokenizer: "), found
    assert P.reward_training_problems(rm(**{"model.tokenizer": str(bpe), "model.hf_config.vocab_size": 384,
                                           "data.chat_template": True}), cuda_available=False) == []
    plain = without_chat_template(bpe, tmp_path / "plain")
    assert P.reward_training_problems(rm(**{"model.tokenizer": str(plain), "model.hf_config.vocab_size": 384,
                                           "data.chat_template": True}), cuda_available=False) == [
        f"data.chat_template: the tokenizer at {plain} has no chat template"]
    nokey = tmp_path / "nokey.jsonl"
    nokey.write_text('{"prompt": "a", "better": "1", "rejected": "2"}\n')
    c = rm(**{"data.train_files": [str(PREFS / "train.jsonl"), str(nokey)], "data.heldout_files": [str(nokey)]})
    assert P.reward_training_problems(c, cuda_available=False) == [
        f"data.train_files[1]: {nokey}: no key 'chosen' (keys: prompt, better, rejected)",
        f"data.heldout_files[0]: {nokey}: no key 'chosen' (keys: prompt, better, rejected)"]
    # pairs longer than the context (64 positions, less the scored one) are dropped; none left is a problem
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"prompt": "1+1=" * 20, "chosen": "2", "rejected": "3"}) + "\n")
    c = rm(**{"data.heldout_files": [str(long)]})
    assert P.reward_training_problems(c, cuda_available=False) == [
        "data.heldout_files: every one of its 1 pairs is longer than the model's context of 64 tokens (less the "
        "scored position)"]


def test_check_reward_training_says_how_many_problems():
    from rlhf_switch.rl.config import ConfigError

    P.check_reward_training(rm(), cuda_available=False)
    with pytest.raises(ConfigError) as e:
        P.check_reward_training(rm(**{"model.dtype": "bfloat16"}), cuda_available=False)
    assert str(e.value).splitlines()[0] == "the reward model config cannot run on world_size=2: 1 problem"
    with pytest.raises(ConfigError) as e:
        P.check_reward_training(rm(**{"model.dtype": "bfloat16", "training.micro_batch_size": 12}),
                                cuda_available=False)
    assert str(e.value).splitlines()[0] == "the reward model config cannot run on world_size=2: 2 problems"


# --------------------------------------------------------------------------------------- reward

def reward_of_an_empty_response(prompt: str, response: str, answer: str) -> float:
    """Scores the answer; raises on the empty response (the check's second call)."""
    if not response:
        raise KeyError("nothing to score")
    return float(response == answer)


def test_the_reward_runs_on_a_held_out_sample_as_the_run_calls_it():
    """Called with the first held-out prompt twice: its right answer, then an empty response."""
    import inspect

    lines, first = inspect.getsourcelines(reward_of_an_empty_response)
    raised_at = first + next(i for i, line in enumerate(lines) if "raise KeyError" in line)
    c = cfg(**{"task.reward_fn": "test_problems:reward_of_an_empty_response", "task.reward_workers": 0})
    assert P._reward(c, P.Facts(None, False)) == [
        f"task.reward_fn: reward function test_problems:reward_of_an_empty_response on sample 1 (prompt='37+32=', "
        f"response='', answer='69') raised KeyError: 'nothing to score' (test_problems.py:{raised_at})"]
    # a config with problems already: loaded, not called (its prompts may not even exist)
    assert P._reward(c, P.Facts(None, False, found=["an earlier problem"])) == []
    assert P._reward(cfg(**{"task.reward_workers": 0}), P.Facts(None, False)) == []
    missing = cfg(**{"task.reward_fn": "no_such_module_xyz:score"})
    assert P._reward(missing, P.Facts(None, False, found=["an earlier problem"])) == [
        "task.reward_fn: reward function 'no_such_module_xyz:score': no module named 'no_such_module_xyz' (is it on "
        "PYTHONPATH / installed?)"]


# --------------------------------------------------------------------------- a reward model's run

def rm_dir(root: Path, hf: dict = HF, tokenizer: str | None = "char") -> Path:
    """A reward model directory as ``rlhf-switch rm`` writes one: the value model, and the
    character tokenizer named in ``reward_model.json`` (or a BPE tokenizer's files, or nothing)."""
    from rlhf_switch.models import value_model
    from rlhf_switch.rl.reward_model import REWARD_MODEL_FILE, tokenizer_identity
    from rlhf_switch.rl.tasks import CharTokenizer

    value_model(hf, 0).save_pretrained(str(root))
    if tokenizer == "char":
        (root / REWARD_MODEL_FILE).write_text(json.dumps({"tokenizer": tokenizer_identity(CharTokenizer())}))
    elif tokenizer == "bpe":
        from rlhf_switch.testing.bpe_tokenizer import build_bpe_tokenizer

        build_bpe_tokenizer(root)
    return root


def ppo_rm(path, **reward):
    return cfg("ppo_tiny.yaml", reward={"model_path": str(path), "engine": "fsdp2", "dp": 2, **reward})


def test_a_reward_models_directory_vocabulary_layout_and_engine(tmp_path):
    assert P._reward_model(cfg(), P.Facts(None, False)) == []
    good = rm_dir(tmp_path / "rm")
    facts = P.Facts(P.model_dims(cfg().model), False)
    assert P._reward_model(ppo_rm(good), facts) == []
    nowhere = tmp_path / "nowhere"
    assert P._reward_model(ppo_rm(nowhere, dp=4), facts) == [
        f"reward.model_path: no such directory: {nowhere}",
        "reward: tp·pp·dp = 1·1·4 = 4, but world_size = 2 (every phase is colocated on all devices)"]
    assert P._reward_model(ppo_rm(good, engine="torch_tp", tp=2, dp=1), facts) == [
        "reward: engine torch_tp builds causal LMs only (use fsdp2 or deepspeed)"]
    assert P._reward_model(ppo_rm(good, engine="no_such_module:Engine"), facts) == [
        "reward.engine: training engine 'no_such_module:Engine': cannot import 'no_such_module': No module named "
        "'no_such_module'"]
    torch_rollout = {"engine": "torch", "dp": 2}  # what an elastic run of this config can resize
    for elastic in ({"on_node_change": "resize"}, {"redundancy": "host"}):
        c = cfg("ppo_tiny.yaml", reward={"model_path": str(good), "engine": "fsdp2", "dp": 2}, rollout=torch_rollout,
                elastic=elastic)
        assert P._reward_model(c, facts) == [
            "reward.model_path: an elastic run (elastic.schedule, on_node_change: resize, redundancy: host) does not "
            "rebuild the reward model's engine in a new world yet"], elastic
    assert P._reward_model(cfg("ppo_tiny.yaml", reward={"model_path": str(good), "engine": "fsdp2", "dp": 2},
                               rollout=torch_rollout, elastic={"redundancy": "none", "on_node_change": "record"}),
                           facts) == []


def test_a_reward_model_reads_the_policys_token_ids(tmp_path):
    facts = P.Facts(P.model_dims(cfg().model), False)
    none = rm_dir(tmp_path / "none", tokenizer=None)
    assert P._reward_model(ppo_rm(none), facts) == [
        f"reward.model_path: {none} names no tokenizer (no tokenizer files, no reward_model.json), so its vocabulary "
        f"cannot be checked against the policy's: copy the tokenizer it was trained with into it"]
    bpe = rm_dir(tmp_path / "bpe", tokenizer="bpe")
    assert P._reward_model(ppo_rm(bpe), facts) == [
        f"reward.model_path: {bpe} does not read the policy's token ids: it was made with a Hugging Face tokenizer, "
        f"the policy uses the character tokenizer"]
    small = rm_dir(tmp_path / "small", {**HF, "vocab_size": 32})
    assert P._reward_model(ppo_rm(small), facts) == [
        "reward.model_path: vocab_size=32, but the policy generates ids up to 63 (its vocab_size=64): the reward "
        "model's vocabulary must be the policy's"]
    assert P._reward_model(ppo_rm(small), P.Facts(None, False)) == []  # the policy's dims unknown: not compared


def test_a_reward_model_run_asks_this_machine_unless_it_joins_a_cluster(monkeypatch):
    import rlhf_switch.device as device

    bf16 = {"model.dtype": "bfloat16"}
    monkeypatch.setattr(device, "cuda_available", lambda: False)
    assert P.reward_training_problems(rm(**bf16)) == ["model.dtype: bfloat16 — on CPU a reward model trains in float32"]
    assert P.reward_training_problems(rm(ray_address="10.0.0.1:6379", **bf16)) == []  # the actors will say
    monkeypatch.setattr(device, "cuda_available", lambda: True)
    assert P.reward_training_problems(rm(**bf16)) == []


def test_a_reward_model_runs_model_trunk_engine_and_context_edge(tmp_path):
    from rlhf_switch.rl.reward_model import sequence_ids
    from rlhf_switch.rl.tasks import CharTokenizer

    lacking = tmp_path / "lacking"
    lacking.mkdir()
    (lacking / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 128}))
    assert P.reward_training_problems(rm(model={"path": str(lacking), "dtype": "float32"}), cuda_available=False) == [
        f"model.path: {lacking / 'config.json'} lacks num_hidden_layers, num_attention_heads, intermediate_size, "
        f"vocab_size"]
    trunk = model_dir(tmp_path / "trunk", {n: s for n, s in LM.items() if n != "model.norm.weight"})
    assert P.reward_training_problems(rm(model={"path": str(trunk), "dtype": "float32"}, **{"train.dp": 4}),
                                      cuda_available=False) == [
        f"model.path: {trunk} lacks model.norm.weight [128] that config.json implies",
        "train: tp·pp·dp = 1·1·4 = 4, but world_size = 2 (every phase is colocated on all devices)",
        "training.micro_batch_size=16 does not divide the per-rank batch 32/4 = 8 pairs"]
    # the value head: an engine that builds causal LMs only is refused
    assert P.reward_training_problems(rm(train={"engine": "torch_tp", "tp": 2}), cuda_available=False) == [
        "train: engine torch_tp builds causal LMs only (use fsdp2 or deepspeed)"]
    assert P.reward_training_problems(rm(train={"engine": "no_such_module:Engine", "dp": 2}),
                                      cuda_available=False) == [
        "train.engine: training engine 'no_such_module:Engine': cannot import 'no_such_module': No module named "
        "'no_such_module'"]
    # a pair fits when its longer sequence has at most 63 ids (64 positions, less the scored one)
    tok = CharTokenizer()
    for ids, fits in ((63, True), (64, False)):
        prompt = "1+" * 40
        while len(sequence_ids(tok, prompt, "2", False)) > ids:
            prompt = prompt[:-1]
        assert len(sequence_ids(tok, prompt, "2", False)) == ids
        edge = tmp_path / f"edge{ids}.jsonl"
        edge.write_text(json.dumps({"prompt": prompt, "chosen": "2", "rejected": "3"}) + "\n")
        found = P.reward_training_problems(rm(**{"data.heldout_files": [str(edge)]}), cuda_available=False)
        assert found == ([] if fits else [
            "data.heldout_files: every one of its 1 pairs is longer than the model's context of 64 tokens (less the "
            "scored position)"]), ids


# ------------------------------------------------------------ the worlds elastic control moves a run into
# A run that cannot call its reward function: the checks below skip the reward check (the run's
# reward already ran), so the worlds they accept would be refused by it.
NO_REWARD = {"task.reward_fn": "rlhf_switch.rl.rewards:no_such_fn"}
ONE = {"world_size": 1, "train": {"engine": "fsdp2", "dp": 1}, "rollout": {"engine": "torch", "dp": 1},
       "reference": {"engine": "fsdp2", "dp": 1}}  # the tiny run's layouts on one device: a world that fits
ENTRY_KEYS = "world_size, train, rollout, reference, critic"


def _refused(*args) -> tuple[str, list[str]]:
    with pytest.raises(ConfigError) as e:
        P.check_resize_request(*args)
    return str(e.value).splitlines()[0], e.value.problems


def test_the_rollout_engines_a_resize_takes_are_named():
    assert P._resizable_engines() == "only the rollout engines torch, vllm"


def test_a_resize_request_becomes_the_schedule_entry_at_its_iteration_in_order():
    run = cfg(**NO_REWARD, elastic={"schedule": [{**ONE, "iteration": 5}]})
    new, entry = P.check_resize_request(run, {"id": "a", "reason": "api", **ONE}, 3, 5, 1)
    assert (entry.iteration, entry.world_size, entry.train.dp, entry.rollout.engine) == (3, 1, 1, "torch")
    assert [e.iteration for e in new.elastic.schedule] == [3, 5]
    assert new.elastic.schedule[0] == entry and new.world_size == 2 and new.algorithm == run.algorithm
    # at the run's last iteration, holding exactly the devices it asks for
    new, entry = P.check_resize_request(cfg(**NO_REWARD, elastic={}), ONE, 5, 5, 1)
    assert [e.iteration for e in new.elastic.schedule] == [5] and entry.world_size == 1


def test_a_resize_request_is_refused_with_every_problem_once():
    run = cfg(elastic={"schedule": [{**ONE, "iteration": 4}]})
    bad = {**ONE, "world_size": 3}  # layouts of one device in a world of three
    why_bad = [f"elastic.schedule[0]: {phase}: tp·pp·dp = 1·1·1 = 1, but world_size = 3 (every phase is colocated "
               f"on all devices)" for phase in ("train", "rollout", "reference")]
    assert _refused(run, {"unreadable": "JSONDecodeError", "foo": 1}, 3, 5, None) == (
        "resize request refused: 1 problem", ["resize request: unreadable (JSONDecodeError)"])
    # what the loop knows refuses it before its entry is checked
    assert _refused(run, {"foo": 1, "bar": 2, **bad}, 6, 5, None) == ("resize request refused: 3 problems", [
        f"resize request: unknown keys ['bar', 'foo'] (give {ENTRY_KEYS})",
        "resize request: this run has no elastic device manager (give the config an elastic block, with the torch "
        "rollout engine or vLLM replicas, colocated)",
        "resize request: the run ends at iteration 5; there is no next iteration to resize before"])
    assert _refused(run, bad, 4, 5, 4) == (
        "resize request refused: 1 problem", ["resize request: elastic.schedule already resizes before iteration 4"])
    # unknown keys alone: the entry is checked too, and a good one is still refused for them
    assert _refused(run, {"foo": 1, **bad}, 3, 5, 4) == (
        "resize request refused: 4 problems", [f"resize request: unknown keys ['foo'] (give {ENTRY_KEYS})"] + why_bad)
    assert _refused(run, {"foo": 1, **ONE}, 3, 5, 4) == (
        "resize request refused: 1 problem", [f"resize request: unknown keys ['foo'] (give {ENTRY_KEYS})"])
    # the config's types, then the devices Ray holds
    assert _refused(run, {**ONE, "world_size": "x"}, 3, 5, 4) == ("resize request refused: 1 problem", [
        "elastic.schedule[0].world_size: Input should be a valid integer, unable to parse string as an integer "
        "(got 'x')"])
    two = {"world_size": 2, "train": {"engine": "fsdp2", "dp": 2}, "rollout": {"engine": "torch", "dp": 2},
           "reference": {"engine": "fsdp2", "dp": 2}}
    assert _refused(run, two, 3, 5, 1) == (
        "resize request refused: 1 problem", ["resize request: world_size 2 — Ray holds 1 devices for this run"])


def test_a_scaled_run_is_the_run_along_dp_checked_but_for_its_reward():
    run = cfg(**NO_REWARD)
    one = P.scaled_run(run, 1)
    assert (one.world_size, one.train.dp, one.rollout.dp, one.reference.dp) == (1, 1, 1, 1)
    assert one.algorithm == run.algorithm and one.seed == run.seed and one.task == run.task
    with pytest.raises(ConfigError) as e:
        P.scaled_run(run, 4)  # 32 sequences per mini batch over 4 ranks: 8, not a multiple of 16
    assert str(e.value).splitlines()[0] == "no 4-device world with the run's layouts scaled along DP"
    assert e.value.problems == ["algorithm.micro_batch_size=16 does not divide the per-rank mini batch 32/4 = 8"]
    with pytest.raises(ConfigError) as e:
        P.scaled_run(run, 0)
    assert str(e.value).splitlines()[0] == "no 0-device world with the run's layouts scaled along DP"
    assert e.value.problems == ["world_size: Input should be greater than or equal to 1 (got 0)"]


# ------------------------------------------------------------------ what the callers pass through

def test_a_check_registered_at_test_time_is_the_function_given(monkeypatch):
    """The registry is filled at import (before a mutation test arms a mutant): register one here."""
    monkeypatch.setattr(P, "CHECKS", dict(P.CHECKS))

    def probe(c, facts):
        return ["probe"]

    assert P.check("probe")(probe) is probe
    assert list(P.CHECKS)[-1] == "probe" and P.CHECKS["probe"] is probe


def test_a_recipe_refuses_a_config_of_another_algorithm():
    c = cfg()  # grpo
    assert P.run_problems(c, cuda_available=False, recipe="grpo") == []
    assert P.run_problems(c, cuda_available=False, recipe="ppo") == [
        "algorithm.name: this recipe runs ppo, the config names 'grpo' (use recipes.grpo or rlhf-switch train)"]


def test_check_run_and_check_reward_training_pass_their_arguments_on(monkeypatch):
    import rlhf_switch.device as device

    P.check_run(cfg(**{"algorithm.top_p": 0.5}), cuda_available=False, skip=("sampling",))  # nothing left to find
    monkeypatch.setattr(device, "cuda_available", lambda: True)  # this machine's answer is not the one given
    with pytest.raises(ConfigError) as e:
        P.check_reward_training(rm(**{"model.dtype": "bfloat16"}), cuda_available=False)
    assert e.value.problems == ["model.dtype: bfloat16 — on CPU a reward model trains in float32"]


def test_a_task_whose_operands_have_one_length_fits():
    """min_len = max_len = 2: 90·90 = 8100 prompts hold 2000 + 200; '99+99' -> '198' is 4 tokens with <eos>."""
    assert P.task_problems(cfg(**{"task.min_len": 2, "task.max_len": 2}), None) == []


def test_the_checks_get_the_models_dimensions():
    """A vocabulary of 40 below the character tokenizer's 47 ids: only a check given the model's
    dimensions can see it."""
    assert P.run_problems(cfg(**{"model.hf_config.vocab_size": 40}), cuda_available=False) == [
        "model: vocab_size=40 is smaller than the tokenizer's 47 ids"]


def test_device_auto_waits_for_the_actors_when_this_machine_cannot_say():
    """Not known before Ray (None): ``auto`` is not resolved, so bf16 is not refused as if on CPU."""
    bf16 = cfg(**{"model.dtype": "bfloat16"})
    assert bf16.device == "auto"
    assert P.device_problems(bf16, None) == []
    assert P.device_problems(bf16, False) == ["model.dtype: bfloat16 — the CPU loop trains in float32"]


from rlhf_switch.engines.base import TrainingEngine  # noqa: E402


class SaysWhatItWasAsked(TrainingEngine):
    """A user's training engine (``test_problems:SaysWhatItWasAsked``) that refuses every layout,
    naming the head and the model's vocabulary it was asked about."""

    @classmethod
    def layout_problems(cls, phase, layout, dims, head="lm"):
        return [f"{phase}: asked for head {head} of a vocabulary of {dims.vocab_size if dims else 'unknown'}"]


def test_a_reward_model_runs_engine_is_asked_for_a_value_head_of_the_model():
    assert P.reward_training_problems(rm(train={"engine": "test_problems:SaysWhatItWasAsked", "dp": 2}),
                                      cuda_available=False) == ["train: asked for head value of a vocabulary of 64"]


def test_a_reward_model_runs_tokenizer_that_does_not_load_is_named_by_model_path(tmp_path):
    m = model_dir(tmp_path / "m", LM)
    (m / "tokenizer_config.json").write_text("{}")
    (m / "tokenizer.json").write_text("not json")
    found = P.reward_training_problems(rm(model={"path": str(m), "dtype": "float32"}), cuda_available=False)
    assert len(found) == 1 and found[0].startswith(f"model.path: the tokenizer in {m} does not load: "), found


def test_a_resize_request_keeps_the_elastic_block_and_needs_one():
    # the block's other settings survive the new entry
    new, _ = P.check_resize_request(cfg(**NO_REWARD, elastic={"on_node_change": "resize"}), ONE, 3, 5, 1)
    assert new.elastic.on_node_change == "resize" and [e.iteration for e in new.elastic.schedule] == [3]
    # a run without an elastic block has no device manager (and no schedule to read)
    assert _refused(cfg(), ONE, 3, 5, None) == ("resize request refused: 1 problem", [
        "resize request: this run has no elastic device manager (give the config an elastic block, with the torch "
        "rollout engine or vLLM replicas, colocated)"])


def test_a_reward_model_runs_train_file_of_pairs_too_long_is_named(tmp_path):
    """Every train pair 64 ids long (one more than the 63 that fit): the train split is named."""
    from rlhf_switch.rl.reward_model import sequence_ids
    from rlhf_switch.rl.tasks import CharTokenizer

    tok = CharTokenizer()
    prompt = "1+" * 40
    while len(sequence_ids(tok, prompt, "2", False)) > 64:
        prompt = prompt[:-1]
    assert len(sequence_ids(tok, prompt, "2", False)) == 64
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"prompt": prompt, "chosen": "2", "rejected": "3"}) + "\n")
    assert P.reward_training_problems(rm(**{"data.train_files": [str(long)]}), cuda_available=False) == [
        "data.train_files: every one of its 1 pairs is longer than the model's context of 64 tokens (less the "
        "scored position)"]


# ------------------------------------------------------------------------ agent (multi-turn rollouts)

def test_agent_problems_each_with_its_words():
    assert P._agent(cfg("agent_guess_tiny.yaml"), None) == []
    assert P._agent(cfg(), None) == []  # no agent block: nothing to check
    assert P._agent(cfg("agent_guess_tiny.yaml", **{"agent.env": "chess"}), None) == [
        "agent.env: unknown environment 'chess'; registered: calc, guess, tools (or name your own as 'module:Class')"]
    got = P._agent(cfg("agent_guess_tiny.yaml", **{"agent.env": "no_such_module:Env", "agent.max_total_tokens": 25,
                                                    "agent.max_turn_tokens": 30}), None)
    assert len(got) == 3
    assert got[0].startswith("agent.env: ") and "no_such_module" in got[0]
    assert got[1] == ("agent.max_total_tokens: 25 — more than algorithm.max_new_tokens=24, the trainer's room for "
                      "everything after the prompt (model turns and observations); leave it null to use that")
    assert got[2] == "agent.max_turn_tokens: 30 — more than algorithm.max_new_tokens=24, the whole episode's room"
    # at the bound: accepted
    assert P._agent(cfg("agent_guess_tiny.yaml", **{"agent.max_total_tokens": 24, "agent.max_turn_tokens": 24}),
                    None) == []


def test_agent_runs_one_step_ahead_and_with_partial_rollout():
    c = cfg("agent_guess_tiny.yaml", **{"algorithm.off_policy": {"max_staleness": 1}})
    assert P._agent(c, None) == []
    # where one step ahead runs is the off-policy check's: replicas of their own devices
    assert P._off_policy(c, None) == [
        "algorithm.off_policy.max_staleness: 1 — generation overlaps training only on rollout replicas of their own "
        "devices: rollout.mode: disaggregated with a replica engine (vllm); this run's rollout is torch, colocated"]
    # partial rollout: each turn generated 4 tokens a call (agent.workflow)
    c = cfg("agent_guess_tiny.yaml", **{"algorithm.off_policy": {"max_staleness": 1, "segment_tokens": 4}})
    assert P._agent(c, None) == []


def test_an_agent_runs_prompt_is_its_episodes_and_must_fit_the_context():
    """The calculator's episode prompt is the tool declaration and the problem: the sizes use it."""
    from rlhf_switch.agent.calc import TOOL_PREFIX
    task_prompt_tokens = P.episode_prompt_tokens

    changes = {"task": {"name": "calc", "min_len": 5, "max_len": 6, "num_train": 100, "num_heldout": 16},
               "agent": {"env": "calc", "env_kwargs": {"tools": True}, "max_turns": 3}}
    with_tool = cfg("agent_guess_tiny.yaml", **changes)
    assert task_prompt_tokens(with_tool) == 1 + len(TOOL_PREFIX) + len("999999+999999=")
    changes["agent"]["env_kwargs"] = {"tools": False}
    assert task_prompt_tokens(cfg("agent_guess_tiny.yaml", **changes)) == 1 + len("999999+999999=")
    changes["agent"]["env_kwargs"] = {"tools": True}
    changes["algorithm.max_new_tokens"] = 64 - 21 + 1  # one token more than the tool prompt leaves
    got = P.task_problems(cfg("agent_guess_tiny.yaml", **changes), P.model_dims(with_tool.model))
    assert got == ["model: the task's longest prompt is 21 tokens; with max_new_tokens=44 that is 65 > "
                   "max_position_embeddings=64"]
    changes["algorithm.max_new_tokens"] = 43
    assert P.task_problems(cfg("agent_guess_tiny.yaml", **changes), P.model_dims(with_tool.model)) == []


def test_an_agent_data_runs_chat_template_must_extend_a_conversation_as_tokens(bpe, tmp_path):
    """With ``data.chat_template`` an agent run writes each observation as the template's message
    (agent.chat): a template that does not end an assistant message with the eos is refused before
    the run."""
    assert P._agent(agent_data_cfg(bpe), None) == []
    assert P._agent(agent_data_cfg(bpe, observation_role="tool"), None) == []  # ChatML writes any role
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in bpe.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    (bad / "chat_template.jinja").write_text("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}"
                                             "{% endfor %}")
    got = P._agent(agent_data_cfg(bad), None)
    assert got == [f"agent: data.chat_template: {bad}: the chat template does not end an assistant message with "
                   "the eos '<|im_end|>', so a generated turn cannot be extended as tokens (it writes '\\nuser: "
                   "rlhfswitchprobeobservation\\n' after one)"], got
    # the first turn is written with the environment's tools: an environment whose chat_tools raises
    got = P._agent(agent_data_cfg(bpe, env="agent_envs:BadChatTools"), None)
    assert got == ["agent: data.chat_template: the first turn (agent.system, the tools agent_envs:BadChatTools "
                   "declares) does not render: RuntimeError: no schema today"], got
    assert P._agent(agent_data_cfg(bpe, env="agent_envs:ChatCalc", system="You add."), None) == []
    # a task run's character tokenizer has no template: nothing to check
    assert P._agent(cfg("agent_guess_tiny.yaml"), None) == []
