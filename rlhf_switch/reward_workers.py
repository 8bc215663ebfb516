"""The run's reward function over whole batches: in the driver's own process, or in worker
processes where a time limit stops every call.

    reward = RewardRunner("my_rewards:score", workers=2, timeout_s=30, say=print)
    scores = reward(prompts, responses, answers)      # one float per sample, in order
    reward.close()                                    # or: with RewardRunner(...) as reward:

``workers`` (``task.reward_workers`` / ``data.reward_workers``; None: ``default_workers``):

- ``0`` — the function is called in this process, as ``score_samples`` does: no start-up and no
  copy of the batch, but a call cannot be stopped; one that took longer than ``timeout_s`` is
  refused when it returns. The default for the shipped rewards (``rlhf_switch.rl.rewards``: pure
  string functions, microseconds a sample).
- ``N >= 1`` — N worker processes (``spawn``), started once and kept for the run, each importing
  the function itself. A batch is cut into N contiguous parts, one per worker; a worker calls a
  batched function once on its part, a per-sample function once per sample. Before each call it
  writes the sample's index and the time into shared memory; the driver polls it, stops a call
  that runs past ``timeout_s`` (the worker and whatever it started are killed) and says every
  ``progress_every_s`` how many samples are scored, so a slow reward never holds the run silently.
  The default (1) for every other function.

A call that raises, returns something that is not a number, runs past the limit, or whose worker
dies becomes one ``RewardError`` naming the function and the sample (its index in the batch and
its strings, shortened); the runner is closed then (its workers stopped) and refuses further calls.

Why processes of our own and not ``concurrent.futures.ProcessPoolExecutor`` or Ray tasks: a
running call must be stoppable at its limit, and ProcessPoolExecutor has no public way to stop a
running call before Python 3.14 (its exit handler even waits for a hung worker); a worker that
dies is seen at once through its process sentinel. Ray tasks are out because the pre-start check
calls the reward through this same path before Ray starts, and the run's placement group holds
the CPUs Ray would schedule them on.
"""
from __future__ import annotations

import atexit
import os
import signal
import time
import weakref
from dataclasses import dataclass
from typing import Callable, Sequence

from .rl.rewards import (RewardError, Watch, describe_sample, is_batched, load_reward_fn, parse_reward_spec,
                         score_samples)

SHIPPED_MODULE = "rlhf_switch.rl.rewards"  # their functions run in the driver by default
LOAD_LIMIT_S = 60.0  # the least time a worker has to import the function (a heavy import under load)
FIELDS = 3  # per worker in the shared array: the index a call started on, when (monotonic), samples scored


def default_workers(spec: str) -> int:
    """0 (the driver's process) for the shipped rewards, 1 worker process for any other function:
    it may be slow or hang, and only a worker's calls can be stopped at the limit."""
    module, _ = parse_reward_spec(spec)
    return 0 if module == SHIPPED_MODULE else 1


class SharedWatch(Watch):
    """A worker's ``Watch``: its slot of the array the driver polls."""

    def __init__(self, progress, slot: int):
        self.progress, self.base = progress, FIELDS * slot

    def started(self, index: int) -> None:
        # the time first: a reader that sees the new index sees its start time
        self.progress[self.base + 1] = time.monotonic()
        self.progress[self.base] = index

    def scored(self, count: int) -> None:
        self.progress[self.base + 2] += count


def _serve(spec: str, conn, progress, slot: int) -> None:
    """A worker process: import the function, say whether it is batched, then score each part of
    a batch the driver sends — ``(first, prompts, responses, answers)`` -> ``("ok", scores)`` or
    ``("error", message)`` — until ``None`` or the driver is gone."""
    try:
        os.setpgrp()  # its own process group: what the function starts is killed with it
    except OSError:
        pass
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle; it stops us
    try:
        fn = load_reward_fn(spec)
    except RewardError as e:
        conn.send(("error", str(e)))
        return
    conn.send(("ready", is_batched(fn)))
    watch = SharedWatch(progress, slot)
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        if job is None:
            return
        first, prompts, responses, answers = job
        try:
            conn.send(("ok", score_samples(fn, prompts, responses, answers, first=first, watch=watch)))
        except RewardError as e:
            conn.send(("error", str(e)))
        except BaseException as e:  # noqa: BLE001 - SystemExit from the user's code, an unpicklable result
            conn.send(("error", f"reward function {spec} on samples {first}..{first + len(prompts) - 1}: "
                                f"{type(e).__name__}: {e}"))


