"""Model families: which Hugging Face classes build a ``model_type``, and how each of its
parameters sits in the VPS (its tensor-parallel role, its layer, the buffers it may fuse into).

=============  ============================================================================
``llama``      the base decoder: q/k/v/o, gate/up/down, RMS norms (optional attention/MLP biases)
``mistral``    Llama's tensors (its sliding window is a compute rule, refused when in use)
``qwen2``      Llama's tensors + q/k/v biases (fused like their weights: ``qkv_proj.bias``)
``qwen3``      Llama's tensors + per-head ``q_norm``/``k_norm`` [head_dim], replicated
``qwen3_moe``  Qwen3 attention + a router ``mlp.gate`` [E, H] (replicated) + E experts per layer
=============  ============================================================================

The spec comes from the model itself: ``derive_spec`` builds the model on the meta device (no
storage), walks ``named_parameters()`` (names, shapes, order) and applies the role rules below.
A parameter no rule names is an error, never a silent ``replicate``.

**Experts (qwen3_moe).** transformers 5 holds a layer's experts stacked in memory:
``mlp.experts.gate_up_proj`` [E, 2I, H] (per expert ``[gate; up]``) and ``mlp.experts.down_proj``
[E, H, I]. ``save_pretrained`` writes them per expert (``mlp.experts.{e}.gate_proj.weight`` [I, H],
``up_proj``, ``down_proj`` [H, I]) and vLLM's Qwen3-MoE loader reads exactly those names. The spec
uses the **per-expert checkpoint names**: they are the addresses every checkpoint and vLLM agree
on, expert parallelism places whole experts (``TensorSpec.expert``), and vLLM's ``w13``/``w2``
buffers are per-expert fusions of them. The stacked in-memory tensors are then a *layout* of
those addresses (``stacked_experts`` says where each expert's tensors sit in them): FSDP2
(sharded on the expert dim) and DeepSpeed ZeRO (flat partitions cut at the per-expert blocks)
describe them per expert (``engines/dtensor_adapter.py``, ``engines/deepspeed_zero.py``); DTensor
TP and pipeline stages do not, so those engines refuse qwen3_moe (their ``layout_problems`` say
so). The spec's order is the model's, each stacked parameter expanded in place expert by expert
(gate, up of expert 0, gate, up of expert 1, …; then every expert's down).
"""
from __future__ import annotations

import copy
import functools
import json
import re
from dataclasses import dataclass
from typing import Any, Mapping

from .vps.spec import AttentionGeometry, FusedGroup, ModelSpec, TensorSpec, config_dtype

DEFAULT_MODEL_TYPE = "llama"  # the configs written before families existed carry no model_type
# transformers' LlamaConfig default for ``max_position_embeddings``: the context of a config dict
# that leaves the field out
DEFAULT_CONTEXT = 2048


def context_length(hf_config: Mapping[str, Any]) -> int:
    """The model's context (``max_position_embeddings``; transformers' Llama default when unset)."""
    return int(hf_config.get("max_position_embeddings") or DEFAULT_CONTEXT)


@dataclass(frozen=True)
class Family:
    model_type: str
    config_class: str  # transformers class names: imported only when a model is built
    causal_lm_class: str
    value_class: str  # XForTokenClassification with num_labels=1: the critic
    moe: bool = False


FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("llama", "LlamaConfig", "LlamaForCausalLM", "LlamaForTokenClassification"),
    Family("mistral", "MistralConfig", "MistralForCausalLM", "MistralForTokenClassification"),
    Family("qwen2", "Qwen2Config", "Qwen2ForCausalLM", "Qwen2ForTokenClassification"),
    Family("qwen3", "Qwen3Config", "Qwen3ForCausalLM", "Qwen3ForTokenClassification"),
    Family("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", "Qwen3MoeForTokenClassification", moe=True),
)}

# (pattern on the name inside a decoder layer, TP role); every family shares these names. A row
# layer's bias is added after the all-reduce, so it is whole on every rank.
LAYER_RULES: tuple[tuple[str, str], ...] = (
    (r"self_attn\.[qkv]_proj\.(weight|bias)", "column"),
    (r"self_attn\.o_proj\.weight", "row"),
    (r"self_attn\.o_proj\.bias", "replicate"),
    (r"self_attn\.[qk]_norm\.weight", "replicate"),  # per head: every head's rank needs all of it
    (r"mlp\.(gate|up)_proj\.(weight|bias)", "column"),
    (r"mlp\.down_proj\.weight", "row"),
    (r"mlp\.down_proj\.bias", "replicate"),
    (r"mlp\.gate\.weight", "replicate"),  # the MoE router: every rank routes every token
    (r"mlp\.experts\.\d+\.(gate|up)_proj\.weight", "column"),
    (r"mlp\.experts\.\d+\.down_proj\.weight", "row"),
    (r"(input|post_attention)_layernorm\.weight", "replicate"),
)
# outside the layers: (name, role, pipeline anchor)
END_RULES: dict[str, tuple[str, str]] = {
    "model.embed_tokens.weight": ("vocab", "first"),
    "model.norm.weight": ("replicate", "last"),
    "lm_head.weight": ("vocab", "last"),
    "score.weight": ("replicate", "last"),  # the value head: one row, no TP rule splits it
    "score.bias": ("replicate", "last"),
}
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.*)")
_RULES = tuple((re.compile(p), role) for p, role in LAYER_RULES)


