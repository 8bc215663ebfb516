"""Where one switch's time goes, per rank: the VPS move against the raw floor, on the same buffers.

    python -m bench.switch_profile --size 10M --case a          # 31 paired repeats
    python -m bench.switch_profile --size 100M --case c --repeats 15

The same four gloo ranks, layouts and buffers as ``bench.switch`` (its cases a–d), and the same
floor: raw p2p (one message per peer, the plan's bytes) followed by the plan's local bytes as big
memcpys, run right after each VPS repeat. Per rank it prints the medians of the move's wall time,
its phases (``MoveReport.phases``: prepare, agree, pack_ahead, post, local, wait), its messages,
and the user and system CPU seconds (``getrusage``: the rank's threads, gloo's included) the move
and the floor each took. With 4 ranks on 2 cores CPU time is wall time, so the CPU the move uses
beyond the floor's is what keeps it off the floor. Bit-exactness and bytes are ``bench.switch``'s
job; this one only looks inside.
"""
from __future__ import annotations

import argparse
import resource
import statistics
import time

import torch.distributed as dist

from bench import baselines
from bench import switch as sw


def _cpu() -> tuple[float, float]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime


def _rank_profile(repeats: int) -> dict:
    raw = dict(baselines.raw_prepare(sw._S), copy_local=True)
    sw._vps_run({})  # warm: the schedule is planned and cached, the staging pool kept
    rows = []
    for _ in range(repeats):
        dist.barrier()
        c0, t0 = _cpu(), time.perf_counter()
        report = sw._vps_run({})
        wall, c1 = time.perf_counter() - t0, _cpu()
        dist.barrier()
        r0 = _cpu()
        x = baselines.raw_run(raw)
        r1 = _cpu()
        dist.barrier()
        rows.append({"wall": wall, "phases": report.phases, "messages": report.messages,
                     "user": c1[0] - c0[0], "sys": c1[1] - c0[1], "floor": x["with_local_s"],
                     "floor_user": r1[0] - r0[0], "floor_sys": r1[1] - r0[1]})
    return {"rows": rows}


def _ms(xs) -> str:
    return f"{statistics.median(xs) * 1e3:.1f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="10M", choices=list(sw.SIZES))
    ap.add_argument("--case", default="a", choices=list(sw.CASES))
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--repeats", type=int, default=31)
    ap.add_argument("--budget-mib", type=float, default=64.0)
    ap.add_argument("--sources", choices=("shared", "private"), default="shared", help="as in bench.switch")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        raise SystemExit("--repeats must be >= 1")
    from rlhf_switch.launch import LocalWorld

    with LocalWorld(sw.WORLD, timeout=600) as world:
        world.run(sw._rank_setup, args.case, args.size, args.dtype, int(args.budget_mib * (1 << 20)), False,
                  args.sources == "shared")
        per_rank = [r["rows"] for r in world.run(_rank_profile, args.repeats)]
    vps, walls = sw._median_of_max([[x["wall"] for x in rows] for rows in per_rank])
    floor, floors = sw._median_of_max([[x["floor"] for x in rows] for rows in per_rank])
    print(f"{args.size} {args.dtype} case {args.case} ({sw.CASES[args.case]}), {args.repeats} paired repeats: "
          f"VPS {vps * 1e3:.1f} ms, floor {floor * 1e3:.1f} ms (slowest rank, medians); VPS at "
          f"{100 * statistics.median(f / w for f, w in zip(floors, walls)):.0f} % of the floor")
    for r, rows in enumerate(per_rank):
        phases = " ".join(f"{k} {_ms([x['phases'][k] for x in rows])}" for k in rows[0]["phases"])
        print(f"rank {r}: move {_ms([x['wall'] for x in rows])} ms ({rows[0]['messages']} messages; {phases}); "
              f"CPU user/sys {_ms([x['user'] for x in rows])}/{_ms([x['sys'] for x in rows])} ms | "
              f"floor {_ms([x['floor'] for x in rows])} ms, CPU user/sys "
              f"{_ms([x['floor_user'] for x in rows])}/{_ms([x['floor_sys'] for x in rows])} ms")
    return 0


if __name__ == "__main__":
    # the ranks must import these functions as ``bench.switch_profile.*``, not ``__main__.*``
    import importlib
    raise SystemExit(importlib.import_module("bench.switch_profile").main())
