"""The user's view of a run: one JSONL record per iteration (and per evaluation) mirrored to
TensorBoard, every rollout in ``rollouts.jsonl``, and a PNG of rewards and time per iteration."""
from __future__ import annotations

import json
from pathlib import Path


class MetricsLog:
    """One JSONL record per iteration (and per evaluation), mirrored to TensorBoard."""

    def __init__(self, out_dir: Path, tensorboard: bool, append: bool):
        self.path = out_dir / "metrics.jsonl"
        if not append:
            self.path.write_text("")
            (out_dir / "rollouts.jsonl").write_text("")
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(out_dir / "tensorboard"))

    def write(self, rec: dict, step: int) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        if self.tb is not None:
            for k, v in rec.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "iteration":
                    self.tb.add_scalar(k, v, step)
            self.tb.flush()

    def write_rollouts(self, iteration: int, prompts, responses, logprobs, rewards) -> None:
        """Every generated sample of the iteration (token ids), in ``rollouts.jsonl``."""
        with (self.path.parent / "rollouts.jsonl").open("a") as f:
            f.write(json.dumps({"iteration": iteration, "prompts": prompts, "responses": responses,
                                "logprobs": logprobs, "rewards": list(rewards)}) + "\n")

    def records(self) -> list[dict]:
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


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
