"""Model specs: the names, global shapes, dtypes and parallel roles of a model's tensors.

A spec is metadata only — it is derived from a transformers config without allocating a single
weight, so layouts for a 70B model can be built on a laptop. Each tensor carries the facts the
layout families need:

- ``tp``: how Megatron-style tensor parallelism splits it — ``column`` (dim 0), ``row`` (dim 1),
  ``vocab`` (dim 0 of an embedding / LM head, may be padded) or ``replicate``;
- ``layer``: its decoder layer, or ``None`` with ``anchor`` = ``first`` / ``last`` for the tensors
  pipeline parallelism pins to the end stages (embedding; final norm and LM head).

Fused buffers (QKV, gate-up) are a property of a *layout*, not of the model: the spec only lists
which tensors may be fused (``FusedGroup``) and the attention geometry needed to interleave them.

LoRA adapters are tensors of the spec like any other (``ModelSpec.with_adapters``): for a target
``W`` [out, in] of a layer, ``….lora_A.weight`` [r, in] and ``….lora_B.weight`` [out, r], with
the TP roles that keep ``B·A`` a block of ``W``'s own shard (a column target splits ``B`` on its
rows, a row target ``A`` on its columns; the other factor is whole), and ``B`` fused like ``W``
(``qkv_proj.lora_B.weight``). Every layout family then places them by the rules it already has.
A spec with adapters says which tensors train (``trainable``): the adapters; the base is frozen.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

DTYPE_BYTES = {
    "float64": 8, "float32": 4, "bfloat16": 2, "float16": 2,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1,
}
TP_ROLES = ("column", "row", "vocab", "replicate")


def itemsize(dtype: str) -> int:
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}") from None


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"
    tp: str = "replicate"
    layer: int | None = None
    anchor: str | None = None  # "first" / "last" stage when layer is None
    expert: int | None = None  # MoE expert index: expert parallelism places it whole on one EP rank

    def __post_init__(self):
        if self.tp not in TP_ROLES:
            raise ValueError(f"{self.name}: tp role {self.tp!r} is not one of {TP_ROLES}")
        if not self.shape or any(int(s) <= 0 for s in self.shape):
            raise ValueError(f"{self.name}: shape {self.shape} must have ndim >= 1 and positive sizes")
        if self.tp == "row" and len(self.shape) < 2:
            raise ValueError(f"{self.name}: a row-parallel tensor needs ndim >= 2, has shape {self.shape}")
        itemsize(self.dtype)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True)
class FusedGroup:
    """Tensors a layout may store in one buffer: ``style`` is ``qkv`` (grouped-query interleave)
    or ``concat`` (per-rank shards stacked on dim 0, e.g. ``[gate; up]``)."""

    buffer: str
    members: tuple[str, ...]
    style: str = "concat"


@dataclass(frozen=True)
class AttentionGeometry:
    num_heads: int
    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class LoraSpec:
    """LoRA adapters on the tensors ``model.layers.{i}.….{target}.weight`` for each name of
    ``targets`` (``q_proj``, …): the layer computes ``W·x + scaling·B·(A·x)``, and its merged weight
    is peft's ``W + (B @ A) * scaling`` with ``scaling = alpha / r``."""

    r: int
    alpha: float
    targets: tuple[str, ...]

    def __post_init__(self):
        if self.r < 1 or not self.targets:
            raise ValueError(f"LoRA needs r >= 1 and at least one target module, got r={self.r}, "
                             f"targets={self.targets}")

    @property
    def scaling(self) -> float:
        return self.alpha / self.r


ADAPTER_FACTORS = ("lora_A", "lora_B")


def adapter_names(target: str) -> tuple[str, str]:
    """The (A, B) tensor names of target tensor ``target`` (``….q_proj.weight``)."""
    stem = target[: -len(".weight")]
    return f"{stem}.lora_A.weight", f"{stem}.lora_B.weight"


