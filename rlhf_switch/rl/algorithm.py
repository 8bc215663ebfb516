"""A run's RL algorithm as one object: how scores become advantages, the policy loss, where the
KL to the reference goes, and how each mini-batch's loss is weighed. The driver asks it for a
rollout batch's per-sequence advantages (``sequence_advantages``); every trainer rank runs its
update with it (``update``). The formulas are ``rl/algorithms.py``'s; this module only assembles
them, so a new algorithm is a new combination of registered pieces, not a new update loop.

Two registered pieces make an algorithm (``ALGORITHMS``):

- an advantage estimator (``ESTIMATORS``): ``group`` — a sample's score against its group's (the
  ``group_size`` samples of one prompt), one number per sequence, computed by the driver, which
  holds every group; ``gae`` — the critic's values, per-token rewards with the KL penalty and GAE,
  whitened over the DP group, computed on each trainer rank (it needs the critic's outputs);
- a policy loss (``POLICY_LOSSES``): ``ppo_clip`` — PPO-clip with clip-higher, aggregated by
  ``loss_aggregation``.

The KL to the reference is either a term of the loss (``kl_in_loss``: GRPO) or a per-token reward
(PPO, inside ``gae``).

Every rank gets the whole rollout batch and takes its DP share (``RankBatch``). Each micro-batch's
loss is weighed by its share of the whole mini-batch over all DP ranks (tokens for ``token-mean``,
sequences with tokens otherwise), times DP because the engines average gradients over DP: the step
is the one-process full-batch step even when ranks and micro-batches hold different numbers of
tokens. Those totals come from the whole batch every rank holds (``mini_batch_totals``), so no
collective is needed for them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from .algorithms import aggregate, grpo_advantages, kl_penalty, masked_mean, policy_loss, ppo_batch
from .choices import Aggregation


# --- the batch, as one trainer rank holds it ------------------------------------------------------

def pad_batch(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], pad_id: int):
    """Right-padded ``prompt + response`` ids ``[B, T]``, the shifted targets ``ids[:, 1:]`` and the
    mask ``[B, T-1]`` of the positions whose logits predict a response token."""
    seqs = [list(p) + list(r) for p, r in zip(prompts, responses)]
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), T - 1), dtype=torch.float32)
    for b, (p, r) in enumerate(zip(prompts, responses)):
        ids[b, : len(p) + len(r)] = torch.tensor(list(p) + list(r), dtype=torch.long)
        mask[b, len(p) - 1: len(p) - 1 + len(r)] = 1.0
    return ids, ids[:, 1:], mask


def loss_weight(mask: torch.Tensor, aggregation: Aggregation) -> torch.Tensor:
    """How much a (micro-)batch counts in an aggregated loss: its tokens for ``token-mean``, its
    sequences with tokens for the ``seq-mean-*`` aggregations."""
    return mask.sum() if aggregation == "token-mean" else (mask.sum(-1) > 0).sum().float()


def mini_batch_totals(prompts: Sequence, responses: Sequence, pad_id: int, dp: int, local_mini: int,
                      aggregation: Aggregation) -> torch.Tensor:
    """Each mini-batch's weight over all ``dp`` ranks (``loss_weight`` of every rank's rows of it,
    summed in float64), from the whole batch every rank is given: the integer counts an
    all-reduce of each rank's own totals would sum — exact in any order — without the collective.
    Rank ``r`` holds rows ``[r·per, (r+1)·per)``."""
    mask = pad_batch(prompts, responses, pad_id)[2]  # a row's mask does not depend on the padding
    per = len(prompts) // dp
    return torch.stack([sum(loss_weight(mask[r * per + s:r * per + s + local_mini], aggregation).double()
                            for r in range(dp)) for s in range(0, per, local_mini)])


@dataclass
class RankBatch:
    """One trainer rank's DP share of a rollout batch, as tensors on its device: ``ids [b, T]``,
    ``mask`` and the rollout engine's per-token log-probs ``[b, T-1]``, the driver's
    per-sequence ``advantages`` or ``scores`` (``[b]``; whichever the estimator uses), and each
    mini-batch's weight over all ranks (``totals``)."""

    ids: torch.Tensor
    mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    totals: torch.Tensor
    local_mini: int
    micro: int
    advantages: torch.Tensor | None = None
    scores: torch.Tensor | None = None

    @classmethod
    def of(cls, batch: dict, dp: int, dp_rank: int, pad_id: int, cfg: Any, device: torch.device) -> "RankBatch":
        """Rank ``dp_rank``'s share of ``batch`` (``prompts``, ``responses``, ``rollout_logprobs``
        and ``advantages`` or ``scores``; the whole rollout batch) under the algorithm block ``cfg``."""
        B, mini = len(batch["prompts"]), cfg.train_batch_size
        if B % mini or mini % dp:
            raise ValueError(f"batch {B}, mini-batch {mini} and DP {dp} do not divide")
        per = B // dp
        lo, hi = dp_rank * per, (dp_rank + 1) * per
        prompts, responses = batch["prompts"][lo:hi], batch["responses"][lo:hi]
        ids, _, mask = (t.to(device) for t in pad_batch(prompts, responses, pad_id))
        rollout_lp = torch.zeros_like(mask)
        for b, lps in enumerate(batch["rollout_logprobs"][lo:hi]):
            p = len(prompts[b])
            rollout_lp[b, p - 1: p - 1 + len(lps)] = torch.tensor(lps, dtype=torch.float32)
        local_mini, micro = mini // dp, min(cfg.micro_batch_size, mini // dp)
        if local_mini % micro:
            raise ValueError(f"micro_batch_size {micro} does not divide the per-rank mini-batch {local_mini}")
        per_sequence = {k: torch.tensor(batch[k][lo:hi], dtype=torch.float32, device=device)
                        for k in ("advantages", "scores") if k in batch}
        totals = mini_batch_totals(batch["prompts"], batch["responses"], pad_id, dp, local_mini, cfg.loss_aggregation)
        return cls(ids, mask, rollout_lp, totals, local_mini, micro, **per_sequence)


