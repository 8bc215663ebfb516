"""Memory at the phase boundary: a trainer's optimizer state (and, ``all``, its weights) parked in
host memory while the rollout engine generates, then put back, bit for bit.

``train.offload`` (``none`` | ``optimizer`` | ``all``) says what leaves the engine's buffers:

- ``optimizer``: the Adam moments (``exp_avg``, ``exp_avg_sq``) and the fp32 master where the
  engine keeps one apart from its weights (DeepSpeed ZeRO: ``separate_weights``; FSDP2's
  parameters *are* the fp32 master, so they stay) — ``adapter.state()`` minus what is weights;
- ``all``: that and the compute weights (``adapter.weights()``: ZeRO's bit16 copy, FSDP2's
  local shards), after the weight sync has read them.

Gradients have no values worth keeping between steps (the next backward overwrites them): the
engine's persistent gradient buffers (``adapter.gradient_buffers()``, where it has any) are
released with the rest and come back zeroed, as the engine made them.

The move out is a VPS move like any other: source = the engine's own fragments (the adapter's
description, gathered into one layout once), destination = ``vps.layouts.host.host_layout`` of
it — each rank's own boxes in host buffers of its own (pinned when the engine's buffers are on a
GPU) — so the plan is local copies only and the executor's checks and accounting apply. Then
each engine buffer's *storage* is resized to 0: the memory is handed back (to the CUDA caching
allocator, and from it to the device with ``empty_cache``) while every tensor object, view and
optimizer-state key the engine holds stays what it was. ``reload`` resizes the storages back,
zeroes them (alignment padding no fragment describes was zero and stays zero: the engines pad
with zeros and Adam keeps a zero with a zero gradient at zero) and moves the host copy back in.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterable

import torch
import torch.distributed as dist

from ..routing.executor import DEFAULT_BUDGET, DEFAULT_TIMEOUT, move
from ..vps import MASTER
from ..vps.layouts.host import host_layout
from ..vps.materialize import torch_dtype
from .train_state import LocalState, TrainAdapter, gather_layouts

OFFLOAD_MODES = ("none", "optimizer", "all")


@dataclass
class OffloadReport:
    direction: str        # "offload" (engine -> host) or "reload" (host -> engine)
    bytes_moved: int      # what the VPS move copied on this rank (the fragments' bytes)
    bytes_released: int   # offload: engine storage handed back; reload: storage taken again
    seconds: float

    def as_dict(self) -> dict:
        return dict(vars(self))


def offloaded_state(adapter: TrainAdapter, mode: str) -> LocalState:
    """The fragments ``mode`` parks (module doc), over the engine's live buffers."""
    if mode not in OFFLOAD_MODES[1:]:
        raise ValueError(f"offload mode {mode!r}: expected one of {', '.join(OFFLOAD_MODES[1:])}")
    state = adapter.state()
    if not getattr(adapter, "separate_weights", False):  # its master is its weights: not optimizer state
        state = _without_field(state, MASTER)
    return state.merge(adapter.weights()) if mode == "all" else state


def _without_field(state: LocalState, field: str) -> LocalState:
    out = LocalState()
    for f in state.fragments:
        if f.key.field != field:
            out.add_buffer(f.buffer, state.tensors[f.buffer])
            out.fragments.append(f)
    return out


