"""Every registered algorithm on the same job, side by side: held-out change, stale check, time.

    python -m bench.algorithms [--config configs/grpo_tiny_fsdp.yaml] [--iterations 20]
        [--algorithms grpo,rloo,...] [--seeds 0] [--out bench/results/algorithms]

Each algorithm runs the config's job from the same warm start (SFT made once, copied into each
run): the config as a user writes it — the shipped file with ``algorithm.name`` changed, nothing
else — so each gets its paper's settings (``rl.choices.ALGORITHM_DEFAULTS``: DAPO's clip-higher,
dynamic sampling and overlong punishment, GSPO's tiny clip range, …) and the config's batch sizes
and learning rate. Each run is ``rlhf-switch train`` in a process of its own. Reported per algorithm
and seed: held-out greedy exact match before iteration 0 and after the last, the change, whether
every iteration's stale-weights check passed, the median seconds per iteration and the rollout
reward of the last iterations. A JSON and a plot (held-out change per algorithm) go to ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def algorithm_config(base: dict, name: str, seed: int, out: Path) -> dict:
    """The config as a user writes it for algorithm ``name``: the shipped one with ``name``
    changed and nothing else (its other settings come from the algorithm's paper)."""
    cfg = yaml.safe_load(yaml.safe_dump(base))
    cfg["algorithm"] = {**base["algorithm"], "name": name}
    cfg.update(seed=seed, output_dir=str(out))
    cfg.setdefault("checkpoint", {})["save_every"] = 0
    return cfg


def run_one(cfg: dict, work: Path, init: Path, iterations: int) -> dict:
    """One ``rlhf-switch train`` of ``cfg`` from the warm start ``init``; its records summarised."""
    out = Path(cfg["output_dir"])
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(init, out / "init")
    path = work / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(
        os.pathsep) if p]))
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "recipes.cli", "train", str(path), "--iterations", str(iterations),
                        "--quiet"], cwd=ROOT, env=env, capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError(f"{cfg['algorithm']['name']}: exit {p.returncode}\n{p.stderr[-3000:]}")
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    its = [r for r in recs if "reward_mean" in r]
    held = {r["eval"]: r["heldout_reward"] for r in recs if "heldout_reward" in r and r["iteration"] in (0, iterations)}
    return {"algorithm": cfg["algorithm"]["name"], "seed": cfg["seed"], "wall_s": time.perf_counter() - t0,
            "heldout_before": held["before"], "heldout_after": held["after"],
            "heldout_change": held["after"] - held["before"],
            "stale_check_passed": all(r["stale_check_passed"] for r in its),
            "max_stale_logprob_diff": max(r["stale_logprob_diff"] for r in its),
            "median_iteration_s": statistics.median(r["iteration_seconds"] for r in its[2:] or its),
            "reward_last5": statistics.mean(r["reward_mean"] for r in its[-5:]),
            "dynamic_sampling_draws": sum(r.get("dynamic_sampling", {}).get("draws", 0) for r in its)}


