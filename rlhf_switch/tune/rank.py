"""Rank every legal combination of per-phase layouts by modelled iteration time.

``rank(cfg, profile)`` enumerates each phase's legal layouts (``enumerate``), keeps the
combinations whose peak memory fits the device (``memory``), and orders them by the sum of the
phases' modelled seconds (``cost``). The switch needs the planner, the only costly part, and
depends on the (train, rollout) pair alone: pairs are visited in the order of their time without
the switch, and planning stops once that time alone exceeds the K-th best total — a switch costs
≥ 0 s, so no skipped pair could enter the top K. Refusals are ``TuneError``: one message.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import product
from typing import Sequence

from ..rl.config import RunConfig
from .cost import PHASE_COLUMNS, SwitchCost, engine_pass, iteration_seconds, switch_cost
from .enumerate import Combination, combination_problems, describe, enumerate_combinations
from ..engines.base import rollout_engine
from .memory import MemoryEstimate, estimate_memory, rollout_bytes, rollout_need, train_state_bytes
from .profile import GIB, MachineProfile
from .workload import Workload


def layout_key(layout) -> tuple:
    """A hashable identity of a phase layout (the config's models are not hashable, nor are the
    dicts some fields hold, such as a rollout layout's ``options``): its class and its JSON."""
    return (type(layout).__name__, layout.model_dump_json())


class TuneError(ValueError):
    """No combination can run: one message saying which phase does not fit and by how much."""


@dataclass(frozen=True)
class Row:
    combo: Combination
    seconds: dict[str, float]      # switch, rollout, logprob, update, total
    memory: MemoryEstimate
    device_memory: float
    switch: SwitchCost | None = None

    @property
    def headroom(self) -> float:
        return self.device_memory - self.memory.peak

    @property
    def switch_share(self) -> float:
        return self.seconds["switch"] / self.seconds["total"] if self.seconds["total"] else 0.0

    def as_dict(self) -> dict:
        return {**{p: describe(layout) for p, layout in self.combo.phases().items()},
                **{f"{k}_s": v for k, v in self.seconds.items()},
                "peak_gib": self.memory.peak / GIB, "headroom_gib": self.headroom / GIB,
                "switch_share": self.switch_share,
                "switch_max_rank_bytes": self.switch.rank_bytes if self.switch else None}


@dataclass
class Ranking:
    rows: list[Row]
    considered: int                 # legal combinations
    fitting: int                    # ... that fit in memory
    planned_pairs: int              # (train, rollout) pairs the planner was asked about
    notes: list[str] = field(default_factory=list)


def _fits(w: Workload, profile: MachineProfile, phases: dict) -> None:
    """Refuse before ranking when no layout of a phase fits alone, naming the smallest need."""
    cap = profile.device_memory
    train_need = min((train_state_bytes(w, t) for t in phases["train"]), default=None)
    if train_need is not None and train_need > cap:
        best = min(phases["train"], key=lambda t: train_state_bytes(w, t))
        raise TuneError(f"the model does not fit world_size={best.size} in any training layout: the smallest "
                        f"training state is {train_need / GIB:.4g} GiB per device ({describe(best)}: weights, "
                        f"gradients, fp32 master and Adam moments), a device has {cap / GIB:.4g} GiB; use more "
                        f"devices or larger ones (--device-memory)")
    need = [(rollout_need(w, r), i) for i, r in enumerate(phases["rollout"])]
    if need and min(need)[0] + (train_need or 0) > cap:
        best = phases["rollout"][min(need)[1]]
        rb = rollout_bytes(w, best)
        kv, what = ((rb["kv_per_sequence"], f"even one sequence of {w.seq} tokens needs")
                    if rollout_engine(best.engine).paged_kv else
                    (rb["kv_cache"], f"{w.rollout_batch} sequences of {w.seq} tokens need"))
        raise TuneError(f"the rollout batch does not fit: {what} {kv / GIB:.4g} GiB of KV cache + "
                        f"{rb['weights'] / GIB:.4g} GiB of weights per device in the smallest rollout layout "
                        f"({describe(best)}), beside {(train_need or 0) / GIB:.4g} GiB of training state; a device "
                        f"has {cap / GIB:.4g} GiB (lower algorithm.prompts_per_iteration, group_size or "
                        f"max_new_tokens, or use larger devices)")


def rank(cfg: RunConfig, profile: MachineProfile, world: int | None = None, top: int = 10,
         train_engines: Sequence[str] | None = None, rollout_engines: Sequence[str] | None = None,
         workload: Workload | None = None) -> Ranking:
    """The ``top`` combinations by modelled iteration time on ``world`` devices of ``profile``."""
    w = workload or Workload.from_config(cfg)
    world = world or cfg.world_size
    phases = enumerate_combinations(cfg, world, train_engines, rollout_engines)
    if not phases["train"] or not phases["rollout"]:
        empty = "train" if not phases["train"] else "rollout"
        raise TuneError(f"no legal {empty} layout on world_size={world} for this model and batch "
                        f"(heads, KV heads, MLP width and layers must divide; see rlhf-switch train's checks)")
    _fits(w, profile, phases)
    # the reference (forward only) and critic are costed alone; the best one that fits is taken
    refs = sorted(phases["reference"], key=lambda r: engine_pass(w, profile, r, world, w.rollout_batch,
                                                                 train=False).total) or [None]
    critics = phases["critic"] or [None]
    candidates = []
    considered = fitting = 0
    for train, rollout, critic in product(phases["train"], phases["rollout"], critics):
        fitted = None
        for ref in refs:
            combo = Combination(train, rollout, ref, critic)
            if combination_problems(cfg, combo):
                continue
            considered += 1
            mem = estimate_memory(w, combo, profile.device_memory)
            if mem.peak <= profile.device_memory:
                fitted = (combo, mem)
                break
        if fitted is None:
            continue
        fitting += 1
        combo, mem = fitted
        no_switch = iteration_seconds(w, profile, combo, switch=SwitchCost(0.0, 0, 0, 0), memory=mem)
        candidates.append((no_switch["total"], combo, mem))
    if not candidates:
        raise TuneError(f"no combination of layouts fits a device of {profile.device_memory / GIB:.3g} GiB on "
                        f"world_size={world} ({considered} legal combinations, each over memory beside the "
                        f"others' resident state); use more devices or larger ones (--device-memory)")
    candidates.sort(key=lambda c: c[0])  # stable: ties keep the enumeration's order
    switches: dict[tuple, SwitchCost] = {}
    rows: list[Row] = []
    for lower_bound, combo, mem in candidates:
        if len(rows) >= top and lower_bound > rows[top - 1].seconds["total"]:
            break
        key = (layout_key(combo.train), layout_key(combo.rollout))
        if key not in switches:
            switches[key] = switch_cost(w, profile, combo.train, combo.rollout)
        secs = iteration_seconds(w, profile, combo, switch=switches[key], memory=mem)
        rows.append(Row(combo, secs, mem, profile.device_memory, switches[key]))
        rows.sort(key=lambda r: r.seconds["total"])
    return Ranking(rows[:top], considered, fitting, len(switches))


def format_table(rows: Sequence[Row]) -> str:
    """The ranked table, one line per combination."""
    head = ["#", "train", "rollout", "reference", "critic", *[f"{p} s" for p in PHASE_COLUMNS], "total s",
            "peak GiB", "headroom GiB", "switch %"]
    lines = [head]
    for i, r in enumerate(rows, 1):
        ph = r.combo.phases()
        lines.append([str(i), describe(ph["train"]), describe(ph["rollout"]),
                      describe(ph["reference"]) if "reference" in ph else "-",
                      describe(ph["critic"]) if "critic" in ph else "-",
                      *[_fmt(r.seconds[p]) for p in PHASE_COLUMNS], _fmt(r.seconds["total"]),
                      f"{r.memory.peak / GIB:.3g}", f"{r.headroom / GIB:.3g}", f"{100 * r.switch_share:.1f}"])
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(wd) for c, wd in zip(line, widths)).rstrip() for line in lines)


def _fmt(s: float) -> str:
    return f"{s:.3g}" if s < 100 else f"{s:.0f}"
