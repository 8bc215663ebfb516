"""Where environments run: a pool of Ray worker actors, or this process (unit tests, evaluation).

Both pools have the same asyncio API, so many samples' episodes run concurrently::

    pool = RayEnvPool(num_workers=4, num_cpus=0.25, timeout_s=30)      # or LocalEnvPool()
    reply = await pool.reset(session, "guess", sample)                 # env spec, sample, env_kwargs
    reply = await pool.step(session, action)                           # EnvReply
    await pool.close(session)                                          # always, however it ended
    pool.shutdown()

A session is one sample's episode: its environment instance lives in one worker (``EnvHost``) from
``reset`` to ``close``, and every call of the session goes to that worker. An ``EnvReply`` carries
the step's observation, reward, done and info — or, when the environment failed the sample,
``finish_reason`` (``env_error`` or ``timeout``) and ``error`` (the message). Nothing an
environment does raises in the caller: it raises, returns a non-string observation or a
non-number reward, cannot be built or imported, takes longer than ``timeout_s``, or its worker
dies — each ends that session's sample with its reason. The caller's own mistakes (a session
reset twice, a call on a session that is not open, two calls of one session at once) raise.

``RayEnvPool``: ``num_workers`` actors, each with ``num_cpus`` (fractions are fine) and
``max_concurrency`` threads, so one session's slow or hung call does not hold the worker's other
sessions. A new session goes to the worker with the fewest open sessions. A call's clock starts
when the worker is up (its start has its own limit, ``start_timeout_s``). A call past
``timeout_s`` fails its session with ``timeout`` and retires the worker — a new one takes its
place at once; the retired one (still running the hung call) finishes its other sessions and is
killed when the last of them closes. A worker that dies is replaced; its sessions fail with
``env_error`` at their next call (their state died with it); a ``reset`` that meets a dead worker
is retried once on its replacement (there was no state to lose). ``LocalEnvPool`` runs the same
``EnvHost`` in this process: calls run inline (no timeout), or, with ``timeout_s``, in threads
whose overrunning calls are abandoned (a thread cannot be stopped: use it for tests only).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import os
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

from .env import build_environment, check_observation, check_step_result
from .limits import FinishReason


@dataclass(frozen=True)
class EnvReply:
    """One environment call's answer, as the pool hands it to the episode."""

    observation: str = ""
    reward: float = 0.0
    done: bool = False
    info: dict = field(default_factory=dict)
    finish_reason: FinishReason | None = None  # env_error or timeout: the environment failed the sample
    error: str | None = None
    seconds: float = 0.0  # the call's time as the pool saw it (queueing in the worker included)

    @property
    def failed(self) -> bool:
        return self.finish_reason is not None

    @staticmethod
    def failure(reason: FinishReason, message: str, seconds: float = 0.0) -> "EnvReply":
        return EnvReply(done=True, finish_reason=reason, error=message, seconds=seconds)


def describe_exception(e: BaseException, limit: int = 3) -> str:
    """``Type: message`` and where it was raised (the innermost ``limit`` frames, one line each)."""
    frames = traceback.extract_tb(e.__traceback__)[-limit:]
    where = " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in reversed(frames))
    return f"{type(e).__name__}: {e}" + (f" (at {where})" if where else "")


