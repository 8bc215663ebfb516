"""vLLM's TP layout of every family against vLLM's own model classes and loaders (no engine).

On each rank of one ``LocalWorld(4)``: vLLM's ``<Family>ForCausalLM`` built for the rank's TP
rank, its ``load_weights`` fed a tiny random checkpoint (``testing.tiny_models``), and every
parameter compared bit for bit with what ``vllm_layout(spec, tp)`` says the worker holds — names
and sizes of the buffers included. Covered: llama, mistral, qwen2 (fused qkv bias), qwen3 (q/k
norms), qwen3_moe (router, ``w13``/``w2`` per expert), at TP 1, 2 and 4, GQA with TP4 above 2 KV
heads (replicated KV heads) and a tied, 64-unaligned vocabulary; and a move of the MoE model from
an expert-parallel FSDP trainer layout into vLLM TP2, checked against vLLM's own load.
"""
from __future__ import annotations


import pytest

from rlhf_switch.compat import set_vllm_env_defaults
from vllm_checks import VLLM_MARKS, hf_greedy

pytestmark = VLLM_MARKS

set_vllm_env_defaults()

GQA = dict(num_attention_heads=4, num_key_value_heads=2, hidden_size=128)  # TP4 > 2 KV heads
WIDE = dict(num_attention_heads=4, num_key_value_heads=4, hidden_size=128)  # TP4 splits KV heads
CASES = [  # (model_type, overrides, TP, shift)
    ("llama", WIDE, 4, 0),
    ("mistral", {}, 2, 0),
    ("qwen2", {}, 1, 0),
    ("qwen2", GQA, 2, 0),
    ("qwen2", GQA, 4, 0),
    ("qwen3", dict(GQA, tie_word_embeddings=True, vocab_size=777), 4, 0),
    ("qwen3", {}, 2, 0),
    ("qwen3_moe", {}, 1, 0),
    ("qwen3_moe", {}, 2, 0),
    ("qwen3_moe", WIDE, 4, 0),
    ("qwen2", GQA, 2, 1),  # control: worker t's parameters against worker t+1's layout
]
MOVED = 8  # the qwen3_moe TP2 case: also moved from an expert-parallel trainer layout


@pytest.fixture(scope="module")
def world():
    from rlhf_switch.launch import LocalWorld

    with LocalWorld(4, timeout=300) as w:
        yield w


def test_vllm_loaders_hold_the_layouts_fragments(world, tmp_path):
    from rlhf_switch.testing.tiny_models import save_tiny_model
    from rlhf_switch.vps import ParallelConfig
    from vllm_family_jobs import family_loader_check

    dirs = {}
    cases = []
    for model_type, overrides, tp, shift in CASES:
        key = (model_type, tuple(sorted(overrides.items())))
        if key not in dirs:
            dirs[key] = str(tmp_path / f"{model_type}-{len(dirs)}")
            save_tiny_model(model_type, dirs[key], seed=len(dirs), **overrides)
        cases.append((dirs[key], tp, shift))
    ep_trainer = ParallelConfig(dp=4, ep=2, dp_shard="fsdp")  # experts 0-1 on dp 0, 2; 2-3 on dp 1, 3
    found = world.run(family_loader_check, cases, (MOVED, ep_trainer), timeout=900)
    for rank, per_case in enumerate(found):
        for (model_type, overrides, tp, shift), problems in zip(CASES, per_case):
            if shift:
                assert any("qkv_proj.weight" in p for p in problems), (rank, problems)
                assert any("qkv_proj.bias" in p for p in problems), (rank, problems)
            else:
                assert problems == [], (rank, model_type, overrides, tp)


