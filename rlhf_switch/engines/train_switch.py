"""Switch a running training engine to another layout: weights, fp32 master and Adam moments move
through one VPS plan (and, into an engine that keeps a bit16 copy apart from its master, that
copy too — DeepSpeed ZeRO then skips its own refresh), straight from the source engine's buffers into the destination's; the step,
LR-scheduler position and RNG travel beside them; training continues where it stopped.

Every world rank calls ``switch_training(src, dst)`` with its own adapters (``None`` on a rank the
engine does not live on). The source engine is only ever read: a refused switch (different models,
a layout the destination cannot hold, mismatched buffers) raises the same ``MoveError`` on every
rank before any byte moves, and the source goes on training as if nothing happened.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ..routing.executor import DEFAULT_BUDGET, MoveError, MoveReport, gc_paused, move
from ..vps import LayoutError
from .train_state import TrainAdapter, gather_layouts


@dataclass
class SwitchReport:
    source: str
    destination: str
    move: MoveReport
    scalars: dict[str, Any]
    full_model_bytes: int  # the fp32 state of the whole model: what no rank may ever hold

    def __str__(self) -> str:
        m = self.move
        return (f"{self.source} -> {self.destination}: rank {m.rank} received {m.bytes_received} B "
                f"(minimum {m.min_bytes_received} B), sent {m.bytes_sent} B, local {m.bytes_local} B, "
                f"peak staging {m.peak_staging_bytes} B (full state {self.full_model_bytes} B), "
                f"{m.seconds * 1e3:.1f} ms")


@gc_paused()  # describing both engines and gathering layouts too: see gc_paused
def switch_training(src: TrainAdapter | None, dst: TrainAdapter | None, *,
                    group: dist.ProcessGroup | None = None, budget_bytes: int = DEFAULT_BUDGET,
                    timeout: timedelta | None = None) -> SwitchReport:
    """Move the training state of ``src`` into ``dst`` (collective over ``group``, default the
    world). ``dst`` must be freshly built for the same model; its state is overwritten."""
    problem = None
    if dst is not None:
        try:
            _prepare(dst)  # torch creates Adam state lazily: give the move somewhere to write
        except Exception as e:  # noqa: BLE001 - reported on every rank below
            problem = f"{dst.name}: cannot prepare its optimizer state: {type(e).__name__}: {e}"
    try:
        return _switch(src, dst, problem, group, budget_bytes, timeout)
    except BaseException:
        if dst is not None and hasattr(dst, "state_unwritten"):
            dst.state_unwritten()  # the state prepared to be overwritten was not: torch's zeros
        raise


def _prepare(dst: TrainAdapter) -> None:
    """``dst.prepare_state``, told the switch overwrites what it creates where the adapter can
    use that (``state_unwritten``: it can undo it)."""
    if hasattr(dst, "state_unwritten"):
        dst.prepare_state(overwritten=True)
    else:
        dst.prepare_state()


def _switch(src: TrainAdapter | None, dst: TrainAdapter | None, problem: str | None,
            group: dist.ProcessGroup | None, budget_bytes: int, timeout: timedelta | None) -> SwitchReport:
    # every source offers its compute weights (field ``param``) beside its state; a destination
    # whose bit16 copy is a buffer apart from its fp32 master (DeepSpeed ZeRO) takes them in the
    # same plan instead of re-deriving them from the master afterwards (an all-gather of the model)
    # — less the elements that are copies of its own master partition in value (fp32 training),
    # which state_written fills locally from the master the plan writes
    src_local = src.state().merge(src.weights()) if src is not None else None
    dst_weights = dst is not None and _separate_weights(dst)
    dst_local = None
    if dst is not None and problem is None:
        dst_local = dst.state().merge(dst.weights(master_copies=False)) if dst_weights else dst.state()
    me = {"src": src.name if src else None, "dst": dst.name if dst else None, "problem": problem,
          "scalars": src.scalars() if src is not None else None}
    try:
        (src_layout, dst_layout), everyone = gather_layouts(
            [(src.spec, src_local) if src else None, (dst.spec, dst_local) if dst_local else None],
            ["source", "destination"], group=group, extra=me)
    except LayoutError as e:  # raised alike on every rank: nothing has moved
        raise MoveError(str(e)) from None
    _refuse_early(everyone)
    src_layout.name = next(e["src"] for e in everyone if e["src"])
    dst_layout.name = next(e["dst"] for e in everyone if e["dst"])
    # a destination for another model fails here, identically on every rank, before any byte moves
    report = move(src_layout, dst_layout, src_local.tensors if src_local else {},
                  dst_local.tensors if dst_local else {}, group=group, budget_bytes=budget_bytes,
                  **({"timeout": timeout} if timeout is not None else {}))
    scalars = next(e["scalars"] for e in everyone if e["scalars"] is not None)
    if dst is not None:
        dst.load_scalars(scalars)
        if dst_weights:
            dst.state_written(weights_written=True)
        else:
            dst.state_written()
    return SwitchReport(src_layout.name, dst_layout.name, report, scalars,
                        full_model_bytes=4 * dst_layout.spec.numel)  # one fp32 copy of every weight


def _separate_weights(adapter: TrainAdapter) -> bool:
    """Whether ``adapter`` keeps compute weights apart from its fp32 master (``separate_weights``),
    so that a switch writes them too (``weights(master_copies=False)``: those that are no copy of
    the rank's own master) and says so with ``state_written(weights_written=True)``."""
    return bool(getattr(adapter, "separate_weights", False))


def _refuse_early(everyone: list[dict]) -> None:
    """Errors every rank can see from the gathered answers: raise the same MoveError everywhere."""
    problems = [e["problem"] for e in everyone if e["problem"]]
    if not any(e["src"] for e in everyone):
        problems.append("no rank holds a source engine")
    if not any(e["dst"] for e in everyone):
        problems.append("no rank holds a destination engine")
    for side in ("src", "dst"):
        names = {e[side] for e in everyone if e[side]}
        if len(names) > 1:
            problems.append(f"the {side} engines disagree on what they are: {sorted(names)}")
    if problems:
        raise MoveError("; ".join(dict.fromkeys(problems)))
