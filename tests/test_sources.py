"""The loop's rollout sources (``recipes/loop/sources.py``), fast: the real sources over a real run
config, a loop stand-in and rollout replicas of ``tests/fake_replicas.py`` (a deterministic engine,
each replica's weights version as the real replicas report it). Every value asserted is computed by
hand: which prompts and seeds each generation was sent, which iteration's batch ``take`` returns,
which version each sample records, exactly where the stale-weights check stops the run.

The prompts each iteration draws (``draw_prompts`` of the config's seed over the six train prompts
below, two a iteration, group size 2): 0: 1+2=, 5+5=; 1: 4+4=, 6+1=; 2: 3+6=, 2+8=; 3: 2+8=, 5+5=.
The engine counts on in digits from the prompt's last one, then eos (id 2), 4 tokens at most:
1+2= -> 3456, 5+5= -> 6789, 4+4= -> 5678, 6+1= -> 2345, 3+6= -> 789<eos>, 2+8= -> 9<eos>.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import pytest
import yaml

from fake_replicas import EOS, Ref, Replicas, tok
from recipes.common import StaleWeightsError
from recipes.loop.loop import Faults
from recipes.loop.sources import MultiTurn, OneStepAhead, Partial, Synchronous, check_staleness, rollout_source
from rlhf_switch.rl.experience import Experience, SampleExperience
from rlhf_switch.rl.tasks import CharTokenizer, Sample, Splits
from test_rl_pure import CONFIGS

SPLITS = Splits(tuple(Sample(p, "") for p in ("1+2=", "5+5=", "3+6=", "2+8=", "4+4=", "6+1=")), ())
SEEDS = 65_536  # sample_seeds: seed 0, iteration it -> it * 65536 + i


def enc(text: str) -> list[int]:
    return [1] + tok(text)  # <bos> + the prompt (encode_prompt)


def resp(digits: str) -> list[int]:
    return [EOS if c == "e" else t for c, t in zip(digits, tok(digits.replace("e", "0")))]


def config(**off_policy):
    from rlhf_switch.rl.config import load_config

    cfg = yaml.safe_load((CONFIGS / "grpo_tiny_async.yaml").read_text())
    cfg["algorithm"].update(prompts_per_iteration=2, group_size=2, max_new_tokens=4, temperature=0.7,
                            mini_batch_size=4, micro_batch_size=2, off_policy=off_policy or None)
    return load_config(cfg)


@dataclass
class Loop:
    """What a source reads of ``recipes.loop.loop.Loop``: the config, the cluster, the faults, the
    tokenizer and context, the prompts, the last iteration and the eos id."""

    cfg: object
    cluster: Replicas = field(default_factory=Replicas)
    last: int = 3
    hooked: list = field(default_factory=list)  # the iterations generate_hook was called with

    def __post_init__(self):
        self.faults = Faults(generate_hook=lambda it, cluster: self.hooked.append((it, cluster is self.cluster)))
        self.tok, self.max_ctx, self.splits, self.eos_id = CharTokenizer(), 64, SPLITS, EOS


def batch(*versions) -> Experience:
    """Samples whose tokens carry these versions (one list of token versions per sample)."""
    out = []
    for i, vs in enumerate(versions):
        s = SampleExperience([1], None, 0, i)
        for v in vs:
            s.generated([5], [-1.0], v)
        out.append(s)
    return Experience(out)


# --- check_staleness -----------------------------------------------------------------------------------
def test_staleness_is_checked_against_the_bound_exactly():
    ok = batch([4], [5], [4, 5])
    assert check_staleness(5, ok, 1) is ok  # 5 - 4 == max_staleness: allowed
    assert check_staleness(5, batch([5]), 0) is not None
    with pytest.raises(StaleWeightsError) as e:
        check_staleness(5, batch([4], [5]), 0)
    assert str(e.value) == ("iteration 5: 1 samples were generated with weights of version 4, more than "
                            "algorithm.off_policy.max_staleness=0 behind the trainer's 5: a weight sync did not reach "
                            "the rollout replicas")
    # two samples too old (a sample's version is its oldest token's: 3 in [3, 5]), the oldest named
    with pytest.raises(StaleWeightsError) as e:
        check_staleness(5, batch([4], [3, 5], [2], [5]), 1)
    assert str(e.value).startswith("iteration 5: 2 samples were generated with weights of version 2, more than "
                                   "algorithm.off_policy.max_staleness=1 behind the trainer's 5:")
    assert check_staleness(7, batch([5], [6], [7]), 2) is not None  # K steps ahead: 7 - 5 == 2
    with pytest.raises(StaleWeightsError, match="iteration 2: 1 samples .* version 0, "):
        check_staleness(2, batch([1], [0, 2]), 1)  # version 0 is a version like any other
    assert check_staleness(1, batch([0], [1]), 1) is not None


def test_a_sample_without_generated_tokens_is_not_stale():
    """An episode its environment failed before the first turn has no token (version -1): no
    weights generated it, so it is not behind the trainer (K-steps-ahead agent runs check it)."""
    exp = batch([], [2])
    assert check_staleness(3, exp, 1) is exp
    with pytest.raises(StaleWeightsError, match="iteration 4: 1 samples .* version 2,"):
        check_staleness(4, batch([], [2]), 1)


# --- Synchronous --------------------------------------------------------------------------------------
def test_synchronous_generates_each_batch_after_the_sync():
    loop = Loop(config())
    src = rollout_source(loop)
    assert type(src) is Synchronous and src.max_staleness == 0
    assert src.take(2) is None and src.stands_by()
    loop.cluster.sync(2)
    t0 = time.perf_counter()
    exp = src.generate(2, [Sample("3+6=", "9"), Sample("6+1=", "7")])
    took = time.perf_counter() - t0
    assert loop.cluster.calls == [{
        "prompts": [enc("3+6=")] * 2 + [enc("6+1=")] * 2, "seeds": [2 * SEEDS + i for i in range(4)],
        "max_new_tokens": 4, "temperature": 0.7, "stop_ids": (), "pull": True}]
    assert loop.hooked == [(2, True)]
    assert exp.column("response") == [resp("789e")] * 2 + [resp("2345")] * 2
    assert exp.column("group") == [0, 0, 1, 1] and exp.column("seed") == [2 * SEEDS + i for i in range(4)]
    assert exp.column("prompt") == [enc("3+6=")] * 2 + [enc("6+1=")] * 2
    assert [s.source.answer for s in exp.samples] == ["9", "9", "7", "7"]
    assert exp.column("versions") == [[2] * 4] * 4 and exp.column("logprobs") == [[-3.0] * 4] * 4
    assert exp.column("loss_mask") == [[1] * 4] * 4
    assert 0 < exp.gen_seconds <= took  # the generation's own span
    # the finishing steps do nothing; the update runs alone
    assert src.finish(exp) is None and src.ahead(2) is None and src.during_update([]) is None
    assert src.close() is None and exp.column("versions") == [[2] * 4] * 4 and len(loop.cluster.calls) == 1


def test_dynamic_samplings_extra_round_takes_seeds_of_its_own():
    loop = Loop(config())
    loop.cluster.sync(1)
    exp = Synchronous(loop).generate(1, [Sample("2+8=", "10"), Sample("1+2=", "3")], draw=2)
    assert loop.cluster.calls[0]["seeds"] == [SEEDS + 8 + i for i in range(4)]  # the third 4 of iteration 1's
    assert exp.column("seed") == [SEEDS + 8 + i for i in range(4)]
    assert exp.column("response") == [resp("9e")] * 2 + [resp("3456")] * 2


def test_an_engine_that_keeps_no_version_records_the_iteration():
    loop = Loop(config())
    loop.cluster.versions = [4, None]  # replica 1's engine counts no versions
    exp = Synchronous(loop).generate(6, [Sample("1+2=", "3"), Sample("2+8=", "10")])
    assert exp.column("versions") == [[4] * 4, [4] * 4, [6, 6], [6, 6]]
    assert exp.column("logprobs") == [[-5.0] * 4, [-5.0] * 4, [-0.5] * 2, [-0.5] * 2]


def test_a_prompt_too_long_for_the_context_is_refused():
    loop = Loop(config())
    loop.max_ctx = 8  # <bos> + 4 characters + 4 new tokens fit 9
    with pytest.raises(ValueError):
        Synchronous(loop).generate(0, [Sample("1+2=", "3")])
    assert loop.cluster.calls == []


# --- OneStepAhead -------------------------------------------------------------------------------------
def test_one_step_ahead_takes_the_batch_made_during_the_last_iteration():
    loop = Loop(config(max_staleness=1))
    src = rollout_source(loop)
    assert type(src) is OneStepAhead and src.max_staleness == 1
    assert src.take(0) is None  # the first iteration: nothing in flight
    loop.cluster.sync(0)
    first = src.generate(0, [Sample("1+2=", "3")])
    assert loop.cluster.calls[0]["pull"] is False  # collected later: fixed shares
    assert first.column("versions") == [[0] * 4] * 2
    src.ahead(0)  # iteration 1's batch, with the weights of version 0
    call = loop.cluster.calls[1]
    assert call["prompts"] == [enc("4+4=")] * 2 + [enc("6+1=")] * 2 and call["pull"] is False
    assert call["seeds"] == [SEEDS + i for i in range(4)] and call["max_new_tokens"] == 4
    assert loop.hooked == [(0, True), (1, True)]
    assert src.stands_by() and src.in_flight[0] == 1
    assert src.take(2) is None and src.take(0) is None  # only the iteration in flight
    got = src.take(1)
    assert got.column("response") == [resp("5678")] * 2 + [resp("2345")] * 2
    assert got.column("versions") == [[0] * 4] * 4 and got.column("group") == [0, 0, 1, 1]
    assert src.in_flight is None and src.take(1) is None  # taken once
    loop.cluster.sync(1)
    src.ahead(1)
    loop.cluster.sync(2)  # the sync of iteration 2 lands after the batch was generated
    assert src.take(2).column("versions") == [[1] * 4, [1] * 4, [1, 1], [1, 1]]
    src.ahead(2)
    assert src.in_flight[0] == 3
    assert src.take(3).column("versions") == [[2, 2], [2, 2], [2] * 4, [2] * 4]
    calls = len(loop.cluster.calls)
    src.ahead(3)  # the last iteration: nothing after it
    assert src.in_flight is None and len(loop.cluster.calls) == calls


def test_one_step_ahead_stops_at_a_sync_that_missed_a_replica():
    """Replica 1 missed iteration 2's sync: the batch made during iteration 2 for iteration 3 has
    its half at version 1, two behind the trainer's 3."""
    loop = Loop(config(max_staleness=1), last=5)
    src = OneStepAhead(loop)
    loop.cluster.sync(1)
    loop.cluster.sync(2, skip=(1,))
    src.ahead(2)
    with pytest.raises(StaleWeightsError) as e:
        src.take(3)
    assert str(e.value).startswith("iteration 3: 2 samples were generated with weights of version 1, more than "
                                   "algorithm.off_policy.max_staleness=1 behind the trainer's 3")
    loop.cluster.sync(3)  # the next sync reaches both: one behind is allowed
    src.ahead(3)
    assert [s.version for s in src.take(4).samples] == [3, 3, 3, 3]


