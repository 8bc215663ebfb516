"""Phase-switch benchmark on CPU: VPS moves against what the field does, on the same buffers.

    python -m bench.switch --quick          # 10M,100M params, fp32 (tens of minutes on a 2-core machine; make bench runs it)
    python -m bench.switch                  # 10M,100M,300M params, fp32 and bf16 (hours there)
    python -m bench.switch --sizes 10M --dtypes bf16 --cases a,d --methods vps,dcp_shm --repeats 7
    python -m bench.switch --quick --methods vps,raw_p2p --paired --repeats 15   # a busy machine

Four gloo ranks (one thread each) on this machine run four transitions of a Llama-shaped model
built from a config (``llama_spec``; no HF model is instantiated: every global tensor is a cheap
deterministic function of (key, element index), evaluated only on the boxes a rank needs):

  a. ZeRO-3 DP4                      -> vLLM TP2 × 2 replicas            (weights)
  b. TP2×DP2 (FSDP, vocab pad 64)    -> vLLM TP4                         (weights)
  c. FSDP DP4                        -> vLLM TP4                         (weights)
  d. ZeRO-1 DP4 (param+master+Adam)  -> TP2×DP2 ZeRO-3 (all four fields) (train -> train)

and times, side by side on the same source/destination buffers:

  vps          ``routing.move`` under a staging budget (``--budget-mib``, default 64 MiB)
  full_gather  what verl / TRL / OpenRLHF do: every tensor (every field) is all-gathered so each
               rank holds it whole, then each rank cuts its destination fragments out of it.
               Each element is contributed once, by its lowest-rank holder; contributions are
               padded to equal size per tensor and gathered with ``all_gather_into_tensor``
               (straight from the shard buffer when the shard is contiguous there, as FSDP2 /
               DeepSpeed ZeRO-3 do), then reassembled unless the gathered buffer already *is*
               the tensor in row-major order. A tensor every rank already holds whole (ZeRO-1's
               params) is not gathered. For ZeRO-1/2's flat optimizer partitions most tensors
               have a single owner, so the padded gather receives (world-1)·numel per rank —
               the same order as DeepSpeed's own ``get_full_hp_param`` (a zero-filled full
               fp32 buffer per parameter, ``all_reduce``d over DP). Peak extra memory = the
               largest staging alive at once (gather output + pack buffer + full tensor).
  dcp_disk,    ``torch.distributed.checkpoint`` save from the source layout + load into the
  dcp_shm      destination layout, to a temp directory on local disk and to /dev/shm (see
               ``_BoxState`` for how arbitrary boxes are expressed; loads land in place).
  raw_p2p      the transport's limit: the per-peer byte counts of the VPS plan, one preallocated
               contiguous tensor per peer and direction, isend/irecv in the same round order,
               no planning, no packing — over the VPS's own transport (gloo, and same-host
               copies for messages of 1 MiB and more where ranks can read each other's memory;
               ``RLHF_SWITCH_SAME_HOST_COPY=0`` runs both on gloo alone). Also reported: the same exchange followed by the plan's
               same-rank bytes as a few big memcpys ("+ local copies"), a floor for any switch
               into separate destination buffers.

``--sources shared`` (the default): every rank's source buffers — and raw p2p's send buffer — are
in shared memory (``same_host.share``, untimed, at setup), as a weight channel's senders are from
its second sync on, so same-host messages are mapped reads for the VPS and the limit alike (one
copy by the receiver, no packing, no page pinning); ``--sources private`` keeps them in private
memory (``process_vm_readv``; the packing of short runs by the VPS's senders).

Every method's destination buffers are reset to NaN, filled once (untimed), and compared bit for
bit with ``materialize(dst, rank, tensor_of)`` on covered elements before the timed repeats
(raw_p2p checks its received bytes instead). A repeat is timed between barriers; its time is the
slowest rank's; the table shows the median over ``--repeats``.

Outputs: a table on stdout, ``<out>/switch.json`` and ``<out>/switch.png``.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
import zlib

import torch
import torch.distributed as dist

from bench import baselines
from rlhf_switch.routing import move, same_host
from rlhf_switch.vps import PARAM, ParallelConfig, build_layout, llama_spec, plan_transition, zero
from rlhf_switch.vps.layouts.vllm import vllm_layout
from rlhf_switch.vps.materialize import allocate, bits, coverage_masks, materialize, torch_dtype
from rlhf_switch.vps.space import row_major_strides
from rlhf_switch.vps.spec import itemsize

WORLD = 4
ADAM = ("param", "master", "exp_avg", "exp_avg_sq")

# Llama-shaped models (untied embeddings, GQA with 4 KV heads, head_dim 32/64): vLLM TP4 and
# Megatron TP2 divide every one of them.
SIZES = {
    "1M": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=384, vocab_size=1000),  # smoke tests only
    "10M": dict(hidden_size=256, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4,
                intermediate_size=1024, vocab_size=8000),
    "100M": dict(hidden_size=768, num_hidden_layers=8, num_attention_heads=12, num_key_value_heads=4,
                 intermediate_size=2048, vocab_size=32000),
    "300M": dict(hidden_size=1024, num_hidden_layers=21, num_attention_heads=16, num_key_value_heads=4,
                 intermediate_size=2816, vocab_size=32000),
}
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
CASES = {
    "a": "ZeRO-3 DP4 -> vLLM TP2x2",
    "b": "TP2xDP2 FSDP -> vLLM TP4",
    "c": "FSDP DP4 -> vLLM TP4",
    "d": "ZeRO-1 DP4 +Adam -> TP2xDP2 ZeRO-3 +Adam",
}
METHODS = ("vps", "full_gather", "dcp_disk", "dcp_shm", "raw_p2p")
LABELS = {"vps": "VPS move", "full_gather": "full gather", "dcp_disk": "DCP disk",
          "dcp_shm": "DCP /dev/shm", "raw_p2p": "raw p2p (limit)"}


def build_case(case: str, size: str, dtype: str):
    spec = llama_spec(dict(SIZES[size], tie_word_embeddings=False), dtype=DTYPES[dtype], name=f"llama-{size}")
    if case == "a":
        src = build_layout(spec, ParallelConfig(dp=4, dp_shard="zero3"))
        dst = vllm_layout(spec, 2, replicas=2)
    elif case == "b":
        src = build_layout(spec, ParallelConfig(tp=2, dp=2, dp_shard="fsdp", vocab_divisible_by=64))
        dst = vllm_layout(spec, 4)
    elif case == "c":
        src = build_layout(spec, ParallelConfig(dp=4, dp_shard="fsdp"))
        dst = vllm_layout(spec, 4)
    elif case == "d":
        src = zero(spec, 4, stage=1)  # fields param + master + exp_avg + exp_avg_sq
        dst = build_layout(spec, ParallelConfig(tp=2, dp=2, dp_shard="zero3", vocab_divisible_by=64),
                           fields=ADAM)
    else:
        raise ValueError(f"unknown case {case!r}; known: {', '.join(CASES)}")
    return spec, src, dst


# --- deterministic global tensors, evaluated per box ---------------------------------------------

class _LazyTensor:
    """A global tensor that exists only as a function of its element index: ``t[slices]`` builds
    just that box. fp32 values are ``0x30000000 + ((i·K + seed) mod 2^28)`` as bits (finite, and
    distinct for every element of a tensor below 2^28 elements, so any misplacement shows);
    16-bit values use 10 varying mantissa bits. Every rank computes the same values."""

    __slots__ = ("shape", "dtype", "seed")

    def __init__(self, shape, dtype: torch.dtype, seed: int):
        self.shape, self.dtype, self.seed = tuple(shape), dtype, seed

    def __getitem__(self, sl):
        if not isinstance(sl, tuple):
            sl = (sl,)
        idx = None
        for s, st, n in zip(sl, row_major_strides(self.shape), self.shape):
            lo, hi, _ = s.indices(n)
            a = torch.arange(lo, hi, dtype=torch.int64)
            if st != 1:
                a.mul_(st)
            idx = a if idx is None else idx.unsqueeze(-1) + a
        idx.mul_(0x9E3779B1).add_(self.seed)
        if self.dtype == torch.float32:
            return idx.bitwise_and_(0x0FFFFFFF).add_(0x30000000).to(torch.int32).view(torch.float32)
        if self.dtype in (torch.bfloat16, torch.float16):
            return idx.bitwise_and_(0x3FF).add_(0x3C00).to(torch.int16).view(self.dtype)
        raise TypeError(f"no synthetic fill for {self.dtype}")


def tensor_of_for(spec):
    def tensor_of(key):
        dt = spec[key.tensor].dtype if key.field == PARAM else "float32"  # state fields are fp32
        seed = zlib.crc32(f"{key.tensor}|{key.field}".encode())
        return _LazyTensor(spec[key.tensor].shape, torch_dtype(dt), seed)
    return tensor_of


# --- rank side: state kept between jobs ------------------------------------------------------------

_S: dict = {}


def _rank_setup(case: str, size: str, dtype: str, budget: int, keep_reference: bool, shared: bool = True) -> dict:
    """Build the layouts, fill the source buffers, allocate the destination ones; with
    ``keep_reference`` also build ``materialize(dst, rank, tensor_of)`` and its coverage masks
    once and keep them (the driver asks for that only when the memory allows it)."""
    _S.clear()
    gc.collect()
    rank = dist.get_rank()
    spec, src, dst = build_case(case, size, dtype)
    t0 = time.perf_counter()
    tensor_of = tensor_of_for(spec)
    src_bufs = materialize(src, rank, tensor_of)
    if shared:  # where a same-host peer can map them (routing/same_host.py, mapped reads)
        same_host.share(src_bufs.values())
    dst_bufs = allocate(dst, rank, fill=0)  # touched now, so no method pays its first-touch faults
    fill_s = time.perf_counter() - t0
    _S.update(spec=spec, src=src, dst=dst, src_bufs=src_bufs, dst_bufs=dst_bufs, tensor_of=tensor_of,
              budget=budget, case=case, shared=shared)
    if keep_reference:
        _S["reference"] = (materialize(dst, rank, tensor_of), coverage_masks(dst, rank))
    dist.barrier()
    return {"fill_s": fill_s, "reference_s": time.perf_counter() - t0 - fill_s,
            "src_bytes": sum(t.numel() * t.element_size() for t in src_bufs.values()),
            "dst_bytes": sum(t.numel() * t.element_size() for t in dst_bufs.values())}


def _rank_teardown() -> None:
    _S.clear()
    same_host.forget_mappings()  # the peers' freed sources: not held until the next case's first move
    _trim()
    dist.barrier()


def _reset_dst() -> None:
    for t in _S["dst_bufs"].values():
        t.fill_(float("nan"))


def _verify_dst() -> tuple[bool, list[str]]:
    """Bit-exact comparison of the destination buffers with ``materialize(dst, rank, tensor_of)``
    on covered elements. Without a kept reference, ranks take turns building it, so only one
    reference copy is alive at a time (300M + Adam would not fit four)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if "reference" in _S:
        bad = _compare(*_S["reference"])
        dist.barrier()
        return not bad, bad
    bad: list[str] = []
    for r in range(world):
        if r == rank:
            bad = _compare(materialize(_S["dst"], rank, _S["tensor_of"]), coverage_masks(_S["dst"], rank))
            _trim()
        dist.barrier()
    return not bad, bad


