"""The user's view of a run: one JSONL record per iteration (and per evaluation), mirrored to the
run's logging backends (``logging: [tensorboard, wandb, mlflow]``), every rollout in
``rollouts.jsonl``, and a PNG of rewards and time per iteration."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Sequence


def scalars(rec: dict, prefix: str = "") -> dict[str, float]:
    """A record's numbers by name, a nested dict's as ``parent/child`` (``phase_seconds/reward``);
    bools, strings, lists and the iteration number (the step) left out."""
    out: dict[str, float] = {}
    for k, v in rec.items():
        if isinstance(v, dict):
            out.update(scalars(v, f"{prefix}{k}/"))
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and not (k == "iteration" and not prefix):
            out[f"{prefix}{k}"] = float(v)
    return out


class TensorBoard:
    """``<output_dir>/tensorboard``: TensorBoard event files. A resumed run hides the steps it
    writes again (``purge_step``)."""

    def __init__(self, out_dir: Path, resume_from: int | None, config: dict, name: str):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(out_dir / "tensorboard"), purge_step=resume_from or None)

    def write(self, values: dict[str, float], step: int) -> None:
        for k, v in values.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def close(self, ok: bool) -> None:
        self.writer.close()


class Wandb:
    """A Weights & Biases run (the ``wandb`` extra): project ``$WANDB_PROJECT`` (default
    ``rlhf-switch``), named ``$WANDB_NAME`` or after the output directory, its files under
    ``<output_dir>/wandb``; ``WANDB_MODE=offline`` keeps it on disk (``wandb sync`` uploads it
    later). The run config is the W&B run's config. A resumed run is a new W&B run of the same
    name, from the iteration it resumes at."""

    def __init__(self, out_dir: Path, resume_from: int | None, config: dict, name: str):
        import wandb

        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "rlhf-switch"),
                              name=os.environ.get("WANDB_NAME", name), dir=str(out_dir), config=config,
                              settings=wandb.Settings(console="off"))  # the metrics, not the terminal

    def write(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def close(self, ok: bool) -> None:
        self.run.finish(exit_code=0 if ok else 1)


class MLflow:
    """An MLflow run (the ``mlflow`` extra): at ``$MLFLOW_TRACKING_URI``, else in
    ``<output_dir>/mlflow.db`` (SQLite; artifacts in ``<output_dir>/mlartifacts``); experiment
    ``$MLFLOW_EXPERIMENT_NAME`` (default ``rlhf-switch``), the run named after the output
    directory, the run config as its parameters (``algorithm.lr``, ...) and as ``config.json``.
    A resumed run is a new MLflow run of the same name."""

    def __init__(self, out_dir: Path, resume_from: int | None, config: dict, name: str):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{out_dir.resolve() / 'mlflow.db'}"
        self.client = MlflowClient(tracking_uri=uri)
        experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME", "rlhf-switch")
        found = self.client.get_experiment_by_name(experiment)
        eid = found.experiment_id if found else self.client.create_experiment(
            experiment, artifact_location=None if os.environ.get("MLFLOW_TRACKING_URI")
            else (out_dir.resolve() / "mlartifacts").as_uri())
        self.run_id = self.client.create_run(eid, run_name=name).info.run_id
        params = [Param(k, str(v)[:6000]) for k, v in _flat(config).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 parameters per batch
            self.client.log_batch(self.run_id, params=params[i:i + 100])
        self.client.log_dict(self.run_id, config, "config.json")

    def write(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in values.items()])

    def close(self, ok: bool) -> None:
        self.client.set_terminated(self.run_id, "FINISHED" if ok else "FAILED")


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


# the names ``logging:`` takes -> the backend (what each needs installed: rlhf_switch.problems LOGGING_EXTRAS)
BACKENDS = {"tensorboard": TensorBoard, "wandb": Wandb, "mlflow": MLflow}


class BackendFailed(RuntimeError):
    """A logging backend named in the config that did not start (W&B not logged in, an MLflow
    server that does not answer): one line, before Ray; the command exits 2 as for bad input."""


class MetricsLog:
    """One JSONL record per iteration (and per evaluation), each also written to every logging
    backend named (``BACKENDS``; its numbers: ``scalars``).

    A new run starts both files empty. A resumed run (``resume_from``: the first iteration it
    runs) first drops every record of iteration ``resume_from`` or later — what the interrupted
    run wrote after its checkpoint, which the resumed run writes again — so each iteration (and
    each evaluation label) is in the files once; TensorBoard hides those steps (``purge_step``).
    ``config``: the run's config (W&B's run config, MLflow's parameters)."""

    def __init__(self, out_dir: Path, backends: Sequence[str] = ("tensorboard",), resume_from: int | None = None,
                 config: dict | None = None):
        self.path = out_dir / "metrics.jsonl"
        rollouts = out_dir / "rollouts.jsonl"
        for f in (self.path, rollouts):
            if resume_from is None:
                f.write_text("")
            else:
                truncate_records(f, resume_from)
        self.backends = []
        for name in backends:
            try:
                self.backends.append(BACKENDS[name](out_dir, resume_from, config or {}, out_dir.resolve().name))
            except Exception as e:  # not logged in, a tracking server that does not answer: one line, before Ray
                self.close(ok=False)
                raise BackendFailed(f"logging: {name} did not start: {type(e).__name__}: "
                                    f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}") from e

    def write(self, rec: dict, step: int) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        values = scalars(rec)
        if values:
            for backend in self.backends:
                backend.write(values, step)

    def write_rollouts(self, iteration: int, prompts, responses, logprobs, rewards, texts=None) -> None:
        """Every generated sample of the iteration (token ids; ``texts``: the prompts and decoded
        responses as text, ``prompt_texts``/``response_texts``), in ``rollouts.jsonl``."""
        with (self.path.parent / "rollouts.jsonl").open("a") as f:
            f.write(json.dumps({"iteration": iteration, "prompts": prompts, "responses": responses,
                                "logprobs": logprobs, "rewards": list(rewards), **(texts or {})}) + "\n")

    def drop_rerun(self, iteration: int) -> None:
        """A lost trainer's recovery runs ``iteration`` and the ones after it again: their
        iteration records and rollouts go (the recovery's own record and the elastic events stay),
        so each iteration is in the files once, as after a ``--resume``. (The backends keep what
        they were sent: TensorBoard and MLflow get the re-run's values of those steps too; W&B,
        whose steps only go up, keeps the first.)"""
        truncate_records(self.path, iteration, keep=lambda rec: not is_iteration_record(rec))
        truncate_records(self.path.parent / "rollouts.jsonl", iteration)

    def records(self) -> list[dict]:
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def close(self, ok: bool = True) -> None:
        """Every backend closed (``ok``: the run finished; W&B and MLflow mark it failed if not)."""
        backends, self.backends = self.backends, []
        for backend in backends:
            backend.close(ok)


