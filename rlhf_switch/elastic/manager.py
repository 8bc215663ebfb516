"""The driver side of an elastic resize, over Ray.

``Devices`` owns the job's logical devices, one single-bundle placement group each, so that a
device can join or leave on its own (a placement group's bundles can only go all together, and
removing a group kills the actors placed on it). A trainer world's actor takes half a device
(``remote_class(num_cpus=0.5, num_gpus=0.5)`` in ``actors/hybrid.py``), so during a resize an old
and a new actor share each kept device. The call order::

    devices = Devices(ray); devices.acquire(range(4))
    cluster = Cluster(cfg4, ray, devices=devices.slots(range(4)))   # the running world
    pending = start_world(ray, actor_cls, cfg2_dict, devices, ResizePlan((0, 1, 2, 3), (0, 1)))
    while not pending.ready(): ...train the old world...               # background build
    result = pending.commit(cluster.workers)                         # stop-the-world + release
    result.workers                                                   # the new world's actors

Nothing here imports the recipes or the actors: the actor class comes from the caller.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from .plan import ResizeError, ResizePlan
from ..timeouts import CONTROL_S, RESIZE_S, SHUTDOWN_S

DEVICE = {"CPU": 1, "GPU": 1}

# The Ray concurrency group of the calls a recovery makes on a surviving trainer actor (its pid,
# ``resize_store``, ``resize_move(source="host_copy")``): a thread of their own, so they answer
# while the actor's main call — a step of a world that lost a rank — still waits in a collective
# for the lost peer until the gloo timeout. The actor class defines it (``actors/hybrid.py``
# ``remote_class``); every other call stays in Ray's default group, in order, one at a time.
CONTROL = "control"


class Devices:
    """Logical devices by id, each its own placement group of one bundle."""

    def __init__(self, ray, bundle: Mapping[str, float] = DEVICE):
        self.ray, self.bundle = ray, dict(bundle)
        self.groups: dict[int, Any] = {}

    def acquire(self, ids: Iterable[int], wait_s: float | None = 120.0) -> list:
        """Reserve the devices ``ids`` not held yet; returns their readiness refs (``wait_s``:
        wait for them here; None: the caller waits, e.g. behind a background build)."""
        from ray.util.placement_group import placement_group

        refs = []
        for d in ids:
            if d not in self.groups:
                self.groups[d] = placement_group([self.bundle], strategy="PACK")
                refs.append(self.groups[d].ready())
        if wait_s is not None and refs:
            self.ray.get(refs, timeout=wait_s)  # pg.ready() can pend forever
        return refs

    def slots(self, ids: Iterable[int]) -> list[tuple[Any, int]]:
        """(placement group, bundle index) per device, as ``Cluster(devices=...)`` takes them."""
        missing = [d for d in ids if d not in self.groups]
        if missing:
            raise ResizeError(f"devices {missing} are not held")
        return [(self.groups[d], 0) for d in ids]

    def strategy(self, d: int):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(self.slots([d])[0][0], placement_group_bundle_index=0)

    def placed(self, ids: Iterable[int], wait_s: float = 60.0, replace_s: float = 5.0) -> list[int]:
        """The devices of ``ids`` whose placement group is placed on a node that is up: Ray says
        alive and its raylet accepts a connection — Ray's own verdict on a node lags (it misses
        heartbeats for ~15 s first), the connection does not. A group on a node that is down is
        waited for: once Ray knows, it re-places the group onto a node with a free device if one
        exists; ``replace_s`` after Ray knows (at most ``wait_s`` in all) a device not placed
        again counts as gone (a trainer lost with its node and no device to replace it:
        ``recovery.recover`` shrinks the world)."""
        from ray.util.placement_group import placement_group_table

        ids = list(ids)
        deadline = time.monotonic() + wait_s
        known_lost: dict[int, float] = {}  # device -> when Ray first said its group is not placed
        while True:
            nodes = {n["NodeID"]: n for n in self.ray.nodes()}
            up: dict[str, bool] = {}
            ok, now = [], time.monotonic()
            for d in ids:
                table = placement_group_table(self.groups[d])
                where = set((table.get("bundles_to_node_id") or {}).values())
                if table.get("state") != "CREATED" or not where:
                    known_lost.setdefault(d, now)
                    continue
                known_lost.pop(d, None)
                for n in where - set(up):
                    up[n] = _node_up(nodes.get(n))
                if all(up[n] for n in where):
                    ok.append(d)
            waiting = [d for d in ids if d not in ok]
            settled = all(d in known_lost and now - known_lost[d] > replace_s for d in waiting)
            if not waiting or settled or now > deadline:
                return ok
            time.sleep(0.5)

    def renumber(self, ids: Sequence[int]) -> None:
        """Device ``ids[i]`` becomes device ``i``; every other device must have been released
        (after a world shrank onto ``ids``: the loop keeps its world on devices ``0..n-1``)."""
        rest = sorted(set(self.groups) - set(ids))
        if rest:
            raise ResizeError(f"devices {rest} are still held: release them before renumbering")
        self.groups = {i: self.groups[d] for i, d in enumerate(ids)}

    def release(self, ids: Iterable[int]) -> None:
        from ray.util.placement_group import remove_placement_group

        for d in list(ids):
            pg = self.groups.pop(d, None)
            if pg is not None:
                remove_placement_group(pg)

    def release_all(self) -> None:
        self.release(list(self.groups))


def _node_up(node: Mapping[str, Any] | None, timeout_s: float = 2.0) -> bool:
    """Whether a ``ray.nodes()`` entry is alive and its raylet's port accepts a connection."""
    import socket

    if node is None or not node.get("Alive"):
        return False
    if not node.get("NodeManagerPort"):
        return True
    try:
        socket.create_connection((node["NodeManagerAddress"], int(node["NodeManagerPort"])), timeout_s).close()
        return True
    except OSError:
        return False


