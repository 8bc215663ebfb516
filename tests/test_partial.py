"""Partial rollout (``recipes/loop/partial.py``), fast: ``Segments`` over rollout replicas of
``tests/fake_replicas.py`` (a deterministic engine that counts on in digits from the sequence's
last digit, then eos; each token's log-prob ``-(version + 1)``; ``ray.wait`` a clock of ticks).
Every value is computed by hand: each round's prompts, seeds and budget, which tokens each
version generated, when a sample is done, how many rounds fit while the update runs.

The three samples: "1+2=" counts 3456789 then eos (longer than any budget below), "2+8=" is 9 eos,
"3+6=" is 789 eos.
"""
from __future__ import annotations

import time

import pytest

from fake_replicas import EOS, Ref, Replicas, tok
from recipes.loop.partial import SEED_STRIDE, Segments
from rlhf_switch.rl.experience import Experience, SampleExperience

PROMPTS = ("1+2=", "2+8=", "3+6=")


def enc(text: str) -> list[int]:
    return [1] + tok(text)


def resp(digits: str) -> list[int]:
    return [EOS if c == "e" else t for c, t in zip(digits, tok(digits.replace("e", "0")))]


def batch(seeds=(10, 20, 30)) -> Experience:
    return Experience([SampleExperience(enc(p), None, i, s) for i, (p, s) in enumerate(zip(PROMPTS, seeds))])


def test_rounds_of_k_tokens_each_with_the_version_that_generated_it():
    cluster, exp = Replicas(n_replicas=2, versions=[5, 5]), batch()
    seg = Segments(cluster, exp, 2, 6, 0.7, EOS, 4)
    assert exp.segmented and seg.rounds == 1 and seg.todo == [0, 1, 2]  # round 1 handed out at once
    assert cluster.calls == [{"prompts": [enc(p) for p in PROMPTS], "seeds": [10, 20, 30], "max_new_tokens": 2,
                              "temperature": 0.7, "stop_ids": (), "pull": False}]
    assert exp.column("response") == [[], [], []] and not any(seg.done(i) for i in range(3))
    seg.collect()
    assert exp.column("response") == [resp("34"), resp("9e"), resp("78")]
    assert exp.column("versions") == [[5, 5]] * 3 and exp.column("loss_mask") == [[1, 1]] * 3
    assert [seg.done(i) for i in range(3)] == [False, True, False]  # 2+8= ended at its eos
    seg.collect()  # nothing in flight: nothing appended
    assert exp.column("response") == [resp("34"), resp("9e"), resp("78")]
    cluster.sync(6)  # the update landed between two rounds
    assert seg.submit() and seg.rounds == 2 and seg.todo == [0, 2]
    assert cluster.calls[1] == {"prompts": [enc("1+2=") + resp("34"), enc("3+6=") + resp("78")],
                                "seeds": [10 + SEED_STRIDE, 30 + SEED_STRIDE], "max_new_tokens": 2,
                                "temperature": 0.7, "stop_ids": (), "pull": False}
    seg.collect()
    assert exp.column("response") == [resp("3456"), resp("9e"), resp("789e")]
    assert exp.column("versions") == [[5, 5, 6, 6], [5, 5], [5, 5, 6, 6]]
    assert exp.column("logprobs") == [[-6.0, -6.0, -7.0, -7.0], [-6.0, -6.0], [-6.0, -6.0, -7.0, -7.0]]
    assert [s.version for s in exp.samples] == [5, 5, 5]
    assert [seg.done(i) for i in range(3)] == [False, True, True]
    assert seg.submit() and seg.todo == [0]
    assert cluster.calls[2]["seeds"] == [10 + 2 * SEED_STRIDE] and cluster.calls[2]["max_new_tokens"] == 2
    seg.collect()
    assert exp.samples[0].response == resp("345678") and seg.done(0)  # at its budget of 6
    assert not seg.submit() and seg.gen is None and seg.rounds == 3 and seg.todo == []
    assert len(cluster.calls) == 3


def test_the_last_round_asks_for_what_is_left_of_the_budget():
    cluster, exp = Replicas(n_replicas=1, versions=[0]), batch()
    seg = Segments(cluster, exp, 3, 5, 1.0, EOS, 0)
    seg.collect()
    assert seg.submit() and cluster.calls[1]["max_new_tokens"] == 2  # 5 - 3
    seg.collect()
    assert exp.column("response") == [resp("34567"), resp("9e"), resp("789e")]
    assert [seg.done(i) for i in range(3)] == [True, True, True] and not seg.submit()


def test_a_round_seed_wraps_at_2_to_the_31():
    cluster = Replicas(n_replicas=1, versions=[0])
    seg = Segments(cluster, batch(seeds=(2**31 - 1, 7, 2**31 - SEED_STRIDE)), 1, 6, 1.0, EOS, 0)
    assert cluster.calls[0]["seeds"] == [2**31 - 1, 7, 2**31 - SEED_STRIDE]
    seg.collect()
    seg.submit()
    assert cluster.calls[1]["seeds"] == [SEED_STRIDE - 1, 7 + SEED_STRIDE, 0]


