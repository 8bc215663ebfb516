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


# ------------------------------------------------------------- the staging ring, computed by hand

def _staged_only(sizes_and_sides, budget, align=1, rank=0, peers=(1,)):
    """A schedule of synthetic steps (no plan, no pieces): each ``(exchange, send bytes, recv
    bytes)``, ``None`` for a message that is not staged (sent / received in place) and ``0`` for
    no message; what ``Schedule.staged`` and ``Schedule.batches`` read of a schedule."""
    from types import SimpleNamespace

    from rlhf_switch.routing.schedule import Chunk, Exchange, Schedule

    def chunk(n, send):
        if n == 0:
            return None
        staged = n is not None
        return Chunk((), (), n if staged else 8, staged if send else False, staged if not send else False)

    steps: dict[int, list] = {}
    for ex, s, r in sizes_and_sides:
        steps.setdefault(ex, []).append((chunk(s, True), chunk(r, False)))
    exchanges = tuple(Exchange(i, peers[i], tuple(steps[i])) for i in sorted(steps))
    return Schedule(SimpleNamespace(rank=rank), budget, exchanges, (), align)


def test_the_staging_ring_places_and_retires_as_worked_out_by_hand():
    """Budget 100, blocks 30, 30, 30 fill [0, 90); 20 fits neither after the tail nor before the
    head (0) until the oldest retires, then at 0; 10 fits exactly between the wrapped tail (20) and
    the head (30); 16 does not (30 + 16 > 30) until the next oldest retires: then before 60."""
    sched = _staged_only([(0, 30, 0), (0, 30, 0), (0, 30, 0), (0, 20, 0), (0, 10, 0), (0, 16, 0)], 100)
    program, peak = sched.staged
    assert [(st.offset, st.send_bytes, st.retire) for st in program] == \
        [(0, 30, 0), (30, 30, 0), (60, 30, 0), (0, 20, 1), (20, 10, 0), (30, 16, 1)]
    assert peak == 90


def test_a_step_stages_both_its_messages_in_one_aligned_block_and_waits_for_room():
    """Align 8. A step's block is [recv | send], each rounded up: 36 -> 40, 16 + 20 -> 16 + 24. The
    third step (40) fits after the tail (80)? no; before the head (0)? no; after one retirement the
    head is 40: it fits at 0 (40 <= 40). A step with nothing staged takes no block; the last (60 ->
    64) finds the ring wrapped (tail 40, head 40) and retires everything older."""
    sched = _staged_only([(0, 36, 0), (0, 0, 36), (0, 20, 16), (1, None, 0), (1, 60, 0)], 100, align=8,
                         peers=(1, 2))
    program, peak = sched.staged
    assert [(st.exchange, st.step, st.offset, st.recv_bytes, st.send_bytes, st.retire) for st in program] == [
        (0, 0, 0, 0, 40, 0), (0, 1, 40, 40, 0, 0), (0, 2, 0, 16, 24, 1), (1, 1, 0, 0, 64, 2)]
    assert peak == 80 and sched.peak_staging_bytes == 80


def test_batches_cut_where_a_step_waits_and_the_lower_rank_sends_first():
    from rlhf_switch.routing.schedule import Batch, Message

    sides = [(0, 36, 0), (0, 0, 36), (0, 20, 16), (1, None, 0), (1, 60, 0)]
    lower = _staged_only(sides, 100, align=8, rank=0, peers=(1, 2))
    assert lower.batches == (
        Batch(0, (Message(0, 0, True), Message(0, 1, False))),
        Batch(1, (Message(0, 2, True), Message(0, 2, False))),
        Batch(0, (Message(1, 0, True),)),
        Batch(2, (Message(1, 1, True),)))
    higher = _staged_only(sides, 100, align=8, rank=3, peers=(1, 2))  # the peer is the lower rank: it goes first
    assert higher.batches[1] == Batch(1, (Message(0, 2, False), Message(0, 2, True)))
    assert lower.messages == higher.messages == 6
    roomy = _staged_only(sides, 1000, align=8, rank=0, peers=(1, 2))  # nothing waits: one batch per exchange
    assert roomy.batches == (
        Batch(0, (Message(0, 0, True), Message(0, 1, False), Message(0, 2, True), Message(0, 2, False))),
        Batch(0, (Message(1, 0, True), Message(1, 1, True))))


def test_the_pair_digest_names_every_part_of_every_message():
    """A peer's digest changes with any message's direction, size, kind, read offsets, order, or
    any piece's box or buffer offsets — and the other peers' digests do not."""
    from types import SimpleNamespace

    from rlhf_switch.routing.schedule import Chunk, Exchange, Piece, Schedule
    from rlhf_switch.vps import Box, StateKey
    from rlhf_switch.vps.planner import Transfer

    def t(lo, src_offset=0, dst_offset=0):
        return Transfer(0, 1, StateKey("w"), Box((lo, 0), (lo + 2, 4)), "a", src_offset, (4, 1), "b", dst_offset,
                        (4, 1), "float32")

    def piece(lo, **kw):
        tr = t(lo, **kw)
        return Piece(tr, tr.box)

    base = [Chunk((piece(0), piece(2)), (0, 32), 64, True, False), Chunk((piece(4),), (0,), 32, False, False)]

    def digests(to_peer_1, rank=0):
        steps = ((to_peer_1[0], None), (None, to_peer_1[1]))
        other = ((Chunk((piece(6),), (0,), 32, False, False), None),)
        sched = Schedule(SimpleNamespace(rank=rank), 1000, (Exchange(0, 1, steps), Exchange(1, 2, other)))
        return sched.message_digests

    ref = digests(base)
    assert ref == digests(list(base)) and set(ref) == {1, 2}
    variants = {
        "size": [base[0]._replace(nbytes=72), base[1]],
        "kind": [base[0]._replace(read=True), base[1]],
        "read offsets": [base[0]._replace(read=True, offsets=(0, 40)), base[1]],
        "box": [base[0], Chunk((piece(5),), (0,), 32, False, False)],
        "source offset": [base[0], Chunk((piece(4, src_offset=1),), (0,), 32, False, False)],
        "destination offset": [base[0], Chunk((piece(4, dst_offset=1),), (0,), 32, False, False)],
        "order": [base[1], base[0]],
    }
    for what, chunks in variants.items():
        d = digests(chunks)
        assert d[1] != ref[1] and d[2] == ref[2], what
    read = [base[0]._replace(read=True), base[1]]
    assert digests(read)[1] != digests([base[0]._replace(read=True, offsets=(0, 40)), base[1]])[1]
    # the direction: the same messages seen from the higher rank are the other way round
    assert digests(base, rank=3)[1] != ref[1]
    # 64 sizes, 64 digests: no two alike (a digest keeps its hash's bits, not a few of them)
    assert len({digests([base[0]._replace(nbytes=8 * k), base[1]])[1] for k in range(64)}) == 64


