"""The torch-native training engines behind the training-engine interface: FSDP2, DTensor TP (and
TP×FSDP2), pipeline stages (and TP×PP). Each is a thin shell over a builder of ``torch_train`` /
``pipeline``: the builder applies the parallelism, the shell says which layouts it runs."""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Any

import torch

from ..families import DENSE, engine_family_problems
from ..models import build_model, model_spec
from ..vps.layouts import ParallelConfig
from .base import LossFn, ModuleEngine, TrainingContext, TrainingEngine


def _fixed(phase: str, layout: Any, engine: str, **want: int) -> list[str]:
    """Layout fields this engine does not use must keep their neutral value."""
    hints = {"tp": "torch_tp", "pp": "torch_pp", "zero_stage": "deepspeed", "dp": "torch_tp"}
    return [f"{phase}: engine {engine} runs {k}={v} only (got {k}={getattr(layout, k)}; for {k} > {v} use "
            f"{'engine ' + hints[k] if hints[k] != engine else 'another engine'})"
            for k, v in want.items() if getattr(layout, k) != v]


class _TorchTrainerEngine(ModuleEngine):
    """Shared by the engines built as a ``torch_train.TorchTrainer``: FSDP2 over DP shards the
    weights, gradients and optimizer state alike (beside TP's split), gathering each FSDP2 unit to
    compute."""

    gathers_sharded_weights = True

    @classmethod
    def parallel_config(cls, layout) -> ParallelConfig:
        return ParallelConfig(tp=layout.tp, dp=layout.dp, dp_shard="fsdp" if layout.dp > 1 else "replicate")

    @classmethod
    def state_shards(cls, layout) -> tuple[int, int, int]:
        n = layout.tp * layout.pp * layout.dp
        return n, n, n

    @classmethod
    def gathers_per_call(cls, model_bytes: float) -> bool:
        return gathers_once(model_bytes)

    def __init__(self, trainer: Any, ctx: TrainingContext):
        self.trainer, self.module = trainer, trainer.module
        self.name = f"critic {trainer.name}" if ctx.head == "value" else trainer.name
        self.spec, self.adapter = trainer.spec, trainer.adapter
        self.dp, self.dp_rank, self.dp_group = trainer.dp, trainer.dp_rank, trainer.dp_group
        self.head, self.micro_batch, self.outputs_batch = ctx.head, ctx.micro_batch, ctx.outputs_batch
        self.lora_dropout = ctx.lora_dropout if ctx.lora is not None else 0.0
        # gathered once per call only where the whole model is small: a large one keeps FSDP2's
        # per-layer gathers (holding it unsharded is what sharding it avoids)
        self.gather_once = gathers_once(self.spec.numel * torch.finfo(ctx.device.torch_dtype()).bits // 8)

    def _optimizer_step(self) -> float:
        # the optimizer (and clipping) reads the sharded parameters, which FSDP2 registers on the
        # module again only when it reshards (``gathered_once`` keeps them gathered until here)
        reshard(self.module)
        return self.trainer.optimizer_step(report_norm=True)

    # FSDP2 (fsdp2, and torch_tp at dp > 1) gathers each layer before its forward and again before
    # its backward, per micro-batch: 5 all-gathers per layer per micro-batch, each a gloo round
    # trip that costs more than the layer's compute at the tiny sizes. Within one call (an
    # ``outputs`` pass, an optimizer step) the sharded parameters do not change, so each layer is
    # gathered once and kept until the call ends: the same gathered values, the same forwards,
    # the same per-micro-batch gradient reduce-scatters — the numbers are bit for bit unchanged;
    # the memory is that of one whole unsharded model for the call's duration.
    # Only for a model of at most ``GATHER_ONCE_BYTES`` unsharded (``gathers_once``).
    @torch.no_grad()
    def outputs(self, ids: torch.Tensor) -> torch.Tensor:
        with gathered_once(self.module) if self.gather_once else nullcontext():
            return super().outputs(ids)

    def train_step(self, ids: torch.Tensor, micro: int, loss_fn) -> dict:
        with gathered_once(self.module) if self.gather_once else nullcontext():
            return super().train_step(ids, micro, loss_fn)


# the largest whole model (compute-dtype bytes) an FSDP2 engine keeps gathered for a whole call
GATHER_ONCE_BYTES = 1 << 30


def gathers_once(model_bytes: float) -> bool:
    """Whether an FSDP2 engine of a model of ``model_bytes`` gathers each unit once per call
    (``gathered_once``) rather than per layer per micro-batch: the tune cost model asks the same."""
    return model_bytes <= GATHER_ONCE_BYTES


def _fsdp_units(module: torch.nn.Module) -> list:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def reshard(module: torch.nn.Module) -> None:
    """Every FSDP2 unit of ``module`` resharded (a unit that is already sharded: nothing)."""
    for m in _fsdp_units(module):
        m.reshard()


@contextmanager
def gathered_once(module: torch.nn.Module):
    """Within the block, every FSDP2 unit of ``module`` stays unsharded after its first gather
    (no reshard after forward or backward); at the end every unit is resharded and its flags are
    restored exactly (FSDP2 treats the root specially, so they are saved, not reset to a default).
    Gradient reduce-scatters are left as they are. A module without FSDP2 units: a no-op. Whatever
    reads or steps the sharded parameters inside the block (the optimizer) calls ``reshard`` first."""
    units = _fsdp_units(module)
    if not units:
        yield
        return
    # the root's lazy init (at its first forward) clears its reshard-after-forward flag; run it
    # now so that what is saved below is what FSDP2 would use outside the block
    units[0]._get_fsdp_state()._lazy_init()
    saved = []
    for m in units:
        state = m._get_fsdp_state()
        saved.append((state, state._auto_reshard_after_forward,
                      [(g, g.post_forward_mesh_info, g.reshard_after_backward) for g in state._fsdp_param_groups]))
        state._auto_reshard_after_forward = False
        for g in state._fsdp_param_groups:
            g.post_forward_mesh_info, g.reshard_after_backward = None, False
    try:
        yield
    finally:
        for state, auto, groups in saved:
            state._auto_reshard_after_forward = auto
            for g, post, after_backward in groups:
                g.post_forward_mesh_info, g.reshard_after_backward = post, after_backward
        reshard(module)


class FSDP2Engine(_TorchTrainerEngine):
    """torch FSDP2 (``fully_shard`` per decoder layer and the root) over all its ranks: DP only.
    Every family: a qwen3_moe layer's stacked experts are sharded on the expert dim, each rank
    holding whole experts, which the adapter describes per expert. bf16 compute: FSDP2's mixed
    precision over fp32 sharded parameters (the master the optimizer steps)."""

    compute_dtypes = ("float32", "bfloat16")
    profile_name = "fsdp2"

    can_offload = True  # tests/test_offload.py
    supports_lora = True  # tests/test_lora.py

    @classmethod
    def gather_messages(cls, tensors: int, layers: int, head: str, model_bytes: float) -> int:
        """A causal LM gathered whole per call is one FSDP2 unit (``build``): one message."""
        if head == "lm" and gathers_once(model_bytes):
            return 1
        return super().gather_messages(tensors, layers, head, model_bytes)

    @classmethod
    def layout_problems(cls, phase, layout, dims, head="lm"):
        return _fixed(phase, layout, "fsdp2", tp=1, pp=1, zero_stage=0)

    @classmethod
    def build(cls, layout, ctx: TrainingContext):
        from .torch_train import build_fsdp2

        value = {} if ctx.head == "lm" else dict(  # the causal LM is build_fsdp2's own default
            model_fn=lambda cfg, seed: build_model(cfg, seed, ctx.head, ctx.init_from),
            spec=model_spec(ctx.hf_config, ctx.head))
        # a causal LM gathered whole per call (gathers_once): one FSDP2 unit, one all-gather and
        # one reduce-scatter per pass instead of one per layer (gloo round trips: 35 -> 15
        # collectives in grpo_tiny_fsdp.yaml's train_on); bit for bit the same (build_fsdp2)
        whole = ctx.head == "lm" and gathers_once(
            model_spec(ctx.hf_config).numel * torch.finfo(ctx.device.torch_dtype()).bits // 8)
        lora = dict(lora=ctx.lora, lora_dropout=ctx.lora_dropout) if ctx.lora is not None else {}
        t = build_fsdp2(ctx.hf_config, ctx.seed, ctx.ranks, optim=ctx.optim, timeout=ctx.timeout,
                        device=ctx.device, per_layer=not whole, **value, **lora)
        return None if t is None else cls(t, ctx)


class TorchTPEngine(_TorchTrainerEngine):
    """DTensor TP (Megatron-style plan on every decoder layer), with FSDP2 over DP when dp > 1.
    The dense families: qwen2's q/k/v biases split with their weights, qwen3's per-head q/k norms
    replicated with their gradients summed over TP (``torch_train.apply_tensor_parallel``). Not
    qwen3_moe: its stacked experts have no TP plan here."""

    profile_name = "torch_tp"

    @classmethod
    def layout_problems(cls, phase, layout, dims, head="lm"):
        problems = _fixed(phase, layout, "torch_tp", pp=1, zero_stage=0)
        problems += engine_family_problems(phase, "torch_tp", dims, DENSE,
                                           "its stacked experts have no tensor-parallel plan here")
        if head != "lm":
            problems.append(f"{phase}: engine torch_tp builds causal LMs only (use fsdp2 or deepspeed)")
        return problems

    @classmethod
    def build(cls, layout, ctx: TrainingContext):
        from .torch_train import build_tp, build_tp_dp

        if layout.dp > 1:
            t = build_tp_dp(ctx.hf_config, ctx.seed, ctx.ranks, tp=layout.tp, optim=ctx.optim, timeout=ctx.timeout,
                            device=ctx.device)
        else:
            t = build_tp(ctx.hf_config, ctx.seed, ctx.ranks, optim=ctx.optim, timeout=ctx.timeout, device=ctx.device)
        return None if t is None else cls(t, ctx)


class TorchPPEngine(TrainingEngine):
    """Pipeline stages (``torch.distributed.pipelining``, GPipe), DTensor TP inside each stage when
    tp > 1: every batch goes through the stages in micro-batches; the last stage computes the
    log-probs and losses and hands them to every rank of the engine. The dense families (the
    stages call the family's own decoder layers); not qwen3_moe."""

    profile_name = "torch_pp"

    @classmethod
    def profile_keys(cls, layout) -> tuple[str, ...]:
        """At tp > 1 its stages run DTensor TP: the TP engine's dispatch costs too."""
        own = super().profile_keys(layout)
        return own + (TorchTPEngine.profile_name,) if layout.tp > 1 else own

    @classmethod
    def layout_problems(cls, phase, layout, dims, head="lm"):
        problems = _fixed(phase, layout, "torch_pp", dp=1, zero_stage=0)
        # the stages (pipeline.LlamaStage) call the family's decoder layers as they are
        problems += engine_family_problems(phase, "torch_pp", dims, DENSE,
                                           "its stages have no MoE layer and no TP plan for one")
        if head != "lm":
            problems.append(f"{phase}: engine torch_pp builds causal LMs only (use fsdp2 or deepspeed)")
        if dims is not None and layout.pp > 1 and getattr(dims, "tie_word_embeddings", False):
            problems.append(f"{phase}: engine torch_pp cannot split a model with tied embeddings over stages")
        return problems

    @classmethod
    def build(cls, layout, ctx: TrainingContext):
        from .pipeline import build_pipeline_trainer

        t = build_pipeline_trainer(ctx.hf_config, ctx.seed, ctx.ranks, tp=layout.tp, optim=ctx.optim,
                                   timeout=ctx.timeout, seq_len=ctx.context, micro=ctx.micro_batch,
                                   device=ctx.device)
        if t is None:
            return None
        self = cls()
        self.trainer, self.module = t, t.module
        self.name, self.spec, self.adapter = t.name, t.spec, t.adapter
        self.dp, self.dp_rank, self.dp_group = t.dp, t.dp_rank, t.dp_group
        self.head = "lm"
        return self

    def outputs(self, ids: torch.Tensor) -> torch.Tensor:
        return self.trainer.outputs(ids)

    def train_step(self, ids: torch.Tensor, micro: int, loss_fn: LossFn) -> dict:
        return self.trainer.train_step(ids, micro, loss_fn)

    def freeze(self) -> None:
        self.module.eval()
