"""The environment interface: gym-shaped, text in and text out, one instance per sample.

    env = build_environment("guess")              # a registered name, or a user's "module:Class"
    observation = env.reset(sample)               # str; "" when there is nothing to add after the prompt
    result = env.step(action)                     # StepResult(observation, reward, done, info)
    env.close()

``action`` is the text of one model turn (decoded up to the end of the turn); the observation is
the text the environment answers with, appended to the conversation as tokens by whoever drives
it (``rlhf_switch.agent.episode``). Environments never see tokens. An environment keeps the state
of one sample; a new sample gets a new instance (one shared instance across prompts is a known
bug class in the field).

``register_environment(name)`` adds a class to ``ENVIRONMENTS``; ``build_environment(spec,
**kwargs)`` builds a registered one or imports a user's ``module:Class`` (any class with
``reset``/``step``/``close``; subclassing ``Environment`` is not required). ``check_step_result``
and ``check_observation`` turn what an environment returned into a ``StepResult`` or one
``EnvError`` saying what is wrong with it — the pool's workers use them so that a bad
return fails that sample with the message, not the caller.
"""
from __future__ import annotations

from ..rl.imports import import_named
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass(frozen=True)
class StepResult:
    """What one ``step`` returns: the text to append (may be ""), the reward of this step, whether
    the episode is over, and anything worth recording (``info``: plain, picklable values)."""

    observation: str
    reward: float = 0.0
    done: bool = False
    info: dict = field(default_factory=dict)


class Environment:
    """A text environment for one sample. Subclass and override ``reset`` and ``step``
    (``close`` if the instance holds something to release)."""

    def reset(self, sample: Any) -> str:
        """Begin the episode of ``sample`` (the task's record: e.g. ``rl.tasks.Sample``); return the
        first observation, appended after the prompt ("" for none)."""
        raise NotImplementedError

    def step(self, action: str) -> StepResult:
        """The model's turn ``action`` (its text); return the environment's answer."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what the instance holds; called once when the sample ends, however it ends."""


class EnvError(RuntimeError):
    """An environment could not be built, raised, or returned something that is not what the
    interface says."""

# name -> class, or the "module:Class" of a shipped one (imported on first use: no import cycle,
# and a worker imports only the environment it runs)
ENVIRONMENTS: dict[str, Callable[..., Any] | str] = {
    "tools": "rlhf_switch.agent.tools:ToolEnvironment",
    "calc": "rlhf_switch.agent.calc:CalcEnvironment",
    "guess": "rlhf_switch.agent.guess:GuessEnvironment",
}


def register_environment(name: str) -> Callable[[type], type]:
    """Class decorator: ``@register_environment("guess")`` makes ``build_environment("guess")``
    build the class."""
    def add(cls: type) -> type:
        if name in ENVIRONMENTS and ENVIRONMENTS[name] is not cls:
            raise ValueError(f"environment {name!r} is already registered ({ENVIRONMENTS[name]!r})")
        ENVIRONMENTS[name] = cls
        return cls
    return add


def environment_class(spec: str) -> Callable[..., Any]:
    """The class ``spec`` names: a registered name, or ``module:Class`` (imported)."""
    spec = ENVIRONMENTS.get(spec, spec)
    if not isinstance(spec, str):
        return spec
    if ":" not in spec:
        raise EnvError(f"unknown environment {spec!r}; registered: {', '.join(sorted(ENVIRONMENTS))} "
                       f"(or name your own as 'module:Class')")
    try:
        obj = import_named(spec, "environment")
    except ValueError as e:
        raise EnvError(str(e)) from None
    missing = [m for m in ("reset", "step", "close") if not callable(getattr(obj, m, None))]
    if missing:
        raise EnvError(f"environment {spec!r} has no {', '.join(missing)} method(s)")
    return obj


def build_environment(spec: str, **kwargs: Any) -> Any:
    """A new instance of the environment ``spec`` names, built with ``kwargs``."""
    return environment_class(spec)(**kwargs)


def check_observation(obs: Any, where: str) -> str:
    """``obs`` when it is a ``str``, else ``EnvError`` naming ``where`` and the type."""
    if not isinstance(obs, str):
        raise EnvError(f"{where} returned an observation of type {type(obs).__name__}, not str: {obs!r:.80}")
    return obs


def check_step_result(result: Any) -> StepResult:
    """``result`` as a ``StepResult`` (a ``StepResult``, or a gym-style 4-tuple ``(observation,
    reward, done, info)``), with a ``str`` observation, a finite real reward, a bool ``done`` and a
    dict ``info``; else ``EnvError`` saying which field is wrong."""
    if isinstance(result, StepResult):
        obs, reward, done, info = result.observation, result.reward, result.done, result.info
    elif isinstance(result, tuple) and len(result) == 4:
        obs, reward, done, info = result
    else:
        raise EnvError(f"step returned a {type(result).__name__}, not a StepResult "
                       f"(or an (observation, reward, done, info) tuple): {result!r:.80}")
    check_observation(obs, "step")
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not math.isfinite(float(reward)):
        raise EnvError(f"step returned a reward that is not a finite number: {reward!r:.80}")
    if not isinstance(done, (bool,)) and not (isinstance(done, numbers.Integral) and done in (0, 1)):
        raise EnvError(f"step returned done={done!r:.80}, not a bool")
    if not isinstance(info, dict):
        raise EnvError(f"step returned info of type {type(info).__name__}, not dict")
    return StepResult(obs, float(reward), bool(done), dict(info))