@pytest.mark.parametrize("world, table", [
    (2, {(0, 1): 0}),
    (3, {(0, 1): 2, (0, 2): 1, (1, 2): 0, (0, 3): 0, (1, 3): 1, (2, 3): 2}),
    (4, {(0, 1): 2, (0, 2): 1, (1, 2): 0, (0, 3): 0, (1, 3): 1, (2, 3): 2}),
    (6, {(0, 1): 3, (0, 2): 1, (1, 4): 0, (2, 3): 0, (0, 5): 0, (3, 5): 3, (2, 4): 3, (1, 3): 2}),
])
def test_pair_rounds_are_the_circle_methods(world, table):
    """``round(a, b) = (a + b) / 2 mod m`` (m = n - 1, n the world rounded up to even; halving mod
    odd m is multiplying by (m + 1) / 2), and ``b`` when ``a`` is the fixed player m: by hand."""
    for (a, b), k in table.items():
        if max(a, b) < world + (world % 2):
            assert pair_round(a, b, world) == k == pair_round(b, a, world), (a, b)


def test_split_box_cuts_whole_rows_when_a_row_fits_else_each_row():
    assert split_box(Box((0, 0), (5, 4)), 20) == [Box((0, 0), (5, 4))]
    assert split_box(Box((1, 0), (6, 4)), 8) == [Box((1, 0), (3, 4)), Box((3, 0), (5, 4)), Box((5, 0), (6, 4))]
    assert split_box(Box((2, 1), (4, 6)), 5) == [Box((2, 1), (3, 6)), Box((3, 1), (4, 6))]
    assert split_box(Box((0, 0), (2, 5)), 2) == [
        Box((0, 0), (1, 2)), Box((0, 2), (1, 4)), Box((0, 4), (1, 5)),
        Box((1, 0), (2, 2)), Box((1, 2), (2, 4)), Box((1, 4), (2, 5))]
    assert split_box(Box((3,), (10,)), 3) == [Box((3,), (6,)), Box((6,), (9,)), Box((9,), (10,))]
    with pytest.raises(LayoutError, match="^staging budget smaller than one element$"):
        split_box(Box((0,), (4,)), 0)


# ------------------------------------------------------- cutting one peer's messages, by hand

def _t(n, src_offset, dst_offset, src_strides=(1,), key="w", dtype="float32", shape=None):
    """A transfer of ``n`` elements (a 1-d box, or ``shape``) between buffers ``a`` and ``b``."""
    from rlhf_switch.vps import StateKey
    from rlhf_switch.vps.planner import Transfer

    shape = shape or (n,)
    box = Box((0,) * len(shape), tuple(shape))
    dst_strides = tuple(int(x) for x in __import__("rlhf_switch.vps.space", fromlist=["x"]).row_major_strides(shape))
    return Transfer(0, 1, StateKey(key), box, "a", src_offset, src_strides, "b", dst_offset, dst_strides, dtype)


def _cut(transfers, cap=1 << 20):
    from rlhf_switch.routing.schedule import _chunks

    return [(tuple(p.transfer.key.tensor for p in c.pieces), c.offsets, c.nbytes, c.stage_send, c.stage_recv)
            for c in _chunks(transfers, cap, None)]


def test_pieces_that_continue_both_runs_are_one_direct_message():
    assert _cut([_t(100, 0, 0, key="x"), _t(100, 100, 100, key="y")]) == [(("x", "y"), (0, 400), 800, False, False)]


def test_a_piece_that_breaks_one_run_joins_when_staging_that_side_costs_at_most_merge_bytes():
    """The second piece continues the source run, not the destination's: joining stages the
    destination side of both (400 + 400 B copied <= MERGE_BYTES): one message, sent straight from
    the source, received into staging. At 65540 B a piece it would copy 131080 B > 131072: two
    direct messages. At 65536 B exactly (131072): one."""
    from rlhf_switch.routing.schedule import MERGE_BYTES

    assert MERGE_BYTES == 131072
    assert _cut([_t(100, 0, 0, key="x"), _t(100, 100, 500, key="y")]) == [(("x", "y"), (0, 400), 800, False, True)]
    assert _cut([_t(16384, 0, 0, key="x"), _t(16384, 16384, 50000, key="y")]) == [
        (("x", "y"), (0, 65536), 131072, False, True)]
    assert _cut([_t(16385, 0, 0, key="x"), _t(16385, 16385, 50000, key="y")]) == [
        (("x",), (0,), 65540, False, False), (("y",), (0,), 65540, False, False)]


def test_a_strided_source_is_staged_and_small_leftovers_travel_together_at_the_end():
    """A strided source view cannot be sent straight: its message is packed. Three pieces that
    join no neighbour (a 12 B one, a 200 KiB one, a 12 B one): the two small ones become one
    staged message after the big one, the second at an 8-byte aligned offset (16)."""
    strided = _t(6, 0, 0, src_strides=(2,), key="s")
    assert _cut([strided]) == [(("s",), (0,), 24, True, False)]
    small_a, big, small_b = _t(3, 0, 0, key="a"), _t(51200, 1000, 1000, key="big"), _t(3, 60000, 60000, key="b")
    assert _cut([small_a, big, small_b]) == [
        (("big",), (0,), 204800, False, False),
        (("a", "b"), (0, 16), 28, True, True)]
    # one small message alone stays where it was
    assert _cut([small_a, big]) == [(("a",), (0,), 12, False, False), (("big",), (0,), 204800, False, False)]


def test_a_message_never_passes_the_cap():
    """cap 800 B: 150 contiguous floats (600 B) then 100 more (400 B) would make 1000 B: two
    messages; a 300-float transfer is cut in row-major sub-boxes of at most 200."""
    assert _cut([_t(150, 0, 0, key="x"), _t(100, 150, 150, key="y")], cap=800) == [
        (("x",), (0,), 600, False, False), (("y",), (0,), 400, False, False)]
    from rlhf_switch.routing.schedule import _chunks

    chunks = _chunks([_t(300, 0, 0, key="z")], 800, None)
    assert [(c.pieces[0].box, c.nbytes) for c in chunks] == [(Box((0,), (200,)), 800), (Box((200,), (300,)), 400)]


