"""What a training-engine adapter is: its live tensors described as VPS fragments, nothing more.

A training engine (DeepSpeed ZeRO, FSDP2, DTensor TP, a pipeline stage) keeps each rank's share
of the model in its own buffers. An adapter answers, on each rank, two questions about them:

- ``weights()``: where the *compute* weights live (field ``param``, the model's dtype) — what a
  rollout engine needs;
- ``state()``: where the *training state* lives — the fp32 weights (field ``master``) and the Adam
  moments (``exp_avg``, ``exp_avg_sq``) — what a training-layout switch must carry.

Each answer is a ``LocalState``: this rank's fragments, its buffer declarations and the buffers
themselves (writable, in place — never a copy). Engines whose parameters *are* the fp32 weights
(FSDP2, DTensor TP, pipeline stages) describe the same tensors as ``param`` in one and ``master``
in the other. ``gather_layouts`` turns every rank's local answers into global ``Layout`` s with one
metadata collective; the executor then moves bytes between the engines' own buffers.

The adapter also carries what is not parameter-shaped (``scalars``: optimizer step, LR scheduler,
RNG), makes lazily created optimizer state exist before it is written (``prepare_state``) and
refreshes whatever the engine derives from the fp32 state after a write (``state_written``).
An adapter whose compute weights are buffers apart from its fp32 master (DeepSpeed ZeRO's bit16
copy) sets ``separate_weights = True``: a training switch then writes its
``weights(master_copies=False)`` in the same plan and calls ``state_written(weights_written=True)``,
which takes them as current instead of re-deriving them from the master. ``master_copies=False``
lets such an adapter leave out the weights that are copies of the rank's own master in value
(fp32 training: one local copy from the written master in ``state_written`` instead of a second
trip over the wire).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

import torch
import torch.distributed as dist  # noqa: F401 - ProcessGroup in annotations

from ..routing.comm import as_comm
from ..vps import Box, BufferSpec, Fragment, Layout, LayoutError, ModelSpec, StateKey, flat_range_to_boxes
from ..vps.materialize import DTYPE_NAMES
from ..vps.space import row_major_strides

def dtype_name(dtype: torch.dtype) -> str:
    """The name the VPS uses for a torch dtype (layouts never import torch)."""
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"the VPS does not move {dtype} tensors") from None


@dataclass
class LocalState:
    """One rank's share of some fields of the state: fragments, declarations and the buffers."""

    fragments: list[Fragment] = field(default_factory=list)
    buffers: dict[str, BufferSpec] = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    def add_buffer(self, name: str, tensor: torch.Tensor) -> str:
        """Declare ``tensor`` (contiguous, used in place) as buffer ``name``."""
        if not tensor.is_contiguous():
            raise ValueError(f"buffer {name!r} is not contiguous; the VPS writes buffers in place")
        if name in self.tensors and self.tensors[name] is not tensor:
            raise ValueError(f"buffer {name!r} declared twice")
        self.tensors[name] = tensor
        self.buffers[name] = BufferSpec(tensor.numel(), dtype_name(tensor.dtype))
        return name

    def add_box(self, key: StateKey, box: Box, buffer: str, offset: int = 0) -> None:
        """``buffer[offset:]`` holds ``box`` of ``key`` as a dense row-major block."""
        self.fragments.append(Fragment(key, box, buffer, offset, row_major_strides(box.shape)))

    def add_flat(self, key: StateKey, shape: Sequence[int], lo: int, hi: int, buffer: str, offset: int) -> None:
        """``buffer[offset:offset + hi - lo]`` holds flat elements ``[lo, hi)`` of ``key``
        (a tensor of ``shape``, row-major) — a ZeRO partition's view of one parameter."""
        strides = row_major_strides(tuple(shape))
        for box in flat_range_to_boxes(tuple(shape), lo, hi):
            first = sum(a * s for a, s in zip(box.lo, strides))
            self.fragments.append(Fragment(key, box, buffer, offset + first - lo, strides))

    def merge(self, other: "LocalState") -> "LocalState":
        for name, t in other.tensors.items():
            self.add_buffer(name, t)
        self.fragments += other.fragments
        return self


@runtime_checkable
class TrainAdapter(Protocol):
    """A running training engine as the VPS sees it (one instance per rank of the engine)."""

    spec: ModelSpec
    name: str  # e.g. "ZeRO3·DP2", shown in reports and errors

    def weights(self) -> LocalState: ...

    def state(self) -> LocalState: ...

    def prepare_state(self) -> None: ...

    def state_written(self) -> None: ...

    def scalars(self) -> dict[str, Any]: ...

    def load_scalars(self, scalars: Mapping[str, Any]) -> None: ...


def gather_layouts(locals_: Sequence[tuple[ModelSpec, LocalState] | None], names: Sequence[str],
                   group: dist.ProcessGroup | None = None, extra: Any = None
                   ) -> tuple[list[Layout | None], list[Any]]:
    """Every rank's local answers -> one global ``Layout`` per answer, with one all_gather_object.

    ``locals_[i]`` is this rank's ``(model spec, share)`` of layout ``i`` (``None`` where this rank
    takes no part: an engine on a subset of the ranks). Layout ``i`` is ``None`` when no rank takes
    part in it. ``extra`` is any picklable value each rank wants the others to see (scalars,
    errors); everyone's ``extra`` comes back beside the layouts. Engines of one layout that
    disagree on the model raise ``LayoutError`` (on every rank alike).
    """
    mine = [(spec, tuple(s.fragments), dict(s.buffers)) if (spec, s) != (None, None) else None
            for spec, s in (x if x is not None else (None, None) for x in locals_)]
    comm = as_comm(group)  # a registered group or a bare one (trainer ranks + another job's ranks)
    everyone = comm.all_gather_object((mine, extra))
    layouts: list[Layout | None] = []
    for i, name in enumerate(names):
        answers = [e[0][i] for e in everyone]
        specs = {a[0].digest: a[0] for a in answers if a is not None}
        if len(specs) > 1:
            raise LayoutError(f"{name}: the engine's ranks describe different models "
                              f"({sorted(s.name for s in specs.values())})")
        if not specs:
            layouts.append(None)
            continue
        spec = specs.popitem()[1]
        layouts.append(Layout(spec, [a[1] if a else () for a in answers],
                              [a[2] if a else {} for a in answers], name=name))
    return layouts, [e[1] for e in everyone]
