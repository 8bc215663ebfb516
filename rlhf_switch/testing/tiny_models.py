"""Tiny random models of every family, built from their transformers config class (no download).

``tiny_config(model_type)`` is a config dict small enough for CPU tests yet inside what vLLM's CPU
backend accepts (head_dim 32 — it refuses 16; 2 KV heads so TP 2 splits them); ``save_tiny_model``
writes ``config.json`` + ``model.safetensors`` of a seeded random model of it. The default vocabulary
is 384: the size of the BPE tokenizer the data recipes train. ``build_model_dir`` is a whole
``model.path`` for ``data:`` runs: the model (transformers' own seeded initialisation, a model to
train rather than to test layouts with) and the shipped BPE tokenizer beside it, the config's
pad/eos ids the tokenizer's.

    python -m rlhf_switch.testing.tiny_models qwen3 /tmp/tiny-qwen3                    # layouts, tests
    python -m rlhf_switch.testing.tiny_models qwen2 runs/gsm8k_tiny_model --tokenizer  # configs/gsm8k_tiny.yaml
"""
from __future__ import annotations

import sys
from pathlib import Path

from ..families import FAMILIES

_BASE = dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=2, head_dim=32,
             intermediate_size=128, num_hidden_layers=2, max_position_embeddings=256,
             rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
             pad_token_id=0, dtype="float32")
_PER_FAMILY = {
    "mistral": dict(sliding_window=None),  # full attention: the window is refused (families.py)
    "qwen2": dict(use_sliding_window=False),
    "qwen3": dict(use_sliding_window=False),
    "qwen3_moe": dict(use_sliding_window=False, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[],
                      norm_topk_prob=True),
}


def tiny_config(model_type: str, vocab_size: int = 384, **overrides) -> dict:
    """A tiny config dict of ``model_type`` (with ``model_type`` in it); ``overrides`` win."""
    if model_type not in FAMILIES:
        raise ValueError(f"model_type {model_type!r} is not supported (known: {', '.join(FAMILIES)})")
    return {"model_type": model_type, **_BASE, **_PER_FAMILY.get(model_type, {}),
            "vocab_size": vocab_size, **overrides}


def randomize(model, seed: int) -> None:
    """Every parameter drawn at random, biases and norms included: transformers initialises those
    to 0 and 1, which would make any layout of them look right (every shard equal)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.1 * noise if name.endswith("norm.weight") else 0.05 * noise)


def save_tiny_model(model_type: str, out_dir: str, vocab_size: int = 384, seed: int = 0, **overrides):
    """Build a random model of ``tiny_config(model_type, vocab_size, **overrides)`` (every
    parameter from ``seed``: ``randomize``) and ``save_pretrained`` it to ``out_dir``; returns
    the model (fp32, eval)."""
    from ..models import causal_lm

    model = causal_lm(tiny_config(model_type, vocab_size, **overrides), seed).eval()
    randomize(model, seed)
    model.save_pretrained(out_dir)
    return model


# a model to train on the GSM8K-format data: at hidden 64 / 2 heads (seed 0, 16 prompts × 8 per
# iteration, lr 1e-4) GRPO moved held-out accuracy only +0.02 to +0.035 from a 0.085-0.415 start;
# at this size, with configs/gsm8k_tiny.yaml's 64 prompts × 8, +0.03 to +0.085 over seeds 0-3
# (measured on a 2-core CPU machine; docs/models-and-data.md)
TRAINABLE = dict(hidden_size=128, num_attention_heads=4, intermediate_size=256)


def build_model_dir(out_dir: str | Path, model_type: str = "qwen2", seed: int = 0, **overrides) -> Path:
    """A ``model.path`` as ``save_pretrained`` writes one: ``config.json`` + ``model.safetensors``
    (fp32, ``TRAINABLE`` size, transformers' initialisation from ``seed``) + the shipped BPE
    tokenizer (384 ids, ChatML template); bos none, pad and eos the tokenizer's."""
    from ..models import causal_lm
    from ..rl.sft import save_hf_checkpoint
    from .bpe_tokenizer import VOCAB_SIZE, build_bpe_tokenizer

    out = Path(out_dir)
    tok = build_bpe_tokenizer(out)
    fields = {**TRAINABLE, "vocab_size": VOCAB_SIZE, "pad_token_id": tok.pad_token_id, "eos_token_id": tok.eos_token_id,
              "bos_token_id": None, **overrides}
    save_hf_checkpoint(causal_lm(tiny_config(model_type, **fields), seed), out)
    return out


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--tokenizer"]
    if len(args) != 2:
        sys.exit(f"usage: python -m rlhf_switch.testing.tiny_models <{'|'.join(FAMILIES)}> <out_dir> [--tokenizer]")
    if "--tokenizer" in sys.argv:
        print(f"wrote {build_model_dir(args[1], args[0])}: config.json, model.safetensors and the BPE tokenizer")
    else:
        save_tiny_model(args[0], args[1])
        print(f"wrote {args[1]}/config.json and model.safetensors")