def test_read_messages_cut_by_the_senders_packing_worked_out_by_hand():
    """cap 100 B, READ_RUN_BYTES 4096: a transfer of 8 KiB runs is read in place (offset -1, no
    packing, no cap); the short ones are packed at 8-byte aligned offsets until the next would pass
    the cap: [in place + 40 B at 0] (40 packed), [80 B], then a strided 4x8 block (32 B runs) cut
    in rows of at most 25 elements: 3 rows (96 B), then 1 (32 B)."""
    from rlhf_switch.routing.schedule import READ_RUN_BYTES, _read_chunks

    assert READ_RUN_BYTES == 4096
    long, a, b = _t(2048, 0, 0, key="long"), _t(10, 5000, 5000, key="a"), _t(20, 6000, 6000, key="b")
    block = _t(32, 7000, 7000, src_strides=(16, 1), key="block", shape=(4, 8))
    got = [(tuple((p.transfer.key.tensor, p.box) for p in c.pieces), c.offsets, c.nbytes, c.stage_send, c.stage_recv,
            c.read, c.packed) for c in _read_chunks([long, a, b, block], 100)]
    assert got == [
        ((("long", Box((0,), (2048,))), ("a", Box((0,), (10,)))), (-1, 0), 8232, True, False, True, 40),
        ((("b", Box((0,), (20,))),), (0,), 80, True, False, True, 80),
        ((("block", Box((0, 0), (3, 8))),), (0,), 96, True, False, True, 96),
        ((("block", Box((3, 0), (4, 8))),), (0,), 32, True, False, True, 32)]
    only_long = _read_chunks([long, _t(2048, 9000, 9000, key="long2")], 100)
    assert [(c.offsets, c.nbytes, c.stage_send, c.packed) for c in only_long] == [((-1, -1), 16384, False, 0)]
    assert _read_chunks([], 100) == []


def test_a_read_messages_runs_on_both_sides_worked_out_by_hand():
    """One piece read in place from buffer ``a`` (a 2x3 box at element 10, rows 5 apart: runs of
    12 B at bytes 40 and 60), one packed at 0 of the sender's block (16 B, from ``c``); both land in
    ``b``, at elements 0-5 (one 24 B run) and 6-9: local runs merge into one of 40 B."""
    from rlhf_switch.routing.schedule import Chunk, Copy, Piece, read_runs_of
    from rlhf_switch.vps import StateKey
    from rlhf_switch.vps.planner import Transfer

    ta = Transfer(0, 1, StateKey("x"), Box((0, 0), (2, 3)), "a", 10, (5, 1), "b", 0, (3, 1), "float32")
    tc = Transfer(0, 1, StateKey("y"), Box((0,), (4,)), "c", 2, (1,), "b", 6, (1,), "float32")
    chunk = Chunk((Piece(ta, ta.box), Piece(tc, tc.box)), (-1, 0), 40, True, False, True, 16)
    runs = read_runs_of(chunk)
    assert (runs.src_names, runs.dst_names, runs.nbytes, runs.sources) == (("a",), ("b",), 40, ("a", "c"))
    assert runs.remote.tolist() == [[1, 40, 12], [1, 60, 12], [0, 0, 16]]
    assert runs.local.tolist() == [[0, 0, 40]]
    assert runs.copies == (Copy("a", 10, (5, 1), "b", 0, (3, 1), (2, 3), "float32"),
                           Copy("c", 2, (1,), "b", 6, (1,), (4,), "float32"))


# ------------------------------------- a compiled program replayed message by message, by hand

def _replay(scheds, src_bufs, dst_bufs):
    """Run the four ranks' compiled programs in this process, one message at a time, the way the
    executor's transports do but written from the ``Op`` contract alone: a sender packs its
    staged copies into its pool, a direct message is its buffer's byte range, a read message's
    receiver takes the runs its ``ReadRuns`` names — base 0 the sender's block at the sender op's
    pool offset, base ``k`` the sender's buffer the offer's ``k``-th address is of — and lays
    them out in its own runs. Returns every rank's ops, per (peer, send), in posting order."""
    import torch

    from rlhf_switch.vps.materialize import torch_dtype

    world = len(scheds)
    pools = [torch.zeros(max(s.program.pool_bytes, 8), dtype=torch.uint8) for s in scheds]

    def strided(base, dtype, offset, strides, shape):
        return torch.as_strided(base.view(torch_dtype(dtype)), shape, strides, offset)

    def run_copies(copies, rank_src, rank_dst, pool_rank):
        for c in copies:
            a = strided(pools[pool_rank] if c.src_buffer is None else src_bufs[rank_src][c.src_buffer],
                        c.dtype, c.src_offset, c.src_strides, c.shape)
            b = strided(pools[pool_rank] if c.dst_buffer is None else dst_bufs[rank_dst][c.dst_buffer],
                        c.dtype, c.dst_offset, c.dst_strides, c.shape)
            b.copy_(a)

    def u8(t):
        return t.view(torch.uint8)

    queues: dict[tuple[int, int, bool], list] = {}
    for r, s in enumerate(scheds):
        run_copies(s.local_runs, r, r, r)
        for pb in s.program.batches:
            for op in pb.ops:
                queues.setdefault((r, op.peer, op.send), []).append(op)
    ops = {k: list(v) for k, v in queues.items()}
    for a in range(world):
        for b in range(world):
            for send in queues.get((a, b, True), []):
                recv = queues[(b, a, False)].pop(0)
                assert (send.nbytes, send.chunk.read) == (recv.nbytes, recv.chunk.read)
                if send.chunk.read:
                    offer, runs = send.read, recv.read
                    # the receiver names the sender's buffers in the order the offer gives addresses
                    assert (offer.in_place, offer.sources) == (runs.src_names, runs.sources)
                    run_copies(send.copies, a, a, a)  # the sender packs what is not read in place
                    wire = []
                    for base, off, n in runs.remote.tolist():
                        mem = pools[a][send.offset:] if base == 0 else u8(src_bufs[a][offer.in_place[base - 1]])
                        assert off + n <= mem.numel()
                        wire.append(mem[off:off + n])
                    wire = torch.cat(wire)
                    assert wire.numel() == runs.nbytes == send.nbytes
                    at = 0
                    for base, off, n in runs.local.tolist():
                        u8(dst_bufs[b][runs.dst_names[base]])[off:off + n] = wire[at:at + n]
                        at += n
                    assert at == runs.nbytes
                    continue
                if send.buffer is None:
                    run_copies(send.copies, a, a, a)
                    wire = pools[a][send.offset:send.offset + send.nbytes].clone()
                else:
                    buf = src_bufs[a][send.buffer]  # as the executor views it: numel elements at offset
                    wire = u8(torch.as_strided(buf, (send.numel,), (1,), send.offset)).clone()
                assert wire.numel() == send.nbytes
                if recv.buffer is None:
                    pools[b][recv.offset:recv.offset + recv.nbytes] = wire
                    run_copies(recv.copies, b, b, b)
                else:
                    u8(torch.as_strided(dst_bufs[b][recv.buffer], (recv.numel,), (1,), recv.offset))[:] = wire
    assert all(not q for (_, _, send), q in queues.items() if not send), "a receive no sender posts"
    return ops


