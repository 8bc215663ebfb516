"""``elastic.rebalance: update`` (``recipes/elastic/rebalance.py``): the rollout replicas' devices join the
trainer world for each update — the training state moves into a world twice the size and back
within every iteration, bit for bit — and the config's refusals."""
from __future__ import annotations

import shutil

import pytest

from rlhf_switch.rl.config import ConfigError, load_config

from test_off_policy import tiny


def _differences(a, b, at: str = "") -> list[str]:
    """Where two gathered training states (``HybridWorker.gathered_state``: tensors, scalars, RNG)
    differ, bit for bit."""
    import torch

    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{at}: keys {sorted(set(a) ^ set(b))}"]
        return [d for k in a for d in _differences(a[k], b[k], f"{at}/{k}")]
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return [] if a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b) else [at]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, f"{at}[{i}]")]
    return [] if a == b else [at]


def test_rebalance_refusals():
    from rlhf_switch.problems import run_problems

    def problems(**changes):
        return run_problems(load_config(tiny("grpo_tiny_async.yaml", **changes)), skip=("reward",))

    colocated = problems(**{"elastic": {"rebalance": "update"}, "rollout.mode": "colocated",
                            "algorithm.off_policy": None})
    assert any("lends the rollout replicas' own devices to the update" in p for p in colocated), colocated
    in_flight = problems(**{"elastic": {"rebalance": "update"}})
    assert any("their devices are not idle to lend" in p for p in in_flight), in_flight
    parked = problems(**{"elastic": {"rebalance": "update"}, "algorithm.off_policy": None, "train.offload": "optimizer"})
    assert any("train.offload: optimizer parks it in host memory" in p for p in parked), parked
    # the grown world (4 devices: DP 4) must split the batch: 32 sequences per mini-batch are 8 per
    # rank, which micro-batches of 16 do not divide
    odd = problems(**{"elastic": {"rebalance": "update"}, "algorithm.off_policy": None})
    assert any(p.startswith("elastic.rebalance: the grown world of 4 devices: algorithm.micro_batch_size=16")
               for p in odd), odd
    assert problems(**{"elastic": {"rebalance": "update"}, "algorithm.off_policy": None,
                       "algorithm.micro_batch_size": 8}) == []
    with pytest.raises(ConfigError, match="rebalance"):
        load_config(tiny("grpo_tiny_async.yaml", **{"elastic": {"rebalance": "always"}}))
    # elastic.lend: the trainer's devices join replicas of their own, while the trainer waits for samples
    lend_colocated = problems(**{"elastic": {"lend": "rollout"}, "rollout.mode": "colocated",
                                 "algorithm.off_policy": None})
    assert any("lends the trainer's devices to rollout replicas of their own devices" in p
               for p in lend_colocated), lend_colocated
    lend_in_flight = problems(**{"elastic": {"lend": "auto"}})
    assert any("elastic.lend: the trainer trains while the replicas generate" in p
               for p in lend_in_flight), lend_in_flight
    assert problems(**{"elastic": {"lend": "rollout"}, "algorithm.off_policy": None}) == []


@pytest.mark.slow
@pytest.mark.vllm
def test_rebalance_grows_and_shrinks_the_trainer_world_each_iteration_bit_for_bit(ray_session, tmp_path):
    """One FSDP2 trainer rank and one vLLM replica on a device of its own; each iteration the
    state moves into a 2-rank world over both devices for the log-probs and the update, and back
    before the sync. Every move lands the sender's state whole (weights, fp32 master, Adam moments,
    step, LR schedule, RNG), and the replica fed from the trainer's own world after the move back
    generates with the weights the grown world trained (the stale check)."""
    from recipes.common import warm_start
    from recipes.train import run
    from test_elastic import _gathered

    cfg = tiny("grpo_tiny_async.yaml", world_size=1, output_dir=str(tmp_path / "run"),
               **{"train.dp": 1, "reference.dp": 1, "rollout.dp": 1, "eval.num_prompts": 16,
                  "algorithm.off_policy": None, "elastic": {"rebalance": "update"}})
    shutil.copytree(warm_start(load_config(cfg), tmp_path / "init", quiet=True), tmp_path / "run" / "init")
    states, worlds = {}, {}

    def gather(it, phase, cluster):
        if phase in ("train", "after_grow", "before_shrink", "after_shrink"):
            states[(it, phase)], worlds[(it, phase)] = _gathered(ray_session, cluster.workers), cluster.world

    recs = [r for r in run(cfg, iterations=2, quiet=True, phase_hook=gather) if "reward_mean" in r]
    for it in (0, 1):
        assert [worlds[(it, p)] for p in ("train", "after_grow", "before_shrink", "after_shrink")] == [1, 2, 2, 1]
        assert _differences(states[(it, "train")], states[(it, "after_grow")]) == []
        # the grown world's update changed the state (weights, moments, step): not a trivial comparison
        changed = _differences(states[(it, "after_grow")], states[(it, "before_shrink")])
        assert any(d.startswith("/master/") for d in changed) and any(d.startswith("/moments/") for d in changed), changed
        assert _differences(states[(it, "before_shrink")], states[(it, "after_shrink")]) == []
        assert states[(it, "after_shrink")]["scalars"]["step"] == states[(it, "train")]["scalars"]["step"] + 4
    assert _differences(states[(0, "after_shrink")], states[(1, "train")]) == []
    assert all(r["stale_check_passed"] and r["stale_logprob_diff"] < 1e-4 for r in recs), recs
    for r in recs:
        reb = r["rebalance"]
        assert reb["world"] == 2 and reb["grow"]["bytes_moved"] == reb["shrink"]["bytes_moved"] > 0, reb
        assert {"grow", "shrink"} <= set(r["phase_seconds"]), r["phase_seconds"]


