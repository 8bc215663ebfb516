"""Pipeline-parallel training engines (PP, and DTensor TP inside pipeline stages: TP×PP) over
``torch.distributed.pipelining``.

Two faces over the same stages (``LlamaStage``: HF parameter names kept, so the adapter
describes them in the VPS directly):

- ``build_pp`` / ``build_tp_pp``: layout engines (a ``TorchTrainer`` with the causal-LM loss,
  GPipe, no clipping) for the layout tests and the training-layout switch;
- ``build_pipeline_trainer``: the RLHF loop's trainer, ``PipelineTrainer``: the log-probs of
  given token ids (``outputs``) and one optimizer step of a caller's per-micro-batch loss
  (``train_step``), with the global gradient norm clipped across all stages and TP shards.

Rank order is Megatron's: stage ``s``, TP rank ``t`` is ``ranks[s · tp + t]``. TP rank ``t`` of
every stage forms its own pipeline (one process group per ``t``): the activations between stages
are plain replicated tensors (RowwiseParallel all-reduces them), so each pipeline carries a full
copy and no cross-TP traffic is needed.

How ``PipelineTrainer`` meets the pipelining runtime (torch 2.13):

- Constant shapes. A ``PipelineStage`` allocates its receive buffers once, from the shapes it
  is told. Every stage here is told them up front (``input_args``/``output_args`` as meta
  tensors: "static" metadata, so no shape-inference forward/backward and no loss call at set-up)
  and every micro-batch is padded to ``[micro, seq_len]``: right padding (token 0) leaves the
  real positions unchanged under causal attention, and the results are sliced back.
- A fixed micro-batch count per schedule. A schedule's ``n_microbatches`` and its stage's
  per-chunk buffers are fixed, so the trainer keeps one (``PipelineStage``, ``ScheduleGPipe``)
  pair per (forward-only or training, n, rows), all wrapping the same module, made on first
  use — every rank of a pipeline reaches the same one in the same call.
- The loss. ``target`` is the batch's row indices; the schedule splits it with the micro-batches,
  so the last stage's loss wrapper knows which rows it holds (``s``), computes their log-probs
  and calls the caller's ``loss_fn(logp, s)``. ``scale_grads=False``: the gradient is the sum of
  the given losses (the caller weights them).
- Results. Only the last stage has logits; every TP rank of it holds them whole (the LM head is
  replicated). Log-probs, stats and the grad norm are broadcast from the last stage's first TP
  rank over a group of all the engine's ranks, so they are the same bits on every rank.
- Clipping. ``torch.nn.utils.clip_grad_norm_`` of the whole model, in one process, spread over
  the stages in its own arithmetic: each rank takes the norm of each of its stage's gradients
  (a TP-sharded DTensor gradient's made whole with ``full_tensor()``), the per-tensor norms are
  gathered along the pipeline in the model's order, and every stage takes the norm of that
  vector and scales its gradients by ``min(max_norm / (norm + 1e-6), 1)`` — fp32 where the
  gradients are. A PP engine therefore clips to the same bits as one process.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..device import CPU, DeviceSpec
from ..models import model_spec
from ..vps.layouts.pipeline import stage_bounds
from ..vps.spec import config_value
from .dtensor_adapter import TorchTrainAdapter
from .optim import AdamWConfig
from .torch_train import (
    DEFAULT_TIMEOUT,
    TorchTrainer,
    apply_tensor_parallel,
    check_ranks,
    check_tp,
    hf_model,
    rank_groups,
)

LossFn = Callable[[torch.Tensor, slice], tuple[torch.Tensor, dict]]


class LlamaStage(nn.Module):
    """Stage ``s`` of a pipelined causal LM of a dense family (Llama-shaped decoder layers: llama,
    mistral, qwen2, qwen3; the name is historical) that keeps the full model's parameter
    names: ``model.layers`` is a ``ModuleDict`` keyed by the original layer index (torchtitan's
    trick), holding only this stage's layers; the embedding lives on the first stage, the final
    norm and LM head on the last. Input: token ids (first stage) or hidden states; output:
    hidden states, or logits on the last stage."""

    def __init__(self, hf: nn.Module, lo: int, hi: int, first: bool, last: bool):
        super().__init__()
        self.model = hf.model
        self.model.layers = nn.ModuleDict({str(i): self.model.layers[i] for i in range(lo, hi)})
        if not first:
            self.model.embed_tokens = None
        if not last:
            self.model.norm = None
        self.lm_head = hf.lm_head if last else None
        self.first, self.last = first, last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.model.embed_tokens(x) if self.first else x
        positions = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        rope = self.model.rotary_emb(h, position_ids=positions)
        for layer in self.model.layers.values():
            # no mask: HF's sdpa path then runs is_causal, as the full model does without padding
            h = layer(h, attention_mask=None, position_ids=positions, position_embeddings=rope)
        if not self.last:
            return h
        return self.lm_head(self.model.norm(h))


# --- building one rank's stage ---------------------------------------------------------------------

@dataclass
class _Stage:
    """This rank's place in a pipeline engine and its stage module."""
    module: LlamaStage
    name: str
    index: int            # stage s
    pp: int
    tp_rank: int          # t
    group: dist.ProcessGroup  # the pipeline of TP rank t (one rank per stage)
    last_src: int         # world rank of the last stage in this rank's pipeline


