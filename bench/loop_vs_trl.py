"""The loop's own overhead against TRL's ``GRPOTrainer`` on the same job, side by side in one run.

    python -m bench.loop_vs_trl [--iterations 20] [--init DIR] [--job configs/grpo_tiny_fsdp.yaml]
        [--configs configs/grpo_tiny_fsdp.yaml configs/grpo_tiny.yaml]
        [--before REV] [--no-trl | --trl-runs 1] [--json FILE]   # make bench-trl: installs TRL into .trl/ first, then this

Every run does ``--job``'s job: its seed, task, SFT and algorithm blocks replace each config's, so
the configs differ in their engines and layouts only. Every run starts from the same warm start
(``--init``, default ``runs/grpo_tiny_fsdp/init`` — made by any run of the job's config, e.g.
``rlhf-switch train configs/grpo_tiny_fsdp.yaml --iterations 1``), draws the same prompts in the
same order with the same reward and hyper-parameters (``bench/trl_grpo.py`` says how TRL is set
to the loop's job). Ours: ``python -m recipes.grpo``
per config in a process of its own (Ray, the engines, the loop as ``rlhf-switch train`` runs it),
evaluation only before the first and after the last iteration, no checkpoints in between, its
``metrics.jsonl`` read back. TRL: ``bench.trl_grpo`` in a process of its own (skipped with one
line when TRL is not importable), run twice — before our runs and after them — so that a load
that comes or goes during the invocation weighs on both sides: the ratios are against the mean of
TRL's two medians, and both are printed (``--trl-runs 1``: before ours only). ``--before REV``:
the same configs run again on the code (and the configs) of git revision ``REV`` (``git archive``
into a temporary directory), in the same invocation, so a change's before and after are measured
under the same load.

Reported per run: the median over iterations 2.. (the first two warm up) of the iteration time and
of each phase (ours: switch, generation, old + reference log-probs, update, the rest — Ray calls,
rewards, logging), the ratio to TRL's (the mean of its runs' medians), and held-out greedy exact match after the last
iteration. The machine's load average is printed beside the figures: other processes on the
2 cores slow every collective of our two workers more than TRL's one process.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
PHASES = (("switch", "switch_train_to_rollout_s"), ("generate", "gen_seconds"),
          ("logprobs", "logprob_seconds"), ("update", "update_seconds"))


def _median(xs):
    return statistics.median(xs) if xs else float("nan")


# what makes the job: the rest of a config (engines, layouts) is what the runs compare
JOB_BLOCKS = ("seed", "task", "sft", "algorithm")


def run_ours(config: Path, init: Path, iterations: int, work: Path, log=print, code: Path = ROOT,
             label: str = "", job: Path | None = None) -> dict:
    """One run of the loop on ``config`` with ``job``'s job (``JOB_BLOCKS``; evaluation at the
    ends only, no checkpoints) from the warm start ``init``; the per-phase medians over iterations
    2.. and the held-out reward after. ``code``: the source tree whose loop runs (and whose
    ``configs/`` ``config`` and ``job`` are read from)."""
    config = config if code == ROOT else code / "configs" / config.name
    cfg = yaml.safe_load(config.read_text())
    if job is not None:
        job_cfg = yaml.safe_load((job if code == ROOT else code / "configs" / job.name).read_text())
        cfg.update({k: job_cfg[k] for k in JOB_BLOCKS if k in job_cfg})
    out = work / f"{label}{config.stem}"
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(init, out / "init")  # the warm start cache: no SFT here
    cfg["output_dir"] = str(out)
    cfg.setdefault("eval", {})["every"] = 0
    cfg.setdefault("checkpoint", {})["save_every"] = 0
    path = work / f"{label}{config.stem}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    t0 = time.perf_counter()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(code)] + [p for p in os.environ.get("PYTHONPATH", "").split(
        os.pathsep) if p and Path(p).resolve() != ROOT]))
    p = subprocess.run([sys.executable, "-m", "recipes.grpo", str(path), "--iterations", str(iterations), "--quiet"],
                       cwd=code, env=env, capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError(f"{config}: exit {p.returncode}\n{p.stderr[-3000:]}")
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    its = [r for r in recs if "iteration_seconds" in r][2:]
    after = [r for r in recs if r.get("eval") == "after"]
    res = {"config": str(config.name), "code": label.rstrip("_") or "this tree", "engines": f"{cfg['train']['engine']} + {cfg['rollout']['engine']}",
           "iterations": iterations, "wall_s": time.perf_counter() - t0,
           "median_iteration_s": _median([r["iteration_seconds"] for r in its]),
           **{f"median_{name}_s": _median([r[key] for r in its]) for name, key in PHASES},
           "heldout_exact_match": after[-1]["heldout_reward"] if after else float("nan"),
           "reward_mean": [r["reward_mean"] for r in recs if "reward_mean" in r]}
    res["median_other_s"] = res["median_iteration_s"] - sum(res[f"median_{n}_s"] for n, _ in PHASES)
    log(f"[ours{' ' + label.rstrip('_') if label else ''}] {config.name}: median {res['median_iteration_s']:.3f} s/iteration, held-out "
        f"{res['heldout_exact_match']:.3f}")
    return res


def run_trl(config: Path, init: Path, iterations: int, work: Path, log=print, label: str = "") -> dict | None:
    """``bench.trl_grpo`` in a process of its own; None (with one line) when TRL is not importable."""
    from bench.trl_grpo import import_trl

    if import_trl() is None:
        log("[trl] skipped: trl is not importable (make bench-trl installs it into .trl/)")
        return None
    out = work / f"trl{label}.json"
    p = subprocess.run([sys.executable, "-m", "bench.trl_grpo", "--config", str(config), "--init", str(init),
                        "--iterations", str(iterations), "--json", str(out)], cwd=ROOT, capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError(f"bench.trl_grpo: exit {p.returncode}\n{p.stderr[-3000:]}")
    res = json.loads(out.read_text())
    log(f"[trl] median {res['median_iteration_s']:.3f} s/iteration, held-out {res['heldout_exact_match']:.3f}")
    return res


def table(ours: list[dict], trls: list[dict]) -> str:
    """Ours against the mean of TRL's runs (before and after ours: the load of the whole invocation)."""
    head = "| run | s / iteration | vs TRL | switch | generate | old+ref log-probs | update | rest | held-out exact match |"
    rows = [head, "|" + "---|" * 9]
    base = statistics.mean(t["median_iteration_s"] for t in trls) if trls else None
    for r in ours:
        ratio = f"{r['median_iteration_s'] / base:.2f}×" if base else "—"
        rows.append(f"| ours ({r['code']}): {r['config']} ({r['engines']}) | {r['median_iteration_s']:.3f} | {ratio} | "
                    + " | ".join(f"{r[f'median_{n}_s']:.3f}" for n in ("switch", "generate", "logprobs", "update", "other"))
                    + f" | {r['heldout_exact_match']:.3f} |")
    for when, trl in zip(("before ours", "after ours") if len(trls) == 2 else ("",) * len(trls), trls):
        rows.append(f"| TRL {trl.get('trl_version', '')} GRPOTrainer ({trl['threads']} thread){', ' + when if when else ''} | "
                    f"{trl['median_iteration_s']:.3f} | {trl['median_iteration_s'] / base:.2f}× | "
                    f"— | — | — | — | — | {trl['heldout_exact_match']:.3f} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", type=Path,
                    default=[ROOT / "configs/grpo_tiny_fsdp.yaml", ROOT / "configs/grpo_tiny.yaml"])
    ap.add_argument("--job", type=Path, default=ROOT / "configs/grpo_tiny_fsdp.yaml",
                    help="the config whose seed, task, SFT and algorithm every run and TRL use (default: %(default)s)")
    ap.add_argument("--init", type=Path, default=ROOT / "runs/grpo_tiny_fsdp/init",
                    help="the warm start every run starts from, made by a run of --job (default: %(default)s)")
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--no-trl", action="store_true", help="ours only")
    ap.add_argument("--trl-runs", type=int, choices=(1, 2), default=2,
                    help="TRL before ours and after (2, default), or before only (1)")
    ap.add_argument("--before", metavar="REV", default=None,
                    help="also run the configs on git revision REV's code and configs (before/after, one load)")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    if not (a.init / "model.safetensors").is_file():
        print(f"error: no warm start at {a.init} (rlhf-switch train {a.job} --iterations 1, or --init DIR)",
              file=sys.stderr)
        return 2
    load = [os.getloadavg()]
    with tempfile.TemporaryDirectory(prefix="loop_vs_trl_") as tmp:
        work = Path(tmp)
        trls = [] if a.no_trl else [run_trl(a.job, a.init, a.iterations, work, label="_before")]
        if a.before:
            tree = work / "before"
            tree.mkdir()
            subprocess.run(f"git -C {ROOT} archive {a.before} | tar -x -C {tree}", shell=True, check=True)
        ours = []
        for c in a.configs:  # each config's after and before back to back: the same load, as far as it goes
            ours.append(run_ours(c, a.init, a.iterations, work, job=a.job))
            if a.before:
                ours.append(run_ours(c, a.init, a.iterations, work, code=tree, label=f"{a.before}_", job=a.job))
        if trls and trls[0] is not None and a.trl_runs == 2:
            trls.append(run_trl(a.job, a.init, a.iterations, work, label="_after"))
        trls = [t for t in trls if t is not None]
    load.append(os.getloadavg())
    print(table(ours, trls))
    print(f"load average (1, 5, 15 min) before {tuple(round(x, 2) for x in load[0])}, "
          f"after {tuple(round(x, 2) for x in load[1])}; {os.cpu_count()} CPUs; {a.iterations} iterations, "
          f"medians over iterations 2..")
    if a.json:
        a.json.write_text(json.dumps({"ours": ours, "trl": trls, "load": load}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