def test_auto_compares_warm_runs_only():
    """A way's first run is its warm-up (1.8 s for a lent replica's first generate against 0.08 s
    warm, seen in a run): it is taken again before it is compared, and only its warm runs count."""
    from recipes.elastic.rebalance import Ways

    ways = Ways(("lent", "own"))
    taken = []
    for it, (cold, warm) in enumerate([(1.8, None), (None, 0.08), (0.1, None), (None, 0.12)]):
        lend, _ = ways.choose(it)
        taken.append(lend)
        ways.measured(it, cold if cold is not None else warm, first=lend)
    assert taken == [True, True, False, False]  # each way twice: a warm-up, then a measurement
    assert ways.last == {"lent": 0.08, "own": 0.12} and ways.measured_at == {"lent": 1, "own": 3}
    assert ways.choose(4) == (True, "lent 0.080 s < own 0.120 s")


def test_auto_grows_where_it_last_paid_and_measures_the_other_way_again():
    """``rebalance: auto``'s choice (pure): not before the grown world is built; each way measured
    once; then the faster, the other measured again after ``PROBE_EVERY`` iterations."""
    from recipes.elastic.rebalance import PROBE_EVERY, choose

    assert choose(False, {}, {}, 0) == (False, "the grown world is still building")
    assert choose(True, {"static": 1.0}, {"static": 0}, 1) == (True, "no warm measurement of grown yet")
    assert choose(True, {"grown": 0.5}, {"grown": 1}, 2)[0] is False       # static not measured yet
    last = {"static": 1.0, "grown": 1.4}
    assert choose(True, last, {"static": 2, "grown": 1}, 3)[0] is False    # the moves cost more than they save
    assert choose(True, {"static": 1.0, "grown": 0.6}, {"static": 2, "grown": 1}, 3)[0] is True
    grow, why = choose(True, last, {"static": 1 + PROBE_EVERY + 1, "grown": 1}, 2 + PROBE_EVERY)
    assert grow and "measured again" in why
    # lend: auto — the same choice between the rollout with the trainer's devices lent and without
    ways = ("lent", "own")
    assert choose(True, {}, {}, 0, ways=ways) == (True, "no warm measurement of lent yet")
    assert choose(True, {"lent": 2.0}, {"lent": 0}, 1, ways=ways) == (False, "no warm measurement of own yet")
    assert choose(True, {"lent": 2.0, "own": 3.0}, {"lent": 0, "own": 1}, 2, ways=ways)[0] is True
    assert choose(True, {"lent": 3.5, "own": 3.0}, {"lent": 0, "own": 1}, 2, ways=ways)[0] is False


class LendingCluster:
    """Stands in for ``recipes.cluster.Cluster`` where ``Lending`` touches it (the cluster is not
    what is tested here; ``Lending``'s bookkeeping is): ``lending``, which ``Lending`` sets, and
    ``generating()``, the replicas a rollout is shared over — the lent one only while lending."""

    def __init__(self):
        self.lending = False
        self.replicas = ["own", "lent"]

    def generating(self) -> list:
        return list(self.replicas) if self.lending else ["own"]