def test_one_step_ahead_with_an_engine_that_keeps_no_version():
    loop = Loop(config(max_staleness=1))
    src = OneStepAhead(loop)
    src.ahead(1)
    assert src.take(2).column("versions") == [[2] * 4] * 2 + [[2, 2]] * 2


# --- Partial ------------------------------------------------------------------------------------------
def test_partial_rollout_source():
    """``segment_tokens: 3``: iteration 1's batch is handed out 3 tokens at a time during the update
    of iteration 0; the round in flight when it ends is taken with the old weights, the rest after
    the next sync with the new ones."""
    loop = Loop(config(max_staleness=1, segment_tokens=3))
    src = rollout_source(loop)
    assert type(src) is Partial and src.max_staleness == 1
    assert src.stands_by() and src.take(1) is None
    src.finish(None)  # nothing taken: nothing to finish
    loop.cluster.sync(0)
    src.ahead(0)
    assert not src.stands_by()  # a receive posted now would hold the rounds up
    assert loop.cluster.calls == [{"prompts": [enc("4+4=")] * 2 + [enc("6+1=")] * 2,
                                   "seeds": [SEEDS + i for i in range(4)], "max_new_tokens": 3, "temperature": 0.7,
                                   "stop_ids": (), "pull": False}]
    assert loop.hooked == [(1, True)]
    src.during_update([Ref(loop.cluster.ray, 3)])  # the update's calls, done 3 ticks on: round 1
    # collected, round 2 handed out (its hook), then the update is done
    assert len(loop.cluster.calls) == 2 and loop.hooked == [(1, True), (1, True)]
    assert loop.cluster.calls[1]["prompts"] == [enc("4+4=") + resp("567")] * 2 + [enc("6+1=") + resp("234")] * 2
    assert loop.cluster.calls[1]["max_new_tokens"] == 1
    exp = src.take(1)  # round 2 in flight: collected with version 0
    assert exp.segmented and src.in_flight is None and src.stands_by()
    assert exp.column("response") == [resp("5678")] * 2 + [resp("2345")] * 2
    assert exp.column("versions") == [[0] * 4] * 4
    loop.cluster.sync(1)
    src.finish(exp)  # all at their budget: nothing more to generate
    assert len(loop.cluster.calls) == 2 and exp.column("versions") == [[0] * 4] * 4
    src.finish(exp)  # once only