def _compare(expected: dict, masks: dict) -> list[str]:
    bad, step = [], 1 << 24
    for name, exp in expected.items():
        got, e, m = bits(_S["dst_bufs"][name]), bits(exp), masks[name]
        for i in range(0, got.numel(), step):
            if not bool(((got[i:i + step] == e[i:i + step]) | ~m[i:i + step]).all()):
                bad.append(name)
                break
    return bad


# --- method 1: VPS ---------------------------------------------------------------------------------

def _vps_prepare(S: dict) -> dict:
    return {}


def _vps_run(ctx: dict):
    return move(_S["src"], _S["dst"], _S["src_bufs"], _S["dst_bufs"], budget_bytes=_S["budget"])


# --- one method, on every rank ---------------------------------------------------------------------

def _trim() -> None:
    """Give freed heap back to the OS (glibc keeps freed chunks below its mmap threshold), so the
    resident set reflects live memory between stages."""
    gc.collect()
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _rss() -> tuple[int, int] | None:
    """(VmRSS, VmHWM) of this process in bytes, or None where /proc says nothing."""
    try:
        vals = {}
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    vals[line.split(":")[0]] = int(line.split()[1]) * 1024
        return vals["VmRSS"], vals["VmHWM"]
    except (OSError, KeyError, ValueError):
        return None


