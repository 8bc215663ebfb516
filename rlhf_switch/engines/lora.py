"""LoRA on a training engine, its checkpoints in peft's format, and what a weight sync moves.

The adapters are tensors of the model's spec (``ModelSpec.with_adapters``): ``….q_proj.lora_A.weight``
[r, in] and ``….q_proj.lora_B.weight`` [out, r] beside the frozen ``….q_proj.weight``. An engine
puts them on its model with peft (``apply_lora``: peft's ``inject_adapter_in_model``, which wraps
each target ``nn.Linear`` and freezes everything else), then describes the peft parameter names by
the spec's (``canonical_name``: ``q_proj.base_layer.weight`` -> ``q_proj.weight``,
``q_proj.lora_A.default.weight`` -> ``q_proj.lora_A.weight``). Only the adapters reach the
optimizer, so only they have Adam moments.

A weight sync into a rollout engine moves one of (``WeightSync``, chosen once per run):

==============  ===============================================================================
``full``        every weight (no LoRA)
``adapters``    ``A`` and ``B`` of every target: ``r·(in + out)`` elements each; the rollout engine
                keeps its own copy of the frozen base and applies them (``RolloutEngine.takes_adapters``)
``merged``      the adapted weights ``W + (B @ A)·alpha/r`` of every target, computed on the trainer's
                ranks (``merged_weights`` of its adapter): ``in·out`` elements each, into the rollout
                engine's base buffers — any engine takes them
==============  ===============================================================================

Either way the destination is the rollout engine's own layout of the same spec, cut down to the
moved tensors (``vps.layout.select``): the planner sees one more pair of layouts, nothing else.

On disk (``save_adapter`` / ``load_adapter``) the adapters are a peft directory —
``adapter_config.json`` + ``adapter_model.safetensors`` with peft's key names
(``base_model.model.<name>``) — so ``peft.PeftModel.from_pretrained(base, dir)`` loads them.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

from ..vps.layout import Layout, select
from ..vps.spec import LoraSpec, ModelSpec, itemsize
from .train_state import LocalState

ADAPTER = "default"  # peft's adapter name: the one adapter of the model
PEFT_PREFIX = "base_model.model."  # peft's key prefix in adapter_model.safetensors
ADAPTER_DIR = "lora_adapter"  # a checkpoint's peft directory (beside its base model.safetensors)
SYNC_MODES = ("full", "adapters", "merged")

_PEFT_NAME = re.compile(r"\.(base_layer)\.|\.(lora_[AB])\.default\.")


def canonical_name(pname: str) -> str:
    """The spec's name of a parameter of a peft-wrapped model (any other name as it is)."""
    return _PEFT_NAME.sub(lambda m: "." if m.group(1) else f".{m.group(2)}.", pname)


def apply_lora(model: torch.nn.Module, lora: LoraSpec, dropout: float = 0.0) -> torch.nn.Module:
    """``model`` with peft's LoRA layers on ``lora.targets`` (in place; everything else frozen)."""
    from peft import LoraConfig, inject_adapter_in_model

    config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=dropout, target_modules=list(lora.targets))
    return inject_adapter_in_model(config, model, adapter_name=ADAPTER)


def initial_adapters(spec: ModelSpec, seed: int) -> dict[str, torch.Tensor]:
    """The adapters a run starts from, the same on any process: peft's default initialisation —
    ``A`` Kaiming-uniform (``a = √5``), ``B`` zero, so the adapted model starts as the base — drawn
    from a generator per tensor seeded by ``seed`` and the tensor's place in the spec."""
    out = {}
    for i, name in enumerate(spec.adapter_tensors):
        t = spec[name]
        x = torch.zeros(t.shape, dtype=torch.float32)
        if name.endswith(".lora_A.weight"):
            # kaiming_uniform_(a=sqrt(5)) on [r, in]: bound = sqrt(6 / ((1 + a²)·in)) = 1/sqrt(in)
            bound = 1.0 / math.sqrt(t.shape[1])
            g = torch.Generator().manual_seed(seed * 1_000_003 + i)
            x.uniform_(-bound, bound, generator=g)
        out[name] = x
    return out