def is_iteration_record(rec: dict) -> bool:
    """An iteration's own record (rewards, losses, timings), not an evaluation or an event."""
    return "reward_mean" in rec


def truncate_records(path: Path, before: int, keep=None) -> int:
    """Keep only the JSONL records of ``path`` whose ``iteration`` is below ``before``, or that
    ``keep(record)`` accepts (and drop a line a crash left half-written); replaced atomically (a temporary file renamed over it), so a
    crash here leaves the old file or the new one. Returns how many records were dropped."""
    import os

    if not path.exists():
        path.write_text("")
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            dropped += 1
            continue
        if int(rec.get("iteration", -1)) < before or (keep is not None and keep(rec)):
            kept.append(line)
        else:
            dropped += 1
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        f.write("".join(line + "\n" for line in kept))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return dropped


EVENT_KEYS = ("resize", "recovery", "event")  # the record keys an elastic event is written under
EVENT_NAMES = {"planned": "planned resize", "node_lost": "node lost", "node_added": "node added",
               "trainer_lost": "trainer lost", "requested": "requested resize",
               "request_refused": "resize request refused"}


def _layout_label(text) -> str:
    """``world 4, train {'engine': 'deepspeed', 'zero_stage': 3, 'dp': 4}`` (what the loop writes)
    as ``4× deepspeed z3 DP4``; any other text as it is (cut at 40 characters)."""
    import ast
    import re

    m = re.fullmatch(r"world (\d+), train (\{.*\})", str(text))
    if m:
        try:
            train = ast.literal_eval(m.group(2))
        except (ValueError, SyntaxError):
            train = None
        if isinstance(train, dict):
            parts = [str(train.get("engine", "?"))]
            if train.get("zero_stage") is not None:
                parts.append(f"z{train['zero_stage']}")
            parts += [f"{k.upper()}{train[k]}" for k in ("tp", "pp", "dp") if int(train.get(k, 1) or 1) > 1]
            return f"{m.group(1)}× " + " ".join(parts)
    return str(text)[:40]


