"""A small torch generation engine whose weights sit in exactly vLLM's per-rank layout.

It is the stand-in for vLLM where vLLM cannot run (CPU unit tests, machines without it): one
``TorchRollout`` per rank of a TP group, weights held as the buffers of
``vllm_layout(spec, tp, replicas)`` for that rank (``allocate`` would build the same dict), and a
Llama forward that reads its weights as *views* into those buffers. So

    move(trainer_layout, engine.layout(replicas), trainer_buffers, engine.buffers)

writes the engine's weights in place: no copy, nothing to reload, and the next forward sees them.

Per TP worker ``t`` of ``T`` (see ``vps/layouts/vllm.py``): ``qkv_proj = [q_t; k_t; v_t]`` (one
KV head, replicated, when ``T > KV heads``), ``gate_up_proj = [gate_t; up_t]``, ``o_proj`` and
``down_proj`` split on dim 1 and summed with ``all_reduce``, embedding and LM head split by rows
of the vocabulary padded to 64. Families: llama, mistral, qwen2 (its q/k/v biases fused like the
weights: ``qkv_proj.bias``), qwen3 (per-head ``q_norm``/``k_norm`` before RoPE, whole on every
worker); no MoE. Default RoPE only. Everything is plain torch: CPU float32
in tests, any device the buffers live on otherwise.

LoRA (a spec ``with_adapters``): the adapters are buffers of the same layout (``A`` of a column
target whole, ``B`` split — and fused — like its weight; the reverse for a row target), so a sync
of the adapters alone writes them in place. The base buffers are then the frozen base, read from
the warm start (``load_base``) and never written; with ``apply_adapters`` on, each adapted linear
adds ``B·(A·x)·alpha/r`` to its base output — peft's own arithmetic (``lora_B(lora_A(x)) *
scaling``, the way vLLM's LoRA kernels do it too), on this worker's block; a row-parallel one
before its all-reduce. Merging ``W + (B @ A)·alpha/r`` once per sync would be cheaper per token
but rounds differently from the trainer: measured on ``configs/grpo_tiny_lora.yaml`` (20
iterations), the stale check's largest log-prob difference was 4.2e-5 merged, 1.6e-5 unmerged
(docs/lora.md). A sync
of merged weights writes the base buffers themselves (``apply_adapters`` off).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Collection, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..vps.layout import Layout
from ..vps.layouts.vllm import padded_vocab, vllm_layout, worker_tensors
from ..vps.materialize import allocate
from ..vps.spec import ModelSpec
from ..families import engine_family_problems
from .base import RolloutContext, RolloutEngine, stop_set

# the families whose tensors are all ones forward reads: Llama's (with or without linear biases), per-
# head q/k RMS norms applied before RoPE (qwen3)
DENSE_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
_KNOWN_TENSOR = re.compile(r"model\.embed_tokens\.weight|model\.norm\.weight|lm_head\.weight|model\.layers\.\d+\."
                           r"((self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.(weight|bias)"
                           r"|(input|post_attention)_layernorm\.weight|self_attn\.[qk]_norm\.weight"
                           r"|(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.lora_[AB]\.weight)")


@dataclass
class KVCache:
    """Preallocated keys and values of one batch of requests: per layer ``[B, kv_heads_t, max_len, hd]``."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2]


def _get(config: Any, name: str, default: Any = None) -> Any:
    return config.get(name, default) if isinstance(config, dict) else getattr(config, name, default)


def rope_theta_of(hf_config: Any) -> float:
    """RoPE base of a config (transformers 5 ``rope_parameters`` or older ``rope_theta``);
    refuses scaled RoPE variants, which this engine does not implement."""
    params = _get(hf_config, "rope_parameters") or {}
    scaling = _get(hf_config, "rope_scaling") or {}
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if kind != "default":
        raise NotImplementedError(f"TorchRollout implements default Llama RoPE only, not {kind!r}")
    return float(params.get("rope_theta") or _get(hf_config, "rope_theta") or 10000.0)


