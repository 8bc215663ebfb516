"""A gloo world of N local processes that stays up and runs many jobs.

Starting ranks costs seconds (spawn, import torch, join the world); moves cost milliseconds. So
a ``LocalWorld`` starts its ranks once and then runs any number of jobs — module-level
functions, pickled by reference — on all ranks at once::

    with LocalWorld(4) as world:
        reports = world.run(my_job, arg)   # my_job(arg) runs on every rank; one result per rank

The driver hosts the TCPStore on a free port it picked itself (port 0), so ranks can never join a
stale world left by someone else. Every wait has a timeout; a job that raises on any rank raises
``RankError`` in the driver with each failing rank's traceback.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import time
import traceback
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


def _worker(rank: int, world_size: int, port: int, timeout_s: float, tasks, results, threads: int):
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    torch.set_num_threads(threads)
    store = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=False,
                          timeout=timedelta(seconds=timeout_s))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
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

    def __init__(self, world_size: int, timeout: float = 120.0, threads_per_rank: int = 1):
        self._broken: str | None = None
        self.world_size = world_size
        self.timeout = timeout
        self._store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True,
                                    wait_for_workers=False, timeout=timedelta(seconds=timeout))
        ctx = mp.get_context("spawn")
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        self._procs = [ctx.Process(target=_worker, daemon=True,
                                   args=(r, world_size, self._store.port, timeout, self._tasks[r],
                                         self._results, threads_per_rank))
                       for r in range(world_size)]
        for p in self._procs:
            p.start()
        self._collect(timeout=max(timeout, 180.0))  # "ready" from every rank

    def run(self, fn: Callable[..., Any], *args, timeout: float | None = None, **kwargs) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results in rank order."""
        if self._broken:
            raise RuntimeError(f"this LocalWorld is broken ({self._broken}); start a new one")
        for q in self._tasks:
            q.put((fn, args, kwargs))
        return self._collect(timeout or self.timeout)

    def _collect(self, timeout: float) -> list[Any]:
        """Every rank's answer. A rank that fails usually leaves the others blocked in a collective
        with it, so after the first failure the others get ``FAILURE_GRACE`` seconds, not the whole
        timeout; a rank process that dies is noticed within seconds. Either way the world is
        marked broken: its ranks may still be inside the failed job."""
        out: dict[int, Any] = {}
        failures: dict[int, str] = {}
        now = time.monotonic()
        deadline, grace = now + timeout, None
        while len(out) + len(failures) < self.world_size:
            waiting = sorted(set(range(self.world_size)) - set(out) - set(failures))
            try:
                rank, ok, value = self._results.get(timeout=1.0)
            except queue.Empty:
                now = time.monotonic()
                dead = [r for r in waiting if not self._procs[r].is_alive()]
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
                if grace is None:
                    grace = time.monotonic() + self.FAILURE_GRACE
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
