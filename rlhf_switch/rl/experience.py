"""The experience of one iteration, as the loop's phases pass it to each other: one
``SampleExperience`` per sample, which the rollout produces and every later phase reads and extends.

=================  ===============  ====================================================================
field              filled by        what
=================  ===============  ====================================================================
``prompt``         rollout          the prompt's token ids
``response``       rollout          the response's token ids (a multi-turn sample: the model's and the
                                    environment's, in order)
``logprobs``       rollout          the rollout engine's log-prob of each response token (0.0 where the
                                    environment wrote it)
``versions``       rollout          the weights' version that generated each response token (-1 where
                                    the environment wrote it)
``loss_mask``      rollout          per response token: 1 — the loss counts it (the model's), 0 — not
``group``          rollout          the index of its prompt in the iteration's draw: the samples of one
                                    group share a prompt (group advantages)
``finish_reason``  rollout/reward   ``stop`` (the end token), ``length`` (cut at ``max_new_tokens``);
                                    a multi-turn sample's is its episode's (``max_turns``,
                                    ``env_error``, ``timeout`` too)
``text``           reward           the decoded response
``raw_reward``     reward           the reward before shaping (the rule's, or rule and model combined)
``reward``         reward           after shaping (DAPO's overlong punishment): what the estimator sees
``rule_reward``,   reward           with a reward model: the two parts of ``raw_reward``
``model_reward``
``advantage``      advantages       where the estimator works in the driver: the sample's advantage
``env_reward``     rollout          a multi-turn sample: its environment's reward (the reward phase
                                    takes it instead of the reward function's)
``episode``        rollout          a multi-turn sample: its ``agent.episode.Episode`` (turns, tool
                                    calls, environment seconds: the record's ``agent`` metrics)
=================  ===============  ====================================================================

On the trainer ranks each rank's share becomes a ``RankBatch`` (``rl.algorithm``), cut from
``Experience.rank_batch``: the padded ids, the loss mask (the response's tokens, times
``loss_mask``, times the algorithm's ``keep``), the rollout log-probs, which tokens the trainer's
own weights generated (the stale-weights check), and the per-sequence advantages or rewards; the
log-probs phase extends it there with the old and reference log-probs and values (``OldPolicy``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence


@dataclass
class SampleExperience:
    """One sample (module docstring: who fills which field)."""

    prompt: list[int]
    source: Any                   # the drawn prompt (rl.tasks.Sample: its text and answer)
    group: int
    seed: int
    response: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    finish_reason: str = ""
    text: str = ""
    raw_reward: float | None = None
    reward: float | None = None
    rule_reward: float | None = None
    model_reward: float | None = None
    advantage: float | None = None
    env_reward: float | None = None
    episode: Any = None

    @property
    def model_versions(self) -> list[int]:
        """The versions of the tokens the model generated, in order (an environment's tokens, -1,
        left out)."""
        return [v for v in self.versions if v >= 0]

    @property
    def version(self) -> int:
        """The weights' version of its oldest token (the sample's staleness); -1 when the model
        generated none (an episode its environment failed before the first turn)."""
        return min(self.model_versions, default=-1)

    @property
    def truncated(self) -> bool:
        """Cut at the length limit before the end token."""
        return self.finish_reason == "length"

    def generated(self, tokens: Sequence[int], logprobs: Sequence[float], version: int) -> None:
        """``tokens`` the model generated with weights of ``version``, appended (the loss counts them)."""
        self.response += list(tokens)
        self.logprobs += list(logprobs)
        self.versions += [version] * len(tokens)
        self.loss_mask += [1] * len(tokens)


@dataclass
class Experience:
    """One iteration's samples (``group_size`` samples of each prompt, in a row) and what the
    rollout that made them says of itself."""

    samples: list[SampleExperience]
    gen_seconds: float = 0.0
    # partial rollout: the samples' tokens may come from several weights' versions (the records say
    # how many did)
    segmented: bool = False
    dynamic_sampling: dict | None = None  # what dynamic sampling kept, drew and filled
    turn_batches: list[int] | None = None  # multi-turn: the size of each batch of turns sent to the engines
    tokens_past_stop: int = 0  # multi-turn: tokens the engines generated after a turn's stop id (cut)

    def __len__(self) -> int:
        return len(self.samples)

    def column(self, name: str) -> list:
        """One field of every sample, in order."""
        return [getattr(s, name) for s in self.samples]

    def groups(self, size: int) -> list["Experience"]:
        """Each prompt's samples as an experience of its own."""
        return [Experience(self.samples[i:i + size], segmented=self.segmented)
                for i in range(0, len(self.samples), size)]

    @staticmethod
    def join(parts: Sequence["Experience"], gen_seconds: float) -> "Experience":
        """Experiences one after the other, generated in ``gen_seconds``."""
        return Experience([s for p in parts for s in p.samples], gen_seconds,
                          segmented=any(p.segmented for p in parts))

    def rank_batch(self, iteration: int, max_staleness: int, fields: dict) -> dict:
        """The batch every trainer rank is sent (``rl.algorithm.RankBatch.of`` takes its share):
        the sequences, the rollout engine's log-probs, each token's loss mask, which tokens the
        trainer's own weights generated — the stale-weights check compares those; in the
        synchronous loop every one (a replica that missed a sync reports its old version, and the
        check must then catch its log-probs, not skip them) — and ``fields``, what the algorithm
        makes of the rewards (``Algorithm.batch_fields``)."""
        fresh = [[v == iteration or not max_staleness for v in s.versions] for s in self.samples]
        return {"prompts": self.column("prompt"), "responses": self.column("response"),
                "rollout_logprobs": self.column("logprobs"), "loss_mask": self.column("loss_mask"),
                "fresh": fresh, **fields}
