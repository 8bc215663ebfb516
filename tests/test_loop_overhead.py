"""The loop's overhead cuts keep the numbers: FSDP2 gathered once per call, AdamW on
the local shards, the batched gradient norm, one FSDP2 unit for a small model (2 gloo ranks, a tiny
untied Llama whose FSDP2 shards are uneven); the update's mini-batch weights without an all-reduce; ZeRO-3 with persistent parameters trains bit-identically to plain ZeRO-3 and a write
of its partitions reaches its forward; and the TRL baseline's tokenizer gives TRL the loop's ids
(no TRL needed)."""
from __future__ import annotations

import pytest
import torch
import yaml

import loop_overhead_jobs as jobs
from helpers import REPO

TINY = dict(model_type="llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=67, max_position_embeddings=64, tie_word_embeddings=False)


def _batches(n: int, rows: int = 4, seq: int = 12) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, TINY["vocab_size"], (rows, seq), generator=g) for _ in range(n)]


@pytest.mark.heavy  # left out of `make test-fast`
def test_fsdp2_gathered_once_and_local_shard_adam_are_bit_identical(world2):
    for rank, got in enumerate(world2.run(jobs.gathered_once_and_local_adam_equal_the_plain_paths, TINY, _batches(3))):
        assert all(got["outputs"]), (rank, got)
        assert all(norm_eq and stats_eq for norm_eq, stats_eq, _ in got["steps"]), (rank, got["steps"])
        assert any(gn > OPTIM_CLIP for *_, gn in got["steps"]), "clipping never ran: the test would not see it"
        assert got["state_equal"] == [], (rank, got["state_equal"])
        assert got["flags_kept"] and got["sharded_after"], (rank, got)


OPTIM_CLIP = jobs.OPTIM.max_grad_norm


@pytest.mark.heavy  # left out of `make test-fast`
def test_fsdp2_one_unit_for_a_small_model_is_bit_identical_to_per_layer_units(world2):
    for rank, got in enumerate(world2.run(jobs.one_unit_equals_per_layer_units, TINY, _batches(3))):
        assert got["units"] == (1, TINY["num_hidden_layers"] + 1), (rank, got["units"])
        assert got["same_layout"] and all(got["outputs"]), (rank, got)
        assert all(norm_eq and stats_eq for norm_eq, stats_eq, _ in got["steps"]), (rank, got["steps"])
        assert any(gn > OPTIM_CLIP for *_, gn in got["steps"]), "clipping never ran: the test would not see it"
        assert got["state_equal"] == [], (rank, got["state_equal"])


@pytest.mark.heavy  # left out of `make test-fast`
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


# ZeRO-3 with persistent parameters (train.persistence_threshold): every parameter of TINY is
# below it (the largest, 67 x 64, has 4288 elements)
KEEP_ALL = 100_000


@pytest.mark.heavy  # left out of `make test-fast`
def test_zero3_persistent_parameters_train_bit_identically(world2):
    for rank, got in enumerate(world2.run(jobs.zero3_persistent_equals_partitioned, TINY, _batches(3), KEEP_ALL)):
        assert got["persistent"] == [0, got["params"]], (rank, got)
        assert got["fetch_hooks"][0] > 0 and got["fetch_hooks"][1] == 0, (rank, got)
        assert got["subprocesses"] == [], (rank, got["subprocesses"])
        assert all(got["outputs"]), (rank, got)
        assert all(n and s for n, s in got["steps"]), (rank, got)
        assert got["weights_equal"], rank


@pytest.mark.heavy  # left out of `make test-fast`
def test_a_weights_write_into_persistent_zero3_reaches_its_forward(world2):
    for rank, got in enumerate(world2.run(jobs.warm_start_into_persistent_zero3, TINY, _batches(1, rows=4)[0],
                                          KEEP_ALL, _batches(2))):
        assert got["persistent"] > 0, got
        assert not got["equal_before"], "the whole copies were already the source's: the test would not see a stale one"
        assert got["equal_after"], rank


def test_persistence_threshold_is_refused_off_zero3():
    """The engines say where it applies (``TrainingEngine.keeps_small_params_whole``): DeepSpeed
    ZeRO-3 only; elsewhere the pre-start checks refuse it, naming the field."""
    from rlhf_switch.engines.base import phase_engine_problems
    from rlhf_switch.rl.config import TrainerLayout

    assert phase_engine_problems("train", TrainerLayout(engine="deepspeed", zero_stage=3, dp=2,
                                                        persistence_threshold=10), None) == []
    for layout in ({"engine": "deepspeed", "zero_stage": 2, "dp": 2}, {"engine": "fsdp2", "dp": 2}):
        problems = phase_engine_problems("train", TrainerLayout(**layout, persistence_threshold=10), None)
        assert problems == [f"train.persistence_threshold: 10 — engine {layout['engine']} with zero_stage "
                            f"{layout.get('zero_stage', 0)} keeps no small parameters whole (DeepSpeed ZeRO-3's "
                            f"stage3_param_persistence_threshold)"]


def _grpo_tiny() -> dict:
    with open(f"{REPO}/configs/grpo_tiny.yaml") as f:
        return yaml.safe_load(f)


@pytest.mark.parametrize("dp,local_mini", [(1, 4), (2, 4), (4, 2)])
@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_mini_batch_totals_equal_the_all_reduced_per_rank_totals(dp, local_mini, aggregation):
    """The update's mini-batch weights from the whole batch equal what the all-reduce of every
    rank's own (padded to its own length) summed before: uneven prompts, responses, one empty."""
    from rlhf_switch.rl.algorithm import loss_weight as _weight, mini_batch_totals, pad_batch as _pad_batch

    g = torch.Generator().manual_seed(3)
    n = 16
    prompts = [[1] + torch.randint(3, 40, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n)]
    responses = [torch.randint(3, 40, (int(torch.randint(0, 9, (1,), generator=g)),), generator=g).tolist()
                 for _ in range(n)]
    responses[5] = []
    per = n // dp
    summed = torch.zeros(per // local_mini, dtype=torch.float64)
    for r in range(dp):  # what each rank had, then the sum the all-reduce made
        mask = _pad_batch(prompts[r * per:(r + 1) * per], responses[r * per:(r + 1) * per], 0)[2]
        summed += torch.stack([_weight(mask[s:s + local_mini], aggregation).double() for s in range(0, per, local_mini)])
    got = mini_batch_totals(prompts, responses, 0, dp, local_mini, aggregation)
    assert got.dtype == torch.float64 and torch.equal(got, summed), (got, summed)
    assert len(set(got.tolist())) > 1, "every mini-batch weighs the same: the test would not see a mix-up"
