"""The soak's job: many alternating train <-> rollout moves on every rank of a LocalWorld, each
checked bit for bit, with this process's RSS and open file descriptors sampled."""
from __future__ import annotations

import os
import random
import time

import torch
import torch.distributed as dist

from rank_jobs import tensor_source
from rlhf_switch.routing import move
from rlhf_switch.vps import Layout
from rlhf_switch.vps.materialize import allocate, bits, coverage_masks, materialize

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def live_rss_bytes() -> int:
    """RSS after dropping the executor's schedule cache (64 schedules, whichever pairs and
    budgets were drawn last: up to ~40 MiB of this model's at budget 1000) and its kept staging
    pool (the last move's, at most its budget), collecting garbage and handing freed heap back to
    the OS: what stays is what the moves retain."""
    import ctypes
    import gc

    from rlhf_switch.routing import executor

    executor._SCHEDULES.clear()
    executor._POOLS.clear()
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    return rss_bytes()


def soak(train: dict[str, Layout], rollout: dict[str, Layout], moves: int, warmup: int, seed: int,
         budgets=(1000, 4096, 65536, 1 << 20), sample_every: int = 50, trace: bool = False) -> dict:
    """``moves`` moves alternating train -> rollout -> train ..., each leg to a layout drawn at
    random (the same draws on every rank: one seeded generator) under a random budget. The
    destination is overwritten with a fill pattern before each move, so every covered element
    must come from the move; it is compared with a direct construction. Samples RSS and open fds
    after ``warmup`` moves (caches full: plans, schedules, gloo's pairs) and every
    ``sample_every`` moves, and at the end: (moves, RSS, live RSS — see ``live_rss_bytes`` —,
    open fds)."""
    rank = dist.get_rank()
    rng = random.Random(seed)
    layouts = {**train, **rollout}
    tensor_of = tensor_source(next(iter(layouts.values())), seed)
    # every layout's expected buffers, coverage masks and one buffer set, built before warm-up
    expected = {n: materialize(lay, rank, tensor_of) for n, lay in layouts.items()}
    masks = {n: coverage_masks(lay, rank) for n, lay in layouts.items()}
    buffers = {n: allocate(lay, rank) for n, lay in layouts.items()}
    cur = rng.choice(sorted(train))
    for n, t in buffers[cur].items():
        t.copy_(expected[cur][n])
    samples, wrong, seconds = [], [], []
    messages = 0
    t0 = time.perf_counter()
    for i in range(moves):
        pool = rollout if cur in train else train
        nxt = rng.choice(sorted(pool))
        budget = rng.choice(budgets)
        dst = buffers[nxt]
        for t in dst.values():
            t.view(torch.uint8).fill_(0xA5)
        ts = time.perf_counter()
        rep = move(layouts[cur], layouts[nxt], buffers[cur], dst, budget_bytes=budget)
        seconds.append(time.perf_counter() - ts)
        messages += rep.messages
        for n, t in dst.items():
            m = masks[nxt][n]
            if not torch.equal(bits(t)[m], bits(expected[nxt][n])[m]):
                wrong.append(f"move {i} {cur} -> {nxt} (budget {budget}): {n} differs")
        cur = nxt
        if i + 1 == warmup or (i + 1 > warmup and (i + 1 - warmup) % sample_every == 0) or i + 1 == moves:
            samples.append((i + 1, rss_bytes(), live_rss_bytes(), open_fds()))
        if trace and i + 1 == warmup:  # after the sample: the schedule cache is empty at both ends
            import tracemalloc
            tracemalloc.start(12)
            snap0 = tracemalloc.take_snapshot()
    top = []
    if trace:
        import tracemalloc
        diff = tracemalloc.take_snapshot().compare_to(snap0, "traceback")
        top = [f"{d.size_diff / 1024:.1f} KiB in {d.count_diff} blocks: " + " <- ".join(
            f"{fr.filename.split('/')[-1]}:{fr.lineno}" for fr in d.traceback[-8:]) for d in diff[:8]]
        tracemalloc.stop()
    return {"rank": rank, "wrong": wrong[:20], "python_growth": top, "samples": samples, "seconds": time.perf_counter() - t0,
            "move_seconds": sorted(seconds), "messages": messages}


def rss_bytes_of(pid: int | str) -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * PAGE
