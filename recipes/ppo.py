"""PPO (with a critic): ``python -m recipes.ppo CONFIG [options]`` (the same as ``rlhf-switch train CONFIG`` for a
PPO config). The loop is ``recipes.loop``: see its docstring for the phases and options."""
from __future__ import annotations

import sys

from recipes.loop import StaleWeightsError, main as _main, run as _run

__all__ = ["run", "main", "StaleWeightsError"]


def run(config_source, *args, **kwargs) -> list[dict]:
    return _run(config_source, *args, algorithm="ppo", **kwargs)


def main(argv=None) -> int:
    return _main(argv, algorithm="ppo")


if __name__ == "__main__":
    sys.exit(main())
