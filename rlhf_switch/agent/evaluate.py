"""Greedy multi-turn evaluation of a Hugging Face causal LM (one process, CPU), and the two tasks'
measures: the calculator task's exact match with and without the tool, the game's success rate.

``BatchedGreedy(model)`` is a ``generate`` function for many concurrent episodes: the turns asked
for in the same event-loop tick are decoded together, grouped by their current length (equal
lengths, no padding: a row's logits do not depend on its batch-mates beyond float summation
order), with the KV cache within a turn; greedy (ties to the lowest id), each row stopping at its
own stop ids or budget. It returns exactly the ids it generated — the episode appends them as
they are (``rlhf_switch.agent.episode``).

``play(model, requests, codec, limits)`` runs the episodes (environments in this process unless a
pool is given) and returns them; ``evaluate_calc`` / ``evaluate_guess`` score a task's samples.
"""
from __future__ import annotations

import asyncio
from typing import Any, Sequence

import torch

from ..rl.tasks import CharTokenizer, Sample
from . import calc, guess
from .episode import Episode, EpisodeRequest, episode_metrics, run_episodes
from .limits import Limits
from .pool import LocalEnvPool


class BatchedGreedy:
    def __init__(self, model: torch.nn.Module, max_batch: int = 256):
        self.model, self.max_batch = model, max_batch
        self._pending: list[tuple[list[int], int, frozenset, asyncio.Future]] = []
        self._scheduled = False
        self.calls = 0  # turns generated (for tests and metrics)

    async def __call__(self, ids: list[int], max_new_tokens: int, stop_ids: frozenset) -> list[int]:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._pending.append((list(ids), int(max_new_tokens), frozenset(stop_ids), fut))
        if not self._scheduled:
            self._scheduled = True
            loop.call_soon(self._flush)  # after every episode ready in this tick has asked
        return await fut

    def _flush(self) -> None:
        batch, self._pending, self._scheduled = self._pending, [], False
        try:
            outs = self.decode([b[0] for b in batch], [b[1] for b in batch], [b[2] for b in batch])
        except Exception as e:
            for *_, fut in batch:
                if not fut.done():
                    fut.set_exception(e)
            return
        for (*_, fut), out in zip(batch, outs):
            if not fut.done():
                fut.set_result(out)

    @torch.no_grad()
    def decode(self, prompts: Sequence[list[int]], max_new: Sequence[int], stops: Sequence[frozenset]) -> list[list[int]]:
        """Each prompt's greedy continuation: up to and including its first stop id, at most its
        ``max_new`` tokens."""
        self.calls += len(prompts)
        out: list[list[int]] = [[] for _ in prompts]
        by_len: dict[int, list[int]] = {}
        for i, p in enumerate(prompts):
            by_len.setdefault(len(p), []).append(i)
        was_training = self.model.training
        self.model.eval()
        try:
            for idx in by_len.values():
                for lo in range(0, len(idx), self.max_batch):
                    self._decode_rows(idx[lo:lo + self.max_batch], prompts, max_new, stops, out)
        finally:
            self.model.train(was_training)
        return out

    def _decode_rows(self, rows, prompts, max_new, stops, out) -> None:
        ids = torch.tensor([prompts[i] for i in rows], dtype=torch.long, device=next(self.model.parameters()).device)
        live = [True] * len(rows)
        res = self.model(input_ids=ids, use_cache=True)
        for step in range(max(max_new[i] for i in rows)):
            nxt = res.logits[:, -1].float().argmax(-1)
            for r, i in enumerate(rows):
                if live[r]:
                    tok = int(nxt[r])
                    out[i].append(tok)
                    live[r] = tok not in stops[i] and len(out[i]) < max_new[i]
            if not any(live):
                break
            res = self.model(input_ids=nxt[:, None], past_key_values=res.past_key_values, use_cache=True)


def play(model: torch.nn.Module, requests: Sequence[EpisodeRequest], codec: Any, limits: Limits,
         pool: Any = None) -> list[Episode]:
    """Every request's episode with ``model`` greedy (``BatchedGreedy``), all concurrently."""
    async def go() -> list[Episode]:
        p = pool if pool is not None else LocalEnvPool()
        return await run_episodes(BatchedGreedy(model), p, requests, codec, limits)
    return asyncio.run(go())


def _context(model: torch.nn.Module) -> int:
    return int(model.config.max_position_embeddings)


def evaluate_calc(model: torch.nn.Module, samples: Sequence[Sample], tools: bool = True,
                  tokenizer: CharTokenizer | None = None) -> dict:
    """Held-out exact match of the calculator task with the tool (``tools=True``) or answering at
    once without it: ``accuracy``, the ``episode_metrics``, and the ``episodes``."""
    tok = tokenizer or CharTokenizer()
    reqs = [calc.request(s, f"e{i}", tok, tools=tools) for i, s in enumerate(samples)]
    eps = play(model, reqs, tok, calc.limits(_context(model), tools=tools))
    return {"accuracy": sum(e.reward == 1.0 for e in eps) / len(eps), **episode_metrics(eps), "episodes": eps}


def evaluate_guess(model: torch.nn.Module, samples: Sequence[Sample], max_turns: int = 6,
                   tokenizer: CharTokenizer | None = None) -> dict:
    """The game's ``success`` rate (won within ``max_turns``), the ``episode_metrics`` and the ``episodes``."""
    tok = tokenizer or CharTokenizer()
    reqs = [guess.request(s, f"e{i}", tok) for i, s in enumerate(samples)]
    eps = play(model, reqs, tok, guess.limits(_context(model), max_turns))
    return {"success": sum(e.reward > 0 for e in eps) / len(eps), **episode_metrics(eps), "episodes": eps}
