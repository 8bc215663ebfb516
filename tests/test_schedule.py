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


@pytest.mark.heavy  # left out of `make test-fast`
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


def _replay_staging(sched):
    """Replay the staging program: blocks in flight never overlap, never leave the pool, and
    never hold more than the budget; returns the most steps in flight at once."""
    program, peak = sched.staged
    alive, most = [], 0
    for step in program:
        assert step.retire <= len(alive)
        alive = alive[step.retire:]  # the oldest retire first
        block = (step.offset, step.offset + step.recv_bytes + step.send_bytes)
        assert step.offset % sched.align == 0 and block[1] <= peak <= sched.budget_bytes
        assert all(block[1] <= a or b <= block[0] for a, b in alive), "staging blocks overlap"
        alive.append(block)
        assert sum(b - a for a, b in alive) <= sched.budget_bytes
        most = max(most, len(alive))
    return most


@pytest.mark.parametrize("pair", [("zero3", "tp4"), ("fsdp", "tp2xpp2"), ("zero1-flat", "tp2xdp2"),
                                  pytest.param(("tp2xdp2", "pp2"), marks=pytest.mark.heavy)])
@pytest.mark.parametrize("merge", [0, None])
def test_messages_are_zero_copy_where_contiguous_and_cut_alike_on_both_ends(layouts4, pair, merge, monkeypatch):
    """With ``MERGE_BYTES`` 0 every contiguous piece of the tiny model travels straight from/into
    the buffers; with the default, small pieces are merged into staged messages."""
    from rlhf_switch.routing import schedule
    from rlhf_switch.routing.schedule import contiguous
    if merge is not None:
        monkeypatch.setattr(schedule, "MERGE_BYTES", merge)
    src, dst = layouts4[pair[0]], layouts4[pair[1]]
    for budget in (64, 1000, 1 << 20):
        scheds = [build_schedule(plan_rank(src, dst, r), budget) for r in range(4)]
        direct = 0
        for a in range(4):
            for ex in scheds[a].exchanges:
                other = next(e for e in scheds[ex.peer].exchanges if e.peer == a)
                mine = [s for s, _ in ex.steps if s]
                theirs = [r for _, r in other.steps if r]
                assert [(m.pieces, m.offsets, m.nbytes, m.stage_send, m.stage_recv) for m in mine] == \
                       [(m.pieces, m.offsets, m.nbytes, m.stage_send, m.stage_recv) for m in theirs]
                for m in mine:
                    assert m.nbytes <= budget // 2
                    for side, staged in (("src", m.stage_send), ("dst", m.stage_recv)):
                        if staged:
                            continue
                        direct += 1
                        # one contiguous range of one buffer, the pieces back to back, no padding
                        pos = None
                        for p, o in zip(m.pieces, m.offsets):
                            t = p.transfer
                            off, strides = p.src_view() if side == "src" else p.dst_view()
                            buf = t.src_buffer if side == "src" else t.dst_buffer
                            assert contiguous(p.box.shape, strides)
                            assert pos is None or pos == (buf, off)
                            pos = (buf, off + p.box.numel)
                        assert m.offsets == tuple(sum(p.nbytes for p in m.pieces[:i]) for i in range(len(m.pieces)))
            _replay_staging(scheds[a])
        if budget == 1 << 20 and merge == 0:
            assert direct, f"{pair}: nothing travels zero-copy"


@pytest.mark.parametrize("pair", [("zero3", "tp4"), ("fsdp", "tp2xpp2"), ("zero1-flat", "tp2xdp2"),
                                  pytest.param(("tp2xdp2", "pp2"), marks=pytest.mark.heavy), ("fsdp", "tp4")])
def test_small_messages_travel_together_at_the_end(layouts4, pair, monkeypatch):
    """Messages of at most ``MERGE_BYTES // 2`` that joined no neighbour (norms between a layer's
    big pieces) are merged into one per peer and direction, after the others: never more messages
    than without it, the same pieces, cut alike on both ends."""
    from rlhf_switch.routing import schedule
    monkeypatch.setattr(schedule, "MERGE_BYTES", 1024)  # the tiny model's norms are ~100 B, its weights KBs
    src, dst = layouts4[pair[0]], layouts4[pair[1]]
    small = schedule.MERGE_BYTES // 2

    def chunks(sched):
        return {(ex.peer, side): [step[side] for step in ex.steps if step[side] is not None]
                for ex in sched.exchanges for side in (0, 1)}

    for budget in (64, 1000, 1 << 20):  # tiny budgets: staging's padding may leave them as they were
        grouped = [chunks(build_schedule(plan_rank(src, dst, r), budget)) for r in range(4)]
        with monkeypatch.context() as m:
            m.setattr(schedule, "_small_together", lambda c, cap, dtypes: c)
            apart = [chunks(build_schedule(plan_rank(src, dst, r), budget)) for r in range(4)]
        fewer = 0
        for r in range(4):
            for key, cs in grouped[r].items():
                before = apart[r][key]
                assert len(cs) <= len(before)
                fewer += len(before) - len(cs)
                assert sorted(p for c in cs for p in c.pieces) == sorted(p for c in before for p in c.pieces)
                peer, side = key
                theirs = grouped[peer][(r, 1 - side)]
                assert [c.pieces for c in cs] == [c.pieces for c in theirs]
                if budget == 1 << 20:
                    assert sum(c.nbytes <= small for c in cs) <= 1  # this peer's small ones: one message
                if len(cs) < len(before):
                    tail = [c.nbytes <= small for c in cs]
                    assert tail == sorted(tail), "the merged small messages come after the others"
        assert fewer or pair == ("zero1-flat", "tp2xdp2") or budget < 1 << 20, \
            f"{pair}: no small messages to merge in the tiny model"


