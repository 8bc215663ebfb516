"""The RLHF loop (GRPO and PPO), driven by one Ray controller over colocated hybrid workers.

    rlhf-switch train configs/grpo_tiny.yaml            # or: python -m recipes.grpo CONFIG
    rlhf-switch train configs/ppo_tiny.yaml             # or: python -m recipes.ppo CONFIG
        [--iterations N] [--output-dir DIR] [--resume [DIR]] [--stale-tol T] [--quiet] [--verbose]

Before iteration 0 the config is checked (``rlhf_switch.problems``: one error listing every
problem, before Ray starts), the warm start is made (SFT on the task, cached) and every engine is
built from it. Each iteration is a fixed sequence of named phases (``Loop.iteration``)::

    rollout_wait  one-step off-policy: the batch generated during the last iteration, collected
    sync        trainer -> rollout engine through the weight channel (a VPS move of the weights);
                elastic.redundancy: host — the buddies' host copies refreshed; train.offload — the
                trainer's optimizer state parked in host memory while the rollout runs
    rollout     group_size samples per prompt (then the parked state comes back); elastic.lend: also
                on replicas lent the trainer's devices (``recipes/rebalance.py``: ``Lending``)
    reward      the run's reward function on every sample (in the driver or its reward workers,
                each call within ``reward_timeout_s``: ``rlhf_switch.reward_workers``); with
                ``reward.model_path`` also the reward model's score in the workers
                (``rule_weight·rule + model_weight·model``)
    advantages  the algorithm's per-sequence advantages (GRPO: group-normalised; PPO: from the
                critic, inside the update)
    grow        elastic.rebalance: the training state into the grown world over the trainer's and
                the replicas' devices (``recipes/rebalance.py``), where the next two phases run
    logprobs    the trainer's log-probs of the generated tokens (the old policy), the reference's,
                PPO's values — and the stale-weights check: the trainer's log-probs must equal the
                rollout engine's within ``--stale-tol``, else ``StaleWeightsError`` before any update
    update      ``epochs`` passes of optimizer steps (``rlhf_switch.rl.algorithm.Algorithm.update``);
                one-step off-policy with ``segment_tokens``: the batch in flight handed out a
                segment at a time meanwhile (``recipes/partial.py``)
    shrink      elastic.rebalance: the state back into the trainer's own world
    record      one line, one record in metrics.jsonl and the logging backends, the rollouts
    checkpoint  every ``checkpoint.save_every`` iterations
    eval        held-out greedy reward before the first iteration, every ``eval.every`` and at the end

Between iterations ``ElasticControl`` (``recipes/elastic_control.py``) runs the planned resizes,
resize requests and node events, and recovers a lost trainer. At the end the final policy is
evaluated and saved to ``<output_dir>/final`` (a HF checkpoint transformers and vLLM load, plus the
optimizer state) and a PNG of reward and time per phase is written.

``--iterations N`` (default: the config's ``algorithm.iterations``) is the run's TOTAL: iterations
0 .. N-1, also on ``--resume``. ``--resume`` finishes an interrupted run: it continues from the
newest complete checkpoint (``checkpoints/step_<K>`` or ``final/``) at the iteration after it,
with the same prompts and seeds, and stops at N-1 — the same ``final/`` as the uninterrupted run;
the records the interrupted run wrote after that checkpoint are dropped from ``metrics.jsonl`` and
``rollouts.jsonl`` first. ``--resume`` of a finished run (``final/`` holds iteration N-1) says so
and exits 0 without starting anything; with a larger N it continues from ``final/``.
"""
from __future__ import annotations

import argparse
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from recipes.cluster import Cluster, start_ray
from recipes.common import (Evaluator, RunFinished, StaleTolerance, StaleWeightsError, draw_extra_prompts,
                            draw_prompts, fault, prune_checkpoints, resolve_resume, sample_seeds, warm_start,
                            write_run_config)
from recipes.run_log import MetricsLog, is_iteration_record, plot_run

__all__ = ["run", "main", "StaleWeightsError"]


def prepare(config_source, iterations=None, output_dir=None):
    """Load and check the config; everything that can be refused is refused here, before Ray
    (``rlhf_switch.problems``). Returns (config, the run's total number of iterations)."""
    from rlhf_switch.problems import check_run
    from rlhf_switch.rl.config import ConfigError, load_config

    cfg = load_config(config_source)
    if output_dir:
        cfg.output_dir = str(output_dir)
    if iterations is not None:
        if int(iterations) < 1:
            raise ConfigError("--iterations", [f"--iterations: {iterations} — the run's total must be at least 1"])
        cfg.algorithm.iterations = int(iterations)  # the total: recorded in <output_dir>/config.yaml
    check_run(cfg)
    return cfg, cfg.algorithm.iterations


@dataclass
class Faults:
    """Fault injection for tests: ``skip_sync_at`` — iterations that generate WITHOUT syncing the
    weights first (the stale-weights check must catch it); ``crash_at`` — iterations that crash
    after generating (the last checkpoint must survive); ``phase_hook(iteration, phase, cluster)``
    — called as the train phase starts, and around a resize (a test kills a trainer there);
    ``generate_hook(iteration, cluster)`` — called right after a batch's generation (or, partial
    rollout, each segment of it handed out while the update runs) goes to the rollout engines, with
    the iteration the batch is for (a test kills a replica there, or holds the segments back)."""

    skip_sync_at: tuple[int, ...] = ()
    crash_at: tuple[int, ...] = ()
    phase_hook: object = None
    generate_hook: object = None

    def hook(self, it: int, phase: str, cluster) -> None:
        if self.phase_hook is not None:
            self.phase_hook(it, phase, cluster)


