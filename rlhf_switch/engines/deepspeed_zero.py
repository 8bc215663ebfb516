"""DeepSpeed ZeRO-1/2/3 as a VPS layout: the engine's own partitions, described and used in place.

Where ZeRO keeps each piece of state (deepspeed 0.19; checked against the engine's tensors in
tests/test_deepspeed.py):

ZeRO-1/2 (``DeepSpeedZeroOptimizer``)
    Per param group ``g`` the bit16 parameters are views into one flat buffer
    ``bit16_groups_flat[g]`` at ``round_robin_bit16_offsets[g]`` — in ``round_robin_bit16_groups``
    order, not the model's — padded to a multiple of ``2·dp``. Every rank holds it whole. Rank ``r``
    owns flat ``[r·P, (r+1)·P)`` (``P = partition_size[g]``): its fp32 master is
    ``single_partition_of_fp32_groups[g]`` and its Adam moments are the torch optimizer's state of
    that flat tensor.
ZeRO-3 (``DeepSpeedZeroOptimizer_Stage3``)
    Every parameter is split on its own: ``P = ceil(numel/dp)``, rank ``r`` owns flat
    ``[r·P, (r+1)·P)`` (the tail zero-padded). Its bit16 slice (``param.ds_tensor``) lives in
    ``fp16_partitioned_groups_flat[g]`` and its fp32 master in ``fp32_partitioned_groups_flat[g]``,
    both at ``grad_position[id][1]``; the Adam moments are the state of the fp32 flat tensor.

After the fp32 master is written, the engine's bit16 copy is stale until it is refreshed from the
master — ``state_written()`` runs DeepSpeed's own refresh (ZeRO-1/2: ``update_lp_params``, an
all-gather of the whole flat bit16 model; ZeRO-3: copy the partition and re-gather the persistent
parameters that keep a full copy). A training switch moves the bit16 copies in the same plan
instead (``separate_weights``: field ``param`` of ``weights()`` is a buffer of its own) and then
calls ``state_written(weights_written=True)``: no refresh from the master, no all-gather (ZeRO-3
still re-gathers its persistent parameters from the written partitions). In fp32 training the
bit16 slice over a rank's own master partition is the master in value: the switch leaves it out
(``weights(master_copies=False)``) and ``state_written`` copies it from the master locally. A write of the bit16
weights alone (the reference's warm start) calls ``weights_written()``.

LoRA (peft's layers, ``engines/lora.py``): only the adapters are in the optimizer's groups. A frozen
parameter has no fp32 master and no moments: ZeRO-1/2 leave it whole on every rank as the module's
own tensor, ZeRO-3 partition it like any other (``param.ds_tensor``, flat ``[r·P, (r+1)·P)``).
The adapter describes that tensor — a buffer of its own per frozen parameter — as both ``param``
and ``master`` (its only copy), and ``merged_weights`` adds ``(B @ A)·alpha/r`` to each target's
share, with ``A`` and ``B`` whole (ZeRO-3: gathered, they are small).

ZeRO-3 persistent parameters (``persistence_threshold``, DeepSpeed's
``stage3_param_persistence_threshold``): a parameter of fewer elements stays gathered whole on
every rank between steps (``ds_persist``; DeepSpeed re-gathers it after each ``step()``) and its
submodule's fetch and release hooks find it there. Its partition (``ds_tensor``) is still the
copy the optimizer writes and the VPS describes: reads of ``weights()`` (the weight channel, a
switch's source) see exactly what the forward computes with, and every write of the partitions
ends in ``state_written`` / ``weights_written``, which gather the whole copies again.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist

from .. import compat
from ..device import CPU, DeviceSpec
from ..families import stacked_experts
from ..vps import EXP_AVG, EXP_AVG_SQ, MASTER, PARAM, ModelSpec, StateKey
from .optim import AdamWConfig, load_schedule
from .train_state import LocalState

ADAM_MOMENTS = (EXP_AVG, EXP_AVG_SQ)


def import_deepspeed(device: DeviceSpec = CPU):
    """DeepSpeed with the accelerator of ``device`` (``compat.import_deepspeed``)."""
    return compat.import_deepspeed(device.kind)


def _join_deepspeed_comm(deepspeed, device: DeviceSpec = CPU) -> None:
    """Let DeepSpeed use the process group that already exists (any launcher, not only its own):
    it reads the rank variables its launcher would have set. ``LOCAL_RANK`` is the device index
    DeepSpeed puts this rank on (``cuda:LOCAL_RANK``): on CUDA the process's own current device —
    a Ray actor sees only its bundle's GPU, as ``cuda:0``, whatever its rank — on CPU the rank."""
    if not dist.is_initialized():
        raise RuntimeError("initialise torch.distributed before building a DeepSpeed engine")
    local = torch.cuda.current_device() if device.is_cuda else dist.get_rank()
    for var, value in (("RANK", dist.get_rank()), ("WORLD_SIZE", dist.get_world_size()),
                       ("LOCAL_RANK", int(os.environ.get("LOCAL_RANK", local)))):
        os.environ.setdefault(var, str(value))
    deepspeed.init_distributed(dist_backend=dist.get_backend(), dist_init_required=False)


