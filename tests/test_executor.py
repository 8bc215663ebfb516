"""Real moves: 4 gloo processes, real point-to-point transfers, checked bit for bit.

One 4-rank world serves the whole module (starting ranks costs seconds, a move milliseconds).
"""
from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rank_jobs
from catalogue import CONFIGS, configs4, synthetic_specs
from rlhf_switch.launch import RankError
from rlhf_switch.routing import prepare
from rlhf_switch.vps import ADAM_FIELDS, PARAM, Layout, StateKey, build_layout, plan_transition, zero
from rlhf_switch.vps.materialize import allocate

PAIRS = list(itertools.product(CONFIGS, CONFIGS))


def run_move(world, src, dst, **kw):
    results = world.run(rank_jobs.move_and_check, src, dst, **kw)
    for r, res in enumerate(results):
        assert res["wrong"] == [], f"{src} -> {dst} rank {r}: {res['wrong']}"
    reports = [res["report"] for res in results]
    plan = plan_transition(src, dst)
    assert sum(rep.bytes_received for rep in reports) == plan.min_bytes
    assert sum(rep.bytes_sent for rep in reports) == plan.min_bytes
    for rep in reports:
        assert rep.bytes_received == rep.min_bytes_received
        assert rep.peak_staging_bytes <= rep.budget_bytes
        assert rep.peak_staging_bytes == rep.planned_peak_staging_bytes
    return reports


def test_all_named_pairs_move_exactly(world4, layouts4):
    """Every pair among replicated, ZeRO-1 flat, ZeRO-3, FSDP, TP2, TP4, PP2, TP2×DP2, TP2×PP2."""
    for a, b in PAIRS:
        reports = run_move(world4, layouts4[a], layouts4[b], seed=len(a) + len(b))
        if a == b:
            assert all(rep.bytes_sent == rep.bytes_received == 0 and rep.messages == 0 for rep in reports)


def test_weights_and_adam_state_in_one_move(world4, tiny_spec):
    fields = (PARAM,) + ADAM_FIELDS
    z1 = zero(tiny_spec, 4, stage=1, fields=fields)
    tp = build_layout(tiny_spec, CONFIGS["tp2xdp2"], fields)
    run_move(world4, z1, tp)
    run_move(world4, tp, zero(tiny_spec, 4, stage=3, fields=fields))


def test_budget_smaller_than_the_largest_tensor(world4, layouts4, tiny_spec):
    largest = max(t.numel * 4 for t in tiny_spec.tensors)
    budget = largest // 8
    src, dst = layouts4["zero3"], layouts4["tp2xpp2"]
    reports = run_move(world4, src, dst, budget_bytes=budget)
    assert max(rep.peak_staging_bytes for rep in reports) <= budget
    # the same move with a roomy budget sends fewer, larger messages
    roomy = run_move(world4, src, dst, budget_bytes=64 << 20)
    assert sum(r.messages for r in roomy) < sum(r.messages for r in reports)


def test_message_count_is_what_the_schedule_says(world4, layouts4):
    src, dst = layouts4["fsdp"], layouts4["tp4"]
    reports = run_move(world4, src, dst, budget_bytes=1 << 20)
    for r, rep in enumerate(reports):
        sched = prepare(src, dst, r, allocate(src, r), allocate(dst, r), 1 << 20)
        assert rep.messages == sched.messages
        links = plan_transition(src, dst).link_bytes()
        assert len(sched.exchanges) == len({b if a == r else a for (a, b) in links if r in (a, b)})


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_layout_pairs_on_real_ranks(world4, data):
    spec = data.draw(synthetic_specs())
    src = build_layout(spec, data.draw(configs4(spec)))
    dst = build_layout(spec, data.draw(configs4(spec)))
    budget = data.draw(st.sampled_from([64, 256, 1 << 20]))
    run_move(world4, src, dst, budget_bytes=budget, seed=data.draw(st.integers(0, 5)))


def test_bad_buffers_on_one_rank_stop_every_rank_before_any_byte(world4, layouts4):
    results = world4.run(rank_jobs.move_with_bad_buffer_on, 2, layouts4["zero3"], layouts4["tp2xpp2"])
    for r, res in enumerate(results):
        assert res["error"].startswith("MoveError: move DP4[zero3] -> TP2·PP2 refused before any data moved: rank 2:")
        assert "missing 'param/lm_head.weight'" in res["error"]
        assert res["untouched"], f"rank {r} wrote into its destination"