def _reset_hwm() -> int | None:
    """Reset the peak-RSS mark to the current RSS (Linux >= 4.0: write 5 to clear_refs);
    return the current RSS, or None if the mark cannot be reset here."""
    _trim()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    r = _rss()
    return r[0] if r else None


def _rss_growth(base: int | None) -> int | None:
    r = _rss()
    return None if base is None or r is None else max(0, r[1] - base)


def _rank_method(method: str, repeats: int, root: str | None = None, paired: bool = False) -> dict:
    """One method on this rank: prepare, one verified run, then ``repeats`` timed runs. Besides
    the times, it measures the resident-set high-water mark above the resident set at the start
    (prepared buffers, staging, DCP's transient copies, heap growth), the verification excluded.
    ``paired`` (VPS only): after each timed VPS repeat, one raw p2p exchange + local copies on the
    same buffers (untimed for the VPS row), so the two are compared under the same load."""
    prep = {"vps": _vps_prepare, "full_gather": baselines.full_gather_prepare, "raw_p2p": baselines.raw_prepare}
    run = {"vps": _vps_run, "full_gather": baselines.full_gather_run, "raw_p2p": baselines.raw_run,
           "dcp_disk": baselines.dcp_run, "dcp_shm": baselines.dcp_run}[method]
    base = _reset_hwm()
    t0 = time.perf_counter()
    ctx = baselines.dcp_prepare(_S, root) if method.startswith("dcp") else prep[method](_S)
    prepare_s = time.perf_counter() - t0
    out: dict = {"prepare_s": prepare_s}

    # warm-up / verification run (untimed for the table; its time is reported as "first_s")
    if method != "raw_p2p":
        _reset_dst()
    dist.barrier()
    t0 = time.perf_counter()
    first = run(ctx)  # raw_p2p: the exchange alone, so its received bytes can be checked
    out["first_s"] = time.perf_counter() - t0
    dist.barrier()
    if method.startswith("dcp"):
        out.update(baselines.dcp_cleanup(ctx))
    growth = [_rss_growth(base)]
    ok, bad = baselines.raw_verify(ctx) if method == "raw_p2p" else _verify_dst()
    reset_ok = _reset_hwm() is not None  # the check's own reference copy must not count
    out["exact"], out["mismatch"] = ok, bad[:5]
    if method == "vps":
        out["report"] = {k: getattr(first, k) for k in (
            "bytes_sent", "bytes_received", "bytes_local", "min_bytes_received", "messages",
            "peak_staging_bytes", "planned_peak_staging_bytes", "budget_bytes", "seconds")}
    elif isinstance(first, dict):
        out["first"] = first
    if method == "raw_p2p":
        out["alloc_bytes"] = ctx["alloc"]
        out["local_bytes"] = ctx["local_bytes"]
        ctx["copy_local"] = True  # timed repeats: exchange, then the local copies

    raw = None
    if paired and method == "vps":  # after the check: the raw receives are carved from the destination
        raw = dict(baselines.raw_prepare(_S), copy_local=True)
        out["paired_raw"] = []
    times, extras = [], []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        r = run(ctx)
        times.append(r["exchange_s"] if method == "raw_p2p" else time.perf_counter() - t0)
        dist.barrier()
        if raw is not None:
            x = baselines.raw_run(raw)
            out["paired_raw"].append((x["exchange_s"], x["with_local_s"]))
            dist.barrier()
        if method.startswith("dcp"):
            baselines.dcp_cleanup(ctx)
        if method == "vps":
            r = {"seconds": r.seconds, "peak_staging_bytes": r.peak_staging_bytes}
        extras.append(r)
    out["times"], out["extras"] = times, extras
    if reset_ok:  # high-water mark of the timed repeats, over the same starting RSS
        growth.append(_rss_growth(base))
    out["rss_growth_bytes"] = None if None in growth else max(growth)
    del ctx
    _trim()
    return out


