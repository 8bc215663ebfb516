"""GPU switch bench (one device): train layout -> vLLM generation layout, on the GPU, unattended.

    python -m bench.gpu_switch                 # 1B and 8B Llama shapes, bf16, cuda:0
    python -m bench.gpu_switch --device cpu --sizes 0.05B   # the same code path on a CPU box

With one device there is one rank, so a colocated switch is the executor's local-copy path:
every destination piece is copied from the training buffers' view into the engine's view, on
the device, with no staging. The figure of merit is achieved bytes/s against the device's
memory bandwidth (each byte is read once and written once, so the roof is half the HBM
bandwidth for a copy). Beside it, in the same run and on the same buffers: one contiguous copy
of the same bytes (the device's floor for them) and gather-then-load, the field's way (each piece
first made a whole tensor of its own, then copied into the engine's buffers), both as ratios.
Multi-GPU paths (NCCL point-to-point, CUDA IPC between processes on one
device) need more than one rank and are not exercised here.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

from rlhf_switch.routing.executor import _run
from rlhf_switch.routing.comm import Comm
from rlhf_switch.routing.schedule import build_schedule
from rlhf_switch.vps import ParallelConfig, build_layout, llama_spec, plan_rank
from rlhf_switch.vps.layouts.vllm import vllm_layout
from rlhf_switch.vps.materialize import allocate, fragment_view

SHAPES = {  # Llama-3-style shapes by size
    "0.05B": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                  intermediate_size=1536, vocab_size=32000),
    "1B": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=8192, vocab_size=128256),
    "8B": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=14336, vocab_size=128256),
}
HBM_GBPS = {"H200": 4800.0, "H100": 3350.0, "A100": 2039.0}  # vendor peak memory bandwidth


def _pattern(frag, dtype: torch.dtype, device) -> torch.Tensor:
    """The global tensor's values on ``frag``'s box, computed from element coordinates on the
    device: ``(Σ coord_d · P_d + seed(key)) mod 251`` — exact in bf16/fp16/fp32, different for
    neighbours in every dimension, so a misplaced piece shows. Any rank (and the check) can
    rebuild any box without holding a global tensor (8B parameters would not fit on the host)."""
    seed = sum(map(ord, f"{frag.key.tensor}|{frag.key.field}")) % 251
    v = torch.full((), seed, dtype=torch.int64, device=device)
    for d, (lo, hi) in enumerate(zip(frag.box.lo, frag.box.hi)):
        prime = (7, 13, 31, 61, 127)[d % 5]
        shape = [1] * len(frag.box.shape)
        shape[d] = hi - lo
        v = v + (torch.arange(lo, hi, device=device) * prime).view(shape)
    return (v % 251).to(dtype)


def fill_pattern(layout, bufs, device, rank: int = 0) -> None:
    """Rank ``rank``'s fragments of ``layout`` in ``bufs`` set to ``_pattern``."""
    for f in layout.fragments(rank):
        fragment_view(bufs[f.buffer], f).copy_(_pattern(f, bufs[f.buffer].dtype, device))


def pattern_exact(layout, bufs, device, rank: int = 0) -> bool:
    """Every fragment of rank ``rank`` of the destination equals a direct construction of it, bit
    for bit."""
    return all(torch.equal(fragment_view(bufs[f.buffer], f), _pattern(f, bufs[f.buffer].dtype, device))
               for f in layout.fragments(rank))


def _views(t, src_bufs, dst_bufs):
    """Transfer ``t``'s source and destination views (its box, strided in each buffer)."""
    shape = tuple(h - l for l, h in zip(t.box.lo, t.box.hi))
    return (src_bufs[t.src_buffer].as_strided(shape, t.src_strides, t.src_offset),
            dst_bufs[t.dst_buffer].as_strided(shape, t.dst_strides, t.dst_offset))