def test_vllm_engine_runs_qwen3_moe_moved_from_an_expert_parallel_trainer(world, tmp_path):
    """A real vLLM engine (TP1) of a tiny qwen3_moe: its greedy tokens equal HF's; then another
    model's weights, held by an EP2·DP4 FSDP trainer layout, are moved into its workers: they hold
    exactly the layout's bytes and generate what HF generates with those weights (FusedMoE reads
    the buffers the move wrote — nothing stale)."""
    import json

    import torch
    from safetensors.torch import load_file

    from rlhf_switch.engines.vllm_rollout import VLLMRollout
    from rlhf_switch.models import model_spec
    from rlhf_switch.testing.tiny_models import save_tiny_model
    from rlhf_switch.vps import ParallelConfig, build_layout
    from rlhf_switch.vps.materialize import bits, coverage_masks, materialize
    from vllm_family_jobs import trainer_buffers

    first = save_tiny_model("qwen3_moe", str(tmp_path / "first"), seed=5)
    second = save_tiny_model("qwen3_moe", str(tmp_path / "second"), seed=6)
    state = load_file(str(tmp_path / "second" / "model.safetensors"))  # per-expert checkpoint names
    spec = model_spec(json.loads((tmp_path / "first" / "config.json").read_text()))
    prompts = [[1, 5, 9, 13, 200], [1] + list(range(100, 140))]
    rollout = VLLMRollout(str(tmp_path / "first"), spec, tp=1)
    try:
        tokens, _ = rollout.generate(prompts, 8, greedy=True)
        assert tokens == hf_greedy(first, prompts, 8)[0]
        src = build_layout(spec, ParallelConfig(dp=4, ep=2, dp_shard="fsdp"))
        rollout.load_from(world, src, trainer_buffers, src, state)
        (got,) = rollout.read_weights()
        want, masks = materialize(rollout.layout, 0, lambda key: state[key.tensor]), coverage_masks(rollout.layout, 0)
        assert set(got) == set(want)
        for name, t in got.items():
            assert torch.equal(bits(t.reshape(-1))[masks[name]], bits(want[name])[masks[name]]), name
        expected = hf_greedy(second, prompts, 8)[0]
        assert expected != tokens, "the two models agree: the check would be empty"
        tokens2, _ = rollout.generate(prompts, 8, greedy=True)
        assert tokens2 == expected
    finally:
        rollout.shutdown()


def test_fsdp2_trained_qwen3_moe_moved_into_vllm_generates_like_hf(world, tmp_path):
    """The RLHF path for MoE: an FSDP2 trainer (transformers' stacked experts, one expert per rank)
    takes a few AdamW steps; its weights move straight from its parameters into a real vLLM engine
    (per-expert tensors into FusedMoE's w13/w2); vLLM's greedy tokens equal HF's with the trained
    weights."""
    import json

    import torch

    from rlhf_switch.engines.vllm_rollout import VLLMRollout
    from rlhf_switch.families import stacked_experts
    from rlhf_switch.models import causal_lm, model_spec
    from rlhf_switch.testing.tiny_models import save_tiny_model
    from rlhf_switch.vps.materialize import bits, coverage_masks, materialize
    from vllm_family_jobs import train_fsdp2, trainer_weights

    save_tiny_model("qwen3_moe", str(tmp_path), seed=7)
    cfg = json.loads((tmp_path / "config.json").read_text())
    spec = model_spec(cfg)
    layout, full = world.run(train_fsdp2, cfg, 3, timeout=300)[0]
    assert layout.spec == spec
    trained = causal_lm(cfg, 0).eval()
    trained.load_state_dict(full)
    per_expert = dict(full)
    for name, t in full.items():
        for tensor, e, lo, hi in stacked_experts(name, tuple(t.shape)) or ():
            per_expert[tensor] = t[e, lo:hi]
    prompts = [[1, 5, 9, 13, 200], [1] + list(range(100, 140))]
    rollout = VLLMRollout(str(tmp_path), spec, tp=1)
    try:
        before, _ = rollout.generate(prompts, 8, greedy=True)
        rollout.load_from(world, layout, trainer_weights)
        (got,) = rollout.read_weights()
        want, masks = materialize(rollout.layout, 0, lambda key: per_expert[key.tensor]), \
            coverage_masks(rollout.layout, 0)
        for name, t in got.items():
            assert torch.equal(bits(t.reshape(-1))[masks[name]], bits(want[name])[masks[name]]), name
        expected = hf_greedy(trained, prompts, 8)[0]
        assert expected != before, "training did not change the greedy tokens: the check would be empty"
        assert rollout.generate(prompts, 8, greedy=True)[0] == expected
    finally:
        rollout.shutdown()