def _stage(hf_config: Any, seed: int, ranks: Sequence[int], tp: int, stage_layers: tuple[int, ...] | None,
           timeout: timedelta, engine_group: bool = False,
           device: DeviceSpec = CPU) -> tuple[_Stage | None, dist.ProcessGroup | None]:
    """Check the layout, create the groups (collective over the WORLD: every world rank creates
    every group, in the same order: [the engine's group,] the pipelines (one per TP rank), then
    the stages' TP groups) and build this rank's stage; (None, None) on ranks outside ``ranks``."""
    from torch.distributed.device_mesh import DeviceMesh

    check_tp(hf_config, tp)
    if tp < 1 or len(ranks) % tp:
        raise ValueError(f"TP={tp} must divide the engine's {len(ranks)} ranks")
    pp = len(ranks) // tp
    name = f"TP{tp}·PP{pp}" if tp > 1 else f"PP{pp}"
    if config_value(hf_config, "tie_word_embeddings", False) and pp > 1:
        raise NotImplementedError("PP with tied embeddings (the head on the last stage shares the "
                                  "first stage's embedding) is not implemented")
    bounds = stage_bounds(int(config_value(hf_config, "num_hidden_layers")), pp, stage_layers)
    grid = torch.tensor(check_ranks(ranks, len(ranks), name)).view(pp, tp)
    engine = dist.new_group(list(ranks), timeout=timeout) if engine_group else None
    group = rank_groups(grid, 0, timeout)
    tp_group = rank_groups(grid, 1, timeout) if tp > 1 else None
    if dist.get_rank() not in ranks:
        return None, None
    s, t = divmod(list(ranks).index(dist.get_rank()), tp)
    hf = hf_model(hf_config, seed)
    module = LlamaStage(hf, *bounds[s], first=s == 0, last=s == pp - 1).to(device.torch_device())
    del hf
    if tp > 1:
        apply_tensor_parallel(module, DeviceMesh.from_group(tp_group, device.kind, mesh_dim_names=("tp",)))
    return _Stage(module, name, s, pp, t, group, int(grid[pp - 1, t])), engine


# --- the layout engines (TorchTrainer) -----------------------------------------------------------

def build_pp(hf_config: Any, seed: int, ranks: Sequence[int], *, microbatches: int = 2,
             stage_layers: tuple[int, ...] | None = None, optim: AdamWConfig = AdamWConfig(),
             timeout: timedelta = DEFAULT_TIMEOUT) -> TorchTrainer | None:
    """``torch.distributed.pipelining`` over ``ranks`` (PP = len(ranks), one stage per rank,
    GPipe with ``microbatches``); layers split as ``vps.layouts.pipeline.stage_bounds``."""
    return _build_pipeline(hf_config, seed, ranks, 1, microbatches, stage_layers, optim, timeout)


