"""Same-host copies (routing/same_host.py): large messages between ranks of one host copied
straight out of the sender's memory. Real moves on 4 gloo processes, checked bit for bit; every
message goes this way here (the threshold set to 1 byte before the world starts), and a sender
killed while its receiver copies out of it is named like any lost rank. Read messages: a
direction's pieces read in place or packed, straight into the destination views."""
from __future__ import annotations

import os

import pytest
import torch

import fault_jobs
import rank_jobs
from rlhf_switch.launch import LocalWorld
from rlhf_switch.routing import Deadlines, same_host
from rlhf_switch.vps import ParallelConfig, build_layout, synthetic_spec
from test_executor import run_move


@pytest.fixture(scope="module")
def copies_world():
    patch = pytest.MonkeyPatch()
    patch.setenv(same_host.MIN_BYTES_ENV, "1")  # every message, however small
    try:
        with LocalWorld(4, timeout=120) as world:
            yield world
    finally:
        patch.undo()


def _all_copies(reports):
    for rep in reports:
        assert rep.messages > 0 and rep.same_host_messages == rep.messages, str(rep)


@pytest.mark.parametrize("pair", [("zero3", "tp2xpp2"), ("fsdp", "tp4"), ("tp2xdp2", "zero1-flat"),
                                  ("pp2", "replicated")])
def test_moves_by_same_host_copies_are_exact(copies_world, layouts4, pair):
    a, b = pair
    _all_copies(run_move(copies_world, layouts4[a], layouts4[b]))


READS_SPEC = synthetic_spec([
    ("wide.row", (64, 4096), "float32", "row"),  # FSDP rows -> TP columns: 4 KiB source runs, read in place
    ("narrow.row", (256, 64), "float32", "row"),  # 64 B source runs: packed by the sender
    ("tall.column", (1024, 64), "float32", "column"),  # one contiguous range each way
    ("norm", (512,), "float32", "replicate"),
], name="reads")


@pytest.mark.parametrize("budget", [1 << 20, 8 << 10])
def test_a_direction_travels_as_read_messages_straight_into_place(copies_world, budget):
    """FSDP DP4 -> TP4: each direction's pieces in one read message when the sender's packing
    fits a quarter of the budget (2 KiB at 8 KiB: the packed pieces are cut over several), the
    long strided runs read in place, nothing staged by the receiver; bit for bit."""
    from rlhf_switch.routing.schedule import READ_RUN_BYTES
    assert 16 * 4 < READ_RUN_BYTES <= 1024 * 4, "the spec's runs straddle the threshold"
    src = build_layout(READS_SPEC, ParallelConfig(dp=4, dp_shard="fsdp"))
    dst = build_layout(READS_SPEC, ParallelConfig(tp=4))
    reports = run_move(copies_world, src, dst, budget_bytes=budget)
    for rep in reports:
        assert rep.read_messages == rep.same_host_messages == rep.messages, str(rep)
        if budget == 1 << 20:
            assert rep.messages == 6, str(rep)  # 3 peers, both directions, one message each
        else:
            assert rep.messages > 6 and 0 < rep.peak_staging_bytes <= budget, str(rep)


def test_read_messages_are_checked_like_any_other(copies_world):
    """``verify="full"`` over read messages: every piece's checksum, computed at its source,
    matches the bytes the receiver read into place."""
    import verify_jobs
    from rlhf_switch.vps import plan_transition
    src = build_layout(READS_SPEC, ParallelConfig(dp=4, dp_shard="fsdp"))
    dst = build_layout(READS_SPEC, ParallelConfig(tp=4))
    plan = plan_transition(src, dst)
    for r, res in enumerate(copies_world.run(verify_jobs.move_verified, src, dst, "full")):
        assert res["error"] is None and res["differ"] == {}, (r, res)
        rep = res["report"]
        assert rep.read_messages == rep.messages > 0, str(rep)
        assert rep.pieces_verified == len([t for t in plan.transfers if t.dst == r])


