"""Schedules (chunks, rounds, staging budget) and their execution over torch.distributed."""
from .executor import DEFAULT_BUDGET, MoveError, MoveReport, move, prepare
from .verify import VerifyError
from .schedule import Schedule, build_schedule, pair_round

__all__ = ["DEFAULT_BUDGET", "MoveError", "MoveReport", "Schedule", "build_schedule", "move",
           "pair_round", "prepare", "VerifyError"]
