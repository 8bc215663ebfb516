"""Schedules: tournament rounds are matchings, chunks respect the budget, boxes split exactly."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhf_switch.routing import build_schedule, pair_round, prepare
from rlhf_switch.routing.schedule import split_box
from rlhf_switch.vps import Box, LayoutError, plan_rank
from rlhf_switch.vps.materialize import allocate


@pytest.mark.parametrize("world", range(2, 18))
def test_rounds_are_matchings_covering_every_pair_once(world):
    rounds: dict[int, list[tuple[int, int]]] = {}
    for a in range(world):
        for b in range(a + 1, world):
            k = pair_round(a, b, world)
            assert k == pair_round(b, a, world)
            rounds.setdefault(k, []).append((a, b))
    assert len(rounds) == world - 1 + (world % 2)
    for pairs in rounds.values():
        ranks = [r for p in pairs for r in p]
        assert len(ranks) == len(set(ranks)), "a rank has two partners in one round"


@settings(max_examples=200, deadline=None)
@given(shape=st.lists(st.integers(1, 7), min_size=1, max_size=4), cap=st.integers(1, 60), data=st.data())
def test_split_box_tiles_the_box_in_row_major_order(shape, cap, data):
    lo = tuple(data.draw(st.integers(0, 3)) for _ in shape)
    box = Box(lo, tuple(l + s for l, s in zip(lo, shape)))
    parts = split_box(box, cap)
    assert all(p.numel <= cap and box.contains(p) for p in parts)
    assert sum(p.numel for p in parts) == box.numel
    for a, b in zip(parts, parts[1:]):
        assert a.lo < b.lo  # row-major order: both ends cut identically and in the same order


def test_chunks_and_peak_respect_the_budget(layouts4):
    src, dst = layouts4["zero3"], layouts4["tp2xpp2"]
    for budget in (16, 100, 1000, 1 << 20):
        for r in range(4):
            sched = prepare(src, dst, r, allocate(src, r), allocate(dst, r), budget)
            assert sched.peak_staging_bytes <= budget
            for ex in sched.exchanges:
                for send, recv in ex.steps:
                    assert (send is None or send.nbytes <= budget // 2) and (recv is None or recv.nbytes <= budget // 2)
            sent = sum(p.nbytes for ex in sched.exchanges for s, _ in ex.steps if s for p in s.pieces)
            assert sent == sched.plan.bytes_sent


def test_both_ends_cut_the_same_chunks(layouts4):
    src, dst = layouts4["fsdp"], layouts4["tp2xpp2"]
    scheds = [build_schedule(plan_rank(src, dst, r), 300) for r in range(4)]
    for a in range(4):
        for ex in scheds[a].exchanges:
            other = next(e for e in scheds[ex.peer].exchanges if e.peer == a)
            assert ex.round == other.round
            mine = [s.pieces for s, _ in ex.steps if s]
            theirs = [r.pieces for _, r in other.steps if r]
            assert mine == theirs


def test_budget_below_one_element_is_refused(layouts4):
    with pytest.raises(LayoutError, match="cannot hold one element"):
        build_schedule(plan_rank(layouts4["zero3"], layouts4["tp4"], 0), 4)