def test_a_pair_may_read_one_way_and_copy_whole_messages_the_other(copies_world):
    """TP4 -> TP2·PP2: the ranks of stage 0 receive layer 0 (16 B column slices of their TP2
    rows: too short to read into place), those of stage 1 layer 1 (whole rows: read messages),
    so pairs across the stages mix a read message one way with ordinary ones the other; bit for bit."""
    spec = synthetic_spec([("a.row", (64, 16), "float32", "row"), ("b.column", (256, 64), "float32", "column")],
                          num_layers=2, name="mixed")
    reports = run_move(copies_world, build_layout(spec, ParallelConfig(tp=4)),
                       build_layout(spec, ParallelConfig(tp=2, pp=2)))
    assert all(rep.same_host_messages == rep.messages for rep in reports)
    assert 0 < sum(rep.read_messages for rep in reports) < sum(rep.messages for rep in reports), reports


def test_a_sender_that_casts_offers_packed_messages_instead(copies_world):
    """fp32 -> bf16: a read takes the sender's bytes as they are, so a casting sender's direction
    goes as ordinary messages (packed and cast, then copied whole); both ends agree on that."""
    src = build_layout(READS_SPEC, ParallelConfig(dp=4, dp_shard="fsdp"))
    dst = build_layout(READS_SPEC, ParallelConfig(tp=4), param_dtype="bfloat16")
    for rep in run_move(copies_world, src, dst):
        assert rep.read_messages == 0 and rep.same_host_messages == rep.messages > 0, str(rep)


@pytest.mark.parametrize("budget", [1 << 20, 8 << 10])
def test_shared_sources_are_read_through_mappings_with_nothing_packed(copies_world, budget):
    """FSDP DP4 -> TP4 from sources in shared memory (``same_host.share``): every read message is
    copied by its receiver straight out of the sender's mapped buffers, the 64 B runs a sender
    would otherwise pack included; bit for bit. A receiver keeps one mapping per storage of a
    peer, and a later move from new storages drops the mappings of the freed ones."""
    src = build_layout(READS_SPEC, ParallelConfig(dp=4, dp_shard="fsdp"))
    dst = build_layout(READS_SPEC, ParallelConfig(tp=4))
    held = []
    for seed in (0, 1):  # each move from freshly made (and shared) source buffers
        reports = run_move(copies_world, src, dst, seed=seed, budget_bytes=budget, shared=True)
        for rep in reports:
            assert rep.read_messages == rep.messages and 2 * rep.mapped_messages == rep.messages > 0, str(rep)
            # their offers went on the board with the agreement (x86-64 Linux), not over gloo
            assert rep.board_messages == (rep.read_messages if same_host._futex() else 0), str(rep)
        held.append(copies_world.run(rank_jobs.mappings_held))
    assert held[0] == held[1] and all(n > 0 for per_rank in held[1] for n in per_rank), held


def test_read_messages_offered_on_the_board_and_over_gloo_mix_in_one_move(copies_world):
    """Sources in shared memory on ranks 0 and 2 only: their read messages are offered on the
    board, ranks 1 and 3's over gloo (their receivers learn which from the board), in one move,
    twice (the board's two slots); bit for bit."""
    src = build_layout(READS_SPEC, ParallelConfig(dp=4, dp_shard="fsdp"))
    dst = build_layout(READS_SPEC, ParallelConfig(tp=4))
    for seed in (0, 1):
        reports = run_move(copies_world, src, dst, seed=seed, shared=(0, 2))
        for r, rep in enumerate(reports):
            assert rep.read_messages == rep.messages == 6, str(rep)  # 3 sends, 3 receives
            if same_host._futex() is not None:  # 3 sends on the board (0, 2) or none, + 1 or 2 receives
                assert rep.board_messages == (3 if r in (0, 2) else 0) + (1 if r in (0, 2) else 2), str(rep)


