"""``recipes.loop.record``: the iteration's record (``metrics.jsonl``) and line, from what the loop's
phases put in an ``IterationRecord``, against hand values of what docs/loop.md ("An iteration's
record", "The train–inference mismatch", "Correcting for the rollout engine's policy") and
docs/agents.md ("The record") say each key is. Inputs are shaped as the loop fills them
(``recipes/loop/loop.py``): every trainer rank's log-probs and update reports (TP peers of one DP
rank report the same rows), the sync's, offload's and redundancy's reports, the memory readers."""
from __future__ import annotations

from recipes.loop import record as R
from recipes.loop.record import IterationRecord
from rlhf_switch.rl.experience import Experience, SampleExperience
from rlhf_switch.rl.tasks import Sample


def sample(group: int, versions: list[int], reward: float = 0.0, finish: str = "stop", *, text: str = "",
           source: Sample | None = None, mask: list[int] | None = None, episode=None) -> SampleExperience:
    """A sample with one response token per entry of ``versions`` (-1: the environment's: loss mask
    0, log-prob 0.0)."""
    n = len(versions)
    s = SampleExperience([1, 2], source or Sample(f"p{group}", "a"), group, 0, response=list(range(10, 10 + n)),
                         logprobs=[0.0 if v < 0 else -0.1 for v in versions], versions=list(versions),
                         loss_mask=[0 if v < 0 else 1 for v in versions] if mask is None else mask,
                         finish_reason=finish, episode=episode)
    s.text, s.reward, s.raw_reward = text, reward, reward
    return s


# ---------------------------------------------------------------- the weights' versions


def test_versions_are_the_model_tokens_versions():
    """``weight_version_min`` / ``staleness_max``: the oldest version any model token of the batch
    was generated with and how far behind the trainer's (iteration 5's) it is;
    ``samples_interrupted``: the samples whose tokens span two versions (a weight update landed
    in their generation). Environment tokens (-1) are no version: an observation between two
    turns does not make a sample interrupted, and a sample its environment failed before the
    model's first turn was generated with no weights at all."""
    exp = Experience([sample(0, [5, 5, 5]),
                      sample(0, [4, 4, 5, 5, 5]),        # interrupted: 4 then 5
                      sample(1, [4, -1, -1, 4]),         # one version, an observation between its turns
                      sample(1, [-1, -1]),               # failed before the model's first turn
                      sample(2, []),
                      sample(2, [5, -1, 5])], segmented=True)
    assert R._versions(exp, 5) == {"samples_interrupted": 1, "weight_version_min": 4, "staleness_max": 1}
    exp.segmented = False  # not a partial rollout: no interrupted samples to count
    assert R._versions(exp, 5) == {"weight_version_min": 4, "staleness_max": 1}
    assert R._versions(Experience([sample(0, [0, 0]), sample(0, [1])]), 2) == {"weight_version_min": 0,
                                                                               "staleness_max": 2}
    three = Experience([sample(0, [3, 4, 5]), sample(0, [5, 5])], segmented=True)  # three versions: still one sample
    assert R._versions(three, 5) == {"samples_interrupted": 1, "weight_version_min": 3, "staleness_max": 2}


def test_a_batch_without_model_tokens_has_no_version():
    exp = Experience([sample(0, [-1, -1]), sample(0, [])], segmented=True)
    assert R._versions(exp, 7) == {"samples_interrupted": 0, "weight_version_min": None, "staleness_max": None}
