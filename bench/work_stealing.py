"""Work stealing vs fixed shares over rollout replicas (``rollout.pull_prompts``), side by side in
one run: the same agent config on vLLM replicas of their own devices, with fixed shares
(``pull_prompts: 0``), each round's turns pulled in chunks of N, and every turn pulled from one
queue in chunks of N (``agent.turn_batching: continuous``), each run's replicas' idle share of
the generations' wall time (``replica_idle_share``; for the queue, of the time it held or ran
turns) and its rollout seconds per iteration.

    python -m bench.work_stealing [--config configs/agent_guess_tiny.yaml] [--pull 4]
        [--iterations 10] [--replicas 2] [--out runs/bench/work_stealing]

Every run uses the same seed, so they play the same samples: the rewards and turns per sample
must come out equal (the answers do not depend on which replica generated them), which the
bench checks. Prints one line per run and writes ``summary.json``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path


def summary(run_dir: Path) -> dict:
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    recs = [r for r in recs if "reward_mean" in r]
    idle = [r["replica_idle_share"] for r in recs if "replica_idle_share" in r]
    return {"iterations": len(recs),
            "idle_share": {k: statistics.mean(i[k] for i in idle) for k in idle[0]} if idle else {},
            "idle_share_max": statistics.mean(r["replica_idle_share_max"] for r in recs if "replica_idle_share_max" in r)
            if idle else float("nan"),
            "rollout_s": statistics.mean(r["phase_seconds"].get("rollout", 0.0) for r in recs),
            "reward_mean": [r["reward_mean"] for r in recs],
            "turns_mean": [r["agent"]["turns_mean"] for r in recs if "agent" in r]}


def main(argv=None) -> dict:
    import yaml

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/agent_guess_tiny.yaml")
    ap.add_argument("--pull", type=int, default=4)
    ap.add_argument("--iterations", type=int, default=10)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--out", default="runs/bench/work_stealing")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {}
    ways = (("fixed", 0, "rounds"), (f"pull{args.pull}", args.pull, "rounds"),
            (f"queue{args.pull}", args.pull, "continuous"))
    for name, pull, batching in ways:
        cfg = yaml.safe_load(Path(args.config).read_text())
        cfg["output_dir"] = str(out / name)
        cfg["agent"]["turn_batching"] = batching
        cfg["rollout"] = {"engine": "vllm", "tp": 1, "pp": 1, "dp": args.replicas, "mode": "disaggregated",
                          "pull_prompts": pull}
        cfg["algorithm"]["iterations"] = args.iterations
        cfg["eval"] = {"num_prompts": 8, **cfg.get("eval", {}), "every": 0}
        path = out / f"{name}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        subprocess.run([sys.executable, "-m", "recipes.train", str(path)], check=True)
        result[name] = s = summary(out / name)
        idle = ", ".join(f"replica {k} {v:.3f}" for k, v in sorted(s["idle_share"].items()))
        print(f"{name}: idle share {idle} (the larger, mean over iterations {s['idle_share_max']:.3f}); "
              f"rollout {s['rollout_s']:.2f} s/iteration")
    runs = list(result.values())
    result["same_samples"] = all(r["reward_mean"] == runs[0]["reward_mean"] and r["turns_mean"] == runs[0]["turns_mean"]
                                 for r in runs)
    print(f"the same rewards and turns every way: {result['same_samples']}")
    (out / "summary.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