@dataclass
class Rollout:
    """One iteration's samples as the phases after the rollout see them (``group_size`` samples
    of each prompt in a row)."""

    samples: list            # the drawn prompts (rl.tasks.Sample), each generated group_size times
    prompts: list            # token ids, one per sequence
    responses: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)   # the rollout engine's, per generated token
    texts: list = field(default_factory=list)      # the decoded responses
    scores: list = field(default_factory=list)     # the reward of each sequence (shaped)
    raw_scores: list = field(default_factory=list)  # ... before shaping (what dynamic sampling compares)
    truncated: list = field(default_factory=list)  # cut at max_new_tokens before the end token
    versions: list = field(default_factory=list)   # the weights' version each sample was generated with (its oldest token's)
    token_versions: list = field(default_factory=list)  # partial rollout: each token's version
    rule_scores: list = field(default_factory=list)   # with a reward model: the rule's part of each score
    model_scores: list = field(default_factory=list)  # ... and the reward model's
    gen_seconds: float = 0.0
    dynamic_sampling: dict | None = None           # what dynamic sampling kept, drew and filled

    FIELDS = ("samples", "prompts", "responses", "logprobs", "texts", "scores", "raw_scores", "truncated", "versions",
              "token_versions", "rule_scores", "model_scores")
    submitted: object = None  # a generation in flight (Cluster.submit_generation), and when it started
    segments: object = None   # partial rollout: the segmented generation (recipes/partial.py)
    started: float = 0.0

    def groups(self, size: int) -> list["Rollout"]:
        """Each prompt's samples as a rollout of its own."""
        return [Rollout(**{f: getattr(self, f)[i:i + size] for f in self.FIELDS})
                for i in range(0, len(self.samples), size)]

    @staticmethod
    def join(parts: list["Rollout"], gen_seconds: float) -> "Rollout":
        """Rollouts one after the other, generated in ``gen_seconds``."""
        return Rollout(**{f: [x for p in parts for x in getattr(p, f)] for f in Rollout.FIELDS},
                       gen_seconds=gen_seconds)


