"""A run's RL algorithm as one object: how scores become advantages, the policy loss, where the
KL to the reference goes, and how each mini-batch's loss is weighed. The driver asks it for a
rollout batch's per-sequence advantages (``sequence_advantages``); every trainer rank runs its
update with it (``update``). The formulas are ``rl/algorithms.py``'s; this module only assembles
them, so a new algorithm is a new combination of registered pieces, not a new update loop.

Two registered pieces make an algorithm (``rl.choices.ALGORITHMS``):

- an advantage estimator (``rl.estimators``: one class each, declaring what it needs — groups, a
  critic, a reference — and the config fields it reads); ``group`` — a sample's score against its
  group's, per sequence, in the driver, which holds every group; ``gae`` — the critic's values,
  per-token rewards with the KL penalty and GAE, on each trainer rank;
- a policy loss (``POLICY_LOSSES``): ``ppo_clip`` (PPO-clip with clip-higher and dual clip),
  ``gspo``, ``cispo``, each aggregated by ``loss_aggregation``.

The KL to the reference is either a term of the loss (``kl_in_loss``: GRPO) or in the estimator's
rewards (its ``kl_in_reward``: PPO, RLOO, REINFORCE++).

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

from .algorithms import (aggregate, cispo_loss, gspo_loss, kl_penalty, masked_mean, masked_sum, off_policy_weights,
                         overlong_penalty, policy_loss)
from .choices import ALGORITHMS, Aggregation
from .choices import POLICY_LOSSES as LOSS_NAMES
from .estimators import estimator_class
from .imports import import_named


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


def per_token(prompts: Sequence[Sequence[int]], values: Sequence[Sequence[Any]], like: torch.Tensor,
              dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Per-response-token ``values`` (one list per sequence) on the ``[B, T-1]`` grid of
    ``pad_batch``'s mask (``like``): sequence ``b``'s token ``t`` at column ``len(prompt)-1+t``, 0
    elsewhere."""
    out = torch.zeros(like.shape, dtype=dtype, device=like.device)
    for b, vals in enumerate(values):
        p = len(prompts[b])
        out[b, p - 1: p - 1 + len(vals)] = torch.tensor(list(vals), dtype=dtype)
    return out