def build_tp_pp(hf_config: Any, seed: int, ranks: Sequence[int], *, tp: int, microbatches: int = 2,
                stage_layers: tuple[int, ...] | None = None, optim: AdamWConfig = AdamWConfig(),
                timeout: timedelta = DEFAULT_TIMEOUT) -> TorchTrainer | None:
    """Pipeline stages with DTensor TP inside each (PP = len(ranks) // tp): stage ``s``, TP rank
    ``t`` is ``ranks[s · tp + t]`` (Megatron order). Each stage's decoder layers get
    ``apply_tensor_parallel``'s plan on the stage's TP group; its embedding / norm / LM head stay
    plain replicated tensors."""
    return _build_pipeline(hf_config, seed, ranks, tp, microbatches, stage_layers, optim, timeout)


def _build_pipeline(hf_config: Any, seed: int, ranks: Sequence[int], tp: int, microbatches: int,
                    stage_layers: tuple[int, ...] | None, optim: AdamWConfig,
                    timeout: timedelta) -> TorchTrainer | None:
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
    from transformers.loss.loss_utils import ForCausalLMLoss

    me, _ = _stage(hf_config, seed, ranks, tp, stage_layers, timeout)
    if me is None:
        return None
    stage, s, pp = me.module, me.index, me.pp
    vocab = stage.model.config.vocab_size
    pipe = PipelineStage(stage, s, pp, torch.device("cpu"), group=me.group)
    # the full model's loss, per microbatch (every microbatch has the same number of tokens,
    # so the schedule's mean over microbatches is the full-batch mean)
    schedule = ScheduleGPipe(pipe, n_microbatches=microbatches,
                             loss_fn=lambda logits, ids: ForCausalLMLoss(logits, ids, vocab))

    def loss_and_backward(ids: torch.Tensor) -> torch.Tensor:
        losses: list[torch.Tensor] = []
        if s == 0:
            schedule.step(ids, target=ids if pp == 1 else None, losses=losses, return_outputs=False)
        elif s == pp - 1:
            schedule.step(target=ids, losses=losses, return_outputs=False)
        else:
            schedule.step(return_outputs=False)
        return torch.stack(losses).mean() if losses else torch.zeros(())

    # the last stage of this rank's pipeline (same TP rank) broadcasts the loss along it
    return TorchTrainer(stage, me.name, model_spec(stage.model.config), optim, loss_and_backward,
                        None, 1, 0, loss_group=me.group if pp > 1 else None, loss_src=me.last_src)


# --- the RLHF loop's pipeline trainer ------------------------------------------------------------

def token_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """[B, T-1] fp32 log-probs of ``ids[:, 1:]`` ([B, T]) under ``logits`` ([B, ≥T, V]: the
    positions past ``T`` — padding — are ignored)."""
    T = ids.shape[1]
    logp = torch.log_softmax(logits[:, :T - 1].float(), dim=-1)
    return logp.gather(-1, ids[:, 1:, None]).squeeze(-1)


