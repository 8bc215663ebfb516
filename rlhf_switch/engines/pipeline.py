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
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..vps import llama_spec
from ..vps.layouts.pipeline import stage_bounds
from .dtensor_adapter import TorchTrainAdapter
from .optim import AdamWConfig
from .torch_train import (DEFAULT_TIMEOUT, TorchTrainer, _cfg, _check_ranks, _groups, _tensor_parallel,
                          check_tp, hf_model)


class LlamaStage(nn.Module):
    """Stage ``s`` of a pipelined ``LlamaForCausalLM`` that keeps the full model's parameter
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
           timeout: timedelta, engine_group: bool = False) -> tuple[_Stage | None, dist.ProcessGroup | None]:
    """Check the layout, create the groups (collective over the WORLD: every world rank creates
    every group, in the same order: [the engine's group,] the pipelines (one per TP rank), then
    the stages' TP groups) and build this rank's stage; (None, None) on ranks outside ``ranks``."""
    from torch.distributed.device_mesh import DeviceMesh

    check_tp(hf_config, tp)
    if tp < 1 or len(ranks) % tp:
        raise ValueError(f"TP={tp} must divide the engine's {len(ranks)} ranks")
    pp = len(ranks) // tp
    name = f"TP{tp}·PP{pp}" if tp > 1 else f"PP{pp}"
    if _cfg(hf_config, "tie_word_embeddings", False) and pp > 1:
        raise NotImplementedError("PP with tied embeddings (the head on the last stage shares the "
                                  "first stage's embedding) is not implemented")
    bounds = stage_bounds(int(_cfg(hf_config, "num_hidden_layers")), pp, stage_layers)
    grid = torch.tensor(_check_ranks(ranks, len(ranks), name)).view(pp, tp)
    engine = dist.new_group(list(ranks), timeout=timeout) if engine_group else None
    group = _groups(grid, 0, timeout)
    tp_group = _groups(grid, 1, timeout) if tp > 1 else None
    if dist.get_rank() not in ranks:
        return None, None
    s, t = divmod(list(ranks).index(dist.get_rank()), tp)
    hf = hf_model(hf_config, seed)
    module = LlamaStage(hf, *bounds[s], first=s == 0, last=s == pp - 1)
    del hf
    if tp > 1:
        _tensor_parallel(module, DeviceMesh.from_group(tp_group, "cpu", mesh_dim_names=("tp",)))
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
    ``_tensor_parallel``'s plan on the stage's TP group; its embedding / norm / LM head stay
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
    return TorchTrainer(stage, me.name, llama_spec(stage.model.config), optim, loss_and_backward,
                        None, 1, 0, loss_group=me.group if pp > 1 else None, loss_src=me.last_src)