@pytest.mark.heavy  # left out of `make test-fast`
def test_staging_overlaps_steps_within_the_budget(layouts4):
    src, dst = layouts4["zero3"], layouts4["tp2xpp2"]
    overlapped = False
    for budget in (16, 64, 100, 1000, 4096):
        for r in range(4):
            sched = build_schedule(plan_rank(src, dst, r), budget)
            most = _replay_staging(sched)
            overlapped |= most > 1
            assert sched.peak_staging_bytes <= budget
    assert overlapped, "no step was ever packed while an older one was in flight"


def test_repeated_prepare_reuses_the_schedule(layouts4):
    src, dst = layouts4["fsdp"], layouts4["tp4"]
    a = prepare(src, dst, 1, allocate(src, 1), allocate(dst, 1), 4096)
    b = prepare(src, dst, 1, allocate(src, 1), allocate(dst, 1), 4096)
    assert a is b
    assert prepare(src, dst, 1, allocate(src, 1), allocate(dst, 1), 8192) is not a  # budget is in the key
    with pytest.raises(ValueError, match="missing"):  # the buffers are still checked every time
        prepare(src, dst, 1, {}, allocate(dst, 1), 4096)


def _elements(shape, offset, strides):
    """The element offsets a strided view covers, in row-major order of its index."""
    import torch
    idx = torch.tensor([offset], dtype=torch.int64)
    for n, s in zip(shape, strides):
        idx = (idx.unsqueeze(-1) + torch.arange(n, dtype=torch.int64) * s).reshape(-1)
    return idx


def _mapping(copies, src_key, dst_key):
    """Per (source side, destination side): the sorted (source element, destination element)
    pairs the copies move, one int64 each."""
    import torch
    out = {}
    for c in copies:
        a = _elements(c.shape, c.src_offset, c.src_strides)
        b = _elements(c.shape, c.dst_offset, c.dst_strides)
        out.setdefault((src_key(c), dst_key(c)), []).append(a * (1 << 31) + b)
    return {k: torch.cat(v).sort().values.tolist() for k, v in out.items()}


@pytest.mark.parametrize("pair", [("fsdp", "tp4"), ("zero3", "tp4"), ("tp4", "fsdp"), ("tp2xdp2", "zero3"),
                                  ("zero1-flat", "tp2xdp2"), ("tp4", "tp2xdp2")])
def test_local_copies_go_view_to_view_and_merge(layouts4, pair):
    """Same-rank pieces — strided ones (row-parallel splits) included — are copied straight from
    the source view to the destination view, never through staging; copies that continue each
    other on both sides are merged; the copies move exactly the elements the plan's local
    transfers do, element for element."""
    from rlhf_switch.routing.schedule import Copy, coalesce, contiguous
    src, dst = layouts4[pair[0]], layouts4[pair[1]]
    strided = merged = 0
    for r in range(4):
        plan = plan_rank(src, dst, r)
        sched = build_schedule(plan, 1000)
        runs = sched.local_runs
        assert all(c.src_buffer is not None and c.dst_buffer is not None for c in runs)  # no staging side
        want = [Copy(t.src_buffer, t.src_offset, t.src_strides, t.dst_buffer, t.dst_offset, t.dst_strides,
                     t.box.shape, t.dtype) for t in plan.local]
        side = (lambda c: c.src_buffer), (lambda c: c.dst_buffer)
        assert _mapping(runs, *side) == _mapping(want, *side)
        strided += sum(not contiguous(t.box.shape, t.src_strides) or not contiguous(t.box.shape, t.dst_strides)
                       for t in plan.local)
        merged += len(plan.local) - len(runs)
        for c in runs:  # fewest dimensions: no size-1 dims, no two dims that are one run on both sides
            assert coalesce(c.shape, (c.src_strides, c.dst_strides)) == (c.shape, [c.src_strides, c.dst_strides])
    assert strided, f"{pair}: no strided same-rank piece"
    if pair in (("zero3", "tp4"), ("tp2xdp2", "zero3")):
        assert merged, f"{pair}: no copies merged"


