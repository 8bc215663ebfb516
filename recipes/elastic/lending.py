"""``elastic.lend``: the trainer's devices lent to the rollout. While the synchronous loop waits for
samples the trainer's devices are idle, so replicas on them (started with the others, fed by the
same weight channel at every sync) take a share of the rollout's prompts — every iteration
(``rollout``) or where that last made the rollout shorter (``auto``: ``rebalance.choose``, the
rollout phase measured each way). Not run on CUDA (a lent replica would need the trainer's memory
freed while it generates)."""
from __future__ import annotations

from recipes.elastic.rebalance import Ways


class Lending:
    """``elastic.lend``: the trainer's devices lent to the rollout — the cluster's replicas on
    them (``cluster.lent``, started with the others) take a share of the rollout's prompts in the
    iterations it lends them: every one (``rollout``) or where that last took less (``auto``:
    ``choose``, the rollout phase measured each way)."""

    def __init__(self, cluster, mode: str):
        self.cluster, self.mode = cluster, mode
        self.auto = Ways(("lent", "own"))  # the rollout phase, each way

    def lend(self, it: int) -> dict:
        """Whether iteration ``it``'s rollout takes the trainer's devices too; sets the cluster's
        ``lending`` and returns what the record says of it."""
        if self.mode == "auto":
            lend, why = self.auto.choose(it)
        else:
            lend, why = True, "lend: rollout"
        self.cluster.lending = lend
        return {"lent": lend, "why": why, "replicas": len(self.cluster.generating())}

    def give_back(self, it: int, seconds: float) -> dict:
        """The rollout is over: the lent replicas stop taking prompts (their devices train again);
        ``seconds``: what the rollout took, ``auto``'s input."""
        self.auto.measured(it, seconds, first=self.cluster.lending)
        self.cluster.lending = False
        return {"rollout_s": seconds}

