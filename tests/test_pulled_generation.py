"""Work stealing over rollout replicas (``rollout.pull_prompts``, recipes/cluster/replicas.py): a
generation cut in chunks, each replica handed the next chunk as soon as it returns one. The
replicas here are real Ray actors whose "engine" answers from the prompt and seed alone (the
pulling is what is tested; real engines generate in tests/test_agent_loop.py's pulled run): the
answers come back in prompt order whatever replica ran them, a replica slowed down takes one
chunk while the other takes the rest, a replica that dies mid-generation hands its chunk to the
others and leaves, and the replicas' generating seconds are added up for the idle share."""
from __future__ import annotations

import os
import time
from types import SimpleNamespace

import pytest

from recipes.cluster.replicas import Generation, PulledGeneration, ReplicasMixin, RolloutTime


class Replica:
    """Answers prompt p with seed s by ``[sum(p) % 97, s % 89, len(p)]`` cut to ``max_new_tokens``,
    after ``delay`` seconds; dies (the process exits) on its ``die_at``-th call."""

    def __init__(self, number: int, delay: float = 0.0, die_at: int = 0, version: int | None = 3):
        self.number, self.delay, self.die_at, self.calls, self.version = number, delay, die_at, [], version

    def generate(self, prompts, max_new_tokens, temperature, seeds, stop_ids):
        self.calls.append(len(prompts))
        if self.die_at and len(self.calls) == self.die_at:
            os._exit(1)
        t0 = time.perf_counter()
        time.sleep(self.delay)
        tokens = [[sum(p) % 97, s % 89, len(p)][:max_new_tokens] for p, s in zip(prompts, seeds)]
        return {"replica": self.number, "lead": True, "tokens": tokens,
                "logprobs": [[-0.25] * len(t) for t in tokens], "version": self.version, "stop_ids": list(stop_ids),
                "seconds": time.perf_counter() - t0}

    def chunk_sizes(self):
        return self.calls


class Replicas(ReplicasMixin):
    """The replicas part of a cluster over ``actors``; a dropped replica only leaves the list (the
    weight channel's forming again is tested with real engines in tests/test_elastic_vllm.py)."""

    def __init__(self, ray, actors, pull: int):
        self.ray, self.replicas, self.quiet, self.in_world = ray, list(actors), True, False
        self.cfg = SimpleNamespace(rollout=SimpleNamespace(pull_prompts=pull, engine="test"))
        self.hf = {"eos_token_id": 2}
        self.replica_events, self.rollout_time, self.dropped = [], RolloutTime(), []

    def generating(self):
        return list(self.replicas)

    def drop_replicas(self, dead):
        self.dropped += [self._index(d) for d in dead]
        self.replicas = [r for r in self.replicas if not any(r is d for d in dead)]
        return [f"replica {i}" for i in self.dropped]

    def _replica_name(self, replica, worker=None):
        return f"replica {replica}"


@pytest.fixture(scope="module")
def ray():
    from conftest import start_local_ray

    ray = start_local_ray(num_cpus=4)
    yield ray
    ray.shutdown()


def actors(ray, *specs):
    cls = ray.remote(num_cpus=0.5)(Replica)
    return [cls.remote(i, **spec) for i, spec in enumerate(specs)]


PROMPTS = [[1] + [i] * (1 + i % 3) for i in range(10)]
SEEDS = list(range(100, 110))


def expected(max_new_tokens=3):
    return [[sum(p) % 97, s % 89, len(p)][:max_new_tokens] for p, s in zip(PROMPTS, SEEDS)]


def test_pulled_answers_come_back_in_prompt_order_and_equal_fixed_shares(ray):
    fixed = Replicas(ray, actors(ray, {}, {}), pull=0)
    gen = fixed.submit_generation(PROMPTS, SEEDS, 3, 1.0, stop_ids=[7])
    assert isinstance(gen, Generation)
    want = fixed.collect_generation(gen)
    pulled = Replicas(ray, actors(ray, {}, {}), pull=3)
    gen = pulled.submit_generation(PROMPTS, SEEDS, 3, 1.0, stop_ids=[7])
    assert isinstance(gen, PulledGeneration) and gen.chunks == [(0, 3), (3, 6), (6, 9), (9, 10)]
    got = pulled.collect_generation(gen)
    assert got == want and got[0] == expected() and got[2] == [3] * 10
    # every chunk went out once, and a generation collected later keeps fixed shares
    sizes = sorted(s for a in pulled.replicas for s in ray.get(a.chunk_sizes.remote()))
    assert sizes == [1, 3, 3, 3]
    assert isinstance(pulled.submit_generation(PROMPTS, SEEDS, 3, 1.0, pull=False), Generation)
    # the replicas' seconds were added up, one wall time per generation
    t = pulled.rollout_time.take()
    assert set(t["busy_s"]) == {0, 1} and t["wall_s"] > 0 and all(0 <= v <= 1 for v in t["idle_share"].values())
    assert pulled.rollout_time.take()["busy_s"] == {}