def test_partial_rollout_finishes_the_interrupted_samples_with_the_new_weights():
    loop = Loop(config(max_staleness=1, segment_tokens=1))
    src = Partial(loop)
    loop.cluster.sync(0)
    src.ahead(0)  # round 1 of iteration 1's batch in flight
    src.during_update([Ref(loop.cluster.ray, 0)])  # the update is done at once: no round handed out
    assert len(loop.cluster.calls) == 1 and loop.hooked == [(1, True)]
    exp = src.take(1)
    assert exp.column("response") == [resp("5")] * 2 + [resp("2")] * 2
    loop.cluster.sync(1)
    src.finish(exp)
    assert exp.column("response") == [resp("5678")] * 2 + [resp("2345")] * 2
    assert exp.column("versions") == [[0, 1, 1, 1]] * 4
    assert exp.column("logprobs") == [[-1.0, -2.0, -2.0, -2.0]] * 4
    assert exp.gen_seconds > 0


def test_partial_rollout_with_an_engine_that_keeps_no_version_records_the_iteration_it_started_in():
    loop = Loop(config(max_staleness=1, segment_tokens=2))
    src = Partial(loop)
    src.ahead(1)
    exp = src.take(2)
    src.finish(exp)
    assert exp.column("versions") == [[1] * 4, [1] * 4, [1, 1], [1, 1]]


