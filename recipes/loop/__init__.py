"""The RLHF loop and its strategies: ``Loop`` (one iteration as named phases, ``loop``), the rollout
sources (``sources``: synchronous, one step ahead, partial — with ``partial``'s segments), the train
worlds (``world``: own, devices lent, rebalanced) and what an iteration reports (``record``). The
recipe that builds and runs it is ``recipes.train``."""
from recipes.loop.loop import PHASES, Faults, Loop, RunState, channel_summary, stand_by_version

__all__ = ["PHASES", "Faults", "Loop", "RunState", "channel_summary", "stand_by_version"]
