"""The driver side of a lost trainer, over Ray (``elastic.redundancy: host``).

A trainer actor died (a call of the iteration raised Ray's ``RayActorError``/``ActorDiedError``,
or a move ran past its deadline). ``lost_ranks`` asks every actor of the world for its pid in
the actors' ``CONTROL`` concurrency group (``manager.CONTROL``): the dead ones answer with Ray's
error once Ray knows, the survivors at once from that group's thread — their main call may still
wait in a collective for the lost peer, until the gloo timeout —, and one that does not answer
within the deadline counts as lost too (it is killed). ``recover`` then:

1. refuses, before anything moves, when a lost rank's copy was held by a lost rank too
   (``vps.layouts.buddy.lost_owners``), or when a survivor's copy was torn by a refresh the loss
   cut short (``host_copy_torn``): ``StateLost`` — the caller falls back to a checkpoint;
2. builds a new world with ``start_world`` — the resize's own background build: a replacement
   for each lost rank on its device where that device is still placed (``Devices.placed``: a
   rank killed on a node that is up, or a lost node's placement group Ray re-placed on a free
   device once it knows the node is down; ``replace_wait_s`` at most; a device's other half
   holds the surviving old actor meanwhile). The devices gone with a lost node are released
   and the world shrinks to the others, rank order kept, with ``config_for(world)`` — the run's
   layouts scaled along DP (``problems.scaled_run``). A smaller world that is not a valid
   config: ``WorldLost``, before anything moves — the caller falls back to a checkpoint;
3. moves the state with the resize's own stop-the-world (``PendingWorld.commit``), the survivors
   sending their host copies (``source="host_copy"``): one VPS plan over the union of the
   survivors and the new ranks; step, LR schedule and RNG as of the last refresh come with it.
   The survivors are killed after it, their stuck main calls with them (nothing waits on those).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from ..vps.layouts.buddy import lost_owners
from .manager import CONTROL, Devices, bytes_by_engine, start_world
from .plan import ResizePlan
from ..timeouts import MOVE_S, RESIZE_S


class StateLost(RuntimeError):
    """A lost rank's share was held only by ranks that are lost too: no host copy can restore it."""

    def __init__(self, message: str, lost: list[int], unrecoverable: list[int]):
        super().__init__(message)
        self.lost, self.unrecoverable = lost, unrecoverable


class WorldLost(RuntimeError):
    """Lost ranks' devices are gone with their node and the devices left cannot hold the run's
    layouts scaled along DP (``why``: the config's first problem)."""

    def __init__(self, message: str, lost: list[int], devices_gone: list[int]):
        super().__init__(message)
        self.lost, self.devices_gone, self.unrecoverable = lost, devices_gone, []


@dataclass
class Recovery:
    workers: list                    # the new world's actors, rank order
    lost: list[int]                  # the old world's lost ranks
    survivors: list[int]             # the old ranks that sent their host copies
    plan: ResizePlan
    detect_s: float                  # from the failure to knowing who is lost
    build_s: float                   # the new world's actors and engines
    move_s: float                    # the union move from the host copies
    seconds: float                   # the whole recovery, driver's view
    members: list[dict] = field(default_factory=list)
    devices: list[int] = field(default_factory=list)       # the new world's devices, rank order
    devices_gone: list[int] = field(default_factory=list)  # lost ranks' devices not placed any more
    extra: dict = field(default_factory=dict)  # what the restored refresh was given (the loop: its iteration)

    @property
    def bytes_moved(self) -> int:
        return sum(m["bytes_sent"] + m["bytes_local"] for m in self.members if m["side"] == "old")

    def event(self, old: str, new: str) -> dict:
        """The run log's record of it."""
        return {"kind": "trainer_lost", "lost_ranks": self.lost, "survivors": self.survivors, "old": old,
                "new": new, "new_world": len(self.workers), "devices_gone": self.devices_gone,
                "detect_s": self.detect_s, "build_s": self.build_s, "move_s": self.move_s,
                "seconds": self.seconds, "bytes_moved": self.bytes_moved,
                "bytes_moved_by_engine": bytes_by_engine(self.members)}


def refreshed_alike(survivors: Sequence[int], extras: Sequence[Sequence[Mapping]], lost: Sequence[int]) -> dict:
    """What the survivors' host copies were last refreshed with (``extras[i]``: survivor
    ``survivors[i]``'s, one per engine), which must be one refresh: a loss right at the end of a
    refresh can leave some survivors with the new copy complete and others never started on it
    (a rank's buddy share comes from one neighbour), and a state pieced from two refreshes is no
    state at all — ``StateLost``. The loop restores the iteration named here, not the one it
    last saw a refresh return for. The copies of one survivor (PPO: the actor's, then the
    critic's, refreshed one after the other) must be of that one refresh too: a policy of one
    iteration beside a critic of another is no state either."""
    seen = {repr(list(e)): r for r, e in zip(survivors, extras)}
    mixed = [r for r, e in zip(survivors, extras) if any(dict(x) != dict(e[0]) for x in e[1:])]
    if len(seen) > 1 or mixed:
        which = (f"rank {mixed[0]}'s engines' copies ({list(extras[survivors.index(mixed[0])])})" if mixed else
                 f"the survivors' copies ({', '.join(f'rank {r}: {k}' for k, r in seen.items())})")
        raise StateLost(f"trainer ranks {list(lost)} are lost during a refresh of the host copies: {which} are of "
                        f"different refreshes; the state cannot be restored from the buddies",
                        list(lost), list(survivors))
    return dict(extras[0][0]) if extras and extras[0] else {}


