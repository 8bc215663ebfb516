"""The multi-turn warm start: teacher forcing on transcripts, the loss on the player's tokens only.

``transcript_batch(transcripts, pad_id)`` right-pads ``[B, T]`` ids and gives the targets
``ids[:, 1:]`` and the mask ``[B, T-1]`` of positions whose next token the player generated (the
observation and prompt tokens are read, never learned) — the convention of ``rl.sft.sft_batch``
and of the trainer's response mask, so ``rl.sft.answer_loss`` computes the loss.
``sft_transcripts(model, transcripts, steps, lr, batch_size, seed)`` trains in place with the
recipe of ``rl.sft.sft`` (AdamW, no weight decay, 5% linear warmup, gradients clipped to norm 1,
batches drawn epoch by epoch in an order fixed by ``seed``).
"""
from __future__ import annotations

import time
from typing import Callable, Sequence

import torch

from ..rl.sft import answer_loss
from .experts import Transcript


def transcript_batch(transcripts: Sequence[Transcript], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    T = max(len(t.ids) for t in transcripts)
    ids = torch.full((len(transcripts), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(transcripts), T - 1), dtype=torch.float32)
    for b, t in enumerate(transcripts):
        if len(t.mask) != len(t.ids):
            raise ValueError(f"transcript {b}: {len(t.mask)} mask entries for {len(t.ids)} tokens")
        if t.mask and t.mask[0]:
            raise ValueError(f"transcript {b}: its first token is marked the player's; nothing predicts it")
        ids[b, :len(t.ids)] = torch.tensor(t.ids, dtype=torch.long)
        mask[b, :len(t.ids) - 1] = torch.tensor(t.mask[1:], dtype=torch.float32)
    return ids, ids[:, 1:], mask


def sft_transcripts(model: torch.nn.Module, transcripts: Sequence[Transcript], steps: int, lr: float,
                    batch_size: int, seed: int, pad_id: int = 0,
                    callback: Callable[[int, float], None] | None = None) -> dict:
    """Train ``model`` in place; returns ``{"steps", "loss_first", "loss_final", "seconds", ...}``
    (``loss_final``: the mean over the last ``min(10, steps)`` steps). Deterministic given the seed
    and the initial weights."""
    if not transcripts:
        raise ValueError("no transcripts to train on")
    gen = torch.Generator().manual_seed(int(seed))
    order: list[int] = []

    def next_batch() -> list[Transcript]:
        picked = []
        while len(picked) < batch_size:
            if not order:
                order.extend(torch.randperm(len(transcripts), generator=gen).tolist())
            picked.append(transcripts[order.pop()])
        return picked

    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    warmup = max(1, steps // 20)
    losses: list[float] = []
    t0 = time.perf_counter()
    for step in range(steps):
        ids, targets, mask = transcript_batch(next_batch(), pad_id)
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / warmup)
        loss = answer_loss(model, ids, targets, mask)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        if callback is not None:
            callback(step + 1, losses[-1])
    model.eval()
    tail = losses[-10:]
    return {"steps": steps, "lr": lr, "batch_size": batch_size, "num_transcripts": len(transcripts),
            "loss_first": losses[0] if losses else float("nan"),
            "loss_final": sum(tail) / len(tail) if tail else float("nan"),
            "seconds": time.perf_counter() - t0}