def test_coalesce_merges_only_dims_that_are_one_run_on_every_side():
    from rlhf_switch.routing.schedule import coalesce
    # dims 0-1 are one run in both views, dims 1-2 only in the first
    assert coalesce((2, 3, 4), [(12, 4, 1), (24, 8, 1)]) == ((6, 4), [(4, 1), (8, 1)])
    assert coalesce((2, 1, 4), [(4, 99, 1), (4, 7, 1)]) == ((8,), [(1,), (1,)])  # size-1 dims dropped
    assert coalesce((1, 1), [(5, 1), (3, 1)]) == ((1,), [(1,), (1,)])
    assert coalesce((3, 2), [(1, 3), (2, 1)]) == ((3, 2), [(1, 3), (2, 1)])  # a transpose stays


@pytest.mark.parametrize("pair", [("zero3", "tp4"), ("fsdp", "tp2xpp2"), ("zero1-flat", "tp2xdp2"),
                                  ("tp2xdp2", "pp2"), ("fsdp", "tp4")])
def test_compiled_program_is_the_schedule(layouts4, pair):
    """The executor's compiled program posts exactly ``Schedule.batches`` (peer, direction, bytes,
    in order); a direct message is the chunk's one buffer range; a staged one's copies move
    exactly its pieces' elements to/from their offsets in the step's pool block, inside the pool."""
    from rlhf_switch.routing.schedule import Copy
    from rlhf_switch.vps.space import row_major_strides
    from rlhf_switch.vps.spec import itemsize
    src, dst = layouts4[pair[0]], layouts4[pair[1]]
    side = (lambda c: c.src_buffer), (lambda c: c.dst_buffer)
    for budget in ((64, 1 << 20) if pair == ("fsdp", "tp4") else (1000, 1 << 20)):
        for r in range(4):
            sched = build_schedule(plan_rank(src, dst, r), budget)
            prog = sched.program
            assert prog.pool_bytes == sched.peak_staging_bytes <= budget
            assert [pb.retire for pb in prog.batches] == [b.retire for b in sched.batches]
            for pb, b in zip(prog.batches, sched.batches):
                assert len(pb.ops) == len(b.messages)
                for op, m in zip(pb.ops, b.messages):
                    ex = sched.exchanges[m.exchange]
                    chunk = ex.steps[m.step][0 if m.send else 1]
                    assert (op.send, op.peer, op.nbytes, op.chunk) == (m.send, ex.peer, chunk.nbytes, chunk)
                    staged = chunk.stage_send if m.send else chunk.stage_recv
                    assert (op.buffer is None) == staged
                    if not staged:
                        p = chunk.pieces[0]
                        off = p.src_view()[0] if m.send else p.dst_view()[0]
                        assert (op.offset, op.numel * itemsize(p.transfer.dtype)) == (off, chunk.nbytes)
                        continue
                    offset, size = prog.steps[op.step]
                    assert offset <= op.offset and op.offset + op.nbytes <= offset + size <= prog.pool_bytes
                    want = []
                    for p, o in zip(chunk.pieces, chunk.offsets):
                        t, shape = p.transfer, p.box.shape
                        at, rm = (op.offset + o) // itemsize(t.dtype), row_major_strides(shape)
                        if m.send:
                            off, strides = p.src_view()
                            want.append(Copy(t.src_buffer, off, strides, None, at, rm, shape, t.dtype))
                        else:
                            off, strides = p.dst_view()
                            want.append(Copy(None, at, rm, t.dst_buffer, off, strides, shape, t.dtype))
                    assert _mapping(op.copies, *side) == _mapping(want, *side)


