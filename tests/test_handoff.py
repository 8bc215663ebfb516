"""The colocated handoff (``rollout.handoff: ipc``): weights handed to a colocated worker process
as one shared-memory handle per packed bucket, copied out with the plan's local copies.

Pure: the bucket layout (every fragment once, buckets within the budget, both holders cover the
model) and ``resolve_handoff`` (colocation from the members' devices). Multi-process (a real
``LocalWorld``: ranks 0-1 a ZeRO-3 DP2 trainer, ranks 2-3 the two workers of a TP2 rollout layout,
worker ``t`` on trainer rank ``t``'s device): each worker's box is spread over both trainer ranks,
so the trainer ranks gather over the group, then hand off locally — bit for bit, every move, with
handles per move = buckets (not tensors), nothing over the group into the workers; a worker whose
buffers misfit is refused by every member before a byte moves, one that never copies is named
lost. The same with real vLLM workers (and HF parity after it) is in ``test_vllm.py``, a GRPO run
in ``test_handoff_loop.py``.
"""
from __future__ import annotations

import pytest

import handoff_jobs
from rlhf_switch.engines.channel import resolve_handoff
from rlhf_switch.vps import LayoutError, llama_spec, vllm_layout, zero
from rlhf_switch.vps.layouts.buckets import bucket_layout
from rlhf_switch.vps.placement import place
from rlhf_switch.vps.spec import itemsize

CONFIG = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256,
              vocab_size=1000, num_hidden_layers=2, max_position_embeddings=256, rms_norm_eps=1e-5,
              tie_word_embeddings=False)
BUDGET = 256 << 10  # several buckets per worker, each bigger than most of its tensors


@pytest.fixture(scope="module")
def layouts():
    spec = llama_spec(CONFIG, dtype="float32", name="tiny-handoff")
    src = place(zero(spec, 2, stage=3, fields=("param",)), range(2), 4)
    dst = place(vllm_layout(spec, 2), range(2, 4), 4)
    return spec, src, dst


def test_bucket_layout_packs_every_fragment_once_within_the_budget(layouts):
    _, _, dst = layouts
    for budget in (BUDGET, 10_000, 64 << 20):
        held = bucket_layout(dst, {2: 0, 3: 1}, budget).validate()  # covers the model, as dst does
        own = bucket_layout(dst, {2: 2, 3: 3}, budget).validate()
        for w, holder in ((2, 0), (3, 1)):
            assert held.buffers(holder) == own.buffers(w) and held.fragments(holder) == own.fragments(w)
            assert all(b.numel * itemsize(b.dtype) <= budget for b in own.buffers(w).values())
            # the worker's boxes, each exactly once (big ones cut into pieces that fit)
            assert sum(f.box.numel for f in own.fragments(w)) == dst.numel(w)
            # dense packing: a bucket's fragments fill it end to end
            used = {}
            for f in own.fragments(w):
                assert f.offset == used.get(f.buffer, 0)
                used[f.buffer] = f.offset + f.box.numel
            assert used == {n: b.numel for n, b in own.buffers(w).items()}
        assert not held.buffers(2) and not held.buffers(3) and not own.buffers(0)
    big = bucket_layout(dst, {2: 0}, 64 << 20)
    assert len(big.buffers(0)) == 1  # one dtype, under the budget: one bucket for the whole worker
    with pytest.raises(LayoutError, match="outside a world"):
        bucket_layout(dst, {2: 7}, BUDGET)


def test_resolve_handoff_from_devices():
    # trainer ranks 0-1 on devices a, b; workers 2-3 on b, a
    assert resolve_handoff("ipc", ["a", "b", "b", "a"], 2) == ("ipc", ((2, 1), (3, 0)))
    assert resolve_handoff("auto", ["a", "b", "b", "a"], 2) == ("ipc", ((2, 1), (3, 0)))
    assert resolve_handoff("p2p", ["a", "b", "b", "a"], 2) == ("p2p", ())
    # worker 3 on another node's device: auto falls back to p2p, ipc is refused naming it
    devices = [("n0", 0), ("n0", 1), ("n0", 0), ("n1", 1)]
    assert resolve_handoff("auto", devices, 2) == ("p2p", ())
    with pytest.raises(ValueError, match=r"channel ranks \[3\] .* have no trainer rank on their device"):
        resolve_handoff("ipc", devices, 2)
    with pytest.raises(ValueError, match="expected one of auto, p2p, ipc"):
        resolve_handoff("nccl", devices, 2)