def _gather_then_load(plan, src_bufs, dst_bufs) -> None:
    """The field's way on one device: every piece first made a whole tensor of its own (a gathered
    ``state_dict``), then loaded into the engine's buffers (``load_weights``): two copies a byte."""
    for t in plan.local:
        src, dst = _views(t, src_bufs, dst_bufs)
        dst.copy_(src.clone())


def timed_median(fn, device: str, repeats: int) -> float:
    """The median of ``repeats`` runs of ``fn`` after one that warms the allocator and kernels."""
    times = []
    for _ in range(repeats + 1):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times[1:])[len(times[1:]) // 2]


class _NoPeers(Comm):
    """A world of one: the schedule has no exchanges, so nothing is ever sent."""
    rank, size = 0, 1


def bench(size: str, dtype: str, device: str, repeats: int) -> dict:
    spec = llama_spec({**SHAPES[size], "torch_dtype": dtype}, name=f"llama-{size}")
    cases = {
        "ZeRO-1 flat -> vLLM TP1": build_layout(spec, ParallelConfig(dp=1, dp_shard="zero")),
        "per-tensor (FSDP DP1) -> vLLM TP1": build_layout(spec, ParallelConfig(dp=1, dp_shard="fsdp")),
    }
    dst = vllm_layout(spec, 1)
    out = {}
    for name, src in cases.items():
        plan = plan_rank(src, dst, 0)
        sched = build_schedule(plan, 64 << 20)
        src_bufs = allocate(src, 0, fill=None, device=device)
        fill_pattern(src, src_bufs, device)
        nbytes = plan.bytes_local
        dst_bufs = allocate(dst, 0, fill=float("nan"), device=device)
        gathered = timed_median(lambda: _gather_then_load(plan, src_bufs, dst_bufs), device, repeats)
        baseline_ok = pattern_exact(dst, dst_bufs, device)
        del dst_bufs
        dst_bufs = allocate(dst, 0, fill=float("nan"), device=device)
        med = timed_median(lambda: _run(sched, sched.batches, src_bufs, dst_bufs, _NoPeers(), None), device, repeats)
        ok = pattern_exact(dst, dst_bufs, device)
        del src_bufs, dst_bufs
        a, b = (torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(2))
        floor = timed_median(lambda: b.copy_(a), device, repeats)  # the same bytes as one contiguous copy
        del a, b
        out[name] = {"bytes": nbytes, "pieces": len(plan.local), "median_s": med, "GBps": nbytes / med / 1e9,
                     "exact": ok, "floor_s": floor, "gather_then_load_s": gathered,
                     "gather_then_load_exact": baseline_ok}
        print(f"  {size} {dtype} {name}: {nbytes / 1e9:.2f} GB in {med * 1e3:.1f} ms = "
              f"{nbytes / med / 1e9:.1f} GB/s ({len(plan.local)} pieces), bit-exact: {ok}; "
              f"{med / floor:.2f}x one contiguous copy of the bytes ({floor * 1e3:.1f} ms), "
              f"{gathered / med:.2f}x faster than gather-then-load ({gathered * 1e3:.1f} ms, exact: {baseline_ok})",
              flush=True)
    return {"params": spec.numel, "cases": out}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--sizes", default="1B,8B")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="bench/results/gpu_switch.json")
    args = ap.parse_args(argv)
    name = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu"
    peak = next((v for k, v in HBM_GBPS.items() if k in name), None)
    print(f"device: {name}" + (f" (peak memory bandwidth {peak:.0f} GB/s)" if peak else ""))
    results = {"device": name, "peak_GBps": peak, "sizes": {}}
    for size in args.sizes.split(","):
        results["sizes"][size] = bench(size, args.dtype, args.device, args.repeats)
        if peak:
            for case, r in results["sizes"][size]["cases"].items():
                # a copy reads and writes every byte: the roof is peak / 2
                print(f"    {case}: {r['GBps'] / (peak / 2):.0%} of the copy roof")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"wrote {args.out}")
    return 0 if all(r["exact"] and r["gather_then_load_exact"]
                    for sz in results["sizes"].values() for r in sz["cases"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
