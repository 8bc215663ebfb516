"""Reward functions and the ``module:function`` plug-in point.

A reward function takes ``(prompt, response, answer)`` — three strings, passed positionally, the
response already decoded up to ``<eos>`` — and returns a number. The shipped ones are exact match
(1.0 or 0.0: what "verifiable" means) and, separately, a partial-credit score for shaping
experiments, and for math word problems (GSM8K style) ``math_answer`` (the final number matches)
and ``math_format`` (the response ends with ``#### <number>``). A user's function is named in the config as ``package.module:function`` (or
``module:Class.method``) and loaded with ``load_reward_fn``; ``score_samples`` calls it over a
batch and turns any exception or non-number into one ``RewardError`` that names the function and
the sample, instead of a traceback from deep inside a worker.
"""
from __future__ import annotations

import importlib
import math
import re
from decimal import Decimal, InvalidOperation
from typing import Callable, Sequence

RewardFn = Callable[[str, str, str], float]


class RewardError(RuntimeError):
    """A reward function could not be loaded, raised, or returned something that is not a number."""


def exact_match(prompt: str, response: str, answer: str) -> float:
    """1.0 when the response is exactly the answer, else 0.0 — no stripping, no normalisation:
    the tasks have one spelling of each answer and the model is taught it."""
    return 1.0 if response == answer else 0.0


def partial_credit(prompt: str, response: str, answer: str) -> float:
    """Fraction of positions where response and answer agree, over the longer of the two (so extra
    characters cost as much as missing ones); 1.0 exactly when ``exact_match`` is. Numbers are
    compared right-aligned: the units digit is the first one a model gets right, and left
    alignment would score ``357`` against ``1357`` as all wrong."""
    if response == answer:
        return 1.0
    if answer.isdigit():
        response, answer = response[::-1], answer[::-1]
    hits = sum(1 for r, a in zip(response, answer) if r == a)
    return hits / max(len(response), len(answer))


# a number as people write it: a sign, thousands commas, a decimal part ("-1,234.50")
_NUMBER = r"-?\d[\d,]*(?:\.\d+)?"
_AFTER_HASHES = re.compile(r"####\s*\$?\s*(" + _NUMBER + r")")
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_ANY_NUMBER = re.compile(_NUMBER)
_ENDS_WITH_ANSWER = re.compile(r"####\s*" + _NUMBER + r"\s*$")


def _as_decimal(text: str) -> Decimal | None:
    """``"1,234.0"`` -> ``Decimal("1234.0")`` (equal to ``Decimal(1234)``); None when not a number."""
    try:
        return Decimal(text.replace(",", "").rstrip("."))
    except InvalidOperation:
        return None


def final_number(text: str) -> Decimal | None:
    """The number a math answer or response commits to: the one after the last ``####`` (GSM8K's
    convention), else the last number inside the last ``\\boxed{}``, else the last number in the
    text; None when there is none."""
    after = _AFTER_HASHES.findall(text)
    if after:
        return _as_decimal(after[-1])
    boxed = _BOXED.findall(text)
    for inside in reversed(boxed):
        numbers = _ANY_NUMBER.findall(inside)
        if numbers:
            return _as_decimal(numbers[-1])
    numbers = _ANY_NUMBER.findall(text)
    return _as_decimal(numbers[-1]) if numbers else None


def math_answer(prompt: str, response: str, answer: str) -> float:
    """1.0 when the response's final number (``final_number``) equals the answer's, compared as
    numbers (``1,234`` == ``1234`` == ``1234.0``), else 0.0 — also when either has no number."""
    expected, got = final_number(answer), final_number(response)
    return 1.0 if expected is not None and got is not None and expected == got else 0.0


def math_format(prompt: str, response: str, answer: str) -> float:
    """1.0 when the response ends its reasoning with ``#### <number>`` (trailing space allowed),
    whatever the number; else 0.0. A shaping reward to add to ``math_answer``, never alone."""
    return 1.0 if _ENDS_WITH_ANSWER.search(response) else 0.0


# what a data: run is scored with when it names no reward
DEFAULT_MATH_REWARD = "rlhf_switch.rl.rewards:math_answer"

