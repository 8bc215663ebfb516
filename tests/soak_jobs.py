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


def soak(train: dict[str, Layout], rollout: dict[str, Layout], moves: int, warmup: int, seed: int,
         budgets=(1000, 4096, 65536, 1 << 20), sample_every: int = 50, trace: bool = False) -> dict:
    """``moves`` moves alternating train -> rollout -> train ..., each leg to a layout drawn at
    random (the same draws on every rank: one seeded generator) under a random budget. The
    destination is overwritten with a fill pattern before each move, so every covered element
    must come from the move; it is compared with a direct construction. Samples RSS and open fds
    after ``warmup`` moves (caches full: plans, schedules, gloo's pairs) and every
    ``sample_every`` moves, and at the end."""
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
        if trace and i + 1 == warmup:
            import tracemalloc
            tracemalloc.start(8)
            snap0 = tracemalloc.take_snapshot()
        if i + 1 == warmup or (i + 1 > warmup and (i + 1 - warmup) % sample_every == 0) or i + 1 == moves:
            samples.append((i + 1, rss_bytes(), open_fds()))
    top = []
    if trace:
        import tracemalloc
        diff = tracemalloc.take_snapshot().compare_to(snap0, "traceback")
        top = [f"{d.size_diff / 1024:.1f} KiB in {d.count_diff} blocks: " + " <- ".join(
            f"{fr.filename.split('/')[-1]}:{fr.lineno}" for fr in d.traceback[:6]) for d in diff[:8]]
        tracemalloc.stop()
    return {"rank": rank, "wrong": wrong[:20], "python_growth": top, "samples": samples, "seconds": time.perf_counter() - t0,
            "move_seconds": sorted(seconds), "messages": messages}
