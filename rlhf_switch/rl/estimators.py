"""Advantage estimators: one class each, registered once, declaring what it needs and reads.

An estimator turns a rollout batch's scores into advantages. It declares, as class attributes the
config reads without running it (nothing here imports torch at module level):

- ``name``: what ``algorithm.advantage`` (or an algorithm's ``rl.choices.ALGORITHMS`` entry)
  calls it;
- ``groups``: it compares the samples of one prompt with each other (``group_size >= 2``;
  dynamic sampling works on such groups);
- ``critic``: it needs a critic's values (the run builds a critic; the block's critic fields,
  ``CRITIC_FIELDS``, are read);
- ``reference``: it needs the reference's log-probs even where ``kl_coef`` is 0;
- ``kl_in_reward``: the KL to the reference goes into its rewards (else into the loss);
- ``fields``: the ``algorithm`` block's fields it reads, ``name -> (type, pydantic Field with its
  default and range)``. The block's schema is built from every registered estimator's fields
  (``rl.config.AlgorithmConfig``), and a field given in a config that the chosen estimator does
  not read is refused.

Two methods compute: ``sequence(scores, cfg)`` in the driver — one advantage per sample of the
rollout batch, or None where the estimator works on the trainer ranks — and ``tokens(batch, old,
cfg, actor, critic)`` on each trainer rank — ``(advantages [b, T-1], the critic's targets or
None)`` from this rank's share (``rl.algorithm.RankBatch``), the old/reference log-probs and values
(``OldPolicy``), the actor and critic engines (``dp``, ``dp_rank``, ``dp_group`` for the
collectives). The formulas are ``rl/algorithms.py``'s.

A user's estimator is a subclass of ``Estimator`` in their own module, named as
``algorithm.advantage: my_pkg.module:MyEstimator``; its ``fields`` may add fields of its own.
"""
from __future__ import annotations

from typing import Any, ClassVar, Mapping, Sequence

from pydantic import Field

from .choices import ALGORITHMS

# what a critic's training reads, for every estimator that declares ``critic``
CRITIC_FIELDS: Mapping[str, tuple[Any, Any]] = {
    "critic_lr": (float, Field(1e-5, gt=0)),
    "value_clip_eps": (float | None, Field(0.2, gt=0)),
}

ESTIMATORS: dict[str, type["Estimator"]] = {}


def register_estimator(cls: type["Estimator"]) -> type["Estimator"]:
    """Register ``cls`` under its ``name`` (a decorator)."""
    if not cls.name or cls.name in ESTIMATORS:
        raise ValueError(f"an estimator needs a name of its own: {cls.__name__} has {cls.name!r}")
    ESTIMATORS[cls.name] = cls
    return cls


class Estimator:
    """The base of every estimator (module docstring: what a subclass declares and computes)."""

    name: ClassVar[str] = ""
    groups: ClassVar[bool] = False
    critic: ClassVar[bool] = False
    reference: ClassVar[bool] = False
    kl_in_reward: ClassVar[bool] = False
    fields: ClassVar[Mapping[str, tuple[Any, Any]]] = {}

    @classmethod
    def fields_read(cls) -> dict[str, tuple[Any, Any]]:
        """Every ``algorithm`` field it reads: its own, and the critic's where it has one."""
        return {**cls.fields, **(CRITIC_FIELDS if cls.critic else {})}

    def sequence(self, scores: Sequence[float], cfg: Any) -> list[float] | None:
        return None

    def tokens(self, batch, old, cfg: Any, actor: Any, critic: Any):
        raise NotImplementedError(f"{type(self).__name__}.tokens")


def estimator_class(name: str) -> type[Estimator]:
    """The estimator ``name`` names: a registered one, or a user's ``module:Class`` (a subclass of
    ``Estimator``); ``ValueError`` saying why not."""
    if name in ESTIMATORS:
        return ESTIMATORS[name]
    if ":" not in name:
        raise ValueError(f"unknown advantage estimator {name!r} (known: {', '.join(ESTIMATORS)}; or your own as "
                         f"'module:Class')")
    from .imports import import_named

    cls = import_named(name, "algorithm.advantage")
    if not (isinstance(cls, type) and issubclass(cls, Estimator)):
        raise ValueError(f"algorithm.advantage {name!r} is not a subclass of rlhf_switch.rl.estimators.Estimator")
    return cls


def all_fields() -> dict[str, tuple[Any, Any]]:
    """The fields every registered estimator reads, together (one declaration per name: two
    estimators that read a field declare it alike)."""
    out: dict[str, tuple[Any, Any]] = {}
    for cls in ESTIMATORS.values():
        for field, decl in cls.fields_read().items():
            if field in out and repr(out[field]) != repr(decl):
                raise ValueError(f"estimators declare algorithm.{field} differently: {out[field]} and {decl}")
            out[field] = decl
    return out


# --- the built-in estimators -----------------------------------------------------------------------

def _whiten_over_dp(values, mask, engine):
    """Whitened over the whole batch: every DP rank of ``engine`` holds a share of it."""
    from .algorithms import global_masked_whiten, masked_whiten

    return masked_whiten(values, mask) if engine.dp == 1 else global_masked_whiten(values, mask, group=engine.dp_group)


def _over_dp(values, engine):
    """``values [b]`` of every DP rank of ``engine``, in DP-rank order (``[dp·b]``: the whole
    batch, rank ``r``'s share at ``[r·b, (r+1)·b)``). Collective over its DP group."""
    if engine.dp == 1:
        return values
    import torch
    import torch.distributed as dist

    tagged = torch.cat([torch.tensor([float(engine.dp_rank)], dtype=torch.float64), values.double()])
    parts = [torch.empty_like(tagged) for _ in range(engine.dp)]
    dist.all_gather(parts, tagged, group=engine.dp_group)
    return torch.cat([p[1:] for p in sorted(parts, key=lambda p: int(p[0]))]).to(values.dtype)