class Loop:
    """One run of the loop: the driver's state, the iteration as named phases (``iteration``) and
    what comes before and after them (``start``, ``finish``). ``ElasticControl`` changes
    ``cluster`` and ``cfg`` between iterations (a resize, a recovery)."""

    def __init__(self, cfg, iterations: int, first: int, resume_dir, stale_tol: float | None, quiet: bool,
                 faults: Faults):
        from rlhf_switch.device import cuda_available, resolve_device
        from rlhf_switch.rl.algorithm import Algorithm

        self.cfg, self.name, self.last, self.first = cfg, cfg.algorithm.name, iterations - 1, first
        self.iterations, self.resume_dir, self.quiet = iterations, resume_dir, quiet
        # the stale-weights check's bound: given, or by the compute dtype (calibrated in bf16/fp16)
        dtype = resolve_device(cfg.device, cuda_available(), cfg.model.dtype).compute_dtype
        self.stale = StaleTolerance(stale_tol, dtype)
        self.stale_tol = self.stale.value  # None until the first iteration calibrates it
        self.faults, self.algorithm = faults, Algorithm.build(cfg.algorithm)
        # one-step off-policy: the next iteration's batch generated while this one trains
        off_policy = getattr(cfg.algorithm, "off_policy", None)
        self.max_staleness = off_policy.max_staleness if off_policy is not None else 0
        self.segment_tokens = off_policy.segment_tokens if off_policy is not None else 0  # partial rollout
        self.ahead: tuple[int, Rollout] | None = None
        self.out_dir = Path(cfg.output_dir)
        self.records: list[dict] = []
        self.cluster = self.log = self.evaluator = self.reward_runner = None
        self.rebalance = None  # elastic.rebalance: the grown trainer world (recipes/rebalance.py)
        self.rebalanced: dict | None = None  # this iteration's grow and shrink
        self.lending = None  # elastic.lend: the trainer's devices lent to the rollout (recipes/rebalance.py)
        self.lend_record: dict | None = None  # this iteration's: whether it lent, why, the rollout's seconds
        self.timings: dict[str, float] = {}

    # --- output ----------------------------------------------------------------------------------
    def say(self, msg: str) -> None:
        if not self.quiet:
            from tqdm import tqdm

            tqdm.write(f"[{self.name}] {msg}")

    def emit(self, rec: dict, step: int | None = None) -> None:
        """A record for the run log (``metrics.jsonl`` and the logging backends) and the caller of ``run``."""
        self.records.append(rec)
        self.log.write(rec, rec.get("iteration", 0) if step is None else step)

    def drop_rerun(self, it: int) -> None:
        """A recovery runs ``it`` and the iterations after it again: their records go."""
        self.records[:] = [r for r in self.records if r.get("iteration", -1) < it or not is_iteration_record(r)]
        self.log.drop_rerun(it)

    @contextmanager
    def timed(self, phase: str):
        """The wall time of one named phase of the current iteration (``phase_seconds``)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.timings[phase] = time.perf_counter() - t0

    # --- before the first iteration --------------------------------------------------------------
    def start(self, t_start: float) -> None:
        """The tokenizer, the prompts, the reward function (its workers started), the run log and the
        warm start."""
        from rlhf_switch.families import context_length
        from rlhf_switch.reward_workers import RewardRunner
        from rlhf_switch.rl.data import load_splits
        from rlhf_switch.rl.tokenizer import load_tokenizer

        cfg = self.cfg
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.tok = load_tokenizer(cfg)
        self.splits, read_line = load_splits(cfg, self.tok)  # prompts rendered (chat template), too-long dropped
        self.say(read_line)
        # its workers (if any) start now and import the function while the warm start runs
        for note in getattr(cfg.algorithm, "off_paper_notes", lambda: [])():  # algorithm.off_paper's choices
            self.say(f"note: {note}")
        self.reward_runner = RewardRunner(cfg.reward_fn, cfg.reward_workers, cfg.reward_timeout_s, say=self.say)
        self.say(f"reward: {self.reward_runner!r}")
        hf = cfg.model.hf_dict()
        self.max_ctx, self.eos_id = context_length(hf), hf.get("eos_token_id")
        write_run_config(self.out_dir, cfg)
        # before the warm start: a logging backend that cannot start (W&B not logged in) is refused first
        self.log = MetricsLog(self.out_dir, cfg.logging, resume_from=self.first if self.resume_dir is not None else None,
                              config=cfg.model_dump(mode="json"))
        self.init_dir = warm_start(cfg, self.out_dir / "init", self.quiet)
        self.say(f"warm start: {self.init_dir} ({time.perf_counter() - t_start:.1f} s)")

    def build(self, world_cfg, ray, devices, t_start: float) -> None:
        """The actors and engines of the first iteration's world, from the warm start (or the
        checkpoint being resumed)."""
        self.cluster = Cluster(world_cfg, ray, self.quiet,
                               devices=devices.slots(range(world_cfg.world_size)) if devices else None,
                               lend=self.cfg.elastic is not None and self.cfg.elastic.lend != "off")
        built = self.cluster.build(self.init_dir, self.resume_dir)
        if self.resume_dir is not None and int(built["start"].get("iteration", -1)) != self.first - 1:
            raise RuntimeError(f"{self.resume_dir}: the engines loaded iteration {built['start'].get('iteration')}, "
                               f"the driver read {self.first - 1}")
        resumed = (f"resumed from {self.resume_dir} at iteration {self.first} of {self.iterations}; "
                   if self.resume_dir else "")
        self.say(f"{self.cfg.world_size} workers: train {built['trainer']}, rollout {built['rollout']}, "
                 f"{built['params']:,} params; {resumed}ready in {time.perf_counter() - t_start:.1f} s")
        self.evaluator = Evaluator(self.cfg, self.splits, self.tok, self.reward_runner, self.max_ctx)
        if self.cfg.elastic is not None and self.cfg.elastic.lend != "off":
            from recipes.rebalance import Lending

            self.lending = Lending(self.cluster, self.cfg.elastic.lend)
            self.say(f"lend {self.cfg.elastic.lend}: {len(self.cluster.lent)} rollout replica(s) on the trainer's "
                     f"devices take a share of the rollout")
        if self.cfg.elastic is not None and self.cfg.elastic.rebalance != "off":
            from recipes.rebalance import Rebalance

            # built in the background while the first iterations run
            self.rebalance = Rebalance(self.cluster, self.cfg, self.init_dir, self.quiet)
            self.say(f"rebalance {self.cfg.elastic.rebalance}: a {self.rebalance.world}-rank trainer world over the "
                     f"trainer's and the replicas' devices is being built for the updates")

    # --- one iteration, phase by phase -----------------------------------------------------------
    def iteration(self, it: int, elastic) -> dict:
        """Iteration ``it``: sync, rollout, reward, advantages, logprobs, update, record, then
        checkpoint and eval where due."""
        t_it, self.timings = time.perf_counter(), {}
        with self.timed("rollout_wait"):  # one-step off-policy: the batch generated during the last iteration
            ahead = self.take_ahead(it)
        with self.timed("sync"):
            sync, copied, off, peak = self.sync(it, elastic)
        if it == self.first and (it == 0 or (self.cfg.eval.every and it % self.cfg.eval.every == 0)):
            self.evaluate(it, "before")  # where the uninterrupted run evaluated before this iteration
        with self.timed("rollout"):
            self.lend(it)
            roll = ahead or self.rollout(it, draw_prompts(self.cfg, self.splits, it))
            if roll.segments is not None:  # partial rollout: the unfinished samples, with the weights just synced
                roll.segments.finish()
        with self.timed("reward"):
            self.reward(roll)
        if getattr(self.cfg.algorithm, "dynamic_sampling", None) is not None:
            with self.timed("dynamic_sampling"):
                roll = self.resample(it, roll)
        self.generate_ahead(it)
        back = self.rollout_done(it, peak)
        with self.timed("advantages"):
            batch = self.advantages(it, roll)
        self.faults.hook(it, "train", self.cluster)
        self.grow(it)
        with self.timed("logprobs"):
            checked = self.logprobs(batch)
        stale = max(s["stale_logprob_diff"] for s in checked)
        self.stale_tol = self.stale.bound(stale)
        stats = None
        if stale <= self.stale_tol:
            with self.timed("update"):
                stats = self.update(peak)
        self.shrink(it)
        rec = self.record(it, roll, sync, copied, off, back, checked, stats, peak, t_it)
        if stats is None:
            raise StaleWeightsError(
                f"iteration {it}: the trainer's log-probs of the generated tokens differ from the rollout "
                f"engine's by {stale:.3g} > {self.stale_tol:g}: the rollout engine ran on stale or wrong "
                f"weights; nothing was updated")
        self.checkpoint(it)
        if self.cfg.eval.every and (it + 1) % self.cfg.eval.every == 0 and it != self.last:
            self.cluster.sync(version=it + 1)
            self.evaluate(it + 1, "before")
        return rec

    def sync(self, it: int, elastic):
        """train -> rollout: the weights through the channel (not at a ``skip_sync_at`` iteration),
        the host copies refreshed (``elastic.redundancy: host``: before offload parks the state),
        the optimizer state parked (``train.offload``), the phase's memory mark."""
        sync = ({"seconds": 0.0, "bytes_moved": 0, "bytes_sent": 0} if it in self.faults.skip_sync_at
                else self.cluster.sync(version=it))
        copied = elastic.refresh_host_copy(it)
        off = self.cluster.offload()
        peak = {"sync": self.cluster.memory_mark(wait=False)}  # read with the record (no round trip here)
        return sync, copied, off, peak

    def rollout(self, it: int, drawn: list, draw: int = 0) -> Rollout:
        """``group_size`` samples of each prompt ``drawn``, generated now (``draw``: the extra round
        of dynamic sampling; its samples take seeds of their own)."""
        return self.collect(it, self.submit(it, drawn, draw))

    def submit(self, it: int, drawn: list, draw: int = 0, segments: bool = False) -> Rollout:
        """The prompts encoded and their generation started (``collect`` waits for it).
        ``segments``: partial rollout — the first segment of every sample (``recipes/partial.py``)."""
        from recipes.partial import Segments
        from rlhf_switch.rl.tasks import encode_prompt

        alg = self.cfg.algorithm
        samples = [s for s in drawn for _ in range(alg.group_size)]
        roll = Rollout(samples, [encode_prompt(self.tok, s.prompt, alg.max_new_tokens, self.max_ctx) for s in samples])
        roll.started = time.perf_counter()
        seeds = sample_seeds(self.cfg, it, len(samples), first=draw * len(samples))
        if segments:
            roll.segments = Segments(self.cluster, roll, seeds, self.segment_tokens, alg.max_new_tokens,
                                     alg.temperature, self.eos_id, it - 1)
        else:
            roll.submitted = self.cluster.submit_generation(roll.prompts, seeds, alg.max_new_tokens, alg.temperature)
        if self.faults.generate_hook is not None:
            self.faults.generate_hook(it, self.cluster)
        return roll

    def collect(self, it: int, roll: Rollout) -> Rollout:
        """The generation of ``roll`` done: its responses, log-probs and each sample's weight
        version (the replica's own count; the driver's iteration where the engine keeps none)."""
        roll.responses, roll.logprobs, versions = self.cluster.collect_generation(roll.submitted)
        roll.versions = [it if v is None else v for v in versions]
        roll.gen_seconds, roll.submitted = time.perf_counter() - roll.started, None
        return roll

    def generate_ahead(self, it: int) -> None:
        """One-step off-policy: iteration ``it + 1``'s batch starts generating now, with the
        weights just synced, while this one trains (the replicas run it before their next receive)."""
        if self.max_staleness and it < self.last:
            self.ahead = (it + 1, self.submit(it + 1, draw_prompts(self.cfg, self.splits, it + 1),
                                              segments=bool(self.segment_tokens)))

    def take_ahead(self, it: int) -> Rollout | None:
        """The batch generated ahead for iteration ``it`` (None: none — the first iteration, or the
        synchronous loop); every sample must be at most ``max_staleness`` versions old."""
        if self.ahead is None or self.ahead[0] != it:
            return None
        roll, self.ahead = self.ahead[1], None
        if roll.segments is not None:  # partial rollout: the round in flight; the rest after the sync
            roll.segments.collect()
        else:
            roll = self.collect(it, roll)
        old = [v for v in roll.versions if it - v > self.max_staleness]
        if old:
            raise StaleWeightsError(f"iteration {it}: {len(old)} samples were generated with weights of version "
                                    f"{min(old)}, more than algorithm.off_policy.max_staleness={self.max_staleness} "
                                    f"behind the trainer's {it}: a weight sync did not reach the rollout replicas")
        return roll

    def rollout_done(self, it: int, peak: dict) -> dict:
        """The rollout engines are done until the next sync: they stand by for it, the phase's
        memory mark, the parked trainer state back (``train.offload``)."""
        fault(self.faults.crash_at, it, "after generation")
        if self.lending is not None:  # the lent devices go back to the trainer
            took = self.timings["rollout"] + self.timings.get("dynamic_sampling", 0.0)
            self.lend_record = {**(self.lend_record or {}), **self.lending.give_back(it, took)}
        # a sync comes before the rollout engines are used again (partial rollout: after more
        # segments of the batch in flight, which a receive posted now would hold up)
        segmented = self.ahead is not None and self.ahead[1].segments is not None
        version = stand_by_version(it, self.faults.skip_sync_at, segmented)
        if version is not None:
            self.cluster.stand_by(version=version)
        peak["generate"] = self.cluster.memory_mark(wait=False)
        return self.cluster.reload()

    def reward(self, roll: Rollout) -> None:
        """The decoded responses, scored by the run's reward function (``RewardRunner``: in this
        process or its workers, every call within ``reward_timeout_s``), shaped by the algorithm
        (DAPO's overlong punishment)."""
        roll.texts = [self.tok.decode(r) for r in roll.responses]
        raw = self.reward_runner([s.prompt for s in roll.samples], roll.texts, [s.answer for s in roll.samples])
        if self.cfg.reward is not None:
            raw = self.model_reward(roll, raw)
        roll.truncated = self.algorithm.truncated(roll.responses, self.eos_id)
        roll.raw_scores = list(raw)
        roll.scores = self.algorithm.shape_scores(raw, roll.responses)

    def resample(self, it: int, roll: Rollout) -> Rollout:
        """Dynamic sampling: the groups without signal (every sample the same reward) dropped and
        more prompts drawn, generated and scored until the batch is full of groups with signal or
        ``max_draws`` rounds are spent (then filled with dropped groups)."""
        alg = self.cfg.algorithm
        kept, dropped, draws, gen_s = [], [], 0, 0.0
        while True:
            gen_s += roll.gen_seconds
            for g in roll.groups(alg.group_size):
                (kept if self.algorithm.has_signal(g.scores, g.raw_scores) else dropped).append(g)
            if len(kept) >= alg.prompts_per_iteration or draws == alg.dynamic_sampling.max_draws:
                break
            draws += 1
            roll = self.rollout(it, draw_extra_prompts(self.cfg, self.splits, it, draws), draw=draws)
            self.reward(roll)
        filled = max(0, alg.prompts_per_iteration - len(kept))
        out = Rollout.join(kept[:alg.prompts_per_iteration] + dropped[:filled], gen_s)
        out.dynamic_sampling = {"groups_with_signal": len(kept), "draws": draws, "filled_with_dropped": filled}
        return out

    def model_reward(self, roll: Rollout, rule: list[float]) -> list[float]:
        """The reward model's score of every sequence (``HybridWorker.reward_scores``: each DP rank
        of its engine scores its share), combined with the rule's: ``rule_weight·rule +
        model_weight·model`` (docs/reward-models.md). Both parts are kept for the record."""
        r = self.cfg.reward
        roll.rule_scores, roll.model_scores = list(rule), self.model_scores(roll.prompts, roll.responses)
        return [r.rule_weight * a + r.model_weight * m for a, m in zip(rule, roll.model_scores)]

    def model_scores(self, prompts: list, responses: list) -> list[float]:
        """The reward model's score of each ``prompts[i] + responses[i]``, in order."""
        shares = {}
        for out in self.cluster.all("reward_scores", {"prompts": prompts, "responses": responses}, desc="reward model"):
            shares.setdefault(out["dp_rank"], out["scores"])
        return [x for k in sorted(shares) for x in shares[k]]

    def advantages(self, it: int, roll: Rollout) -> dict:
        """The batch every trainer rank gets: the sequences, the rollout engine's log-probs and
        what the algorithm makes of the scores (``Algorithm.batch_fields``)."""
        return {"prompts": roll.prompts, "responses": roll.responses, "rollout_logprobs": roll.logprobs,
                # the samples the stale-weights check compares: those generated with the trainer's
                # weights; in the synchronous loop every one (a replica that missed a sync reports
                # its old version, and the check must then catch its log-probs, not skip them)
                "fresh": ([[v == it for v in tv] for tv in roll.token_versions] if roll.token_versions else
                          [v == it or not self.max_staleness for v in roll.versions]),
                **self.algorithm.batch_fields(roll.scores, roll.truncated)}

    def lend(self, it: int) -> None:
        """``elastic.lend``: whether this rollout takes the trainer's devices too — every iteration
        (``rollout``) or where it last paid (``auto``); ``rollout_done`` gives them back."""
        if self.lending is not None:
            self.lend_record = self.lending.lend(it)

    def grow(self, it: int) -> None:
        """``elastic.rebalance``: the training state into the grown world (the trainer's devices
        and the replicas'), where the log-probs and the update run — every iteration (``update``),
        or where it last paid (``auto``: ``rebalance.choose``)."""
        reb = self.rebalance
        if reb is None:
            return
        self._train_t0 = time.perf_counter()
        if self.cfg.elastic.rebalance == "auto":
            grow, why = reb.auto.choose(it, reb.built())
            self.rebalanced = {"world": reb.world if grow else self.cluster.world, "grown": grow, "why": why}
            if not grow:
                return
        with self.timed("grow"):
            self.rebalanced = {**(self.rebalanced or {}), "world": reb.world, "grown": True, "grow": reb.grow()}
        self.faults.hook(it, "after_grow", self.cluster)

    def shrink(self, it: int) -> None:
        """The state back into the trainer's own world, before the record and the next sync."""
        reb = self.rebalance
        if reb is None:
            return
        if reb.grown:
            self.faults.hook(it, "before_shrink", self.cluster)
            with self.timed("shrink"):
                self.rebalanced["shrink"] = reb.shrink()
            self.faults.hook(it, "after_shrink", self.cluster)
        # the train phase, the way it went (with the moves when grown): auto's next choice
        reb.auto.measured(it, time.perf_counter() - self._train_t0, first="shrink" in self.rebalanced)
        self.rebalanced["built_s"] = reb.built_s

    def logprobs(self, batch: dict) -> list[dict]:
        """Every trainer rank's old/reference log-probs (PPO: values) of its share, and its part
        of the stale-weights check."""
        return self.cluster.collect(self.cluster.submit("logprobs", batch), "log-probs")

    def update(self, peak: dict) -> list[dict]:
        calls = self.cluster.submit("update")
        # the train phase's mark, queued behind the update: it is there when the update returns
        peak["train"] = self.cluster.memory_mark(wait=False)
        if self.ahead is not None and self.ahead[1].segments is not None:
            # partial rollout: segments handed out until the update is done
            nxt, hook = self.ahead[0], self.faults.generate_hook
            self.ahead[1].segments.pump(calls, None if hook is None else lambda: hook(nxt, self.cluster))
        return self.cluster.collect(calls, "train")

    def record(self, it, roll, sync, copied, off, back, checked, stats, peak, t_it) -> dict:
        """The iteration's record (``metrics.jsonl``; ``run_metrics``), its rollouts and one line."""
        peak = {p: read() for p, read in peak.items()}
        rec = run_metrics(it, roll, sync, copied, off, back, checked, stats, peak, self.timings,
                          self.stale_tol, time.perf_counter() - t_it)
        rec["stale_tol_source"] = self.stale.source
        if self.rebalanced is not None:  # elastic.rebalance: the grown world's size, the moves there and back
            rec["rebalance"], self.rebalanced = self.rebalanced, None
        if self.lend_record is not None:  # elastic.lend: whether the rollout took the trainer's devices, how long
            rec["lend"], self.lend_record = self.lend_record, None
        lost, self.cluster.replica_events = self.cluster.replica_events, []
        if lost:  # rollout replicas that died mid-generation: their prompts generated again by the others
            rec["rollout_replicas_lost"] = lost
            for ev in lost:
                where, again = (("during a sync", "the sync run again over") if "during" in ev else
                                ("mid-generation", f"its {ev['requeued_prompts']} prompts generated again by"))
                self.say(f"it {it}: lost {', '.join(ev['lost'])} {where}; {again} the {ev['replicas_left']} "
                         f"replica(s) left ({ev['seconds']:.1f} s)")
        self.emit(rec, it)
        self.log.write_rollouts(it, roll.prompts, roll.responses, roll.logprobs, roll.scores,
                                texts={"prompt_texts": [s.prompt for s in roll.samples], "response_texts": roll.texts,
                                       "weight_versions": roll.versions,
                                       **({"token_versions": roll.token_versions} if roll.token_versions else {})})
        loss = f"kl {rec['kl']:.2e}  loss {rec['policy_loss']:+.4f}  " if stats is not None else "no update  "
        self.say(f"it {it}: reward {rec['reward_mean']:.3f}  {loss}gen {rec['gen_tokens_per_s']:.0f} tok/s  "
                 f"switch {sync['seconds'] * 1e3:.0f} ms ({sync['bytes_moved'] / 1024:.0f} KiB) / back "
                 f"{back['seconds'] * 1e3:.0f} ms  {stale_check_said(rec, self.stale_tol)}  "
                 f"[{rec['iteration_seconds']:.1f} s]")
        return rec

    def checkpoint(self, it: int) -> None:
        every, root = self.cfg.checkpoint.save_every, self.out_dir / "checkpoints"
        if every and (it + 1) % every == 0 and it != self.last:
            s = self.cluster.save(root / f"step_{it + 1}", {"iteration": it})
            prune_checkpoints(root, self.cfg.checkpoint.keep)
            self.say(f"checkpoint {root / f'step_{it + 1}'} ({s:.1f} s)")

    def evaluate(self, it: int, when: str) -> None:
        """Held-out greedy reward with the rollout engine's current weights (and the reward
        model's score of the same responses, where the run has one)."""
        t0 = time.perf_counter()
        r = self.evaluator(self.cluster)
        rec = {"iteration": it, "heldout_reward": r, "eval": when}
        if self.cfg.reward is not None:  # the reward model's mean score of the same greedy responses
            scores = self.model_scores(self.evaluator.prompts, self.evaluator.responses)
            rec["heldout_model_reward"] = sum(scores) / len(scores)
        self.emit({**rec, "eval_seconds": time.perf_counter() - t0}, it)
        model = f", reward model {rec['heldout_model_reward']:.3f}" if "heldout_model_reward" in rec else ""
        self.say(f"held-out greedy reward {when} iteration {it}: {r:.3f}{model} ({len(self.evaluator.prompts)} prompts)")

    # --- after the last iteration ----------------------------------------------------------------
    def finish(self) -> None:
        """The final policy synced, evaluated and saved; how the weight channel was used."""
        self.cluster.sync(version=self.last + 1)
        self.evaluate(self.last + 1, "after")
        s = self.cluster.save(self.out_dir / "final", {"iteration": self.last})
        self.say(f"final actor: {self.out_dir / 'final'} (HF safetensors + optimizer state, {s:.1f} s)")
        channel = channel_summary(self.cluster)
        self.log.write({"iteration": self.last + 1, "channel": channel}, self.last + 1)
        self.say(f"weight channel: opened {channel['opened']}x, {channel['moves']} syncs, process groups made "
                 f"per member process: {channel['groups_per_member']}")


