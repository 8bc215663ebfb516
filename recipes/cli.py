"""``rlhf-switch`` — the command line.

    rlhf-switch train CONFIG [--iterations N] [--output-dir DIR] [--resume [DIR]] [--stale-tol T]
                             [--quiet] [--verbose]
    rlhf-switch tune CONFIG [--world-size N] [--device-memory GiB] [--top K] [--out FILE]
                            [--calibrate] [--profile FILE]
    rlhf-switch rm CONFIG [--steps N] [--output-dir DIR] [--quiet] [--verbose]

``train`` runs the recipe the config's ``algorithm.name`` names (``recipes.grpo`` or
``recipes.ppo``) with the same options as ``python -m recipes.<name>``; ``rlhf-switch train
--help`` describes them. ``tune`` ranks the config's per-phase layouts by modelled iteration time
(``recipes.tune``). ``rm`` trains a reward model from preference pairs (``recipes.rm``), which a
run's ``reward.model_path`` then takes. ``rlhf-switch`` alone prints the usage and exits 2.
"""
from __future__ import annotations

import argparse
import sys

COMMANDS = ("train", "tune", "rm")
DESCRIPTION = "RLHF (GRPO/PPO) over Ray with per-phase layouts switched through the Virtual Parameter Space."
TRAIN_DESCRIPTION = """\
Run GRPO or PPO as the config's algorithm.name says (the same as python -m recipes.grpo|ppo).

  rlhf-switch train configs/grpo_tiny.yaml                   # 20 iterations (algorithm.iterations)
  rlhf-switch train configs/grpo_tiny.yaml --resume          # finish it after a crash: same final/
  rlhf-switch train configs/grpo_tiny.yaml --resume --iterations 30   # continue a finished run to 30

--iterations is the run's total, also with --resume."""


def parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The top-level parser and its ``train`` sub-parser."""
    from recipes import rm as rm_recipe
    from recipes import tune as tune_recipe
    from recipes.train import add_arguments

    ap = argparse.ArgumentParser(prog="rlhf-switch", description=DESCRIPTION)
    sub = ap.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    train = sub.add_parser("train", help="run GRPO or PPO from a config (rlhf-switch train --help)",
                           description=TRAIN_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(train)
    tune = sub.add_parser("tune", help="rank per-phase layouts by modelled iteration time (rlhf-switch tune --help)",
                          description=tune_recipe.TUNE_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    tune_recipe.add_arguments(tune)
    rm = sub.add_parser("rm", help="train a reward model from preference pairs (rlhf-switch rm --help)",
                        description=rm_recipe.RM_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    rm_recipe.add_arguments(rm)
    ap.commands = {"train": train, "tune": tune, "rm": rm}  # each command's own usage, for the one-word errors
    return ap, train


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap, train = parser()
    if not argv:
        ap.print_usage(sys.stderr)
        print(f"rlhf-switch: give a command (known: {', '.join(COMMANDS)}); rlhf-switch --help for more",
              file=sys.stderr)
        return 2
    if not argv[0].startswith("-") and argv[0] not in COMMANDS:
        ap.print_usage(sys.stderr)
        print(f"rlhf-switch: unknown command {argv[0]!r} (known: {', '.join(COMMANDS)})", file=sys.stderr)
        return 2
    if argv in ([c] for c in COMMANDS):
        ap.commands[argv[0]].print_usage(sys.stderr)
        example = "configs/rm_tiny.yaml" if argv[0] == "rm" else "configs/grpo_tiny.yaml"
        print(f"rlhf-switch {argv[0]}: give a config file, e.g. {example} (rlhf-switch {argv[0]} --help)",
              file=sys.stderr)
        return 2
    try:
        a = ap.parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (2), already printed by argparse
        return int(e.code or 0)
    if a.command is None:
        ap.print_usage(sys.stderr)
        return 2
    from rlhf_switch.runtime_env import use_kernel_caches_of_this_machine

    use_kernel_caches_of_this_machine()  # this process compiles too (the warm start), before anything does
    if a.command == "tune":
        from recipes.tune import main_args

        return main_args(a)
    if a.command == "rm":
        from recipes.rm import run_args as rm_args

        return rm_args(a)
    from rlhf_switch.rl.config import ConfigError, load_config

    try:
        algorithm = load_config(a.config).algorithm.name
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from recipes.train import run_args

    return run_args(a, algorithm)


if __name__ == "__main__":
    sys.exit(main())
