"""Many episodes driven together (rlhf_switch.agent.workflow): turns batched only when every episode
still running waits for the model, each answer cut after its first stop id, turn seeds, and the
token-exactness check — which must catch a history rebuilt from text, a changed model token and a
loss mask on the environment's tokens. The "engine" here is a scripted batch function (the
workflow's contract is about tokens, not about a model); the loop's multi-turn runs with real
engines are in tests/test_agent_loop.py. Seconds, one process."""
from __future__ import annotations

import json

import pytest

from rlhf_switch.agent import calc, guess
from rlhf_switch.agent.limits import Limits
from rlhf_switch.agent.pool import LocalEnvPool
from rlhf_switch.agent.workflow import (TokenMismatchError, TurnCall, _digest, check_tokens, cut_at_stop,
                                        episode_request, run_workflow, turn_seed)
from rlhf_switch.rl.tasks import CharTokenizer, Sample

TOK = CharTokenizer()
GARBAGE = TOK.encode("999")  # what an engine that does not know the stop ids generates after one


class Scripted:
    """A batch "engine": each prompt's answer is ``policy(context text)`` encoded (a final answer
    with its <eos>), then garbage past the stop (the batcher must cut it); log-probs -0.5 per token, version 7. Records every batch."""

    def __init__(self, policy):
        self.policy, self.batches = policy, []

    def __call__(self, prompts, seeds, budgets, temperature, stops):
        self.batches.append((list(map(list, prompts)), list(seeds), list(budgets), temperature, list(stops)))
        tokens = [(self.turn(self.policy(TOK.decode(p), s)) + GARBAGE)[:b] for p, s, b in zip(prompts, seeds, budgets)]
        return tokens, [[-0.5] * len(t) for t in tokens], [7] * len(tokens)

    @staticmethod
    def turn(text: str) -> list[int]:
        """A call or a guess ends at its closing character; a final answer at <eos>."""
        return TOK.encode(text) + ([] if text.endswith((",", ">")) else [TOK.eos_id])


def binary_search(text: str, seed: int) -> str:
    lo, hi = guess.feasible(text)
    return f"{(lo + hi + 1) // 2 if lo < hi else lo},"


def test_every_game_is_played_turn_by_turn_in_batches_and_cut_at_the_stop():
    secrets = ["1", "32", "63", "17", "40"]
    requests = [episode_request("guess", {}, Sample("guess=", s), f"s{i}", TOK) for i, s in enumerate(secrets)]
    engine = Scripted(binary_search)
    result = run_workflow(engine, LocalEnvPool(), requests, TOK, guess.limits(64), seeds=[10, 11, 12, 13, 14],
                          temperature=1.0)
    eps = result.episodes
    assert all(e.finish_reason == "stop" and e.reward == 1.0 for e in eps)
    # a batch holds every episode still playing: 5 at first, fewer as games are won
    turns = [e.turns for e in eps]
    assert result.batches == [sum(t > k for t in turns) for k in range(max(turns))]
    assert result.batches[0] == 5 and len(engine.batches) == max(turns)
    # each turn is the guess and its "," — the garbage after the stop is never appended
    for e in eps:
        assert all(a.endswith(",") for a in e.actions)
        assert not any(e.response_ids[k:k + 3] == GARBAGE for k in range(len(e.response_ids)))
        model = [t for t, m in zip(e.response_ids, e.loss_mask) if m]
        assert TOK.decode(model) == "".join(e.actions)
        assert e.logprobs == [-0.5 if m else 0.0 for m in e.loss_mask]
        assert e.versions == [7 if m else -1 for m in e.loss_mask]
    assert result.tokens_past_stop == len(GARBAGE) * len(result.calls)  # counted, as the loop records it
    # turn 0 with each sample's own seed, later turns with seeds of their own
    assert engine.batches[0][1] == [10, 11, 12, 13, 14]
    assert engine.batches[1][1] == [turn_seed(s, 1) for s, t in zip([10, 11, 12, 13, 14], turns) if t > 1]
    assert result.calls and len(result.calls) == sum(turns)
    # every turn counted per episode: turn k of each game still playing is sent with turn k's seed
    assert max(turns) >= 3
    for k, batch in enumerate(engine.batches):
        assert batch[1] == [turn_seed(s, k) for s, t in zip([10, 11, 12, 13, 14], turns) if t > k]
    for i, t in enumerate(turns):
        assert [c.turn for c in result.calls if c.episode == i] == list(range(t))