@pytest.mark.parametrize("pair, budget, reads, merge", [
    (("fsdp", "tp2xpp2"), 1000, False, None),  # messages of 250 B at most: the staging ring wraps
    (("zero3", "tp4"), 1 << 20, False, 0),  # every contiguous piece sent / received in place
    (("zero1-flat", "tp2xdp2"), 4096, "all", None),  # read messages, some pieces packed, some read in place
    (("fsdp", "tp4"), 256, "all", None),
    (("tp2xdp2", "pp2"), 1 << 20, "all", None),
    # only lower -> higher rank reads: a step packs a read message beside a staged receive
    (("fsdp", "tp2xpp2"), 1000, "up", None),
])
def test_a_compiled_program_replayed_by_hand_delivers_every_byte(layouts4, pair, budget, reads, merge, monkeypatch):
    """Every rank's compiled program, replayed message by message in one process (``_replay``):
    every destination element ends up as a direct construction of the destination has it, no
    padding byte is written, no source byte changes; every staged op stays inside its step's
    block of the pool and every batch starts the pool blocks of the staged steps its ops use,
    each step once, in the staging program's order."""
    import rank_jobs
    import torch

    from rlhf_switch.routing import schedule
    from rlhf_switch.vps.materialize import allocate, bits, coverage_masks, materialize
    from rlhf_switch.vps.spec import itemsize

    monkeypatch.setattr(schedule, "READ_RUN_BYTES", 200)  # both kinds of read pieces in the tiny model
    if merge is not None:
        monkeypatch.setattr(schedule, "MERGE_BYTES", merge)
    src, dst = layouts4[pair[0]], layouts4[pair[1]]
    directions = frozenset((a, b) for a in range(4) for b in range(4) if a != b and (reads == "all" or a < b)
                           ) if reads else frozenset()
    scheds = [build_schedule(plan_rank(src, dst, r), budget, None, directions) for r in range(4)]
    tensor_of = rank_jobs.tensor_source(src, 3)
    src_bufs = [materialize(src, r, tensor_of) for r in range(4)]
    before_src = [{n: t.clone() for n, t in bufs.items()} for bufs in src_bufs]
    dst_bufs = [rank_jobs.garbage_like(allocate(dst, r, fill=None), 1000 + r) for r in range(4)]
    before_dst = [{n: t.clone() for n, t in bufs.items()} for bufs in dst_bufs]
    ops = _replay(scheds, src_bufs, dst_bufs)
    kinds, beside = set(), 0
    for r, sched in enumerate(scheds):
        expected, masks = materialize(dst, r, tensor_of), coverage_masks(dst, r)
        for n, t in dst_bufs[r].items():
            m = masks[n]
            assert torch.equal(bits(t)[m], bits(expected[n])[m]), (pair, r, n)
            assert torch.equal(bits(t)[~m], bits(before_dst[r][n])[~m]), f"{n}: padding written"
        for n, t in src_bufs[r].items():
            assert torch.equal(bits(t), bits(before_src[r][n])), f"source {n} changed"
        prog, started, blocks = sched.program, [], {}
        for pb in prog.batches:
            started += pb.new_steps
            for op in pb.ops:
                kinds.add((op.send, op.chunk.read, op.buffer is None))
                if op.step >= 0:
                    assert op.step in pb.new_steps
                    offset, size = prog.steps[op.step]
                    packed = op.chunk.packed if op.chunk.read else op.nbytes
                    assert offset <= op.offset and op.offset + packed <= offset + size <= prog.pool_bytes
                    beside += op.chunk.read and op.offset > offset  # after the step's staged receive
                    blocks.setdefault(op.step, []).append((op.offset, op.offset + packed))
        assert started == list(range(len(sched.staged[0])))
        plan = sched.plan
        assert (prog.bytes_sent, prog.bytes_received, prog.bytes_local) == tuple(
            sum(t.box.numel * itemsize(t.dtype) for t in ts) for ts in (plan.sends, plan.recvs, plan.local))
        # the pool lives where the first staged step's staged side has its buffers
        if not sched.staged[0]:
            assert prog.pool_on is None
        else:
            first = sched.staged[0][0]
            send_chunk, recv_chunk = sched.exchanges[first.exchange].steps[first.step]
            assert prog.pool_on in ({("dst", p.transfer.dst_buffer) for p in recv_chunk.pieces} if first.recv_bytes
                                    else {("src", p.transfer.src_buffer) for p in send_chunk.pieces})
        for (a0, a1), (b0, b1) in (sorted(v) for v in blocks.values() if len(v) == 2):
            assert a1 <= b0, "a step's receive and send overlap in the pool"
        assert sum(len(v) for k, v in ops.items() if k[0] == r) == sched.messages
    # (send, read, staged): the kinds of op each case is there for
    assert {(True, True, True), (False, True, True)} <= kinds if reads else \
        {(True, False, merge is None), (False, False, merge is None)} <= kinds
    assert beside or reads != "up"