def test_the_update_of_the_last_iteration_pumps_nothing():
    loop = Loop(config(max_staleness=1, segment_tokens=1), last=0)
    src = Partial(loop)
    src.ahead(0)
    src.during_update([])
    assert loop.cluster.calls == [] and src.stands_by()


def test_partial_rounds_without_a_generate_hook():
    loop = Loop(config(max_staleness=1, segment_tokens=1))
    loop.faults = Faults()
    src = Partial(loop)
    loop.cluster.sync(0)
    src.ahead(0)
    src.during_update([Ref(loop.cluster.ray, 5)])
    assert len(loop.cluster.calls) == 3  # rounds 2 and 3 handed out, no hook to call


def test_rollout_source_by_config():
    assert type(rollout_source(Loop(config()))) is Synchronous
    assert type(rollout_source(Loop(config(max_staleness=0)))) is Synchronous
    assert type(rollout_source(Loop(config(max_staleness=0, correction="tis")))) is Synchronous
    assert type(rollout_source(Loop(config(max_staleness=1)))) is OneStepAhead
    assert type(rollout_source(Loop(config(max_staleness=1, segment_tokens=4)))) is Partial
    assert MultiTurn.__mro__[1] is Synchronous


# --- MultiTurn ----------------------------------------------------------------------------------------
# an agent run over the same prompts, the environments in this process: agent_envs:Numbers asks for
# one number (reward 1 for digits), so an episode is one model turn: 1+2= -> 3456 runs out of its 4
# tokens ("length", reward 0), 2+8= -> 9<eos> ends at the eos ("stop", reward 1)
def agent_config(max_staleness=None, segment_tokens=0, **agent):
    from rlhf_switch.rl.config import load_config

    cfg = yaml.safe_load((CONFIGS / "grpo_tiny_async.yaml").read_text())
    off = None if max_staleness is None else {"max_staleness": max_staleness, "segment_tokens": segment_tokens}
    cfg["algorithm"].update(prompts_per_iteration=2, group_size=2, max_new_tokens=4, temperature=0.7,
                            mini_batch_size=4, micro_batch_size=2, off_policy=off)
    cfg["agent"] = {"env": "agent_envs:Numbers", "env_kwargs": {"turns": 1}, "max_turns": 2,
                    "pool": {"in_process": True}, **agent}
    return load_config(cfg)


