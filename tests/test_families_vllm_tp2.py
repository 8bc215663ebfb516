"""Every family beyond llama through a real multi-process vLLM TP2 engine.

For mistral, qwen2, qwen3 and qwen3_moe: one ``VLLMRollout(tp=2)`` (mp backend, its two workers
in their own processes) started from a tiny random checkpoint (weights A, ``save_tiny_model``);
then weights B (another seed) held by a trainer layout over a ``LocalWorld(2)`` of gloo ranks —
ZeRO-3 DP2, Megatron TP2 (fused qkv incl. bias, fused gate/up), FSDP DP2, EP2·FSDP DP2 — are moved
into the workers through the VPS. After the move: the workers hold B bit for bit; vLLM's greedy
tokens equal HF's (transformers model of the family with B) and its log-probs are within
``LOGPROB_ATOL`` of HF's log-softmax; and B's tokens differ from A's on some prompt (so the move is
what changed them). One engine at a time (25-45 s to start on 2 cores), shut down before the next;
the file takes ~2.5-3.5 min. llama's TP2 path is ``test_vllm.py``.
"""
from __future__ import annotations

import json
import time

import pytest

from rlhf_switch.compat import set_vllm_env_defaults
from vllm_checks import VLLM_MARKS

pytestmark = [*VLLM_MARKS, pytest.mark.slow]

set_vllm_env_defaults()

# fp32 on both sides; TP2's row-parallel all-reduce changes only the summation order. Measured
# (every family, weights A and B): max |vLLM - HF| log-prob 4.8e-7 = 1 ulp at |lp| ~ 5
# (log-probs -4.6..-5.1 here, logit std ~0.4: a real distribution, not a flat one); 1e-5 is ~20 ulp
LOGPROB_ATOL = 1e-5
PROMPTS = [[1, 5, 9, 13, 200], [1] + list(range(100, 140)), [1, 300, 7, 7, 42, 8]]
MAX_TOKENS = 8
# model_type -> the trainer layout that holds weights B (world of 2 ranks)
TRAINERS = {
    "mistral": dict(dp=2, dp_shard="zero3"),
    "qwen2": dict(tp=2, fuse_qkv=True, fuse_gate_up=True),
    "qwen3": dict(dp=2, dp_shard="fsdp"),
    "qwen3_moe": dict(dp=2, ep=2, dp_shard="fsdp"),
}


@pytest.fixture(scope="module")
def world():
    from rlhf_switch.launch import LocalWorld

    with LocalWorld(2, timeout=300) as w:
        yield w


@pytest.mark.parametrize("model_type", list(TRAINERS))
def test_trainer_layout_into_vllm_tp2_generates_like_hf(world, tmp_path, model_type):
    from safetensors.torch import load_file

    from rlhf_switch.engines.vllm_rollout import VLLMRollout
    from rlhf_switch.models import model_spec
    from rlhf_switch.testing.tiny_models import save_tiny_model
    from rlhf_switch.vps import ParallelConfig, build_layout
    from vllm_checks import assert_matches_hf, assert_weights_equal, hf_greedy
    from vllm_family_jobs import trainer_buffers

    dir_a = str(tmp_path / "a")
    model_a = save_tiny_model(model_type, dir_a, seed=11)
    model_b = save_tiny_model(model_type, str(tmp_path / "b"), seed=12)
    state_b = load_file(str(tmp_path / "b" / "model.safetensors"))  # checkpoint names (per expert)
    spec = model_spec(json.loads((tmp_path / "a" / "config.json").read_text()))
    tokens_a, _ = hf_greedy(model_a, PROMPTS, MAX_TOKENS)

    t0 = time.perf_counter()
    rollout = VLLMRollout(dir_a, spec, tp=2)
    start_s = time.perf_counter() - t0
    try:
        _, _, diff_a = assert_matches_hf(rollout, model_a, PROMPTS, MAX_TOKENS, atol=LOGPROB_ATOL)
        src = build_layout(spec, ParallelConfig(**TRAINERS[model_type]))
        assert src.world_size == world.world_size
        report = rollout.load_from(world, src, trainer_buffers, src, state_b)
        assert all(w["bytes_received"] == w["min_bytes_received"] for w in report.workers)
        assert_weights_equal(rollout, state_b)
        tokens_b, _, diff_b = assert_matches_hf(rollout, model_b, PROMPTS, MAX_TOKENS, atol=LOGPROB_ATOL)
        assert tokens_b != tokens_a, "weights A and B give the same tokens: the check would be empty"
    finally:
        rollout.shutdown()
    print(f"{model_type}: engine start {start_s:.1f}s, {src.name} -> vLLM TP2 move {report.seconds:.2f}s, "
          f"max |logprob diff| A {diff_a:.2e} B {diff_b:.2e}")