class TorchRollout:
    """One TP worker of a Llama generation engine (construct it on every rank of ``group``)."""

    def __init__(self, spec: ModelSpec, *, tp: int = 1, tp_rank: int = 0,
                 group: dist.ProcessGroup | None = None, rms_norm_eps: float = 1e-6,
                 rope_theta: float = 10000.0, dtype: str | None = None, device: str = "cpu"):
        if tp > 1 and (group is None or dist.get_world_size(group) != tp or dist.get_rank(group) != tp_rank):
            raise ValueError(f"TP={tp} worker {tp_rank} needs its TP group (dist.new_group of the "
                             f"replica's {tp} ranks) in which it has rank {tp_rank}")
        extra = [t.name for t in spec.tensors if not _KNOWN_TENSOR.fullmatch(t.name)]
        if getattr(spec, "num_experts", 0) or spec.attention is None or extra:
            raise NotImplementedError(f"TorchRollout runs dense models of {', '.join(DENSE_FAMILIES)} only, "
                                      f"not {spec.name!r}"
                                      + (f" (it has {', '.join(extra[:3])})" if extra else ""))
        self.spec, self.tp, self.tp_rank, self.group, self.dtype = spec, tp, tp_rank, group, dtype
        self.eps, self.theta = rms_norm_eps, rope_theta
        a = spec.attention
        self.head_dim = a.head_dim
        self.q_heads = a.num_heads // tp                      # local query heads
        self.kv_heads = max(a.num_kv_heads // tp, 1)          # local KV heads (1, replicated, if tp > KV)
        self.vocab = spec["model.embed_tokens.weight"].shape[0]
        self.vocab_per_rank = padded_vocab(self.vocab) // tp  # rows [t·per, (t+1)·per) of the padded vocab
        # the buffers vLLM's worker t would hold, and 2-D views of them (the only weights there are)
        self.buffers: dict[str, torch.Tensor] = {
            n: b.to(device) for n, b in allocate(self.layout(), tp_rank).items()}
        self.w: dict[str, torch.Tensor] = {
            lt.buffer: self.buffers[f"param/{lt.buffer}"].view(lt.shape) for lt in worker_tensors(spec, tp, tp_rank)}
        self.apply_adapters = False  # LoRA: add B·(A·x)·alpha/r to each adapted linear (set_apply_adapters)
        self.adapters: dict[str, list] = self._adapter_views() if spec.lora is not None else {}
        # default Llama RoPE: inv_freq[i] = theta^(-2i/hd)
        hd = self.head_dim
        self.inv_freq = 1.0 / (rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64, device=device).float() / hd))

    @classmethod
    def from_hf_config(cls, spec: ModelSpec, hf_config: Any, **kw) -> "TorchRollout":
        return cls(spec, rms_norm_eps=float(_get(hf_config, "rms_norm_eps", 1e-6)),
                   rope_theta=rope_theta_of(hf_config), **kw)

    def layout(self, replicas: int = 1) -> Layout:
        """The layout of ``replicas`` engines like this one (rank = replica·tp + tp_rank): the
        destination of a move into this engine's buffers."""
        return vllm_layout(self.spec, self.tp, replicas, self.dtype)

    # --- LoRA -----------------------------------------------------------------------------------------
    @torch.no_grad()
    def load_base(self, model_dir: str) -> None:
        """This worker's blocks of the base tensors (all but the adapters) from the HF checkpoint at
        ``model_dir`` (its ``model.safetensors``): the frozen base a sync of adapters never writes."""
        from safetensors import safe_open

        from ..vps.materialize import fragment_view

        with safe_open(f"{model_dir}/model.safetensors", framework="pt") as f:
            for frag in self.layout().fragments(self.tp_rank):
                if self.spec.is_adapter(frag.key.tensor):
                    continue
                block = f.get_slice(frag.key.tensor)[tuple(slice(lo, hi) for lo, hi in zip(frag.box.lo, frag.box.hi))]
                fragment_view(self.buffers[frag.buffer], frag).copy_(block)

    def _adapter_views(self) -> dict[str, list]:
        """Per local weight buffer: ``(first row, end row, A, B)`` of each adapted tensor in it —
        its output rows there and views of this worker's ``A`` [r, in_t] and ``B`` [out_t, r]
        blocks (the same rows as the weight's, the same columns: the spec's TP roles)."""
        from ..vps.materialize import fragment_view

        frags = {f.key.tensor: f for f in self.layout().fragments(self.tp_rank)}
        out: dict[str, list] = {}
        for target in self.spec.adapted_tensors:
            wf = frags[target]
            af, bf = (frags[target[: -len(".weight")] + f".lora_{x}.weight"] for x in "AB")
            if (bf.box.lo[0], bf.box.hi[0]) != (wf.box.lo[0], wf.box.hi[0]) or \
                    (af.box.lo[1], af.box.hi[1]) != (wf.box.lo[1], wf.box.hi[1]):
                raise ValueError(f"{target}: this worker's {wf.box} is not the rows of {bf.box} and the columns of "
                                 f"{af.box}")
            name = wf.buffer[len("param/"):]
            first = wf.offset // self.w[name].shape[1]  # the weight fills whole rows of its local buffer
            out.setdefault(name, []).append((first, first + wf.box.shape[0],
                                             fragment_view(self.buffers[af.buffer], af),
                                             fragment_view(self.buffers[bf.buffer], bf)))
        return out

    def set_apply_adapters(self, on: bool) -> None:
        """Whether the forward adds the adapters' output (a sync of adapters) or reads the base
        buffers alone (a sync of merged weights into them, or no LoRA)."""
        if on and self.spec.lora is None:
            raise ValueError(f"model {self.spec.name!r} has no LoRA adapters to apply")
        self.apply_adapters = on

    def _lora(self, y: torch.Tensor, x: torch.Tensor, weight: str) -> torch.Tensor:
        """``y`` (the linear's base output) plus each adapter's ``B·(A·x)·scaling`` on its rows."""
        if not self.apply_adapters or weight not in self.adapters:
            return y
        scaling = self.spec.lora.scaling
        for first, end, a, b in self.adapters[weight]:
            y[..., first:end] = y[..., first:end] + F.linear(F.linear(x, a), b) * scaling
        return y

    # --- collectives over the TP group (no-ops at TP=1) --------------------------------------------
    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def _all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.tp)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    # --- the model ---------------------------------------------------------------------------------
    def _column(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """Column-parallel (or fused) linear: this rank's output features, bias included (and
        LoRA's output, ``_lora``)."""
        return self._lora(F.linear(x, self.w[name + ".weight"], self.w.get(name + ".bias")), x, name + ".weight")

    def _row(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """Row-parallel linear: partial sums over this rank's input features, summed over the TP
        group, then the (whole, replicated) bias once."""
        y = self._all_reduce(self._lora(F.linear(x, self.w[name + ".weight"]), x, name + ".weight"))
        b = self.w.get(name + ".bias")
        return y if b is None else y + b

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        var = x.pow(2).mean(-1, keepdim=True)
        return weight * (x * torch.rsqrt(var + self.eps))

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # x [B, h, T, hd], positions [T] or [B, T]
        freqs = positions.float()[..., None] * self.inv_freq           # [(B,) T, hd/2]
        emb = torch.cat((freqs, freqs), dim=-1)                        # [(B,) T, hd]
        if emb.dim() == 3:
            emb = emb[:, None]                                         # [B, 1, T, hd]
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        x1, x2 = x[..., : self.head_dim // 2], x[..., self.head_dim // 2:]
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        # vocab-parallel: this rank looks up ids in [lo, lo + per) and the TP group sums
        w = self.w["model.embed_tokens.weight"]                       # [per, H]
        lo = self.tp_rank * self.vocab_per_rank
        mine = (ids >= lo) & (ids < lo + self.vocab_per_rank)
        x = F.embedding(torch.where(mine, ids - lo, torch.zeros_like(ids)), w)  # [B, T, H]
        return self._all_reduce(x * mine.unsqueeze(-1).to(x.dtype))

    def _attention(self, i: int, x: torch.Tensor, slots: torch.Tensor, pad: torch.Tensor | None,
                   cache: KVCache | None) -> torch.Tensor:
        B, T, _ = x.shape
        p, hd, nq, nkv = f"model.layers.{i}.self_attn.", self.head_dim, self.q_heads, self.kv_heads
        # RoPE position of row b at slot s is s - pad[b]: each row sees its unpadded positions
        positions = slots if pad is None else (slots[None, :] - pad[:, None]).clamp(min=0)  # [T] / [B, T]
        qkv = self._column(x, p + "qkv_proj")                          # [B, T, (nq + 2·nkv)·hd]
        q, k, v = qkv.split([nq * hd, nkv * hd, nkv * hd], dim=-1)
        q, k = q.view(B, T, nq, hd), k.view(B, T, nkv, hd)
        if p + "q_norm.weight" in self.w:  # qwen3: RMS norm over each head's features, before RoPE
            q, k = self._rms_norm(q, self.w[p + "q_norm.weight"]), self._rms_norm(k, self.w[p + "k_norm.weight"])
        q = self._rope(q.transpose(1, 2), positions)                   # [B, nq, T, hd]
        k = self._rope(k.transpose(1, 2), positions)                   # [B, nkv, T, hd]
        v = v.view(B, T, nkv, hd).transpose(1, 2)                      # [B, nkv, T, hd]
        if cache is not None:                                          # write, then read the prefix
            cache.k[i][:, :, slots] = k
            cache.v[i][:, :, slots] = v
            end = int(slots[-1]) + 1
            k, v = cache.k[i][:, :, :end], cache.v[i][:, :, :end]      # [B, nkv, S, hd]
            key_slot = torch.arange(end, device=x.device)
        else:
            key_slot = slots
        k = k.repeat_interleave(nq // nkv, dim=1)                      # GQA: [B, nq, S, hd]
        v = v.repeat_interleave(nq // nkv, dim=1)
        mask = key_slot[None, :] <= slots[:, None]                     # causal, [T, S]
        if pad is not None:  # a row's left padding is no key; a pad query sees only itself (no NaN)
            mask = (mask & (key_slot[None, None, :] >= pad[:, None, None])) | \
                (key_slot[None, None, :] == slots[None, :, None])       # [B, T, S]
            mask = mask[:, None]                                       # [B, 1, T, S]
        att = (q @ k.transpose(-2, -1)) / math.sqrt(hd)                # [B, nq, T, S]
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, nq * hd)           # [B, T, nq·hd]
        return self._row(y, p + "o_proj")                               # [B, T, H]

    def _mlp(self, i: int, x: torch.Tensor) -> torch.Tensor:
        p = f"model.layers.{i}.mlp."
        gate, up = self._column(x, p + "gate_up_proj").chunk(2, dim=-1)  # [B, T, I/tp] each
        return self._row(F.silu(gate) * up, p + "down_proj")               # [B, T, H]

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                kv_cache: KVCache | None = None, pad: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[B, T, vocab]`` (identical on every TP rank) of ``input_ids [B, T]`` at
        ``positions [T]`` (a contiguous range of slots, default ``0..T-1``). With ``kv_cache`` the
        new keys and values are stored at those slots and attention also sees the cached prefix.
        ``pad [B]``: row ``b`` is left-padded with ``pad[b]`` slots: they are no keys for it, and
        its slot ``s`` has RoPE position ``s - pad[b]`` (so a padded row computes what it would
        alone); the logits at pad slots are meaningless."""
        if positions is None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self._embed(input_ids)                                     # [B, T, H]
        for i in range(self.spec.num_layers):
            p = f"model.layers.{i}."
            x = x + self._attention(i, self._rms_norm(x, self.w[p + "input_layernorm.weight"]), positions, pad,
                                    kv_cache)
            x = x + self._mlp(i, self._rms_norm(x, self.w[p + "post_attention_layernorm.weight"]))
        x = self._rms_norm(x, self.w["model.norm.weight"])
        head = "model.embed_tokens.weight" if self.spec.tied_lm_head else "lm_head.weight"
        logits = self._all_gather_last(F.linear(x, self.w[head]))     # [B, T, padded vocab]
        return logits[..., : self.vocab]                               # drop the padding columns

    __call__ = forward

    def new_kv_cache(self, batch: int, max_len: int) -> KVCache:
        ref = self.w["model.norm.weight"]
        shape = (batch, self.kv_heads, max_len, self.head_dim)
        n = self.spec.num_layers
        return KVCache([ref.new_zeros(shape) for _ in range(n)], [ref.new_zeros(shape) for _ in range(n)])

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0,
                 seed: int | Sequence[int] = 0, eos_token_id: int | None = None, stop_ids: Collection[int] = ()
                 ) -> tuple[list[list[int]], list[list[float]]]:
        """Greedy (``temperature == 0``) or sampled decoding of all prompts together: prompts
        left-padded to the longest into one KV cache, one forward (so one all-reduce per
        row-parallel layer) per step for the whole batch. Returns the generated tokens per prompt
        (stopping after ``eos_token_id`` or any id of ``stop_ids``) and each token's log-probability under the model's raw
        logits (vLLM's default ``raw_logprobs``). A finished row stays in the batch, ignored, and
        draws nothing more. Every TP rank computes the same logits and draws from the same seeded
        generators, so every rank returns the same tokens. ``seed``: one seed per prompt, each
        prompt drawing from its own generator seeded with it (a sample then depends only on its
        prompt and seed, not on the batch or replica it ran in), or one int: one generator for
        the whole call, drawn by the unfinished rows in row order at each step."""
        if not prompts:
            return [], []
        per_prompt = not isinstance(seed, int)
        if per_prompt and len(seed) != len(prompts):
            raise ValueError(f"{len(seed)} seeds for {len(prompts)} prompts")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("empty prompt")
        device = self.w["model.norm.weight"].device
        B, L = len(prompts), max(len(p) for p in prompts)
        pad = torch.tensor([L - len(p) for p in prompts], dtype=torch.long, device=device)
        ids = torch.tensor([[0] * (L - len(p)) + list(p) for p in prompts], dtype=torch.long, device=device)
        if temperature <= 0:
            gens = []
        elif per_prompt:
            gens = [torch.Generator(device=device).manual_seed(int(s)) for s in seed]
        else:
            gens = [torch.Generator(device=device).manual_seed(seed)] * B  # one, shared
        cache = self.new_kv_cache(B, L + max_new_tokens)
        logits = self.forward(ids, torch.arange(L, device=device), cache, pad)[:, -1]  # [B, vocab]
        tokens_out: list[list[int]] = [[] for _ in prompts]
        logprobs_out: list[list[float]] = [[] for _ in prompts]
        live = list(range(B))                                          # rows still generating
        stops = set(stop_set(eos_token_id, stop_ids))
        for step in range(max_new_tokens):
            logits = logits.float()
            logp = logits.log_softmax(-1)                              # [B, vocab]
            if temperature > 0:
                probs = (logits / temperature).softmax(-1)
                toks = [0] * B                                         # finished rows: a dummy
                for b in live:
                    toks[b] = int(torch.multinomial(probs[b], 1, generator=gens[b]))
            else:
                toks = logits.argmax(-1).tolist()
            tok_t = torch.tensor(toks, dtype=torch.long, device=device)
            lps = logp.gather(1, tok_t[:, None])[:, 0].tolist()
            still = []
            for b in live:
                tokens_out[b].append(toks[b])
                logprobs_out[b].append(lps[b])
                if toks[b] not in stops:
                    still.append(b)
            live = still
            if not live or step == max_new_tokens - 1:
                break
            logits = self.forward(tok_t[:, None], torch.arange(L + step, L + step + 1, device=device), cache,
                                  pad)[:, -1]
        return tokens_out, logprobs_out


class TorchRolloutEngine(RolloutEngine):
    """``TorchRollout`` behind the rollout-engine interface: one TP worker per rank of the
    trainer's world (placement ``worker``), its weights the very buffers the channel writes."""

    placement = "worker"
    takes_adapters = True
    resizable = True  # it lives in the trainer's actors: it follows the trainer world's resize
    profile_name = "torch"

    @classmethod
    def layout_problems(cls, phase, layout, dims):
        return super().layout_problems(phase, layout, dims) + engine_family_problems(
            phase, "torch rollout", dims, DENSE_FAMILIES, "its forward has no mixture-of-experts layer")

    @classmethod
    def build(cls, ctx: RolloutContext) -> "TorchRolloutEngine":
        self = cls()
        self.engine = TorchRollout.from_hf_config(ctx.spec, dict(ctx.hf_config), tp=ctx.tp, tp_rank=ctx.tp_rank,
                                                  group=ctx.group, device=ctx.device.torch_device())
        self.name = f"TorchRollout TP{ctx.tp}"
        if ctx.spec.lora is not None:  # the base is never synced: its own copy, from the warm start
            self.engine.load_base(ctx.model_dir)
        return self

    def buffers(self) -> dict[str, torch.Tensor]:
        return self.engine.buffers

    def weight_sync(self, mode: str) -> None:
        super().weight_sync(mode)
        if self.engine.spec.lora is not None:
            self.engine.set_apply_adapters(mode == "adapters")

    def generate(self, prompts, max_new_tokens, temperature, seeds, stop_ids):
        return self.engine.generate([list(p) for p in prompts], max_new_tokens, temperature=temperature,
                                    seed=list(seeds), stop_ids=stop_ids)
