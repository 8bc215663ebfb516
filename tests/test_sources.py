"""``recipes.loop.sources``' version check, engine-free: a batch made ahead is refused when a sample
is more than ``max_staleness`` versions behind the trainer (docs/loop.md, "One-step off-policy":
a sync that did not reach the replicas), judged by the model's tokens only."""
from __future__ import annotations

import pytest

from recipes.common import StaleWeightsError
from recipes.loop.sources import check_staleness
from rlhf_switch.rl.experience import Experience, SampleExperience
from rlhf_switch.rl.tasks import Sample


def sample(versions: list[int]) -> SampleExperience:
    return SampleExperience([1], Sample("q", "a"), 0, 0, response=[5] * len(versions), logprobs=[-0.1] * len(versions),
                            versions=list(versions), loss_mask=[0 if v < 0 else 1 for v in versions])


@pytest.mark.parametrize("it, k, versions", [
    (3, 1, [[3, 3], [2, 2, 3]]),           # one step ahead: one version behind at most
    (5, 2, [[3, -1, 3], [4], [5]]),        # two steps ahead, an observation between turns
    (0, 0, [[0]]),
    (4, 1, [[4], [-1, -1], []]),           # an episode its environment failed before the first turn
])
def test_batches_within_max_staleness_pass(it, k, versions):
    exp = Experience([sample(v) for v in versions])
    assert check_staleness(it, exp, k) is exp


@pytest.mark.parametrize("it, k, versions, oldest, count", [
    (3, 1, [[3], [1, 1], [1, 2]], 1, 2),   # a sync did not reach a replica: two samples two behind
    (5, 2, [[2, -1, 5], [5]], 2, 1),        # its oldest token decides
    (2, 0, [[1], [-1]], 1, 1),
])
def test_a_sample_too_far_behind_stops_the_run(it, k, versions, oldest, count):
    with pytest.raises(StaleWeightsError, match=rf"iteration {it}: {count} samples were generated with weights of "
                                                rf"version {oldest}, more than algorithm.off_policy.max_staleness={k}"):
        check_staleness(it, Experience([sample(v) for v in versions]), k)
