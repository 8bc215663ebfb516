"""A node lost with trainers on it: ``elastic.redundancy: host`` restores them onto
the devices left — a smaller world, the layouts scaled along DP — when theirs are gone.

- Pure: the scaled request for fewer devices (``nodes.scaled_request``), the config it makes,
  checked as the config is (``problems.scaled_run``: a batch the new DP does not divide, a
  world too small for a buddy, one ``ConfigError``), ``Devices.renumber``, and the loop's node
  watch naming what a recovery did with a lost node's trainers.
- Two nodes started as an operator starts them (``tests/ray_nodes.py``: ``ray start`` processes
  with environments of their own, 2 CPUs and 2 logical GPUs each; slow): GRPO ZeRO-3 DP4 with
  ``redundancy: host`` joins them by the config's ``ray_address`` and runs on all four devices;
  the second node goes as a machine does (every process of it — raylet, trainers, the rest —
  ``kill -9``'d at once) as iteration 1's train phase starts. Its placement groups cannot be
  placed again (the head has no free device), so the loop shrinks to DP2 on the head's two
  devices, restores the state of iteration 1's refresh from the head ranks' host copies (the
  buddies were on the other node) bit for bit, runs iteration 1 again and ends at iteration 2
  with no checkpoint.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def _config(out: Path, world: int) -> dict:
    sys.path.insert(0, str(HERE))
    from test_node_events import _config as node_config

    cfg = node_config(out, world)  # ZeRO-3, torch rollout, 4 prompts of 4 samples: fits DP4 and DP2
    cfg["elastic"] = {"redundancy": "host"}
    return cfg


def test_the_scaled_request_shrinks_along_dp_and_the_smaller_config_is_checked(tmp_path):
    from rlhf_switch.elastic.nodes import grown_request, scaled_request
    from rlhf_switch.problems import scaled_run
    from rlhf_switch.rl.config import ConfigError, load_config

    cfg = load_config(_config(tmp_path, 4))
    now = cfg.model_dump()
    req = scaled_request(now, 2)
    assert (req["world_size"], req["train"]["dp"], req["rollout"]["dp"], req["train"]["zero_stage"]) == (2, 2, 2, 3)
    assert grown_request is scaled_request
    tp2 = {**now, "train": {**now["train"], "engine": "megatron", "tp": 2, "dp": 2}}
    assert scaled_request(tp2, 2)["train"] == {**tp2["train"], "dp": 1}  # along DP, tp kept
    small = scaled_run(cfg, 2)
    assert (small.world_size, small.train.dp, small.rollout.dp) == (2, 2, 2)
    assert small.elastic.redundancy == "host" and small.seed == cfg.seed and small.algorithm == cfg.algorithm
    # 3 devices: DP3 does not divide the batch; 1 device: no other rank to keep a copy
    for world, want in ((3, "divide"), (1, "world_size >= 2")):
        with pytest.raises(ConfigError, match=f"no {world}-device world") as e:
            scaled_run(cfg, world)
        assert any(want in p for p in e.value.problems), e.value.problems


def test_devices_renumber_keeps_the_world_on_0_to_n():
    from rlhf_switch.elastic.manager import Devices
    from rlhf_switch.elastic.plan import ResizeError

    devices = Devices(None)
    devices.groups = {0: "pg0", 1: "pg1", 2: "pg2", 3: "pg3"}
    with pytest.raises(ResizeError, match=r"devices \[2\] are still held"):
        devices.renumber([3, 0, 1])
    devices.groups.pop(2)
    devices.renumber([1, 3, 0])
    assert devices.groups == {0: "pg1", 1: "pg3", 2: "pg0"}


def test_the_node_lost_record_says_what_the_recovery_did(tmp_path):
    from recipes.elastic.nodes import watch_nodes
    from rlhf_switch.elastic.nodes import snapshot
    from rlhf_switch.rl.config import load_config
    from test_node_events import Nodes, node

    a, b = "a" * 56, "b" * 56
    cfg = load_config(_config(tmp_path, 4))
    ray = Nodes(node(a, cpus=2))
    seen = snapshot([node(a, cpus=2), node(b, cpus=2)])
    recovered = [{"kind": "trainer_lost", "lost_ranks": [1, 3], "lost_nodes": [f"10.0.0.2 {b[:8]}"],
                  "action": "recovered to 2 devices from the host copies (a smaller world)"}]
    _, notes = watch_nodes(tmp_path, cfg, seen, ray, 1, lambda s: None, recovered)
    (ev,) = [n["event"] for n in notes]
    assert ev["kind"] == "node_lost" and ev["node_id"] == b and ev["cluster_devices"] == 2
    assert ev["action"] == "trainer rank(s) [1, 3] lost with it: recovered to 2 devices from the host copies " \
                          "(a smaller world)"
    _, notes = watch_nodes(tmp_path, cfg, seen, ray, 1, lambda s: None, [])  # no trainer of it
    assert notes[0]["event"]["action"].startswith("recorded")


@pytest.fixture(scope="module")
def two_nodes():
    """Two nodes started as an operator starts them (``ray_nodes.operator_cluster``; 2 CPUs, 2
    logical GPUs each: 2 devices each). Stopped at module end."""
    from ray_nodes import operator_cluster

    with operator_cluster(2) as nodes:
        yield nodes


@pytest.mark.slow
def test_a_node_lost_shrinks_grpo_dp4_to_dp2_on_the_survivors_without_a_checkpoint(two_nodes, tmp_path):
    from test_elastic import _differences, _gathered
    from helpers import records

    from recipes.grpo import run

    nodes = two_nodes
    second = nodes.workers[0]
    out = tmp_path / "shrink"
    seen: dict = {}

    def remove_in_train(it, phase, cluster):
        if it != 1:
            return
        ray = cluster.ray
        seen.setdefault("states", []).append(_gathered(ray, cluster.workers))
        if len(seen["states"]) == 1:  # as iteration 1's train phase starts: synced, copied, generated
            seen["head"] = nodes.node_id(ray, nodes.head)
            seen["second"] = nodes.node_id(ray, second)
            seen["ranks_on_it"] = [r for r, n in enumerate(cluster.rank_nodes()) if seen["second"][:8] in n]
            # the node goes as a machine does: its raylet, its trainers' processes and the rest at
            # once (a worker left running would hold its peers in the step's collective until the
            # gloo timeout, 120 s, before they fail)
            nodes.kill(second)

    recs = run({**_config(out, 4), "ray_address": nodes.address}, quiet=True, phase_hook=remove_in_train)
    assert len(seen["ranks_on_it"]) == 2, seen  # DP4 on both nodes: two ranks each
    (event,) = [r["recovery"] for r in recs if "recovery" in r]
    assert event["kind"] == "trainer_lost" and event["lost_ranks"] == seen["ranks_on_it"], event
    assert len(event["devices_gone"]) == 2 and event["new_world"] == 2 and "fell_back_to" not in event, event
    assert "world 4" in event["old"] and "'dp': 4" in event["old"], event
    assert "world 2" in event["new"] and "'dp': 2" in event["new"] and "shrunk" in event["new"], event
    assert event["restored_iteration"] == 1 and event["bytes_moved"] > 0
    (lost,) = [r for r in recs if r.get("event", {}).get("kind") == "node_lost"]
    assert lost["iteration"] == 1 and lost["event"]["node_id"] == seen["second"], lost
    assert lost["event"]["action"].startswith(f"trainer rank(s) {seen['ranks_on_it']} lost with it: recovered "
                                              f"to 2 devices"), lost
    # the state at the re-run's train phase (DP2, restored from the host copies) is the state at
    # the first attempt's (DP4, as refreshed): bit for bit
    assert len(seen["states"]) == 2 and _differences(*seen["states"]) == []
    steps = [r for r in recs if "reward_mean" in r]
    assert [r["iteration"] for r in steps] == [0, 1, 2] and all(r["stale_check_passed"] for r in steps)
    assert all(r["redundancy_bytes"] > 0 for r in steps)
    assert not (out / "checkpoints").exists()
    where = next(x["channel"]["nodes"] for x in records(out) if "channel" in x)
    assert len(where["trainers"]) == 2 and {m["node_id"] for m in where["trainers"]} == {seen["head"]}, where
    print(f"\nnode lost in iteration 1's train phase: ranks {event['lost_ranks']} lost, DP4 -> DP2 in "
          f"{event['seconds']:.1f} s (detect {event['detect_s']:.1f} of which probe {event['probe_s']:.1f}, build {event['build_s']:.1f}, move "
          f"{event['move_s']:.2f} s), {event['bytes_moved']} B")
