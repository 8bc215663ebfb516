"""Many samples' episodes driven together against a batch generator: what a multi-turn rollout is.

    result = run_workflow(generate_batch, pool, requests, codec, limits, seeds, temperature)

``generate_batch(prompts, seeds, budgets, temperature, stops)`` is the rollout engines, called with
every turn that is ready at once (token ids in, token ids, their log-probs and the weight version
out: ``recipes.loop.workflow`` adapts the run's replicas to it). Each sample's episode runs as its own
coroutine (``episode.run_episode``); its ``generate`` call parks the turn in ``TurnBatcher``, which
sends parked turns as one batch in one of two ways (``batching``, the config's
``agent.turn_batching``):

- ``rounds`` (the default): when every episode still running is waiting for the model — the
  environments' calls of one round run concurrently in the pool meanwhile. The batches depend
  only on the samples, their seeds and the environments' answers, never on timing; but a round
  waits for its slowest environment call (a tool that answers late holds every episode).
- ``continuous``: whenever no batch is being generated — the turns that parked meanwhile go out
  together as soon as the engines return the batch before. No episode waits for another's
  environment call, only for the batch in flight; which turns share a batch depends on timing.

Either way a sample's tokens are the same: each turn is sampled from its own context and seed
(below), and the run's engines give a prompt the same tokens in any batch (tested: the torch
engine against one prompt at a time, and the two ways here against each other).

A turn's budget differs per sample (what is left of the total), and so may its stop ids (the
episode's own, e.g. a tool call's closing token, besides ``<eos>``): both go to the engines, which
stop there (the run's vLLM and torch engines do). The batcher still cuts each answer after its
first stop id, so a generator that does not stop (a test's scripted one, a greedy evaluator) gives
the same episode: the tokens kept are exactly those an engine that stopped there produces, since a
token is sampled from the ones before it and the sample's own seed, never from the ones after. Turn 0 is generated with the sample's own seed (a one-turn workflow is the
single-turn rollout, token for token); its call ``t`` (a turn, or with ``segment_tokens`` a segment
of one) with ``turn_seed(seed, t)``.

**Partial rollout** (``segment_tokens`` K > 0): a turn is generated K tokens a call; a call that
ends neither at a stop id nor at the turn's budget is followed by one whose context is the
turn's tokens so far, appended (its seed the next call number's). A weight update can land
between two calls (an agent run K steps ahead syncs between calls), so one turn's tokens may
carry several versions, each token its own.

Token exactness is checked, not assumed (``check_tokens``): the batcher records every call's
context (its length and a digest of its ids) and the ids it returned; every episode's final
sequence must begin with each of its calls' contexts, hold each call's ids right after it, and
its loss mask must be 1 on exactly those ids. An episode whose history was rebuilt from text
(decoded and encoded again between turns, the field's most reported multi-turn bug) fails it.
"""
from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

from .env import environment_class
from .episode import Episode, EpisodeRequest, Generated, run_episode
from .limits import Limits

# (prompts, seeds, budgets, temperature, stops) -> (tokens, logprobs, versions): one entry per prompt
GenerateBatch = Callable[[list[list[int]], list[int], list[int], float, list[frozenset]],
                         tuple[list[list[int]], list[list[float]], list[int]]]


class TurnStream(Protocol):
    """Engines that take turns at any time and answer each as soon as it is generated (the run's
    replicas pulling from one queue: ``recipes.cluster.turn_queue``). ``submit`` returns at once,
    one ``concurrent.futures.Future`` per prompt, each resolving to (tokens, logprobs, version)."""

    def submit(self, prompts: list[list[int]], seeds: list[int], budgets: list[int], temperature: float,
               stops: list[frozenset]) -> list: ...


class TokenMismatchError(RuntimeError):
    """A sample's trained tokens are not the tokens its turns were generated from and produced."""


def episode_request(env: str, env_kwargs: dict, sample: Any, session: str, tokenizer: Any,
                    rendered: bool = False) -> EpisodeRequest:
    """The episode of ``sample`` in environment ``env``: for a chat model (``tokenizer`` an
    ``agent.chat.ChatCodec``) ``chat.chat_request`` (``rendered``: the prompt is the template's
    first turn already); else the environment class's own
    ``episode_request(sample, session, tokenizer, **env_kwargs)`` when it has one (its prompt
    text and the stop ids that end a model turn), else ``<bos>`` + the sample's prompt with no
    stop id but ``<eos>``."""
    from .chat import ChatCodec, chat_request

    if isinstance(tokenizer, ChatCodec):
        return chat_request(tokenizer, env, env_kwargs, sample, session, rendered)
    cls = environment_class(env)
    own = getattr(cls, "episode_request", None)
    if own is not None:
        return own(sample, session, tokenizer, **env_kwargs)
    return EpisodeRequest(session=session, env=env, sample=sample,
                          prompt_ids=tuple(tokenizer.encode(sample.prompt, add_bos=True)), env_kwargs=dict(env_kwargs))


