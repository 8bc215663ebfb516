"""Boxes and flat ranges: the arithmetic every layout rests on."""
from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhf_switch.vps import Box, flat_range_to_boxes
from rlhf_switch.vps.layout import disjoint_regions, subtract


def test_worked_example():
    assert flat_range_to_boxes((3, 4), 2, 9) == [Box((0, 2), (1, 4)), Box((1, 0), (2, 4)), Box((2, 0), (3, 1))]


@settings(max_examples=300, deadline=None)
@given(shape=st.lists(st.integers(1, 6), min_size=1, max_size=4), data=st.data())
def test_flat_range_is_tiled_exactly_in_order(shape, data):
    total = int(torch.tensor(shape).prod())
    start = data.draw(st.integers(0, total))
    stop = data.draw(st.integers(start, total))
    boxes = flat_range_to_boxes(shape, start, stop)
    assert len(boxes) <= 2 * len(shape) - 1
    index = torch.arange(total).view(shape)
    covered = []
    for b in boxes:
        covered += index[tuple(slice(l, h) for l, h in zip(b.lo, b.hi))].reshape(-1).tolist()
    assert covered == list(range(start, stop))


boxes2d = st.builds(lambda a, b, c, d: Box((min(a, b), min(c, d)), (max(a, b) + 1, max(c, d) + 1)),
                    st.integers(0, 6), st.integers(0, 6), st.integers(0, 6), st.integers(0, 6))


@settings(max_examples=200, deadline=None)
@given(a=boxes2d, b=boxes2d)
def test_subtract_and_intersect_partition_the_box(a, b):
    grid = torch.zeros(8, 8, dtype=torch.int32)
    inter = a.intersect(b)
    for piece in subtract(a, b) + ([inter] if inter else []):
        grid[piece.lo[0]:piece.hi[0], piece.lo[1]:piece.hi[1]] += 1
    expect = torch.zeros(8, 8, dtype=torch.int32)
    expect[a.lo[0]:a.hi[0], a.lo[1]:a.hi[1]] = 1
    assert torch.equal(grid, expect)


@settings(max_examples=200, deadline=None)
@given(boxes=st.lists(boxes2d, min_size=1, max_size=5))
def test_disjoint_regions_keep_every_holder(boxes):
    groups = {}
    for i, b in enumerate(boxes):
        groups.setdefault(b, []).append((i, None))
    regions = disjoint_regions(groups)
    count = torch.zeros(8, 8, dtype=torch.int32)
    holders = [[set() for _ in range(8)] for _ in range(8)]
    for reg in regions:
        count[reg.box.lo[0]:reg.box.hi[0], reg.box.lo[1]:reg.box.hi[1]] += 1
        for x in range(reg.box.lo[0], reg.box.hi[0]):
            for y in range(reg.box.lo[1], reg.box.hi[1]):
                holders[x][y] = {h for h, _ in reg.holders}
    for x in range(8):
        for y in range(8):
            want = {i for i, b in enumerate(boxes) if b.lo[0] <= x < b.hi[0] and b.lo[1] <= y < b.hi[1]}
            assert count[x, y] == (1 if want else 0)
            if want:
                assert holders[x][y] == want
