"""``rl.experience``: what one iteration's samples say of themselves and the batch every trainer
rank is sent. Hand values from the module's docstrings: a sample's version is its oldest *model*
token's (environment tokens carry -1), ``generated`` appends model tokens the loss counts, groups
are ``group_size`` samples in a row, and ``rank_batch``'s ``fresh`` marks exactly the tokens the
trainer's own weights (version == iteration) generated — every token in the synchronous loop, where
a replica that missed a sync must still be caught by the stale-weights check."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rlhf_switch.rl.algorithm import RankBatch
from rlhf_switch.rl.experience import Experience, SampleExperience
from rlhf_switch.rl.tasks import Sample


def sample(group: int, versions: list[int], *, finish: str = "stop", prompt=(1, 2), mask=None,
           logprobs=None, seed: int = 0) -> SampleExperience:
    """A sample whose response has one token per entry of ``versions`` (-1: the environment's,
    loss mask 0 and log-prob 0.0 unless given), token ids 10, 11, ... and log-probs -0.01·(k+1)."""
    n = len(versions)
    mask = [0 if v < 0 else 1 for v in versions] if mask is None else mask
    lps = [0.0 if v < 0 else -0.01 * (k + 1) for k, v in enumerate(versions)] if logprobs is None else logprobs
    return SampleExperience(list(prompt), Sample(f"p{group}", "a"), group, seed, response=list(range(10, 10 + n)),
                            logprobs=lps, versions=list(versions), loss_mask=mask, finish_reason=finish)


# ---------------------------------------------------------------- SampleExperience


@pytest.mark.parametrize("versions, oldest", [
    ([4, 4, 4], 4),                    # one version
    ([5, 5, 4, 4], 4),                 # partial rollout: two versions; the oldest token's is the sample's
    ([4, 5, 5], 4),
    ([-1, -1, 3, 3, -1, 2, 2, -1], 2),  # multi-turn: environment tokens (-1) are not a version
    ([0, 0, -1, 1], 0),                # version 0 (the first iteration's weights) is a version
    ([-1, -1, -1], -1),                # the environment failed before the model's first turn
    ([], -1),                          # nothing generated at all
])
def test_a_samples_version_is_its_oldest_model_tokens(versions, oldest):
    assert sample(0, versions).version == oldest


@pytest.mark.parametrize("reason, cut", [("length", True), ("stop", False), ("max_turns", False),
                                         ("env_error", False), ("timeout", False), ("", False)])
def test_truncated_means_cut_at_the_length_limit_only(reason, cut):
    assert sample(0, [1], finish=reason).truncated is cut


def test_generated_appends_model_tokens_after_what_is_there():
    """A multi-turn sample: a model turn, an observation the environment wrote (mask 0, version
    -1, log-prob 0.0), then the next model turn with newer weights (partial rollout)."""
    s = SampleExperience([1, 2, 3], Sample("q", "a"), 0, 9)
    s.generated([20, 21], [-0.5, -0.25], 3)
    assert (s.response, s.logprobs, s.versions, s.loss_mask) == ([20, 21], [-0.5, -0.25], [3, 3], [1, 1])
    s.response += [30, 31, 32]  # the observation, as the episode appends it
    s.logprobs += [0.0] * 3
    s.versions += [-1] * 3
    s.loss_mask += [0] * 3
    s.generated((40,), (-1.5,), 4)  # any sequence, e.g. the engine's tuples
    assert s.response == [20, 21, 30, 31, 32, 40]
    assert s.logprobs == [-0.5, -0.25, 0.0, 0.0, 0.0, -1.5]
    assert s.versions == [3, 3, -1, -1, -1, 4]
    assert s.loss_mask == [1, 1, 0, 0, 0, 1]
    assert s.version == 3 and s.prompt == [1, 2, 3]
    s.generated([], [], 5)  # an empty segment changes nothing
    assert len(s.response) == len(s.logprobs) == len(s.versions) == len(s.loss_mask) == 6 and s.version == 3


def test_generated_copies_what_it_is_given():
    s = SampleExperience([1], Sample("q", "a"), 0, 0)
    tokens, lps = [7, 8], [-0.1, -0.2]
    s.generated(tokens, lps, 0)
    tokens.append(9)
    lps.append(-0.3)
    assert s.response == [7, 8] and s.logprobs == [-0.1, -0.2] and s.versions == [0, 0]


def test_samples_do_not_share_their_lists():
    a, b = SampleExperience([1], Sample("q", "a"), 0, 0), SampleExperience([1], Sample("q", "a"), 0, 1)
    a.generated([5], [-0.1], 2)
    assert b.response == b.logprobs == b.versions == b.loss_mask == []


# ---------------------------------------------------------------- Experience


def six_samples() -> list[SampleExperience]:
    """Three prompts, two samples each (group_size 2), of uneven lengths."""
    return [sample(i // 2, [2] * (i + 1), seed=i, prompt=(i,)) for i in range(6)]


def test_column_is_one_field_of_every_sample_in_order():
    exp = Experience(six_samples())
    assert len(exp) == 6
    assert exp.column("group") == [0, 0, 1, 1, 2, 2]
    assert exp.column("seed") == [0, 1, 2, 3, 4, 5]
    assert exp.column("prompt") == [[0], [1], [2], [3], [4], [5]]
    assert [len(r) for r in exp.column("response")] == [1, 2, 3, 4, 5, 6]
    assert exp.column("truncated") == [False] * 6  # properties too
    assert Experience([]).column("group") == [] and len(Experience([])) == 0


@pytest.mark.parametrize("segmented", [False, True])
def test_groups_are_each_prompts_samples(segmented):
    samples = six_samples()
    exp = Experience(samples, gen_seconds=3.0, segmented=segmented, dynamic_sampling={"draws": 1})
    groups = exp.groups(2)
    assert len(groups) == 3
    for g, part in enumerate(groups):
        assert part.samples == samples[2 * g:2 * g + 2]
        assert part.samples[0] is samples[2 * g]  # the samples themselves, not copies
        assert part.column("group") == [g, g]
        assert part.segmented is segmented
        assert part.gen_seconds == 0.0 and part.dynamic_sampling is None
    assert [len(g) for g in exp.groups(3)] == [3, 3]
    assert [g.column("seed") for g in exp.groups(3)] == [[0, 1, 2], [3, 4, 5]]
    assert [len(g) for g in exp.groups(6)] == [6]
    assert [len(g) for g in exp.groups(1)] == [1] * 6
    assert Experience([]).groups(2) == []


def test_join_puts_experiences_one_after_the_other():
    samples = six_samples()
    a, b, c = Experience(samples[:2], 1.0), Experience(samples[2:5], 2.0, segmented=True), Experience(samples[5:], 4.0)
    a.dynamic_sampling, a.turn_batches, a.tokens_past_stop = {"draws": 0}, [2], 3
    joined = Experience.join([c, a, b], gen_seconds=7.5)
    assert joined.samples == samples[5:] + samples[:2] + samples[2:5]
    assert joined.gen_seconds == 7.5 and joined.segmented is True
    assert joined.dynamic_sampling is None and joined.turn_batches is None and joined.tokens_past_stop == 0
    assert Experience.join([a, c], 0.5).segmented is False  # none segmented
    assert Experience.join([b], 0.5).segmented is True      # the only one segmented
    assert Experience.join([a, b], 0.5).segmented is True   # the last of several
    assert Experience.join([b, a], 0.5).segmented is True   # the first of several
    assert Experience.join([], 0.0).samples == []
    # the loop's dynamic sampling: groups of two draws joined back into one batch
    again = Experience.join(Experience(samples, segmented=False).groups(2)[::-1], 1.0)
    assert again.column("group") == [2, 2, 1, 1, 0, 0]


def mixed_batch() -> Experience:
    """Iteration 5's batch of a K-steps-ahead agent run with partial rollout: samples of uneven
    length whose tokens come from versions 3, 4 and 5, with environment tokens (-1) between."""
    return Experience([
        sample(0, [5, 5, 5]),                       # generated with the trainer's weights
        sample(0, [4, 4, 5, 5, 5]),                 # interrupted by the sync: the continued part is fresh
        sample(1, [4, -1, -1, 4]),                  # one version old, an observation between its turns
        sample(1, [3, 3, -1, 5]),                   # two versions old, then fresh after the observation
        sample(2, [-1, -1]),                        # failed before the model's first turn
        sample(2, []),                              # nothing at all
    ], gen_seconds=2.0, segmented=True)


def test_rank_batch_marks_the_tokens_of_the_trainers_own_weights_fresh():
    exp = mixed_batch()
    fields = {"advantages": [0.5, -0.5, 1.0, -1.0, 0.0, 0.0], "keep": [1, 1, 1, 1, 0, 1]}
    for k in (1, 2):  # one step ahead or two: fresh is the version, not the staleness bound
        batch = exp.rank_batch(5, k, fields)
        assert batch["fresh"] == [[True, True, True], [False, False, True, True, True],
                                  [False, False, False, False], [False, False, False, True], [False, False], []]
    assert set(batch) == {"prompts", "responses", "rollout_logprobs", "loss_mask", "fresh", "advantages", "keep"}
    assert batch["prompts"] == [[1, 2]] * 6
    assert batch["responses"] == [[10, 11, 12], [10, 11, 12, 13, 14], [10, 11, 12, 13], [10, 11, 12, 13], [10, 11], []]
    assert batch["rollout_logprobs"][2] == [-0.01, 0.0, 0.0, -0.04]
    assert batch["loss_mask"] == [[1, 1, 1], [1] * 5, [1, 0, 0, 1], [1, 1, 0, 1], [0, 0], []]
    assert batch["advantages"] == fields["advantages"] and batch["keep"] == fields["keep"]
    # iteration 4's view of the same tokens: its own weights are version 4
    assert exp.rank_batch(4, 1, {})["fresh"][1] == [True, True, False, False, False]
    assert exp.rank_batch(3, 2, {})["fresh"][3] == [True, True, False, False]


def test_rank_batch_in_the_synchronous_loop_checks_every_token():
    """``max_staleness: 0``: every token is compared, whatever version a replica reported — one
    that missed a sync says 4 in iteration 5, and its log-probs must be checked, not skipped."""
    exp = mixed_batch()
    fresh = exp.rank_batch(5, 0, {"scores": [0.0] * 6})["fresh"]
    assert fresh == [[True] * 3, [True] * 5, [True] * 4, [True] * 4, [True] * 2, []]


def test_the_stale_check_compares_the_fresh_model_tokens_only():
    """``RankBatch.of`` on ``rank_batch``'s output (two DP ranks, uneven lengths): the stale-weights
    check's tokens are the model's tokens of version == iteration — never an environment's, never
    an older version's (whose log-probs are another policy's). Each token's rollout log-prob is
    distinct (-0.01·(k+1)), so their sum says which tokens were picked."""
    exp = Experience([
        sample(0, [5, 5, 5]),           # all three
        sample(0, [4, 4, 5, 5, 5]),     # the last three: -0.03 - 0.04 - 0.05
        sample(1, [3, -1, 5, 5]),       # the last two: -0.03 - 0.04
        sample(1, [-1, 4, 4]),          # none
    ])
    cfg = SimpleNamespace(train_batch_size=4, micro_batch_size=2, loss_aggregation="token-mean")
    expected = {1: ([3, 3, 2, 0], [-0.06, -0.12, -0.07, 0.0]),  # one step ahead
                0: ([3, 5, 3, 2], [-0.06, -0.15, -0.08, -0.05])}  # synchronous: every model token
    for k, (count, lp_sum) in expected.items():
        batch = exp.rank_batch(5, k, {"advantages": [1.0, -1.0, 0.5, -0.5]})
        rows = [RankBatch.of(batch, 2, r, 0, cfg, torch.device("cpu")) for r in (0, 1)]
        # each rank's rows padded to its own longest: summed per row, rank after rank
        assert [n for r in rows for n in r.checked_mask.sum(-1).tolist()] == count, k
        picked = [x for r in rows for x in (r.checked_mask * r.rollout_logprobs).sum(-1).tolist()]
        assert picked == pytest.approx(lp_sum), k
