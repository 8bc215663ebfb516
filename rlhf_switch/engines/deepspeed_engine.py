"""DeepSpeed ZeRO-1/2/3 behind the training-engine interface (the VPS view of its partitions is
``deepspeed_zero.ZeroAdapter``). Micro-batches accumulate gradients inside one optimizer step:
the engine is told where the accumulation boundary is, so its ``gradient_accumulation_steps``
stays 1 and any number of micro-batches makes one step."""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..models import build_model, model_spec
from ..vps.layouts import ParallelConfig
from .base import LossFn, ModuleEngine, TrainingContext


class DeepSpeedEngine(ModuleEngine):
    can_offload = True  # ZeRO-1/2/3: tests/test_offload.py
    supports_lora = True  # ZeRO-1/2/3: tests/test_lora.py
    # bf16: DeepSpeed's bit16 weights compute, its fp32 master copy and moments stay apart
    compute_dtypes = ("float32", "bfloat16")
    zero_stages = (1, 2, 3)
    steps_flat_group = True  # ZeRO's optimizer steps one flat fp32 partition
    gathers_sharded_weights = True  # ZeRO-3 gathers each layer's partitions in its forward hooks
    profile_name = "deepspeed"

    @classmethod
    def profile_key(cls, layout) -> str:
        """One key per ZeRO stage (``deepspeed-z3``): each stage's hooks cost differently."""
        return f"{cls.profile_name}-z{layout.zero_stage}"

    @classmethod
    def parallel_config(cls, layout) -> ParallelConfig:
        """The bit16 weights: partitioned over DP at ZeRO-3, whole on every rank at ZeRO-1/2."""
        return ParallelConfig(dp=layout.dp, dp_shard="zero3" if layout.zero_stage == 3 else "replicate")

    @classmethod
    def state_shards(cls, layout) -> tuple[int, int, int]:
        """ZeRO-1 partitions the optimizer state, ZeRO-2 the gradients too, ZeRO-3 the weights too."""
        z, dp = layout.zero_stage, layout.dp
        return (dp if z == 3 else 1), (dp if z >= 2 else 1), dp

    @classmethod
    def gather_messages(cls, tensors: int, layers: int, head: str, model_bytes: float) -> int:
        return tensors  # ZeRO-3 gathers parameter by parameter

    @classmethod
    def step_collectives(cls, layout) -> tuple[str, ...]:
        """ZeRO-1 all-reduces the gradients, ZeRO-2 reduce-scatters them; each rank steps its
        partition and the updated weights are all-gathered."""
        return ("all_reduce" if layout.zero_stage == 1 else "reduce_scatter", "all_gather")

    @classmethod
    def keeps_small_params_whole(cls, layout) -> bool:
        return layout.zero_stage == 3

    @classmethod
    def layout_problems(cls, phase, layout, dims, head="lm"):
        problems = []
        if layout.tp > 1 or layout.pp > 1:
            problems.append(f"{phase}: engine deepspeed is ZeRO data parallelism (tp=1, pp=1); "
                            f"for tp={layout.tp}, pp={layout.pp} use engine torch_tp / torch_pp")
        if layout.zero_stage not in cls.zero_stages:
            problems.append(f"{phase}: engine deepspeed needs zero_stage 1, 2 or 3, got {layout.zero_stage}")
        return problems

    @classmethod
    def build(cls, layout, ctx: TrainingContext):
        from .deepspeed_zero import build_zero_trainer

        if layout.zero_stage not in cls.zero_stages:
            raise ValueError(f"engine deepspeed needs zero_stage 1, 2 or 3, got {layout.zero_stage}")
        ranks = list(ctx.ranks)
        # only the engine's ranks build the model (ZeRO-3 counts the parameters it partitions)
        on = dist.get_rank() in ranks
        module = build_model(ctx.hf_config, ctx.seed, ctx.head, ctx.init_from) if on else torch.nn.Linear(1, 1)
        spec = model_spec(module.config, ctx.head) if on else None
        if on and ctx.lora is not None:  # peft's layers on the targets, the base frozen (engines/lora.py)
            from .lora import apply_lora

            module, spec = apply_lora(module, ctx.lora, ctx.lora_dropout), spec.with_adapters(ctx.lora)
        z = build_zero_trainer(module, spec, int(layout.zero_stage), ctx.micro_batch, ranks, optim=ctx.optim,
                               dtype=ctx.device.compute_dtype, device=ctx.device,
                               persistence_threshold=int(getattr(layout, "persistence_threshold", 0)))
        if z is None:
            return None
        self = cls()
        self.zero, self.engine = z, z.engine
        self.module = z.engine  # forward through the engine (ZeRO-3 gathers partitions in its hooks)
        self.adapter, self.spec = z.adapter, spec
        self.name = (f"{'critic ' if ctx.head == 'value' else ''}ZeRO{layout.zero_stage}·DP{len(ranks)}"
                     + ("·LoRA" if ctx.lora is not None else ""))
        self.adapter.name = self.name
        self.dp, self.dp_group = z.dp, z.dp_group
        self.dp_rank = dist.get_rank(z.dp_group)
        self.head, self.micro_batch, self.outputs_batch = ctx.head, ctx.micro_batch, ctx.outputs_batch
        self.lora_dropout = ctx.lora_dropout if ctx.lora is not None else 0.0
        return self

    def _backward(self, loss: torch.Tensor, last: bool) -> None:
        self.engine.set_gradient_accumulation_boundary(last)
        self.engine.backward(loss, scale_wrt_gas=False)

    def _optimizer_step(self) -> float:
        self.engine.step()
        gn = self.engine.get_global_grad_norm()
        return float(gn) if gn is not None else float("nan")

    def outputs(self, ids: torch.Tensor) -> torch.Tensor:
        with self.zero.scope():  # DeepSpeed's world collectives on the engine's own ranks
            return super().outputs(ids)

    def train_step(self, ids: torch.Tensor, micro: int, loss_fn: LossFn) -> dict:
        with self.zero.scope():
            return super().train_step(ids, micro, loss_fn)

    def freeze(self) -> None:
        self.engine.eval()