@pytest.mark.parametrize("pair", [("fsdp", "tp4"), ("zero3", "tp2xpp2"), ("zero1-flat", "tp2xdp2"), ("tp2xdp2", "pp2")])
def test_read_messages_cut_alike_and_stage_only_what_the_sender_packs(layouts4, pair, monkeypatch):
    """Directions read out of the sender's memory (``reads``): cut alike on both ends; a piece
    is read in place when its source runs are long (``READ_RUN_BYTES``, lowered here so the tiny
    model has both kinds), else packed at an aligned offset of the sender's block; the sender's
    packing per message fits a quarter of the budget, the receiver stages nothing, and the runs
    on both sides carry exactly the message's bytes. One message per direction when it all fits."""
    from rlhf_switch.routing import schedule
    from rlhf_switch.routing.schedule import ALIGN, read_runs_of, run_bytes
    from rlhf_switch.vps.spec import itemsize
    long_run = 200  # the tiny model's source runs are 64 B to 16 KiB
    monkeypatch.setattr(schedule, "READ_RUN_BYTES", long_run)
    src, dst = layouts4[pair[0]], layouts4[pair[1]]
    reads = frozenset((a, b) for a in range(4) for b in range(4) if a != b)
    kinds = set()
    for budget in (256, 4096, 1 << 20):
        scheds = [build_schedule(plan_rank(src, dst, r), budget, None, reads) for r in range(4)]
        for a in range(4):
            for ex in scheds[a].exchanges:
                other = next(e for e in scheds[ex.peer].exchanges if e.peer == a)
                mine = [s for s, _ in ex.steps if s]
                assert mine == [r for _, r in other.steps if r]
                if budget == 1 << 20:
                    assert len(mine) == 1
                sent = 0
                for m in mine:
                    assert m.read and not m.stage_recv and m.stage_send == (m.packed > 0) and m.packed <= budget // 4
                    end = 0
                    for p, o in zip(m.pieces, m.offsets):
                        per = itemsize(p.transfer.dtype)
                        in_place = run_bytes(p.box.shape, p.transfer.src_strides, per) >= long_run
                        kinds.add(in_place)
                        assert (o < 0) == in_place
                        if o >= 0:
                            assert o % ALIGN == 0 and o >= end
                            end = o + p.nbytes
                    assert end == m.packed
                    runs = read_runs_of(m)
                    assert int(runs.remote[:, 2].sum()) == int(runs.local[:, 2].sum()) == m.nbytes == \
                        sum(p.nbytes for p in m.pieces)
                    sent += m.nbytes
                assert sent == sum(t.box.numel * itemsize(t.dtype) for t in scheds[a].plan.sends if t.dst == ex.peer)
            _replay_staging(scheds[a])
    assert kinds == {True, False}, "the pair should have pieces of both kinds"


# ---------------------------------------------------------------- whole moves, in this process
# The schedule's every choice (cuts, merges, staging ring, read messages, compiled copies) ends up
# in bytes: a move run on 4 threads of this process (``thread_world``), where ``make mutate`` sees
# it, must leave every destination element equal to a direct construction of the destination and
# every padding byte and source byte as it was (``rank_jobs.move_and_check``).

THREAD_MOVES = [  # (source, destination, budget, how the bytes travel, read messages expected)
    ("zero3", "tp4", 1 << 20, "p2p", False),
    ("fsdp", "tp2xpp2", 1000, "p2p", False),  # messages of 250 B at most: the staging ring wraps
    ("tp2xdp2", "pp2", 4096, "same-host", False),  # every message a single copy between the ranks' memory
    ("zero1-flat", "tp2xdp2", 4096, "shared", True),  # sources in shared memory: mapped, and read messages
    ("fsdp", "vllm-bf16", 1 << 20, "same-host", False),  # fp32 into bf16: the sender casts, so it stages
    ("tp4", "zero3", 4096, "shared", False),
]


@pytest.mark.parametrize("src_name, dst_name, budget, way, reads", THREAD_MOVES,
                         ids=[f"{a}-{b}-{n}-{w}" for a, b, n, w, _ in THREAD_MOVES])
def test_a_move_on_threads_is_bit_exact(layouts4, tiny_spec, src_name, dst_name, budget, way, reads, monkeypatch):
    import rank_jobs
    from rlhf_switch.routing import same_host
    from rlhf_switch.vps.layouts.vllm import vllm_layout
    from thread_world import run_on_threads

    layouts = {**layouts4, "vllm-bf16": vllm_layout(tiny_spec, 4, dtype="bfloat16")}
    src, dst = layouts[src_name], layouts[dst_name]
    if way == "p2p":
        monkeypatch.setenv(same_host.ENV, "0")
    else:
        monkeypatch.setenv(same_host.MIN_BYTES_ENV, "1")  # every message, however small
    results = run_on_threads(4, lambda r, comm: rank_jobs.move_and_check(
        src, dst, seed=3, budget_bytes=budget, rank=r, group=comm, shared=way == "shared"))
    for r, res in enumerate(results):
        assert isinstance(res, dict), res
        assert res["wrong"] == [], (r, res["wrong"])
        rep = res["report"]
        assert rep.peak_staging_bytes <= budget
        if not reads:  # (read messages cut a direction otherwise: schedule._read_chunks)
            assert rep.messages == build_schedule(plan_rank(src, dst, r), budget).messages
    reports = [res["report"] for res in results]
    assert sum(rep.same_host_messages for rep in reports) == \
        (0 if way == "p2p" else sum(rep.messages for rep in reports))
    assert (sum(rep.mapped_messages for rep in reports) > 0) == (way == "shared")
    assert (sum(rep.read_messages for rep in reports) > 0) == reads
