"""One rank's part of the stop-the-world move (run inside its actor, on every old and new rank
at once): join the union group — the weight channel's own mechanism, a gloo group over the store
old rank 0 hosts — and move the training state with ``switch_training`` over it."""
from __future__ import annotations

import time
from datetime import timedelta

from ..engines.channel import ChannelEnd
from ..engines.train_switch import switch_training
from .plan import UnionEndpoint


def move_over_union(adapter, endpoint: UnionEndpoint, store=None) -> dict:
    """Old side: ``adapter`` is the old engine's, only read. New side: the freshly built engine's,
    overwritten with the old world's state, step, LR schedule and RNG. ``store``: the union store
    itself, on the member that hosts it. Returns this rank's move report and scalars."""
    t0 = time.perf_counter()
    end = ChannelEnd.join(endpoint.host, endpoint.port, endpoint.rank, endpoint.world_size, store=store,
                          timeout_s=endpoint.timeout_s, standby_s=endpoint.timeout_s)
    joined_s = time.perf_counter() - t0
    try:
        old, new = (adapter, None) if endpoint.side == "old" else (None, adapter)
        report = switch_training(old, new, group=end.comm, timeout=timedelta(seconds=endpoint.timeout_s))
    finally:
        end.close()
    m = report.move
    return {"union_rank": endpoint.rank, "side": endpoint.side, "join_s": joined_s,
            "move_s": m.seconds, "seconds": time.perf_counter() - t0, "bytes_sent": m.bytes_sent,
            "bytes_received": m.bytes_received, "bytes_local": m.bytes_local,
            "min_bytes_received": m.min_bytes_received, "step": int(report.scalars.get("step", 0))}