def test_destination_in_source_memory_is_refused_before_any_byte(world4, layouts4):
    # local copies run while transfers are in flight: an aliased buffer would be read after it
    # was overwritten, so the move is refused on every rank
    results = world4.run(rank_jobs.move_into_source_memory_on, 1, layouts4["fsdp"], layouts4["tp2xpp2"])
    for r, res in enumerate(results):
        assert res["error"].startswith("MoveError: move DP4[fsdp] -> TP2·PP2 refused before any data moved: rank 1:")
        assert "share memory" in res["error"], res["error"]
        assert res["untouched"], f"rank {r} wrote into its destination"


def test_plan_digest_mismatch_is_caught(world4, layouts4):
    # rank 3 was handed another destination layout: every rank refuses, naming who planned what
    results = world4.run(rank_jobs.move_with_different_dst_on, 3, layouts4["zero3"],
                         layouts4["tp2xpp2"], layouts4["tp2"])
    for res in results:
        assert res["error"].startswith("MoveError: plan digest mismatch")
        assert "ranks [0, 1, 2] planned" in res["error"] and "ranks [3] planned" in res["error"]
        assert res["untouched"]


def test_world_size_mismatch_is_refused(world4, tiny_spec):
    two = build_layout(tiny_spec, CONFIGS["tp2"].__class__(tp=2))
    with pytest.raises(RankError, match="this process group has 4"):
        world4.run(rank_jobs.move_and_check, two, two)


def _without(layout, rank, tensor):
    frags = [tuple(f for f in layout.fragments(r) if not (r == rank and f.key.tensor == tensor))
             for r in range(layout.world_size)]
    return Layout(layout.spec, frags, [layout.buffers(r) for r in range(layout.world_size)], "holey")


def test_destination_that_does_not_cover_the_model_is_refused(world4, layouts4):
    holey = _without(layouts4["tp2xpp2"], 1, "model.layers.0.mlp.up_proj.weight")
    for res in world4.run(rank_jobs.attempt_move, layouts4["zero3"], holey):
        assert res["error"].startswith("MoveError: move DP4[zero3] -> holey refused before any data moved: every rank:")
        assert "model.layers.0.mlp.up_proj.weight: ranks hold 3072 of its 6144 elements" in res["error"]
        assert res["untouched"]


def test_unknown_tensor_names_are_refused(world4, layouts4, tiny_spec):
    good = layouts4["fsdp"]
    frags = [tuple(f._replace(key=StateKey("model.layers.9.mlp.up_proj.weight")) if i == 0 else f
                   for i, f in enumerate(good.fragments(r))) for r in range(4)]
    bad = Layout(tiny_spec, frags, [good.buffers(r) for r in range(4)], "renamed")
    for res in world4.run(rank_jobs.attempt_move, layouts4["zero3"], bad):
        assert "unknown tensor 'model.layers.9.mlp.up_proj.weight'" in res["error"]
        assert res["untouched"]


def test_move_over_a_bare_process_group(world4, layouts4):
    """The group a trainer and vLLM workers form is not registered with torch.distributed."""
    run_move(world4, layouts4["tp2xdp2"], layouts4["pp2"], bare_group=True)


def test_the_world_survives_refusals(world4, layouts4):
    run_move(world4, layouts4["pp2"], layouts4["fsdp"])


def _unpicklable():
    import threading
    return threading.Lock()


def test_a_job_returning_something_unpicklable_fails_at_once(world4):
    with pytest.raises(RankError, match="cannot pickle"):
        world4.run(_unpicklable, timeout=30)


@pytest.mark.parametrize("merge", [0, pytest.param(128 << 10, marks=pytest.mark.heavy)])
def test_zero_copy_and_overlapped_moves_are_exact_and_reuse_their_schedule(world4, layouts4, merge):
    """Zero-copy messages (``MERGE_BYTES`` 0: every contiguous piece goes straight from/into the
    buffers) and staged ones in flight together, under a roomy and a tiny budget; the second,
    identical move runs from the cached schedule."""
    cases = [(a, b, budget) for a, b in [("zero3", "tp4"), ("fsdp", "tp2xpp2"), ("zero1-flat", "tp2xdp2")]
             for budget in (1000, 1 << 20)] + [("tp2xdp2", "pp2", 64)]
    for a, b, budget in cases:
        src, dst = layouts4[a], layouts4[b]
        results = world4.run(rank_jobs.move_twice_with_merge, merge, src, dst, budget_bytes=budget)
        plan = plan_transition(src, dst)
        for r, res in enumerate(results):
            assert res["wrong"] == [], f"{a} -> {b} (budget {budget}) rank {r}: {res['wrong']}"
            assert res["reused"]
            for rep in res["reports"]:
                assert rep.bytes_received == rep.min_bytes_received
                assert rep.peak_staging_bytes == rep.planned_peak_staging_bytes <= budget
        assert sum(res["reports"][0].bytes_sent for res in results) == plan.min_bytes


