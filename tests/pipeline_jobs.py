"""Rank-side jobs for ``test_pipeline_trainer.py`` (module level, so they pickle by reference).

The truth is a one-process ``hf_model(cfg, seed)`` on every rank: its log-probs, and the same
model trained with the same loss on the same micro-batches, ``torch.nn.utils.clip_grad_norm_``,
AdamW and the LR schedule. Each rank compares its own stage's parameters (a TP shard made whole
with ``full_tensor()``) with the same-named one-process parameters.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from rlhf_switch.engines.optim import AdamWConfig
from rlhf_switch.engines.pipeline import build_pipeline_trainer, token_logprobs
from rlhf_switch.engines.torch_train import hf_model

KL_COEF = 0.05


def batch(cfg: dict, rows: int, T: int, seed: int) -> dict:
    """Right-padded token ids with per-row lengths, a mask of the response tokens (positions of
    ``ids[:, 1:]``), group-normalised-looking advantages and a reference model's log-probs."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, cfg["vocab_size"], (rows, T), generator=g)
    lengths = torch.randint(T // 2, T + 1, (rows,), generator=g)
    pos = torch.arange(T - 1)
    mask = ((pos[None] >= 2) & (pos[None] < lengths[:, None] - 1)).float()  # prompt of 3 tokens
    ids[torch.arange(T)[None] >= lengths[:, None]] = 0  # padding
    adv = torch.randn(rows, generator=g)
    ref = -torch.rand(rows, T - 1, generator=g) * 5
    return {"ids": ids, "mask": mask, "adv": adv, "ref": ref}


def grpo_loss(data: dict, old: torch.Tensor):
    """A GRPO-like loss_fn: clipped-ratio policy term and k3 KL to the reference, each token
    weighted by 1 / (the whole batch's mask total) — the micro-batch losses sum to the batch's."""
    mask, adv, ref, total = data["mask"], data["adv"], data["ref"], data["mask"].sum()

    def loss_fn(logp: torch.Tensor, s: slice):
        ratio = torch.exp(logp - old[s])
        pg = -torch.minimum(ratio * adv[s, None], ratio.clamp(0.8, 1.2) * adv[s, None])
        d = ref[s] - logp
        kl = torch.exp(d) - d - 1
        loss = ((pg + KL_COEF * kl) * mask[s]).sum() / total
        return loss, {"loss": float(loss.detach()), "kl": float((kl.detach() * mask[s]).sum() / mask[s].sum()),
                      "rows": (s.start, s.stop)}
    return loss_fn


def reference(cfg: dict, seed: int, optim: AdamWConfig, steps: list[dict], micro: int):
    """The one-process run: per step, old log-probs, backward of each micro-batch's loss in
    order, clip_grad_norm_ (when max_grad_norm > 0), AdamW, the scheduler."""
    model = hf_model(cfg, seed)
    opt = optim.make(model.parameters())
    sched = optim.scheduler(opt)
    norms, stats = [], []
    for data in steps:
        ids = data["ids"]
        with torch.no_grad():
            old = token_logprobs(model(input_ids=ids).logits, ids)
        loss_fn = grpo_loss(data, old)
        st = []
        for i in range(0, ids.shape[0], micro):
            s = slice(i, i + micro)
            loss, stat = loss_fn(token_logprobs(model(input_ids=ids[s]).logits, ids[s]), s)
            loss.backward()
            st.append(stat)
        if optim.max_grad_norm > 0:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), optim.max_grad_norm)))
        else:
            norms.append(float("nan"))
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        stats.append(st)
    return model, norms, stats


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()


def outputs_and_training(cfg: dict, ranks: list[int], tp: int, *, seed: int = 0, seq_len: int = 16,
                         micro: int = 2, max_grad_norm: float = 0.05, lr: float = 3e-3) -> dict | None:
    """Build a PipelineTrainer on ``ranks``; log-probs of a batch whose rows are not a multiple of
    ``micro`` and whose T < seq_len; then 2 train_steps of the GRPO-like loss, each on old
    log-probs from ``outputs``. Everything compared with the one-process run on this rank."""
    optim = AdamWConfig(lr=lr, max_grad_norm=max_grad_norm)
    trainer = build_pipeline_trainer(cfg, seed, ranks, tp=tp, optim=optim, seq_len=seq_len, micro=micro)
    if trainer is None:
        return None
    out = {"name": trainer.name, "stage": trainer.stage_index, "rank": dist.get_rank()}

    ids = batch(cfg, 5, 11, seed=1)["ids"]
    logp = trainer.outputs(ids)
    with torch.no_grad():
        want = token_logprobs(hf_model(cfg, seed)(input_ids=ids).logits, ids)
    out["logp_shape"] = tuple(logp.shape)
    out["logp_diff"] = (logp - want).abs().max().item()
    out["logp"] = logp

    steps = [batch(cfg, 4, 12, seed=2), batch(cfg, 4, 12, seed=3)]
    before = {n: _full(p).clone() for n, p in trainer.module.named_parameters()}
    results = []
    for data in steps:
        old = trainer.outputs(data["ids"])
        results.append(trainer.train_step(data["ids"], micro, grpo_loss(data, old)))
    model, norms, stats = reference(cfg, seed, optim, steps, micro)
    ref = dict(model.named_parameters())
    params = {n: _full(p) for n, p in trainer.module.named_parameters()}
    out["names"] = sorted(params)
    out["param_diff"] = max((params[n] - ref[n].detach()).abs().max().item() for n in params)
    out["worst"] = max(params, key=lambda n: (params[n] - ref[n].detach()).abs().max().item())
    out["param_moved"] = min((params[n] - before[n]).abs().max().item() for n in params)
    out["grad_norms"], out["ref_grad_norms"] = [r["grad_norm"] for r in results], norms
    out["stats"], out["ref_stats"] = [r["stats"] for r in results], stats
    try:  # a micro size other than the trainer's is refused on every rank before any communication
        trainer.train_step(steps[0]["ids"], 1, grpo_loss(steps[0], old))
        out["other_micro"] = "accepted"
    except ValueError as e:
        out["other_micro"] = str(e)
    return out
