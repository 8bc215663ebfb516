"""Turn one rank's plan into a schedule: chunks under a staging budget, in deadlock-free rounds.

*Chunks.* Transfers to one peer are packed, in the plan's canonical order, into chunks of at
most ``budget // 2`` bytes (a step stages at most one outgoing and one incoming chunk). A
transfer larger than that is cut into sub-boxes in row-major order. Both ends cut identically
because both start from the same transfer list.

*Rounds.* Pairs of ranks talk in the rounds of a round-robin tournament (the circle method):
in round ``k`` every rank has at most one partner, so no rank can wait on a peer that waits on
someone else. The round of a pair is a formula of the two ranks, so each rank orders its own
peers without knowing anyone else's plan and without any extra collective::

    n = world rounded up to even, m = n - 1
    round(a, b) = a            if b == m   (the fixed player)
                = (a + b) / 2  mod m        otherwise

*Staging.* A piece that is contiguous on its side of the wire and travels alone is sent from, or
received into, the buffer itself; everything else goes through a staging tensor. The schedule
knows the exact peak before anything runs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

from ..vps.layout import LayoutError
from ..vps.planner import RankPlan, Transfer
from ..vps.space import Box, row_major_strides
from ..vps.spec import itemsize


class Piece(NamedTuple):
    transfer: Transfer
    box: Box  # inside transfer.box

    @property
    def nbytes(self) -> int:
        return self.box.numel * itemsize(self.transfer.dtype)

    def src_view(self) -> tuple[int, tuple[int, ...]]:
        t = self.transfer
        return t.src_offset + _delta(self.box, t.box, t.src_strides), t.src_strides

    def dst_view(self) -> tuple[int, tuple[int, ...]]:
        t = self.transfer
        return t.dst_offset + _delta(self.box, t.box, t.dst_strides), t.dst_strides


ALIGN = 8  # piece offsets inside a staging tensor, so any dtype can view its slice


class Chunk(NamedTuple):
    pieces: tuple[Piece, ...]
    offsets: tuple[int, ...]  # byte offset of each piece in the chunk's staging tensor
    nbytes: int  # staging size, alignment included
    stage_send: bool  # the sender packs into a staging tensor
    stage_recv: bool  # the receiver unpacks from a staging tensor


class Exchange(NamedTuple):
    round: int
    peer: int
    steps: tuple[tuple[Chunk | None, Chunk | None], ...]  # (send, recv) per step


@dataclass(frozen=True)
class Schedule:
    plan: RankPlan
    budget_bytes: int
    exchanges: tuple[Exchange, ...]

    @property
    def peak_staging_bytes(self) -> int:
        peak = 0
        for ex in self.exchanges:
            for send, recv in ex.steps:
                peak = max(peak, (send.nbytes if send and send.stage_send else 0)
                           + (recv.nbytes if recv and recv.stage_recv else 0))
        return peak

    @property
    def messages(self) -> int:
        return sum((s is not None) + (r is not None) for ex in self.exchanges for s, r in ex.steps)

    def __str__(self) -> str:
        return (f"{self.plan}; {len(self.exchanges)} exchanges, {self.messages} messages, "
                f"peak staging {self.peak_staging_bytes} B (budget {self.budget_bytes} B)")


def pair_round(a: int, b: int, world_size: int) -> int:
    n = world_size + (world_size % 2)
    m = n - 1
    if a == m:
        return b
    if b == m:
        return a
    return (a + b) * ((m + 1) // 2) % m


def contiguous(shape: Sequence[int], strides: Sequence[int]) -> bool:
    return all(st == rs for n, st, rs in zip(shape, strides, row_major_strides(shape)) if n > 1)


def build_schedule(plan: RankPlan, budget_bytes: int, src_dtypes: dict[str, str] | None = None) -> Schedule:
    """``src_dtypes``: this rank's source buffer dtypes (a sender casting to the wire dtype must
    stage); without it, sends are assumed not to need a cast."""
    cap = budget_bytes // 2
    by_peer_send: dict[int, list[Transfer]] = {}
    by_peer_recv: dict[int, list[Transfer]] = {}
    for t in plan.sends:
        by_peer_send.setdefault(t.dst, []).append(t)
    for t in plan.recvs:
        by_peer_recv.setdefault(t.src, []).append(t)
    biggest_item = max((itemsize(t.dtype) for t in plan.sends + plan.recvs), default=1)
    if cap < biggest_item:
        raise LayoutError(f"a staging budget of {budget_bytes} B cannot hold one element in each "
                          f"direction (needs >= {2 * biggest_item} B)")
    exchanges = []
    for peer in sorted(set(by_peer_send) | set(by_peer_recv)):
        sends = _chunks(by_peer_send.get(peer, []), cap, src_dtypes)
        recvs = _chunks(by_peer_recv.get(peer, []), cap, None)
        steps = tuple((sends[i] if i < len(sends) else None, recvs[i] if i < len(recvs) else None)
                      for i in range(max(len(sends), len(recvs))))
        exchanges.append(Exchange(pair_round(plan.rank, peer, plan.world_size), peer, steps))
    exchanges.sort(key=lambda e: (e.round, e.peer))
    return Schedule(plan, budget_bytes, tuple(exchanges))


def _chunks(transfers: list[Transfer], cap: int, src_dtypes: dict[str, str] | None) -> list[Chunk]:
    chunks: list[Chunk] = []
    cur: list[Piece] = []
    size = 0

    def close():
        nonlocal cur, size
        if cur:
            chunks.append(_chunk(tuple(cur), size, src_dtypes))
        cur, size = [], 0

    for t in transfers:
        per = itemsize(t.dtype)
        for box in split_box(t.box, cap // per):
            p = Piece(t, box)
            if _aligned(size) + p.nbytes > cap:
                close()
            cur.append(p)
            size = _aligned(size) + p.nbytes
    close()
    return chunks


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _chunk(pieces: tuple[Piece, ...], nbytes: int, src_dtypes: dict[str, str] | None) -> Chunk:
    offsets, off = [], 0
    for p in pieces:
        off = _aligned(off)
        offsets.append(off)
        off += p.nbytes
    if len(pieces) > 1:
        return Chunk(pieces, tuple(offsets), nbytes, True, True)
    p = pieces[0]
    t = p.transfer
    cast = src_dtypes is not None and src_dtypes.get(t.src_buffer, t.dtype) != t.dtype
    return Chunk(pieces, (0,), nbytes, cast or not contiguous(p.box.shape, t.src_strides),
                 not contiguous(p.box.shape, t.dst_strides))


def split_box(box: Box, max_numel: int) -> list[Box]:
    """Cut ``box`` into row-major sub-boxes of at most ``max_numel`` elements each."""
    if max_numel < 1:
        raise LayoutError("staging budget smaller than one element")
    if box.numel <= max_numel:
        return [box]
    inner = box.numel // box.shape[0]
    lo, hi = box.lo, box.hi
    if inner <= max_numel:
        rows = max_numel // inner
        return [Box((r,) + lo[1:], (min(r + rows, hi[0]),) + hi[1:]) for r in range(lo[0], hi[0], rows)]
    out = []
    for r in range(lo[0], hi[0]):
        slab = Box((0,) + lo[1:], (1,) + hi[1:])
        out += [Box((r,) + b.lo[1:], (r + 1,) + b.hi[1:]) for b in _split_inner(slab, max_numel)]
    return out


def _split_inner(slab: Box, max_numel: int) -> list[Box]:
    inner = Box(slab.lo[1:], slab.hi[1:])
    return [Box((0,) + b.lo, (1,) + b.hi) for b in split_box(inner, max_numel)]


def _delta(sub: Box, box: Box, strides: Sequence[int]) -> int:
    return sum((a - b) * s for a, b, s in zip(sub.lo, box.lo, strides))
