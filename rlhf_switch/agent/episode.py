"""One sample's multi-turn episode, driven turn by turn over an append-only token list.

    episode = await run_episode(generate, pool, request, codec, limits)

``generate(token_ids, max_new_tokens, stop_ids)`` is the model (any engine: an async function that
returns the new token ids — ``<eos>`` or the stop id that ended the turn included — or a
``Generated`` with their log-probs and weight versions). ``pool`` is an environment pool
(``rlhf_switch.agent.pool``), ``request`` an ``EpisodeRequest`` (session, environment, sample,
prompt ids, stop ids), ``codec`` what turns a model turn's ids into the action text and an
observation's text into ids (``CharTokenizer`` as it is; ``HFCodec`` around a Hugging Face
tokenizer; ``agent.chat.ChatCodec`` for a chat model, whose ``observation_ids(text, turn)`` writes an
observation as the chat template's message after the model's last turn).

Token exactness: the episode's tokens are the prompt, then, in order, each model turn's ids
exactly as ``generate`` returned them and each observation's ids from ``codec.encode`` of that
observation alone. Nothing already in the list is ever decoded and encoded again: the action text
given to the environment is decoded from the turn's ids, and those ids stay. ``loss_mask`` is 1 on
model tokens and 0 on environment tokens; with ``Generated`` log-probs and versions, environment
tokens get log-prob 0.0 and version -1.

Each turn: the model generates at most ``limits.turn_budget`` tokens, stopping at ``<eos>`` or one
of the request's ``stop_ids``; the environment steps on the turn's text; its observation is
appended and the model goes on, until the environment says done (``stop``), the model has had
``max_turns`` turns (``max_turns``), the budget runs out (``length``), or the environment fails
(``env_error`` / ``timeout``, the pool's message in ``error``). A turn the budget cut before it
stopped is not sent to the environment. An observation is appended only when the model will read
it: not after ``done`` or the last turn, and not when it does not leave at least one token of the
budget for the model's next turn — the sample then ends with ``length`` and ``dropped_tokens``
says how long the observation was (it is never cut: a cut observation is text the environment did
not say, and nothing would be generated after it). The session is
closed in every case. The episode's ``reward`` is the sum of its steps' rewards (a failed sample
keeps what it had; the caller decides whether failures are zeroed or excluded).
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Protocol, Sequence

from .limits import FAILURES, FINISH_REASONS, FinishReason, Limits


class Codec(Protocol):
    eos_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


def observation_ids(codec: Codec, text: str, turn: Sequence[int] | None) -> list[int]:
    """An observation's ids after model turn ``turn`` (None before the first): the codec's own
    ``observation_ids`` when it has one (a chat template's message), else ``encode(text)``."""
    own = getattr(codec, "observation_ids", None)
    return own(text, turn) if own is not None else codec.encode(text)


class HFCodec:
    """A Hugging Face tokenizer as a ``Codec``: observations encoded alone, without special tokens
    (``add_special_tokens=False``); a turn decoded up to its eos, special tokens skipped."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.eos_id = tokenizer.eos_token_id

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        ids = list(ids)
        if self.eos_id in ids:
            ids = ids[:ids.index(self.eos_id)]
        return self.tokenizer.decode(ids, skip_special_tokens=True)


@dataclass(frozen=True)
class Generated:
    """One model turn as an engine returns it."""

    token_ids: list[int]
    logprobs: list[float] | None = None
    versions: list[int] | None = None


Generate = Callable[[list[int], int, frozenset], Awaitable["Generated | list[int]"]]


@dataclass(frozen=True)
class EpisodeRequest:
    session: str
    env: str  # a registered environment name or "module:Class"
    sample: Any
    prompt_ids: tuple[int, ...]
    env_kwargs: dict = field(default_factory=dict)
    stop_ids: frozenset = frozenset()  # besides the codec's eos: where a model turn ends


@dataclass
class Episode:
    session: str
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)  # everything after the prompt
    loss_mask: list[int] = field(default_factory=list)  # 1: model token, 0: environment token
    logprobs: list[float] | None = None  # when generate gave them; 0.0 on environment tokens
    versions: list[int] | None = None  # when generate gave them; -1 on environment tokens
    segments: list[tuple[str, int]] = field(default_factory=list)  # ("model" | "env", tokens), in order
    actions: list[str] = field(default_factory=list)  # each model turn's text, as the environment got it
    observations: list[str] = field(default_factory=list)  # each observation appended
    infos: list[dict] = field(default_factory=list)  # each step's info
    step_rewards: list[float] = field(default_factory=list)
    reward: float = 0.0
    turns: int = 0  # model turns
    finish_reason: FinishReason | None = None
    error: str | None = None
    dropped_tokens: int = 0  # the length of an observation that did not fit (finish_reason length)
    env_seconds: float = 0.0

    @property
    def failed(self) -> bool:
        return self.finish_reason in FAILURES

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def text(self, codec: Codec) -> str:
        """The conversation after the prompt as text: each segment decoded alone (a model turn up
        to its eos), in order — for records; the token list is what trains."""
        out, at = [], 0
        for _, n in self.segments:
            out.append(codec.decode(self.response_ids[at:at + n]))
            at += n
        return "".join(out)

    def _append(self, kind: str, ids: Sequence[int], logprobs: Sequence[float] | None = None,
                versions: Sequence[int] | None = None) -> None:
        model = kind == "model"
        if model:
            if not any(k == "model" for k, _ in self.segments):  # the first turn decides what the record holds
                self.logprobs = [0.0] * len(self.response_ids) if logprobs is not None else None
                self.versions = [-1] * len(self.response_ids) if versions is not None else None
            elif (logprobs is None) != (self.logprobs is None) or (versions is None) != (self.versions is None):
                raise ValueError("generate returned log-probs or versions for some turns of an episode, not all")
        self.response_ids += ids
        self.loss_mask += [1 if model else 0] * len(ids)
        if self.logprobs is not None:
            self.logprobs += list(logprobs) if model and logprobs is not None else [0.0] * len(ids)
        if self.versions is not None:
            self.versions += list(versions) if model and versions is not None else [-1] * len(ids)
        self.segments.append((kind, len(ids)))

    def _finish(self, reason: FinishReason, error: str | None = None) -> None:
        assert reason in FINISH_REASONS, reason
        self.finish_reason, self.error = reason, error


def _as_generated(out: Any, budget: int, stops: frozenset) -> Generated:
    g = out if isinstance(out, Generated) else Generated(list(out))
    ids = [int(i) for i in g.token_ids]
    if not ids or len(ids) > budget:
        raise ValueError(f"generate returned {len(ids)} tokens for a turn of at most {budget} (and at least 1)")
    cut = [k for k, i in enumerate(ids[:-1]) if i in stops]
    if cut:
        raise ValueError(f"generate went on after a stop token (position {cut[0]} of {len(ids)})")
    for name, extra in (("logprobs", g.logprobs), ("versions", g.versions)):
        if extra is not None and len(extra) != len(ids):
            raise ValueError(f"generate returned {len(extra)} {name} for {len(ids)} tokens")
    return Generated(ids, None if g.logprobs is None else list(g.logprobs),
                     None if g.versions is None else list(g.versions))


async def run_episode(generate: Generate, pool: Any, request: EpisodeRequest, codec: Codec,
                      limits: Limits) -> Episode:
    """Drive ``request``'s sample through its environment (see the module docstring)."""
    ep = Episode(request.session, list(request.prompt_ids))
    prompt_len = len(ep.prompt_ids)
    limits.check_prompt(prompt_len)
    stops = frozenset(request.stop_ids) | {codec.eos_id}
    turn = None  # the last model turn, which an observation follows

    def observe(text: str) -> bool:
        """Append the observation; False when the episode ended over it."""
        try:
            ids = observation_ids(codec, text, None if turn is None else turn.token_ids)
        except Exception as e:
            ep._finish("env_error", f"the observation cannot be tokenized: {type(e).__name__}: {e}")
            return False
        room = limits.room(prompt_len, len(ep.response_ids))
        if len(ids) >= room:  # the model must have a token left to read it with
            ep.dropped_tokens = len(ids)
            ep._finish("length", f"an observation of {len(ids)} tokens leaves no room for the model "
                                 f"({room} tokens left)")
            return False
        if ids:
            ep._append("env", ids)
        ep.observations.append(text)
        return True

    # a caller's mistake (the session already open) raises here, before this episode owns the session
    reply = await pool.reset(request.session, request.env, request.sample, request.env_kwargs)
    try:
        ep.env_seconds += reply.seconds
        if reply.failed:
            ep._finish(reply.finish_reason, reply.error)
            return ep
        if reply.observation and not observe(reply.observation):
            return ep
        while True:
            budget = limits.turn_budget(prompt_len, len(ep.response_ids))
            if budget == 0:
                ep._finish("length", "no room left for a model turn")
                return ep
            turn = _as_generated(await generate(ep.ids, budget, stops), budget, stops)
            ep._append("model", turn.token_ids, turn.logprobs, turn.versions)
            ep.turns += 1
            if turn.token_ids[-1] not in stops:
                ep._finish("length", f"a model turn used its {budget} tokens without ending")
                return ep
            action = codec.decode(turn.token_ids)
            ep.actions.append(action)
            reply = await pool.step(request.session, action)
            ep.env_seconds += reply.seconds
            if reply.failed:
                ep._finish(reply.finish_reason, reply.error)
                return ep
            ep.infos.append(reply.info)
            ep.step_rewards.append(reply.reward)
            ep.reward += reply.reward
            if reply.done:
                ep._finish("stop")
                return ep
            if ep.turns >= limits.max_turns:
                ep._finish("max_turns")
                return ep
            if not observe(reply.observation):
                return ep
    finally:
        await pool.close(request.session)


async def run_episodes(generate: Generate, pool: Any, requests: Sequence[EpisodeRequest], codec: Codec,
                       limits: Limits, concurrency: int | None = None) -> list[Episode]:
    """``run_episode`` for every request, concurrently (at most ``concurrency`` at once), in order."""
    gate = asyncio.Semaphore(concurrency) if concurrency else None

    async def one(r: EpisodeRequest) -> Episode:
        if gate is None:
            return await run_episode(generate, pool, r, codec, limits)
        async with gate:
            return await run_episode(generate, pool, r, codec, limits)

    return list(await asyncio.gather(*(one(r) for r in requests)))


def episode_metrics(episodes: Sequence[Episode]) -> dict:
    """What a batch of episodes did: ``reward_mean``, ``turns_mean``, ``tokens_mean`` (after the
    prompt), ``finish/<reason>`` (fractions), ``tool_calls_per_sample``, ``tool_call_success``
    (of the calls tried; NaN when none), ``env_seconds_mean`` and ``dropped_tokens`` (total)."""
    n = len(episodes)
    if n == 0:
        return {"n": 0}
    calls = [i for e in episodes for i in e.infos if "tool_ok" in i]
    out = {"n": n,
           "reward_mean": sum(e.reward for e in episodes) / n,
           "turns_mean": sum(e.turns for e in episodes) / n,
           "tokens_mean": sum(len(e.response_ids) for e in episodes) / n,
           "tool_calls_per_sample": len(calls) / n,
           "tool_call_success": sum(bool(i["tool_ok"]) for i in calls) / len(calls) if calls else float("nan"),
           "env_seconds_mean": sum(e.env_seconds for e in episodes) / n,
           "dropped_tokens": sum(e.dropped_tokens for e in episodes)}
    for r in FINISH_REASONS:
        out[f"finish/{r}"] = sum(e.finish_reason == r for e in episodes) / n
    return out
