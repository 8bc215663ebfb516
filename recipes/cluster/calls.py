"""Calls to many actors at once and what their failures become: ``wait_all`` (a progress bar, the
first failure raised, the member named), ``stop_actors``, and the run's errors for a rollout engine
that failed (``RolloutEngineFailed``) and a weight sync that lost a member (``SyncFailed``)."""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Sequence

from rlhf_switch.timeouts import PHASE_S, SHUTDOWN_S


@contextmanager
def phase(desc: str, total: int, quiet: bool):
    """A progress bar for one phase of an iteration (``update`` per finished actor call)."""
    from tqdm import tqdm

    bar = tqdm(total=total, desc=desc, leave=False, disable=quiet, dynamic_ncols=True)
    try:
        yield bar
    finally:
        bar.close()


def wait_all(ray, refs: list, desc: str, quiet: bool, timeout: float = PHASE_S, died: list | None = None,
             failed=None) -> list:
    """``ray.get`` of ``refs`` in order, with a progress bar that advances as each finishes; the
    first failure is raised at once (the others are not waited for). ``died``: a list that takes
    the index of each call whose actor died (its result None) instead of raising. ``failed(index,
    error)``: the exception raised instead of Ray's ``RayTaskError`` when a call raised (the caller
    names the member; the error is chained)."""
    from ray.exceptions import RayActorError, RayTaskError

    pending, index = list(refs), {ref: i for i, ref in enumerate(refs)}
    deadline = time.monotonic() + timeout
    with phase(desc, len(refs), quiet) as bar:
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not done:
                raise TimeoutError(f"{desc}: {len(pending)} of {len(refs)} actor calls unfinished after {timeout} s")
            try:
                ray.get(done)  # raises the actor's error here
            except RayActorError:
                if died is None:
                    raise
                died.append(index[done[0]])
            except RayTaskError as e:
                if failed is None:
                    raise
                raise failed(index[done[0]], e) from e
            bar.update(len(done))
    return [None if died and i in died else ray.get(ref) for i, ref in enumerate(refs)]


def stop_actors(ray, actors: Sequence) -> None:
    """Shut the engines of ``actors`` down (their worker processes too), then free the actors."""
    try:
        ray.get([a.shutdown.remote() for a in actors], timeout=SHUTDOWN_S)
    except Exception:  # noqa: BLE001 - best effort: the actors are killed next
        pass
    for a in actors:
        ray.kill(a)


class RolloutEngineFailed(RuntimeError):
    """A rollout engine that failed to start or while generating — its call raised, or its replica
    died and none is left to generate its share: one line naming the member (rollout replica, or
    the trainer rank whose actor runs the engine, with its node) and the engine's own error."""


def engine_error(error: Exception) -> str:
    """``Type: first line of the message`` of the exception a Ray call raised inside the actor (the
    engine's own, ``RayTaskError.cause``), not Ray's wrapper with the remote traceback."""
    cause = getattr(error, "cause", None)
    cause = cause if isinstance(cause, BaseException) else error
    lines = [line.strip() for line in str(cause).splitlines() if line.strip()]
    return f"{type(cause).__name__}: {lines[0] if lines else '(no message)'}"


class SyncFailed(RuntimeError):
    """A weight sync that failed, naming the channel member(s) lost — an actor Ray reports dead
    (``ActorDiedError``), else the ranks the surviving members' ``PeerLost`` errors name — as
    trainer rank / rollout replica and worker, with the node each was placed on."""

    def __init__(self, message: str, lost: list[str]):
        super().__init__(message)
        self.lost = lost

