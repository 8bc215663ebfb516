"""vLLM's tensor-parallel generation layout (what each worker's ``model_runner.model`` holds).

Rules, from vLLM's own layers (``vllm/model_executor/layers/linear.py``,
``vocab_parallel_embedding.py``), for TP size ``T`` and worker ``t``:

==================  ===============================================================================
``qkv_proj``        ``[q_t; k_t; v_t]`` on dim 0: q heads ``[t·H/T, (t+1)·H/T)``; when ``T <= KV``,
                    KV heads ``[t·KV/T, (t+1)·KV/T)``; when ``T > KV`` each worker holds ONE KV head,
                    ``t // (T/KV)`` — KV heads are *replicated*, not split
``gate_up_proj``    ``[gate_t; up_t]`` on dim 0
``o_proj``,         dim 1 split (their biases, if any, whole on every worker)
``down_proj``
embedding, LM head  vocabulary padded to a multiple of 64, then split in ``T`` equal row ranges;
                    padding rows belong to no tensor. Tied embeddings: one parameter serves both
norms               whole on every worker
==================  ===============================================================================

``replicas`` independent engines (data-parallel rollout) stack on the rank axis:
``rank = replica · T + t``. Buffers are named ``param/<vLLM parameter name>``.
Worked example (4 heads, 2 KV heads, head_dim 32, T=4): worker 3 holds q rows [96:128], k rows
[32:64] (KV head 3 // 2 = 1) and v rows [32:64] — workers 2 and 3 hold the same k and v box.
"""
from __future__ import annotations

from ..layout import BufferSpec, Fragment, Layout, LayoutError
from ..space import PARAM, Box, StateKey
from ..spec import ModelSpec
from . import data_parallel
from .local import LocalTensor, Part, whole
from .tensor_parallel import shard, undivided_dims

VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE


def check_vllm_tp(spec: ModelSpec, tp: int) -> None:
    if spec.attention is None:
        raise LayoutError(f"model {spec.name!r} has no attention geometry; vLLM's layout needs it")
    a = spec.attention
    bad = []
    if a.num_heads % tp:
        bad.append(f"num_attention_heads={a.num_heads}")
    if tp <= a.num_kv_heads and a.num_kv_heads % tp:
        bad.append(f"num_key_value_heads={a.num_kv_heads}")
    if tp > a.num_kv_heads and tp % a.num_kv_heads:
        bad.append(f"num_key_value_heads={a.num_kv_heads} (TP above it must be a multiple of it)")
    # k/v are not split when TP > KV heads (one head per worker, replicated): the head rule covers them
    kv = {m for g in spec.fused if g.style == "qkv" for m in g.members[1:]} if tp > a.num_kv_heads else set()
    bad += undivided_dims(spec, tp, padded_vocab, "padded vocab={}", skip=kv)
    if bad:
        raise LayoutError(f"vLLM cannot run {spec.name!r} at TP={tp}: it does not divide " + ", ".join(bad))


def padded_vocab(vocab: int) -> int:
    return -(-vocab // VOCAB_PADDING) * VOCAB_PADDING


def worker_tensors(spec: ModelSpec, tp: int, rank: int) -> list[LocalTensor]:
    """The local tensors (vLLM parameters) of TP worker ``rank``, in model order."""
    fused = {m: g for g in spec.fused for m in g.members}
    out: list[LocalTensor] = []
    done: set[str] = set()
    for t in spec.tensors:
        g = fused.get(t.name)
        if g is not None:
            if g.buffer not in done:
                done.add(g.buffer)
                out.append(_fused(spec, g.members, g.buffer, g.style, tp, rank))
            continue
        if t.tp == "vocab":
            per = padded_vocab(t.shape[0]) // tp
            lo, hi = rank * per, min((rank + 1) * per, t.shape[0])
            parts = (Part(t.name, _rows(t, lo, hi), 0),) if hi > lo else ()
            out.append(LocalTensor(t.name, (per,) + t.shape[1:], parts, t.dtype))
        elif t.tp == "replicate" or tp == 1:
            out.append(whole(t.name, t.shape, t.dtype))
        else:
            local, box = shard(t, tp, rank, None)
            out.append(LocalTensor(t.name, local, (Part(t.name, box, 0),), t.dtype))
    return out


def _rows(t, lo: int, hi: int) -> Box:
    return Box((lo,) + (0,) * (len(t.shape) - 1), (hi,) + t.shape[1:])


def _fused(spec: ModelSpec, members, buffer: str, style: str, tp: int, rank: int) -> LocalTensor:
    """Members stacked on dim 0, each as this worker's shard of it (``qkv``: with vLLM's KV rule)."""
    if style == "qkv":
        a = spec.attention
        q, k, v = (spec[m] for m in members)
        hd, q_heads = a.head_dim, a.num_heads // tp
        if tp >= a.num_kv_heads:
            kv_lo, kv_n = rank // (tp // a.num_kv_heads), 1
        else:
            kv_n = a.num_kv_heads // tp
            kv_lo = rank * kv_n
        boxes = [(q, _rows(q, rank * q_heads * hd, (rank + 1) * q_heads * hd)),
                 (k, _rows(k, kv_lo * hd, (kv_lo + kv_n) * hd)), (v, _rows(v, kv_lo * hd, (kv_lo + kv_n) * hd))]
    else:  # [gate_t; up_t], and MoE w13 = per expert [gate_t; up_t], w2 = per expert down_t
        boxes = [(spec[m], shard(spec[m], tp, rank, None)[1]) for m in members]
    parts, row = [], 0
    for t, box in boxes:
        parts.append(Part(t.name, box, row))
        row += box.shape[0]
    return LocalTensor(buffer, (row,) + boxes[0][1].shape[1:], tuple(parts), boxes[0][0].dtype)


def vllm_layout(spec: ModelSpec, tp: int, replicas: int = 1, dtype: str | None = None) -> Layout:
    """The weights of ``replicas`` vLLM engines of TP ``tp`` (``param`` field only: an engine
    holds no optimizer state). ``dtype`` is the engine's dtype (default: the model's)."""
    if tp < 1 or replicas < 1:
        raise LayoutError(f"vLLM TP and replicas must be >= 1, got tp={tp}, replicas={replicas}")
    check_vllm_tp(spec, tp)
    if dtype is not None and all(t.dtype == dtype for t in spec.tensors):
        dtype = None  # one spelling per layout: the digest must not depend on a redundant argument
    per_worker = []
    for t in range(tp):
        pieces, numels = data_parallel.replicate(worker_tensors(spec, tp, t), 1, 0)
        frags = tuple(Fragment(StateKey(name, PARAM), box, f"{PARAM}/{buf}", off, strides)
                      for name, box, buf, off, strides in pieces)
        bufs = {f"{PARAM}/{b}": BufferSpec(n, dtype or spec[_first_tensor(spec, b)].dtype)
                for b, n in numels.items()}
        per_worker.append((frags, bufs))
    frags = [per_worker[r % tp][0] for r in range(tp * replicas)]
    bufs = [per_worker[r % tp][1] for r in range(tp * replicas)]
    name = f"vLLM-TP{tp}" + (f"×{replicas}" if replicas > 1 else "")
    return Layout(spec, frags, bufs, name, f"vllm(tp={tp},replicas={replicas},dtype={dtype})")


def _first_tensor(spec: ModelSpec, buffer: str) -> str:
    if buffer in spec:
        return buffer
    for g in spec.fused:
        if g.buffer == buffer:
            return g.members[0]
    raise LayoutError(f"no tensor behind vLLM buffer {buffer!r}")
