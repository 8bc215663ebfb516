"""Rank jobs for tests/test_train_switch.py: real engines (DeepSpeed ZeRO, FSDP2, DTensor TP,
TP×DP, pipeline stages) switched into each other mid-training through the VPS.

A *recipe* names an engine and the world ranks it lives on: ``(kind, ranks, kwargs)``. Every
world rank builds every recipe (process groups are created collectively); ranks outside the
engine get ``None``.
"""
from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from rlhf_switch.engines import pipeline, torch_train
from rlhf_switch.engines.deepspeed_zero import build_zero_trainer
from rlhf_switch.engines.train_switch import switch_training
from rlhf_switch.routing import MoveError
from rlhf_switch.vps import MASTER, PARAM, llama_spec

from train_jobs_ds import BATCH, MODEL, OPTIM, batch, mismatches, read_back, tiny_llama

TORCH_BUILDERS = {"fsdp2": torch_train.build_fsdp2, "tp": torch_train.build_tp,
                  "tp_dp": torch_train.build_tp_dp, "pp": pipeline.build_pp,
                  "tp_pp": pipeline.build_tp_pp}


def build(recipe: tuple, seed: int, **model_overrides):
    kind, ranks, kwargs = recipe
    if kind == "zero":
        model, spec = tiny_llama(seed, **model_overrides)
        return build_zero_trainer(model, spec, kwargs["stage"], micro_batch=BATCH // len(ranks),
                                  ranks=ranks, optim=OPTIM, persistence_threshold=kwargs.get("persistence_threshold", 0),
                                  dtype=kwargs.get("dtype", "float32"))
    return TORCH_BUILDERS[kind]({**MODEL, **model_overrides}, seed, ranks, optim=OPTIM, **kwargs)


def _first(values):
    return next(v for v in values if v is not None)


def _everyone(obj) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _assembled(pieces) -> dict:
    """{(tensor, field): full tensor} from every world rank's ``read_back`` pieces."""
    spec = llama_spec(MODEL)
    full = {}
    for rank_pieces in _everyone(pieces):
        for (name, field), boxes in rank_pieces.items():
            for box, values in boxes:
                t = full.setdefault((name, field), torch.zeros(spec[name].shape, dtype=values.dtype))
                t[box.slices] = values
    return full


def full_state(trainer) -> dict:
    """{(tensor, field): full tensor} of an engine's training state, assembled on every world rank
    from each rank's fragments (the adapters' descriptions are checked against the engines' own
    gathers in test_deepspeed.py / test_torch_train.py)."""
    return _assembled(read_back(trainer.adapter.state()) if trainer is not None else {})


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))[:5]
    return max((a[k] - b[k]).abs().max().item() for k in a)


def switch_and_continue(src: tuple, dst: tuple, k: int) -> dict:
    """Train ``2k`` steps in ``src`` (the reference), then again: ``k`` steps in ``src``, switch
    to a freshly built ``dst`` (other seed), ``k`` more steps in ``dst``."""
    ref = build(src, seed=0)
    ref_losses = [ref.train_step(batch(s)) for s in range(2 * k)] if ref else None
    ref_final = full_state(ref)
    ref_losses = _first(_everyone(ref_losses))
    del ref

    a = build(src, seed=0)
    losses = [a.train_step(batch(s)) for s in range(k)] if a else None
    at_switch = full_state(a)
    b = build(dst, seed=1)
    if b is not None and getattr(b.adapter, "separate_weights", False):
        garbage_fill_bit16(b)  # a stale bit16 copy after the switch would show below
    full_bytes = 4 * llama_spec(MODEL).numel
    budget = full_bytes // 8  # far below one full copy: the move must stream
    report = switch_training(a.adapter if a else None, b.adapter if b else None, budget_bytes=budget)
    exact = mismatches(read_back(b.adapter.state()), at_switch) if b else []
    # the compute weights too (fp32 training: bit16 == master), read from the engine's own bit16
    # buffers — for DeepSpeed the copy the switch wrote in place of update_lp_params
    exact += mismatches(as_master(read_back(b.adapter.weights())), at_switch) if b else []
    step_after = b.adapter.scalars()["step"] if b else None
    lr_after = [g["lr"] for g in b.optimizer.param_groups] if b and hasattr(b, "optimizer") else None
    losses_b = [b.train_step(batch(s)) for s in range(k, 2 * k)] if b else None
    final = full_state(b)
    everyone = _everyone({"losses": losses, "losses_b": losses_b, "step": step_after})
    return {"ref_losses": ref_losses, "losses": _first(e["losses"] for e in everyone) +
            _first(e["losses_b"] for e in everyone), "exact_mismatches": exact,
            "steps_after": [e["step"] for e in everyone if e["step"] is not None],
            "lr_after": lr_after, "max_state_diff": _max_diff(final, ref_final),
            "bytes_received": report.move.bytes_received, "min_bytes": report.move.min_bytes_received,
            "peak_staging": report.move.peak_staging_bytes, "budget": budget, "full_bytes": full_bytes,
            "report": str(report)}