class EnvHost:
    """The environments of a worker's sessions (session id -> instance). Each method returns an
    ``EnvReply`` and never raises: an environment's failure becomes ``env_error``, its instance is
    closed and dropped. Run as a Ray actor by ``RayEnvPool``, in process by ``LocalEnvPool``."""

    def __init__(self):
        self.envs: dict[str, Any] = {}

    def pid(self) -> int:
        return os.getpid()

    def _fail(self, session: str, what: str, e: BaseException) -> EnvReply:
        env = self.envs.pop(session, None)
        if env is not None:
            try:
                env.close()
            except Exception:  # the sample already failed: its first error is the one to report
                pass
        return EnvReply.failure("env_error", f"environment {what}: {describe_exception(e)}")

    def reset(self, session: str, spec: str, kwargs: dict, sample: Any) -> EnvReply:
        if session in self.envs:
            return EnvReply.failure("env_error", f"session {session!r} is already open in this worker")
        try:
            env = build_environment(spec, **kwargs)
        except Exception as e:
            return EnvReply.failure("env_error", f"{spec!r} could not be built: {describe_exception(e)}")
        self.envs[session] = env
        try:
            obs = check_observation(env.reset(sample), "reset")
        except Exception as e:
            return self._fail(session, "reset", e)
        return EnvReply(obs)

    def step(self, session: str, action: str) -> EnvReply:
        env = self.envs.get(session)
        if env is None:
            return EnvReply.failure("env_error", f"no open environment for session {session!r}")
        try:
            r = check_step_result(env.step(action))
        except Exception as e:
            return self._fail(session, "step", e)
        return EnvReply(r.observation, r.reward, r.done, r.info)

    def close(self, session: str) -> EnvReply:
        """Close and drop the session's environment; ``error`` says what ``close`` raised, if it did
        (the sample's result stands: nothing is left to fail)."""
        env = self.envs.pop(session, None)
        if env is not None:
            try:
                env.close()
            except Exception as e:
                return EnvReply(done=True, error=f"environment close: {describe_exception(e)}")
        return EnvReply(done=True)

    def sessions(self) -> list[str]:
        return sorted(self.envs)


def _timed(reply: EnvReply, t0: float) -> EnvReply:
    return EnvReply(reply.observation, reply.reward, reply.done, reply.info, reply.finish_reason, reply.error,
                    time.perf_counter() - t0)


class _Sessions:
    """The caller-side rules both pools share: a session is reset once, called one call at a
    time, and ends at its first failure or ``done``."""

    def __init__(self):
        self._open: set[str] = set()
        self._busy: set[str] = set()

    def begin_reset(self, session: str) -> None:
        if session in self._open:
            raise ValueError(f"session {session!r} is already open: close it before resetting it again")
        self._open.add(session)
        self._busy.add(session)

    def begin_call(self, session: str) -> None:
        if session not in self._open:
            raise ValueError(f"session {session!r} is not open (never reset, or already closed)")
        if session in self._busy:
            raise RuntimeError(f"session {session!r} already has a call in flight: one call at a time")
        self._busy.add(session)

    def end_call(self, session: str) -> None:
        self._busy.discard(session)

    def end(self, session: str) -> bool:
        """Forget the session; whether it was open."""
        self._busy.discard(session)
        if session in self._open:
            self._open.discard(session)
            return True
        return False

    @property
    def open(self) -> set[str]:
        return set(self._open)


