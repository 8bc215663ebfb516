"""Resize requests from outside the config: a one-slot mailbox in the run's output directory.

A caller (another process, a notebook, a scheduler) asks a running loop for a new world::

    from rlhf_switch.elastic.requests import request_resize, wait_answer
    rid = request_resize("runs/grpo", world_size=2, train={"engine": "deepspeed", "zero_stage": 3, "dp": 2},
                         rollout={"engine": "torch", "tp": 1, "dp": 2})
    wait_answer("runs/grpo", rid)    # {"status": "accepted", "iteration": 5, ...}, later "done"

The loop takes the request at its next iteration boundary and checks it as an ``elastic.schedule``
entry at the next iteration (``rlhf_switch.problems.check_resize_request``: the config's types and the pre-start checks,
the devices Ray holds) before anything starts. A request that does not pass is answered
``refused`` with every problem, and the run trains on; one that passes becomes that schedule
entry — the new world is built during the current iteration and committed before the next, the
same path as a planned resize — and is answered ``accepted``, then ``done`` (or ``abandoned``).

Files (each written whole, then renamed into place): ``elastic_request.json`` (the pending
request; a second one is refused while it waits), ``elastic_request.taken.json`` (the last one
taken) and ``elastic_answer.json`` (the latest answer, with the request's id).
"""
from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path
from typing import Any, Mapping

from .plan import ResizeError
from ..timeouts import RESIZE_S

REQUEST, TAKEN, ANSWER = "elastic_request.json", "elastic_request.taken.json", "elastic_answer.json"
FINAL = ("done", "refused", "abandoned")


def _write(path: Path, data: Mapping) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(dict(data)))
    os.replace(tmp, path)


def request_resize(output_dir, world_size: int, train: Mapping, rollout: Mapping,
                   reference: Mapping | None = None, reason: str | None = None,
                   critic: Mapping | None = None) -> str:
    """Ask the loop writing to ``output_dir`` for a world of ``world_size`` devices with these
    layouts (the phase blocks' form) from its next iteration on; returns the request's id.
    ``reason``: why (e.g. ``node_added`` from the loop's own node watch), kept in its records."""
    out = Path(output_dir)
    if not out.is_dir():
        raise ResizeError(f"{out}: no run writes there (no such directory)")
    if (out / REQUEST).exists():
        raise ResizeError(f"{out / REQUEST}: a request is still waiting to be taken")
    rid = uuid.uuid4().hex[:12]
    body: dict[str, Any] = {"id": rid, "world_size": world_size, "train": dict(train), "rollout": dict(rollout)}
    for phase, block in (("reference", reference), ("critic", critic)):  # exactly when the run has one
        if block is not None:
            body[phase] = dict(block)
    if reason is not None:
        body["reason"] = str(reason)
    _write(out / REQUEST, body)
    return rid


def take_request(output_dir) -> dict | None:
    """The pending request, moved aside (the loop's side, at an iteration boundary); None if none.
    A file that is not a JSON object is returned as ``{"id": None, "unreadable": why}``."""
    out = Path(output_dir)
    try:
        os.replace(out / REQUEST, out / TAKEN)
    except FileNotFoundError:
        return None
    try:
        body = json.loads((out / TAKEN).read_text())
    except (OSError, ValueError) as e:
        return {"id": None, "unreadable": f"{type(e).__name__}: {e}"}
    return body if isinstance(body, dict) else {"id": None, "unreadable": "not a JSON object"}


def answer(output_dir, request: Mapping, status: str, message: str, **more) -> dict:
    body = {"id": request.get("id"), "status": status, "message": message, **more}
    _write(Path(output_dir) / ANSWER, body)
    return body


def read_answer(output_dir) -> dict | None:
    try:
        return json.loads((Path(output_dir) / ANSWER).read_text())
    except (FileNotFoundError, ValueError):
        return None


def wait_answer(output_dir, rid: str, statuses=FINAL + ("accepted",), timeout_s: float = RESIZE_S) -> dict:
    """The loop's answer to request ``rid`` once its status is one of ``statuses``."""
    deadline = time.monotonic() + timeout_s
    while True:
        a = read_answer(output_dir)
        if a is not None and a.get("id") == rid and a.get("status") in statuses:
            return a
        if time.monotonic() > deadline:
            raise TimeoutError(f"no answer {statuses} to resize request {rid} in {output_dir} within {timeout_s} s")
        time.sleep(0.1)
