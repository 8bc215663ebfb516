"""``rlhf-switch`` — the command line.

    rlhf-switch train CONFIG [--iterations N] [--output-dir DIR] [--resume [DIR]] [--quiet]

``train`` runs the recipe the config's ``algorithm.name`` names (``recipes.grpo`` or
``recipes.ppo``) with the same options as ``python -m recipes.<name>``.
"""
from __future__ import annotations

import sys


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command != "train":
        print(f"rlhf-switch: unknown command {command!r} (known: train)", file=sys.stderr)
        return 2
    if not rest or rest[0].startswith("-"):
        print("rlhf-switch train: give a config file, e.g. configs/grpo_tiny.yaml", file=sys.stderr)
        return 2
    from rlhf_switch.rl.config import ConfigError, load_config

    try:
        algorithm = load_config(rest[0]).algorithm.name
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if algorithm == "grpo":
        from recipes.grpo import main as recipe
    else:
        from recipes.ppo import main as recipe
    return recipe(rest)


if __name__ == "__main__":
    sys.exit(main())