def test_read_runs_of_three_dim_views_two_in_place_buffers_and_merges_per_buffer_by_hand():
    """Four pieces of one read message: a 2x3x2 box of ``a`` (strides 20, 4, 1: no two dims one
    run, so runs of 2 elements = 8 B at bytes 0, 16, 32, 80, 96, 112) read in place, 4 elements of
    ``c`` at element 2 read in place (the offer's second address: base 2), and two pieces packed at
    0 (8 B) and 8 (12 B) of the sender's block (base 0, one run of 20 B). Locally the box fills
    ``b`` 0-11 (one run of 48 B) and the other three ``d`` 0-3, 4-5, 6-8 (16 + 8 + 12 B merge into
    one run of 36 B)."""
    from rlhf_switch.routing.schedule import Chunk, Piece, read_runs_of
    from rlhf_switch.vps import StateKey
    from rlhf_switch.vps.planner import Transfer

    def t(name, box, src, src_offset, src_strides, dst_offset, dst, dst_strides):
        return Transfer(0, 1, StateKey(name), box, src, src_offset, src_strides, dst, dst_offset, dst_strides,
                        "float32")

    ta = t("x", Box((0, 0, 0), (2, 3, 2)), "a", 0, (20, 4, 1), 0, "b", (6, 2, 1))
    tc = t("y", Box((0,), (4,)), "c", 2, (1,), 0, "d", (1,))
    te = t("z", Box((0,), (2,)), "e", 0, (1,), 4, "d", (1,))
    tf = t("w", Box((0,), (3,)), "f", 5, (1,), 6, "d", (1,))
    chunk = Chunk(tuple(Piece(x, x.box) for x in (ta, tc, te, tf)), (-1, -1, 0, 8), 84, True, False, True, 20)
    runs = read_runs_of(chunk)
    assert (runs.src_names, runs.dst_names, runs.sources, runs.nbytes) == (("a", "c"), ("b", "d"), ("a", "c", "e", "f"), 84)
    assert runs.remote.tolist() == [[1, 0, 8], [1, 16, 8], [1, 32, 8], [1, 80, 8], [1, 96, 8], [1, 112, 8],
                                    [2, 8, 16], [0, 0, 20]]
    assert runs.local.tolist() == [[0, 0, 48], [1, 0, 36]]


def test_run_bytes_and_the_read_in_place_threshold_by_hand():
    """A view's runs: the coalesced last dimension when its stride is 1, else one element; a
    source run of exactly ``READ_RUN_BYTES`` is read in place, one element less is packed; a
    message whose packing is a single byte still stages it."""
    from rlhf_switch.routing.schedule import READ_RUN_BYTES, _read_chunks, run_bytes

    assert run_bytes((2, 3, 2), (20, 4, 1), 4) == 8
    assert run_bytes((2, 3), (3, 1), 4) == 24  # one run: the dims coalesce
    assert run_bytes((4, 3), (1, 4), 4) == 4  # a transposed view: runs of one element
    assert READ_RUN_BYTES == 4096
    at = _read_chunks([_t(1024, 0, 0)], 1 << 20)
    assert [(c.offsets, c.stage_send, c.packed) for c in at] == [((-1,), False, 0)]
    below = _read_chunks([_t(1023, 0, 0)], 1 << 20)
    assert [(c.offsets, c.stage_send, c.packed) for c in below] == [((0,), True, 4092)]
    byte = _read_chunks([_t(1, 0, 0, dtype="uint8")], 100)
    assert [(c.offsets, c.nbytes, c.stage_send, c.packed) for c in byte] == [((0,), 1, True, 1)]


def test_a_direction_is_read_only_when_every_destination_run_is_long_enough():
    """``can_read``: every destination run at least ``READ_LOCAL_RUN_BYTES`` (256 B) long —
    exactly 256 B is enough, 2 or 4 bytes less in any one transfer is not; runs count bytes of
    the transfer's dtype; a transposed destination (runs of one element) never is."""
    from rlhf_switch.routing.schedule import READ_LOCAL_RUN_BYTES, can_read
    from rlhf_switch.vps import StateKey
    from rlhf_switch.vps.planner import Transfer

    assert READ_LOCAL_RUN_BYTES == 256
    assert can_read([_t(64, 0, 0), _t(1000, 64, 64)])
    assert not can_read([_t(1000, 0, 0), _t(63, 1000, 1000)])
    assert can_read([_t(128, 0, 0, dtype="bfloat16")]) and not can_read([_t(127, 0, 0, dtype="bfloat16")])
    transposed = Transfer(0, 1, StateKey("w"), Box((0, 0), (64, 64)), "a", 0, (64, 1), "b", 0, (1, 64), "float32")
    assert not can_read([transposed]) and can_read([])


def test_a_run_counts_every_piece_it_takes_against_the_cap():
    """cap 1000 B, three contiguous 400 B pieces: the first two make one 800 B message, the
    third would pass the cap: a message of its own."""
    assert _cut([_t(100, 0, 0, key="x"), _t(100, 100, 100, key="y"), _t(100, 200, 200, key="z")], cap=1000) == [
        (("x", "y"), (0, 400), 800, False, False), (("z",), (0,), 400, False, False)]


def test_a_piece_that_breaks_the_source_run_stages_the_source_side():
    """The mirror of the destination case: the second piece continues the destination run, not
    the source's: one message, packed from the source, received straight into the destination."""
    assert _cut([_t(100, 0, 0, key="x"), _t(100, 500, 100, key="y")]) == [(("x", "y"), (0, 400), 800, True, False)]


@pytest.mark.parametrize("y_src, y_dst", [(3, 3), (3, 50), (50, 3)])  # y continues both runs, or only one
def test_a_message_staged_on_both_sides_counts_its_padding_against_the_cap(y_src, y_dst, monkeypatch):
    """cap 56 B, 12 B pieces (3 floats). x and y form a direct run (24 B, unpadded); z breaks it
    on both sides, so the message is staged on both: laid out padded, x at 0, y at 16, z at 32
    (44 B). w would start at 48 and end at 60 > 56: a message of its own — counting the run
    unpadded (24 + 12 = 36, w at 40, 52 B) would put it in and pass the cap. (The leftover small
    messages are not merged here: ``_small_together`` is switched off to see the cut itself.)"""
    from rlhf_switch.routing import schedule

    monkeypatch.setattr(schedule, "_small_together", lambda chunks, cap, dtypes: chunks)
    pieces = [_t(3, 0, 0, key="x"), _t(3, y_src, y_dst, key="y"), _t(3, 100, 100, key="z"), _t(3, 200, 200, key="w")]
    assert _cut(pieces, cap=56) == [(("x", "y", "z"), (0, 16, 32), 44, True, True), (("w",), (0,), 12, False, False)]
    # and at cap 44 the padded message fills the cap exactly: z still joins (an over-count would refuse it)
    assert _cut(pieces, cap=44) == [(("x", "y", "z"), (0, 16, 32), 44, True, True), (("w",), (0,), 12, False, False)]
    # at cap 40 z does not fit (44 B padded; counted unpadded, 24 + 12 = 36, it would pass the cap): z and w
    # make a second message, staged on both sides
    assert _cut(pieces, cap=40) == [(("x", "y"), (0, 12), 24, y_src == 50, y_dst == 50),
                                    (("z", "w"), (0, 16), 28, True, True)]