@dataclass
class ResizeResult:
    workers: list                  # the new world's actors, rank order
    plan: ResizePlan
    background_s: float            # from start_world to the new world's engines built
    stop_the_world_s: float        # the union move, driver's view (the old world is idle only here)
    release_s: float               # the old actors shut down and freed (the new world may train)
    members: list[dict] = field(default_factory=list)  # every union rank's move report

    @property
    def bytes_moved(self) -> int:
        return bytes_moved(self.members)

    @property
    def bytes_moved_by_engine(self) -> list[int]:
        return bytes_by_engine(self.members)


def bytes_moved(members: Sequence[Mapping]) -> int:
    """The bytes a union move's old side sent or kept (``union_move``'s member reports)."""
    return sum(m["bytes_sent"] + m["bytes_local"] for m in members if m["side"] == "old")


def union_move(ray, old_workers: Sequence, new_workers: Sequence, plan: ResizePlan, timeout_s: float = RESIZE_S,
               source: str = "engine") -> list[dict]:
    """One VPS move of the training state over the union of ``old_workers`` (only read; ``source``
    as ``HybridWorker.resize_move`` takes it) and ``new_workers`` (overwritten): the union store
    on old rank 0, every member's ``resize_move``. Returns every union rank's move report."""
    # host copies: the survivors' main calls are stuck in their broken world, so their part runs
    # in the control group; their engines' own state (a planned resize) is read in order
    group = {"concurrency_group": CONTROL} if source == "host_copy" else {}
    host, port = ray.get(old_workers[0].resize_store.options(**group).remote(), timeout=CONTROL_S)
    refs = [w.resize_move.options(**group).remote(plan.endpoint(host, port, "old", r), source)
            for r, w in enumerate(old_workers)]
    refs += [w.resize_move.remote(plan.endpoint(host, port, "new", r)) for r, w in enumerate(new_workers)]
    return ray.get(refs, timeout=timeout_s)


def bytes_by_engine(members: Sequence[Mapping]) -> list[int]:
    """The bytes the old side sent or kept, per engine moved (the trainer's, then PPO's critic's)."""
    old = [m for m in members if m["side"] == "old"]
    return [sum(m["parts"][i]["bytes_sent"] + m["parts"][i]["bytes_local"] for m in old)
            for i in range(len(old[0]["parts"]) if old else 0)]


