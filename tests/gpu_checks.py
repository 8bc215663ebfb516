"""The trainer and the rollout engine on one device, end to end, in one process: what a GPU runs.

    python tests/gpu_checks.py                   # cuda: nccl, bf16 compute over an fp32 master
    python tests/gpu_checks.py --device cpu      # the same code with gloo and float32 (test_device.py)

One rank (NCCL refuses two ranks on one GPU): FSDP2 over a world of one, built with the run's
``DeviceSpec``; a few optimizer steps; then the weight sync a run makes — a VPS move of the
trainer's master weights into the torch rollout engine's buffers in its compute dtype — checked
bit for bit against the trainer's parameters cast to that dtype, and the rollout engine's
log-probs against the trainer's own forward. ``--lora R``: the trainer trains rank-R peft
adapters on a frozen base; the engine first takes the base (its warm start), then each sync moves
the adapters alone (``engines.lora.WeightSync``). Needs torch and transformers (and peft for
``--lora``), no Ray, vLLM or DeepSpeed, so it runs on a bare GPU machine. Prints one JSON object;
exit 1 when a check fails.
"""
from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlhf_switch.device import resolve_device  # noqa: E402
from rlhf_switch.engines.torch_rollout import TorchRollout  # noqa: E402
from rlhf_switch.engines.lora import WeightSync, canonical_name, only  # noqa: E402
from rlhf_switch.engines.torch_train import build_fsdp2  # noqa: E402
from rlhf_switch.engines.train_state import gather_layouts  # noqa: E402
from rlhf_switch.routing import move  # noqa: E402
from rlhf_switch.vps import select  # noqa: E402
from rlhf_switch.vps.materialize import bits, materialize  # noqa: E402
from rlhf_switch.vps.spec import LoraSpec  # noqa: E402

# a small Llama: big enough for real kernels, small enough for any device
HF_CONFIG = dict(model_type="llama", vocab_size=4096, hidden_size=512, intermediate_size=1536,
                 num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                 max_position_embeddings=256, tie_word_embeddings=False, rms_norm_eps=1e-6,
                 pad_token_id=0, bos_token_id=1, eos_token_id=2)


def logprobs_of(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return logits.float().log_softmax(-1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _timed_move(src, dst, src_bufs, dst_bufs, cuda: bool):
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    report = move(src, dst, src_bufs, dst_bufs)
    if cuda:
        torch.cuda.synchronize()
    return report, time.perf_counter() - t0


def check(device: str, steps: int, dtype: str | None, lora_r: int = 0) -> dict:
    spec = resolve_device(device, torch.cuda.is_available(), dtype)
    if spec.is_cuda:
        torch.cuda.set_device(0)
    dist.init_process_group(spec.backend, rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{_free_port()}")
    try:
        lora = LoraSpec(lora_r, 2.0 * lora_r, ("q_proj", "k_proj", "v_proj", "o_proj")) if lora_r else None
        trainer = build_fsdp2(HF_CONFIG, 0, [0], device=spec, lora=lora)
        gen = torch.Generator().manual_seed(1)
        ids = torch.randint(3, HF_CONFIG["vocab_size"], (8, 64), generator=gen).to(spec.torch_device())
        losses = [trainer.train_step(ids) for _ in range(steps)]

        engine = TorchRollout.from_hf_config(trainer.spec, HF_CONFIG, tp=1, tp_rank=0, group=None,
                                             dtype=spec.compute_dtype, device=str(spec.torch_device()))
        model = trainer.spec
        dst = engine.layout(1)
        if lora is not None:  # the warm start: the frozen base, once
            base = [t.name for t in model.tensors if not model.is_adapter(t.name)]
            weights = only(trainer.adapter.weights(), base)
            (src,), _ = gather_layouts([(model.subset(base, "base"), weights)], ["train"])
            move(src, select(dst, base, "base"), weights.tensors, engine.buffers)
        sync = WeightSync.choose(model, "adapters" if lora else "auto", True, spec.compute_dtype)
        engine.set_apply_adapters(sync.mode == "adapters")
        weights = sync.source(trainer.adapter)
        (src,), _ = gather_layouts([(sync.spec_of(model), weights)], ["train"])
        dst = sync.destination(dst)
        report, sync_s = _timed_move(src, dst, weights.tensors, engine.buffers, spec.is_cuda)

        # the truth without the layouts' arithmetic: the trainer's parameters, cast as the engine computes
        truth = {canonical_name(n): (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu()
                 for n, p in trainer.module.named_parameters()}
        want = materialize(dst, 0, lambda k: truth[k.tensor].to(spec.torch_dtype()))
        exact = all(torch.equal(bits(want[b]), bits(engine.buffers[b].cpu())) for b in want)

        with torch.no_grad():
            ref = logprobs_of(trainer.module(input_ids=ids).logits, ids)
            got = logprobs_of(engine.forward(ids), ids)
        return {"device": torch.cuda.get_device_name(0) if spec.is_cuda else "cpu", "backend": spec.backend,
                "compute_dtype": spec.compute_dtype, "master_dtype": spec.master_dtype,
                "params": sum(t.numel() for t in truth.values()),
                "master_dtypes": sorted({str(t.dtype) for t in truth.values()}),
                "engine_dtypes": sorted({str(b.dtype) for b in engine.buffers.values()}),
                "losses": [round(float(x), 4) for x in losses], "sync": sync.mode,
                "sync_bytes": report.bytes_sent + report.bytes_local, "sync_seconds": sync_s,
                "sync_exact": exact, "logprob_max_diff": float((got - ref).abs().max()),
                "logprob_mean_diff": float((got - ref).abs().mean())}
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--dtype", default=None, help="compute dtype (default: the device's: bf16 on cuda)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--lora", type=int, default=0, metavar="R", help="train rank-R adapters and sync them alone")
    ap.add_argument("--tol", type=float, default=None,
                    help="the largest log-prob difference accepted (default 1e-4 in float32, 5e-2 in bf16)")
    a = ap.parse_args(argv)
    r = check(a.device, a.steps, a.dtype, a.lora)
    tol = a.tol if a.tol is not None else (1e-4 if r["compute_dtype"] == "float32" else 5e-2)
    r["tolerance"] = tol
    r["ok"] = bool(r["sync_exact"] and r["logprob_max_diff"] <= tol and r["losses"][-1] < r["losses"][0])
    print(json.dumps(r, indent=1))
    return 0 if r["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