def test_contiguity_ignores_only_dimensions_of_size_one():
    """One row of a wider matrix is one run (a size-1 dimension's stride does not matter): sent
    straight; two rows of it are not: packed."""
    assert _cut([_t(4, 0, 0, src_strides=(8, 1), key="row", shape=(1, 4))]) == [(("row",), (0,), 16, False, False)]
    assert _cut([_t(8, 0, 0, src_strides=(8, 1), key="rows", shape=(2, 4))]) == [(("rows",), (0,), 32, True, False)]


def test_big_pieces_that_continue_both_runs_join_whatever_their_size():
    """Two 256 KiB pieces continuing both runs: one direct message (no staging to price)."""
    assert _cut([_t(65536, 0, 0, key="x"), _t(65536, 65536, 65536, key="y")]) == [
        (("x", "y"), (0, 262144), 524288, False, False)]


def test_every_sub_box_of_a_cut_transfer_travels_after_one_joins():
    """cap 800 B: x (20 floats) then y, 5 rows of 60 floats cut in boxes of 3 rows (720 B) and 2:
    the first box joins x (exactly 800 B), the second is a message of its own."""
    from rlhf_switch.routing.schedule import _chunks

    x, y = _t(20, 0, 0, key="x"), _t(300, 20, 20, key="y", shape=(5, 60))
    got = [(tuple((p.transfer.key.tensor, p.box) for p in c.pieces), c.nbytes) for c in _chunks([x, y], 800, None)]
    assert got == [((("x", Box((0,), (20,))), ("y", Box((0, 0), (3, 60)))), 800), ((("y", Box((3, 0), (5, 60))),), 480)]


def test_a_sender_that_casts_stages_every_message_merged_small_ones_too():
    """Source buffer ``a`` holds bf16 where the transfers are fp32: every message the sender
    sends is packed (cast) — the two big ones that join nothing and the small ones merged at the
    end, which would otherwise go straight from the source (b continues a's source run)."""
    from rlhf_switch.routing.schedule import _chunks

    small_a, big, small_b = _t(3, 0, 0, key="a"), _t(51200, 1000, 1000, key="big"), _t(3, 3, 60000, key="b")
    big2 = _t(51200, 60000, 200000, key="big2")
    for dtypes, staged in ((None, False), ({"a": "float32"}, False), ({"a": "bfloat16"}, True)):
        got = [(tuple(p.transfer.key.tensor for p in c.pieces), c.stage_send)
               for c in _chunks([small_a, big, small_b, big2], 1 << 20, dtypes)]
        assert got == [(("big",), staged), (("big2",), staged), (("a", "b"), staged)], dtypes


def test_messages_of_exactly_half_merge_bytes_count_as_small():
    """Two 64 KiB messages (``MERGE_BYTES // 2``) that joined no neighbour travel together at the
    end: b continues a's source run, so one 128 KiB message, sent straight, received into staging."""
    small_a, big, small_b = _t(16384, 0, 0, key="a"), _t(51200, 50000, 50000, key="big"), _t(16384, 16384, 200000, key="b")
    assert _cut([small_a, big, small_b]) == [
        (("big",), (0,), 204800, False, False), (("a", "b"), (0, 65536), 131072, False, True)]


def test_small_messages_merge_up_to_the_cap_counting_a_direct_run_unpadded(monkeypatch):
    """``MERGE_BYTES`` 40 (small: at most 20 B), cap 24 B: a and b (12 B each) are apart, big
    (24 B) between them. b continues a's source run, so together they are one 24 B message sent
    straight from the source — exactly the cap (counted padded, 16 + 12, it would not fit)."""
    from rlhf_switch.routing import schedule

    monkeypatch.setattr(schedule, "MERGE_BYTES", 40)
    a, big, b = _t(3, 0, 0, key="a"), _t(6, 100, 100, key="big"), _t(3, 3, 500, key="b")
    assert _cut([a, big, b], cap=24) == [(("big",), (0,), 24, False, False), (("a", "b"), (0, 12), 24, False, True)]


def test_small_messages_merge_into_as_few_as_fit_each_closed_like_any_other(monkeypatch):
    """``MERGE_BYTES`` 40, cap 24 B. b continues a's destination run: one message received
    straight into it, packed from the source. Three small ones a, b, c: a and b fill the cap, c is
    a second merged message (direct: it is alone). A sender that casts packs every one of them."""
    from rlhf_switch.routing import schedule
    from rlhf_switch.routing.schedule import _chunks

    monkeypatch.setattr(schedule, "MERGE_BYTES", 40)
    a, big, b = _t(3, 0, 0, key="a"), _t(6, 100, 100, key="big"), _t(3, 500, 3, key="b")
    assert _cut([a, big, b], cap=24) == [(("big",), (0,), 24, False, False), (("a", "b"), (0, 12), 24, True, False)]
    b, big2, c = _t(3, 3, 500, key="b"), _t(6, 200, 200, key="big2"), _t(3, 300, 300, key="c")
    assert _cut([a, big, b, big2, c], cap=24) == [
        (("big",), (0,), 24, False, False), (("big2",), (0,), 24, False, False),
        (("a", "b"), (0, 12), 24, False, True), (("c",), (0,), 12, False, False)]
    cast = _chunks([a, big, b, big2, c], 24, {"a": "bfloat16"})
    assert [(tuple(p.transfer.key.tensor for p in m.pieces), m.stage_send) for m in cast] == [
        (("big",), True), (("big2",), True), (("a", "b"), True), (("c",), True)]


def test_small_messages_stay_in_place_unless_merging_saves_one(monkeypatch):
    """``MERGE_BYTES`` 40, cap 24 B. Two 12 B messages continuing neither run do not fit together
    padded (16 + 12 > 24): nothing merges, and every message stays where it was. A message of
    exactly ``MERGE_BYTES // 2`` (20 B) is small and merges once, with a 4 B one continuing its
    source run (exactly the cap)."""
    from rlhf_switch.routing import schedule

    monkeypatch.setattr(schedule, "MERGE_BYTES", 40)
    a, big, b = _t(3, 0, 0, key="a"), _t(6, 100, 100, key="big"), _t(3, 50, 50, key="b")
    assert _cut([a, big, b], cap=24) == [
        (("a",), (0,), 12, False, False), (("big",), (0,), 24, False, False), (("b",), (0,), 12, False, False)]
    half, one = _t(5, 0, 0, key="half"), _t(1, 5, 500, key="one")
    assert _cut([half, big, one], cap=24) == [
        (("big",), (0,), 24, False, False), (("half", "one"), (0, 20), 24, False, True)]