def test_a_slow_replica_takes_one_chunk_and_the_other_the_rest(ray):
    """Replica 0 takes 3 s a call: by the time it returns its first chunk, replica 1 has pulled
    and answered every other one (fixed shares would have given replica 0 half the prompts)."""
    cluster = Replicas(ray, actors(ray, {"delay": 3.0}, {}), pull=2)
    got = cluster.collect_generation(cluster.submit_generation(PROMPTS, SEEDS, 2, 1.0))
    assert got[0] == expected(2)
    slow, fast = (ray.get(a.chunk_sizes.remote()) for a in cluster.replicas)
    assert slow == [2] and fast == [2, 2, 2, 2]
    idle = cluster.rollout_time.take()["idle_share"]
    assert idle[1] > idle[0]  # the fast replica waited for the slow one's last chunk


def test_a_replica_that_dies_hands_its_chunk_to_the_others_and_leaves(ray):
    cluster = Replicas(ray, actors(ray, {"die_at": 2, "delay": 0.2}, {"delay": 0.2}), pull=2)
    got = cluster.collect_generation(cluster.submit_generation(PROMPTS, SEEDS, 3, 1.0))
    assert got[0] == expected()  # nothing lost, in prompt order
    assert cluster.dropped == [0] and len(cluster.replicas) == 1
    (event,) = cluster.replica_events
    assert event["requeued_prompts"] == 2 and event["replicas_left"] == 1
    # no replica left: one clear error, not a hang
    alone = Replicas(ray, actors(ray, {"die_at": 1}), pull=4)
    from recipes.cluster.calls import RolloutEngineFailed

    with pytest.raises(RolloutEngineFailed, match="no rollout replica is left"):
        alone.collect_generation(alone.submit_generation(PROMPTS, SEEDS, 3, 1.0))


# --- one queue of turns (recipes/cluster/turn_queue.py: agent.turn_batching continuous) -------------
def answers(futures, timeout=60):
    return [f.result(timeout=timeout) for f in futures]


def test_a_turn_queue_answers_each_turn_as_soon_as_its_chunk_is_back(ray):
    """Replica 0 takes 3 s a call. Turns submitted while it holds its first chunk go to replica 1
    and are answered before that chunk: no turn waits for another's chunk, nor for a batch."""
    from recipes.cluster.turn_queue import TurnQueue

    cluster = Replicas(ray, actors(ray, {"delay": 3.0}, {}), pull=2)
    with TurnQueue(cluster, 2) as q:
        first = q.submit(PROMPTS, SEEDS, [3] * 10, 1.0, [frozenset({7})] * 10)
        later = q.submit(PROMPTS[:4], SEEDS[:4], [2] * 4, 1.0, [frozenset({7})] * 4)
        got_later = answers(later)
        held = [f.done() for f in first]
        got_first = answers(first)
    assert [a[0] for a in got_first] == expected() and [a[0] for a in got_later] == expected(2)[:4]
    assert all(lp == [-0.25] * len(t) and v == 3 for t, lp, v in got_first + got_later)
    # the slow replica's chunk (the first two turns) was still out when the later turns came back
    assert held == [False, False] + [True] * 8
    slow, fast = (ray.get(a.chunk_sizes.remote()) for a in cluster.replicas)
    assert slow == [2] and sorted(fast) == [2, 2, 2, 2, 2, 2] and sorted(q.calls) == [2] * 7
    t = cluster.rollout_time.take()
    assert set(t["busy_s"]) == {0, 1} and t["wall_s"] > 0 and t["idle_share"][1] > t["idle_share"][0]


def test_a_turn_queue_sends_one_budget_and_one_set_of_stop_ids_per_call(ray):
    """Turns of different budgets or stop ids never share a call (the engines stop at both); the
    chunk takes the head's kind and the others keep their places."""
    from recipes.cluster.turn_queue import TurnQueue

    cluster = Replicas(ray, actors(ray, {}), pull=4)
    budgets = [3, 1, 3, 2, 3, 1, 3, 2, 3, 3]
    stops = [frozenset({7}) if i != 8 else frozenset({9}) for i in range(10)]
    with TurnQueue(cluster, 4) as q:
        got = answers(q.submit(PROMPTS, SEEDS, budgets, 1.0, stops))
    assert [a[0] for a in got] == [e[:b] for e, b in zip(expected(), budgets)]
    # one replica, so the calls are in order: the head's kind first, up to four of it
    assert q.calls == [4, 2, 2, 1, 1]
    (replica,) = cluster.replicas
    assert ray.get(replica.chunk_sizes.remote()) == q.calls


