"""How a multi-turn sample ends, and the limits that end it.

``FinishReason`` is one of:

===============  ==========================================================================
``stop``         the environment said ``done`` (the model gave its final answer, the game ended)
``length``       the token budget ran out: a model turn hit it without finishing, or an
                 observation would not fit in what is left (it is then not appended)
``max_turns``    the model had ``max_turns`` turns and the environment was not done
``env_error``    the environment raised, returned something that is not what the interface
                 says (a non-string observation, a non-number reward), could not be built, its
                 observation could not be tokenized, or its worker died
``timeout``      an environment call ran past the pool's time limit
===============  ==========================================================================

``Limits``: ``max_turns`` (model turns), ``max_total_tokens`` (everything after the prompt: the
reset observation, model turns and observations), ``max_context`` (the model's context: prompt +
everything after it) and, optionally, ``max_turn_tokens`` (one model turn). ``turn_budget`` is
how many tokens the next model turn may generate; ``room`` how many tokens may still be appended.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

FinishReason = Literal["stop", "length", "max_turns", "env_error", "timeout"]
FINISH_REASONS: tuple[str, ...] = get_args(FinishReason)
# the reasons that say the environment failed the sample (not the model)
FAILURES: tuple[str, ...] = ("env_error", "timeout")


@dataclass(frozen=True)
class Limits:
    max_turns: int
    max_total_tokens: int
    max_context: int
    max_turn_tokens: int | None = None

    def __post_init__(self):
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {self.max_turns}")
        if self.max_total_tokens < 1 or self.max_context < 1:
            raise ValueError(f"max_total_tokens and max_context must be >= 1, got "
                             f"{self.max_total_tokens}, {self.max_context}")
        if self.max_turn_tokens is not None and self.max_turn_tokens < 1:
            raise ValueError(f"max_turn_tokens must be >= 1 (or None), got {self.max_turn_tokens}")

    def room(self, prompt_len: int, response_len: int) -> int:
        """Tokens that may still be appended after ``response_len`` response tokens (either limit)."""
        return max(0, min(self.max_total_tokens - response_len, self.max_context - prompt_len - response_len))

    def turn_budget(self, prompt_len: int, response_len: int) -> int:
        """The most tokens the next model turn may generate."""
        room = self.room(prompt_len, response_len)
        return room if self.max_turn_tokens is None else min(room, self.max_turn_tokens)

    def check_prompt(self, prompt_len: int) -> None:
        """Refuse a prompt that leaves no room for a single generated token."""
        if prompt_len >= self.max_context:
            raise ValueError(f"the prompt is {prompt_len} tokens, the model's context {self.max_context}: "
                             f"no room for a response")