def stand_by_version(it: int, skip_sync_at, segmented: bool) -> int | None:
    """The weights' version the rollout replicas record with the receive they post when iteration
    ``it``'s rollout is done (``Cluster.stand_by``): that of the next sync, ``it + 1`` — the weights
    this iteration's update makes, which iteration ``it + 1`` generates with (its sync is
    ``sync(version=it + 1)``). None: no receive posted now — no sync at ``it + 1``
    (``skip_sync_at``), or partial rollout's segments still in flight (a receive would hold them up)."""
    if it + 1 in skip_sync_at or segmented:
        return None
    return it + 1


def stale_check_said(rec: dict, tol: float) -> str:
    """The iteration line's part on the stale-weights check and the train–inference mismatch:
    whether the check passed and over how many tokens, or that it compared none (every sample
    of the batch was generated with older weights)."""
    n = rec.get("stale_check_tokens", 0)
    if not n:
        return "stale check: no token compared (every sample older than the trainer's weights)"
    verdict = "passed" if rec["stale_check_passed"] else f"FAILED (> {tol:g})"
    return (f"stale check {verdict} ({n} tokens, Δlogp max {rec['stale_logprob_diff']:.1e}, "
            f"p99 {rec['mismatch_logprob_diff_p99']:.1e}, mismatch KL {rec['mismatch_kl']:.1e})")


