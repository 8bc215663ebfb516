"""Jobs for ``test_verify.py`` (run on every rank of a ``LocalWorld``): moves with ``verify``, and
a test-only corruption of one staged chunk in flight through ``MoveHooks.staged_receive``."""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from rank_jobs import garbage_like, tensor_source
from rlhf_switch.routing import MoveHooks, executor, move
from rlhf_switch.vps import Layout
from rlhf_switch.vps.materialize import allocate, bits, coverage_masks, materialize


def corrupting_hook(record: list):
    """A ``MoveHooks.staged_receive`` that flips one bit (0x40) of the first byte of the first piece of
    the first staged chunk this rank receives — after it arrived, before it is unpacked — and
    records which piece that was."""
    def hook(chunk, buf):
        if record:
            return
        p, o = chunk.pieces[0], chunk.offsets[0]
        buf[o] = buf[o] ^ 0x40
        t = p.transfer
        record.append({"key": str(t.key), "box": str(t.box), "piece": str(p.box), "src": t.src, "dst": t.dst,
                       "buffer": t.dst_buffer})
    return hook


def move_verified(src: Layout, dst: Layout, verify: str = "off", fraction: float = 0.1, seed: int = 0,
                  corrupt_rank: int | None = None, budget_bytes: int = 1 << 20) -> dict:
    """Move seeded ``src`` buffers into garbage ``dst`` buffers with ``verify``; on
    ``corrupt_rank`` one staged chunk is corrupted in flight. Returns the error (if the move
    raised), the corrupted piece, the destination elements that differ from a direct
    construction of ``dst`` (per buffer), and the report."""
    rank = dist.get_rank()
    tensor_of = tensor_source(src, 0)
    src_bufs = materialize(src, rank, tensor_of)
    dst_bufs = garbage_like(allocate(dst, rank, fill=None), 1000 + rank)
    record: list = []
    hooks = MoveHooks(staged_receive=corrupting_hook(record)) if rank == corrupt_rank else None
    report, error = None, None
    try:
        report = move(src, dst, src_bufs, dst_bufs, budget_bytes=budget_bytes, verify=verify,
                      verify_fraction=fraction, verify_seed=seed, hooks=hooks)
    except Exception as e:  # noqa: BLE001 - the test inspects it
        error = f"{type(e).__name__}: {e}"
    expected = materialize(dst, rank, tensor_of)
    masks = coverage_masks(dst, rank)
    differ = {}
    for n, t in dst_bufs.items():
        m = masks[n]
        k = int((bits(t)[m] != bits(expected[n])[m]).sum())
        if k:
            differ[n] = k
    return {"error": error, "corrupted": record[0] if record else None, "differ": differ, "report": report}


def time_modes(src: Layout, dst: Layout, modes: list[tuple[str, float]], repeats: int = 3,
               budget_bytes: int = executor.DEFAULT_BUDGET) -> dict:
    """Per (mode, fraction): the seconds of each of ``repeats`` moves on this rank (after one
    warm-up move that plans and caches the schedule), with the verify phase's share."""
    rank = dist.get_rank()
    src_bufs = materialize(src, rank, tensor_source(src, 0))
    dst_bufs = allocate(dst, rank)
    move(src, dst, src_bufs, dst_bufs, budget_bytes=budget_bytes)  # warm-up: plan, schedule
    out = {}
    for verify, fraction in modes:
        secs, vsecs = [], []
        for i in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            rep = move(src, dst, src_bufs, dst_bufs, budget_bytes=budget_bytes, verify=verify,
                       verify_fraction=fraction, verify_seed=i)
            secs.append(time.perf_counter() - t0)
            vsecs.append(rep.phases.get("verify", 0.0))
        out[f"{verify}({fraction})" if verify == "sample" else verify] = {
            "seconds": secs, "verify_seconds": vsecs, "median": statistics.median(secs),
            "pieces_verified": rep.pieces_verified, "bytes_received": rep.bytes_received,
            "bytes_local": rep.bytes_local}
    return out


def checksum_rate(numel: int = 10_000_000) -> float:
    """Seconds to checksum ``numel`` float32 elements (one contiguous view) on this rank."""
    from rlhf_switch.routing.verify import checksum
    t = torch.randn(numel)
    checksum(t)
    t0 = time.perf_counter()
    checksum(t)
    return time.perf_counter() - t0


def move_with_seed_of_rank(src: Layout, dst: Layout) -> dict:
    """Every rank verifies with its own seed (its rank): the ranks disagree on what to check."""
    rank = dist.get_rank()
    src_bufs = materialize(src, rank, tensor_source(src, 0))
    dst_bufs = allocate(dst, rank)
    try:
        move(src, dst, src_bufs, dst_bufs, verify="sample", verify_seed=rank)
        return {"error": None}
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}"}


def channel_verified(src: Layout, dst: Layout, verify: str, fraction: float, moves: int,
                     corrupt_rank: int | None = None) -> dict:
    """``moves`` moves through a ``ChannelEnd`` over this world whose ``verify`` setting is the
    channel's (as an ``Endpoint`` carries it); the last move corrupted in flight on
    ``corrupt_rank``. Returns each move's checked count and the error, if any."""
    from rlhf_switch.engines.channel import ChannelEnd

    rank = dist.get_rank()
    end = ChannelEnd.over(verify=verify, verify_fraction=fraction)
    end.set_layouts(src, dst)
    src_bufs = materialize(src, rank, tensor_source(src, 0))
    dst_bufs = allocate(dst, rank)
    checked, error, record = [], None, []
    try:
        for i in range(moves):
            hooks = (MoveHooks(staged_receive=corrupting_hook(record))
                     if i == moves - 1 and rank == corrupt_rank else None)
            checked.append(end.move(src_bufs, dst_bufs, hooks=hooks).pieces_verified)
    except Exception as e:  # noqa: BLE001
        error = f"{type(e).__name__}: {e}"
    return {"checked": checked, "error": error, "stats": end.stats()}
