"""The supervised warm start: a tiny Llama taught the task's answers before RL, so its first
rollouts already earn some reward. Pure torch + transformers, one process.

- ``build_initial_model(hf_config, seed)``: the run's initial weights (``torch_train.hf_model``:
  the same weights every rank and every engine builds from the seed).
- ``sft(model, task_cfg, sft_cfg, seed)``: teacher forcing on the task's train split, prompt →
  answer + ``<eos>``; the loss counts the answer tokens only. Prompts are encoded exactly as the
  GRPO loop encodes them (``encode_prompt``: ``<bos>`` + the prompt's characters).
- ``evaluate(model, samples, ...)``: greedy decoding of held-out prompts, the task's reward and
  exact-match accuracy.
- ``save_hf_checkpoint`` / ``load_hf_weights``: a HF directory vLLM can load without a tokenizer
  (``skip_tokenizer_init=True``), and the way back into an already-built model.
- ``warm_start(cfg, out_dir)``: all of it for a ``RunConfig``, cached in ``out_dir`` by a
  fingerprint of (model config, task or data config, SFT config, seed). A ``model.path`` with
  weights is the starting point (``AutoModelForCausalLM.from_pretrained``: any family); without
  SFT it is the warm start itself. ``data:`` runs train on (rendered prompt, answer) pairs with
  the run's HF tokenizer.
"""
from __future__ import annotations

import hashlib
import inspect
import json
import math
import os
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from .algorithms import logprobs_from_logits
from .rewards import RewardFn, exact_match, score_samples
from .tasks import CharTokenizer, Sample, build_task, encode_prompt, longest_answer_tokens, make_splits

FINGERPRINT_FILE = "warm_start.json"
# bump when what a checkpoint holds for the same inputs changes (training recipe, file layout)
FINGERPRINT_VERSION = 1


def build_initial_model(hf_config: Mapping[str, Any], seed: int) -> torch.nn.Module:
    """The run's initial ``LlamaForCausalLM`` (fp32, sdpa), weights drawn from ``seed``."""
    from rlhf_switch.models import causal_lm

    return causal_lm(hf_config, seed)


def _max_context(model: torch.nn.Module) -> int:
    from ..families import context_length

    return context_length(model.config.to_dict())


# ---------------------------------------------------------------- SFT


def sft_batch(tokenizer: CharTokenizer, samples: Sequence[Sample], max_new_tokens: int,
              max_ctx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``<bos> prompt answer <eos>`` ids ``[B, T]``, the targets ``ids[:, 1:]`` and
    the mask ``[B, T-1]`` of the positions whose logits predict an answer token (or the
    ``<eos>``): the same convention as the GRPO trainer's response mask."""
    seqs, starts = [], []
    for s in samples:
        prompt = encode_prompt(tokenizer, s.prompt, max_new_tokens, max_ctx)
        answer = tokenizer.encode(s.answer, add_eos=True)
        if len(answer) > max_new_tokens:
            raise ValueError(f"answer {s.answer!r} is {len(answer)} tokens with <eos>, more than "
                             f"max_new_tokens={max_new_tokens}")
        seqs.append(prompt + answer)
        starts.append(len(prompt))
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), tokenizer.pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), T - 1), dtype=torch.float32)
    for b, (seq, p) in enumerate(zip(seqs, starts)):
        ids[b, :len(seq)] = torch.tensor(seq, dtype=torch.long)
        mask[b, p - 1:len(seq) - 1] = 1.0
    return ids, ids[:, 1:], mask