class PipelineTrainer:
    """One rank of a PP (or TP×PP) engine over ``ranks`` (stage s, TP rank t = ranks[s*tp + t]).

    ``outputs(ids)`` and ``train_step(ids, micro, loss_fn)`` are collective over the engine's
    ranks: every rank calls them with the same ``ids`` and gets the same result. ``micro``
    (micro-batch rows) is fixed at build or by the first ``train_step``; ``seq_len`` bounds T.
    """
    dp, dp_rank, dp_group = 1, 0, None  # no data parallelism inside a pipeline engine here

    def __init__(self, me: _Stage, engine: dist.ProcessGroup, src: int, optim: AdamWConfig,
                 seq_len: int, micro: int | None):
        self.module, self.name = me.module, me.name
        self.spec = model_spec(self.module.model.config)
        self.stage_index, self.pp = me.index, me.pp
        self.seq_len, self.micro = int(seq_len), micro
        self._pipe, self._engine, self._src = me.group, engine, src
        self._max_grad_norm = optim.max_grad_norm
        self.optimizer = optim.make(self.module.parameters())
        self.scheduler = optim.scheduler(self.optimizer)
        self.adapter = TorchTrainAdapter(self.spec, self.name, self.module, self.optimizer, self.scheduler)
        self.device = next(self.module.parameters()).device
        self._schedules: dict[tuple[bool, int, int], tuple[Any, Any]] = {}  # key -> (stage, schedule)
        self._batch: tuple[torch.Tensor, LossFn, list] | None = None  # what the loss wrapper reads
        self._stage_norms: list[tuple[int, int]] | None = None  # (stage, gradients) per pipeline member

    @property
    def first(self) -> bool:
        return self.stage_index == 0

    @property
    def last(self) -> bool:
        return self.stage_index == self.pp - 1

    # --- the two calls ---------------------------------------------------------------------------
    @torch.no_grad()
    def outputs(self, ids: torch.LongTensor) -> torch.Tensor:
        """[B, T-1] fp32 log-probs of ``ids[:, 1:]``, on every rank of the engine."""
        ids = self._check(ids)
        B, T = ids.shape
        rows = self.micro or B  # before the micro size is fixed: one micro-batch
        padded = self._pad(ids, rows)
        stage, schedule = self._schedule(False, padded.shape[0] // rows, rows)
        logits = schedule.eval(*((padded,) if self.first else ()))
        out = (token_logprobs(logits[:B], ids).contiguous() if self.last
               else torch.empty(B, T - 1, dtype=torch.float32, device=self.device))
        del logits
        stage.clear_runtime_states()  # forward-only: nothing pops the cached chunks and outputs
        dist.broadcast(out, src=self._src, group=self._engine)
        return out

    def train_step(self, ids: torch.LongTensor, micro: int, loss_fn: LossFn) -> dict:
        """One optimizer step of the SUM of ``loss_fn(logp, s)`` over the micro-batches
        ``s = slice(i, i + micro)``; returns ``{"grad_norm", "stats"}``, the same on every rank."""
        ids = self._check(ids)
        B = ids.shape[0]
        if micro < 1 or B % micro:
            raise ValueError(f"{self.name}: batch {B} is not a multiple of micro={micro}")
        if self.micro is None:
            self.micro = micro
        elif micro != self.micro:
            raise ValueError(f"{self.name}: micro-batches are {self.micro} rows (pipeline buffers "
                             f"are allocated for that size), got micro={micro}")
        _, schedule = self._schedule(True, B // micro, micro)
        stats: list = []
        self._batch = (ids, loss_fn, stats)
        try:
            schedule.step(*((self._pad(ids, micro),) if self.first else ()),
                          target=torch.arange(B, device=self.device) if self.last else None,
                          return_outputs=False)
        finally:
            self._batch = None
        grad_norm = self._clip()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        result = [{"grad_norm": grad_norm, "stats": stats}]
        dist.broadcast_object_list(result, src=self._src, group=self._engine)
        return result[0]

    # --- pieces ----------------------------------------------------------------------------------
    def _check(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.dim() != 2 or ids.dtype != torch.long:
            raise ValueError(f"{self.name}: ids must be a [B, T] LongTensor, got {ids.dtype} {tuple(ids.shape)}")
        B, T = ids.shape
        if not 2 <= T <= self.seq_len:
            raise ValueError(f"{self.name}: T={T} must be in [2, seq_len={self.seq_len}]")
        return ids.to(self.device)

    def _pad(self, ids: torch.Tensor, rows: int) -> torch.Tensor:
        """``ids`` right-padded with token 0 to [a multiple of ``rows``, seq_len]."""
        B, T = ids.shape
        out = ids.new_zeros((-(-B // rows) * rows, self.seq_len), device=self.device)
        out[:B, :T] = ids
        return out

    def _schedule(self, train: bool, n: int, rows: int):
        """The (stage, schedule) pair for ``n`` micro-batches of ``rows`` rows, made on first
        use with static shapes: [rows, seq_len] token ids into the first stage, hidden states
        [rows, seq_len, H] between stages, logits [rows, seq_len, V] out of the last."""
        from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

        key = (train, n, rows)
        if key not in self._schedules:
            cfg = self.module.model.config

            def meta(*shape, dtype=torch.float32):
                grad = train and dtype.is_floating_point  # activations carry gradients when training
                return torch.empty(shape, dtype=dtype, device="meta", requires_grad=grad)

            hidden = meta(rows, self.seq_len, cfg.hidden_size)
            stage = PipelineStage(self.module, self.stage_index, self.pp, self.device,
                                  input_args=meta(rows, self.seq_len, dtype=torch.long) if self.first else hidden,
                                  output_args=meta(rows, self.seq_len, cfg.vocab_size) if self.last else hidden,
                                  group=self._pipe)
            self._schedules[key] = stage, ScheduleGPipe(stage, n_microbatches=n, scale_grads=False,
                                                        loss_fn=self._micro_loss if train else None)
        return self._schedules[key]

    def _micro_loss(self, logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The schedule's loss on the last stage: ``rows`` are the micro-batch's row indices."""
        ids, loss_fn, stats = self._batch
        i = int(rows[0])
        s = slice(i, i + rows.numel())
        loss, st = loss_fn(token_logprobs(logits, ids[s]), s)
        stats.append({k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in st.items()})
        return loss

    @torch.no_grad()
    def _clip(self) -> float:
        """Global-norm clipping over all stages and TP shards, in the arithmetic of
        ``torch.nn.utils.clip_grad_norm_`` on the whole model (module doc); the norm before
        clipping (NaN when clipping is off)."""
        if self._max_grad_norm <= 0:
            return float("nan")
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        norms = []
        for g in grads:  # same order on every TP rank of the stage: full_tensor() is collective
            n = torch.linalg.vector_norm(g, 2)
            norms.append(n.full_tensor() if hasattr(n, "full_tensor") else n)
        total = torch.linalg.vector_norm(self._model_order(norms), 2)
        coef = torch.clamp(self._max_grad_norm / (total + 1e-6), max=1.0)  # multiplied even at 1, as torch does
        for g in grads:
            (g.to_local() if hasattr(g, "to_local") else g).mul_(coef)
        return float(total)

    def _model_order(self, norms: list[torch.Tensor]) -> torch.Tensor:
        """Every stage's per-tensor norms (one rank per stage: this TP rank's pipeline), stage
        after stage: the vector ``clip_grad_norm_`` stacks in one process, in its order. Its
        norm is then the same reduction over the same numbers — not a sum of per-stage squares,
        which rounds differently."""
        local = torch.stack(norms).float() if norms else torch.zeros(0, device=self.device)
        if self._stage_norms is None:  # (stage, tensors) of every member, once: the stages do not change
            mine = torch.tensor([self.stage_index, local.numel()], dtype=torch.int64, device=self.device)
            rows = [torch.empty_like(mine) for _ in range(self.pp)]
            dist.all_gather(rows, mine, group=self._pipe)
            self._stage_norms = [tuple(int(v) for v in r) for r in rows]
        width = max(n for _, n in self._stage_norms)
        padded = torch.zeros(width, dtype=torch.float32, device=self.device)
        padded[:local.numel()] = local
        out = [torch.empty_like(padded) for _ in range(self.pp)]
        dist.all_gather(out, padded, group=self._pipe)
        by_stage = sorted(zip(self._stage_norms, out), key=lambda x: x[0][0])
        return torch.cat([v[:n] for (_, n), v in by_stage])


def build_pipeline_trainer(hf_config: Any, seed: int, ranks: Sequence[int], *, tp: int = 1,
                           optim: AdamWConfig = AdamWConfig(), timeout: timedelta = DEFAULT_TIMEOUT,
                           seq_len: int, micro: int | None = None,
                           stage_layers: tuple[int, ...] | None = None,
                           device: DeviceSpec = CPU) -> PipelineTrainer | None:
    """A ``PipelineTrainer`` over ``ranks`` (PP = len(ranks) // tp) on ``device`` (the run's,
    ``rlhf_switch.device``). Collective over the WORLD (every world rank calls it: ``new_group``
    is collective); None on ranks outside ``ranks``."""
    me, engine = _stage(hf_config, seed, ranks, tp, stage_layers, timeout, engine_group=True, device=device)
    if me is None:
        return None
    src = int(list(ranks)[(me.pp - 1) * tp])  # the last stage's first TP rank
    return PipelineTrainer(me, engine, src, optim, seq_len, micro)
