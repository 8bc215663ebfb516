"""Planner correctness without processes: every plan is applied in one process to all ranks'
buffers and checked bit for bit against a direct construction of the destination layout."""
from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from catalogue import CONFIGS, configs4, named_layouts, synthetic_specs
from rank_jobs import tensor_source
from rlhf_switch.vps import (ADAM_FIELDS, PARAM, LayoutError, build_layout,
                             plan_rank, plan_transition, replicated, zero)
from rlhf_switch.vps.materialize import allocate, bits, coverage_masks, materialize
from rlhf_switch.vps.spec import itemsize


def apply_plan(plan, src_bufs, dst_bufs):
    for t in plan.transfers:
        s = torch.as_strided(src_bufs[t.src][t.src_buffer], t.box.shape, t.src_strides, t.src_offset)
        d = torch.as_strided(dst_bufs[t.dst][t.dst_buffer], t.box.shape, t.dst_strides, t.dst_offset)
        d.copy_(s)


def brute_force_minimum(src, dst) -> int:
    """Bytes every rank lacks, counted element by element with masks."""
    total = 0
    for r in range(dst.world_size):
        have: dict = {}
        for f in src.fragments(r):
            m = have.setdefault(f.key, torch.zeros(src.spec[f.key.tensor].shape, dtype=torch.bool))
            m[tuple(slice(l, h) for l, h in zip(f.box.lo, f.box.hi))] = True
        for f in dst.fragments(r):
            need = torch.zeros(dst.spec[f.key.tensor].shape, dtype=torch.bool)
            need[tuple(slice(l, h) for l, h in zip(f.box.lo, f.box.hi))] = True
            if f.key in have:
                need &= ~have[f.key]
            total += int(need.sum()) * itemsize(dst.buffers(r)[f.buffer].dtype)
    return total


def check_move(src, dst, seed=0):
    W = src.world_size
    tensor_of = tensor_source(src, seed)
    plan = plan_transition(src, dst)
    src_bufs = [materialize(src, r, tensor_of) for r in range(W)]
    dst_bufs = [allocate(dst, r, fill=None) for r in range(W)]
    for bufs in dst_bufs:
        for t in bufs.values():
            bits(t).view(-1).fill_(0x5A)  # recognisable garbage
    apply_plan(plan, src_bufs, dst_bufs)
    for r in range(W):
        expected = materialize(dst, r, tensor_of)
        masks = coverage_masks(dst, r)
        for name, t in dst_bufs[r].items():
            m = masks[name]
            assert torch.equal(bits(t)[m], bits(expected[name])[m]), f"{src} -> {dst}: rank {r} {name}"
            assert (bits(t)[~m].to(torch.int64) & 0xFF).eq(0x5A).all(), f"padding written on rank {r} {name}"
    # one rank's own plan is exactly its share of everyone's
    everyone = set(plan.transfers)
    mine = [plan_rank(src, dst, r) for r in range(W)]
    assert set(t for p in mine for t in p.local + p.sends + p.recvs) == everyone
    for p in mine:
        assert all(t.src == p.rank or t.dst == p.rank for t in p.local + p.sends + p.recvs)
    assert sum(p.bytes_received for p in mine) == plan.bytes_moved
    assert plan.bytes_moved == plan.min_bytes == brute_force_minimum(src, dst)
    return plan


@pytest.mark.parametrize("src_name,dst_name", list(itertools.product(CONFIGS, CONFIGS)))
def test_every_named_pair_is_exact_and_minimal(layouts4, src_name, dst_name):
    plan = check_move(layouts4[src_name], layouts4[dst_name])
    if src_name == dst_name:
        assert plan.bytes_moved == 0 and plan.bytes_local > 0


def test_tied_embeddings_under_pp(tiny_tied_spec):
    lays = named_layouts(tiny_tied_spec)
    for a, b in [("tp2xpp2", "zero3"), ("zero3", "tp2xpp2"), ("pp2", "tp4"), ("tp4", "pp2")]:
        check_move(lays[a], lays[b])
    # the last stage holds the embedding as its LM head: a replica of the same key
    pp2 = lays["pp2"]
    assert {f.buffer for f in pp2.fragments(2) if f.key.tensor == "model.embed_tokens.weight"} == {"param/lm_head.weight"}


def test_optimizer_state_moves_with_the_weights(tiny_spec):
    """ZeRO-1 (params whole, fp32 master + Adam moments flat-partitioned) to TP2×DP2[zero3] with
    every field, and back: one plan serves all fields, each in its own dtype."""
    fields = (PARAM,) + ADAM_FIELDS
    z1 = zero(tiny_spec, 4, stage=1, fields=fields)
    tp = build_layout(tiny_spec, CONFIGS["tp2xdp2"], fields)
    z3 = zero(tiny_spec, 4, stage=3, fields=fields)
    for a, b in [(z1, tp), (tp, z1), (z1, z3), (z3, z1)]:
        plan = check_move(a, b)
        assert {t.key.field for t in plan.transfers} == set(fields)
    # ZeRO-1 → ZeRO-1 keeps every byte where it is
    assert plan_transition(z1, z1).bytes_moved == 0