def test_a_turn_budget_is_each_samples_own_and_the_context_is_the_whole_list_so_far():
    requests = [episode_request("calc", {"tools": True}, Sample("12345*67=", "827115"), "c0", TOK),
                episode_request("calc", {"tools": False}, Sample("11111+22222=", "33333"), "c1", TOK)]
    assert requests[0].prompt_ids == calc.request(requests[0].sample, "c0", TOK, True).prompt_ids
    engine = Scripted(lambda text, seed: calc.expert_policy(text))
    result = run_workflow(engine, LocalEnvPool(), requests, TOK, calc.limits(64), seeds=[3, 4], temperature=0.0)
    a, b = result.episodes
    assert (a.reward, a.turns, b.reward, b.turns) == (1.0, 2, 1.0, 1)
    prompts, _, budgets, temperature, stops = engine.batches[0]
    assert prompts == [list(r.prompt_ids) for r in requests] and temperature == 0.0
    assert budgets == [64 - len(r.prompt_ids) for r in requests]
    # each turn goes with its episode's own stop ids (the engines stop there): the tool call's
    # closing text for the sample with tools, the eos alone without
    assert stops == [frozenset(TOK.encode(calc.CompactCallFormat.stop)) | {TOK.eos_id}, frozenset({TOK.eos_id})]
    # the second turn's context: the prompt, the call and the calculator's answer, as one list
    assert engine.batches[1][0] == [a.ids[:len(a.prompt_ids) + a.segments[0][1] + a.segments[1][1]]]


@pytest.mark.parametrize("batching", ["rounds", "continuous"])
def test_a_failing_engine_fails_the_workflow_not_hangs_it(batching):
    def broken(prompts, seeds, budgets, temperature, stops):
        raise RuntimeError("replica lost")

    requests = [episode_request("guess", {}, Sample("guess=", "5"), f"b{i}", TOK) for i in range(3)]
    with pytest.raises(RuntimeError, match="replica lost"):
        run_workflow(broken, LocalEnvPool(), requests, TOK, guess.limits(64), seeds=[0, 1, 2], temperature=1.0,
                     batching=batching)


def test_cut_at_stop_and_turn_seed():
    assert cut_at_stop([5, 6, 7, 6], frozenset({6})) == 2
    assert cut_at_stop([5, 6, 7], frozenset({9})) == 3 and cut_at_stop([], frozenset({1})) == 0
    assert cut_at_stop([2, 6], frozenset({2, 6})) == 1
    assert turn_seed(123, 0) == 123
    seeds = {turn_seed(s, t) for s in range(50) for t in range(1, 6)}
    assert len(seeds) == 250 and all(0 <= x < 2 ** 62 for x in seeds)
    assert turn_seed(123, 2) == turn_seed(123, 2) != turn_seed(124, 2)
    # the seeds are part of what makes a run reproducible: the same ones in every version (the first
    # 8 bytes of blake2b("seed:turn"), little-endian, shifted right by 2)
    assert (turn_seed(123, 1), turn_seed(123, 2), turn_seed(7, 5)) == (
        3599309027165979627, 1286273070284400737, 2572067823860015625)


def _one_game():
    """A played game: its sequence, mask, prompt length and the batcher's calls."""
    req = episode_request("guess", {}, Sample("guess=", "20"), "g", TOK)
    result = run_workflow(Scripted(binary_search), LocalEnvPool(), [req], TOK, guess.limits(64), seeds=[1],
                          temperature=1.0)
    e = result.episodes[0]
    assert e.turns >= 3
    return list(e.ids), list(e.loss_mask), len(e.prompt_ids), result.calls


def test_token_check_passes_the_played_game_and_counts_its_model_tokens():
    seq, mask, p, calls = _one_game()
    assert check_tokens([seq], [mask], [p], calls) == sum(mask)


