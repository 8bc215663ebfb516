"""Planner correctness without processes: every plan is applied in one process to all ranks'
buffers and checked bit for bit against a direct construction of the destination layout."""
from __future__ import annotations

import itertools
import zlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from catalogue import CONFIGS, configs4, named_layouts, synthetic_specs
from rank_jobs import tensor_source
from rlhf_switch.vps import (ADAM_FIELDS, PARAM, LayoutError, StateKey, build_layout, llama_spec,
                             minimum_bytes_received, plan_rank, plan_transition, replicated, zero)
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


def check_move(src, dst, seed=0, ranks_per_node=None):
    W = src.world_size
    tensor_of = tensor_source(src, seed)
    plan = plan_transition(src, dst, ranks_per_node)
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
    mine = [plan_rank(src, dst, r, ranks_per_node) for r in range(W)]
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


# =================================================================================================
# The documented holder choice, the posting order both ends rely on, and a node preference
# =================================================================================================

def documented_choices(src, dst, ranks_per_node=None):
    """Sorted ``(holder, requester, key, piece)`` of every transfer of ``src -> dst``, by the rule
    the planner documents, written out here from fragments alone (``src``'s boxes of a key must be
    equal or disjoint): a requester that holds the piece copies it locally; the others, in rank
    order (position ``i``), take holder ``(i + crc32(f"{tensor}|{field}|{piece.lo}")) % n`` of the
    piece's ``n`` holders in rank order — of the holders on the requester's node when
    ``ranks_per_node`` is given and there are some there."""
    W = src.world_size
    out = []
    for key in {f.key for r in range(W) for f in dst.fragments(r)}:
        held, wanted = {}, {}
        for r in range(W):
            for f in src.fragments(r):
                if f.key == key:
                    held.setdefault(f.box, []).append(r)
            for f in dst.fragments(r):
                if f.key == key:
                    wanted.setdefault(f.box, []).append(r)
        boxes = sorted(held)
        assert all(a.intersect(b) is None for a, b in itertools.combinations(boxes, 2)), key
        for dbox, requesters in wanted.items():
            for sbox in boxes:
                piece = sbox.intersect(dbox)
                if piece is None:
                    continue
                holders = held[sbox]
                out += [(d, d, key, piece) for d in requesters if d in holders]
                rot = zlib.crc32(f"{key.tensor}|{key.field}|{piece.lo}".encode())
                for i, d in enumerate(d for d in requesters if d not in holders):
                    pool = holders
                    if ranks_per_node:
                        pool = [h for h in holders if h // ranks_per_node == d // ranks_per_node] or holders
                    out.append((pool[(i + rot) % len(pool)], d, key, piece))
    return sorted(out)


def check_posting_order(src, dst, ranks_per_node=None):
    """What two ranks rely on without talking: rank r's sends to p are, in order, p's receives
    from r (a pair posts its messages in the same order), grouped by peer, and in canonical order
    within a peer (the model's tensor order, then the field's name, then the box); the pair
    digests agree; each rank's minimum is ``minimum_bytes_received``."""
    W = src.world_size
    index = {t.name: i for i, t in enumerate(src.spec.tensors)}
    fields = sorted(src.fields())
    plans = [plan_rank(src, dst, r, ranks_per_node) for r in range(W)]
    for p in plans:
        def canon(peer, t):
            return (peer, index[t.key.tensor], fields.index(t.key.field), t.box.lo)
        assert [canon(t.dst, t) for t in p.sends] == sorted(canon(t.dst, t) for t in p.sends)
        assert [canon(t.src, t) for t in p.recvs] == sorted(canon(t.src, t) for t in p.recvs)
        assert all(t.src == t.dst == p.rank for t in p.local)
        assert p.min_bytes_received == minimum_bytes_received(src, dst, p.rank)
        assert p.peers() == sorted({t.dst for t in p.sends} | {t.src for t in p.recvs})
        for q in range(W):
            if q == p.rank:
                continue
            sent = [t for t in p.sends if t.dst == q]
            assert sent == [t for t in plans[q].recvs if t.src == p.rank], (p.rank, q)
            if q in p.pair_digests:
                assert plans[q].pair_digests[p.rank] == p.pair_digests[q]
    assert sum(p.bytes_sent for p in plans) == sum(p.bytes_received for p in plans)
    return plans


SMALL = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
             intermediate_size=16, vocab_size=20, tie_word_embeddings=False)
