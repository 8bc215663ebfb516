"""DP × TP × PP layouts: compose the three families on a rank mesh.

Rank order is Megatron's default, TP fastest, then DP, then PP::

    rank = pp_rank · (dp · tp) + dp_rank · tp + tp_rank

e.g. TP2·PP2 on 4 ranks: rank 0 = (pp 0, tp 0), 1 = (pp 0, tp 1), 2 = (pp 1, tp 0), 3 = (pp 1, tp 1).
Pipeline picks a stage's tensors, tensor parallelism turns them into local tensors, and the DP
sharding (``replicate``/``fsdp``/``zero3``/``zero``) spreads those local tensors over the DP group.
Every field of the state gets the same geometry in its own buffers, named ``{field}/{buffer}``.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from ..layout import (BufferSpec, Fragment, Holders, Layout, LayoutError, RankClasses, _overlap, union,
                      without_gc)
from ..space import ADAM_FIELDS, PARAM, Box, StateKey, row_major_strides, tuple_new
from ..spec import ModelSpec
from . import data_parallel, expert_parallel, pipeline, tensor_parallel


@dataclass(frozen=True)
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    dp_shard: str = "replicate"
    fuse_qkv: bool = False
    fuse_gate_up: bool = False
    vocab_divisible_by: int | None = None
    zero_alignment: int = 2
    stage_layers: tuple[int, ...] | None = None
    ep: int = 1  # expert parallel, carved out of DP (Megatron): experts split over dp_rank % ep

    def __post_init__(self):
        bad = [f"{n}={v}" for n, v in (("tp", self.tp), ("pp", self.pp), ("dp", self.dp), ("ep", self.ep))
               if int(v) < 1]
        if bad:
            raise LayoutError(f"parallel sizes must be >= 1: {', '.join(bad)}")
        if self.dp % self.ep:
            raise LayoutError(f"EP={self.ep} must divide DP={self.dp} (expert parallelism is carved out of DP)")
        if self.dp_shard not in data_parallel.DP_SHARDINGS:
            raise LayoutError(f"dp_shard={self.dp_shard!r} is not one of {data_parallel.DP_SHARDINGS}")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pp_rank, dp_rank, tp_rank) of a global rank."""
        pp_rank, rest = divmod(rank, self.dp * self.tp)
        dp_rank, tp_rank = divmod(rest, self.tp)
        return pp_rank, dp_rank, tp_rank

    def __str__(self) -> str:
        parts = [f"{n}{v}" for n, v in (("TP", self.tp), ("PP", self.pp), ("EP", self.ep), ("DP", self.dp))
                 if v > 1]
        s = "·".join(parts) or "DP1"
        if self.dp_shard != "replicate" and self.dp > 1:
            s += f"[{self.dp_shard}]"
        return s


@without_gc
def build_layout(spec: ModelSpec, config: ParallelConfig, fields: tuple[str, ...] = (PARAM,),
                 param_dtype: str | None = None, state_dtype: str = "float32",
                 world_size: int | None = None, name: str | None = None) -> Layout:
    """The layout of ``fields`` under ``config``. ``param`` uses the model's dtype (or
    ``param_dtype``); every other field (fp32 master, Adam moments) uses ``state_dtype``.

    Ranks with equal ``(pp, tp, ep, dp shard)`` coordinates (replicas) form one class, built on
    first use; ``MeshHolders`` finds the classes that hold one key without building the others."""
    if world_size is not None and world_size != config.world_size:
        raise LayoutError(f"{config} needs tp·pp·dp = {config.tp}·{config.pp}·{config.dp} = "
                          f"{config.world_size} ranks, the world has {world_size}")
    tensor_parallel.check_tp(spec, config.tp, config.vocab_divisible_by, config.fuse_qkv)
    tensor_parallel.check_tp_cover(spec, config.tp, config.fuse_qkv, config.fuse_gate_up)
    expert_parallel.check_ep(spec, config.ep)
    fields = tuple(fields)
    build = _ClassBuilder(spec, config, fields, param_dtype, state_dtype)

    def class_of(rank: int) -> tuple[int, int, int, int]:
        pp_rank, dp_rank, tp_rank = config.coords(rank)
        return (pp_rank, tp_rank, dp_rank % config.ep, dp_rank if config.dp_shard != "replicate" else 0)

    classes = RankClasses.of_ranks([class_of(r) for r in range(config.world_size)], build)
    if config.dp_shard in ("zero", "zero3") and len({t.dtype for t in spec.tensors}) > 1 and \
            any((param_dtype if f == PARAM else state_dtype) is None for f in fields):
        for c in range(len(classes.members)):  # a flat buffer may mix dtypes: refuse it now
            classes.get(c)
    recipe = f"mesh({asdict(config)},fields={fields},param_dtype={param_dtype},state_dtype={state_dtype})"
    # boxes of one key are equal or disjoint, except the tied LM head's under a stage-wide flat
    # partition (its flat range starts elsewhere on the last stage than on the first)
    partition = not (config.dp_shard == "zero" and spec.tied_lm_head and config.pp > 1)
    holders = MeshHolders(spec, config, fields, classes, build.stages, param_dtype, state_dtype)
    return Layout.lazy(spec, classes, name or str(config), recipe, fields, holders, partition)


