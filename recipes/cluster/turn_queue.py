"""One queue of turns the rollout replicas pull from: an agent run's turns with
``agent.turn_batching: continuous`` and ``rollout.pull_prompts: N`` (``agent.workflow.TurnStream``).

    queue = TurnQueue(cluster, n, version)   # version: what a turn records where the engine keeps none
    futures = queue.submit(prompts, seeds, budgets, temperature, stops)  # at any time, from any thread
    ...                  # each future: (tokens, logprobs, version) as soon as its chunk is back
    queue.close()        # replicas that died leave the run; their generating seconds are recorded

Turns wait in one queue, in the order they came. A thread hands each replica with no call of
this queue in flight the next chunk: up to N turns from the queue's head that share the head's
budget, temperature and stop ids (what one engine call takes; the engines stop at both, so a turn
never gets tokens it would cut). A replica that returns a chunk gets the next one at once — turns
submitted while every replica was busy included — so a replica stuck on a long turn holds only its
own chunk, and an episode never waits for turns other than its own. A replica that dies: its
chunk goes back to the queue's front for the others; it leaves the run (``drop_replicas``) at
``close``. None left: every turn not answered fails with ``RolloutEngineFailed``; a chunk out
longer than ``timeouts.PHASE_S``: every one fails with ``TimeoutError``.

A sample's tokens are those of any other batching (its own seed; the engines' results do not
depend on the batch). ``rollout_time`` gets each call's generating seconds against the seconds
during which the queue held or ran turns (not those when every episode was with its environment).
"""
from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Sequence

from recipes.cluster.calls import RolloutEngineFailed, engine_error
from rlhf_switch.timeouts import PHASE_S

POLL_S = 0.02  # how often the pump looks for a returned chunk while new turns may be waiting


@dataclass
class _Turn:
    prompt: list
    seed: int
    budget: int
    temperature: float
    stops: tuple
    future: Future

    @property
    def call(self) -> tuple:
        """What one engine call shares: budget, temperature and stop ids."""
        return self.budget, self.temperature, self.stops


