"""One elastic resize that changes both the trainer world and the vLLM replicas' layout.

During the iteration before the entry, both are built in the background: the new trainer world
(``rlhf_switch.elastic.manager.start_world``: its actors and empty engines on the new world's
devices) and the new rollout replicas (``Cluster.start_replicas`` on those same devices). At the
boundary, one stop-the-world: the trainer's state moves over the union of old and new ranks
(``PendingWorld.commit``; the old trainers leave), the new world and its replicas are adopted
(``Cluster.adopt``: the weight channel planned between them, one sync fills the replicas before
they generate, the old replicas leave), and only then are the devices only the old world used
released. Either side failing to build abandons both, with one message; the current world trains
on.

Logical devices: on a kept device the old trainer (0.5 CPU, 0.5 GPU) and old replica (0.4, 0.5)
hold the whole bundle until the boundary, so the new world's actors take no share of Ray's
(``COMBINED_TRAINER_SLOT``; the new replicas ``cluster.TRANSITION_SLOT``): the new trainer rank
``r`` sits on device ``r``'s bundle (its node) like every rank does, and the device manager's
placement groups stay the run's.
"""
from __future__ import annotations

import time
from pathlib import Path

# (CPU, GPU) of a new trainer actor of a combined resize: a kept device's bundle is full (old trainer
# + old replica) until the boundary, and Ray's shares cannot change after an actor starts
COMBINED_TRAINER_SLOT = (0.0, 0.0)


def rollout_layout(cfg) -> str:
    r = cfg.rollout
    return f"{r.engine} TP{r.tp}×{cfg.world_size // r.tp}"


def trainer_layout(cfg) -> str:
    """The trainer world of ``cfg``, as the resize and recovery records name it."""
    return f"world {cfg.world_size}, train {cfg.train.model_dump(exclude_defaults=True)}"


def layout(cfg) -> str:
    """Trainer world and rollout layout of ``cfg``, as the resize record names them."""
    return f"{trainer_layout(cfg)}, rollout {rollout_layout(cfg)}"


class PendingCombined:
    """A new trainer world and its new rollout replicas, both starting in the background."""

    def __init__(self, world, replicas, config, started_at: int, error: str | None = None):
        self.world, self.replicas, self.config, self.started_at, self.error = world, replicas, config, started_at, error

    def abandon(self) -> None:
        if self.world is not None and self.world.workers:
            self.world.abandon()
        if self.replicas is not None:
            self.replicas.abandon()


def start_combined_resize(ray, cluster, new, devices, init_dir: Path, it: int) -> PendingCombined:
    """Start building the world of ``new`` (trainer ranks on devices ``0..world_size-1``) and its
    rollout replicas on those devices, in the background while iteration ``it`` runs on the
    current world."""
    from actors.hybrid import remote_class
    from rlhf_switch.elastic import ResizeError, ResizePlan
    from rlhf_switch.elastic.manager import start_world

    if cluster.device.is_cuda:  # fail closed: nothing of this ran on a GPU
        return PendingCombined(None, None, new, it, "a combined resize on CUDA is not built yet (the new trainer "
                               "ranks take no GPU share of Ray's during the transition; their device is not "
                               "handed to them)")
    plan = ResizePlan(tuple(range(cluster.world)), tuple(range(new.world_size)))
    world = start_world(ray, remote_class(*COMBINED_TRAINER_SLOT), new.model_dump(), devices, plan,
                        init_dir=str(init_dir), device=cluster.device)
    try:  # the added devices are held now (their groups made): the replicas may be placed on them
        replicas = cluster.start_replicas(new, init_dir, devices.slots(plan.new_devices))
    except (ValueError, ResizeError) as e:
        world.abandon()
        return PendingCombined(None, None, new, it, f"the new rollout replicas cannot start ({e})")
    return PendingCombined(world, replicas, new, it)


def commit_combined_resize(ray, cluster, pending: PendingCombined, devices, it: int) -> dict:
    """The stop-the-world before iteration ``it``. Returns the resize event (``abandoned``: why,
    when either side failed to build — both are dropped, the current world is untouched)."""
    from recipes.cluster import wait_all
    from rlhf_switch.elastic import ResizeError

    old = layout(cluster.cfg)
    t0 = time.perf_counter()
    error = pending.error
    if error is None:
        try:  # both sides built, or one clear message (the other side is dropped with it)
            pending.world.wait()
            wait_all(ray, pending.replicas.starts, "start new rollout replicas", True,
                     timeout=max(1.0, pending.world.timeout_s - (t0 - pending.replicas.t0)))
        except Exception as e:  # noqa: BLE001 - nothing of the current world has moved
            error = (str(e) if isinstance(e, ResizeError) else
                     f"starting the new rollout replicas failed ({type(e).__name__}: "
                     f"{str(e).splitlines()[0] if str(e) else ''})")
    if error is not None:
        pending.abandon()
        return {"kind": "planned", "part": "trainer+rollout", "old": old, "new": layout(pending.config),
                "abandoned": f"{error}; both the new trainer world and its rollout replicas abandoned, the "
                             f"current world trains on"}
    waited = time.perf_counter() - t0
    replicas_background_s = time.perf_counter() - pending.replicas.t0
    try:
        moved = pending.world.commit(cluster.workers, release=False)
    except ResizeError as e:  # the old world keeps its state; its replicas generate on
        cluster.abandon_replicas()
        return {"kind": "planned", "part": "trainer+rollout", "old": old, "new": layout(pending.config),
                "abandoned": f"{e}; the new rollout replicas abandoned too"}
    swap = cluster.adopt(pending.config, moved.workers, devices.slots(moved.plan.new_devices))
    stop_s = moved.stop_the_world_s + swap["stop_the_world_s"]
    # the devices only the old world used: free now that its trainers and its replicas are gone
    t1 = time.perf_counter()
    devices.release(moved.plan.released)
    return {"kind": "planned", "part": "trainer+rollout", "old": old, "new": layout(cluster.cfg),
            "iterations_during_build": it - pending.started_at,
            "background_s": max(moved.background_s, replicas_background_s),
            "trainer_background_s": moved.background_s, "replicas_background_s": replicas_background_s,
            "waited_for_build_s": waited, "stop_the_world_s": stop_s,
            "trainer_move_s": moved.stop_the_world_s, "replica_swap_s": swap["stop_the_world_s"],
            "fill_sync_s": swap["fill_sync_s"],
            "release_s": moved.release_s + swap["release_s"] + (time.perf_counter() - t1),
            "bytes_moved": moved.bytes_moved + swap["bytes_moved"],
            "trainer_bytes_moved": moved.bytes_moved, "fill_bytes_moved": swap["bytes_moved"],
            "old_replicas": swap["old_replicas"], "new_replicas": swap["new_replicas"],
            "old_replicas_gone": swap["old_replicas_gone"], "devices_released": list(moved.plan.released)}
