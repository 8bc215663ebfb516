"""GRPO: ``python -m recipes.grpo CONFIG [options]`` (the same as ``rlhf-switch train CONFIG`` for a
GRPO config). The recipe is ``recipes.train``: see its docstring for the options, ``recipes.loop`` for the phases."""
from __future__ import annotations

import sys

from recipes.train import StaleWeightsError, main as _main, run as _run

__all__ = ["run", "main", "StaleWeightsError"]


def run(config_source, *args, **kwargs) -> list[dict]:
    return _run(config_source, *args, algorithm="grpo", **kwargs)


def main(argv=None) -> int:
    return _main(argv, algorithm="grpo")


if __name__ == "__main__":
    sys.exit(main())
