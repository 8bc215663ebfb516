"""Rank-side jobs for ``test_torch_train.py`` (module level, so they pickle by reference).

The truth every adapter fragment is checked against is obtained without the adapter's box
arithmetic: DTensors' ``full_tensor()`` (parameters and AdamW moments), and for pipeline stages a
one-process model trained on the same batches with the same microbatch gradient accumulation.
"""
from __future__ import annotations

import hashlib
import logging

import torch
import torch.distributed as dist

from rlhf_switch.engines import pipeline, torch_train
from rlhf_switch.engines.dtensor_adapter import MOMENTS, is_dtensor
from rlhf_switch.engines.optim import AdamWConfig
from rlhf_switch.engines.train_state import gather_layouts
from rlhf_switch.routing import move
from rlhf_switch.families import stacked_experts
from rlhf_switch.models import model_spec
from rlhf_switch.vps import EXP_AVG, EXP_AVG_SQ, MASTER, PARAM, StateKey
from rlhf_switch.vps.materialize import fragment_view

BUILDERS = {"fsdp2": torch_train.build_fsdp2, "tp": torch_train.build_tp,
            "tp_dp": torch_train.build_tp_dp, "pp": pipeline.build_pp,
            "tp_pp": pipeline.build_tp_pp}


def build(cfg: dict, seed: int, plan: tuple) -> torch_train.TorchTrainer | None:
    kind, ranks, kwargs = plan
    return BUILDERS[kind](cfg, seed, ranks, **kwargs)


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def dtensor_truth(trainer) -> tuple[dict[StateKey, torch.Tensor], dict[str, str]]:
    """Global tensors of every field from ``full_tensor()`` (collective over the engine: every
    rank walks the parameters in the same order), and digests of the plain (replicated) ones —
    the driver checks that all ranks of the engine hold the same bits."""
    # gathering TP×DP's _StridedShard × Shard warns (two all-gathers) once per tensor: expected here
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    truth, plain = {}, {}
    for name, p in trainer.module.named_parameters():
        st = trainer.optimizer.state[p]
        tensors = {MASTER: p, EXP_AVG: st["exp_avg"], EXP_AVG_SQ: st["exp_avg_sq"]}
        for field, t in tensors.items():
            if is_dtensor(t):
                truth[StateKey(name, field)] = t.full_tensor().detach()
            else:
                truth[StateKey(name, field)] = t.detach()
                plain[f"{field}/{name}"] = _digest(t)
        truth[StateKey(name, PARAM)] = truth[StateKey(name, MASTER)]
        # a stacked MoE expert parameter: the spec's per-expert tensors are slices of it
        for tensor, e, lo, hi in stacked_experts(name, tuple(p.shape)) or ():
            for field in (PARAM, MASTER, EXP_AVG, EXP_AVG_SQ):
                truth[StateKey(tensor, field)] = truth[StateKey(name, field)][e, lo:hi]
    return truth, plain


def reference_truth(cfg: dict, seed: int, batches, microbatches: int) -> tuple[dict[StateKey, torch.Tensor], list]:
    """A one-process model trained like a GPipe schedule: per batch, backward of each
    microbatch's mean loss (gradients accumulate in order), gradients divided by the number of
    microbatches, one AdamW step. Its weights and moments, and its per-batch mean losses."""
    model = torch_train.hf_model(cfg, seed)
    opt = AdamWConfig().make(model.parameters())
    losses = []
    for ids in batches:
        parts = []
        for mb in ids.chunk(microbatches):
            loss = torch_train.causal_lm_loss(model, mb)
            loss.backward()
            parts.append(loss.detach())
        for p in model.parameters():
            p.grad.div_(microbatches)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(torch.stack(parts).mean()))
    truth = {}
    for name, p in model.named_parameters():
        truth[StateKey(name, PARAM)] = truth[StateKey(name, MASTER)] = p.detach()
        for field in MOMENTS:
            truth[StateKey(name, field)] = opt.state[p][field] if opt.state else torch.zeros_like(p)
    return truth, losses


def _readback_mismatches(trainer, truth: dict[StateKey, torch.Tensor]) -> tuple[list[str], int]:
    """Every fragment of ``weights()`` and ``state()``, read from its buffer through its own
    offset and strides, against the slice of the global tensor it claims to hold."""
    bad, n = [], 0
    for local in (trainer.adapter.weights(), trainer.adapter.state()):
        for f in local.fragments:
            got = fragment_view(local.tensors[f.buffer], f)
            want = truth[f.key][f.box.slices]
            n += 1
            if got.shape != want.shape or not torch.equal(got, want):
                bad.append(f"{f.key} {f.box}")
    return bad, n


