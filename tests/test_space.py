"""Boxes and flat ranges: the arithmetic every layout rests on."""
from __future__ import annotations

import pytest
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


def test_keys_and_boxes_by_hand():
    from rlhf_switch.vps import StateKey
    from rlhf_switch.vps.space import row_major_strides

    assert str(StateKey("w")) == "w" and str(StateKey("w", "exp_avg")) == "w[exp_avg]"
    assert StateKey("w").field == "param"
    b = Box((1, 0), (3, 4))
    assert Box.full((2, 3)) == Box((0, 0), (2, 3)) and Box.full(()) == Box((), ())
    assert (b.shape, b.numel, b.empty, str(b)) == ((2, 4), 8, False, "[1:3,0:4]")
    assert (Box.full(()).numel, str(Box.full(()))) == (1, "[]")
    assert Box((1, 2), (1, 5)).empty and Box((1, 2), (0, 5)).empty and not Box((0,), (1,)).empty
    assert b.slices == (slice(1, 3), slice(0, 4))
    assert b.intersect(Box((2, 3), (5, 9))) == Box((2, 3), (3, 4))
    assert b.intersect(Box((3, 0), (4, 4))) is None and b.intersect(Box((0, 4), (9, 5))) is None  # touching
    assert b.intersect(Box((0, 0), (9, 9))) == b
    assert b.contains(Box((1, 1), (3, 4))) and b.contains(b)
    assert not b.contains(Box((0, 1), (2, 2))) and not b.contains(Box((1, 1), (3, 5)))
    assert b.shift((2, -1)) == Box((3, -1), (5, 3))
    assert row_major_strides((2, 3, 4)) == (12, 4, 1) and row_major_strides((5,)) == (1,)
    assert row_major_strides(()) == ()


def test_flat_ranges_edges_and_refusals():
    assert flat_range_to_boxes((), 0, 1) == [Box((), ())]
    assert flat_range_to_boxes((), 0, 0) == [] and flat_range_to_boxes((), 1, 1) == []
    assert flat_range_to_boxes((2, 3), 4, 4) == []
    # origin shifts the boxes (a part of a tensor placed at its global position)
    assert flat_range_to_boxes((2, 3), 1, 5, origin=(4, 6)) == [Box((4, 7), (5, 9)), Box((5, 6), (6, 8))]
    assert flat_range_to_boxes((2, 3), 1, 5, origin=(0, 0)) == flat_range_to_boxes((2, 3), 1, 5)
    for start, stop in ((2, 13), (-1, 3), (5, 4)):
        with pytest.raises(ValueError, match=rf"^flat range \[{start}, {stop}\) is outside a tensor of 12 elements$"):
            flat_range_to_boxes((3, 4), start, stop)
    assert flat_range_to_boxes((3, 4), 0, 12) == [Box((0, 0), (3, 4))]
    assert flat_range_to_boxes((3, 4), 4, 12) == [Box((1, 0), (3, 4))]
    assert flat_range_to_boxes((3, 4), 0, 10) == [Box((0, 0), (2, 4)), Box((2, 0), (3, 2))]
    assert flat_range_to_boxes((2, 2, 3), 5, 7) == [Box((0, 1, 2), (1, 2, 3)), Box((1, 0, 0), (2, 1, 1))]


# --- layouts as values -----------------------------------------------------------------------------

def _w_spec():
    from rlhf_switch.vps import synthetic_spec
    return synthetic_spec([("w", (4, 3), "float32", "replicate"), ("v", (2,), "bfloat16", "replicate")])


def _rows_layout(name="rows", offset=0):
    """Rank 0: rows 0:2 of w and all of v; rank 1: rows 2:4 of w (at ``offset``) and all of v."""
    from rlhf_switch.vps import BufferSpec, Fragment, Layout, StateKey

    w, v = StateKey("w"), StateKey("v")
    return Layout(_w_spec(), [[Fragment(w, Box((0, 0), (2, 3)), "param/w", 0, (3, 1)),
                               Fragment(v, Box((0,), (2,)), "param/v", 0, (1,))],
                              [Fragment(w, Box((2, 0), (4, 3)), "param/w", offset, (3, 1)),
                               Fragment(v, Box((0,), (2,)), "param/v", 0, (1,))]],
                  [{"param/w": BufferSpec(6, "float32"), "param/v": BufferSpec(2, "bfloat16")},
                   {"param/w": BufferSpec(6 + offset, "float32"), "param/v": BufferSpec(2, "bfloat16")}], name)