def test_ipc_handoff_zero3_dp2_into_tp2_workers_bit_exact(world4, layouts):
    _, src, dst = layouts
    mode, colocated = resolve_handoff("auto", [0, 1, 0, 1], 2)
    assert mode == "ipc"
    out = world4.run(handoff_jobs.channel_moves, src, dst, mode, colocated, BUDGET, timeout=300)
    assert all(all(r["exact"]) for r in out), [r["exact"] for r in out]
    for w in (2, 3):
        reports = out[w]["reports"]
        buckets = len(bucket_layout(dst, dict(colocated), BUDGET).buffers(w - 2))
        for rep in reports:
            assert rep["handoff"] == "ipc"
            # one handle per bucket, fewer than the tensors it fills; nothing over the group
            assert rep["handles"] == buckets < rep["tensors"] == out[w]["buffers"]
            assert rep["bytes_received"] == 0 and rep["messages"] == 0
            assert rep["bytes_local"] == dst.numel(w) * 4
        assert out[w]["stats"]["handles_received"] == 2 * buckets
    for t in (0, 1):
        rep = out[t]["reports"][0]
        # each trainer rank gathers its worker's box from both ranks: half of it over the group
        assert rep["handles"] == out[3 - t]["reports"][0]["handles"] and rep["bytes_received"] > 0
        assert out[t]["stats"]["handles_sent"] == 2 * rep["handles"]


def test_p2p_channel_unchanged_by_default(world4, layouts):
    _, src, dst = layouts
    out = world4.run(handoff_jobs.channel_moves, src, dst, "p2p", (), BUDGET, 1, timeout=300)
    assert all(all(r["exact"]) for r in out)
    assert all(r["stats"]["handoff"] == "p2p" and r["stats"]["handles_sent"] == 0 for r in out)
    assert out[2]["reports"][0]["bytes_received"] == dst.numel(2) * 4


def test_ipc_worker_misfit_refused_by_every_member_before_a_byte_moves(world4, layouts):
    """Worker rank 3's buffer of the wrong dtype: it refuses in the gather's agreement, so every
    member raises the same ``MoveError`` and no buffer anywhere is written."""
    _, src, dst = layouts
    _, colocated = resolve_handoff("ipc", [0, 1, 0, 1], 2)
    out = world4.run(handoff_jobs.ipc_misfit_or_silent, src, dst, colocated, BUDGET, "misfit", 3, timeout=300)
    for r, res in enumerate(out):
        assert res["error"] and "MoveError" in res["error"] and "destination buffers of rank 3" in res["error"], (r, res)
        assert "is torch.float64, layout says float32" in res["error"], res["error"]
        assert res["dst_untouched"] and res["src_intact"], (r, res)


@pytest.mark.heavy  # left out of `make test-fast`
def test_ipc_worker_that_never_copies_is_named_lost(world4, layouts):
    """Worker rank 3 takes part in the gather, then never copies out of its buckets: its trainer
    rank (1) raises ``PeerLost`` naming it within the move's deadline (10 s + its bytes at 50 MB/s);
    worker 2 and its trainer rank finish."""
    _, src, dst = layouts
    _, colocated = resolve_handoff("ipc", [0, 1, 0, 1], 2)
    out = world4.run(handoff_jobs.ipc_misfit_or_silent, src, dst, colocated, BUDGET, "silent", 3, timeout=300)
    assert out[1]["error"] and "PeerLost" in out[1]["error"] and "lost rank 3" in out[1]["error"], out[1]
    assert out[1]["lost"] == [3] and out[1]["elapsed_s"] < 60, out[1]
    assert out[0]["error"] is None and out[2]["error"] is None, (out[0], out[2])
    assert out[1]["src_intact"]
