"""Tiny torch-native training engines: FSDP2, DTensor TP, TP×DP on a 2-D mesh, pipeline stages,
and TP inside pipeline stages (TP×PP).

Each ``build_*`` function is called on EVERY rank of the world (process groups are created
collectively over the world) and returns a ``TorchTrainer`` on the ranks the engine lives on,
``None`` elsewhere, so one world can hold several engines on disjoint subsets of its ranks.
Every engine builds the same Hugging Face causal LM of the config's family (``families.py``; fp32,
seeded, identical on every rank), applies its parallelism, and trains it with the shared
``optim.AdamWConfig`` recipe (torch ``AdamW`` + ``LambdaLR`` warmup); its parameters keep their HF names, so ``trainer.adapter`` (a
``TorchTrainAdapter``) describes them in the VPS directly.

``train_step(input_ids)`` takes the GLOBAL batch on every rank; each DP rank takes its contiguous
slice. Every sample has the same number of tokens (no padding), so averaging the per-rank mean
losses (FSDP2's gradient reduce-scatter averages over DP) gives the one-process full-batch update.

Rank order on a mesh is Megatron's (TP fastest): ``ranks[dp_rank · tp + tp_rank]``, and
``ranks[pp_rank · tp + tp_rank]`` for TP×PP.
"""
from __future__ import annotations

import functools
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..device import CPU, DeviceSpec
from ..models import causal_lm as hf_model  # noqa: F401 - the name tests and benches import
from ..models import model_spec
from ..vps.spec import config_value
from .base import DEFAULT_TIMEOUT
from .dtensor_adapter import TorchTrainAdapter
from .optim import AdamWConfig


class TorchTrainer:
    """One rank of a torch-native engine: ``train_step`` and the ``adapter``."""

    def __init__(self, module: nn.Module, name: str, spec, optim: AdamWConfig,
                 loss_and_backward: Callable[[torch.Tensor], torch.Tensor] | None,
                 dp_group: dist.ProcessGroup | None, dp: int, dp_rank: int,
                 loss_group: dist.ProcessGroup | None = None, loss_src: int | None = None):
        self.module, self.name, self.spec = module, name, spec
        self.dp, self.dp_rank, self.dp_group = dp, dp_rank, dp_group
        self._loss_and_backward = loss_and_backward
        # pipeline: only the last stage knows the loss; it broadcasts it over the stage group
        self._loss_group, self._loss_src = loss_group, loss_src
        if optim.max_grad_norm > 0 and loss_group is not None:
            # a pipeline stage sees only its own parameters' gradients; the global norm would need
            # an all-reduce across stages, which these stages do not do yet
            raise NotImplementedError(f"{name}: gradient clipping is not supported on pipeline stages")
        self._max_grad_norm = optim.max_grad_norm
        # the recipe every engine shares, so a switch between engines continues the same update
        # only what trains (all of it, or LoRA's adapters): a frozen tensor has no optimizer state
        self.optimizer = optim.make([p for p in module.parameters() if p.requires_grad], on_local_shards=True)
        self.scheduler = optim.scheduler(self.optimizer)
        # spec None: a model the VPS has no description of (the critic's value model) — no adapter
        self.adapter = (TorchTrainAdapter(spec, name, module, self.optimizer, self.scheduler)
                        if spec is not None else None)

    def train_step(self, input_ids: torch.Tensor) -> float:
        if self._loss_and_backward is None:
            raise NotImplementedError(f"{self.name}: this engine was built without a loss; its owner "
                                      f"runs forward/backward and the optimizer itself")
        B = input_ids.shape[0]
        if B % self.dp:
            raise ValueError(f"{self.name}: batch {B} is not divisible by DP={self.dp}")
        per = B // self.dp
        loss = self._loss_and_backward(input_ids[self.dp_rank * per:(self.dp_rank + 1) * per])
        self.optimizer_step()
        return self._global_mean(loss.detach().clone())

    def optimizer_step(self, report_norm: bool = False) -> float:
        """Clip (when ``max_grad_norm`` > 0), step the optimizer and the LR schedule, zero the
        gradients. Returns the global gradient norm before clipping — NaN when clipping is off,
        unless ``report_norm`` (then it is computed anyway)."""
        gn = float("nan")
        if self._max_grad_norm > 0 or report_norm:  # DTensor gradients: the norm is the global one
            limit = self._max_grad_norm if self._max_grad_norm > 0 else float("inf")
            gn = clip_grad_norm(self.module.parameters(), limit)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return gn

    def _global_mean(self, loss: torch.Tensor) -> float:
        if self._loss_group is not None:
            dist.broadcast(loss, src=self._loss_src, group=self._loss_group)
        if self.dp > 1:
            dist.all_reduce(loss, group=self.dp_group)
            loss /= self.dp
        return float(loss)


