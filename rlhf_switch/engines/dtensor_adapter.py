"""The VPS adapter of torch-native engines: FSDP2, DTensor TP (and both at once), pipeline stages.

Their parameters already carry everything a layout needs. A DTensor knows its global shape and
placements, and ``compute_local_shape_and_global_offset`` turns those into the box its local
tensor holds — for FSDP2's ``Shard(0)`` (uneven last shard: the local tensor is the real rows
only, a view into FSDP2's padded storage), TP's ``Shard(0)``/``Shard(1)`` and the 2-D
``_StridedShard`` × ``Shard`` that FSDP2 makes of a TP weight. A plain tensor (pipeline stage,
replicated norm) holds its whole tensor. Parameter names are HF names, so they are the VPS
tensor names as they stand — except a MoE layer's stacked experts (``families.stacked_experts``):
one buffer holding, per expert it has whole, that expert's per-expert tensors at their offsets.

The parameters are fp32 and ARE the master weights: ``weights()`` describes them as ``param``,
``state()`` as ``master`` plus AdamW's ``exp_avg``/``exp_avg_sq`` (same placements as the
parameter) of those that train. With LoRA (peft's layers, ``engines/lora.py``) the parameters
are named by the spec's names (``canonical_name``) and only the adapters train; ``merged_weights``
gives the adapted weights ``W + (B @ A)·alpha/r`` of this rank's shards (a merged weight sync). Buffers are the live tensors (detached aliases, so the executor's in-place writes
need no ``no_grad``): FSDP2 all-gathers from the sharded storage the local tensor views, so a
write is what the next forward reads.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from ..families import stacked_experts
from ..vps import EXP_AVG, EXP_AVG_SQ, MASTER, PARAM, Box, ModelSpec, StateKey
from .optim import load_schedule
from .train_state import LocalState

MOMENTS = (EXP_AVG, EXP_AVG_SQ)  # field name == AdamW's state key


def is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def local_box(t: torch.Tensor) -> tuple[Box, torch.Tensor]:
    """(global box, local tensor) of a parameter-shaped tensor: a DTensor's shard, or a plain
    tensor whole. The local tensor must be a dense row-major block of exactly that box."""
    if not is_dtensor(t):
        return Box.full(t.shape), t.detach()
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import _StridedShard

    odd = [p for p in t.placements if not isinstance(p, (Shard, _StridedShard, Replicate))]  # i.e. Partial
    if odd:
        raise ValueError(f"placements {t.placements}: a {odd[0]} DTensor holds no box of the tensor")
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    local = t._local_tensor.detach()  # the storage itself (to_local() would add an autograd node)
    if tuple(local.shape) != tuple(shape):
        raise ValueError(f"local shard {tuple(local.shape)} is not the {tuple(shape)} block the placements "
                         f"{t.placements} give (padded shard?)")
    if not local.is_contiguous():
        raise ValueError(f"local shard of shape {tuple(local.shape)} is not contiguous")
    return Box(tuple(offset), tuple(o + s for o, s in zip(offset, shape))), local


class TorchTrainAdapter:
    """``TrainAdapter`` over a module with HF parameter names and its ``torch.optim.AdamW``."""

    def __init__(self, spec: ModelSpec, name: str, module: nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: Any = None):
        self.spec, self.name = spec, name
        self.optimizer, self.scheduler = optimizer, scheduler
        from .lora import canonical_name  # peft's wrapped names -> the spec's (identity without LoRA)

        self.params: dict[str, nn.Parameter] = {canonical_name(n): p for n, p in module.named_parameters()}
        self._merged: dict[str, torch.Tensor] = {}  # merged_weights' buffers, kept across syncs
        # transformers 5 stacks a MoE layer's experts in one parameter; the spec names them per expert
        self.stacked = {n: stacked_experts(n, tuple(p.shape)) for n, p in self.params.items()
                        if n not in spec and stacked_experts(n, tuple(p.shape))}
        unknown = [n for n in self.params if n not in spec and n not in self.stacked]
        if unknown:
            raise ValueError(f"{name}: parameters {unknown[:4]} are not tensors of model {spec.name!r}")

    # --- descriptions ------------------------------------------------------------------------------
    def _describe(self, field: str, tensor_of, trainable_only: bool = False) -> LocalState:
        out = LocalState()
        for name, p in self.params.items():
            if trainable_only and not self.spec.trainable(name):  # frozen: no optimizer state
                continue
            box, local = local_box(tensor_of(name, p))
            if box.empty:  # an FSDP2 rank past the last row: nothing here
                continue
            buffer = out.add_buffer(f"{field}/{name}", local)
            if name in self.stacked:
                self._describe_experts(out, field, name, tuple(p.shape), box, buffer)
            else:
                out.add_box(StateKey(name, field), box, buffer)
        return out

    def _describe_experts(self, out: LocalState, field: str, name: str, shape, box: Box, buffer: str) -> None:
        """A stacked expert parameter [E, R, C] held as experts ``[box.lo[0], box.hi[0])`` whole (what
        FSDP2's ``Shard(0)`` makes of it): each expert's tensors are row blocks of its ``[R, C]``."""
        if box.lo[1:] != (0,) * (len(shape) - 1) or box.hi[1:] != tuple(shape[1:]):
            raise ValueError(f"{self.name}: {name} is split inside an expert ({box}); only whole experts "
                             f"(dim-0 shards) are described")
        row = shape[2]
        for tensor, e, lo, hi in self.stacked[name]:
            if box.lo[0] <= e < box.hi[0]:
                offset = ((e - box.lo[0]) * shape[1] + lo) * row
                out.add_box(StateKey(tensor, field), Box.full((hi - lo, row)), buffer, offset)

    def weights(self) -> LocalState:
        return self._describe(PARAM, lambda n, p: p)

    def state(self) -> LocalState:
        out = self._describe(MASTER, lambda n, p: p)
        for field in MOMENTS:
            out.merge(self._describe(field, lambda n, p: self._moment(n, p, field), trainable_only=True))
        return out

    @torch.no_grad()
    def merged_weights(self) -> LocalState:
        """The LoRA targets' merged weights ``W + (B @ A)·scaling`` (peft's ``merge``) over this
        rank's box of each ``W``, as ``param`` of the target, in buffers kept from one call to the
        next (a weight channel plans them once). Collective over the engine (``A`` gathered whole:
        a ``Shard(0)`` of ``W`` needs all of ``A``'s columns and the rows of ``B`` it has)."""
        from .lora import merge

        out = LocalState()
        scaling = self.spec.lora.scaling
        for target in self.spec.adapted_tensors:
            a_name, b_name = target[: -len(".weight")] + ".lora_A.weight", target[: -len(".weight")] + ".lora_B.weight"
            a = self.params[a_name]
            a = a.full_tensor() if is_dtensor(a) else a.detach()  # every rank: a collective
            box, w = local_box(self.params[target])
            b_box, b = local_box(self.params[b_name])
            if box.empty:
                continue
            if (b_box.lo[0], b_box.hi[0]) != (box.lo[0], box.hi[0]) or b_box.hi[1] - b_box.lo[1] != a.shape[0]:
                raise ValueError(f"{self.name}: {b_name} holds {b_box}, not the rows of {target}'s {box}")
            buf = self._merged.get(target)
            if buf is None or buf.shape != w.shape:
                buf = self._merged[target] = torch.empty_like(w)
            buf.copy_(merge(w, a[:, box.lo[1]:box.hi[1]], b, scaling))
            out.add_box(StateKey(target, PARAM), box, out.add_buffer(f"merged/{target}", buf))
        return out

    def _moment(self, name: str, p: nn.Parameter, field: str) -> torch.Tensor:
        state = self.optimizer.state.get(p)
        if not state or field not in state:
            raise RuntimeError(f"{self.name}: {name} has no AdamW state yet; call prepare_state() "
                               f"before describing or writing the state of an engine that has not stepped")
        return state[field]

    # --- making state exist, and refreshing after writes ------------------------------------------
    def prepare_state(self) -> None:
        """Create AdamW's lazy state exactly as its first ``step`` would (``Adam._init_group``,
        foreach/fused/capturable off): a CPU fp32 ``step`` of 0 and zero moments shaped and
        placed like the parameter (``zeros_like`` keeps a DTensor's mesh and placements)."""
        for group in self.optimizer.param_groups:
            if group.get("fused") or group.get("capturable") or group.get("amsgrad"):
                raise NotImplementedError("prepare_state mirrors plain AdamW (no fused/capturable/amsgrad)")
            for p in group["params"]:
                state = self.optimizer.state[p]
                if len(state) == 0:
                    state["step"] = torch.tensor(0.0, dtype=torch.get_default_dtype())
                    for field in MOMENTS:
                        state[field] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def state_written(self) -> None:
        """Nothing to refresh: the buffers are the parameters and moments themselves (FSDP2's
        next all-gather reads the sharded storage the written local tensor views)."""

    # --- what is not parameter-shaped --------------------------------------------------------------
    def scalars(self) -> dict[str, Any]:
        steps = {int(s["step"]) for s in self.optimizer.state.values() if "step" in s}
        if len(steps) > 1:
            raise RuntimeError(f"{self.name}: parameters disagree on the optimizer step: {sorted(steps)}")
        return {"step": steps.pop() if steps else 0,
                "lr_scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
                "rng": torch.get_rng_state()}

    def load_scalars(self, scalars: Mapping[str, Any]) -> None:
        """Set every parameter's AdamW step (creating the state if needed), the LR scheduler (which
        also sets the param groups' lr) and the CPU RNG."""
        self.prepare_state()
        for s in self.optimizer.state.values():
            s["step"].fill_(float(scalars["step"]))
        sched = scalars.get("lr_scheduler")
        if (sched is None) != (self.scheduler is None):
            raise ValueError(f"{self.name}: LR scheduler state {'missing' if sched is None else 'given'} "
                             f"but this engine {'has' if self.scheduler is not None else 'has no'} scheduler")
        if sched is not None:
            load_schedule(self.scheduler, self.optimizer.param_groups, sched)
        if scalars.get("rng") is not None:
            torch.set_rng_state(scalars["rng"])
