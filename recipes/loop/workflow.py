"""Multi-turn rollouts in the loop: the run's replicas as a batch generator and held-out evaluation
of episodes, for the ``agent`` block's rollout source.

``recipes.loop.sources.MultiTurn`` is the synchronous source (``max_staleness: 0``) with each
sample an episode in the run's environment (``rlhf_switch.agent``): every sample's conversation runs concurrently, the
turns that are ready at once go to the rollout replicas as one batch (``agent.workflow``), the
environments answer from the pool's workers meanwhile. A sample's experience is its episode's
append-only token list: the response is every model turn and observation in order, the loss mask
1 on the model's tokens only, the log-probs and versions the engine's (0.0 and -1 on the
environment's). Its reward is the environment's (the sum of its steps'); a sample the environment
failed (``env_error``, ``timeout``) gets 0 and, with ``agent.failed_samples: exclude``, no token
in the loss. Before the samples leave the rollout every one is checked token for token against
what its turns were generated from and produced (``agent.workflow.check_tokens``): a mismatch
stops the run before anything trains on it.
"""
from __future__ import annotations


def replica_batches(loop, it: int):
    """The run's rollout replicas as ``agent.workflow``'s ``generate_batch``: one generation per
    distinct (budget, stop ids) — a prompt's ``max_new_tokens`` and the ids its turn ends at, which
    the engines stop on — all submitted before any is collected; a sample's version is its
    replica's (the driver's iteration where the engine keeps none)."""
    def generate_batch(prompts, seeds, budgets, temperature, stops):
        cluster, order = loop.cluster, {}
        for i, (b, s) in enumerate(zip(budgets, stops)):
            order.setdefault((b, tuple(sorted(s))), []).append(i)
        submitted = []
        for (b, s), idx in order.items():
            submitted.append((idx, cluster.submit_generation([prompts[i] for i in idx], [seeds[i] for i in idx], b,
                                                             temperature, s)))
            loop.faults.generate_hook_for(it, cluster)
        tokens, logprobs, versions = [None] * len(prompts), [None] * len(prompts), [None] * len(prompts)
        for idx, sub in submitted:
            for i, t, lp, v in zip(idx, *cluster.collect_generation(sub)):
                tokens[i], logprobs[i], versions[i] = t, lp, it if v is None else v
        return tokens, logprobs, versions
    return generate_batch


class ReplicaTurns:
    """The run's rollout replicas as ``agent.workflow``'s ``TurnStream``: one queue of turns they
    pull chunks of ``rollout.pull_prompts`` from (``recipes.cluster.turn_queue``; ``agent.turn_batching:
    continuous``), each turn answered as soon as its chunk is back; a sample's version is its
    replica's (the driver's iteration where the engine keeps none). Closed on leaving the ``with``."""

    def __init__(self, loop, it: int):
        from recipes.cluster.turn_queue import TurnQueue

        self.loop, self.it = loop, it
        self.queue = TurnQueue(loop.cluster, loop.cfg.rollout.pull_prompts, version=it)

    def submit(self, prompts, seeds, budgets, temperature, stops) -> list:
        futures = self.queue.submit(prompts, seeds, budgets, temperature, stops)
        self.loop.faults.generate_hook_for(self.it, self.loop.cluster)
        return futures

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.queue.close()


def turn_engines(loop, it: int):
    """What an iteration's episodes send their turns to, as a context manager: the replicas' turn
    queue (``ReplicaTurns``) with ``agent.turn_batching: continuous`` and ``rollout.pull_prompts``
    on rollout replicas; else ``replica_batches``."""
    from contextlib import nullcontext

    cfg, cluster = loop.cfg, loop.cluster
    if cfg.agent.turn_batching == "continuous" and cfg.rollout.pull_prompts and not cluster.in_world:
        return ReplicaTurns(loop, it)
    return nullcontext(replica_batches(loop, it))


class EpisodeEvaluator:
    """The held-out greedy reward of an agent run: the first ``eval.num_prompts`` held-out samples
    (``eval.split: all``: then the train ones) played as episodes at temperature 0, each scored by its environment (a failed one 0); the
    last call's prompts and responses stay in ``prompts`` and ``responses`` (a reward model
    scores them too)."""

    def __init__(self, loop, source):
        self.loop, self.source = loop, source
        self.samples = loop.cfg.eval.samples(loop.splits)
        self.prompts, self.responses, self.calls = [], [], 0

    def __call__(self, cluster) -> float:
        self.calls += 1
        result = self.source.play(-1, self.samples, [0] * len(self.samples), 0.0, f"eval{self.calls}")
        self.prompts = [e.prompt_ids for e in result.episodes]
        self.responses = [e.response_ids for e in result.episodes]
        return sum(0.0 if e.failed else e.reward for e in result.episodes) / len(result.episodes)