def garbage_fill_bit16(trainer) -> None:
    """Fill a fresh DeepSpeed engine's bit16 copies (ZeRO-1/2: the whole flat groups the module's
    parameters are views of; ZeRO-3: the partitions) with NaN: whatever the switch does not write
    — or a refresh it skips — stays visibly wrong."""
    for t in trainer.adapter.weights().tensors.values():
        t.fill_(float("nan"))


def as_master(claims: dict) -> dict:
    """Weights claims keyed as the master they must equal (fp32 training)."""
    assert all(f == PARAM for _, f in claims), sorted({f for _, f in claims})
    return {(name, MASTER): pieces for (name, _), pieces in claims.items()}


def _digest(trainer) -> str | None:
    if trainer is None:
        return None
    h = hashlib.sha256()
    for name, t in sorted(trainer.adapter.state().tensors.items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def refuse_other_model(src: tuple, dst: tuple) -> dict:
    """Switch into an engine built for another model: refused on every rank before anything
    moves; the source's bytes are untouched and it trains on."""
    a = build(src, seed=0)
    if a:
        a.train_step(batch(0))
    before = _digest(a)
    b = build(dst, seed=1, num_hidden_layers=MODEL["num_hidden_layers"] + 1)
    error = None
    try:
        switch_training(a.adapter if a else None, b.adapter if b else None)
    except MoveError as e:
        error = str(e)
    after = _digest(a)
    loss = a.train_step(batch(1)) if a else None
    # a DeepSpeed destination's moments, created unset for the switch to overwrite, are the
    # zeros torch would create once the switch is refused
    moments = [t for k, t in b.adapter.state().tensors.items() if not k.startswith(MASTER)] \
        if b is not None and hasattr(b.adapter, "state_unwritten") else []
    return {"error": error, "untouched": before == after, "loss": loss,
            "moments_zero": all(bool((t == 0).all()) for t in moments), "moments": len(moments)}


def master_copies_left_out(dtype: str) -> dict:
    """ZeRO-2 DP2 (ranks 0, 1) -> ZeRO-2 DP4 in ``dtype``, the destination's bit16 copies NaN
    first. fp32: the bit16 elements over each destination rank's own master partition are left
    out of the plan (``weights(master_copies=False)``) and copied from the written master; bf16:
    nothing is left out. Either way every bit16 element must come out equal to the source's."""
    src, dst = ("zero", [0, 1], {"stage": 2, "dtype": dtype}), ("zero", ALL_RANKS, {"stage": 2, "dtype": dtype})
    a = build(src, seed=0)
    if a:
        a.train_step(batch(0))
    state_at_switch = full_state(a)
    weights_at_switch = _assembled(read_back(a.adapter.weights()) if a else {})
    b = build(dst, seed=1)
    garbage_fill_bit16(b)
    described = sum(f.box.numel for f in b.adapter.weights(master_copies=False).fragments)
    report = switch_training(a.adapter if a else None, b.adapter)
    own = sum(f.box.numel for f in b.adapter.state().fragments if f.key.field == MASTER)
    exact = mismatches(read_back(b.adapter.state()), state_at_switch)
    exact += mismatches(read_back(b.adapter.weights()), weights_at_switch)
    return {"exact_mismatches": exact, "described": described, "own": own, "numel": llama_spec(MODEL).numel,
            "weights_are_master": b.adapter.weights_are_master(), "bit16_bytes": b.adapter.opt.bit16_groups_flat[0].element_size(),
            "bytes_received": report.move.bytes_received, "min_bytes": report.move.min_bytes_received}


ALL_RANKS = [0, 1, 2, 3]