def test_token_check_catches_a_history_rebuilt_between_turns():
    """The field's multi-turn bug: the conversation decoded and encoded again, so an earlier
    observation's ids differ from the ones the next turn was generated from."""
    seq, mask, p, calls = _one_game()
    env_pos = p + mask.index(0)  # the first observation's token
    rebuilt = seq[:env_pos] + [TOK.encode("<")[0] if seq[env_pos] != TOK.encode("<")[0] else TOK.encode(">")[0]] \
        + seq[env_pos + 1:]
    with pytest.raises(TokenMismatchError, match="before turn 1 are not"):
        check_tokens([rebuilt], [mask], [p], calls)


def test_token_check_catches_a_changed_model_token_and_a_shifted_turn():
    seq, mask, p, calls = _one_game()
    last = max(p + k for k, m in enumerate(mask) if m)
    changed = seq[:last] + [TOK.eos_id if seq[last] != TOK.eos_id else 5] + seq[last + 1:]
    with pytest.raises(TokenMismatchError, match="are not those turn"):
        check_tokens([changed], [mask], [p], calls)
    shifted = [TurnCall(c.episode, c.turn, c.context_len, c.context_digest, c.output) for c in calls]
    c0 = shifted[0]
    shifted[0] = TurnCall(0, 0, c0.context_len - 1, _digest(seq[:c0.context_len - 1]), c0.output)
    with pytest.raises(TokenMismatchError):
        check_tokens([seq], [mask], [p], shifted)


def test_token_check_catches_a_loss_mask_on_the_environments_tokens_or_off_the_models():
    seq, mask, p, calls = _one_game()
    on_env = list(mask)
    on_env[mask.index(0)] = 1
    with pytest.raises(TokenMismatchError, match="which no model turn generated"):
        check_tokens([seq], [on_env], [p], calls)
    off_model = list(mask)
    off_model[0] = 0
    with pytest.raises(TokenMismatchError, match="which a model turn generated"):
        check_tokens([seq], [off_model], [p], calls)
    with pytest.raises(TokenMismatchError, match=f"{len(mask) - 1} loss-mask entries for {len(mask)} response tokens"):
        check_tokens([seq], [mask[:-1]], [p], calls)


def test_token_check_names_the_missing_turn_of_a_sequence_cut_right_after_its_context():
    """A sequence that ends where the last turn's context ends holds that context but not the
    turn's tokens: the check says which tokens are missing, not that the context differs."""
    seq, mask, p, calls = _one_game()
    last = calls[-1]
    with pytest.raises(TokenMismatchError, match=f"tokens {last.context_len}..{last.context_len + len(last.output)} "
                                                 f"are not those turn {last.turn} generated"):
        check_tokens([seq[:last.context_len]], [mask[:last.context_len - p]], [p], calls)


def test_an_environment_without_its_own_request_gets_the_samples_prompt():
    req = episode_request("agent_envs:Raises", {}, Sample("7+8=", "15"), "r", TOK)
    assert req.prompt_ids == tuple(TOK.encode("7+8=", add_bos=True)) and req.stop_ids == frozenset()
    kwargs = {"level": 2}
    req = episode_request("agent_envs:Raises", kwargs, Sample("7+8=", "15"), "r", TOK)
    assert req.env_kwargs == {"level": 2} and req.env_kwargs is not kwargs  # the environment's arguments, a copy


def test_a_batch_waits_for_every_episode_still_running_however_long_its_environment_takes():
    """Environments answering after different times (threads of the pool): each round's turns still
    go to the engine as one batch — sending the first to arrive alone would make the batches, and
    so a run, depend on timing."""
    requests = [episode_request("agent_envs:Sleeps", {}, Sample("go=", s), f"z{i}", TOK)
                for i, s in enumerate(["0", "0.05", "0.1"])]
    engine = Scripted(lambda text, seed: "ok")
    with LocalEnvPool(timeout_s=5.0) as pool:
        result = run_workflow(engine, pool, requests, TOK, Limits(max_turns=3, max_total_tokens=40, max_context=64),
                              seeds=[0, 1, 2], temperature=1.0)
    assert [e.finish_reason for e in result.episodes] == ["max_turns"] * 3
    assert result.batches == [3, 3, 3]


