"""Nodes added to or lost from the Ray cluster, seen by comparing two snapshots of ``ray.nodes()``.

The loop (``recipes/loop.py``) takes a snapshot when it starts and one at every iteration
boundary of a run with an ``elastic`` block; each change becomes an ``event`` record
(``node_added`` / ``node_lost``, drawn on the run's PNG). With ``elastic.on_node_change: resize``
a node added also becomes a resize request (``scaled_request``) that goes through the same
mailbox and checks as one from ``requests.request_resize``. A node lost takes its trainers with
it: ``elastic.redundancy: host``'s recovery (``recovery.py``) restores them onto the devices left,
a smaller world with the same layouts scaled along DP (``scaled_request`` too) when a lost rank's
device is gone with the node; the ``node_lost`` record says what was done.

Everything here is pure (lists of dicts in, dicts out): no Ray.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence


@dataclass(frozen=True)
class NodeChange:
    kind: str           # "node_added" or "node_lost"
    node_id: str
    devices: int        # the node's logical devices (one bundle of 1 CPU + 1 GPU each)
    gpus: float
    cpus: float


def node_devices(resources: Mapping[str, Any]) -> int:
    """How many of the device manager's bundles (``manager.DEVICE``: 1 CPU + 1 GPU) a node's
    resources hold."""
    return int(min(float(resources.get("GPU", 0)), float(resources.get("CPU", 0))))


def snapshot(nodes: Sequence[Mapping[str, Any]]) -> dict[str, dict]:
    """``ray.nodes()`` as {node id: {"alive", "gpus", "cpus", "devices"}}."""
    out = {}
    for n in nodes:
        res = n.get("Resources") or {}
        out[str(n["NodeID"])] = {"alive": bool(n.get("Alive")), "gpus": float(res.get("GPU", 0)),
                                 "cpus": float(res.get("CPU", 0)), "devices": node_devices(res)}
    return out


def cluster_devices(snap: Mapping[str, Mapping]) -> int:
    """The devices of the alive nodes of a snapshot."""
    return sum(n["devices"] for n in snap.values() if n["alive"])


def node_changes(before: Mapping[str, Mapping], after: Mapping[str, Mapping]) -> list[NodeChange]:
    """The nodes alive in ``after`` and not in ``before`` (added) and those alive in ``before``
    and dead or gone in ``after`` (lost), in node id order, added first. A node that was already
    dead, or that joins dead, is no change; a dead node that comes back alive is added."""
    def alive(snap, nid):
        return nid in snap and snap[nid]["alive"]

    def change(kind, n, nid):
        return NodeChange(kind, nid, n["devices"], n["gpus"], n["cpus"])

    added = [change("node_added", after[nid], nid) for nid in sorted(after)
             if alive(after, nid) and not alive(before, nid)]
    lost = [change("node_lost", before[nid], nid) for nid in sorted(before)
            if alive(before, nid) and not alive(after, nid)]
    return added + lost


def scaled_request(now: Mapping[str, Any], world: int) -> dict:
    """A resize request (``requests.request_resize``'s keyword arguments) for a world of
    ``world`` devices, more (a node added) or fewer (a node lost) than ``now``'s, from the config
    in force ``now`` (``RunConfig.at_iteration(...).model_dump()``): the train, rollout,
    reference and critic layouts scaled along DP (``rl.config.scaled_along_dp``). Not checked here: a layout that does not
    scale (``tp·pp`` not dividing ``world``) or a batch the new DP does not divide is refused by
    ``problems.check_resize_request`` / ``problems.scaled_run`` with the config's own messages."""
    from ..rl.config import scaled_along_dp

    return scaled_along_dp(now, world)


grown_request = scaled_request  # a node added: the name the loop's watch and its tests use
