"""Megatron-style tensor parallelism: which local tensors TP rank ``t`` of ``tp`` holds.

Rules (Megatron-LM ``ColumnParallelLinear`` / ``RowParallelLinear`` / ``VocabParallelEmbedding``):

=========  ======================================================================================
column     dim 0 split evenly (q/k/v, gate/up and their biases)
row        dim 1 split evenly (o_proj, down_proj); a row layer's bias is replicated
vocab      dim 0 split evenly after padding the vocabulary to a multiple of
           ``vocab_divisible_by * tp`` (padding rows belong to no tensor and are never moved)
replicate  whole tensor on every TP rank (norms)
=========  ======================================================================================

Fusion, when asked for, follows Megatron's buffers: ``qkv`` interleaves per query group —
rank t holds groups ``[t·G/tp, (t+1)·G/tp)`` and for each group its q heads, then its k head, then
its v head; ``concat`` stacks the members' shards, each split by its own role (``[gate_t; up_t]``
of column shards; a MoE ``w2`` of every expert's ``down_proj`` row shard). Worked example, 4 heads,
2 KV groups, head_dim 2, tp=2: rank 0's ``qkv_proj`` rows are q[0:4], k[0:2], v[0:2]; rank 1's
are q[4:8], k[2:4], v[2:4].
"""
from __future__ import annotations

import functools

from ..layout import LayoutError
from ..space import Box, tuple_new
from ..spec import FusedGroup, ModelSpec, TensorSpec
from .local import LocalTensor, Part


def check_tp(spec: ModelSpec, tp: int, vocab_divisible_by: int | None, fuse_qkv: bool) -> None:
    """One error naming every factor ``tp`` does not divide."""
    if tp < 1:
        raise LayoutError(f"TP must be >= 1, got {tp}")
    if tp == 1:
        return
    bad = []
    if spec.attention is not None:
        a = spec.attention
        if a.num_heads % tp:
            bad.append(f"num_attention_heads={a.num_heads}")
        if a.num_kv_heads % tp:
            bad.append(f"num_key_value_heads={a.num_kv_heads}")
    if vocab_divisible_by is None:
        bad += undivided_dims(spec, tp, lambda v: v, "vocab={} (pass vocab_divisible_by to pad it)")
    else:
        bad += undivided_dims(spec, tp, lambda v: padded_vocab(v, tp, vocab_divisible_by), "")
    if bad:
        shown = ", ".join(bad[:8]) + (f", … ({len(bad)} in all)" if len(bad) > 8 else "")
        raise LayoutError(f"TP={tp} does not divide {shown}")


def check_tp_cover(spec: ModelSpec, tp: int, fuse_qkv: bool, fuse_gate_up: bool) -> None:
    """Refuse, when the layout is built, TP rules whose ranks together do not hold every element
    of a fused buffer's members (each member's distinct boxes over the TP ranks must tile it).
    Unfused tensors follow ``shard``, whose split ``check_tp`` has already made even. Checked once
    per fused geometry: a model's layers repeat a few."""
    if tp == 1 or not (fuse_qkv or fuse_gate_up):
        return
    seen: set[tuple] = set()
    problems = []
    for g in spec.fused:
        if not ((g.style == "qkv" and fuse_qkv) or (g.style == "concat" and fuse_gate_up)):
            continue
        members = [spec[m] for m in g.members]
        geometry = (g.style, tuple((t.shape, t.tp) for t in members))
        if geometry in seen:
            continue
        seen.add(geometry)
        boxes: dict[str, set[Box]] = {m: set() for m in g.members}
        for rank in range(tp):
            for p in _fused(spec, g, tp, rank).parts:
                boxes[p.tensor].add(p.box)
        for t in members:
            held = sum(b.numel for b in boxes[t.name])
            if held != t.numel:
                problems.append(f"{t.name} in {g.buffer}: TP ranks hold {held} of its {t.numel} elements")
    if problems:
        raise LayoutError(f"TP={tp} with fused buffers does not cover the model: " + "; ".join(problems[:8]))


def undivided_dims(spec: ModelSpec, tp: int, vocab_rows, vocab_note: str, skip=frozenset()) -> list[str]:
    """The tensor dims a TP split would cut unevenly: column dim 0, row dim 1, and the vocabulary
    as ``vocab_rows`` pads it (``vocab_note`` formats the padded size)."""
    bad = []
    for t in spec.tensors:
        if t.name in skip:
            continue
        if t.tp == "column" and t.shape[0] % tp:
            bad.append(f"{t.name} dim 0={t.shape[0]}")
        elif t.tp == "row" and t.shape[1] % tp:
            bad.append(f"{t.name} dim 1={t.shape[1]}")
        elif t.tp == "vocab" and vocab_rows(t.shape[0]) % tp:
            bad.append(f"{t.name} " + vocab_note.format(vocab_rows(t.shape[0])))
    return bad


