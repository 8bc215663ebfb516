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
