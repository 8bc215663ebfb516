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

    def make(self, params, on_local_shards: bool = False) -> torch.optim.AdamW:
        # foreach=False: the per-parameter loop keeps each param's arithmetic independent of its
        # neighbours, so a parameter updated in any layout gets the same bits
        cls = LocalShardAdamW if on_local_shards else torch.optim.AdamW
        return cls(params, lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay, foreach=False)

    def scheduler(self, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, LinearWarmup(self.warmup_steps))


class LocalShardAdamW(torch.optim.AdamW):
    """torch's AdamW whose step runs on the local shards of DTensor parameters (FSDP2, DTensor
    TP): Adam is elementwise, so each DTensor op of the update is its local op on the local
    tensors — the same kernels on the same numbers, bit for bit — and stepping the local tensors
    directly skips DTensor's dispatch of ~12 ops per parameter per step (at the tiny sizes that
    dispatch cost more than the arithmetic). The parameters, their state (DTensors, as
    torch's AdamW keeps them) and ``state_dict`` are torch's; only ``step`` differs."""

    @torch.no_grad()
    def step(self, closure=None):
        from torch.optim.adam import adam

        if closure is not None:
            raise ValueError("LocalShardAdamW.step takes no closure")
        for group in self.param_groups:
            params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = [], [], [], [], [], []
            has_complex = self._init_group(group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps)
            local = [[_local(t) for t in ts] for ts in (params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs)]
            beta1, beta2 = group["betas"]
            adam(*local, steps, amsgrad=group["amsgrad"], has_complex=has_complex, beta1=beta1, beta2=beta2,
                 lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"],
                 foreach=group["foreach"], capturable=group["capturable"], differentiable=group["differentiable"],
                 fused=group["fused"], grad_scale=getattr(self, "grad_scale", None),
                 found_inf=getattr(self, "found_inf", None), decoupled_weight_decay=group["decoupled_weight_decay"])
        return None


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor (an alias: in-place updates land in the DTensor) where every
    placement is Shard or Replicate (an elementwise op is then its local op); else ``t``."""
    placements = getattr(t, "placements", None)
    if placements is not None and all(p.is_shard() or p.is_replicate() for p in placements):
        return t.to_local()
    return t


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
