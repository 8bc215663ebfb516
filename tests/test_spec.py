"""Model specs derived from a transformers config equal the real model's parameters."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from catalogue import TINY_LLAMA
from rlhf_switch.vps import llama_spec


@pytest.mark.parametrize("extra", [
    {},
    {"tie_word_embeddings": True},
    {"attention_bias": True, "mlp_bias": True},
    {"num_key_value_heads": 2, "head_dim": 16},
])
def test_llama_spec_matches_named_parameters(extra):
    cfg = LlamaConfig(**{**TINY_LLAMA, **extra})
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    spec = llama_spec(cfg)
    real = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    assert [(t.name, t.shape) for t in spec.tensors] == real
    assert spec.tied_lm_head == bool(extra.get("tie_word_embeddings", False))
    assert {t.dtype for t in spec.tensors} == {"float32"}


def test_spec_roles_and_anchors():
    spec = llama_spec(TINY_LLAMA)
    roles = {t.name.split(".")[-2]: t.tp for t in spec.tensors if t.layer == 0}
    assert roles == {"q_proj": "column", "k_proj": "column", "v_proj": "column", "o_proj": "row",
                     "gate_proj": "column", "up_proj": "column", "down_proj": "row",
                     "input_layernorm": "replicate", "post_attention_layernorm": "replicate"}
    assert spec["model.embed_tokens.weight"].anchor == "first"
    assert spec["lm_head.weight"].anchor == "last" and spec["model.norm.weight"].anchor == "last"
    with pytest.raises(KeyError, match="has no tensor 'nope'"):
        spec["nope"]


def test_dtype_comes_from_the_config():
    assert {t.dtype for t in llama_spec({**TINY_LLAMA, "torch_dtype": "bfloat16"}).tensors} == {"bfloat16"}
    assert llama_spec(TINY_LLAMA).digest != llama_spec({**TINY_LLAMA, "vocab_size": 251}).digest