class _DataParallelGroup:
    """The `mpu` DeepSpeed asks for when the engine lives on a subset of the world: its ranks are
    one data-parallel group, with no model parallelism."""

    def __init__(self, ranks: Sequence[int], dp_group: dist.ProcessGroup, self_group: dist.ProcessGroup):
        self._ranks, self._dp, self._self = list(ranks), dp_group, self_group

    def get_data_parallel_group(self):
        return self._dp

    def get_data_parallel_rank(self):
        return dist.get_rank(self._dp)

    def get_data_parallel_world_size(self):
        return len(self._ranks)

    def get_data_parallel_group_ranks(self):
        return list(self._ranks)

    def get_model_parallel_group(self):
        return self._self

    def get_model_parallel_rank(self):
        return 0

    def get_model_parallel_world_size(self):
        return 1


def _groups_for(ranks: Sequence[int]) -> tuple[dist.ProcessGroup | None, _DataParallelGroup | None]:
    """(dp group, mpu) for an engine on ``ranks``; every world rank must call this (new_group is
    collective). ``(None, None)`` when the engine spans the whole world."""
    world = dist.get_world_size()
    if list(ranks) == list(range(world)):
        return None, None
    me = dist.get_rank()
    dp_group = dist.new_group(list(ranks))
    selves = [dist.new_group([r]) for r in range(world)]
    if me not in ranks:
        return None, None
    return dp_group, _DataParallelGroup(ranks, dp_group, selves[me])


# DeepSpeed patches live in compat; these names stay importable from here
_engine_world = compat.deepspeed_world_collectives_on
_agree_on_param_ids = compat.agree_on_zero3_param_ids


@dataclass
class ZeroTrainer:
    """A DeepSpeed engine plus the one thing the tests and recipes do with it: a training step on
    a global batch (each DP rank takes its contiguous slice)."""

    engine: Any
    adapter: "ZeroAdapter | None"  # None for a model without a VPS description (spec=None)
    dp_group: dist.ProcessGroup | None = None
    ranks: tuple[int, ...] = ()
    losses: list[float] = field(default_factory=list)

    @property
    def dp(self) -> int:
        return dist.get_world_size(self.dp_group)

    def scope(self):
        """Where DeepSpeed's world collectives must run for this engine (its own group when it
        lives on a subset of the world): wrap direct engine calls such as ``save_checkpoint``."""
        return _engine_world(self.dp_group, self.ranks)

    def train_step(self, input_ids: torch.Tensor) -> float:
        dp, r = self.dp, dist.get_rank(self.dp_group)
        if input_ids.shape[0] % dp:
            raise ValueError(f"global batch {input_ids.shape[0]} is not divisible by DP={dp}")
        mine = input_ids.chunk(dp)[r]
        with self.scope():
            loss = self.engine(input_ids=mine, labels=mine).loss
            self.engine.backward(loss)
            self.engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=self.dp_group)
        self.losses.append(mean.item() / dp)
        return self.losses[-1]


