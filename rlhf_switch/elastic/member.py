"""One rank's part of the stop-the-world move (run inside its actor, on every old and new rank
at once): join the union group — the weight channel's own mechanism, a gloo group over the store
old rank 0 hosts — and move the training state with ``switch_training`` over it, one engine after
the other (the trainer, then PPO's critic) on the same group."""
from __future__ import annotations

import time
from datetime import timedelta
from typing import Sequence

from ..engines.channel import ChannelEnd
from ..engines.train_switch import switch_training
from .plan import UnionEndpoint

BYTES = ("bytes_sent", "bytes_received", "bytes_local", "min_bytes_received")


def move_over_union(adapters: Sequence, endpoint: UnionEndpoint, store=None) -> dict:
    """Old side: ``adapters`` are the old engines', only read. New side: the freshly built
    engines', overwritten with the old world's state, step, LR schedule and RNG. Both sides give
    the same engines in the same order (the config's phases: a critic on one side exactly when
    on the other). ``store``: the union store itself, on the member that hosts it. Returns this
    rank's move report — bytes summed over the engines, each engine's in ``parts`` — and the
    first engine's step (``steps``: every engine's)."""
    t0 = time.perf_counter()
    end = ChannelEnd.join(endpoint.host, endpoint.port, endpoint.rank, endpoint.world_size, store=store,
                          timeout_s=endpoint.timeout_s, standby_s=endpoint.timeout_s)
    joined_s = time.perf_counter() - t0
    parts = []
    try:
        for adapter in adapters:
            old, new = (adapter, None) if endpoint.side == "old" else (None, adapter)
            report = switch_training(old, new, group=end.comm, timeout=timedelta(seconds=endpoint.timeout_s))
            m = report.move
            parts.append({"move_s": m.seconds, **{k: getattr(m, k) for k in BYTES},
                          "step": int(report.scalars.get("step", 0))})
    finally:
        end.close()
    return {"union_rank": endpoint.rank, "side": endpoint.side, "join_s": joined_s,
            "move_s": sum(p["move_s"] for p in parts), "seconds": time.perf_counter() - t0,
            **{k: sum(p[k] for p in parts) for k in BYTES}, "parts": parts,
            "step": parts[0]["step"], "steps": [p["step"] for p in parts]}
