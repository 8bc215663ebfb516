"""Validation of ``rlhf-switch tune`` on this machine: predicted vs measured time per phase.

    python -m bench.tune_validate --measure          # real `rlhf-switch train` runs -> measured JSON
    python -m bench.tune_validate --measure --only ds_z3   # the cases whose name starts with ds_z3
    python -m bench.tune_validate                    # the table: prediction (calibrated CPU profile) vs measured

Each case is ``configs/grpo_tiny.yaml`` (or ``ppo_tiny.yaml``) with other per-phase layouts, run
for ``--iterations`` iterations without SFT, a small held-out eval and no intermediate checkpoints;
the first iteration (warm-up: first compiles, first allocations) is left out and the median of
the others taken. The loop's own metrics (``<output_dir>/metrics.jsonl``: ``switch_train_to_rollout_s``,
``gen_seconds``, ``logprob_seconds``, ``update_seconds``, ``iteration_seconds``) are the measured
figures. The machine is shared: the 1-minute load average before and after each run goes beside it.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
MEASURED = RESULTS / "tune_validate_measured.json"


def _ds(stage: int, dp: int) -> dict:
    return {"engine": "deepspeed", "zero_stage": stage, "tp": 1, "pp": 1, "dp": dp}


def _t(engine: str, tp: int = 1, pp: int = 1, dp: int = 1) -> dict:
    return {"engine": engine, "zero_stage": 0, "tp": tp, "pp": pp, "dp": dp}


# name -> (base config, world, train, rollout, reference or None, critic or None)
CASES = {
    "ds_z3_vllm_tp2":        ("grpo_tiny", 2, _ds(3, 2), _t("vllm", tp=2), _ds(3, 2), None),
    "ds_z1_vllm_tp1x2":      ("grpo_tiny", 2, _ds(1, 2), _t("vllm", dp=2), _ds(1, 2), None),
    "ds_z2_torch_tp2":       ("grpo_tiny", 2, _ds(2, 2), _t("torch", tp=2), _ds(2, 2), None),
    # what `rlhf-switch tune configs/grpo_tiny.yaml` recommended with the first calibrated CPU profile
    "ds_z2_vllm_tp1x2":      ("grpo_tiny", 2, _ds(2, 2), _t("vllm", dp=2), _ds(2, 2), None),
    # ... and with a later calibration
    "ds_z1_torch_tp1x2":     ("grpo_tiny", 2, _ds(1, 2), _t("torch", dp=2), _ds(1, 2), None),
    # ... and with the median-repeat calibration: the pipeline engine at TP2, PP1
    "pp_tp2_torch_tp1x2_ref_z2": ("grpo_tiny", 2, _t("torch_pp", tp=2), _t("torch", dp=2), _ds(2, 2), None),
    # ... and once the pipeline engine's TP stages pay the TP engine's fixed costs too
    "pp2_torch_tp1x2_ref_z2": ("grpo_tiny", 2, _t("torch_pp", pp=2), _t("torch", dp=2), _ds(2, 2), None),
    "fsdp2_torch_tp1x2":     ("grpo_tiny", 2, _t("fsdp2", dp=2), _t("torch", dp=2), _t("fsdp2", dp=2), None),
    "torch_tp2_torch_tp2":   ("grpo_tiny", 2, _t("torch_tp", tp=2), _t("torch", tp=2), _t("torch_tp", tp=2), None),
    "torch_pp2_torch_tp1x2": ("grpo_tiny", 2, _t("torch_pp", pp=2), _t("torch", dp=2), _t("torch_pp", pp=2), None),
    "w4_fsdp2_torch_tp2x2":  ("grpo_tiny", 4, _t("fsdp2", dp=4), _t("torch", tp=2, dp=2), _t("fsdp2", dp=4), None),
    "w4_tp2dp2_torch_tp1x4": ("grpo_tiny", 4, _t("torch_tp", tp=2, dp=2), _t("torch", dp=4), _t("torch_tp", tp=2, dp=2), None),
    "w4_ds_z3_vllm_tp2x2":   ("grpo_tiny", 4, _ds(3, 4), _t("vllm", tp=2, dp=2), _ds(3, 4), None),
    "ppo_ds_z3_vllm_tp1x2":  ("ppo_tiny", 2, _ds(3, 2), _t("vllm", dp=2), _ds(3, 2), _ds(2, 2)),
}


def case_config(name: str, out_root: Path) -> dict:
    """The case's config as a dict: the base config with the case's layouts, no SFT, a small eval."""
    base, world, train, rollout, reference, critic = CASES[name]
    cfg = yaml.safe_load((REPO / "configs" / f"{base}.yaml").read_text())
    cfg.update(world_size=world, output_dir=str(out_root / name), train=train, rollout=rollout, logging=[])
    cfg["sft"] = None
    cfg["eval"] = {"every": 0, "num_prompts": 4}
    cfg["checkpoint"] = {"save_every": 0, "keep": 1}
    if reference is not None:
        cfg["reference"] = reference
    if critic is not None:
        cfg["critic"] = critic
    algo = cfg["algorithm"]
    mini = algo.get("mini_batch_size") or algo["prompts_per_iteration"] * algo["group_size"]
    algo["micro_batch_size"] = min(algo["micro_batch_size"], mini // train["dp"])
    return cfg


PHASE_KEYS = ("switch_train_to_rollout_s", "gen_seconds", "logprob_seconds", "update_seconds", "iteration_seconds")


def measure(name: str, iterations: int, out_root: Path) -> dict:
    cfg = case_config(name, out_root)
    out = Path(cfg["output_dir"])
    out.mkdir(parents=True, exist_ok=True)
    path = out / "case.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    (out / "metrics.jsonl").unlink(missing_ok=True)
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "recipes.cli", "train", str(path), "--iterations", str(iterations),
                           "--quiet"], cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    row = {"case": name, "rc": proc.returncode, "wall_s": wall, "load_before": load_before,
           "load_after": os.getloadavg()[0], "iterations": iterations}
    if proc.returncode:
        row["error"] = (proc.stderr or proc.stdout)[-2000:]
        return row
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    its = [r for r in recs if "reward_mean" in r and r["iteration"] >= 1]
    for k in PHASE_KEYS:
        row[k] = statistics.median(r[k] for r in its)
        row[k + "_all"] = [r[k] for r in its]
    row["bytes_moved"] = its[0]["bytes_moved"]
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--measure", action="store_true", help="run the real trainings (minutes each)")
    ap.add_argument("--only", default=None, help="cases whose name starts with this")
    ap.add_argument("--iterations", type=int, default=4)
    ap.add_argument("--out-root", default=str(REPO / "runs" / "tune_validate"))
    ap.add_argument("--profile", default=None, help="machine profile JSON (default: the shipped CPU profile)")
    ap.add_argument("--measured", default=str(MEASURED), help="the measured JSON (read and extended; default: %(default)s)")
    a = ap.parse_args(argv)
    names = [n for n in CASES if a.only is None or n.startswith(a.only)]
    RESULTS.mkdir(parents=True, exist_ok=True)
    if a.measure:
        path = Path(a.measured)
        done = json.loads(path.read_text()) if path.exists() else {}
        for n in names:
            row = measure(n, a.iterations, Path(a.out_root))
            done[n] = row
            path.write_text(json.dumps(done, indent=1))
            print(json.dumps({k: v for k, v in row.items() if not k.endswith("_all")}), flush=True)
        return 0
    measured = {}
    for p in a.measured.split(","):  # several files: a case's last one wins
        measured.update(json.loads(Path(p).read_text()))
    rows = predict_rows(measured, names, a.profile or "cpu_local")
    table = format_rows(rows)
    (RESULTS / "tune_validate.json").write_text(json.dumps(rows, indent=1))
    (RESULTS / "tune_validate.md").write_text(table + "\n")
    print(table)
    return 0


PAIRS = (("switch", "switch_train_to_rollout_s"), ("rollout", "gen_seconds"), ("logprob", "logprob_seconds"),
         ("update", "update_seconds"), ("total", "iteration_seconds"))


def predict_rows(measured: dict, names: list[str], profile_name: str) -> list[dict]:
    """Each measured case beside the model's prediction for its layouts (ratio = predicted / measured)."""
    from rlhf_switch.rl.config import load_config
    from rlhf_switch.tune import Combination, Workload, load_profile
    from rlhf_switch.tune.cost import iteration_seconds

    profile = load_profile(profile_name)
    rows = []
    for n in names:
        m = measured.get(n)
        if not m or m.get("rc"):
            continue
        cfg = load_config(case_config(n, Path("runs/tune_validate")))
        combo = Combination(cfg.train, cfg.rollout, cfg.reference, cfg.critic)
        pred = iteration_seconds(Workload.from_config(cfg), profile, combo)
        row = {"case": n, "world": cfg.world_size, "load": (m["load_before"] + m["load_after"]) / 2,
               "group": f"{CASES[n][0]} on {cfg.world_size}"}
        for phase, key in PAIRS:
            row[f"{phase}_pred"], row[f"{phase}_meas"] = pred[phase], m[key]
            row[f"{phase}_ratio"] = pred[phase] / m[key] if m[key] else float("nan")
        rows.append(row)
    # ranks compare layouts of one workload on one world (what the tuner ranks)
    for group in {r["group"] for r in rows}:
        same = [r for r in rows if r["group"] == group]
        by_pred = sorted(same, key=lambda r: r["total_pred"])
        by_meas = sorted(same, key=lambda r: r["total_meas"])
        for r in same:
            r["rank_pred"], r["rank_meas"] = by_pred.index(r) + 1, by_meas.index(r) + 1
    return rows


