"""``rlhf-switch tune CONFIG``: rank the per-phase layouts of a run by modelled iteration time.

    rlhf-switch tune configs/grpo_tiny.yaml                        # this machine's profile, the config's world
    rlhf-switch tune configs/grpo_tiny.yaml --world-size 4 --top 5 --out runs/best.yaml
    rlhf-switch tune configs/grpo_tiny.yaml --calibrate --profile runs/my_cpu.json   # measure first
    rlhf-switch tune CONFIG --profile h100_ib --world-size 64 --device-memory 80    # H100 80 GB

The estimates are ``rlhf_switch.tune`` (pure functions; the switch is the planner's own per-rank
plan); ``--out`` writes the best combination as a config ``rlhf-switch train`` runs unchanged.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

TUNE_DESCRIPTION = __doc__.split("\n\n", 1)[1].rsplit("\n\n", 1)[0]


def add_arguments(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    ap.add_argument("config", metavar="CONFIG", help="the run's YAML: model, batch sizes and algorithm are taken "
                                                     "from it, its layouts are what is tuned")
    ap.add_argument("--world-size", type=int, metavar="N", help="devices (default: the config's world_size)")
    ap.add_argument("--device-memory", type=float, metavar="GiB", help="memory per device (default: the profile's)")
    ap.add_argument("--top", type=int, default=10, metavar="K", help="rows of the ranked table (default: %(default)s)")
    ap.add_argument("--out", metavar="FILE", help="write the best combination as a config for rlhf-switch train")
    ap.add_argument("--profile", metavar="FILE",
                    help="machine profile JSON or a shipped name (h100_ib, cpu_local); default: cpu_local without a "
                         "GPU, h100_ib with one. With --calibrate: where the measured profile is written "
                         "(default: machine_profile.json)")
    ap.add_argument("--calibrate", action="store_true",
                    help="measure this machine first (matmul, memory, gloo p2p and collectives on 2 local processes, "
                         "decode steps of the config's model; ~1-3 min) and rank with that profile")
    ap.add_argument("--switch-run", action="append", default=[], metavar="DIR",
                    help="with --calibrate: a finished rlhf-switch train output directory (config.yaml, "
                         "metrics.jsonl) whose switch timings give its rollout engine's fixed cost per sync; "
                         "repeat for each rollout engine")
    return ap


def _default_profile() -> str:
    import torch
    return "h100_ib" if torch.cuda.is_available() else "cpu_local"


def main_args(a: argparse.Namespace) -> int:
    """Exit codes: 0 ranked, 2 bad input (config, profile, or nothing fits: one message)."""
    from rlhf_switch.rl.config import ConfigError, load_config
    from rlhf_switch.tune import TuneError, format_table, rank
    from rlhf_switch.tune.profile import GIB, ProfileError, load_profile, save_profile

    def fail(msg: str) -> int:
        print(f"error: {msg}", file=sys.stderr)
        return 2

    try:
        cfg = load_config(a.config)
    except ConfigError as e:
        return fail(str(e))
    if a.world_size is not None and a.world_size < 1:
        return fail(f"--world-size must be at least 1, got {a.world_size}")
    if a.device_memory is not None and a.device_memory <= 0:
        return fail(f"--device-memory must be positive GiB, got {a.device_memory}")
    if a.top < 1:
        return fail(f"--top must be at least 1, got {a.top}")
    if cfg.model.hf_config is None and not (Path(cfg.model.path) / "config.json").is_file():
        return fail(f"model.path: no config.json at {Path(cfg.model.path) / 'config.json'}")
    try:
        if a.calibrate:
            from recipes.tune_calibrate import calibrate
            from rlhf_switch.tune.workload import Workload

            profile = calibrate(Workload.from_config(cfg), switch_runs=tuple(a.switch_run))
            where = save_profile(profile, a.profile or "machine_profile.json")
            print(f"profile written: {where}")
        else:
            profile = load_profile(a.profile or _default_profile())
    except ProfileError as e:
        return fail(str(e))
    profile = profile.with_memory(a.device_memory)
    world = a.world_size or cfg.world_size
    try:
        ranking = rank(cfg, profile, world=world, top=a.top)
    except TuneError as e:
        return fail(str(e))
    print(f"profile {profile.name}: {profile.origin}")
    print(f"world_size {world}, {profile.device_memory / GIB:.3g} GiB per device; {ranking.considered} legal "
          f"combinations, {ranking.fitting} fit in memory, switch planned for {ranking.planned_pairs} "
          f"(train, rollout) pairs; times are modelled seconds per iteration")
    print(format_table(ranking.rows))
    if a.out:
        write_config(cfg, ranking.rows[0], a.out)
        print(f"best combination written: {a.out} (rlhf-switch train {a.out})")
    return 0


def write_config(cfg, row, path: str) -> Path:
    """The config with the best combination's layouts: a file ``rlhf-switch train`` loads as is."""
    import yaml

    from rlhf_switch.tune import describe

    best = row.combo.apply(cfg)
    secs = ", ".join(f"{k} {v:.3g} s" for k, v in row.seconds.items())
    header = (f"# written by rlhf-switch tune; modelled seconds per iteration: {secs}\n"
              f"# layouts: " + "; ".join(f"{p} {describe(layout)}" for p, layout in row.combo.phases().items()) + "\n")
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(header + yaml.safe_dump(best.model_dump(mode="json"), sort_keys=False))
    return p