@dataclass
class _Worker:
    slot: int
    process: object
    conn: object
    batched: bool | None = None  # None until it has loaded the function


_LIVE: "weakref.WeakSet[RewardRunner]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    """At exit, before multiprocessing's own handler joins (and would wait for) a hung worker."""
    for runner in list(_LIVE):
        runner.close()


class RewardRunner:
    """The reward function ``spec`` (``module:function``) over batches; see the module docstring.
    ``say``: where progress lines go (None: nowhere)."""

    def __init__(self, spec: str, workers: int | None = None, timeout_s: float = 60.0,
                 say: Callable[[str], None] | None = None, progress_every_s: float = 10.0):
        self.spec, self.timeout_s, self.say, self.progress_every_s = spec, float(timeout_s), say, progress_every_s
        self.workers = default_workers(spec) if workers is None else int(workers)
        if self.workers < 0 or self.timeout_s <= 0:
            raise ValueError(f"workers must be >= 0 and timeout_s > 0, got {self.workers}, {self.timeout_s}")
        self.fn = None
        self._pool: list[_Worker] = []
        self._closed = False
        if self.workers == 0:
            self.fn = load_reward_fn(spec)
            return
        import multiprocessing as mp

        ctx = mp.get_context("spawn")  # never fork: the driver holds Ray's and torch's threads
        self._progress = ctx.RawArray("d", FIELDS * self.workers)
        _LIVE.add(self)
        for slot in range(self.workers):
            here, there = ctx.Pipe()
            p = ctx.Process(target=_serve, args=(spec, there, self._progress, slot),
                            name=f"reward-worker-{slot}", daemon=False)  # its function may start processes
            _start_without_main(p)
            there.close()
            self._pool.append(_Worker(slot, p, here))

    def __repr__(self) -> str:
        where = "in this process" if self.workers == 0 else f"in {self.workers} worker process" + \
            "es" * (self.workers > 1)
        return f"{self.spec} {where}, each call limited to {self.timeout_s:g} s"

    def __enter__(self) -> "RewardRunner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- scoring -------------------------------------------------------------------------------
    def __call__(self, prompts: Sequence[str], responses: Sequence[str], answers: Sequence[str]) -> list[float]:
        """One float per sample, in order (module docstring)."""
        if self._closed:
            raise RewardError(f"reward function {self.spec}: its workers were stopped after an earlier error")
        if not len(prompts) == len(responses) == len(answers):
            raise ValueError(f"prompts, responses and answers must be equally long, got "
                             f"{len(prompts)}, {len(responses)}, {len(answers)}")
        if self.workers == 0:
            return score_samples(self.fn, prompts, responses, answers, timeout_s=self.timeout_s)
        if not prompts:
            return []
        self.wait_ready()
        prompts, responses, answers = list(prompts), list(responses), list(answers)
        pending: dict[int, tuple[_Worker, int, int]] = {}
        self._progress[:] = [0.0] * len(self._progress)  # no call started, nothing scored
        for w, (lo, hi) in zip(self._pool, _parts(len(prompts), len(self._pool))):
            self._progress[FIELDS * w.slot] = lo  # where it starts: a worker that dies first is named there
            w.conn.send((lo, prompts[lo:hi], responses[lo:hi], answers[lo:hi]))
            pending[w.slot] = (w, lo, hi)
        results: dict[int, list[float]] = {}
        t0 = said = time.monotonic()
        while pending:
            self._wait([w for w, _, _ in pending.values()])
            for slot, (w, lo, hi) in list(pending.items()):
                if not (w.conn.poll() or not w.process.is_alive()):
                    continue
                kind, value = self._receive(w, lambda: self._sample(prompts, responses, answers, w))
                if kind != "ok":
                    self._fail(value)
                results[lo] = value
                del pending[slot]
            now = time.monotonic()
            for w, lo, hi in pending.values():
                index, started = self._current(w)
                if started and now - started > self.timeout_s:
                    call = f"batched call on samples {lo}..{hi - 1}, the first" if w.batched else "call on"
                    self._fail(f"reward function {self.spec}: its {call} "
                               f"{describe_sample(index, prompts[index], responses[index], answers[index])} did not "
                               f"return within {self.timeout_s:g} s (reward_timeout_s); its worker process was "
                               f"stopped")
            if self.say is not None and pending and now - said >= self.progress_every_s:
                said = now
                done = sum(int(self._progress[FIELDS * w.slot + 2]) for w in self._pool)
                self.say(f"reward: {done}/{len(prompts)} samples scored after {now - t0:.0f} s "
                         f"({self!r})")
        return [s for lo in sorted(results) for s in results[lo]]

    def wait_ready(self) -> None:
        """Every worker has imported the function (else the RewardError of its import)."""
        limit = max(self.timeout_s, LOAD_LIMIT_S)
        deadline = time.monotonic() + limit
        waiting = [w for w in self._pool if w.batched is None]
        while waiting:
            if time.monotonic() > deadline:
                self._fail(f"reward function {self.spec}: its worker process did not import it within {limit:g} s")
            self._wait(waiting)
            for w in list(waiting):
                if w.conn.poll() or not w.process.is_alive():
                    kind, value = self._receive(w, lambda: "while importing it")
                    if kind != "ready":
                        self._fail(value)
                    w.batched = value
                    waiting.remove(w)

    # --- the workers ---------------------------------------------------------------------------
    def _poll_s(self) -> float:
        return min(0.5, self.timeout_s / 4)

    def _wait(self, workers: list[_Worker]) -> None:
        from multiprocessing.connection import wait

        wait([w.conn for w in workers] + [w.process.sentinel for w in workers], timeout=self._poll_s())

    def _current(self, w: _Worker) -> tuple[int, float]:
        base = FIELDS * w.slot
        index = int(self._progress[base])  # the index first: its start time is written before it
        return index, self._progress[base + 1]

    def _sample(self, prompts, responses, answers, w: _Worker) -> str:
        index, _ = self._current(w)
        return f"while scoring {describe_sample(index, prompts[index], responses[index], answers[index])}"

    def _receive(self, w: _Worker, doing: Callable[[], str]) -> tuple[str, object]:
        """The worker's message, or ``("error", why)`` when it died (its pipe closed)."""
        try:
            if w.conn.poll():
                return w.conn.recv()
        except (EOFError, OSError):
            pass
        w.process.join(1.0)
        code = w.process.exitcode
        how = (f"was killed by signal {-code} ({signal.Signals(-code).name})" if code is not None and code < 0
               else f"exited with code {code}")
        return "error", f"reward function {self.spec}: its worker process {how} {doing()}"

    def _fail(self, message: str):
        self.close(grace_s=0.0)  # a worker may be stuck in a call: no waiting for it
        raise RewardError(message)

    def close(self, grace_s: float = 1.0) -> None:
        """Stop the workers: asked to exit, killed (with their process group) when they have not
        within ``grace_s``."""
        if self._closed:
            return
        self._closed = True
        _LIVE.discard(self)
        for w in self._pool:
            try:
                w.conn.send(None)
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + grace_s
        for w in self._pool:
            w.process.join(max(0.0, deadline - time.monotonic()))
            if w.process.is_alive():
                _kill(w.process)
            w.process.join()
            w.conn.close()


def _start_without_main(process) -> None:
    """Start a spawned process that does not import the driver's ``__main__``. Spawn runs the
    main script (or ``-m`` module) again in every child, for targets defined there; ``_serve`` is
    not, and that import would cost the worker the driver's imports (Ray, the loop) and fail in a
    script that starts a run without an ``if __name__ == "__main__":`` guard. With a bare module
    in its place while the child's start-up data is taken, the child imports only what the
    reward function needs."""
    import sys
    import types

    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        process.start()
    finally:
        sys.modules["__main__"] = main


def _kill(process) -> None:
    """SIGKILL the worker's process group (what its function started goes too), or the worker."""
    try:
        if os.getpgid(process.pid) == process.pid:
            os.killpg(process.pid, signal.SIGKILL)
            return
    except OSError:
        pass
    process.kill()


def _parts(n: int, k: int) -> list[tuple[int, int]]:
    """``[0, n)`` cut into at most ``k`` contiguous, non-empty parts of nearly equal size."""
    k = min(k, n)
    size, extra = divmod(n, k)
    parts, lo = [], 0
    for i in range(k):
        hi = lo + size + (i < extra)
        parts.append((lo, hi))
        lo = hi
    return parts