def lost_ranks(ray, workers: Sequence, deadline_s: float = MOVE_S) -> list[int]:
    """The ranks of ``workers`` that are dead or do not answer within ``deadline_s`` (those are
    killed: a rank that hangs cannot be part of the recovery)."""
    from ray.exceptions import RayActorError

    # the control group: a survivor's main call may be stuck in the broken world's collective
    probes = [w.pid.options(concurrency_group=CONTROL).remote() for w in workers]
    done, pending = ray.wait(probes, num_returns=len(probes), timeout=deadline_s)
    lost = []
    for r, ref in enumerate(probes):
        if ref in pending:
            ray.kill(workers[r])
            lost.append(r)
            continue
        try:
            ray.get(ref)
        except RayActorError:
            lost.append(r)
    return lost


def recover(ray, actor_cls, config: Mapping, devices: Devices, device_ids: Sequence[int], workers: Sequence,
            lost: Sequence[int], shift: int = 1, init_dir: str | None = None, device=None,
            failed_at: float | None = None, timeout_s: float = RESIZE_S,
            config_for: Callable[[int], Mapping] | None = None, replace_wait_s: float = 60.0) -> Recovery:
    """Replace the world ``workers`` (rank ``r`` on device ``device_ids[r]``) that lost the ranks
    ``lost`` by a new world of ``config`` (the same world size) holding the state of the last
    refresh, or of ``config_for(n)`` on the ``n`` devices left when lost ranks' devices are gone
    (None: ``WorldLost``); ``failed_at``: ``time.perf_counter()`` when the failure was seen
    (module doc)."""
    t0 = failed_at if failed_at is not None else time.perf_counter()
    n, lost = len(workers), sorted(lost)
    gone = lost_owners(n, lost, shift)
    if gone or len(lost) == n:
        raise StateLost(f"trainer ranks {lost} of {n} are lost and so is every host copy of rank(s) "
                        f"{gone or lost}: the state cannot be restored from the buddies", lost, gone or lost)
    for r in lost:
        ray.kill(workers[r])  # a hung one included: its half of the device goes to its replacement
    # every device asked: a rank on a node going down may still answer the probe (its process
    # outlives its raylet for a moment), its host copy is not to be read
    placed = devices.placed(device_ids, wait_s=replace_wait_s)
    devices_gone = [d for d in device_ids if d not in placed]
    on_gone = [r for r in range(n) if device_ids[r] in devices_gone and r not in lost]
    if on_gone:
        lost = sorted(lost + on_gone)
        gone = lost_owners(n, lost, shift)
        if gone or len(lost) == n:
            raise StateLost(f"trainer ranks {lost} of {n} are lost (devices {devices_gone} gone with their node) "
                            f"and so is every host copy of rank(s) {gone or lost}: the state cannot be restored "
                            f"from the buddies", lost, gone or lost)
        for r in on_gone:
            ray.kill(workers[r])
    survivors = [r for r in range(n) if r not in lost]
    # a refresh the loss interrupted (stuck in the main thread, mid-move) has left its host buffers a
    # mix of two states: refused here, before anything is built or moved
    torn = ray.get([workers[r].host_copy_torn.options(concurrency_group=CONTROL).remote() for r in survivors],
                   timeout=60)
    if any(torn):
        bad = [r for r, t in zip(survivors, torn) if t]
        raise StateLost(f"trainer ranks {lost} of {n} are lost during a refresh of the host copies: the copies "
                        f"of rank(s) {bad} are torn ({torn[survivors.index(bad[0])][0]}), the state cannot be "
                        f"restored from the buddies", lost, bad)
    extra = refreshed_alike(survivors, ray.get([workers[r].host_copy_extra.options(concurrency_group=CONTROL)
                                                .remote() for r in survivors], timeout=60), lost)
    new_devices = [d for d in device_ids if d not in devices_gone]
    if devices_gone:
        why = "no smaller world is built here" if config_for is None else None
        if config_for is not None:
            try:
                config = config_for(len(new_devices))
            except Exception as e:  # noqa: BLE001 - the config's own message, one line
                problems = getattr(e, "problems", None) or [str(e)]
                why = f"{type(e).__name__}: {problems[0]}"
        if why is not None:
            raise WorldLost(f"trainer ranks {lost} of {n} are lost with devices {devices_gone}, which are not "
                            f"placed any more; the {len(new_devices)} devices left cannot take the run ({why})",
                            lost, devices_gone)
        devices.release(devices_gone)  # a lost node's groups: not re-placed behind the run's back
    detect_s = time.perf_counter() - t0
    plan = ResizePlan(tuple(device_ids[r] for r in survivors), tuple(new_devices))
    t1 = time.perf_counter()
    pending = start_world(ray, actor_cls, config, devices, plan, timeout_s=timeout_s, init_dir=init_dir,
                          device=device)
    pending.wait()
    build_s = time.perf_counter() - t1
    result = pending.commit([workers[r] for r in survivors], timeout_s=timeout_s, source="host_copy")
    return Recovery(result.workers, lost, survivors, plan, detect_s, build_s, result.stop_the_world_s,
                    time.perf_counter() - t0, result.members, list(new_devices), devices_gone, extra)
