"""Demo: shard a tiny Llama in one layout on 4 CPU processes, switch it to another, check it.

    make run                                    # ZeRO-3 DP4 -> Megatron TP2·PP2 -> TP4 (fused)
    python -m recipes.switch_demo --src fsdp --dst tp2xdp2 --budget-mib 1

A real Hugging Face checkpoint (safetensors) is written from ``LlamaForCausalLM(config)``; each
rank reads only its own fragments of it into the source layout, the VPS moves the state into the
destination layout over gloo, and each rank compares its buffers bit for bit with the destination
layout built directly from the checkpoint.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
import torch.distributed as dist

from rlhf_switch.launch import LocalWorld
from rlhf_switch.routing import move
from rlhf_switch.vps import ParallelConfig, build_layout, llama_spec, plan_transition
from rlhf_switch.vps.materialize import allocate, bits, materialize

PAD = dict(vocab_divisible_by=64)
LAYOUTS = {
    "replicated": ParallelConfig(dp=4),
    "zero1": ParallelConfig(dp=4, dp_shard="zero"),
    "zero3": ParallelConfig(dp=4, dp_shard="zero3"),
    "fsdp": ParallelConfig(dp=4, dp_shard="fsdp"),
    "tp2xdp2": ParallelConfig(tp=2, dp=2, dp_shard="fsdp", **PAD),
    "tp2xpp2": ParallelConfig(tp=2, pp=2, fuse_qkv=True, fuse_gate_up=True, **PAD),
    "pp2": ParallelConfig(pp=2, dp=2),
    "tp4": ParallelConfig(tp=4, fuse_qkv=True, fuse_gate_up=True, **PAD),
}


def _rank_switch(path: str, src, dst, budget: int) -> dict:
    from safetensors import safe_open

    rank = dist.get_rank()
    with safe_open(path, "pt") as ckpt:
        def tensor_of(key):  # a lazy slice: each rank reads only the boxes it holds
            return ckpt.get_slice(key.tensor)
        src_bufs = materialize(src, rank, tensor_of)
        expected = materialize(dst, rank, tensor_of)
    dst_bufs = allocate(dst, rank)
    dist.barrier()
    t0 = time.perf_counter()
    report = move(src, dst, src_bufs, dst_bufs, budget_bytes=budget)
    dist.barrier()
    wall = time.perf_counter() - t0
    exact = all(torch.equal(bits(dst_bufs[n]), bits(expected[n])) for n in expected)
    return {"report": report, "wall": wall, "exact": exact}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", default="zero3", choices=LAYOUTS)
    ap.add_argument("--dst", default="tp2xpp2", choices=LAYOUTS)
    ap.add_argument("--then", default="tp4", choices=list(LAYOUTS) + ["none"])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--budget-mib", type=float, default=4.0)
    args = ap.parse_args(argv)

    from transformers import LlamaConfig, LlamaForCausalLM
    from safetensors.torch import save_file

    cfg = LlamaConfig(hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=8,
                      num_key_value_heads=4, intermediate_size=args.hidden * 3, vocab_size=1000,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    spec = llama_spec(cfg, name="tiny-llama")
    print(f"model: tiny Llama, {spec.numel / 1e6:.2f}M parameters, {len(spec.tensors)} tensors, fp32")
    budget = int(args.budget_mib * (1 << 20))
    hops = [args.src, args.dst] + ([] if args.then == "none" else [args.then])
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.safetensors")
        save_file({n: p.detach().contiguous() for n, p in model.named_parameters()}, path)
        print("starting 4 ranks (gloo)…", flush=True)
        t0 = time.perf_counter()
        with LocalWorld(4) as world:
            print(f"ranks up in {time.perf_counter() - t0:.1f} s")
            ok = True
            for a, b in zip(hops, hops[1:]):
                src, dst = build_layout(spec, LAYOUTS[a]), build_layout(spec, LAYOUTS[b])
                plan = plan_transition(src, dst)
                results = world.run(_rank_switch, path, src, dst, budget)
                print(f"\n{src.name} -> {dst.name}")
                print(f"  plan: {len(plan.transfers)} pieces; {plan.bytes_moved / 1e6:.3f} MB across ranks "
                      f"(minimum {plan.min_bytes / 1e6:.3f} MB), {plan.bytes_local / 1e6:.3f} MB local copies")
                print(f"  {'rank':>4} {'sent MB':>9} {'recv MB':>9} {'local MB':>9} {'msgs':>5} "
                      f"{'staging KiB':>11} {'ms':>7}  exact")
                for r, res in enumerate(results):
                    rep = res["report"]
                    print(f"  {r:>4} {rep.bytes_sent / 1e6:9.3f} {rep.bytes_received / 1e6:9.3f} "
                          f"{rep.bytes_local / 1e6:9.3f} {rep.messages:5d} {rep.peak_staging_bytes / 1024:11.1f} "
                          f"{rep.seconds * 1e3:7.1f}  {'yes' if res['exact'] else 'NO'}")
                exact = all(res["exact"] for res in results)
                wall = max(res["wall"] for res in results)
                print(f"  switch took {wall * 1e3:.1f} ms; bytes moved == minimum: "
                      f"{sum(r['report'].bytes_received for r in results) == plan.min_bytes}; "
                      f"bit-exact on every rank: {exact}")
                ok &= exact
    print("\nall switches bit-exact" if ok else "\nMISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
