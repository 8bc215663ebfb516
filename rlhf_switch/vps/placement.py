"""Put a layout on some ranks of a larger world.

A trainer and a generation engine are different processes even when they share devices: 4 trainer
ranks and 2 vLLM workers form one 6-rank group for the move. The trainer's layout then lives on
ranks 0–3 and the engine's on ranks 4–5; every other rank holds nothing of it::

    move(place(train, range(0, 4), 6), place(vllm_layout(spec, tp=2), range(4, 6), 6), ...)
"""
from __future__ import annotations

from typing import Sequence

from .layout import Layout, LayoutError


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
