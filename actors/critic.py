"""The PPO critic: a training engine whose model has a value head, and the value loss over it.

No Ray here: ``Critic`` runs inside a worker process that already has a gloo default process
group (the hybrid worker's world, or a test's ``LocalWorld``). The engine is any registered
training engine that builds value heads (``fsdp2``, ``deepspeed``; ``TrainingContext(head=
"value")``): the critic is not a fork of an engine, only the loss and the batch bookkeeping.

- the model: ``rlhf_switch.models.value_model`` — the family's ``…ForTokenClassification`` with one
  label, its trunk optionally from an actor checkpoint; ``value_spec`` is its VPS description, so
  the critic's state is saved, resumed and switched like the actor's;
- positions: ``values(ids)[b, t]`` is the value of the state after ``ids[b, :t+1]``, i.e. before
  token ``t+1`` is generated — the position whose logits give the actor's log-prob of token
  ``t+1``. So values, log-probs and the hybrid worker's mask are all ``[B, T-1]`` and aligned;
- data parallelism: ``values`` and ``update`` take THIS rank's share of the batch (the caller
  slices; ``local_slice`` does it for a global batch). Every DP rank must call them together with
  the same number of rows. ``update`` weighs each micro-batch by its share of the GLOBAL token
  count (all-reduced), so DP ranks with unequal numbers of response tokens still give exactly the
  one-process token-mean gradient.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Sequence

import torch
import torch.distributed as dist

from rlhf_switch.engines.base import (
    DEFAULT_TIMEOUT,
    TrainingContext,
    TrainingEngine,
    training_engine,
)
from rlhf_switch.engines.optim import AdamWConfig
from rlhf_switch.models import load_trunk, value_model, value_spec  # noqa: F401 - the critic's model, re-exported
from rlhf_switch.rl.algorithm import loss_weight
from rlhf_switch.rl.algorithms import Aggregation, value_loss

TIMEOUT = DEFAULT_TIMEOUT


@dataclass(frozen=True)
class CriticLayout:
    """What ``Critic.build`` reads of a layout (``rl.config.TrainLayout`` has these fields)."""

    engine: str = "fsdp2"
    zero_stage: int = 0
    dp: int = 1
    tp: int = 1
    pp: int = 1


class Critic:
    """One DP rank of the critic: a value-head training engine and its loss."""

    def __init__(self, engine: TrainingEngine, micro_batch: int = 1):
        if engine.head != "value":
            raise ValueError(f"{engine.name}: the critic needs an engine built with head='value'")
        self.engine, self.micro_batch = engine, micro_batch
        self.name, self.adapter, self.spec = engine.name, engine.adapter, engine.spec
        self.dp_group, self.dp, self.dp_rank = engine.dp_group, engine.dp, engine.dp_rank
        self.steps = 0

    @classmethod
    def build(cls, layout: Any, hf_config: Any, seed: int, ranks: Sequence[int] | None = None, *,
              lr: float = 1e-5, max_grad_norm: float = 0.0, micro_batch: int = 1, weight_decay: float = 0.0,
              init_from: str | None = None, optim: AdamWConfig | None = None,
              timeout: timedelta = TIMEOUT) -> "Critic | None":
        """The critic over ``ranks`` (default: the whole world) with the training engine
        ``layout.engine`` names, DP = ``layout.dp`` = ``len(ranks)``. Optimizer: ``optim`` or
        ``AdamWConfig(lr, weight_decay, max_grad_norm)``. ``micro_batch``: sequences per forward.
        Collective over the world; ``None`` outside ``ranks``."""
        ranks = list(range(dist.get_world_size())) if ranks is None else [int(r) for r in ranks]
        if int(layout.dp) != len(ranks):
            raise ValueError(f"critic: layout dp={layout.dp} but {len(ranks)} ranks {ranks}")
        if micro_batch < 1:
            raise ValueError(f"critic: micro_batch must be >= 1, got {micro_batch}")
        engine_cls = training_engine(layout.engine)
        problems = engine_cls.layout_problems("critic", layout, None, head="value")
        if problems:
            raise ValueError("; ".join(problems))
        optim = optim or AdamWConfig(lr=lr, weight_decay=weight_decay, max_grad_norm=max_grad_norm or 0.0)
        ctx = TrainingContext(dict(hf_config), seed, tuple(ranks), optim, micro_batch=micro_batch, head="value",
                              init_from=init_from, timeout=timeout)
        engine = engine_cls.build(layout, ctx)
        return None if engine is None else cls(engine, micro_batch)

    def local_slice(self, t: torch.Tensor) -> torch.Tensor:
        """This DP rank's contiguous share of a global batch (rows)."""
        if t.shape[0] % self.dp:
            raise ValueError(f"{self.name}: batch {t.shape[0]} is not divisible by DP={self.dp}")
        per = t.shape[0] // self.dp
        return t[self.dp_rank * per:(self.dp_rank + 1) * per]

    @torch.no_grad()
    def values(self, ids: torch.Tensor) -> torch.Tensor:
        """``[B, T-1]`` values of this rank's ``ids [B, T]``: ``values[b, t]`` is V of the state
        after ``ids[b, :t+1]`` (aligned with the actor's log-prob of token ``t+1``). Collective
        over the DP group: every rank calls it with the same ``B``. Micro-batches of the
        engine's ``micro_batch``."""
        return self.engine.outputs(ids)

    def update(self, ids: torch.Tensor, mask: torch.Tensor, returns: torch.Tensor, old_values: torch.Tensor,
               clip_eps: float | None = 0.2, micro_batch: int | None = None,
               aggregation: Aggregation = "token-mean") -> dict[str, float]:
        """One optimizer step on this rank's share: clipped value loss (``value_loss``) in
        micro-batches of ``micro_batch`` rows, gradients accumulated, each micro-batch weighted
        by its share of the global batch (tokens for ``token-mean``, sequences with tokens for
        the ``seq-mean-*`` aggregations), so the step is the one-process full-batch step.
        ``ids [B, T]``; ``mask``, ``returns``, ``old_values`` ``[B, T-1]``.
        Returns ``vf_loss`` (global), ``vf_clipfrac`` (global, per token), ``grad_norm``
        (global, before clipping), ``tokens`` (global)."""
        B = ids.shape[0]
        if tuple(mask.shape) != (B, ids.shape[1] - 1):
            raise ValueError(f"{self.name}: mask {tuple(mask.shape)} does not fit ids {tuple(ids.shape)} "
                             f"(want [B, T-1])")
        micro = micro_batch or self.micro_batch
        n_chunks = -(-B // micro)
        mask = mask.float()

        def weight(m: torch.Tensor) -> torch.Tensor:
            return loss_weight(m, aggregation)

        # global weight and token count; and the same number of micro-batches everywhere (sharded
        # engines gather inside each forward: unequal counts would hang, so refuse on every rank)
        totals = torch.stack([weight(mask), mask.sum()]).double()
        counts = torch.tensor([n_chunks, -n_chunks], dtype=torch.int64, device=mask.device)
        if self.dp > 1:
            dist.all_reduce(totals, group=self.dp_group)
            dist.all_reduce(counts, op=dist.ReduceOp.MAX, group=self.dp_group)
        if int(counts[0]) != -int(counts[1]):
            raise ValueError(f"{self.name}: DP ranks have between {-int(counts[1])} and {int(counts[0])} "
                             f"micro-batches; every rank needs the same number")
        W, tokens = float(totals[0]), float(totals[1])
        scale = self.dp / max(W, 1.0)  # the engines average gradients over DP

        def loss_fn(v: torch.Tensor, s: slice):
            m = mask[s]
            vl, st = value_loss(v, old_values[s].float(), returns[s].float(), m, clip_eps=clip_eps,
                                aggregation=aggregation)
            w = weight(m)
            return vl * (w * scale), {"loss_sum": float((vl.detach() * w).double()),
                                      "clip_sum": float((st["vf_clipfrac"] * m.sum()).double())}

        step = self.engine.train_step(ids, micro, loss_fn)
        stats = torch.tensor([sum(s["loss_sum"] for s in step["stats"]), sum(s["clip_sum"] for s in step["stats"])],
                             dtype=torch.float64, device=mask.device)
        if self.dp > 1:
            dist.all_reduce(stats, group=self.dp_group)
        self.steps += 1
        return {"vf_loss": float(stats[0]) / max(W, 1.0), "vf_clipfrac": float(stats[1]) / max(tokens, 1.0),
                "grad_norm": step["grad_norm"], "tokens": int(tokens)}

    def state_dict_full(self, all_ranks: bool = False) -> dict[str, torch.Tensor]:
        """Every parameter whole, fp32, by its HF name (``model.*``, ``score.*``) — on DP rank 0
        (``{}`` elsewhere) or on every rank with ``all_ranks``: a VPS move of the engine's weights
        into whole tensors. Collective over the world."""
        from rlhf_switch.engines.full_state import FullState
        from rlhf_switch.engines.train_state import gather_layouts
        from rlhf_switch.routing import move

        holder = FullState(self.spec, name="full weights") if all_ranks or self.dp_rank == 0 else None
        whole = holder.weights() if holder is not None else None
        mine = self.adapter.weights()
        (src, dst), _ = gather_layouts([(self.spec, mine), (self.spec, whole) if whole else None],
                                       [self.name, "whole"])
        with torch.no_grad():
            move(src, dst, mine.tensors, whole.tensors if whole else {})
        return {k: v.clone() for k, v in holder.master.items()} if holder is not None else {}
