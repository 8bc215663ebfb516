"""The NCCL posting discipline: the two ends of every message post it at the same place.

NCCL matches the messages between two ranks by posting order alone (no tags). A move posts, on
both ends of every pair, the same sequence of messages with the same sizes — whatever each end
stages — and a rank that would post another order is refused before a byte moves. Checked three ways: on the schedules of every rank (no processes), on what real
ranks record posting (``MoveHooks.post``), and with a deliberately mis-ordered program on
one rank (``MoveHooks.posting_order``).
"""
from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rank_jobs
from catalogue import CONFIGS, configs4, synthetic_specs
from rlhf_switch.routing import prepare
from rlhf_switch.vps import build_layout, plan_transition
from rlhf_switch.vps.materialize import allocate

Posts = list[tuple[int, bool, int]]  # what one rank posted, in order: (peer, send?, bytes)


def misordered(posts: dict[int, Posts]) -> list[str]:
    """Every pair (a, b) whose messages a -> b are not received by b in the order a sent them,
    at the same sizes: what NCCL would mis-match (the check fires on any non-empty answer)."""
    bad = []
    for a, b in itertools.permutations(sorted(posts), 2):
        sent = [n for p, s, n in posts[a] if p == b and s]
        received = [n for p, s, n in posts[b] if p == a and not s]
        if sent != received:
            at = next((i for i, (x, y) in enumerate(zip(sent, received)) if x != y), min(len(sent), len(received)))
            bad.append(f"{a} -> {b}: message {at} sent as {sent[at:at + 3]} B, received as {received[at:at + 3]} B")
    return bad


def ordered_posts(schedule, batches=None) -> Posts:
    """What the executor posts on this schedule's rank (``executor._run``)."""
    out = []
    for b in schedule.batches if batches is None else batches:
        for m in b.messages:
            ex = schedule.exchanges[m.exchange]
            chunk = ex.steps[m.step][0 if m.send else 1]
            out.append((ex.peer, m.send, chunk.nbytes))
    return out


def tagged_posts(schedule) -> Posts:
    """What the executor once posted (the "tagged" discipline, each message of a pair
    under its own tag): every direct message at once, then the staged ones in the staging
    program's order — the two ends of a message staged on one side only at different places."""
    out = []
    for ex in schedule.exchanges:
        for send, recv in ex.steps:
            if recv is not None and not recv.stage_recv:
                out.append((ex.peer, False, recv.nbytes))
            if send is not None and not send.stage_send:
                out.append((ex.peer, True, send.nbytes))
    for st_ in schedule.staged[0]:
        ex = schedule.exchanges[st_.exchange]
        send, recv = ex.steps[st_.step]
        if st_.recv_bytes:
            out.append((ex.peer, False, recv.nbytes))
        if st_.send_bytes:
            out.append((ex.peer, True, send.nbytes))
    return out


def schedules(src, dst, budget):
    return [prepare(src, dst, r, allocate(src, r), allocate(dst, r), budget) for r in range(src.world_size)]


PAIRS = [(a, b) for a, b in itertools.product(CONFIGS, CONFIGS) if a != b]


SMALL = [("zero3", "tp2xpp2"), ("fsdp", "tp4"), ("tp2xdp2", "pp2"), ("zero1-flat", "tp2")]  # 64 B: ~10^4 messages each


@pytest.mark.parametrize("budget", [pytest.param(b, marks=pytest.mark.heavy) for b in (64, 1000)] + [1 << 20])
def test_both_ends_of_every_message_post_it_at_the_same_place(layouts4, budget):
    """Every named pair (a few under a 64 B budget), three budgets: the ordered programs match
    message for message; the whole per-pair sequence (both directions interleaved) is the same
    on both ends, and so is its digest (what the agreement compares)."""
    for a, b in SMALL if budget == 64 else PAIRS:
        scheds = schedules(layouts4[a], layouts4[b], budget)
        posts = {r: ordered_posts(s) for r, s in enumerate(scheds)}
        assert misordered(posts) == [], (a, b, budget)
        for r, s in enumerate(scheds):
            for ex in s.exchanges:
                mine = [(r < ex.peer) == send for p, send, _ in posts[r] if p == ex.peer]
                theirs = [(ex.peer < r) == send for p, send, _ in posts[ex.peer] if p == r]
                assert mine == theirs  # the same (direction) sequence, seen from both ends
                assert s.message_digests[ex.peer] == scheds[ex.peer].message_digests[r]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_layout_pairs_post_in_the_same_order_on_both_ends(data):
    spec = data.draw(synthetic_specs())
    src = build_layout(spec, data.draw(configs4(spec)))
    dst = build_layout(spec, data.draw(configs4(spec)))
    budget = data.draw(st.sampled_from([32, 64, 256, 1000, 1 << 20]))
    scheds = schedules(src, dst, budget)
    assert misordered({r: ordered_posts(s) for r, s in enumerate(scheds)}) == []