@dataclass
class OldPolicy:
    """What the update compares against, computed before it (the log-probs phase): the trainer's
    log-probs of the generated tokens with the weights that generated them (``old``), the
    reference's (``ref``; None without a reference) and the critic's values (None without one),
    all ``[b, T-1]`` and zero off the mask."""

    old: torch.Tensor
    ref: torch.Tensor | None
    values: torch.Tensor | None


# --- the registered pieces ------------------------------------------------------------------------

class GroupAdvantages:
    """GRPO's estimator: each sample's score minus its group's mean, over the group's std + eps
    when ``norm_adv_by_std`` (``grpo_advantages``). Per sequence, in the driver."""

    needs_critic = False

    def sequence(self, scores: Sequence[float], cfg: Any) -> list[float]:
        return grpo_advantages(torch.tensor(scores), cfg.group_size, cfg.norm_adv_by_std, cfg.adv_eps).tolist()

    def tokens(self, batch: RankBatch, old: OldPolicy, cfg: Any, group: Any) -> tuple[torch.Tensor, None]:
        return batch.advantages[:, None] * batch.mask, None


class GaeAdvantages:
    """PPO's estimator: per-token rewards (the score on the last token, ``-kl_coef·KL`` on each),
    GAE on the critic's values, whitened over the critic's DP group (``ppo_batch``). Per token, on
    each trainer rank; returns the advantages and the critic's targets."""

    needs_critic = True

    def sequence(self, scores: Sequence[float], cfg: Any) -> None:
        return None

    def tokens(self, batch: RankBatch, old: OldPolicy, cfg: Any, group: Any) -> tuple[torch.Tensor, torch.Tensor]:
        out = ppo_batch(old.old, old.ref, old.values, batch.scores, batch.mask, kl_coef=cfg.kl_coef,
                        kl_estimator=cfg.kl_estimator, gamma=cfg.gamma, lam=cfg.lam, whiten=cfg.whiten_advantages,
                        group=group)
        return out["advantages"], out["returns"]


def ppo_clip_loss(lp: torch.Tensor, old_lp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, cfg: Any):
    """PPO-clip (``policy_loss``), ``clip_eps_high`` for DAPO's clip-higher."""
    return policy_loss(lp, old_lp, adv, mask, clip_eps=cfg.clip_eps, clip_eps_high=cfg.clip_eps_high,
                       aggregation=cfg.loss_aggregation)


ESTIMATORS: dict[str, Callable[[], Any]] = {"group": GroupAdvantages, "gae": GaeAdvantages}
POLICY_LOSSES: dict[str, Callable] = {"ppo_clip": ppo_clip_loss}
# algorithm.name -> (advantage estimator, policy loss, KL to the reference in the loss)
ALGORITHMS: dict[str, tuple[str, str, bool]] = {"grpo": ("group", "ppo_clip", True),
                                                "ppo": ("gae", "ppo_clip", False)}


# --- the algorithm --------------------------------------------------------------------------------