# --- driver ----------------------------------------------------------------------------------------

def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62


def _median_of_max(per_rank_times: list[list[float]]) -> tuple[float, list[float]]:
    walls = [max(ts) for ts in zip(*per_rank_times)]
    return statistics.median(walls), walls


def _fmt_mb(n: float) -> str:
    return f"{n / 1e6:.1f}"


def run_bench(args) -> dict:
    from rlhf_switch.launch import LocalWorld

    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for s in sizes:
        if s not in SIZES:
            raise SystemExit(f"unknown size {s!r}; known: {', '.join(SIZES)}")
    for d in dtypes:
        if d not in DTYPES:
            raise SystemExit(f"unknown dtype {d!r}; known: {', '.join(DTYPES)}")
    for m in methods:
        if m not in METHODS:
            raise SystemExit(f"unknown method {m!r}; known: {', '.join(METHODS)}")
    if "vps" not in methods:
        methods.insert(0, "vps")  # ratios are to VPS
    if "raw_p2p" in methods:  # run the limit right after VPS
        methods.remove("raw_p2p")
        methods.insert(1, "raw_p2p")
    global _GIT
    _GIT = _git()  # the library version this run imports
    budget = int(args.budget_mib * (1 << 20))
    results: list = []
    t_start = time.perf_counter()
    print(f"starting {WORLD} gloo ranks (1 thread each) on {os.cpu_count()} cores…", flush=True)
    disk_root = tempfile.mkdtemp(prefix="bench-switch-")
    shm_root = tempfile.mkdtemp(prefix="bench-switch-", dir="/dev/shm") if os.path.isdir("/dev/shm") else None

    def partial(status: str) -> dict:
        return {"meta": dict(_meta(args, budget, time.perf_counter() - t_start), status=status),
                "results": results}

    def cleanup() -> None:
        shutil.rmtree(disk_root, ignore_errors=True)
        if shm_root:
            shutil.rmtree(shm_root, ignore_errors=True)

    world = LocalWorld(WORLD, timeout=args.timeout)
    stop = threading.Event()

    def watchdog() -> None:
        # LocalWorld notices a dead rank only when a job times out (--timeout, an hour by
        # default); a rank killed by the OOM killer should end the run now, keeping what is done
        while not stop.wait(2.0):
            dead = [(r, p.exitcode) for r, p in enumerate(world._procs) if not p.is_alive()]
            if dead and not stop.is_set():
                print(f"\nABORT: rank(s) {dead} (rank, exit code) died — -9 is SIGKILL, e.g. the OOM "
                      f"killer; writing what finished and stopping", flush=True)
                _write_json(args.out, partial(f"aborted: ranks {dead} died"))
                for p in world._procs:
                    if p.is_alive():
                        p.kill()
                cleanup()
                os._exit(3)

    threading.Thread(target=watchdog, daemon=True).start()
    try:
        print(f"ranks up in {time.perf_counter() - t_start:.1f} s", flush=True)
        for size in sizes:
            for dtype in dtypes:
                for case in cases:
                    _bench_one(world, size, dtype, case, methods, budget, args,
                               {"dcp_disk": disk_root, "dcp_shm": shm_root}, results)
                    _write_json(args.out, partial("running"))  # a crash keeps the finished cases
    finally:
        stop.set()
        world.close()
        cleanup()
    return partial("complete")


