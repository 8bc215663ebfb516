"""Every deadline of a run, named once: how long a wait may take before it is an error. A wait
that passes its deadline fails with a message naming what it waited for (never hangs the run).

On a loaded machine (2 cores, every engine of a test on them) starts and moves take far longer than
on an idle GPU node: these bound hangs, not normal operation.
"""
from __future__ import annotations

# --- a move's collective waits (routing, the weight channel, a resize's union move) ----------------
MOVE_S = 300.0        # any one wait inside a move: a peer's bytes, a store key, a process group formed
STANDBY_S = 3600.0    # a channel member posted ahead of the others (a rollout replica standing by
                      # while the trainer trains) before they arrive
# --- the driver's calls to the run's actors ---------------------------------------------------------
SHUTDOWN_S = 60.0     # an actor's shutdown call, before it is killed
CONTROL_S = 120.0     # a short control call: a placement group ready, a layout or counters asked
START_S = 180.0       # an actor's start-up call: devices seen, a store opened, a world joined
SYNC_S = 600.0        # one weight sync, every member's part of it
RESIZE_S = 600.0      # a resize: a background world built, its stop-the-world move, an answer to a request
PHASE_S = 900.0       # one phase's calls to every trainer rank (logprobs, update, ...)
