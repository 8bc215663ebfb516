"""The legal per-phase layouts of a run: what ``rlhf-switch train`` would accept, phase by phase.

A layout is legal for a phase when the pre-start checks accept it (``rlhf_switch.problems``: it covers the
world, TP divides heads, KV heads and MLP width, PP has a layer per stage, DP divides the batch)
and the phase's engine runs it (the engine registry's ``layout_problems``: DeepSpeed is ZeRO 1–3
DP only, ``torch_pp`` has ``dp`` 1, the critic needs an engine with a value head, …). Nothing here
is a second copy of those rules: every candidate is asked of them.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import product
from typing import Iterable, Sequence

from ..engines.base import (EngineError, phase_engine_problems, rollout_engine_names, training_engine,
                            training_engine_names)
from ..problems import batch_problems, layout_problems, model_split_problems
from ..rl import config as rlconfig
from ..rl.config import PhaseLayout, RolloutLayout, RunConfig, TrainerLayout, TrainLayout


@dataclass(frozen=True)
class Combination:
    """One layout per phase of a run (``reference``/``critic`` None when the run has none)."""

    train: TrainerLayout
    rollout: RolloutLayout
    reference: TrainLayout | None = None
    critic: TrainLayout | None = None

    def phases(self) -> dict[str, PhaseLayout]:
        return {p: getattr(self, p) for p in rlconfig.PHASES if getattr(self, p) is not None}

    def apply(self, cfg: RunConfig) -> RunConfig:
        """``cfg`` with these layouts (and ``world_size`` theirs)."""
        return cfg.model_copy(update={"world_size": self.train.size, **self.phases()})


def describe(layout: PhaseLayout) -> str:
    """``deepspeed ZeRO3·DP2``, ``torch_tp TP2·DP2``, ``vllm TP2×2`` (rollout: TP × replicas)."""
    if isinstance(layout, RolloutLayout):
        return f"{layout.engine} TP{layout.tp}×{layout.dp}"
    parts = [f"{n}{v}" for n, v in (("TP", layout.tp), ("PP", layout.pp), ("DP", layout.dp)) if v > 1] or ["DP1"]
    zero = f"ZeRO{layout.zero_stage}·" if layout.zero_stage else ""
    return f"{layout.engine} {zero}{'·'.join(parts)}"


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def phase_problems(phase: str, layout: PhaseLayout, world: int, dims) -> list[str]:
    """Why ``layout`` cannot run ``phase`` on ``world`` devices for the model ``dims``."""
    problems = layout_problems(phase, layout, world)
    if dims is not None:
        problems += model_split_problems(phase, layout, dims)
    return problems + phase_engine_problems(phase, layout, dims)


def zero_stages(phase: str, engine: str) -> tuple[int, ...]:
    """The ``zero_stage`` values to try for ``engine`` in ``phase``: a training engine's own
    (DeepSpeed: 1, 2, 3), else 0 — also for a name the registry cannot resolve, which
    ``phase_problems`` then refuses with the reason."""
    if phase == "rollout":
        return (0,)
    try:
        return training_engine(engine).zero_stages
    except EngineError:
        return (0,)


def phase_layouts(phase: str, world: int, dims, engines: Iterable[str]) -> list[PhaseLayout]:
    """Every legal layout of ``phase`` on ``world`` devices with one of ``engines``."""
    # the train block has fields of its own (offload); the candidates keep their defaults
    cls = {"rollout": RolloutLayout, "train": TrainerLayout}.get(phase, TrainLayout)
    found = []
    for engine in engines:
        for tp, pp in product(divisors(world), divisors(world)):
            if world % (tp * pp):
                continue
            for zero in zero_stages(phase, engine):
                layout = cls(engine=engine, zero_stage=zero, tp=tp, pp=pp, dp=world // (tp * pp))
                if not phase_problems(phase, layout, world, dims):
                    found.append(layout)
    return found


def combination_problems(cfg: RunConfig, combo: Combination) -> list[str]:
    """The rules that tie phases and the batch together (``problems.batch_problems``)."""
    return batch_problems(combo.apply(cfg))


def enumerate_combinations(cfg: RunConfig, world: int | None = None,
                           train_engines: Sequence[str] | None = None,
                           rollout_engines: Sequence[str] | None = None) -> dict[str, list]:
    """``{"train": [...], "rollout": [...], "reference": [...], "critic": [...]}``: each phase's
    legal layouts on ``world`` (default: the config's) with the registered engines (or those
    given); phases the run does not have are empty lists."""
    world = world or cfg.world_size
    dims = rlconfig.model_dims(cfg.model)
    train_engines = list(train_engines or training_engine_names())
    rollout_engines = list(rollout_engines or rollout_engine_names())
    out = {"train": phase_layouts("train", world, dims, train_engines),
           "rollout": phase_layouts("rollout", world, dims, rollout_engines),
           "reference": phase_layouts("reference", world, dims, train_engines) if cfg.reference is not None else [],
           "critic": phase_layouts("critic", world, dims, train_engines) if cfg.critic is not None else []}
    # a layout whose batch split fails for every partner is dropped here already
    out["rollout"] = [r for r in out["rollout"] if cfg.algorithm.prompts_per_iteration % r.dp == 0
                      and cfg.eval.num_prompts % r.dp == 0]
    return out