SMALL_MOE4 = dict(hidden_size=8, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=2,
                  moe_intermediate_size=4, num_experts=4, vocab_size=16)


def _small_pairs():
    from rlhf_switch.vps import ParallelConfig, vllm_layout
    from rlhf_switch.vps.spec import qwen3_moe_spec

    spec = llama_spec(SMALL, name="small")
    lay = {n: build_layout(spec, c) for n, c in {
        "tp2": ParallelConfig(tp=2, dp=2, vocab_divisible_by=2),
        "pp2": ParallelConfig(pp=2, dp=2),
        "zero3": ParallelConfig(dp=4, dp_shard="zero3"),
        "zero": ParallelConfig(dp=4, dp_shard="zero"),
        "tp2xpp2": ParallelConfig(tp=2, pp=2, fuse_qkv=True, vocab_divisible_by=2),
        "fsdp2xtp2": ParallelConfig(tp=2, dp=2, dp_shard="fsdp", fuse_gate_up=True, vocab_divisible_by=2)}.items()}
    lay["vllm2x2"] = vllm_layout(spec, 2, replicas=2)
    moe = qwen3_moe_spec(SMALL_MOE4)
    ep = build_layout(moe, ParallelConfig(dp=4, ep=2))
    ep_pp = build_layout(moe, ParallelConfig(pp=2, dp=2, ep=2))
    return [(lay["tp2"], lay["pp2"]), (lay["pp2"], lay["tp2"]), (lay["tp2"], lay["zero3"]),
            (lay["zero3"], lay["tp2xpp2"]), (lay["tp2xpp2"], lay["vllm2x2"]), (lay["vllm2x2"], lay["tp2"]),
            (lay["fsdp2xtp2"], lay["zero"]), (lay["zero"], lay["fsdp2xtp2"]), (lay["tp2"], lay["zero"]),
            (ep, vllm_layout(moe, 2, replicas=2)), (vllm_layout(moe, 2, replicas=2), ep), (ep, ep_pp), (ep_pp, ep)]


@pytest.mark.parametrize("ranks_per_node", [None, 2, 3])
def test_holder_choice_is_the_documented_rule(ranks_per_node):
    """Everyone's plan and every rank's own part follow the holder rule written out in
    ``documented_choices``, with and without a node preference (nodes of 2: {0,1} {2,3}; of 3:
    {0,1,2} {3}), and both ends of a pair agree on the order of their messages."""
    for src, dst in _small_pairs():
        plan = plan_transition(src, dst, ranks_per_node)
        got = sorted((t.src, t.dst, t.key, t.box) for t in plan.transfers)
        assert got == documented_choices(src, dst, ranks_per_node), f"{src} -> {dst}"
        plans = check_posting_order(src, dst, ranks_per_node)
        assert sorted(t for p in plans for t in p.local + p.sends + p.recvs) == \
            sorted(plan.transfers + tuple(t for t in plan.transfers if t.src != t.dst))
        assert sum(p.bytes_received for p in plans) == plan.bytes_moved
        assert sum(p.bytes_local for p in plans) == plan.bytes_local


def test_moves_with_a_node_preference_are_exact():
    """``check_move`` (bits, minimum bytes, every rank's part) with nodes of 2 and of 3 ranks; the
    last pairs' source is a stage-wide flat partition of a tied model under PP, whose embedding
    boxes overlap (the first stage's and the LM head's flat ranges start at different places)."""
    from rlhf_switch.vps import ParallelConfig

    tied = llama_spec({**SMALL, "tie_word_embeddings": True}, name="small-tied")
    flat = build_layout(tied, ParallelConfig(pp=2, dp=2, dp_shard="zero"))
    assert not flat._partition
    pairs = _small_pairs()[:9] + [(flat, build_layout(tied, ParallelConfig(tp=2, dp=2, vocab_divisible_by=2))),
                                  (flat, build_layout(tied, ParallelConfig(dp=4, dp_shard="zero3")))]
    for src, dst in pairs:
        for rpn in (2, 3):
            check_move(src, dst, ranks_per_node=rpn)
            check_posting_order(src, dst, rpn)


