"""Schedules (chunks, rounds, staging budget) and their execution over torch.distributed."""
from .executor import DEFAULT_BUDGET, Deadlines, MoveError, MoveHooks, MoveReport, PeerLost, gc_paused, move, prepare
from .schedule import Schedule, build_schedule, pair_round
from .verify import VerifyError

__all__ = ["DEFAULT_BUDGET", "Deadlines", "MoveError", "MoveHooks", "MoveReport", "PeerLost", "Schedule",
           "build_schedule", "gc_paused", "move", "pair_round", "prepare", "VerifyError"]