def test_multi_turn_plays_each_sample_as_an_episode():
    loop = Loop(agent_config())
    src = rollout_source(loop)
    assert type(src) is MultiTurn and src.max_staleness == 0 and src.codec is loop.tok
    assert src.limits.max_turns == 2 and src.limits.max_total_tokens == 4 and src.limits.max_context == 64
    assert src.take(3) is None and src.stands_by()
    src.ahead(3)  # synchronous: nothing ahead
    assert src.in_flight == {} and src._ahead is None and loop.cluster.calls == []
    loop.cluster.sync(3)
    t0 = time.perf_counter()
    exp = src.generate(3, [Sample("1+2=", "3"), Sample("2+8=", "10")], draw=1)
    took = time.perf_counter() - t0
    assert loop.cluster.calls == [{
        "prompts": [enc("1+2=")] * 2 + [enc("2+8=")] * 2, "seeds": [3 * SEEDS + 4 + i for i in range(4)],
        "max_new_tokens": 4, "temperature": 0.7, "stop_ids": (EOS,), "pull": True}]
    assert loop.hooked == [(3, True)]
    assert exp.column("prompt") == [enc("1+2=")] * 2 + [enc("2+8=")] * 2
    assert exp.column("seed") == [3 * SEEDS + 4 + i for i in range(4)] and exp.column("group") == [0, 0, 1, 1]
    assert [s.source.answer for s in exp.samples] == ["3", "3", "10", "10"]
    assert exp.column("response") == [resp("3456")] * 2 + [resp("9e")] * 2
    assert exp.column("versions") == [[3] * 4] * 2 + [[3, 3]] * 2
    assert exp.column("logprobs") == [[-4.0] * 4] * 2 + [[-4.0] * 2] * 2
    assert exp.column("loss_mask") == [[1] * 4] * 2 + [[1, 1]] * 2
    assert exp.column("env_reward") == [0.0, 0.0, 1.0, 1.0]
    assert exp.column("finish_reason") == ["length", "length", "stop", "stop"]
    assert [s.episode.session for s in exp.samples] == [f"it3.1-{i}" for i in range(4)]
    assert exp.turn_batches == [4] and exp.tokens_past_stop == 0 and 0 < exp.gen_seconds <= took
    src.close()


def test_multi_turn_failed_episodes_zero_or_excluded():
    for failed, mask in (("zero", [1, 1]), ("exclude", [0, 0])):
        loop = Loop(agent_config(env="agent_envs:Raises", env_kwargs={}, failed_samples=failed))
        loop.cluster.sync(0)
        src = rollout_source(loop)
        exp = src.generate(0, [Sample("2+8=", "10")])
        assert exp.column("response") == [resp("9e")] * 2 and exp.column("versions") == [[0, 0]] * 2
        assert exp.column("finish_reason") == ["env_error"] * 2 and exp.column("env_reward") == [0.0, 0.0]
        assert exp.column("loss_mask") == [mask] * 2, failed
        src.close()


