"""The train world (``recipes/loop/world.py``), fast: ``TrainWorld`` with the real ``Lending`` over
a cluster stand-in (three replicas, the third on the trainer's devices), and a stand-in of
``Rebalance`` (whose grown world is Ray actors) keeping its interface — ``world``, ``built()``,
``grown``, ``grow()``, ``shrink()``, ``built_s``, the real ``Ways`` as ``auto``, ``close()``. Each
hook's record, the faults' hooks and ``auto``'s inputs are asserted by hand."""
from __future__ import annotations

import time
from types import SimpleNamespace

from recipes.elastic.lending import Lending
from recipes.elastic.rebalance import Ways
from recipes.loop.loop import Faults
from recipes.loop.record import IterationRecord
from recipes.loop.world import TrainWorld
from rlhf_switch.rl.config import ElasticConfig


class Cluster:
    """What ``Lending`` and the world read of ``Cluster``: the replicas, which are lent the
    trainer's devices (``lent``), ``lending`` and ``generating()`` (as ``ReplicasMixin``'s)."""

    def __init__(self):
        self.replicas, self.lent, self.lending, self.world = ["r0", "r1", "r2"], [2], False, 2

    def generating(self):
        own = [r for i, r in enumerate(self.replicas) if i not in self.lent]
        return list(self.replicas) if self.lending or not own else own


class Rebalance:
    """``recipes.elastic.rebalance.Rebalance``'s interface, its moves a record of the calls."""

    def __init__(self, cluster, cfg=None, init_dir=None, quiet=True):
        self.cluster, self.args, self.world, self.small = cluster, (cfg, init_dir, quiet), 4, cluster.world
        self.ready, self.built_s, self._home, self.moves, self.closed = True, None, None, [], 0
        self.auto = Ways(("grown", "static"))

    def built(self):
        if self.ready and self.built_s is None:
            self.built_s = 1.5
        return self.built_s is not None

    @property
    def grown(self):
        return self._home is not None

    def grow(self):
        assert not self.grown
        self.built_s = 1.5 if self.built_s is None else self.built_s  # the build waited for
        self.moves.append("grow")
        self._home, self.cluster.world = "small", self.world
        return {"seconds": 0.5}

    def shrink(self):
        assert self.grown
        self.moves.append("shrink")
        self._home, self.cluster.world = None, self.small
        return {"seconds": 0.25}

    def close(self):
        self.closed += 1


def faults():
    hooked = []
    return Faults(phase_hook=lambda it, phase, cluster: hooked.append((it, phase, cluster))), hooked


def rollout_record(it: int, rollout: float, dynamic_sampling: float | None = None) -> IterationRecord:
    rec = IterationRecord(it)
    rec.timings["rollout"] = rollout
    if dynamic_sampling is not None:
        rec.timings["dynamic_sampling"] = dynamic_sampling
    return rec


def test_a_world_of_its_own_does_nothing():
    world, rec, cluster = TrainWorld(), IterationRecord(0), Cluster()
    assert (world.lending, world.rebalance, world.rebalance_mode, world.faults) == (None, None, "off", None)
    world.before_rollout(0, rec)
    world.after_rollout(0, rec)
    world.before_train(0, rec, cluster)
    world.after_train(0, rec, cluster)
    world.close()
    assert (rec.lend, rec.rebalance, rec.timings) == (None, None, {}) and cluster.world == 2


def test_the_world_of_a_config(monkeypatch):
    import recipes.elastic.rebalance as rebalance_module

    said = []
    monkeypatch.setattr(rebalance_module, "Rebalance", Rebalance)

    def loop(elastic):
        f, _ = faults()
        return SimpleNamespace(cfg=SimpleNamespace(elastic=elastic), cluster=Cluster(), faults=f, init_dir="/init",
                               quiet=False, say=said.append)

    plain = loop(None)
    world = TrainWorld.of(plain)
    assert (world.lending, world.rebalance, world.rebalance_mode) == (None, None, "off") and world.faults is plain.faults
    off = TrainWorld.of(loop(ElasticConfig()))
    assert (off.lending, off.rebalance, off.rebalance_mode) == (None, None, "off") and said == []
    both = loop(ElasticConfig(lend="auto", rebalance="update"))
    world = TrainWorld.of(both)
    assert isinstance(world.lending, Lending) and world.lending.cluster is both.cluster and world.lending.mode == "auto"
    assert isinstance(world.rebalance, Rebalance) and world.rebalance.cluster is both.cluster
    assert world.rebalance.args == (both.cfg, "/init", False) and world.rebalance_mode == "update"
    assert world.faults is both.faults
    assert said == ["lend auto: 1 rollout replica(s) on the trainer's devices take a share of the rollout",
                    "rebalance update: a 4-rank trainer world over the trainer's and the replicas' devices is being "
                    "built for the updates"]
    reb = TrainWorld.of(loop(ElasticConfig(rebalance="auto")))
    assert reb.lending is None and reb.rebalance_mode == "auto"
    lend = TrainWorld.of(loop(ElasticConfig(lend="rollout")))
    assert lend.rebalance is None and lend.lending.mode == "rollout" and lend.rebalance_mode == "off"