def test_a_dtype_change_prices_staging_every_direct_side_of_the_message(monkeypatch):
    """``MERGE_BYTES`` 40. x (3 fp32, 12 B) is direct on the source only (its destination view is
    strided); y (8 bf16, 16 B) starts where x's source run ends, but in another dtype: the unpadded
    run cannot go on. Joining stages x's source side (12 B) and both of y's (16 + 16 B): 44 B > 40,
    so two messages — pricing only y's destination side (16 B), as if y continued the run, would
    join them. (``_small_together`` is switched off to see the cut itself.)"""
    from rlhf_switch.routing import schedule
    from rlhf_switch.vps import StateKey
    from rlhf_switch.vps.planner import Transfer

    monkeypatch.setattr(schedule, "MERGE_BYTES", 40)
    monkeypatch.setattr(schedule, "_small_together", lambda chunks, cap, dtypes: chunks)
    x = Transfer(0, 1, StateKey("x"), Box((0,), (3,)), "a", 0, (1,), "b", 0, (2,), "float32")
    y = _t(8, 3, 100, key="y", dtype="bfloat16")
    assert _cut([x, y]) == [(("x",), (0,), 12, False, True), (("y",), (0,), 16, False, False)]
    # a y of 6 bf16 (12 + 12 + 12 = 36 B) joins: staged on both sides from then on
    y6 = _t(6, 3, 100, key="y", dtype="bfloat16")
    assert _cut([x, y6]) == [(("x", "y"), (0, 16), 28, True, True)]


def test_a_pieces_views_start_where_its_box_lies_inside_the_transfers_box():
    """A 4x6 transfer box at rows 2.., columns 4.. of a tensor, read from ``a`` at element 100
    with rows 20 apart and written to ``b`` at 0 row-major (rows 6 apart): its piece at rows 3..5,
    columns 5..10 starts one row and one column in: at 100 + 20 + 1 = 121 in ``a``, 6 + 1 = 7 in ``b``."""
    from rlhf_switch.routing.schedule import Piece
    from rlhf_switch.vps import StateKey
    from rlhf_switch.vps.planner import Transfer

    t = Transfer(0, 1, StateKey("w"), Box((2, 4), (6, 10)), "a", 100, (20, 1), "b", 0, (6, 1), "float32")
    p = Piece(t, Box((3, 5), (5, 10)))
    assert p.src_view() == (121, (20, 1)) and p.dst_view() == (7, (6, 1))
    assert Piece(t, t.box).src_view() == (100, (20, 1)) and Piece(t, t.box).dst_view() == (0, (6, 1))


def test_a_source_buffer_the_dtypes_do_not_name_is_sent_without_a_cast():
    """``src_dtypes`` names the buffers whose dtype the sender knows; a transfer out of a buffer it
    does not name is taken as holding the wire dtype already: sent straight, not packed."""
    from rlhf_switch.routing.schedule import _chunks

    x = _t(100, 0, 0, key="x")
    assert [c.stage_send for c in _chunks([x], 1 << 20, {"other": "bfloat16"})] == [False]
    assert [c.stage_send for c in _chunks([x], 1 << 20, {"a": "bfloat16"})] == [True]


def _line(key, n, src_offset, dst_offset, src_stride=1, dst_stride=1, dtype="float32"):
    """A 1-d transfer of ``n`` elements from ``a`` to ``b``; a stride other than 1 makes that side a
    strided view (never one run)."""
    from rlhf_switch.vps import StateKey
    from rlhf_switch.vps.planner import Transfer

    return Transfer(0, 1, StateKey(key), Box((0,), (n,)), "a", src_offset, (src_stride,), "b", dst_offset,
                    (dst_stride,), dtype)


# (x, y, the messages): MERGE_BYTES 40, x is 3 floats (12 B). y joins when the staging joining costs
# (x on each side whose run y breaks, y on each side where it could travel straight) is at most 40 B.
JOIN_CASES = [
    # x direct on both sides; y continues the source run only: x's destination side and y's (12 + 28 = 40: joins; 12 + 32: not)
    (_line("x", 3, 0, 0), _line("y", 7, 3, 100), [("x", "y")]),
    (_line("x", 3, 0, 0), _line("y", 8, 3, 100), [("x",), ("y",)]),
    # the mirror: y continues the destination run only
    (_line("x", 3, 0, 0), _line("y", 7, 100, 3), [("x", "y")]),
    (_line("x", 3, 0, 0), _line("y", 8, 100, 3), [("x",), ("y",)]),
    # x staged on both sides (strided views): y's two sides (20 + 20 = 40: joins; 24 + 24: not)
    (_line("x", 3, 0, 0, 2, 2), _line("y", 5, 100, 100), [("x", "y")]),
    (_line("x", 3, 0, 0, 2, 2), _line("y", 6, 100, 100), [("x",), ("y",)]),
    # x staged on the source side, y continues its destination run: y's source side staged (40 B
    # joins, 44 not), unless y's source is strided anyway (44 B joins)
    (_line("x", 3, 0, 0, src_stride=2), _line("y", 10, 100, 3), [("x", "y")]),
    (_line("x", 3, 0, 0, src_stride=2), _line("y", 11, 100, 3), [("x",), ("y",)]),
    (_line("x", 3, 0, 0, src_stride=2), _line("y", 11, 100, 3, src_stride=2), [("x", "y")]),
    # the mirror on the destination side
    (_line("x", 3, 0, 0, dst_stride=2), _line("y", 10, 3, 100), [("x", "y")]),
    (_line("x", 3, 0, 0, dst_stride=2), _line("y", 11, 3, 100), [("x",), ("y",)]),
    (_line("x", 3, 0, 0, dst_stride=2), _line("y", 11, 3, 100, dst_stride=2), [("x", "y")]),
    # x direct on the destination only, y (bf16) starts where that run ends: the dtype change
    # stages x's destination side and both of y's (12 + 16 + 16 > 40; 12 + 12 + 12 joins)
    (_line("x", 3, 0, 0, src_stride=2), _line("y", 8, 100, 3, dtype="bfloat16"), [("x",), ("y",)]),
    (_line("x", 3, 0, 0, src_stride=2), _line("y", 6, 100, 3, dtype="bfloat16"), [("x", "y")]),
]


