"""Execute a transition on real buffers over ``torch.distributed``.

``move`` is the whole protocol, in this order:

1. every rank plans its own part (``plan_rank``) and checks its buffers against both layouts;
2. one ``all_gather_object`` of (plan digest, per-peer digests, error): if any rank failed or any
   two ranks disagree on what they are about to exchange, *every* rank raises the same
   ``MoveError`` — before a byte has moved;
3. local copies (source view → destination view, no staging);
4. the schedule's exchanges, round by round: per step one ``isend`` and/or one ``irecv`` of at
   most ``budget/2`` bytes each, straight from/into the buffers when the piece is contiguous.

Every wait has a timeout. Source buffers are only read, so a failed move loses no state.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Mapping

import torch
import torch.distributed as dist

from ..vps.layout import Layout, LayoutError
from ..vps.materialize import torch_dtype
from ..vps.planner import RankPlan, check_pair, plan_rank
from ..vps.spec import itemsize
from .comm import Comm, as_comm
from .schedule import Chunk, Schedule, build_schedule

DEFAULT_BUDGET = 64 << 20
DEFAULT_TIMEOUT = timedelta(minutes=5)


class MoveError(RuntimeError):
    """A move refused (identically on every rank) before any data moved."""


@dataclass
class MoveReport:
    rank: int
    transition: str
    bytes_sent: int
    bytes_received: int
    bytes_local: int
    min_bytes_received: int
    messages: int
    peak_staging_bytes: int  # measured: the largest staging allocation alive at once
    planned_peak_staging_bytes: int
    budget_bytes: int
    seconds: float
    dry_run: bool = False

    def __str__(self) -> str:
        return (f"rank {self.rank}: {self.transition}: sent {self.bytes_sent} B, received "
                f"{self.bytes_received} B (minimum {self.min_bytes_received} B), local {self.bytes_local} B, "
                f"{self.messages} messages, peak staging {self.peak_staging_bytes} B of "
                f"{self.budget_bytes} B, {self.seconds * 1e3:.1f} ms")


def move(src: Layout, dst: Layout, src_buffers: Mapping[str, torch.Tensor],
         dst_buffers: Mapping[str, torch.Tensor], *, group: dist.ProcessGroup | Comm | None = None,
         budget_bytes: int = DEFAULT_BUDGET, ranks_per_node: int | None = None,
         timeout: timedelta = DEFAULT_TIMEOUT, dry_run: bool = False) -> MoveReport | Schedule:
    """Move everything ``dst`` wants from ``src``'s buffers into ``dst``'s buffers on this rank.

    ``group`` is the default world, a registered group, a bare ``ProcessGroup`` (one formed
    between a trainer and an engine's workers) or a ``Comm``; layout rank ``r`` is group rank ``r``.
    With ``dry_run`` nothing is communicated: the schedule is returned (it states its peak
    staging memory and every message it would send); without a process group it plans rank 0.
    """
    comm = as_comm(group) if not dry_run or dist.is_initialized() or group is not None else None
    rank = comm.rank if comm else 0
    world = comm.size if comm else src.world_size
    if src.world_size != world or dst.world_size != world:
        raise LayoutError(f"{src.name} is for {src.world_size} ranks and {dst.name} for "
                          f"{dst.world_size}; this process group has {world}")
    schedule, error = None, None
    try:
        schedule = prepare(src, dst, rank, src_buffers, dst_buffers, budget_bytes, ranks_per_node)
    except (LayoutError, ValueError, KeyError) as e:
        error = f"{type(e).__name__}: {e}"
    if dry_run:
        if error:
            raise MoveError(error)
        return schedule
    _agree(schedule.plan if schedule else None, error, comm, src, dst)
    return _run(schedule, src_buffers, dst_buffers, comm, timeout)


def prepare(src: Layout, dst: Layout, rank: int, src_buffers, dst_buffers, budget_bytes: int,
            ranks_per_node: int | None = None) -> Schedule:
    check_pair(src, dst)
    _validated(src)
    _validated(dst)
    plan = plan_rank(src, dst, rank, ranks_per_node)
    _check_buffers("source", src, rank, src_buffers)
    _check_buffers("destination", dst, rank, dst_buffers)
    src_dtypes = {n: b.dtype for n, b in src.buffers(rank).items()}
    return build_schedule(plan, budget_bytes, src_dtypes)


_VALID: set[str] = set()


def _validated(layout: Layout) -> None:
    if layout.digest not in _VALID:
        layout.validate()
        _VALID.add(layout.digest)


def _check_buffers(what: str, layout: Layout, rank: int, buffers: Mapping[str, torch.Tensor]) -> None:
    problems = []
    for name, b in layout.buffers(rank).items():
        t = buffers.get(name)
        if t is None:
            problems.append(f"missing {name!r}")
        elif t.dtype != torch_dtype(b.dtype):
            problems.append(f"{name!r} is {t.dtype}, layout says {b.dtype}")
        elif t.numel() < b.numel:
            problems.append(f"{name!r} has {t.numel()} elements, layout needs {b.numel}")
        elif not t.is_contiguous():
            problems.append(f"{name!r} is not contiguous")
    if problems:
        raise ValueError(f"{what} buffers of rank {rank} do not match {layout.name}: " + "; ".join(problems))


def _agree(plan: RankPlan | None, error: str | None, comm: Comm, src, dst) -> None:
    rank, world = comm.rank, comm.size
    mine = (plan.digest if plan else None, plan.pair_digests if plan else {}, error)
    everyone = comm.all_gather_object(mine)
    errors = [(r, e) for r, (_, _, e) in enumerate(everyone) if e]
    if errors:
        msgs = {e for _, e in errors}
        if len(msgs) == 1 and len(errors) == world:
            detail = f"every rank: {msgs.pop()}"
        else:
            detail = "; ".join(f"rank {r}: {e}" for r, e in errors)
        raise MoveError(f"move {src.name} -> {dst.name} refused before any data moved: {detail}")
    digests = {}
    for r, (d, _, _) in enumerate(everyone):
        digests.setdefault(d, []).append(r)
    if len(digests) > 1:
        detail = "; ".join(f"ranks {rs} planned {d}" for d, rs in digests.items())
        raise MoveError(f"plan digest mismatch, refusing to move {src.name} -> {dst.name}: {detail} "
                        f"(the ranks were given different layouts or library versions)")
    for p, d in plan.pair_digests.items():
        theirs = everyone[p][1].get(rank)
        if theirs != d:
            raise MoveError(f"rank {rank} and rank {p} disagree on the transfers between them "
                            f"({d} vs {theirs}); refusing to move {src.name} -> {dst.name}")


def _view(buffers, name: str, offset: int, shape, strides) -> torch.Tensor:
    buf = buffers[name]
    return torch.as_strided(buf, shape, strides, buf.storage_offset() + offset)


class _Staging:
    """Counts the bytes of staging tensors alive at once (what a budget promises)."""

    def __init__(self):
        self.current = 0
        self.peak = 0

    def alloc(self, nbytes: int, device: torch.device) -> torch.Tensor:
        self.current += nbytes
        self.peak = max(self.peak, self.current)
        return torch.empty(nbytes, dtype=torch.uint8, device=device)  # NCCL needs it on the GPU

    def free(self, t: torch.Tensor | None) -> None:
        if t is not None:
            self.current -= t.numel()


def _pack(chunk: Chunk, src_buffers, staging: _Staging) -> tuple[torch.Tensor, torch.Tensor | None]:
    if not chunk.stage_send:
        p = chunk.pieces[0]
        off, strides = p.src_view()
        return _view(src_buffers, p.transfer.src_buffer, off, p.box.shape, strides).reshape(-1).view(torch.uint8), None
    buf = staging.alloc(chunk.nbytes, src_buffers[chunk.pieces[0].transfer.src_buffer].device)
    for p, o in zip(chunk.pieces, chunk.offsets):
        off, strides = p.src_view()
        src = _view(src_buffers, p.transfer.src_buffer, off, p.box.shape, strides)
        buf[o:o + p.nbytes].view(torch_dtype(p.transfer.dtype)).view(p.box.shape).copy_(src)
    return buf, buf


def _recv_target(chunk: Chunk, dst_buffers, staging: _Staging) -> tuple[torch.Tensor, torch.Tensor | None]:
    if not chunk.stage_recv:
        p = chunk.pieces[0]
        off, strides = p.dst_view()
        return _view(dst_buffers, p.transfer.dst_buffer, off, p.box.shape, strides).reshape(-1).view(torch.uint8), None
    buf = staging.alloc(chunk.nbytes, dst_buffers[chunk.pieces[0].transfer.dst_buffer].device)
    return buf, buf


def _unpack(chunk: Chunk, buf: torch.Tensor, dst_buffers) -> None:
    for p, o in zip(chunk.pieces, chunk.offsets):
        off, strides = p.dst_view()
        _view(dst_buffers, p.transfer.dst_buffer, off, p.box.shape, strides).copy_(
            buf[o:o + p.nbytes].view(torch_dtype(p.transfer.dtype)).view(p.box.shape))


def _run(schedule: Schedule, src_buffers, dst_buffers, comm: Comm, timeout: timedelta) -> MoveReport:
    plan = schedule.plan
    t0 = time.perf_counter()
    for t in plan.local:
        _view(dst_buffers, t.dst_buffer, t.dst_offset, t.box.shape, t.dst_strides).copy_(
            _view(src_buffers, t.src_buffer, t.src_offset, t.box.shape, t.src_strides))
    staging = _Staging()
    messages = 0
    for ex in schedule.exchanges:
        peer = ex.peer
        for send, recv in ex.steps:
            works, rbuf, sbuf_owned, rbuf_owned = [], None, None, None
            if recv is not None:
                rbuf, rbuf_owned = _recv_target(recv, dst_buffers, staging)
                works.append(comm.irecv(rbuf, peer))
            if send is not None:
                sbuf, sbuf_owned = _pack(send, src_buffers, staging)
                works.append(comm.isend(sbuf, peer))
            for w in works:
                w.wait(timeout)
            messages += len(works)
            if recv is not None and rbuf_owned is not None:
                _unpack(recv, rbuf, dst_buffers)
            staging.free(sbuf_owned)
            staging.free(rbuf_owned)
    if staging.peak > schedule.budget_bytes:  # a broken promise is a bug, never a silent one
        raise AssertionError(f"staging peaked at {staging.peak} B over the {schedule.budget_bytes} B budget")
    return MoveReport(plan.rank, plan.transition, plan.bytes_sent, plan.bytes_received, plan.bytes_local,
                      plan.min_bytes_received, messages, staging.peak, schedule.peak_staging_bytes,
                      schedule.budget_bytes, time.perf_counter() - t0)