def format_rows(rows: list[dict]) -> str:
    head = "| case | world | load | " + " | ".join(f"{p} pred / meas (ratio)" for p, _ in PAIRS) + \
        " | rank pred / meas |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        cells = [f"{r[p + '_pred'] * 1e3:.0f} / {r[p + '_meas'] * 1e3:.0f} ms ({r[p + '_ratio']:.2f})" for p, _ in PAIRS]
        lines.append(f"| {r['case']} | {r['world']} | {r['load']:.1f} | " + " | ".join(cells) +
                     f" | {r['rank_pred']} / {r['rank_meas']} |")
    within = sum(0.7 <= r["total_ratio"] <= 1.3 for r in rows)
    lines.append("")
    lines.append(f"total within ±30 %: {within} of {len(rows)}")
    for group in sorted({r["group"] for r in rows}):
        same = [r for r in rows if r["group"] == group]
        k = min(3, len(same))
        top_pred = [r["case"] for r in sorted(same, key=lambda r: r["rank_pred"])[:k]]
        top_meas = [r["case"] for r in sorted(same, key=lambda r: r["rank_meas"])[:k]]
        lines.append(f"{group} ({len(same)} cases): measured top {k} {top_meas}, predicted top {k} {top_pred} "
                     f"({'same set' if set(top_pred) == set(top_meas) else 'different set'}"
                     f"{', same order' if top_pred == top_meas else ''})")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