def _write_json(out_dir: str, data: dict) -> str:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "switch.json")
    with open(path + ".tmp", "w") as f:
        json.dump(data, f, indent=1, default=str)
    os.replace(path + ".tmp", path)
    return path


def _bench_one(world, size, dtype, case, methods, budget, args, roots, results: list) -> dict:
    """One (size, dtype, case): every method on the same buffers. The entry is appended to
    ``results`` before the first method runs and filled as methods finish, so an aborted run
    still reports the methods it completed."""
    tag = f"[{size} {dtype} {case}]"
    t_case = time.perf_counter()
    spec, src, dst = build_case(case, size, dtype)
    t0 = time.perf_counter()
    plan = plan_transition(src, dst)
    plan_s = time.perf_counter() - t0
    print(f"{tag} {src.name} -> {dst.name}: {spec.numel / 1e6:.1f}M params; plan {plan_s:.2f} s: "
          f"{_fmt_mb(plan.bytes_moved)} MB across ranks (min {_fmt_mb(plan.min_bytes)} MB), "
          f"{_fmt_mb(plan.bytes_local)} MB local", flush=True)
    src_total = sum(b.numel * itemsize(b.dtype) for r in range(WORLD) for b in src.buffers(r).values())
    dst_total = sum(b.numel * itemsize(b.dtype) for r in range(WORLD) for b in dst.buffers(r).values())
    dst_elems = sum(b.numel for r in range(WORLD) for b in dst.buffers(r).values())
    ckpt_bytes = sum(r.box.numel * itemsize(src.buffers(r.holders[0][0])[r.holders[0][1].buffer].dtype)
                     for k in src.all_keys() for r in src.regions(k))
    # keep a reference copy (and masks) per rank only if everything, /dev/shm checkpoint included,
    # still leaves 3 GiB free; otherwise ranks rebuild it one at a time for each check
    keep_ref = (src_total + 2 * dst_total + dst_elems + ckpt_bytes + (3 << 30)) < _mem_available()
    load_before = os.getloadavg()
    setup = world.run(_rank_setup, case, size, dtype, budget, keep_ref, args.sources == "shared",
                      timeout=args.timeout)
    src_mib = max(s["src_bytes"] for s in setup) / 2**20
    dst_mib = max(s["dst_bytes"] for s in setup) / 2**20
    print(f"{tag} buffers filled in {max(s['fill_s'] for s in setup):.1f} s "
          f"(src {src_mib:.0f} MiB, dst {dst_mib:.0f} MiB per rank max)", flush=True)
    entry = {"size": size, "dtype": dtype, "case": case, "transition": f"{src.name} -> {dst.name}",
             "description": CASES[case], "params": spec.numel, "tensors": len(spec.tensors),
             "plan": {"seconds": plan_s, "bytes_moved": plan.bytes_moved, "min_bytes": plan.min_bytes,
                      "bytes_local": plan.bytes_local, "pieces": len(plan.transfers)},
             "setup": setup, "reference_kept": keep_ref, "methods": {}, "complete": False}
    results.append(entry)
    for m in methods:
        t_m = time.perf_counter()
        root = roots.get(m)
        if m.startswith("dcp"):
            if root is None:
                entry["methods"][m] = {"skipped": "no such directory"}
                print(f"{tag} {LABELS[m]}: skipped (no directory)", flush=True)
                continue
            # the checkpoint, plus per rank what DCP holds transiently (a clone of each item
            # before torch.save; a whole saved chunk per read) and heap growth, plus headroom:
            # 300M + Adam (4.5 GiB in /dev/shm) was OOM-killed with 6.6 GiB available
            need = ckpt_bytes + WORLD * (512 << 20) + (3 << 29)
            avail = _mem_available() if m == "dcp_shm" else shutil.disk_usage(root).free
            if avail < need:
                what = "MemAvailable" if m == "dcp_shm" else "free disk"
                why = f"{what} {avail / 2**30:.1f} GiB < {need / 2**30:.1f} GiB needed"
                entry["methods"][m] = {"skipped": why}
                print(f"{tag} {LABELS[m]}: skipped ({why})", flush=True)
                continue
        print(f"{tag} {LABELS[m]}: running 1 + {args.repeats}…", flush=True)
        res = world.run(_rank_method, m, args.repeats, root, paired=args.paired, timeout=args.timeout)
        med, walls = _median_of_max([r["times"] for r in res])
        rec = {"median_s": med, "walls_s": walls, "first_s": max(r["first_s"] for r in res),
               "prepare_s": max(r["prepare_s"] for r in res), "exact": all(r["exact"] for r in res),
               "mismatch": {i: r["mismatch"] for i, r in enumerate(res) if r["mismatch"]},
               "stage_wall_s": time.perf_counter() - t_m}
        rec["eff_GBps"] = plan.min_bytes / med / 1e9 if med > 0 else None
        growth = [r.get("rss_growth_bytes") for r in res]
        rec["rss_growth_bytes"] = None if None in growth else max(growth)
        if m == "vps":
            reps = [r["report"] for r in res]
            rec["bytes_moved"] = sum(r["bytes_received"] for r in reps)
            rec["min_bytes_received"] = sum(r["min_bytes_received"] for r in reps)
            rec["peak_extra_bytes"] = max(r["peak_staging_bytes"] for r in reps)
            rec["planned_peak_extra_bytes"] = max(r["planned_peak_staging_bytes"] for r in reps)
            rec["messages"] = sum(r["messages"] for r in reps)
            rec["budget_bytes"] = budget
            if args.paired:  # raw p2p (+ local copies) right after each VPS repeat, same buffers
                rec["paired_raw_median_s"], _ = _median_of_max([[x[0] for x in r["paired_raw"]] for r in res])
                rec["paired_raw_local_median_s"], _ = _median_of_max([[x[1] for x in r["paired_raw"]] for r in res])
                vps_walls = rec["walls_s"]
                raw_walls = [max(x[1] for x in xs) for xs in zip(*[r["paired_raw"] for r in res])]
                rec["paired_fraction_of_raw_local"] = statistics.median(
                    rl / v for rl, v in zip(raw_walls, vps_walls))
            rec["move_internal_median_s"] = statistics.median(
                max(ex[i]["seconds"] for ex in (r["extras"] for r in res)) for i in range(args.repeats))
        elif m == "full_gather":
            rec["peak_extra_bytes"] = max(max(x["peak_staging_bytes"] for x in r["extras"] + [r["first"]])
                                          for r in res)
            rec["bytes_moved"] = sum(r["first"]["bytes_received"] for r in res)
        elif m.startswith("dcp"):
            rec["save_median_s"] = statistics.median(max(ex[i]["save_s"] for ex in (r["extras"] for r in res))
                                                     for i in range(args.repeats))
            rec["load_median_s"] = statistics.median(max(ex[i]["load_s"] for ex in (r["extras"] for r in res))
                                                     for i in range(args.repeats))
            rec["copy_s"] = 0.0
            rec["loaded_in_place"] = True
            rec["checkpoint_bytes"] = res[0].get("checkpoint_bytes", 0)
            rec["path"] = root
        elif m == "raw_p2p":
            rec["bytes_moved"] = plan.bytes_moved
            rec["peak_extra_bytes"] = max(r["alloc_bytes"] for r in res)
            rec["local_bytes"] = sum(r["local_bytes"] for r in res)
            rec["with_local_median_s"], rec["with_local_walls_s"] = _median_of_max(
                [[x["with_local_s"] for x in r["extras"]] for r in res])
        entry["methods"][m] = rec
        extra = ""
        if "peak_extra_bytes" in rec:
            extra += f", peak extra {rec['peak_extra_bytes'] / 2**20:.1f} MiB/rank"
        if rec["rss_growth_bytes"] is not None:
            extra += f", RSS high-water +{rec['rss_growth_bytes'] / 2**20:.0f} MiB/rank"
        if m.startswith("dcp"):
            extra += (f" (save {rec['save_median_s']:.3f} s + load {rec['load_median_s']:.3f} s, "
                      f"{rec['checkpoint_bytes'] / 2**20:.0f} MiB)")
        print(f"{tag} {LABELS[m]}: median {med:.3f} s, first {rec['first_s']:.3f} s{extra}, "
              f"{'bit-exact' if rec['exact'] else 'MISMATCH ' + str(rec['mismatch'])} "
              f"[{rec['stage_wall_s']:.1f} s]", flush=True)
    vps = entry["methods"]["vps"]["median_s"]
    raw = entry["methods"].get("raw_p2p", {}).get("median_s")
    for m, rec in entry["methods"].items():
        if "median_s" not in rec:
            continue
        rec["ratio_to_vps"] = rec["median_s"] / vps if vps else None
        rec["fraction_of_raw"] = raw / rec["median_s"] if raw and rec["median_s"] else None
    world.run(_rank_teardown, timeout=args.timeout)
    entry["case_wall_s"] = time.perf_counter() - t_case
    entry["loadavg_1min"] = {"start": load_before[0], "end": os.getloadavg()[0]}
    entry["complete"] = True
    print(f"{tag} done in {entry['case_wall_s']:.1f} s", flush=True)
    return entry


