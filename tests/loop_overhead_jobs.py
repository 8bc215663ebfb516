"""Rank-side jobs for ``test_loop_overhead.py`` (module level, so they pickle by reference)."""
from __future__ import annotations

import subprocess

import torch
import torch.distributed as dist

from rlhf_switch.engines.base import ModuleEngine, TrainingContext, training_engine
from rlhf_switch.engines.optim import AdamWConfig
from rlhf_switch.engines.torch_train import clip_grad_norm

OPTIM = AdamWConfig(lr=1e-3, max_grad_norm=1.0)


def _engine(cfg: dict, plain: bool):
    """An FSDP2 engine of ``cfg`` (seed 0, both ranks). ``plain``: the paths before the overhead
    work — FSDP2's own per-layer gathers (ModuleEngine's outputs/train_step) and torch's AdamW
    on the DTensors."""
    ctx = TrainingContext(cfg, 0, tuple(range(dist.get_world_size())), OPTIM, micro_batch=2)
    eng = training_engine("fsdp2").build(None, ctx)
    if plain:
        t = eng.trainer
        t.optimizer = OPTIM.make(t.module.parameters())
        t.scheduler = OPTIM.scheduler(t.optimizer)
    return eng


def _loss(lp: torch.Tensor, s: slice):
    loss = -lp.mean()
    return loss, {"loss": float(loss.detach())}


def _state(eng) -> dict[str, torch.Tensor]:
    out = {}
    for n, p in eng.module.named_parameters():
        out[n] = p.detach().to_local().clone()
        st = eng.trainer.optimizer.state[p]
        for k in ("exp_avg", "exp_avg_sq"):
            out[f"{n}.{k}"] = st[k].to_local().clone()
    return out


def gathered_once_and_local_adam_equal_the_plain_paths(cfg: dict, batches: list[torch.Tensor]) -> dict:
    """The same seeded model trained twice on the same batches — once through the engine as it
    is (each FSDP2 unit gathered once per call, AdamW on the local shards), once through the
    plain paths — and compared bit for bit: outputs, losses, gradient norms, weights and Adam
    moments. Also: after a call every parameter is sharded again and FSDP2's reshard flags are
    what they were."""
    new, plain = _engine(cfg, False), _engine(cfg, True)
    flags = lambda e: [(g.post_forward_mesh_info is None, g.reshard_after_backward)  # noqa: E731
                       for m in e.module.modules() if hasattr(m, "_get_fsdp_state")
                       for g in m._get_fsdp_state()._fsdp_param_groups]
    ModuleEngine.outputs(plain, batches[0])  # FSDP2's lazy init on both before the flags are read
    new.outputs(batches[0])
    before = flags(new)
    got = {"outputs": [], "steps": [], "flags_kept": True, "sharded_after": True}
    for ids in batches:
        a, b = new.outputs(ids), ModuleEngine.outputs(plain, ids)
        got["outputs"].append(bool(torch.equal(a, b)))
        sa = new.train_step(ids, 2, _loss)
        sb = ModuleEngine.train_step(plain, ids, 2, _loss)
        got["steps"].append((sa["grad_norm"] == sb["grad_norm"], sa["stats"] == sb["stats"], sa["grad_norm"]))
        got["flags_kept"] &= flags(new) == before
        got["sharded_after"] &= all(hasattr(p, "to_local") for p in new.module.parameters())
    sa, sb = _state(new), _state(plain)
    got["state_equal"] = sorted(k for k in sa if not torch.equal(sa[k], sb[k]))
    return got


def one_unit_equals_per_layer_units(cfg: dict, batches: list[torch.Tensor]) -> dict:
    """The FSDP2 engine as built for a small causal LM (one FSDP2 unit, the root) against the
    same seeded model sharded per decoder layer and the root (``build_fsdp2(per_layer=True)``),
    trained on the same batches: outputs, losses, gradient norms, weights and Adam moments bit for
    bit, and the same VPS description of the weights (each parameter sharded alike)."""
    from rlhf_switch.engines.torch_engines import FSDP2Engine, _fsdp_units
    from rlhf_switch.engines.torch_train import build_fsdp2

    ranks = tuple(range(dist.get_world_size()))
    ctx = TrainingContext(cfg, 0, ranks, OPTIM, micro_batch=2)
    one = training_engine("fsdp2").build(None, ctx)
    layers = FSDP2Engine(build_fsdp2(cfg, 0, ranks, optim=OPTIM, per_layer=True), ctx)
    got = {"units": (len(_fsdp_units(one.module)), len(_fsdp_units(layers.module))), "outputs": [], "steps": [],
           "same_layout": [tuple(e.adapter.weights().fragments) for e in (one, layers)]}
    got["same_layout"] = got["same_layout"][0] == got["same_layout"][1]
    for ids in batches:
        got["outputs"].append(bool(torch.equal(one.outputs(ids), layers.outputs(ids))))
        sa, sb = one.train_step(ids, 2, _loss), layers.train_step(ids, 2, _loss)
        got["steps"].append((sa["grad_norm"] == sb["grad_norm"], sa["stats"] == sb["stats"], sa["grad_norm"]))
    sa, sb = _state(one), _state(layers)
    got["state_equal"] = sorted(k for k in sa if not torch.equal(sa[k], sb[k]))
    return got