GAMMA = (float, Field(1.0, ge=0, le=1))  # the discount, where an estimator uses returns


@register_estimator
class GroupAdvantages(Estimator):
    """GRPO's estimator: each sample's score minus its group's mean, over the group's std + eps
    when ``norm_adv_by_std`` (DeepSeekMath; Dr. GRPO drops the std). Per sequence, in the driver,
    which holds every group."""

    name, groups = "group", True
    fields = {"norm_adv_by_std": (bool, Field(True)), "adv_eps": (float, Field(1e-6, gt=0))}

    def sequence(self, scores: Sequence[float], cfg: Any) -> list[float]:
        import torch

        from .algorithms import grpo_advantages

        return grpo_advantages(torch.tensor(scores), cfg.group_size, cfg.norm_adv_by_std, cfg.adv_eps).tolist()

    def tokens(self, batch, old, cfg: Any, actor: Any, critic: Any):
        return batch.advantages[:, None] * batch.mask, None


@register_estimator
class RlooAdvantages(Estimator):
    """RLOO's estimator (Ahmadian et al. 2024; verl's recipe): each sample's reward — its score,
    less ``kl_coef·Σ_t KL_t`` (the KL to the reference as a reward, ``use_kl_in_reward``) — minus
    the mean of the other samples' rewards in its group. On the trainer ranks, which hold the
    log-probs: each rank's rewards gathered over DP first (a group may span two ranks' shares)."""

    name, groups, kl_in_reward = "rloo", True, True

    def tokens(self, batch, old, cfg: Any, actor: Any, critic: Any):
        from .algorithms import kl_penalty, masked_sum, rloo_advantages

        rewards = batch.scores.double()
        if old.ref is not None and cfg.kl_coef:
            kl = kl_penalty(old.old, old.ref, cfg.kl_estimator, cfg.kl_clamp)
            rewards = rewards - cfg.kl_coef * masked_sum(kl, batch.response_mask, dim=-1).double()
        every = rloo_advantages(_over_dp(rewards, actor), cfg.group_size)
        b = rewards.shape[0]
        mine = every[actor.dp_rank * b:(actor.dp_rank + 1) * b].float()
        return mine[:, None] * batch.mask, None


@register_estimator
class GroupWhitenedAdvantages(Estimator):
    """REINFORCE++-baseline's estimator (OpenRLHF; verl's ``reinforce_plus_plus_baseline``): the
    group's mean subtracted in the driver, then every token's value whitened over the whole batch
    on the trainer ranks (across DP)."""

    name, groups = "group_whitened", True

    def sequence(self, scores: Sequence[float], cfg: Any) -> list[float]:
        import torch

        from .algorithms import grpo_advantages

        return grpo_advantages(torch.tensor(scores), cfg.group_size, norm_by_std=False).tolist()

    def tokens(self, batch, old, cfg: Any, actor: Any, critic: Any):
        return _whiten_over_dp(batch.advantages[:, None] * batch.mask, batch.mask, actor) * batch.mask, None


@register_estimator
class ReinforcePlusPlusAdvantages(Estimator):
    """REINFORCE++'s estimator (Hu 2025): per-token rewards (the score on the last token, the KL
    penalty ``-kl_coef·KL`` on each), discounted returns (``gamma``), whitened over the whole
    batch across DP. No critic, no groups. On the trainer ranks."""

    name, kl_in_reward = "reinforce_pp", True
    fields = {"gamma": GAMMA}

    def tokens(self, batch, old, cfg: Any, actor: Any, critic: Any):
        import torch

        from .algorithms import discounted_returns, kl_penalty, token_rewards

        kl = (kl_penalty(old.old, old.ref, cfg.kl_estimator, cfg.kl_clamp) * batch.mask if old.ref is not None
              else torch.zeros_like(batch.mask))
        returns = discounted_returns(token_rewards(batch.scores, batch.mask, kl, cfg.kl_coef), batch.mask, cfg.gamma)
        return _whiten_over_dp(returns, batch.mask, actor) * batch.mask, returns


@register_estimator
class GaeAdvantages(Estimator):
    """PPO's estimator: per-token rewards (the score on the last token, ``-kl_coef·KL`` on each),
    GAE on the critic's values, whitened over the critic's DP group (``ppo_batch``). Per token, on
    each trainer rank; returns the advantages and the critic's targets."""

    name, critic, kl_in_reward = "gae", True, True
    fields = {"gamma": GAMMA, "lam": (float, Field(0.95, ge=0, le=1)), "whiten_advantages": (bool, Field(True))}

    def tokens(self, batch, old, cfg: Any, actor: Any, critic: Any):
        from .algorithms import ppo_batch

        out = ppo_batch(old.old, old.ref, old.values, batch.scores, batch.mask, kl_coef=cfg.kl_coef,
                        kl_estimator=cfg.kl_estimator, kl_clamp=cfg.kl_clamp, gamma=cfg.gamma, lam=cfg.lam,
                        whiten=cfg.whiten_advantages, group=critic.dp_group)
        return out["advantages"], out["returns"]


# the algorithms whose estimator needs no critic (rl.choices.ALGORITHMS)
CRITIC_FREE: tuple[str, ...] = tuple(n for n, (est, _) in ALGORITHMS.items() if not ESTIMATORS[est].critic)