class PendingWorld:
    """A new trainer world under construction: its actors started and their engines being built
    (Ray runs each actor's calls in order), none of which waits on the driver."""

    def __init__(self, ray, actor_cls, config: Mapping, devices: Devices, plan: ResizePlan,
                 timeout_s: float = RESIZE_S, init_dir: str | None = None, device=None):
        self.ray, self.devices, self.plan, self.timeout_s = ray, devices, plan, timeout_s
        self.t0 = time.perf_counter()
        # the devices the new world adds: reserved now, waited for behind the build
        self._device_refs = devices.acquire(plan.added, wait_s=None)
        self.workers = [actor_cls.options(scheduling_strategy=devices.strategy(d)).remote()
                        for d in plan.new_devices]
        # rank 0 hosts the new world's store on its own node; the ref goes on unresolved
        address = self.workers[0].open_store.remote()
        n = plan.new_world
        inits = [w.init_world_at.remote(address, r, n, *([device] if device is not None else []))
                 for r, w in enumerate(self.workers)]
        self._builds = [w.build_empty.remote(dict(config), init_dir) for w in self.workers]
        self._refs = self._device_refs + inits + self._builds
        self.built_s: float | None = None

    def ready(self) -> bool:
        """Whether every engine of the new world is built (raises ``ResizeError`` at once if one
        failed: the old world is untouched and trains on)."""
        done, pending = self.ray.wait(self._refs, num_returns=len(self._refs), timeout=0)
        for ref in done:
            self._check(ref)
        if pending:
            if time.perf_counter() - self.t0 > self.timeout_s:
                self.abandon()
                raise ResizeError(f"the new trainer world was not built within {self.timeout_s} s; "
                                  f"abandoned, the old world trains on")
            return False
        if self.built_s is None:
            self.built_s = time.perf_counter() - self.t0
        return True

    def _check(self, ref) -> None:
        try:
            self.ray.get(ref, timeout=0)
        except Exception as e:  # noqa: BLE001 - one clear message, then the construction is gone
            self.abandon()
            raise ResizeError(f"building the new trainer world failed ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''}); abandoned, the old world "
                              f"trains on") from e

    def wait(self, timeout_s: float | None = None) -> None:
        deadline = time.perf_counter() + (timeout_s if timeout_s is not None else self.timeout_s)
        while not self.ready():
            if time.perf_counter() > deadline:
                raise ResizeError("the new trainer world is still building")
            time.sleep(0.2)

    def abandon(self) -> None:
        for w in self.workers:
            self.ray.kill(w)
        self.workers = []
        self.devices.release(self.plan.added)

    def commit(self, old_workers: Sequence, timeout_s: float = RESIZE_S, source: str = "engine",
               release: bool = True) -> ResizeResult:
        """The stop-the-world: one VPS move over the union of old and new ranks (every old rank
        sends what it holds — the ranks leaving too, before they leave), then the old actors are
        shut down and the devices only they used released. Call between two steps of the old
        world, after ``ready()``. ``source="host_copy"``: the old ranks are the survivors of a
        world that lost a rank and send their host copies (``elastic.recovery``) from the actors'
        ``CONTROL`` concurrency group (their main calls may still wait on the broken world's
        groups); those groups are broken, so they are killed without a shutdown. ``release=False``: the devices
        only the old world used stay held (other actors of the old world still run there, e.g.
        the old rollout replicas of a combined resize); the caller releases ``plan.released``."""
        if len(old_workers) != self.plan.old_world:
            raise ResizeError(f"{len(old_workers)} old actors for an old world of {self.plan.old_world}")
        self.wait()
        ray, plan = self.ray, self.plan
        t0 = time.perf_counter()
        try:  # host copies: each old actor is killed after its part (nothing waits for its stuck call)
            members = union_move(ray, old_workers, self.workers, plan, timeout_s, source)
        except Exception as e:  # noqa: BLE001 - the old side only read its state: it trains on
            self.abandon()
            raise ResizeError(f"the stop-the-world move failed ({type(e).__name__}); the new world "
                              f"is abandoned, the old world keeps its state") from e
        stop_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        try:
            if source == "engine":
                ray.get([w.shutdown.remote() for w in old_workers], timeout=SHUTDOWN_S)
        finally:
            for w in old_workers:
                ray.kill(w)
            if release:
                self.devices.release(plan.released)
        return ResizeResult(list(self.workers), plan, self.built_s or 0.0, stop_s,
                            time.perf_counter() - t1, members)


def start_world(ray, actor_cls, config: Mapping, devices: Devices, plan: ResizePlan,
                timeout_s: float = RESIZE_S, init_dir: str | None = None, device=None) -> PendingWorld:
    """Start building the trainer world of ``config`` (its ``world_size`` and ``train`` layout) on
    ``plan.new_devices`` in the background; returns at once. ``init_dir``: the run's warm start,
    from which the new world's reference and in-actor rollout engine are built too. ``device``:
    the run's (``rlhf_switch.device.DeviceSpec``; default the actors' own default, CPU)."""
    world = int(config.get("world_size", 0))
    if world != plan.new_world:
        raise ResizeError(f"the new config's world_size {world} is not the {plan.new_world} devices "
                          f"{list(plan.new_devices)} of the plan")
    return PendingWorld(ray, actor_cls, config, devices, plan, timeout_s, init_dir, device)