def mini_batch_totals(prompts: Sequence, responses: Sequence, pad_id: int, dp: int, local_mini: int,
                      aggregation: Aggregation, keep: Sequence[float] | None = None,
                      loss_mask: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
    """Each mini-batch's weight over all ``dp`` ranks (``loss_weight`` of every rank's rows of it,
    summed in float64), from the whole batch every rank is given: the integer counts an
    all-reduce of each rank's own totals would sum — exact in any order — without the collective.
    Rank ``r`` holds rows ``[r·per, (r+1)·per)``. ``loss_mask``: per response token, 0 where the
    loss does not count it (an environment's tokens); ``keep``: per sequence."""
    mask = pad_batch(prompts, responses, pad_id)[2]  # a row's mask does not depend on the padding
    if loss_mask is not None:
        mask = mask * per_token(prompts, loss_mask, mask)
    if keep is not None:
        mask = mask * torch.tensor(keep, dtype=torch.float32)[:, None]
    per = len(prompts) // dp
    return torch.stack([sum(loss_weight(mask[r * per + s:r * per + s + local_mini], aggregation).double()
                            for r in range(dp)) for s in range(0, per, local_mini)])


@dataclass
class RankBatch:
    """One trainer rank's DP share of a rollout batch, as tensors on its device: ``ids [b, T]``,
    the masks and the rollout engine's per-token log-probs ``[b, T-1]``, the driver's
    per-sequence ``advantages`` or ``scores`` (``[b]``; whichever the estimator uses), and each
    mini-batch's weight over all ranks (``totals``). The batch's ``keep`` (per sequence, 0 or 1:
    overlong filtering) takes a sequence out of the loss, not out of the stale-weights check."""

    ids: torch.Tensor
    mask: torch.Tensor                # the tokens the loss counts: the model's in the response, less any masked sequence
    rollout_logprobs: torch.Tensor
    totals: torch.Tensor
    local_mini: int
    micro: int
    response_mask: torch.Tensor | None = None  # every token the model generated
    advantages: torch.Tensor | None = None
    scores: torch.Tensor | None = None
    fresh: torch.Tensor | None = None  # [b, T] bool: tokens generated with the trainer's own weights (None: all)

    def __post_init__(self):
        if self.response_mask is None:
            self.response_mask = self.mask

    @classmethod
    def of(cls, batch: dict, dp: int, dp_rank: int, pad_id: int, cfg: Any, device: torch.device) -> "RankBatch":
        """Rank ``dp_rank``'s share of ``batch`` (``rl.experience.Experience.rank_batch``: ``prompts``,
        ``responses``, ``rollout_logprobs``, optionally ``loss_mask`` and ``fresh`` per token, and
        ``advantages`` or ``scores``; the whole rollout batch) under the algorithm block ``cfg``."""
        B, mini = len(batch["prompts"]), cfg.train_batch_size
        if B % mini or mini % dp:
            raise ValueError(f"batch {B}, mini-batch {mini} and DP {dp} do not divide")
        per = B // dp
        lo, hi = dp_rank * per, (dp_rank + 1) * per
        prompts, responses = batch["prompts"][lo:hi], batch["responses"][lo:hi]
        ids, _, mask = (t.to(device) for t in pad_batch(prompts, responses, pad_id))
        rollout_lp = per_token(prompts, batch["rollout_logprobs"][lo:hi], mask)
        if "loss_mask" in batch:  # the model's tokens only: an environment's are neither trained nor checked
            mask = mask * per_token(prompts, batch["loss_mask"][lo:hi], mask)
        local_mini, micro = mini // dp, min(cfg.micro_batch_size, mini // dp)
        if local_mini % micro:
            raise ValueError(f"micro_batch_size {micro} does not divide the per-rank mini-batch {local_mini}")
        per_sequence = {k: torch.tensor(batch[k][lo:hi], dtype=torch.float32, device=device)
                        for k in ("advantages", "scores") if k in batch}
        keep = batch.get("keep")
        totals = mini_batch_totals(batch["prompts"], batch["responses"], pad_id, dp, local_mini, cfg.loss_aggregation,
                                   keep, batch.get("loss_mask"))
        loss_mask = mask if keep is None else mask * torch.tensor(keep[lo:hi], dtype=torch.float32, device=device)[:, None]
        fresh = None
        if "fresh" in batch:  # per sample (one bool) or per generated token (a list)
            fresh = per_token(prompts, [f if isinstance(f, (list, tuple)) else [f] * len(r)
                                        for f, r in zip(batch["fresh"][lo:hi], responses)], mask, torch.bool)
        return cls(ids, loss_mask, rollout_lp, totals, local_mini, micro, response_mask=mask, fresh=fresh,
                   **per_sequence)

    @property
    def checked_mask(self) -> torch.Tensor:
        """The tokens the stale-weights check compares: every generated token of the samples made
        with the trainer's own weights (a stale sample's log-probs are another version's)."""
        return self.response_mask if self.fresh is None else self.response_mask * self.fresh


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
# An estimator (``rl.estimators``: registered classes declaring what they need and read) turns scores
# into advantages. A policy loss: ``(lp, old_lp, advantages, mask, cfg) -> (loss, stats)``, with
# ``stats["clipfrac"]``; a user's own is ``algorithm.policy_loss: module:function``.

def ppo_clip_loss(lp: torch.Tensor, old_lp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, cfg: Any):
    """PPO-clip (``policy_loss``); ``clip_eps_high`` for DAPO's clip-higher, ``dual_clip``."""
    return policy_loss(lp, old_lp, adv, mask, clip_eps=cfg.clip_eps, clip_eps_high=cfg.clip_eps_high,
                       aggregation=cfg.loss_aggregation, norm_len=cfg.max_new_tokens, dual_clip=cfg.dual_clip)


def gspo_policy_loss(lp: torch.Tensor, old_lp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, cfg: Any):
    """GSPO's sequence-level ratio (``gspo_loss``), aggregated as the config says."""
    return gspo_loss(lp, old_lp, adv, mask, clip_eps=cfg.clip_eps, clip_eps_high=cfg.clip_eps_high,
                     aggregation=cfg.loss_aggregation, norm_len=cfg.max_new_tokens)


def cispo_policy_loss(lp: torch.Tensor, old_lp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, cfg: Any):
    """CISPO's clipped, stop-gradient importance weight (``cispo_loss``)."""
    return cispo_loss(lp, old_lp, adv, mask, clip_eps=cfg.clip_eps, clip_eps_high=cfg.clip_eps_high,
                      aggregation=cfg.loss_aggregation, norm_len=cfg.max_new_tokens)


POLICY_LOSSES: dict[str, Callable] = {"ppo_clip": ppo_clip_loss, "gspo": gspo_policy_loss, "cispo": cispo_policy_loss}
assert set(POLICY_LOSSES) == set(LOSS_NAMES)


# --- the algorithm --------------------------------------------------------------------------------

class Algorithm:
    """The run's algorithm, from its config block (``rl.config``'s ``algorithm``): the estimator
    and the policy loss ``rl.choices.ALGORITHMS`` names for it, or the block's ``advantage`` /
    ``policy_loss``. A user's own algorithm (``name: module:Class``) subclasses this and may
    override any method; ``Algorithm.build(cfg)`` makes whichever the block names."""

    estimator_name, loss_name = "group", "ppo_clip"  # a user's subclass starts from GRPO's pieces

    def __init__(self, cfg: Any):
        self.cfg, self.name = cfg, cfg.name
        estimator, loss = ALGORITHMS.get(cfg.name, (self.estimator_name, self.loss_name))
        estimator = getattr(cfg, "advantage", None) or estimator
        loss = getattr(cfg, "policy_loss", None) or loss
        self.estimator = estimator_class(estimator)()
        self.policy_loss = POLICY_LOSSES[loss] if loss in POLICY_LOSSES else import_named(loss, "algorithm.policy_loss")
        self.needs_critic = self.estimator.critic
        # the KL to the reference: a per-token reward of the estimator's, or a term of the loss
        self.kl_in_loss = not self.estimator.kl_in_reward

    @staticmethod
    def build(cfg: Any) -> "Algorithm":
        """The algorithm ``cfg.name`` names: a built-in, or a user's ``module:Class``."""
        if cfg.name in ALGORITHMS:
            return Algorithm(cfg)
        cls = import_named(cfg.name, "algorithm.name")
        if not (isinstance(cls, type) and issubclass(cls, Algorithm)):
            raise ValueError(f"algorithm.name {cfg.name!r} is not a subclass of rlhf_switch.rl.algorithm.Algorithm")
        return cls(cfg)

    # the driver ------------------------------------------------------------------------------------
    def sequence_advantages(self, scores: Sequence[float]) -> list[float] | None:
        """One advantage per sample of the rollout batch (its ``group_size`` samples of each prompt
        in a row), or None where the estimator works per token on the trainer ranks."""
        return self.estimator.sequence(scores, self.cfg)

    def batch_fields(self, scores: Sequence[float], truncated: Sequence[bool] = ()) -> dict:
        """What the update needs of the rewards, as the batch sent to the trainer ranks carries it:
        ``advantages`` (per sequence, from the driver's estimator) or the ``scores``; with
        ``overlong.mask_truncated``, ``keep`` — 0 for a response cut at the length limit."""
        adv = self.sequence_advantages(scores)
        out = {"scores": list(scores)} if adv is None else {"advantages": adv}
        overlong = getattr(self.cfg, "overlong", None)
        if overlong is not None and overlong.mask_truncated:
            out["keep"] = [0.0 if t else 1.0 for t in truncated]
        return out

    def truncated(self, responses: Sequence[Sequence[int]], eos_id: int | None) -> list[bool]:
        """Which responses the length limit cut (``max_new_tokens`` tokens, the last not the end token)."""
        limit = self.cfg.max_new_tokens
        return [len(r) >= limit and (not r or r[-1] != eos_id) for r in responses]

    def shape_scores(self, scores: Sequence[float], responses: Sequence[Sequence[int]]) -> list[float]:
        """The rewards as the estimator sees them: with ``overlong``, DAPO's soft punishment of the
        responses in the last ``buffer_len`` tokens before the limit added."""
        overlong = getattr(self.cfg, "overlong", None)
        if overlong is None or not overlong.penalty:
            return list(scores)
        lengths = torch.tensor([len(r) for r in responses])
        penalty = overlong_penalty(lengths, self.cfg.max_new_tokens, overlong.buffer_len, overlong.penalty)
        return [float(s) + float(p) for s, p in zip(scores, penalty)]

    def correct_off_policy(self, adv: torch.Tensor, batch: RankBatch, old: OldPolicy) -> tuple[torch.Tensor, dict]:
        """``off_policy.correction``: each token's advantage times its importance weight
        (``off_policy_weights``: the trainer's probability over the rollout engine's, truncated or
        masked, per token or per sequence) — the same as weighing its loss, which every registered
        loss is linear in for a non-negative weight. ``correct: all`` weighs every token (the
        rollout engine's mismatch with the trainer is corrected on fresh samples too); ``stale``
        only those generated with older weights than the trainer's (the rest keep weight 1)."""
        op = getattr(self.cfg, "off_policy", None)
        if op is None or op.correction in (None, "none"):
            return adv, {}
        w = off_policy_weights(old.old, batch.rollout_logprobs, batch.mask, op.correction, cap=op.cap, low=op.low,
                               high=op.high)
        if op.correct == "stale" and batch.fresh is not None:
            w = torch.where(batch.fresh, torch.ones_like(w), w)
        return adv * w, {"is_weight_sum": float(masked_sum(w, batch.mask)),
                         "is_masked_tokens": int(((w == 0) & batch.mask.bool()).sum())}

    def has_signal(self, group: Sequence[float], raw: Sequence[float] | None = None) -> bool:
        """A group whose samples did not all get the same reward (dynamic sampling keeps it):
        compared on the reward before shaping (``raw``; DAPO's accuracy) unless
        ``dynamic_sampling.filter_on: shaped`` (``group``, the shaped rewards)."""
        ds = getattr(self.cfg, "dynamic_sampling", None)
        seen = group if raw is None or (ds is not None and ds.filter_on == "shaped") else raw
        return len(set(seen)) > 1

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
        adv, returns = self.estimator.tokens(batch, old, cfg, actor, critic)
        adv, is_stats = self.correct_off_policy(adv, batch, old)
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
                    kl_mean = aggregate(kl_penalty(lp, ref[rows], cfg.kl_estimator, cfg.kl_clamp), mask,
                                        cfg.loss_aggregation, cfg.max_new_tokens)
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
        out.update(is_stats)
        out.update(tokens=int(batch.mask.sum()), dp_rank=int(getattr(actor, "dp_rank", 0)),
                   old_vs_ref_kl=float(masked_mean(kl_penalty(old.old, ref, "k3"), batch.mask))
                   if batch.mask.any() else 0.0)
        return out
