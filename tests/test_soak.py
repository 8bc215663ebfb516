"""Soak: hundreds of alternating train <-> rollout moves on 4 processes, random layouts and
budgets, every move bit-exact, and no rank's memory or file descriptors creeping up.

Run by ``make test`` at a size of a few minutes (``--soak-moves``, default ``DEFAULT_MOVES``);
the long one: ``pytest tests/test_soak.py -m soak --soak-moves 5000``.
"""
from __future__ import annotations

import pytest

import soak_jobs
from catalogue import named_layouts
from rlhf_switch.vps import vllm_layout

DEFAULT_MOVES = 2000
WARMUP = 200  # by then every cache is full: plans (lru 256), schedules (64), gloo's pairs
# Allowed growth from the warm-up sample to the last one, per rank. Measured on the 2-core
# machine (400 moves): see the README's soak paragraph.
RSS_MARGIN = 16 << 20
FD_MARGIN = 0


@pytest.mark.soak
def test_soak_alternating_train_rollout_moves(world4, tiny_spec, request):
    moves = request.config.getoption("--soak-moves") or DEFAULT_MOVES
    assert moves > WARMUP
    train = named_layouts(tiny_spec)
    rollout = {"vllm-tp4": vllm_layout(tiny_spec, 4), "vllm-tp2x2": vllm_layout(tiny_spec, 2, replicas=2),
               "vllm-tp1x4": vllm_layout(tiny_spec, 1, replicas=4)}
    results = world4.run(soak_jobs.soak, train, rollout, moves, WARMUP, 7, timeout=max(600, moves * 3))
    lines = []
    for res in results:
        assert res["wrong"] == [], res["wrong"]
        (_, rss0, fd0), (_, rss1, fd1) = res["samples"][0], res["samples"][-1]
        ms = res["move_seconds"]
        lines.append(f"rank {res['rank']}: {moves} moves in {res['seconds']:.0f} s (median move "
                     f"{ms[len(ms) // 2] * 1e3:.1f} ms, {res['messages']} messages); RSS "
                     f"{rss0 / 2**20:.1f} -> {rss1 / 2**20:.1f} MiB, fds {fd0} -> {fd1}; samples "
                     + " ".join(f"{i}:{r / 2**20:.1f}/{f}" for i, r, f in res["samples"]))
    print("\n" + "\n".join(lines))
    for res in results:
        (_, rss0, fd0), (_, rss1, fd1) = res["samples"][0], res["samples"][-1]
        assert rss1 - rss0 <= RSS_MARGIN, lines
        assert fd1 - fd0 <= FD_MARGIN, lines
