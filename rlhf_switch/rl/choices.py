"""The names a config chooses among for the RL maths, in one place and without torch (loading a
config must not import it): ``rl/config.py`` types its fields with them, ``rl/algorithms.py`` and
``rl/algorithm.py`` implement each and refuse any other."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal, Mapping, get_args

# how a per-token loss becomes one number (rl/algorithms.py: aggregate)
Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
# Schulman's estimators of KL(π ‖ π_ref) from samples of π (rl/algorithms.py: kl_penalty)
KLEstimator = Literal["k1", "k2", "k3"]

AGGREGATIONS: tuple[str, ...] = get_args(Aggregation)
KL_ESTIMATORS: tuple[str, ...] = get_args(KLEstimator)

POLICY_LOSSES: tuple[str, ...] = ("ppo_clip", "gspo", "cispo")

# algorithm.name -> (advantage estimator, policy loss); what each estimator needs and reads is its
# class's declaration (rl/estimators.py)
ALGORITHMS: dict[str, tuple[str, str]] = {
    "grpo": ("group", "ppo_clip"),
    "dr_grpo": ("group", "ppo_clip"),
    "dapo": ("group", "ppo_clip"),
    "rloo": ("rloo", "ppo_clip"),
    "reinforce_pp": ("reinforce_pp", "ppo_clip"),
    "reinforce_pp_baseline": ("group_whitened", "ppo_clip"),
    "gspo": ("group", "gspo"),
    "cispo": ("group", "cispo"),
    "ppo": ("gae", "ppo_clip"),
}

# each algorithm's defaults where they differ from the block's (rl/config.py), from its paper.
# The rule (docs/algorithms.md): a field the config does not give takes the algorithm's value here;
# a field the config gives is used as given — and refused when it leaves the algorithm's paper
# (PAPER_RULES), unless the config lists it in ``algorithm.off_paper`` (then a warning at start).
ALGORITHM_DEFAULTS: dict[str, dict] = {
    # Dr. GRPO (Liu et al. 2025): no std normalisation, no per-response length normalisation, no KL
    "dr_grpo": {"norm_adv_by_std": False, "loss_aggregation": "seq-mean-token-sum-norm", "kl_coef": 0.0},
    # DAPO (Yu et al. 2025): clip-higher, token-mean, no KL, dynamic sampling, soft overlong punishment
    "dapo": {"clip_eps": 0.2, "clip_eps_high": 0.28, "loss_aggregation": "token-mean", "kl_coef": 0.0,
             "dynamic_sampling": {}, "overlong": {}},
    # RLOO (Ahmadian et al. 2024; verl's recipe): the KL as a per-sequence reward (k1), the
    # leave-one-out baseline over the KL-shaped rewards
    "rloo": {"kl_estimator": "k1"},
    # REINFORCE++ (Hu 2025): the KL as a per-token reward (k1), returns whitened over the batch
    "reinforce_pp": {"kl_estimator": "k1"},
    # REINFORCE++-baseline (OpenRLHF): the group mean as baseline, KL in the loss with k2
    "reinforce_pp_baseline": {"kl_estimator": "k2"},
    # GSPO (Zheng et al. 2025): a sequence-level ratio, a tiny clip range, per-sequence means, no KL
    "gspo": {"clip_eps": 3e-4, "clip_eps_high": 4e-4, "loss_aggregation": "seq-mean-token-mean", "kl_coef": 0.0},
    # CISPO (MiniMax-M1, 2025): the importance weight clipped above only, token-mean, no KL
    "cispo": {"clip_eps": 1.0, "clip_eps_high": 0.28, "loss_aggregation": "token-mean", "kl_coef": 0.0},
    # PPO (Schulman et al. 2017; InstructGPT's KL): one sample per prompt, the KL as a per-token reward (k1)
    "ppo": {"group_size": 1, "kl_coef": 0.05, "kl_estimator": "k1"},
}


@dataclass(frozen=True)
class PaperRule:
    """What an algorithm's paper fixes about one field: ``holds(block)`` on the block's values (a
    mapping of field -> value), and ``paper`` — the paper's setting, as the refusal says it."""

    field: str
    holds: Callable[[Mapping[str, Any]], bool]
    paper: str


def _equals(field: str, value: Any) -> PaperRule:
    return PaperRule(field, lambda b: b.get(field) == value, repr(value))


def _at_most(field: str, bound: float, paper: str) -> PaperRule:
    return PaperRule(field, lambda b: b.get(field) is not None and b[field] <= bound, paper)


# the settings that make each algorithm that algorithm (its paper's): a config value outside them
# is refused unless named in ``algorithm.off_paper``
PAPER_RULES: dict[str, tuple[PaperRule, ...]] = {
    "dr_grpo": (_equals("norm_adv_by_std", False), _equals("loss_aggregation", "seq-mean-token-sum-norm"),
                _equals("kl_coef", 0.0)),
    "dapo": (PaperRule("clip_eps_high", lambda b: (b.get("clip_eps_high") or 0.0) > b.get("clip_eps", 0.0),
                       "a clip_eps_high above clip_eps (clip-higher: 0.28 over 0.2)"),
             _equals("loss_aggregation", "token-mean"), _equals("kl_coef", 0.0),
             PaperRule("dynamic_sampling", lambda b: b.get("dynamic_sampling") is not None, "it on"),
             PaperRule("overlong", lambda b: b.get("overlong") is not None, "it on")),
    "rloo": (_equals("kl_estimator", "k1"),),
    "reinforce_pp": (_equals("kl_estimator", "k1"),),
    "gspo": (_at_most("clip_eps", 1e-3, "3e-4 (a sequence ratio's range, at most 1e-3)"),
             _at_most("clip_eps_high", 1e-3, "4e-4 (at most 1e-3)"),
             _equals("loss_aggregation", "seq-mean-token-mean"), _equals("kl_coef", 0.0)),
    "cispo": (_equals("clip_eps", 1.0), _equals("loss_aggregation", "token-mean"), _equals("kl_coef", 0.0)),
}


def off_paper(name: str, block: Mapping[str, Any]) -> list[tuple[PaperRule, Any]]:
    """The rules of algorithm ``name``'s paper that ``block`` (its fields' values) breaks, each
    with the value the block holds."""
    return [(rule, block.get(rule.field)) for rule in PAPER_RULES.get(name, ()) if not rule.holds(block)]




def shown(value: Any) -> str:
    """A config value as the user wrote it (a block as its fields, None as null)."""
    if value is None:
        return "null"
    if hasattr(value, "model_dump"):
        return str(value.model_dump())
    return repr(value) if isinstance(value, str) else str(value)
