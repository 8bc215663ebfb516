"""A ``model.path`` directory for ``data:`` runs with no download: a tiny, seeded Llama whose
vocabulary is exactly the shipped BPE tokenizer's (384 ids), saved with that tokenizer beside it.

    python -m rlhf_switch.testing.tiny_model runs/gsm8k_tiny_model   # what configs/gsm8k_tiny.yaml reads
"""
from __future__ import annotations

import sys
from pathlib import Path

from .bpe_tokenizer import VOCAB_SIZE, build_bpe_tokenizer

# head_dim 32: vLLM refuses 16; 2 KV heads: rollout TP2 splits them
TINY_LLAMA = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128,
                  tie_word_embeddings=False)


def build_tiny_llama_dir(out_dir: str | Path, seed: int = 0, **overrides) -> Path:
    """``config.json`` + ``model.safetensors`` (fp32, weights from ``seed``) + the BPE tokenizer
    in ``out_dir``; the config's pad/eos ids are the tokenizer's."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlhf_switch.rl.sft import save_hf_checkpoint

    out = Path(out_dir)
    tok = build_bpe_tokenizer(out)
    torch.manual_seed(seed)
    ids = {"pad_token_id": tok.pad_token_id, "eos_token_id": tok.eos_token_id, "bos_token_id": None}
    cfg = LlamaConfig(**{**TINY_LLAMA, **ids, **overrides})
    save_hf_checkpoint(LlamaForCausalLM(cfg).float(), out)
    return out


if __name__ == "__main__":
    print(build_tiny_llama_dir(sys.argv[1] if len(sys.argv) > 1 else "runs/gsm8k_tiny_model"))