def batched_norm_equals_per_tensor_norm(cfg: dict, ids: torch.Tensor) -> tuple[float, float]:
    """``clip_grad_norm`` (one all-reduce per mesh dim) against the per-tensor DTensor norms it
    replaced, on the same FSDP2 gradients."""
    eng = _engine(cfg, True)
    ModuleEngine._per_token(eng, eng._forward(ids), ids).mean().backward()
    grads = [p.grad for p in eng.module.parameters() if p.grad is not None]
    per_tensor = float(torch.linalg.vector_norm(torch.stack(
        [torch.linalg.vector_norm(g, 2).full_tensor().double() for g in grads]), 2))
    return clip_grad_norm(eng.module.parameters(), float("inf")), per_tensor


# --- ZeRO-3 with persistent parameters (train.persistence_threshold) ----------------------------

def _zero3(cfg: dict, seed: int, threshold: int):
    """A ZeRO-3 DP2 engine of ``cfg`` built as the loop builds it, from a config layout."""
    from rlhf_switch.rl.config import TrainerLayout

    ctx = TrainingContext(cfg, seed, tuple(range(dist.get_world_size())), OPTIM, micro_batch=2)
    layout = TrainerLayout(engine="deepspeed", zero_stage=3, dp=2, persistence_threshold=threshold)
    return training_engine("deepspeed").build(layout, ctx)


def zero3_persistent_equals_partitioned(cfg: dict, batches: list[torch.Tensor], threshold: int) -> dict:
    """The same seeded model trained on the same batches by ZeRO-3 with every parameter fetched
    per submodule (threshold 0) and with parameters below ``threshold`` kept whole (all of them:
    no submodule fetches either): outputs, gradient norms, losses and the partitions compared
    bit for bit."""
    plain, kept = _zero3(cfg, 0, 0), _zero3(cfg, 0, threshold)
    got = {"persistent": [len(e.engine.optimizer.persistent_parameters) for e in (plain, kept)],
           # DeepSpeed's per-submodule forward fetch/release hooks (deepspeed_zero
           # _submodule_fetches_dropped_when_whole: gone when every parameter is persistent)
           "fetch_hooks": [len(e.engine.optimizer.parameter_offload.forward_hooks) for e in (plain, kept)],
           "params": sum(1 for _ in kept.module.parameters()), "outputs": [], "steps": []}
    spawned, popen = [], subprocess.Popen.__init__

    def counted(self, *args, **kwargs):  # DeepSpeed's CPU device_count ran numactl per backward
        spawned.append(args[0] if args else kwargs.get("args"))
        popen(self, *args, **kwargs)

    subprocess.Popen.__init__ = counted
    try:
        for ids in batches:
            got["outputs"].append(bool(torch.equal(plain.outputs(ids), kept.outputs(ids))))
            sa, sb = plain.train_step(ids, 2, _loss), kept.train_step(ids, 2, _loss)
            got["steps"].append((sa["grad_norm"] == sb["grad_norm"], sa["stats"] == sb["stats"]))
    finally:
        subprocess.Popen.__init__ = popen
    got["subprocesses"] = spawned  # compat.cache_deepspeed_cpu_device_count: none
    wa, wb = plain.adapter.weights(), kept.adapter.weights()
    got["weights_equal"] = all(torch.equal(wa.tensors[k], wb.tensors[k]) for k in wa.tensors)
    return got


def warm_start_into_persistent_zero3(cfg: dict, ids: torch.Tensor, threshold: int, batches: list) -> dict:
    """The reference's warm start (``actors/hybrid.py _load_weights``) into a ZeRO-3 engine whose
    parameters are kept whole: a trained source engine's weights moved into a fresh engine of
    another seed that has run a forward already (a resume, a resize), then
    ``adapter.weights_written()``. The destination's forward must give the source's log-probs
    bit for bit — and before ``weights_written`` it must not (its whole copies are still its
    own seed's: the check can fail)."""
    from rlhf_switch.engines.train_state import gather_layouts
    from rlhf_switch.routing import move

    src = _zero3(cfg, 0, 0)
    for b in batches:
        src.train_step(b, 2, _loss)
    dst = _zero3(cfg, 1, threshold)
    dst.outputs(ids)  # DeepSpeed gathers a persistent parameter at its first fetch and keeps it from then on
    theirs, mine = src.adapter.weights(), dst.adapter.weights()
    (a, b), _ = gather_layouts([(src.spec, theirs), (dst.spec, mine)], ["source", "warm start"])
    with torch.no_grad():
        move(a, b, theirs.tensors, mine.tensors)
    want = src.outputs(ids)
    before = bool(torch.equal(dst.outputs(ids), want))
    dst.adapter.weights_written()
    return {"persistent": len(dst.engine.optimizer.persistent_parameters), "equal_before": before,
            "equal_after": bool(torch.equal(dst.outputs(ids), want))}
