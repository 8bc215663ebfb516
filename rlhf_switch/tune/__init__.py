"""The per-phase cost model behind ``rlhf-switch tune``: pure functions of a run's config, the
legal layouts of each phase, and a machine profile; the planner gives the switch's bytes.

    profile.py    machine profiles (shipped: H100/H200 + InfiniBand from published figures; this CPU, measured)
    enumerate.py  every legal layout per phase, as the config's checks and the engine registry allow
    workload.py   what one iteration asks: model sizes, batch shapes
    memory.py     per-device memory per phase; refusals
    cost.py       seconds per phase (compute, engine communication, decode, the switch)
    rank.py       the ranked combinations
    calibrate.py  the measured micro-runs behind the CPU profile
"""
from .enumerate import Combination, describe, enumerate_combinations
from .profile import MachineProfile, load_profile, save_profile
from .rank import Ranking, Row, TuneError, format_table, rank
from .workload import Workload

__all__ = ["Combination", "MachineProfile", "Ranking", "Row", "TuneError", "Workload", "describe",
           "enumerate_combinations", "format_table", "load_profile", "rank", "save_profile"]