def _two_rank_pair(field="param"):
    """Rank 0 holds all of w (4×3 float32), rank 1 nothing; the destination splits w's rows 2 + 2."""
    from rlhf_switch.vps import BufferSpec, Fragment, Layout, StateKey, Box, synthetic_spec

    spec = synthetic_spec([("w", (4, 3), "float32", "replicate")])
    k = StateKey("w", field)
    buf = f"{field}/w"
    src = Layout(spec, [[Fragment(k, Box((0, 0), (4, 3)), buf, 0, (3, 1))], []],
                 [{buf: BufferSpec(12, "float32")}, {}], name="one")
    dst = Layout(spec, [[Fragment(k, Box((0, 0), (2, 3)), buf, 1, (3, 1))],
                        [Fragment(k, Box((2, 0), (4, 3)), buf, 0, (3, 1))]],
                 [{buf: BufferSpec(7, "float32")}, {buf: BufferSpec(6, "bfloat16")}], name="rows")
    return src, dst


def test_a_hand_plan_of_two_ranks():
    """Every number of a plan small enough to write by hand: offsets, strides, dtypes, bytes, text."""
    from rlhf_switch.vps import Box, StateKey, Transfer

    src, dst = _two_rank_pair("exp_avg")
    k = StateKey("w", "exp_avg")
    local = Transfer(0, 0, k, Box((0, 0), (2, 3)), "exp_avg/w", 0, (3, 1), "exp_avg/w", 1, (3, 1), "float32")
    sent = Transfer(0, 1, k, Box((2, 0), (4, 3)), "exp_avg/w", 6, (3, 1), "exp_avg/w", 0, (3, 1), "bfloat16")
    plan = plan_transition(src, dst)
    assert plan.transfers == (local, sent)
    assert (local.numel, local.nbytes, sent.numel, sent.nbytes) == (6, 24, 6, 12)  # bf16 travels as the destination
    assert str(sent) == "0->1 w[exp_avg][2:4,0:3] (12 B)"
    assert (plan.bytes_moved, plan.bytes_local, plan.min_bytes, plan.world_size) == (12, 24, 12, 2)
    assert plan.link_bytes() == {(0, 1): 12}
    assert plan.transition == "one -> rows"
    assert str(plan) == "one -> rows: 2 pieces, 12 B across ranks (minimum 12 B), 24 B local"
    p0, p1 = plan_rank(src, dst, 0), plan_rank(src, dst, 1)
    assert (p0.local, p0.sends, p0.recvs, p1.local, p1.sends, p1.recvs) == ((local,), (sent,), (), (), (), (sent,))
    assert (p0.rank, p0.world_size, p1.rank, p0.transition) == (0, 2, 1, "one -> rows")
    assert (p0.bytes_sent, p0.bytes_received, p0.bytes_local, p0.min_bytes_received) == (12, 0, 24, 0)
    assert (p1.bytes_sent, p1.bytes_received, p1.bytes_local, p1.min_bytes_received) == (0, 12, 0, 12)
    assert p0.peers() == [1] and p1.peers() == [0]
    assert set(p0.pair_digests) == {1} and p0.pair_digests[1] == p1.pair_digests[0]
    assert str(p0) == ("rank 0 of one -> rows: 1 local copies (24 B), 1 sends (12 B) to 1 peers, "
                       "0 receives (0 B, minimum 0 B)")
    assert str(p1) == ("rank 1 of one -> rows: 0 local copies (0 B), 0 sends (0 B) to 0 peers, "
                       "1 receives (12 B, minimum 12 B)")
    # the way back: rank 1 sends its rows (bf16 there, cast to the destination's float32)
    back = plan_transition(dst, src)
    assert back.transfers == (Transfer(0, 0, k, Box((0, 0), (2, 3)), "exp_avg/w", 1, (3, 1), "exp_avg/w", 0, (3, 1), "float32"),
                              Transfer(1, 0, k, Box((2, 0), (4, 3)), "exp_avg/w", 0, (3, 1), "exp_avg/w", 6, (3, 1), "float32"))
    assert plan_rank(dst, src, 0).recvs == back.transfers[1:]
    assert plan_rank(dst, src, 1).sends == back.transfers[1:]
    assert plan_rank(dst, src, 1).min_bytes_received == 0 and plan_rank(dst, src, 0).min_bytes_received == 24


