"""The static split against devices moved between phases on the same job, side by side in one run.

    python -m bench.rebalance [--config configs/grpo_tiny_async.yaml] [--world 1] [--iterations 10]
        [--seeds 0,1] [--modes static,update,auto,lend,lend_auto] [--out bench/results/rebalance]

Both runs are the synchronous loop (``off_policy`` removed) with vLLM replicas on devices of their
own (``rollout.mode: disaggregated``), from the same warm start per seed. ``static``: the trainer
trains on its ``--world`` devices while the replicas' devices wait for the next sync. ``update``:
each iteration the training state moves into a world over both (twice the ranks, DP scaled) for
the log-probs and the update, and back before the sync (``recipes/elastic/rebalance.py``). ``auto``: only
in the iterations where that last took less time. ``lend`` (``elastic.lend: rollout``): the other
way — replicas on the trainer's devices take a share of every rollout; ``lend_auto``: only where
that last made the rollout shorter. Runs alternate per seed, so a load that comes
or goes weighs on every mode. Reported per run: the median seconds per
iteration (iterations 2..: the grown world is built in the background during the first), its
rollout, its train phases (log-probs + update) and the two moves, bytes per move, and whether every
check passed; then each mode's ratio to static of the seconds per iteration, and how many
iterations grew or lent.

On a CPU box every logical device shares the same cores, so the grown world computes no faster:
the table measures what the round trip costs, not the speed-up that devices of their own would give.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import yaml

from bench.algorithms import ROOT, side_by_side

MODES = ("static", "update", "auto", "lend", "lend_auto")


def summary(out: Path, res: dict) -> dict:
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    its = [r for r in recs if "reward_mean" in r][2:]

    def median(f):
        return statistics.median(f(r) for r in its)

    res.update(iteration_s=median(lambda r: r["iteration_seconds"]),
               rollout_s=median(lambda r: r["phase_seconds"]["rollout"]),
               lent_iterations=sum(bool(r.get("lend", {}).get("lent")) for r in its),
               train_s=median(lambda r: r["phase_seconds"]["logprobs"] + r["phase_seconds"]["update"]),
               moves_s=median(lambda r: r["phase_seconds"].get("grow", 0.0) + r["phase_seconds"].get("shrink", 0.0)),
               move_bytes=max(r.get("rebalance", {}).get("grow", {}).get("bytes_moved", 0) for r in its),
               train_world=max((r.get("rebalance", {}).get("world", 0) for r in its), default=0) or None,
               grown_iterations=sum(bool(r.get("rebalance", {}).get("grown")) for r in its))
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.rebalance", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "grpo_tiny_async.yaml")
    ap.add_argument("--world", type=int, default=1, help="the trainer's devices (as many replicas of TP 1)")
    ap.add_argument("--iterations", type=int, default=10)
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--modes", default=",".join(MODES), help=f"of {', '.join(MODES)}; static first")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "rebalance")
    a = ap.parse_args(argv)
    modes = a.modes.split(",")
    if modes[0] != "static" or any(m not in MODES for m in modes):
        ap.error(f"--modes: static first, then any of {', '.join(MODES[1:])}")
    base = yaml.safe_load(a.config.read_text())
    base["algorithm"].pop("off_policy", None)
    w = a.world
    base.update(world_size=w)
    for phase in ("train", "reference"):
        base[phase]["dp"] = w
    base["rollout"].update(dp=w, tp=1)
    base.setdefault("checkpoint", {})["save_every"] = 0
    base.setdefault("eval", {})["num_prompts"] = 50

    def configure(cfg: dict, mode: str) -> None:
        if mode in ("update", "auto"):
            cfg["elastic"] = {"rebalance": mode}
        elif mode != "static":
            cfg["elastic"] = {"lend": "rollout" if mode == "lend" else "auto"}

    def report(r: dict) -> None:
        print(f"[{r['mode']} seed {r['seed']}] {r['iteration_s']:.2f} s/iteration (rollout {r['rollout_s']:.2f} s, lent "
              f"in {r['lent_iterations']} iterations; train {r['train_s']:.2f} s, moves "
              f"{r['moves_s']:.2f} s, grown in {r['grown_iterations']} iterations), checks "
              f"{'passed' if r['stale_check_passed'] else 'FAILED'}", flush=True)

    results = side_by_side(base, modes, [int(s) for s in a.seeds.split(",")], a.out, a.iterations, configure,
                           summary, report)
    rows = ["| mode | seed | trainer ranks in the update | iterations grown / lent (2..) | s / iteration | "
            "rollout (s) | log-probs + update (s) | grow + shrink (s) | bytes per move | held-out change |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        rows.append(f"| {r['mode']} | {r['seed']} | {r['train_world'] or w} | {r['grown_iterations']} / "
                    f"{r['lent_iterations']} | {r['iteration_s']:.2f} | {r['rollout_s']:.2f} | {r['train_s']:.2f} | "
                    f"{r['moves_s']:.3f} | {r['move_bytes']:,} | {r['heldout_change']:+.3f} |")
    by = {m: [r for r in results if r["mode"] == m] for m in modes}
    base_s = statistics.mean(r["iteration_s"] for r in by["static"])
    ratios = {m: statistics.mean(r["iteration_s"] for r in by[m]) / base_s for m in modes[1:]}
    print("\n".join(rows))
    print("; ".join(f"{m} / static seconds per iteration: {x:.2f}x" for m, x in ratios.items()))
    (a.out / "rebalance.json").write_text(json.dumps({"runs": results, "iteration_s_ratios": ratios}, indent=1))
    return 0 if all(r["stale_check_passed"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
