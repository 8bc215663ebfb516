"""The models every engine builds, and their VPS descriptions: a causal LM and its value-head twin.

Both are Hugging Face models of the config's family (``families.py``: llama, mistral, qwen2,
qwen3, qwen3_moe; a dict without ``model_type`` is Llama) built from a config dict (or config
object), fp32, sdpa attention, weights drawn from ``torch.manual_seed(seed)`` — identical on every
rank that builds them, so an engine can shard a model each rank built for itself.

- ``causal_lm``: ``<Family>ForCausalLM`` — the actor, the reference, the SFT warm start;
- ``value_model``: ``<Family>ForTokenClassification`` with one label — the PPO critic: the same
  trunk with a scalar head (optionally the trunk of an actor checkpoint);
- ``model_spec(hf_config, head)``: the VPS description of either (``head`` ``"lm"`` or ``"value"``),
  derived from the model itself (``families.derive_spec``): names and order equal to the model's
  ``named_parameters()`` (a MoE layer's stacked experts appear per expert: see ``families``);
- ``family_problems(hf_config)``: why a config's model cannot run here (unknown ``model_type``, …).

This module sits below the engines and the RL code: both build models from here.
"""
from __future__ import annotations

import glob
import os
from typing import Any, Literal, Mapping

import torch
from torch import nn

from .families import derive_spec, family_problems, hf_config_object, model_class
from .vps import ModelSpec

__all__ = ["HEADS", "build_model", "causal_lm", "family_problems", "load_trunk", "model_spec",
           "value_model", "value_spec"]

Head = Literal["lm", "value"]
HEADS = ("lm", "value")


def _hidden(cfg: Any) -> int:
    return int(cfg["hidden_size"] if isinstance(cfg, Mapping) else cfg.hidden_size)


def causal_lm(hf_config: Any, seed: int) -> nn.Module:
    """The HF ``<Family>ForCausalLM`` of ``hf_config`` (dict or config), fp32, sdpa attention, with
    weights drawn from ``torch.manual_seed(seed)``: identical on every rank."""
    cfg = hf_config_object(hf_config)
    cfg._attn_implementation = "sdpa"  # the pipeline stages call it directly; keep one kernel everywhere
    torch.manual_seed(seed)
    return model_class(hf_config, "lm")(cfg).float().train()


def value_model(hf_config: Any, seed: int, init_from: str | None = None,
                head_std: float | None = None) -> nn.Module:
    """``<Family>ForTokenClassification`` (``num_labels=1``) of ``hf_config`` (dict or config): fp32,
    sdpa attention, no dropout, weights from ``torch.manual_seed(seed)`` — identical on every rank.

    ``init_from``: a directory with a safetensors checkpoint of the family's causal LM (one
    ``model.safetensors`` or shards ``*.safetensors``); its trunk ``model.*`` replaces the seeded
    trunk (all of it: a missing or misshapen tensor raises). ``head_std``: std of the value
    head's weight (default ``1/(hidden+1)``, OpenRLHF's choice; 0 = zeros); its bias is 0."""
    cfg = hf_config_object(hf_config)
    cfg.num_labels = 1
    cfg.classifier_dropout = 0.0  # transformers' default would be 0.1: a noisy critic
    cfg.use_cache = False
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = model_class(hf_config, "value")(cfg).float()
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
    """Copy the ``model.*`` tensors of a safetensors HF checkpoint (the family's causal LM) into
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


def value_spec(hf_config: Any, name: str | None = None) -> ModelSpec:
    """The VPS description of ``value_model``: the trunk's tensors, no LM head, and the value head
    ``score.weight [1, H]`` (+ ``score.bias [1]`` where the family has one), replicated: no TP rule
    splits a 1-row head. Names and order equal ``value_model(...).named_parameters()``."""
    return derive_spec(hf_config, "value", name)


def build_model(hf_config: Any, seed: int, head: Head = "lm", init_from: str | None = None) -> nn.Module:
    """The model of ``head``: ``causal_lm`` or ``value_model`` (whose trunk may come from ``init_from``)."""
    if head == "lm":
        return causal_lm(hf_config, seed)
    if head == "value":
        return value_model(hf_config, seed, init_from=init_from)
    raise ValueError(f"unknown model head {head!r} (known: {', '.join(HEADS)})")


def model_spec(hf_config: Any, head: Head = "lm") -> ModelSpec:
    """The VPS description of ``build_model(hf_config, seed, head)``."""
    if head == "lm":
        return derive_spec(hf_config, "lm")
    if head == "value":
        return value_spec(hf_config)
    raise ValueError(f"unknown model head {head!r} (known: {', '.join(HEADS)})")
