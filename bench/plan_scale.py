"""Planning at scale, metadata only: Llama-3-70B and Qwen3-235B-A22B on 64, 256 and 1024 ranks.

    python -m bench.plan_scale            # table + bench/results/plan_scale.json
    python -m bench.plan_scale --quick    # the 64-rank cases only

For each train -> rollout pair it reports the time to build both layouts, the time for ONE rank
to plan its own part (cold caches, median over a few ranks — what every rank of a real run does
in parallel), the full plan where it is affordable, bytes against the minimum, the busiest link,
the rank's rounds, and a modelled switch time on a stated fabric: 8 GPUs per node on NVLink
(900 GB/s per GPU), 8×400 Gb/s InfiniBand per node (50 GB/s per GPU). The executor runs a rank's
exchanges round by round, so its modelled time is the sum over its rounds of the larger of its
sent and received bytes on that link, divided by that link's bandwidth.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time

from rlhf_switch.vps import ParallelConfig, build_layout, llama_spec, plan_rank, plan_transition
from rlhf_switch.vps.layouts.vllm import vllm_layout
from rlhf_switch.vps.spec import qwen3_moe_spec

GPUS_PER_NODE = 8
NVLINK_GBPS = 900.0
IB_GBPS_PER_GPU = 8 * 400 / 8 / GPUS_PER_NODE  # 8×400 Gb/s per node = 400 GB/s, shared by 8 GPUs

LLAMA_70B = dict(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                 intermediate_size=28672, vocab_size=128256, torch_dtype="bfloat16")
QWEN3_235B = dict(hidden_size=4096, num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4,
                  head_dim=128, moe_intermediate_size=1536, num_experts=128, vocab_size=151936,
                  torch_dtype="bfloat16")

# (name, model, world, train config, rollout TP) — rollout = world / TP replicas of vLLM TP
CASES = [
    ("70B TP8·PP2·DP4 -> vLLM TP4×16", "llama", 64, ParallelConfig(tp=8, pp=2, dp=4), 4),
    ("70B TP8·PP2·DP4[zero3] -> vLLM TP4×16", "llama", 64, ParallelConfig(tp=8, pp=2, dp=4, dp_shard="zero3"), 4),
    ("70B TP8·PP4·DP8 -> vLLM TP8×32", "llama", 256, ParallelConfig(tp=8, pp=4, dp=8), 8),
    ("70B TP8·PP4·DP32 -> vLLM TP8×128", "llama", 1024, ParallelConfig(tp=8, pp=4, dp=32), 8),
    ("235B PP4·EP16·DP16 -> vLLM TP16×4", "moe", 64, ParallelConfig(pp=4, dp=16, ep=16), 16),
    ("235B PP8·EP16·DP32 -> vLLM TP16×16", "moe", 256, ParallelConfig(pp=8, dp=32, ep=16), 16),
    ("235B TP4·PP8·EP16·DP32 -> vLLM TP16×64", "moe", 1024, ParallelConfig(tp=4, pp=8, dp=32, ep=16), 16),
]


def modelled_seconds(plan) -> float:
    """Sum over this rank's peers (one per round) of max(sent, received) / link bandwidth."""
    per_peer: dict[int, list[int]] = {}
    for t in plan.sends:
        per_peer.setdefault(t.dst, [0, 0])[0] += t.nbytes
    for t in plan.recvs:
        per_peer.setdefault(t.src, [0, 0])[1] += t.nbytes
    total = 0.0
    for peer, (sent, recv) in per_peer.items():
        same_node = peer // GPUS_PER_NODE == plan.rank // GPUS_PER_NODE
        total += max(sent, recv) / ((NVLINK_GBPS if same_node else IB_GBPS_PER_GPU) * 1e9)
    return total


