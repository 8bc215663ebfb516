"""The weights' version each sample records, without Ray or engines: the version a receive posted
ahead carries (``recipes.loop.stand_by_version``, ``Cluster.stand_by``) and what a rollout replica
records from a receive and hands out with every generation (``actors.rollout_replica``).

Iteration ``it`` starts with ``sync(version=it)``: the trainer's weights after ``it`` updates go to
the replicas, and every sample generated until the next sync records version ``it``. When the
rollout is done the replicas post their next receive (``stand_by``) while the trainer trains; it
serves the next iteration's sync, so it carries ``it + 1``. One less, and the next iteration's
fresh samples would record the version before — counted stale by the off-policy check and
corrected as stale; one more, and a stale sample would pass for fresh.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from actors.rollout_replica import RolloutReplica
from recipes.cluster import Cluster
from recipes.loop import Loop, stand_by_version


def test_a_receive_posted_after_iteration_its_rollout_carries_the_next_iterations_version():
    assert [stand_by_version(it, set(), False) for it in range(4)] == [1, 2, 3, 4]
    assert stand_by_version(5, {6}, False) is None  # no sync at 6: nothing to wait in
    assert stand_by_version(5, {5, 7}, False) == 6  # skips elsewhere do not matter
    assert stand_by_version(5, set(), True) is None  # partial rollout: segments still in flight
    assert stand_by_version(5, {6}, True) is None


class Replica:
    """A replica actor's handle as ``Cluster.stand_by`` calls it: ``channel_receive.remote``."""

    def __init__(self, log, name):
        self.channel_receive = SimpleNamespace(remote=lambda version: log.append((name, version)) or (name, version))


def test_stand_by_posts_one_receive_per_replica_with_the_version_given():
    """``Cluster.stand_by`` (on a stand-in cluster's state: its replicas' handles and whether a
    receive is posted or a move is incoming) posts each replica's receive once, with ``version``."""
    log = []
    cluster = SimpleNamespace(replicas=[Replica(log, "r0"), Replica(log, "r1")], _standing_by=None, _incoming=None)
    Cluster.stand_by(cluster, version=stand_by_version(6, set(), False))
    assert log == [("r0", 7), ("r1", 7)] and cluster._standing_by == [("r0", 7), ("r1", 7)]
    Cluster.stand_by(cluster, version=8)  # posted already: the sync takes that one
    assert log == [("r0", 7), ("r1", 7)]
    busy = SimpleNamespace(replicas=[Replica(log, "r2")], _standing_by=None, _incoming=object())
    Cluster.stand_by(busy, version=3)  # a move into the replicas is under way: nothing posted
    none = SimpleNamespace(replicas=[], _standing_by=None, _incoming=None)
    Cluster.stand_by(none, version=3)
    assert log == [("r0", 7), ("r1", 7)] and busy._standing_by is None and none._standing_by is None


class Engine:
    """Stands in for a replica's rollout engine (vLLM; not what is tested here)."""

    def __init__(self):
        self.received = 0

    def channel_receive(self):
        self.received += 1
        return [{"worker": 0}]

    def generate(self, prompts, max_new_tokens, temperature, seeds, stop_ids):
        return [[7] * max_new_tokens for _ in prompts], [[-0.5] * max_new_tokens for _ in prompts]


def test_a_replica_records_the_version_of_its_last_receive_in_every_generation():
    replica = RolloutReplica()
    replica.engine, replica.replica, replica.tp = Engine(), 1, 1
    first = replica.generate([[1, 2]], 2, 1.0, [5], [])
    assert first["version"] is None  # no receive yet: the loop records its own iteration
    assert replica.channel_receive(3)["workers"] == [{"worker": 0}]
    out = replica.generate([[1, 2], [3]], 2, 1.0, [5, 6], [])
    assert (out["version"], out["tokens"], out["replica"], out["lead"]) == (3, [[7, 7], [7, 7]], 1, True)
    replica.channel_receive(stand_by_version(3, set(), False))
    assert replica.generate([[1]], 1, 1.0, [5], [])["version"] == 4
    assert replica.engine.received == 2


@pytest.mark.parametrize("it", [0, 4])
def test_the_next_iterations_samples_record_its_own_version(it):
    """The chain over one iteration boundary: the receive posted after iteration ``it``'s rollout
    (``stand_by``) is the one iteration ``it + 1``'s sync fills; the replica's samples of iteration
    ``it + 1`` record ``it + 1``, the trainer's iteration — fresh, not one behind."""
    log = []
    replica = RolloutReplica()
    replica.engine, replica.replica, replica.tp = Engine(), 0, 1
    cluster = SimpleNamespace(replicas=[Replica(log, "r0")], _standing_by=None, _incoming=None)
    Cluster.stand_by(cluster, version=stand_by_version(it, set(), False))
    (_, version), = cluster._standing_by  # the receive the next sync completes
    replica.channel_receive(version)
    assert replica.generate([[1]], 1, 1.0, [0], [])["version"] == it + 1


class StandByCluster:
    """Stands in for the cluster where ``Loop.rollout_done`` touches it."""

    def __init__(self):
        self.log = []

    def stand_by(self, version=None):
        self.log.append(("stand_by", version))

    def memory_mark(self, wait):
        self.log.append(("memory_mark", wait))
        return {"rss": 1}

    def reload(self):
        self.log.append(("reload",))
        return {"seconds": 0.0}


@pytest.mark.parametrize("it,skip,segmented,posted", [(4, set(), False, [("stand_by", 5)]), (4, {5}, False, []),
                                                      (4, set(), True, [])])
def test_the_loop_posts_the_receive_with_the_next_iterations_version(it, skip, segmented, posted):
    """``Loop.rollout_done`` (on a stand-in loop's state and cluster): the receive posted when the
    rollout is done carries ``it + 1``; none where no sync follows or segments are in flight."""
    cluster = StandByCluster()
    loop = SimpleNamespace(faults=SimpleNamespace(crash_at=[], skip_sync_at=skip), cluster=cluster,
                           world=SimpleNamespace(after_rollout=lambda it, rec: None),
                           source=SimpleNamespace(stands_by=lambda: not segmented))
    rec = SimpleNamespace(peak={}, reloaded=None)
    Loop.rollout_done(loop, it, rec)
    assert cluster.log == posted + [("memory_mark", False), ("reload",)]
    assert rec.peak == {"generate": {"rss": 1}} and rec.reloaded == {"seconds": 0.0}
