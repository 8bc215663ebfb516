"""The executor's two posting disciplines, A/B on the same buffers, interleaved.

    python -m bench.posting_discipline --sizes 10M --cases a,b,c,d --repeats 15

The cases and buffers of ``bench.switch`` (4 gloo ranks). Each repeat moves once ordered and once
tagged (which goes first alternates), each timed between barriers as the slowest rank's time, so
load from other jobs on a shared machine falls on both alike; the table shows medians. Both are
checked bit for bit against ``materialize`` before the timed repeats.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch.distributed as dist

from bench.switch import _rank_setup, _rank_teardown, _reset_dst, _S, _verify_dst
from rlhf_switch.routing import move

DISCIPLINES = ("ordered", "tagged")


def _rank_ab(repeats: int) -> dict:
    def once(discipline: str) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        move(_S["src"], _S["dst"], _S["src_bufs"], _S["dst_bufs"], budget_bytes=_S["budget"], discipline=discipline)
        return time.perf_counter() - t0

    exact = {}
    for d in DISCIPLINES:
        _reset_dst()
        once(d)
        exact[d] = _verify_dst()[0]
    times: dict[str, list[float]] = {d: [] for d in DISCIPLINES}
    for i in range(repeats):
        for d in (DISCIPLINES if i % 2 == 0 else DISCIPLINES[::-1]):
            times[d].append(once(d))
    return {"times": times, "exact": exact}


def main(argv=None) -> int:
    from rlhf_switch.launch import LocalWorld

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="10M")
    ap.add_argument("--cases", default="a,b,c,d")
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--budget-mib", type=int, default=64)
    args = ap.parse_args(argv)
    with LocalWorld(4, timeout=600) as world:
        for size in args.sizes.split(","):
            for case in args.cases.split(","):
                world.run(_rank_setup, case, size, args.dtype, args.budget_mib << 20, True)
                res = world.run(_rank_ab, args.repeats)
                world.run(_rank_teardown)
                line = f"{size} {args.dtype} {case}:"
                for d in DISCIPLINES:
                    walls = [max(ts) for ts in zip(*(r["times"][d] for r in res))]
                    exact = all(r["exact"][d] for r in res)
                    line += f"  {d} {statistics.median(walls) * 1e3:7.1f} ms (exact: {exact})"
                print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
