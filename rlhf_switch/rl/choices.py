"""The names a config chooses among for the RL maths, in one place and without torch (loading a
config must not import it): ``rl/config.py`` types its fields with them, ``rl/algorithms.py``
implements each and refuses any other."""
from __future__ import annotations

from typing import Literal, get_args

# how a per-token loss becomes one number (rl/algorithms.py: aggregate)
Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
# Schulman's estimators of KL(π ‖ π_ref) from samples of π (rl/algorithms.py: kl_penalty)
KLEstimator = Literal["k1", "k2", "k3"]

AGGREGATIONS: tuple[str, ...] = get_args(Aggregation)
KL_ESTIMATORS: tuple[str, ...] = get_args(KLEstimator)
