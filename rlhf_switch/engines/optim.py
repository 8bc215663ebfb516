"""The optimizer recipe every training engine shares: AdamW with a linear-warmup schedule.

A training-layout switch carries Adam moments, the step count and the scheduler's position; for
the continued run to equal an uninterrupted one, the engine on each side must apply the same
update rule with the same hyperparameters. Engines take one ``AdamWConfig`` and build torch's
``AdamW`` (DeepSpeed through ``torch_adam``, which needs no compiled op) and a ``LambdaLR`` whose
``lr_lambda`` is the picklable ``LinearWarmup``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AdamWConfig:
    lr: float = 3e-3
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.0
    warmup_steps: int = 0  # linear warmup from lr/warmup_steps to lr, then constant
    # global-norm gradient clipping; 0 = off. DeepSpeed clips at 1.0 unless told otherwise, which
    # silently scales every update relative to an unclipped engine — so the recipe states it
    max_grad_norm: float = 0.0

    def make(self, params) -> torch.optim.AdamW:
        # foreach=False: the per-parameter loop keeps each param's arithmetic independent of its
        # neighbours, so a parameter updated in any layout gets the same bits
        return torch.optim.AdamW(params, lr=self.lr, betas=self.betas, eps=self.eps,
                                 weight_decay=self.weight_decay, foreach=False)

    def scheduler(self, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, LinearWarmup(self.warmup_steps))


def load_schedule(scheduler, optimizer_groups, state: dict) -> None:
    """Restore a scheduler's position and the learning rate it implies: ``load_state_dict``
    restores the schedule, not the param groups' current ``lr``."""
    scheduler.load_state_dict(state)
    for group, lr in zip(optimizer_groups, scheduler.get_last_lr()):
        group["lr"] = lr


@dataclass(frozen=True)
class LinearWarmup:
    warmup_steps: int

    def __call__(self, step: int) -> float:
        if self.warmup_steps <= 0:
            return 1.0
        return min(1.0, (step + 1) / self.warmup_steps)