def build_zero_trainer(model: torch.nn.Module, spec: ModelSpec | None, stage: int, micro_batch: int,
                       ranks: Sequence[int] | None = None, optim: AdamWConfig = AdamWConfig(),
                       dtype: str = "float32", persistence_threshold: int = 0,
                       extra_config: Mapping[str, Any] | None = None,
                       device: DeviceSpec = CPU) -> ZeroTrainer | None:
    """``model`` under ZeRO ``stage`` with DP over ``ranks`` (default: the world). Every world
    rank calls this; ranks outside ``ranks`` get ``None``. ``persistence_threshold``: ZeRO-3 keeps
    parameters smaller than this whole on every rank (DeepSpeed's default is 1e5).
    ``spec=None``: a model the VPS has no description of (the critic's value model): no adapter.
    ``extra_config``: more DeepSpeed config keys (e.g. ``{"checkpoint": {"load_universal": True}}``).
    ``device``: the run's (``rlhf_switch.device``): DeepSpeed's accelerator and the device it puts
    the model on; ``dtype`` is the compute dtype (bf16: bit16 weights beside the fp32 master)."""
    if stage not in (1, 2, 3):
        raise ValueError(f"ZeRO stage must be 1, 2 or 3, got {stage}")
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"DeepSpeed on this machine trains in float32 or bfloat16, not {dtype}")
    deepspeed = import_deepspeed(device)
    if not device.is_cuda:
        compat.cache_deepspeed_cpu_device_count()  # else a subprocess per ZeRO-3 backward
    with compat.deepspeed_shm_op_build_skipped():  # DeepSpeed's comm backend is created here
        _join_deepspeed_comm(deepspeed, device)
    ranks = list(range(dist.get_world_size())) if ranks is None else list(ranks)
    dp_group, mpu = _groups_for(ranks)
    if dist.get_rank() not in ranks:
        return None
    config = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": persistence_threshold},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": optim.max_grad_norm,
        "bf16": {"enabled": dtype == "bfloat16"},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
        **(extra_config or {}),
    }
    optimizer = optim.make([p for p in model.parameters() if p.requires_grad])  # LoRA: the adapters only
    compat.set_deepspeed_global_mpu(mpu)  # else a world engine after a subset one inherits its groups
    if stage == 3:
        _agree_on_param_ids(dp_group)
    with _engine_world(dp_group, ranks):
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=optim.scheduler,
                                          config=config, mpu=mpu)
    if stage == 3:
        _persistent_regathered_in_one_collective(engine.optimizer)
        if DROP_FETCHES_WHEN_WHOLE:
            _submodule_fetches_dropped_when_whole(engine)
    adapter = ZeroAdapter(engine, spec, name=f"ZeRO{stage}·DP{len(ranks)}") if spec is not None else None
    return ZeroTrainer(engine, adapter, dp_group, tuple(ranks))