def test_a_layout_by_hand():
    import pickle

    from rlhf_switch.vps import Fragment, LayoutError, Region, StateKey

    lay = _rows_layout().validate()
    assert (repr(lay), str(lay), lay.world_size) == ("Layout(rows, world=2, model=synthetic)", "rows", 2)
    assert lay.keys(1) == {StateKey("w"), StateKey("v")} and lay.fields() == ("param",)
    assert (lay.numel(0), lay.numel(1)) == (8, 8)
    assert lay.groups(StateKey("v")) == {Box((0,), (2,)): [(0, lay.fragments(0)[1]), (1, lay.fragments(1)[1])]}
    assert lay.regions(StateKey("w")) == (Region(Box((0, 0), (2, 3)), ((0, lay.fragments(0)[0]),)),
                                         Region(Box((2, 0), (4, 3)), ((1, lay.fragments(1)[0]),)))
    assert sorted(lay.all_keys()) == [StateKey("v"), StateKey("w")]
    f = Fragment(StateKey("w"), Box((1, 0), (4, 3)), "param/w", 5, (3, 1))
    assert f.view(Box((2, 1), (3, 3))) == (5 + 3 + 1, (3, 1)) and f.span == 5 + 2 * 3 + 2 + 1
    # a value: equal by content whatever its name, different when any offset differs; pickles as itself
    assert lay == _rows_layout("other") and hash(lay) == hash(_rows_layout("other")) and lay != "rows"
    assert lay.digest != _rows_layout(offset=1).digest
    back = pickle.loads(pickle.dumps(lay))
    assert back == lay and back.name == "rows" and back.fragments(1) == lay.fragments(1)
    from rlhf_switch.vps import Layout
    with pytest.raises(LayoutError, match=r"^bad: 2 fragment lists but 1 buffer maps$"):
        Layout(_w_spec(), [[], []], [{}], name="bad")


def test_union_and_select():
    from rlhf_switch.vps import BufferSpec, LayoutError, Layout, select, union
    from rlhf_switch.vps import replicated

    a, spec = _rows_layout(), _w_spec()
    state = Layout(spec, [[f._replace(key=f.key._replace(field="exp_avg"), buffer="exp_avg/" + f.buffer[6:])
                           for f in a.fragments(r)] for r in range(2)],
                   [{"exp_avg/" + n[6:]: BufferSpec(b.numel, "float32") for n, b in a.buffers(r).items()} for r in range(2)],
                   "state")
    u = union(a, state).validate()
    assert u.name == "rows+state" and u.fields() == ("exp_avg", "param")
    assert u.fragments(1) == a.fragments(1) + state.fragments(1)
    assert dict(u.buffers(0)) == {**a.buffers(0), **state.buffers(0)}
    assert union(a, state, name="z").name == "z"
    assert union(a, a).buffers(0) == a.buffers(0)  # the same buffer declared identically twice is fine
    with pytest.raises(LayoutError, match=r"^cannot merge rows and DP2: different models$"):
        union(a, replicated(synthetic_spec_other(), 2))
    with pytest.raises(LayoutError, match=r"^cannot merge rows \(world 2\) and DP3 \(world 3\)$"):
        union(a, replicated(spec, 3))
    clash = Layout(spec, [[], []], [{"param/w": BufferSpec(7, "float32")}, {}], "clash")
    with pytest.raises(LayoutError, match=r"^buffer 'param/w' on rank 0 is declared twice differently$"):
        union(a, clash)
    # recipes: two built layouts merge into a recipe, a hand layout has none (its digest hashes fragments)
    r1, r2 = replicated(spec, 2), replicated(spec, 2, fields=("master",))
    assert union(r1, r2)._recipe == f"union({r1._recipe};{r2._recipe})" and union(a, state)._recipe is None
    # select: only w, its buffer with its whole declaration, a model of its own
    only_w = select(a, ["w"], "w-only").validate()
    assert only_w.name == "rows[w-only]" and only_w.spec.digest == spec.subset(["w"], "w-only").digest
    assert only_w.fragments(1) == a.fragments(1)[:1] and dict(only_w.buffers(1)) == {"param/w": a.buffers(1)["param/w"]}
    assert select(a, ["v"], "v", name="vv").name == "vv"
    assert select(a, ["w"], "x").digest != select(a, ["v"], "x").digest


