"""The driver side of a lost trainer, over Ray (``elastic.redundancy: host``).

A trainer actor died (a call of the iteration raised Ray's ``RayActorError``/``ActorDiedError``,
or a move ran past its deadline). ``lost_ranks`` asks every actor of the world for its pid: the
dead ones answer with Ray's error at once, the survivors once their interrupted call has failed
(their world's groups lost a member), and one that does not answer within the deadline counts as
lost too (it is killed). ``recover`` then:

1. refuses, before anything moves, when a lost rank's copy was held by a lost rank too
   (``vps.layouts.buddy.lost_owners``): ``StateLost`` — the caller falls back to a checkpoint;
2. builds a new world of the same size on the same devices (the replacement for each lost rank
   where its actor was; a device's other half holds the surviving old actor meanwhile) with
   ``start_world`` — the resize's own background build;
3. moves the state with the resize's own stop-the-world (``PendingWorld.commit``), the survivors
   sending their host copies (``source="host_copy"``): one VPS plan over the union of the
   survivors and the new ranks; step, LR schedule and RNG as of the last refresh come with it.
   The survivors are killed after it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from ..vps.layouts.buddy import lost_owners
from .manager import Devices, bytes_by_engine, start_world
from .plan import ResizePlan


class StateLost(RuntimeError):
    """A lost rank's share was held only by ranks that are lost too: no host copy can restore it."""

    def __init__(self, message: str, lost: list[int], unrecoverable: list[int]):
        super().__init__(message)
        self.lost, self.unrecoverable = lost, unrecoverable


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

    @property
    def bytes_moved(self) -> int:
        return sum(m["bytes_sent"] + m["bytes_local"] for m in self.members if m["side"] == "old")

    def event(self, old: str, new: str) -> dict:
        """The run log's record of it."""
        return {"kind": "trainer_lost", "lost_ranks": self.lost, "survivors": self.survivors, "old": old,
                "new": new, "detect_s": self.detect_s, "build_s": self.build_s, "move_s": self.move_s,
                "seconds": self.seconds, "bytes_moved": self.bytes_moved,
                "bytes_moved_by_engine": bytes_by_engine(self.members)}


def lost_ranks(ray, workers: Sequence, deadline_s: float = 300.0) -> list[int]:
    """The ranks of ``workers`` that are dead or do not answer within ``deadline_s`` (those are
    killed: a rank that hangs cannot be part of the recovery)."""
    from ray.exceptions import RayActorError

    probes = [w.pid.remote() for w in workers]
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
            failed_at: float | None = None, timeout_s: float = 600.0) -> Recovery:
    """Replace the world ``workers`` (rank ``r`` on device ``device_ids[r]``) that lost the ranks
    ``lost`` by a new world of ``config`` (the same world size) holding the state of the last
    refresh; ``failed_at``: ``time.perf_counter()`` when the failure was seen (module doc)."""
    t0 = failed_at if failed_at is not None else time.perf_counter()
    n, lost = len(workers), sorted(lost)
    gone = lost_owners(n, lost, shift)
    if gone or len(lost) == n:
        raise StateLost(f"trainer ranks {lost} of {n} are lost and so is every host copy of rank(s) "
                        f"{gone or lost}: the state cannot be restored from the buddies", lost, gone or lost)
    survivors = [r for r in range(n) if r not in lost]
    for r in lost:
        ray.kill(workers[r])  # a hung one included: its half of the device goes to its replacement
    detect_s = time.perf_counter() - t0
    plan = ResizePlan(tuple(device_ids[r] for r in survivors), tuple(device_ids))
    t1 = time.perf_counter()
    pending = start_world(ray, actor_cls, config, devices, plan, timeout_s=timeout_s, init_dir=init_dir,
                          device=device)
    pending.wait()
    build_s = time.perf_counter() - t1
    result = pending.commit([workers[r] for r in survivors], timeout_s=timeout_s, source="host_copy")
    return Recovery(result.workers, lost, survivors, plan, detect_s, build_s, result.stop_the_world_s,
                    time.perf_counter() - t0, result.members)
