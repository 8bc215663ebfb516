"""Partial rollout (``algorithm.off_policy.segment_tokens``): the batch in flight, generated a
segment of K tokens at a time, so that a weight update can land between two segments.

With one-step off-policy, iteration i+1's batch is generated while iteration i trains. Generated
whole, a long sample holds the weights of version i to its last token, and the next sync waits
for it. Generated in segments, each round is every unfinished sample's next K tokens (its prompt
is the prompt and what it has generated so far, its seed that of the sample and the round). The
driver hands out rounds while the update runs (``pump``). When the update is done it stops: the
round in flight finishes with the old weights, the next sync lands, and the unfinished samples
continue with the new weights (``finish``). Every token records the version of the weights that
generated it, and its log-prob is that version's, so the stale-weights check compares the tokens
generated with the trainer's own weights and the importance correction weighs the others.
"""
from __future__ import annotations

import time

# a round's seed: the sample's, moved on by this much per round (a prime: rounds do not collide)
SEED_STRIDE = 1_000_003


class Segments:
    """One batch's segmented generation on the rollout replicas: what each sample has so far (its
    ``response``, ``logprobs``, ``versions``: ``rl.experience.SampleExperience``) and the round in
    flight."""

    def __init__(self, cluster, exp, segment_tokens: int, max_new_tokens: int, temperature: float,
                 eos_id: int | None, version: int):
        self.cluster, self.exp, self.started = cluster, exp, time.perf_counter()
        self.k, self.max_new, self.temperature, self.eos = segment_tokens, max_new_tokens, temperature, eos_id
        self.version = version  # a version for an engine that keeps none (the driver's iteration)
        exp.segmented = True
        self.rounds, self.todo, self.gen = 0, [], None
        self.submit()

    def done(self, i: int) -> bool:
        r = self.exp.samples[i].response
        return len(r) >= self.max_new or (bool(r) and self.eos is not None and r[-1] == self.eos)

    def submit(self) -> bool:
        """The next round: every unfinished sample's next ``k`` tokens. False when none is left."""
        samples = self.exp.samples
        self.todo = [i for i in range(len(samples)) if not self.done(i)]
        if not self.todo:
            self.gen = None
            return False
        n_new = min(self.k, self.max_new - len(samples[self.todo[0]].response))  # every unfinished one: the same length
        prompts = [samples[i].prompt + samples[i].response for i in self.todo]
        seeds = [(samples[i].seed + SEED_STRIDE * self.rounds) % 2**31 for i in self.todo]
        self.gen = self.cluster.submit_generation(prompts, seeds, n_new, self.temperature, pull=False)
        self.rounds += 1
        return True

    def collect(self) -> None:
        """The round in flight, done: its tokens appended to their samples, each with the version
        of the weights that generated it."""
        if self.gen is None:
            return
        tokens, logprobs, versions = self.cluster.collect_generation(self.gen)
        for i, t, lp, v in zip(self.todo, tokens, logprobs, versions):
            self.exp.samples[i].generated(t, lp, self.version if v is None else v)
        self.gen = None

    def pump(self, calls: list, on_round=None) -> None:
        """While ``calls`` (the update) run: each round that is done collected and the next handed
        out (then ``on_round()``, a test's hook). Returns when the update is done (a round may
        still be in flight) or nothing is left."""
        ray = self.cluster.ray
        while self.gen is not None:
            if len(ray.wait(calls, num_returns=len(calls), timeout=0)[0]) == len(calls):
                return
            refs = self.gen.refs
            if len(ray.wait(refs, num_returns=len(refs), timeout=0.01)[0]) == len(refs):
                self.collect()
                if self.submit() and on_round is not None:
                    on_round()

    def finish(self) -> None:
        """The rest, round after round (after the sync: with the new weights)."""
        self.collect()
        while self.submit():
            self.collect()
        self.exp.gen_seconds = time.perf_counter() - self.started