def config_dict(hf_config: Any) -> dict:
    """``hf_config`` (dict or transformers config) as a plain dict with its ``model_type``."""
    if isinstance(hf_config, Mapping):
        d = dict(hf_config)
    else:
        d = hf_config.to_dict()
    d.setdefault("model_type", DEFAULT_MODEL_TYPE)
    return d


def model_type(hf_config: Any) -> str:
    if isinstance(hf_config, Mapping):
        return str(hf_config.get("model_type") or DEFAULT_MODEL_TYPE)
    return str(getattr(hf_config, "model_type", None) or DEFAULT_MODEL_TYPE)


def family(hf_config: Any) -> Family:
    """The family of ``hf_config``; an unknown ``model_type`` raises naming it and the known ones."""
    problems = family_problems(hf_config)
    if problems:
        raise ValueError("; ".join(problems))
    return FAMILIES[model_type(hf_config)]


def family_problems(hf_config: Any) -> list[str]:
    """Why this package cannot run ``hf_config``'s model (empty when it can): an unknown
    ``model_type``, or a feature the families' rules do not express. Sliding-window attention is
    refused: the torch engines and pipeline stages call full causal sdpa attention, so the trainer
    and a rollout engine honouring the window would compute different models."""
    mt = model_type(hf_config)
    if mt not in FAMILIES:
        return [f"model_type {mt!r} is not supported (known: {', '.join(FAMILIES)})"]
    cfg = config_dict(hf_config)
    problems = []
    window = cfg.get("sliding_window")
    uses_window = cfg.get("use_sliding_window", mt == "mistral")  # Mistral has no switch: the window is on
    if window is not None and uses_window and int(window) < int(cfg.get("max_position_embeddings") or 0):
        problems.append(f"model_type {mt!r}: sliding_window={window} is not supported (attention here is "
                        f"full causal; set sliding_window to null or use_sliding_window to false)")
    return problems


DENSE = ("llama", "mistral", "qwen2", "qwen3")  # no MoE layer


def engine_family_problems(phase: str, engine: str, dims: Any, runs: tuple[str, ...], why: str) -> list[str]:
    """An engine's refusal of a model family: ``dims`` (``rl.config.ModelDims`` or None) names the
    ``model_type``; ``runs`` the families the engine runs; ``why`` says what stops the others."""
    mt = getattr(dims, "model_type", None) or DEFAULT_MODEL_TYPE
    if mt in runs or mt not in FAMILIES:  # an unknown family is family_problems' to report
        return []
    return [f"{phase}: engine {engine} cannot run model_type {mt!r}: {why} (it runs {', '.join(runs)})"]


def hf_config_object(hf_config: Any):
    """A transformers config of the family's class from a dict (a config object is copied)."""
    import transformers

    if not isinstance(hf_config, Mapping):
        return copy.deepcopy(hf_config)
    fam = family(hf_config)
    kwargs = {k: v for k, v in hf_config.items() if k != "model_type"}
    return getattr(transformers, fam.config_class)(**kwargs)


def model_class(hf_config: Any, head: str):
    import transformers

    fam = family(hf_config)
    return getattr(transformers, fam.causal_lm_class if head == "lm" else fam.value_class)


def derive_spec(hf_config: Any, head: str = "lm", name: str | None = None) -> ModelSpec:
    """The VPS spec of the family's model of ``head`` (``lm`` or ``value``), from the model
    itself built on the meta device. Cached per config."""
    return _derive(json.dumps(config_dict(hf_config), sort_keys=True, default=str), head, name)