def test_multi_turn_an_episode_failed_at_reset_has_no_version_and_is_not_stale():
    loop = Loop(agent_config(max_staleness=1, env="agent_envs:BadReset", env_kwargs={}), last=3)
    loop.cluster.sync(1)
    src = rollout_source(loop)
    src.ahead(1)
    exp = src.take(2)
    assert exp.column("response") == [[]] * 4 and exp.column("versions") == [[]] * 4
    assert [s.version for s in exp.samples] == [-1] * 4 and exp.column("finish_reason") == ["env_error"] * 4
    src.close()


def test_multi_turn_k_steps_ahead():
    """``max_staleness: 2``: after iteration 0 the episodes of iterations 1 and 2 are played, then
    one more iteration each time (not past the last, 4); ``take`` returns the iteration's own."""
    loop = Loop(agent_config(max_staleness=2), last=4)
    src = rollout_source(loop)
    assert src.max_staleness == 2 and src.take(1) is None

    def sync(version):  # the episodes in flight done first (here a sync would land between their turns)
        for f in src.in_flight.values():
            f.result()
        loop.cluster.sync(version)

    sync(0)
    src.ahead(0)
    assert sorted(src.in_flight) == [1, 2] and not src.stands_by()
    one = src.take(1)
    assert sorted(src.in_flight) == [2] and src.take(1) is None
    assert one.column("prompt") == [enc("4+4=")] * 2 + [enc("6+1=")] * 2  # iteration 1's prompts
    assert one.column("response") == [resp("5678")] * 2 + [resp("2345")] * 2
    assert one.column("seed") == [SEEDS + i for i in range(4)] and one.column("versions") == [[0] * 4] * 4
    sync(1)
    src.ahead(1)  # 2 in flight already: 3 alone
    assert sorted(src.in_flight) == [2, 3]
    two = src.take(2)  # two versions behind: allowed
    assert two.column("versions") == [[0] * 4] * 2 + [[0, 0]] * 2
    assert two.column("seed") == [2 * SEEDS + i for i in range(4)]
    sync(2)
    src.ahead(2)
    assert sorted(src.in_flight) == [3, 4]
    assert src.take(3).column("versions") == [[1, 1]] * 2 + [[1] * 4] * 2
    sync(3)
    src.ahead(3)  # 4 in flight, 5 is past the last
    assert sorted(src.in_flight) == [4]
    assert src.take(4).column("versions") == [[2] * 4] * 4
    src.ahead(4)
    assert src.in_flight == {} and src.stands_by()
    assert sorted(loop.hooked) == [(i, True) for i in (1, 2, 3, 4)]
    assert src._ahead._max_workers == 2
    src.close()
    with pytest.raises(RuntimeError):  # the threads are shut down
        src._ahead.submit(print)


def test_multi_turn_k_steps_ahead_stops_at_a_missed_sync():
    loop = Loop(agent_config(max_staleness=2), last=4)
    src = rollout_source(loop)
    loop.cluster.sync(0)
    src.ahead(0)
    src.take(1)
    src.ahead(1)  # iteration 1's sync did not happen: iteration 3's episodes with version 0
    src.take(2)
    with pytest.raises(StaleWeightsError) as e:
        src.take(3)
    assert str(e.value).startswith("iteration 3: 4 samples were generated with weights of version 0, more than "
                                   "algorithm.off_policy.max_staleness=2 behind the trainer's 3")
    src.close()


def test_multi_turn_partial_turns():
    """``segment_tokens: 2``: each turn generated 2 tokens a call."""
    loop = Loop(agent_config(max_staleness=1, segment_tokens=2))
    loop.cluster.sync(0)
    src = rollout_source(loop)
    exp = src.generate(0, [Sample("1+2=", "3")])
    assert [c["max_new_tokens"] for c in loop.cluster.calls] == [2, 2]
    assert loop.cluster.calls[1]["prompts"] == [enc("1+2=") + resp("34")] * 2
    assert exp.column("response") == [resp("3456")] * 2
    assert exp.segmented  # the record counts the samples a sync interrupted (samples_interrupted)
    src.close()
    loop = Loop(agent_config(max_staleness=1))
    loop.cluster.sync(0)
    src = rollout_source(loop)
    assert not src.generate(0, [Sample("1+2=", "3")]).segmented
    src.close()