class LocalEnvPool:
    """Environments in this process (see the module docstring): for unit tests of environments
    and for evaluation, where starting Ray buys nothing."""

    def __init__(self, timeout_s: float | None = None):
        self.host = EnvHost()
        self.timeout_s = timeout_s
        self._sessions = _Sessions()
        self._threads = (concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="env")
                         if timeout_s is not None else None)

    async def _run(self, session: str, fn, *args) -> EnvReply:
        t0 = time.perf_counter()
        try:
            if self._threads is None:
                reply = fn(*args)
            else:
                fut = asyncio.get_running_loop().run_in_executor(self._threads, fn, *args)
                try:
                    reply = await asyncio.wait_for(fut, self.timeout_s)
                except asyncio.TimeoutError:
                    self.host.envs.pop(session, None)  # abandoned: its thread keeps running
                    return EnvReply.failure("timeout", f"the environment call of session {session!r} ran past "
                                                       f"{self.timeout_s} s", time.perf_counter() - t0)
        finally:
            self._sessions.end_call(session)
        return _timed(reply, t0)

    async def reset(self, session: str, env: str, sample: Any, env_kwargs: dict | None = None) -> EnvReply:
        self._sessions.begin_reset(session)
        return await self._run(session, self.host.reset, session, env, dict(env_kwargs or {}), sample)

    async def step(self, session: str, action: str) -> EnvReply:
        self._sessions.begin_call(session)
        return await self._run(session, self.host.step, session, action)

    async def close(self, session: str) -> None:
        if self._sessions.end(session):
            self.host.close(session)

    def shutdown(self) -> None:
        for s in self._sessions.open:
            self._sessions.end(s)
            self.host.close(s)
        if self._threads is not None:
            self._threads.shutdown(wait=False, cancel_futures=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()


@dataclass
class _Worker:
    actor: Any
    index: int  # the n-th worker this pool started (names it in messages)
    pid: int | None = None
    sessions: set = field(default_factory=set)
    retired: bool = False  # a call timed out on it: no new sessions; killed when its last one ends
    dead: bool = False


class RayEnvPool:
    """Environments in ``num_workers`` Ray actors (see the module docstring). Needs a running Ray
    (``ray.init``); the actors import the environment's module, so it must be importable there
    (``PYTHONPATH`` / the job's ``runtime_env``)."""

    def __init__(self, num_workers: int = 2, num_cpus: float = 0.25, timeout_s: float = 30.0,
                 start_timeout_s: float = 120.0, max_concurrency: int = 32):
        import ray

        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if not num_cpus > 0:
            raise ValueError(f"num_cpus must be > 0, got {num_cpus}")
        if not ray.is_initialized():
            raise RuntimeError("RayEnvPool needs a running Ray: ray.init(address='local', ...) first")
        self.ray = ray
        self.num_workers, self.num_cpus = num_workers, num_cpus
        self.timeout_s, self.start_timeout_s, self.max_concurrency = timeout_s, start_timeout_s, max_concurrency
        self._actor_cls = ray.remote(EnvHost)
        self._started = 0
        self.workers: list[_Worker] = [self._spawn() for _ in range(num_workers)]  # the ones taking sessions
        self._retired: list[_Worker] = []
        self._where: dict[str, _Worker] = {}
        self._sessions = _Sessions()
        self.replaced = {"timeout": 0, "died": 0}

    # ------------------------------------------------------------ workers

    def _spawn(self) -> _Worker:
        self._started += 1
        actor = self._actor_cls.options(num_cpus=self.num_cpus, max_concurrency=self.max_concurrency,
                                        max_restarts=0).remote()
        return _Worker(actor, self._started)

    def _replace(self, w: _Worker, why: str) -> None:
        """Take ``w`` out of the routing and start its successor in its place."""
        if w in self.workers:
            self.workers[self.workers.index(w)] = self._spawn()
            self.replaced[why] += 1
        if w.dead:
            self._kill(w)
            if w in self._retired:
                self._retired.remove(w)
        else:  # (a second timeout on a worker already retired changes nothing)
            w.retired = True
            if w not in self._retired:
                self._retired.append(w)
            self._kill_if_idle(w)

    def _kill(self, w: _Worker) -> None:
        try:
            self.ray.kill(w.actor, no_restart=True)
        except Exception:  # already gone
            pass

    def _kill_if_idle(self, w: _Worker) -> None:
        if w.retired and not w.sessions:
            self._kill(w)
            if w in self._retired:
                self._retired.remove(w)

    async def _ready(self, w: _Worker) -> str | None:
        """None once ``w`` answers (its pid recorded), else why it cannot take calls."""
        if w.dead:
            return f"environment worker {w.index} died"
        if w.pid is not None:
            return None
        try:
            w.pid = await asyncio.wait_for(_await(w.actor.pid.remote()), self.start_timeout_s)
            return None
        except asyncio.TimeoutError:
            why = (f"environment worker {w.index} did not start in {self.start_timeout_s} s (are there CPUs "
                   f"for {self.num_workers} workers x num_cpus={self.num_cpus}?)")
        except Exception as e:
            why = f"environment worker {w.index} failed to start: {type(e).__name__}: {e}"
        w.dead = True
        self._replace(w, "died")
        return why

    def _pick(self) -> _Worker:
        return min(self.workers, key=lambda w: (w.dead, len(w.sessions), w.index))

    async def _call(self, w: _Worker, session: str, method: str, *args) -> EnvReply:
        t0 = time.perf_counter()
        why = await self._ready(w)
        if why is not None:
            return EnvReply.failure("env_error", why, time.perf_counter() - t0)
        t0 = time.perf_counter()
        ref = getattr(w.actor, method).remote(*args)
        try:
            reply = await asyncio.wait_for(_await(ref), self.timeout_s)
        except asyncio.TimeoutError:
            w.sessions.discard(session)
            self._replace(w, "timeout")
            return EnvReply.failure("timeout", f"{method} of session {session!r} ran past {self.timeout_s} s "
                                               f"(environment worker {w.index}, pid {w.pid}, is replaced)",
                                    time.perf_counter() - t0)
        except self.ray.exceptions.RayActorError as e:
            w.dead = True
            self._replace(w, "died")
            return EnvReply.failure("env_error", f"environment worker {w.index} (pid {w.pid}) died: "
                                                 f"{type(e).__name__}: {str(e)[:300]}", time.perf_counter() - t0)
        except Exception as e:  # e.g. a sample or a result that does not pickle
            return EnvReply.failure("env_error", f"{method} of session {session!r} failed in Ray: "
                                                 f"{type(e).__name__}: {str(e)[:300]}", time.perf_counter() - t0)
        return _timed(reply, t0)

    # ------------------------------------------------------------ sessions

    async def reset(self, session: str, env: str, sample: Any, env_kwargs: dict | None = None) -> EnvReply:
        self._sessions.begin_reset(session)
        try:
            for attempt in range(2):
                w = self._pick()
                w.sessions.add(session)
                self._where[session] = w
                reply = await self._call(w, session, "reset", session, env, dict(env_kwargs or {}), sample)
                if not (w.dead and attempt == 0):  # a dead worker held no state yet: once more on its successor
                    break
                w.sessions.discard(session)
            if reply.failed:
                self._end(session)
            return reply
        finally:
            self._sessions.end_call(session)

    async def step(self, session: str, action: str) -> EnvReply:
        self._sessions.begin_call(session)
        try:
            w = self._where.get(session)
            if w is None:
                reply = EnvReply.failure("env_error", f"session {session!r} already ended")
            elif w.dead:
                reply = EnvReply.failure("env_error", f"environment worker {w.index} (pid {w.pid}) died")
            else:
                reply = await self._call(w, session, "step", session, action)
            if reply.failed:
                self._end(session)
            return reply
        finally:
            self._sessions.end_call(session)

    async def close(self, session: str) -> None:
        """End the session: its environment is closed in its worker (a close that raises or hangs
        costs nothing but, for a hang, the worker)."""
        w = self._where.get(session)
        if not self._sessions.end(session) or w is None:
            return
        if not w.dead and session in w.sessions:
            await self._call(w, session, "close", session)
        self._end(session)

    def _end(self, session: str) -> None:
        w = self._where.pop(session, None)
        if w is not None:
            w.sessions.discard(session)
            self._kill_if_idle(w)

    async def pids(self) -> list[int | None]:
        """The pids of the workers taking sessions (each started, if it was not yet)."""
        for w in list(self.workers):
            await self._ready(w)
        return [w.pid for w in self.workers]

    def worker_of(self, session: str) -> _Worker | None:
        return self._where.get(session)

    def shutdown(self) -> None:
        for w in self.workers + self._retired:
            self._kill(w)
        self.workers, self._retired = [], []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()


async def _await(ref):
    return await ref