def run_metrics(it, roll, sync, copied, off, back, checked, stats, peak, timings, stale_tol, seconds) -> dict:
    """One iteration's record: rewards, losses, timings, bytes and memory per phase. ``stats``:
    the update's per-rank reports (None when the stale-weights check stopped it)."""
    from rlhf_switch.rl.algorithms import mismatch_over_ranks

    stale = max(s["stale_logprob_diff"] for s in checked)
    n_tokens, gen_s = sum(len(r) for r in roll.responses), roll.gen_seconds
    first = stats[0] if stats else {}
    rec = {"iteration": it, "reward_mean": sum(roll.scores) / len(roll.scores)}
    if roll.model_scores:  # a reward model: both parts of the reward
        rec.update(rule_reward_mean=sum(roll.rule_scores) / len(roll.rule_scores),
                   model_reward_mean=sum(roll.model_scores) / len(roll.model_scores))
    if stats:
        rec.update({k: sum(s[k] for s in stats) / len(stats) for k in ("policy_loss", "kl", "clipfrac")},
                   grad_norm=first["grad_norm"])
    # the train–inference mismatch over the tokens generated with the trainer's weights (the ones
    # the stale check compares): |Δlogp| max / mean / p99, the k3 KL, the sequences' IS ratios
    rec.update(mismatch_over_ranks([s["mismatch"] for s in checked if "mismatch" in s]))
    rec.update({
        "stale_logprob_diff": stale, "stale_check_passed": stale <= stale_tol, "stale_tol": stale_tol,
        "stale_check_tokens": rec.get("mismatch_tokens", 0),
        "gen_tokens": n_tokens, "gen_seconds": gen_s, "gen_tokens_per_s": n_tokens / gen_s if gen_s > 0 else float("nan"),
        "switch_train_to_rollout_s": sync["seconds"],
        # the weights stay where they are in the trainer; the parked state (train.offload) comes back
        "switch_rollout_to_train_s": back["seconds"],
        # train.offload: bytes and seconds of each move (per rank: the rank's own state)
        "offload_bytes": off["bytes"], "offload_bytes_per_rank": off["bytes_per_rank"],
        "offload_released_bytes": off["released_bytes"], "offload_seconds": off["seconds"],
        "reload_bytes": back["bytes"], "reload_bytes_per_rank": back["bytes_per_rank"], "reload_seconds": back["seconds"],
        # elastic.redundancy: host — the refresh of the buddies' host copies
        "redundancy_bytes": copied["bytes"], "redundancy_seconds": copied["seconds"],
        # per phase, the largest over the trainer ranks (peak_device_measure says of what)
        **{f"peak_device_bytes_{p}": m["bytes"] for p, m in peak.items()},
        "peak_device_measure": peak["sync"]["measure"],
        "bytes_moved": sync["bytes_moved"], "bytes_sent": sync["bytes_sent"],
        "weights_synced": sync.get("weights", "full"),  # full, or a LoRA run's adapters / merged weights
        # rollout.handoff ipc: bucket handles handed to the workers (one per bucket)
        "handoff": sync.get("handoff", "p2p"), "handles": sync.get("handles", 0),
        "switch_breakdown": sync.get("breakdown", {}),
        "train_seconds": timings.get("logprobs", 0.0) + timings.get("update", 0.0),
        # inside train: old/reference log-probs (and PPO values) vs the update, slowest worker
        "logprob_seconds": max(s["logprob_seconds"] for s in checked),
    })
    if stats:
        rec.update(update_seconds=max(s["update_seconds"] for s in stats), optimizer_steps=first["steps"],
                   **{k: first[k] for k in ("vf_loss", "vf_clipfrac", "value_mean", "return_mean") if k in first})
    if roll.dynamic_sampling is not None:
        rec["dynamic_sampling"] = roll.dynamic_sampling
    # the weights' versions the batch was generated with (the trainer's is ``it``), and the rate
    if roll.token_versions:  # partial rollout: the samples whose generation a weight update interrupted
        rec["samples_interrupted"] = sum(len(set(v)) > 1 for v in roll.token_versions)
    rec.update(weight_version_min=min(roll.versions), staleness_max=it - min(roll.versions),
               samples_per_s=len(roll.samples) / seconds if seconds > 0 else float("nan"))
    if stats and "is_weight_sum" in first:  # off_policy.correction: over the whole batch (each DP rank once)
        shares = list({s.get("dp_rank", i): s for i, s in enumerate(stats)}.values())
        tokens = sum(s["tokens"] for s in shares)
        rec.update(is_weight_mean=sum(s["is_weight_sum"] for s in shares) / tokens if tokens else float("nan"),
                   is_masked_tokens=sum(s["is_masked_tokens"] for s in shares))
    rec.update(truncated=sum(roll.truncated), phase_seconds=dict(timings), iteration_seconds=seconds,
               example={"prompt": roll.samples[0].prompt, "response": roll.texts[0], "answer": roll.samples[0].answer})
    return rec


