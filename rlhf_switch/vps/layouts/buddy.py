"""Redundancy as a layout: every rank keeps, in host buffers of its own, what it holds of another
layout AND what its *buddy* holds of it — so the state of any single lost rank survives on the
rank that kept its copy.

The holder of rank ``r``'s copy is ``(r + shift) % n``: a cyclic shift, so every rank holds
exactly one buddy's copy (its own share and one more in host memory). ``buddy_shift(nodes)``
picks the smallest shift that puts every copy on another node than its owner (ranks ``0..n-1``
listed with their node names), else 1 (one node: the next rank).

``buddy_layout(layout, shift)``: rank ``h``'s own fragments packed into host buffers ``host/B``
(as ``host_layout`` packs them) and those of ``b = (h - shift) % n`` into ``buddy/B``. A box
the holder already has itself (a replicated weight: ZeRO-1/2's bit16 copy, a replicated norm
under TP) is not copied twice. ``lost_owners(n, lost, shift)``: the ranks whose share is gone
when ranks ``lost`` are (the owner and the holder of its copy both lost) — pure data, decided
before any rank moves a byte.
"""
from __future__ import annotations

from typing import Iterable, Sequence

from ..layout import BufferSpec, Fragment, Layout, LayoutError
from ..space import row_major_strides
from .host import HOST_PREFIX

BUDDY_PREFIX = "buddy/"


def buddy_shift(nodes: Sequence[str]) -> int:
    """The smallest cyclic shift that puts every rank's copy on another node than the rank's
    own (``nodes[r]``: rank ``r``'s node), else 1."""
    n = len(nodes)
    for shift in range(1, n):
        if all(nodes[(r + shift) % n] != nodes[r] for r in range(n)):
            return shift
    return 1


def holder_of(rank: int, world: int, shift: int = 1) -> int:
    """The rank that keeps ``rank``'s copy."""
    return (rank + shift) % world


def lost_owners(world: int, lost: Iterable[int], shift: int = 1) -> list[int]:
    """The ranks whose share no surviving rank holds when the ranks ``lost`` are gone."""
    lost = set(lost)
    if world == 1:
        return sorted(lost)
    return sorted(r for r in lost if holder_of(r, world, shift) in lost)


def buddy_layout(layout: Layout, shift: int = 1, name: str | None = None) -> Layout:
    """Rank ``h``: its own fragments of ``layout`` and those of ``(h - shift) % n``, each packed
    densely into host buffers of its own (module doc)."""
    n = layout.world_size
    if n > 1 and not 1 <= shift < n:
        raise LayoutError(f"buddy shift {shift} in a world of {n}: expected 1..{n - 1}")
    fragments, buffers = [], []
    for h in range(n):
        mine, sizes, dtypes = [], {}, {}
        own = layout.fragments(h)
        held = {}
        for f in own:
            held.setdefault(f.key, []).append(f.box)

        def pack(f: Fragment, prefix: str, src_rank: int) -> None:
            buffer = prefix + f.buffer
            offset = sizes.get(buffer, 0)
            mine.append(Fragment(f.key, f.box, buffer, offset, row_major_strides(f.box.shape)))
            sizes[buffer] = offset + f.box.numel
            dtypes[buffer] = layout.buffers(src_rank)[f.buffer].dtype

        for f in own:
            pack(f, HOST_PREFIX, h)
        b = (h - shift) % n
        if b != h:
            for f in layout.fragments(b):
                boxes = held.get(f.key, ())
                if any(box.contains(f.box) for box in boxes):
                    continue  # replicated: the holder's own copy is the buddy's too
                if any(box.intersect(f.box) is not None for box in boxes):
                    raise LayoutError(f"buddy layout: rank {h} holds part of {f.key}{f.box} of rank {b} "
                                      f"(a partly overlapping box); not supported")
                pack(f, BUDDY_PREFIX, b)
        fragments.append(tuple(mine))
        buffers.append({name_: BufferSpec(size, dtypes[name_]) for name_, size in sizes.items()})
    return Layout(layout.spec, fragments, buffers, name=name or f"buddy({layout.name}, shift {shift})")
