"""Elastic resize of a trainer world: the stop-the-world move against a checkpoint restart.

Measured (real Ray actors, real DeepSpeed ZeRO-3, gloo on this CPU box), on the same run:

  resize    the elastic manager's path (``rlhf_switch.elastic``): the new world built in the
            background (``start_world``: actors, their group, the engine empty in its layout),
            then ``PendingWorld.commit`` — one VPS plan over the union of old and new ranks
            moves fp32 master, Adam moments, the bit16 copy, step / LR schedule / RNG
            (``switch_training``), the old actors leave. Only the commit stops training.
  restart   the loop's own checkpoint path: the old world writes the FullState checkpoint
            (``HybridWorker.save_checkpoint``: every rank moves its part to rank 0, which writes
            HF safetensors + optimizer state), a new world starts (actors, group, the engine
            built) and loads it (rank 0 reads it whole, the VPS spreads it). Training is stopped
            for all of it.

ZeRO-3 DP4 -> DP2 and back DP2 -> DP4, 10M and 100M models (``bench.switch.SIZES``), after two
training steps (non-zero moments). Both destinations are checked against the source's state bit
for bit (sha256 of every gathered fp32 master / moment tensor, step, LR schedule, RNG).

Modelled (metadata only, no bytes move): the same kind of resize of Llama-3-70B and
Qwen3-235B-A22B at 64 / 256 / 1024 ranks — ZeRO-3-sharded bf16 weights + fp32 master + Adam
moments, DP n -> DP n/2 and back, old and new ranks sharing GPUs in the union world — planned
per rank by the planner (``vps.plan_rank``, a sample of ranks) and timed by the link model of
``bench/plan_scale.py`` (bytes per peer over NVLink / InfiniBand; no fixed costs), next to the
reference system's published figures.

    python -m bench.elastic                       # 10M, 100M and the modelled table
    python -m bench.elastic --sizes 1M --no-back --model-ranks 64    # the CI smoke run
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from actors.hybrid import HybridWorker

RESULTS = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parent.parent
# published by the reference system; its public code handles Megatron layouts only
REFERENCE = {"70B": "< 2 s (70B dense)", "235B": "4.36 s (235B MoE)",
             "offload": "~33 s (30B MoE, CPU-offloaded optimizer)"}


class BenchWorker(HybridWorker):
    """``HybridWorker`` plus what the bench needs: a digest of the whole training state (compared
    on the driver, not the state itself: 1.2 GB at 100M) and a checkpoint load into an engine
    built empty (the restart's destination, built exactly like the resize's)."""

    def state_digest(self) -> dict | None:
        """sha256 of every gathered tensor and the scalars, on rank 0 (collective)."""
        import torch

        state = self.gathered_state()
        if state is None:
            return None

        def sha(t: torch.Tensor) -> str:
            return hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()

        out = {f"master/{n}": sha(t) for n, t in state["master"].items()}
        out.update({f"{f}/{n}": sha(t) for f, ts in state["moments"].items() for n, t in ts.items()})
        sc = state["scalars"]
        out.update({k: repr(sc[k]) for k in ("step", "global_steps", "global_samples", "lr_scheduler") if k in sc})
        out["rng"] = sha(sc["rng"])
        return out

    def load_checkpoint(self, path: str) -> dict:
        start = self._load_state(path, weights_only=False)
        self.train_steps = int(start.get("step", 0))
        return {"rank": self.rank, "step": self.train_steps}


def run_config(size: str, world: int) -> dict:
    """The loop's config of a trainer world: ``size`` from ``bench.switch.SIZES``, ZeRO-3 DP
    ``world``, torch rollout (built only by the loop; the bench moves the trainer), no reference."""
    import yaml

    from bench.switch import SIZES

    cfg = yaml.safe_load((REPO / "configs" / "grpo_tiny.yaml").read_text())
    cfg.pop("sft", None)
    cfg.pop("reference", None)
    cfg.update(world_size=world, output_dir=tempfile.gettempdir())
    cfg["model"] = {"dtype": "float32", "hf_config": dict(
        model_type="llama", **SIZES[size], max_position_embeddings=64, tie_word_embeddings=False,
        pad_token_id=0, bos_token_id=1, eos_token_id=2)}
    cfg["train"] = {"engine": "deepspeed", "zero_stage": 3, "tp": 1, "pp": 1, "dp": world}
    cfg["rollout"] = {"engine": "torch", "tp": 1, "pp": 1, "dp": world}
    cfg["checkpoint"] = {"save_every": 0}
    cfg["algorithm"].update(kl_coef=0.0, lr=1e-3, prompts_per_iteration=4, group_size=2, mini_batch_size=8,
                            micro_batch_size=2)
    return cfg


def _batch(step: int, size: int = 8) -> dict:
    """A GRPO batch of random tokens and advantages, a function of ``step`` only."""
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    return {"prompts": [torch.randint(3, 47, (8,), generator=g).tolist() for _ in range(size)],
            "responses": [torch.randint(3, 47, (8,), generator=g).tolist() for _ in range(size)],
            "rollout_logprobs": [[0.0] * 8 for _ in range(size)],
            "advantages": torch.randn(size, generator=g).tolist()}


class Bench:
    def __init__(self, ray, ckpt_root: Path):
        from rlhf_switch.elastic.manager import Devices

        self.ray, self.ckpt_root = ray, ckpt_root
        self.actor_cls = ray.remote(num_cpus=0.5, num_gpus=0.5)(BenchWorker)
        self.devices = Devices(ray)
        self.devices.acquire(range(4))

    def world(self, cfg: dict, ids) -> list:
        """A trainer world built the way the resize builds its new one (actors, group, engine)."""
        ray = self.ray
        workers = [self.actor_cls.options(scheduling_strategy=self.devices.strategy(d)).remote() for d in ids]
        address = workers[0].open_store.remote()
        ray.get([w.init_world_at.remote(address, r, len(workers)) for r, w in enumerate(workers)], timeout=600)
        ray.get([w.build_empty.remote(cfg, None) for w in workers], timeout=1200)
        return workers

    def digest(self, workers) -> dict:
        return self.ray.get([w.state_digest.remote() for w in workers], timeout=1200)[0]

    def kill(self, workers) -> None:
        for w in workers:
            self.ray.kill(w)

    def resize_and_restart(self, size: str, old: list, old_ids: tuple, new_ids: tuple, say) -> tuple[dict, list]:
        """From the running world ``old``: the checkpoint written (the restart's save), the resize
        (background build, commit), then the restart's new world built and loaded. Returns the
        row and the resized world (``old`` is gone)."""
        from rlhf_switch.elastic import ResizePlan
        from rlhf_switch.elastic.manager import start_world

        ray, n, m = self.ray, len(old_ids), len(new_ids)
        name = f"ZeRO-3 DP{n} -> DP{m}"
        cfg_new = run_config(size, m)
        truth = self.digest(old)
        ckpt = self.ckpt_root / f"{size}-dp{n}-dp{m}"
        t0 = time.perf_counter()
        ray.get([w.save_checkpoint.remote(str(ckpt), {}) for w in old], timeout=1200)
        save_s = time.perf_counter() - t0
        ckpt_bytes = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())
        say(f"{size} {name}: restart's checkpoint written in {save_s:.2f} s ({ckpt_bytes / 2**20:.0f} MiB)")

        pending = start_world(ray, self.actor_cls, cfg_new, self.devices, ResizePlan(old_ids, new_ids))
        pending.wait()
        result = pending.commit(old)
        resized = result.workers
        resize_exact = self.digest(resized) == truth
        say(f"{size} {name}: resize built in the background in {result.background_s:.2f} s, stop-the-world "
            f"{result.stop_the_world_s:.3f} s ({result.bytes_moved / 2**20:.0f} MiB), exact={resize_exact}")

        t0 = time.perf_counter()
        fresh = self.world(cfg_new, new_ids)
        start_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        ray.get([w.load_checkpoint.remote(str(ckpt)) for w in fresh], timeout=1200)
        load_s = time.perf_counter() - t0
        restart_exact = self.digest(fresh) == truth
        self.kill(fresh)
        shutil.rmtree(ckpt, ignore_errors=True)
        say(f"{size} {name}: restart: new world {start_s:.2f} s, load {load_s:.2f} s, exact={restart_exact}")
        restart_s = save_s + start_s + load_s
        stop_s = result.stop_the_world_s
        row = {"size": size, "resize": name, "old_world": n, "new_world": m, "tensors_compared": len(truth),
               "resize_exact": resize_exact, "restart_exact": restart_exact,
               "background_s": result.background_s, "stop_the_world_s": stop_s, "release_s": result.release_s,
               "slowest_member_move_s": max(x["move_s"] for x in result.members), "bytes_moved": result.bytes_moved,
               "restart_save_s": save_s, "restart_world_s": start_s, "restart_load_s": load_s,
               "restart_s": restart_s, "checkpoint_bytes": ckpt_bytes,
               "restart_over_stop": restart_s / stop_s, "save_load_over_stop": (save_s + load_s) / stop_s}
        return row, resized

    def size(self, size: str, back: bool, say) -> list[dict]:
        ray = self.ray
        t0 = time.perf_counter()
        world = self.world(run_config(size, 4), (0, 1, 2, 3))
        for step in range(2):  # Adam moments, step and LR schedule non-zero
            ray.get([w.train_on.remote(_batch(step)) for w in world], timeout=1200)
        say(f"{size}: ZeRO-3 DP4 world built and trained 2 steps in {time.perf_counter() - t0:.1f} s")
        rows = []
        try:
            row, world = self.resize_and_restart(size, world, (0, 1, 2, 3), (0, 1), say)
            rows.append(row)
            if back:
                row, world = self.resize_and_restart(size, world, (0, 1), (0, 1, 2, 3), say)
                rows.append(row)
        finally:
            self.kill(world)
            self.devices.acquire(range(4))  # a shrink released devices 2, 3
        return rows


# ----------------------------------------------------------------------------- modelled


def model_cases():
    from rlhf_switch.vps import ParallelConfig

    def pair(model, tp, pp, dp, ep=1):
        return (model, ParallelConfig(tp=tp, pp=pp, dp=dp, ep=ep, dp_shard="zero3"),
                ParallelConfig(tp=tp, pp=pp, dp=dp // 2, ep=ep, dp_shard="zero3"))

    return [pair("70B", 8, 2, 4), pair("70B", 8, 4, 8), pair("70B", 8, 4, 32),
            pair("235B", 1, 4, 16, 8), pair("235B", 1, 8, 32, 16), pair("235B", 4, 8, 32, 16)]


def modelled(max_ranks: int, say) -> list[dict]:
    """Per case and direction (shrink DP n -> n/2, grow back): a sample of ranks of the union
    world planned (``vps.plan_rank``), each timed by ``bench.plan_scale.modelled_seconds`` with
    union rank -> GPU (old rank r and new rank n + r on GPU r); the slowest sampled rank."""
    from bench.plan_scale import GPUS_PER_NODE, IB_GBPS_PER_GPU, LLAMA_70B, NVLINK_GBPS, QWEN3_235B, modelled_seconds
    from rlhf_switch.vps import ADAM_FIELDS, PARAM, build_layout, llama_spec, plan_rank
    from rlhf_switch.vps.placement import place_lazy
    from rlhf_switch.vps.spec import qwen3_moe_spec

    specs = {"70B": llama_spec(LLAMA_70B, name="llama-3-70b"), "235B": qwen3_moe_spec(QWEN3_235B, name="qwen3-235b-a22b")}
    fields = (PARAM,) + ADAM_FIELDS
    rows = []
    for model, big, small in model_cases():
        if big.world_size > max_ranks:
            continue
        spec = specs[model]
        for a, b in ((big, small), (small, big)):
            n, m = a.world_size, b.world_size
            t0 = time.perf_counter()
            src = place_lazy(build_layout(spec, a, fields), range(n), n + m)
            dst = place_lazy(build_layout(spec, b, fields), range(n, n + m), n + m)
            # new ranks receive (first, middle, last); the last old rank sends (it leaves on a shrink)
            ranks = sorted({n, n + m // 2, n + m - 1, n - 1})
            worst, most = 0.0, 0
            for r in ranks:
                p = plan_rank(src, dst, r, None)
                assert p.bytes_received == p.min_bytes_received
                worst = max(worst, modelled_seconds(p, lambda q: q if q < n else q - n))
                most = max(most, p.bytes_sent, p.bytes_received)
            plan_rank.cache_clear()
            row = {"model": model, "old": str(a), "new": str(b), "old_ranks": n, "new_ranks": m,
                   "state_bytes": spec.numel * (2 + 12), "rank_bytes": most, "modelled_s": worst,
                   "ranks_planned": ranks, "plan_s": time.perf_counter() - t0}
            rows.append(row)
            say(f"modelled {model} {a} -> {b} ({n} -> {m} ranks): {most / 1e9:.1f} GB on the busiest planned "
                f"rank, {worst:.2f} s ({row['plan_s']:.1f} s to plan)")
    for r in rows:
        r["fabric"] = {"gpus_per_node": GPUS_PER_NODE, "nvlink_GBps": NVLINK_GBPS, "ib_GBps_per_gpu": IB_GBPS_PER_GPU}
    return rows


# ----------------------------------------------------------------------------- tables


def format_tables(rows: list[dict], model_rows: list[dict]) -> str:
    out = []
    if rows:
        out += ["| model | resize | background build | stop-the-world (slowest member's move) | restart: save + new world + load "
                "| restart / stop-the-world | (save + load) / stop-the-world | bit-exact resize / restart |",
                "|---|---|---|---|---|---|---|---|"]
        for r in rows:
            out.append(f"| {r['size']} | {r['resize']} | {r['background_s']:.2f} s | {r['stop_the_world_s']:.3f} s "
                       f"({r['slowest_member_move_s']:.3f} s) | {r['restart_s']:.2f} s ({r['restart_save_s']:.2f} + "
                       f"{r['restart_world_s']:.2f} + {r['restart_load_s']:.2f}) | {r['restart_over_stop']:.1f}× | "
                       f"{r['save_load_over_stop']:.1f}× | {r['resize_exact']} / {r['restart_exact']} |")
    if model_rows:
        out += ["", "| model (modelled) | ranks | layout | per-rank bytes (busiest) | modelled move | reference system (published) |",
                "|---|---|---|---|---|---|"]
        for r in model_rows:
            out.append(f"| {r['model']} | {r['old_ranks']} → {r['new_ranks']} | {r['old']} → {r['new']} | "
                       f"{r['rank_bytes'] / 1e9:.1f} GB | {r['modelled_s']:.2f} s | {REFERENCE[r['model']]} |")
        out.append(f"\nModelled: bytes per peer over the link model of bench/plan_scale.py only (no group creation, "
                   f"no agreement, no engine work); reference CPU-offloaded path: {REFERENCE['offload']}.")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="*", default=["10M", "100M"], help="measured model sizes (bench.switch.SIZES)")
    ap.add_argument("--no-back", action="store_true", help="only DP4 -> DP2 (not back to DP4)")
    ap.add_argument("--model-ranks", type=int, default=1024, help="modelled cases up to this many ranks (0: none)")
    ap.add_argument("--ckpt-dir", default=None, help="where the restart's checkpoint goes (default: a temp dir in ~)")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)

    def say(msg: str) -> None:
        print(f"[elastic {time.strftime('%H:%M:%S')}] {msg}", flush=True)

    load = os.getloadavg()
    say(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} CPUs")
    rows = []
    if args.sizes:
        import ray

        from rlhf_switch.runtime_env import job_runtime_env

        ckpt_root = Path(tempfile.mkdtemp(prefix="elastic-bench-", dir=args.ckpt_dir or os.path.expanduser("~")))
        # the actors import this checkout (bench.elastic.BenchWorker): its path travels in the job
        ray.init(address="local", num_cpus=4, num_gpus=4, include_dashboard=False, log_to_driver=False,
                 runtime_env=job_runtime_env())
        try:
            bench = Bench(ray, ckpt_root)
            for size in args.sizes:
                rows += bench.size(size, not args.no_back, say)
            bench.devices.release_all()
        finally:
            ray.shutdown()
            shutil.rmtree(ckpt_root, ignore_errors=True)
    model_rows = modelled(args.model_ranks, say) if args.model_ranks else []
    load_after = os.getloadavg()
    table = format_tables(rows, model_rows)
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = {"rows": rows, "modelled": model_rows, "reference": REFERENCE, "table": table,
            "load_average_before": load, "load_average_after": load_after, "cpus": os.cpu_count(),
            "when": time.strftime("%Y-%m-%d %H:%M:%S")}
    (out / "elastic.json").write_text(json.dumps(data, indent=1))
    (out / "elastic.md").write_text(
        f"# bench.elastic ({data['when']})\n\n`python -m bench.elastic {' '.join(argv if argv is not None else sys.argv[1:])}`; "
        f"load average {load[0]:.2f} before, {load_after[0]:.2f} after, {os.cpu_count()} CPUs\n\n{table}\n")
    say(f"wrote {out / 'elastic.json'} and {out / 'elastic.md'}")
    bad = [r for r in rows if not (r["resize_exact"] and r["restart_exact"])]
    if bad:
        say(f"NOT bit-exact: {[(r['size'], r['resize']) for r in bad]}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