@pytest.mark.parametrize("x, y, messages", JOIN_CASES)
def test_a_piece_joins_when_the_staging_it_costs_is_at_most_merge_bytes_case_by_case(x, y, messages, monkeypatch):
    """``_joins``' price, side by side (``_small_together`` switched off: it would merge small
    leftovers again and hide the cut)."""
    from rlhf_switch.routing import schedule

    monkeypatch.setattr(schedule, "MERGE_BYTES", 40)
    monkeypatch.setattr(schedule, "_small_together", lambda chunks, cap, dtypes: chunks)
    assert [keys for keys, *_ in _cut([x, y])] == messages


def test_the_cap_counts_a_run_that_goes_on_on_one_side_unpadded(monkeypatch):
    """cap 24 B: y (12 B) continues x's source run only (or only its destination run): one 24 B
    message, direct on that side — counted padded (16 + 12 = 28 B) it would pass the cap."""
    from rlhf_switch.routing import schedule

    monkeypatch.setattr(schedule, "_small_together", lambda chunks, cap, dtypes: chunks)
    assert _cut([_t(3, 0, 0, key="x"), _t(3, 3, 50, key="y")], cap=24) == [(("x", "y"), (0, 12), 24, False, True)]
    assert _cut([_t(3, 0, 0, key="x"), _t(3, 50, 3, key="y")], cap=24) == [(("x", "y"), (0, 12), 24, True, False)]


def test_merge_copies_joins_only_a_copy_that_continues_the_last_on_both_sides():
    """``a``: 2 rows of 4 floats read 10 apart from ``a`` at 0, written 4 apart into ``b`` at 0. ``c``
    (3 more rows, from 20 and into 8) continues it on both sides: one copy of 5 rows; ``d`` (from 50,
    into 20) continues that: one copy of 6. A copy that differs from ``c`` in one thing only (a
    buffer, the dtype, the row shape, a side's strides or start) stays a copy of its own."""
    from rlhf_switch.routing.schedule import Copy, merge_copies

    a = Copy("a", 0, (10, 1), "b", 0, (4, 1), (2, 4), "float32")
    c = Copy("a", 20, (10, 1), "b", 8, (4, 1), (3, 4), "float32")
    d = Copy("a", 50, (10, 1), "b", 20, (4, 1), (1, 4), "float32")
    assert merge_copies([a]) == [a] and merge_copies([]) == []
    assert merge_copies([a, c]) == [a._replace(shape=(5, 4))]
    assert merge_copies([a, c, d]) == [a._replace(shape=(6, 4))]
    apart = [c._replace(src_buffer="x"), c._replace(dst_buffer="x"), c._replace(dtype="bfloat16"),
             c._replace(shape=(3, 5)), c._replace(src_strides=(12, 1)), c._replace(dst_strides=(5, 1)),
             c._replace(src_offset=21), c._replace(dst_offset=9)]
    for other in apart:
        assert merge_copies([a, other]) == [a, other], other
    # only the last copy is continued: c follows a, not the copy between them
    between = Copy("a", 100, (10, 1), "b", 100, (4, 1), (1, 4), "float32")
    assert merge_copies([a, between, c]) == [a, between, c]


def test_a_rank_that_only_copies_locally_has_a_schedule_without_messages():
    """No sends, no receives: no element size to fit in the budget (it counts as 1 B), no
    exchanges, the local copies straight from view to view, and staging aligned to 1."""
    from rlhf_switch.routing.schedule import Copy
    from rlhf_switch.vps.planner import RankPlan

    plan = RankPlan(0, 2, "x -> y", "digest", (_line("x", 4, 0, 10),), (), (), 0)
    schedule = build_schedule(plan, 2)
    assert schedule.exchanges == () and schedule.align == 1
    assert schedule.local_runs == (Copy("a", 0, (1,), "b", 10, (1,), (4,), "float32"),)


def test_local_copies_come_in_source_then_destination_offset_order():
    """Two local copies out of the same source element: the one written lower in the destination
    first, whatever their strides."""
    from rlhf_switch.routing.schedule import _local_runs

    one, two = _line("x", 4, 0, 10), _line("y", 4, 0, 0, src_stride=2)
    assert [c.dst_offset for c in _local_runs([one, two])] == [0, 10]


def test_the_message_cap_is_a_quarter_of_the_budget_in_whole_elements_else_half():
    """400 B to send. Budget 1000: cap 248 B (a quarter, 250, down to whole floats): 248 + 152.
    Budget 16: a quarter holds exactly one float: 4 B messages. Budget 8: a quarter (2 B) holds
    none, so half (4 B). Budget 7 cannot hold a float each way: refused, naming the 8 B it needs."""
    from rlhf_switch.vps.planner import RankPlan

    def sends(budget, n):
        plan = RankPlan(0, 2, "x -> y", "digest", (), (_line("x", n, 0, 0),), (), 0)
        return [send.nbytes for ex in build_schedule(plan, budget).exchanges for send, _ in ex.steps]

    assert sends(1000, 100) == [248, 152]
    assert sends(16, 3) == [4, 4, 4]
    assert sends(8, 3) == [4, 4, 4]
    with pytest.raises(LayoutError, match=r"budget of 7 B .* \(needs >= 8 B\)"):
        sends(7, 3)


def test_exchanges_come_in_round_order_and_a_casting_sender_packs():
    """Rank 0 of 4 sends to 1, 2 and 3: rounds 2, 1 and 0 (3 is the fixed player), so the
    exchanges go to 3, 2, 1. With its source buffer ``a`` in bf16 (the wire is fp32) every
    message is packed."""
    from rlhf_switch.vps.planner import RankPlan

    sends = tuple(_line("x", 10, 0, 0)._replace(dst=peer) for peer in (1, 2, 3))
    plan = RankPlan(0, 4, "x -> y", "digest", (), sends, (), 0)
    schedule = build_schedule(plan, 1 << 20)
    assert [(ex.round, ex.peer) for ex in schedule.exchanges] == [(0, 3), (1, 2), (2, 1)]
    assert {s.stage_send for ex in schedule.exchanges for s, _ in ex.steps} == {False}
    cast = build_schedule(plan, 1 << 20, src_dtypes={"a": "bfloat16"})
    assert {s.stage_send for ex in cast.exchanges for s, _ in ex.steps} == {True}
