"""Rank-side jobs of ``test_handoff.py`` (module level, so they pickle by reference; top level light)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from rank_jobs import garbage_like, tensor_source
from rlhf_switch.vps import Layout
from rlhf_switch.vps.materialize import allocate, bits, coverage_masks, materialize


def channel_moves(src: Layout, dst: Layout, handoff: str, colocated, budget: int, moves: int = 2) -> dict:
    """``moves`` moves through one weight channel (``ChannelEnd.join``, rank 0 hosts the store)
    with handoff ``handoff``: the source ranks' buffers hold ``src`` (a new seed per move), the
    destination ranks' buffers start as garbage; each move is checked bit for bit against a
    direct construction of ``dst``. Returns this rank's reports and what it saw."""
    from rlhf_switch.engines.channel import ChannelEnd, open_store

    rank = dist.get_rank()
    store, host, port = open_store(120) if rank == 0 else (None, None, None)
    addr = [(host, port)]
    dist.broadcast_object_list(addr, src=0)
    end = ChannelEnd.join(addr[0][0], addr[0][1], rank, dist.get_world_size(), store=store, timeout_s=120,
                          budget_bytes=budget, standby_s=120, handoff=handoff, colocated=colocated)
    end.set_layouts(src, dst)
    dst_bufs = garbage_like(allocate(dst, rank, fill=None), 1000 + rank)
    masks = coverage_masks(dst, rank)
    reports, exact = [], []
    for seed in range(moves):
        tensor_of = tensor_source(src, seed)
        src_bufs = materialize(src, rank, tensor_of)
        reports.append(vars(end.move(src_bufs, dst_bufs)).copy())
        want = materialize(dst, rank, tensor_of)
        exact.append(all(torch.equal(bits(dst_bufs[n])[masks[n]], bits(want[n])[masks[n]]) for n in dst_bufs))
    stats = end.stats()
    dist.barrier()  # rank 0 hosts the store: it stays until everyone is done with it
    end.close()
    return {"reports": reports, "exact": exact, "stats": stats, "buffers": len(dst_bufs)}


def _joined(src: Layout, dst: Layout, colocated, budget: int):
    from rlhf_switch.engines.channel import ChannelEnd, open_store

    rank = dist.get_rank()
    store, host, port = open_store(120) if rank == 0 else (None, None, None)
    addr = [(host, port)]
    dist.broadcast_object_list(addr, src=0)
    end = ChannelEnd.join(addr[0][0], addr[0][1], rank, dist.get_world_size(), store=store, timeout_s=120,
                          budget_bytes=budget, standby_s=120, handoff="ipc", colocated=colocated)
    end.set_layouts(src, dst)
    return end, store


def ipc_misfit_or_silent(src: Layout, dst: Layout, colocated, budget: int, fault: str, bad_rank: int) -> dict:
    """One ipc move where rank ``bad_rank`` (a worker) either brings a destination buffer of the
    wrong dtype (``fault="misfit"``) or takes part in the gather and then never copies
    (``"silent"``). Returns the error this rank raised and whether its buffers stayed as they were."""
    import time

    from rlhf_switch.routing.executor import move

    rank = dist.get_rank()
    end, store = _joined(src, dst, colocated, budget)
    src_bufs = materialize(src, rank, tensor_source(src, 0))
    src_copy = {n: t.clone() for n, t in src_bufs.items()}
    dst_bufs = garbage_like(allocate(dst, rank, fill=None), 1000 + rank)
    if fault == "misfit" and rank == bad_rank:
        name = next(iter(dst_bufs))
        dst_bufs[name] = dst_bufs[name].double()
    dst_copy = {n: t.clone() for n, t in dst_bufs.items()}
    t0 = time.perf_counter()
    error, lost = None, []
    try:
        if fault == "silent" and rank == bad_rank:  # the gather's agreement, then nothing more
            move(end.src, end._gather, {}, {}, group=end._comm, timeout=end.timeout)
        else:
            end.move(src_bufs, dst_bufs)
    except Exception as e:  # noqa: BLE001 - reported to the test
        error, lost = f"{type(e).__name__}: {e}", getattr(e, "lost", [])
    elapsed = time.perf_counter() - t0
    dist.barrier()
    end.close()
    return {"error": error, "lost": lost, "elapsed_s": elapsed,
            "dst_untouched": all(torch.equal(bits(t), bits(dst_copy[n])) for n, t in dst_bufs.items()),
            "src_intact": all(torch.equal(bits(t), bits(src_copy[n])) for n, t in src_bufs.items())}
