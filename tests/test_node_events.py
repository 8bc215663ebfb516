"""Nodes added to or lost from Ray during a run: events, and with
``elastic.on_node_change: resize`` a node added grows the run through the resize-request path.

- ``rlhf_switch.elastic.nodes`` (pure): two snapshots of ``ray.nodes()`` compared; the request a
  grown cluster makes (layouts scaled along DP), checked by ``problems.check_resize_request``.
- The loop's watch (``recipes.elastic.nodes.watch_nodes``) on plain ``ray.nodes()``-shaped lists: every
  change an ``event`` record, a node added a request in the run's mailbox (or not, and why).
- Nodes started as an operator starts them (``tests/ray_nodes.py``: ``ray start`` processes with
  environments of their own, 2 CPUs and 2 logical GPUs each; slow): GRPO (ZeRO-3 DP2, torch
  rollout) joins the head by the config's ``ray_address`` and starts on its two devices; a second
  node joins (``ray start --address``) while iteration 0 trains; the loop records ``node_added``
  before iteration 1, requests 4 devices, builds DP4 during iteration 1 and commits it before
  iteration 2, and the run finishes on both nodes.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from rlhf_switch.elastic.nodes import cluster_devices, grown_request, node_changes, snapshot

HERE = Path(__file__).resolve().parent
A, B, C = "a" * 56, "b" * 56, "c" * 56


def node(nid: str, alive: bool = True, gpus: float = 2, cpus: float = 4) -> dict:
    """One entry as ``ray.nodes()`` gives it (the keys read here)."""
    return {"NodeID": nid, "Alive": alive, "Resources": {"CPU": cpus, "GPU": gpus, f"node:{nid[:4]}": 1.0}}


def test_node_changes_between_two_snapshots():
    one = snapshot([node(A)])
    two = snapshot([node(A), node(B, gpus=4, cpus=3)])
    assert cluster_devices(one) == 2 and cluster_devices(two) == 2 + 3  # a device: 1 CPU + 1 GPU
    assert node_changes(one, one) == []
    (added,) = node_changes(one, two)
    assert (added.kind, added.node_id, added.devices, added.gpus, added.cpus) == ("node_added", B, 3, 4, 3)
    dead_b = snapshot([node(A), node(B, alive=False)])
    (lost,) = node_changes(two, dead_b)
    assert (lost.kind, lost.node_id, lost.devices) == ("node_lost", B, 3)  # its devices as last seen alive
    assert node_changes(two, snapshot([node(A)])) == [lost]                # gone from the list: lost too
    assert node_changes(dead_b, dead_b) == [] and node_changes(one, dead_b) == []  # joins dead: no change
    assert [c.kind for c in node_changes(dead_b, two)] == ["node_added"]   # back alive: added
    both = node_changes(two, snapshot([node(B, gpus=4, cpus=3), node(C, gpus=1)]))
    assert [(c.kind, c.node_id) for c in both] == [("node_added", C), ("node_lost", A)]
    assert cluster_devices(snapshot([node(A, gpus=0)])) == 0  # a CPU-only node holds no device


def _config(out: Path, world: int) -> dict:
    sys.path.insert(0, str(HERE))
    from test_elastic import _config as elastic_config

    cfg = elastic_config(out, world)
    cfg["algorithm"].update(iterations=3, prompts_per_iteration=4, micro_batch_size=2)  # fits DP2 and DP4
    return cfg


def test_the_grown_request_scales_dp_and_goes_through_the_request_checks(tmp_path):
    from rlhf_switch.problems import check_resize_request
    from rlhf_switch.rl.config import ConfigError, load_config

    cfg = load_config({**_config(tmp_path, 2), "elastic": {"on_node_change": "resize"}})
    assert load_config({**_config(tmp_path, 2), "elastic": {}}).elastic.on_node_change == "record"
    with pytest.raises(ConfigError, match="on_node_change"):  # before Ray: one ConfigError
        load_config({**_config(tmp_path, 2), "elastic": {"on_node_change": "grow"}})
    from rlhf_switch.problems import run_problems

    replicas = load_config({**_config(tmp_path, 2), "elastic": {"on_node_change": "resize"},
                            "rollout": {"engine": "vllm", "tp": 1, "dp": 2}})
    problems = [p for p in run_problems(replicas, skip=("reward", "prompts")) if "on_node_change: resize" in p]
    assert problems and "only a rollout engine in the trainer's actors" in problems[0], problems
    # with redundancy: host a node added is a request as any (the schedule path takes redundancy)
    kept = load_config({**_config(tmp_path, 2), "elastic": {"on_node_change": "resize", "redundancy": "host"}})
    now = {k: getattr(cfg, k).model_dump() for k in ("train", "rollout")} | {"reference": None}
    req = grown_request(now, 4)
    assert (req["world_size"], req["train"]["dp"], req["rollout"]["dp"], req["train"]["zero_stage"]) == (4, 4, 4, 3)
    assert "reference" not in req
    new, entry = check_resize_request(cfg, {"id": "n", "reason": "node_added", **req}, 1, 2, 4)
    assert (entry.iteration, new.at_iteration(1).train.dp, new.at_iteration(1).rollout.dp) == (1, 4, 4)
    assert check_resize_request(kept, {"id": "n", **req}, 1, 2, 4)[1].world_size == 4
    with pytest.raises(ConfigError, match="resize request refused") as e:  # a world of 1 keeps no copy
        check_resize_request(kept, {"id": "n", **grown_request(now, 1)}, 1, 2, 4)
    assert any("redundancy: host needs every world of the run >= 2" in p for p in e.value.problems), e.value.problems
    # 3 devices: DP3 does not divide the 16 samples' mini-batch of 8 — the config's own message
    with pytest.raises(ConfigError, match="resize request refused") as e:
        check_resize_request(cfg, {"id": "n", **grown_request(now, 3)}, 1, 2, 3)
    assert any("elastic.schedule[0]" in p for p in e.value.problems), e.value.problems
    tp2 = {**now, "train": {**now["train"], "engine": "megatron", "tp": 2, "dp": 1}}
    assert grown_request(tp2, 4)["train"] == {**tp2["train"], "dp": 2}  # along DP, tp kept


class Nodes:
    """What ``watch_nodes`` asks of Ray: ``nodes()``, here a list the test sets."""

    def __init__(self, *entries):
        self.entries = list(entries)

    def nodes(self):
        return list(self.entries)


def test_the_loop_watch_records_every_change_and_requests_a_resize_for_a_node_added(tmp_path):
    from recipes.elastic.nodes import watch_nodes
    from rlhf_switch.elastic import requests
    from rlhf_switch.rl.config import load_config

    said: list[str] = []
    ray = Nodes(node(A, cpus=2))
    for mode in ("record", "resize"):
        out = tmp_path / mode
        out.mkdir()
        cfg = load_config({**_config(out, 2), "elastic": {"on_node_change": mode}})
        seen = snapshot(ray.nodes())
        ray.entries = [node(A, cpus=2)]
        seen, notes = watch_nodes(out, cfg, seen, ray, 1, said.append)
        assert notes == []
        ray.entries = [node(A, cpus=2), node(B, cpus=2)]
        seen, notes = watch_nodes(out, cfg, seen, ray, 1, said.append)
        (ev,) = [n["event"] for n in notes if n["iteration"] == 1]
        assert (ev["kind"], ev["node_id"], ev["devices"], ev["cluster_devices"]) == ("node_added", B, 2, 4)
        assert (ev["old"], ev["new"]) == ("2 devices", "4 devices")
        pending = requests.take_request(out)
        if mode == "record":
            assert pending is None and ev["action"].startswith("recorded")
        else:
            assert ev["action"].startswith("resize requested: 4 devices") and pending["id"] == ev["request"]
            assert (pending["reason"], pending["world_size"], pending["train"]["dp"], pending["rollout"]["dp"]) == (
                "node_added", 4, 4, 4)
        ray.entries = [node(A, cpus=2), node(B, alive=False)]
        seen, notes = watch_nodes(out, cfg, seen, ray, 2, said.append)
        (ev,) = [n["event"] for n in notes]
        assert ev["kind"] == "node_lost" and "redundancy: host" in ev["action"] and ev["cluster_devices"] == 2
        assert requests.take_request(out) is None  # a node lost is only recorded
    # a node added while another request waits: that one goes first, this one says why not
    out = tmp_path / "resize"
    requests.request_resize(out, world_size=2, train={"engine": "deepspeed", "zero_stage": 3, "dp": 2},
                            rollout={"engine": "torch", "tp": 1, "dp": 2})
    ray.entries = [node(A, cpus=2), node(C, cpus=2)]
    _, notes = watch_nodes(out, cfg, snapshot([node(A, cpus=2)]), ray, 1, said.append)
    assert notes[0]["event"]["action"].startswith("no resize:") and "still waiting" in notes[0]["event"]["action"]
    assert any("node added before iteration 1" in s for s in said)


@pytest.fixture(scope="module")
def head_node():
    """One node started as an operator starts it (``ray_nodes.operator_cluster``; 2 CPUs, 2 logical
    GPUs: 2 devices); the test adds the second. Stopped at module end."""
    from ray_nodes import operator_cluster

    with operator_cluster(1) as nodes:
        yield nodes


@pytest.mark.slow
def test_a_node_added_during_a_grpo_run_grows_it_dp2_to_dp4(head_node, tmp_path):
    from PIL import Image

    from recipes.grpo import run
    from rlhf_switch.elastic.requests import read_answer
    from helpers import records

    nodes = head_node
    out = tmp_path / "grow"
    cfg = {**_config(out, 2), "ray_address": nodes.address}
    cfg["elastic"] = {"on_node_change": "resize"}
    seen = {}

    def hook(it, phase, cluster):
        # a node joins while iteration 0 trains (seen at its end, once Ray reports it)
        if it == 0 and phase == "train":
            seen["head"] = nodes.node_id(cluster.ray, nodes.head)
            seen["added"] = nodes.wait_seen(cluster.ray, nodes.add())

    recs = run(cfg, quiet=True, phase_hook=hook)
    (added,) = [r for r in recs if r.get("event", {}).get("kind") == "node_added"]
    ev = added["event"]
    assert added["iteration"] == 1 and ev["node_id"] == seen["added"] != seen["head"], (ev, seen)
    assert (ev["devices"], ev["cluster_devices"]) == (2, 4) and ev["action"].startswith("resize requested: 4"), ev
    (resize,) = [r for r in recs if "resize" in r]
    r = resize["resize"]
    assert resize["iteration"] == 2 and (r["kind"], r["reason"]) == ("requested", "node_added"), r
    assert "abandoned" not in r and r["bytes_moved"] > 0 and r["iterations_during_build"] == 1, r
    assert "world 2" in r["old"] and "world 4" in r["new"] and "'dp': 4" in r["new"], r
    assert read_answer(out)["status"] == "done"
    steps = [x for x in recs if "reward_mean" in x]
    assert [x["iteration"] for x in steps] == [0, 1, 2] and all(x["stale_check_passed"] for x in steps)
    where = next(x["channel"]["nodes"] for x in records(out) if "channel" in x)
    assert len({m["node_id"] for m in where["trainers"]}) == 2, where  # DP4 on both nodes
    described = Image.open(out / "grpo.png").text["Description"]
    assert "iteration 1: node added" in described and "iteration 2: requested resize" in described, described
    print(f"node added before iteration 1; resized before 2: background {r['background_s']:.1f} s, "
          f"waited {r['waited_for_build_s']:.1f} s, stop-the-world {r['stop_the_world_s']:.2f} s, "
          f"{r['bytes_moved']} B")
