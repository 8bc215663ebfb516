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
from rlhf_switch.engines.train_state import gather_layouts
from rlhf_switch.routing import move
from rlhf_switch.vps import select
from rlhf_switch.vps.materialize import bits, materialize
from rlhf_switch.vps.spec import LoraSpec


def ids_of(vocab: int, batch: int = 4, length: int = 12, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def build_engine(cfg: dict, lora: tuple, kind: str, seed: int = 0):
    """A LoRA training engine over ranks 0, 1 through the engine interface: ``fsdp2`` or
    ``zero1``/``zero2``/``zero3`` (DeepSpeed)."""
    from rlhf_switch.engines.base import TrainingContext, training_engine
    from rlhf_switch.rl.config import TrainLayout

    layout = (TrainLayout(engine="fsdp2", dp=2) if kind == "fsdp2"
              else TrainLayout(engine="deepspeed", zero_stage=int(kind[-1]), dp=2))
    ctx = TrainingContext(cfg, seed, (0, 1), AdamWConfig(lr=1e-2), micro_batch=2, lora=LoraSpec(*lora))
    return training_engine(layout.engine).build(layout, ctx)


def trained(cfg: dict, lora: tuple, kind: str = "fsdp2", steps: int = 2, seed: int = 0):
    """``build_engine`` after ``steps`` optimizer steps (B no longer zero): each DP rank's half of
    a batch, a loss that raises the log-probs of its tokens."""
    engine = build_engine(cfg, lora, kind, seed)
    ids = ids_of(cfg["vocab_size"]).chunk(2)[dist.get_rank()]
    for _ in range(steps):
        engine.train_step(ids, 2, lambda out, rows: (-out.mean(), {}))
    return engine


def whole(engine) -> dict[str, torch.Tensor]:
    """Every parameter whole, by the spec's names (collective: FSDP2's ``full_tensor``, ZeRO-3's
    gather)."""
    model = engine.engine.module if hasattr(engine, "zero") else engine.module
    out = {}
    for n, p in model.named_parameters():
        if hasattr(p, "ds_tensor"):
            import deepspeed

            with deepspeed.zero.GatheredParameters([p]):
                t = p.data.detach().clone()
        else:
            t = (p.full_tensor() if is_dtensor(p) else p).detach().clone()
        out[canonical_name(n)] = t
    return out


def logprobs_of(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return logits.float().log_softmax(-1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]


def describe(cfg: dict, lora: tuple, kind: str) -> dict:
    """What the engine describes: the global layouts of weights() and state(), which parameters
    the optimizer holds, and whether the frozen base stayed as built while the adapters moved."""
    from rlhf_switch.models import causal_lm

    t = trained(cfg, lora, kind)
    (weights, state), _ = gather_layouts([(t.spec, t.adapter.weights()), (t.spec, t.adapter.state())],
                                         ["weights", "state"])
    weights.validate()
    tensors = whole(t)
    start = dict(causal_lm(cfg, 0).named_parameters())
    base_kept = all(torch.equal(tensors[n], start[n].detach()) for n in start)
    held = {str(f.key) for r in range(2) for f in state.fragments(r)}
    return {"base_kept": base_kept, "keys": sorted(held),
            "adapters_moved": all(float(tensors[n].abs().max()) > 0 for n in t.spec.adapter_tensors if "lora_B" in n),
            "trainable": sum(p.requires_grad for p in (t.engine.module if kind != "fsdp2" else t.module).parameters()),
            "spec_digest": t.spec.digest}


def sync_into_rollout(cfg: dict, lora: tuple, tp: int, mode: str, kind: str = "fsdp2") -> dict:
    """The LoRA engine's weights into a TorchRollout of TP ``tp`` (``2 // tp`` replicas on
    the same two ranks): first the whole model (what the rollout engine's warm start holds: the
    frozen base, and the adapters' start), then one sync of ``mode`` (``adapters`` / ``merged``).
    Returns the bytes of that sync, whether the rollout engine's adapter buffers are the
    trainer's bit for bit, and the largest difference of its log-probs from the trainer's."""
    t = trained(cfg, lora, kind)
    spec, rank = t.spec, dist.get_rank()
    groups = [dist.new_group([r, r + 1]) for r in range(0, 2, 2)] if tp > 1 else [None, None]
    ro = TorchRollout.from_hf_config(spec, cfg, tp=tp, tp_rank=rank % tp, group=groups[rank // tp])
    everything = ro.layout(2 // tp)
    base = [x.name for x in spec.tensors if not spec.is_adapter(x.name)]
    weights = only(t.adapter.weights(), base)
    (src_all,), _ = gather_layouts([(spec.subset(base, "base"), weights)], ["train"])
    move(src_all, select(everything, base, "base"), weights.tensors, ro.buffers)  # the base, as the warm start has it
    sync = WeightSync.choose(spec, mode, True, "float32")
    ro.set_apply_adapters(sync.mode == "adapters")
    mine = sync.source(t.adapter)
    (src,), _ = gather_layouts([(sync.spec_of(spec), mine)], ["train"])
    report = move(src, sync.destination(everything), mine.tensors, ro.buffers)
    truth = whole(t)
    adapters = select(everything, spec.adapter_tensors, "adapters")
    want = materialize(adapters, rank, lambda k: truth[k.tensor])
    exact = all(torch.equal(bits(want[b]), bits(ro.buffers[b])) for b in want) if sync.mode == "adapters" else None
    ids = ids_of(cfg["vocab_size"])
    trainer = torch.cat(dist_all_gather(t.outputs(ids.chunk(2)[rank])))  # each DP rank its half
    rollout = logprobs_of(ro.forward(ids), ids)
    return {"mode": sync.mode, "bytes_moved": report.bytes_sent + report.bytes_local, "bytes": dict(sync.bytes),
            "adapters_exact": exact, "logprob_diff": float((rollout - trainer).abs().max())}


def dist_all_gather(t: torch.Tensor) -> list[torch.Tensor]:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return parts


def save_for_peft(cfg: dict, lora: tuple, path: str, kind: str = "fsdp2") -> dict:
    """The trained engine saved through the VPS (engine -> FullState on rank 0 -> disk: the loop's
    checkpoint path) and the trainer's logits for the test process to compare peft's against."""
    from rlhf_switch.engines.full_state import FullState
    from rlhf_switch.engines.train_switch import switch_training

    t = trained(cfg, lora, kind)
    holder = FullState(t.spec, name="checkpoint") if dist.get_rank() == 0 else None
    switch_training(t.adapter, holder)
    if holder is not None:
        holder.save_dir(path, cfg)
    dist.barrier()
    ids = ids_of(cfg["vocab_size"])
    return {"logprobs": torch.cat(dist_all_gather(t.outputs(ids.chunk(2)[dist.get_rank()]))),
            "saved": whole(t), "spec_digest": t.spec.digest}


def load_back(cfg: dict, lora: tuple, path: str, kind: str = "fsdp2") -> dict:
    """A fresh LoRA engine (other seed) loaded from the checkpoint through the VPS: its whole
    parameters and Adam moments, to compare with what was saved."""
    from rlhf_switch.engines.full_state import FullState
    from rlhf_switch.engines.train_switch import switch_training

    t = build_engine(cfg, lora, kind, seed=7)
    holder = FullState.load_dir(path, t.spec) if dist.get_rank() == 0 else None
    switch_training(holder, t.adapter)
    back = FullState(t.spec, name="read back") if dist.get_rank() == 0 else None
    switch_training(t.adapter, back)  # what the engine holds now, whole on rank 0
    return {"params": whole(t), "master": back.master if back else None, "moments": back.moments if back else None,
            "step": t.adapter.scalars()["step"]}





# --- into vLLM: the trained engine stays in the rank process between jobs ---------------------------------
_KEPT: dict = {}


def train_and_describe(cfg: dict, lora: tuple, mode: str, kind: str = "fsdp2"):
    """Train an engine and keep it here; the global layout of what a sync of ``mode`` moves
    (rank 0 returns it)."""
    t = trained(cfg, lora, kind)
    sync = WeightSync.choose(t.spec, mode, True, "float32")
    _KEPT.update(engine=t, sync=sync, held=sync.source(t.adapter))
    (src,), _ = gather_layouts([(sync.spec_of(t.spec), _KEPT["held"])], ["train"])
    return src if dist.get_rank() == 0 else None


def kept_buffers() -> dict:
    """``load_from``'s ``make_buffers``: the kept engine's buffers of the sync."""
    return _KEPT["held"].tensors


def kept_logprobs(ids: torch.Tensor) -> torch.Tensor:
    """The kept engine's log-probs of ``ids[:, 1:]`` (each DP rank its half, gathered)."""
    return torch.cat(dist_all_gather(_KEPT["engine"].outputs(ids.chunk(2)[dist.get_rank()])))
