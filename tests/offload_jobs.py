"""Rank jobs for tests/test_offload.py: a real engine's state parked in host memory and put back."""
from __future__ import annotations

import torch

from rlhf_switch.engines import torch_train
from rlhf_switch.engines.offload import HostOffload, live_state_bytes, offloaded_state
from rlhf_switch.vps import EXP_AVG, EXP_AVG_SQ

from train_jobs_ds import MODEL, OPTIM, batch, zero


def build(kind: str, stage: int):
    if kind == "zero":
        return zero(stage)
    return torch_train.build_fsdp2(MODEL, 0, [0, 1], optim=OPTIM)


def storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """Every byte of the storage behind ``t`` (padding no fragment describes included)."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage()).clone()


def optimizer_bytes(trainer, kind: str, mode: str) -> int:
    """What ``mode`` must move, counted from the torch optimizer the engine steps — not from the
    adapter: the tensors it keeps Adam state for (ZeRO: the fp32 master partitions — DeepSpeed's
    ZeRO-3 empties the param groups, the state keys remain; FSDP2: the parameters, which are the
    weights) and their Adam moments."""
    if kind == "zero":
        base = trainer.engine.optimizer.optimizer
    else:
        base = trainer.optimizer
    local = [p.to_local() if hasattr(p, "to_local") else p for p in base.state]
    moments = sum((s[f].to_local() if hasattr(s[f], "to_local") else s[f]).nbytes
                  for s in base.state.values() for f in (EXP_AVG, EXP_AVG_SQ))
    masters = sum(p.nbytes for p in base.state) if kind == "zero" else 0  # FSDP2: the master is the weights
    weights = 0
    if mode == "all":
        if kind == "zero":  # the bit16 copy: ZeRO-1/2 the whole flat groups, ZeRO-3 this rank's partition
            o = trainer.engine.optimizer
            flat = o.fp16_partitioned_groups_flat if trainer.adapter.stage == 3 else o.bit16_groups_flat
            weights = sum(t.nbytes for t in flat)
        else:
            weights = sum(p.nbytes for p in local)
    return masters + moments + weights


def round_trip(kind: str, stage: int, mode: str, steps: int = 2) -> dict:
    """Two identical engines take a step; one parks its state in host memory and takes it back;
    then both train on. Its storages must hold the same bytes as before the round trip (padding
    too), the memory must really have been handed back, and the two must go on bit-identically."""
    a, b = build(kind, stage), build(kind, stage)
    losses_a, losses_b = [a.train_step(batch(0))], [b.train_step(batch(0))]
    parked = offloaded_state(a.adapter, mode)
    before = {name: storage_bytes(t) for name, t in parked.tensors.items()}
    live_before = live_state_bytes(a.adapter)
    off = HostOffload(a.adapter, mode)
    out = off.offload()
    released_now = all(t.untyped_storage().nbytes() == 0 for t in parked.tensors.values())
    live_parked = live_state_bytes(a.adapter)
    back = off.reload()
    after = {name: storage_bytes(t) for name, t in offloaded_state(a.adapter, mode).tensors.items()}
    changed = sorted(n for n in before if not torch.equal(before[n], after[n]))
    # a second round trip reuses the plan and the host buffers
    again = (off.offload(), off.reload())
    for s in range(1, 1 + steps):
        losses_a.append(a.train_step(batch(s)))
        losses_b.append(b.train_step(batch(s)))
    final_a = {n: storage_bytes(t) for n, t in offloaded_state(a.adapter, "all").tensors.items()}
    final_b = {n: storage_bytes(t) for n, t in offloaded_state(b.adapter, "all").tensors.items()}
    return {"changed": changed, "released_now": released_now, "losses_a": losses_a, "losses_b": losses_b,
            "final_differs": sorted(n for n in final_a if not torch.equal(final_a[n], final_b[n])),
            "moved": [out.bytes_moved, back.bytes_moved, again[0].bytes_moved, again[1].bytes_moved],
            "optimizer_bytes": optimizer_bytes(a, kind, mode), "live": [live_before, live_parked],
            "released": out.bytes_released, "taken": back.bytes_released}
