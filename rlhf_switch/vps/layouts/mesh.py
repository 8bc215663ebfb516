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

from ..layout import BufferSpec, Fragment, Layout, LayoutError, union, without_gc
from ..space import ADAM_FIELDS, PARAM, StateKey, tuple_new
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
    ``param_dtype``); every other field (fp32 master, Adam moments) uses ``state_dtype``."""
    if world_size is not None and world_size != config.world_size:
        raise LayoutError(f"{config} needs tp·pp·dp = {config.tp}·{config.pp}·{config.dp} = "
                          f"{config.world_size} ranks, the world has {world_size}")
    tensor_parallel.check_tp(spec, config.tp, config.vocab_divisible_by, config.fuse_qkv)
    expert_parallel.check_ep(spec, config.ep)
    shard = getattr(data_parallel, config.dp_shard)
    kwargs = {"alignment": config.zero_alignment} if config.dp_shard == "zero" else {}

    local_cache: dict[tuple[int, int], list] = {}
    dtype_cache: dict[tuple[int, int], dict[str, str]] = {}
    rank_cache: dict[tuple[int, int, int], tuple] = {}
    # one StateKey / buffer name per (field, name) for the whole layout, not one per fragment:
    # a 70B layout has tens of thousands of fragments, most of them of a few hundred keys
    keys: dict[str, dict[str, StateKey]] = {f: {} for f in fields}
    names: dict[str, dict[str, str]] = {f: {} for f in fields}
    frags, bufs = [], []
    for rank in range(config.world_size):
        pp_rank, dp_rank, tp_rank = config.coords(rank)
        # replicas share one tuple: cheap to build, hash and pickle at scale
        ep_rank = dp_rank % config.ep
        ck = (pp_rank, tp_rank, ep_rank, dp_rank if config.dp_shard != "replicate" else 0)
        if ck not in rank_cache:
            lk = (pp_rank, tp_rank, ep_rank)
            if lk not in local_cache:
                tensors = expert_parallel.keep_experts(
                    spec, pipeline.stage_tensors(spec, config.pp, pp_rank, config.stage_layers), config.ep, ep_rank)
                local_cache[lk] = tensor_parallel.local_tensors(
                    spec, tensors, config.tp, tp_rank, vocab_divisible_by=config.vocab_divisible_by,
                    fuse_qkv=config.fuse_qkv, fuse_gate_up=config.fuse_gate_up)
                dtype_cache[lk] = _buffer_dtypes(spec, local_cache[lk])
            pieces, numels = expert_parallel.shard_dense_and_experts(
                shard, local_cache[lk], spec, config.dp, dp_rank, config.ep, **kwargs)
            rank_frags, rank_bufs = [], {}
            dtypes = dtype_cache[lk]
            for field in fields:
                dtype = (param_dtype if field == PARAM else state_dtype)
                field_keys, field_names = keys[field], names[field]
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
                        d = dtypes[buf] = _buffer_dtype(spec, local_cache[lk], buf)
                    rank_bufs[f"{field}/{buf}"] = BufferSpec(n, d)
            rank_cache[ck] = (tuple(rank_frags), rank_bufs)
        f, b = rank_cache[ck]
        frags.append(f)
        bufs.append(b)
    recipe = f"mesh({asdict(config)},fields={fields},param_dtype={param_dtype},state_dtype={state_dtype})"
    return Layout(spec, frags, bufs, name or str(config), recipe)


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
