"""Synchronous against one-step off-policy GRPO on the same job, side by side in one run.

    python -m bench.async_rollout [--config configs/grpo_tiny_async.yaml] [--iterations 20]
        [--seeds 0,1,2] [--modes sync,one_step] [--segment-tokens 2] [--reward-target R]
        [--reward-window 1] [--out bench/results/async_rollout]

Both runs use the config's disaggregated rollout (vLLM replicas on devices of their own) from the
same warm start per seed: ``sync`` is ``off_policy.max_staleness: 0`` (generate, then train),
``one_step`` is ``max_staleness: 1`` (the next batch generates while this one trains, TIS
correction), ``partial`` is one-step with partial rollout (``segment_tokens``: the batch in
flight generated a segment at a time, interrupted by the update). The devices moved between
phases, on the synchronous loop: ``lend`` (``elastic.lend: rollout``: replicas on the trainer's
devices take a share of each rollout), ``rebalance`` (``elastic.rebalance: update``: the replicas'
devices join the trainer world for each update) and ``both``; with ``rebalance`` or ``both`` among
the modes, every mode's micro-batch is cut to what the grown world's DP divides. Runs alternate per seed, so a
load that comes or goes weighs on every mode. Any config with a disaggregated rollout works:
``configs/grpo_20m_long.yaml`` is the long-generation one (20M parameters, 64-128-token answers
of skewed lengths).

Reported per run: the held-out greedy reward (the task's reward: exact match on the tiny config)
before and after, samples per second (the median over iterations 2.. of the rollout batch over
the iteration's wall time), the exposed wait for generation, the rollout reward of the last 3
iterations, the time to reward (``bench.algorithms.time_to_reward``: seconds of iterations until
the rollout reward first reaches the target — ``--reward-target``, else the same seed's final
reward of the first mode, ``sync`` by default; with ``--reward-window N``,
the mean of N iterations' rewards must reach it) and whether every check passed; then the ratio of
the modes' samples/s.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import yaml

from bench.algorithms import ROOT, side_by_side, time_to_reward

# each mode's algorithm.off_policy and elastic blocks
MODES = {"sync": ({"max_staleness": 0}, None), "one_step": ({"max_staleness": 1}, None),
         "partial": ({"max_staleness": 1}, None),
         "lend": ({"max_staleness": 0}, {"lend": "rollout"}),
         "rebalance": ({"max_staleness": 0}, {"rebalance": "update"}),
         "both": ({"max_staleness": 0}, {"lend": "rollout", "rebalance": "update"})}


def summary(out: Path, res: dict) -> dict:
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    every = [r for r in recs if "reward_mean" in r]
    its = every[2:] or every
    res.update(rewards=[{k: r[k] for k in ("iteration", "reward_mean", "iteration_seconds")} for r in every],
               reward_final=statistics.mean(r["reward_mean"] for r in every[-3:]),
               samples_per_s=statistics.median(r["samples_per_s"] for r in its),
               rollout_wait_s=statistics.median(r["phase_seconds"].get("rollout_wait", 0) + r["phase_seconds"]["rollout"]
                                                for r in its),
               staleness=sorted({r["staleness_max"] for r in its}),
               interrupted=statistics.median(r.get("samples_interrupted", 0) for r in its))
    return res


def with_time_to_reward(results: list[dict], first: str, target: float | None, window: int) -> str:
    """Each run's ``reward_target`` and ``time_to_reward_s``: to ``target`` where given, else to
    the final reward (its last 3 iterations) of mode ``first``'s run of the same seed — seeds start
    from different warm starts, so one target for all would be reached at once by some and never
    by others. Returns where the targets came from."""
    final = {r["seed"]: r["reward_final"] for r in results if r["mode"] == first}
    for r in results:
        r["reward_target"] = target if target is not None else final[r["seed"]]
        r["time_to_reward_s"] = time_to_reward(r["rewards"], r["reward_target"], window)
    return f"{target:.4f} (--reward-target)" if target is not None else \
        f"per seed, {first}'s rollout reward over its last 3 iterations"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.async_rollout", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "grpo_tiny_async.yaml")
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--modes", default="sync,one_step", help=f"of {', '.join(MODES)}; the first is the ratios' base")
    ap.add_argument("--segment-tokens", type=int, default=2, help="partial: tokens per segment")
    ap.add_argument("--reward-target", type=float, default=None,
                    help="the rollout reward the time to reward is measured to (default: per seed, the first "
                         "mode's reward over its last 3 iterations)")
    ap.add_argument("--reward-window", type=int, default=1,
                    help="iterations whose mean rollout reward must reach the target")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "async_rollout")
    a = ap.parse_args(argv)
    modes = a.modes.split(",")
    if a.reward_window < 1:
        ap.error(f"--reward-window must be >= 1, got {a.reward_window}")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        ap.error(f"unknown modes {unknown}; known: {', '.join(MODES)}")
    base = yaml.safe_load(a.config.read_text())
    base.setdefault("checkpoint", {})["save_every"] = 0

    if {"rebalance", "both"} & set(modes):  # the grown world (twice the DP) must split the mini-batch too
        alg, dp = base["algorithm"], 2 * base["train"]["dp"]
        alg["micro_batch_size"] = min(alg["micro_batch_size"], alg["mini_batch_size"] // dp)
        print(f"micro_batch_size {alg['micro_batch_size']} in every mode (the grown world's DP {dp})")

    def configure(cfg: dict, mode: str) -> None:
        off_policy, elastic = MODES[mode]
        cfg["algorithm"]["off_policy"] = {**cfg["algorithm"].get("off_policy", {}), **off_policy}
        if elastic is not None:
            cfg["elastic"] = dict(elastic)
        if mode == "partial":
            cfg["algorithm"]["off_policy"]["segment_tokens"] = a.segment_tokens

    def report(r: dict) -> None:
        print(f"[{r['mode']} seed {r['seed']}] held-out {r['heldout_before']:.3f} -> {r['heldout_after']:.3f} "
              f"({r['heldout_change']:+.3f}), {r['samples_per_s']:.0f} samples/s, staleness {r['staleness']}, "
              f"checks {'passed' if r['stale_check_passed'] else 'FAILED'}", flush=True)

    results = side_by_side(base, modes, [int(s) for s in a.seeds.split(",")], a.out, a.iterations, configure,
                           summary, report)
    by = {m: [r for r in results if r["mode"] == m] for m in modes}
    target_from = with_time_to_reward(results, modes[0], a.reward_target, a.reward_window)
    print(f"reward target: {target_from} (window {a.reward_window})")
    rows = ["| mode | seed | held-out before → after | change | samples/s | exposed generation wait (s) | staleness | "
            "samples interrupted | rollout reward (last 3) | reward target | time to reward (s) |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        ttr = "never" if r["time_to_reward_s"] is None else f"{r['time_to_reward_s']:.1f}"
        rows.append(f"| {r['mode']} | {r['seed']} | {r['heldout_before']:.3f} → {r['heldout_after']:.3f} | "
                    f"{r['heldout_change']:+.3f} | {r['samples_per_s']:.3g} | {r['rollout_wait_s']:.3f} | "
                    f"{', '.join(map(str, r['staleness']))} | {r['interrupted']:.0f} | {r['reward_final']:.3f} | "
                    f"{r['reward_target']:.3f} | {ttr} |")
    rate = {m: statistics.mean(r["samples_per_s"] for r in rs) for m, rs in by.items()}
    ratios = {m: rate[m] / rate[modes[0]] for m in modes[1:]}
    change = {m: statistics.mean(r["heldout_change"] for r in rs) for m, rs in by.items()}
    print("\n".join(rows))
    print("; ".join(f"{m} / {modes[0]} samples/s: {x:.2f}x" for m, x in ratios.items()) +
          "; mean held-out change: " + ", ".join(f"{m} {c:+.3f}" for m, c in change.items()))
    (a.out / "async_rollout.json").write_text(json.dumps(
        {"runs": results, "samples_per_s_ratios": ratios, "reward_target_from": target_from,
         "reward_window": a.reward_window}, indent=1))
    return 0 if all(r["stale_check_passed"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