def test_strided_local_copies_at_storage_offsets_are_exact(world4, layouts4):
    """Pairs whose same-rank pieces are strided at the source (row-parallel splits: FSDP/ZeRO-3 ->
    TP4) or at the destination (TP -> FSDP/ZeRO-3), and pairs whose local copies merge, with every
    buffer a view at a storage offset inside a larger tensor: bit-exact, nothing outside the views
    written, bytes = the minimum, staging within the budget."""
    for a, b in [("fsdp", "tp4"), ("zero3", "tp4"), ("tp4", "fsdp"), ("tp2xdp2", "zero3")]:
        src, dst = layouts4[a], layouts4[b]
        results = world4.run(rank_jobs.move_at_storage_offsets, src, dst, budget_bytes=4096)
        plan = plan_transition(src, dst)
        for r, res in enumerate(results):
            assert res["wrong"] == [], f"{a} -> {b} rank {r}: {res['wrong']}"
            rep = res["report"]
            assert rep.bytes_received == rep.min_bytes_received
            assert rep.peak_staging_bytes == rep.planned_peak_staging_bytes <= 4096
        assert sum(res["report"].bytes_local for res in results) == plan.bytes_local > 0
        assert sum(res["report"].bytes_sent for res in results) == plan.min_bytes


def test_a_copy_between_two_strided_views_at_storage_offsets():
    """The executor's copy (``_Bound.copy``), one straight copy between two strided views (a
    column block of one buffer into a column block of another), both buffers views at storage
    offsets, against torch's own indexing; nothing else in either storage changes."""
    import torch

    from rlhf_switch.routing.executor import _Bound
    from rlhf_switch.routing.schedule import Copy
    g = torch.Generator().manual_seed(3)
    src_host = torch.randn(7 + 6 * 10, generator=g)
    dst_host = torch.randn(5 + 4 * 9, generator=g)
    src, dst = src_host[7:].view(6, 10), dst_host[5:].view(4, 9)  # storage offsets 7 and 5
    before_src, before_dst = src_host.clone(), dst_host.clone()
    # rows 1..4, columns 2..6 of src -> rows 0..3, columns 4..8 of dst
    c = Copy("w", 1 * 10 + 2, (10, 1), "w", 0 * 9 + 4, (9, 1), (4, 5), "float32")
    _Bound({"w": src}, {"w": dst}, None).copy(c)
    want = before_dst.clone()
    want[5:].view(4, 9)[0:4, 4:9] = src[1:5, 2:7]
    assert torch.equal(dst_host.view(torch.int32), want.view(torch.int32))
    assert torch.equal(src_host.view(torch.int32), before_src.view(torch.int32))


def test_the_staging_pool_is_kept_for_the_next_move_never_over_its_budget_nor_shared():
    """A completed move leaves its CPU staging pool for the next (fresh pages cost more than the
    packing); a move takes it only when it fits and is within its own budget, and holds it
    alone while it runs."""
    import torch

    from rlhf_switch.routing import executor

    cpu = torch.device("cpu")
    executor._POOLS.pop(cpu, None)
    first = executor._take_pool(cpu, 4096, 1 << 20)
    executor._give_pool(first)
    again = executor._take_pool(cpu, 1000, 1 << 20)  # smaller: a slice of the kept pool
    assert again.numel() == 1000 and again.data_ptr() == first.data_ptr()
    other = executor._take_pool(cpu, 1000, 1 << 20)  # the kept pool is in use: a new one
    assert other.data_ptr() != first.data_ptr()
    executor._give_pool(again)
    executor._give_pool(other)  # not bigger than the kept one: dropped
    assert executor._POOLS[cpu].data_ptr() == first.data_ptr()
    small_budget = executor._take_pool(cpu, 1000, 2048)  # the kept 4096 B would exceed this budget
    assert small_budget.data_ptr() != first.data_ptr() and small_budget.numel() == 1000
    executor._POOLS.pop(cpu, None)


def test_the_cyclic_gc_is_held_off_during_a_move_and_restored_after(world4, layouts4):
    """A full collection starting on one rank mid-move stalls its peers (``gc_paused``): no
    message is posted with it on, and a move leaves it as it found it, on or off."""
    for res in world4.run(rank_jobs.move_watching_gc, layouts4["zero3"], layouts4["tp4"]):
        for before, seen in res.items():
            assert seen["wrong"] == []
            assert seen["during"] and not any(seen["during"])
            assert seen["after"] is before