def run(config_source, iterations: int | None = None, output_dir: str | None = None,
        stale_tol: float | None = None, quiet: bool = False, resume: str | bool | None = None,
        skip_sync_at: tuple[int, ...] = (), crash_at: tuple[int, ...] = (), algorithm: str | None = None,
        verbose: bool = False, phase_hook=None, generate_hook=None) -> list[dict]:
    """Run the loop; returns this call's per-iteration records (also in
    ``<output_dir>/metrics.jsonl``). ``iterations`` is the run's total (default: the config's),
    also when resuming: ``resume`` (True: the newest checkpoint of this run, or a directory)
    continues after the checkpoint's iteration up to ``iterations - 1``; a finished run returns
    ``[]`` at once (module docstring). ``verbose``: vLLM's INFO logs too. ``skip_sync_at``,
    ``crash_at``, ``phase_hook``, ``generate_hook``: fault injection for tests (``Faults``)."""
    from recipes.elastic_control import ElasticControl

    cfg, iterations = prepare(config_source, iterations, output_dir)
    name = cfg.algorithm.name
    if algorithm is not None and name != algorithm:
        from rlhf_switch.rl.config import ConfigError

        raise ConfigError(f"recipes.{algorithm}", [f"algorithm.name: this recipe runs {algorithm}, the config "
                                                   f"names {name!r} (use recipes.{name} or rlhf-switch train)"])
    # where a resumed run continues (a PPO checkpoint must hold the critic's state too)
    try:
        point = resolve_resume(resume, Path(cfg.output_dir), iterations,
                               parts=("critic",) if cfg.critic is not None else ())
    except RunFinished as e:
        if not quiet:
            print(f"[{name}] {e}")
        return []
    resume_dir, first = (point[0], point[1] + 1) if point else (None, 0)
    loop = Loop(cfg, iterations, first, resume_dir, stale_tol, quiet, Faults(skip_sync_at, crash_at, phase_hook, generate_hook))
    t_start = time.perf_counter()
    try:
        loop.start(t_start)
        elastic = ElasticControl(loop)
        ray, owns_ray = start_ray(cfg, elastic.most_devices(), verbose=verbose)
    except BaseException:
        if loop.log is not None:
            loop.log.close(ok=False)
        if loop.reward_runner is not None:  # its workers started first
            loop.reward_runner.close()
        raise
    ok = False
    try:
        loop.build(cfg.at_iteration(first), ray, elastic.acquire(ray), t_start)
        elastic.started()
        it = first
        while it <= loop.last:
            try:
                elastic.between_iterations(it)
                loop.iteration(it, elastic)
            except Exception as e:  # noqa: BLE001 - a lost trainer is recovered; anything else is raised
                it = elastic.recover(e, it)
                continue
            it += 1
        loop.finish()
        ok = True
    finally:
        if loop.rebalance is not None:  # before the cluster: the trainer's own world gets its actors back
            loop.rebalance.close()
        loop.log.close(ok)
        loop.reward_runner.close()
        elastic.close(graceful=ok)
        if owns_ray:
            ray.shutdown()
    png = plot_run(loop.log.records(), loop.out_dir / f"{name}.png",
                   f"{name.upper()} {cfg.task.name if cfg.task else 'data'}: {cfg.train.engine} → {cfg.rollout.engine}")
    loop.say(f"{len([r for r in loop.records if 'reward_mean' in r])} iterations in "
             f"{time.perf_counter() - t_start:.1f} s; metrics: {loop.log.path}" + (f"; plot: {png}" if png else ""))
    return loop.records