@functools.lru_cache(maxsize=64)
def _derive(config_json: str, head: str, name: str | None) -> ModelSpec:
    import torch

    cfg = json.loads(config_json)
    fam = family(cfg)
    obj = hf_config_object(cfg)
    if head == "value":
        obj.num_labels = 1
    with torch.device("meta"):
        model = model_class(cfg, head)(obj)
    dtype = config_dtype(cfg)
    tensors: list[TensorSpec] = []
    for pname, p in model.named_parameters():
        tensors += _tensors_of(pname, tuple(p.shape), dtype)
    layers = int(cfg["num_hidden_layers"])
    nh = int(cfg["num_attention_heads"])
    nkv = int(cfg.get("num_key_value_heads") or nh)
    hd = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // nh)
    names = {t.name for t in tensors}
    tied = head == "lm" and "lm_head.weight" not in names
    label = name or (fam.model_type if head == "lm" else f"{fam.model_type}-value")
    # from the model, not the config: transformers 5 writes Qwen3-MoE's num_experts as num_local_experts
    experts = len({t.expert for t in tensors if t.expert is not None})
    return ModelSpec(label, tuple(tensors), layers, AttentionGeometry(nh, nkv, hd),
                     _fused_groups(names, layers), tied, experts)


def stacked_experts(pname: str, shape: tuple[int, ...]) -> list[tuple[str, int, int, int]] | None:
    """Where the per-expert tensors sit in a stacked expert parameter of transformers 5:
    ``(tensor name, expert e, first row, end row)`` — tensor = ``param[e, first:end]`` — or None
    for any other parameter. ``mlp.experts.gate_up_proj`` [E, 2I, H] holds per expert
    ``gate_proj`` (rows ``[0, I)``) then ``up_proj`` (``[I, 2I)``); ``mlp.experts.down_proj``
    [E, H, I] holds ``down_proj`` whole."""
    m = _LAYER.fullmatch(pname)
    if m is None or m.group(2) not in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):
        return None
    prefix = f"model.layers.{m.group(1)}.mlp.experts."
    if m.group(2) == "mlp.experts.down_proj":
        return [(f"{prefix}{e}.down_proj.weight", e, 0, shape[1]) for e in range(shape[0])]
    half = shape[1] // 2
    return [(f"{prefix}{e}.{w}_proj.weight", e, i * half, (i + 1) * half)
            for e in range(shape[0]) for i, w in enumerate(("gate", "up"))]


def _tensors_of(pname: str, shape: tuple[int, ...], dtype: str) -> list[TensorSpec]:
    """The spec tensors of one model parameter: itself, or a stacked expert tensor expanded into
    its per-expert checkpoint tensors (see the module docstring)."""
    if pname in END_RULES:
        role, anchor = END_RULES[pname]
        return [TensorSpec(pname, shape, dtype, role, anchor=anchor)]
    m = _LAYER.fullmatch(pname)
    if m is None:
        raise ValueError(f"parameter {pname!r} is outside the decoder layers and no family rule names it")
    layer, rest = int(m.group(1)), m.group(2)
    stacked = stacked_experts(pname, shape)
    if stacked is not None:  # gate/up column-parallel, down row-parallel, as the dense MLP
        return [TensorSpec(name, (hi - lo,) + shape[2:], dtype, "row" if name.endswith("down_proj.weight")
                           else "column", layer, expert=e) for name, e, lo, hi in stacked]
    for rule, role in _RULES:
        if rule.fullmatch(rest):
            return [TensorSpec(pname, shape, dtype, role, layer)]
    raise ValueError(f"parameter {pname!r}: no family rule gives its tensor-parallel role")


def _fused_groups(names: set[str], layers: int) -> tuple[FusedGroup, ...]:
    """The buffers a layout may fuse (vLLM's, Megatron's): ``qkv_proj`` weight and bias,
    ``gate_up_proj`` weight and bias, and a MoE layer's ``experts.w13_weight`` (per expert
    ``[gate; up]``) and ``experts.w2_weight`` (per expert ``down``)."""
    out: list[FusedGroup] = []
    for i in range(layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        for kind in ("weight", "bias"):
            qkv = tuple(f"{a}{x}_proj.{kind}" for x in "qkv")
            if all(n in names for n in qkv):
                out.append(FusedGroup(f"{a}qkv_proj.{kind}", qkv, "qkv"))
        for kind in ("weight", "bias"):
            gate_up = (f"{m}gate_proj.{kind}", f"{m}up_proj.{kind}")
            if all(n in names for n in gate_up):
                out.append(FusedGroup(f"{m}gate_up_proj.{kind}", gate_up, "concat"))
        experts = sorted({int(n[len(m) + 8:].split(".")[0]) for n in names if n.startswith(m + "experts.")})
        if experts:
            out.append(FusedGroup(m + "experts.w13_weight", tuple(f"{m}experts.{e}.{w}_proj.weight"
                                                                  for e in experts for w in ("gate", "up")), "concat"))
            out.append(FusedGroup(m + "experts.w2_weight",
                                  tuple(f"{m}experts.{e}.down_proj.weight" for e in experts), "concat"))
    return tuple(out)