def run_events(records: list[dict]) -> list[dict]:
    """The elastic events of a run log (a planned resize, a node lost or added, a trainer lost
    and recovered — whatever record holds a dict under ``resize``, ``recovery`` or ``event``), in
    iteration order: iteration (the event happened before it), kind, old → new layout, the
    stop-the-world seconds and whether it was abandoned, plus the label the PNG shows."""
    out = []
    for r in records:
        for key in EVENT_KEYS:
            e = r.get(key)
            if not isinstance(e, dict) or "iteration" not in r:
                continue
            kind = str(e.get("kind", key))
            ev = {"iteration": int(r["iteration"]), "kind": kind, "old": e.get("old"), "new": e.get("new"),
                  "stop_the_world_s": e.get("stop_the_world_s"), "abandoned": e.get("abandoned")}
            label = EVENT_NAMES.get(kind, kind.replace("_", " "))
            if ev["abandoned"]:
                label += " (abandoned)"
            elif ev["old"] is not None or ev["new"] is not None:
                label += f"\n{_layout_label(ev['old'])} → {_layout_label(ev['new'])}"
            if isinstance(ev["stop_the_world_s"], (int, float)):
                label += f"\nstop-the-world {ev['stop_the_world_s']:.2f} s"
            ev["label"] = label
            out.append(ev)
    return sorted(out, key=lambda ev: ev["iteration"])


def _mark_events(axes, events: list[dict]) -> None:
    """A vertical line at the boundary before each event's iteration, on every panel; the label
    on the first (staggered so that close events stay readable)."""
    for i, ev in enumerate(events):
        x = ev["iteration"] - 0.5
        color = "tab:red" if ev["kind"] in ("node_lost", "trainer_lost") else "tab:purple"
        for ax in axes:
            ax.axvline(x, color=color, ls="--", lw=1.2, alpha=0.8)
        axes[0].annotate(ev["label"], xy=(x, 1 - 0.17 * (i % 4)), xycoords=("data", "axes fraction"),
                         xytext=(3, -3), textcoords="offset points", va="top", fontsize=6.5, color=color,
                         zorder=10, bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": color, "alpha": 0.9})


def plot_run(records: list[dict], path: Path, title: str) -> Path | None:
    """reward (train samples and held-out) per iteration, and each iteration's time split into
    switch / generate / train; the run's elastic events (``run_events``) marked on the iteration
    axis of both, and listed in the PNG's ``Description`` text (what a test can read back)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    its = [r for r in records if "reward_mean" in r]
    evals = [r for r in records if "heldout_reward" in r]
    if not its:
        return None
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.plot([r["iteration"] for r in its], [r["reward_mean"] for r in its], label="rollout reward (train prompts)")
    if evals:
        a.plot([r["iteration"] for r in evals], [r["heldout_reward"] for r in evals], "o-", label="held-out greedy reward")
    a.set_xlabel("iteration")
    a.set_ylabel("reward")
    a.legend(loc="lower right")
    a.grid(alpha=0.3)
    x = [r["iteration"] for r in its]
    bottom = [0.0] * len(its)
    for key, label in (("switch_train_to_rollout_s", "switch train→rollout"), ("gen_seconds", "generate"),
                       ("train_seconds", "train (log-probs + update)")):
        vals = [r.get(key, 0.0) for r in its]
        b.bar(x, vals, bottom=bottom, label=label)
        bottom = [p + v for p, v in zip(bottom, vals)]
    b.set_xlabel("iteration")
    b.set_ylabel("seconds")
    b.legend()
    b.set_title("time per iteration")
    events = run_events(records)
    _mark_events((a, b), events)
    fig.suptitle(title)
    fig.tight_layout()
    described = "; ".join(f"iteration {ev['iteration']}: " + ev["label"].replace("\n", ", ") for ev in events)
    fig.savefig(path, dpi=110, metadata={"Description": f"events: {described or 'none'}"})
    plt.close(fig)
    return path
