"""PPO (with a critic): ``python -m recipes.ppo CONFIG [options]`` (the same as ``rlhf-switch train CONFIG`` for a
PPO config). The recipe is ``recipes.train``: see its docstring for the options, ``recipes.loop`` for the phases."""
from __future__ import annotations

import sys

from recipes.train import StaleWeightsError, main as _main, run as _run

__all__ = ["run", "main", "StaleWeightsError"]


def run(config_source, *args, **kwargs) -> list[dict]:
    return _run(config_source, *args, algorithm="ppo", **kwargs)


def main(argv=None) -> int:
    return _main(argv, algorithm="ppo")


if __name__ == "__main__":
    sys.exit(main())
