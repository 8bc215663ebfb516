"""A world of N local processes (gloo; ``backend="nccl"``: one GPU per rank) that stays up and runs many jobs.

Starting ranks costs seconds (spawn, import torch, join the world); moves cost milliseconds. So
a ``LocalWorld`` starts its ranks once and then runs any number of jobs — module-level
functions, pickled by reference — on all ranks at once::

    with LocalWorld(4) as world:
        reports = world.run(my_job, arg)   # my_job(arg) runs on every rank; one result per rank

The driver hosts the TCPStore on a free port it picked itself (port 0), so ranks can never join a
stale world left by someone else. Every wait has a timeout; a job that raises on any rank raises
``RankError`` in the driver with each failing rank's traceback.

A rank that dies (or a move that failed and closed its group) breaks the world: ``run_all`` runs a
job and returns what the surviving ranks answered instead of raising, and ``replace(rank)``
starts a fresh process for the dead rank and re-forms the default group on every rank — a new
generation of it, over its own prefix of the same store — so the world runs jobs again::

    outcome = world.run_all(job)         # outcome.results, outcome.failures, outcome.dead
    world.replace(*outcome.dead)         # fresh processes for them; every rank in a new group
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist


class RankError(RuntimeError):
    def __init__(self, failures: dict[int, str], stuck: list[int] | None = None):
        self.failures = failures
        self.stuck = stuck or []
        first = failures[min(failures)]
        more = (f" (ranks {self.stuck} are still inside the job, probably blocked in a collective "
                f"with them; this world cannot run more jobs)" if self.stuck else "")
        super().__init__(f"job failed on ranks {sorted(failures)}{more}; rank {min(failures)}:\n{first}")


@dataclass
class Outcome:
    """What ``run_all`` got back: results of the ranks that answered, tracebacks of those that
    raised, the ranks whose process died, and those still inside the job when it gave up."""

    results: dict[int, Any] = field(default_factory=dict)
    failures: dict[int, str] = field(default_factory=dict)
    dead: list[int] = field(default_factory=list)
    stuck: list[int] = field(default_factory=list)


_RANK_STATE: dict = {}  # inside a rank process: what re-forming its default group needs


def _init_group(generation: int) -> None:
    st = _RANK_STATE
    dist.init_process_group(st["backend"], store=dist.PrefixStore(f"world-gen{generation}", st["store"]),
                            rank=st["rank"], world_size=st["world_size"], timeout=timedelta(seconds=st["timeout_s"]))


def _reform(generation: int) -> str:
    """A job: leave the default group (perhaps broken by a dead peer or a failed move) and join
    its next generation."""
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - a broken group may not tear down cleanly; a new one is made anyway
        pass
    _init_group(generation)
    return "ready"


def _worker(rank: int, world_size: int, port: int, timeout_s: float, tasks, results, threads: int,
            generation: int = 0, backend: str = "gloo"):
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    torch.set_num_threads(threads)
    if backend == "nccl":  # one device per rank (NCCL refuses two ranks of a group on one GPU)
        torch.cuda.set_device(rank % torch.cuda.device_count())
    store = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=False,  # the driver's host (LocalWorld)
                          timeout=timedelta(seconds=timeout_s))
    _RANK_STATE.update(store=store, rank=rank, world_size=world_size, timeout_s=timeout_s, backend=backend)
    _init_group(generation)
    results.put((rank, True, pickle.dumps("ready")))
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            # pickle here, not in the queue's feeder thread, so an unpicklable result is an error
            # the driver sees at once instead of a silent hang
            payload = pickle.dumps(fn(*args, **kwargs))
            results.put((rank, True, payload))
        except BaseException as e:  # noqa: BLE001 - everything goes back to the driver
            results.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    dist.destroy_process_group()


class LocalWorld:
    FAILURE_GRACE = 20.0  # seconds the other ranks get to finish after one rank's job failed

    def __init__(self, world_size: int, timeout: float = 120.0, threads_per_rank: int = 1,
                 backend: str = "gloo"):
        self._broken: str | None = None
        self.backend = backend  # the default group's: gloo (CPU tensors) or nccl (one GPU per rank)
        self.world_size = world_size
        self.timeout = timeout
        # loopback on purpose: a LocalWorld's ranks are this driver's own spawned children, on this
        # host by construction (the test and bench world, not the run loop; the loop's stores are
        # on the node IP Ray reports, engines/channel.node_address)
        self._store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True,
                                    wait_for_workers=False, timeout=timedelta(seconds=timeout))
        self._threads = threads_per_rank
        self._generation = 0
        self._ctx = ctx = mp.get_context("spawn")
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        self._procs = [self._spawn(r) for r in range(world_size)]
        self._collect(timeout=max(timeout, 180.0))  # "ready" from every rank

    def _spawn(self, rank: int):
        p = self._ctx.Process(target=_worker, daemon=True,
                              args=(rank, self.world_size, self._store.port, self.timeout, self._tasks[rank],
                                    self._results, self._threads, self._generation, self.backend))
        p.start()
        return p

    def run_all(self, fn: Callable[..., Any], *args, timeout: float | None = None, **kwargs) -> Outcome:
        """Run ``fn`` on every rank like ``run``, but never raise for a rank's failure or death:
        wait (up to ``timeout``) for every rank that is still alive to answer and return what came
        back. A rank that died leaves the world broken until ``replace``."""
        if self._broken:
            raise RuntimeError(f"this LocalWorld is broken ({self._broken}); replace the dead ranks first")
        for q in self._tasks:
            q.put((fn, args, kwargs))
        return self._collect(timeout or self.timeout, tolerate=True)

    def replace(self, *ranks: int, timeout: float | None = None) -> None:
        """Fresh processes for ``ranks`` (killed first if still alive), and the default group
        re-formed on every rank as its next generation (the survivors leave the old one, which a
        dead peer or a failed move has broken). The surviving ranks must be idle (their jobs
        returned); their state outside the group — module globals, caches — is kept."""
        self._generation += 1
        for r in ranks:
            p = self._procs[r]
            if p.is_alive():
                p.kill()
            p.join(timeout=10)
            self._tasks[r] = self._ctx.Queue()  # the dead process may have held the old one's lock
        for r in range(self.world_size):
            if r not in ranks:
                self._tasks[r].put((_reform, (self._generation,), {}))
        for r in ranks:
            self._procs[r] = self._spawn(r)
        self._broken = None
        self._collect(timeout or max(self.timeout, 180.0))

    def run(self, fn: Callable[..., Any], *args, timeout: float | None = None, **kwargs) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results in rank order."""
        if self._broken:
            raise RuntimeError(f"this LocalWorld is broken ({self._broken}); start a new one")
        for q in self._tasks:
            q.put((fn, args, kwargs))
        return self._collect(timeout or self.timeout)

    def _collect(self, timeout: float, tolerate: bool = False) -> list[Any] | Outcome:
        """Every rank's answer. A rank that fails usually leaves the others blocked in a collective
        with it, so after the first failure the others get ``FAILURE_GRACE`` seconds, not the whole
        timeout; a rank process that dies is noticed within seconds. Either way the world is
        marked broken: its ranks may still be inside the failed job. With ``tolerate`` (``run_all``)
        nothing is raised: the living ranks get the whole ``timeout`` and an ``Outcome`` returns."""
        out: dict[int, Any] = {}
        failures: dict[int, str] = {}
        gone: list[int] = []
        now = time.monotonic()
        deadline, grace = now + timeout, None
        while len(out) + len(failures) + len(gone) < self.world_size:
            waiting = sorted(set(range(self.world_size)) - set(out) - set(failures) - set(gone))
            try:
                rank, ok, value = self._results.get(timeout=0.2 if tolerate else 1.0)
            except queue.Empty:
                now = time.monotonic()
                dead = [r for r in waiting if not self._procs[r].is_alive()]
                if tolerate:
                    if dead:
                        gone += dead
                        self._broken = f"ranks {sorted(gone)} died"
                    elif now > deadline:
                        self._broken = f"ranks {waiting} did not answer within {timeout:.0f} s"
                        return Outcome(out, failures, sorted(gone), waiting)
                    continue
                if dead:
                    self._broken = f"ranks {dead} died"
                    failures.update({r: "the rank process died (killed, out of memory, or crashed)"
                                     for r in dead})
                    raise RankError(failures, stuck=[r for r in waiting if r not in dead])
                if grace is not None and now > grace:
                    self._broken = f"ranks {waiting} stuck after ranks {sorted(failures)} failed"
                    raise RankError(failures, stuck=waiting)
                if now > deadline:
                    self._broken = f"ranks {waiting} did not answer within {timeout:.0f} s"
                    raise TimeoutError(self._broken) from None
                continue
            if ok:
                out[rank] = pickle.loads(value)
            else:
                failures[rank] = value
                if grace is None and not tolerate:
                    grace = time.monotonic() + self.FAILURE_GRACE
        if tolerate:
            return Outcome(out, failures, sorted(gone))
        if failures:
            raise RankError(failures)
        return [out[r] for r in range(self.world_size)]

    def close(self) -> None:
        for q in self._tasks:
            try:
                q.put(None)
            except (ValueError, OSError):
                pass
        deadline = time.monotonic() + 10  # one shared grace period, not 10 s per rank
        for p in self._procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)

    def __enter__(self) -> "LocalWorld":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
