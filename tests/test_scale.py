"""Planning at scale is metadata only: a 70B model on 64 ranks is planned without torch.

Times are reported by ``make bench`` (bench/plan_scale.py), never asserted here."""
from __future__ import annotations

import subprocess
import sys
import textwrap


def test_70b_on_64_ranks_one_rank_plans_its_part_without_tensors():
    code = textwrap.dedent("""
        import sys
        from rlhf_switch.vps import ParallelConfig, build_layout, llama_spec, plan_rank
        cfg = dict(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                   intermediate_size=28672, vocab_size=128256, torch_dtype="bfloat16")
        spec = llama_spec(cfg)
        src = build_layout(spec, ParallelConfig(tp=8, pp=2, dp=4, dp_shard="zero3"))
        dst = build_layout(spec, ParallelConfig(tp=4, dp=16, fuse_qkv=True, fuse_gate_up=True))
        for rank in (0, 37, 63):
            p = plan_rank(src, dst, rank)
            assert p.bytes_received == p.min_bytes_received > 0, p
            # a TP4 rank holds a quarter of the 70B model in bf16; everything not already local arrives
            need = sum(f.box.numel for f in dst.fragments(rank)) * 2
            assert p.bytes_received + p.bytes_local == need, (p, need)
        assert "torch" not in sys.modules, "planning imported torch"
        print("ok", spec.numel)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    n = int(out.stdout.split()[1])
    assert 69e9 < n < 72e9  # Llama-3-70B has 70.6B parameters


# --- the fast paths planning at scale takes give the plain paths' answers -------------------------

import itertools  # noqa: E402

import pytest  # noqa: E402

from rlhf_switch.vps import (PARAM, BufferSpec, Fragment, Layout, ParallelConfig, StateKey,  # noqa: E402
                             build_layout, llama_spec, plan_rank)
from rlhf_switch.vps import planner  # noqa: E402
from rlhf_switch.vps.layout import _pairwise_disjoint  # noqa: E402
from rlhf_switch.vps.layouts import data_parallel  # noqa: E402
from rlhf_switch.vps.layouts.vllm import vllm_buffer, vllm_layout, worker_tensors  # noqa: E402
from rlhf_switch.vps.spec import qwen3_moe_spec  # noqa: E402

SMALL_MOE = qwen3_moe_spec(dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=2,
                                head_dim=16, moe_intermediate_size=32, num_experts=8, vocab_size=100))
TIED = llama_spec(dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                       intermediate_size=96, vocab_size=250, tie_word_embeddings=True, attention_bias=True),
                  name="tied")


def eager_copy(lay: Layout) -> Layout:
    """The same layout as plain per-rank lists (no rank classes built on demand, no holders())."""
    return Layout(lay.spec, [lay.fragments(r) for r in range(lay.world_size)],
                  [lay.buffers(r) for r in range(lay.world_size)], lay.name)


def holder_rows(boxes) -> list:
    items = boxes.items() if isinstance(boxes, dict) else boxes
    return [(b, [(h.fragment, tuple(h.ranks), h.dtype) for h in held]) for b, held in items]


def assert_same_holders(lazy: Layout, eager: Layout) -> None:
    for key in eager.all_keys():
        assert holder_rows(lazy._key_index(key)) == holder_rows(eager._key_index(key)), key
        boxes = list(eager._key_index(key))
        probes = boxes + [type(b)((0,) * len(b.lo), tuple(max(1, h // 3) for h in b.hi)) for b in boxes]
        for box in probes:
            assert holder_rows(lazy._meeting(key, box)) == holder_rows(eager._meeting(key, box)), (key, box)
            assert holder_rows([(box, lazy._holders_of(key, box))]) == \
                holder_rows([(box, eager._holders_of(key, box))]), (key, box)
        if lazy._partition:
            assert _pairwise_disjoint(sorted(eager._key_index(key))), f"{lazy}: {key} boxes overlap"


@pytest.mark.parametrize("spec,tp,replicas", [(SMALL_MOE, 1, 2), (SMALL_MOE, 4, 2), (SMALL_MOE, 16, 1),
                                              (TIED, 2, 3), (TIED, 8, 1)])
def test_lazy_vllm_layout_is_the_plain_construction(spec, tp, replicas):
    """Worker by worker, ``vllm_layout`` holds what ``worker_tensors`` describes, and its
    per-tensor ``holders`` answer what an index over every rank answers."""
    lay = vllm_layout(spec, tp, replicas)
    first = {vllm_buffer(g.buffer): g.members[0] for g in spec.fused}  # vLLM's names (MoE: routed_experts.*)
    for r in range(lay.world_size):
        pieces, numels = data_parallel.replicate(worker_tensors(spec, tp, r % tp), 1, 0)
        assert lay.fragments(r) == tuple(Fragment(StateKey(n, PARAM), box, f"{PARAM}/{buf}", off, strides)
                                         for n, box, buf, off, strides in pieces)
        assert dict(lay.buffers(r)) == {f"{PARAM}/{b}": BufferSpec(n, spec[first.get(b, b)].dtype)
                                        for b, n in numels.items()}
    assert_same_holders(vllm_layout(spec, tp, replicas), eager_copy(lay))


MESHES = [ParallelConfig(tp=tp, pp=pp, dp=dp, ep=ep, dp_shard=sh, fuse_qkv=fuse, fuse_gate_up=fuse, vocab_divisible_by=8)
          for tp, pp, dp, ep, sh, fuse in itertools.product((1, 2), (1, 2), (2, 4), (1, 2), ("replicate", "zero3", "zero"),
                                                            (False, True))
          if (tp + pp + dp + ep + len(sh) + fuse) % 3 == 0]  # a third of them, every factor varied


@pytest.mark.parametrize("spec,cfg", [(s, c) for s in (SMALL_MOE, TIED) for c in MESHES if c.ep == 1 or s.num_experts],
                         ids=lambda x: x.name if hasattr(x, "tensors") else str(x).replace("·", "x"))  # ASCII ids: mutmut passes them back
def test_lazy_mesh_holders_are_the_index(spec, cfg):
    lay = build_layout(spec, cfg, fields=("param", "exp_avg"))
    assert_same_holders(build_layout(spec, cfg, fields=("param", "exp_avg")), eager_copy(lay))


def plain_rank_plan(src, dst, rank, ranks_per_node):
    """``plan_rank`` as it was before its own-part fast path: the general per-key walk for every key."""
    keys = sorted(src.keys(rank) | dst.keys(rank), key=planner._order(src))
    wanted = {}
    for f in dst.fragments(rank):
        wanted.setdefault(f.key, set()).add(f.box)
    ts = [t for k in keys for t in planner._plan_key(k, src, dst, rank, ranks_per_node, wanted.get(k, set()))]
    position = {k: i for i, k in enumerate(keys)}
    return (tuple(t for t in ts if t.src == t.dst == rank),
            tuple(sorted((t for t in ts if t.src == rank != t.dst), key=lambda t: (t.dst, position[t.key], t.box.lo))),
            tuple(sorted((t for t in ts if t.dst == rank != t.src), key=lambda t: (t.src, position[t.key], t.box.lo))))


@pytest.mark.heavy  # left out of `make test-fast`
def test_rank_plan_fast_path_is_the_plain_walk_on_a_small_moe():
    trains = [ParallelConfig(pp=2, dp=8, ep=4), ParallelConfig(tp=2, pp=2, dp=4, ep=2, dp_shard="zero3"),
              ParallelConfig(pp=2, dp=8, ep=8, dp_shard="zero")]
    gens = [vllm_layout(SMALL_MOE, 16), vllm_layout(SMALL_MOE, 4, replicas=4)]
    for cfg, gen, rpn in itertools.product(trains, gens, (None, 4)):
        train = build_layout(SMALL_MOE, cfg)
        for src, dst in ((train, gen), (gen, train)):
            for r in range(16):
                p = plan_rank(src, dst, r, rpn)
                assert (p.local, p.sends, p.recvs) == plain_rank_plan(eager_copy(src), eager_copy(dst), r, rpn)


def test_lazy_layouts_pickle_as_the_layouts_they_equal():
    import pickle

    for lay in (vllm_layout(SMALL_MOE, 4, replicas=2), build_layout(SMALL_MOE, ParallelConfig(pp=2, dp=4, ep=2))):
        back = pickle.loads(pickle.dumps(lay))
        assert back == lay and back.name == lay.name
        assert all(back.fragments(r) == lay.fragments(r) and dict(back.buffers(r)) == dict(lay.buffers(r))
                   for r in range(lay.world_size))


GEOMETRY_LAYOUTS = [lambda: vllm_layout(SMALL_MOE, 4, replicas=2), lambda: vllm_layout(SMALL_MOE, 16),
                    lambda: vllm_layout(TIED, 2, replicas=2),
                    lambda: build_layout(SMALL_MOE, ParallelConfig(pp=2, dp=8, ep=4), fields=("param", "exp_avg")),
                    lambda: build_layout(SMALL_MOE, ParallelConfig(tp=2, pp=2, dp=4, ep=2, fuse_qkv=True)),
                    lambda: build_layout(TIED, ParallelConfig(tp=2, pp=2, dp=2, vocab_divisible_by=8))]


@pytest.mark.parametrize("make", GEOMETRY_LAYOUTS)
def test_keys_of_one_geometry_are_held_alike(make):
    """What the planner relies on to reuse one key's receipt for another: keys of equal
    ``_geometry`` have the same holders of the same boxes, fragments differing only in key,
    buffer and offset, and ``_relocate`` names those."""
    lay = make()
    eager = eager_copy(lay)
    first: dict = {}
    shared = 0
    for key in eager.all_keys():
        g = lay._geometry(key)
        if g is None:
            continue
        rep = first.setdefault(g, key)
        if rep == key:
            continue
        shared += 1
        moved = [(b, [(Fragment(key, h.fragment.box, *lay._relocate(key, h.fragment), h.fragment.strides),
                       tuple(h.ranks), h.dtype) for h in held]) for b, held in lay._key_index(rep).items()]
        assert moved == holder_rows(eager._key_index(key)), (key, rep)
    assert shared > 0


def test_pair_digests_agree_between_the_two_ends_and_name_the_transfers():
    src = build_layout(SMALL_MOE, ParallelConfig(pp=2, dp=8, ep=4))
    dst = vllm_layout(SMALL_MOE, 4, replicas=4)
    plans = [plan_rank(src, dst, r, 4) for r in range(16)]
    for p in plans:
        assert set(p.pair_digests) == set(p.peers())
        for q, d in p.pair_digests.items():
            assert plans[q].pair_digests[p.rank] == d
    p = next(p for p in plans if p.sends)
    t = p.sends[0]
    for changed in (t._replace(src_offset=t.src_offset + 1), t._replace(dst_buffer=t.dst_buffer + "x"),
                    t._replace(key=StateKey(t.key.tensor, "exp_avg"))):
        assert planner._pair_digests(p.rank, (changed,) + p.sends[1:], p.recvs)[t.dst] != p.pair_digests[t.dst]