@dataclass(frozen=True)
class ModelSpec:
    name: str
    tensors: tuple[TensorSpec, ...]
    num_layers: int = 0
    attention: AttentionGeometry | None = None
    fused: tuple[FusedGroup, ...] = ()
    tied_lm_head: bool = False  # LM head shares the embedding tensor (no lm_head.weight)
    num_experts: int = 0
    lora: LoraSpec | None = None  # the adapters among ``tensors`` (with_adapters); None: none
    _by_name: Mapping[str, TensorSpec] = field(default=None, compare=False, repr=False, hash=False)

    def __post_init__(self):
        by_name = {}
        for t in self.tensors:
            if t.name in by_name:
                raise ValueError(f"model spec {self.name!r} lists tensor {t.name!r} twice")
            if t.layer is not None and not 0 <= t.layer < self.num_layers:
                raise ValueError(f"{t.name}: layer {t.layer} outside 0..{self.num_layers - 1}")
            by_name[t.name] = t
        for g in self.fused:
            missing = [m for m in g.members if m not in by_name]
            if missing:
                raise ValueError(f"fused group {g.buffer!r} names unknown tensors {missing}")
        object.__setattr__(self, "_by_name", by_name)

    def __getitem__(self, name: str) -> TensorSpec:
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"model {self.name!r} has no tensor {name!r}") from None

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def order(self, name: str) -> int:
        return self._order()[name]

    def _order(self) -> Mapping[str, int]:
        cached = self.__dict__.get("_order_cache")
        if cached is None:
            cached = {t.name: i for i, t in enumerate(self.tensors)}
            object.__setattr__(self, "_order_cache", cached)
        return cached

    @property
    def numel(self) -> int:
        return sum(t.numel for t in self.tensors)

    @property
    def digest(self) -> str:
        cached = self.__dict__.get("_digest")
        if cached is None:
            # the name is a label, not geometry: equal tensors under two names are one model
            geometry = (self.tensors, self.num_layers, self.attention, self.fused, self.tied_lm_head,
                        self.num_experts) + ((self.lora,) if self.lora is not None else ())
            h = hashlib.sha256(repr(geometry).encode())
            cached = h.hexdigest()[:16]
            object.__setattr__(self, "_digest", cached)
        return cached

    # --- LoRA adapters ------------------------------------------------------------------------------
    def lora_targets(self, targets: Sequence[str]) -> tuple[str, ...]:
        """The tensors of decoder layers that the module names ``targets`` (``q_proj``, …) adapt:
        each layer's ``….{target}.weight`` of ndim 2, in spec order (MoE experts excluded: a stacked
        expert tensor is no linear module LoRA can wrap)."""
        ends = tuple(f".{t}.weight" for t in targets)
        return tuple(t.name for t in self.tensors if t.layer is not None and t.expert is None
                     and len(t.shape) == 2 and t.name.endswith(ends) and ".lora_" not in t.name)

    def with_adapters(self, lora: LoraSpec) -> "ModelSpec":
        """This spec plus LoRA's ``A`` and ``B`` for every target (``lora_targets``), each pair right
        after its target, in the target's dtype; ``B`` of a fused group's targets fused like them."""
        if self.lora is not None:
            raise ValueError(f"model {self.name!r} already has LoRA adapters")
        targets = set(self.lora_targets(lora.targets))
        missing = [t for t in lora.targets if not any(n.endswith(f".{t}.weight") for n in targets)]
        if missing:
            raise ValueError(f"model {self.name!r} has no LoRA target {', '.join(missing)}")
        tensors: list[TensorSpec] = []
        for t in self.tensors:
            tensors.append(t)
            if t.name in targets:
                out, inp = t.shape
                a, b = adapter_names(t.name)
                # column target: B splits with W's rows, A whole; row target: A splits with W's
                # columns, B whole; a whole W: both whole
                tensors.append(TensorSpec(a, (lora.r, inp), t.dtype, "row" if t.tp == "row" else "replicate", t.layer))
                tensors.append(TensorSpec(b, (out, lora.r), t.dtype, "column" if t.tp == "column"
                                          else "replicate", t.layer))
        fused = list(self.fused)
        for g in self.fused:
            if g.buffer.endswith(".weight") and all(m in targets for m in g.members):
                fused.append(FusedGroup(adapter_names(g.buffer)[1], tuple(adapter_names(m)[1] for m in g.members),
                                        g.style))
        return ModelSpec(self.name, tuple(tensors), self.num_layers, self.attention, tuple(fused),
                         self.tied_lm_head, self.num_experts, lora)

    def is_adapter(self, name: str) -> bool:
        return self.lora is not None and name.endswith((".lora_A.weight", ".lora_B.weight"))

    def trainable(self, name: str) -> bool:
        """Whether the optimizer steps tensor ``name`` (and keeps moments of it): every tensor,
        or with LoRA adapters only those."""
        return self.lora is None or self.is_adapter(name)

    @property
    def adapter_tensors(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tensors if self.is_adapter(t.name))

    @property
    def adapted_tensors(self) -> tuple[str, ...]:
        """The base tensors the adapters change (their targets), in spec order."""
        return self.lora_targets(self.lora.targets) if self.lora is not None else ()

    def subset(self, tensors: Sequence[str], label: str) -> "ModelSpec":
        """The model of only ``tensors`` (in spec order; fused groups of which all are kept), named
        ``<name>[<label>]``: what a move of part of a model (a LoRA sync) is a move of — layouts of it
        cover those tensors and nothing else (``vps.layout.select``)."""
        wanted = set(tensors)
        unknown = sorted(wanted - set(self._by_name))
        if unknown:
            raise KeyError(f"model {self.name!r} has no tensors {unknown[:3]}")
        return ModelSpec(f"{self.name}[{label}]", tuple(t for t in self.tensors if t.name in wanted), self.num_layers,
                         self.attention, tuple(g for g in self.fused if all(m in wanted for m in g.members)),
                         self.tied_lm_head, self.num_experts)

    def base(self) -> "ModelSpec":
        """This spec without its adapters (the model a checkpoint's ``model.safetensors`` holds)."""
        if self.lora is None:
            return self
        adapters = set(self.adapter_tensors)
        return ModelSpec(self.name, tuple(t for t in self.tensors if t.name not in adapters), self.num_layers,
                         self.attention, tuple(g for g in self.fused if g.members[0] not in adapters),
                         self.tied_lm_head, self.num_experts)


