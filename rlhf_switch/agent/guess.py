"""The multi-turn game: guess a secret number in ``1..63`` from higher/lower answers.

A conversation in the character vocabulary (the secret is 41)::

    <bos>guess=32,>48,<40,>44,<41,
               '-'^'-'^'-'^'-'^'-'   model turns (stop at ","), ^ the environment's answer

Each model turn is a guess ending with ``,``; the environment answers ``>`` (the secret is higher),
``<`` (lower) or, for a turn that is not a number in range, ``x``. A right guess ends the episode
(``done``; its answer is not appended) with reward ``1 - turn_cost·(guesses - 1)`` (``turn_cost``
0 by default: success is all that counts); the episode's ``max_turns`` (6 by default: binary
search always wins in 6) ends a game that was not won, reward 0. The model must read the feedback:
the secret never appears in the conversation.

``GuessTask`` (an ``rl.tasks.Task``: every secret once, held-out first by ``make_splits``; the
prompt is the same for every sample, so held-out only means secrets not trained on);
``GuessEnvironment``; ``request`` / ``limits`` for an episode; ``expert_policy(noise, rng)``: the
scripted player of the warm-start transcripts — binary search, except that with probability
``noise`` a turn guesses uniformly among the numbers still possible.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Callable, Iterator

from ..rl.tasks import CharTokenizer, Sample, Task
from .env import Environment, StepResult
from .episode import EpisodeRequest
from .limits import Limits
from .tools import sample_field

PROMPT = "guess="
END = ","  # ends a guess: where generation stops
HIGHER, LOWER, INVALID = ">", "<", "x"
GUESS = re.compile(r"(\d{1,3}),?")


class GuessEnvironment(Environment):
    """The game for one secret (the sample's answer) in ``low..high``."""

    def __init__(self, low: int = 1, high: int = 63, turn_cost: float = 0.0):
        if not 0 <= low <= high:
            raise ValueError(f"need 0 <= low <= high, got {low}, {high}")
        self.low, self.high, self.turn_cost = low, high, turn_cost
        self.secret, self.guesses = None, 0

    # the RL loop's warm start (recipes.common.agent_warm_start): the noisy expert's games
    warm_start_transcripts = "rlhf_switch.agent.experts:guess_warm_start"

    @classmethod
    def episode_request(cls, sample, session: str, tokenizer, low: int = 1, high: int = 63,
                        turn_cost: float = 0.0) -> "EpisodeRequest":
        """The RL loop's episode of ``sample`` (``agent.workflow.episode_request``): ``request``."""
        return request(sample, session, tokenizer, low, high, turn_cost)

    def reset(self, sample) -> str:
        self.secret = int(sample_field(sample, "answer"))
        if not self.low <= self.secret <= self.high:
            raise ValueError(f"the secret {self.secret} is not in {self.low}..{self.high}")
        self.guesses = 0
        return ""

    def step(self, action: str) -> StepResult:
        self.guesses += 1
        m = GUESS.fullmatch(action)
        guess = int(m.group(1)) if m else None
        if guess is None or not self.low <= guess <= self.high:
            return StepResult(INVALID, 0.0, False, {"guess": None, "feedback": INVALID})
        if guess == self.secret:
            return StepResult("", 1.0 - self.turn_cost * (self.guesses - 1), True, {"guess": guess, "won": True})
        feedback = HIGHER if self.secret > guess else LOWER
        return StepResult(feedback, 0.0, False, {"guess": guess, "feedback": feedback})


@dataclass(frozen=True)
class GuessTask(Task):
    """Every secret in ``min_len..max_len`` (here the range of the secret, not a length)."""

    name: str = "guess"
    min_len: int = 1
    max_len: int = 63

    def _sample(self, secret: int) -> Sample:
        return Sample(PROMPT, str(secret))

    def draw(self, rng: random.Random) -> Sample:
        return self._sample(rng.randint(self.min_len, self.max_len))

    def space_size(self) -> int:
        return self.max_len - self.min_len + 1

    def all_samples(self) -> Iterator[Sample]:
        return (self._sample(n) for n in range(self.min_len, self.max_len + 1))

    def longest(self) -> Sample:
        return self._sample(self.max_len)


def request(sample: Sample, session: str, tokenizer: CharTokenizer, low: int = 1, high: int = 63,
            turn_cost: float = 0.0) -> EpisodeRequest:
    return EpisodeRequest(session=session, env="guess", sample=sample,
                          prompt_ids=tuple(tokenizer.encode(PROMPT, add_bos=True)),
                          env_kwargs={"low": low, "high": high, "turn_cost": turn_cost},
                          stop_ids=frozenset(tokenizer.encode(END)))


def limits(max_context: int, max_turns: int = 6) -> Limits:
    return Limits(max_turns=max_turns, max_total_tokens=max_context, max_context=max_context)


def feasible(text: str, low: int = 1, high: int = 63) -> tuple[int, int]:
    """The secrets still possible after the conversation ``text`` (its guesses and answers)."""
    for g, fb in re.findall(r"(\d+),([<>x])", text):
        if fb == HIGHER:
            low = max(low, int(g) + 1)
        elif fb == LOWER:
            high = min(high, int(g) - 1)
    return low, high


def expert_policy(noise: float, rng: random.Random, low: int = 1, high: int = 63) -> Callable[[str], str]:
    """A player: the midpoint of what is still possible, or with probability ``noise`` a uniform
    pick of it."""
    def play(text: str) -> str:
        lo, hi = feasible(text, low, high)
        guess = rng.randint(lo, hi) if rng.random() < noise else (lo + hi + 1) // 2 if lo < hi else lo
        return f"{guess}{END}"
    return play