def test_an_episode_that_ends_leaves_the_batches_and_the_others_still_wait_for_each_other():
    """One game done after its first turn while the two others' environments take different
    times: every later batch holds both of them (an episode that ends must count as one fewer
    episode to wait for, no more)."""
    requests = [episode_request("agent_envs:Pid", {}, Sample("go=", "1"), "d0", TOK)] + [
        episode_request("agent_envs:Sleeps", {}, Sample("go=", s), f"d{i}", TOK) for i, s in enumerate(["0", "0.3"], 1)]
    engine = Scripted(lambda text, seed: "ok")
    with LocalEnvPool(timeout_s=5.0) as pool:
        result = run_workflow(engine, pool, requests, TOK, Limits(max_turns=3, max_total_tokens=40, max_context=64),
                              seeds=[0, 1, 2], temperature=1.0)
    assert [e.finish_reason for e in result.episodes] == ["stop", "max_turns", "max_turns"]
    assert result.batches == [3, 2, 2]


class HeldBack:
    """A pool (``LocalEnvPool`` underneath) whose every step of session ``held`` waits until all the
    other sessions have closed — a tool that answers late — or ``wait_s`` passed (``timed_out``)."""

    def __init__(self, held: str, others, wait_s: float = 10.0):
        self.inner, self.held, self.others, self.wait_s = LocalEnvPool(), held, set(others), wait_s
        self.timed_out, self._gate = False, None

    async def reset(self, session, env, sample, env_kwargs=None):
        return await self.inner.reset(session, env, sample, env_kwargs)

    async def step(self, session, action):
        if session == self.held and self.others:
            import asyncio

            self._gate = self._gate or asyncio.Event()
            try:
                await asyncio.wait_for(self._gate.wait(), self.wait_s)
            except asyncio.TimeoutError:
                self.timed_out = True
        return await self.inner.step(session, action)

    async def close(self, session):
        await self.inner.close(session)
        self.others.discard(session)
        if not self.others and self._gate is not None:
            self._gate.set()


def noisy_search(text: str, seed: int) -> str:
    """A player whose guesses depend on the turn's seed: a uniform pick of what is still possible."""
    import random

    lo, hi = guess.feasible(text)
    return f"{random.Random(seed).randint(lo, hi)},"


def test_continuous_batching_lets_the_others_play_on_while_one_environment_is_slow_same_tokens():
    """``batching="continuous"``: game 0's environment answers only once every other game has ended.
    The others play to the end meanwhile (in rounds they would wait for it: each round needs every
    episode still running), and every game is the one the rounds play, token for token."""
    secrets = ["1", "32", "63", "17", "40", "5"]
    seeds = [10, 11, 12, 13, 14, 15]
    requests = lambda tag: [episode_request("guess", {}, Sample("guess=", s), f"{tag}{i}", TOK)
                            for i, s in enumerate(secrets)]
    rounds_engine, cont_engine = Scripted(noisy_search), Scripted(noisy_search)
    rounds = run_workflow(rounds_engine, LocalEnvPool(), requests("r"), TOK, guess.limits(64), seeds, 1.0)
    held = HeldBack("c0", [f"c{i}" for i in range(1, len(secrets))])
    cont = run_workflow(cont_engine, held, requests("c"), TOK, guess.limits(64), seeds, 1.0, batching="continuous")
    assert not held.timed_out  # the others ended without game 0's environment answering
    for a, b in zip(rounds.episodes, cont.episodes):
        assert (a.ids, a.loss_mask, a.logprobs, a.versions, a.reward, a.turns, a.finish_reason) == \
            (b.ids, b.loss_mask, b.logprobs, b.versions, b.reward, b.turns, b.finish_reason)
    turns = [e.turns for e in cont.episodes]
    assert turns[0] >= 2 and max(turns[1:]) >= 3  # game 0 had a second turn; the others more than one each
    # every other game's last turn was sent before game 0's second
    sent = [(c.episode, c.turn) for c in cont.calls]
    assert all(sent.index((i, t - 1)) < sent.index((0, 1)) for i, t in enumerate(turns) if i)
    assert sum(cont.batches) == sum(turns) == len(cont.calls)
    assert rounds.batches == [sum(t > k for t in turns) for k in range(max(turns))]
    # each turn still went with its own seed, whatever batch it was in
    sent_seeds = [sd for _, sds, *_ in cont_engine.batches for sd in sds]
    assert sent_seeds == [turn_seed(seeds[c.episode], c.turn) for c in cont.calls]


