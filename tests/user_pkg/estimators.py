"""A user's advantage estimator, one file outside the package (docs/algorithms.md, "Your own
algorithm"): each token's advantage is the sequence's score minus ``baseline_scale`` times the
critic's value there; the critic learns the score."""
from __future__ import annotations

from pydantic import Field

from rlhf_switch.rl.estimators import Estimator


class CriticBaseline(Estimator):
    critic = True
    fields = {"baseline_scale": (float, Field(1.0, gt=0))}

    def tokens(self, batch, old, cfg, actor, critic):
        adv = (batch.scores[:, None] - cfg.baseline_scale * old.values) * batch.mask
        return adv, batch.scores[:, None] * batch.mask
