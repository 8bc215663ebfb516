"""What one iteration of a run asks of the machine, from its config: the model's sizes and the
batch shapes of each phase. Pure numbers; the cost and memory models read only these."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from ..families import derive_spec
from ..rl import config as rlconfig
from ..rl.config import RunConfig
from ..vps.spec import ModelSpec, itemsize

# a data: run's prompts are as long as the files make them; without max_prompt_tokens the model
# assumes this many tokens (the GSM8K-format prompts with a chat template are ~100-200)
DEFAULT_DATA_PROMPT_TOKENS = 256


@dataclass(frozen=True)
class Workload:
    hf_config: dict
    dtype: str                 # the model's (training and rollout weights)
    rollout_batch: int         # sequences generated per iteration
    mini_batch: int            # sequences per optimizer step
    micro_batch: int           # sequences per forward (per DP rank)
    epochs: int
    prompt_tokens: int
    new_tokens: int
    has_reference: bool
    has_critic: bool
    logprob_micro_batch: int | None = None  # sequences per forward of the log-prob passes (None: micro_batch)

    @classmethod
    def from_config(cls, cfg: RunConfig, hf_config: dict | None = None) -> "Workload":
        algo = cfg.algorithm
        hf = dict(hf_config) if hf_config is not None else _hf_config(cfg)
        return cls(hf_config=hf, dtype=compute_dtype_of(cfg), rollout_batch=algo.rollout_batch_size,
                   mini_batch=algo.train_batch_size, micro_batch=algo.micro_batch_size, epochs=algo.epochs,
                   prompt_tokens=_prompt_tokens(cfg), new_tokens=algo.max_new_tokens,
                   has_reference=cfg.reference is not None, has_critic=cfg.critic is not None,
                   logprob_micro_batch=algo.logprob_micro_batch_size)

    # --- the model ---------------------------------------------------------------------------
    @cached_property
    def spec(self) -> ModelSpec:
        return derive_spec(self.hf_config, "lm")

    @cached_property
    def value_spec(self) -> ModelSpec:
        return derive_spec(self.hf_config, "value")

    @property
    def dims(self) -> rlconfig.ModelDims:
        return rlconfig.ModelDims.from_hf_config(self.hf_config)

    @property
    def bytes_per_param(self) -> int:
        return itemsize(self.dtype)

    @property
    def seq(self) -> int:
        return self.prompt_tokens + self.new_tokens

    @property
    def head_dim(self) -> int:
        return int(self.hf_config.get("head_dim") or self.dims.hidden_size // self.dims.num_heads)

    def params(self, head: str = "lm") -> int:
        return (self.spec if head == "lm" else self.value_spec).numel

    @cached_property
    def matmul_params(self) -> float:
        """Parameters one token multiplies through (no embedding lookup; MoE: the routed
        ``num_experts_per_tok`` of ``num_experts``)."""
        experts = int(self.hf_config.get("num_experts") or 0)
        routed = int(self.hf_config.get("num_experts_per_tok") or 0)
        total = 0.0
        for t in self.spec.tensors:
            if t.name.endswith("embed_tokens.weight") and not self.spec.tied_lm_head:
                continue
            if len(t.shape) < 2:
                continue
            share = routed / experts if t.expert is not None and experts else 1.0
            total += t.numel * share
        return total

    def forward_flops_per_token(self) -> float:
        """2 FLOPs per multiplied parameter, plus attention scores and values over the sequence."""
        d = self.dims
        attn = 4 * d.num_layers * d.num_heads * self.head_dim * self.seq
        return 2 * self.matmul_params + attn

    def layer_params(self) -> float:
        """Parameters of one decoder layer (all experts)."""
        return sum(t.numel for t in self.spec.tensors if t.layer == 0)


def _hf_config(cfg: RunConfig) -> dict:
    if cfg.model.hf_config is not None:
        hf = dict(cfg.model.hf_config)
    else:
        import json
        from pathlib import Path
        hf = json.loads((Path(cfg.model.path) / "config.json").read_text())
    hf.setdefault("torch_dtype", compute_dtype_of(cfg))
    return hf


def compute_dtype_of(cfg: RunConfig) -> str:
    """The compute dtype the run would have: ``model.dtype``, else its device's default
    (``rlhf_switch.device``: bf16 on ``device: cuda``; ``auto`` is modelled as the CPU default,
    float32 — set ``model.dtype`` or ``device: cuda`` to model bf16)."""
    from ..device import DEFAULT_COMPUTE_DTYPE

    return cfg.model.dtype or DEFAULT_COMPUTE_DTYPE["cuda" if cfg.device == "cuda" else "cpu"]


def _prompt_tokens(cfg: RunConfig) -> int:
    if cfg.task is not None:
        return rlconfig.task_prompt_tokens(cfg)
    return cfg.data.max_prompt_tokens or DEFAULT_DATA_PROMPT_TOKENS
