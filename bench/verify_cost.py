"""What ``move(..., verify=...)`` costs: one ~10M-parameter Llama (fp32) moved ZeRO-3 DP4 -> vLLM
TP4 on four gloo ranks, with verify off / sample(0.1) / full, median of 3 moves each, in the
same processes (the schedule planned once by a warm-up move).

    python -m bench.verify_cost [--repeats 3]

Prints a table (the slowest rank's move per repeat, median over repeats; the verify phase's
share) and the checksum's own rate on one rank. Nothing is asserted: times on a shared machine
vary.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))  # verify_jobs, rank_jobs (importable in ranks)

# ~9.9M parameters: embeddings and LM head 2 x 6000 x 384, 3 layers of GQA attention and MLP
SPEC = dict(hidden_size=384, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=4,
            intermediate_size=1024, vocab_size=6000, tie_word_embeddings=False)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    import verify_jobs
    from rlhf_switch.launch import LocalWorld
    from rlhf_switch.vps import ParallelConfig, build_layout, llama_spec

    spec = llama_spec(SPEC, name="llama-10m")
    params = sum(t.numel for t in spec.tensors)
    src = build_layout(spec, ParallelConfig(dp=4, dp_shard="zero3"))
    dst = build_layout(spec, ParallelConfig(tp=4, fuse_qkv=True, fuse_gate_up=True, vocab_divisible_by=64))
    modes = [("off", 0.1), ("sample", 0.1), ("full", 1.0)]
    with LocalWorld(4, timeout=600) as world:
        results = world.run(verify_jobs.time_modes, src, dst, modes, args.repeats, timeout=600)
        rate = world.run(verify_jobs.checksum_rate, 10_000_000)[0]
    print(f"{spec.name}: {params / 1e6:.2f}M params fp32, {src.name} -> {dst.name}, 4 gloo ranks, "
          f"median of {args.repeats}")
    print(f"{'verify':<14} {'move ms':>9} {'verify ms':>10} {'pieces checked':>15} {'vs off':>8}")
    base = None
    for name in results[0]:
        per_repeat = [max(r[name]["seconds"][i] for r in results) for i in range(args.repeats)]
        ver = [max(r[name]["verify_seconds"][i] for r in results) for i in range(args.repeats)]
        med = statistics.median(per_repeat)
        base = base or med
        checked = sum(r[name]["pieces_verified"] for r in results)
        print(f"{name:<14} {med * 1e3:9.1f} {statistics.median(ver) * 1e3:10.1f} {checked:15d} "
              f"{med / base:7.2f}x")
    print(f"checksum alone: 10M float32 (40 MB) in {rate * 1e3:.1f} ms on one rank "
          f"({40 / rate / 1e3:.2f} GB/s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
