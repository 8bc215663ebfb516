"""The tool-use task: arithmetic a tiny model cannot do in its head, with a calculator tool.

A sample is a sum of two 5–6-digit numbers or a product of a 5–6-digit number and a 2-digit one
(``CalcTask``; ``rl.tasks.Sample(prompt="12345*67=", answer="827115")``). With the tool, the prompt
declares it (``TOOL_PREFIX``) and a conversation in the character vocabulary reads::

    <bos><calc>12345*67=<calc 12345*67>=827115 827115<eos>
                        '--- model ---''- env -''-- model --'

The model calls the calculator in the compact call format (``<calc expression>``; generation stops
at ``>``), the environment answers ``=<result> `` (``=err syntax `` and the like for a bad call),
and the model's turn without a call is its final answer, scored by exact match. Without the tool
the prompt is the bare problem and the model answers at once (``12345*67=827115<eos>``): one turn,
no tool offered (a call is an unknown tool).

``Calculator`` evaluates ``<int><op><int>`` for ``op`` in ``+ - *`` (integers of at most 12 digits)
and raises on anything else (the environment's ``=err failed ``). ``CalcEnvironment`` is
``ToolEnvironment`` with it, the compact format and exact match (``tools=False``: no tool).
``request`` and ``limits`` build an episode of a sample; ``expert_policy`` is the scripted
policy the warm-start transcripts come from (``rlhf_switch.agent.experts``).
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Iterator

from ..rl.tasks import CharTokenizer, Sample, Task, _numbers_with_digits
from .episode import EpisodeRequest
from .limits import Limits
from .tools import CompactCallFormat, Tool, ToolEnvironment

TOOL_PREFIX = "<calc>"  # the prompt's declaration that the calculator may be called
EXPRESSION = re.compile(r"(\d{1,12})([+\-*])(\d{1,12})")


class Calculator(Tool):
    name = "calc"
    description = "Exact integer arithmetic: one + - or * between two non-negative integers, e.g. 12345*67."
    parameters = {"type": "object",
                  "properties": {"expression": {"type": "string", "description": "<int><op><int>"}},
                  "required": ["expression"], "additionalProperties": False}

    def call(self, expression: str) -> str:
        m = EXPRESSION.fullmatch(expression)
        if m is None:
            raise ValueError(f"not <int><op><int>: {expression!r}")
        a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
        return str(a + b if op == "+" else a - b if op == "-" else a * b)


class CalcEnvironment(ToolEnvironment):
    """The calculator task's environment: ``tools=True`` offers the calculator, ``False`` nothing."""

    def __init__(self, tools: bool = True):
        super().__init__([Calculator()] if tools else [], CompactCallFormat(), "rlhf_switch.rl.rewards:exact_match")

    # the RL loop's warm start (recipes.common.agent_warm_start): the scripted expert's transcripts
    warm_start_transcripts = "rlhf_switch.agent.experts:calc_warm_start"

    @classmethod
    def episode_request(cls, sample: Sample, session: str, tokenizer: CharTokenizer, tools: bool = True) -> EpisodeRequest:
        """The RL loop's episode of ``sample`` (``agent.workflow.episode_request``): ``request``."""
        return request(sample, session, tokenizer, tools)


@dataclass(frozen=True)
class CalcTask(Task):
    """Sums of two ``min_len``–``max_len``-digit numbers and products of one such number and a
    ``multiplier_digits``-digit one, each operation equally often (``ops``)."""

    name: str = "calc"
    min_len: int = 5
    max_len: int = 6
    ops: str = "+*"
    multiplier_digits: int = 2

    def __post_init__(self):
        super().__post_init__()
        if not self.ops or set(self.ops) - set("+*"):
            raise ValueError(f"calc: ops must be made of '+' and '*', got {self.ops!r}")

    def _operand(self, rng: random.Random) -> int:
        return rng.choice(_numbers_with_digits(self._length(rng)))

    def _sample(self, a: int, op: str, b: int) -> Sample:
        return Sample(f"{a}{op}{b}=", str(a + b if op == "+" else a * b))

    def draw(self, rng: random.Random) -> Sample:
        op = rng.choice(self.ops)
        a = self._operand(rng)
        b = self._operand(rng) if op == "+" else rng.choice(_numbers_with_digits(self.multiplier_digits))
        return self._sample(a, op, b)

    def _count(self) -> int:
        return sum(len(_numbers_with_digits(n)) for n in self._lengths())

    def space_size(self) -> int:
        n = self._count()
        return (n * n if "+" in self.ops else 0) + (n * len(_numbers_with_digits(self.multiplier_digits))
                                                    if "*" in self.ops else 0)

    def all_samples(self) -> Iterator[Sample]:
        operands = [a for n in self._lengths() for a in _numbers_with_digits(n)]
        if "+" in self.ops:
            yield from (self._sample(a, "+", b) for a in operands for b in operands)
        if "*" in self.ops:
            yield from (self._sample(a, "*", b) for a in operands for b in _numbers_with_digits(self.multiplier_digits))

    def longest(self) -> Sample:
        big = 10 ** self.max_len - 1
        return self._sample(big, "+", big) if "+" in self.ops else \
            self._sample(big, "*", 10 ** self.multiplier_digits - 1)

    def longest_episode(self, tools: bool = True) -> int:
        """Tokens of the longest expert episode (prompt with ``<bos>`` included): what the
        model's context must hold."""
        longest = 0
        big = 10 ** self.max_len - 1
        for op in self.ops:
            s = self._sample(big, op, big if op == "+" else 10 ** self.multiplier_digits - 1)
            expr = s.prompt[:-1]
            n = 1 + len(s.prompt) + len(s.answer) + 1
            if tools:
                n += len(TOOL_PREFIX) + len(f"<calc {expr}>") + len(f"={s.answer} ")
            longest = max(longest, n)
        return longest


def prompt_text(sample: Sample, tools: bool = True) -> str:
    return (TOOL_PREFIX if tools else "") + sample.prompt


def request(sample: Sample, session: str, tokenizer: CharTokenizer, tools: bool = True) -> EpisodeRequest:
    """The episode of ``sample``: with the tool (its declaration in the prompt, turns stop at the
    call's ``>``) or without (the bare prompt, one turn)."""
    return EpisodeRequest(session=session, env="calc", sample=sample,
                          prompt_ids=tuple(tokenizer.encode(prompt_text(sample, tools), add_bos=True)),
                          env_kwargs={"tools": tools},
                          stop_ids=frozenset(tokenizer.encode(CompactCallFormat.stop)) if tools else frozenset())


def limits(max_context: int, tools: bool = True, max_turns: int = 3) -> Limits:
    """With the tool ``max_turns`` turns (a call, the answer, one more try), without it one; the
    whole context is the budget."""
    return Limits(max_turns=max_turns if tools else 1, max_total_tokens=max_context, max_context=max_context)


def expert_policy(text: str) -> str:
    """The scripted expert's next turn for the conversation ``text`` (decoded, ``<bos>`` dropped):
    call the calculator on the prompt's expression, then copy its result; without the tool,
    compute the answer itself. A final answer is returned without its ``<eos>`` (the caller
    ends the turn with it)."""
    if text.startswith(TOOL_PREFIX):
        if text.endswith("="):
            return f"<calc {text[len(TOOL_PREFIX):-1]}>"
        m = re.search(r"=(-?\d+) $", text)
        if m is None:
            raise ValueError(f"the calc expert cannot continue {text!r}")
        return m.group(1)
    return Calculator().call(text[:-1])