class _ClassBuilder:
    """``(pp, tp, ep, dp shard) -> (fragments, buffers)`` of one rank class: pipeline picks the
    stage's tensors, expert parallelism its experts, tensor parallelism turns them into local
    tensors and the DP sharding spreads those over the DP group."""

    def __init__(self, spec: ModelSpec, config: ParallelConfig, fields, param_dtype, state_dtype):
        self.spec, self.config, self.fields = spec, config, fields
        self.param_dtype, self.state_dtype = param_dtype, state_dtype
        self.shard = getattr(data_parallel, config.dp_shard)
        self.kwargs = {"alignment": config.zero_alignment} if config.dp_shard == "zero" else {}
        self.stages = pipeline.all_stage_tensors(spec, config.pp, config.stage_layers)
        self.local_cache: dict[tuple[int, int, int], list] = {}
        self.kept: dict[tuple[int, int], list] = {}
        self.dtype_cache: dict[tuple[int, int, int], dict[str, str]] = {}
        # one StateKey / buffer name per (field, name) for the whole layout, not one per fragment:
        # a 70B layout has tens of thousands of fragments, most of them of a few hundred keys
        self.keys: dict[str, dict[str, StateKey]] = {f: {} for f in fields}
        self.names: dict[str, dict[str, str]] = {f: {} for f in fields}

    def _kept(self, pp_rank: int, ep_rank: int) -> list:
        """``expert_parallel.keep_experts`` of a stage, for all EP ranks in one pass."""
        kept = self.kept.get((pp_rank, ep_rank))
        if kept is None:
            ep, stage = self.config.ep, self.stages[pp_rank]
            if ep == 1:
                return expert_parallel.keep_experts(self.spec, stage, ep, ep_rank)
            per = self.spec.num_experts // ep
            lists: list[list] = [[] for _ in range(ep)]
            for item in stage:
                x = item[0].expert
                if x is None:
                    for one in lists:
                        one.append(item)
                else:
                    lists[x // per].append(item)
            for e, one in enumerate(lists):
                self.kept[(pp_rank, e)] = one
            kept = lists[ep_rank]
        return kept

    @without_gc
    def __call__(self, ck: tuple[int, int, int, int]) -> tuple[tuple[Fragment, ...], dict[str, BufferSpec]]:
        spec, config = self.spec, self.config
        pp_rank, tp_rank, ep_rank, dp_rank = ck
        lk = (pp_rank, tp_rank, ep_rank)
        local = self.local_cache.get(lk)
        if local is None:
            tensors = self._kept(pp_rank, ep_rank)
            local = self.local_cache[lk] = tensor_parallel.local_tensors(
                spec, tensors, config.tp, tp_rank, vocab_divisible_by=config.vocab_divisible_by,
                fuse_qkv=config.fuse_qkv, fuse_gate_up=config.fuse_gate_up)
            self.dtype_cache[lk] = _buffer_dtypes(spec, local)
        pieces, numels = expert_parallel.shard_dense_and_experts(
            self.shard, local, spec, config.dp, dp_rank, config.ep, **self.kwargs)
        rank_frags, rank_bufs = [], {}
        dtypes = self.dtype_cache[lk]
        for field in self.fields:
            dtype = (self.param_dtype if field == PARAM else self.state_dtype)
            field_keys, field_names = self.keys[field], self.names[field]
            for tname, box, buf, off, strides in pieces:
                key = field_keys.get(tname)
                if key is None:
                    key = field_keys[tname] = StateKey(tname, field)
                bname = field_names.get(buf)
                if bname is None:
                    bname = field_names[buf] = f"{field}/{buf}"
                rank_frags.append(tuple_new(Fragment, (key, box, bname, off, strides)))
            for buf, n in numels.items():
                d = dtype or dtypes.get(buf)
                if d is None:  # a flat buffer: the model's dtype, found once per local list
                    d = dtypes[buf] = _buffer_dtype(spec, local, buf)
                rank_bufs[f"{field}/{buf}"] = BufferSpec(n, d)
        return tuple(rank_frags), rank_bufs


class MeshHolders:
    """``holders(key, box)`` of a mesh layout: the classes that can hold ``key`` — its stage(s),
    its expert's EP rank (every EP rank for a dense tensor), the TP ranks whose shard meets
    ``box``, every DP shard. Under DP ``replicate`` an unfused tensor's fragment in a class is its
    TP shard, whole, at offset 0 of its own buffer: written down directly. Otherwise the classes
    are built (once each) and asked for their fragments of it."""

    def __init__(self, spec: ModelSpec, config: ParallelConfig, fields, classes: RankClasses, stages,
                 param_dtype: str | None = None, state_dtype: str | None = None):
        self.spec, self.config, self.fields, self.classes = spec, config, frozenset(fields), classes
        self.field_dtype = {f: (param_dtype if f == PARAM else state_dtype) for f in fields}
        # tensors a fused buffer may hold here: their offsets depend on the group, build the class
        self.fusable = {m for g in spec.fused if (g.style == "qkv" and config.fuse_qkv)
                        or (g.style == "concat" and config.fuse_gate_up) for m in g.members}
        self.class_id = {}  # (pp, tp, ep, dp shard) -> class id
        for c, ranks in enumerate(classes.members):
            pp_rank, dp_rank, tp_rank = config.coords(ranks[0])
            self.class_id[(pp_rank, tp_rank, dp_rank % config.ep,
                           dp_rank if config.dp_shard != "replicate" else 0)] = c
        self.stages_of: dict[str, list[tuple[int, str]]] = {}  # tensor -> (stage, buffer) holding it
        for s, tensors in enumerate(stages):
            for t, buffer in tensors:
                self.stages_of.setdefault(t.name, []).append((s, buffer))
        self.tp_boxes: dict[tuple, list] = {}  # (shape, tp role) -> box of each TP rank
        self.tp_meeting: dict[tuple, list[int]] = {}  # (shape, tp role, box) -> TP ranks meeting it
        self.by_key: dict[int, dict[StateKey, list[Fragment]]] = {}  # class id -> key -> fragments
        self.geometries: dict[str, int] | None = None  # tensor -> geometry (less the field)
        self.dtypes: dict[int, dict[str, str]] = {}

    def __call__(self, key: StateKey, box: Box | None) -> list[tuple[Box, Holders]]:
        t = self.spec._by_name.get(key.tensor)
        if t is None or key.field not in self.fields:
            return []
        config = self.config
        ep = config.ep
        if t.expert is not None and ep > 1:
            eps = (t.expert // (self.spec.num_experts // ep),)
        else:
            eps = range(ep)
        tps = self._tp_ranks(t, box)
        stages = self.stages_of.get(t.name, ())
        if config.dp_shard == "replicate":
            if t.name not in self.fusable:
                return self._replicated(key, t, stages, eps, tps)
            pairs = [(e, 0) for e in eps]  # (EP rank, DP shard) of the classes
        else:  # each DP rank is one shard, of EP rank d % ep
            pairs = [(d % ep, d) for e in eps for d in range(e, config.dp, ep)]
        found = [self.class_id[(s, w, e, d)] for s, _ in stages for e, d in pairs for w in tps]
        out = []
        for c in (sorted(set(found)) if len(found) > 1 else found):
            by_key = self.by_key.get(c)
            if by_key is None:
                frags, bufs = self.classes.get(c)
                by_key = self.by_key[c] = {}
                for f in frags:
                    by_key.setdefault(f.key, []).append(f)
                self.dtypes[c] = {n: b.dtype for n, b in bufs.items()}
            ranks, dtypes = self.classes.members[c], self.dtypes[c]
            for f in by_key.get(key, ()):
                if box is None or _overlap(f.box, box):
                    out.append((f.box, tuple_new(Holders, (f, ranks, dtypes.get(f.buffer)))))
        return out

    def geometry(self, key: StateKey):
        """Under DP ``replicate``, an unfused tensor of one stage is held as its TP shards, at
        offset 0 of its own buffer, by the classes of that stage and of its expert's EP rank:
        tensors equal in those (the experts of one EP rank in one stage, the like layers of one
        stage) share a geometry. None for every other tensor."""
        if self.geometries is None:
            self.geometries = self._geometries()
        g = self.geometries.get(key.tensor)
        return (g, key.field) if g is not None and key.field in self.fields else None

    def _geometries(self) -> dict[str, int]:
        """tensor -> its geometry, a number per (shape, TP role, dtype, stage, EP rank), for the
        tensors that have one (all of them, in one pass: a MoE model has tens of thousands)."""
        if self.config.dp_shard != "replicate":
            return {}
        ep = self.config.ep
        per = self.spec.num_experts // ep if ep > 1 else None
        kinds: dict[tuple, int] = {}
        out = {}
        for name, stages in self.stages_of.items():
            if len(stages) != 1 or name in self.fusable:
                continue
            t = self.spec._by_name[name]
            kind = (t.shape, t.tp, t.dtype, stages[0][0], t.expert // per if per and t.expert is not None else None)
            out[name] = kinds.setdefault(kind, len(kinds))
        return out

    def relocate(self, key: StateKey, fragment: Fragment) -> tuple[str, int]:
        return f"{key.field}/{self.stages_of[key.tensor][0][1]}", 0

    def _replicated(self, key: StateKey, t, stages, eps, tps) -> list[tuple[Box, Holders]]:
        """Fragments of an unfused tensor under DP replicate, without building a class: class
        ``(s, w, e)`` holds TP rank ``w``'s shard at offset 0 of buffer ``{field}/{buffer}``."""
        boxes = self._tp_boxes(t)
        dtype = self.field_dtype[key.field] or t.dtype
        members, class_id = self.classes.members, self.class_id
        found = []
        for s, buffer in stages:
            bname = f"{key.field}/{buffer}"
            for w in tps:
                b, strides = boxes[w]
                if b is None:
                    continue
                f = tuple_new(Fragment, (key, b, bname, 0, strides))
                for e in eps:
                    found.append((class_id[(s, w, e, 0)], f))
        if len(found) > 1:
            found.sort(key=_first)
        return [(f[1], tuple_new(Holders, (f, members[c], dtype))) for c, f in found]

    def _tp_boxes(self, t) -> list[tuple[Box | None, tuple[int, ...] | None]]:
        """(box, row-major strides) of each TP rank's shard of ``t`` (None: vocabulary padding)."""
        k = (t.shape, t.tp)
        boxes = self.tp_boxes.get(k)
        if boxes is None:
            boxes = self.tp_boxes[k] = []
            for w in range(self.config.tp):
                b = tensor_parallel.shard(t, self.config.tp, w, self.config.vocab_divisible_by)[1]
                boxes.append((b, row_major_strides(b.shape) if b is not None else None))
        return boxes

    def _tp_ranks(self, t, box: Box | None):
        tp = self.config.tp
        if box is None or tp == 1:
            return range(tp)
        k = (t.shape, t.tp, box)
        found = self.tp_meeting.get(k)
        if found is None:
            found = self.tp_meeting[k] = [w for w, (b, _) in enumerate(self._tp_boxes(t))
                                          if b is not None and _overlap(b, box)]
        return found


def _first(item):
    return item[0]


def _buffer_dtypes(spec: ModelSpec, local: list) -> dict[str, str]:
    """buffer -> dtype of each local tensor (a pure-padding vocab shard included)."""
    return {lt.buffer: lt.dtype for lt in local}


def _buffer_dtype(spec: ModelSpec, local: list, buffer: str) -> str:
    """A flat (zero/zero3) buffer mixes a rank's tensors: they must share one dtype."""
    dtypes = {lt.dtype for lt in local} or {t.dtype for t in spec.tensors}
    if len(dtypes) > 1:
        raise LayoutError(f"a flat {buffer} buffer cannot hold tensors of several dtypes {sorted(dtypes)}; "
                          f"pass param_dtype")
    return dtypes.pop()


# --- the layouts people name ---------------------------------------------------------------------

def replicated(spec: ModelSpec, world_size: int, fields=(PARAM,), **kw) -> Layout:
    return build_layout(spec, ParallelConfig(dp=world_size), fields, **kw)


def fsdp(spec: ModelSpec, dp: int, fields=(PARAM,), **kw) -> Layout:
    return build_layout(spec, ParallelConfig(dp=dp, dp_shard="fsdp"), fields, **kw)


def zero(spec: ModelSpec, dp: int, stage: int, fields=(PARAM,) + ADAM_FIELDS, **kw) -> Layout:
    """DeepSpeed ZeRO: stage 1/2 keep ``param`` whole on every rank and partition the fp32 master
    and Adam moments in one flat range; stage 3 partitions every field tensor by tensor."""
    if stage not in (1, 2, 3):
        raise LayoutError(f"ZeRO stage must be 1, 2 or 3, got {stage}")
    name = f"ZeRO{stage}·DP{dp}"
    if stage == 3:
        return build_layout(spec, ParallelConfig(dp=dp, dp_shard="zero3"), tuple(fields), name=name, **kw)
    opt = tuple(f for f in fields if f != PARAM)
    parts = []
    if PARAM in fields:
        parts.append(build_layout(spec, ParallelConfig(dp=dp), (PARAM,), name=name, **kw))
    if opt:
        parts.append(build_layout(spec, ParallelConfig(dp=dp, dp_shard="zero"), opt, name=name, **kw))
    return parts[0] if len(parts) == 1 else union(*parts, name=name)
