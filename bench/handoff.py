"""Weight sync p2p vs the colocated handoff (ipc), side by side in one cluster.

    python -m bench.handoff [--config configs/grpo_tiny.yaml] [--syncs 40] [--rounds 2] [--json FILE]
    python -m bench.handoff --processes 100M [--syncs 10]      # no Ray, no vLLM: bytes only

Builds the config's engines once (Ray, the trainer, vLLM; the model's seeded initial weights: no
SFT), then alternates the run's weight channel between ``rollout.handoff: p2p`` and ``ipc``
(``Cluster.open_channel`` again: a new channel, the same engines), ``--rounds`` times each; per
round 3 warm-up syncs, then ``--syncs`` timed ``Cluster.sync`` calls (driver's view: the
replicas' receive posted and every trainer rank's send, as in the loop without the post-ahead).
Prints the median and quartiles of each, the medians of the slowest trainer rank's and worker's
part of the move (ipc: the gather + handoff; the worker's wait for its handles + its copy) and
the handles per sync. After the last round the trainer's log-probs are checked against vLLM's
on a generated batch (the weights really arrived).

``--processes SIZE`` (a ``bench.switch`` size: 1M, 10M, 100M, 300M; fp32): the same two handoffs
between plain processes, a ``LocalWorld`` of 4 — ranks 0-1 a ZeRO-3 DP2 trainer, ranks 2-3 the
two workers of a vLLM TP2 layout (worker ``t`` on rank ``t``'s device) — to see how the two scale
with the bytes, without the loop around them. Per handoff 2 warm-up moves, then ``--syncs``
timed ones (every rank between two barriers; the slowest rank's time); at the end each worker's
buffers after ipc are compared with those after p2p (bit for bit).
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(xs, n=4)
    return q[0], statistics.median(xs), q[2]


def _moves_job(src, dst, colocated, budget: int, moves: int) -> dict:
    """One rank of ``--processes``: both handoffs through a weight channel each, timed."""
    import torch
    import torch.distributed as dist

    from rlhf_switch.engines.channel import ChannelEnd, open_store
    from rlhf_switch.vps.materialize import torch_dtype

    rank = dist.get_rank()
    g = torch.Generator().manual_seed(rank)
    src_bufs = {n: torch.randn(b.numel, generator=g).to(torch_dtype(b.dtype)) for n, b in src.buffers(rank).items()}
    dst_bufs = {n: torch.zeros(b.numel, dtype=torch_dtype(b.dtype)) for n, b in dst.buffers(rank).items()}
    out, landed = {}, {}
    for mode in ("p2p", "ipc"):
        store, host, port = open_store(300) if rank == 0 else (None, None, None)
        addr = [(host, port)]
        dist.broadcast_object_list(addr, src=0)
        end = ChannelEnd.join(addr[0][0], addr[0][1], rank, dist.get_world_size(), store=store, timeout_s=300,
                              budget_bytes=budget, handoff=mode, colocated=colocated if mode == "ipc" else ())
        end.set_layouts(src, dst)
        for b in dst_bufs.values():
            b.zero_()
        times, handles = [], 0
        for i in range(moves + 2):
            dist.barrier()
            t0 = time.perf_counter()
            report = end.move(src_bufs, dst_bufs)
            if i >= 2:
                times.append(time.perf_counter() - t0)
            handles = getattr(report, "handles", 0)
        landed[mode] = {n: t.clone() for n, t in dst_bufs.items()}
        dist.barrier()
        end.close()
        del store
        out[mode] = {"times": times, "handles": handles}
    out["same"] = all(torch.equal(landed["p2p"][n].view(torch.int32), landed["ipc"][n].view(torch.int32))
                      for n in dst_bufs)
    return out


def processes(size: str, syncs: int, budget: int) -> dict:
    from bench.switch import SIZES
    from rlhf_switch.engines.channel import resolve_handoff
    from rlhf_switch.launch import LocalWorld
    from rlhf_switch.vps import llama_spec, vllm_layout, zero
    from rlhf_switch.vps.placement import place

    spec = llama_spec(dict(SIZES[size], tie_word_embeddings=False), dtype="float32", name=f"llama-{size}")
    src = place(zero(spec, 2, stage=3, fields=("param",)), range(2), 4)
    dst = place(vllm_layout(spec, 2), range(2, 4), 4)
    _, colocated = resolve_handoff("ipc", [0, 1, 0, 1], 2)
    with LocalWorld(4, timeout=900) as world:
        res = world.run(_moves_job, src, dst, colocated, budget, syncs, timeout=1800)
    nbytes = sum(dst.numel(r) for r in (2, 3)) * 4
    result = {"size": size, "bytes_per_sync": nbytes, "same_bits": all(r["same"] for r in res)}
    print(f"llama-{size}: ZeRO-3 DP2 -> vLLM TP2, {nbytes / 2**20:.1f} MiB per sync into the workers, "
          f"{syncs} syncs per handoff; ipc landed the same bits as p2p: {result['same_bits']}")
    print(f"{'handoff':8} {'sync median (q1-q3)':>28} {'GB/s':>7} {'handles/sync':>13}")
    for mode in ("p2p", "ipc"):
        per_move = [max(r[mode]["times"][i] for r in res) for i in range(syncs)]
        q1, med, q3 = quartiles(per_move)
        handles = sum(r[mode]["handles"] for r in res[:2])
        result[mode] = {"sync_s": [q1, med, q3], "handles": handles}
        print(f"{mode:8} {med * 1e3:>12.1f} ms ({q1 * 1e3:.1f}-{q3 * 1e3:.1f}) {nbytes / med / 1e9:>7.2f} {handles:>13}")
    result["ipc_over_p2p"] = result["ipc"]["sync_s"][1] / result["p2p"]["sync_s"][1]
    print(f"ipc / p2p (median sync): {result['ipc_over_p2p']:.2f}")
    return result


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/grpo_tiny.yaml")
    ap.add_argument("--syncs", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--processes", default=None, metavar="SIZE", help="plain processes, a model of this size")
    ap.add_argument("--budget-mib", type=int, default=64)
    a = ap.parse_args(argv)
    if a.processes:
        result = processes(a.processes, a.syncs, a.budget_mib << 20)
        if a.json:
            Path(a.json).write_text(json.dumps(result, indent=2))
        return result

    from recipes.cluster import Cluster, start_ray
    from recipes.common import warm_start
    from rlhf_switch.rl.config import load_config

    cfg = load_config(a.config)
    cfg.sft = None  # the seeded initial weights: the bench moves bytes, it does not learn
    out = Path(tempfile.mkdtemp(prefix="bench-handoff-"))
    init = warm_start(cfg, out / "init", quiet=True)
    ray, owned = start_ray(cfg, cfg.world_size)
    cluster = Cluster(cfg, ray, quiet=True)
    rows: dict[str, dict[str, list]] = {m: {"sync_s": [], "trainer_move_s": [], "worker_move_s": [], "handles": []}
                                        for m in ("p2p", "ipc")}
    try:
        t0 = time.perf_counter()
        cluster.build(init, None)
        print(f"engines built in {time.perf_counter() - t0:.0f} s", flush=True)
        for _ in range(a.rounds):
            for mode in ("p2p", "ipc"):
                cluster.cfg.rollout.handoff = mode
                cluster.open_channel()
                for _ in range(3):
                    cluster.sync()
                for _ in range(a.syncs):
                    s = cluster.sync()
                    assert s["handoff"] == mode, s
                    rows[mode]["sync_s"].append(s["seconds"])
                    rows[mode]["trainer_move_s"].append(s["breakdown"]["trainer_move_s"])
                    rows[mode]["worker_move_s"].append(s["breakdown"]["worker_move_s"])
                    rows[mode]["handles"].append(s["handles"])
                    bytes_moved = s["bytes_moved"]
        n = cfg.algorithm.train_batch_size  # one mini-batch: the trainer checks, nothing learns
        prompts = [[1, 5 + i % 40, 7, 9] for i in range(n)]
        tokens, lps = cluster.generate(prompts, list(range(n)), 4, 1.0)
        stats = cluster.all("train_on", {"prompts": prompts, "responses": tokens, "rollout_logprobs": lps,
                                         "advantages": [0.0] * n})
        stale = max(s["stale_logprob_diff"] for s in stats)
    finally:
        cluster.shutdown()
        if owned:
            ray.shutdown()
    result = {"config": a.config, "syncs_per_round": a.syncs, "rounds": a.rounds, "bytes_moved": bytes_moved,
              "stale_logprob_diff_after": stale}
    print(f"{a.config}: {a.rounds} rounds x {a.syncs} syncs per handoff, {bytes_moved / 2**20:.2f} MiB per sync; "
          f"trainer vs vLLM log-probs after the last ipc sync: max |diff| {stale:.1e}")
    print(f"{'handoff':8} {'sync median (q1-q3)':>26} {'trainer move':>13} {'worker move':>12} {'handles/sync':>13}")
    for mode, r in rows.items():
        q1, med, q3 = quartiles(r["sync_s"])
        tm, wm = statistics.median(r["trainer_move_s"]), statistics.median(r["worker_move_s"])
        result[mode] = {"sync_s": [q1, med, q3], "trainer_move_s": tm, "worker_move_s": wm, "handles": r["handles"][0]}
        print(f"{mode:8} {med * 1e3:>12.2f} ms ({q1 * 1e3:.2f}-{q3 * 1e3:.2f}) {tm * 1e3:>10.2f} ms "
              f"{wm * 1e3:>9.2f} ms {r['handles'][0]:>13}")
    ratio = result["ipc"]["sync_s"][1] / result["p2p"]["sync_s"][1]
    result["ipc_over_p2p"] = ratio
    print(f"ipc / p2p (median sync): {ratio:.2f}")
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