def _misordered_tagged_case(layouts4):
    """A named pair and budget where the pre-issue-13 order posts some message at different
    places on its two ends (one end stages it, the other does not)."""
    for budget in (1000, 64, 1 << 20):
        for a, b in PAIRS:
            scheds = schedules(layouts4[a], layouts4[b], budget)
            if misordered({r: tagged_posts(s) for r, s in enumerate(scheds)}):
                return a, b, budget
    raise AssertionError("the pre-issue-13 order posts every pair in order: no case to show")


def test_the_check_fires_on_the_old_order_and_on_a_swapped_program(layouts4):
    a, b, budget = _misordered_tagged_case(layouts4)
    scheds = schedules(layouts4[a], layouts4[b], budget)
    assert misordered({r: tagged_posts(s) for r, s in enumerate(scheds)})
    # two sends swapped on one rank: caught by the check, and by the agreement's digests
    swapped = rank_jobs.swap_two_sends(scheds[1])
    posts = {r: ordered_posts(s) for r, s in enumerate(scheds)}
    posts[1] = ordered_posts(scheds[1], swapped)
    moved = [(x, y) for x, y in zip(ordered_posts(scheds[1]), posts[1]) if x != y]
    if moved:  # the two sizes differ (a batch is one peer): the recorded sequences show it
        assert misordered(posts)
    # equal sizes or not, the digest of the posting order differs: the agreement refuses
    peers = {scheds[1].exchanges[m.exchange].peer for bt in swapped for m in bt.messages}
    assert any(scheds[1].digest_messages(swapped).get(p) != scheds[1].message_digests[p] for p in peers)


@pytest.mark.heavy  # left out of `make test-fast`
def test_real_ranks_post_both_ends_of_every_message_at_the_same_place(world4, layouts4):
    """Recorded on 4 gloo ranks, including the case the old order mis-posted: moves are exact,
    bytes = minimum, every rank posts exactly its schedule's program, and every pair matches."""
    a, b, budget = _misordered_tagged_case(layouts4)
    cases = [(a, b, budget), ("zero3", "tp2xpp2", 1000), ("fsdp", "tp4", 64), ("zero1-flat", "tp2xdp2", 1 << 20)]
    for x, y, bud in cases:
        src, dst = layouts4[x], layouts4[y]
        results = world4.run(rank_jobs.move_recording_posts, src, dst, budget_bytes=bud)
        assert all(res["wrong"] == [] for res in results), (x, y, bud)
        assert sum(res["report"].bytes_received for res in results) == plan_transition(src, dst).min_bytes
        posts = {r: res["posts"] for r, res in enumerate(results)}
        scheds = schedules(src, dst, bud)
        assert all(posts[r] == ordered_posts(s) for r, s in enumerate(scheds))  # the program, as run
        assert misordered(posts) == [], (x, y, bud)


@pytest.mark.heavy  # left out of `make test-fast`
def test_a_rank_posting_in_another_order_is_refused_before_any_byte(world4, layouts4):
    """Rank 1 would post two of its sends in swapped order, or rank 2 cut other messages (another
    budget): every rank refuses in the agreement (the digests cover each pair's messages and
    their order), and no destination byte is written."""
    results = world4.run(rank_jobs.move_misordered_on, 1, layouts4["zero3"], layouts4["tp2xpp2"], 1000)
    for r, res in enumerate(results):
        assert res["error"] is not None and res["error"].startswith("MoveError:"), (r, res["error"])
        assert "posting order" in res["error"], res["error"]
        assert res["untouched"], f"rank {r} wrote into its destination"
    # a rank under another budget cuts other messages: refused the same way (the transfers agree)
    results = world4.run(rank_jobs.move_with_budget_on, 2, 4096, layouts4["zero3"], layouts4["tp2xpp2"], 1000)
    for r, res in enumerate(results):
        assert res["error"] is not None and "posting order" in res["error"], (r, res["error"])
        assert res["untouched"], f"rank {r} wrote into its destination"
    # the same world then moves exactly
    results = world4.run(rank_jobs.move_recording_posts, layouts4["zero3"], layouts4["tp2xpp2"], budget_bytes=1000)
    assert all(res["wrong"] == [] for res in results)