# the task name -> the reward a config gets when it names none
DEFAULT_REWARDS: dict[str, str] = {
    "addition": "rlhf_switch.rl.rewards:exact_match",
    "sorting": "rlhf_switch.rl.rewards:exact_match",
    "reversal": "rlhf_switch.rl.rewards:exact_match",
}


def parse_reward_spec(spec: str) -> tuple[str, str]:
    """``"pkg.module:attr.path"`` -> ``("pkg.module", "attr.path")``, or a ValueError saying why not."""
    module, sep, attr = spec.partition(":")
    if not sep or not module.strip() or not attr.strip() or ":" in attr:
        raise ValueError(f"reward function {spec!r} must be written 'module:function' "
                         f"(e.g. 'rlhf_switch.rl.rewards:exact_match')")
    return module.strip(), attr.strip()


def _import_module(module: str, spec: str):
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        # the module itself (or a parent package) is missing — vs. the module importing something
        # missing, which is the user's bug inside their file and needs the original message
        if e.name is not None and (module == e.name or module.startswith(e.name + ".")):
            raise RewardError(f"reward function {spec!r}: no module named {module!r} "
                              f"(is it on PYTHONPATH / installed?)") from e
        raise RewardError(f"reward function {spec!r}: importing {module!r} failed: {e}") from e
    except Exception as e:
        raise RewardError(f"reward function {spec!r}: importing {module!r} raised "
                          f"{type(e).__name__}: {e}") from e


def load_reward_fn(spec: str) -> RewardFn:
    """Import ``module`` and return ``attr`` (a dotted path is followed: ``Class.method``)."""
    try:
        module_name, attr_path = parse_reward_spec(spec)
    except ValueError as e:
        raise RewardError(str(e)) from None
    obj = _import_module(module_name, spec)
    walked = module_name
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            public = sorted(n for n in dir(obj) if not n.startswith("_") and callable(getattr(obj, n, None)))
            hint = f"; callables there: {', '.join(public[:20])}" if public else ""
            raise RewardError(f"reward function {spec!r}: {walked!r} has no attribute {part!r}{hint}")
        obj = getattr(obj, part)
        walked = f"{walked}.{part}" if walked != module_name else f"{module_name}:{part}"
    if not callable(obj):
        raise RewardError(f"reward function {spec!r} is a {type(obj).__name__}, not callable")
    return obj


def describe_fn(fn: Callable) -> str:
    """``module:qualname`` of a function, the way a config names it."""
    module = getattr(fn, "__module__", None) or "?"
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
    return f"{module}:{name}"


def _shorten(text: str, limit: int = 80) -> str:
    return repr(text) if len(text) <= limit else repr(text[:limit]) + f"... ({len(text)} chars)"


def score_samples(fn: RewardFn, prompts: Sequence[str], responses: Sequence[str],
                  answers: Sequence[str]) -> list[float]:
    """``fn`` on every sample, as floats. An exception, or a result that is not a finite real
    number, becomes a RewardError naming the function, the sample's index and its strings."""
    if not len(prompts) == len(responses) == len(answers):
        raise ValueError(f"prompts, responses and answers must be equally long, got "
                         f"{len(prompts)}, {len(responses)}, {len(answers)}")
    scores = []
    for i, (p, r, a) in enumerate(zip(prompts, responses, answers)):
        where = (f"reward function {describe_fn(fn)} on sample {i} "
                 f"(prompt={_shorten(p)}, response={_shorten(r)}, answer={_shorten(a)})")
        try:
            value = fn(p, r, a)
        except Exception as e:
            raise RewardError(f"{where} raised {type(e).__name__}: {e}") from e
        # bool is an int subclass and a fine 1/0 reward; strings, None, tensors of several values are not
        if isinstance(value, (str, bytes)):
            raise RewardError(f"{where} returned {value!r} ({type(value).__name__}), not a number")
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise RewardError(f"{where} returned {value!r} ({type(value).__name__}), not a number") from None
        if not math.isfinite(number):
            raise RewardError(f"{where} returned {number}, not a finite number")
        scores.append(number)
    return scores