def delta_weight(a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """peft's ``LoraLayer.get_delta_weight``, op for op: ``(B @ A) * scaling``."""
    return (b @ a) * scaling


def merge(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """peft's merged weight, op for op (``get_delta_weight`` then the add of ``merge``):
    ``W + (B @ A) * scaling``."""
    return weight + delta_weight(a, b, scaling)


# --- what a weight sync moves -------------------------------------------------------------------------

def tensor_bytes(spec: ModelSpec, names, dtype: str) -> int:
    return sum(spec[n].numel for n in names) * itemsize(dtype)


@dataclass(frozen=True)
class WeightSync:
    """What every weight sync of a run moves (module docstring), and the bytes each choice would
    move per sync in the rollout engine's dtype."""

    mode: str
    tensors: tuple[str, ...] | None  # the moved tensors; None: every one
    bytes: Mapping[str, int]         # per mode the engine could take: bytes per sync

    @classmethod
    def choose(cls, spec: ModelSpec, option: str, takes_adapters: bool, dtype: str) -> "WeightSync":
        """``option`` (``model.lora.sync``: ``auto``/``adapters``/``merged``; ignored without LoRA)
        for a rollout engine that does (not) take adapters: ``auto`` is the fewer bytes."""
        base = spec.base()
        full = {"full": tensor_bytes(base, [t.name for t in base.tensors], dtype)}
        if spec.lora is None:
            return cls("full", None, full)
        adapters, merged = spec.adapter_tensors, spec.adapted_tensors
        sizes = {**full, "merged": tensor_bytes(spec, merged, dtype)}
        if takes_adapters:
            sizes["adapters"] = tensor_bytes(spec, adapters, dtype)
        if option == "adapters" and not takes_adapters:
            raise ValueError("model.lora.sync: adapters — this rollout engine does not take adapters (use merged "
                             "or auto)")
        mode = option if option != "auto" else min(("adapters", "merged") if takes_adapters else ("merged",),
                                                   key=lambda m: sizes[m])
        return cls(mode, adapters if mode == "adapters" else merged, sizes)

    def spec_of(self, spec: ModelSpec) -> ModelSpec:
        """The model a sync moves: ``spec``, or its subset of the moved tensors."""
        return spec if self.tensors is None else spec.subset(self.tensors, self.mode)

    def source(self, adapter: Any) -> LocalState:
        """The trainer rank's part of the sync: what ``adapter`` holds of the moved tensors."""
        if self.mode == "merged":
            return adapter.merged_weights()
        weights = adapter.weights()
        return weights if self.tensors is None else only(weights, self.tensors)

    def destination(self, layout: Layout) -> Layout:
        """The rollout engine's ``layout`` cut down to the moved tensors."""
        return layout if self.tensors is None else select(layout, self.tensors, self.mode)


def only(state: LocalState, tensors) -> LocalState:
    """The fragments of ``tensors`` in ``state``, and the buffers they point into."""
    wanted = set(tensors)
    out = LocalState()
    for f in state.fragments:
        if f.key.tensor in wanted:
            if f.buffer not in out.tensors:
                out.add_buffer(f.buffer, state.tensors[f.buffer])
            out.fragments.append(f)
    return out


# --- peft's directory format --------------------------------------------------------------------------

def save_adapter(path: str | Path, spec: ModelSpec, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype,
                 dropout: float = 0.0, base_model: str | None = None) -> Path:
    """``tensors`` (the spec's adapter names) as a peft adapter directory at ``path``: peft's own
    ``LoraConfig.save_pretrained`` writes ``adapter_config.json``."""
    from peft import LoraConfig
    from safetensors.torch import save_file

    lora = spec.lora
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=dropout, target_modules=list(lora.targets),
               base_model_name_or_path=base_model, task_type="CAUSAL_LM").save_pretrained(str(path))
    save_file({PEFT_PREFIX + n: tensors[n].detach().to("cpu", dtype).contiguous() for n in spec.adapter_tensors},
              str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
    return path


def load_adapter(path: str | Path, spec: ModelSpec) -> dict[str, torch.Tensor]:
    """The adapters of the peft directory at ``path`` by the spec's names; refuses a directory
    whose rank, alpha, targets or tensors are not ``spec``'s."""
    from safetensors.torch import load_file

    path = Path(path)
    config = json.loads((path / "adapter_config.json").read_text())
    lora = spec.lora
    found = (int(config["r"]), float(config["lora_alpha"]), sorted(config["target_modules"]))
    if found != (lora.r, lora.alpha, sorted(lora.targets)):
        raise ValueError(f"{path}: adapter r={found[0]}, alpha={found[1]}, targets {found[2]}; the run's model has "
                         f"r={lora.r}, alpha={lora.alpha}, targets {sorted(lora.targets)}")
    raw = load_file(str(path / "adapter_model.safetensors"))
    tensors = {canonical_name(k[len(PEFT_PREFIX):] if k.startswith(PEFT_PREFIX) else k): v for k, v in raw.items()}
    missing = [n for n in spec.adapter_tensors if n not in tensors]
    wrong = [n for n in spec.adapter_tensors if n in tensors and tuple(tensors[n].shape) != spec[n].shape]
    if missing or wrong or len(tensors) != len(spec.adapter_tensors):
        raise ValueError(f"{path}: the adapters are not the model's (missing {missing[:3]}, misshapen {wrong[:3]}, "
                         f"{len(tensors)} tensors for {len(spec.adapter_tensors)})")
    return {n: tensors[n].float() for n in spec.adapter_tensors}
