"""The PPO critic: a Llama trunk with a scalar value head, trained with FSDP2 or DeepSpeed ZeRO.

No Ray here: ``Critic`` runs inside a worker process that already has a gloo default process
group (the hybrid worker's world, or a test's ``LocalWorld``). ``Critic.build`` is called on every
rank of the world (the engines create their groups collectively) and returns ``None`` on ranks
outside the critic's ``ranks``.

- ``value_model(hf_config, seed)``: transformers' ``LlamaForTokenClassification`` with one label
  (fp32, sdpa attention, no classifier dropout), seeded like ``torch_train.hf_model``; optionally
  its trunk (``model.*``) loaded from an actor checkpoint (safetensors of a ``LlamaForCausalLM``).
  The head (``score``) is drawn small (std ``1/(hidden+1)``, OpenRLHF's choice) or zero, with
  a zero bias.
- Positions: ``values(ids)[b, t]`` is the value of the state after ``ids[b, :t+1]``, i.e. before
  token ``t+1`` is generated — the position whose logits give the actor's log-prob of token
  ``t+1``. So values, log-probs and the hybrid worker's mask are all ``[B, T-1]`` and aligned.
- Data parallelism: ``values`` and ``update`` take THIS rank's share of the batch (the caller
  slices; ``local_slice`` does it for a global batch). Every DP rank must call them together with
  the same number of rows (FSDP2 all-gathers parameters inside each forward). ``update`` weighs
  each micro-batch by its share of the GLOBAL token count (all-reduced), so DP ranks with unequal
  numbers of response tokens still give exactly the one-process token-mean gradient.
"""
from __future__ import annotations

import copy
import glob
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from rlhf_switch.engines.optim import AdamWConfig
from rlhf_switch.vps import ModelSpec, llama_spec
from rlhf_switch.rl.algorithms import Aggregation, value_loss

TIMEOUT = timedelta(seconds=120)


# --- the model -------------------------------------------------------------------------------------

def _hidden(hf_config: Any) -> int:
    return int(hf_config["hidden_size"] if isinstance(hf_config, Mapping) else hf_config.hidden_size)


def value_model(hf_config: Any, seed: int, init_from: str | None = None,
                head_std: float | None = None) -> nn.Module:
    """``LlamaForTokenClassification`` (``num_labels=1``) of ``hf_config`` (dict or config): fp32,
    sdpa attention, no dropout, weights from ``torch.manual_seed(seed)`` — identical on every rank.

    ``init_from``: a directory with a safetensors checkpoint of a ``LlamaForCausalLM`` (one
    ``model.safetensors`` or shards ``*.safetensors``); its trunk ``model.*`` replaces the seeded
    trunk (all of it: a missing or misshapen tensor raises). ``head_std``: std of the value
    head's weight (default ``1/(hidden+1)``; 0 = zeros); its bias is 0."""
    from transformers import LlamaConfig, LlamaForTokenClassification

    cfg = LlamaConfig(**hf_config) if isinstance(hf_config, Mapping) else copy.deepcopy(hf_config)
    cfg.num_labels = 1
    cfg.classifier_dropout = 0.0  # transformers' default would be 0.1: a noisy critic
    cfg.use_cache = False
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = LlamaForTokenClassification(cfg).float()
    std = 1.0 / (_hidden(cfg) + 1) if head_std is None else float(head_std)
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed)
        model.score.weight.copy_(torch.randn(model.score.weight.shape, generator=g) * std)
        if model.score.bias is not None:
            model.score.bias.zero_()
    if init_from is not None:
        load_trunk(model, init_from)
    return model.train()