def test_multi_turn_refuses_a_pool_whose_workers_did_not_start(monkeypatch):
    import rlhf_switch.agent.config as agent_config_module

    class Pool:  # a Ray pool whose second worker did not start
        shut = 0

        async def pids(self):
            return [101, None]

        def shutdown(self):
            Pool.shut += 1

    monkeypatch.setattr(agent_config_module, "build_pool", lambda cfg: Pool())
    with pytest.raises(RuntimeError) as e:
        MultiTurn(Loop(agent_config(pool={"num_workers": 3, "num_cpus": 0.5, "start_timeout_s": 7})))
    assert str(e.value) == ("agent.pool: the environment workers did not start within start_timeout_s=7.0 s; each "
                            "needs num_cpus=0.5 free in the Ray cluster beside the run's devices (3 workers)")
    assert Pool.shut == 1

    class Started(Pool):
        async def pids(self):
            return [101, 102]

    monkeypatch.setattr(agent_config_module, "build_pool", lambda cfg: Started())
    src = MultiTurn(Loop(agent_config()))
    assert isinstance(src.pool, Started) and Pool.shut == 1
    src.close()
    assert Pool.shut == 2


def test_multi_turn_a_failed_episode_scores_0_whatever_its_steps_paid():
    """agent_envs:PaysThenRaises pays 1 for the first turn (34, ended at its stop id 4) and
    raises at the second (56): the episode failed, its reward is 0, not the 1 its steps paid."""
    for failed, mask in (("zero", [1] * 4), ("exclude", [0] * 4)):
        loop = Loop(agent_config(env="agent_envs:PaysThenRaises", env_kwargs={}, failed_samples=failed))
        loop.cluster.sync(0)
        src = rollout_source(loop)
        exp = src.generate(0, [Sample("1+2=", "3")])
        assert [(s.episode.reward, s.episode.failed) for s in exp.samples] == [(1.0, True)] * 2
        assert exp.column("env_reward") == [0.0, 0.0] and exp.column("finish_reason") == ["env_error"] * 2
        assert exp.column("response") == [resp("3456")] * 2 and exp.column("loss_mask") == [mask] * 2
        assert exp.turn_batches == [2, 2] and [c["stop_ids"] for c in loop.cluster.calls] == [(EOS, 7, 9)] * 2
        src.close()


def test_multi_turn_evaluates_held_out_episodes_greedily_through_its_replicas():
    loop = Loop(agent_config())
    loop.splits = Splits(SPLITS.train, (Sample("2+8=", "10"), Sample("1+2=", "3")))
    loop.cluster.sync(5)
    src = rollout_source(loop)
    assert src.evaluator.source is src
    assert src.evaluator(loop.cluster) == 0.5  # 2+8= -> 9<eos> pays 1, 1+2= runs out of tokens
    assert loop.cluster.calls == [{"prompts": [enc("2+8="), enc("1+2=")], "seeds": [0, 0], "max_new_tokens": 4,
                                   "temperature": 0.0, "stop_ids": (EOS,), "pull": True}]
    assert src.evaluator.responses == [resp("9e"), resp("3456")] and loop.hooked == [(-1, True)]
    src.close()


def test_multi_turn_close_waits_for_the_episodes_in_flight():
    import threading

    loop = Loop(agent_config(max_staleness=1), last=2)
    release = threading.Event()

    def held(it, cluster):  # iteration 1's turns held back until the timer releases them
        release.wait(10)

    loop.faults = Faults(generate_hook=held)
    src = rollout_source(loop)
    loop.cluster.sync(0)
    src.ahead(0)
    future = src.in_flight[1]
    timer = threading.Timer(0.3, release.set)
    timer.start()
    src.close()  # waits for the episodes in flight
    assert future.done()
    timer.join()