def test_refusals_say_which_layouts_and_ranks():
    src, dst = _two_rank_pair()
    with pytest.raises(LayoutError, match=r"^rank 2 is outside a world of 2$"):
        plan_rank(src, dst, 2)
    with pytest.raises(LayoutError, match=r"^rank -1 is outside a world of 2$"):
        plan_rank(src, dst, -1)
    assert plan_rank(src, dst, 1).rank == 1
    other = replicated(llama_spec(SMALL, name="small"), 2)
    with pytest.raises(LayoutError, match=r"^cannot move one \(model 'synthetic'\) into DP2 \(model 'small'\): "
                                          r"the layouts describe different models$"):
        plan_transition(src, other)
    spec = llama_spec(SMALL, name="small")
    with pytest.raises(LayoutError, match=r"^cannot move DP2 \(2 ranks\) into DP4 \(4 ranks\): world sizes differ$"):
        plan_rank(replicated(spec, 2), replicated(spec, 4), 0)
    with pytest.raises(LayoutError, match=r"^DP2 wants fields \['exp_avg', 'master'\] that DP2 does not hold$"):
        plan_rank(replicated(spec, 2), replicated(spec, 2, fields=("param", "master", "exp_avg")), 0)


def test_a_source_that_misses_elements_is_refused_on_every_path():
    """Rank 0 holds rows 0:3 of w only: rank 1's rows 2:4 are half missing, and every planning path
    (everyone's plan, a rank's own part with and without a node preference) names the hole."""
    from rlhf_switch.vps import BufferSpec, Fragment, Layout, StateKey, Box

    src, dst = _two_rank_pair()
    holey = Layout(src.spec, [[Fragment(StateKey("w"), Box((0, 0), (3, 3)), "param/w", 0, (3, 1))], []],
                   [{"param/w": BufferSpec(9, "float32")}, {}], name="holey")
    msg = r"^holey holds only 3 of the 6 elements of w\[2:4,0:3\] that rows needs$"
    with pytest.raises(LayoutError, match=msg):
        plan_transition(holey, dst)
    for rpn in (None, 1):
        with pytest.raises(LayoutError, match=msg):
            plan_rank(holey, dst, 1, rpn)
    assert plan_rank(holey, dst, 0).recvs == ()  # rank 0's own rows are all there
    # a rank wanting two boxes of the key takes the general walk: the same refusal
    two = Layout(src.spec, [[Fragment(StateKey("w"), Box((0, 0), (2, 3)), "param/w", 0, (3, 1))],
                            [Fragment(StateKey("w"), Box((2, 0), (3, 3)), "param/w", 0, (3, 1)),
                             Fragment(StateKey("w"), Box((3, 0), (4, 3)), "param/w", 3, (3, 1))]],
                 [{"param/w": BufferSpec(6, "float32")}, {"param/w": BufferSpec(6, "float32")}], name="two")
    msg = r"^holey holds only 0 of the 3 elements of w\[3:4,0:3\] that two needs$"
    with pytest.raises(LayoutError, match=msg):
        plan_transition(holey, two)
    for rpn in (None, 1):
        with pytest.raises(LayoutError, match=msg):
            plan_rank(holey, two, 1, rpn)


def test_the_general_walk_gives_every_key_the_same_transfers():
    """``_plan_key`` is the walk ``plan_rank`` takes for a key whose boxes overlap or that a rank
    holds several boxes of; run here on every key, in both of its documented modes: everyone's
    transfers (``rank`` None) are ``plan_transition``'s, and a rank's (its destination boxes given
    or found by itself) are the ones it sends or receives there."""
    from rlhf_switch.vps.planner import _plan_key

    for src, dst in _small_pairs()[:9] + _six_rank_pairs():
        for rpn in (None, 2, 3):
            plan = plan_transition(src, dst, rpn)
            for key in {t.key for t in plan.transfers}:
                everyone = sorted(t for t in plan.transfers if t.key == key)
                assert sorted(_plan_key(key, src, dst, None, rpn)) == everyone, (str(src), str(dst), key)
                for r in range(src.world_size):
                    mine = [t for t in everyone if r in (t.src, t.dst)]
                    boxes = {f.box for f in dst.fragments(r) if f.key == key}
                    assert sorted(_plan_key(key, src, dst, r, rpn)) == mine
                    assert sorted(_plan_key(key, src, dst, r, rpn, boxes)) == mine


def _six_rank_pairs():
    """Three replicas of each TP shard (holders {0, 2, 4} and {1, 3, 5}) into PP2×DP3, and back:
    with one node of 6 (or 3), a requester picks among three (two) holders on its node."""
    from rlhf_switch.vps import ParallelConfig

    spec = llama_spec(SMALL, name="small")
    tp = build_layout(spec, ParallelConfig(tp=2, dp=3, vocab_divisible_by=2))
    pp = build_layout(spec, ParallelConfig(pp=2, dp=3))
    return [(tp, pp), (pp, tp)]


