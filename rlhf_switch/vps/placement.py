"""Put a layout on some ranks of a larger world.

A trainer and a generation engine are different processes even when they share devices: 4 trainer
ranks and 2 vLLM workers form one 6-rank group for the move. The trainer's layout then lives on
ranks 0–3 and the engine's on ranks 4–5; every other rank holds nothing of it::

    move(place(train, range(0, 4), 6), place(vllm_layout(spec, tp=2), range(4, 6), 6), ...)
"""
from __future__ import annotations

from typing import Sequence

from .layout import Holders, Layout, LayoutError, RankClasses


def place(layout: Layout, ranks: Sequence[int], world_size: int) -> Layout:
    ranks = list(ranks)
    if len(ranks) != layout.world_size:
        raise LayoutError(f"{layout.name} has {layout.world_size} ranks; {len(ranks)} were given to place it on")
    if len(set(ranks)) != len(ranks) or not all(0 <= r < world_size for r in ranks):
        raise LayoutError(f"ranks {ranks} must be distinct and inside a world of {world_size}")
    frags = [()] * world_size
    bufs = [{}] * world_size
    for i, r in enumerate(ranks):
        frags[r] = layout.fragments(i)
        bufs[r] = layout.buffers(i)
    name = f"{layout.name}@{ranks[0]}-{ranks[-1]}" if ranks == list(range(ranks[0], ranks[-1] + 1)) \
        else f"{layout.name}@{ranks}"
    return Layout(layout.spec, frags, bufs, name, f"place({layout.digest},{ranks},{world_size})")


def place_lazy(layout: Layout, ranks: range, world_size: int) -> Layout:
    """``place`` for a lazy layout with a ``holders`` family (``build_layout``, ``vllm_layout``) on
    a contiguous block of ranks: the same layout (same digest, same fragments per rank), still
    lazy — no rank's fragments are built until it is asked for, so one rank's plan of a
    1024-rank move of a 235B model stays as cheap as unplaced (``tune`` plans a sample of ranks).
    Anything else: ``place``."""
    holders = layout._holders_fn
    if holders is None or not isinstance(ranks, range) or ranks.step != 1 or len(ranks) != layout.world_size \
            or ranks.start < 0 or ranks.stop > world_size:
        return place(layout, ranks, world_size)
    off, inner = ranks.start, layout._rank_classes()
    n_inner = len(inner.members)
    empty = [r for r in range(world_size) if r not in ranks]
    # class ids count from 0 in order of first rank: the empty ranks' class comes first when rank 0 is empty
    first = 1 if off > 0 else 0
    empty_id = 0 if off > 0 else n_inner
    of = [empty_id if r not in ranks else inner.of[r - off] + first for r in range(world_size)]
    members = [None] * (n_inner + (1 if empty else 0))
    for c, m in enumerate(inner.members):
        members[c + first] = _shift(m, off)
    if empty:
        members[empty_id] = tuple(empty)

    def build(c: int):
        return ((), {}) if empty and c == empty_id else inner.get(c - first)

    classes = RankClasses(of, members, build)
    name = f"{layout.name}@{ranks[0]}-{ranks[-1]}"
    return Layout.lazy(layout.spec, classes, name, f"place({layout.digest},{list(ranks)},{world_size})",
                       layout.fields(), _ShiftedHolders(holders, off), layout._partition)


def _shift(ranks, off: int):
    return range(ranks.start + off, ranks.stop + off, ranks.step) if isinstance(ranks, range) \
        else tuple(r + off for r in ranks)


class _ShiftedHolders:
    """A layout family's ``holders`` with every rank moved by ``off`` (geometry and relocation do
    not depend on where the ranks sit)."""

    def __init__(self, holders, off: int):
        self.holders, self.off = holders, off
        if hasattr(holders, "geometry"):
            self.geometry = holders.geometry
        if hasattr(holders, "relocate"):
            self.relocate = holders.relocate

    def __call__(self, key, box):
        return [(b, Holders(h.fragment, _shift(h.ranks, self.off), h.dtype)) for b, h in self.holders(key, box)]