def test_lend_rollout_every_iteration():
    cluster = Cluster()
    world = TrainWorld(lending=Lending(cluster, "rollout"))
    rec = rollout_record(3, 2.0, 0.5)
    world.before_rollout(3, rec)
    assert rec.lend == {"lent": True, "why": "lend: rollout", "replicas": 3} and cluster.lending
    world.after_rollout(3, rec)  # the rollout's seconds: generation and dynamic sampling's rounds
    assert rec.lend == {"lent": True, "why": "lend: rollout", "replicas": 3, "rollout_s": 2.5}
    assert not cluster.lending and world.lending.auto.runs == {"lent": 1}
    alone = rollout_record(4, 1.25)
    world.after_rollout(4, alone)  # no lend recorded before: the give-back's alone
    assert alone.lend == {"rollout_s": 1.25}


def test_lend_auto_measures_the_rollout_with_dynamic_sampling():
    """Lent at 0 (warm-up) and 1 (4 s: 1 s generating, 3 s of dynamic sampling's rounds), own at 2
    (warm-up) and 3 (2 s): iteration 4 keeps the trainer's devices, 4 >= 2."""
    cluster = Cluster()
    world = TrainWorld(lending=Lending(cluster, "auto"))
    lent = []
    for it, rollout, ds in ((0, 9.0, None), (1, 1.0, 3.0), (2, 9.0, None), (3, 2.0, None), (4, 1.0, None)):
        rec = rollout_record(it, rollout, ds)
        world.before_rollout(it, rec)
        lent.append((rec.lend["lent"], rec.lend["replicas"]))
        world.after_rollout(it, rec)
    assert lent == [(True, 3), (True, 3), (False, 2), (False, 2), (False, 2)]
    assert world.lending.auto.last == {"lent": 4.0, "own": 1.0} and world.lending.auto.measured_at == {"lent": 1, "own": 4}
    assert rec.lend == {"lent": False, "why": "lent 4.000 s >= own 2.000 s", "replicas": 2, "rollout_s": 1.0}


def test_rebalance_update_grows_for_every_train_phase():
    cluster, (f, hooked) = Cluster(), faults()
    world = TrainWorld(rebalance=Rebalance(cluster), rebalance_mode="update", faults=f)
    t0 = time.perf_counter()
    for it in (5, 6):
        rec = IterationRecord(it)
        world.before_train(it, rec, cluster)
        assert rec.rebalance == {"world": 4, "grown": True, "grow": {"seconds": 0.5}} and cluster.world == 4
        assert set(rec.timings) == {"grow"}
        world.after_train(it, rec, cluster)
        assert rec.rebalance == {"world": 4, "grown": True, "grow": {"seconds": 0.5}, "shrink": {"seconds": 0.25},
                                 "built_s": 1.5}
        assert set(rec.timings) == {"grow", "shrink"} and cluster.world == 2
    span = time.perf_counter() - t0
    assert hooked == [(it, phase, cluster) for it in (5, 6) for phase in ("after_grow", "before_shrink", "after_shrink")]
    assert world.rebalance.moves == ["grow", "shrink"] * 2
    # the train phase measured grown (its first run a warm-up), from before the grow to after the shrink
    auto = world.rebalance.auto
    assert auto.runs == {"grown": 2} and auto.measured_at == {"grown": 6} and 0 < auto.last["grown"] <= span
    world.close()
    assert world.rebalance.closed == 1


def test_rebalance_auto_grows_where_it_last_paid():
    cluster, (f, hooked) = Cluster(), faults()
    reb = Rebalance(cluster)
    reb.ready = False
    world = TrainWorld(rebalance=reb, rebalance_mode="auto", faults=f)
    rec = IterationRecord(0)
    world.before_train(0, rec, cluster)  # still building: the trainer's own world
    assert rec.rebalance == {"world": 2, "grown": False, "why": "the grown world is still building"}
    world.after_train(0, rec, cluster)
    assert rec.rebalance == {"world": 2, "grown": False, "why": "the grown world is still building", "built_s": None}
    assert reb.auto.runs == {"static": 1} and hooked == [] and reb.moves == [] and rec.timings == {}
    reb.ready = True
    rec = IterationRecord(1)
    world.before_train(1, rec, cluster)
    assert rec.rebalance == {"world": 4, "grown": True, "why": "no warm measurement of grown yet",
                             "grow": {"seconds": 0.5}}
    world.after_train(1, rec, cluster)
    assert rec.rebalance["shrink"] == {"seconds": 0.25} and rec.rebalance["built_s"] == 1.5
    assert reb.auto.runs == {"static": 1, "grown": 1}
    assert [p for _, p, _ in hooked] == ["after_grow", "before_shrink", "after_shrink"]
    # measured both ways, warm: grown 1 s, static 3 s -> grown at 9; static 0.5 s -> static at 10
    reb.auto.last, reb.auto.measured_at = {"grown": 1.0, "static": 3.0}, {"grown": 8, "static": 8}
    rec = IterationRecord(9)
    world.before_train(9, rec, cluster)
    assert rec.rebalance["grown"] and rec.rebalance["why"] == "grown 1.000 s < static 3.000 s"
    world.after_train(9, rec, cluster)
    reb.auto.last["grown"] = 5.0
    rec = IterationRecord(10)
    world.before_train(10, rec, cluster)
    assert rec.rebalance == {"world": 2, "grown": False, "why": "grown 5.000 s >= static 3.000 s"}
    world.after_train(10, rec, cluster)
    assert reb.auto.measured_at["static"] == 10 and not reb.grown


def test_close_without_rebalance():
    world = TrainWorld(lending=Lending(Cluster(), "rollout"))
    assert world.close() is None