def test_cast_on_the_wire_counts_destination_bytes(tiny_spec):
    fp32 = replicated(tiny_spec, 4)
    bf16 = build_layout(tiny_spec, CONFIGS["tp2xpp2"], param_dtype="bfloat16")
    plan = plan_transition(fp32, bf16)
    assert all(t.dtype == "bfloat16" for t in plan.transfers)
    assert plan.bytes_moved == 0  # every rank of a replicated source already holds what it needs
    plan = plan_transition(build_layout(tiny_spec, CONFIGS["zero3"]), bf16)
    assert plan.bytes_moved == plan.min_bytes == brute_force_minimum(build_layout(tiny_spec, CONFIGS["zero3"]), bf16)


def test_replica_choice_prefers_self_then_node_then_spreads(tiny_spec):
    src = replicated(tiny_spec, 4)
    dst = build_layout(tiny_spec, CONFIGS["tp4"])
    assert all(t.src == t.dst for t in plan_transition(src, dst).transfers)
    # TP2×DP2 → TP4: each TP4 piece has two holders; with 2 ranks per node the same node wins
    src = build_layout(tiny_spec, CONFIGS["tp2"])
    plan = plan_transition(src, dst, ranks_per_node=2)
    assert all(t.src // 2 == t.dst // 2 for t in plan.transfers)
    # without node information, the two replicas share the sending
    sent = plan_transition(src, build_layout(tiny_spec, CONFIGS["zero3"])).link_bytes()
    per_sender = {s: sum(b for (a, _), b in sent.items() if a == s) for s in range(4)}
    assert min(per_sender.values()) > 0.5 * max(per_sender.values())


def test_plans_are_cached_and_digests_name_inputs(layouts4):
    a, b = layouts4["zero3"], layouts4["tp2xpp2"]
    assert plan_transition(a, b) is plan_transition(a, b)
    assert plan_rank(a, b, 1) is plan_rank(a, b, 1)
    assert plan_rank(a, b, 0).digest == plan_rank(a, b, 3).digest == plan_transition(a, b).digest
    assert plan_transition(a, b).digest != plan_transition(b, a).digest
    p0, p1 = plan_rank(a, b, 0), plan_rank(a, b, 1)
    assert p0.pair_digests[1] == p1.pair_digests[0]


def test_refusals_name_the_problem(tiny_spec, tiny_tied_spec, layouts4):
    other = named_layouts(tiny_tied_spec)["tp2"]
    with pytest.raises(LayoutError, match="different models"):
        plan_transition(layouts4["tp2"], other)
    with pytest.raises(LayoutError, match="world sizes differ"):
        plan_transition(replicated(tiny_spec, 2), layouts4["tp2"])
    with pytest.raises(LayoutError, match=r"wants fields \['exp_avg'"):
        plan_transition(layouts4["tp2"], build_layout(tiny_spec, CONFIGS["zero3"], ("param", "exp_avg")))


def test_source_that_does_not_hold_everything_is_refused(tiny_spec, layouts4):
    from rlhf_switch.vps import Layout
    full = layouts4["tp2"]
    # drop rank 1's (and its DP replica rank 3's) fragments of one tensor: nobody holds that shard
    gone = "model.layers.1.mlp.up_proj.weight"
    frags = [tuple(f for f in full.fragments(r) if not (r % 2 == 1 and f.key.tensor == gone)) for r in range(4)]
    holey = Layout(tiny_spec, frags, [full.buffers(r) for r in range(4)], "holey")
    with pytest.raises(LayoutError, match="does not cover"):
        holey.validate()
    with pytest.raises(LayoutError, match=f"holds only .* {gone}"):
        plan_transition(holey, layouts4["replicated"])


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_specs_and_layouts(data):
    spec = data.draw(synthetic_specs())
    fields = data.draw(st.sampled_from([("param",), ("param", "exp_avg")]))
    src = build_layout(spec, data.draw(configs4(spec)), fields).validate()
    dst = build_layout(spec, data.draw(configs4(spec)), fields).validate()
    check_move(src, dst, seed=data.draw(st.integers(0, 3)))
    assert plan_transition(dst, dst).bytes_moved == 0


def test_moe_expert_parallel_to_vllm_and_back():
    """Qwen3-MoE shapes: experts as tensors, EP carved out of DP, vLLM's stacked w13/w2."""
    from rlhf_switch.vps import ParallelConfig
    from rlhf_switch.vps.layouts.vllm import vllm_layout
    from rlhf_switch.vps.spec import qwen3_moe_spec

    spec = qwen3_moe_spec(dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=32, moe_intermediate_size=32, num_experts=4, vocab_size=100))
    trains = [build_layout(spec, ParallelConfig(dp=4, ep=4, dp_shard="zero")),
              build_layout(spec, ParallelConfig(pp=2, dp=2, ep=2, dp_shard="zero3")),
              build_layout(spec, ParallelConfig(tp=2, dp=2, ep=2, dp_shard="fsdp", vocab_divisible_by=2,
                                                fuse_gate_up=True))]
    # DP4·EP4: rank 2 holds experts 2 only (whole), and every dense tensor's quarter
    experts = {f.key.tensor.split(".")[5] for f in trains[0].fragments(2) if ".experts." in f.key.tensor}
    assert experts == {"2"}
    for train in trains:
        for gen in (vllm_layout(spec, 2, replicas=2), vllm_layout(spec, 4)):
            check_move(train, gen)
            check_move(gen, train)
    with pytest.raises(LayoutError, match="EP=3 does not divide num_experts=4"):
        build_layout(spec, ParallelConfig(dp=3, ep=3))
