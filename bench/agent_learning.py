"""Learning curves of an agent run over seeds: the config as shipped, one run per seed, the greedy
reward on the evaluation set (played as episodes: the held-out samples, or with ``eval.split: all``
the held-out then the train ones) and the sampled reward per iteration, plotted.

    python -m bench.agent_learning [--config configs/agent_calc_tiny.yaml] [--seeds 0 1 2]
        [--iterations N] [--out runs/bench/agent_learning] [--plot-only]

Each seed runs ``rlhf-switch train`` on the config with ``seed`` set (its own warm start too) into
``<out>/<config stem>/seed<N>``; ``--plot-only`` reads those runs' ``metrics.jsonl`` again. Prints
per seed the greedy reward before, at each evaluation and after, and the mean sampled reward of
the first and last five iterations; writes ``curves.png`` and ``summary.json`` beside the runs.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def curves(run_dir: Path) -> dict:
    heldout, sampled = {}, {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "heldout_reward" in r:
            heldout[r["iteration"]] = r["heldout_reward"]
        elif "reward_mean" in r:
            sampled[r["iteration"]] = r["reward_mean"]
    return {"heldout": heldout, "sampled": sampled}


def plot(per_seed: dict, path: Path, title: str, evaluated: str = "held-out") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.5))
    for i, (seed, c) in enumerate(sorted(per_seed.items())):
        a.plot(list(c["heldout"]), list(c["heldout"].values()), marker="o", color=f"C{i}", label=f"seed {seed}")
        b.plot(list(c["sampled"]), list(c["sampled"].values()), color=f"C{i}", label=f"seed {seed}")
    a.set(title=f"{evaluated}, greedy episodes", xlabel="iteration", ylabel="reward")
    b.set(title="sampled episodes (the training batch)", xlabel="iteration", ylabel="reward")
    a.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/agent_calc_tiny.yaml")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--iterations", type=int, default=None)
    ap.add_argument("--out", default="runs/bench/agent_learning")
    ap.add_argument("--plot-only", action="store_true")
    args = ap.parse_args(argv)
    import yaml

    root = Path(args.out) / Path(args.config).stem
    ev = yaml.safe_load(Path(args.config).read_text()).get("eval") or {}
    evaluated = "held-out" if ev.get("split", "heldout") == "heldout" else "held-out + train"
    per_seed = {}
    for seed in args.seeds:
        run_dir = root / f"seed{seed}"
        if not args.plot_only:
            from recipes.train import run

            cfg = yaml.safe_load(Path(args.config).read_text())
            cfg.update(seed=seed, output_dir=str(run_dir))
            run(cfg, iterations=args.iterations, quiet=True)
        per_seed[seed] = c = curves(run_dir)
        s = list(c["sampled"].values())
        first, last = statistics.mean(s[:5]), statistics.mean(s[-5:])
        h = c["heldout"]
        print(f"seed {seed}: {evaluated} " + " → ".join(f"{v:.3f}" for v in h.values())
              + f" (iterations {', '.join(map(str, h))}); sampled {first:.3f} (first 5) → {last:.3f} (last 5)")
    summary = {seed: {"heldout": c["heldout"], "sampled_first5": statistics.mean(list(c["sampled"].values())[:5]),
                      "sampled_last5": statistics.mean(list(c["sampled"].values())[-5:])}
               for seed, c in per_seed.items()}
    gains = [list(c["heldout"].values())[-1] - list(c["heldout"].values())[0] for c in per_seed.values()]
    print(f"{evaluated} gain, last − first: {', '.join(f'{g:+.3f}' for g in gains)} (mean {statistics.mean(gains):+.3f})")
    root.mkdir(parents=True, exist_ok=True)
    (root / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot(per_seed, root / "curves.png", f"{Path(args.config).stem}: seeds {', '.join(map(str, args.seeds))}", evaluated)
    print(f"plot: {root / 'curves.png'}")
    return summary


if __name__ == "__main__":
    main()
