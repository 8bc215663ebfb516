"""A lost trainer without a checkpoint (issue 15, ``elastic.redundancy: host``).

Pure part: the buddy layout (``vps/layouts/buddy.py``) — every rank's own share and its buddy's,
packed in host buffers; any single lost rank's share survives, both an owner and its holder lost
is named before anything moves.
"""
from __future__ import annotations

import pytest


def _survivors(layout, lost):
    from rlhf_switch.vps import Layout

    keep = [r for r in range(layout.world_size) if r not in lost]
    return Layout(layout.spec, [layout.fragments(r) for r in keep], [layout.buffers(r) for r in keep],
                  name=f"{layout.name} minus {sorted(lost)}")


def test_buddy_layout_keeps_every_single_lost_ranks_share():
    """For every named 4-rank layout with Adam state: the buddy layout is valid; rank h holds its
    own boxes and those of h-1 it does not hold already; the refresh into it sends each rank only
    its buddy's share; with any one rank lost the survivors' copies still cover the whole model,
    with two neighbours lost they do not, and ``lost_owners`` says which share is gone."""
    from catalogue import CONFIGS, TINY_LLAMA
    from rlhf_switch.vps import ADAM_FIELDS, PARAM, build_layout, llama_spec, plan_rank
    from rlhf_switch.vps.layout import LayoutError
    from rlhf_switch.vps.layouts.buddy import buddy_layout, lost_owners

    spec = llama_spec(TINY_LLAMA, name="tiny-llama")
    for name, config in CONFIGS.items():
        src = build_layout(spec, config, (PARAM, *ADAM_FIELDS))
        n = src.world_size
        buddy = buddy_layout(src).validate()
        for h in range(n):
            own = {(f.key, f.box) for f in src.fragments(h)}
            other = {(f.key, f.box) for f in src.fragments((h - 1) % n)}
            assert {(f.key, f.box) for f in buddy.fragments(h)} == own | other, (name, h)
            plan = plan_rank(src, buddy, h)
            assert plan.bytes_local == sum(b.numel * 4 for _, b in own), (name, h)
            assert plan.bytes_received == sum(b.numel * 4 for k, b in other - own
                                              if not any(k == k2 and b2.contains(b) for k2, b2 in own)), (name, h)
        for lost in range(n):
            _survivors(buddy, {lost}).validate(require_cover=True)
            assert lost_owners(n, {lost}) == []
        if name in ("zero3", "fsdp", "tp4"):  # every share on one rank only: neighbours 1, 2 lost, 1's is gone
            with pytest.raises(LayoutError, match="does not cover"):
                _survivors(buddy, {1, 2}).validate(require_cover=True)
            assert lost_owners(n, {1, 2}) == [1]


def test_buddy_shift_puts_copies_on_another_node():
    from rlhf_switch.vps.layouts.buddy import buddy_shift, holder_of, lost_owners

    assert buddy_shift(["a"] * 4) == 1
    assert buddy_shift(["a", "a", "b", "b"]) == 2
    assert buddy_shift(["a", "b", "a", "b"]) == 1
    assert [holder_of(r, 4, 2) for r in range(4)] == [2, 3, 0, 1]
    assert lost_owners(4, {0, 1}, shift=2) == [] and lost_owners(4, {0, 2}, shift=2) == [0, 2]
