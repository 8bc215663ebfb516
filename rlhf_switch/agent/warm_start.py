"""The two agent tasks' supervised warm starts, and their measurement.

``warm_start_calc`` / ``warm_start_guess`` build the project's tiny Llama (``model.hf_config`` of
``configs/grpo_tiny.yaml``: 64-id vocabulary, 64-token context) from a seed, make the task's
expert transcripts (``rlhf_switch.agent.experts``) from its train split and train on them
(``rlhf_switch.agent.sft``); ``evaluate_at`` steps, they measure the held-out split (greedy):
the calculator task's exact match with the tool and without it, the game's success rate.

    python -m rlhf_switch.agent.warm_start calc --steps 300 600 --seeds 0 1
    python -m rlhf_switch.agent.warm_start guess --steps 300 600 --seeds 0 1

prints one JSON line per (seed, evaluated step) and the minutes each run took.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Sequence

import torch

from ..rl.sft import build_initial_model
from ..rl.tasks import CharTokenizer, make_splits
from .calc import CalcTask
from .evaluate import evaluate_calc, evaluate_guess
from .experts import calc_transcripts, guess_transcripts
from .guess import GuessTask
from .sft import sft_transcripts

TINY_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "grpo_tiny.yaml"


def tiny_hf_config(path: str | Path = TINY_CONFIG) -> dict:
    """The ``model.hf_config`` block of a run config (default: the project's tiny Llama)."""
    import yaml

    return dict(yaml.safe_load(Path(path).read_text())["model"]["hf_config"])


def _train(model, transcripts, steps, lr, batch_size, seed, evaluate_at, measure) -> tuple[dict, list[dict]]:
    marks = sorted(set(evaluate_at) | {steps})
    points: list[dict] = []
    t0 = time.perf_counter()

    def callback(step: int, loss: float) -> None:
        if step in marks:
            t = time.perf_counter()
            points.append({"step": step, "loss": loss, **measure(), "train_minutes": (t - t0 - sum(
                p["eval_seconds"] for p in points)) / 60})
            points[-1]["eval_seconds"] = time.perf_counter() - t
            model.train()
    stats = sft_transcripts(model, transcripts, steps, lr, batch_size, seed, callback=callback)
    return stats, points


def warm_start_calc(hf_config: dict, steps: int, seed: int, num_train: int = 4000, num_heldout: int = 200,
                    data_seed: int = 0, direct_fraction: float = 0.25, lr: float = 1e-3, batch_size: int = 32,
                    evaluate_at: Sequence[int] = (), task: CalcTask | None = None) -> tuple[torch.nn.Module, dict]:
    """The calculator task's warm-started model and ``{"sft": stats, "points": [...]}``, a point
    per evaluated step: ``with_tool`` and ``without_tool`` held-out exact match, ``tool_calls``
    (per sample, with the tool) and ``tool_call_success``."""
    task = task or CalcTask()
    tok = CharTokenizer()
    model = build_initial_model(hf_config, seed)
    ctx = int(model.config.max_position_embeddings)
    if task.longest_episode() > ctx:
        raise ValueError(f"the task's longest episode is {task.longest_episode()} tokens, the context {ctx}")
    splits = make_splits(task, num_train, num_heldout, data_seed)
    data = calc_transcripts(splits.train, tok, ctx, direct_fraction=direct_fraction, seed=data_seed)

    def measure() -> dict:
        with_tool = evaluate_calc(model, splits.heldout, tools=True)
        without = evaluate_calc(model, splits.heldout, tools=False)
        return {"with_tool": with_tool["accuracy"], "without_tool": without["accuracy"],
                "tool_calls": with_tool["tool_calls_per_sample"], "tool_call_success": with_tool["tool_call_success"],
                "examples": [(e.actions, e.observations) for e in with_tool["episodes"][:3]]}
    stats, points = _train(model, data, steps, lr, batch_size, seed, evaluate_at, measure)
    return model, {"sft": stats, "points": points}


def warm_start_guess(hf_config: dict, steps: int, seed: int, games_per_sample: int = 40, noise: float = 0.5,
                     num_heldout: int = 16, data_seed: int = 0, lr: float = 1e-3, batch_size: int = 32,
                     max_turns: int = 6, evaluate_at: Sequence[int] = (),
                     task: GuessTask | None = None) -> tuple[torch.nn.Module, dict]:
    """The game's warm-started model and ``{"sft": stats, "points": [...]}``: ``success`` on the
    held-out secrets and on every secret (``success_all``), ``turns`` (mean)."""
    task = task or GuessTask()
    tok = CharTokenizer()
    model = build_initial_model(hf_config, seed)
    ctx = int(model.config.max_position_embeddings)
    splits = make_splits(task, task.space_size() - num_heldout, num_heldout, data_seed)
    data = guess_transcripts(splits.train, tok, ctx, games_per_sample, noise, seed=data_seed, max_turns=max_turns)
    everything = list(task.all_samples())

    def measure() -> dict:
        held = evaluate_guess(model, splits.heldout, max_turns)
        every = evaluate_guess(model, everything, max_turns)
        return {"success": held["success"], "success_all": every["success"], "turns": every["turns_mean"],
                "invalid": sum(i.get("feedback") == "x" for e in every["episodes"] for i in e.infos) / len(everything),
                "examples": [e.actions for e in every["episodes"][:3]]}
    stats, points = _train(model, data, steps, lr, batch_size, seed, evaluate_at, measure)
    return model, {"sft": stats, "points": points}


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("task", choices=["calc", "guess"])
    ap.add_argument("--steps", type=int, nargs="+", required=True, help="evaluate after each; train to the last")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--num-train", type=int, default=4000, help="calc: train samples")
    ap.add_argument("--direct-fraction", type=float, default=0.25, help="calc: transcripts without the tool")
    ap.add_argument("--games", type=int, default=40, help="guess: games per train secret")
    ap.add_argument("--noise", type=float, default=0.5, help="guess: the player's chance of a random possible guess")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    hf = tiny_hf_config()
    for seed in args.seeds:
        t0 = time.perf_counter()
        if args.task == "calc":
            _, out = warm_start_calc(hf, max(args.steps), seed, num_train=args.num_train, lr=args.lr,
                                     batch_size=args.batch_size, direct_fraction=args.direct_fraction,
                                     evaluate_at=args.steps)
        else:
            _, out = warm_start_guess(hf, max(args.steps), seed, games_per_sample=args.games, noise=args.noise,
                                      lr=args.lr, batch_size=args.batch_size, evaluate_at=args.steps)
        for p in out["points"]:
            print(json.dumps({"task": args.task, "seed": seed, **{k: v for k, v in vars(args).items()
                                                                    if k not in ("task", "steps", "seeds")}, **p}),
                  flush=True)
        print(json.dumps({"task": args.task, "seed": seed, "minutes": (time.perf_counter() - t0) / 60,
                          "sft": out["sft"]}), flush=True)


if __name__ == "__main__":
    main()
