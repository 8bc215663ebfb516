"""Ray's nodes watched at each iteration boundary (``elastic.on_node_change``): a node added or lost
becomes a run-log event; with ``resize``, a node added becomes a resize request to every device
now available (``rlhf_switch.elastic.nodes`` compares the snapshots)."""
from __future__ import annotations

from pathlib import Path


def snapshot_nodes(ray) -> dict:
    from rlhf_switch.elastic.nodes import snapshot

    return snapshot(ray.nodes())



def watch_nodes(out_dir: Path, cfg, seen: dict, ray, it: int, say, recovered: list[dict] = ()) -> tuple[dict, list[dict]]:
    """At the boundary before iteration ``it``: Ray's nodes compared with ``seen``; every node
    added or lost is an ``event`` record. With ``elastic.on_node_change: resize`` a node added is
    also a resize request to every device now available (layouts scaled along DP), written to the
    run's mailbox as ``requests.request_resize`` writes one: the controller checks it right after,
    as any request (refused with the config's messages, or a schedule entry at ``it + 1``). A node
    lost took its trainers with it: its record says what the recovery since the last watch
    (``recovered``, the recovery events naming the node) did with them. Returns the new snapshot
    and the records."""
    from rlhf_switch.elastic import nodes

    now = nodes.snapshot(ray.nodes())
    changes = nodes.node_changes(seen, now)
    if not changes:
        return now, []
    before, total = nodes.cluster_devices(seen), nodes.cluster_devices(now)
    notes = []
    for c in changes:
        ev = {"kind": c.kind, "node_id": c.node_id, "devices": c.devices, "gpus": c.gpus, "cpus": c.cpus,
              "cluster_devices": total, "old": f"{before} devices", "new": f"{total} devices"}
        if c.kind == "node_lost":
            done = [r for r in recovered if any(c.node_id[:8] in n.split()[-1] for n in r.get("lost_nodes", ()))]
            if done:  # rank_nodes names a node "address id[:8]"
                ev["action"] = f"trainer rank(s) {done[-1]['lost_ranks']} lost with it: {done[-1]['action']}"
            else:
                ev["action"] = "recorded (a lost trainer is elastic.redundancy: host's job)"
        notes.append({"iteration": it, "event": ev})
        say(f"{c.kind.replace('_', ' ')} before iteration {it}: {c.node_id[:12]} ({c.devices} devices); "
            f"the cluster has {total} devices")
    added = [n for n in notes if n["event"]["kind"] == "node_added"]
    if added:
        _answer_node_added(added[-1]["event"], out_dir, cfg, it, total)
    return now, notes



def _answer_node_added(ev: dict, out_dir: Path, cfg, it: int, total: int) -> None:
    """``ev``'s action for a node added: recorded, or a resize request to all ``total`` devices."""
    from rlhf_switch.elastic import ResizeError, nodes, requests

    target = cfg.at_iteration(it + 1)  # the world in force after this boundary (a due entry included)
    if cfg.elastic.on_node_change != "resize":
        ev["action"] = "recorded (elastic.on_node_change: record)"
    elif total <= target.world_size:
        ev["action"] = f"no resize: the run already uses {target.world_size} devices"
    else:
        dumped = {k: (getattr(target, k).model_dump() if getattr(target, k) is not None else None)
                  for k in ("train", "rollout", "reference")}
        try:
            rid = requests.request_resize(out_dir, reason="node_added", **nodes.grown_request(dumped, total))
            ev["action"] = f"resize requested: {total} devices (request {rid})"
            ev["request"] = rid
        except ResizeError as e:  # another request waits in the mailbox: that one goes first
            ev["action"] = f"no resize: {e}"