# --- model and groups ------------------------------------------------------------------------------

@torch.no_grad()
def clip_grad_norm(parameters, max_norm: float) -> float:
    """``clip_grad_norm_`` for parameters on *different* meshes (TP×FSDP2 has 2-D DTensors for
    the TP-sharded weights and 1-D ones for the rest, and torch's version stacks the per-tensor
    norms, which DTensor refuses across meshes): each gradient's norm is reduced over its own
    mesh to a plain number first. Returns the total norm before clipping (``max_norm`` inf:
    report only).

    The per-tensor reductions are batched: the squared local norms of all gradients sharded over
    the same mesh dims go in one all-reduce per dim (one collective per step for FSDP2, where
    reducing each tensor's DTensor norm on its own was one gloo round trip per parameter). The
    arithmetic is DTensor's own (local norm, ``** 2``, sum over ranks, ``** 0.5`` per tensor, then
    the norm of the per-tensor norms in float64), so a gradient sharded over one mesh dim gets the
    same norm as before; over two dims (TP×FSDP2) the square is no longer rooted in between."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return 0.0
    groups: dict = {}  # (mesh, reduced mesh dims) -> indices into grads
    norms: list = [None] * len(grads)
    for i, g in enumerate(grads):
        placements = getattr(g, "placements", None)
        if placements is None:  # a plain tensor: its norm is local
            norms[i] = torch.linalg.vector_norm(g, 2).double()
        elif any(p.is_partial() for p in placements):  # not a gradient layout seen here: DTensor's way
            norms[i] = torch.linalg.vector_norm(g, 2).full_tensor().double()
        else:
            dims = tuple(d for d, p in enumerate(placements) if p.is_shard())
            groups.setdefault((id(g.device_mesh), dims), (g.device_mesh, dims, []))[2].append(i)
    for mesh, dims, idx in groups.values():
        sq = torch.stack([torch.linalg.vector_norm(grads[i].to_local(), 2) for i in idx]) ** 2
        for d in dims:
            dist.all_reduce(sq, group=mesh.get_group(d))
        for i, n in zip(idx, sq ** 0.5):
            norms[i] = n.double()
    total = float(torch.linalg.vector_norm(torch.stack(norms), 2))
    coef = max_norm / (total + 1e-6)
    if coef < 1:
        for g in grads:
            (g.to_local() if hasattr(g, "to_local") else g).mul_(coef)
    return total


def causal_lm_loss(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=input_ids, labels=input_ids).loss


def rank_groups(grid: torch.Tensor, dim: int, timeout: timedelta) -> dist.ProcessGroup | None:
    """Create the groups along mesh dim ``dim`` of ``grid`` (world ranks) — ``new_group`` is
    collective over the WORLD, so every rank creates every group — and return this rank's."""
    mine = None
    lines = grid.movedim(dim, -1).reshape(-1, grid.shape[dim]).tolist()
    for line in lines:
        g = dist.new_group(line, timeout=timeout)
        if dist.get_rank() in line:
            mine = g
    return mine


def device_mesh(ranks: Sequence[int], shape: Sequence[int], names: tuple[str, ...],
                timeout: timedelta = DEFAULT_TIMEOUT, device: DeviceSpec = CPU):
    """A ``DeviceMesh`` of ``device.kind`` over ``ranks`` (row-major into ``shape``), or ``None``
    on ranks outside.

    Built from our own groups (``DeviceMesh.from_group``), not by ``DeviceMesh(...)``: that one
    also calls ``new_group`` on every world rank but with gloo's default 30-minute timeout."""
    grid = torch.tensor(list(ranks), dtype=torch.int).view(*shape)
    groups = [rank_groups(grid, d, timeout) for d in range(len(shape))]
    if dist.get_rank() not in ranks:
        return None
    from torch.distributed.device_mesh import DeviceMesh

    if len(shape) == 1:
        return DeviceMesh.from_group(groups[0], device.kind, mesh_dim_names=names)
    return DeviceMesh.from_group(groups, device.kind, mesh=grid, mesh_dim_names=names)