def time_to_reward(records: list[dict], target: float, window: int = 1) -> float | None:
    """Seconds of training until the rollout reward first reaches ``target``: the summed
    ``iteration_seconds`` from the start of the first iteration to the end of the first one whose
    ``reward_mean`` (the reward of the batch it trained on; with ``window`` > 1, the mean over it
    and the ``window - 1`` iterations before it) is at least ``target``; None when none is.
    ``records`` are a run's ``metrics.jsonl`` records: the iterations' are those with
    ``reward_mean``, taken in iteration order; evaluations and checkpoints between them are not
    counted."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    its = sorted((r for r in records if "reward_mean" in r), key=lambda r: r["iteration"])
    elapsed, rewards = 0.0, []
    for r in its:
        elapsed += r["iteration_seconds"]
        rewards.append(r["reward_mean"])
        last = rewards[-window:]
        if len(last) == window and sum(last) / window >= target:
            return elapsed
    return None


def side_by_side(base: dict, modes: list[str], seeds: list[int], out: Path, iterations: int, configure,
                 summarise, report) -> list[dict]:
    """Each mode's run of ``base``, per seed from one warm start, the modes in turn (a load that
    comes or goes weighs on every mode): ``configure(cfg, mode)`` changes a copy of ``base``,
    ``summarise(output_dir, result)`` adds the mode's own figures to ``run_one``'s, ``report(result)``
    prints it. Returns the results in run order, each with its ``mode``."""
    from recipes.common import warm_start
    from rlhf_switch.rl.config import load_config

    out.mkdir(parents=True, exist_ok=True)
    results = []
    for seed in seeds:
        init = out / f"init_seed{seed}"
        warm_start(load_config({**base, "seed": seed}), init, quiet=True)
        for mode in modes:
            cfg = yaml.safe_load(yaml.safe_dump(base))
            configure(cfg, mode)
            cfg.update(seed=seed, output_dir=str(out / f"{mode}_seed{seed}"))
            results.append(summarise(Path(cfg["output_dir"]), {**run_one(cfg, out, init, iterations), "mode": mode}))
            report(results[-1])
    return results


def table(results: list[dict]) -> str:
    rows = ["| algorithm | seed | held-out before → after | change | stale check | s / iteration | rollout reward (last 5) |",
            "|---|---|---|---|---|---|---|"]
    for r in results:
        rows.append(f"| {r['algorithm']} | {r['seed']} | {r['heldout_before']:.3f} → {r['heldout_after']:.3f} | "
                    f"{r['heldout_change']:+.3f} | {'passed' if r['stale_check_passed'] else 'FAILED'} "
                    f"(max Δ {r['max_stale_logprob_diff']:.1e}) | {r['median_iteration_s']:.2f} | {r['reward_last5']:.3f} |")
    return "\n".join(rows)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["algorithm"] for r in results))
    fig, ax = plt.subplots(figsize=(8, 3.5))
    for i, name in enumerate(names):
        changes = [r["heldout_change"] for r in results if r["algorithm"] == name]
        ax.scatter([i] * len(changes), changes, color="C0")
        ax.bar(i, statistics.mean(changes), color="C0", alpha=0.3)
    ax.axhline(0, color="black", linewidth=0.5)
    ax.set_xticks(range(len(names)), names, rotation=20)
    ax.set_ylabel("held-out exact match: after − before")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    from recipes.common import warm_start
    from rlhf_switch.rl.estimators import CRITIC_FREE
    from rlhf_switch.rl.config import load_config

    ap = argparse.ArgumentParser(prog="python -m bench.algorithms", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "grpo_tiny_fsdp.yaml")
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--algorithms", default=",".join(CRITIC_FREE))
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "algorithms")
    a = ap.parse_args(argv)
    base = yaml.safe_load(a.config.read_text())
    a.out.mkdir(parents=True, exist_ok=True)
    results = []
    for seed in [int(s) for s in a.seeds.split(",")]:
        init = a.out / f"init_seed{seed}"  # the warm start, made once per seed (cached by its fingerprint)
        warm_start(load_config(algorithm_config(base, "grpo", seed, a.out)), init, quiet=True)
        for name in a.algorithms.split(","):
            r = run_one(algorithm_config(base, name, seed, a.out / f"{name}_seed{seed}"), a.out, init, a.iterations)
            results.append(r)
            print(f"[{name} seed {seed}] held-out {r['heldout_before']:.3f} -> {r['heldout_after']:.3f} "
                  f"({r['heldout_change']:+.3f}), stale check {'passed' if r['stale_check_passed'] else 'FAILED'}, "
                  f"{r['median_iteration_s']:.2f} s/iteration", flush=True)
    (a.out / "algorithms.json").write_text(json.dumps(results, indent=1))
    plot(results, a.out / "algorithms.png")
    print(table(results))
    print(f"json: {a.out / 'algorithms.json'}; plot: {a.out / 'algorithms.png'}")
    return 0 if all(r["stale_check_passed"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
