"""Resize requests from outside the config: a one-slot mailbox in the run's output directory.

A caller (another process, a notebook, a scheduler) asks a running loop for a new world::

    from rlhf_switch.elastic.requests import request_resize, wait_answer
    rid = request_resize("runs/grpo", world_size=2, train={"engine": "deepspeed", "zero_stage": 3, "dp": 2},
                         rollout={"engine": "torch", "tp": 1, "dp": 2})
    wait_answer("runs/grpo", rid)    # {"status": "accepted", "iteration": 5, ...}, later "done"

The loop takes the request at its next iteration boundary and checks it as an ``elastic.schedule``
entry at the next iteration (``checked_request``: the config's own validators and fit checks,
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

REQUEST, TAKEN, ANSWER = "elastic_request.json", "elastic_request.taken.json", "elastic_answer.json"
ENTRY_KEYS = ("world_size", "train", "rollout", "reference", "critic")
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


def wait_answer(output_dir, rid: str, statuses=FINAL + ("accepted",), timeout_s: float = 600.0) -> dict:
    """The loop's answer to request ``rid`` once its status is one of ``statuses``."""
    deadline = time.monotonic() + timeout_s
    while True:
        a = read_answer(output_dir)
        if a is not None and a.get("id") == rid and a.get("status") in statuses:
            return a
        if time.monotonic() > deadline:
            raise TimeoutError(f"no answer {statuses} to resize request {rid} in {output_dir} within {timeout_s} s")
        time.sleep(0.1)


def checked_request(cfg, request: Mapping, iteration: int, last: int, devices_held: int | None):
    """The run's config with ``request`` as the ``elastic.schedule`` entry at ``iteration`` (the
    one after the boundary it was taken at), checked like a schedule entry in the config: the
    config's validators, the pre-start checks of the world it makes (``rlhf_switch.problems``; its
    reward already ran), and the ``devices_held`` Ray can
    give (None: the run has no elastic device manager). Returns (config, entry); raises one
    ``ConfigError`` listing every problem."""
    from ..problems import check_run
    from ..rl.config import ConfigError, load_config

    where = "resize request"

    def refuse(problems: list[str]):
        return ConfigError(f"{where} refused: {len(problems)} problem{'s' * (len(problems) != 1)}", problems)

    problems = []
    if "unreadable" in request:
        raise refuse([f"{where}: unreadable ({request['unreadable']})"])
    unknown = sorted(set(request) - set(ENTRY_KEYS) - {"id", "reason"})
    if unknown:
        problems.append(f"{where}: unknown keys {unknown} (give {', '.join(ENTRY_KEYS)})")
    if devices_held is None:
        problems.append(f"{where}: this run has no elastic device manager (give the config an elastic block, "
                        f"with the torch rollout engine or vLLM replicas, colocated)")
    if iteration > last:
        problems.append(f"{where}: the run ends at iteration {last}; there is no next iteration to resize before")
    schedule = [e.model_dump() for e in (cfg.elastic.schedule if cfg.elastic else [])]
    if any(e["iteration"] == iteration for e in schedule):
        problems.append(f"{where}: elastic.schedule already resizes before iteration {iteration}")
    if len(problems) > len(unknown[:1]):  # no entry to check
        raise refuse(problems)
    entry = {**{k: request[k] for k in ENTRY_KEYS if k in request}, "iteration": iteration}
    data = cfg.model_dump()
    data["elastic"] = {**(data.get("elastic") or {}),
                       "schedule": sorted(schedule + [entry], key=lambda e: e["iteration"])}
    try:
        new = load_config(data)
        check_run(new, skip=("reward",))
    except ConfigError as e:
        raise refuse(problems + (e.problems or [str(e)])) from None
    (accepted,) = [e for e in new.elastic.schedule if e.iteration == iteration]
    if accepted.world_size > devices_held:
        problems.append(f"{where}: world_size {accepted.world_size} — Ray holds {devices_held} devices for this run")
    if problems:
        raise refuse(problems)
    return new, accepted


def scaled_config(cfg, world: int):
    """The run's config on ``world`` devices, its train, rollout and reference layouts scaled
    along DP (``nodes.scaled_request``): the world a lost node leaves (``recovery.recover``).
    Checked as the config is: its validators and the pre-start checks; raises one ``ConfigError``
    (e.g. a TP that does not divide ``world``, a batch the new DP does not divide)."""
    from ..problems import check_run
    from ..rl.config import ConfigError, load_config
    from .nodes import scaled_request

    data = cfg.model_dump()
    data.update(scaled_request(data, world))
    try:
        new = load_config(data)
        check_run(new, skip=("reward",))
    except ConfigError as e:
        raise ConfigError(f"no {world}-device world with the run's layouts scaled along DP",
                          e.problems or [str(e)]) from None
    return new
