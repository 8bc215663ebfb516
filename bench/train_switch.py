"""Training-layout switch with optimizer state: the VPS against DeepSpeed's universal checkpoint.

The case DeepSpeed's own tooling exists for: a ZeRO engine trained on DP2 (ranks 0, 1 of a
4-rank gloo world) continues on DP4. Side by side, in one run, on the same trained state:

  vps        ``switch_training``: fp32 master + Adam moments straight from the DP2 engine's
             partitions into the DP4 engine's, step / LR schedule / RNG beside them;
  universal  what DeepSpeed offers: ``save_checkpoint`` from DP2 → ``ds_to_universal`` (with
             ``--inject_missing_state``, needed for a plain HF model) → a DP4 engine built with
             ``load_universal`` loads it — to local disk and to /dev/shm.

Both destinations are compared with the source's state (full fp32 master and moments) and must be
bit-exact. Reported per size: median wall time of each method (≥ 3 repeats; the universal
checkpoint's three stages separately), the ratio, bytes moved by the VPS against its minimum,
and the VPS's peak staging memory. Engine construction is outside the timings on both sides.

    python -m bench.train_switch                 # 10M and 100M, 3 repeats
    python -m bench.train_switch --sizes 10M --repeats 5
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist

from bench.switch import SIZES
from rlhf_switch.engines.deepspeed_zero import build_zero_trainer
from rlhf_switch.engines.optim import AdamWConfig
from rlhf_switch.engines.torch_train import hf_model
from rlhf_switch.engines.train_switch import switch_training
from rlhf_switch.launch import LocalWorld
from rlhf_switch.vps import llama_spec

OPTIM = AdamWConfig(lr=1e-3, weight_decay=0.01, warmup_steps=2)
SRC_RANKS, BATCH, SEQ = [0, 1], 4, 16
RESULTS = os.path.join(os.path.dirname(__file__), "results")

_STATE: dict = {}  # per rank process: the trained source engine, kept between jobs


def _config(size: str) -> dict:
    return dict(SIZES[size], tie_word_embeddings=False, max_position_embeddings=64)


def _trainer(size: str, seed: int, ranks, universal: bool = False):
    cfg = _config(size)
    extra = {"checkpoint": {"load_universal": True}} if universal else None
    return build_zero_trainer(hf_model(cfg, seed), llama_spec(cfg), 2, micro_batch=BATCH // len(ranks),
                              ranks=ranks, optim=OPTIM, extra_config=extra)


def _full(trainer) -> dict:
    """Full fp32 master + Adam moments by DeepSpeed's own gather (collective over the engine),
    and the parameter's bit16 copy (ZeRO-2: whole on every rank; fp32 training: equal to the
    master) — what the next forward pass computes with."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out = {}
    for p, name in trainer.engine.param_names.items():
        out[name] = (safe_get_full_fp32_param(p), safe_get_full_optimizer_state(p, "exp_avg"),
                     safe_get_full_optimizer_state(p, "exp_avg_sq"), p.data)
    return out


def _digests(full: dict | None) -> dict | None:
    """sha256 of every full tensor: what ranks compare (gathering 100M-parameter states is not)."""
    if full is None:
        return None
    import hashlib

    return {name: [hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
                   for t in tensors] for name, tensors in full.items()}


def _destination(kind: str):
    """One DP4 destination engine per (size, method), reused by every repeat: DeepSpeed engines are
    not freed promptly, and a fresh 100M engine per repeat runs a 2-core, 24 GiB box out of memory."""
    if _STATE.get("dst_kind") != kind:
        _STATE.pop("dst", None)
        gc.collect()
        _STATE["dst"] = _trainer(_STATE["size"], 1, list(range(dist.get_world_size())),
                                 universal=kind == "universal")
        _STATE["dst_kind"] = kind
    return _STATE["dst"]


def prepare_source(size: str, steps: int = 2) -> dict:
    _STATE.clear()
    gc.collect()
    src = _trainer(size, 0, SRC_RANKS)
    if src is not None:
        g = torch.Generator().manual_seed(0)
        for _ in range(steps):
            src.train_step(torch.randint(0, _config(size)["vocab_size"], (BATCH, SEQ), generator=g))
    _STATE.update(src=src, truth=_digests(_full(src)) if src else None, size=size)
    return {"params": sum(p.numel() for p in src.engine.module.parameters()) if src else None}


def _timed(fn):
    dist.barrier()
    t0 = time.perf_counter()
    out = fn()
    dist.barrier()
    return time.perf_counter() - t0, out


def run_vps() -> dict:
    src, dst = _STATE["src"], _destination("vps")
    seconds, report = _timed(lambda: switch_training(src.adapter if src else None, dst.adapter))
    exact = _digests(_full(dst)) == _truth_everywhere()
    m = report.move
    # over every rank: bytes received against the minimum (summed), the largest staging and the
    # slowest rank's move alone (the rest of the switch is the layouts' exchange and DeepSpeed's
    # own bit16 refresh after the write)
    sums = torch.tensor([m.bytes_received, m.min_bytes_received], dtype=torch.int64)
    dist.all_reduce(sums)
    maxes = torch.tensor([m.peak_staging_bytes, m.seconds, m.messages, m.read_messages], dtype=torch.float64)
    dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
    return {"seconds": seconds, "exact": exact, "bytes_received": int(sums[0]), "min_bytes": int(sums[1]),
            "peak_staging": int(maxes[0]), "move_s": float(maxes[1]),
            "messages": int(maxes[2]), "read_messages": int(maxes[3])}  # the most on one rank


