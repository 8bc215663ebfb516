"""Rank-side jobs of ``test_lora.py`` (module level, so they pickle by reference).

The truth each move is checked against comes without the adapters' layout arithmetic: the FSDP2
parameters' ``full_tensor()`` (every rank gathers every parameter, in the same order), and the
trainer's own forward (peft's unmerged ``W·x + s·B·(A·x)``) for the logits.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from rlhf_switch.engines.dtensor_adapter import is_dtensor
from rlhf_switch.engines.lora import WeightSync, canonical_name, only
from rlhf_switch.engines.optim import AdamWConfig
from rlhf_switch.engines.torch_rollout import TorchRollout
from rlhf_switch.engines.torch_train import build_fsdp2
from rlhf_switch.engines.train_state import gather_layouts
from rlhf_switch.routing import move
from rlhf_switch.vps import PARAM, select
from rlhf_switch.vps.materialize import bits, materialize
from rlhf_switch.vps.spec import LoraSpec


def ids_of(vocab: int, batch: int = 4, length: int = 12, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def trained_lora_fsdp2(cfg: dict, lora: tuple, steps: int = 2, seed: int = 0):
    """A LoRA FSDP2 engine over ranks 0, 1 after ``steps`` optimizer steps (B no longer zero)."""
    t = build_fsdp2(cfg, seed, [0, 1], optim=AdamWConfig(lr=1e-2), lora=LoraSpec(*lora))
    ids = ids_of(cfg["vocab_size"])
    for _ in range(steps):
        t.train_step(ids)
    return t


def whole(t) -> dict[str, torch.Tensor]:
    """Every parameter whole, by the spec's names (collective)."""
    return {canonical_name(n): (p.full_tensor() if is_dtensor(p) else p).detach().clone()
            for n, p in t.module.named_parameters()}


def describe_lora_fsdp2(cfg: dict, lora: tuple) -> dict:
    """What the engine describes: the global layouts of weights() and state(), which parameters
    the optimizer holds, and whether the frozen base stayed as built while the adapters moved."""
    from rlhf_switch.models import causal_lm

    t = trained_lora_fsdp2(cfg, lora)
    (weights, state), _ = gather_layouts([(t.spec, t.adapter.weights()), (t.spec, t.adapter.state())],
                                         ["weights", "state"])
    weights.validate()
    tensors = whole(t)
    start = dict(causal_lm(cfg, 0).named_parameters())
    base_kept = all(torch.equal(tensors[n], start[n].detach()) for n in start)
    held = {str(f.key) for r in range(2) for f in state.fragments(r)}
    return {"base_kept": base_kept, "keys": sorted(held),
            "adapters_moved": all(float(tensors[n].abs().max()) > 0 for n in t.spec.adapter_tensors if "lora_B" in n),
            "optimizer_params": sum(len(g["params"]) for g in t.optimizer.param_groups),
            "spec_digest": t.spec.digest}


def sync_into_rollout(cfg: dict, lora: tuple, tp: int, mode: str) -> dict:
    """The FSDP2 LoRA engine's weights into a TorchRollout of TP ``tp`` (``2 // tp`` replicas on
    the same two ranks): first the whole model (what the rollout engine's warm start holds: the
    frozen base, and the adapters' start), then one sync of ``mode`` (``adapters`` / ``merged``).
    Returns the bytes of that sync, whether the rollout engine's adapter buffers are the
    trainer's bit for bit, and the largest difference of its logits from the trainer's forward."""
    t = trained_lora_fsdp2(cfg, lora)
    spec, rank = t.spec, dist.get_rank()
    groups = [dist.new_group([r, r + 1]) for r in range(0, 2, 2)] if tp > 1 else [None, None]
    ro = TorchRollout.from_hf_config(spec, cfg, tp=tp, tp_rank=rank % tp, group=groups[rank // tp])
    everything = ro.layout(2 // tp)
    base = [x.name for x in spec.tensors if not spec.is_adapter(x.name)]
    weights = only(t.adapter.weights(), base)
    (src_all,), _ = gather_layouts([(spec.subset(base, "base"), weights)], ["train"])
    move(src_all, select(everything, base, "base"), weights.tensors, ro.buffers)  # the base, as the warm start has it
    sync = WeightSync.choose(spec, mode, True, "float32")
    ro.set_merge_adapters(sync.mode == "adapters")
    mine = sync.source(t.adapter)
    (src,), _ = gather_layouts([(sync.spec_of(spec), mine)], ["train"])
    report = move(src, sync.destination(everything), mine.tensors, ro.buffers)
    ro.weights_updated()
    truth = whole(t)
    adapters = select(everything, spec.adapter_tensors, "adapters")
    want = materialize(adapters, rank, lambda k: truth[k.tensor])
    exact = all(torch.equal(bits(want[b]), bits(ro.buffers[b])) for b in want) if sync.mode == "adapters" else None
    ids = ids_of(cfg["vocab_size"])
    with torch.no_grad():
        trainer = t.module(input_ids=ids).logits.float()
    logits = ro.forward(ids)
    return {"mode": sync.mode, "bytes_moved": report.bytes_sent + report.bytes_local, "bytes": dict(sync.bytes),
            "adapters_exact": exact, "logit_diff": float((logits - trainer).abs().max()),
            "logprob_diff": float((logits.log_softmax(-1) - trainer.log_softmax(-1)).abs().max())}


def save_for_peft(cfg: dict, lora: tuple, path: str) -> dict:
    """The trained engine saved through the VPS (engine -> FullState on rank 0 -> disk: the loop's
    checkpoint path) and the trainer's logits for the test process to compare peft's against."""
    from rlhf_switch.engines.full_state import FullState
    from rlhf_switch.engines.train_switch import switch_training

    t = trained_lora_fsdp2(cfg, lora)
    holder = FullState(t.spec, name="checkpoint") if dist.get_rank() == 0 else None
    switch_training(t.adapter, holder)
    if holder is not None:
        holder.save_dir(path, cfg)
    dist.barrier()
    with torch.no_grad():
        logits = t.module(input_ids=ids_of(cfg["vocab_size"])).logits.float()
    return {"logits": logits, "spec_digest": t.spec.digest}


def load_back(cfg: dict, lora: tuple, path: str) -> dict:
    """A fresh LoRA engine (other seed) loaded from the checkpoint through the VPS: its whole
    parameters and Adam moments, to compare with what was saved."""
    from rlhf_switch.engines.full_state import FullState
    from rlhf_switch.engines.train_switch import switch_training

    t = build_fsdp2(cfg, 7, [0, 1], optim=AdamWConfig(lr=1e-2), lora=LoraSpec(*lora))
    holder = FullState.load_dir(path, t.spec) if dist.get_rank() == 0 else None
    switch_training(holder, t.adapter)
    moments = {canonical_name(n): {k: (v.full_tensor() if is_dtensor(v) else v).clone()
                                   for k, v in t.optimizer.state[p].items() if k != "step"}
               for n, p in t.module.named_parameters() if p.requires_grad}
    return {"params": whole(t), "moments": moments, "step": t.adapter.scalars()["step"]}


__all__ = ["describe_lora_fsdp2", "sync_into_rollout", "save_for_peft", "load_back", "PARAM"]
