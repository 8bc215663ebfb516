"""The actors of one run and the phases that involve all of them, on Ray: the facade.

The driver is Ray's single controller. ``Cluster`` owns the actors: one ``HybridWorker`` per
logical device (training engine, reference, and for ``rollout.engine: torch`` the rollout engine)
and, for a rollout engine of placement ``replica`` (vLLM), one ``RolloutReplica`` per replica,
on the placement group's bundles (``recipes.cluster.placement``). Its parts, each in a module of
its own: the rollout replicas (``replicas``: their lifecycle and the generation shared over them)
and the weight channel's lifecycle (``channel``: opened once, re-formed when a layout changes,
each sync train -> rollout through it). Here: the actors started, every engine built, calls to
every trainer rank, a new trainer world adopted (elastic), the phase boundary's offload and memory
marks, saving and shutting down.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Sequence

from recipes.cluster.calls import RolloutEngineFailed, engine_error, wait_all
from recipes.cluster.channel import ChannelMixin
from recipes.cluster.placement import STRATEGIES, PlacementError, rank_bundles, resources_for
from recipes.cluster.replicas import ReplicasMixin, RolloutTime
from rlhf_switch.timeouts import CONTROL_S, PHASE_S, SHUTDOWN_S, START_S


class Cluster(ReplicasMixin, ChannelMixin):
    """The actors of one run and the phases that involve all of them."""

    def __init__(self, cfg, ray, quiet: bool = False, devices: Sequence | None = None, lend: bool = False):
        """``devices``: one (placement group, bundle index) per rank, owned by the caller (the
        elastic device manager, whose devices outlive a world); by default the cluster makes and
        owns a placement group of ``world_size`` devices. ``lend``: replicas on the trainer's
        devices too (``elastic.lend``; ``resources``)."""
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from actors.hybrid import hf_config_of, remote_class
        from rlhf_switch.problems import world_device
        from rlhf_switch.engines.base import rollout_engine

        self.cfg, self.quiet, self.ray = cfg, quiet, ray
        self.hf = hf_config_of(cfg)
        self.world = world = cfg.world_size
        self.workers, self.replicas = [], []
        self._incoming = None  # new rollout replicas starting in the background (start_replicas)
        self.rollout_cls = rollout_engine(cfg.rollout.engine)
        self.in_world = self.rollout_cls.placement == "worker"
        self.resources = res = resources_for(cfg, lend)
        self.tp, self.n_replicas = cfg.rollout.tp, len(res.replicas) or world // cfg.rollout.tp
        self.lending = False  # elastic.lend: whether the replicas on the trainer's devices generate now
        self.owns_devices = devices is None
        if devices is None:
            self.pg = placement_group(list(res.bundles), strategy=STRATEGIES[cfg.placement])
            ray.get(self.pg.ready(), timeout=CONTROL_S)  # pg.ready() can pend forever
            # rank r sits on bundle self.bundles[r]: a colocated replica's tp ranks on one node
            # (rank_bundles); the bundles after the trainer's (rollout.colocate: false) hold one whole
            # replica each
            bundle_nodes = ray.util.placement_group_table(self.pg)["bundles_to_node_id"]
            try:
                self.bundles = rank_bundles([bundle_nodes[b] for b in range(world)],
                                            1 if self.in_world or not cfg.rollout.colocate else self.tp)
            except PlacementError:
                from ray.util.placement_group import remove_placement_group

                remove_placement_group(self.pg)
                raise
            self.devices = [(self.pg, b) for b in self.bundles]  # rank r: (placement group, bundle)
        else:  # the elastic device manager's: one per trainer rank, nothing else placed
            if len(devices) != world or len(res.bundles) != world:
                raise ValueError(f"{len(devices)} caller-owned devices for a world of {world} whose run needs "
                                 f"{len(res.bundles)} bundles")
            self.pg, self.devices = None, list(devices)
            self.bundles = [index for _, index in self.devices]

        def on(bundle: int):
            pg, index = self._slot(bundle)
            return PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index)

        self.workers = [remote_class(num_cpus=s.num_cpus, num_gpus=s.num_gpus).options(scheduling_strategy=on(s.bundle))
                        .remote() for s in res.workers]
        # the run's device, backend and dtypes: resolved once, from what the actors on their
        # bundles see (cuda only if every one sees a GPU)
        seen = ray.get([w.devices_seen.remote() for w in self.workers], timeout=START_S)
        try:
            self.device = world_device(cfg, all(s["cuda"] for s in seen))
            if self.lent and self.device.is_cuda:  # fail closed: nothing of this ran on a GPU
                raise ValueError("elastic.lend on CUDA is not built yet (a replica lent the trainer's GPUs would "
                                 "need the trainer's memory freed while it generates)")
        except Exception:  # a ConfigError: nothing of this run may stay behind on a joined cluster
            self.shutdown(graceful=False)
            raise
        self._replica_gpus: list[list[str]] = []
        self._gpus_seen = [s["gpu_ids"] for s in seen]  # per trainer rank: replicas started later use them
        if not self.in_world:
            from actors.rollout_replica import remote_class as replica_class

            self.replicas = [replica_class(num_cpus=s.num_cpus, num_gpus=s.num_gpus)
                             .options(scheduling_strategy=on(s.bundle)).remote() for s in res.replicas]
            # colocated: replica r's workers use the (whole) devices of the trainer ranks it shares
            self._replica_gpus = self._gpus_of(res)
        # rank 0 hosts the world's store on its own node's address: nothing assumes one host
        host, port = ray.get(self.workers[0].open_store.remote(), timeout=START_S)
        ray.get([w.init_world.remote(host, port, r, world, self.device) for r, w in enumerate(self.workers)],
                timeout=START_S)
        self.channel_opened = 0
        self.handoff = "p2p"  # the weight channel's, once opened (rollout.handoff resolved)
        self._standing_by = None  # the replicas' receives posted ahead of the next sync
        self.replica_events: list[dict] = []  # replicas lost mid-generation, their prompts re-queued
        self.rollout_time = RolloutTime()     # the replicas' generating seconds against the generations' wall time

    def all(self, method: str, *args, desc: str | None = None, **kwargs) -> list:
        return self.collect(self.submit(method, *args, **kwargs), desc or method)

    def submit(self, method: str, *args, **kwargs) -> list:
        """Every trainer rank's call of ``method``, not waited for (``collect``): what the driver
        asks next is queued behind it on each worker (a worker runs its calls in order)."""
        return [getattr(w, method).remote(*args, **kwargs) for w in self.workers]

    def collect(self, refs: list, desc: str) -> list:
        return wait_all(self.ray, refs, desc, self.quiet)

    def build(self, init_dir: Path, resume_dir: Path | None) -> dict:
        """Build every engine (rollout replicas start from ``init_dir`` while the trainers
        build), then open the weight channel between them — once for the whole run."""
        gpus = self._replica_gpus or [None] * len(self.replicas)
        starts = [r.start.remote(self.cfg.rollout.engine, self._replica_context(self.cfg, init_dir, i), gpus[i])
                  for i, r in enumerate(self.replicas)]
        built = self.all("build", self.cfg, str(init_dir), str(resume_dir) if resume_dir else None,
                         self.device, desc="build engines")
        if starts:
            wait_all(self.ray, starts, "start rollout replicas", self.quiet, failed=lambda i, e: RolloutEngineFailed(
                f"{self._replica_name(i)} failed to start its engine: {engine_error(e)}"))
        self.open_channel()
        return built[0]

    def _on(self, bundle: int):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        pg, index = self._slot(bundle)
        return PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index)

    def adopt(self, cfg, workers: list, devices: Sequence) -> dict | None:
        """After an elastic resize (``rlhf_switch.elastic.manager``): the new world's actors —
        trainer, reference, critic and in-actor rollout engine built by ``build_empty(config, init_dir)``,
        the training state moved in — become this cluster's; the weight channel is re-formed over
        them and the next ``sync`` brings their rollout engines up to date. With rollout replicas
        (vLLM, a combined resize): ``cfg``'s replicas must be starting on ``devices``
        (``start_replicas(cfg, init_dir, devices)``); they take over here — ``swap_replicas``: the
        channel formed over the new trainer world and them, one sync fills them, the old replicas
        shut down — and its figures are returned."""
        if self.replicas and (self._incoming is None or self._incoming.cfg is not cfg):
            raise ValueError("adopt: a world with rollout replicas needs the new world's replicas started first "
                             "(start_replicas with its devices)")
        seen = self._gpus_seen  # per device (rank r on device r): the ids seen there, kept with the device
        self.cfg, self.workers, self.world, self.devices = cfg, list(workers), cfg.world_size, list(devices)
        self.bundles = [index for _, index in self.devices]
        self._gpus_seen = [seen[d] if d < len(seen) else [] for d in range(self.world)]
        if self.replicas:
            return self.swap_replicas(fall_back=False)
        self.resources = resources_for(cfg)
        self.tp, self.n_replicas = cfg.rollout.tp, cfg.world_size // cfg.rollout.tp
        self.open_channel()

    # --- elastic.redundancy: host ---------------------------------------------------------------------
    @property
    def buddy_shift(self) -> int:
        """Which rank keeps rank r's host copy: ``(r + shift) % world``, another node's where the
        ranks' nodes allow (``vps.layouts.buddy.buddy_shift``); per world."""
        from rlhf_switch.vps.layouts.buddy import buddy_shift

        key = tuple(map(id, self.workers))
        if getattr(self, "_buddy", (None,))[0] != key:
            nodes = [self._node_of_rank(r) for r in range(self.world)]
            self._buddy = (key, buddy_shift(nodes), nodes)
        return self._buddy[1]

    def rank_nodes(self) -> list[str]:
        """Each trainer rank's node (``address id[:8]``) as ``buddy_shift`` last saw it: still
        known after a node is lost (its placement groups then name no node)."""
        buddy = getattr(self, "_buddy", None)
        return list(buddy[2]) if buddy else ["?"] * self.world

    def refresh_host_copy(self, extra: dict) -> dict:
        """Every trainer rank's state as of now into the host copies (one VPS move into the buddy
        layout; ``extra``, the data position, kept beside): bytes copied, from the buddies, held."""
        reports = self.all("redundancy_refresh", self.buddy_shift, extra, desc="host copy")
        return {"bytes": sum(r["bytes_local"] + r["bytes_received"] for r in reports),
                "bytes_received": sum(r["bytes_received"] for r in reports),
                "held_bytes": sum(r["bytes_held"] for r in reports),
                "seconds": max(r["seconds"] for r in reports)}

    def _slot(self, bundle: int) -> tuple:
        """(placement group, bundle index) of a ``resources`` bundle: the first ``world`` are the
        trainer ranks' devices (rank r on ``self.devices[r]``), any after them a replica's own."""
        return self.devices[bundle] if bundle < self.world else (self.pg, bundle)

    def _node_of_rank(self, rank: int, bundle: int | None = None) -> str:
        """The node of rank ``rank``'s bundle (or of ``resources`` bundle ``bundle``): its address
        and id (nodes may share an address)."""
        try:
            pg, index = self._slot(rank if bundle is None else bundle)
            node_id = self.ray.util.placement_group_table(pg)["bundles_to_node_id"][index]
            address = next(n["NodeManagerAddress"] for n in self.ray.nodes() if n["NodeID"] == node_id)
            return f"{address} {node_id[:8]}"
        except Exception:  # noqa: BLE001 - a name without an address is still a name
            return "?"

    def _trainer_name(self, rank: int) -> str:
        return f"trainer rank {rank} (node {self._node_of_rank(rank)})"

    def nodes(self) -> dict:
        """Where the run's actors are, as each actor's process reports it (Ray's node id and
        address, pid): the trainer ranks in rank order, the rollout replicas (their engines'
        workers are the replica actors' own processes) in replica order; each rank's bundle."""
        got = self.ray.get([w.node.remote() for w in self.workers] + [r.node.remote() for r in self.replicas],
                           timeout=CONTROL_S)
        return {"placement": self.cfg.placement, "trainers": got[:self.world], "replicas": got[self.world:],
                "n_nodes": len({g["node_id"] for g in got}), "rank_bundles": list(self.bundles)}

    # --- memory at the phase boundary ----------------------------------------------------------------
    def offload(self) -> dict:
        """The trainers' state ``train.offload`` names into host memory (after a sync)."""
        return self._boundary("offload")

    def reload(self) -> dict:
        """The parked state back into the trainers' buffers (before the update)."""
        return self._boundary("reload")

    def _boundary(self, method: str) -> dict:
        if self.cfg.train.offload == "none":  # nothing moves: no call to the workers
            return {"bytes": 0, "bytes_per_rank": [0] * self.world, "released_bytes": 0, "seconds": 0.0}
        reports = self.all(method, desc=f"{method} trainer state")
        return {"bytes": sum(r["bytes_moved"] for r in reports),
                "bytes_per_rank": [r["bytes_moved"] for r in reports],
                "released_bytes": sum(r["bytes_released"] for r in reports),
                "seconds": max(r["seconds"] for r in reports)}

    def memory_mark(self, wait: bool = True):
        """Every trainer rank's peak memory in the phase that ends now (the largest, and per rank).
        ``wait=False``: the marks are requested now and read later — a function that returns the
        same dict. A worker runs its calls in order, so the mark still closes the phase where it
        was asked for; the driver just does not wait a Ray round trip for it (three per iteration)."""
        refs = [w.memory_mark.remote() for w in self.workers]

        def read() -> dict:
            marks = self.ray.get(refs, timeout=PHASE_S)
            return {"bytes": max(m["bytes"] for m in marks), "per_rank": [m["bytes"] for m in marks],
                    "measure": marks[0]["measure"]}
        return read() if wait else read

    def save(self, path: Path, extra: dict) -> float:
        t0 = time.perf_counter()
        self.all("save_checkpoint", str(path), extra, desc=f"save {path.name}")
        return time.perf_counter() - t0

    def shutdown(self, graceful: bool = True) -> None:
        """Stop the engines and free the actors and their placement group (a shared Ray session
        goes on; an owned one is shut down by the recipe)."""
        from ray.util.placement_group import remove_placement_group

        ray = self.ray
        self.abandon_replicas()
        if graceful:
            try:
                if self.replicas:
                    ray.get([r.shutdown.remote() for r in self.replicas], timeout=SHUTDOWN_S)
                ray.get([w.shutdown.remote() for w in self.workers], timeout=SHUTDOWN_S)
            except Exception:  # noqa: BLE001 - best effort: the actors are killed next
                pass
        for a in self.replicas + self.workers:
            ray.kill(a)
        self.replicas, self.workers = [], []
        if self.owns_devices:
            remove_placement_group(self.pg)