def _truth_everywhere() -> dict:
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, _STATE["truth"])
    return next(t for t in everyone if t is not None)


def run_universal(root: str) -> dict:
    """save (DP2) → ds_to_universal (rank 0) → load into a fresh DP4 engine."""
    from deepspeed.checkpoint import ds_to_universal

    src, dst = _STATE["src"], _destination("universal")
    rank = dist.get_rank()
    folder = os.path.join(root, f"ckpt-{os.getpid() if rank == 0 else 0}")
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, folder)
    folder = everyone[0]

    def save():
        if src is not None:
            with src.scope():
                src.engine.save_checkpoint(folder, tag="step")

    def convert():
        if rank == 0:
            args = SimpleNamespace(input_folder=os.path.join(folder, "step"),
                                   output_folder=os.path.join(folder, "step_universal"),
                                   num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False,
                                   strict=True, inject_missing_state=True)
            out = sys.stdout
            sys.stdout = open(os.devnull, "w")  # the converter prints per parameter
            try:
                ds_to_universal.main(args)
            finally:
                sys.stdout.close()
                sys.stdout = out

    def load():
        dst.engine.load_checkpoint(folder, tag="step_universal")

    t_save, _ = _timed(save)
    t_convert, _ = _timed(convert)
    t_load, _ = _timed(load)
    exact = _digests(_full(dst)) == _truth_everywhere()
    dist.barrier()
    if rank == 0:
        shutil.rmtree(folder, ignore_errors=True)
    return {"seconds": t_save + t_convert + t_load, "save": t_save, "convert": t_convert,
            "load": t_load, "exact": exact}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="+", default=["10M", "100M"], choices=list(SIZES))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args(argv)
    roots = {"disk": tempfile.mkdtemp(prefix="ds-universal-", dir=os.path.expanduser("~")),
             "shm": tempfile.mkdtemp(prefix="ds-universal-", dir="/dev/shm")}
    rows = []
    try:
        with LocalWorld(4, timeout=900) as world:
            for size in args.sizes:
                params = next(r["params"] for r in world.run(prepare_source, size) if r["params"])
                row = {"size": size, "params": params}
                for method in ("universal:shm", "universal:disk", "vps"):
                    runs = []
                    for i in range(args.repeats):
                        if method == "vps":
                            r = world.run(run_vps)[0]
                        else:
                            r = world.run(run_universal, roots[method.split(":")[1]])[0]
                        runs.append(r)
                        msgs = (f" (messages on the busiest rank: {r['messages']}, {r['read_messages']} of them "
                                f"read messages)" if "messages" in r else "")
                        print(f"{size} {method} #{i + 1}: {r['seconds']:.3f} s exact={r['exact']}{msgs}", flush=True)
                    row[method] = {k: statistics.median(x[k] for x in runs) if isinstance(runs[0][k], float)
                                   else runs[-1][k] for k in runs[0]}
                    row[method]["exact"] = all(x["exact"] for x in runs)
                rows.append(row)
    finally:
        for r in roots.values():
            shutil.rmtree(r, ignore_errors=True)
    print(format_table(rows))
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "train_switch.json")
    with open(path, "w") as f:
        json.dump({"rows": rows, "repeats": args.repeats, "when": time.strftime("%Y-%m-%d %H:%M:%S")}, f, indent=1)
    print(f"wrote {path}")
    _plot(rows, os.path.join(args.out, "train_switch.png"))
    return 0


def format_table(rows) -> str:
    lines = ["| model | VPS (of it the move) | universal ckpt /dev/shm (save + convert + load) | universal ckpt disk | "
             "VPS speed-up shm / disk | VPS bytes = min | VPS peak staging | bit-exact |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        v, s, d = r["vps"], r["universal:shm"], r["universal:disk"]
        lines.append(
            f"| {r['size']} ({r['params'] / 1e6:.1f}M) | {v['seconds']:.3f} s ({v['move_s']:.3f} s) | {s['seconds']:.2f} s "
            f"({s['save']:.2f} + {s['convert']:.2f} + {s['load']:.2f}) | {d['seconds']:.2f} s | "
            f"{s['seconds'] / v['seconds']:.1f}× / {d['seconds'] / v['seconds']:.1f}× | "
            f"{v['bytes_received'] == v['min_bytes']} | {v['peak_staging'] / 2**20:.1f} MiB | "
            f"{v['exact'] and s['exact'] and d['exact']} |")
    return "\n".join(lines)


def _plot(rows, path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 3.5))
    labels = [r["size"] for r in rows]
    x = range(len(rows))
    for i, (method, color) in enumerate((("vps", "tab:green"), ("universal:shm", "tab:orange"),
                                         ("universal:disk", "tab:red"))):
        ax.bar([j + (i - 1) * 0.27 for j in x], [r[method]["seconds"] for r in rows], 0.27, label=method,
               color=color)
    ax.set_xticks(list(x), labels)
    ax.set_yscale("log")
    ax.set_ylabel("seconds (log)")
    ax.set_title("ZeRO-2 DP2 → DP4 with Adam state: VPS vs DeepSpeed universal checkpoint")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