def test_multi_turn_batches_turns_as_configured(monkeypatch):
    import rlhf_switch.agent.workflow as workflow

    seen, real = [], workflow.run_workflow

    def spy(*args, **kw):
        seen.append((args[7], kw))
        return real(*args, **kw)

    monkeypatch.setattr(workflow, "run_workflow", spy)
    for batching in ("continuous", "rounds"):
        loop = Loop(agent_config(turn_batching=batching))
        src = rollout_source(loop)
        src.generate(0, [Sample("2+8=", "10")])
        src.close()
    assert seen == [("continuous", {"segment_tokens": 0}), ("rounds", {"segment_tokens": 0})]


def test_multi_turn_a_chat_run_encodes_the_rendered_prompt_as_it_is(tmp_path):
    """``data.chat_template``: the loader rendered each prompt with the template's first turn
    (``agent.config.chat_prompt``, the system message in it); the episodes' codec is the chat one
    over the run's tokenizer, and the prompt is encoded as it is, not wrapped in the template again."""
    from transformers import AutoTokenizer

    from rlhf_switch.agent.chat import ChatCodec
    from rlhf_switch.agent.config import chat_prompt
    from rlhf_switch.rl.config import DataConfig
    from rlhf_switch.testing.bpe_tokenizer import build_bpe_tokenizer
    from test_agent_chat import QWEN_STYLE

    build_bpe_tokenizer(tmp_path)
    hf = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    hf.chat_template = QWEN_STYLE
    cfg = agent_config(system="Be brief.", observation_role="tool")
    loop = Loop(cfg.model_copy(update={"data": DataConfig(train_files=["t"], heldout_files=["h"], chat_template=True)}))
    loop.tok = hf
    loop.cluster.sync(0)
    src = rollout_source(loop)
    assert type(src.codec) is ChatCodec and src.codec.tokenizer is hf
    assert (src.codec.system, src.codec.observation_role) == ("Be brief.", "tool")
    text = chat_prompt(hf, cfg.agent)("2+8=")
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+8=<|im_end|>\n<|im_start|>assistant\n"
    src.generate(0, [Sample(text, "10")])
    ids = hf.encode(text, add_special_tokens=False)
    assert loop.cluster.calls[0]["prompts"] == [ids, ids] and loop.cluster.calls[0]["stop_ids"] == (hf.eos_token_id,)
    src.close()


# --- the version check on hand-made batches (model tokens only; -1: an environment's) ---

def with_versions(versions: list[int]) -> SampleExperience:
    return SampleExperience([1], Sample("q", "a"), 0, 0, response=[5] * len(versions), logprobs=[-0.1] * len(versions),
                            versions=list(versions), loss_mask=[0 if v < 0 else 1 for v in versions])


@pytest.mark.parametrize("it, k, versions", [
    (3, 1, [[3, 3], [2, 2, 3]]),           # one step ahead: one version behind at most
    (5, 2, [[3, -1, 3], [4], [5]]),        # two steps ahead, an observation between turns
    (0, 0, [[0]]),
    (4, 1, [[4], [-1, -1], []]),           # an episode its environment failed before the first turn
])
def test_batches_within_max_staleness_pass(it, k, versions):
    exp = Experience([with_versions(v) for v in versions])
    assert check_staleness(it, exp, k) is exp


@pytest.mark.parametrize("it, k, versions, oldest, count", [
    (3, 1, [[3], [1, 1], [1, 2]], 1, 2),   # a sync did not reach a replica: two samples two behind
    (5, 2, [[2, -1, 5], [5]], 2, 1),        # its oldest token decides
    (2, 0, [[1], [-1]], 1, 1),
])
def test_a_sample_too_far_behind_stops_the_run(it, k, versions, oldest, count):
    with pytest.raises(StaleWeightsError, match=rf"iteration {it}: {count} samples were generated with weights of "
                                                rf"version {oldest}, more than algorithm.off_policy.max_staleness={k}"):
        check_staleness(it, Experience([with_versions(v) for v in versions]), k)
