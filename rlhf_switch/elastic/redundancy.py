"""One rank's host copy of the trainer's state in the buddy layout (``elastic.redundancy: host``).

``HostCopy.refresh`` is one VPS move, collective over the trainer's world, from what a training
switch carries (``adapter.state()`` and ``adapter.weights()``: fp32 master, Adam moments, a
bit16 copy where the engine keeps one apart) into ``vps.layouts.buddy.buddy_layout`` of it — the
rank's own share and its buddy's, in host buffers of its own (pinned when the engine is on a
GPU) — with the step, LR schedule and RNG kept beside them, as of that moment.

After a rank is lost, ``HostCopy.source()`` is the surviving rank's copy as the *source* of a
training switch (``engines.train_switch.switch_training`` accepts any adapter): the recovery
move over the union of the survivors and the new world's ranks is the resize's own
(``elastic.member.move_over_union``), reading host buffers instead of an engine's.
"""
from __future__ import annotations

import copy
import time
from datetime import timedelta
from typing import Any, Mapping

import torch
import torch.distributed as dist

from ..engines.train_state import LocalState, TrainAdapter, gather_layouts
from ..routing.executor import DEFAULT_BUDGET, DEFAULT_TIMEOUT, move
from ..vps.layouts.buddy import buddy_layout
from ..vps.materialize import torch_dtype

REDUNDANCY_MODES = ("none", "host")


def switched_state(adapter: TrainAdapter) -> LocalState:
    """What a training switch reads from a source engine: its state and its compute weights."""
    return adapter.state().merge(adapter.weights())


class HostCopy:
    """One rank of the trainer's host copy (every rank of ``group`` holds one and calls
    ``refresh`` together; the layouts are gathered once, at the first refresh)."""

    def __init__(self, adapter: TrainAdapter, shift: int = 1, *, group: dist.ProcessGroup | None = None,
                 budget_bytes: int = DEFAULT_BUDGET, timeout: timedelta = DEFAULT_TIMEOUT):
        self.adapter, self.shift, self.group = adapter, shift, group
        self.budget_bytes, self.timeout = budget_bytes, timeout
        self.layouts = None          # (engine layout, buddy layout)
        self.rank = None             # this rank in the trainer's world at the refreshes
        self.host: dict[str, torch.Tensor] = {}
        self._planned = None
        self.scalars: dict[str, Any] | None = None
        self.extra: dict[str, Any] = {}
        self.refreshes = 0
        self.torn = False            # a refresh began and has not finished: the buffers mix two states

    def refresh(self, extra: Mapping[str, Any] | None = None) -> dict:
        """Copy the engine's state as of now into the buddy layout; ``extra``: what the caller
        keeps with it (the data position). Returns this rank's bytes and seconds."""
        t0 = time.perf_counter()
        local = switched_state(self.adapter)
        self._check_planned(local)
        engine, buddy = self.layouts
        # the move writes the host buffers in place: until it and the scalars are done (a loss in
        # the middle leaves it stuck or failed), the copy is refused as a source
        self.torn = True
        report = move(engine, buddy, local.tensors, self.host, group=self.group,
                      budget_bytes=self.budget_bytes, timeout=self.timeout)
        self.scalars = copy.deepcopy(self.adapter.scalars())
        self.extra = dict(extra or {})
        self.refreshes += 1
        self.torn = False
        return {"bytes_local": report.bytes_local, "bytes_received": report.bytes_received,
                "bytes_held": sum(t.numel() * t.element_size() for t in self.host.values()),
                "seconds": time.perf_counter() - t0}

    def _check_planned(self, local: LocalState) -> None:
        mine = (tuple(local.fragments), dict(local.buffers))
        if self.layouts is None:
            (engine,), _ = gather_layouts([(self.adapter.spec, local)], [self.adapter.name], group=self.group)
            buddy = buddy_layout(engine, self.shift)
            self.rank = dist.get_rank(self.group)
            pin = next(iter(local.tensors.values())).device.type == "cuda"
            self.host = {name: torch.zeros(b.numel, dtype=torch_dtype(b.dtype), pin_memory=pin)
                         for name, b in buddy.buffers(self.rank).items()}
            self.layouts, self._planned = (engine, buddy), mine
        elif mine != self._planned:
            raise RuntimeError(f"{self.adapter.name}: its state is no longer where the host copy's plan has it "
                               f"(an engine rebuilt?); make a new HostCopy")

    def source(self) -> "HostCopySource":
        if self.scalars is None:
            raise RuntimeError(f"{self.adapter.name}: the host copy was never refreshed")
        if self.torn:
            raise RuntimeError(f"{self.adapter.name}: a refresh of the host copy was cut short (or is running): "
                               f"its buffers mix two states")
        return HostCopySource(self)


class HostCopySource:
    """A rank's host copy as the read-only source of a training switch (``switch_training``):
    its fragments are the buddy layout's on this rank, its scalars those of the last refresh."""

    separate_weights = False  # a source only: never written

    def __init__(self, copy_: HostCopy):
        self._copy = copy_
        self.spec = copy_.adapter.spec
        self.name = f"host copy of {copy_.adapter.name}"  # alike on every surviving rank

    def state(self) -> LocalState:
        _, buddy = self._copy.layouts
        rank = self._copy.rank
        return LocalState(list(buddy.fragments(rank)), dict(buddy.buffers(rank)), dict(self._copy.host))

    def weights(self) -> LocalState:
        return LocalState()  # in ``state()`` already: the copy holds every field the switch moves

    def scalars(self) -> dict[str, Any]:
        return copy.deepcopy(self._copy.scalars)

    def prepare_state(self) -> None:
        raise RuntimeError(f"{self.name} is a source only")

    def state_written(self, weights_written: bool = False) -> None:
        raise RuntimeError(f"{self.name} is a source only")

    def load_scalars(self, scalars: Mapping[str, Any]) -> None:
        raise RuntimeError(f"{self.name} is a source only")