def channel_summary(cluster) -> dict:
    """How the run's weight channel was used: how often it was opened (once, unless a layout
    changed), the syncs through it, the process groups each member process made for it, and the
    Ray nodes its members ran on (``Cluster.nodes``)."""
    stats = cluster.channel_stats()
    members = stats["trainers"] + [w for r in stats["replicas"] for w in r["workers"]]
    return {"opened": cluster.channel_opened, "moves": max(m.get("moves", 0) for m in members),
            "groups_per_member": sorted({m.get("groups_created", 0) for m in members}),
            "members": len(members), "pieces_verified": sum(m.get("pieces_verified", 0) for m in members),
            "nodes": cluster.nodes()}


def add_arguments(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The loop's options (``rlhf-switch train`` and ``python -m recipes.grpo|ppo``)."""
    ap.add_argument("config", metavar="CONFIG",
                    help="the run's YAML (docs/configuration.md); its algorithm.name picks GRPO or PPO")
    ap.add_argument("--iterations", type=int, metavar="N",
                    help="the run's TOTAL number of iterations (0 .. N-1), also with --resume: a resumed run "
                         "stops where the uninterrupted one stops (default: the config's algorithm.iterations)")
    ap.add_argument("--output-dir", metavar="DIR",
                    help="where checkpoints/, final/, metrics.jsonl, rollouts.jsonl, tensorboard/ (and wandb/, mlflow.db) "
                         "and the plot go "
                         "(default: the config's output_dir)")
    ap.add_argument("--resume", nargs="?", const=True, default=None, metavar="DIR",
                    help="finish an interrupted run: continue from the newest complete checkpoint of this run "
                         "(checkpoints/step_K or final/), or from DIR, up to the total; the records written after "
                         "that checkpoint are dropped from metrics.jsonl and rollouts.jsonl. A finished run (final/ "
                         "holds iteration N-1) is reported as finished, exit 0; a larger N continues it")
    ap.add_argument("--stale-tol", type=float, default=None, metavar="T",
                    help="the stale-weights check: the largest difference between the trainer's and the rollout "
                         "engine's log-probs of the generated tokens that passes (default: 1e-4 in float32; in "
                         "bfloat16/float16, 4x the first iteration's gap, where both hold the same weights)")
    ap.add_argument("--quiet", action="store_true", help="no progress bars and no per-iteration lines")
    ap.add_argument("--verbose", action="store_true",
                    help="vLLM's INFO logs too (default: its warnings and errors only, so they do not interleave "
                         "with the progress bars; sets VLLM_LOGGING_LEVEL=INFO for the run's vLLM processes)")
    return ap


def run_args(a: argparse.Namespace, algorithm: str | None = None) -> int:
    """Run the loop with parsed options; the exit code (2: bad input, 3: stale weights)."""
    from rlhf_switch.rl.config import ConfigError
    from rlhf_switch.rl.rewards import RewardError

    try:
        run(a.config, a.iterations, a.output_dir, a.stale_tol, a.quiet, a.resume, algorithm=algorithm,
            verbose=a.verbose)
    except (ConfigError, FileNotFoundError, RewardError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except StaleWeightsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    return 0


def main(argv=None, algorithm: str | None = None) -> int:
    ap = argparse.ArgumentParser(prog=f"python -m recipes.{algorithm or 'loop'}", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    return run_args(add_arguments(ap).parse_args(argv), algorithm)


if __name__ == "__main__":
    sys.exit(main())