class HeldStream:
    """A ``TurnStream`` over ``Scripted``'s answers, each turn answered in a thread of its own —
    but game ``held``'s turns (recognised by their seeds) only once ``release`` is set, or after
    ``wait_s`` (``timed_out``): a replica stuck on one long turn."""

    def __init__(self, policy, held_seeds, release, wait_s: float = 10.0):
        import concurrent.futures

        self.engine, self.held, self.release, self.wait_s = Scripted(policy), set(held_seeds), release, wait_s
        self.threads = concurrent.futures.ThreadPoolExecutor(8)
        self.timed_out, self.submits = False, []

    def submit(self, prompts, seeds, budgets, temperature, stops):
        self.submits.append(len(prompts))
        self.sent = getattr(self, "sent", []) + [(temperature, list(stops))]

        def one(p, s, b, st):
            if s in self.held and not self.release.wait(self.wait_s):
                self.timed_out = True
            tokens, logprobs, versions = self.engine([p], [s], [b], temperature, [st])
            return tokens[0], logprobs[0], versions[0]
        return [self.threads.submit(one, *a) for a in zip(prompts, seeds, budgets, stops)]


class ClosesRelease(LocalEnvPool):
    """``LocalEnvPool`` that sets ``release`` once every session but ``held`` has closed."""

    def __init__(self, held: str, others, release):
        super().__init__()
        self.held, self.others, self.release = held, set(others), release

    async def close(self, session):
        await super().close(session)
        self.others.discard(session)
        if not self.others:
            self.release.set()


def test_a_turn_stream_answers_each_episode_as_soon_as_its_own_turn_is_back():
    """Engines that answer turn by turn (``TurnStream``: the replicas pulling from one queue): game
    0's first turn is answered only after the other games have ended — they play on meanwhile,
    though all six first turns went in together, and every game is the one the rounds play."""
    import threading

    secrets, seeds = ["1", "32", "63", "17", "40", "5"], [10, 11, 12, 13, 14, 15]
    requests = lambda tag: [episode_request("guess", {}, Sample("guess=", s), f"{tag}{i}", TOK)
                            for i, s in enumerate(secrets)]
    rounds = run_workflow(Scripted(noisy_search), LocalEnvPool(), requests("r"), TOK, guess.limits(64), seeds, 1.0)
    guess_stops = frozenset(TOK.encode(",")) | {TOK.eos_id}
    for batching in ("continuous", "rounds"):
        release = threading.Event()
        stream = HeldStream(noisy_search, [turn_seed(10, t) for t in range(8)], release,
                            wait_s=10.0 if batching == "continuous" else 0.5)
        pool = ClosesRelease("s0", [f"s{i}" for i in range(1, 6)], release)
        got = run_workflow(stream, pool, requests("s"), TOK, guess.limits(64), seeds, 1.0, batching=batching)
        for a, b in zip(rounds.episodes, got.episodes):
            assert (a.ids, a.loss_mask, a.logprobs, a.versions, a.reward) == (b.ids, b.loss_mask, b.logprobs,
                                                                             b.versions, b.reward)
        # each turn went with the run's temperature and its episode's stop ids (the game's "," and <eos>)
        assert {t for t, _ in stream.sent} == {1.0}
        assert all(st == guess_stops for _, sts in stream.sent for st in sts)
        if batching == "continuous":
            assert not stream.timed_out and stream.submits[0] == 6
            turns = [e.turns for e in got.episodes]
            answered = [(c.episode, c.turn) for c in got.calls]
            assert all(answered.index((i, t - 1)) < answered.index((0, 0)) for i, t in enumerate(turns) if i)
            assert sum(stream.submits) == sum(turns) == sum(got.batches)
        else:  # rounds still wait for every episode: game 0's turn held them until it timed out
            assert stream.timed_out and got.batches == rounds.batches