def answer_loss(model: torch.nn.Module, ids: torch.Tensor, targets: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
    """Mean negative log-likelihood of the answer tokens (right padding and causal attention
    leave every real position untouched, so no attention mask is needed)."""
    logits = model(input_ids=ids, use_cache=False).logits[:, :-1]
    nll = -logprobs_from_logits(logits, targets)
    return (nll * mask).sum() / mask.sum().clamp(min=1)


def _get(cfg: Any, name: str, default: Any = None) -> Any:
    return cfg.get(name, default) if isinstance(cfg, Mapping) else getattr(cfg, name, default)


def sft(model: torch.nn.Module, task_cfg: Any, sft_cfg: Any, seed: int, progress: bool = True,
        max_new_tokens: int | None = None,
        callback: Callable[[int, float], None] | None = None,
        samples: Sequence[Sample] | None = None, tokenizer: Any = None) -> dict:
    """Train ``model`` in place: ``sft_cfg.steps`` AdamW steps (peak ``sft_cfg.lr``: linear
    warmup over the first 5% of the steps, then constant; no weight decay; gradients clipped to
    norm 1) of ``sft_cfg.batch_size`` train samples, drawn epoch by epoch in
    an order fixed by ``seed``. ``task_cfg``/``sft_cfg`` are the run config's blocks (or dicts
    with the same fields). ``max_new_tokens`` is the context check's response budget (default:
    the task's longest answer with ``<eos>``). ``callback(step, loss)`` runs after every step
    (steps counted from 1; it may evaluate the model). Deterministic given the seed and the initial
    weights. Returns ``{"steps", "loss_first", "loss_final", "seconds", ...}``, ``loss_final``
    the mean answer loss over the last ``min(10, steps)`` steps.

    ``samples`` with ``tokenizer`` (and ``max_new_tokens``) replace the task: a ``data:`` run's
    train split (prompts already rendered) and its HF tokenizer; ``task_cfg`` is then unused."""
    steps, lr, batch_size = int(_get(sft_cfg, "steps")), float(_get(sft_cfg, "lr")), int(_get(sft_cfg, "batch_size"))
    max_ctx = _max_context(model)
    if samples is None:
        task = build_task(_get(task_cfg, "name"), _get(task_cfg, "min_len", 1), _get(task_cfg, "max_len", 3),
                          _get(task_cfg, "length_skew", 0.0))
        train = make_splits(task, _get(task_cfg, "num_train", 2000), _get(task_cfg, "num_heldout", 200),
                            _get(task_cfg, "seed", 0)).train
        tok = CharTokenizer()
        if max_new_tokens is None:
            max_new_tokens = longest_answer_tokens(task, tok)
    else:
        if tokenizer is None or max_new_tokens is None:
            raise ValueError("sft on samples needs their tokenizer and max_new_tokens")
        train, tok = tuple(samples), tokenizer
    if not train:
        raise ValueError("the train split is empty")

    gen = torch.Generator().manual_seed(int(seed))
    order: list[int] = []

    def next_batch() -> list[Sample]:
        picked = []
        while len(picked) < batch_size:
            if not order:
                order.extend(torch.randperm(len(train), generator=gen).tolist())
            picked.append(train[order.pop()])
        return picked

    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    warmup = max(1, steps // 20)

    def lr_at(step: int) -> float:  # linear warmup over 5% of the steps, then constant
        return lr * min(1.0, (step + 1) / warmup)
    losses: list[float] = []
    t0 = time.perf_counter()
    bar = None
    if progress and steps:
        from tqdm import tqdm

        bar = tqdm(total=steps, desc="sft", unit="step", dynamic_ncols=True)
    try:
        for step in range(steps):
            ids, targets, mask = sft_batch(tok, next_batch(), max_new_tokens, max_ctx)
            for group in opt.param_groups:
                group["lr"] = lr_at(step)
            loss = answer_loss(model, ids, targets, mask)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            losses.append(float(loss.detach()))
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{losses[-1]:.4f}")
            if callback is not None:
                callback(step + 1, losses[-1])
    finally:
        if bar is not None:
            bar.close()
    model.eval()
    tail = losses[-10:]
    return {"steps": steps, "lr": lr, "batch_size": batch_size,
            "loss_first": losses[0] if losses else float("nan"),
            "loss_final": sum(tail) / len(tail) if tail else float("nan"),
            "seconds": time.perf_counter() - t0, "num_train": len(train)}


# ---------------------------------------------------------------- evaluation


@torch.no_grad()
def generate(model: torch.nn.Module, prompts: Sequence[Sequence[int]], max_new_tokens: int, eos_id: int,
             batch_size: int = 64, temperature: float = 0.0,
             generator: torch.Generator | None = None) -> list[list[int]]:
    """Each prompt's response ids, ``<eos>`` included when produced, nothing after it.

    Greedy when ``temperature == 0`` (ties go to the lowest id), else sampled from
    ``softmax(logits / temperature)`` with ``generator``. Prompts are batched by length — equal
    lengths, no padding, so a prompt's logits do not depend on what it is batched with beyond
    float summation order, and no attention mask or position ids are needed — in the order of
    their first appearance; rows that finished keep running (their extra tokens are dropped)."""
    out: list[list[int] | None] = [None] * len(prompts)
    by_len: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_len.setdefault(len(p), []).append(i)
    was_training = model.training
    model.eval()
    try:
        for idx in by_len.values():
            for lo in range(0, len(idx), batch_size):
                rows = idx[lo:lo + batch_size]
                ids = torch.tensor([list(prompts[i]) for i in rows], dtype=torch.long)
                done = torch.zeros(len(rows), dtype=torch.bool)
                new = []
                for _ in range(max_new_tokens):
                    logits = model(input_ids=ids, use_cache=False).logits[:, -1].float()
                    if temperature == 0:
                        nxt = logits.argmax(-1)
                    else:
                        probs = torch.softmax(logits / temperature, dim=-1)
                        nxt = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
                    new.append(nxt)
                    done |= nxt == eos_id
                    ids = torch.cat([ids, nxt[:, None]], dim=1)
                    if bool(done.all()):
                        break
                gen = torch.stack(new, dim=1).tolist()
                for r, i in enumerate(rows):
                    seq = gen[r]
                    out[i] = seq[:seq.index(eos_id) + 1] if eos_id in seq else seq
    finally:
        model.train(was_training)
    return out  # type: ignore[return-value]


def evaluate(model: torch.nn.Module, samples: Sequence[Sample], tokenizer: CharTokenizer,
             reward_fn: RewardFn, max_new_tokens: int, max_ctx: int | None = None,
             batch_size: int = 64) -> dict:
    """Greedy responses to ``samples`` (prompts encoded as the GRPO loop does), scored with
    ``reward_fn`` through ``score_samples``. Returns ``reward_mean``, ``accuracy`` (exact match),
    ``n``, ``responses`` (decoded, in sample order) and ``rewards``. Deterministic."""
    max_ctx = _max_context(model) if max_ctx is None else max_ctx
    prompts = [encode_prompt(tokenizer, s.prompt, max_new_tokens, max_ctx) for s in samples]
    ids = generate(model, prompts, max_new_tokens, tokenizer.eos_id, batch_size=batch_size)
    texts = [tokenizer.decode(r) for r in ids]
    p, a = [s.prompt for s in samples], [s.answer for s in samples]
    rewards = score_samples(reward_fn, p, texts, a)
    exact = score_samples(exact_match, p, texts, a)
    n = len(samples)
    return {"reward_mean": sum(rewards) / n if n else float("nan"),
            "accuracy": sum(exact) / n if n else float("nan"),
            "n": n, "responses": texts, "rewards": rewards}


# ---------------------------------------------------------------- checkpoints


def save_hf_checkpoint(model: torch.nn.Module, out_dir: str | os.PathLike) -> Path:
    """``model.safetensors`` + ``config.json`` (+ ``generation_config.json``) in ``out_dir``: a
    HF directory that ``LlamaForCausalLM.from_pretrained`` loads bit-exactly and vLLM loads with
    ``skip_tokenizer_init=True``. ``config.json`` names ``architectures: [LlamaForCausalLM]`` and
    the dtype under both spellings (``dtype``, transformers ≥ 5; ``torch_dtype``, older readers)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    kwargs = {}
    if "safe_serialization" in inspect.signature(model.save_pretrained).parameters:
        kwargs["safe_serialization"] = True  # transformers < 5; 5 writes safetensors only
    model.save_pretrained(out, **kwargs)
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    cfg["architectures"] = [type(model).__name__]
    cfg["dtype"] = cfg["torch_dtype"] = dtype
    cfg.setdefault("model_type", "llama")
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    if not list(out.glob("*.safetensors")):
        raise RuntimeError(f"save_pretrained wrote no .safetensors file in {out}")
    return out


def load_hf_weights(model: torch.nn.Module, ckpt_dir: str | os.PathLike, strict: bool = True) -> torch.nn.Module:
    """Copy the weights saved in ``ckpt_dir`` (one or several ``*.safetensors``) into ``model``,
    in place (its parameters keep their identity); returns ``model``."""
    from safetensors.torch import load_file

    files = sorted(Path(ckpt_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {ckpt_dir}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if getattr(model.config, "tie_word_embeddings", False):
        missing = [k for k in missing if k != "lm_head.weight"]
    if strict and (missing or unexpected):
        raise RuntimeError(f"{ckpt_dir}: missing {missing}, unexpected {unexpected}")
    return model


# ---------------------------------------------------------------- the warm start


def _file_stamps(root: str | os.PathLike, patterns: Sequence[str]) -> dict:
    """``{file name: [size, mtime_ns]}`` of the files in ``root`` matching ``patterns``: a
    changed model or tokenizer changes the fingerprint."""
    root = Path(root)
    files = sorted({f for p in patterns for f in root.glob(p) if f.is_file()})
    return {f.name: [f.stat().st_size, f.stat().st_mtime_ns] for f in files}


def _path_stamp(path: str | os.PathLike) -> list:
    p = Path(path)
    return [str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] if p.is_file() else [str(p), None, None]


def fingerprint(cfg: Any) -> dict:
    """What a warm-start checkpoint is a function of: the configs, and for files (``model.path``,
    the tokenizer, data files) their paths, sizes and modification times."""
    task = cfg.task.model_dump(mode="json") if cfg.task is not None else None
    if task is not None and not task["length_skew"]:
        del task["length_skew"]  # unskewed: the prompts (and digest) of before the field existed
    fp = {"version": FINGERPRINT_VERSION,
          "hf_config": cfg.model.hf_config,
          "task": task,
          "sft": cfg.sft.model_dump(mode="json") if cfg.sft is not None else None,
          "max_new_tokens": cfg.algorithm.max_new_tokens,
          "seed": cfg.seed}
    if cfg.model.path is not None:
        fp["model_path"] = str(Path(cfg.model.path).resolve())
        fp["model_files"] = _file_stamps(cfg.model.path, ("config.json", "*.safetensors"))
    if cfg.data is not None:
        from .tokenizer import tokenizer_path

        fp["data"] = cfg.data.model_dump(mode="json")
        fp["data_files"] = [_path_stamp(f) for f in (*cfg.data.train_files, *cfg.data.heldout_files)]
        fp["tokenizer_files"] = _file_stamps(tokenizer_path(cfg), ("tokenizer*.json", "*.jinja", "*.model"))
    return fp


def _has_weights(path: str | None) -> bool:
    return path is not None and any(Path(path).glob("*.safetensors"))


def initial_model(cfg: Any) -> torch.nn.Module:
    """The model the warm start begins from: ``model.path``'s weights when it holds any
    (``AutoModelForCausalLM``, fp32: any family transformers knows), else the seeded model of
    ``model.hf_config`` or of ``model.path``'s ``config.json``."""
    if _has_weights(cfg.model.path):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32)
        return model.float().train()
    hf_config = cfg.model.hf_config
    if hf_config is None:
        hf_config = json.loads((Path(cfg.model.path) / "config.json").read_text())
    return build_initial_model(hf_config, cfg.seed)


def data_sft_samples(cfg: Any, tokenizer: Any = None,
                     render: Callable[[str], str] | None = None) -> tuple[Any, list[Sample]]:
    """A ``data:`` run's tokenizer and the train samples SFT learns: those whose answer (with the
    eos) fits ``max_new_tokens`` — the RL loop could never generate the others whole. ``render``:
    the prompts' rendering (``rl.data.load_splits``'s)."""
    from .data import load_splits
    from .tokenizer import load_tokenizer

    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(cfg)
    splits, _ = load_splits(cfg, tokenizer, render)
    budget = cfg.algorithm.max_new_tokens
    train = [s for s in splits.train if len(tokenizer.encode(s.answer, add_eos=True)) <= budget]
    if not train:
        raise ValueError(f"sft: no train answer fits algorithm.max_new_tokens={budget} tokens (with the eos)")
    return tokenizer, train


def _digest(fp: dict) -> str:
    return hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()


def cached_checkpoint(cfg: Any, out_dir: str | os.PathLike, sft_on: str | None = None) -> Path | None:
    """``out_dir`` when it holds a finished warm start for ``cfg`` (``sft_on``: trained on what
    ``warm_start``'s ``train`` names), else None."""
    out = Path(out_dir)
    try:
        saved = json.loads((out / FINGERPRINT_FILE).read_text())
    except (OSError, ValueError):
        return None
    fp = fingerprint(cfg)
    if sft_on is not None:
        fp["sft_on"] = sft_on
    if saved.get("digest") != _digest(fp):
        return None
    if not (out / "config.json").is_file() or not list(out.glob("*.safetensors")):
        return None
    return out


def warm_start(cfg: Any, out_dir: str | os.PathLike, progress: bool = True,
               log: Callable[[str], None] | None = print,
               train: tuple[str, Callable[[torch.nn.Module], dict]] | None = None) -> Path:
    """The run's initial checkpoint: ``initial_model(cfg)`` (``model.path``'s weights, or the
    seeded model), SFT when ``cfg.sft`` is set with ``steps > 0`` (on the task, or on a ``data:``
    run's rendered train pairs with its tokenizer), saved in ``out_dir`` with
    ``save_hf_checkpoint``. Reused, not retrained, when ``out_dir`` already holds one with the same
    ``fingerprint`` (``warm_start.json``, written last, records it and the SFT stats). Returns
    ``out_dir`` — or ``model.path`` itself when it holds weights and there is no SFT.

    ``train``: ``(name, fn)`` — another SFT than the task's prompt → answer pairs (an agent run's
    multi-turn transcripts): ``fn(model)`` trains the model in place and returns its stats;
    ``name`` says what it trains on and goes into the fingerprint."""
    out = Path(out_dir)
    train_sft = cfg.sft is not None and cfg.sft.steps > 0
    if not train_sft and _has_weights(cfg.model.path):
        # nothing to train: the model's own directory is the start (its files are read, never written)
        if log:
            log(f"[warm_start] no SFT: starting from {cfg.model.path}")
        return Path(cfg.model.path)
    if cached_checkpoint(cfg, out, None if train is None else train[0]) is not None:
        if log:
            log(f"[warm_start] reusing {out}")
        return out
    fp = fingerprint(cfg)
    if train is not None:
        fp["sft_on"] = train[0]
    model = initial_model(cfg)
    stats: dict = {"steps": 0}
    if train_sft:
        if train is not None:
            stats = train[1](model)
        elif cfg.data is not None:
            tokenizer, train = data_sft_samples(cfg)
            stats = sft(model, None, cfg.sft, cfg.seed, progress=progress,
                        max_new_tokens=cfg.algorithm.max_new_tokens, samples=train, tokenizer=tokenizer)
        else:
            stats = sft(model, cfg.task, cfg.sft, cfg.seed, progress=progress,
                        max_new_tokens=cfg.algorithm.max_new_tokens)
        if log:
            log(f"[warm_start] SFT {stats['steps']} steps: answer loss {stats['loss_first']:.3f} -> "
                f"{stats['loss_final']:.3f} in {stats['seconds']:.1f} s")
    # a stale fingerprint must not survive a half-written checkpoint
    (out / FINGERPRINT_FILE).unlink(missing_ok=True)
    for old in out.glob("*.safetensors") if out.is_dir() else ():
        old.unlink()
    save_hf_checkpoint(model, out)
    if cfg.data is not None:
        # the warm start is the rollout engine's model directory: vLLM loads the run's tokenizer from it
        from .tokenizer import copy_tokenizer_files, tokenizer_path

        copy_tokenizer_files(tokenizer_path(cfg), out)
    stats = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in stats.items()}
    (out / FINGERPRINT_FILE).write_text(json.dumps({"digest": _digest(fp), "fingerprint": fp, "sft_stats": stats},
                                                   indent=2, sort_keys=True) + "\n")
    return out
