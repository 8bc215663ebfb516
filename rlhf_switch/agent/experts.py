"""Warm-start data: transcripts of scripted players, made by the same episode driver and
environments the model will meet, so their tokens are laid out exactly as the model's own
episodes are.

- ``Transcript``: one conversation's ids (prompt included) and its per-token loss mask (1 on the
  player's tokens, 0 on the prompt and the environment's).
- ``policy_generate(policy, codec)``: a text policy (conversation so far -> next turn's text) as a
  ``generate`` function; a turn that does not end with a stop id gets ``<eos>``.
- ``transcripts(requests, policies, codec, limits)``: play every request with its policy (in
  this process, ``LocalEnvPool``) and keep the episodes as transcripts.
- ``calc_transcripts`` / ``guess_transcripts``: the two tasks' warm-start mixes.
"""
from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from typing import Callable, Sequence

from ..rl.tasks import CharTokenizer, Sample
from . import calc, guess
from .episode import Episode, EpisodeRequest, run_episode
from .limits import Limits
from .pool import LocalEnvPool

Policy = Callable[[str], str]


@dataclass(frozen=True)
class Transcript:
    ids: tuple[int, ...]
    mask: tuple[int, ...]  # per token of ids: 1 where the player generated it

    @staticmethod
    def of(episode: Episode) -> "Transcript":
        return Transcript(tuple(episode.ids), tuple([0] * len(episode.prompt_ids) + episode.loss_mask))


def policy_generate(policy: Policy, codec) -> Callable:
    async def generate(ids: list[int], max_new_tokens: int, stop_ids: frozenset) -> list[int]:
        out = codec.encode(policy(codec.decode(ids)))
        if not out or out[-1] not in stop_ids:
            out.append(codec.eos_id)
        return out[:max_new_tokens]
    return generate


def transcripts(requests: Sequence[EpisodeRequest], policies: Sequence[Policy], codec, limits: Sequence[Limits],
                keep: Callable[[Episode], bool] = lambda e: True) -> list[Transcript]:
    """Each request played by its policy under its limits; the episodes ``keep`` accepts, as
    transcripts, in order. An episode the environment failed is an error (the data is ours)."""
    async def play() -> list[Episode]:
        pool = LocalEnvPool()
        return list(await asyncio.gather(*(run_episode(policy_generate(p, codec), pool, r, codec, lim)
                                           for r, p, lim in zip(requests, policies, limits))))
    episodes = asyncio.run(play())
    bad = [e for e in episodes if e.failed]
    if bad:
        raise RuntimeError(f"{len(bad)} expert episodes failed; the first: {bad[0].finish_reason}: {bad[0].error}")
    return [Transcript.of(e) for e in episodes if keep(e)]


def calc_transcripts(samples: Sequence[Sample], tokenizer: CharTokenizer, max_context: int,
                     direct_fraction: float = 0.25, seed: int = 0) -> list[Transcript]:
    """The calculator task's warm start: each sample once, ``direct_fraction`` of them (drawn from
    ``seed``) without the tool, answered at once; the others call the tool and copy its result."""
    rng = random.Random(f"calc-mix:{seed}")
    tools = [rng.random() >= direct_fraction for _ in samples]
    reqs = [calc.request(s, f"w{i}", tokenizer, tools=t) for i, (s, t) in enumerate(zip(samples, tools))]
    return transcripts(reqs, [calc.expert_policy] * len(reqs), tokenizer,
                       [calc.limits(max_context, tools=t) for t in tools])


def guess_transcripts(samples: Sequence[Sample], tokenizer: CharTokenizer, max_context: int, games_per_sample: int,
                      noise: float, seed: int = 0, max_turns: int = 6) -> list[Transcript]:
    """The game's warm start: ``games_per_sample`` games of each secret by the noisy binary-search
    player (``guess.expert_policy``), every game kept (lost ones too: each turn is still a
    possible guess)."""
    rng = random.Random(f"guess-play:{seed}")
    reqs = [guess.request(s, f"g{i}:{k}", tokenizer) for i, s in enumerate(samples) for k in range(games_per_sample)]
    policies = [guess.expert_policy(noise, random.Random(rng.random())) for _ in reqs]
    return transcripts(reqs, policies, tokenizer, [guess.limits(max_context, max_turns)] * len(reqs))


def calc_warm_start(samples: Sequence[Sample], tokenizer: CharTokenizer, max_context: int, seed: int, max_turns: int,
                    tools: bool = True) -> list[Transcript]:
    """The calculator's transcripts for the RL loop's warm start (``CalcEnvironment``'s
    ``warm_start_transcripts``): each sample once, a quarter answered at once, the rest through
    the tool (all at once without it)."""
    return calc_transcripts(samples, tokenizer, max_context, direct_fraction=0.25 if tools else 1.0, seed=seed)


def guess_warm_start(samples: Sequence[Sample], tokenizer: CharTokenizer, max_context: int, seed: int, max_turns: int,
                     low: int = 1, high: int = 63, turn_cost: float = 0.0) -> list[Transcript]:
    """The game's transcripts for the RL loop's warm start (``GuessEnvironment``'s
    ``warm_start_transcripts``): 40 games of each train secret by the noisy binary-search player
    (half its guesses uniform among the numbers still possible), lost games kept."""
    if (low, high) != (1, 63):
        raise ValueError(f"the game's warm-start transcripts are played in 1..63, not {low}..{high}")
    return guess_transcripts(samples, tokenizer, max_context, games_per_sample=40, noise=0.5, seed=seed,
                             max_turns=max_turns)
