"""Layout truth: every layout family against an independent, plain-torch construction of the
framework rule it claims to follow (Megatron TP/PP, FSDP2 ``Shard(0)``, DeepSpeed ZeRO-1/2/3).

``materialize`` fills a rank's buffers *from the layout's own fragments*, so it cannot be its own
reference. Here the expected per-rank buffers are built without looking at fragments at all —
``torch.chunk`` / ``cat`` / ``reshape`` / zero padding of the global tensors, following each rule
as the frameworks state it — and compared with ``materialize`` bit for bit (padding included,
which ``materialize`` fills with 0).
"""
from __future__ import annotations

import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlhf_switch.vps import (
    ADAM_FIELDS, Box, BufferSpec, Fragment, Layout, LayoutError, ParallelConfig, StateKey,
    build_layout, fsdp, llama_spec, replicated, synthetic_spec, zero,
)
from rlhf_switch.vps.materialize import bits, materialize, synthetic_tensor, torch_dtype
from rlhf_switch.vps.layouts.vllm import vllm_layout
from rlhf_switch.vps.spec import qwen3_moe_spec

EMBED = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"
NORM = "model.norm.weight"
SEED = 7

SETTINGS = settings(max_examples=60, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# =================================================================================================
# Independent reference
# =================================================================================================

class Model:
    """What the reference knows about a model: tensor names in order, their global tensors per
    field, their TP role and layer. For Llama specs roles/layers come from the *names* (the
    Megatron rules), not from the spec's own annotations."""

    def __init__(self, spec, cfg=None, seed=SEED):
        self.spec = spec
        self.cfg = cfg  # llama config dict, or None for a synthetic spec
        self.seed = seed
        self.names = [t.name for t in spec.tensors]
        self._cache = {}
        if cfg is None:
            n, L = len(self.names), spec.num_layers
            self.layer = {name: min(i * L // n, L - 1) for i, name in enumerate(self.names)}
            self.role = {t.name: t.tp for t in spec.tensors}
        else:
            self.layer = {}
            self.role = {}
            for name in self.names:
                m = re.match(r"model\.layers\.(\d+)\.", name)
                self.layer[name] = int(m.group(1)) if m else None
                self.role[name] = llama_role(name)

    def tensor(self, name, field="param"):
        k = (name, field)
        if k not in self._cache:
            dtype = None if field == "param" else "float32"
            self._cache[k] = synthetic_tensor(self.spec[name], StateKey(name, field), self.seed, dtype)
        return self._cache[k]

    def tensor_of(self, key: StateKey):
        return self.tensor(key.tensor, key.field)


def llama_role(name):
    if name in (EMBED, LM_HEAD):
        return "vocab"
    if re.search(r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$", name):
        return "column"
    if re.search(r"\.(o_proj|down_proj)\.weight$", name):
        return "row"
    return "replicate"  # norms, o_proj / down_proj biases


def ref_stage(model: Model, pp: int, stage: int, stage_layers=None):
    """[(tensor name, buffer name)] of pipeline stage ``stage``, in model order."""
    L = model.spec.num_layers
    if stage_layers is None:
        sizes = [L // pp + (1 if s < L % pp else 0) for s in range(pp)]
    else:
        sizes = list(stage_layers)
    lo = sum(sizes[:stage])
    hi = lo + sizes[stage]
    first, last = stage == 0, stage == pp - 1
    out = []
    for name in model.names:
        layer = model.layer[name]
        if layer is not None:
            keep = lo <= layer < hi
        elif name == EMBED:
            keep = first
        else:  # final norm, LM head
            keep = last
        if keep:
            out.append((name, name))
    tied = model.cfg is not None and model.cfg.get("tie_word_embeddings", False)
    if tied and last and not first:
        out.append((EMBED, LM_HEAD))
    return out


def _pad_rows(x, rows):
    if x.shape[0] == rows:
        return x
    pad = torch.zeros((rows - x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype)
    return torch.cat([x, pad])


def ref_tp(model: Model, stage, field, tp, t, vdb=None, fuse_qkv=False, fuse_gate_up=False):
    """[(buffer name, local tensor)] of TP rank ``t`` (Megatron rules), in model order."""
    out = []
    for name, buf in stage:
        x = model.tensor(name, field)
        role = model.role[name]
        m = re.match(r"(.*\.self_attn\.)([qkv])_proj\.(weight|bias)$", name)
        g = re.match(r"(.*\.mlp\.)(gate|up)_proj\.(weight|bias)$", name)
        if fuse_qkv and m and model.cfg is not None:
            if m.group(2) != "q":
                continue  # emitted with q
            prefix, kind = m.group(1), m.group(3)
            q = x
            k = model.tensor(f"{prefix}k_proj.{kind}", field)
            v = model.tensor(f"{prefix}v_proj.{kind}", field)
            cfg = model.cfg
            nh = cfg["num_attention_heads"]
            G = cfg.get("num_key_value_heads") or nh
            hd = cfg["hidden_size"] // nh
            rest = tuple(q.shape[1:])
            qg = q.reshape((G, nh // G * hd) + rest)
            kg = k.reshape((G, hd) + rest)
            vg = v.reshape((G, hd) + rest)
            per = G // tp
            rows = [torch.cat([qg[i], kg[i], vg[i]]) for i in range(t * per, (t + 1) * per)]
            out.append((f"{prefix}qkv_proj.{kind}", torch.cat(rows)))
        elif fuse_gate_up and g and model.cfg is not None:
            if g.group(2) != "gate":
                continue
            prefix, kind = g.group(1), g.group(3)
            up = model.tensor(f"{prefix}up_proj.{kind}", field)
            out.append((f"{prefix}gate_up_proj.{kind}",
                        torch.cat([x.chunk(tp, 0)[t], up.chunk(tp, 0)[t]])))
        elif tp == 1 or role == "replicate":
            out.append((buf, x))
        elif role == "column":
            assert x.shape[0] % tp == 0
            out.append((buf, x.tensor_split(tp, 0)[t]))
        elif role == "row":
            assert x.shape[1] % tp == 0
            out.append((buf, x.tensor_split(tp, 1)[t]))
        elif role == "vocab":
            V = x.shape[0]
            if vdb is None:
                assert V % tp == 0
                Vp = V
            else:
                mult = vdb * tp
                Vp = (V + mult - 1) // mult * mult
            out.append((buf, _pad_rows(x, Vp).tensor_split(tp, 0)[t]))
        else:
            raise AssertionError(role)
    return out


def ref_dp(local, dp, i, mode, alignment=2, dtype=torch.float32):
    """{buffer name: flat tensor} of DP rank ``i`` for ``local`` = [(buffer, local tensor)];
    ``dtype`` is only used for a flat buffer of a rank without tensors."""
    if mode == "replicate":
        return {b: x.reshape(-1) for b, x in local}
    if mode == "fsdp":  # FSDP2 Shard(0): torch.chunk, padded to the first chunk's size
        out = {}
        for b, x in local:
            rows = x.shape[0]
            c = -(-rows // dp)
            chunks = torch.chunk(x, dp, dim=0)  # may return fewer than dp chunks
            mine = chunks[i] if i < len(chunks) else x[:0]
            out[b] = _pad_rows(mine, c).reshape(-1)
        return out
    if mode == "zero3":  # DeepSpeed ZeRO-3: per tensor, ceil(numel/dp) each, padded
        parts = []
        for _, x in local:
            flat = x.reshape(-1)
            n = flat.numel()
            P = -(-n // dp)
            padded = torch.cat([flat, torch.zeros(P * dp - n, dtype=flat.dtype)])
            parts.append(padded[i * P:(i + 1) * P])
        return {"zero3.flat": torch.cat(parts) if parts else torch.zeros(0, dtype=dtype)}
    if mode == "zero":  # DeepSpeed ZeRO-1/2 flat partition, aligned to alignment*dp
        if local:
            flat = torch.cat([x.reshape(-1) for _, x in local])
        else:
            flat = torch.zeros(0, dtype=dtype)
        n = flat.numel()
        m = alignment * dp
        total = -(-n // m) * m
        padded = torch.cat([flat, torch.zeros(total - n, dtype=flat.dtype)])
        P = total // dp
        return {"zero.flat": padded[i * P:(i + 1) * P]}
    raise AssertionError(mode)


def ref_rank(model: Model, cfg: ParallelConfig, rank: int, fields=("param",)):
    """Expected {"{field}/{buffer}": flat tensor} of ``rank`` under ``cfg``."""
    tp, pp, dp = cfg.tp, cfg.pp, cfg.dp
    pp_rank, rest = divmod(rank, dp * tp)
    dp_rank, tp_rank = divmod(rest, tp)
    assert rank == pp_rank * (dp * tp) + dp_rank * tp + tp_rank
    stage = ref_stage(model, pp, pp_rank, cfg.stage_layers)
    out = {}
    for field in fields:
        local = ref_tp(model, stage, field, tp, tp_rank, cfg.vocab_divisible_by,
                       cfg.fuse_qkv, cfg.fuse_gate_up)
        dtype = (torch_dtype(model.spec.tensors[0].dtype) if field == "param" else torch.float32)
        for b, x in ref_dp(local, dp, dp_rank, cfg.dp_shard, cfg.zero_alignment, dtype).items():
            out[f"{field}/{b}"] = x
    return out


def assert_bits_equal(layout: Layout, rank: int, expected: dict, model: Model):
    got = materialize(layout, rank, model.tensor_of)
    assert sorted(got) == sorted(expected), f"{layout} rank {rank}: buffers differ"
    for name, exp in expected.items():
        g = got[name]
        decl = layout.buffers(rank)[name]
        assert g.numel() == exp.numel(), (
            f"{layout} rank {rank} {name}: {g.numel()} elements, expected {exp.numel()}")
        assert torch_dtype(decl.dtype) == g.dtype
        assert g.dtype == exp.dtype, f"{layout} rank {rank} {name}: dtype {g.dtype}, expected {exp.dtype}"
        assert torch.equal(bits(g), bits(exp)), f"{layout} rank {rank} {name}: contents differ"


def check_layout(model: Model, cfg: ParallelConfig, layout: Layout | None = None, fields=("param",),
                 dtypes=None):
    layout = layout if layout is not None else build_layout(model.spec, cfg, fields)
    layout.validate()
    assert layout.world_size == cfg.world_size
    for rank in range(cfg.world_size):
        expected = ref_rank(model, cfg, rank, fields)
        assert_bits_equal(layout, rank, expected, model)
        if dtypes is not None:
            for name, b in layout.buffers(rank).items():
                assert b.dtype == dtypes[name.split("/")[0]], (rank, name, b)
    return layout


def tiny_cfg(**kw):
    cfg = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=24, vocab_size=24, tie_word_embeddings=False, attention_bias=False)
    cfg.update(kw)
    return cfg


def tiny(dtype=None, **kw):
    cfg = tiny_cfg(**kw)
    return Model(llama_spec(cfg, dtype=dtype), cfg)


# =================================================================================================
# Reference self-checks (the reference must itself follow the rules as written)
# =================================================================================================

def test_reference_qkv_interleave_matches_worked_example():
    # 4 heads, 2 KV groups, head_dim 2, tp=2: rank 0 = q[0:4], k[0:2], v[0:2]; rank 1 = q[4:8]...
    model = tiny(hidden_size=8, num_attention_heads=4, num_key_value_heads=2, intermediate_size=8)
    a = "model.layers.0.self_attn."
    q, k, v = (model.tensor(a + f"{n}_proj.weight") for n in "qkv")
    stage = ref_stage(model, 1, 0)
    for t, (qs, ks) in enumerate([((0, 4), (0, 2)), ((4, 8), (2, 4))]):
        local = dict(ref_tp(model, stage, "param", 2, t, fuse_qkv=True))
        exp = torch.cat([q[qs[0]:qs[1]], k[ks[0]:ks[1]], v[ks[0]:ks[1]]])
        assert torch.equal(local[a + "qkv_proj.weight"], exp)


def test_reference_fsdp_empty_trailing_chunk():
    x = torch.arange(10.).reshape(5, 2)
    # torch.chunk(5 rows, 4) returns only 3 chunks of 2, 2, 1 rows: rank 3 holds nothing
    assert len(torch.chunk(x, 4)) == 3
    got = [ref_dp([("b", x)], 4, i, "fsdp")["b"] for i in range(4)]
    assert [g.tolist() for g in got] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 0], [0, 0, 0, 0]]


# =================================================================================================
# One rule at a time
# =================================================================================================

def test_replicated_every_rank_holds_every_tensor_whole():
    model = tiny(dtype="bfloat16")
    lay = replicated(model.spec, 3)
    check_layout(model, ParallelConfig(dp=3), lay, dtypes={"param": "bfloat16"})
    for r in range(3):
        assert set(lay.buffers(r)) == {f"param/{n}" for n in model.names}
        for n in model.names:
            got = materialize(lay, r, model.tensor_of)[f"param/{n}"]
            assert torch.equal(bits(got), bits(model.tensor(n).reshape(-1)))


def test_tp2_megatron_column_row_vocab_replicate():
    model = tiny(attention_bias=True, mlp_bias=True)
    lay = check_layout(model, ParallelConfig(tp=2))
    # spot-check the roles directly against hand slices
    for t in range(2):
        got = materialize(lay, t, model.tensor_of)
        q = model.tensor("model.layers.1.self_attn.q_proj.weight")
        o = model.tensor("model.layers.1.self_attn.o_proj.weight")
        ob = model.tensor("model.layers.1.self_attn.o_proj.bias")
        n0, n1 = q.shape[0] // 2, o.shape[1] // 2
        assert torch.equal(got["param/model.layers.1.self_attn.q_proj.weight"],
                           q[t * n0:(t + 1) * n0].reshape(-1))
        assert torch.equal(got["param/model.layers.1.self_attn.o_proj.weight"],
                           o[:, t * n1:(t + 1) * n1].reshape(-1))
        assert torch.equal(got["param/model.layers.1.self_attn.o_proj.bias"], ob)
        assert torch.equal(got["param/model.norm.weight"], model.tensor(NORM))


def test_tp_spec_roles_agree_with_megatron_names():
    spec = llama_spec(tiny_cfg(attention_bias=True, mlp_bias=True))
    for t in spec.tensors:
        assert t.tp == llama_role(t.name), t.name


def test_tp_vocab_padding_pad_rows_are_zero():
    model = tiny(vocab_size=11)
    cfg = ParallelConfig(tp=2, vocab_divisible_by=4)  # 11 -> 16 rows, 8 per rank
    lay = check_layout(model, cfg)
    H = 16
    r1 = materialize(lay, 1, model.tensor_of)
    for name in (EMBED, LM_HEAD):
        buf = r1[f"param/{name}"].reshape(8, H)
        assert torch.equal(buf[:3], model.tensor(name)[8:11])
        assert torch.equal(bits(buf[3:]), torch.zeros(5, H, dtype=torch.int32))
        assert lay.buffers(0)[f"param/{name}"].numel == 8 * H


def test_tp_vocab_not_divisible_without_padding_is_an_error():
    spec = llama_spec(tiny_cfg(vocab_size=11))
    with pytest.raises(LayoutError) as e:
        build_layout(spec, ParallelConfig(tp=2))
    msg = str(e.value)
    assert "vocab=11" in msg and EMBED in msg and LM_HEAD in msg


@pytest.mark.parametrize("attention_bias", [False, True])
def test_fused_qkv_gqa_tp2(attention_bias):
    # 8 query heads in 4 KV groups, head_dim 4: each TP rank holds 2 groups of (2 q, 1 k, 1 v) heads
    model = tiny(hidden_size=32, num_attention_heads=8, num_key_value_heads=4,
                 attention_bias=attention_bias)
    lay = check_layout(model, ParallelConfig(tp=2, fuse_qkv=True))
    hd = 4
    kinds = ("weight", "bias") if attention_bias else ("weight",)
    for t in range(2):
        got = materialize(lay, t, model.tensor_of)
        for kind in kinds:
            a = "model.layers.0.self_attn."
            q, k, v = (model.tensor(f"{a}{n}_proj.{kind}") for n in "qkv")
            rows = []
            for grp in (2 * t, 2 * t + 1):
                rows += [q[grp * 2 * hd:(grp + 1) * 2 * hd], k[grp * hd:(grp + 1) * hd],
                         v[grp * hd:(grp + 1) * hd]]
            assert torch.equal(got[f"param/{a}qkv_proj.{kind}"], torch.cat(rows).reshape(-1))
            for n in "qkv":
                assert f"param/{a}{n}_proj.{kind}" not in got


def test_fused_qkv_mqa_tp1_and_gate_up():
    model = tiny(num_attention_heads=4, num_key_value_heads=1, mlp_bias=True, attention_bias=True)
    check_layout(model, ParallelConfig(fuse_qkv=True, fuse_gate_up=True))


def test_fused_gate_up_tp2():
    model = tiny()
    lay = check_layout(model, ParallelConfig(tp=2, fuse_gate_up=True))
    m = "model.layers.1.mlp."
    gate, up = model.tensor(m + "gate_proj.weight"), model.tensor(m + "up_proj.weight")
    for t in range(2):
        got = materialize(lay, t, model.tensor_of)[f"param/{m}gate_up_proj.weight"]
        exp = torch.cat([gate[t * 12:(t + 1) * 12], up[t * 12:(t + 1) * 12]]).reshape(-1)
        assert torch.equal(got, exp)


def test_pp_uneven_layers_earlier_stages_take_the_remainder():
    model = tiny(num_hidden_layers=5)
    lay = check_layout(model, ParallelConfig(pp=2))

    def layers(rank):
        return {int(m.group(1)) for b in lay.buffers(rank)
                if (m := re.match(r"param/model\.layers\.(\d+)\.", b))}
    assert layers(0) == {0, 1, 2} and layers(1) == {3, 4}
    assert f"param/{EMBED}" in lay.buffers(0) and f"param/{EMBED}" not in lay.buffers(1)
    assert {f"param/{NORM}", f"param/{LM_HEAD}"} <= set(lay.buffers(1))
    assert not {f"param/{NORM}", f"param/{LM_HEAD}"} & set(lay.buffers(0))


def test_pp_three_stages_of_seven_layers():
    model = tiny(num_hidden_layers=7)
    check_layout(model, ParallelConfig(pp=3))  # 3 + 2 + 2


def test_pp_custom_stage_layers():
    model = tiny(num_hidden_layers=4)
    check_layout(model, ParallelConfig(pp=3, stage_layers=(1, 0, 3)))


@pytest.mark.parametrize("tp", [1, 2])
def test_tied_embeddings_pp2_last_stage_holds_embedding_as_lm_head(tp):
    model = tiny(tie_word_embeddings=True, num_hidden_layers=3)
    assert LM_HEAD not in model.spec
    cfg = ParallelConfig(tp=tp, pp=2)
    lay = check_layout(model, cfg)
    E = model.tensor(EMBED)
    n = E.shape[0] // tp
    for t in range(tp):
        first = materialize(lay, t, model.tensor_of)
        last = materialize(lay, tp + t, model.tensor_of)
        assert torch.equal(first[f"param/{EMBED}"], E[t * n:(t + 1) * n].reshape(-1))
        assert torch.equal(last[f"param/{LM_HEAD}"], E[t * n:(t + 1) * n].reshape(-1))
        assert f"param/{EMBED}" not in last
    # the embedding key is held twice (once per end stage) per TP shard
    assert count_holdings(lay, StateKey(EMBED)).eq(2).all()


def test_tied_embeddings_pp1_no_extra_buffer():
    model = tiny(tie_word_embeddings=True)
    lay = check_layout(model, ParallelConfig())
    assert f"param/{LM_HEAD}" not in lay.buffers(0)


# --- data parallel sharding ------------------------------------------------------------------------

def uneven_spec(dtype="float32"):
    return synthetic_spec([("a", (5, 3), dtype, "replicate"), ("b", (7,), dtype, "replicate"),
                           ("c", (2, 3, 5), dtype, "replicate"), ("d", (1, 4), dtype, "replicate")],
                          num_layers=2)


@pytest.mark.parametrize("dp", [2, 3, 4, 6])
def test_fsdp_uneven_rows_torch_chunk_semantics(dp):
    model = Model(uneven_spec())
    lay = fsdp(model.spec, dp)
    check_layout(model, ParallelConfig(dp=dp, dp_shard="fsdp"), lay)
    # c = ceil(rows / dp) rows per rank, padding included
    for r in range(dp):
        assert lay.buffers(r)["param/a"].numel == -(-5 // dp) * 3
        assert lay.buffers(r)["param/d"].numel == 4


def test_fsdp_llama_uneven_vocab_dp4():
    model = tiny(vocab_size=10, dtype="bfloat16")  # 10 rows over 4: 3, 3, 3, 1
    check_layout(model, ParallelConfig(dp=4, dp_shard="fsdp"), fsdp(model.spec, 4))


@pytest.mark.parametrize("dp", [2, 3, 4, 7])
def test_zero3_uneven_numel(dp):
    model = Model(uneven_spec("bfloat16"))
    lay = build_layout(model.spec, ParallelConfig(dp=dp, dp_shard="zero3"))
    check_layout(model, ParallelConfig(dp=dp, dp_shard="zero3"), lay)
    P = sum(-(-n // dp) for n in (15, 7, 30, 4))
    assert all(lay.buffers(r) == {"param/zero3.flat": BufferSpec(P, "bfloat16")} for r in range(dp))


@pytest.mark.parametrize("dp,alignment", [(2, 2), (3, 2), (4, 2), (3, 1), (5, 4)])
def test_zero_flat_partition(dp, alignment):
    model = Model(uneven_spec())
    cfg = ParallelConfig(dp=dp, dp_shard="zero", zero_alignment=alignment)
    lay = check_layout(model, cfg)
    total = 15 + 7 + 30 + 4
    m = alignment * dp
    assert lay.buffers(0)["param/zero.flat"].numel * dp == -(-total // m) * m


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_stage12_three_fields(stage):
    model = tiny(dtype="bfloat16", vocab_size=13)
    dp = 3
    lay = zero(model.spec, dp, stage)
    assert set(lay.fields()) == {"param", *ADAM_FIELDS}
    lay.validate()
    for r in range(dp):
        assert set(lay.buffers(r)) == ({f"param/{n}" for n in model.names}
                                       | {f"{f}/zero.flat" for f in ADAM_FIELDS})
        for f in ADAM_FIELDS:
            assert lay.buffers(r)[f"{f}/zero.flat"].dtype == "float32"
        expected = ref_rank(model, ParallelConfig(dp=dp), r, ("param",))
        expected.update(ref_rank(model, ParallelConfig(dp=dp, dp_shard="zero"), r, ADAM_FIELDS))
        assert_bits_equal(lay, r, expected, model)
    # each field's master copy is partitioned: every element once, over all ranks
    for name in model.names:
        for f in ADAM_FIELDS:
            assert count_holdings(lay, StateKey(name, f)).eq(1).all()
        assert count_holdings(lay, StateKey(name)).eq(dp).all()


def test_zero_stage3_all_fields_zero3():
    model = tiny(dtype="bfloat16", vocab_size=13)
    dp = 3
    lay = zero(model.spec, dp, 3)
    lay.validate()
    for r in range(dp):
        assert set(lay.buffers(r)) == {f"{f}/zero3.flat" for f in ("param",) + ADAM_FIELDS}
        assert lay.buffers(r)["param/zero3.flat"].dtype == "bfloat16"
        assert lay.buffers(r)["master/zero3.flat"].dtype == "float32"
        expected = ref_rank(model, ParallelConfig(dp=dp, dp_shard="zero3"), r,
                            ("param",) + ADAM_FIELDS)
        assert_bits_equal(lay, r, expected, model)


def test_zero_bad_stage():
    with pytest.raises(LayoutError, match="stage"):
        zero(llama_spec(tiny_cfg()), 2, 4)


# --- expert parallelism (Megatron MoE) ---------------------------------------------------------------
# Megatron's rule, written out here without the layout code: with DP size D and EP size E, DP rank d
# is EP rank d % E and expert-DP rank d // E; EP rank e holds experts [e·X/E, (e+1)·X/E) of every MoE
# layer whole (TP still splits each expert as a column / row linear); dense tensors stay on every DP
# rank. DP sharding spreads the dense local tensors over all D ranks and the expert local tensors
# over the D/E ranks holding the same experts, each group in its own buffer(s).

def moe(**kw):
    """A Qwen3-MoE model. Default sizes are odd (hidden 7, expert rows 5) so that ZeRO/FSDP shards
    of the experts come out uneven."""
    cfg = dict(hidden_size=7, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=4,
               moe_intermediate_size=5, num_experts=8, vocab_size=10, tie_word_embeddings=False)
    cfg.update(kw)
    return Model(qwen3_moe_spec(cfg), cfg)


def expert_of(name):
    """The expert index in a Qwen3-MoE tensor name (``….mlp.experts.{e}.…``), None for a dense tensor."""
    m = re.search(r"\.mlp\.experts\.(\d+)\.", name)
    return int(m.group(1)) if m else None


def ref_rank_ep(model: Model, cfg: ParallelConfig, rank: int, fields=("param",)):
    """Expected {"{field}/{buffer}": flat tensor} of ``rank`` under ``cfg`` with EP (rule above)."""
    tp, dp, ep = cfg.tp, cfg.dp, cfg.ep
    X = model.cfg["num_experts"]
    pp_rank, rest = divmod(rank, dp * tp)
    dp_rank, tp_rank = divmod(rest, tp)
    ep_rank, edp_rank = dp_rank % ep, dp_rank // ep
    mine = range(ep_rank * X // ep, (ep_rank + 1) * X // ep)
    stage = [(n, b) for n, b in ref_stage(model, cfg.pp, pp_rank, cfg.stage_layers)
             if expert_of(n) is None or expert_of(n) in mine]
    out = {}
    for field in fields:
        local = ref_tp(model, stage, field, tp, tp_rank, cfg.vocab_divisible_by)
        dense = [(b, x) for b, x in local if expert_of(b) is None]
        experts = [(b, x) for b, x in local if expert_of(b) is not None]
        for b, x in ref_dp(dense, dp, dp_rank, cfg.dp_shard, cfg.zero_alignment).items():
            out[f"{field}/{b}"] = x
        for b, x in ref_dp(experts, dp // ep, edp_rank, cfg.dp_shard, cfg.zero_alignment).items():
            if b in ("zero.flat", "zero3.flat"):  # the experts' own flat buffer
                b = b.replace(".flat", ".experts.flat")
            out[f"{field}/{b}"] = x
    return out


def experts_held(layout: Layout, rank: int) -> dict[int, set[int]]:
    """layer -> the experts of which ``rank`` holds some part."""
    out: dict[int, set[int]] = {}
    for f in layout.fragments(rank):
        e = expert_of(f.key.tensor)
        if e is not None:
            out.setdefault(int(re.match(r"model\.layers\.(\d+)\.", f.key.tensor).group(1)), set()).add(e)
    return out


def test_ep_places_experts_per_megatron_rule():
    """Which rank holds which experts, as hand tables (8 experts, 2 layers)."""
    model = moe(hidden_size=8, moe_intermediate_size=6)  # TP2 divides every dim here
    lo, hi = {0, 1, 2, 3}, {4, 5, 6, 7}
    cases = [
        # DP4·EP2: dp 0, 2 hold experts 0–3; dp 1, 3 hold 4–7 (the module docstring's example)
        (ParallelConfig(dp=4, ep=2), {0: [lo, lo], 1: [hi, hi], 2: [lo, lo], 3: [hi, hi]}),
        # DP4·EP4: two experts per rank, in order
        (ParallelConfig(dp=4, ep=4, dp_shard="zero3"),
         {0: [{0, 1}] * 2, 1: [{2, 3}] * 2, 2: [{4, 5}] * 2, 3: [{6, 7}] * 2}),
        # DP8·EP8: one expert per rank, rank d holds expert d
        (ParallelConfig(dp=8, ep=8, dp_shard="fsdp"), {d: [{d}, {d}] for d in range(8)}),
        # TP2·DP2·EP2: rank = dp·2 + tp, both TP ranks of a DP rank hold its experts
        (ParallelConfig(tp=2, dp=2, ep=2, vocab_divisible_by=2), {0: [lo, lo], 1: [lo, lo], 2: [hi, hi], 3: [hi, hi]}),
        # PP2·DP2·EP2: rank = pp·2 + dp; stage 0 has layer 0 only, stage 1 layer 1 only
        (ParallelConfig(pp=2, dp=2, ep=2, dp_shard="zero"), {0: {0: lo}, 1: {0: hi}, 2: {1: lo}, 3: {1: hi}}),
        # DP4 without EP: every rank holds every expert
        (ParallelConfig(dp=4, dp_shard="zero3"), {r: [set(range(8))] * 2 for r in range(4)}),
    ]
    for cfg, table in cases:
        lay = build_layout(model.spec, cfg)
        for rank, want in table.items():
            want = dict(enumerate(want)) if isinstance(want, list) else want
            assert experts_held(lay, rank) == want, (str(cfg), rank)
            if cfg.dp_shard != "replicate":
                continue  # (sharded, a small dense tensor may have no rows left for a rank)
            # the dense tensors of its stage stay on every rank: attention, norms, the router
            stage = {n for n, _ in ref_stage(model, cfg.pp, rank // (cfg.dp * cfg.tp))} - \
                {n for n in model.names if expert_of(n) is not None}
            assert stage <= {f.key.tensor for f in lay.fragments(rank)}, (str(cfg), rank)


@pytest.mark.parametrize("cfg", [
    ParallelConfig(dp=4, ep=2),
    ParallelConfig(dp=4, ep=2, dp_shard="fsdp"),  # expert rows 5 over expert-DP 2: 3 + 2
    ParallelConfig(dp=4, ep=2, dp_shard="zero3"),  # expert numel 35 over 2: 18 + 17 (padded)
    ParallelConfig(dp=6, ep=2, dp_shard="zero"),  # expert-DP 3
    ParallelConfig(dp=6, ep=2, dp_shard="zero", zero_alignment=16),  # both groups padded to 16·their DP
    ParallelConfig(dp=4, ep=4, dp_shard="zero"),  # expert-DP 1: each rank its experts whole
    ParallelConfig(pp=2, dp=4, ep=2, dp_shard="zero3"),
], ids=lambda c: str(c).replace("·", "x") + (f"-align{c.zero_alignment}" if c.zero_alignment != 2 else ""))
def test_ep_matches_megatron_reference(cfg):
    """Every rank's buffers, bit for bit, against the rule above (odd sizes: uneven shards)."""
    model = moe()
    lay = build_layout(model.spec, cfg, ("param", "exp_avg"))
    lay.validate()
    for rank in range(cfg.world_size):
        assert_bits_equal(lay, rank, ref_rank_ep(model, cfg, rank, ("param", "exp_avg")), model)
    # each expert element is held by the D/E ranks of its EP rank, or once when they shard it
    reps = 1 if cfg.dp_shard != "replicate" else cfg.dp // cfg.ep
    for name in model.names:
        if expert_of(name) is not None:
            assert count_holdings(lay, StateKey(name)).eq(reps).all(), name


def test_keep_experts_per_ep_rank():
    """``keep_experts``, the rule on its own: EP rank e keeps experts [e·X/E, (e+1)·X/E) and every
    dense tensor, in the given order (8 experts)."""
    from rlhf_switch.vps.layouts.expert_parallel import keep_experts

    spec = moe().spec
    stage = [(t, t.name) for t in spec.tensors if t.layer == 1]
    dense = [(t, b) for t, b in stage if expert_of(t.name) is None]
    assert len(dense) == 9 and len(stage) == 9 + 8 * 3
    for ep, table in ((2, [{0, 1, 2, 3}, {4, 5, 6, 7}]), (4, [{0, 1}, {2, 3}, {4, 5}, {6, 7}]),
                      (8, [{e} for e in range(8)])):
        for e, want in enumerate(table):
            kept = keep_experts(spec, stage, ep, e)
            assert [x for x in kept if expert_of(x[0].name) is None] == dense
            assert kept == [x for x in stage if expert_of(x[0].name) in want or expert_of(x[0].name) is None]
    assert keep_experts(spec, stage, 1, 0) == stage


def test_ep_tp2_matches_megatron_reference():
    model = moe(hidden_size=8, moe_intermediate_size=6)
    for mode in ("replicate", "fsdp", "zero3", "zero"):
        cfg = ParallelConfig(tp=2, dp=4, ep=2, dp_shard=mode, vocab_divisible_by=2)
        lay = build_layout(model.spec, cfg)
        for rank in range(cfg.world_size):
            assert_bits_equal(lay, rank, ref_rank_ep(model, cfg, rank), model)


def test_ep_refuses_uneven_experts_and_bad_sizes():
    """Experts are never split unevenly over EP ranks: an EP that does not divide the experts, or
    that is not carved out of DP, or a model without experts, is refused."""
    with pytest.raises(LayoutError, match="EP=4 does not divide num_experts=6"):
        build_layout(moe(num_experts=6).spec, ParallelConfig(dp=4, ep=4))
    with pytest.raises(LayoutError, match="EP=3 must divide DP=4"):
        ParallelConfig(dp=4, ep=3)
    with pytest.raises(LayoutError, match="needs a mixture-of-experts model"):
        build_layout(llama_spec(tiny_cfg()), ParallelConfig(dp=2, ep=2))
    with pytest.raises(LayoutError, match="ep=0"):
        ParallelConfig(dp=2, ep=0)
    # EP 1 on a dense model is no EP at all
    assert build_layout(llama_spec(tiny_cfg()), ParallelConfig(dp=2, ep=1)).world_size == 2


# --- vLLM's generation layout --------------------------------------------------------------------------
# vLLM's rules (vllm/model_executor/layers/linear.py, vocab_parallel_embedding.py, fused_moe), written
# out here for TP size T and worker t: ``qkv_proj`` = [q_t; k_t; v_t], q heads split evenly, KV heads
# split evenly when T <= KV, else worker t holds KV head t // (T/KV) whole; ``gate_up_proj`` =
# [gate_t; up_t]; o/down_proj split on dim 1, their biases whole; the vocabulary padded to a multiple
# of 64, then split in T equal row ranges (padding rows are zero here); MoE experts stacked as
# ``mlp.experts.routed_experts.w13_weight`` = per expert [gate_t; up_t] and ``w2_weight`` = per expert
# down_t; norms, q/k norms and the router whole; replica r's worker t is rank r·T + t.

def ref_vllm(model: Model, tp: int, rank: int) -> dict[str, torch.Tensor]:
    cfg, t = model.cfg, rank % tp
    nh = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or nh
    hd = cfg.get("head_dim") or cfg["hidden_size"] // nh

    def rows(x):
        return x.tensor_split(tp, 0)[t]

    def cols(x):
        return x.tensor_split(tp, 1)[t]

    out = {}
    for name in model.names:
        x = model.tensor(name)
        qkv = re.match(r"(.*\.self_attn\.)([qkv])_proj\.(weight|bias)$", name)
        mlp = re.match(r"(.*\.mlp\.)(gate|up|down)_proj\.(weight|bias)$", name)
        expert = re.match(r"(.*\.mlp\.experts\.)(\d+)\.(gate|up|down)_proj\.weight$", name)
        if name in (EMBED, LM_HEAD):
            vp = -(-x.shape[0] // 64) * 64
            out[name] = _pad_rows(x, vp)[t * vp // tp:(t + 1) * vp // tp]
        elif qkv:
            if qkv.group(2) != "q":
                continue
            a, kind = qkv.group(1), qkv.group(3)
            k, v = model.tensor(f"{a}k_proj.{kind}"), model.tensor(f"{a}v_proj.{kind}")
            heads = range(t * kv // tp, (t + 1) * kv // tp) if tp <= kv else [t // (tp // kv)]
            kr = slice(heads[0] * hd, (heads[-1] + 1) * hd)
            out[f"{a}qkv_proj.{kind}"] = torch.cat([rows(x), k[kr], v[kr]])
        elif expert:
            m, e, w = expert.group(1), int(expert.group(2)), expert.group(3)
            if e != 0 or w == "up":
                continue
            n = cfg["num_experts"]
            if w == "gate":
                out[f"{m}routed_experts.w13_weight"] = torch.cat(
                    [rows(model.tensor(f"{m}{i}.{p}_proj.weight")) for i in range(n) for p in ("gate", "up")])
            else:
                out[f"{m}routed_experts.w2_weight"] = torch.cat(
                    [cols(model.tensor(f"{m}{i}.down_proj.weight")) for i in range(n)])
        elif mlp and mlp.group(2) in ("gate", "up"):
            if mlp.group(2) == "gate":
                out[f"{mlp.group(1)}gate_up_proj.{mlp.group(3)}"] = torch.cat(
                    [rows(x), rows(model.tensor(f"{mlp.group(1)}up_proj.{mlp.group(3)}"))])
        elif re.search(r"\.(o_proj|down_proj)\.weight$", name):
            out[name] = cols(x)
        else:  # norms, q/k norms, the router, o/down biases
            out[name] = x
    return {f"param/{b}": x.reshape(-1) for b, x in out.items()}


@pytest.mark.parametrize("tp,replicas,kw", [
    (1, 1, {}), (2, 2, {"attention_bias": True, "mlp_bias": True}), (4, 1, {}),  # TP4 > 2 KV heads: shared
    (4, 1, {"num_key_value_heads": 4, "attention_bias": True}), (2, 1, {"tie_word_embeddings": True}),
    (4, 2, {"num_key_value_heads": 1, "vocab_size": 100}),  # 100 -> 128 rows: worker 3 holds rows 96:100
])
def test_vllm_layout_matches_vllm_rules(tp, replicas, kw):
    model = tiny(**kw)  # vocab 24 -> 64 rows: at TP4 workers 2 and 3 hold padding only
    lay = vllm_layout(model.spec, tp, replicas).validate()
    assert lay.world_size == tp * replicas
    for rank in range(tp * replicas):
        assert_bits_equal(lay, rank, ref_vllm(model, tp, rank), model)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_vllm_layout_of_a_moe_matches_vllm_rules(tp):
    model = moe(hidden_size=8, moe_intermediate_size=4, num_experts=4, num_key_value_heads=2)
    lay = vllm_layout(model.spec, tp).validate()
    for rank in range(tp):
        assert_bits_equal(lay, rank, ref_vllm(model, tp, rank), model)
    assert lay.name == f"vLLM-TP{tp}"


def test_vllm_layout_engine_dtype_names_and_refusals():
    model = tiny()
    bf16 = vllm_layout(model.spec, 2, dtype="bfloat16")
    assert {b.dtype for r in range(2) for b in bf16.buffers(r).values()} == {"bfloat16"}
    # the model's own dtype named is the same layout, digest included
    assert vllm_layout(model.spec, 2, dtype="float32") == vllm_layout(model.spec, 2)
    assert vllm_layout(model.spec, 2, 3).name == "vLLM-TP2×3"
    with pytest.raises(LayoutError, match=r"^vLLM TP and replicas must be >= 1, got tp=0, replicas=1$"):
        vllm_layout(model.spec, 0)
    with pytest.raises(LayoutError, match=r"^vLLM TP and replicas must be >= 1, got tp=2, replicas=0$"):
        vllm_layout(model.spec, 2, 0)
    with pytest.raises(LayoutError, match=r"unknown engine dtype 'float8'"):
        vllm_layout(model.spec, 2, dtype="float8")
    # every factor vLLM's TP must divide, each named: KV heads at TP <= KV, query heads, KV heads at
    # TP > KV (a multiple of them), the padded vocabulary
    with pytest.raises(LayoutError) as e:
        vllm_layout(tiny(num_attention_heads=6, num_key_value_heads=3, hidden_size=24).spec, 2)
    assert "num_attention_heads" not in str(e.value) and "num_key_value_heads=3" in str(e.value)
    with pytest.raises(LayoutError) as e:
        vllm_layout(tiny(num_attention_heads=6, num_key_value_heads=2, hidden_size=24).spec, 4)
    msg = str(e.value)
    assert msg.startswith("vLLM cannot run 'llama' at TP=4: it does not divide ")
    assert "num_attention_heads=6" in msg and "num_key_value_heads=2 (TP above it must be a multiple of it)" not in msg
    with pytest.raises(LayoutError, match=r"num_key_value_heads=2 \(TP above it must be a multiple of it\)"):
        vllm_layout(tiny(num_attention_heads=6, num_key_value_heads=2, hidden_size=24, intermediate_size=18).spec, 3)
    with pytest.raises(LayoutError, match="has no attention geometry"):
        vllm_layout(synthetic_spec([("a", (4, 2), "float32", "replicate")]), 1)


# --- compositions ------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["replicate", "fsdp", "zero3", "zero"])
def test_tp2_dp2_fused_with_each_dp_sharding(mode):
    model = tiny(attention_bias=True, vocab_size=13, num_attention_heads=4, num_key_value_heads=2)
    cfg = ParallelConfig(tp=2, dp=3, dp_shard=mode, fuse_qkv=True, fuse_gate_up=True,
                         vocab_divisible_by=2)
    check_layout(model, cfg)


def test_tp2_pp2_rank_order():
    model = tiny(num_hidden_layers=3)
    cfg = ParallelConfig(tp=2, pp=2)
    lay = check_layout(model, cfg)
    # rank = pp·(dp·tp) + dp·tp + tp: ranks 0, 1 are stage 0; 2, 3 stage 1
    assert f"param/{EMBED}" in lay.buffers(1) and f"param/{EMBED}" not in lay.buffers(2)
    assert f"param/{LM_HEAD}" in lay.buffers(2)


def test_tp2_pp2_dp2_all_axes():
    model = tiny(num_hidden_layers=3, tie_word_embeddings=True, vocab_size=14)
    for mode in ("fsdp", "zero3", "zero"):
        check_layout(model, ParallelConfig(tp=2, pp=2, dp=2, dp_shard=mode, fuse_qkv=True))


def test_state_fields_with_dtype_override():
    model = tiny(dtype="bfloat16")
    fields = ("param", "master", "exp_avg")
    lay = build_layout(model.spec, ParallelConfig(tp=2, dp=2, dp_shard="fsdp"), fields)
    check_layout(model, ParallelConfig(tp=2, dp=2, dp_shard="fsdp"), lay, fields,
                 dtypes={"param": "bfloat16", "master": "float32", "exp_avg": "float32"})
    lay16 = build_layout(model.spec, ParallelConfig(dp=2, dp_shard="zero"), ("param",),
                         param_dtype="float16")
    assert lay16.buffers(0)["param/zero.flat"].dtype == "float16"


# =================================================================================================
# Property tests
# =================================================================================================

def count_holdings(layout: Layout, key: StateKey) -> torch.Tensor:
    """How many times each element of ``key`` is held, summed over ranks."""
    count = torch.zeros(layout.spec[key.tensor].shape, dtype=torch.int32)
    for r in range(layout.world_size):
        for f in layout.fragments(r):
            if f.key == key:
                count[tuple(slice(l, h) for l, h in zip(f.box.lo, f.box.hi))] += 1
    return count


@st.composite
def synthetic_case(draw):
    tp = draw(st.sampled_from([1, 2, 3]))
    pp = draw(st.sampled_from([1, 2, 3]))
    dp = draw(st.sampled_from([1, 2, 3, 4]))
    mode = draw(st.sampled_from(["replicate", "fsdp", "zero3", "zero"]))
    dtype = draw(st.sampled_from(["float32", "bfloat16", "float16", "int16"]))
    num_layers = draw(st.integers(pp, 4))
    n = draw(st.integers(1, 6))
    rows, vocab_bad = [], False
    for i in range(n):
        role = draw(st.sampled_from(["column", "row", "vocab", "replicate"]))
        ndim = draw(st.integers(2 if role == "row" else 1, 3))
        shape = [draw(st.integers(1, 5)) for _ in range(ndim)]
        if role == "column":
            shape[0] = tp * draw(st.integers(1, 3))
        elif role == "row":
            shape[1] = tp * draw(st.integers(1, 3))
        elif role == "vocab":
            shape[0] = draw(st.integers(1, 9))
            vocab_bad |= shape[0] % tp != 0
        rows.append((f"t{i}", tuple(shape), dtype, role))
    vdb = draw(st.sampled_from([None, 1, 2, 3]))
    if vdb is None and vocab_bad:
        vdb = 1
    stage_layers = None
    if pp > 1 and draw(st.booleans()):
        cuts = sorted(draw(st.lists(st.integers(0, num_layers), min_size=pp - 1, max_size=pp - 1)))
        bounds = [0] + cuts + [num_layers]
        stage_layers = tuple(bounds[s + 1] - bounds[s] for s in range(pp))
    cfg = ParallelConfig(tp=tp, pp=pp, dp=dp, dp_shard=mode, vocab_divisible_by=vdb,
                         zero_alignment=draw(st.sampled_from([1, 2])) if mode == "zero" else 2,
                         stage_layers=stage_layers)
    return synthetic_spec(rows, num_layers=num_layers), cfg


@SETTINGS
@given(synthetic_case())
def test_property_synthetic_layouts_validate_cover_and_match_reference(case):
    spec, cfg = case
    model = Model(spec)
    lay = build_layout(spec, cfg, world_size=cfg.world_size)
    lay.validate()
    # every element is held exactly once per replica: tp copies of replicate-role tensors,
    # dp copies unless the DP group shards
    for t in spec.tensors:
        reps = (cfg.tp if t.tp == "replicate" or cfg.tp == 1 else 1) * \
               (cfg.dp if cfg.dp_shard == "replicate" else 1)
        c = count_holdings(lay, StateKey(t.name))
        assert c.eq(reps).all(), (t, str(cfg), c)
    for rank in range(cfg.world_size):
        assert_bits_equal(lay, rank, ref_rank(model, cfg, rank), model)


@st.composite
def llama_case(draw):
    nkv = draw(st.sampled_from([1, 2, 4]))
    q_per = draw(st.sampled_from([1, 2, 3]))
    hd = draw(st.sampled_from([2, 4]))
    nh = nkv * q_per
    tp = draw(st.sampled_from([d for d in (1, 2, 4) if nkv % d == 0]))
    L = draw(st.integers(1, 3))
    pp = draw(st.integers(1, min(L, 2)))
    dp = draw(st.integers(1, 3))
    vocab = draw(st.integers(5, 23))
    vdb = draw(st.sampled_from([1, 2, 4] if vocab % tp else [None, 1, 2, 4]))
    cfg = dict(hidden_size=nh * hd, num_hidden_layers=L, num_attention_heads=nh,
               num_key_value_heads=nkv, intermediate_size=4 * draw(st.integers(1, 4)),
               vocab_size=vocab, tie_word_embeddings=draw(st.booleans()),
               attention_bias=draw(st.booleans()), mlp_bias=draw(st.booleans()))
    pc = ParallelConfig(tp=tp, pp=pp, dp=dp,
                        dp_shard=draw(st.sampled_from(["replicate", "fsdp", "zero3", "zero"])),
                        fuse_qkv=draw(st.booleans()), fuse_gate_up=draw(st.booleans()),
                        vocab_divisible_by=vdb)
    dtype = draw(st.sampled_from(["float32", "bfloat16"]))
    fields = draw(st.sampled_from([("param",), ("param", "exp_avg")]))
    return cfg, pc, dtype, fields


@SETTINGS
@given(llama_case())
def test_property_llama_layouts_match_megatron_reference(case):
    cfg, pc, dtype, fields = case
    model = Model(llama_spec(cfg, dtype=dtype), cfg)
    lay = build_layout(model.spec, pc, fields)
    lay.validate()
    for rank in range(pc.world_size):
        assert_bits_equal(lay, rank, ref_rank(model, pc, rank, fields), model)
    tied_pp = cfg["tie_word_embeddings"] and pc.pp > 1
    for name in model.names:
        reps = (2 if tied_pp and name == EMBED else 1) \
            * (pc.tp if llama_role(name) == "replicate" else 1) \
            * (pc.dp if pc.dp_shard == "replicate" else 1)
        assert count_holdings(lay, StateKey(name)).eq(reps).all(), (name, str(pc))


# =================================================================================================
# Errors
# =================================================================================================

def test_tp_error_names_every_failing_factor_in_one_message():
    # tp=4: heads 6 and kv heads 3 do not divide, vocab 102 neither (q/k/v/o rows still do)
    spec = llama_spec(tiny_cfg(hidden_size=48, num_attention_heads=6, num_key_value_heads=3,
                               intermediate_size=32, vocab_size=102, num_hidden_layers=1))
    with pytest.raises(LayoutError) as e:
        build_layout(spec, ParallelConfig(tp=4))
    msg = str(e.value)
    for part in ("TP=4", "num_attention_heads=6", "num_key_value_heads=3", f"{EMBED} vocab=102",
                 f"{LM_HEAD} vocab=102"):
        assert part in msg, (part, msg)
    # tp=2: only the kv heads and the vocab (101) fail
    spec = llama_spec(tiny_cfg(hidden_size=48, num_attention_heads=6, num_key_value_heads=3,
                               intermediate_size=32, vocab_size=101))
    with pytest.raises(LayoutError) as e:
        build_layout(spec, ParallelConfig(tp=2))
    msg = str(e.value)
    assert "num_key_value_heads=3" in msg and "vocab=101" in msg
    assert "num_attention_heads" not in msg


def _one_tensor_spec():
    return synthetic_spec([("w", (4, 3), "float32", "replicate")])


def _frag(tensor, lo, hi, buf="param/w", offset=0):
    shape = tuple(h - l for l, h in zip(lo, hi))
    return Fragment(StateKey(tensor), Box(tuple(lo), tuple(hi)), buf, offset, (shape[1], 1))


def test_validate_unknown_tensor():
    spec = _one_tensor_spec()
    lay = Layout(spec, [[_frag("w", (0, 0), (4, 3)), _frag("nope", (0, 0), (4, 3), "param/x")]],
                 [{"param/w": BufferSpec(12, "float32"), "param/x": BufferSpec(12, "float32")}],
                 name="hand")
    with pytest.raises(LayoutError, match="unknown tensor 'nope'"):
        lay.validate()


def test_validate_hole_does_not_cover():
    spec = _one_tensor_spec()
    lay = Layout(spec, [[_frag("w", (0, 0), (2, 3))], [_frag("w", (3, 0), (4, 3))]],
                 [{"param/w": BufferSpec(6, "float32")}, {"param/w": BufferSpec(3, "float32")}])
    with pytest.raises(LayoutError, match="does not cover"):
        lay.validate()
    lay.validate(require_cover=False)


def test_validate_overlapping_boxes_on_one_rank():
    spec = _one_tensor_spec()
    lay = Layout(spec, [[_frag("w", (0, 0), (3, 3)), _frag("w", (2, 0), (4, 3), offset=9)]],
                 [{"param/w": BufferSpec(15, "float32")}])
    with pytest.raises(LayoutError, match="overlapping"):
        lay.validate()
    # the same boxes on two different ranks are fine (overlap across ranks is replication)
    Layout(spec, [[_frag("w", (0, 0), (3, 3))], [_frag("w", (2, 0), (4, 3))]],
           [{"param/w": BufferSpec(9, "float32")}, {"param/w": BufferSpec(6, "float32")}]).validate()


def test_validate_view_outside_buffer_and_box_outside_tensor():
    spec = _one_tensor_spec()
    with pytest.raises(LayoutError, match="spans"):
        Layout(spec, [[_frag("w", (0, 0), (4, 3))]], [{"param/w": BufferSpec(11, "float32")}]).validate()
    with pytest.raises(LayoutError, match="outside shape"):
        Layout(spec, [[_frag("w", (0, 0), (5, 3))]], [{"param/w": BufferSpec(15, "float32")}]).validate()
    with pytest.raises(LayoutError, match="undeclared buffer"):
        Layout(spec, [[_frag("w", (0, 0), (4, 3))]], [{}]).validate()


def test_build_layout_wrong_world_size():
    spec = llama_spec(tiny_cfg(num_hidden_layers=2))
    cfg = ParallelConfig(tp=2, pp=2, dp=3)
    with pytest.raises(LayoutError) as e:
        build_layout(spec, cfg, world_size=8)
    msg = str(e.value)
    assert "tp·pp·dp" in msg and "2·2·3" in msg and "12" in msg and "8" in msg
    assert build_layout(spec, cfg, world_size=12).world_size == 12


def test_parallel_config_rejects_bad_sizes_and_modes():
    with pytest.raises(LayoutError, match="tp=0"):
        ParallelConfig(tp=0)
    with pytest.raises(LayoutError, match="dp_shard"):
        ParallelConfig(dp_shard="zero4")
    with pytest.raises(LayoutError, match="PP=3"):
        build_layout(llama_spec(tiny_cfg(num_hidden_layers=2)), ParallelConfig(pp=3))


# =================================================================================================
# Library bugs (these tests fail until fixed)
# =================================================================================================

def test_validate_checks_every_rank_even_when_ranks_share_a_fragment_tuple():
    """``Layout.validate`` skips a rank whose fragment tuple is the *same object* as an earlier
    rank's (``checked`` is keyed by ``id(frags)``), so that rank's buffers are never checked. A
    hand-made layout reusing one tuple with a missing / too small buffer on rank 1 passes."""
    spec = _one_tensor_spec()
    frags = (_frag("w", (0, 0), (4, 3)),)
    missing = Layout(spec, [frags, frags], [{"param/w": BufferSpec(12, "float32")}, {}])
    with pytest.raises(LayoutError, match="undeclared buffer"):
        missing.validate()
    small = Layout(spec, [frags, frags], [{"param/w": BufferSpec(12, "float32")},
                                          {"param/w": BufferSpec(3, "float32")}])
    with pytest.raises(LayoutError, match="spans"):
        small.validate()


_DTYPE_PROBE = """
from rlhf_switch.vps import ParallelConfig, build_layout, synthetic_spec
for other, vocab_dtype in (("float32", "bfloat16"), ("bfloat16", "float32")):
    spec = synthetic_spec([("a", (4, 2), other, "replicate"), ("v", (3, 2), vocab_dtype, "vocab")])
    lay = build_layout(spec, ParallelConfig(tp=2, vocab_divisible_by=4))  # 3 -> 8 rows, 4 per rank
    print(other, vocab_dtype, lay.buffers(0)["param/v"].dtype, lay.buffers(1)["param/v"].dtype)
"""


def test_padding_only_vocab_shard_buffer_has_the_tensor_dtype():
    """With vocab padding a TP rank may hold only padding rows of a vocab tensor (its local
    tensor has no parts). ``mesh._buffer_dtype`` then falls back to ``next(iter({t.dtype for t in
    spec.tensors}))``: with mixed dtypes that is an arbitrary, hash-seed dependent dtype, not the
    tensor's, so TP ranks disagree on the dtype of the same buffer. The probe runs under several
    fixed ``PYTHONHASHSEED``s so the outcome does not depend on this process's seed."""
    import os
    import subprocess
    import sys

    wrong = []
    for seed in ("0", "1", "2", "3"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run([sys.executable, "-c", _DTYPE_PROBE], env=env, check=True,
                             capture_output=True, text=True).stdout
        for line in out.splitlines():
            other, vocab_dtype, d0, d1 = line.split()
            assert d0 == vocab_dtype
            if d1 != vocab_dtype:
                wrong.append(f"PYTHONHASHSEED={seed}: tensor 'v' is {vocab_dtype} (other tensor "
                             f"{other}) but rank 1's padding-only buffer 'param/v' is {d1}")
    assert not wrong, "; ".join(wrong)


@pytest.mark.parametrize("tp, inter, block", [(1, 48, 16), (2, 48, 16), (2, 64, 16), (1, 64, 8)])
def test_blocked_experts_layout_is_pad_then_block_transpose(tp, inter, block):
    """``processed_layout`` with ``BlockedExperts`` forms places every expert element where an
    independent construction puts it: each expert's rows padded (w13: gate and up halves each to
    the next multiple of 32; w2: its columns), then viewed as ``[E, N'/b, b, K']`` and the last
    two dims swapped. Padding elements belong to no fragment; every other buffer is untouched."""
    from rlhf_switch.models import model_spec
    from rlhf_switch.testing.tiny_models import tiny_config
    from rlhf_switch.vps.layouts.vllm import expert_forms, processed_layout, vllm_layout
    from rlhf_switch.vps.materialize import coverage_masks

    spec = model_spec(tiny_config("qwen3_moe", moe_intermediate_size=inter))
    E, H, i = 4, 64, inter // tp
    pad = -(-i // 32) * 32
    base = vllm_layout(spec, tp)
    forms = {}
    for name in base.buffers(0):
        if name.endswith("w13_weight"):
            forms[name] = next(f for f in expert_forms(name, (E, 2 * i, H), (E, 2 * pad, H)) if f.block == block)
        elif name.endswith("w2_weight"):
            forms[name] = next(f for f in expert_forms(name, (E, H, i), (E, H, pad)) if f.block == block)
    layout = processed_layout(base, forms)
    state = {t.name: torch.randn(t.shape, generator=torch.Generator().manual_seed(k)) for k, t in enumerate(spec.tensors)}
    for r in range(tp):
        plain = materialize(base, r, lambda key: state[key.tensor])
        got, masks = materialize(layout, r, lambda key: state[key.tensor]), coverage_masks(layout, r)
        for name, b in layout.buffers(r).items():
            form = forms.get(name)
            if form is None:
                assert torch.equal(bits(got[name]), bits(plain[name])), name
                continue
            created = plain[name].view(form.created)
            padded = created.new_zeros(form.live)
            half, half2 = form.created[1] // form.halves, form.live[1] // form.halves
            for h in range(form.halves):
                padded[:, h * half2:h * half2 + half, :form.created[2]] = created[:, h * half:(h + 1) * half]
            want = padded.view(E, form.live[1] // block, block, form.live[2]).transpose(-1, -2).reshape(-1)
            assert b.numel == want.numel()
            assert torch.equal(bits(got[name]), bits(want)), name
            assert int(masks[name].sum()) == created.numel()  # padding: covered by no fragment


def test_vllm_parameter_shapes_and_names():
    """What the rollout engine checks its workers' parameters against: vLLM's names and shapes
    (FusedMoE's w13 [E, 2I/T, H] and w2 [E, H, I/T]; everything else the local shape)."""
    from rlhf_switch.vps.layouts.vllm import param_shape, vllm_buffer, worker_tensors

    spec = moe(hidden_size=8, moe_intermediate_size=4, num_experts=4).spec
    m = "model.layers.1.mlp.experts."
    assert vllm_buffer(m + "w13_weight") == m + "routed_experts.w13_weight"
    assert vllm_buffer(m + "w2_weight") == m + "routed_experts.w2_weight"
    assert vllm_buffer("model.layers.1.self_attn.qkv_proj.weight") == "model.layers.1.self_attn.qkv_proj.weight"
    for tp in (1, 2, 4):
        shapes = {lt.buffer: param_shape(spec, lt) for lt in worker_tensors(spec, tp, tp - 1)}
        assert shapes[m + "routed_experts.w13_weight"] == (4, 2 * 4 // tp, 8)
        assert shapes[m + "routed_experts.w2_weight"] == (4, 8, 4 // tp)
        assert shapes["model.layers.1.self_attn.qkv_proj.weight"] == ((4 // tp + 2 * max(1, 2 // tp)) * 4, 8)
        assert shapes["model.embed_tokens.weight"] == (64 // tp, 8)
        assert shapes["model.layers.1.mlp.gate.weight"] == (4, 8)
        assert all(type(n) is int for shape in shapes.values() for n in shape)  # torch's view() takes ints


# =================================================================================================
# The mesh's names, digests and refusals
# =================================================================================================

def test_parallel_config_names_coords_and_refusals():
    assert str(ParallelConfig()) == "DP1" and str(ParallelConfig(dp_shard="zero3")) == "DP1"
    assert str(ParallelConfig(dp=4)) == "DP4" and str(ParallelConfig(tp=2)) == "TP2"
    assert str(ParallelConfig(tp=2, pp=3, dp=4, ep=2, dp_shard="fsdp")) == "TP2·PP3·EP2·DP4[fsdp]"
    cfg = ParallelConfig(tp=2, pp=2, dp=3)
    assert cfg.world_size == 12
    # rank = pp·(dp·tp) + dp·tp + tp, written out
    assert [cfg.coords(r) for r in range(12)] == [(p, d, t) for p in range(2) for d in range(3) for t in range(2)]
    with pytest.raises(LayoutError, match=r"^parallel sizes must be >= 1: tp=0, dp=-1$"):
        ParallelConfig(tp=0, dp=-1)
    with pytest.raises(LayoutError, match=r"^parallel sizes must be >= 1: pp=0, ep=0$"):
        ParallelConfig(pp=0, ep=0)
    assert ParallelConfig(tp=1, pp=1, dp=1, ep=1).world_size == 1
    with pytest.raises(LayoutError, match=r"^EP=3 must divide DP=4 \(expert parallelism is carved out of DP\)$"):
        ParallelConfig(dp=4, ep=3)
    with pytest.raises(LayoutError, match=r"^dp_shard='zero4' is not one of \('replicate', 'fsdp', 'zero3', 'zero'\)$"):
        ParallelConfig(dp_shard="zero4")
    spec = llama_spec(tiny_cfg())
    with pytest.raises(LayoutError, match=r"^TP2·PP2·DP3 needs tp·pp·dp = 2·2·3 = 12 ranks, the world has 8$"):
        build_layout(spec, cfg, world_size=8)
    with pytest.raises(LayoutError, match=r"^EP=2 needs a mixture-of-experts model; 'llama' has no experts$"):
        build_layout(spec, ParallelConfig(dp=2, ep=2))
    with pytest.raises(LayoutError, match=r"^EP=4 does not divide num_experts=6$"):
        build_layout(moe(num_experts=6).spec, ParallelConfig(dp=4, ep=4))


def test_named_layouts_names():
    spec = llama_spec(tiny_cfg())
    assert replicated(spec, 3).name == "DP3" and fsdp(spec, 2).name == "DP2[fsdp]"
    assert build_layout(spec, ParallelConfig(tp=2), name="mine").name == "mine"
    z1, z2, z3 = zero(spec, 2, 1), zero(spec, 2, 2, fields=("param",)), zero(spec, 2, 3)
    assert (z1.name, z2.name, z3.name) == ("ZeRO1·DP2", "ZeRO2·DP2", "ZeRO3·DP2")
    assert z2.fields() == ("param",) and set(z2.buffers(0)) == {f"param/{n}" for n in spec._order()}
    only_adam = zero(spec, 2, 1, fields=ADAM_FIELDS)
    assert only_adam.name == "ZeRO1·DP2" and only_adam.fields() == tuple(sorted(ADAM_FIELDS))
    assert set(only_adam.buffers(1)) == {f"{f}/zero.flat" for f in ADAM_FIELDS}
    with pytest.raises(LayoutError, match=r"^ZeRO stage must be 1, 2 or 3, got 0$"):
        zero(spec, 2, 0)


def test_layout_digests_tell_every_argument_apart():
    """Plans are cached by the layouts' digests: two layouts differing in any argument must differ
    in digest, and the same arguments must give the same digest."""
    spec = llama_spec(tiny_cfg())
    base = dict(tp=2, dp=2, dp_shard="zero", vocab_divisible_by=2)
    variants = [dict(tp=1), dict(pp=2), dict(dp=4), dict(dp_shard="zero3"), dict(fuse_qkv=True),
                dict(fuse_gate_up=True), dict(vocab_divisible_by=4), dict(zero_alignment=4)]
    layouts = [build_layout(spec, ParallelConfig(**base))]
    layouts += [build_layout(spec, ParallelConfig(**{**base, **v})) for v in variants]
    layouts += [build_layout(spec, ParallelConfig(**base), ("param", "exp_avg")),
                build_layout(spec, ParallelConfig(**base), param_dtype="bfloat16"),
                build_layout(spec, ParallelConfig(**base), ("param", "exp_avg"), state_dtype="bfloat16"),
                build_layout(spec, ParallelConfig(pp=2, dp=2, stage_layers=(0, 2))),
                build_layout(spec, ParallelConfig(pp=2, dp=2, stage_layers=(1, 1)))]
    assert len({lay.digest for lay in layouts}) == len(layouts)
    assert build_layout(spec, ParallelConfig(**base)).digest == layouts[0].digest
    assert build_layout(spec, ParallelConfig(**base)) == layouts[0]


def test_a_flat_buffer_of_mixed_dtypes_is_refused_when_the_layout_is_built():
    """A ZeRO flat buffer holds one dtype: a model of two dtypes needs ``param_dtype`` (refused
    before any rank is asked for, not when a rank's buffers are first built)."""
    spec = synthetic_spec([("a", (4, 2), "float32", "replicate"), ("b", (3, 2), "bfloat16", "replicate")])
    for mode in ("zero", "zero3"):
        with pytest.raises(LayoutError, match=rf"^a flat {mode}\.flat buffer cannot hold tensors of several "
                                              r"dtypes \['bfloat16', 'float32'\]; pass param_dtype$"):
            build_layout(spec, ParallelConfig(dp=2, dp_shard=mode))
        lay = build_layout(spec, ParallelConfig(dp=2, dp_shard=mode), param_dtype="float16").validate()
        assert lay.buffers(1)[f"param/{mode}.flat"].dtype == "float16"
    # the Adam state is float32 whatever the model's dtypes: no refusal for it
    lay = build_layout(spec, ParallelConfig(dp=2, dp_shard="zero"), ("exp_avg",))
    assert lay.buffers(0)["exp_avg/zero.flat"].dtype == "float32"
    # replicated and FSDP buffers are per tensor: each keeps its own dtype
    lay = build_layout(spec, ParallelConfig(dp=2, dp_shard="fsdp"))
    assert (lay.buffers(0)["param/a"].dtype, lay.buffers(0)["param/b"].dtype) == ("float32", "bfloat16")


def test_pipeline_stage_refusals_and_edges():
    spec = llama_spec(tiny_cfg(num_hidden_layers=2))
    with pytest.raises(LayoutError, match=r"^PP=3 is larger than the model's 2 layers$"):
        build_layout(spec, ParallelConfig(pp=3))
    # one layer cannot fill two stages: refused, not split (1, 0)
    from rlhf_switch.vps.layouts.pipeline import stage_bounds
    with pytest.raises(LayoutError, match=r"^PP=2 is larger than the model's 1 layers$"):
        stage_bounds(1, 2)
    for bad in ((1, 0), (1, 0, 0), (3, 0, -1)):
        with pytest.raises(LayoutError, match=rf"^stage_layers={re.escape(str(bad))} must give 3 stages summing to 2 layers$"):
            build_layout(spec, ParallelConfig(pp=3, stage_layers=bad))
    # PP as deep as the layers, and stages without layers, are fine
    assert build_layout(spec, ParallelConfig(pp=2)).world_size == 2
    lay = build_layout(spec, ParallelConfig(pp=3, stage_layers=(0, 2, 0)))
    assert {f.key.tensor for f in lay.fragments(0)} == {EMBED}
    assert {f.key.tensor for f in lay.fragments(2)} == {NORM, LM_HEAD}
    # a model without layers: its tensors go by their anchors alone
    from rlhf_switch.vps import ModelSpec, TensorSpec
    flat = ModelSpec("flat", (TensorSpec("a", (4,), anchor="first"), TensorSpec("b", (2,), anchor="last")), 0)
    assert [f.key.tensor for f in build_layout(flat, ParallelConfig(dp=2)).validate().fragments(1)] == ["a", "b"]
    two = build_layout(flat, ParallelConfig(pp=2)).validate()
    assert [f.key.tensor for f in two.fragments(0)] == ["a"] and [f.key.tensor for f in two.fragments(1)] == ["b"]


def test_tp_refusal_lists_at_most_eight_factors():
    # 12 tensors of odd dims over TP2: the message names the first 8 and the count
    spec = synthetic_spec([(f"c{i}", (3, 2), "float32", "column") for i in range(6)]
                          + [(f"r{i}", (2, 3), "float32", "row") for i in range(6)])
    with pytest.raises(LayoutError) as e:
        build_layout(spec, ParallelConfig(tp=2))
    want = ("TP=2 does not divide " + ", ".join([f"c{i} dim 0=3" for i in range(6)] + ["r0 dim 1=3", "r1 dim 1=3"])
            + ", … (12 in all)")
    assert str(e.value) == want
    spec = synthetic_spec([("v", (5, 2), "float32", "vocab"), ("c", (4, 2), "float32", "column")])
    with pytest.raises(LayoutError) as e:
        build_layout(spec, ParallelConfig(tp=2))
    assert str(e.value) == "TP=2 does not divide v vocab=5 (pass vocab_divisible_by to pad it)"
    lay = build_layout(spec, ParallelConfig(tp=4, vocab_divisible_by=1))  # 5 -> 8 rows; c's 4 rows divide
    assert lay.buffers(3)["param/v"].numel == 2 * 2  # rows 6:8 of the padded 8: padding only
    with pytest.raises(LayoutError) as e:
        build_layout(spec, ParallelConfig(tp=3, vocab_divisible_by=2))  # 5 -> 6 rows; c's 4 rows do not split 3 ways
    assert str(e.value) == "TP=3 does not divide c dim 0=4"


def test_tp_refusal_edges_by_hand():
    """``check_tp`` at its edges: TP 0; exactly 8 factors (all named) and 9 (8 and the count); the
    heads named when ``vocab_divisible_by`` pads the vocabulary; and ``undivided_dims`` still checks
    the tensors after one it skips (vLLM's replicated k/v at TP above the KV heads)."""
    from rlhf_switch.vps.layouts.tensor_parallel import check_tp, undivided_dims

    with pytest.raises(LayoutError, match=r"^TP must be >= 1, got 0$"):
        check_tp(synthetic_spec([("c", (4, 2), "float32", "column")]), 0, None, False)
    for n, tail in ((8, ""), (9, ", … (9 in all)")):
        spec = synthetic_spec([(f"c{i}", (3, 2), "float32", "column") for i in range(n)])
        with pytest.raises(LayoutError) as e:
            build_layout(spec, ParallelConfig(tp=2))
        assert str(e.value) == "TP=2 does not divide " + ", ".join(f"c{i} dim 0=3" for i in range(8)) + tail
    # heads 6 and KV heads 3 over TP 4; every dim divides (vocab 102 padded to 104)
    spec = llama_spec(tiny_cfg(hidden_size=48, num_attention_heads=6, num_key_value_heads=3,
                               intermediate_size=32, vocab_size=102, num_hidden_layers=1))
    with pytest.raises(LayoutError) as e:
        build_layout(spec, ParallelConfig(tp=4, vocab_divisible_by=1))
    assert str(e.value) == "TP=4 does not divide num_attention_heads=6, num_key_value_heads=3"
    spec = synthetic_spec([("a", (3, 2), "float32", "column"), ("b", (2, 3), "float32", "row")])
    assert undivided_dims(spec, 2, lambda v: v, "", skip={"a"}) == ["b dim 1=3"]


def test_tp_fused_cover_check_by_hand():
    """``check_tp_cover`` on fused rules that lose elements, by hand: a ``qkv`` group whose q has
    more rows than its attention geometry gives (2 heads of head_dim 2: the rule takes 4 of q's 6
    rows), and ``concat`` groups of vocab-role members (``_fused`` splits them unpadded, where
    ``check_tp`` allowed them padded: 5 rows over TP 2 lose row 4). Only the groups the config
    fuses are checked, each geometry once (``b`` repeats ``a``'s: not named), in the spec's order;
    the message names the first 8 problems. ``local_tensors`` fuses nothing unless asked."""
    from rlhf_switch.vps import ModelSpec, TensorSpec
    from rlhf_switch.vps.layouts.tensor_parallel import check_tp_cover, local_tensors
    from rlhf_switch.vps.spec import AttentionGeometry, FusedGroup

    def vocab(name, rows):
        return TensorSpec(name, (rows, 2), tp="vocab", layer=0)

    tensors = (TensorSpec("q", (6, 4), tp="column", layer=0), TensorSpec("k", (4, 4), tp="column", layer=0),
               TensorSpec("v", (4, 4), tp="column", layer=0), vocab("a0", 5), vocab("a1", 5), vocab("b0", 5),
               vocab("b1", 5), vocab("c0", 7))
    groups = (FusedGroup("qkv", ("q", "k", "v"), "qkv"), FusedGroup("a", ("a0", "a1")),
              FusedGroup("b", ("b0", "b1")), FusedGroup("c", ("c0",)))
    spec = ModelSpec("lossy", tensors, 1, AttentionGeometry(2, 2, 2), groups)
    q = ["q in qkv: TP ranks hold 16 of its 24 elements"]
    a = [f"a{i} in a: TP ranks hold 8 of its 10 elements" for i in range(2)]
    c = ["c0 in c: TP ranks hold 12 of its 14 elements"]  # 7 rows: 3 a rank
    for fuse_qkv, fuse_gate_up, want in ((True, False, q), (False, True, a + c), (True, True, q + a + c)):
        with pytest.raises(LayoutError) as e:
            check_tp_cover(spec, 2, fuse_qkv, fuse_gate_up)
        assert str(e.value) == "TP=2 with fused buffers does not cover the model: " + "; ".join(want)
    check_tp_cover(spec, 2, False, False)  # nothing fused: unfused tensors follow check_tp's split
    assert [lt.buffer for lt in local_tensors(spec, [(t, t.name) for t in tensors], 2, 0)] == [t.name for t in tensors]

    nine = ModelSpec("nine", tuple(vocab(f"m{i}", 5) for i in range(9)), 1, None,
                     (FusedGroup("m", tuple(f"m{i}" for i in range(9))),))
    with pytest.raises(LayoutError) as e:
        check_tp_cover(nine, 2, False, True)
    assert str(e.value) == ("TP=2 with fused buffers does not cover the model: "
                            + "; ".join(f"m{i} in m: TP ranks hold 8 of its 10 elements" for i in range(8)))


# =================================================================================================
# Layouts derived from another: handoff buckets, host copies, buddy copies (hand values)
# =================================================================================================

def _hand_dst():
    """Two ranks. Rank 0 holds w (4×3 float32) whole, v (5, bfloat16) whole, u (2, float32) whole,
    in that order; rank 1 holds rows 1:3 of w at offset 2 of a buffer of 9."""
    spec = synthetic_spec([("w", (4, 3), "float32", "replicate"), ("v", (5,), "bfloat16", "replicate"),
                           ("u", (2,), "float32", "replicate")])
    w, v, u = StateKey("w"), StateKey("v"), StateKey("u")
    return Layout(spec, [[Fragment(w, Box((0, 0), (4, 3)), "param/w", 0, (3, 1)),
                          Fragment(v, Box((0,), (5,)), "param/v", 0, (1,)),
                          Fragment(u, Box((0,), (2,)), "param/u", 0, (1,))],
                         [Fragment(w, Box((1, 0), (3, 3)), "param/w", 2, (3, 1))]],
                  [{"param/w": BufferSpec(12, "float32"), "param/v": BufferSpec(5, "bfloat16"),
                    "param/u": BufferSpec(2, "float32")}, {"param/w": BufferSpec(9, "float16")}], "hand")


def test_buckets_by_hand():
    from rlhf_switch.vps.layouts.buckets import bucket_layout, bucket_name, worker_buckets

    dst = _hand_dst()
    w, v, u = StateKey("w"), StateKey("v"), StateKey("u")
    assert bucket_name(3, 1) == "bucket/3/1"
    # 32 B: w (48 B) cut into two runs of 2 rows (24 B each), a bucket each; v in a bfloat16 bucket
    # of its own; u (8 B) fits after w's second run (24 + 8 = 32 B)
    frags, bufs = worker_buckets(dst, 0, 32)
    assert frags == (Fragment(w, Box((0, 0), (2, 3)), "bucket/0/0", 0, (3, 1)),
                     Fragment(w, Box((2, 0), (4, 3)), "bucket/0/1", 0, (3, 1)),
                     Fragment(v, Box((0,), (5,)), "bucket/0/2", 0, (1,)),
                     Fragment(u, Box((0,), (2,)), "bucket/0/1", 6, (1,)))
    assert bufs == {"bucket/0/0": BufferSpec(6, "float32"), "bucket/0/1": BufferSpec(8, "float32"),
                    "bucket/0/2": BufferSpec(5, "bfloat16")}
    # 8 B: a row of w (12 B) does not fit: each row cut in 2 + 1 elements; v in runs of 4 elements;
    # every piece starts a new bucket when the open one of its dtype is full
    frags, bufs = worker_buckets(dst, 0, 8)
    assert [(f.key.tensor, f.box, f.buffer, f.offset) for f in frags][:3] == [
        ("w", Box((0, 0), (1, 2)), "bucket/0/0", 0), ("w", Box((0, 2), (1, 3)), "bucket/0/1", 0),
        ("w", Box((1, 0), (2, 2)), "bucket/0/2", 0)]
    assert [f.box for f in frags if f.key == v] == [Box((0,), (4,)), Box((4,), (5,))]
    assert sum(f.box.numel for f in frags) == 12 + 5 + 2
    assert all(b.numel * (4 if b.dtype == "float32" else 2) <= 8 for b in bufs.values())
    # 1-D runs: v (5 × 2 B) in 4 B buckets is 2 + 2 + 1; a bucket of one float16 row piece of rank 1
    frags, _ = worker_buckets(dst, 0, 4)
    assert [f.box for f in frags if f.key == v] == [Box((0,), (2,)), Box((2,), (4,)), Box((4,), (5,))]
    frags, bufs = worker_buckets(dst, 1, 100)
    assert frags == (Fragment(w, Box((1, 0), (3, 3)), "bucket/1/0", 0, (3, 1)),)
    assert bufs == {"bucket/1/0": BufferSpec(6, "float16")}
    with pytest.raises(LayoutError, match=r"^the bucket budget must be positive, not 0$"):
        worker_buckets(dst, 0, 0)
    with pytest.raises(LayoutError, match=r"^a bucket of 3 B cannot hold one float32 element$"):
        worker_buckets(dst, 0, 3)
    lay = bucket_layout(dst, {0: 1, 1: 1}, 32)
    assert lay.name == "buckets(hand)" and lay.fragments(0) == () and dict(lay.buffers(0)) == {}
    assert lay.fragments(1) == worker_buckets(dst, 0, 32)[0] + worker_buckets(dst, 1, 32)[0]
    assert dict(lay.buffers(1)) == {**worker_buckets(dst, 0, 32)[1], **worker_buckets(dst, 1, 32)[1]}
    assert lay.digest != bucket_layout(dst, {0: 1, 1: 0}, 32).digest != bucket_layout(dst, {0: 1, 1: 1}, 64).digest
    for bad in ({2: 0}, {0: 2}, {-1: 0}, {0: -1}):
        w_, h_ = next(iter(bad.items()))
        with pytest.raises(LayoutError, match=rf"^bucket holder {h_} of rank {w_} is outside a world of 2$"):
            bucket_layout(dst, bad, 32)


def test_host_and_buddy_copies_by_hand():
    from rlhf_switch.vps.layouts.buddy import buddy_layout, buddy_shift, holder_of, lost_owners
    from rlhf_switch.vps.layouts.host import host_layout

    dst = _hand_dst()
    w, v, u = StateKey("w"), StateKey("v"), StateKey("u")
    host = host_layout(dst)
    assert host.name == "host(hand)" and host_layout(dst, name="h").name == "h"
    assert host.fragments(1) == (Fragment(w, Box((1, 0), (3, 3)), "host/param/w", 0, (3, 1)),)
    assert dict(host.buffers(1)) == {"host/param/w": BufferSpec(6, "float16")}  # the padding is not carried
    assert [f.buffer for f in host.fragments(0)] == ["host/param/w", "host/param/v", "host/param/u"]
    # buddies, shift 1: rank 1 (rows 1:3 of w) keeps rank 0's copy, whose whole w partly overlaps
    # its own rows: a buddy copy does not cut boxes, refused
    with pytest.raises(LayoutError, match=r"^buddy layout: rank 1 holds part of w\[0:4,0:3\] of rank 0 "
                                          r"\(a partly overlapping box\); not supported$"):
        buddy_layout(dst)
    three = Layout(dst.spec, [dst.fragments(0), dst.fragments(0)[1:], dst.fragments(0)[:1]],
                   [dst.buffers(0), dst.buffers(0), dst.buffers(0)], "three")
    b = buddy_layout(three).validate()
    assert b.name == "buddy(three, shift 1)" and buddy_layout(three, name="x").name == "x"
    # rank 1 (v, u) keeps rank 0's w (v and u it holds itself); rank 2 (w) keeps rank 1's v and u;
    # rank 0 holds everything of rank 2 already
    assert b.fragments(1) == (Fragment(v, Box((0,), (5,)), "host/param/v", 0, (1,)),
                              Fragment(u, Box((0,), (2,)), "host/param/u", 0, (1,)),
                              Fragment(w, Box((0, 0), (4, 3)), "buddy/param/w", 0, (3, 1)))
    assert b.fragments(2)[1:] == (Fragment(v, Box((0,), (5,)), "buddy/param/v", 0, (1,)),
                                  Fragment(u, Box((0,), (2,)), "buddy/param/u", 0, (1,)))
    assert [f.buffer for f in b.fragments(0)] == ["host/param/w", "host/param/v", "host/param/u"]
    assert dict(b.buffers(2)) == {"host/param/w": BufferSpec(12, "float32"), "buddy/param/v": BufferSpec(5, "bfloat16"),
                                  "buddy/param/u": BufferSpec(2, "float32")}
    b2 = buddy_layout(three, shift=2)
    assert b2.name == "buddy(three, shift 2)"
    # shift 2: rank 0 keeps rank 1's v and u (held already), rank 2 keeps rank 0's (w held already)
    assert [f.buffer for f in b2.fragments(0)] == ["host/param/w", "host/param/v", "host/param/u"]
    assert [f.buffer for f in b2.fragments(2)] == ["host/param/w", "buddy/param/v", "buddy/param/u"]
    for bad in (0, 3, -1):
        with pytest.raises(LayoutError, match=rf"^buddy shift {bad} in a world of 3: expected 1\.\.2$"):
            buddy_layout(three, shift=bad)
    one = Layout(dst.spec, [dst.fragments(0)], [dst.buffers(0)], "one")
    assert buddy_layout(one, shift=5).fragments(0) == host_layout(one).fragments(0)  # nobody else to keep
    assert buddy_shift(["a"]) == 1 and buddy_shift(["a", "b", "c"]) == 1 and buddy_shift(["a", "a", "a"]) == 1
    assert buddy_shift(["a", "a", "a", "b", "b", "b"]) == 3
    assert [holder_of(r, 3) for r in range(3)] == [1, 2, 0]
    assert lost_owners(1, {0}) == [0] and lost_owners(3, {2, 0}) == [2] and lost_owners(3, []) == []


# vLLM's LoRA layers (vllm/lora/layers), written out: per wrapped module (qkv_proj, o_proj, gate_up_proj,
# down_proj) and per output slice of it (q, k, v; gate, up; one otherwise), lora_a_stacked[slice] is
# [max_loras, 1, max_rank, in_t] and lora_b_stacked[slice] [max_loras, 1, out_t, max_rank]; the adapter in
# slot s has A in the first r rows of slot s and B in its first r columns. A worker's A / B block is cut
# as its weight is: a column target's B takes the weight's rows (A whole), a row target's A its columns.

def ref_vllm_lora(model: Model, tp: int, rank: int, slot: int, max_rank: int) -> dict[str, torch.Tensor]:
    cfg, t = model.cfg, rank % tp
    nh = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or nh
    hd = cfg.get("head_dim") or cfg["hidden_size"] // nh
    base = {n: x for n, x in ref_vllm(model, tp, rank).items() if ".lora_" not in n}
    slices = {"q": ("self_attn.qkv_proj", 0), "k": ("self_attn.qkv_proj", 1), "v": ("self_attn.qkv_proj", 2),
              "o": ("self_attn.o_proj", 0), "gate": ("mlp.gate_up_proj", 0), "up": ("mlp.gate_up_proj", 1),
              "down": ("mlp.down_proj", 0)}
    for name in model.names:
        m = re.match(r"(model\.layers\.\d+\.)(self_attn|mlp)\.(\w+)_proj\.lora_A\.weight$", name)
        if not m:
            continue
        a, b = model.tensor(name), model.tensor(name.replace("lora_A", "lora_B"))
        which = m.group(3)
        if which in ("o", "down"):  # row target: A's columns split, B whole
            a = a.tensor_split(tp, 1)[t]
        elif which == "q":
            b = b[t * nh // tp * hd:(t + 1) * nh // tp * hd]
        elif which in ("k", "v"):
            heads = range(t * kv // tp, (t + 1) * kv // tp) if tp <= kv else [t // (tp // kv)]
            b = b[heads[0] * hd:(heads[-1] + 1) * hd]
        else:
            b = b.tensor_split(tp, 0)[t]
        module, index = slices[which]
        r = a.shape[0]
        sa = torch.zeros(slot + 1, max_rank, a.shape[1], dtype=a.dtype)
        sa[slot, :r] = a
        sb = torch.zeros(slot + 1, b.shape[0], max_rank, dtype=b.dtype)
        sb[slot, :, :r] = b
        base[f"lora/{m.group(1)}{module}.lora_a_stacked.{index}"] = sa.reshape(-1)
        base[f"lora/{m.group(1)}{module}.lora_b_stacked.{index}"] = sb.reshape(-1)
    return base


@pytest.mark.parametrize("tp,replicas,slot,r", [(1, 1, 0, 8), (2, 2, 1, 3), (4, 1, 2, 16)])
def test_vllm_lora_layout_matches_vllm_lora_slots(tp, replicas, slot, r):
    from rlhf_switch.vps.layouts.vllm import vllm_lora_layout
    from rlhf_switch.vps.spec import LoraSpec

    cfg = tiny_cfg()  # 4 heads, 2 KV heads: at TP 4 two workers share each KV head's B rows
    spec = llama_spec(cfg).with_adapters(LoraSpec(r, 2.0 * r, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                               "up_proj", "down_proj")))
    model = Model(spec, cfg)
    lay = vllm_lora_layout(spec, tp, replicas, slot=slot).validate()
    assert lay.name == f"vLLM-TP{tp}" + (f"×{replicas}" if replicas > 1 else "") + "·LoRA"
    for rank in range(tp * replicas):
        assert_bits_equal(lay, rank, ref_vllm_lora(model, tp, rank, slot, 8 if r <= 8 else 16), model)
    assert vllm_lora_layout(spec, tp, replicas, slot=slot) == lay
    assert vllm_lora_layout(spec, tp, replicas, slot=slot + 1) != lay
    half = vllm_lora_layout(spec, tp, replicas, dtype="bfloat16", slot=slot)
    assert {b.dtype for b in half.buffers(0).values()} == {"bfloat16"} and half != lay


def test_vllm_lora_ranks_and_names():
    from rlhf_switch.vps.layouts.vllm import lora_slot_buffer, vllm_lora_layout, vllm_lora_rank

    assert [vllm_lora_rank(r) for r in (1, 2, 8, 9, 16, 17, 256, 257, 320, 321, 512)] == \
        [1, 8, 8, 16, 16, 32, 256, 320, 320, 512, 512]
    with pytest.raises(LayoutError, match=r"^vLLM runs LoRA ranks up to 512, not 513$"):
        vllm_lora_rank(513)
    assert lora_slot_buffer("model.layers.0.self_attn.qkv_proj", "b", 2) == \
        "lora/model.layers.0.self_attn.qkv_proj.lora_b_stacked.2"
    with pytest.raises(LayoutError, match=r"^model 'llama' has no LoRA adapters$"):
        vllm_lora_layout(llama_spec(tiny_cfg()), 2)
    # by default one engine, its adapter in slot 0
    from rlhf_switch.vps.spec import LoraSpec

    spec = llama_spec(tiny_cfg()).with_adapters(LoraSpec(4, 8.0, ("q_proj",)))
    lay = vllm_lora_layout(spec, 2)
    assert lay.world_size == 2 and lay == vllm_lora_layout(spec, 2, 1, slot=0)
    assert {f.offset for f in lay.fragments(0) if ".lora_" in f.key.tensor} == {0}


def test_buckets_cut_boxes_off_row_0_and_at_every_budget_edge():
    """Cuts of boxes that do not start at row 0 (rank 1 holds rows 1:3 of w), a budget of exactly
    one row, of one element, and a 3-D tensor's dense strides, all written out by hand."""
    from rlhf_switch.vps.layouts.buckets import worker_buckets

    dst = _hand_dst()
    w, u = StateKey("w"), StateKey("u")
    # rank 1's w rows 1:3 (float16, 6 B a row): 8 B fits one row, and two do not share a bucket
    frags, bufs = worker_buckets(dst, 1, 8)
    assert frags == (Fragment(w, Box((1, 0), (2, 3)), "bucket/1/0", 0, (3, 1)),
                     Fragment(w, Box((2, 0), (3, 3)), "bucket/1/1", 0, (3, 1)))
    assert bufs == {"bucket/1/0": BufferSpec(3, "float16"), "bucket/1/1": BufferSpec(3, "float16")}
    # 4 B: a row does not fit, each row cut in 2 + 1 elements, a bucket each
    frags, _ = worker_buckets(dst, 1, 4)
    assert frags == (Fragment(w, Box((1, 0), (2, 2)), "bucket/1/0", 0, (2, 1)),
                     Fragment(w, Box((1, 2), (2, 3)), "bucket/1/1", 0, (1, 1)),
                     Fragment(w, Box((2, 0), (3, 2)), "bucket/1/2", 0, (2, 1)),
                     Fragment(w, Box((2, 2), (3, 3)), "bucket/1/3", 0, (1, 1)))
    # rank 0's w (float32, 12 B a row) at 12 B: one row a bucket, all four rows
    frags, _ = worker_buckets(dst, 0, 12)
    assert [f.box for f in frags if f.key == w] == [Box((i, 0), (i + 1, 3)) for i in range(4)]
    # 4 B is one float32 element: u in two pieces of one element, no bucket over 4 B
    frags, bufs = worker_buckets(dst, 0, 4)
    assert [(f.box, f.offset) for f in frags if f.key == u] == [(Box((0,), (1,)), 0), (Box((1,), (2,)), 0)]
    assert all(b.numel * (4 if b.dtype == "float32" else 2) <= 4 for b in bufs.values())
    # a 3-D tensor keeps dense row-major strides; a 1-byte dtype fits a budget of 1 B, an element a bucket
    spec = synthetic_spec([("c", (2, 3, 4), "float32", "replicate"), ("b", (3,), "uint8", "replicate")])
    c, b = StateKey("c"), StateKey("b")
    lay = Layout(spec, [[Fragment(c, Box((0, 0, 0), (2, 3, 4)), "param/c", 0, (12, 4, 1)),
                         Fragment(b, Box((0,), (3,)), "param/b", 0, (1,))]],
                 [{"param/c": BufferSpec(24, "float32"), "param/b": BufferSpec(3, "uint8")}], "3d")
    frags, _ = worker_buckets(lay, 0, 1 << 10)
    assert frags[0] == Fragment(c, Box((0, 0, 0), (2, 3, 4)), "bucket/0/0", 0, (12, 4, 1))
    # 16 B: a [3, 4] slab (48 B) does not fit, nor a row of 4 (16 B fits exactly: one row a piece)
    frags, _ = worker_buckets(lay, 0, 16)
    assert [f.box for f in frags if f.key == c] == [Box((i, j, 0), (i + 1, j + 1, 4)) for i in range(2) for j in range(3)]
    assert all(f.strides == (4, 4, 1) for f in frags if f.key == c)
    only_b = Layout(spec, [lay.fragments(0)[1:]], [{"param/b": BufferSpec(3, "uint8")}], "b")
    frags, bufs = worker_buckets(only_b, 0, 1)
    assert [(f.box, f.buffer) for f in frags] == [(Box((i,), (i + 1,)), f"bucket/0/{i}") for i in range(3)]
    assert bufs == {f"bucket/0/{i}": BufferSpec(1, "uint8") for i in range(3)}


def test_host_and_buddy_copies_of_a_shared_buffer_and_of_distinct_ranks():
    """Two fragments of one buffer are packed one after the other; with every rank holding
    something else, each rank keeps exactly its predecessor's share (shift 1)."""
    from rlhf_switch.vps.layouts.buddy import buddy_layout, lost_owners
    from rlhf_switch.vps.layouts.host import host_layout

    dst = _hand_dst()
    w, v, u = StateKey("w"), StateKey("v"), StateKey("u")
    flat = Layout(dst.spec, [[Fragment(w, Box((0, 0), (4, 3)), "param/flat", 2, (3, 1)),
                              Fragment(u, Box((0,), (2,)), "param/flat", 14, (1,))],
                             [Fragment(v, Box((0,), (5,)), "param/v", 0, (1,))]],
                  [{"param/flat": BufferSpec(16, "float32")}, {"param/v": BufferSpec(5, "bfloat16")}], "flat")
    host = host_layout(flat).validate()
    assert host.spec is flat.spec
    assert host.fragments(0) == (Fragment(w, Box((0, 0), (4, 3)), "host/param/flat", 0, (3, 1)),
                                 Fragment(u, Box((0,), (2,)), "host/param/flat", 12, (1,)))
    assert dict(host.buffers(0)) == {"host/param/flat": BufferSpec(14, "float32")}
    b = buddy_layout(flat).validate()
    assert b.spec is flat.spec
    assert b.fragments(1) == (Fragment(v, Box((0,), (5,)), "host/param/v", 0, (1,)),
                              Fragment(w, Box((0, 0), (4, 3)), "buddy/param/flat", 0, (3, 1)),
                              Fragment(u, Box((0,), (2,)), "buddy/param/flat", 12, (1,)))
    assert dict(b.buffers(1)) == {"host/param/v": BufferSpec(5, "bfloat16"),
                                  "buddy/param/flat": BufferSpec(14, "float32")}
    assert b.fragments(0)[2:] == (Fragment(v, Box((0,), (5,)), "buddy/param/v", 0, (1,)),)
    with pytest.raises(LayoutError, match=r"^buddy shift 2 in a world of 2: expected 1\.\.1$"):
        buddy_layout(flat, shift=2)
    # three ranks holding w, v and u: rank h keeps rank h - 1's (not h + 1's)
    own = [dst.fragments(0)[i:i + 1] for i in range(3)]
    three = Layout(dst.spec, own, [dst.buffers(0)] * 3, "distinct")
    b = buddy_layout(three).validate()
    assert [[(f.key.tensor, f.buffer) for f in b.fragments(h)] for h in range(3)] == [
        [("w", "host/param/w"), ("u", "buddy/param/u")], [("v", "host/param/v"), ("w", "buddy/param/w")],
        [("u", "host/param/u"), ("v", "buddy/param/v")]]
    # who is lost: an owner whose copy's holder is lost too
    assert lost_owners(2, {0}) == [] and lost_owners(2, {0, 1}) == [0, 1]
    assert lost_owners(4, {0, 2}, shift=2) == [0, 2] and lost_owners(4, {0, 1}, shift=2) == []
    assert lost_owners(4, {0, 1}) == [0]


def test_pipeline_stage_tensors_of_one_stage_and_of_all():
    """``stage_tensors`` (one stage) and ``all_stage_tensors`` (every stage in one pass) against the
    reference's stage split, tied embeddings, custom splits and a model without layers included."""
    from rlhf_switch.vps import ModelSpec, TensorSpec
    from rlhf_switch.vps.layouts.pipeline import all_stage_tensors, stage_bounds, stage_tensors

    cases = [(tiny(num_hidden_layers=3), 2, None), (tiny(num_hidden_layers=3), 3, None),
             (tiny(num_hidden_layers=7), 3, None), (tiny(num_hidden_layers=4), 3, (2, 0, 2)),
             (tiny(num_hidden_layers=3, tie_word_embeddings=True), 2, None),
             (tiny(num_hidden_layers=3, tie_word_embeddings=True), 1, None)]
    for model, pp, layers in cases:
        every = all_stage_tensors(model.spec, pp, layers)
        assert len(every) == pp
        for s in range(pp):
            want = ref_stage(model, pp, s, layers)
            assert [(t.name, buf) for t, buf in stage_tensors(model.spec, pp, s, layers)] == want, (pp, layers, s)
            assert [(t.name, buf) for t, buf in every[s]] == want, (pp, layers, s)
    assert stage_bounds(7, 3) == [(0, 3), (3, 5), (5, 7)] and stage_bounds(4, 3, (2, 0, 2)) == [(0, 2), (2, 2), (2, 4)]
    flat = ModelSpec("flat", (TensorSpec("a", (4,), anchor="first"), TensorSpec("b", (2,), anchor="last")), 0)
    for pp in (1, 2):
        for s in range(pp):
            names = [t.name for t, _ in stage_tensors(flat, pp, s)]
            assert names == [t.name for t, _ in all_stage_tensors(flat, pp)[s]]
            assert names == (["a", "b"] if pp == 1 else [["a"], ["b"]][s])


def local_from_parts(model: Model, lt) -> torch.Tensor:
    """A local tensor built from its parts alone: each part's box of the global tensor, written
    at its first local row; rows no part fills are 0 (vocabulary padding)."""
    x = torch.zeros(lt.shape, dtype=torch_dtype(lt.dtype))
    for p in lt.parts:
        piece = model.tensor(p.tensor)[tuple(slice(lo, hi) for lo, hi in zip(p.box.lo, p.box.hi))]
        x[p.row:p.row + p.box.shape[0]] = piece.reshape((p.box.shape[0],) + tuple(lt.shape[1:]))
    return x


@pytest.mark.parametrize("model,tp", [
    (tiny(), 1), (tiny(attention_bias=True, mlp_bias=True), 2), (tiny(), 4),
    (tiny(num_key_value_heads=4, attention_bias=True), 4), (tiny(tie_word_embeddings=True), 2),
    (tiny(num_key_value_heads=1, vocab_size=100), 4), (moe(hidden_size=8, moe_intermediate_size=4, num_experts=4), 2),
    (moe(hidden_size=8, moe_intermediate_size=4, num_experts=4), 4),
    (tiny(vocab_size=32), 4)], ids=lambda x: str(x) if isinstance(x, int) else "")  # 32 -> 64 rows: worker 2 starts at 32
def test_vllm_worker_tensors_are_vllms_parameters(model, tp):
    """``worker_tensors`` (the local tensors the rollout engines view vLLM's parameters as) hold,
    built from their parts alone, what vLLM's rules put in each parameter (``ref_vllm``), with the
    model's dtype."""
    from rlhf_switch.vps.layouts.vllm import worker_tensors

    for t in range(tp):
        local = worker_tensors(model.spec, tp, t)
        got = {f"param/{lt.buffer}": local_from_parts(model, lt).reshape(-1) for lt in local}
        want = ref_vllm(model, tp, t)
        assert sorted(got) == sorted(want)
        for name, x in want.items():
            assert got[name].dtype == x.dtype and torch.equal(bits(got[name]), bits(x)), (tp, t, name)
        assert all(type(n) is int for lt in local for n in lt.shape)
        assert all(p.box.numel > 0 for lt in local for p in lt.parts)  # padding rows are no part


def test_mesh_named_layouts_pass_fields_and_dtypes_on():
    """``replicated``, ``fsdp`` and ``zero`` build the fields they are given, in the dtypes asked
    for; ZeRO-1/2's ``param`` alone is DDP's replicated layout (the same digest: one plan)."""
    spec = llama_spec(tiny_cfg())
    for lay in (replicated(spec, 2, ("param", "exp_avg"), param_dtype="bfloat16"),
                fsdp(spec, 2, ("param", "exp_avg"), param_dtype="bfloat16"),
                zero(spec, 2, 3, ("param", "exp_avg"), param_dtype="bfloat16", state_dtype="float64"),
                zero(spec, 2, 1, ("param", "exp_avg"), param_dtype="bfloat16", state_dtype="float64")):
        assert set(lay.fields()) == {"param", "exp_avg"}
        state = "float64" if lay.name.startswith("ZeRO") else "float32"
        assert {n.split("/")[0]: b.dtype for n, b in lay.buffers(1).items()} == {"param": "bfloat16",
                                                                                 "exp_avg": state}
    assert zero(spec, 2, 2, ("exp_avg",), state_dtype="float64").buffers(0)["exp_avg/zero.flat"].dtype == "float64"
    assert zero(spec, 2, 1, ("param",)) == replicated(spec, 2) and zero(spec, 2, 1, ("param",)).name == "ZeRO1·DP2"


@pytest.mark.parametrize("kv,tp", [(2, 4), (2, 2), (1, 4)])
def test_vllm_holders_of_any_box_are_those_an_index_finds(kv, tp):
    """``Workers`` answers which workers hold a box of a tensor without building them (the planner
    asks it for every box it moves): for every box of rows and columns of a KV head split
    (TP > KV: heads shared), a row split and a column split, the same holders as a scan of every
    rank's fragments."""
    from rlhf_switch.vps.layout import _overlap

    spec = tiny(num_key_value_heads=kv, attention_bias=True).spec
    eager = vllm_layout(spec, tp)
    for name in ("model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.k_proj.bias",
                 "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.o_proj.weight", EMBED):
        key, shape = StateKey(name), spec[name].shape
        cuts = [sorted({0, 1, n // 2, n // 2 + 1, n - 1, n} | set(range(0, n + 1, 4))) for n in shape]
        spans = [[(a, b) for a in c for b in c if a < b] for c in cuts]
        probes = [Box((r[0],), (r[1],)) for r in spans[0]] if len(shape) == 1 else \
            [Box((r[0], c[0]), (r[1], c[1])) for r in spans[0] for c in spans[1]]
        for box in probes:
            lazy = vllm_layout(spec, tp)  # asked before any index is built: Workers answers
            got = sorted((b, r) for b, held in lazy._meeting(key, box) for h in held for r in h.ranks)
            want = sorted((f.box, r) for r in range(tp) for f in eager.fragments(r)
                          if f.key == key and _overlap(f.box, box))
            assert got == want, (name, box)
        # a geometry names only keys the engine holds: no optimizer state
        lazy = vllm_layout(spec, tp)
        assert lazy._geometry(key) is not None and lazy._geometry(StateKey(name, "exp_avg")) is None
        assert lazy._meeting(StateKey(name, "exp_avg"), Box.full(shape)) == []


def test_mesh_geometries_group_like_tensors_of_one_ep_rank():
    """Under DP replicate, tensors of one shape, TP role, dtype, stage and EP rank are held alike
    and share a geometry (the planner works each geometry out once): the experts of one EP rank
    do, those of two EP ranks do not, and without EP an expert shares it with a dense tensor of
    its shape and role."""
    model = moe(hidden_size=8, num_attention_heads=4, head_dim=4, moe_intermediate_size=16, num_experts=4)
    gate = "model.layers.0.mlp.experts.{}.gate_proj.weight"
    q = "model.layers.0.self_attn.q_proj.weight"  # [16, 8], column: an expert's gate_proj's shape and role
    ep2 = build_layout(model.spec, ParallelConfig(dp=4, ep=2))
    g = [ep2._geometry(StateKey(gate.format(e))) for e in range(4)]
    assert g[0] is not None and g[0] == g[1] and g[2] == g[3] and g[0] != g[2]
    assert ep2._geometry(StateKey(q)) not in (None, g[0], g[2])
    one = build_layout(model.spec, ParallelConfig(dp=2))
    assert len({one._geometry(StateKey(name)) for name in [q] + [gate.format(e) for e in range(4)]}) == 1
    assert one._geometry(StateKey(q, "exp_avg")) is None  # a field the layout does not hold


def test_mesh_holders_by_field_and_ep_rank():
    """A mesh layout's holders, asked before any class is built: each field's boxes in that
    field's dtype (``param_dtype`` for ``param``, ``state_dtype`` for the others, as the buffers
    are), nothing for a field the layout does not hold, and for an expert only the classes of its
    EP rank built (DP rank d is EP rank d % EP: expert 3 of 4 at EP 2 is on DP ranks 1 and 3)."""
    spec = moe(num_experts=4).spec
    expert = "model.layers.0.mlp.experts.3.down_proj.weight"
    for cfg in (ParallelConfig(dp=2), ParallelConfig(dp=4, ep=2, dp_shard="zero3")):
        for name in (NORM, expert):
            lay = build_layout(spec, cfg, ("param", "exp_avg"), param_dtype="float16", state_dtype="float64")
            for field, dtype in (("param", "float16"), ("exp_avg", "float64")):
                held = [h for hs in lay._key_index(StateKey(name, field)).values() for h in hs]
                assert held and all(h.dtype == dtype == lay.buffers(h.ranks[0])[h.fragment.buffer].dtype
                                    for h in held), (cfg, name, field)
            assert lay._key_index(StateKey(name, "exp_avg_sq")) == {}
    lay = build_layout(spec, ParallelConfig(dp=4, ep=2, dp_shard="zero3"))
    held = [h for hs in lay._key_index(StateKey(expert)).values() for h in hs]
    assert sorted({r for h in held for r in h.ranks}) == [1, 3]
    assert sorted(lay._rank_classes().built) == [1, 3]  # class c is DP rank c here


def test_zero_pads_to_twice_dp_by_default_and_fused_rows_must_stack():
    """``data_parallel.zero``'s default alignment is DeepSpeed's 2 (a flat range padded to a
    multiple of 2·DP); a fused group whose members' local rows differ cannot be one buffer."""
    from rlhf_switch.vps import ModelSpec, TensorSpec
    from rlhf_switch.vps.layouts import data_parallel
    from rlhf_switch.vps.layouts.local import whole
    from rlhf_switch.vps.spec import FusedGroup

    five = [whole("a", (5,), "float32")]
    assert [data_parallel.zero(five, 2, r)[1] for r in range(2)] == [{"zero.flat": 4}] * 2  # 5 -> 8
    assert data_parallel.zero(five, 2, 1)[0] == [("a", Box((4,), (5,)), "zero.flat", 0, (1,))]
    assert data_parallel.zero(five, 2, 1, alignment=3)[1] == {"zero.flat": 3}  # 5 -> 6
    spec = ModelSpec("odd", (TensorSpec("g", (4, 2), tp="column", layer=0), TensorSpec("u", (4, 3), tp="column", layer=0)),
                     1, fused=(FusedGroup("gu", ("g", "u")),))
    with pytest.raises(LayoutError, match=re.escape("fused buffer gu: member u has local shape (2, 3), the first "
                                                    "member's rows are (2,); they cannot stack on dim 0")):
        build_layout(spec, ParallelConfig(tp=2, fuse_gate_up=True))


def test_blocked_experts_refusals_by_hand():
    """``BlockedExperts.problems`` names each way a created ``[E, N, K]`` buffer does not fit the
    live one, and ``fragments`` refuses a fragment that is not a row-major slab of it."""
    from rlhf_switch.vps.layouts.vllm import BlockedExperts

    assert BlockedExperts((2, 6, 4), (2, 8, 4), 2, 4).problems() == []
    assert BlockedExperts((2, 6, 4), (3, 8, 4), 2, 4).problems() == ["[2, 6, 4] does not fit [3, 8, 4]"]
    assert BlockedExperts((2, 6, 4), (2, 4, 4), 2, 2).problems() == ["[2, 6, 4] does not fit [2, 4, 4]"]
    assert BlockedExperts((2, 6, 4), (2, 8, 2), 2, 2).problems() == ["[2, 6, 4] does not fit [2, 8, 2]"]
    assert BlockedExperts((2, 6, 4), (2, 8, 4), 2, 8).problems() == ["2 row ranges of 6 -> 8 rows are not whole blocks of 8"]
    assert BlockedExperts((2, 5, 4), (2, 8, 4), 2, 4).problems() == ["2 row ranges of 5 -> 8 rows are not whole blocks of 4"]
    assert BlockedExperts((2, 6, 4), (2, 9, 4), 1, 3).problems() == []
    form = BlockedExperts((2, 6, 4), (2, 8, 4), 2, 4)
    w = StateKey("w")
    with pytest.raises(LayoutError, match=re.escape("w: a fragment of strides (1, 6) in a [2, 6, 4] expert buffer is not "
                                                    "a row-major slab of it; 4-row blocks of [2, 8, 4] cannot place it")):
        form.fragments(Fragment(w, Box((0, 0), (2, 4)), "b", 0, (1, 6)))
    # a [2, 6, 4] buffer (gate rows 0:3, up rows 3:6 of each expert): a fragment must lie inside one
    # expert's one row range; its offset says where it starts (e·N·K + n·K + k)
    assert form.fragments(Fragment(w, Box((1, 0), (2, 4)), "b", 4, (4, 1))) == [Fragment(w, Box((1, 0), (2, 4)), "b", 1, (1, 4))]
    for offset, box, rows, cols, e in ((48, Box((0, 0), (1, 4)), "[0, 1)", "[0, 4)", 2),  # no expert 2
                                       (2, Box((0, 0), (1, 4)), "[0, 1)", "[2, 6)", 0),  # past column 4
                                       (8, Box((0, 0), (2, 4)), "[2, 4)", "[0, 4)", 0),  # gate row 2, up row 3
                                       (44, Box((0, 0), (2, 4)), "[5, 7)", "[0, 4)", 1)):  # past row 6
        with pytest.raises(LayoutError, match=re.escape(f"w: its rows {rows} x columns {cols} of expert {e} do not fit "
                                                        f"one row range of a [2, 6, 4] buffer")):
            form.fragments(Fragment(w, box, "b", offset, (4, 1)))


def test_expert_forms_by_hand():
    """``expert_forms``: a ``w13`` buffer is two row ranges (gate, up), each padded to whole blocks
    (6 -> 8 rows: 4-row blocks only), a ``w2`` buffer one (8 rows: 8- and 4-row blocks, in
    ``EXPERT_BLOCKS``' order); a buffer that is not 3-D before or after loading has no form."""
    from rlhf_switch.vps.layouts.vllm import BlockedExperts, expert_forms

    w13 = "model.layers.0.mlp.experts.routed_experts.w13_weight"
    w2 = "model.layers.0.mlp.experts.routed_experts.w2_weight"
    assert expert_forms(w13, (2, 6, 4), (2, 8, 4)) == [BlockedExperts((2, 6, 4), (2, 8, 4), 2, 4)]
    assert expert_forms(w2, (2, 6, 4), (2, 8, 4)) == [BlockedExperts((2, 6, 4), (2, 8, 4), 1, b) for b in (8, 4)]
    assert expert_forms(w13, (2, 6, 4), (16, 4)) == expert_forms(w13, (12, 4), (2, 8, 4)) == []


def test_processed_layout_refuses_a_form_that_does_not_fit():
    """``processed_layout`` names each problem of each form before building anything; without
    forms it is the base layout itself."""
    from rlhf_switch.vps.layouts.vllm import BlockedExperts, processed_layout

    base = vllm_layout(tiny().spec, 1)
    assert processed_layout(base, {}) is base
    with pytest.raises(LayoutError) as e:
        processed_layout(base, {"param/w": BlockedExperts((2, 6, 4), (3, 8, 4), 2, 8)})
    assert str(e.value) == "param/w: [2, 6, 4] does not fit [3, 8, 4]; 2 row ranges of 6 -> 8 rows are not whole blocks of 8"


def test_processed_layout_keeps_the_base_spec_and_its_holders():
    """A processed layout is one of the base's model, named after it, and its holders (what the
    planner asks) are those of its fragments, rank by rank: the same keys as the base, every
    processed expert fragment with strides ``(1, block)``."""
    from rlhf_switch.models import model_spec
    from rlhf_switch.testing.tiny_models import tiny_config
    from rlhf_switch.vps.layouts.vllm import expert_forms, processed_layout

    spec = model_spec(tiny_config("qwen3_moe", moe_intermediate_size=48))
    base = vllm_layout(spec, 2, replicas=2)
    forms = {n: expert_forms(n, (4, 48, 64), (4, 64, 64))[0] for n in base.buffers(0) if n.endswith("w13_weight")}
    lay = processed_layout(base, forms)
    assert forms and lay.spec is spec and lay.name == "vLLM-TP2×2·processed"
    assert sorted(lay.all_keys()) == sorted(base.all_keys())
    for key in lay.all_keys():
        held = [(r, f) for box, hs in lay._key_index(key).items() for h in hs for r in h.ranks for f in [h.fragment]]
        assert sorted((r, f) for r, f in held) == sorted((r, f) for r in range(4) for f in lay.fragments(r) if f.key == key)
        assert all(f.strides == (1, 16) for _, f in held if f.buffer in forms)


def test_blocked_experts_fragment_across_blocks_by_hand():
    """A fragment whose rows cross a block boundary becomes one fragment per block, at the element
    ``e·N'·K' + (n' // b)·b·K' + k·b + n' % b`` of its first row and column (here rows 2..5,
    columns 1..2 of a [1, 8, 3] buffer in 4-row blocks: rows 2-3 in block 0, rows 4-5 in block 1)."""
    from rlhf_switch.vps.layouts.vllm import BlockedExperts

    form, w = BlockedExperts((1, 8, 3), (1, 8, 3), 1, 4), StateKey("w")
    assert form.fragments(Fragment(w, Box((10, 1), (14, 3)), "b", 2 * 3 + 1, (3, 1))) == [
        Fragment(w, Box((10, 1), (12, 3)), "b", 1 * 4 + 2, (1, 4)),
        Fragment(w, Box((12, 1), (14, 3)), "b", 1 * 4 * 3 + 1 * 4, (1, 4))]


def test_vllm_worker_of_only_vocabulary_padding_holds_no_embedding_rows():
    """Vocabulary 96, padded to 128, over TP 4: worker 3's rows [96, 128) are all padding, so it
    holds no fragment of the embedding (its buffer is still there) and is no holder of it."""
    spec = tiny(vocab_size=96).spec
    lay = vllm_layout(spec, 4)
    assert [r for r in range(4) if any(f.key.tensor == EMBED for f in lay.fragments(r))] == [0, 1, 2]
    assert f"param/{EMBED}" in lay.buffers(3)
    assert sorted(r for hs in lay._key_index(StateKey(EMBED)).values() for h in hs for r in h.ranks) == [0, 1, 2]


def test_vllm_row_split_of_a_3d_tensor_by_hand():
    """A row-role tensor of three dims is split on dim 1 only: worker w holds ``[:, 2w:2w+2, :]``
    of a ``[2, 4, 3]`` tensor at TP 2, every other dim whole."""
    from rlhf_switch.vps import ModelSpec, TensorSpec
    from rlhf_switch.vps.spec import AttentionGeometry

    spec = ModelSpec("row3d", (TensorSpec("r", (2, 4, 3), tp="row", layer=0),), 1, AttentionGeometry(2, 2, 2))
    lay = vllm_layout(spec, 2)
    assert [[f.box for f in lay.fragments(w)] for w in range(2)] == [[Box((0, 0, 0), (2, 2, 3))],
                                                                       [Box((0, 2, 0), (2, 4, 3))]]


def test_vllm_tp_check_messages_and_kv_heads_shared_above_their_count():
    """``check_vllm_tp`` by hand. At TP 4 over one KV head of 6 rows, k and v are not split (each
    worker holds the head whole), so rows that TP does not divide are accepted; at TP 2 over three
    KV heads of 5 rows they are split and named with the head count; a padded vocabulary TP does not
    divide is named at its padded size; every factor in one message, comma-separated."""
    lay = vllm_layout(tiny(num_attention_heads=4, num_key_value_heads=1, hidden_size=24, num_hidden_layers=1).spec, 4)
    k = "model.layers.0.self_attn.k_proj.weight"
    assert [[f.box for f in lay.fragments(w) if f.key.tensor == k] for w in range(4)] == [[Box((0, 0), (6, 24))]] * 4
    with pytest.raises(LayoutError) as e:
        vllm_layout(tiny(num_attention_heads=6, num_key_value_heads=3, hidden_size=30, num_hidden_layers=1).spec, 2)
    assert str(e.value) == ("vLLM cannot run 'llama' at TP=2: it does not divide num_key_value_heads=3, "
                            "model.layers.0.self_attn.k_proj.weight dim 0=15, "
                            "model.layers.0.self_attn.v_proj.weight dim 0=15")
    with pytest.raises(LayoutError) as e:
        vllm_layout(tiny(num_attention_heads=6, num_key_value_heads=3, hidden_size=24, intermediate_size=18,
                         num_hidden_layers=1).spec, 3)
    assert str(e.value) == ("vLLM cannot run 'llama' at TP=3: it does not divide "
                            "model.embed_tokens.weight padded vocab=64, lm_head.weight padded vocab=64")
