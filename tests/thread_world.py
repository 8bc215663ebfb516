"""A world of ranks as threads of the pytest process, over one gloo group (``HashStore``).

For the tests that must run a rank's code where ``make mutate`` sees it: mutmut learns which
test reaches a function in the pytest process only, and a ``LocalWorld``'s ranks are processes of
their own. Threads of one process are real gloo ranks all the same (loopback TCP), and a
group of this process is also found by the same-host transport's probe (``same_host``), so a
move between them reads its peers' memory as between processes of one host. A handful of
small moves take about a second."""
from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any, Callable


def run_on_threads(world: int, job: Callable[[int, Any], Any], timeout_s: float = 120) -> list:
    """``job(rank, comm)`` on every rank at once, each a thread with a ``GroupComm`` over one new
    gloo group; per rank what it returned, or ``"<ExceptionType>: <message>"``."""
    import torch.distributed as dist

    from rlhf_switch.routing.comm import GroupComm

    store, out = dist.HashStore(), [None] * world

    def rank(r: int) -> None:
        try:
            pg = dist.ProcessGroupGloo(store, r, world, timedelta(seconds=timeout_s / 2))
            out[r] = job(r, GroupComm(pg, store=store))
        except Exception as e:  # noqa: BLE001 - the test compares them
            out[r] = f"{type(e).__name__}: {e}"

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    assert not any(t.is_alive() for t in threads), "a rank thread is stuck"
    return out