def test_whole_messages_from_shared_memory_are_mapped_too(copies_world):
    """The mixed pair above from shared sources: its ordinary messages sent straight from a source
    buffer are copied through a mapping as well, its staged ones by ``process_vm_readv``; bit for bit."""
    spec = synthetic_spec([("a.row", (64, 16), "float32", "row"), ("b.column", (256, 64), "float32", "column")],
                          num_layers=2, name="mixed")
    reports = run_move(copies_world, build_layout(spec, ParallelConfig(tp=4)),
                       build_layout(spec, ParallelConfig(tp=2, pp=2)), shared=True)
    reads = sum(rep.read_messages for rep in reports) // 2
    assert reads < sum(rep.mapped_messages for rep in reports) <= sum(rep.messages for rep in reports) // 2, reports


@pytest.mark.parametrize("share_sources", [True, False])
def test_a_weight_channel_shares_its_sources_after_the_first_move(copies_world, share_sources):
    """A weight channel told to (``share_sources``, as a weight sync is): its first move reads by
    ``process_vm_readv`` and then moves the senders' buffers into shared memory, once; every later
    move from them is mapped reads. Untold, nothing is shared; bit for bit either way."""
    src = build_layout(READS_SPEC, ParallelConfig(dp=4, dp_shard="fsdp"))
    dst = build_layout(READS_SPEC, ParallelConfig(tp=4))
    for r, res in enumerate(copies_world.run(rank_jobs.channel_moves, src, dst, 3, share_sources)):
        assert res["wrong"] == [], (r, res["wrong"])
        if share_sources:
            assert res["mapped"][0] == 0 and res["mapped"][1] == res["mapped"][2] == 3, (r, res["mapped"])
            assert res["shared"] and res["stats"]["shared_bytes"] > 0, (r, res["stats"])
        else:
            assert res["mapped"] == [0, 0, 0] and not res["shared"] and res["stats"]["shared_bytes"] == 0


@pytest.mark.heavy  # left out of `make test-fast`
def test_switched_off_mappings_leave_shared_sources_to_process_vm_readv(layouts4, monkeypatch):
    monkeypatch.setenv(same_host.MAP_ENV, "0")
    monkeypatch.setenv(same_host.MIN_BYTES_ENV, "1")
    with LocalWorld(4, timeout=120) as world:
        src = build_layout(READS_SPEC, ParallelConfig(dp=4, dp_shard="fsdp"))
        dst = build_layout(READS_SPEC, ParallelConfig(tp=4))
        for rep in run_move(world, src, dst, shared=True):
            assert rep.read_messages == rep.messages > 0 and rep.mapped_messages == 0, str(rep)


def test_read_runs_continue_a_call_that_copied_part(monkeypatch):
    """``read_runs`` from this process into itself, two runs per call and lists cut unalike, so
    calls stop inside runs on either side and are continued from there."""
    monkeypatch.setattr(same_host, "IOV_MAX", 2)
    src = torch.arange(100_000, dtype=torch.float32)
    dst = torch.zeros(100_000)

    def runs(t, cuts):
        return torch.tensor([[t.data_ptr() + a, b - a] for a, b in zip(cuts, cuts[1:])], dtype=torch.int64)
    same_host.read_runs(os.getpid(), runs(src, [0, 4000, 4004, 130_000, 130_004, 400_000]),
                        runs(dst, [0, 12, 200_000, 200_400, 400_000]))
    assert torch.equal(src, dst)


def test_staging_reused_only_after_the_receiver_copied(copies_world, layouts4):
    """A budget far below the move: staged blocks are reused many times, each only once its
    receiver has acknowledged its copy (otherwise later bytes would overwrite earlier ones)."""
    reports = run_move(copies_world, layouts4["tp2xpp2"], layouts4["fsdp"], budget_bytes=4096)
    _all_copies(reports)
    assert any(rep.peak_staging_bytes > 0 for rep in reports)