def check_tp(hf_config: Any, tp: int) -> None:
    """TP splits heads, KV heads and the MLP width evenly (Colwise/Rowwise): refuse, before
    anything is built, a TP that does not divide them."""
    nh = int(config_value(hf_config, "num_attention_heads"))
    nkv = int(config_value(hf_config, "num_key_value_heads") or nh)
    inter = int(config_value(hf_config, "intermediate_size"))
    bad = [f"{n}={v}" for n, v in (("num_attention_heads", nh), ("num_key_value_heads", nkv),
                                   ("intermediate_size", inter)) if v % tp]
    if tp < 1 or bad:
        raise ValueError(f"TP={tp} must divide {', '.join(bad) or 'the model'}: a TP engine cannot take this layout")


def check_ranks(ranks: Sequence[int], size: int, what: str) -> list[int]:
    """``ranks`` must be ascending: ``new_group`` numbers a group's members in ascending order,
    and DTensor collectives and pipeline peers follow that numbering, so a mesh or stage order
    that is not ascending would put shards and stages on the wrong ranks."""
    ranks = [int(r) for r in ranks]
    world = dist.get_world_size()
    if len(ranks) != size or not all(0 <= r < world for r in ranks) or ranks != sorted(set(ranks)):
        raise ValueError(f"{what} needs {size} distinct ascending ranks of the world of {world}, got {ranks}")
    return ranks


# --- FSDP2 -----------------------------------------------------------------------------------------

def build_fsdp2(hf_config: Any, seed: int, ranks: Sequence[int], *, optim: AdamWConfig = AdamWConfig(),
                timeout: timedelta = DEFAULT_TIMEOUT,
                model_fn: Callable[[Any, int], nn.Module] | None = None, spec=None,
                device: DeviceSpec = CPU, per_layer: bool = True, lora=None,
                lora_dropout: float = 0.0) -> TorchTrainer | None:
    """FSDP2 over ``ranks`` (DP = len(ranks)): ``fully_shard`` on every decoder layer and the root.
    ``per_layer=False``: on the root only — one unit, so one all-gather and one gradient
    reduce-scatter per pass instead of one per layer and the root; each parameter is sharded on
    dim 0 over the same mesh either way (the same shards, the same VPS description), and the
    reduce-scatter sums element by element, so the numbers are the same bit for bit. For a model
    that is gathered whole anyway (``torch_engines.gathered_once``).

    ``model_fn(hf_config, seed)``: build another model with a Llama trunk at ``.model.layers``
    instead of the causal LM (e.g. the critic's value model, ``rlhf_switch.models.value_model``), whose
    VPS description is ``spec`` (None: no adapter). Such a trainer has no ``train_step``: its
    owner runs the forward/backward and ``optimizer``/``scheduler`` itself. ``device``: the run's
    (``rlhf_switch.device``): the model is built on the CPU, seeded, then moved there; with a
    compute dtype narrower than the master (bf16 + fp32) FSDP2's mixed precision gathers the
    parameters in the compute dtype for forward/backward and reduces gradients in the master's,
    while the sharded parameters — what the optimizer steps and the adapter describes — stay fp32.
    ``lora`` (a ``vps.spec.LoraSpec``; causal LM only): peft's LoRA layers on its targets before
    sharding (``engines/lora.py``) — the base frozen, only the adapters in the optimizer — and the
    spec ``with_adapters``."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dp = len(check_ranks(ranks, len(ranks), "FSDP2"))
    mesh = device_mesh(ranks, (dp,), ("dp",), timeout, device)
    if mesh is None:
        return None
    model = hf_model(hf_config, seed) if model_fn is None else model_fn(hf_config, seed)
    if lora is not None:
        from .lora import apply_lora

        if model_fn is not None:
            raise ValueError("LoRA is for the causal LM (the actor), not a model_fn's model")
        model = apply_lora(model, lora, lora_dropout)
    model = model.to(device.torch_device())
    mixed = {"mp_policy": MixedPrecisionPolicy(param_dtype=device.torch_dtype("compute"),
                                               reduce_dtype=device.torch_dtype("master"))} if device.mixed else {}
    for layer in model.model.layers if per_layer else ():
        fully_shard(layer, mesh=mesh, **mixed)
    fully_shard(model, mesh=mesh, **mixed)
    if model_fn is not None:
        return TorchTrainer(model, f"FSDP2·DP{dp}", spec, optim, None,
                            mesh.get_group("dp"), dp, mesh.get_local_rank("dp"))
    spec = model_spec(model.config) if lora is None else model_spec(model.config).with_adapters(lora)
    return TorchTrainer(model, f"FSDP2·DP{dp}" + ("·LoRA" if lora is not None else ""), spec, optim,
                        lambda ids: _backward(causal_lm_loss(model, ids)),
                        mesh.get_group("dp"), dp, mesh.get_local_rank("dp"))


def _backward(loss: torch.Tensor) -> torch.Tensor:
    loss.backward()
    return loss


# --- DTensor TP, and TP×DP -----------------------------------------------------------------------

class _SumGradOverTP(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the TP group. For a replicated weight
    that each TP rank applies to its own heads only (qwen3's per-head q/k norms): its full
    gradient is the sum of the ranks' partial ones, identical on every rank after the sum."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _head_norm_forward(norm: nn.Module, group, x: torch.Tensor) -> torch.Tensor:
    """transformers' Qwen3 RMSNorm forward, op for op, its weight through ``_SumGradOverTP``."""
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return _SumGradOverTP.apply(norm.weight, group) * x.to(dtype)


