"""Rank-side jobs for ``test_torch_rollout.py`` (module level, so they pickle by reference).

Every job: read the tiny HF model's global tensors lazily from its safetensors file, fill the
trainer layout, build this rank's ``TorchRollout`` (TP group = the ranks of its replica), move the
trainer buffers into the engine's buffers, and compare with the HF model run on the same rank.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from rlhf_switch.engines.torch_rollout import TorchRollout
from rlhf_switch.routing import move
from rlhf_switch.models import model_spec
from rlhf_switch.vps import Layout
from rlhf_switch.vps.layouts.vllm import vllm_layout
from rlhf_switch.vps.materialize import allocate, bits, coverage_masks, materialize

_GROUPS: dict[int, list] = {}


def tp_group(tp: int):
    """(this rank's TP group, its rank in it, number of replicas). ``dist.new_group`` is
    collective over the world, so every rank creates every replica's group, once per ``tp``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if tp > 1 and tp not in _GROUPS:
        _GROUPS[tp] = [dist.new_group(list(range(r, r + tp))) for r in range(0, world, tp)]
    return (_GROUPS[tp][rank // tp] if tp > 1 else None), rank % tp, world // tp


def _hf(model_dir: str):
    """The checkpoint's config and model, of whichever family it is."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(model_dir)
    return cfg, AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def safetensors_source(model_dir: str):
    """``tensor_of`` reading slices of the global tensors straight from the file (no full load)."""
    from safetensors import safe_open

    f = safe_open(os.path.join(model_dir, "model.safetensors"), "pt")
    return lambda key: f.get_slice(key.tensor)


def engine_from_trainer(model_dir: str, trainer: Layout, tp: int):
    """The HF config and model, the trainer buffers, the engine, and its (vLLM) layout, after one move."""
    rank = dist.get_rank()
    cfg, hf = _hf(model_dir)
    spec = model_spec(cfg)
    assert spec == trainer.spec, "the driver's spec and the file's config disagree"
    trainer_bufs = materialize(trainer, rank, safetensors_source(model_dir))
    group, tp_rank, replicas = tp_group(tp)
    engine = TorchRollout.from_hf_config(spec, cfg, tp=tp, tp_rank=tp_rank, group=group)
    dst = vllm_layout(spec, tp, replicas)
    assert engine.layout(replicas) == dst
    fresh = allocate(dst, rank)  # the engine's buffers are exactly what `allocate` would make
    assert {n: (t.dtype, t.numel()) for n, t in fresh.items()} == \
        {n: (t.dtype, t.numel()) for n, t in engine.buffers.items()}
    move(trainer, dst, trainer_bufs, engine.buffers)
    return cfg, hf, trainer_bufs, engine, dst


def _agrees_with(dst: Layout, engine: TorchRollout, tensor_of) -> bool:
    """The engine's buffers hold, bit for bit, a direct construction of its layout."""
    rank = dist.get_rank()
    want, masks = materialize(dst, rank, tensor_of), coverage_masks(dst, rank)
    return all(torch.equal(bits(engine.buffers[n])[m], bits(want[n])[m]) for n, m in masks.items())


def _compare(cfg, hf, engine: TorchRollout, prompts, max_new_tokens: int) -> dict:
    """Max |logit difference| over ``prompts`` (one forward each, no cache), greedy tokens of
    both, and the engine's logprobs against a cache-free forward of prompt + generated tokens."""
    diff, logits = 0.0, []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            ref = hf(ids).logits
        got = engine.forward(ids)
        diff = max(diff, (ref - got).abs().max().item())
        logits.append(got)
    eos = cfg.eos_token_id
    tokens, logprobs = engine.generate(prompts, max_new_tokens, eos_token_id=eos)
    hf_tokens = [hf.generate(torch.tensor([p]), max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=eos, pad_token_id=eos)[0, len(p):].tolist() for p in prompts]
    return {"logit_diff": diff, "logits": logits, "tokens": tokens, "hf_tokens": hf_tokens,
            "logprob_diff": _logprob_diff(engine, prompts, tokens, logprobs)}


def _logprob_diff(engine: TorchRollout, prompts, tokens, logprobs) -> float:
    """KV-cache decoding vs one cache-free forward over the whole sequence."""
    worst = 0.0
    for p, toks, lps in zip(prompts, tokens, logprobs):
        seq = torch.tensor([p + toks])
        logp = engine.forward(seq)[0].log_softmax(-1)                    # [T, vocab]
        want = logp[len(p) - 1: len(p) - 1 + len(toks)].gather(1, torch.tensor(toks)[:, None])[:, 0]
        worst = max(worst, (want - torch.tensor(lps)).abs().max().item())
    return worst


def logits_vs_hf(model_dir: str, trainer: Layout, tp: int, prompts, max_new_tokens: int) -> dict:
    cfg, hf, _, engine, dst = engine_from_trainer(model_dir, trainer, tp)
    out = _compare(cfg, hf, engine, prompts, max_new_tokens)
    out.pop("logits")
    out["exact_buffers"] = _agrees_with(dst, engine, safetensors_source(model_dir))
    return out


def perturb(hf, steps: int = 3, seed: int = 1234, lr: float = 0.5) -> None:
    """A few SGD steps on random tokens: identical on every rank (same seed, same arithmetic)."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(hf.parameters(), lr=lr)
    hf.train()
    for _ in range(steps):
        ids = torch.randint(0, hf.config.vocab_size, (2, 12), generator=g)
        hf(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    hf.eval()


def no_stale_weights(model_dir: str, trainer: Layout, tp: int, prompts, max_new_tokens: int) -> dict:
    """Move, generate, train the HF model a little, re-materialize the trainer layout, move again
    into the SAME engine buffers, and compare with the updated HF model."""
    rank = dist.get_rank()
    cfg, hf, _, engine, dst = engine_from_trainer(model_dir, trainer, tp)
    before = _compare(cfg, hf, engine, prompts, max_new_tokens)
    buffers, ptrs = engine.buffers, {n: t.data_ptr() for n, t in engine.buffers.items()}
    perturb(hf)
    params = {n: p.detach() for n, p in hf.state_dict().items()}
    new_trainer_bufs = materialize(trainer, rank, lambda key: params[key.tensor])
    move(trainer, dst, new_trainer_bufs, engine.buffers)
    after = _compare(cfg, hf, engine, prompts, max_new_tokens)
    in_place = engine.buffers is buffers and all(t.data_ptr() == ptrs[n] for n, t in buffers.items())
    return {
        "before": before["logit_diff"], "after": after["logit_diff"],
        "old_vs_new": min((a - b).abs().max().item() for a, b in zip(before["logits"], after["logits"])),
        "tokens": after["tokens"], "hf_tokens": after["hf_tokens"], "in_place": in_place,
        "exact_buffers": _agrees_with(dst, engine, lambda key: params[key.tensor]),
    }


def sampled(model_dir: str, trainer: Layout, tp: int, prompts, max_new_tokens: int, seed: int) -> dict:
    _, _, _, engine, _ = engine_from_trainer(model_dir, trainer, tp)
    a = engine.generate(prompts, max_new_tokens, temperature=1.0, seed=seed)
    b = engine.generate(prompts, max_new_tokens, temperature=1.0, seed=seed)
    c = engine.generate(prompts, max_new_tokens, temperature=1.0, seed=seed + 1)
    return {"a": a, "b": b, "c": c,
            "logprob_diff": _logprob_diff(engine, prompts, *a)}


@torch.no_grad()
def reference_generate(engine: TorchRollout, prompts, max_new_tokens: int, temperature: float = 0.0,
                       seed=0, eos_token_id=None, stop_ids=()):
    """The one-prompt-at-a-time ``TorchRollout.generate`` as it was before batched decoding (own
    KV cache per prompt, no padding): the reference the batched one must reproduce."""
    per_prompt = not isinstance(seed, int)
    gen = torch.Generator(device=engine.w["model.norm.weight"].device).manual_seed(0 if per_prompt else seed)
    device = gen.device
    tokens_out, logprobs_out = [], []
    for i, prompt in enumerate(prompts):
        if per_prompt:
            gen.manual_seed(int(seed[i]))
        cache = engine.new_kv_cache(1, len(prompt) + max_new_tokens)
        ids = torch.tensor([prompt], dtype=torch.long, device=device)
        logits = engine.forward(ids, torch.arange(len(prompt), device=device), cache)[0, -1]
        toks, lps = [], []
        for step in range(max_new_tokens):
            logp = logits.float().log_softmax(-1)
            if temperature > 0:
                probs = (logits.float() / temperature).softmax(-1)
                tok = int(torch.multinomial(probs, 1, generator=gen))
            else:
                tok = int(logits.argmax())
            toks.append(tok)
            lps.append(float(logp[tok]))
            if tok == eos_token_id or tok in stop_ids or step == max_new_tokens - 1:
                break
            pos = len(prompt) + step
            ids = torch.tensor([[tok]], dtype=torch.long, device=device)
            logits = engine.forward(ids, torch.arange(pos, pos + 1, device=device), cache)[0, -1]
        tokens_out.append(toks)
        logprobs_out.append(lps)
    return tokens_out, logprobs_out


def _max_lp_diff(a, b) -> float:
    return max((abs(x - y) for la, lb in zip(a, b) for x, y in zip(la, lb)), default=0.0)


def batched_vs_reference(model_dir: str, trainer: Layout, tp: int, prompts, max_new_tokens: int,
                         seeds) -> dict:
    """Batched ``generate`` against ``reference_generate``, greedy and sampled with per-sample
    seeds, each with an EOS picked so that some rows stop early: the token row 0 drew at step 1
    of an EOS-free reference run."""
    _, _, _, engine, _ = engine_from_trainer(model_dir, trainer, tp)
    out = {}
    for mode, temp in (("greedy", 0.0), ("sampled", 1.0)):
        free = reference_generate(engine, prompts, max_new_tokens, temp, seeds)
        eos = free[0][0][1]
        ref = reference_generate(engine, prompts, max_new_tokens, temp, seeds, eos)
        got = engine.generate(prompts, max_new_tokens, temperature=temp, seed=seeds, eos_token_id=eos)
        # a sample does not depend on its batch: the reversed batch gives each prompt the same sample
        rev = engine.generate(prompts[::-1], max_new_tokens, temperature=temp, seed=seeds[::-1], eos_token_id=eos)
        # an agent turn's own stop id beside the eos: the token row 1 drew at step 2
        stop = free[0][1][2]
        stops = {"ref": reference_generate(engine, prompts, max_new_tokens, temp, seeds, eos, stop_ids={stop})[0],
                 "got": engine.generate(prompts, max_new_tokens, temperature=temp, seed=seeds, eos_token_id=eos,
                                        stop_ids=[stop])[0]}
        out[mode] = {"eos": eos, "ref": ref, "got": got, "rev": (rev[0][::-1], rev[1][::-1]), "stops": stops,
                     "lp_diff": max(_max_lp_diff(ref[1], got[1]), _max_lp_diff(ref[1], rev[1][::-1])),
                     "vs_forward": _logprob_diff(engine, prompts, *got)}
    return out


def time_generate(model_dir: str, trainer: Layout, tp: int, prompts, max_new_tokens: int, seeds,
                  repeats: int = 3) -> dict:
    """Seconds per generate call (batched and ``reference_generate``), sampled, per-sample seeds."""
    import time

    _, _, _, engine, _ = engine_from_trainer(model_dir, trainer, tp)
    times = {"batched": [], "reference": []}
    for _ in range(repeats):
        for name, fn in (("batched", engine.generate),
                         ("reference", lambda *a, **k: reference_generate(engine, *a, **k))):
            dist.barrier()
            t0 = time.perf_counter()
            res = fn(prompts, max_new_tokens, temperature=1.0, seed=seeds, eos_token_id=2)
            times[name].append(time.perf_counter() - t0)
            times[name + "_result"] = res
    return times