def test_a_bare_group_uses_them_too(copies_world, layouts4):
    _all_copies(run_move(copies_world, layouts4["zero3"], layouts4["tp4"], bare_group=True))


@pytest.mark.heavy  # left out of `make test-fast`
def test_switched_off_every_message_stays_on_gloo(layouts4):
    patch = pytest.MonkeyPatch()
    patch.setenv(same_host.ENV, "0")
    patch.setenv(same_host.MIN_BYTES_ENV, "1")
    try:
        with LocalWorld(4, timeout=120) as world:
            reports = run_move(world, layouts4["zero3"], layouts4["tp2xpp2"])
    finally:
        patch.undo()
    assert all(rep.messages > 0 and rep.same_host_messages == 0 for rep in reports)


@pytest.mark.slow
def test_a_sender_killed_while_its_receiver_copies_is_named_and_nothing_is_lost(copies_world):
    """FSDP DP4 -> replicated, one 32 MiB fp32 shard per message: rank 2 dies right after
    offering its first one. Every survivor that still needed rank 2 raises PeerLost naming it;
    one whose exchange with rank 2 was over before the kill took effect (its reader copied and
    acknowledged rank 2's offer before the kernel tore the dying process down, and rank 2's reader
    had acknowledged its own send) may finish, with all of rank 2's bytes. Sources stay intact;
    after rank 2 is replaced the same move is exact."""
    spec = synthetic_spec([("big.column", (4096, 2048), "float32", "column")], name="big")
    src = build_layout(spec, ParallelConfig(dp=4, dp_shard="fsdp"))
    dst = build_layout(spec, ParallelConfig(dp=4))
    deadline = Deadlines(floor_s=3.0, min_rate=50e6, ceiling_s=60.0, census_s=4.0)
    dying = 2
    outcome = copies_world.run_all(fault_jobs.move_with_a_death, dying, "mid_copy", src, dst, deadline, 64 << 20)
    assert outcome.dead == [dying], outcome
    assert not outcome.failures, outcome.failures
    raised = 0
    for r, res in sorted(outcome.results.items()):
        assert res["source_intact"], f"rank {r}: a failed move changed a source buffer"
        if res["error"] is None:  # the race above: it has everything rank 2 was to send it
            assert res["from_dead_elements"] > 0 and res["from_dead_arrived"] == res["from_dead_elements"], res
            continue
        raised += 1
        assert res["error"].startswith("PeerLost: move "), res
        assert dying in res["lost"] and f"lost rank {dying}" in res["error"], res["error"]
    assert raised, "every survivor finished: rank 2 died after its move was over"
    copies_world.replace(dying)
    for r, res in enumerate(copies_world.run(rank_jobs.move_and_check, src, dst, budget_bytes=64 << 20)):
        assert res["wrong"] == [], f"after replacing rank {dying}: rank {r}: {res['wrong']}"
        assert res["report"].same_host_messages == res["report"].messages > 0


_EXIT_SCRIPT = """
import os, sys
os.environ[sys.argv[1]] = "1"
import rank_jobs
from rlhf_switch.launch import LocalWorld
from rlhf_switch.vps import ParallelConfig, build_layout, synthetic_spec
spec = synthetic_spec([("wide.row", (64, 4096), "float32", "row"), ("narrow.row", (256, 64), "float32", "row"),
                       ("norm", (512,), "float32", "replicate")], name="exit")
src, dst = build_layout(spec, ParallelConfig(dp=4, dp_shard="fsdp")), build_layout(spec, ParallelConfig(tp=4))
if __name__ == "__main__":
    for _ in range(int(sys.argv[2])):
        with LocalWorld(4, timeout=120) as world:
            for seed in range(3):
                for r in world.run(rank_jobs.move_and_check, src, dst, seed=seed):
                    assert r["wrong"] == [] and r["report"].read_messages > 0, r
"""