def apply_tensor_parallel(model: nn.Module, tp_mesh) -> None:
    """Megatron-style TP of every decoder layer: q/k/v/gate/up column-parallel, o/down
    row-parallel (one all-reduce each). Embedding, norms and LM head stay plain replicated
    tensors: they see replicated activations and replicated (all-reduced) gradients, so they
    stay bit-identical on every TP rank. Qwen3's per-head q/k norms see only the rank's heads:
    their gradients are summed over TP (``_SumGradOverTP``). q/k/v biases (qwen2) are split with
    their weights by ``ColwiseParallel``. ``model`` is an HF model or a ``LlamaStage`` (whose
    ``model.layers`` is a ``ModuleDict`` of this stage's layers only)."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    plan = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel()}
    layers = model.model.layers
    for layer in (layers.values() if isinstance(layers, nn.ModuleDict) else layers):
        parallelize_module(layer, tp_mesh, plan)
        for norm in (getattr(layer.self_attn, "q_norm", None), getattr(layer.self_attn, "k_norm", None)):
            if norm is not None:  # qwen3: a rank's norm sees its own heads only
                norm.forward = functools.partial(_head_norm_forward, norm, tp_mesh.get_group())


def build_tp(hf_config: Any, seed: int, ranks: Sequence[int], *, optim: AdamWConfig = AdamWConfig(),
             timeout: timedelta = DEFAULT_TIMEOUT, device: DeviceSpec = CPU) -> TorchTrainer | None:
    """DTensor TP over ``ranks`` (TP = len(ranks), no DP), on ``device``."""
    tp = len(ranks)
    check_tp(hf_config, tp)
    mesh = device_mesh(check_ranks(ranks, tp, f"TP{tp}"), (tp,), ("tp",), timeout, device)
    if mesh is None:
        return None
    model = hf_model(hf_config, seed).to(device.torch_device())
    apply_tensor_parallel(model, mesh)
    return TorchTrainer(model, f"TP{tp}", model_spec(model.config), optim,
                        lambda ids: _backward(causal_lm_loss(model, ids)), None, 1, 0)


def build_tp_dp(hf_config: Any, seed: int, ranks: Sequence[int], *, tp: int,
                optim: AdamWConfig = AdamWConfig(), timeout: timedelta = DEFAULT_TIMEOUT,
                device: DeviceSpec = CPU) -> TorchTrainer | None:
    """TP inside, FSDP2 over DP on a (dp, tp) mesh (torchtitan's 2-D parallelism):
    ``ranks[dp_rank · tp + tp_rank]``. TP-sharded weights become 2-D DTensors
    (``_StridedShard`` over dp + ``Shard`` over tp); replicated ones are sharded over dp only."""
    from torch.distributed.fsdp import fully_shard

    check_tp(hf_config, tp)
    if tp < 1 or len(ranks) % tp:
        raise ValueError(f"TP={tp} must divide the engine's {len(ranks)} ranks")
    dp = len(ranks) // tp
    mesh = device_mesh(check_ranks(ranks, len(ranks), f"TP{tp}·DP{dp}"), (dp, tp), ("dp", "tp"), timeout, device)
    if mesh is None:
        return None
    model = hf_model(hf_config, seed).to(device.torch_device())
    apply_tensor_parallel(model, mesh["tp"])
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return TorchTrainer(model, f"TP{tp}·DP{dp}", model_spec(model.config), optim,
                        lambda ids: _backward(causal_lm_loss(model, ids)),
                        mesh.get_group("dp"), dp, mesh.get_local_rank("dp"))