class HostOffload:
    """One rank of a training engine's offload (every rank of ``group`` holds one and calls
    ``offload`` / ``reload`` together: the layouts are gathered once, at the first offload)."""

    def __init__(self, adapter: TrainAdapter, mode: str, *, group: dist.ProcessGroup | None = None,
                 budget_bytes: int = DEFAULT_BUDGET, timeout: timedelta = DEFAULT_TIMEOUT):
        if mode not in OFFLOAD_MODES[1:]:
            raise ValueError(f"offload mode {mode!r}: expected one of {', '.join(OFFLOAD_MODES[1:])}")
        self.adapter, self.mode, self.group = adapter, mode, group
        self.budget_bytes, self.timeout = budget_bytes, timeout
        self.layouts = None          # (engine layout, host layout), gathered at the first offload
        self.host: dict[str, torch.Tensor] = {}
        self._planned = None         # this rank's fragments and buffers the layouts were made from
        self._released: list[tuple[torch.Tensor, int]] = []  # one tensor per storage, its bytes
        self.parked = False

    def offload(self) -> OffloadReport:
        if self.parked:
            raise RuntimeError(f"{self.adapter.name}: the state is already in host memory")
        t0 = time.perf_counter()
        local = offloaded_state(self.adapter, self.mode)
        self._check_planned(local)
        engine, host = self.layouts
        report = move(engine, host, local.tensors, self.host, group=self.group,
                      budget_bytes=self.budget_bytes, timeout=self.timeout)
        released = self._release(list(local.tensors.values()) + self._gradient_buffers())
        self.parked = True
        return OffloadReport("offload", report.bytes_local, released, time.perf_counter() - t0)

    def reload(self) -> OffloadReport:
        if not self.parked:
            raise RuntimeError(f"{self.adapter.name}: nothing was offloaded")
        t0 = time.perf_counter()
        taken = self._restore()
        local = offloaded_state(self.adapter, self.mode)
        engine, host = self.layouts
        report = move(host, engine, self.host, local.tensors, group=self.group,
                      budget_bytes=self.budget_bytes, timeout=self.timeout)
        self.parked = False
        return OffloadReport("reload", report.bytes_local, taken, time.perf_counter() - t0)

    # --- the layouts and the host buffers --------------------------------------------------------
    def _check_planned(self, local: LocalState) -> None:
        mine = (tuple(local.fragments), dict(local.buffers))
        if self.layouts is None:
            (engine,), _ = gather_layouts([(self.adapter.spec, local)], [f"{self.adapter.name} ({self.mode})"],
                                          group=self.group)
            host = host_layout(engine)
            rank = dist.get_rank(self.group)
            device = next(iter(local.tensors.values())).device
            pin = device.type == "cuda"  # page-locked: device <-> host copies at full bandwidth
            self.host = {name: torch.empty(b.numel, dtype=torch_dtype(b.dtype), pin_memory=pin)
                         for name, b in host.buffers(rank).items()}
            self.layouts, self._planned = (engine, host), mine
        elif mine != self._planned:
            raise RuntimeError(f"{self.adapter.name}: its state is no longer where the offload's plan has it "
                               f"(an engine rebuilt?); make a new HostOffload")

    def _gradient_buffers(self) -> list[torch.Tensor]:
        grads = getattr(self.adapter, "gradient_buffers", None)
        return list(grads()) if grads is not None else []

    # --- handing the engine's memory back, and taking it again -----------------------------------
    def _release(self, tensors: Iterable[torch.Tensor]) -> int:
        """Resize every distinct storage behind ``tensors`` to 0 bytes (views and tensor objects
        stay valid: they see the storage again once it is resized back)."""
        seen, released = set(), 0
        for t in tensors:
            storage = t.untyped_storage()
            if storage.data_ptr() in seen or storage.nbytes() == 0:
                continue
            seen.add(storage.data_ptr())
            self._released.append((t, storage.nbytes()))
            released += storage.nbytes()
            storage.resize_(0)
        if any(t.is_cuda for t, _ in self._released):
            torch.cuda.empty_cache()  # to the device, for the rollout engine in another process
        return released

    def _restore(self) -> int:
        taken = 0
        for t, nbytes in self._released:
            storage = t.untyped_storage()
            storage.resize_(nbytes)
            torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage).zero_()
            taken += nbytes
        self._released = []
        return taken


def live_state_bytes(adapter: TrainAdapter) -> int:
    """The bytes the engine's state and weights buffers hold now (each storage once): what a
    CPU machine reports as the trainer's memory of a phase (``torch.cuda.max_memory_allocated``
    stands for it on a GPU)."""
    seen, total = set(), 0
    tensors = list(adapter.state().tensors.values()) + list(adapter.weights().tensors.values())
    grads = getattr(adapter, "gradient_buffers", None)
    for t in tensors + (list(grads()) if grads is not None else []):
        s = t.untyped_storage()
        if s.nbytes() and s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total