@pytest.mark.heavy  # left out of `make test-fast`
def test_ranks_whose_readers_copied_exit_without_an_abort(tmp_path):
    """A rank process that received by same-host copies ends cleanly: its readers are ended
    before the interpreter stops its threads. (Before, a reader still sending the last
    acknowledgement — posted after its receive was complete, so the rank could finish first —
    died inside gloo's C++ code at exit, and the process printed "terminate called without an
    active exception": in 3 of 4 runs of this script, so this test catches it most times, not
    every time.) Four worlds, three moves each."""
    import subprocess
    import sys
    script = tmp_path / "exit_cleanly.py"
    script.write_text(_EXIT_SCRIPT)
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(here), here]))
    out = subprocess.run([sys.executable, str(script), same_host.MIN_BYTES_ENV, "4"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "terminate called" not in out.stderr, out.stderr[-3000:]


# --- the agreement in shared memory (same_host._Board) -------------------------------------------

def _boards(n: int, pids=None):
    """``n`` boards of one process, each mapping the others' tensors (their peers' pages shared
    the way ``for_group`` maps them, without processes)."""
    pages = [torch.zeros(same_host._Board.numel(n), dtype=torch.int64).share_memory_() for _ in range(n)]
    pids = pids or [os.getpid()] * n
    return [same_host._Board(r, pids, pages[r], {p: pages[p] for p in range(n) if p != r}) for r in range(n)]


needs_board = pytest.mark.skipif(same_host._futex() is None, reason="the board needs futex(2) on x86-64 Linux")


@needs_board
def test_a_board_gathers_every_row_across_threads_and_keeps_two_agreements_apart():
    import threading
    from datetime import timedelta
    boards = _boards(3)
    got = {}

    def rank(r):
        for k in range(1, 6):
            fin = boards[r].start([r, k, -r, 1 << 60])
            got[r, k] = fin(timedelta(seconds=10))

    threads = [threading.Thread(target=rank, args=(r,)) for r in (1, 2)]
    for t in threads:
        t.start()
    rank(0)
    for t in threads:
        t.join(10)
    for r in range(3):
        for k in range(1, 6):
            assert got[r, k] == [[q, k, -q, 1 << 60] for q in range(3)], (r, k)


@needs_board
def test_a_board_wait_names_a_peer_that_closed_exited_or_never_came():
    import subprocess
    import sys
    from datetime import timedelta
    boards = _boards(2)
    boards[1].close()
    with pytest.raises(same_host.PeerGone, match="rank 1 closed") as e:
        boards[0].start([0] * 4)(timedelta(seconds=5))
    assert e.value.peer == 1
    with pytest.raises(RuntimeError, match="closed its group"):
        boards[1].start([0] * 4)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    boards = _boards(2, [os.getpid(), gone.pid])
    with pytest.raises(same_host.PeerGone, match=f"rank 1's process \\({gone.pid}\\) has exited"):
        boards[0].start([0] * 4)(timedelta(seconds=5))
    boards = _boards(2)
    fin = boards[0].start([0] * 4)
    assert not fin.done()
    with pytest.raises(RuntimeError, match="Timed out"):
        fin(timedelta(seconds=0.3))


@needs_board
def test_offers_on_the_board_reach_their_receivers_and_are_acknowledged_by_count():
    """Rank 0 writes its read messages' offers (one marked as going over gloo) before its row;
    once the agreement is in, each receiver finds its own, in order, and its acknowledgements
    complete the sender's waits. Offers too many for the page go over gloo, all of them."""
    import threading
    from datetime import timedelta
    boards = _boards(3)
    offers = {1: [[11, 12, 13], None, [14]], 2: [[21] * 40]}
    assert boards[0].post_offers(offers)
    fins = [b.start([0] * 4) for b in boards]
    for f in fins:
        f(timedelta(seconds=5))
    k = boards[1].seq
    assert [boards[1].offer(0, k, j) for j in range(3)] == offers[1]
    assert boards[2].offer(0, k, 0) == offers[2][0]
    with pytest.raises(RuntimeError, match="offered 3 read messages to rank 1"):
        boards[1].offer(0, k, 3)
    with pytest.raises(RuntimeError, match="Timed out .* acknowledgement"):
        boards[0].wait_acknowledged(1, 1, timedelta(seconds=0.2))
    later = threading.Timer(0.1, lambda: [boards[1].acknowledge(0) for _ in range(2)])
    later.start()
    boards[0].wait_acknowledged(1, 2, timedelta(seconds=5))  # woken by the second count
    later.join()
    boards[2].acknowledge(0)
    boards[0].wait_acknowledged(2, 1, timedelta(seconds=5))
    # the next move's offers go in the other slot; too many: all over gloo
    assert not boards[0].post_offers({1: [[7] * same_host._Board.OFFERS_NUMEL]})
    for f in [b.start([0] * 4) for b in boards]:
        f(timedelta(seconds=5))
    assert boards[1].offer(0, k + 1, 0) is None
    boards[2].close()
    with pytest.raises(same_host.PeerGone, match="rank 2 closed .* acknowledgement") as e:
        boards[0].wait_acknowledged(2, 2, timedelta(seconds=5))
    assert e.value.peer == 2


def test_every_move_agrees_once_on_the_board(copies_world, layouts4):
    src, dst = layouts4["fsdp"], layouts4["tp4"]
    copies_world.run(rank_jobs.move_and_check, src, dst)  # the group's probe has run: its board is up
    before = copies_world.run(rank_jobs.board_agreements)
    for seed in range(2):
        for r, res in enumerate(copies_world.run(rank_jobs.move_and_check, src, dst, seed=seed)):
            assert res["wrong"] == [], f"rank {r}: {res['wrong']}"
    after = copies_world.run(rank_jobs.board_agreements)
    if same_host._futex() is None:
        assert after == [None] * 4
    else:
        assert None not in before and [a - b for a, b in zip(after, before)] == [2] * 4, (before, after)


def test_a_refused_move_is_refused_everywhere_through_the_board(copies_world, layouts4):
    src, dst = layouts4["fsdp"], layouts4["tp4"]
    copies_world.run(rank_jobs.move_and_check, src, dst)
    before = copies_world.run(rank_jobs.board_agreements)
    results = copies_world.run(rank_jobs.move_with_bad_buffer_on, 2, src, dst)
    for r, res in enumerate(results):
        assert res["error"] is not None and res["error"].startswith("MoveError"), (r, res)
        assert "rank 2" in res["error"], res["error"]
    after = copies_world.run(rank_jobs.board_agreements)
    if same_host._futex() is not None:
        assert [a - b for a, b in zip(after, before)] == [1] * 4, (before, after)
    for r, res in enumerate(copies_world.run(rank_jobs.move_and_check, src, dst)):
        assert res["wrong"] == [], f"after the refusal: rank {r}: {res['wrong']}"


@pytest.mark.heavy  # left out of `make test-fast`
def test_switched_off_the_agreement_stays_on_gloo(layouts4):
    patch = pytest.MonkeyPatch()
    patch.setenv(same_host.BOARD_ENV, "0")
    try:
        with LocalWorld(4, timeout=120) as world:
            for r, res in enumerate(world.run(rank_jobs.move_and_check, layouts4["fsdp"], layouts4["tp4"])):
                assert res["wrong"] == [], f"rank {r}: {res['wrong']}"
            assert world.run(rank_jobs.board_agreements) == [None] * 4
    finally:
        patch.undo()


def test_the_board_switched_off_on_one_rank_keeps_the_whole_group_on_gloo(copies_world, layouts4):
    """Each rank says in the probe whether it would use a board: one that would not keeps every
    rank on the gloo collective (split, half the group would wait on rows never written)."""
    results = copies_world.run(rank_jobs.move_on_a_new_group_with_the_board_off_on, 1,
                               layouts4["fsdp"], layouts4["tp4"])
    for r, res in enumerate(results):
        assert res["wrong"] == [], f"rank {r}: {res['wrong']}"
        assert res["board"] is False, r


@pytest.mark.slow
@needs_board
def test_a_rank_dead_before_the_agreement_is_named_without_waiting_for_the_deadline(copies_world, layouts4):
    """Rank 3 dies just before its move: the others, waiting for its row on the board, see its
    process gone (checked every ``_Board.POLL_S``) and raise PeerLost naming it well inside the
    deadline; after it is replaced, the new world agrees on a new board and moves exactly."""
    _a_death_is_named_at_once(copies_world, layouts4["fsdp"], layouts4["tp4"], "before_move",
                              same_host.PEER_GONE)
    assert None not in copies_world.run(rank_jobs.board_agreements)


def _a_death_is_named_at_once(world, src, dst, point: str, said: str, shared: bool = False) -> None:
    """Rank 3 dies at ``point`` (``fault_jobs``): every survivor raises PeerLost naming it, with
    ``said`` in the error, inside the census (a board wait checks its peer every ``POLL_S``:
    0.10-0.13 s here, neither the 20 s deadline nor the census); sources intact; after rank 3 is
    replaced the same move is exact."""
    deadline = Deadlines(floor_s=20.0, min_rate=50e6, ceiling_s=60.0, arrival_s=20.0, census_s=4.0)
    world.run(rank_jobs.move_and_check, src, dst)  # the probe is done: the board is up
    outcome = world.run_all(fault_jobs.move_with_a_death, 3, point, src, dst, deadline, 1 << 20, shared=shared)
    assert outcome.dead == [3] and not outcome.failures, outcome
    for r in (0, 1, 2):
        res = outcome.results[r]
        print(f"rank {r}: {res['elapsed_s']:.2f} s: {res['error'][:200]}")
        assert res["error"] is not None and res["error"].startswith("PeerLost: move "), res
        assert res["lost"] == [3] and "lost rank 3" in res["error"], res["error"]
        assert said in res["error"], res["error"]
        assert res["elapsed_s"] < deadline.census_s, res
        assert res["source_intact"]
    world.replace(3)
    for r, res in enumerate(world.run(rank_jobs.move_and_check, src, dst, shared=shared)):
        assert res["wrong"] == [], f"after replacing rank 3: rank {r}: {res['wrong']}"
        assert not shared or res["report"].board_messages > 0, str(res["report"])


@pytest.mark.slow
@needs_board
def test_a_receiver_dead_before_it_acknowledges_a_board_offer_is_named_at_once(copies_world):
    """Rank 3 dies as it takes a read message offered on the board: its senders, waiting on the
    board for its acknowledgement (no gloo message to close), see its process gone within
    ``_Board.POLL_S`` and raise PeerLost naming it, well inside their deadlines; their sources are
    intact, and after rank 3 is replaced the new world moves exactly."""
    _a_death_is_named_at_once(copies_world, build_layout(READS_SPEC, ParallelConfig(dp=4, dp_shard="fsdp")),
                              build_layout(READS_SPEC, ParallelConfig(tp=4)), "taking_a_board_offer",
                              "acknowledgement of a read message", shared=True)


def test_rank_bitmasks_of_large_groups_cross_the_gather_in_int64_words():
    """The probe's verdicts (per rank: which ranks it reads, which it maps) travel as int64s; a
    group of more than 63 ranks on hosts that read each other would overflow one (before: the
    probe raised at the first move of such a group)."""
    for world in (1, 4, 62, 63, 64, 200, 1024):
        words = same_host._mask_words(world)
        for mask in (0, 1, (1 << world) - 1, (1 << world) - 1 - (1 << (world - 1)), 0x5555 % (1 << world)):
            parts = same_host._to_words(mask, words)
            assert len(parts) == words and all(0 <= p < 1 << 63 for p in parts), (world, parts)
            assert torch.tensor(parts, dtype=torch.int64).tolist() == parts
            assert same_host._from_words(parts) == mask, (world, mask)