class Algorithm:
    """The run's algorithm, from its config block (``rl.config``'s ``algorithm``)."""

    def __init__(self, cfg: Any):
        if cfg.name not in ALGORITHMS:
            raise ValueError(f"unknown algorithm {cfg.name!r}; known: {', '.join(ALGORITHMS)}")
        estimator, loss, kl_in_loss = ALGORITHMS[cfg.name]
        self.cfg, self.name = cfg, cfg.name
        self.estimator = ESTIMATORS[estimator]()
        self.policy_loss = POLICY_LOSSES[loss]
        self.kl_in_loss = kl_in_loss
        self.needs_critic = self.estimator.needs_critic

    # the driver ------------------------------------------------------------------------------------
    def sequence_advantages(self, scores: Sequence[float]) -> list[float] | None:
        """One advantage per sample of the rollout batch (its ``group_size`` samples of each prompt
        in a row), or None where the estimator works per token on the trainer ranks (``gae``)."""
        return self.estimator.sequence(scores, self.cfg)

    def batch_fields(self, scores: Sequence[float]) -> dict:
        """What the update needs of the rewards, as the batch sent to the trainer ranks carries it:
        ``advantages`` (per sequence) or, for a per-token estimator, the ``scores``."""
        adv = self.sequence_advantages(scores)
        return {"scores": list(scores)} if adv is None else {"advantages": adv}

    # each trainer rank -----------------------------------------------------------------------------
    def update(self, actor: Any, critic: Any, batch: RankBatch, old: OldPolicy) -> dict:
        """``epochs`` passes over this rank's share in mini-batches, one optimizer step of
        ``actor`` (a training engine: ``train_step``) each — and of ``critic`` (``update``) after
        it where the estimator uses one. Collective over the actor's (and critic's) DP group.
        Returns the mean stats and the counts the run log records."""
        cfg = self.cfg
        with_critic = self.needs_critic
        if with_critic and (critic is None or old.values is None):
            raise ValueError(f"{self.name} needs a critic's values")
        adv, returns = self.estimator.tokens(batch, old, cfg, critic.dp_group if with_critic else None)
        ref = old.ref if old.ref is not None else old.old
        kl_in_loss = self.kl_in_loss and cfg.kl_coef > 0 and old.ref is not None
        stats: dict[str, list[float]] = {"policy_loss": [], "kl": [], "clipfrac": [], "grad_norm": [],
                                         "vf_loss": [], "vf_clipfrac": []}
        starts = range(0, batch.ids.shape[0], batch.local_mini)
        for _ in range(cfg.epochs):
            for start, total in zip(starts, batch.totals.tolist()):
                m = slice(start, start + batch.local_mini)
                scale = actor.dp / max(total, 1.0)

                def loss_fn(lp, s, m=m, scale=scale):
                    rows = slice(m.start + s.start, m.start + s.stop)
                    mask = batch.mask[rows]
                    pl, st = self.policy_loss(lp, old.old[rows], adv[rows], mask, cfg)
                    kl_mean = aggregate(kl_penalty(lp, ref[rows], cfg.kl_estimator), mask, cfg.loss_aggregation)
                    loss = pl + cfg.kl_coef * kl_mean if kl_in_loss else pl
                    return loss * (loss_weight(mask, cfg.loss_aggregation) * scale), {
                        "policy_loss": float(pl.detach()), "kl": float(kl_mean.detach()),
                        "clipfrac": float(st["clipfrac"])}

                step = actor.train_step(batch.ids[m], batch.micro, loss_fn)
                for st in step["stats"]:
                    for k, v in st.items():
                        stats[k].append(v)
                if step["grad_norm"] == step["grad_norm"]:
                    stats["grad_norm"].append(step["grad_norm"])
                if with_critic:
                    vs = critic.update(batch.ids[m], batch.mask[m], returns[m], old.values[m],
                                       clip_eps=cfg.value_clip_eps, micro_batch=batch.micro,
                                       aggregation=cfg.loss_aggregation)
                    stats["vf_loss"].append(vs["vf_loss"])
                    stats["vf_clipfrac"].append(vs["vf_clipfrac"])
        out = {k: (sum(v) / len(v) if v else float("nan")) for k, v in stats.items()
               if v or k not in ("vf_loss", "vf_clipfrac")}
        if with_critic:
            out.update(value_mean=float(masked_mean(old.values, batch.mask)),
                       return_mean=float(masked_mean(returns, batch.mask)))
        out.update(tokens=int(batch.mask.sum()),
                   old_vs_ref_kl=float(masked_mean(kl_penalty(old.old, ref, "k3"), batch.mask))
                   if batch.mask.any() else 0.0)
        return out