def run_case(name: str, model: str, world: int, cfg: ParallelConfig, rollout_tp: int, specs: dict,
             sample_ranks: int, full_plan_max: int) -> dict:
    spec = specs[model]
    gc.collect()
    t0 = time.perf_counter()
    src = build_layout(spec, cfg)
    dst = vllm_layout(spec, rollout_tp, replicas=world // rollout_tp)
    layouts_s = time.perf_counter() - t0
    ranks = sorted({0, world // 3 + 1, world // 2 + 3, world - 1})[:sample_ranks]
    plan_times, plans = [], []
    for r in ranks:  # cold: fresh layouts (no cached index/regions) and an empty plan cache
        a, b = build_layout(spec, cfg), vllm_layout(spec, rollout_tp, replicas=world // rollout_tp)
        plan_rank.cache_clear()
        t0 = time.perf_counter()
        p = plan_rank(a, b, r, GPUS_PER_NODE)
        plan_times.append(time.perf_counter() - t0)
        plans.append(p)
    row = {
        "case": name, "world": world, "params": spec.numel, "tensors": len(spec.tensors),
        "layouts_s": layouts_s, "rank_plan_s": statistics.median(plan_times), "ranks": ranks,
        "rank_bytes_received": [p.bytes_received for p in plans],
        "rank_min_bytes": [p.min_bytes_received for p in plans],
        "rank_peers": [len(p.peers()) for p in plans],
        "modelled_s": max(modelled_seconds(p) for p in plans),
    }
    assert all(p.bytes_received == p.min_bytes_received for p in plans)
    if world <= full_plan_max:
        plan_transition.cache_clear()
        t0 = time.perf_counter()
        full = plan_transition(src, dst, GPUS_PER_NODE)
        row["full_plan_s"] = time.perf_counter() - t0
        row["bytes_moved"], row["min_bytes"] = full.bytes_moved, full.min_bytes
        links = full.link_bytes()
        row["max_link_bytes"] = max(links.values()) if links else 0
        row["transfers"] = len(full.transfers)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="64-rank cases only")
    ap.add_argument("--ranks", type=int, default=3, help="ranks sampled for the rank-local plan")
    ap.add_argument("--full-plan-max", type=int, default=64, help="build the full plan up to this world size")
    ap.add_argument("--out", default="bench/results/plan_scale.json")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    specs = {"llama": llama_spec(LLAMA_70B, name="llama-3-70b")}
    llama_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    specs["moe"] = qwen3_moe_spec(QWEN3_235B, name="qwen3-235b-a22b")
    moe_s = time.perf_counter() - t0
    print(f"specs: Llama-3-70B {specs['llama'].numel / 1e9:.1f}B params in {llama_s:.2f} s; Qwen3-235B-A22B "
          f"{specs['moe'].numel / 1e9:.1f}B params, {len(specs['moe'].tensors)} tensors, in {moe_s:.2f} s")
    print(f"fabric model: {GPUS_PER_NODE} GPUs/node, NVLink {NVLINK_GBPS:.0f} GB/s, IB {IB_GBPS_PER_GPU:.0f} GB/s per GPU")
    rows = []
    hdr = f"{'case':44} {'ranks':>5} {'layouts s':>9} {'1 rank s':>8} {'full s':>7} {'moved = min':>11} " \
          f"{'peers':>5} {'model s':>7}"
    print(hdr)
    for name, model, world, cfg, tp in CASES:
        if args.quick and world > 64:
            continue
        row = run_case(name, model, world, cfg, tp, specs, args.ranks, args.full_plan_max)
        rows.append(row)
        full = f"{row['full_plan_s']:7.2f}" if "full_plan_s" in row else f"{'-':>7}"
        eq = row.get("bytes_moved", None) == row.get("min_bytes", None)
        print(f"{name:44} {world:5d} {row['layouts_s']:9.2f} {row['rank_plan_s']:8.2f} {full} "
              f"{'yes' if eq else 'rank-only':>11} {max(row['rank_peers']):5d} {row['modelled_s']:7.2f}", flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"spec_s": {"llama-3-70b": llama_s, "qwen3-235b-a22b": moe_s}, "cases": rows,
                   "fabric": {"gpus_per_node": GPUS_PER_NODE, "nvlink_GBps": NVLINK_GBPS,
                              "ib_GBps_per_gpu": IB_GBPS_PER_GPU}}, f, indent=2)
    print(f"wrote {args.out}")
    print("reference (published): DynaTrain 70B < 2 s, 235B 4.36 s; NeMo-RL nccl_reshard DeepSeek-V3 1.9–2.8 s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
