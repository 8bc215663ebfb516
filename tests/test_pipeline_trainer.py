"""The RLHF loop's pipeline trainer (``engines/pipeline.py``: PP2, TP2×PP2) against one process.

A tiny vLLM-shaped Llama (head_dim 32, 4 heads / 2 KV heads, 2 layers: PP2 is one layer per
stage), untied. Every rank of the engine compares with a one-process ``hf_model`` of the same
seed: ``outputs`` (a batch of 5 rows with micro 2, T=11 < seq_len=16: padded both ways), then 2
``train_step``s of a GRPO-like loss over 2 micro-batches of 2 rows each, with AdamW and gradient
clipping that bites (norms ~8 and ~4 against max 0.05), against the same loss on the same
micro-batches with ``torch.nn.utils.clip_grad_norm_``.

Tolerances (fp32). Log-probs: 1e-5 (measured 4.8e-7). Parameters after 2 AdamW steps: 3e-5
(measured 1.3e-5 PP2, 6.3e-6 TP2×PP2): padding changes the matmul shapes and so their rounding,
and Adam's first steps turn a gradient's last-bit difference into up to ~lr·1e-3 of update. With
no padding (T = seq_len) PP2 is bit-identical to the one-process run (asserted: 0.0, the clip's
grad norms too — the clip is ``clip_grad_norm_``'s arithmetic), so the residual is that rounding
and nothing else; a step that lost a micro-batch or clipped with a
per-stage norm would move parameters by ~lr = 3e-3 (each tensor moved ≥ 6e-3 here).
"""
from __future__ import annotations

import math

import pytest
import torch

import pipeline_jobs as jobs
from helpers import TINY

LOGP_ATOL = 1e-5
PARAM_ATOL = 3e-5
NORM_RTOL = 1e-5




def check(results: list, ranks: list[int], name: str, param_atol: float = PARAM_ATOL,
          clipped: bool = True) -> list[dict]:
    """Every engine rank against the one-process run, and all engine ranks alike."""
    mine = [r for r in results if r is not None]
    assert [r["rank"] for r in mine] == ranks and all(r["name"] == name for r in mine)
    first = mine[0]
    for r in mine:
        where = f"{name} rank {r['rank']} (stage {r['stage']})"
        assert r["logp_shape"] == (5, 10), where
        assert r["logp_diff"] <= LOGP_ATOL, f"{where}: log-probs off by {r['logp_diff']}"
        assert torch.equal(r["logp"], first["logp"]), f"{where}: ranks return different log-probs"
        assert r["param_diff"] <= param_atol, f"{where}: {r['worst']} off by {r['param_diff']}"
        assert r["param_moved"] > 100 * param_atol, f"{where}: training barely moved the weights"
        # results are broadcast from one rank: the same bits everywhere
        assert r["grad_norms"] == first["grad_norms"] or all(map(math.isnan, r["grad_norms"]))
        assert r["stats"] == first["stats"], where
        for got, want in zip(r["stats"], r["ref_stats"]):
            assert [s["rows"] for s in got] == [(0, 2), (2, 4)], where
            for g, w in zip(got, want):
                assert g["loss"] == pytest.approx(w["loss"], rel=1e-5, abs=1e-6), where
                assert g["kl"] == pytest.approx(w["kl"], rel=1e-5), where
        if clipped:
            assert min(r["grad_norms"]) > 10 * 0.05, "clipping did not bite: the test proves less"
            assert r["grad_norms"] == pytest.approx(r["ref_grad_norms"], rel=NORM_RTOL), where
        else:
            assert all(map(math.isnan, r["grad_norms"])), f"{where}: clipping off must report NaN"
        assert "micro=1" in r["other_micro"], where
    # each stage holds its own layers (and the embedding first, norm + LM head last)
    by_stage = {r["stage"]: r["names"] for r in mine}
    assert "model.embed_tokens.weight" in by_stage[0] and "lm_head.weight" in by_stage[1]
    assert not set(by_stage[0]) & set(by_stage[1])
    return mine


@pytest.mark.heavy  # left out of `make test-fast`
def test_pp2_equals_one_process(world2):
    check(world2.run(jobs.outputs_and_training, TINY, [0, 1], 1), [0, 1], "PP2")


def test_pp2_without_padding_is_bit_identical(world2):
    """T = seq_len and B a multiple of micro in training: the same shapes as the one-process run,
    and clipping in ``clip_grad_norm_``'s own arithmetic (the per-tensor norms of every stage,
    gathered in the model's order, reduced in fp32) — hence the same bits, the grad norms
    included. Clipping on, then off."""
    for max_grad_norm in (0.05, 0.0):
        results = world2.run(jobs.outputs_and_training, TINY, [0, 1], 1, seq_len=12, max_grad_norm=max_grad_norm)
        for r in check(results, [0, 1], "PP2", 0.0, clipped=max_grad_norm > 0):
            if max_grad_norm > 0:
                assert r["grad_norms"] == r["ref_grad_norms"], r["rank"]


@pytest.mark.heavy  # left out of `make test-fast`
def test_tp2_pp2_equals_one_process(world4):
    results = world4.run(jobs.outputs_and_training, TINY, [0, 1, 2, 3], 2)
    mine = check(results, [0, 1, 2, 3], "TP2·PP2")
    # the two TP ranks of a stage hold the same tensors (sharded or replicated)
    assert mine[0]["names"] == mine[1]["names"] and mine[2]["names"] == mine[3]["names"]


@pytest.mark.heavy  # left out of `make test-fast`
def test_pp2_on_part_of_the_world(world4):
    """Stages on ranks 1 and 3; ranks 0 and 2 take part in group creation and get None."""
    results = world4.run(jobs.outputs_and_training, TINY, [1, 3], 1)
    assert results[0] is None and results[2] is None
    check(results, [1, 3], "PP2")
