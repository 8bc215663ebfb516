"""What a strided piece costs between two processes of one host, by each way it could travel.

    python -m bench.cma_runs                       # 13 MB in runs of 768 B and 4 KiB
    python -m bench.cma_runs --run-bytes 768,2048,4096,8192 --mbytes 26

A piece whose runs are short on one side (a row-parallel column slice: FSDP rows of 3072 B cut
into TP4 slices of 768 B) can cross with ``process_vm_readv`` / ``process_vm_writev`` in four
ways. This measures each, on this machine, as the calling process's CPU time (median of 9):

  pack + read        the sender packs the runs into one block (``copy_``), the receiver reads
                     the block in one run — what read messages do for runs under READ_RUN_BYTES
  read, remote runs  the receiver reads the sender's runs in place into one block of its own
                     (``process_vm_readv``, one remote iovec per run: each pins its pages)
  read, local runs   one remote block read into runs of the caller's own
  write, local runs  the sender writes its own runs into one remote block (``process_vm_writev``)
  write, remote runs one local block written into the other process's runs

Every way's bytes are read back from where they landed and compared. "µs/run" is the time
beyond one contiguous copy of the same bytes, per run. The buffers are warm (the same ones every
repeat); inside a switch the sources are cold and packing costs more (13 MB of 768 B runs: ~1.3 ms
here, 3.4–3.6 ms of a rank's CPU in the 4-rank switch at 100M c). The schedule's
READ_RUN_BYTES (schedule.py) is where "read, remote runs" meets "pack + read"; the write ways
were measured as a way to skip the sender's packing and found dearer than packing.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time

import torch

from rlhf_switch.routing import same_host


def _holder(q, ready, rows: int, cols: int, width: int) -> None:
    """The other process: a row-major source, a block for runs to land in, a packed block."""
    src = torch.rand(rows, cols)
    block = torch.zeros(rows, width)
    packed = src[:, :width].contiguous()
    q.put((mp.current_process().pid, src.data_ptr(), block.data_ptr(), packed.data_ptr()))
    ready.wait()


def _cpu_ms(fn, repeats: int = 9) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return statistics.median(times) * 1e3


def measure(run_bytes: int, total_bytes: int) -> dict:
    width = run_bytes // 4
    cols = 4 * width  # the runs are a quarter of each row, as in a TP4 slice of full rows
    rows = max(1, total_bytes // run_bytes)
    ctx = mp.get_context("spawn")
    q, ready = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=_holder, args=(q, ready, rows, cols, width), daemon=True)
    proc.start()
    try:
        pid, their_src, their_block, their_packed = q.get(timeout=120)
        src, block, staged = torch.rand(rows, cols), torch.zeros(rows, width), torch.empty(rows, width)
        nbytes = rows * run_bytes
        step = torch.arange(rows, dtype=torch.int64) * cols * 4

        def runs(base):
            return torch.stack([base + step, torch.full((rows,), run_bytes, dtype=torch.int64)], 1)

        def one(base):
            return torch.tensor([[base, nbytes]], dtype=torch.int64)

        theirs = torch.empty(rows, width)  # the other process's bytes, read back to check each way

        def landed(what, got, base, strided):
            same_host.read_runs(pid, runs(base) if strided else one(base), one(theirs.data_ptr()))
            if not torch.equal(got, theirs):
                raise AssertionError(f"{what}: the bytes that landed differ from the ones sent")

        out = {"pack": _cpu_ms(lambda: staged.copy_(src[:, :width]))}
        out["read"] = _cpu_ms(lambda: same_host.read_runs(pid, one(their_packed), one(block.data_ptr())))
        landed("read", block, their_packed, False)
        block.zero_()
        out["read, remote runs"] = _cpu_ms(
            lambda: same_host.read_runs(pid, runs(their_src), one(block.data_ptr())))
        landed("read, remote runs", block, their_src, True)
        out["read, local runs"] = _cpu_ms(
            lambda: same_host.read_runs(pid, one(their_packed), runs(src.data_ptr())))
        landed("read, local runs", src[:, :width], their_packed, False)
        src[:, :width].uniform_()
        out["write, local runs"] = _cpu_ms(
            lambda: same_host.copy_runs("process_vm_writev", pid, one(their_block), runs(src.data_ptr())))
        landed("write, local runs", src[:, :width], their_block, False)
        staged.uniform_()
        out["write, remote runs"] = _cpu_ms(
            lambda: same_host.copy_runs("process_vm_writev", pid, runs(their_src), one(staged.data_ptr())))
        landed("write, remote runs", staged, their_src, True)
        out.update(runs=rows, nbytes=nbytes)
        return out
    finally:
        ready.set()
        proc.join(10)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run-bytes", default="768,4096", help="comma-separated run lengths (multiples of 4)")
    ap.add_argument("--mbytes", type=float, default=13.0, help="bytes per measurement, in MB")
    args = ap.parse_args(argv)
    if same_host._readv() is None:
        raise SystemExit("no process_vm_readv here (Linux only)")
    print(f"{'run':>7} {'runs':>7}  {'way':<20} {'CPU ms':>7} {'µs/run':>7}")
    for rb in (int(x) for x in args.run_bytes.split(",")):
        if rb % 4:
            raise SystemExit(f"--run-bytes {rb}: not a multiple of 4")
        m = measure(rb, int(args.mbytes * 1e6))
        base = m["read"]
        rows = [("pack + read", m["pack"] + m["read"])] + [
            (k, m[k]) for k in ("read, remote runs", "read, local runs", "write, local runs", "write, remote runs")]
        for way, ms in rows:
            print(f"{rb:>6}B {m['runs']:>7}  {way:<20} {ms:>7.2f} {(ms - base) * 1e3 / m['runs']:>7.2f}")
    return 0


if __name__ == "__main__":
    # the holder process must import ``_holder`` as ``bench.cma_runs._holder``, not ``__main__``'s
    import importlib
    raise SystemExit(importlib.import_module("bench.cma_runs").main())