def _git() -> dict:
    """The library version measured: HEAD and whether rlhf_switch/ differs from it."""
    import subprocess
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "rlhf_switch"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return {"head": head, "rlhf_switch_modified": bool(dirty)}
    except (OSError, subprocess.SubprocessError):
        return {}


_GIT = None


def _meta(args, budget: int, total: float) -> dict:
    global _GIT
    if _GIT is None:
        _GIT = _git()
    return {"git": _GIT,"command": " ".join([os.path.basename(sys.executable), "-m", "bench.switch"] + sys.argv[1:]),
            "world": WORLD, "backend": "gloo", "threads_per_rank": 1, "cpu_count": os.cpu_count(),
            "machine": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "budget_bytes": budget, "repeats": args.repeats, "wall_s": total,
            "sources": args.sources,
            "loadavg_at_end": os.getloadavg(),
            "timing": "per repeat: barrier, time on every rank, barrier; repeat time = slowest rank; "
                      "median over repeats (a first untimed run verifies correctness)",
            "eff_GBps": "plan minimum bytes (what any correct switch must move across ranks) / median time",
            "models": {s: dict(SIZES[s]) for s in SIZES}}


def format_table(data: dict) -> str:
    lines = []
    head = (f"{'size':>5} {'dtype':>5} {'case':>4}  {'method':<16}{'median s':>9} {'x VPS':>7} "
            f"{'eff GB/s':>9} {'% raw':>6} {'wire MB':>9} {'peak extra MiB/rank':>20} {'RSS+ MiB':>8}  "
            f"{'exact':>5}")
    lines.append(head)
    lines.append("-" * len(head))
    for e in data["results"]:
        p = e["plan"]
        moved = e["methods"].get("vps", {}).get("bytes_moved")
        lines.append(f"{e['size']:>5} {e['dtype']:>5} {e['case']:>4}  {e['transition']}  "
                     f"({e['params'] / 1e6:.1f}M params; VPS moved "
                     f"{_fmt_mb(moved) if moved is not None else '?'} MB, plan minimum "
                     f"{_fmt_mb(p['min_bytes'])} MB, local {_fmt_mb(p['bytes_local'])} MB)"
                     + ("" if e.get("complete", True) else "  [incomplete: the run stopped here]"))
        for m in METHODS:
            rec = e["methods"].get(m)
            if rec is None:
                continue
            if "skipped" in rec:
                lines.append(f"{'':>17}  {LABELS[m]:<16}skipped: {rec['skipped']}")
                continue
            wire = rec.get("bytes_moved")
            if m.startswith("dcp"):
                wire = 2 * rec.get("checkpoint_bytes", 0)  # written + read back
            peak = rec.get("peak_extra_bytes")
            peak_s = f"{peak / 2**20:.1f}" if peak is not None else "n/a"
            if m == "vps":
                peak_s += f" (budget {rec['budget_bytes'] / 2**20:.0f})"
            frac = rec.get("fraction_of_raw")
            rss = rec.get("rss_growth_bytes")
            rss_s = f"{rss / 2**20:.0f}" if rss is not None else "n/a"
            ratio = rec.get("ratio_to_vps")
            lines.append(f"{'':>17}  {LABELS[m]:<16}{rec['median_s']:>9.3f} "
                         f"{(f'{ratio:.2f}x' if ratio else 'n/a'):>7} "
                         f"{rec['eff_GBps']:>9.3f} {(f'{100 * frac:.0f}%' if frac else 'n/a'):>6} "
                         f"{(_fmt_mb(wire) if wire is not None else 'n/a'):>9} {peak_s:>20} {rss_s:>8}  "
                         f"{'yes' if rec['exact'] else 'NO':>5}")
            if m == "vps" and "paired_raw_local_median_s" in rec:
                lines.append(f"{'':>17}  {'  paired floor':<16}{rec['paired_raw_local_median_s']:>9.3f} "
                             f"(raw p2p {rec['paired_raw_median_s']:.3f} + local copies, run after each VPS "
                             f"repeat): VPS at {100 * rec['paired_fraction_of_raw_local']:.0f} % of it "
                             f"(median of per-repeat ratios)")
            if m == "raw_p2p" and "with_local_median_s" in rec:
                wl = rec["with_local_median_s"]
                vps = e["methods"]["vps"]["median_s"]  # VPS always runs first
                lines.append(f"{'':>17}  {'  + local copies':<16}{wl:>9.3f} {wl / vps:>6.2f}x "
                             f"{e['plan']['min_bytes'] / wl / 1e9:>9.3f} {'':>6} "
                             f"{_fmt_mb(rec['local_bytes']) + ' loc':>9}")
    lines.append("")
    lines.append("median s: median over repeats of the slowest rank's time; x VPS: median / VPS median; "
                 "eff GB/s: plan-minimum bytes / median; % raw: raw p2p median / median; wire MB: bytes "
                 "received across ranks (DCP: checkpoint written + read); DCP loads in place (no extra copy);\n"
                 "peak extra: measured staging (VPS: MoveReport.peak_staging_bytes; full gather: gather "
                 "output + pack + full tensor; raw: its buffers); RSS+: the rank's resident-set high-water "
                 "mark above its resident set before the method (verification excluded), max over ranks;\n"
                 "'+ local copies': the raw exchange followed by the plan's same-rank bytes as big contiguous "
                 "memcpys (MB loc), a floor for any switch into separate destination buffers.")
    return "\n".join(lines)


