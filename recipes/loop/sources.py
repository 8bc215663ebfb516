"""Where an iteration's samples come from: the rollout source, one per run mode.

==================  ===================================================================================
``Synchronous``     each iteration generates its own batch after the sync (``max_staleness: 0``)
``OneStepAhead``    iteration i+1's batch is generated while iteration i trains (``max_staleness: 1``):
                    every sample is at most one update old; one batch in flight
``Partial``         one step ahead, the batch in flight generated K tokens at a time
                    (``segment_tokens``): the update landing interrupts it, and its unfinished samples
                    continue with the new weights after the next sync (``recipes.loop.partial``)
``MultiTurn``       each sample an episode with an environment (``agent``; ``recipes.loop.workflow``):
                    synchronous, or K steps ahead (``max_staleness: K``: the next K iterations'
                    episodes played in driver threads while this one trains)
==================  ===================================================================================

A source owns the generation's submission and collection and the batch in flight. The loop asks it,
in order: ``take(it)`` — the batch made ahead for ``it`` (None: none); ``generate(it, drawn)`` —
a batch made now; ``finish(exp)`` — after the sync, what the batch still lacks; ``ahead(it)`` —
start the next iteration's batch; ``stands_by()`` — whether the rollout engines may post their
receive for the next sync now; ``during_update(calls)`` — work while the update runs.
"""
from __future__ import annotations

import time

from recipes.common import StaleWeightsError, draw_prompts, sample_seeds
from rlhf_switch.rl.experience import Experience, SampleExperience