@pytest.mark.parametrize("ranks_per_node", [None, 3, 6])
def test_holder_choice_among_three_replicas_on_a_node(ranks_per_node):
    for src, dst in _six_rank_pairs():
        plan = plan_transition(src, dst, ranks_per_node)
        assert sorted((t.src, t.dst, t.key, t.box) for t in plan.transfers) == \
            documented_choices(src, dst, ranks_per_node)
        check_posting_order(src, dst, ranks_per_node)
        check_move(src, dst, ranks_per_node=ranks_per_node)


def test_posting_order_with_several_fields():
    """Keys are ordered by the model's tensor order, then by field name: a tensor's exp_avg and
    master go out right after its param, before the next tensor's."""
    from rlhf_switch.vps import ParallelConfig

    spec = llama_spec(SMALL, name="small")
    fields = ("param", "master", "exp_avg")
    src = build_layout(spec, ParallelConfig(tp=2, dp=2, vocab_divisible_by=2), fields)
    dst = build_layout(spec, ParallelConfig(dp=4, dp_shard="zero3"), fields)
    plans = check_posting_order(src, dst)
    sent = [t.key for t in plans[0].sends if t.dst == 1]
    keys = list(dict.fromkeys(sent))
    assert keys[:3] == [StateKey(keys[0].tensor, f) for f in ("exp_avg", "master", "param")]
    plan = plan_transition(src, dst)
    assert sorted((t.src, t.dst, t.key, t.box) for t in plan.transfers) == documented_choices(src, dst)


def test_pair_digests_see_both_directions():
    """A pair's digest covers what the lower rank sends and what it receives: changing a transfer
    either way changes it on both ends."""
    from rlhf_switch.vps.planner import _pair_digests

    src, dst = _two_rank_pair()
    p0, p1 = plan_rank(src, dst, 0), plan_rank(src, dst, 1)  # 0 sends to 1
    q0, q1 = plan_rank(dst, src, 0), plan_rank(dst, src, 1)  # 1 sends to 0
    assert p0.pair_digests[1] == p1.pair_digests[0] and q0.pair_digests[1] == q1.pair_digests[0]
    assert p0.pair_digests[1] != q0.pair_digests[1]
    for plan in (p0, p1, q0, q1):
        for attr in ("sends", "recvs"):
            ts = getattr(plan, attr)
            if not ts:
                continue
            changed = (ts[0]._replace(dst_offset=ts[0].dst_offset + 1),) + ts[1:]
            sends, recvs = (changed, plan.recvs) if attr == "sends" else (plan.sends, changed)
            peer = 1 - plan.rank
            assert _pair_digests(plan.rank, sends, recvs)[peer] != plan.pair_digests[peer], (plan.rank, attr)


# --- how much work a plan takes: counted, not timed ---------------------------------------------------

class _Counted:
    """Counts the calls of ``cls.name`` inside a ``with`` (the method itself still runs)."""

    def __init__(self, monkeypatch, cls, name):
        self.calls, orig = 0, getattr(cls, name)

        def counted(*args, **kwargs):
            self.calls += 1
            return orig(*args, **kwargs)
        monkeypatch.setattr(cls, name, counted)