def synthetic_spec_other():
    from rlhf_switch.vps import synthetic_spec
    return synthetic_spec([("w", (4, 3), "float32", "replicate")], name="other")


def test_validate_lists_every_problem_and_counts_past_twenty():
    from rlhf_switch.vps import BufferSpec, Fragment, Layout, LayoutError, StateKey

    spec = _w_spec()
    bad = [Fragment(StateKey("w"), Box((0, 0), (1, 3)), "param/w", -1, (3, 1)),  # negative offset
           Fragment(StateKey("w"), Box((0,), (1,)), "param/w", 0, (1,)),  # wrong number of dims
           Fragment(StateKey("w"), Box((1, 1), (1, 3)), "param/w", 0, (3, 1))]  # empty
    lay = Layout(spec, [bad + [Fragment(StateKey(f"x{i}"), Box((0,), (1,)), "param/w", 0, (1,)) for i in range(21)]],
                 [{"param/w": BufferSpec(12, "float32")}], name="many")
    with pytest.raises(LayoutError) as e:
        lay.validate()
    msg = str(e.value)
    assert msg.startswith("layout many is invalid: rank 0: w [0:1,0:3] spans [-1, 2) of buffer 'param/w' "
                          "which has 12 elements; rank 0: box [0:1] of w is outside shape (4, 3); "
                          "rank 0: box [1:1,1:3] of w is outside shape (4, 3); rank 0: unknown tensor 'x0'")
    assert msg.endswith(" (and 4 more)") and msg.count("; ") == 19
    # not covering: each uncovered key named with its count
    from rlhf_switch.vps import Layout as L
    half = L(spec, [[Fragment(StateKey("w"), Box((0, 0), (2, 3)), "param/w", 0, (3, 1))]],
             [{"param/w": BufferSpec(6, "float32")}], name="half")
    with pytest.raises(LayoutError, match=r"^layout half is invalid: w: ranks hold 6 of its 12 elements \(the layout "
                                          r"does not cover the tensor\); v: ranks hold 0 of its 2 elements"):
        half.validate()
    half.validate(require_cover=False)


def test_rank_classes_and_holder_order():
    from rlhf_switch.vps.layout import Holders, RankClasses, expand

    built = []
    cl = RankClasses.of_ranks(["a", "b", "a", "b", "a", "b", "c"], lambda k: built.append(k) or ((k,), {}))
    assert cl.of == [0, 1, 0, 1, 0, 1, 2] and cl.members == [range(0, 5, 2), range(1, 6, 2), (6,)]
    assert isinstance(cl.members[0], range) and built == []
    assert cl.get(1) == (("b",), {}) and cl.get(1) == (("b",), {}) and built == ["b"]  # built once, on use
    assert RankClasses.of_ranks([0, 0, 1], None).members == [(0, 1), (2,)]
    assert RankClasses.of_ranks([0, 1, 0, 0], None).members == [(0, 2, 3), (1,)]  # uneven steps: a tuple
    g1, g2 = Holders("f1", (0, 3), None), Holders("f2", range(1, 5, 2), None)
    assert expand([g1, g2]) == [(0, "f1"), (1, "f2"), (3, "f1"), (3, "f2")]
    assert expand([g2]) == [(1, "f2"), (3, "f2")]


def test_gc_is_paused_only_inside_and_restored():
    import gc

    from rlhf_switch.vps.layout import without_gc

    seen = []

    @without_gc
    def probe(fail=False):
        seen.append(gc.isenabled())
        if fail:
            raise RuntimeError("x")
        return 7

    assert gc.isenabled()
    assert probe() == 7 and seen == [False] and gc.isenabled()
    with pytest.raises(RuntimeError):
        probe(fail=True)
    assert gc.isenabled()
    gc.disable()
    try:
        probe()
        assert not gc.isenabled()  # paused by the caller: left paused
    finally:
        gc.enable()
    assert probe.__name__ == "probe"