def test_lend_auto_records_each_rollout_as_the_way_it_ran():
    """``lend: auto`` over twenty iterations with a stand-in cluster: each rollout's seconds are
    recorded as the way it ran (lent or own) at its iteration, from each way's second run on (the
    first is its warm-up); the choice follows them — each way until it has a warm measurement,
    then the faster, the slower measured again once it is ``PROBE_EVERY`` iterations old —; the
    devices are given back after every rollout."""
    from recipes.elastic.lending import Lending
    from recipes.elastic.rebalance import PROBE_EVERY

    assert PROBE_EVERY == 8
    cluster = LendingCluster()
    lending = Lending(cluster, "auto")
    seconds = {"lent": 3.0, "own": 2.0}  # lending costs more here, until it gets cheaper (iteration 10)
    want = [  # (iteration, lent, why)
        (0, True, "no warm measurement of lent yet"),
        (1, True, "no warm measurement of lent yet"),
        (2, False, "no warm measurement of own yet"),
        (3, False, "no warm measurement of own yet"),
        *((it, False, "lent 3.000 s >= own 2.000 s") for it in range(4, 10)),
        (10, True, "lent last measured at iteration 1: measured again"),
        *((it, True, "lent 1.000 s < own 2.000 s") for it in range(11, 18)),
        (18, False, "own last measured at iteration 9: measured again"),
        (19, True, "lent 1.000 s < own 2.000 s"),
    ]
    runs = {"lent": 0, "own": 0}
    for it, lent, why in want:
        assert lending.lend(it) == {"lent": lent, "why": why, "replicas": 2 if lent else 1}, it
        assert cluster.lending is lent
        if it == 10:
            seconds["lent"] = 1.0
        way = "lent" if lent else "own"
        runs[way] += 1
        assert lending.give_back(it, seconds[way]) == {"rollout_s": seconds[way]}
        assert cluster.lending is False
        if runs[way] == 1:  # the way's warm-up: not recorded
            assert way not in lending.auto.last, (it, lending.auto)
        else:
            assert lending.auto.last[way] == seconds[way] and lending.auto.measured_at[way] == it, (it, lending.auto)
    assert lending.auto.last == {"lent": 1.0, "own": 2.0} and lending.auto.measured_at == {"lent": 19, "own": 18}


def test_lend_rollout_lends_every_iteration():
    from recipes.elastic.lending import Lending

    cluster = LendingCluster()
    lending = Lending(cluster, "rollout")
    for it in range(3):
        assert lending.lend(it) == {"lent": True, "why": "lend: rollout", "replicas": 2}
        assert cluster.lending is True
        lending.give_back(it, 1.5)
        assert cluster.lending is False
    assert lending.auto.last == {"lent": 1.5} and lending.auto.measured_at == {"lent": 2}


@pytest.mark.slow
@pytest.mark.vllm
def test_auto_moves_devices_each_way_where_it_last_paid(ray_session, tmp_path):
    """``rebalance: auto`` and ``lend: auto`` in one real run (one trainer rank, one replica of
    its own, one lent the trainer's device). The update: the trainer's own world trains while the
    grown one builds (iteration 0 waits 10 s in its train phase, so the build is done after it);
    the first iteration after that grows to measure the grown way, and each later one takes the way
    its record says; every move is a whole round trip. The rollout: iteration 0 lends the trainer's
    device (both replicas generate), iteration 1 too (the first was its warm-up), iterations 2 and 3
    do not, then the faster way. The stale-weights
    check passes throughout — the lent replica is fed by every sync, as the other is."""
    import time

    from recipes.common import warm_start
    from recipes.train import run

    cfg = tiny("grpo_tiny_async.yaml", world_size=1, output_dir=str(tmp_path / "run"),
               **{"train.dp": 1, "reference.dp": 1, "rollout.dp": 1, "eval.num_prompts": 16,
                  "algorithm.off_policy": None, "elastic": {"rebalance": "auto", "lend": "auto"}})
    shutil.copytree(warm_start(load_config(cfg), tmp_path / "init", quiet=True), tmp_path / "run" / "init")

    def wait_for_the_build(it, phase, cluster):
        if (it, phase) == (0, "train"):
            time.sleep(10)

    recs = [r for r in run(cfg, iterations=5, quiet=True, phase_hook=wait_for_the_build) if "reward_mean" in r]
    reb = [r["rebalance"] for r in recs]
    grown = [x["grown"] for x in reb]
    assert any(grown) and "no warm measurement of grown yet" in reb[grown.index(True)]["why"], reb
    for x in reb:
        assert x["world"] == (2 if x["grown"] else 1), x
        if x["grown"]:
            assert x["grow"]["bytes_moved"] == x["shrink"]["bytes_moved"] > 0, x
    assert all(r["stale_check_passed"] and r["stale_logprob_diff"] < 1e-4 for r in recs), recs
    lend = [r["lend"] for r in recs]  # each way twice (a warm-up, then a warm measurement)
    assert [(x["lent"], x["replicas"]) for x in lend[:4]] == [(True, 2), (True, 2), (False, 1), (False, 1)], lend
    assert lend[4]["lent"] == (lend[1]["rollout_s"] < lend[3]["rollout_s"]), lend
    assert all(x["replicas"] == (2 if x["lent"] else 1) for x in lend), lend