def test_planning_work_is_one_intersection_per_piece_and_one_view_per_fragment(monkeypatch):
    """The planner's complexity contract, by hand counts on a key of many boxes: each destination
    box is intersected only with the source regions that can meet it (the skip-ahead over the
    regions sorted by their lower corner), and a piece sent to many replicas computes each
    fragment's view of it once (replicas share their fragment). Work, not wall time: a slower
    plan is the same plan."""
    from rlhf_switch.vps import ParallelConfig, synthetic_spec
    from rlhf_switch.vps.layout import Fragment
    from rlhf_switch.vps.planner import _plan_key
    from rlhf_switch.vps.space import Box

    spec = synthetic_spec([("w", (16, 4), "float32", "column")])
    key = StateKey("w")
    def rows():
        return build_layout(spec, ParallelConfig(dp=16, dp_shard="fsdp"))  # 16 boxes of one row each
    halves = build_layout(spec, ParallelConfig(tp=2, dp=8))  # 2 boxes of 8 rows, 8 replicas each
    every = build_layout(spec, ParallelConfig(dp=16))  # the whole tensor on all 16 ranks
    cases = [(rows(), rows(), 16, 16, 32), (halves, every, 32, 2, 4), (every, halves, 16, 2, 4)]
    for src, dst, n, intersections, views in cases:
        plan_transition.cache_clear()
        want = sorted(plan_transition(src, dst).transfers)  # also fills the layouts' own caches
        assert len(want) == n
        # plan_transition also intersects each rank's one destination box with its one source box
        # (the minimum it could receive): 16 more
        for plan, extra in ((lambda: sorted(_plan_key(key, src, dst, None, None)), 0),
                            (lambda: sorted(plan_transition(src, dst).transfers), 16)):
            plan_transition.cache_clear()
            meets, viewed = _Counted(monkeypatch, Box, "intersect"), _Counted(monkeypatch, Fragment, "view")
            assert plan() == want
            monkeypatch.undo()
            # one intersection per (destination box, source region) pair that meets; one view per
            # fragment per piece: every fragment of a replicated box is one shared object
            assert (meets.calls, viewed.calls) == (intersections + extra, views), (str(src), str(dst), extra)


def test_planning_a_rank_costs_the_same_for_any_number_of_like_layers(monkeypatch):
    """A rank works out how a box of one geometry (shape, split, holders) is received and sent
    once, and reuses it for every key of that geometry (a model's layers, a MoE layer's experts):
    six layers cost it no more fragment views than two."""
    from rlhf_switch.vps import ParallelConfig, vllm_layout
    from rlhf_switch.vps.layout import Fragment
    from rlhf_switch.vps.planner import plan_rank

    counts = {}
    for layers in (2, 6):
        spec = llama_spec(dict(SMALL, num_hidden_layers=layers, num_key_value_heads=2), name="small")
        pairs = [(build_layout(spec, ParallelConfig(tp=2, dp=2)), vllm_layout(spec, 4)),
                 (vllm_layout(spec, 2, 2), build_layout(spec, ParallelConfig(tp=2, dp=2, fuse_qkv=True,
                                                                             fuse_gate_up=True)))]
        for i, (src, dst) in enumerate(pairs):
            plans = [plan_rank(src, dst, r) for r in range(4)]  # the layouts' own caches filled
            plan_rank.cache_clear()
            viewed = _Counted(monkeypatch, Fragment, "view")
            assert [plan_rank(src, dst, r) for r in range(4)] == plans
            monkeypatch.undo()
            counts.setdefault(i, []).append(viewed.calls)
    assert all(two == six > 0 for two, six in counts.values()), counts


@pytest.mark.parametrize("ranks_per_node", [None, 4])
def test_a_sender_ships_from_its_own_copy_where_holders_keep_a_box_at_different_offsets(ranks_per_node):
    """Ranks 0-2 each hold all of ``a`` at a different offset of their buffer (4·rank); ranks 3-7
    want it (with 4 ranks a node, rank 3 shares a node with the holders). Every rank's own plan
    sends from its own copy (the offset of the rank that sends), and the per-rank plans are the
    global plan's transfers."""
    from rlhf_switch.vps import BufferSpec, Fragment, Layout, StateKey, Box, synthetic_spec

    spec = synthetic_spec([("a", (4,), "float32", "replicate")])
    k, buf, whole = StateKey("a"), "param/a", Box((0,), (4,))
    src = Layout(spec, [[Fragment(k, whole, buf, 4 * r, (1,))] if r < 3 else [] for r in range(8)],
                 [{buf: BufferSpec(12, "float32")} if r < 3 else {} for r in range(8)], name="offsets")
    dst = Layout(spec, [[Fragment(k, whole, buf, 0, (1,))] if r >= 3 else [] for r in range(8)],
                 [{buf: BufferSpec(4, "float32")} if r >= 3 else {} for r in range(8)], name="wanted")
    sends = [t for r in range(8) for t in plan_rank(src, dst, r, ranks_per_node).sends]
    assert sorted(t.dst for t in sends) == [3, 4, 5, 6, 7]
    assert all(t.src_offset == 4 * t.src and t.dst_offset == 0 for t in sends), sends
    assert sorted(sends) == sorted(t for t in plan_transition(src, dst, ranks_per_node).transfers if t.src != t.dst)
    assert len({t.src for t in sends}) > 1  # the requesters are spread over the holders
