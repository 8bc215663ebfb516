"""A node lost with trainers on it: ``elastic.redundancy: host`` restores them onto
the devices left — a smaller world, the layouts scaled along DP — when theirs are gone.

- Pure: the scaled request for fewer devices (``nodes.scaled_request``), the config it makes,
  checked as the config is (``requests.scaled_config``: a batch the new DP does not divide, a
  world too small for a buddy, one ``ConfigError``), ``Devices.renumber``, and the loop's node
  watch naming what a recovery did with a lost node's trainers.
- A real Ray cluster of two nodes on this machine (``ray.cluster_utils.Cluster``, 2 CPUs and 2
  logical GPUs each; slow): GRPO ZeRO-3 DP4 with ``redundancy: host`` on all four devices; the
  second node is removed (its trainers' processes ``kill -9``'d, then ``remove_node``, not
  graceful: its raylet and the rest killed) as iteration 1's train phase starts. Its placement groups cannot be placed again (the head has no
  free device), so the loop shrinks to DP2 on the head's two devices, restores the state of
  iteration 1's refresh from the head ranks' host copies (the buddies were on the other node)
  bit for bit, runs iteration 1 again and ends at iteration 2 with no checkpoint.
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
    from rlhf_switch.elastic.requests import scaled_config
    from rlhf_switch.rl.config import ConfigError, load_config

    cfg = load_config(_config(tmp_path, 4))
    now = cfg.model_dump()
    req = scaled_request(now, 2)
    assert (req["world_size"], req["train"]["dp"], req["rollout"]["dp"], req["train"]["zero_stage"]) == (2, 2, 2, 3)
    assert grown_request is scaled_request
    tp2 = {**now, "train": {**now["train"], "engine": "megatron", "tp": 2, "dp": 2}}
    assert scaled_request(tp2, 2)["train"] == {**tp2["train"], "dp": 1}  # along DP, tp kept
    small = scaled_config(cfg, 2)
    assert (small.world_size, small.train.dp, small.rollout.dp) == (2, 2, 2)
    assert small.elastic.redundancy == "host" and small.seed == cfg.seed and small.algorithm == cfg.algorithm
    # 3 devices: DP3 does not divide the batch; 1 device: no other rank to keep a copy
    for world, want in ((3, "divide"), (1, "world_size >= 2")):
        with pytest.raises(ConfigError, match=f"no {world}-device world") as e:
            scaled_config(cfg, world)
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
    from recipes.elastic_control import watch_nodes
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
    """A Ray cluster of two nodes (2 CPUs, 2 logical GPUs each: 2 devices each) on this machine,
    its driver connected; yields (ray, the cluster, the second node's handle)."""
    from helpers import ray_cluster

    with ray_cluster(2, cpus=2, gpus=2) as (ray, cluster, (second,)):
        yield ray, cluster, second


@pytest.mark.slow
def test_a_node_lost_shrinks_grpo_dp4_to_dp2_on_the_survivors_without_a_checkpoint(two_nodes, tmp_path):
    import os
    import signal

    from test_elastic import _differences, _gathered
    from helpers import records

    from recipes.grpo import run

    ray, ray_cluster, second = two_nodes
    head = {n["NodeID"] for n in ray.nodes() if n["Alive"]} - {second.node_id}
    out = tmp_path / "shrink"
    seen: dict = {}

    def remove_in_train(it, phase, cluster):
        if it != 1:
            return
        seen.setdefault("states", []).append(_gathered(ray, cluster.workers))
        if len(seen["states"]) == 1:  # as iteration 1's train phase starts: synced, copied, generated
            seen["ranks_on_it"] = [r for r, n in enumerate(cluster.rank_nodes()) if second.node_id[:8] in n]
            # the node goes as a machine does: its trainers' processes with it (kill -9), then its
            # raylet and the rest; a worker left running would hold its peers in the step's
            # collective until the gloo timeout (120 s) before they fail
            pids = ray.get([cluster.workers[r].pid.remote() for r in seen["ranks_on_it"]], timeout=60)
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            ray_cluster.remove_node(second, allow_graceful=False)

    recs = run(_config(out, 4), quiet=True, phase_hook=remove_in_train)
    assert len(seen["ranks_on_it"]) == 2, seen  # DP4 on both nodes: two ranks each
    (event,) = [r["recovery"] for r in recs if "recovery" in r]
    assert event["kind"] == "trainer_lost" and event["lost_ranks"] == seen["ranks_on_it"], event
    assert len(event["devices_gone"]) == 2 and event["new_world"] == 2 and "fell_back_to" not in event, event
    assert "world 4" in event["old"] and "'dp': 4" in event["old"], event
    assert "world 2" in event["new"] and "'dp': 2" in event["new"] and "shrunk" in event["new"], event
    assert event["restored_iteration"] == 1 and event["bytes_moved"] > 0
    (lost,) = [r for r in recs if r.get("event", {}).get("kind") == "node_lost"]
    assert lost["iteration"] == 1 and lost["event"]["node_id"] == second.node_id, lost
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
    assert len(where["trainers"]) == 2 and {m["node_id"] for m in where["trainers"]} <= head, where
    print(f"\nnode lost in iteration 1's train phase: ranks {event['lost_ranks']} lost, DP4 -> DP2 in "
          f"{event['seconds']:.1f} s (detect {event['detect_s']:.1f} of which probe {event['probe_s']:.1f}, build {event['build_s']:.1f}, move "
          f"{event['move_s']:.2f} s), {event['bytes_moved']} B from the host copies")
