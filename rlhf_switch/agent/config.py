"""The ``agent`` config block (typed, strict), for a run's multi-turn rollouts::

    agent:
      env: calc                    # a registered environment or "module:Class"
      env_kwargs: {tools: true}
      max_turns: 3
      max_total_tokens: 48         # everything after the prompt (observations included)
      max_turn_tokens: null        # one model turn (null: only the total)
      failed_samples: zero         # env_error / timeout samples: zero (reward 0, trained on) | exclude
      pool:
        num_workers: 2             # Ray actors running the environments
        num_cpus: 0.25             # each (fractions are fine)
        timeout_s: 30              # one reset / step / close call
        start_timeout_s: 120       # a worker's start
        max_concurrency: 32        # threads per worker: calls of different sessions at once
        in_process: false          # true: no Ray (LocalEnvPool: no timeouts; tests, evaluation)

``AgentConfig.limits(max_context)`` and ``EnvPoolConfig.build()`` give what the episode driver
and the pool take.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from .limits import Limits


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class EnvPoolConfig(_Strict):
    num_workers: int = Field(2, ge=1)
    num_cpus: float = Field(0.25, gt=0)
    timeout_s: float = Field(30.0, gt=0)
    start_timeout_s: float = Field(120.0, gt=0)
    max_concurrency: int = Field(32, ge=1)
    in_process: bool = False

    def build(self) -> Any:
        """The pool: ``RayEnvPool`` (Ray must be running), or ``LocalEnvPool`` when ``in_process``."""
        from .pool import LocalEnvPool, RayEnvPool

        if self.in_process:
            return LocalEnvPool()
        return RayEnvPool(num_workers=self.num_workers, num_cpus=self.num_cpus, timeout_s=self.timeout_s,
                          start_timeout_s=self.start_timeout_s, max_concurrency=self.max_concurrency)


class AgentConfig(_Strict):
    env: str
    env_kwargs: dict = Field(default_factory=dict)
    max_turns: int = Field(..., ge=1)
    max_total_tokens: int = Field(..., ge=1)
    max_turn_tokens: int | None = Field(None, ge=1)
    failed_samples: Literal["zero", "exclude"] = "zero"
    pool: EnvPoolConfig = Field(default_factory=EnvPoolConfig)

    @field_validator("env")
    @classmethod
    def _known(cls, v: str) -> str:
        from .env import ENVIRONMENTS

        if v not in ENVIRONMENTS and ":" not in v:
            raise ValueError(f"unknown environment {v!r}; registered: {', '.join(sorted(ENVIRONMENTS))} "
                             f"(or 'module:Class')")
        return v

    def limits(self, max_context: int) -> Limits:
        return Limits(max_turns=self.max_turns, max_total_tokens=self.max_total_tokens, max_context=max_context,
                      max_turn_tokens=self.max_turn_tokens)
