"""The loop-overhead changes of issue 18 keep the numbers: FSDP2 gathered once per call, AdamW on
the local shards, the batched gradient norm (2 gloo ranks, a tiny untied Llama whose FSDP2 shards
are uneven); and the TRL baseline's tokenizer gives TRL the loop's ids (no TRL needed)."""
from __future__ import annotations

import torch

import loop_overhead_jobs as jobs

TINY = dict(model_type="llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=67, max_position_embeddings=64, tie_word_embeddings=False)


def _batches(n: int, rows: int = 4, seq: int = 12) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, TINY["vocab_size"], (rows, seq), generator=g) for _ in range(n)]


def test_fsdp2_gathered_once_and_local_shard_adam_are_bit_identical(world2):
    for rank, got in enumerate(world2.run(jobs.gathered_once_and_local_adam_equal_the_plain_paths, TINY, _batches(3))):
        assert all(got["outputs"]), (rank, got)
        assert all(norm_eq and stats_eq for norm_eq, stats_eq, _ in got["steps"]), (rank, got["steps"])
        assert any(gn > OPTIM_CLIP for *_, gn in got["steps"]), "clipping never ran: the test would not see it"
        assert got["state_equal"] == [], (rank, got["state_equal"])
        assert got["flags_kept"] and got["sharded_after"], (rank, got)


OPTIM_CLIP = jobs.OPTIM.max_grad_norm


def test_batched_gradient_norm_equals_the_per_tensor_dtensor_norms(world2):
    for batched, per_tensor in world2.run(jobs.batched_norm_equals_per_tensor_norm, TINY, _batches(1)[0]):
        assert batched == per_tensor


def test_trl_baseline_tokenizer_is_the_character_tokenizer():
    from bench.trl_grpo import char_tokenizer_hf
    from rlhf_switch.rl.tasks import CHARACTERS, CharTokenizer

    ct, hf = CharTokenizer(), char_tokenizer_hf()
    text = CHARACTERS + "12+34="
    ids = ct.encode(text, add_bos=True)
    assert hf(text)["input_ids"] == ids
    assert hf.decode(ids + [ct.eos_id, ct.pad_id], skip_special_tokens=True) == ct.decode(ids) == text