def gather_whole(params: Sequence[torch.nn.Parameter]) -> None:
    """The ZeRO-3 parameters of ``params`` not gathered now, gathered whole from their partitions
    in one collective per DP group: DeepSpeed's own coalesced gather (the one its fetch hooks
    use), where ``param.all_gather`` launches one all-gather per parameter. A copy of the
    partitions either way: the same bits."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    todo = [p for p in params if p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
    if todo:
        todo[0].all_gather_coalesced(todo).wait()


def _persistent_regathered_in_one_collective(opt) -> None:
    """After each ``step()`` ZeRO-3 gathers its persistent parameters again from the updated
    partitions (``_post_step``), one all-gather per parameter: 21 collectives a step on the tiny
    2-layer model, each a wait for the other rank. The same gather in one collective
    (``gather_whole``); nothing else of ``_post_step`` changes."""
    if not opt.persistent_parameters or any(p.ds_secondary_tensor is not None for p in opt.persistent_parameters):
        return  # hpZ's secondary partitions are gathered from elsewhere: DeepSpeed's own path
    post_step = opt._post_step

    def _post_step(timer_names):
        held, opt.persistent_parameters = opt.persistent_parameters, []
        try:
            post_step(timer_names)
        finally:
            opt.persistent_parameters = held
        gather_whole(held)

    opt._post_step = _post_step


# a ZeRO-3 model whose every parameter is persistent runs without DeepSpeed's per-submodule
# parameter fetch and release (``_submodule_fetches_dropped_when_whole``); False keeps them (the
# bench compares the two)
DROP_FETCHES_WHEN_WHOLE = True


def _no_fetch(sub_module) -> None:
    """A backward fetch/release of a model held whole: nothing to fetch or release."""


class _BackwardMarker(torch.autograd.Function):
    """The node DeepSpeed's ``PreBackwardFunctionForModule`` / ``PostBackwardFunctionModule`` put
    into the graph (forward: ``detach``; backward: the gradient unchanged), without their
    callback — there is nothing to fetch — and in the ``forward(ctx, ...)`` form, which
    ``Function.apply`` does not re-bind through ``inspect.signature`` on every call."""

    @staticmethod
    def forward(ctx, tensor):
        return tensor.detach()

    @staticmethod
    def backward(ctx, *grads):
        return grads


def _submodule_fetches_dropped_when_whole(engine) -> bool:
    """ZeRO-3 hooks every submodule: before its forward it fetches the submodule's parameters
    and records it in the prefetch trace, after it releases them, and the same around its
    backward (two autograd Functions wrapped around the submodule's outputs and inputs call the
    fetch and release when the backward reaches them). When every parameter is persistent
    (``ds_persist``: ``persistence_threshold`` above the largest), each fetch finds the parameter
    gathered and each release keeps it: they compute nothing. Dropped here:

    - the forward fetch and release hooks: removed; one forward pre-hook on the model gathers
      whatever is not gathered now instead (``gather_whole``: nothing, except on the first
      forward and after a path that released every parameter — ``step()``'s
      ``_partition_all_parameters`` before its re-gather, an offload);
    - the backward fetch and release: gone. The two autograd Functions' nodes stay, as
      ``_BackwardMarker`` (the same node without the callback) — they are nodes of the backward
      graph, and without them the autograd engine sums a tensor's gradient from its several
      uses (the q/k/v projections of one input) in another order: not bit for bit.

    The gradient hooks that reduce-scatter each gradient into its partition are on the
    parameters, not the submodules: untouched. Bit for bit with threshold 0
    (tests/test_loop_overhead.py). False (nothing changed) when a parameter is not persistent,
    or with hpZ secondary partitions or parameter offload."""
    offload = getattr(engine.optimizer, "parameter_offload", None)
    params = list(engine.module.parameters())
    if (offload is None or not params or not all(getattr(p, "ds_persist", False) for p in params)
            or any(p.ds_secondary_tensor is not None for p in params)
            or getattr(offload, "offload_device", None) not in (None, "none")):
        return False
    for hook in offload.forward_hooks:
        hook.remove()
    offload.forward_hooks = []
    # DeepSpeed's backward hooks apply ``module.pre_bwd_fn`` / ``post_bwd_fn``, looked up per call
    for module in engine.module.modules():
        if "pre_bwd_fn" in module.__dict__:
            module.pre_bwd_fn = module.post_bwd_fn = _BackwardMarker
    # what a Function DeepSpeed made before this would still call (parameter_offload.py)
    offload.pre_sub_module_backward_function = offload.post_sub_module_backward_function = _no_fetch
    engine.module.register_forward_pre_hook(lambda module, args: gather_whole(params))
    gather_whole(params)
    return True


def add_param_flat(out: LocalState, field_: str, name: str, shape: tuple[int, ...], lo: int, hi: int,
                   buffer: str, offset: int) -> None:
    """``buffer[offset:offset + hi - lo]`` holds flat elements ``[lo, hi)`` of parameter ``name``.
    A stacked MoE expert parameter (``families.stacked_experts``) is a run of per-expert tensors,
    each a contiguous block of its flat range: the range is cut at their edges."""
    stacked = stacked_experts(name, shape)
    if stacked is None:
        out.add_flat(StateKey(name, field_), shape, lo, hi, buffer, offset)
        return
    row = math.prod(shape[2:])
    for tensor, e, r0, r1 in stacked:
        b0, b1 = (e * shape[1] + r0) * row, (e * shape[1] + r1) * row  # the tensor's block
        a, b = max(lo, b0), min(hi, b1)
        if a < b:
            out.add_flat(StateKey(tensor, field_), (r1 - r0,) + tuple(shape[2:]), a - b0, b - b0, buffer,
                         offset + a - lo)


class ZeroAdapter:
    """One rank of a DeepSpeed ZeRO engine, described as VPS fragments over its own buffers."""

    # the bit16 weights are buffers apart from the fp32 master: a training switch moves them in
    # the same plan and calls state_written(weights_written=True) (see train_switch)
    separate_weights = True

    def __init__(self, engine: Any, spec: ModelSpec, name: str | None = None):
        self.engine = engine
        self.spec = spec
        self.stage = engine.zero_optimization_stage()
        if self.stage not in (1, 2, 3):
            raise ValueError(f"the ZeRO adapter needs ZeRO stage 1, 2 or 3, the engine runs stage {self.stage}")
        self.opt = engine.optimizer
        self.name = name or f"ZeRO{self.stage}·DP{engine.dp_world_size}"
        from .lora import canonical_name  # peft's wrapped names -> the spec's (identity without LoRA)

        names = {p: canonical_name(n) for p, n in engine.param_names.items()}
        # transformers 5 stacks a MoE layer's experts in one parameter; the spec names them per expert
        unknown = sorted(n for p, n in names.items()
                         if n not in spec and stacked_experts(n, tuple(getattr(p, "ds_shape", p.shape))) is None)
        if unknown:
            raise ValueError(f"{self.name}: parameters {unknown[:5]} are not tensors of model {spec.name!r}")
        self._names = names
        self._unset_moments: list[torch.Tensor] = []  # see prepare_state(overwritten=True)

    # --- where each parameter's share is -----------------------------------------------------
    def _frozen(self):
        """(name, shape, flat lo, flat hi, buffer) of each frozen parameter's share on this rank:
        ZeRO-1/2 the whole module tensor, ZeRO-3 its partition (``ds_tensor``)."""
        for p, name in self._names.items():
            if p.requires_grad:
                continue
            if self.stage == 3:
                P = p.ds_tensor.numel()
                r = dist.get_rank(group=p.ds_process_group)
                lo, hi = r * P, min((r + 1) * P, p.ds_numel)
                if lo < hi:
                    yield name, tuple(p.ds_shape), lo, hi, p.ds_tensor.data.view(-1)
            else:
                yield name, tuple(p.shape), 0, p.numel(), p.data.view(-1)

    def _describe_frozen(self, out: LocalState, field_: str) -> None:
        for name, shape, lo, hi, t in self._frozen():
            add_param_flat(out, field_, name, shape, lo, hi, out.add_buffer(f"{field_}/frozen/{name}", t), 0)

    def _groups(self) -> int:
        return len(self.opt.fp16_groups) if self.stage == 3 else len(self.opt.bit16_groups)

    def _master(self, g: int) -> torch.Tensor:
        o = self.opt
        return o.fp32_partitioned_groups_flat[g] if self.stage == 3 else o.single_partition_of_fp32_groups[g]

    def _owned(self, g: int):
        """(name, shape, flat lo, flat hi, offset in the group's partition buffers) of each
        parameter share this rank owns in group ``g``."""
        o = self.opt
        if self.stage == 3:
            for p in o.fp16_groups[g]:
                _, off, P = o.grad_position[o.get_param_id(p)]
                r = dist.get_rank(group=p.ds_process_group)
                lo, hi = r * P, min((r + 1) * P, p.ds_numel)
                if lo < hi:
                    yield self._names[p], tuple(p.ds_shape), lo, hi, off
            return
        r = dist.get_rank(group=o.real_dp_process_group[g])
        P = o.partition_size[g]
        for p, off in zip(o.round_robin_bit16_groups[g], o.round_robin_bit16_offsets[g]):
            lo, hi = max(off, r * P), min(off + p.numel(), (r + 1) * P)
            if lo < hi:
                yield self._names[p], tuple(p.shape), lo - off, hi - off, lo - r * P

    # --- the adapter ---------------------------------------------------------------------------
    def weights(self, master_copies: bool = True) -> LocalState:
        """The bit16 (compute-dtype) weights: whole on every rank under ZeRO-1/2, this rank's
        partition of each parameter under ZeRO-3.

        ``master_copies=False`` (what a training switch writes beside the state): leave out the
        bit16 elements that are copies of this rank's own fp32 master partition in value
        (``weights_are_master``: fp32 training) — ZeRO-1/2's slice ``[r·P, (r+1)·P)`` of each
        flat group, ZeRO-3's whole partition. ``state_written(weights_written=True)`` fills
        them from the written master with one local copy, so they never cross the wire twice.
        With a bit16 dtype of its own (bf16) nothing is left out."""
        out = LocalState()
        o = self.opt
        skip_own = not master_copies and self.weights_are_master()
        for g in range(self._groups()):
            if self.stage == 3:
                if skip_own:  # the partition is all this rank's own: nothing left to describe
                    continue
                buf = out.add_buffer(f"{PARAM}/g{g}", o.fp16_partitioned_groups_flat[g])
                for name, shape, lo, hi, off in self._owned(g):
                    add_param_flat(out, PARAM, name, shape, lo, hi, buf, off)
            else:
                buf = out.add_buffer(f"{PARAM}/g{g}", o.bit16_groups_flat[g])
                if skip_own:
                    r, P = dist.get_rank(group=o.real_dp_process_group[g]), o.partition_size[g]
                    own = (r * P, (r + 1) * P)
                for p, off in zip(o.round_robin_bit16_groups[g], o.round_robin_bit16_offsets[g]):
                    runs = [(off, off + p.numel())]
                    if skip_own:  # the parameter's flat range less the own partition: 0-2 runs
                        runs = [(a, b) for a, b in ((off, min(off + p.numel(), own[0])),
                                                    (max(off, own[1]), off + p.numel())) if a < b]
                    for a, b in runs:
                        add_param_flat(out, PARAM, self._names[p], tuple(p.shape), a - off, b - off, buf, a)
        if not skip_own:  # a frozen parameter is its own master: with the state already
            self._describe_frozen(out, PARAM)
        return out

    @torch.no_grad()
    def merged_weights(self) -> LocalState:
        """The LoRA targets' merged weights ``W + (B @ A)·scaling`` (peft's ``merge``) over this
        rank's share of each ``W`` (``_frozen``), as ``param`` of the target, in buffers kept from
        one call to the next. ``A`` and ``B`` are whole here: ZeRO-1/2's module tensors, ZeRO-3's
        gathered (collective over the DP group, every rank in spec order)."""
        from .lora import delta_weight

        params = {name: p for p, name in self._names.items()}
        frozen = {name: (shape, lo, hi, t) for name, shape, lo, hi, t in self._frozen()}
        merged = getattr(self, "_merged", None) or {}
        self._merged = merged
        out = LocalState()
        scaling = self.spec.lora.scaling
        for target in self.spec.adapted_tensors:
            stem = target[: -len(".weight")]
            a, b = params[stem + ".lora_A.weight"], params[stem + ".lora_B.weight"]
            if self.stage == 3:
                import deepspeed

                with deepspeed.zero.GatheredParameters([a, b]):
                    delta = delta_weight(a.data, b.data, scaling)
            else:
                delta = delta_weight(a.data, b.data, scaling)
            if target not in frozen:
                continue
            shape, lo, hi, w = frozen[target]
            buf = merged.get(target)
            if buf is None or buf.numel() != hi - lo:
                buf = merged[target] = torch.empty(hi - lo, dtype=w.dtype, device=w.device)
            # W + (B @ A)·s elementwise over the share: peft's merge, element for element
            buf.copy_(w[: hi - lo] + delta.reshape(-1)[lo:hi].to(w.dtype))
            add_param_flat(out, PARAM, target, shape, lo, hi, out.add_buffer(f"merged/{target}", buf), 0)
        return out

    def weights_are_master(self) -> bool:
        """Whether every group's bit16 copy has its fp32 master's dtype (fp32 training): then the
        bit16 slice over this rank's master partition holds the master's values bit for bit —
        DeepSpeed builds the master as a copy of it and copies the master back into it after
        every step (``update_lp_params``; ZeRO-3 ``_reassign_or_swap_out_partitioned_parameters``)."""
        o = self.opt
        for g in range(self._groups()):
            bit16 = o.fp16_partitioned_groups_flat[g] if self.stage == 3 else o.bit16_groups_flat[g]
            if bit16.dtype != self._master(g).dtype:
                return False
        return True

    @torch.no_grad()
    def _own_weights_from_master(self) -> None:
        """This rank's bit16 slice over its master partition := the master (the local half of
        DeepSpeed's refresh, without its all-gather)."""
        o = self.opt
        for g in range(self._groups()):
            if self.stage == 3:
                o.fp16_partitioned_groups_flat[g].data.copy_(o.fp32_partitioned_groups_flat[g].data)
            else:
                r = dist.get_rank(group=o.real_dp_process_group[g])
                o.parallel_partitioned_bit16_groups[g][r].data.copy_(o.single_partition_of_fp32_groups[g].data)

    def state(self) -> LocalState:
        """fp32 master and Adam moments of this rank's partition (``prepare_state`` first on an
        engine that has not stepped yet: torch creates Adam state at the first step)."""
        out = LocalState()
        base = self.opt.optimizer
        for g in range(self._groups()):
            master = self._master(g)
            st = base.state.get(master, {})
            missing = [k for k in ADAM_MOMENTS if k not in st]
            if missing:
                raise RuntimeError(f"{self.name}: no Adam {missing} yet (the engine has not stepped); "
                                   f"call prepare_state() before describing a fresh engine")
            tensors = {MASTER: master, EXP_AVG: st[EXP_AVG], EXP_AVG_SQ: st[EXP_AVG_SQ]}
            for field_, t in tensors.items():
                buf = out.add_buffer(f"{field_}/g{g}", t.data)
                for name, shape, lo, hi, off in self._owned(g):
                    add_param_flat(out, field_, name, shape, lo, hi, buf, off)
        self._describe_frozen(out, MASTER)
        return out

    @torch.no_grad()
    def prepare_state(self, overwritten: bool = False) -> None:
        """Create the Adam state torch would create at the first step (zeros, step 0).

        ``overwritten``: the caller writes every element ``state()`` describes right after (a
        training switch). Those are left unset — a pass over two fp32 copies of the partition
        spared — and only the partition's padding, which nothing describes, gets its zeros; until
        ``state_written`` (or ``state_unwritten``, which zeroes them: a refused switch) the
        moments hold no values."""
        base = self.opt.optimizer
        for g in range(self._groups()):
            master = self._master(g)
            st = base.state[master]
            if EXP_AVG not in st:
                st["step"] = torch.tensor(0.0)
                for k in ADAM_MOMENTS:
                    st[k] = (torch.empty_like if overwritten else torch.zeros_like)(
                        master, memory_format=torch.preserve_format)
                if overwritten:
                    for lo, hi in self._undescribed(g):
                        for k in ADAM_MOMENTS:
                            st[k][lo:hi].zero_()
                    self._unset_moments.extend(st[k] for k in ADAM_MOMENTS)

    def _undescribed(self, g: int) -> list[tuple[int, int]]:
        """The ranges of group ``g``'s partition buffers no parameter share covers (padding)."""
        gaps, at = [], 0
        for lo, hi in sorted((off, off + hi - lo) for _, _, lo, hi, off in self._owned(g)):
            if lo > at:
                gaps.append((at, lo))
            at = max(at, hi)
        n = self._master(g).numel()
        return gaps + [(at, n)] if at < n else gaps

    @torch.no_grad()
    def state_unwritten(self) -> None:
        """A switch that was to write the state created by ``prepare_state(overwritten=True)``
        did not: give the moments the zeros torch would have created."""
        for t in self._unset_moments:
            t.zero_()
        self._unset_moments = []

    @torch.no_grad()
    def state_written(self, weights_written: bool = False) -> None:
        """The fp32 master changed under the engine: refresh its bit16 copy the way it would
        after a step. Collective over the engine's DP group.

        ``weights_written``: the bit16 copies described by ``weights()`` were written too (every
        rank's whole flat groups under ZeRO-1/2, its partitions under ZeRO-3), consistent with
        the master — they are taken as current: no all-gather. Where ``weights_are_master`` the
        slice over this rank's own partition is copied from the master all the same (a training
        switch writes ``weights(master_copies=False)``, which leaves it out; elsewhere the copy
        rewrites the same bits)."""
        self._unset_moments = []  # written now
        o = self.opt
        if self.stage == 3:
            if not weights_written or self.weights_are_master():
                self._own_weights_from_master()  # param.ds_tensor are views of these flat buffers
            self.weights_written()
        else:
            o._hp_optimizer_states_linked = False  # re-link the lp params' optimizer fragments
            o._lazy_init_hp_params_optimizer_state()
            if not weights_written:
                o.update_lp_params()  # fp32 partition -> bit16 partition -> all-gather the flat buffer
            elif self.weights_are_master():
                self._own_weights_from_master()

    @torch.no_grad()
    def weights_written(self) -> None:
        """The bit16 weights ``weights()`` describes were written in place, the master left alone
        (the reference's warm start). ZeRO-3: the parameters DeepSpeed keeps whole between steps
        (``persistent_parameters``: fewer elements than ``persistence_threshold``) are what the
        forward reads, and their whole copy is still the old one — release every gathered
        parameter as ``step()`` does and gather the persistent ones again from the written
        partitions. ZeRO-1/2 compute on the written flat buffer itself: nothing to do. Collective
        over the engine's DP group."""
        if self.stage != 3:
            return
        o = self.opt
        o._partition_all_parameters()
        gather_whole(o.persistent_parameters)
        o.invalidate_secondary_tensor()

    def gradient_buffers(self) -> list[torch.Tensor]:
        """The flat gradient partitions the optimizer keeps allocated between steps (ZeRO-3's
        ``grad_partitions_flat_buffer``, ZeRO-2's ``grads_in_partition``): an offload releases
        them (the next backward overwrites their values)."""
        names = ("grad_partitions_flat_buffer",) if self.stage == 3 else ("grads_in_partition",)
        return [t for t in (getattr(self.opt, n, None) for n in names) if t is not None]

    def scalars(self) -> dict[str, Any]:
        base = self.opt.optimizer
        steps = {float(st["step"]) for st in base.state.values() if "step" in st}
        if len(steps) > 1:
            raise RuntimeError(f"{self.name}: Adam step counts differ between groups: {sorted(steps)}")
        sched = self.engine.lr_scheduler
        return {"step": int(steps.pop()) if steps else 0,
                "global_steps": self.engine.global_steps,
                "global_samples": self.engine.global_samples,
                "lr_scheduler": sched.state_dict() if sched is not None else None,
                "rng": torch.get_rng_state()}

    def load_scalars(self, scalars: Mapping[str, Any]) -> None:
        base = self.opt.optimizer
        for st in base.state.values():
            if "step" in st:
                st["step"].fill_(float(scalars["step"]))
        self.engine.global_steps = scalars.get("global_steps", scalars["step"])
        self.engine.global_samples = scalars.get("global_samples", self.engine.global_samples)
        sched = self.engine.lr_scheduler
        if sched is not None and scalars.get("lr_scheduler") is not None:
            load_schedule(sched, base.param_groups, scalars["lr_scheduler"])
        if scalars.get("rng") is not None:
            torch.set_rng_state(scalars["rng"])
