"""Where a run's actors go: one placement-group bundle per logical device, each actor's slot in it
(``resources``), and rank -> bundle (``rank_bundles``: a rollout replica's TP ranks on one node).
Pure: nothing here talks to Ray."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Slot:
    """Where one actor goes: a placement-group bundle and what it takes of it."""

    bundle: int
    num_cpus: float
    num_gpus: float


@dataclass(frozen=True)
class Resources:
    """The placement group of a run and every actor's slot in it (``resources``)."""

    bundles: tuple[dict, ...]
    workers: tuple[Slot, ...]                    # one hybrid worker per trainer rank
    replicas: tuple[Slot, ...]                   # one actor per rollout replica (placement "replica")
    replica_devices: tuple[tuple[int, ...], ...]  # colocated: the bundles whose devices replica r's workers use

    @property
    def devices(self) -> int:
        return int(sum(b.get("GPU", 0) for b in self.bundles))

    @property
    def cpus(self) -> float:
        return float(sum(b.get("CPU", 0) for b in self.bundles))


# what a rollout replica started while the old replicas still run takes of its first device's bundle
# (CPU, GPU): that bundle's trainer rank (0.5, 0.5) and old replica (0.4, 0.5) leave (0.1, 0) free
TRANSITION_SLOT = (0.1, 0.0)


# what a replica lent the trainer's devices (elastic.lend) takes of its first device's bundle (CPU,
# GPU): the trainer rank there holds (0.5, 1.0) when the replicas have devices of their own; the
# GPUs are handed to it by id, as a colocated replica's are
LENT_SLOT = (0.4, 0.0)


def resources(world: int, tp: int, replica_placement: bool, colocate: bool = True, lend: bool = False) -> Resources:
    """The bundles and actor slots of a run of ``world`` trainer devices whose rollout engine runs
    replicas of TP ``tp`` (``replica_placement``: in actors of their own, vLLM; else inside the
    hybrid workers). Pure.

    Colocated (the default): one bundle per device; its hybrid worker and (placement replica) the
    replica that starts on it take half each, and replica ``r``'s TP workers use the ``tp`` whole
    devices of bundles ``r·tp .. r·tp+tp-1`` (a Ray actor holds a share of ONE bundle, so those
    devices are handed to it, ``replica_devices``). Not colocated: the trainer's devices, then one
    bundle of ``tp`` devices per replica, all its own; ``lend`` (``elastic.lend``): after those
    replicas, as many again on the trainer's devices — each beside the trainer rank of its first
    device (``LENT_SLOT``), its TP workers handed that rank's and the next ones' devices as a
    colocated replica's are."""
    device = {"CPU": 1, "GPU": 1}
    workers = tuple(Slot(i, 0.5, 0.5 if colocate else 1.0) for i in range(world))
    if not replica_placement:
        return Resources((device,) * world, workers, (), ())
    n = world // tp
    if colocate:
        replicas = tuple(Slot(r * tp, 0.4, 0.5) for r in range(n))
        return Resources((device,) * world, workers, replicas,
                         tuple(tuple(range(r * tp, (r + 1) * tp)) for r in range(n)))
    replicas = tuple(Slot(world + r, 1, tp) for r in range(n))
    bundles = (device,) * world + ({"CPU": 1, "GPU": tp},) * n
    if not lend:
        return Resources(bundles, workers, replicas, ())
    lent = tuple(Slot(r * tp, *LENT_SLOT) for r in range(n))
    return Resources(bundles, workers, replicas + lent,
                     ((),) * n + tuple(tuple(range(r * tp, (r + 1) * tp)) for r in range(n)))


def lent_replicas(res: Resources, world: int, colocate: bool) -> list[int]:
    """The replicas of ``res`` on the trainer's devices of a run whose replicas have devices of
    their own (``elastic.lend``): they generate only in the iterations that lend them. Pure."""
    return [] if colocate else [i for i, s in enumerate(res.replicas) if s.bundle < world]


def resources_for(cfg, lend: bool = False) -> Resources:
    """``resources`` of a run config (of one world: ``lend`` is the run's ``elastic.lend``)."""
    from rlhf_switch.engines.base import rollout_engine

    return resources(cfg.world_size, cfg.rollout.tp, rollout_engine(cfg.rollout.engine).placement == "replica",
                     cfg.rollout.colocate, lend)


# config ``placement`` -> the placement group's strategy (SPREAD is Ray's best-effort spread: on one
# node every bundle still fits)
STRATEGIES = {"pack": "PACK", "spread": "SPREAD"}


class PlacementError(RuntimeError):
    """The placement group's bundles landed where a rollout replica cannot run."""


def rank_bundles(bundle_nodes: Sequence[str], group: int = 1) -> list[int]:
    """Rank -> placement-group bundle: the bundles grouped by node (nodes in the order of their
    first bundle, bundles in index order within a node), so every ``group`` consecutive ranks — a
    rollout replica's TP devices, whose workers run inside one actor — share a node. On one node,
    and whenever Ray packed the bundles in order, this is the identity. ``bundle_nodes[b]``: the
    node of bundle ``b``. Raises ``PlacementError`` when a group would span nodes."""
    nodes = list(dict.fromkeys(bundle_nodes))
    order = sorted(range(len(bundle_nodes)), key=lambda b: (nodes.index(bundle_nodes[b]), b))
    for first in range(0, len(order), group):
        spanned = sorted({bundle_nodes[b] for b in order[first:first + group]}, key=nodes.index)
        if len(spanned) > 1:
            counts = {n[:8]: bundle_nodes.count(n) for n in nodes}
            raise PlacementError(
                f"ranks {first}..{first + group - 1} (one rollout replica of tp {group}) would span nodes "
                f"{[n[:8] for n in spanned]}: its workers run inside one actor on one node. Devices per node "
                f"{counts}: use placement: pack, or nodes whose device counts are multiples of {group}")
    return order