def plot(data: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = data["results"]
    sizes = list(dict.fromkeys(e["size"] for e in rows))
    methods = [m for m in METHODS if any("median_s" in e["methods"].get(m, {}) for e in rows)]
    colors = {"vps": "tab:green", "full_gather": "tab:orange", "dcp_disk": "tab:red",
              "dcp_shm": "tab:purple", "raw_p2p": "tab:gray"}
    width = 0.8 / max(len(methods), 1)
    ncol = max(sum(1 for e in rows if e["size"] == s) for s in sizes)
    fig, axes = plt.subplots(len(sizes), 1, figsize=(max(10, 1.4 * ncol + 2), 3.6 * len(sizes) + 1.4),
                             squeeze=False)
    for ax, size in zip(axes[:, 0], sizes):
        sub = [e for e in rows if e["size"] == size]
        for i, m in enumerate(methods):
            xs, ys = [], []
            for j, e in enumerate(sub):
                rec = e["methods"].get(m, {})
                if "median_s" in rec:
                    xs.append(j + (i - (len(methods) - 1) / 2) * width)
                    ys.append(rec["median_s"])
            ax.bar(xs, ys, width, label=LABELS[m], color=colors.get(m))
        for j, e in enumerate(sub):  # speed-up of VPS over the best baseline, above the group
            v = e["methods"].get("vps", {}).get("median_s")
            if not v:
                continue
            base = [e["methods"][m]["median_s"] for m in ("full_gather", "dcp_disk", "dcp_shm")
                    if "median_s" in e["methods"].get(m, {})]
            if base:
                top = max(r.get("median_s", 0) for r in e["methods"].values())
                ax.text(j, top * 1.15, f"{min(base) / v:.1f}x", ha="center", fontsize=7)
        ax.set_yscale("log")
        ax.set_xticks(range(len(sub)))
        ax.set_xticklabels([f"{e['dtype']} {e['case']}" for e in sub], fontsize=8)
        ax.set_ylabel(f"{size} params: seconds")
        ax.grid(axis="y", which="both", alpha=0.3)
        ax.margins(y=0.15)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, ncol=len(methods), loc="upper center", bbox_to_anchor=(0.5, 0.935))
    meta = data["meta"]
    fig.suptitle(f"Phase switch on CPU ({meta['world']} gloo ranks, {meta['cpu_count']} cores, torch "
                 f"{meta['torch']}, VPS budget {meta['budget_bytes'] / 2**20:.0f} MiB)\n"
                 f"median of the slowest rank, log scale; number = best baseline / VPS", fontsize=9, y=0.995)
    fig.text(0.01, 0.005, "   ".join(f"{k}: {v}" for k, v in CASES.items()), fontsize=7)
    fig.tight_layout(rect=(0, 0.02, 1, 0.9))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="10M,100M,300M", help=f"comma list of {', '.join(SIZES)}")
    ap.add_argument("--dtypes", default="fp32,bf16", help="comma list of fp32, bf16, fp16")
    ap.add_argument("--cases", default="a,b,c,d")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--budget-mib", type=float, default=64.0, help="VPS staging budget per rank")
    ap.add_argument("--quick", action="store_true", help="10M,100M, fp32 only")
    ap.add_argument("--paired", action="store_true",
                    help="after each timed VPS repeat, run raw p2p + local copies on the same buffers "
                         "(the VPS-to-floor ratio under the same load: for a busy machine; the VPS's "
                         "RSS figure then includes the raw exchange's buffers)")
    ap.add_argument("--sources", choices=("shared", "private"), default="shared",
                    help="source buffers (and raw p2p's send buffer) in shared memory, as a weight channel "
                         "shares its senders' after the first sync (mapped reads), or private (process_vm_readv)")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per rank job / collective")
    ap.add_argument("--replot", metavar="JSON", help="only redraw the table and PNG of a saved run")
    args = ap.parse_args(argv)
    if args.replot:
        with open(args.replot) as f:
            data = json.load(f)
        print(format_table(data))
        png = os.path.splitext(args.replot)[0] + ".png"
        plot(data, png)
        print(f"\nwrote {png}")
        return 0
    if args.quick:
        args.sizes, args.dtypes = "10M,100M", "fp32"
    if args.repeats < 1:
        raise SystemExit("--repeats must be >= 1")

    import signal
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the clean-up of temp dirs
    data = run_bench(args)
    table = format_table(data)
    print()
    print(table)
    data["table"] = table
    jpath = _write_json(args.out, data)
    ppath = os.path.join(args.out, "switch.png")
    try:
        plot(data, ppath)
    except ImportError as e:
        ppath = f"(no plot: {e}; pip install matplotlib)"
    print(f"\nwrote {jpath} and {ppath}; total {data['meta']['wall_s']:.1f} s")
    ok = all(rec.get("exact", True) for e in data["results"] for rec in e["methods"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    # the ranks must import these functions as ``bench.switch.*``, not ``__main__.*``
    import importlib
    raise SystemExit(importlib.import_module("bench.switch").main())