def turn_seed(seed: int, turn: int) -> int:
    """The sampling seed of a sample's turn ``turn``: its own seed for the first, then a hash of
    (seed, turn) below 2^62."""
    if turn == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


def cut_at_stop(tokens: Sequence[int], stops: frozenset) -> int:
    """How many of ``tokens`` a turn keeps: up to and including its first stop id (all when none)."""
    for k, t in enumerate(tokens):
        if t in stops:
            return k + 1
    return len(tokens)


@dataclass
class TurnCall:
    """One model turn as the batcher sent it: which episode, its context and what came back."""

    episode: int
    turn: int
    context_len: int
    context_digest: str
    output: list[int]


def _digest(ids: Sequence[int]) -> str:
    return hashlib.blake2b(",".join(map(str, ids)).encode(), digest_size=16).hexdigest()


@dataclass
class TurnBatcher:
    """Parks each episode's turn and sends the parked turns as one batch: when every episode still
    running waits for the model (rounds), or whenever no batch is generating (``continuous``;
    module docstring)."""

    generate_batch: GenerateBatch
    seeds: list[int]
    temperature: float
    live: int = 0
    continuous: bool = False  # batching "continuous": send whenever no batch is generating (module docstring)
    segment_tokens: int = 0  # > 0: a turn generated this many tokens a call (partial rollout)
    calls: list[TurnCall] = field(default_factory=list)
    batches: list[int] = field(default_factory=list)  # the size of each batch sent
    past_stop: int = 0  # tokens the engines returned after a turn's first stop id (cut)
    _parked: list[tuple] = field(default_factory=list)
    _turns: dict[int, int] = field(default_factory=dict)
    _flushing: bool = False

    def generate_for(self, episode: int):
        """The ``generate`` function of episode ``episode`` (its seeds are ``seeds[episode]``'s);
        with ``segment_tokens`` K, a turn is generated K tokens a call (module docstring)."""
        async def call(ids: list[int], budget: int, stops: frozenset) -> Generated:
            fut = asyncio.get_running_loop().create_future()
            self._parked.append((episode, list(ids), budget, stops, fut))
            self._maybe_flush()
            return await fut

        async def generate(ids: list[int], budget: int, stops: frozenset) -> Generated:
            if not self.segment_tokens:
                return await call(ids, budget, stops)
            tokens, logprobs, versions = [], [], []
            while True:  # the turn so far is the next segment's context: appended, never re-tokenized
                g = await call(list(ids) + tokens, min(self.segment_tokens, budget - len(tokens)), stops)
                tokens += g.token_ids
                logprobs += g.logprobs
                versions += g.versions
                if tokens[-1] in stops or len(tokens) >= budget:
                    return Generated(tokens, logprobs, versions)
        return generate

    def episode_done(self) -> None:
        self.live -= 1
        self._maybe_flush()

    def _maybe_flush(self) -> None:
        # rounds: only once no episode still running is busy with its environment
        ready = self.continuous or len(self._parked) == self.live
        if self._parked and ready and not self._flushing:
            self._flushing = True
            asyncio.get_running_loop().create_task(self._flush())

    def _numbered(self, parked: list) -> tuple[list[int], list[int]]:
        """Each parked turn's number in its episode and its seed (the numbers counted on)."""
        turns = [self._turns.get(e, 0) for e, *_ in parked]
        for e, *_ in parked:
            self._turns[e] = self._turns.get(e, 0) + 1
        return turns, [turn_seed(self.seeds[e], t) for (e, *_), t in zip(parked, turns)]

    def _answer(self, parked: tuple, turn: int, toks, lps, version) -> None:
        """The parked turn's episode gets its answer, cut after its first stop id."""
        e, ids, budget, stops, fut = parked
        keep = cut_at_stop(toks[:budget], stops)
        self.past_stop += len(toks) - keep
        out = Generated([int(x) for x in toks[:keep]], [float(x) for x in lps[:keep]], [int(version)] * keep)
        self.calls.append(TurnCall(e, turn, len(ids), _digest(ids), out.token_ids))
        fut.set_result(out)

    async def _flush(self) -> None:
        if hasattr(self.generate_batch, "submit"):
            return await self._flush_to_stream()
        parked, self._parked = self._parked, []
        try:
            turns, seeds = self._numbered(parked)
            # the engines block: in a thread, so the event loop keeps the pool's calls going
            tokens, logprobs, versions = await asyncio.to_thread(
                self.generate_batch, [p[1] for p in parked], seeds, [p[2] for p in parked], self.temperature,
                [p[3] for p in parked])
            for p, t, toks, lps, v in zip(parked, turns, tokens, logprobs, versions):
                self._answer(p, t, toks, lps, v)
            self.batches.append(len(parked))
        except BaseException as exc:  # every parked episode learns the batch failed
            for *_, fut in parked:
                if not fut.done():
                    fut.set_exception(exc)
            return
        finally:
            self._flushing = False
        self._maybe_flush()

    async def _flush_to_stream(self) -> None:
        """The parked turns into a ``TurnStream``; each episode gets its answer as soon as its own
        turn is back, and turns that park meanwhile go in at once (no batch to wait for)."""
        parked, self._parked = self._parked, []
        self._flushing = False
        try:
            turns, seeds = self._numbered(parked)
            futures = self.generate_batch.submit([p[1] for p in parked], seeds, [p[2] for p in parked],
                                                 self.temperature, [p[3] for p in parked])
            self.batches.append(len(parked))
        except BaseException as exc:
            for *_, fut in parked:
                fut.set_exception(exc)
            return

        async def one(p: tuple, t: int, f) -> None:
            try:
                self._answer(p, t, *await asyncio.wrap_future(f))
            except BaseException as exc:
                if not p[-1].done():
                    p[-1].set_exception(exc)

        await asyncio.gather(*(one(p, t, f) for p, t, f in zip(parked, turns, futures)))