def load_trunk(model: nn.Module, checkpoint_dir: str) -> None:
    """Copy the ``model.*`` tensors of a safetensors HF checkpoint (a ``LlamaForCausalLM``) into
    ``model.model`` — strictly: every trunk tensor must be there with its shape."""
    from safetensors.torch import load_file

    files = sorted(glob.glob(os.path.join(checkpoint_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {checkpoint_dir!r} (init_from wants an HF checkpoint directory)")
    trunk: dict[str, torch.Tensor] = {}
    for f in files:
        for k, v in load_file(f).items():
            if k.startswith("model."):
                trunk[k[len("model."):]] = v
    missing, unexpected = model.model.load_state_dict(trunk, strict=False)
    missing = [k for k in missing if not k.endswith("rotary_emb.inv_freq")]
    if missing or unexpected:
        raise ValueError(f"{checkpoint_dir}: the checkpoint's trunk does not fit the critic: missing "
                         f"{missing[:5]}, unexpected {unexpected[:5]}")


# --- the critic ------------------------------------------------------------------------------------

def value_spec(hf_config: Any, name: str = "llama-value") -> ModelSpec:
    """The VPS description of ``value_model``: the Llama trunk's tensors (as ``llama_spec``), no
    LM head, and the value head ``score.weight [1, H]`` + ``score.bias [1]`` (replicated: no TP
    rule splits a 1-row head). Names and order equal ``value_model(...).named_parameters()`` —
    so the critic's engines have VPS adapters, and its training state is saved, resumed and
    switched like the actor's."""
    from rlhf_switch.vps.spec import TensorSpec

    base = llama_spec(dict(hf_config) if isinstance(hf_config, Mapping) else hf_config)
    trunk = tuple(t for t in base.tensors if t.name != "lm_head.weight")
    dtype = trunk[0].dtype
    H = trunk[0].shape[1]
    head = (TensorSpec("score.weight", (1, H), dtype, "replicate", anchor="last"),
            TensorSpec("score.bias", (1,), dtype, "replicate", anchor="last"))
    return ModelSpec(name, trunk + head, base.num_layers, base.attention, base.fused, False)


@dataclass(frozen=True)
class CriticLayout:
    """What ``Critic.build`` reads of a layout (``rl.config.TrainLayout`` has these fields)."""

    engine: str = "fsdp2"
    zero_stage: int = 0
    dp: int = 1
    tp: int = 1
    pp: int = 1


class Critic:
    """One DP rank of the critic engine. Build with ``Critic.build`` on every world rank."""

    def __init__(self, *, kind: str, module: nn.Module, forward, name: str, dp_group, dp: int, dp_rank: int,
                 micro_batch: int, max_grad_norm: float, trainer: Any):
        self.kind, self.module, self._forward, self.name = kind, module, forward, name
        self.dp_group, self.dp, self.dp_rank = dp_group, dp, dp_rank
        self.micro_batch, self.max_grad_norm = micro_batch, max_grad_norm
        self.trainer = trainer  # TorchTrainer (fsdp2) or ZeroTrainer (deepspeed)
        self.adapter = trainer.adapter  # the VPS view of its training state (value_spec)
        self.spec = self.adapter.spec
        self.steps = 0

    # --- construction ----------------------------------------------------------------------------
    @classmethod
    def build(cls, layout: Any, hf_config: Any, seed: int, ranks: Sequence[int] | None = None, *,
              lr: float = 1e-5, max_grad_norm: float = 0.0, micro_batch: int = 1, weight_decay: float = 0.0,
              init_from: str | None = None, head_std: float | None = None, optim: AdamWConfig | None = None,
              timeout: timedelta = TIMEOUT) -> "Critic | None":
        """The critic over ``ranks`` (default: the whole world) with ``layout.engine`` ``fsdp2``
        or ``deepspeed`` (``layout.zero_stage`` 1/2/3), DP = ``layout.dp`` = ``len(ranks)``.
        Optimizer: ``optim`` or ``AdamWConfig(lr, weight_decay, max_grad_norm)`` — the recipe
        every engine shares (torch AdamW, no compiled op). ``micro_batch``: sequences per forward
        (the default of ``values``/``update``). Collective over the world; ``None`` outside ``ranks``."""
        ranks = list(range(dist.get_world_size())) if ranks is None else [int(r) for r in ranks]
        engine, dp = layout.engine, int(layout.dp)
        if getattr(layout, "tp", 1) != 1 or getattr(layout, "pp", 1) != 1:
            raise NotImplementedError(f"critic: tp={layout.tp}, pp={layout.pp}: the critic runs data parallel only")
        if dp != len(ranks):
            raise ValueError(f"critic: layout dp={dp} but {len(ranks)} ranks {ranks}")
        if micro_batch < 1:
            raise ValueError(f"critic: micro_batch must be >= 1, got {micro_batch}")
        optim = optim or AdamWConfig(lr=lr, weight_decay=weight_decay, max_grad_norm=max_grad_norm or 0.0)
        spec = value_spec(hf_config)

        def make(cfg, s):
            return value_model(cfg, s, init_from=init_from, head_std=head_std)

        if engine == "fsdp2":
            from rlhf_switch.engines.torch_train import build_fsdp2

            t = build_fsdp2(hf_config, seed, ranks, optim=optim, timeout=timeout, model_fn=make, spec=spec)
            if t is None:
                return None
            module = t.module
            return cls(kind="fsdp2", module=module, forward=module, name=f"critic {t.name}",
                       dp_group=t.dp_group, dp=t.dp, dp_rank=t.dp_rank, micro_batch=micro_batch,
                       max_grad_norm=optim.max_grad_norm, trainer=t)
        if engine == "deepspeed":
            from rlhf_switch.engines.deepspeed_zero import build_zero_trainer

            stage = int(layout.zero_stage)
            if stage not in (1, 2, 3):
                raise ValueError(f"critic: engine deepspeed needs zero_stage 1, 2 or 3, got {stage}")
            # only ranks of the engine build the model (ZeRO-3 counts its parameters)
            module = make(hf_config, seed) if dist.get_rank() in ranks else torch.nn.Linear(1, 1)
            z = build_zero_trainer(module, spec, stage, micro_batch, ranks, optim=optim)
            if z is None:
                return None
            return cls(kind="deepspeed", module=z.engine.module, forward=z.engine,
                       name=f"critic ZeRO{stage}·DP{len(ranks)}", dp_group=z.dp_group, dp=z.dp,
                       dp_rank=dist.get_rank(z.dp_group), micro_batch=micro_batch,
                       max_grad_norm=optim.max_grad_norm, trainer=z)
        raise NotImplementedError(f"critic: engine {engine!r}: the critic trains with fsdp2 or deepspeed")

    # --- helpers ---------------------------------------------------------------------------------
    def _scope(self):
        import contextlib

        return self.trainer.scope() if self.kind == "deepspeed" else contextlib.nullcontext()

    def local_slice(self, t: torch.Tensor) -> torch.Tensor:
        """This DP rank's contiguous share of a global batch (rows)."""
        if t.shape[0] % self.dp:
            raise ValueError(f"{self.name}: batch {t.shape[0]} is not divisible by DP={self.dp}")
        per = t.shape[0] // self.dp
        return t[self.dp_rank * per:(self.dp_rank + 1) * per]

    def _values_of(self, ids: torch.Tensor) -> torch.Tensor:
        """``[B, T-1]`` values with autograd (the head's output at positions 0..T-2)."""
        out = self._forward(input_ids=ids, use_cache=False)
        return out.logits[:, :-1, 0].float()

    def _chunks(self, n: int, micro: int) -> list[slice]:
        return [slice(i, min(i + micro, n)) for i in range(0, n, micro)]

    # --- the API ---------------------------------------------------------------------------------
    @torch.no_grad()
    def values(self, ids: torch.Tensor, micro_batch: int | None = None) -> torch.Tensor:
        """``[B, T-1]`` values of this rank's ``ids [B, T]``: ``values[b, t]`` is V of the state
        after ``ids[b, :t+1]`` (aligned with the actor's log-prob of token ``t+1``). Collective
        over the DP group under FSDP2/ZeRO-3: every rank calls it with the same ``B``."""
        micro = micro_batch or self.micro_batch
        with self._scope():
            return torch.cat([self._values_of(ids[s]) for s in self._chunks(ids.shape[0], micro)])

    def update(self, ids: torch.Tensor, mask: torch.Tensor, returns: torch.Tensor, old_values: torch.Tensor,
               clip_eps: float | None = 0.2, micro_batch: int | None = None,
               aggregation: Aggregation = "token-mean") -> dict[str, float]:
        """One optimizer step on this rank's share: clipped value loss (``value_loss``) in
        micro-batches of ``micro_batch`` rows, gradients accumulated, each micro-batch weighted
        by its share of the global batch (tokens for ``token-mean``, sequences with tokens for
        the ``seq-mean-*`` aggregations), so the step is the one-process full-batch step.
        ``ids [B, T]``; ``mask``, ``returns``, ``old_values`` ``[B, T-1]``.
        Returns ``vf_loss`` (global), ``vf_clipfrac`` (global, per token), ``grad_norm``
        (global, before clipping), ``tokens`` (global)."""
        B = ids.shape[0]
        if tuple(mask.shape) != (B, ids.shape[1] - 1):
            raise ValueError(f"{self.name}: mask {tuple(mask.shape)} does not fit ids {tuple(ids.shape)} "
                             f"(want [B, T-1])")
        micro = micro_batch or self.micro_batch
        chunks = self._chunks(B, micro)
        mask = mask.float()

        def weight(m: torch.Tensor) -> torch.Tensor:
            return m.sum() if aggregation == "token-mean" else (m.sum(-1) > 0).sum().float()

        # global weight and token count; and the same number of micro-batches everywhere (FSDP2
        # all-gathers inside each forward: unequal counts would hang, so refuse on every rank)
        totals = torch.stack([weight(mask), mask.sum()]).double()
        counts = torch.tensor([len(chunks), -len(chunks)], dtype=torch.int64)
        if self.dp > 1:
            dist.all_reduce(totals, group=self.dp_group)
            dist.all_reduce(counts, op=dist.ReduceOp.MAX, group=self.dp_group)
        if int(counts[0]) != -int(counts[1]):
            raise ValueError(f"{self.name}: DP ranks have between {-int(counts[1])} and {int(counts[0])} "
                             f"micro-batches; every rank needs the same number")
        W, tokens = float(totals[0]), float(totals[1])
        scale = self.dp / max(W, 1.0)  # the engines average gradients over DP

        loss_sum = torch.zeros((), dtype=torch.float64)
        clip_sum = torch.zeros((), dtype=torch.float64)
        ds = self.kind == "deepspeed"
        engine = self.trainer.engine if ds else None
        with self._scope():
            for i, s in enumerate(chunks):
                m = mask[s]
                v = self._values_of(ids[s])
                vl, st = value_loss(v, old_values[s].float(), returns[s].float(), m, clip_eps=clip_eps,
                                    aggregation=aggregation)
                w = weight(m)
                loss = vl * (w * scale)
                if ds:
                    engine.set_gradient_accumulation_boundary(i == len(chunks) - 1)
                    engine.backward(loss, scale_wrt_gas=False)
                else:
                    loss.backward()
                loss_sum += (vl.detach() * w).double()
                clip_sum += (st["vf_clipfrac"] * m.sum()).double()
            if ds:
                engine.step()
                gn = engine.get_global_grad_norm()
                grad_norm = float(gn) if gn is not None else float("nan")
            else:
                grad_norm = self.trainer.optimizer_step(report_norm=True)
        stats = torch.stack([loss_sum, clip_sum])
        if self.dp > 1:
            dist.all_reduce(stats, group=self.dp_group)
        self.steps += 1
        return {"vf_loss": float(stats[0]) / max(W, 1.0), "vf_clipfrac": float(stats[1]) / max(tokens, 1.0),
                "grad_norm": grad_norm, "tokens": int(tokens)}

    def state_dict_full(self, all_ranks: bool = False) -> dict[str, torch.Tensor]:
        """Every parameter whole, fp32, by its HF name (``model.*``, ``score.*``) — on DP rank 0
        (``{}`` elsewhere) or on every rank with ``all_ranks``. Collective over the DP group."""
        keep = all_ranks or self.dp_rank == 0
        out: dict[str, torch.Tensor] = {}
        if self.kind == "fsdp2":
            for name, p in self.module.named_parameters():
                full = p.full_tensor() if hasattr(p, "full_tensor") else p
                if keep:
                    out[name] = full.detach().clone()
            return out
        from deepspeed.utils import safe_get_full_fp32_param

        with self._scope():
            for name, p in self.module.named_parameters():
                full = safe_get_full_fp32_param(p)
                if keep:
                    out[name] = full.detach().clone()
        return out