def test_a_turn_queues_replica_that_dies_hands_its_chunk_over_and_none_left_is_one_error(ray):
    from recipes.cluster.calls import RolloutEngineFailed
    from recipes.cluster.turn_queue import TurnQueue

    cluster = Replicas(ray, actors(ray, {"die_at": 1, "delay": 0.5}, {"delay": 0.2}), pull=2)
    with TurnQueue(cluster, 2) as q:
        got = answers(q.submit(PROMPTS, SEEDS, [3] * 10, 1.0, [frozenset()] * 10))
    assert [a[0] for a in got] == expected()  # nothing lost
    assert cluster.dropped == [0] and len(cluster.replicas) == 1
    (event,) = cluster.replica_events
    assert event["requeued_prompts"] == 2 and event["replicas_left"] == 1
    alone = Replicas(ray, actors(ray, {"die_at": 1}), pull=2)
    with TurnQueue(alone, 2) as q:
        futures = q.submit(PROMPTS, SEEDS, [3] * 10, 1.0, [frozenset()] * 10)
        for f in futures:
            with pytest.raises(RolloutEngineFailed, match="no rollout replica is left"):
                f.result(timeout=60)
        with pytest.raises(RolloutEngineFailed):  # and so does a turn submitted later
            q.submit(PROMPTS[:1], SEEDS[:1], [3], 1.0, [frozenset()])[0].result(timeout=5)


def test_an_agent_runs_turns_go_to_the_queue_only_when_continuous_and_pulled(ray):
    """``recipes.loop.workflow.turn_engines``: the replicas' turn queue for ``turn_batching:
    continuous`` with ``pull_prompts``; the batch function otherwise (rounds, fixed shares, or the
    torch engine in the trainer's actors). A turn's version is its replica's; the fault hook runs
    after each submission."""
    from recipes.loop.workflow import ReplicaTurns, turn_engines

    hooked = []

    def loop_of(batching, pull, in_world=False, version=3):
        cluster = Replicas(ray, actors(ray, {"version": version}), pull=pull)
        cluster.in_world = in_world
        cfg = SimpleNamespace(agent=SimpleNamespace(turn_batching=batching), rollout=cluster.cfg.rollout)
        return SimpleNamespace(cfg=cfg, cluster=cluster, faults=SimpleNamespace(
            generate_hook_for=lambda it, c: hooked.append(it)))

    for batching, pull, in_world in (("rounds", 2, False), ("continuous", 0, False), ("continuous", 2, True)):
        with turn_engines(loop_of(batching, pull, in_world), 5) as engines:
            assert callable(engines) and not hasattr(engines, "submit"), (batching, pull, in_world)
    with turn_engines(loop_of("continuous", 2), 5) as engines:
        assert isinstance(engines, ReplicaTurns) and engines.queue.chunk == 2
        got = answers(engines.submit(PROMPTS[:3], SEEDS[:3], [3] * 3, 1.0, [frozenset()] * 3))
    assert [a[0] for a in got] == expected()[:3] and [a[2] for a in got] == [3] * 3 and hooked == [5]
    # an engine that keeps no version: the driver's iteration
    with turn_engines(loop_of("continuous", 2, version=None), 6) as engines:
        got = answers(engines.submit(PROMPTS[:3], SEEDS[:3], [3] * 3, 1.0, [frozenset()] * 3))
    assert [a[2] for a in got] == [6] * 3 and hooked == [5, 6]


def test_a_turn_queue_whose_replica_does_not_answer_fails_every_turn_not_hangs(ray, monkeypatch):
    from recipes.cluster import turn_queue

    monkeypatch.setattr(turn_queue, "PHASE_S", 0.5)
    cluster = Replicas(ray, actors(ray, {"delay": 3.0}), pull=2)
    with turn_queue.TurnQueue(cluster, 2) as q:
        futures = q.submit(PROMPTS[:4], SEEDS[:4], [3] * 4, 1.0, [frozenset()] * 4)
        for f in futures:
            with pytest.raises(TimeoutError, match="has not answered a chunk of turns in 0.5 s"):
                f.result(timeout=60)