def layout_truth(cfg: dict, plans: list[tuple], batches: list[torch.Tensor], seed: int = 0) -> dict:
    """Build engines on disjoint subsets of the world (``plans``: (builder, ranks, kwargs)),
    train each on ``batches``, gather the global layouts (every world rank), and check every
    fragment on this rank against independently obtained global tensors."""
    trainers = [build(cfg, seed, plan) for plan in plans]
    mine = [t for t in trainers if t is not None]
    assert len(mine) <= 1, "plans must put engines on disjoint ranks"
    trainer = mine[0] if mine else None
    if trainer is not None:
        trainer.adapter.prepare_state()  # so that a zero-step engine has moments to check
    losses = [trainer.train_step(b) for b in batches] if trainer else []

    locals_, names = [], []
    for t, (kind, _, _) in zip(trainers, plans):
        locals_ += [t.adapter.weights(), t.adapter.state()] if t else [None, None]
        names += [f"{kind}:weights", f"{kind}:state"]
    spec = model_spec(cfg)
    layouts, _ = gather_layouts([(spec, x) if x is not None else None for x in locals_], names)
    for layout in layouts:
        layout.validate()

    out = {"losses": losses, "layouts": layouts if dist.get_rank() == 0 else None, "name": None}
    if trainer is None:
        return out
    out["name"] = trainer.name
    kind = plans[trainers.index(trainer)][0]
    if kind == "pp":
        truth, ref_losses = reference_truth(cfg, seed, batches, microbatches=2)
        out["reference_losses"], plain = ref_losses, {}
    else:
        truth, plain = dtensor_truth(trainer)
    if kind == "tp_pp":  # TP rounds differently: how far the stage is from the one-process run
        ref, out["reference_losses"] = reference_truth(cfg, seed, batches, microbatches=2)
        out["reference_max_diff"] = max((truth[k] - ref[k]).abs().max().item() for k in truth)
        out["reference_tensors"] = sorted({k.tensor for k in truth})
    out["mismatches"], out["fragments"] = _readback_mismatches(trainer, truth)
    out["plain_digests"] = plain
    return out


def _full_state(trainer) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in trainer.module.named_parameters():
        out[f"master/{name}"] = p.full_tensor().detach()
        for field in MOMENTS:
            out[f"{field}/{name}"] = trainer.optimizer.state[p][field].full_tensor()
    return out


def move_fsdp2_to_tp_dp(cfg: dict, before: list[torch.Tensor], after: list[torch.Tensor],
                        warmup_steps: int = 4) -> dict:
    """FSDP2·DP4 trains ``before``; its state moves into a fresh TP2·DP2 (other seed); both then
    train ``after``. A second fresh TP2·DP2 that gets nothing is the control."""
    optim = AdamWConfig(warmup_steps=warmup_steps)
    world = list(range(dist.get_world_size()))
    src = torch_train.build_fsdp2(cfg, 1, world, optim=optim)
    dst = torch_train.build_tp_dp(cfg, 2, world, tp=2, optim=optim)
    control = torch_train.build_tp_dp(cfg, 3, world, tp=2, optim=optim)
    for b in before:
        src.train_step(b)
    dst.adapter.prepare_state()
    src_state, dst_state = src.adapter.state(), dst.adapter.state()
    (src_layout, dst_layout), scalars = gather_layouts(
        [(src.spec, src_state), (dst.spec, dst_state)], [src.name, dst.name], extra=src.adapter.scalars())
    report = move(src_layout, dst_layout, src_state.tensors, dst_state.tensors, budget_bytes=1 << 16)
    dst.adapter.state_written()
    dst.adapter.load_scalars(scalars[dist.get_rank()])  # the source rank here: same RNG stream

    a, b = _full_state(src), _full_state(dst)
    unequal = [k for k in a if not torch.equal(a[k], b[k])]
    lrs = [g["lr"] for g in src.optimizer.param_groups], [g["lr"] for g in dst.optimizer.param_groups]
    scalars_equal = (src.adapter.scalars()["step"] == dst.adapter.scalars()["step"]
                     and src.scheduler.state_dict() == dst.scheduler.state_dict() and lrs[0] == lrs[1])
    return {"unequal": unequal, "tensors": len(a), "scalars_equal": scalars_equal, "lr": lrs[1][0],
            "bytes_received": report.bytes_received, "min_bytes": report.min_bytes_received,
            "src_losses": [src.train_step(x) for x in after],
            "dst_losses": [dst.train_step(x) for x in after],
            "control_losses": [control.train_step(x) for x in after]}


def refusals(cfg: dict) -> list[str]:
    """Every rank asks for engines that cannot be built; each must refuse with ``ValueError``
    before creating a process group (a half-built mesh would leave ranks waiting), which the
    final all_reduce over the world shows."""
    world = list(range(dist.get_world_size()))
    attempts = [lambda: torch_train.build_tp_dp(cfg, 0, world, tp=4),        # 4 does not divide 2 KV heads
                lambda: pipeline.build_pp(cfg, 0, world[::-1][:2]),      # stages on descending ranks
                lambda: torch_train.build_fsdp2(cfg, 0, [world[-1], world[0]])]
    errors = []
    for attempt in attempts:
        try:
            attempt()
            errors.append("no error")
        except ValueError as e:
            errors.append(str(e))
    t = torch.ones(1)
    dist.all_reduce(t)
    return errors + [f"world ok: {int(t)}"]


def fsdp2_mixed_precision(cfg: dict) -> dict:
    """FSDP2 with a bf16-compute / fp32-master ``DeviceSpec`` on CPU: what the layers compute in,
    what the optimizer steps and the adapter describes, and that a step changes the master."""
    from rlhf_switch.device import DeviceSpec

    spec = DeviceSpec("cpu", "gloo", "bfloat16", "float32")
    t = torch_train.build_fsdp2(cfg, 0, list(range(dist.get_world_size())), device=spec)
    seen = {}
    up = t.module.model.layers[0].mlp.up_proj
    up.register_forward_hook(lambda m, args, out: seen.update(input=str(args[0].dtype), weight=str(m.weight.dtype)))
    before = {n: p.to_local().clone() for n, p in t.module.named_parameters()}
    ids = torch.randint(3, int(cfg["vocab_size"]), (2 * dist.get_world_size(), 8), generator=torch.Generator().manual_seed(1))
    loss = t.train_step(ids)
    return {"compute": seen, "loss": loss,
            "params": sorted({str(p.dtype) for p in t.module.parameters()}),
            "weights": sorted({b.dtype for b in t.adapter.weights().buffers.values()}),
            "moved": all(not torch.equal(before[n], p.to_local()) for n, p in t.module.named_parameters()
                         if p.to_local().numel())}
