"""The user's view of a run: one JSONL record per iteration (and per evaluation) mirrored to
TensorBoard, every rollout in ``rollouts.jsonl``, and a PNG of rewards and time per iteration."""
from __future__ import annotations

import json
from pathlib import Path


class MetricsLog:
    """One JSONL record per iteration (and per evaluation), mirrored to TensorBoard.

    A new run starts both files empty. A resumed run (``resume_from``: the first iteration it
    runs) first drops every record of iteration ``resume_from`` or later — what the interrupted
    run wrote after its checkpoint, which the resumed run writes again — so each iteration (and
    each evaluation label) is in the files once; TensorBoard hides those steps (``purge_step``)."""

    def __init__(self, out_dir: Path, tensorboard: bool, resume_from: int | None = None):
        self.path = out_dir / "metrics.jsonl"
        rollouts = out_dir / "rollouts.jsonl"
        for f in (self.path, rollouts):
            if resume_from is None:
                f.write_text("")
            else:
                truncate_records(f, resume_from)
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(out_dir / "tensorboard"), purge_step=resume_from or None)

    def write(self, rec: dict, step: int) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        if self.tb is not None:
            for k, v in rec.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "iteration":
                    self.tb.add_scalar(k, v, step)
            self.tb.flush()

    def write_rollouts(self, iteration: int, prompts, responses, logprobs, rewards, texts=None) -> None:
        """Every generated sample of the iteration (token ids; ``texts``: the prompts and decoded
        responses as text, ``prompt_texts``/``response_texts``), in ``rollouts.jsonl``."""
        with (self.path.parent / "rollouts.jsonl").open("a") as f:
            f.write(json.dumps({"iteration": iteration, "prompts": prompts, "responses": responses,
                                "logprobs": logprobs, "rewards": list(rewards), **(texts or {})}) + "\n")

    def records(self) -> list[dict]:
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def truncate_records(path: Path, before: int) -> int:
    """Keep only the JSONL records of ``path`` whose ``iteration`` is below ``before`` (and drop a
    line a crash left half-written); replaced atomically (a temporary file renamed over it), so a
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
        if int(rec.get("iteration", -1)) < before:
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


def plot_run(records: list[dict], path: Path, title: str) -> Path | None:
    """reward (train samples and held-out) per iteration, and each iteration's time split into
    switch / generate / train."""
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
    a.legend()
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
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
