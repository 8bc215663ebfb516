"""Planning at scale, metadata only: Llama-3-70B and Qwen3-235B-A22B on 64, 256 and 1024 ranks.

    python -m bench.plan_scale            # table + bench/results/plan_scale.{json,png}
    python -m bench.plan_scale --quick    # the 64-rank cases only
    python -m bench.plan_scale --only "235B TP4" --ranks 1   # one case, one rank

For each train -> rollout pair it reports the time to construct both layouts (lazy: a rank class
is built when first needed), the time for ONE rank to plan its own part *including* constructing
the layouts and building the classes it needs (fresh layouts, cold plan cache, median over a few
ranks — what every rank of a real run does in parallel; wall and CPU seconds, the CPU figure
being the fairer one on a shared machine), the full plan where it is affordable (up to
``--full-plan-max-pieces`` destination fragments in all), bytes against the minimum, the rank's
peers, and a modelled switch time on a stated fabric: 8 GPUs per node on NVLink
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


def modelled_seconds(plan, device=None) -> float:
    """Sum over this rank's peers (one per round) of max(sent, received) / link bandwidth.
    ``device``: the GPU of a rank when ranks share GPUs (the union world of an elastic resize,
    where an old and a new rank sit on one GPU; default: rank ``r`` on GPU ``r``); a peer on the
    same GPU is counted at NVLink bandwidth (an upper bound for an on-device copy)."""
    device = device or (lambda r: r)
    per_peer: dict[int, list[int]] = {}
    for t in plan.sends:
        per_peer.setdefault(t.dst, [0, 0])[0] += t.nbytes
    for t in plan.recvs:
        per_peer.setdefault(t.src, [0, 0])[1] += t.nbytes
    total = 0.0
    for peer, (sent, recv) in per_peer.items():
        same_node = device(peer) // GPUS_PER_NODE == device(plan.rank) // GPUS_PER_NODE
        total += max(sent, recv) / ((NVLINK_GBPS if same_node else IB_GBPS_PER_GPU) * 1e9)
    return total


def run_case(name: str, model: str, world: int, cfg: ParallelConfig, rollout_tp: int, specs: dict,
             sample_ranks: int, full_plan_max_pieces: int, reverse: bool = False) -> dict:
    """``reverse``: plan vLLM -> training instead (the weights coming back, or a rollout layout
    feeding a new trainer): replicated norms and KV heads make every rank a candidate holder there,
    the direction the planner's geometry sharing must also cover. One-rank plans only."""
    spec = specs[model]

    def layouts():
        train, rollout = build_layout(spec, cfg), vllm_layout(spec, rollout_tp, replicas=world // rollout_tp)
        return (rollout, train) if reverse else (train, rollout)

    gc.collect()
    t0 = time.perf_counter()
    src, dst = layouts()
    layouts_s = time.perf_counter() - t0
    ranks = sorted({world // 2 + 3, 0, world // 3 + 1, world - 1}, key=lambda r: r != world // 2 + 3)[:sample_ranks]
    plan_times, cpu_times, plans = [], [], []
    for r in ranks:  # cold: fresh layouts (no rank class built, no index) and an empty plan cache
        gc.collect()
        plan_rank.cache_clear()
        t0, c0 = time.perf_counter(), time.process_time()
        a, b = layouts()
        p = plan_rank(a, b, r, GPUS_PER_NODE)
        plan_times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)
        plans.append(p)
    row = {
        "case": name, "direction": "vLLM -> train" if reverse else "train -> vLLM", "world": world, "params": spec.numel, "tensors": len(spec.tensors),
        "layouts_s": layouts_s, "rank_plan_s": statistics.median(plan_times),
        "rank_plan_cpu_s": statistics.median(cpu_times), "rank_plan_all_s": plan_times, "ranks": ranks,
        "rank_bytes_received": [p.bytes_received for p in plans],
        "rank_min_bytes": [p.min_bytes_received for p in plans],
        "rank_peers": [len(p.peers()) for p in plans],
        "modelled_s": max(modelled_seconds(p) for p in plans),
    }
    assert all(p.bytes_received == p.min_bytes_received for p in plans)
    # every vLLM worker holds a piece of every tensor: about tensors × world destination pieces
    if not reverse and len(spec.tensors) * world <= full_plan_max_pieces:
        plan_transition.cache_clear()
        del a, b, plans
        gc.collect()
        t0, c0 = time.perf_counter(), time.process_time()
        full = plan_transition(src, dst, GPUS_PER_NODE)  # builds every rank class of both layouts
        row["full_plan_s"] = time.perf_counter() - t0
        row["full_plan_cpu_s"] = time.process_time() - c0
        row["bytes_moved"], row["min_bytes"] = full.bytes_moved, full.min_bytes
        links = full.link_bytes()
        row["max_link_bytes"] = max(links.values()) if links else 0
        row["transfers"] = len(full.transfers)
        del full
        plan_transition.cache_clear()
    return row


def plot(rows: list[dict], path: str) -> None:
    """One rank's plan and the full plan, seconds per case (log scale), and the targets."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["rank_plan_s"] for r in rows], 0.4, label="one rank (layouts + plan)")
    ax.bar([x + 0.2 for x in xs], [r.get("full_plan_s", 0) for r in rows], 0.4, label="full plan (everyone's)")
    ax.axhline(1, color="C0", ls="--", lw=1, label="one-rank target 1 s")
    ax.axhline(30, color="C1", ls="--", lw=1, label="full-plan target 30 s")
    ax.set_yscale("log")
    ax.set_ylabel("seconds (one core)")
    ax.set_xticks(list(xs), [f"{r['case'].split(' -> ')[0]}\n{r['world']} ranks"
                             + ("\n(vLLM -> train)" if r.get("direction") == "vLLM -> train" else "")
                             for r in rows], fontsize=6)
    ax.legend(fontsize=8)
    ax.set_title("Planning at scale, metadata only")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="64-rank cases only")
    ap.add_argument("--only", default=None, help="run the cases whose name starts with this")
    ap.add_argument("--ranks", type=int, default=3, help="ranks sampled for the rank-local plan")
    ap.add_argument("--full-plan-max-pieces", type=int, default=3_000_000,
                    help="build the full plan when tensors × world is at most this")
    ap.add_argument("--direction", choices=("forward", "reverse", "both"), default="both",
                    help="train -> vLLM (forward), vLLM -> train (reverse, one-rank plans), or both")
    ap.add_argument("--out", default="bench/results/plan_scale.json")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    # a spec's digest (which every plan checks) is computed once per process, with the spec
    specs = {"llama": llama_spec(LLAMA_70B, name="llama-3-70b")}
    specs["llama"].digest
    llama_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    specs["moe"] = qwen3_moe_spec(QWEN3_235B, name="qwen3-235b-a22b")
    specs["moe"].digest
    moe_s = time.perf_counter() - t0
    print(f"specs: Llama-3-70B {specs['llama'].numel / 1e9:.1f}B params in {llama_s:.2f} s; Qwen3-235B-A22B "
          f"{specs['moe'].numel / 1e9:.1f}B params, {len(specs['moe'].tensors)} tensors, in {moe_s:.2f} s")
    print(f"fabric model: {GPUS_PER_NODE} GPUs/node, NVLink {NVLINK_GBPS:.0f} GB/s, IB {IB_GBPS_PER_GPU:.0f} GB/s per GPU")
    rows = []
    hdr = f"{'case':44} {'dir':>4} {'ranks':>5} {'layouts s':>9} {'1 rank s':>8} {'(cpu)':>6} {'full s':>7} {'(cpu)':>6} " \
          f"{'moved = min':>11} {'peers':>5} {'model s':>7}"
    print(hdr)
    for name, model, world, cfg, tp in CASES:
        if (args.quick and world > 64) or (args.only and not name.startswith(args.only)):
            continue
        for reverse in {"forward": (False,), "reverse": (True,), "both": (False, True)}[args.direction]:
            row = run_case(name, model, world, cfg, tp, specs, args.ranks, args.full_plan_max_pieces, reverse)
            rows.append(row)
            full = f"{'-':>7} {'-':>6}"
            if "full_plan_s" in row:
                full = f"{row['full_plan_s']:7.2f} {row['full_plan_cpu_s']:6.2f}"
            # with a full plan: its bytes against the minimum; without one: the sampled ranks' (asserted)
            eq = "yes" if row.get("bytes_moved", 0) == row.get("min_bytes", 0) else "NO"
            eq = eq if "full_plan_s" in row else "ranks: yes"
            print(f"{name:44} {'rev' if reverse else 'fwd':>4} {world:5d} {row['layouts_s']:9.2f} "
                  f"{row['rank_plan_s']:8.2f} {row['rank_plan_cpu_s']:6.2f} {full} {eq:>11} {max(row['rank_peers']):5d} {row['modelled_s']:7.2f}",
                  flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"spec_s": {"llama-3-70b": llama_s, "qwen3-235b-a22b": moe_s}, "cases": rows,
                   "fabric": {"gpus_per_node": GPUS_PER_NODE, "nvlink_GBps": NVLINK_GBPS,
                              "ib_GBps_per_gpu": IB_GBPS_PER_GPU}}, f, indent=2)
    print(f"wrote {args.out}")
    png = os.path.splitext(args.out)[0] + ".png"
    try:
        plot(rows, png)
        print(f"wrote {png}")
    except ImportError as e:
        print(f"(no plot: {e}; pip install matplotlib)")
    print("reference (published): DynaTrain 70B < 2 s, 235B 4.36 s; NeMo-RL nccl_reshard DeepSeek-V3 1.9–2.8 s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
