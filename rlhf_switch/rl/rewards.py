"""Reward functions and the ``module:function`` plug-in point.

A reward function takes ``(prompt, response, answer)`` — three strings, passed positionally, the
response already decoded up to ``<eos>`` — and returns a number. A *batched* reward function
(declared with ``@batched``, or any callable with an attribute ``batched = True``) takes three
equally long lists of strings instead and returns one number per sample, in the same order. The
shipped ones are exact match (1.0 or 0.0: what "verifiable" means) and, separately, a
partial-credit score for shaping experiments, and for math word problems (GSM8K style)
``math_answer`` (the final number matches) and ``math_format`` (the response ends with
``#### <number>``). A user's function is named in the config as ``package.module:function`` (or
``module:Class.method``) and loaded with ``load_reward_fn``; ``score_samples`` calls it over a
batch (once for a batched function, once per sample otherwise) and turns any exception, a result
that is not a number, or a call over the time limit into one ``RewardError`` that names the
function and the sample, instead of a traceback from deep inside a worker. Where the loop runs it
(this process, or worker processes whose calls a timeout stops): ``rlhf_switch.reward_workers``.
"""
from __future__ import annotations

import importlib
import math
import re
import time
import traceback
from decimal import Decimal, InvalidOperation
from typing import Any, Callable, Sequence

RewardFn = Callable[[str, str, str], float]


class RewardError(RuntimeError):
    """A reward function could not be loaded, raised, returned something that is not a number, or
    took longer than its time limit."""


def batched(fn):
    """Declare ``fn`` a batched reward function: ``fn(prompts, responses, answers)`` with three
    equally long lists of strings returns one number per sample, in order (a list, a tuple, a 1-D
    array or tensor). One call scores a whole batch (or, with several reward workers, one
    contiguous part of it per worker), so a function that sends its samples to a server or a
    sandbox can do so at once. The same as setting ``fn.batched = True``."""
    fn.batched = True
    return fn


def is_batched(fn) -> bool:
    """Whether ``fn`` is declared batched (``@batched``; a bound method follows its function)."""
    return getattr(fn, "batched", False) is True


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
    # the agent tasks: an agent run is scored by its environment; this scores a single-turn run
    "calc": "rlhf_switch.rl.rewards:exact_match",
    "guess": "rlhf_switch.rl.rewards:exact_match",
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


def describe_sample(i: int, prompt: str, response: str, answer: str) -> str:
    """``sample 3 (prompt='12+5=', response='17', answer='17')``, each string shortened."""
    return f"sample {i} (prompt={_shorten(prompt)}, response={_shorten(response)}, answer={_shorten(answer)})"


def describe_exception(e: BaseException) -> str:
    """``KeyError: 'x' (my_rewards.py:12)``: the exception and where it was raised."""
    frames = traceback.extract_tb(e.__traceback__)
    at = f" ({frames[-1].filename.rsplit('/', 1)[-1]}:{frames[-1].lineno})" if frames else ""
    return f"{type(e).__name__}: {e}{at}"


def as_score(value: Any, where: Callable[[], str]) -> float:
    """``value`` as a float; a RewardError (``where()`` names the call) when it is not a finite
    real number. bool is an int subclass and a fine 1/0 reward; strings, None and tensors of
    several values are not."""
    if isinstance(value, (str, bytes)):
        raise RewardError(f"{where()} returned {value!r} ({type(value).__name__}), not a number")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise RewardError(f"{where()} returned {value!r} ({type(value).__name__}), not a number") from None
    if not math.isfinite(number):
        raise RewardError(f"{where()} returned {number}, not a finite number")
    return number


class Watch:
    """What ``score_samples`` reports as it goes (a worker process writes it where the driver
    reads it: ``rlhf_switch.reward_workers``): a call starting on sample ``index``, samples scored."""

    def started(self, index: int) -> None:
        pass

    def scored(self, count: int) -> None:
        pass


def score_samples(fn: RewardFn, prompts: Sequence[str], responses: Sequence[str],
                  answers: Sequence[str], *, first: int = 0, timeout_s: float | None = None,
                  watch: Watch | None = None) -> list[float]:
    """``fn`` on every sample, as floats: one call per sample, or one call over all of them when
    ``fn`` is batched (``is_batched``). An exception, a result that is not a finite real number,
    or (``timeout_s``) a call that returned later than that becomes a RewardError naming the
    function, the sample (its index: ``first`` + its position here) and its strings. A call in
    this process cannot be stopped at the limit, only refused after it; worker processes stop it
    (``rlhf_switch.reward_workers``)."""
    if not len(prompts) == len(responses) == len(answers):
        raise ValueError(f"prompts, responses and answers must be equally long, got "
                         f"{len(prompts)}, {len(responses)}, {len(answers)}")
    name = describe_fn(fn)
    if is_batched(fn):
        return _score_batch(fn, name, list(prompts), list(responses), list(answers), first, timeout_s, watch)
    scores = []
    for i, (p, r, a) in enumerate(zip(prompts, responses, answers)):
        def where(i=i, p=p, r=r, a=a) -> str:
            return f"reward function {name} on {describe_sample(first + i, p, r, a)}"

        if watch is not None:
            watch.started(first + i)
        t0 = time.perf_counter()
        try:
            value = fn(p, r, a)
        except Exception as e:
            raise RewardError(f"{where()} raised {describe_exception(e)}") from e
        _within(where, time.perf_counter() - t0, timeout_s)
        scores.append(as_score(value, where))
        if watch is not None:
            watch.scored(1)
    return scores


def _score_batch(fn, name: str, prompts: list, responses: list, answers: list, first: int,
                 timeout_s: float | None, watch: Watch | None) -> list[float]:
    n = len(prompts)
    if n == 0:
        return []

    def where() -> str:
        last = first + n - 1
        return (f"reward function {name} (batched) on samples {first}..{last}, the first "
                f"{describe_sample(first, prompts[0], responses[0], answers[0])}")

    if watch is not None:
        watch.started(first)
    t0 = time.perf_counter()
    try:
        values = fn(prompts, responses, answers)
    except Exception as e:
        raise RewardError(f"{where()} raised {describe_exception(e)}") from e
    _within(where, time.perf_counter() - t0, timeout_s)
    if hasattr(values, "tolist"):  # an array or tensor: its numbers as Python floats
        values = values.tolist()
    if isinstance(values, (str, bytes, dict)) or not hasattr(values, "__len__"):
        raise RewardError(f"{where()} returned {_shorten(repr(values), 60)} ({type(values).__name__}), "
                          f"not one number per sample")
    values = list(values)
    if len(values) != n:
        raise RewardError(f"{where()} returned {len(values)} scores for {n} samples")
    scores = [as_score(v, lambda i=i: f"reward function {name} (batched) on "
                                      f"{describe_sample(first + i, prompts[i], responses[i], answers[i])}")
              for i, v in enumerate(values)]
    if watch is not None:
        watch.scored(n)
    return scores


def _within(where: Callable[[], str], seconds: float, timeout_s: float | None) -> None:
    if timeout_s is not None and seconds > timeout_s:
        raise RewardError(f"{where()} took {seconds:.1f} s, over the limit of {timeout_s:g} s "
                          f"(reward_timeout_s; in the driver's process a call is refused after it "
                          f"returns — reward_workers >= 1 stops it at the limit)")