@dataclass
class WorkflowResult:
    episodes: list[Episode]
    calls: list[TurnCall]
    batches: list[int]  # the size of each batch of turns sent to the engines
    tokens_past_stop: int = 0  # generated after a turn's stop id or budget and cut: 0 when the engines stop there


BATCHING = ("rounds", "continuous")


def run_workflow(generate_batch: GenerateBatch, pool: Any, requests: Sequence[EpisodeRequest], codec: Any,
                 limits: Limits, seeds: Sequence[int], temperature: float, batching: str = "rounds",
                 segment_tokens: int = 0) -> WorkflowResult:
    """Every request's episode, the turns of all of them batched ``batching``'s way (module
    docstring), each turn ``segment_tokens`` tokens a call when > 0 (partial rollout), checked for
    token exactness (``check_tokens``)."""
    if batching not in BATCHING:
        raise ValueError(f"batching must be one of {BATCHING}, got {batching!r}")
    if segment_tokens < 0:
        raise ValueError(f"segment_tokens must be >= 0, got {segment_tokens}")
    batcher = TurnBatcher(generate_batch, list(seeds), temperature, live=len(requests),
                          continuous=batching == "continuous", segment_tokens=segment_tokens)

    async def one(i: int, r: EpisodeRequest) -> Episode:
        try:
            return await run_episode(batcher.generate_for(i), pool, r, codec, limits)
        finally:
            batcher.episode_done()

    async def all_of_them() -> list[Episode]:
        return list(await asyncio.gather(*(one(i, r) for i, r in enumerate(requests))))

    episodes = asyncio.run(all_of_them())
    check_tokens([e.ids for e in episodes], [e.loss_mask for e in episodes], [len(e.prompt_ids) for e in episodes],
                 batcher.calls)
    return WorkflowResult(episodes, batcher.calls, batcher.batches, batcher.past_stop)


def check_tokens(sequences: Sequence[Sequence[int]], loss_masks: Sequence[Sequence[int]],
                 prompt_lens: Sequence[int], calls: Sequence[TurnCall]) -> int:
    """``TokenMismatchError`` unless every sequence (prompt + response, as it will be trained) is
    what its turns were generated from and produced: each call's context is a prefix of it, the
    call's ids follow right after, and the loss mask is 1 on exactly the calls' ids. Returns the
    number of model tokens checked."""
    model = [set() for _ in sequences]
    for c in calls:
        seq = sequences[c.episode]
        end = c.context_len + len(c.output)
        if _digest(seq[:c.context_len]) != c.context_digest or c.context_len > len(seq):
            raise TokenMismatchError(f"sample {c.episode}: its tokens before turn {c.turn} are not the "
                                     f"{c.context_len} tokens that turn was generated from")
        if list(seq[c.context_len:end]) != c.output:
            raise TokenMismatchError(f"sample {c.episode}: tokens {c.context_len}..{end} are not those turn "
                                     f"{c.turn} generated")
        model[c.episode].update(range(c.context_len, end))
    for i, (seq, mask, p) in enumerate(zip(sequences, loss_masks, prompt_lens)):
        if len(mask) != len(seq) - p:
            raise TokenMismatchError(f"sample {i}: {len(mask)} loss-mask entries for {len(seq) - p} response tokens")
        wrong = [k for k, m in enumerate(mask) if bool(m) != (p + k in model[i])]
        if wrong:
            raise TokenMismatchError(f"sample {i}: the loss mask is {mask[wrong[0]]} at response token {wrong[0]}, "
                                     f"which {'no' if mask[wrong[0]] else 'a'} model turn generated")
    return sum(len(m) for m in model)
