"""Where an iteration trains and generates: the train world, one per run mode.

=============  ========================================================================================
own            the trainer's devices train, the rollout engines' generate: nothing moves
``lent``       ``elastic.lend``: the trainer's devices generate too, lent to the rollout while the
               synchronous loop waits for samples (``recipes.elastic.lending``)
``rebalanced``  ``elastic.rebalance``: the rollout replicas' devices join the trainer world for the
               log-probs and the update (``recipes.elastic.rebalance``)
=============  ========================================================================================

``TrainWorld`` holds the parts a run uses (none, either or both) and the loop calls it at four points:
``before_rollout`` (lend), ``after_rollout`` (give back), ``before_train`` (grow) and
``after_train`` (shrink). Each writes what it did into the iteration's record.
"""
from __future__ import annotations

import time


class TrainWorld:
    """The run's devices between the phases: its parts (``lending``, ``rebalance``; None where the
    run has none)."""

    def __init__(self, lending=None, rebalance=None, rebalance_mode: str = "off", faults=None):
        self.lending, self.rebalance, self.rebalance_mode, self.faults = lending, rebalance, rebalance_mode, faults
        self._train_t0 = 0.0

    @classmethod
    def of(cls, loop) -> "TrainWorld":
        """The run's world, from ``elastic.lend`` and ``elastic.rebalance`` (said on the console)."""
        elastic = loop.cfg.elastic
        lending = rebalance = None
        if elastic is not None and elastic.lend != "off":
            from recipes.elastic.lending import Lending

            lending = Lending(loop.cluster, elastic.lend)
            loop.say(f"lend {elastic.lend}: {len(loop.cluster.lent)} rollout replica(s) on the trainer's devices "
                     f"take a share of the rollout")
        if elastic is not None and elastic.rebalance != "off":
            from recipes.elastic.rebalance import Rebalance

            # built in the background while the first iterations run
            rebalance = Rebalance(loop.cluster, loop.cfg, loop.init_dir, loop.quiet)
            loop.say(f"rebalance {elastic.rebalance}: a {rebalance.world}-rank trainer world over the trainer's and "
                     f"the replicas' devices is being built for the updates")
        return cls(lending, rebalance, elastic.rebalance if elastic is not None else "off", loop.faults)

    def before_rollout(self, it: int, rec) -> None:
        """``elastic.lend``: whether this rollout takes the trainer's devices too — every iteration
        (``rollout``) or where it last paid (``auto``)."""
        if self.lending is not None:
            rec.lend = self.lending.lend(it)

    def after_rollout(self, it: int, rec) -> None:
        """The lent devices go back to the trainer; the rollout's seconds are ``auto``'s input."""
        if self.lending is not None:
            took = rec.timings["rollout"] + rec.timings.get("dynamic_sampling", 0.0)
            rec.lend = {**(rec.lend or {}), **self.lending.give_back(it, took)}

    def before_train(self, it: int, rec, cluster) -> None:
        """``elastic.rebalance``: the training state into the grown world (the trainer's devices and
        the replicas'), where the log-probs and the update run — every iteration (``update``), or
        where it last paid (``auto``: ``rebalance.choose``)."""
        reb = self.rebalance
        if reb is None:
            return
        self._train_t0 = time.perf_counter()
        if self.rebalance_mode == "auto":
            grow, why = reb.auto.choose(it, reb.built())
            rec.rebalance = {"world": reb.world if grow else cluster.world, "grown": grow, "why": why}
            if not grow:
                return
        with rec.timed("grow"):
            rec.rebalance = {**(rec.rebalance or {}), "world": reb.world, "grown": True, "grow": reb.grow()}
        self.faults.hook(it, "after_grow", cluster)

    def after_train(self, it: int, rec, cluster) -> None:
        """The state back into the trainer's own world, before the record and the next sync; the
        train phase as it went (with the moves when grown) is ``auto``'s next input."""
        reb = self.rebalance
        if reb is None:
            return
        if reb.grown:
            self.faults.hook(it, "before_shrink", cluster)
            with rec.timed("shrink"):
                rec.rebalance["shrink"] = reb.shrink()
            self.faults.hook(it, "after_shrink", cluster)
        reb.auto.measured(it, time.perf_counter() - self._train_t0, first="shrink" in rec.rebalance)
        rec.rebalance["built_s"] = reb.built_s

    def close(self) -> None:
        """Before the cluster: the trainer's own world gets its actors back."""
        if self.rebalance is not None:
            self.rebalance.close()