class FailingStream:
    """A ``TurnStream`` that fails: at ``submit`` itself, or each turn's future with ``exc``."""

    def __init__(self, at_submit: bool):
        self.at_submit = at_submit

    def submit(self, prompts, seeds, budgets, temperature, stops):
        import concurrent.futures

        if self.at_submit:
            raise RuntimeError("queue closed")
        futures = [concurrent.futures.Future() for _ in prompts]
        for f in futures:
            f.set_exception(RuntimeError("replica lost"))
        return futures


@pytest.mark.parametrize("batching", ["rounds", "continuous"])
@pytest.mark.parametrize("at_submit", [True, False])
def test_a_failing_turn_stream_fails_the_workflow_with_its_error_not_hangs_it(batching, at_submit):
    requests = [episode_request("guess", {}, Sample("guess=", "5"), f"f{i}", TOK) for i in range(3)]
    with pytest.raises(RuntimeError, match="queue closed" if at_submit else "replica lost"):
        run_workflow(FailingStream(at_submit), LocalEnvPool(), requests, TOK, guess.limits(64), [0, 1, 2], 1.0,
                     batching=batching)


class Continuing:
    """A batch engine that can continue a turn: a context ending in part of a guess gets the rest
    of ``binary_search``'s guess (a prompt or an answer character ends the text it plays from).
    Each call's tokens carry the call's number as their version."""

    def __init__(self):
        self.calls = 0

    def __call__(self, prompts, seeds, budgets, temperature, stops):
        self.calls += 1
        tokens = []
        for p, b in zip(prompts, budgets):
            text = TOK.decode(p)
            cut = max(text.rfind(c) for c in "=<>x") + 1
            tokens.append(TOK.encode(binary_search(text[:cut], 0)[len(text) - cut:])[:b])
        return tokens, [[-0.5] * len(t) for t in tokens], [self.calls] * len(tokens)


@pytest.mark.parametrize("batching", ["rounds", "continuous"])
def test_partial_rollout_generates_a_turn_k_tokens_a_call_and_each_token_keeps_its_version(batching):
    """``segment_tokens: 1``: every guess ("32," is three tokens) takes a call a token, each call's
    context the turn so far; the games are the ones played a turn a call, and a turn's tokens
    carry the versions of the calls that made them (a weight update between two is possible)."""
    secrets = ["1", "32", "63", "17"]
    requests = lambda tag: [episode_request("guess", {}, Sample("guess=", s), f"{tag}{i}", TOK)
                            for i, s in enumerate(secrets)]
    whole = run_workflow(Continuing(), LocalEnvPool(), requests("w"), TOK, guess.limits(64), [0, 1, 2, 3], 1.0)
    engine = Continuing()
    part = run_workflow(engine, LocalEnvPool(), requests("p"), TOK, guess.limits(64), [0, 1, 2, 3], 1.0,
                        batching=batching, segment_tokens=1)
    for a, b in zip(whole.episodes, part.episodes):
        assert (a.ids, a.loss_mask, a.reward, a.turns, a.actions) == (b.ids, b.loss_mask, b.reward, b.turns, b.actions)
        assert b.reward == 1.0
    assert all(len(c.output) == 1 for c in part.calls)
    assert len(part.calls) == sum(sum(b.loss_mask) for b in part.episodes) > len(whole.calls)
    # a guess of three tokens came from three calls: three versions in one turn
    e = part.episodes[2]
    first_turn = [v for v, m in zip(e.versions, e.loss_mask) if m][:3]
    assert len(TOK.decode([t for t, m in zip(e.response_ids, e.loss_mask) if m][:3])) == 3 and len(set(first_turn)) == 3
    # each call numbered in its episode: call t of a game with turn_seed(seed, t)
    for i in range(len(secrets)):
        assert [c.turn for c in part.calls if c.episode == i] == list(range(sum(part.episodes[i].loss_mask)))
    # a turn that reaches its budget without a stop id ends there, segmented or not
    short = Limits(max_turns=3, max_total_tokens=40, max_context=64, max_turn_tokens=2)
    w = run_workflow(Continuing(), LocalEnvPool(), requests("a"), TOK, short, [0, 1, 2, 3], 1.0)
    p = run_workflow(Continuing(), LocalEnvPool(), requests("b"), TOK, short, [0, 1, 2, 3], 1.0, batching=batching,
                     segment_tokens=1)
    assert [e.ids for e in p.episodes] == [e.ids for e in w.episodes]
    assert [e.finish_reason for e in p.episodes] == ["length"] * 4  # "32" of "32,"
    assert [TOK.decode(e.response_ids) for e in p.episodes] == ["32"] * 4 and len(p.calls) == 8
    # segments of 2 in a turn of 3 that never stops: 2 tokens, then the 1 left (never more)
    three = Limits(max_turns=1, max_total_tokens=40, max_context=64, max_turn_tokens=3)
    nines = Scripted(lambda text, seed: "9999")
    p = run_workflow(nines, LocalEnvPool(), requests("c")[:1], TOK, three, [0], 1.0, batching=batching,
                     segment_tokens=2)
    assert TOK.decode(p.episodes[0].response_ids) == "999" and p.episodes[0].finish_reason == "length"
    assert [b[2] for b in nines.batches] == [[2], [1]]
    with pytest.raises(ValueError, match="segment_tokens must be >= 0"):
        run_workflow(engine, LocalEnvPool(), requests("n"), TOK, guess.limits(64), [0, 1, 2, 3], 1.0, segment_tokens=-1)


