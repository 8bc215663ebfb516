"""Synchronous against one-step off-policy GRPO on the same job, side by side in one run.

    python -m bench.async_rollout [--config configs/grpo_tiny_async.yaml] [--iterations 20]
        [--seeds 0,1,2] [--modes sync,one_step] [--segment-tokens 2] [--out bench/results/async_rollout]

Both runs use the config's disaggregated rollout (vLLM replicas on devices of their own) from the
same warm start per seed: ``sync`` is ``off_policy.max_staleness: 0`` (generate, then train),
``one_step`` is ``max_staleness: 1`` (the next batch generates while this one trains, TIS
correction), ``partial`` is one-step with partial rollout (``segment_tokens``: the batch in
flight generated a segment at a time, interrupted by the update). Runs alternate per seed, so a
load that comes or goes weighs on every mode. Reported per run: held-out greedy exact match before and after, samples per second (the
median over iterations 2.. of the rollout batch over the iteration's wall time), the exposed wait
for generation, and whether every check passed; then the ratio of the two modes' samples/s.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import yaml

from bench.algorithms import ROOT, side_by_side

MODES = {"sync": {"max_staleness": 0}, "one_step": {"max_staleness": 1}, "partial": {"max_staleness": 1}}


def summary(out: Path, res: dict) -> dict:
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    its = [r for r in recs if "reward_mean" in r][2:]
    res.update(samples_per_s=statistics.median(r["samples_per_s"] for r in its),
               rollout_wait_s=statistics.median(r["phase_seconds"].get("rollout_wait", 0) + r["phase_seconds"]["rollout"]
                                                for r in its),
               staleness=sorted({r["staleness_max"] for r in its}),
               interrupted=statistics.median(r.get("samples_interrupted", 0) for r in its))
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.async_rollout", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "grpo_tiny_async.yaml")
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--modes", default="sync,one_step", help=f"of {', '.join(MODES)}; the first is the ratios' base")
    ap.add_argument("--segment-tokens", type=int, default=2, help="partial: tokens per segment")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "async_rollout")
    a = ap.parse_args(argv)
    modes = a.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        ap.error(f"unknown modes {unknown}; known: {', '.join(MODES)}")
    base = yaml.safe_load(a.config.read_text())
    base.setdefault("checkpoint", {})["save_every"] = 0

    def configure(cfg: dict, mode: str) -> None:
        cfg["algorithm"]["off_policy"] = {**cfg["algorithm"].get("off_policy", {}), **MODES[mode]}
        if mode == "partial":
            cfg["algorithm"]["off_policy"]["segment_tokens"] = a.segment_tokens

    def report(r: dict) -> None:
        print(f"[{r['mode']} seed {r['seed']}] held-out {r['heldout_before']:.3f} -> {r['heldout_after']:.3f} "
              f"({r['heldout_change']:+.3f}), {r['samples_per_s']:.0f} samples/s, staleness {r['staleness']}, "
              f"checks {'passed' if r['stale_check_passed'] else 'FAILED'}", flush=True)

    results = side_by_side(base, modes, [int(s) for s in a.seeds.split(",")], a.out, a.iterations, configure,
                           summary, report)
    rows = ["| mode | seed | held-out before → after | change | samples/s | exposed generation wait (s) | staleness | "
            "samples interrupted |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        rows.append(f"| {r['mode']} | {r['seed']} | {r['heldout_before']:.3f} → {r['heldout_after']:.3f} | "
                    f"{r['heldout_change']:+.3f} | {r['samples_per_s']:.0f} | {r['rollout_wait_s']:.3f} | "
                    f"{', '.join(map(str, r['staleness']))} | {r['interrupted']:.0f} |")
    by = {m: [r for r in results if r["mode"] == m] for m in modes}
    rate = {m: statistics.mean(r["samples_per_s"] for r in rs) for m, rs in by.items()}
    ratios = {m: rate[m] / rate[modes[0]] for m in modes[1:]}
    change = {m: statistics.mean(r["heldout_change"] for r in rs) for m, rs in by.items()}
    print("\n".join(rows))
    print("; ".join(f"{m} / {modes[0]} samples/s: {x:.2f}x" for m, x in ratios.items()) +
          "; mean held-out change: " + ", ".join(f"{m} {c:+.3f}" for m, c in change.items()))
    (a.out / "async_rollout.json").write_text(json.dumps({"runs": results, "samples_per_s_ratios": ratios}, indent=1))
    return 0 if all(r["stale_check_passed"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