def config_value(config: Any, name: str, default: Any = None) -> Any:
    """A field of a HF config given as a dict or as a ``PretrainedConfig``."""
    if isinstance(config, Mapping):
        return config.get(name, default)
    return getattr(config, name, default)


def config_dtype(config: Any) -> str:
    """The parameter dtype a config names (``float32`` when it names none)."""
    # transformers 5 calls it `dtype` (reading `torch_dtype` warns); older configs, dicts: torch_dtype
    if isinstance(config, Mapping) or not hasattr(config, "dtype"):
        found = config_value(config, "dtype") or config_value(config, "torch_dtype")
    else:
        found = config.dtype
    return str(found or "float32").replace("torch.", "")


def llama_spec(config: Any, dtype: str | None = None, name: str = "llama") -> ModelSpec:
    """Spec of a Hugging Face ``LlamaForCausalLM`` (and Llama-shaped models: Qwen2, Mistral)
    from its config object or dict. Names and order equal ``model.named_parameters()``."""
    H = int(config_value(config, "hidden_size"))
    L = int(config_value(config, "num_hidden_layers"))
    nh = int(config_value(config, "num_attention_heads"))
    nkv = int(config_value(config, "num_key_value_heads") or nh)
    hd = int(config_value(config, "head_dim") or H // nh)
    inter = int(config_value(config, "intermediate_size"))
    V = int(config_value(config, "vocab_size"))
    tied = bool(config_value(config, "tie_word_embeddings", False))
    attn_bias = bool(config_value(config, "attention_bias", False))
    mlp_bias = bool(config_value(config, "mlp_bias", False))
    dtype = dtype or config_dtype(config)
    itemsize(dtype)

    tensors: list[TensorSpec] = [TensorSpec("model.embed_tokens.weight", (V, H), dtype, "vocab", anchor="first")]
    fused: list[FusedGroup] = []
    for i in range(L):
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."

        def t(n, shape, tp):
            tensors.append(TensorSpec(n, shape, dtype, tp, layer=i))

        t(a + "q_proj.weight", (nh * hd, H), "column")
        if attn_bias:
            t(a + "q_proj.bias", (nh * hd,), "column")
        t(a + "k_proj.weight", (nkv * hd, H), "column")
        if attn_bias:
            t(a + "k_proj.bias", (nkv * hd,), "column")
        t(a + "v_proj.weight", (nkv * hd, H), "column")
        if attn_bias:
            t(a + "v_proj.bias", (nkv * hd,), "column")
        t(a + "o_proj.weight", (H, nh * hd), "row")
        if attn_bias:
            t(a + "o_proj.bias", (H,), "replicate")
        t(m + "gate_proj.weight", (inter, H), "column")
        if mlp_bias:
            t(m + "gate_proj.bias", (inter,), "column")
        t(m + "up_proj.weight", (inter, H), "column")
        if mlp_bias:
            t(m + "up_proj.bias", (inter,), "column")
        t(m + "down_proj.weight", (H, inter), "row")
        if mlp_bias:
            t(m + "down_proj.bias", (H,), "replicate")
        t(p + "input_layernorm.weight", (H,), "replicate")
        t(p + "post_attention_layernorm.weight", (H,), "replicate")
        fused.append(FusedGroup(a + "qkv_proj.weight", (a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"), "qkv"))
        if attn_bias:
            fused.append(FusedGroup(a + "qkv_proj.bias", (a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"), "qkv"))
        fused.append(FusedGroup(m + "gate_up_proj.weight", (m + "gate_proj.weight", m + "up_proj.weight"), "concat"))
        if mlp_bias:
            fused.append(FusedGroup(m + "gate_up_proj.bias", (m + "gate_proj.bias", m + "up_proj.bias"), "concat"))
    tensors.append(TensorSpec("model.norm.weight", (H,), dtype, "replicate", anchor="last"))
    if not tied:
        tensors.append(TensorSpec("lm_head.weight", (V, H), dtype, "vocab", anchor="last"))
    return ModelSpec(name, tuple(tensors), L, AttentionGeometry(nh, nkv, hd), tuple(fused), tied)


def qwen3_moe_spec(config: Any, dtype: str | None = None, name: str = "qwen3-moe") -> ModelSpec:
    """Spec of a Qwen3-MoE model with *per-expert* tensors (``mlp.experts.{e}.gate_proj.weight`` —
    the checkpoint names vLLM's loader reads; transformers 5 stacks them in memory, which is a
    layout, not a different state). Every layer is sparse (Qwen3-235B-A22B: 94 layers × 128
    experts). vLLM stacks a layer's experts into ``w13_weight`` = per expert ``[gate_t; up_t]``
    and ``w2_weight`` = per expert ``down_t``: fused groups here."""
    H = int(config_value(config, "hidden_size"))
    L = int(config_value(config, "num_hidden_layers"))
    nh = int(config_value(config, "num_attention_heads"))
    nkv = int(config_value(config, "num_key_value_heads") or nh)
    hd = int(config_value(config, "head_dim") or H // nh)
    inter = int(config_value(config, "moe_intermediate_size"))
    E = int(config_value(config, "num_experts"))
    V = int(config_value(config, "vocab_size"))
    tied = bool(config_value(config, "tie_word_embeddings", False))
    dtype = dtype or str(config_value(config, "dtype") or config_value(config, "torch_dtype") or "float32").replace("torch.", "")
    tensors = [TensorSpec("model.embed_tokens.weight", (V, H), dtype, "vocab", anchor="first")]
    fused: list[FusedGroup] = []
    for i in range(L):
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        tensors += [TensorSpec(a + "q_proj.weight", (nh * hd, H), dtype, "column", i),
                    TensorSpec(a + "k_proj.weight", (nkv * hd, H), dtype, "column", i),
                    TensorSpec(a + "v_proj.weight", (nkv * hd, H), dtype, "column", i),
                    TensorSpec(a + "o_proj.weight", (H, nh * hd), dtype, "row", i),
                    TensorSpec(a + "q_norm.weight", (hd,), dtype, "replicate", i),
                    TensorSpec(a + "k_norm.weight", (hd,), dtype, "replicate", i),
                    TensorSpec(m + "gate.weight", (E, H), dtype, "replicate", i)]
        for e in range(E):
            x = f"{m}experts.{e}."
            tensors += [TensorSpec(x + "gate_proj.weight", (inter, H), dtype, "column", i, expert=e),
                        TensorSpec(x + "up_proj.weight", (inter, H), dtype, "column", i, expert=e),
                        TensorSpec(x + "down_proj.weight", (H, inter), dtype, "row", i, expert=e)]
        tensors += [TensorSpec(p + "input_layernorm.weight", (H,), dtype, "replicate", i),
                    TensorSpec(p + "post_attention_layernorm.weight", (H,), dtype, "replicate", i)]
        fused.append(FusedGroup(a + "qkv_proj.weight", (a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"), "qkv"))
        fused.append(FusedGroup(m + "experts.w13_weight", tuple(f"{m}experts.{e}.{w}_proj.weight"
                                                                for e in range(E) for w in ("gate", "up")), "concat"))
        fused.append(FusedGroup(m + "experts.w2_weight", tuple(f"{m}experts.{e}.down_proj.weight" for e in range(E)),
                                "concat"))
    tensors.append(TensorSpec("model.norm.weight", (H,), dtype, "replicate", anchor="last"))
    if not tied:
        tensors.append(TensorSpec("lm_head.weight", (V, H), dtype, "vocab", anchor="last"))
    return ModelSpec(name, tuple(tensors), L, AttentionGeometry(nh, nkv, hd), tuple(fused), tied, E)


def synthetic_spec(shapes: Sequence[tuple[str, tuple[int, ...], str, str]], num_layers: int = 1,
                   name: str = "synthetic") -> ModelSpec:
    """A spec from ``(name, shape, dtype, tp_role)`` rows; tensors are spread over ``num_layers``
    layers in order, so pipeline layouts have something to split."""
    tensors = []
    n = len(shapes)
    for i, (tname, shape, dtype, tp) in enumerate(shapes):
        layer = min(i * num_layers // max(n, 1), num_layers - 1)
        tensors.append(TensorSpec(tname, tuple(shape), dtype, tp, layer=layer))
    return ModelSpec(name, tuple(tensors), num_layers)
