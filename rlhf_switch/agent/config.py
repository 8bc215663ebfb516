"""The ``agent`` config block and what the episode driver and the pool are built from.

The block itself (``AgentConfig``, ``EnvPoolConfig``) is a part of the run config
(``rlhf_switch.rl.config``: typed, strict, importing nothing of this package)::

    agent:
      env: calc                    # a registered environment or "module:Class" (checked before the run)
      env_kwargs: {tools: true}
      max_turns: 3
      max_total_tokens: null       # everything after the prompt (observations included); null: the
                                   # run's algorithm.max_new_tokens (the trainer's room)
      max_turn_tokens: null        # one model turn (null: only the total)
      failed_samples: zero         # env_error / timeout samples: zero (reward 0, trained on) | exclude
      observation_role: user       # with data.chat_template: an observation's message role (user | tool)
      system: null                 # with data.chat_template: the system message (null: the template's default)
      pool:
        num_workers: 2             # Ray actors running the environments
        num_cpus: 0.25             # each (fractions are fine)
        timeout_s: 30              # one reset / step / close call
        start_timeout_s: 120       # a worker's start
        max_concurrency: 32        # threads per worker: calls of different sessions at once
        in_process: false          # true: no Ray (LocalEnvPool: no timeouts; tests, evaluation)

``episode_limits(block, max_context)``, ``build_pool(block.pool)`` and, for a chat model,
``chat_codec(tokenizer, block)`` give what the episode driver and the pool take;
``prompt_renderer(cfg, tokenizer)`` is how a chat run's data loader writes each prompt
(``chat_prompt``: the system message and the environment's tools in the template's first turn).
"""
from __future__ import annotations

from typing import Any, Callable

from ..rl.config import AgentConfig, EnvPoolConfig
from .limits import Limits

__all__ = ["AgentConfig", "EnvPoolConfig", "build_pool", "chat_codec", "chat_prompt", "episode_limits",
           "prompt_renderer"]


def build_pool(pool: EnvPoolConfig) -> Any:
    """The pool: ``RayEnvPool`` (Ray must be running), or ``LocalEnvPool`` when ``in_process``."""
    from .pool import LocalEnvPool, RayEnvPool

    if pool.in_process:
        return LocalEnvPool()
    return RayEnvPool(num_workers=pool.num_workers, num_cpus=pool.num_cpus, timeout_s=pool.timeout_s,
                      start_timeout_s=pool.start_timeout_s, max_concurrency=pool.max_concurrency)


def episode_limits(agent: AgentConfig, max_context: int, max_total_tokens: int | None = None) -> Limits:
    """The episode's limits; ``max_total_tokens``: where the block leaves it null (a run's
    ``algorithm.max_new_tokens``)."""
    total = agent.max_total_tokens if agent.max_total_tokens is not None else max_total_tokens
    if total is None:
        raise ValueError("agent.max_total_tokens is not set")
    return Limits(max_turns=agent.max_turns, max_total_tokens=total, max_context=max_context,
                  max_turn_tokens=agent.max_turn_tokens)


def chat_codec(tokenizer: Any, agent: AgentConfig) -> Any:
    """The codec of a chat model's episodes (``agent.chat.ChatCodec``; ``ChatTemplateError`` when
    the tokenizer's template cannot extend a conversation token by token)."""
    from .chat import ChatCodec

    return ChatCodec(tokenizer, observation_role=agent.observation_role, system=agent.system)


def prompt_renderer(cfg: Any, tokenizer: Any) -> Callable[[str], str] | None:
    """How a run writes a data prompt's text for the model (``rl.data.load_splits``'s ``render``):
    an agent run with a chat template starts each episode from the template's first turn with
    its system message and the environment's tools (``chat_prompt``); None — the loader's own
    rendering — for any other run."""
    if cfg.agent is not None and cfg.data is not None and cfg.data.chat_template:
        return chat_prompt(tokenizer, cfg.agent)
    return None


def chat_prompt(tokenizer: Any, agent: AgentConfig) -> Callable[[str], str]:
    """A chat run's prompt for a data file's prompt text: the template's first turn with
    ``agent.system`` and the tools the environment declares (``chat.env_tools``) — what the
    episodes start from, so the loader's length check counts all of it."""
    from .chat import env_tools

    codec, tools = chat_codec(tokenizer, agent), env_tools(agent.env, agent.env_kwargs)
    return lambda text: codec.prompt_text(text, tools)
