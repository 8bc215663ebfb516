"""The colocated handoff: buckets shared with another process on the same device, by handle.

A trainer process and a rollout worker process on one device need not send bytes through a
process group: the trainer packs what the worker needs into a few buckets (a ``bucket_layout``,
``vps/layouts/buckets.py``), hands the worker one handle per bucket, and the worker copies out of
the buckets into its parameters with the plan's local copies. One code path for both devices:

- ``allocate(layout, rank, device)``: the rank's buckets, made once — on CPU in shared memory, on
  a GPU ordinary device memory;
- ``export(buckets)``: one handle per bucket, ``torch.multiprocessing.reductions.reduce_tensor``
  pickled by ``ForkingPickler`` (CUDA IPC on a GPU; on CPU a shared-memory file name) — bytes for
  whatever side channel the caller has (a TCPStore);
- ``open_handles(handles)``: the buckets in the receiving process, mapping the same memory;
- ``copy_local(src, dst, ...)``: a move that has only same-rank pieces (the worker's copy out of
  its buckets), through the executor's local-copy path.

CPU sharing strategy: torch's default (``file_descriptor``) passes a file descriptor through a
``multiprocessing`` connection authenticated with the *sender's* authkey; a vLLM worker is no
child of the trainer's process and is rejected ("digest sent was rejected"). The ``file_system``
strategy names a shared-memory file instead, which any process on the host can open; buckets are
made and exported under it (``_file_system_sharing``), the process-wide setting is restored after.
"""
from __future__ import annotations

import pickle
import time
from contextlib import contextmanager
from typing import Mapping

import torch

from ..vps.layout import Layout, LayoutError
from ..vps.materialize import torch_dtype
from .executor import DEFAULT_BUDGET, MoveReport, _check_buffers, _copy_local, prepare


@contextmanager
def _file_system_sharing():
    import torch.multiprocessing as mp

    before = mp.get_sharing_strategy()
    mp.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        mp.set_sharing_strategy(before)


def allocate(layout: Layout, rank: int, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Rank ``rank``'s buffers of ``layout`` (its buckets), zeroed; in shared memory on CPU."""
    device = torch.device(device)
    out = {}
    with _file_system_sharing():
        for name, b in layout.buffers(rank).items():
            t = torch.zeros(b.numel, dtype=torch_dtype(b.dtype), device=device)
            out[name] = t.share_memory_() if device.type == "cpu" else t
    return out


def export(buckets: Mapping[str, torch.Tensor]) -> list[tuple[str, bytes]]:
    """One handle per bucket: (name, pickled ``reduce_tensor``)."""
    from multiprocessing.reduction import ForkingPickler

    from torch.multiprocessing.reductions import reduce_tensor

    out = []
    with _file_system_sharing():
        for name, t in buckets.items():
            if t.device.type == "cpu" and not t.is_shared():
                raise ValueError(f"bucket {name!r} is not in shared memory: another process cannot map it")
            out.append((name, bytes(ForkingPickler.dumps(reduce_tensor(t)))))
    return out


def open_handles(handles: list[tuple[str, bytes]]) -> dict[str, torch.Tensor]:
    """The buckets behind ``handles`` in this process (the same memory, not a copy)."""
    out = {}
    for name, h in handles:
        rebuild, args = pickle.loads(h)
        out[name] = rebuild(*args)
    return out


def check_destination(layout: Layout, rank: int, buffers: Mapping[str, torch.Tensor]) -> str | None:
    """Why ``buffers`` cannot be rank ``rank``'s destination of ``layout`` (None: they can) —
    asked by a worker before the trainer's ranks fill its buckets, so a misfit is refused by
    every member in the agreement instead of after the gather."""
    try:
        _check_buffers("destination", layout, rank, buffers)
    except ValueError as e:
        return f"ValueError: {e}"
    return None


@torch.no_grad()
def copy_local(src: Layout, dst: Layout, rank: int, src_buffers: Mapping[str, torch.Tensor],
               dst_buffers: Mapping[str, torch.Tensor], budget_bytes: int = DEFAULT_BUDGET) -> MoveReport:
    """Rank ``rank``'s part of ``src -> dst`` where every piece it receives is its own (no peer
    is involved: nothing is communicated); refused (``LayoutError``) before a byte moves if the
    plan has a message for this rank."""
    t0 = time.perf_counter()
    schedule = prepare(src, dst, rank, src_buffers, dst_buffers, budget_bytes)
    plan = schedule.plan
    if plan.bytes_sent or plan.bytes_received:
        raise LayoutError(f"{plan.transition}: rank {rank} would send {plan.bytes_sent} B and receive "
                          f"{plan.bytes_received} B; a local copy moves only its own pieces")
    t1 = time.perf_counter()
    _copy_local(schedule, src_buffers, dst_buffers)
    t2 = time.perf_counter()
    return MoveReport(plan.rank, plan.transition, 0, 0, plan.bytes_local, plan.min_bytes_received, 0, 0, 0,
                      budget_bytes, t2 - t0, phases=dict(prepare=t1 - t0, local=t2 - t1))


def settle(buffers: Mapping[str, torch.Tensor]) -> None:
    """Wait for the device's queued work on ``buffers`` (a GPU's kernels are asynchronous: the
    other process must not read a bucket still being written, nor the trainer refill one still
    being read); nothing to wait for on CPU."""
    if any(t.is_cuda for t in buffers.values()):
        torch.cuda.synchronize()