class TurnQueue:
    """Turns pulled by ``cluster``'s generating replicas in chunks of up to ``chunk`` (module
    docstring)."""

    def __init__(self, cluster, chunk: int, version: int | None = None):
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk}")
        self.cluster, self.chunk = cluster, chunk
        self.version = version  # a turn's version where the engine keeps none (the driver's iteration)
        self.replicas = list(cluster.generating())
        if not self.replicas:
            raise RuntimeError("no rollout replica is left to generate with")
        self.calls: list[int] = []  # each engine call's number of turns, in the order sent
        self._pending: deque[_Turn] = deque()
        self._running: dict = {}  # ref -> (replica, its chunk)
        self._sent: dict = {}  # ref -> when it was sent (a chunk out longer than PHASE_S fails the queue)
        self._dead: list = []
        self._requeued = 0
        self._got: list[dict] = []
        self._error: BaseException | None = None
        self._closed = False
        self._wall_s, self._active_since = 0.0, None
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._pump, name="turn-queue", daemon=True)
        self._thread.start()

    # --- the caller's side ------------------------------------------------------------------------
    def submit(self, prompts: Sequence[Sequence[int]], seeds: Sequence[int], budgets: Sequence[int],
               temperature: float, stops: Sequence) -> list[Future]:
        futures = [Future() for _ in prompts]
        with self._cond:
            if self._error is not None or self._closed:
                for f in futures:
                    f.set_exception(self._error or RuntimeError("the turn queue is closed"))
                return futures
            for p, s, b, st, f in zip(prompts, seeds, budgets, stops, futures):
                self._pending.append(_Turn(list(p), int(s), int(b), float(temperature),
                                           tuple(sorted(int(t) for t in st)), f))
            self._cond.notify()
        return futures

    def close(self) -> None:
        """Stop taking turns (those never sent fail), wait for the calls in flight, then record
        the seconds and drop the replicas that died."""
        with self._cond:
            self._closed = True
            while self._pending:
                self._pending.popleft().future.set_exception(RuntimeError("the turn queue was closed first"))
            self._cond.notify()
        self._thread.join()
        self.cluster.rollout_time.add(self._wall_s, self._got)
        if self._dead:
            self.cluster.drop_lost(self._dead, self._requeued)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # --- the pump ---------------------------------------------------------------------------------
    def _next_chunk(self) -> list[_Turn]:
        """Up to ``chunk`` turns from the head that share its call; the others keep their places."""
        key, chunk, passed = self._pending[0].call, [], []
        while self._pending and len(chunk) < self.chunk:
            t = self._pending.popleft()
            (chunk if t.call == key else passed).append(t)
        self._pending.extendleft(reversed(passed))
        return chunk

    def _hand_out(self) -> None:
        """Each live replica with no chunk of this queue in flight gets the next one (under the lock)."""
        busy = [r for r, _ in self._running.values()]
        for r in self.replicas:
            if not self._pending:
                return
            if any(r is d for d in self._dead) or any(r is b for b in busy):
                continue
            chunk = self._next_chunk()
            budget, temperature, stops = chunk[0].call
            ref = r.generate.remote([t.prompt for t in chunk], budget, temperature, [t.seed for t in chunk],
                                    self.cluster._stop_ids(stops))
            self._running[ref] = (r, chunk)
            self._sent[ref] = time.monotonic()
            self.calls.append(len(chunk))

    def _clock(self, now: float) -> None:
        """Count the seconds during which turns were waiting or generating (under the lock)."""
        if self._active_since is not None:
            self._wall_s += now - self._active_since
        self._active_since = now if (self._pending or self._running) else None

    def _pump(self) -> None:
        try:
            while True:
                with self._cond:
                    self._clock(time.perf_counter())
                    self._hand_out()
                    self._clock(time.perf_counter())
                    if not self._running:
                        if self._closed:
                            return
                        self._cond.wait()
                        continue
                    refs = list(self._running)
                done, _ = self.cluster.ray.wait(refs, num_returns=1, timeout=POLL_S)
                for ref in done:
                    self._returned(ref)
                oldest = min((self._sent[r] for r in refs if r not in done), default=None)
                if oldest is not None and time.monotonic() - oldest > PHASE_S:
                    raise TimeoutError(f"a rollout replica has not answered a chunk of turns in {PHASE_S} s")
        except BaseException as exc:  # nothing may hang on a pump that stopped
            self._fail_all(exc)

    def _returned(self, ref) -> None:
        from ray.exceptions import RayActorError

        with self._cond:
            replica, chunk = self._running.pop(ref)
            self._sent.pop(ref, None)
        try:
            g = self.cluster.ray.get(ref)
        except RayActorError:
            with self._cond:
                self._dead.append(replica)
                self._pending.extendleft(reversed(chunk))
                self._requeued += len(chunk)
                alive = [r for r in self.replicas if not any(r is d for d in self._dead)]
            if not alive:
                self._fail_all(RolloutEngineFailed(
                    f"{self.cluster._replica_name(self.cluster._index(replica))} died while generating (its actor "
                    f"lost) and no rollout replica is left to generate its turns"))
            return
        except Exception as e:
            err = RolloutEngineFailed(f"{self.cluster._replica_name(self.cluster._index(replica))} failed while "
                                      f"generating: {engine_error(e)}")
            for t in chunk:
                t.future.set_exception(err)
            return
        with self._cond:
            self._got.append(g)
        version = self.version if g.get("version") is None else g["version"]
        for t, toks, lps in zip(chunk, g["tokens"], g["logprobs"]):
            t.future.set_result((toks, lps, version))

    def _fail_all(self, exc: BaseException) -> None:
        """Every turn waiting or in flight fails with ``exc``, and so does every later one."""
        with self._cond:
            self._error = exc
            waiting = list(self._pending) + [t for _, chunk in self._running.values() for t in chunk]
            self._pending.clear()
            self._running.clear()
            self._sent.clear()
            self._closed = True
            self._cond.notify_all()
        for t in waiting:
            if not t.future.done():
                t.future.set_exception(exc)