def padded_vocab(vocab: int, tp: int, vocab_divisible_by: int | None) -> int:
    if vocab_divisible_by is None:
        return vocab
    m = vocab_divisible_by * tp
    return -(-vocab // m) * m


def shard(t: TensorSpec, tp: int, rank: int, vocab_divisible_by: int | None) -> tuple[tuple[int, ...], Box | None]:
    """(local shape, global box held) of one unfused tensor; box is None for a pure-padding shard."""
    shape = t.shape
    if tp == 1 or t.tp == "replicate":
        return shape, Box.full(shape)
    if t.tp == "row":
        n = shape[1] // tp
        lo = (0, rank * n) + (0,) * (len(shape) - 2)
        return (shape[0], n) + shape[2:], Box(lo, (shape[0], (rank + 1) * n) + shape[2:])
    rows = padded_vocab(shape[0], tp, vocab_divisible_by) if t.tp == "vocab" else shape[0]
    n = rows // tp
    lo, hi = rank * n, min((rank + 1) * n, shape[0])
    local = (n,) + shape[1:]
    if hi <= lo:
        return local, None
    return local, Box((lo,) + (0,) * (len(shape) - 1), (hi,) + shape[1:])


@functools.lru_cache(maxsize=1 << 12)
def _shard(shape: tuple[int, ...], role: str, tp: int, rank: int, vocab_divisible_by: int | None):
    """``shard`` by geometry: the layers of a model repeat a few shapes, so this is a lookup."""
    return shard(TensorSpec("_", shape, tp=role), tp, rank, vocab_divisible_by)


def local_tensors(spec: ModelSpec, tensors: list[tuple[TensorSpec, str]], tp: int, rank: int, *,
                  vocab_divisible_by: int | None = None, fuse_qkv: bool = False,
                  fuse_gate_up: bool = False) -> list[LocalTensor]:
    """Local tensors of TP rank ``rank`` for ``tensors`` = [(spec, buffer name)] of its stage."""
    fused_into: dict[str, FusedGroup] = {}
    if fuse_qkv or fuse_gate_up:
        present = {t.name for t, _ in tensors}
        for g in spec.fused:
            if not ((g.style == "qkv" and fuse_qkv) or (g.style == "concat" and fuse_gate_up)):
                continue
            if not present.issuperset(g.members):  # e.g. a MoE layer's experts split over EP ranks
                continue
            for m in g.members:
                fused_into[m] = g
    out: list[LocalTensor] = []
    done: set[str] = set()
    for t, buffer in tensors:
        g = fused_into.get(t.name)
        if g is None:
            local, box = _shard(t.shape, t.tp, tp, rank, vocab_divisible_by)
            out.append(tuple_new(LocalTensor, (buffer, local, (tuple_new(Part, (t.name, box, 0)),) if box else (),
                                               t.dtype)))
        elif g.buffer not in done:
            done.add(g.buffer)
            out.append(_fused(spec, g, tp, rank))
    return out


def _fused(spec: ModelSpec, g: FusedGroup, tp: int, rank: int) -> LocalTensor:
    members = [spec[m] for m in g.members]
    parts: list[Part] = []
    row = 0

    def add_box(t: TensorSpec, box: Box):
        nonlocal row
        parts.append(Part(t.name, box, row))
        row += box.shape[0]

    def add(t: TensorSpec, lo: int, hi: int):
        add_box(t, Box((lo,) + (0,) * (len(t.shape) - 1), (hi,) + t.shape[1:]))

    if g.style == "qkv":
        a = spec.attention
        q, k, v = members
        groups = a.num_kv_heads // tp
        q_rows = a.num_heads // a.num_kv_heads * a.head_dim
        for grp in range(rank * groups, (rank + 1) * groups):
            add(q, grp * q_rows, (grp + 1) * q_rows)
            add(k, grp * a.head_dim, (grp + 1) * a.head_dim)
            add(v, grp * a.head_dim, (grp + 1) * a.head_dim)
        trailing = members[0].shape[1:]
    else:
        # each member split by its own role: [gate_t; up_t] are column shards (dim 0), a MoE
        # layer's w2 stacks row shards (dim 1) of every expert's down_proj on dim 0
        trailing = None
        for t in members:
            local, box = _shard(t.shape, t.tp, tp, rank, None)
            if trailing is None:
                trailing = local[1:]
            elif local[1:] != trailing:
                raise LayoutError(f"fused buffer {g.buffer}: member {t.name} has local shape {local}, "
                                  f"the first member's rows are {trailing}; they cannot stack on dim 0")
            add_box(t, box)
    return LocalTensor(g.buffer, (row,) + trailing, tuple(parts), members[0].dtype)