class Synchronous:
    """Each iteration's batch generated after its sync, with the trainer's weights."""

    max_staleness = 0
    collected_at_once = True  # a generation collected as soon as it is submitted: it may be pulled (rollout.pull_prompts)

    def __init__(self, loop):
        self.loop = loop

    def take(self, it: int) -> Experience | None:
        return None

    def generate(self, it: int, drawn: list, draw: int = 0) -> Experience:
        """``group_size`` samples of each prompt ``drawn``, generated now (``draw``: an extra round
        of dynamic sampling, whose samples take seeds of their own)."""
        return self._collect(it, *self._submit(it, drawn, draw))

    def finish(self, exp: Experience) -> None:
        pass

    def ahead(self, it: int) -> None:
        pass

    def stands_by(self) -> bool:
        return True

    def during_update(self, calls: list) -> None:
        pass

    def close(self) -> None:
        """The run is over: what the source holds released."""

    # --- the generation's parts ------------------------------------------------------------------------
    def _samples(self, it: int, drawn: list, draw: int) -> Experience:
        """The batch's samples, prompts encoded and seeds drawn, nothing generated yet."""
        from rlhf_switch.rl.tasks import encode_prompt

        loop, alg = self.loop, self.loop.cfg.algorithm
        sources = [s for s in drawn for _ in range(alg.group_size)]
        seeds = sample_seeds(loop.cfg, it, len(sources), first=draw * len(sources))
        return Experience([SampleExperience(encode_prompt(loop.tok, s.prompt, alg.max_new_tokens, loop.max_ctx), s,
                                            i // alg.group_size, seed) for i, (s, seed) in enumerate(zip(sources, seeds))])

    def _submit(self, it: int, drawn: list, draw: int = 0) -> tuple[Experience, object, float]:
        """The batch's generation started (``_collect`` waits for it)."""
        exp, started = self._samples(it, drawn, draw), time.perf_counter()
        alg = self.loop.cfg.algorithm
        submitted = self.loop.cluster.submit_generation(exp.column("prompt"), exp.column("seed"), alg.max_new_tokens,
                                                        alg.temperature, pull=self.collected_at_once)
        self.loop.faults.generate_hook_for(it, self.loop.cluster)
        return exp, submitted, started

    def _collect(self, it: int, exp: Experience, submitted, started: float) -> Experience:
        """The generation done: each sample's tokens, log-probs and the version of the weights that
        generated them (the replica's own count; the driver's iteration where the engine keeps none)."""
        responses, logprobs, versions = self.loop.cluster.collect_generation(submitted)
        for s, tokens, lps, v in zip(exp.samples, responses, logprobs, versions):
            s.generated(tokens, lps, it if v is None else v)
        exp.gen_seconds = time.perf_counter() - started
        return exp


def check_staleness(it: int, exp: Experience, max_staleness: int) -> Experience:
    """``exp`` as it is, or ``StaleWeightsError`` when a sample is more than ``max_staleness``
    versions behind the trainer (a sync that did not reach the rollout replicas). A sample the model
    generated no token of (version -1: an episode its environment failed before the first turn) was
    made with no weights: it is never stale."""
    old = [v for v in (s.version for s in exp.samples) if v >= 0 and it - v > max_staleness]
    if old:
        raise StaleWeightsError(f"iteration {it}: {len(old)} samples were generated with weights of version "
                                f"{min(old)}, more than algorithm.off_policy.max_staleness={max_staleness} "
                                f"behind the trainer's {it}: a weight sync did not reach the rollout replicas")
    return exp


class OneStepAhead(Synchronous):
    """The next iteration's batch generated while this one trains; a sample more than
    ``max_staleness`` versions behind the trainer stops the run (a sync that did not reach the
    rollout replicas)."""

    max_staleness = 1
    collected_at_once = False  # the batch in flight is collected an iteration later: fixed shares

    def __init__(self, loop):
        super().__init__(loop)
        self.in_flight: tuple[int, tuple] | None = None  # (the iteration it is for, what _submit returned)

    def take(self, it: int) -> Experience | None:
        if self.in_flight is None or self.in_flight[0] != it:
            return None
        exp = self._take(*self.in_flight[1])
        self.in_flight = None
        return check_staleness(it, exp, self.max_staleness)

    def _take(self, exp, submitted, started) -> Experience:
        return self._collect(self.in_flight[0], exp, submitted, started)

    def ahead(self, it: int) -> None:
        """Iteration ``it + 1``'s batch starts generating now, with the weights just synced, while
        this one trains (the replicas run it before their next receive)."""
        if it < self.loop.last:
            self.in_flight = (it + 1, self._start(it + 1, draw_prompts(self.loop.cfg, self.loop.splits, it + 1)))

    def _start(self, it: int, drawn: list) -> tuple:
        return self._submit(it, drawn)


class Partial(OneStepAhead):
    """One step ahead, the batch in flight generated in segments (``recipes.loop.partial``)."""

    def _start(self, it: int, drawn: list) -> tuple:
        from recipes.loop.partial import Segments

        exp = self._samples(it, drawn, 0)
        alg = self.loop.cfg.algorithm
        segments = Segments(self.loop.cluster, exp, self.loop.cfg.algorithm.off_policy.segment_tokens,
                            alg.max_new_tokens, alg.temperature, self.loop.eos_id, it - 1)
        self.loop.faults.generate_hook_for(it, self.loop.cluster)
        return exp, segments

    def _take(self, exp, segments) -> Experience:
        segments.collect()  # the round in flight; the rest after the sync
        self._finishing = segments
        return exp

    def finish(self, exp: Experience) -> None:
        """The unfinished samples, with the weights just synced."""
        segments, self._finishing = getattr(self, "_finishing", None), None
        if segments is not None:
            segments.finish()

    def stands_by(self) -> bool:
        # a receive posted now would hold up the segments handed out while the update runs
        return self.in_flight is None

    def during_update(self, calls: list) -> None:
        """Segments of the batch in flight handed out until the update is done."""
        if self.in_flight is not None:
            nxt, (_, segments) = self.in_flight
            hook = self.loop.faults.generate_hook
            segments.pump(calls, None if hook is None else lambda: hook(nxt, self.loop.cluster))


class MultiTurn(Synchronous):
    """Each sample an episode with the run's environment (``agent``; ``recipes.loop.workflow``):
    generated after the sync (``max_staleness: 0``), or K steps ahead (``max_staleness: K``):
    iterations i+1..i+K's episodes played, each in a thread of the driver, while iteration i
    trains — their turns go to the rollout replicas (of their own devices) round after round
    meanwhile, and ``take`` waits for iteration i+1's before its sync. A sync while episodes are
    in flight reaches the replicas between two of their rounds, so a later turn records the newer
    version (a sample's tokens may carry several); the oldest is at most K behind the iteration
    that trains on it (the first turns of iteration i+K's episodes run with iteration i's weights).
    The replicas post no receive ahead while episodes are in flight (a later round would wait
    behind it for a sync that waits for the episodes)."""

    def __init__(self, loop):
        super().__init__(loop)
        self.max_staleness = loop.cfg.algorithm.max_staleness
        self.in_flight: dict = {}  # the iteration each batch in flight is for -> the Future of its Experience
        self._ahead = None  # the threads the episodes in flight are played in
        from recipes.loop.workflow import EpisodeEvaluator
        from rlhf_switch.agent.config import build_pool, chat_codec, episode_limits

        agent, alg = loop.cfg.agent, loop.cfg.algorithm
        self.limits = episode_limits(agent, loop.max_ctx, alg.max_new_tokens)
        chat = loop.cfg.data is not None and loop.cfg.data.chat_template
        self.codec = chat_codec(loop.tok, agent) if chat else loop.tok
        self.pool = build_pool(agent.pool)
        self.evaluator = EpisodeEvaluator(loop, self)
        self._started()

    def _started(self) -> None:
        """The pool's workers up, or one clear error now: a worker that cannot start would fail
        every sample's episode (``env_error``) and the run would train on nothing."""
        import asyncio

        pids = getattr(self.pool, "pids", None)
        if pids is not None and None in asyncio.run(pids()):
            self.pool.shutdown()
            p = self.loop.cfg.agent.pool
            raise RuntimeError(f"agent.pool: the environment workers did not start within start_timeout_s="
                               f"{p.start_timeout_s} s; each needs num_cpus={p.num_cpus} free in the Ray cluster "
                               f"beside the run's devices ({p.num_workers} workers)")

    def requests(self, samples, tag: str) -> list:
        from rlhf_switch.agent.workflow import episode_request

        agent = self.loop.cfg.agent
        # a data run's loader applied the chat template to the prompt already (data.chat_template)
        return [episode_request(agent.env, agent.env_kwargs, s, f"{tag}-{i}", self.codec, rendered=True)
                for i, s in enumerate(samples)]

    def play(self, it: int, samples, seeds, temperature: float, tag: str):
        """Every sample's episode (``agent.workflow.run_workflow``) over the run's replicas."""
        from recipes.loop.workflow import turn_engines
        from rlhf_switch.agent.workflow import run_workflow

        off = self.loop.cfg.algorithm.off_policy
        with turn_engines(self.loop, it) as engines:
            return run_workflow(engines, self.pool, self.requests(samples, tag), self.codec, self.limits, seeds,
                                temperature, self.loop.cfg.agent.turn_batching,
                                segment_tokens=off.segment_tokens if off is not None else 0)

    def generate(self, it: int, drawn: list, draw: int = 0) -> Experience:
        loop, alg = self.loop, self.loop.cfg.algorithm
        sources = [s for s in drawn for _ in range(alg.group_size)]
        seeds = sample_seeds(loop.cfg, it, len(sources), first=draw * len(sources))
        started = time.perf_counter()
        result = self.play(it, sources, seeds, alg.temperature, f"it{it}.{draw}")
        exclude = loop.cfg.agent.failed_samples == "exclude"
        samples = []
        for i, (src, seed, ep) in enumerate(zip(sources, seeds, result.episodes)):
            s = SampleExperience(ep.prompt_ids, src, i // alg.group_size, seed, response=ep.response_ids,
                                 logprobs=ep.logprobs or [], versions=ep.versions or [], finish_reason=ep.finish_reason,
                                 loss_mask=[0] * len(ep.loss_mask) if exclude and ep.failed else ep.loss_mask,
                                 env_reward=0.0 if ep.failed else ep.reward, episode=ep)
            samples.append(s)
        off = loop.cfg.algorithm.off_policy
        exp = Experience(samples, time.perf_counter() - started, segmented=bool(off and off.segment_tokens))
        exp.turn_batches, exp.tokens_past_stop = result.batches, result.tokens_past_stop
        return exp

    def take(self, it: int) -> Experience | None:
        future = self.in_flight.pop(it, None)
        return None if future is None else check_staleness(it, future.result(), self.max_staleness)

    def ahead(self, it: int) -> None:
        """K steps ahead: the episodes of iterations ``it + 1 .. it + K`` not started yet start
        now (after a resume or the first iteration, all of them; then ``it + K`` alone), with the
        weights just synced."""
        if not self.max_staleness:
            return
        from concurrent.futures import ThreadPoolExecutor

        if self._ahead is None:
            self._ahead = ThreadPoolExecutor(self.max_staleness, thread_name_prefix="episodes-ahead")
        for nxt in range(it + 1, min(it + self.max_staleness, self.loop.last) + 1):
            if nxt not in self.in_flight:
                drawn = draw_prompts(self.loop.cfg, self.loop.splits, nxt)
                self.in_flight[nxt] = self._ahead.submit(self.generate, nxt, drawn)

    def stands_by(self) -> bool:
        return not self.in_flight

    def close(self) -> None:
        self.pool.shutdown()  # episodes still in flight (a run stopped by an error) fail and end
        if self._ahead is not None:
            self._ahead.shutdown(wait=True, cancel_futures=True)


def rollout_source(loop):
    """The run's rollout source, from ``algorithm.off_policy`` and ``agent`` (multi-turn:
    ``recipes.loop.workflow``)."""
    alg = loop.cfg.algorithm
    if loop.cfg.agent is not None:
        return MultiTurn(loop)
    if not alg.max_staleness:
        return Synchronous(loop)
    return Partial(loop) if alg.off_policy.segment_tokens else OneStepAhead(loop)
