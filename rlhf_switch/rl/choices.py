"""The names a config chooses among for the RL maths, in one place and without torch (loading a
config must not import it): ``rl/config.py`` types its fields with them, ``rl/algorithms.py`` and
``rl/algorithm.py`` implement each and refuse any other."""
from __future__ import annotations

from typing import Literal, get_args

# how a per-token loss becomes one number (rl/algorithms.py: aggregate)
Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
# Schulman's estimators of KL(π ‖ π_ref) from samples of π (rl/algorithms.py: kl_penalty)
KLEstimator = Literal["k1", "k2", "k3"]

AGGREGATIONS: tuple[str, ...] = get_args(Aggregation)
KL_ESTIMATORS: tuple[str, ...] = get_args(KLEstimator)

# the advantage estimators (rl/algorithm.py: ESTIMATORS) and what each needs: groups of samples of
# one prompt (group_size >= 2), a critic, the KL to the reference as a per-token reward
# (instead of a term of the loss)
ESTIMATOR_NEEDS: dict[str, dict[str, bool]] = {
    "group": {"groups": True, "critic": False, "kl_in_reward": False},
    "rloo": {"groups": True, "critic": False, "kl_in_reward": False},
    "group_whitened": {"groups": True, "critic": False, "kl_in_reward": False},
    "reinforce_pp": {"groups": False, "critic": False, "kl_in_reward": True},
    "gae": {"groups": False, "critic": True, "kl_in_reward": True},
}
POLICY_LOSSES: tuple[str, ...] = ("ppo_clip", "gspo", "cispo")

# algorithm.name -> (advantage estimator, policy loss); PPO's own block is the one with a critic
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

# each algorithm's defaults where they differ from the block's (rl/config.py), from its paper
ALGORITHM_DEFAULTS: dict[str, dict] = {
    # Dr. GRPO (Liu et al. 2025): no std normalisation, no per-response length normalisation, no KL
    "dr_grpo": {"norm_adv_by_std": False, "loss_aggregation": "seq-mean-token-sum-norm", "kl_coef": 0.0},
    # DAPO (Yu et al. 2025): clip-higher, token-mean, no KL, dynamic sampling, soft overlong punishment
    "dapo": {"clip_eps": 0.2, "clip_eps_high": 0.28, "loss_aggregation": "token-mean", "kl_coef": 0.0,
             "dynamic_sampling": {}, "overlong": {}},
    # REINFORCE++ (Hu 2025): the KL as a per-token reward (k1), returns whitened over the batch
    "reinforce_pp": {"kl_estimator": "k1"},
    # REINFORCE++-baseline (OpenRLHF): the group mean as baseline, KL in the loss with k2
    "reinforce_pp_baseline": {"kl_estimator": "k2"},
    # GSPO (Zheng et al. 2025): a sequence-level ratio, a tiny clip range, per-sequence means, no KL
    "gspo": {"clip_eps": 3e-4, "clip_eps_high": 4e-4, "loss_aggregation": "seq-mean-token-mean", "kl_coef": 0.0},
    # CISPO (MiniMax-M1, 2025): the importance weight clipped above only, no KL
    "cispo": {"clip_eps": 1.0, "clip_eps_high": 0.28, "kl_coef": 0.0},
}
CRITIC_FREE: tuple[str, ...] = tuple(n for n, (est, _) in ALGORITHMS.items() if not ESTIMATOR_NEEDS[est]["critic"])