def test_done():
    cluster = Replicas(n_replicas=1, versions=[0])
    exp = batch()
    seg = Segments(cluster, exp, 1, 3, 1.0, EOS, 0)
    assert not seg.done(0)  # nothing yet
    exp.samples[0].response = resp("34e")[:2]
    assert not seg.done(0)
    exp.samples[0].response = resp("345")
    assert seg.done(0)  # the budget
    exp.samples[0].response = resp("3e")
    assert seg.done(0)  # the eos
    exp.samples[0].response = resp("e3")
    assert not seg.done(0)  # an eos only ends it as the last token
    no_eos = Segments(Replicas(n_replicas=1, versions=[0]), batch(), 1, 3, 1.0, None, 0)
    no_eos.exp.samples[0].response = resp("3e")
    assert not no_eos.done(0)  # a model without an eos id: only the budget ends a sample
    no_eos.exp.samples[0].response = resp("3e4")
    assert no_eos.done(0)


def test_a_batch_already_done_submits_nothing():
    exp = batch()
    for s in exp.samples:
        s.generated(resp("9e"), [-1.0, -1.0], 0)
    cluster = Replicas(n_replicas=1, versions=[0])
    seg = Segments(cluster, exp, 2, 6, 1.0, EOS, 0)
    assert cluster.calls == [] and seg.gen is None and seg.rounds == 0 and seg.todo == []
    seg.pump([Ref(cluster.ray, 100)])  # nothing left: returns at once
    seg.finish()
    assert cluster.calls == [] and exp.column("response") == [resp("9e")] * 3 and exp.gen_seconds > 0


def test_an_engine_that_keeps_no_version_records_the_given_one():
    cluster = Replicas(n_replicas=2, versions=[None, 3])
    exp = batch()
    seg = Segments(cluster, exp, 2, 4, 1.0, EOS, 7)
    seg.finish()
    assert exp.column("versions") == [[7] * 4, [7, 7], [3] * 4]
    assert exp.column("logprobs") == [[-0.5] * 4, [-0.5] * 2, [-4.0] * 4]


def test_pump_hands_out_rounds_until_the_update_is_done():
    """Rounds of one token take 2 ticks, the update's two calls 7 and 3: the update asked at ticks
    1, 3, 5, 7 (done), the round in flight at 2 (round 1 done: round 2 out), 4 (round 3 out), 6
    (round 4 out)."""
    cluster, exp = Replicas(n_replicas=2, versions=[0, 0], ticks=2), batch()
    t0 = time.perf_counter()
    seg = Segments(cluster, exp, 1, 6, 1.0, EOS, 0)
    rounds = []
    seg.pump([Ref(cluster.ray, 7), Ref(cluster.ray, 3)], on_round=lambda: rounds.append(seg.rounds))
    assert rounds == [2, 3, 4] and seg.rounds == 4 and seg.todo == [0, 2]  # round 4 still in flight
    assert exp.column("response") == [resp("345"), resp("9e"), resp("789")]
    assert exp.column("versions") == [[0, 0, 0], [0, 0], [0, 0, 0]]
    cluster.sync(1)
    seg.finish()  # the round in flight with version 0, the rest with 1
    took = time.perf_counter() - t0
    assert exp.column("response") == [resp("345678"), resp("9e"), resp("789e")]
    assert exp.column("versions") == [[0, 0, 0, 0, 1, 1], [0, 0], [0, 0, 0, 0]]
    assert exp.column("logprobs")[0] == [-1.0] * 4 + [-2.0] * 2
    assert cluster.ray.now == 7 and 0 < exp.gen_seconds <= took  # from the first round to the last


def test_pump_stops_when_nothing_is_left():
    cluster, exp = Replicas(n_replicas=1, versions=[2]), batch()
    seg = Segments(cluster, exp, 3, 4, 1.0, EOS, 0)
    calls = [Ref(cluster.ray, 1000)]
    seg.pump(calls)  # no hook: the rounds handed out all the same
    assert seg.gen is None and cluster.ray.now < 1000
    assert exp.column("response") == [resp("3456"), resp("9e"), resp("789e")]
    assert exp.column("versions") == [[2] * 4, [2] * 2, [2] * 4]


def test_pump_returns_at_once_when_the_update_is_done():
    cluster, exp = Replicas(n_replicas=1, versions=[0], ticks=0), batch()
    seg = Segments(cluster, exp, 1, 6, 1.0, EOS, 0)
    seg.pump([Ref(cluster.ray, 0)], on_round=pytest.fail)
    assert seg.rounds == 1 and exp.column("response") == [[], [], []] and seg.gen is not None
