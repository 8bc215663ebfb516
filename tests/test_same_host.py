"""Same-host copies (routing/same_host.py): large messages between ranks of one host copied
straight out of the sender's memory. Real moves on 4 gloo processes, checked bit for bit; every
message goes this way here (the threshold set to 1 byte before the world starts), and a sender
killed while its receiver copies out of it is named like any lost rank."""
from __future__ import annotations

import pytest

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


def test_staging_reused_only_after_the_receiver_copied(copies_world, layouts4):
    """A budget far below the move: staged blocks are reused many times, each only once its
    receiver has acknowledged its copy (otherwise later bytes would overwrite earlier ones)."""
    reports = run_move(copies_world, layouts4["tp2xpp2"], layouts4["fsdp"], budget_bytes=4096)
    _all_copies(reports)
    assert any(rep.peak_staging_bytes > 0 for rep in reports)


def test_a_bare_group_uses_them_too(copies_world, layouts4):
    _all_copies(run_move(copies_world, layouts4["zero3"], layouts4["tp4"], bare_group=True))


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