def test_continuous_batching_sends_what_parked_while_a_batch_generated_as_one_batch():
    """Environments answering after different times: each batch holds every turn that parked while
    the one before was generating — never a turn alone while others wait — and no more than one
    batch is generated at a time."""
    requests = [episode_request("agent_envs:Sleeps", {}, Sample("go=", s), f"w{i}", TOK)
                for i, s in enumerate(["0", "0", "0.2"])]
    in_flight, most = [0], [0]

    def engine(prompts, seeds, budgets, temperature, stops):
        in_flight[0] += 1
        most[0] = max(most[0], in_flight[0])
        try:
            import time

            time.sleep(0.1)
            return Scripted(lambda text, seed: "ok")(prompts, seeds, budgets, temperature, stops)
        finally:
            in_flight[0] -= 1

    with LocalEnvPool(timeout_s=5.0) as pool:
        result = run_workflow(engine, pool, requests, TOK, Limits(max_turns=3, max_total_tokens=40, max_context=64),
                              seeds=[0, 1, 2], temperature=1.0, batching="continuous")
    assert [e.finish_reason for e in result.episodes] == ["max_turns"] * 3
    assert most[0] == 1 and sum(result.batches) == 9
    # the two quick games go on together, the slow one after them: never all three in one batch after the first
    assert result.batches[0] == 3 and max(result.batches[1:]) == 2
    with pytest.raises(ValueError, match="batching must be one of"):
        run_workflow(engine, LocalEnvPool(), requests, TOK, guess.limits(64), [0, 1, 2], 1.0, batching="round")


def test_an_agent_runs_warm_start_trains_on_its_environments_transcripts(tmp_path):
    """``recipes.common.agent_warm_start``: the game's SFT is on played games (the loss on the
    player's turns), its checkpoint's fingerprint says so, and a single-turn run's warm start of
    the same task and model is another checkpoint."""
    import yaml

    from recipes.common import agent_warm_start, warm_start
    from rlhf_switch.rl.config import load_config
    from rlhf_switch.rl.sft import cached_checkpoint
    from test_rl_pure import CONFIGS

    data = yaml.safe_load((CONFIGS / "agent_guess_tiny.yaml").read_text())
    data["sft"].update(steps=3, batch_size=4)
    cfg = load_config(data)
    name, _ = agent_warm_start(cfg)
    assert name == 'agent transcripts {"env": "guess", "env_kwargs": {"high": 63, "low": 1}, "max_turns": 6}'
    out = warm_start(cfg, tmp_path / "init", quiet=True)
    saved = json.loads((out / "warm_start.json").read_text())
    assert saved["fingerprint"]["sft_on"] == name
    assert saved["sft_stats"]["num_transcripts"] == 62 * 40 and saved["sft_stats"]["steps"] == 3
    assert cached_checkpoint(cfg, out, name) == out and cached_checkpoint(cfg, out) is None
    single = load_config({**data, "agent": None})
    assert agent_warm_start(single) is None
    no_sft = load_config({**data, "sft": None})
    assert agent_warm_start(no_sft) is None
