"""The RLHF loop: one iteration as named phases over the run's cluster, composed with the run's
rollout source (``recipes.loop.sources``) and train world (``recipes.loop.world``).

The phases of one iteration, in order (``PHASES``; docs/loop.md lists the same, a test checks it):

    rollout_wait  the batch a source generated ahead for this iteration, collected (one-step off-policy)
    sync          trainer -> rollout engines through the weight channel (a VPS move of the weights);
                  elastic.redundancy: host — the buddies' host copies refreshed; train.offload — the
                  trainer's optimizer state parked in host memory while the rollout runs
    rollout       group_size samples per prompt, from the source (elastic.lend: on the trainer's
                  devices too); partial rollout: the unfinished samples finished with the new weights
    reward        the run's reward function on every sample (in the driver or its reward workers, each
                  call within reward_timeout_s) — a multi-turn sample's environment's reward instead;
                  a reward model's score too; shaped by the algorithm
    dynamic_sampling  DAPO's: groups without signal dropped, more prompts drawn
    advantages    the algorithm's per-sequence advantages (the driver's estimators), the batch the
                  trainer ranks take their shares of
    grow          elastic.rebalance: the training state into the grown world
    logprobs      old / reference log-probs, PPO's values, and the stale-weights check: the trainer's
                  log-probs of the generated tokens must equal the rollout engine's within the bound
                  (recipes.common.StaleTolerance), else StaleWeightsError before any update
    update        epochs passes of optimizer steps (Algorithm.update); partial rollout: the batch in
                  flight handed out a segment at a time meanwhile
    shrink        elastic.rebalance: the state back into the trainer's own world
    record        one line, one record in metrics.jsonl and the logging backends, the rollouts
    checkpoint    every checkpoint.save_every iterations
    eval          held-out greedy reward every eval.every iterations

Between iterations elastic control (``recipes.elastic.control``) changes the run's world through the
``RunState`` the loop shares with it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from recipes.common import (Evaluator, StaleTolerance, StaleWeightsError, draw_extra_prompts, draw_prompts, fault,
                            prune_checkpoints)
from recipes.loop.record import IterationRecord
from recipes.run_log import is_iteration_record
from rlhf_switch.rl.experience import Experience

PHASES = ("rollout_wait", "sync", "rollout", "reward", "dynamic_sampling", "advantages", "grow", "logprobs",
          "update", "shrink", "record", "checkpoint", "eval")


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

    def generate_hook_for(self, it: int, cluster) -> None:
        if self.generate_hook is not None:
            self.generate_hook(it, cluster)


@dataclass
class RunState:
    """What the loop and elastic control share: the config in force and the cluster (a resize or a
    recovery replaces them between iterations), where the run writes, its iterations, and the calls
    by which elastic control reports (``emit``, ``say``), reaches a test's hooks (``hook``) and drops
    the records of iterations a recovery runs again (``drop_rerun``)."""

    cfg: object
    out_dir: Path
    first: int
    last: int
    iterations: int
    quiet: bool
    faults: Faults
    cluster: object = None
    init_dir: Path | None = None
    records: list[dict] = field(default_factory=list)
    log: object = None

    def say(self, msg: str) -> None:
        if not self.quiet:
            from tqdm import tqdm

            tqdm.write(f"[{self.cfg.algorithm.name}] {msg}")

    def emit(self, rec: dict, step: int | None = None) -> None:
        """A record for the run log (``metrics.jsonl`` and the logging backends) and the caller of ``run``."""
        self.records.append(rec)
        self.log.write(rec, rec.get("iteration", 0) if step is None else step)

    def hook(self, it: int, phase: str) -> None:
        self.faults.hook(it, phase, self.cluster)

    def drop_rerun(self, it: int) -> None:
        """A recovery runs ``it`` and the iterations after it again: their records go."""
        self.records[:] = [r for r in self.records if r.get("iteration", -1) < it or not is_iteration_record(r)]
        self.log.drop_rerun(it)


class Loop:
    """One run of the loop: the iteration as named phases (``iteration``) and what comes after the
    last (``finish``), over the run's state (``RunState``), rollout source and train world."""

    def __init__(self, state: RunState, stale_tol: float | None):
        from rlhf_switch.device import cuda_available, resolve_device
        from rlhf_switch.rl.algorithm import Algorithm

        self.state = state
        cfg = state.cfg
        # the stale-weights check's bound: given, or by the compute dtype (calibrated in bf16/fp16)
        self.stale = StaleTolerance(stale_tol, resolve_device(cfg.device, cuda_available(), cfg.model.dtype).compute_dtype)
        self.algorithm = Algorithm.build(cfg.algorithm)
        self.source = self.world = self.evaluator = self.reward_runner = None

    # the run's state, as the phases read it
    cfg = property(lambda self: self.state.cfg)
    cluster = property(lambda self: self.state.cluster)
    faults = property(lambda self: self.state.faults)
    last = property(lambda self: self.state.last)
    init_dir = property(lambda self: self.state.init_dir)
    quiet = property(lambda self: self.state.quiet)

    def say(self, msg: str) -> None:
        self.state.say(msg)

    def ready(self, splits, tok, reward_runner, max_ctx: int, eos_id: int | None) -> None:
        """The run's prompts, tokenizer and reward function; the source, the world and the evaluator
        over the cluster just built."""
        from recipes.loop.sources import rollout_source
        from recipes.loop.world import TrainWorld

        self.splits, self.tok, self.reward_runner, self.max_ctx, self.eos_id = splits, tok, reward_runner, max_ctx, eos_id
        self.source = rollout_source(self)
        # a multi-turn source evaluates episodes; every other run greedy single-turn responses
        self.evaluator = getattr(self.source, "evaluator", None) or Evaluator(self.cfg, splits, tok, reward_runner,
                                                                              max_ctx)
        self.world = TrainWorld.of(self)

    # --- one iteration, phase by phase -----------------------------------------------------------
    def iteration(self, it: int, elastic) -> dict:
        """Iteration ``it``'s phases (``PHASES``)."""
        rec = IterationRecord(it)
        with rec.timed("rollout_wait"):
            ahead = self.source.take(it)
        with rec.timed("sync"):
            self.sync(it, elastic, rec)
        if it == self.state.first and (it == 0 or (self.cfg.eval.every and it % self.cfg.eval.every == 0)):
            self.evaluate(it, "before")  # where the uninterrupted run evaluated before this iteration
        exp = self.rollout(it, ahead, rec)
        self.source.ahead(it)
        self.rollout_done(it, rec)
        with rec.timed("advantages"):
            batch = self.advantages(it, exp)
        self.train(it, batch, rec)
        out = self.record(exp, rec)
        if rec.stats is None:
            raise StaleWeightsError(
                f"iteration {it}: the trainer's log-probs of the generated tokens differ from the rollout "
                f"engine's by {rec.stale_gap:.3g} > {rec.stale_tol:g}: the rollout engine ran on stale or wrong "
                f"weights; nothing was updated")
        self.checkpoint(it)
        if self.cfg.eval.every and (it + 1) % self.cfg.eval.every == 0 and it != self.last:
            self.cluster.sync(version=it + 1)
            self.evaluate(it + 1, "before")
        return out

    def sync(self, it: int, elastic, rec: IterationRecord) -> None:
        """train -> rollout: the weights through the channel (not at a ``skip_sync_at`` iteration),
        the host copies refreshed (``elastic.redundancy: host``: before offload parks the state),
        the optimizer state parked (``train.offload``), the phase's memory mark."""
        rec.sync = ({"seconds": 0.0, "bytes_moved": 0, "bytes_sent": 0} if it in self.faults.skip_sync_at
                    else self.cluster.sync(version=it))
        rec.copied = elastic.refresh_host_copy(it)
        rec.offloaded = self.cluster.offload()
        rec.peak["sync"] = self.cluster.memory_mark(wait=False)  # read with the record (no round trip here)

    def rollout(self, it: int, ahead: Experience | None, rec: IterationRecord) -> Experience:
        """The batch this iteration trains on: the source's (made ahead, or now), scored and shaped,
        dynamic sampling's rounds drawn."""
        with rec.timed("rollout"):
            self.world.before_rollout(it, rec)
            exp = ahead or self.source.generate(it, draw_prompts(self.cfg, self.splits, it))
            self.source.finish(exp)  # partial rollout: the unfinished samples, with the weights just synced
        with rec.timed("reward"):
            self.reward(exp)
        if getattr(self.cfg.algorithm, "dynamic_sampling", None) is not None:
            with rec.timed("dynamic_sampling"):
                exp = self.resample(it, exp)
        return exp

    def rollout_done(self, it: int, rec: IterationRecord) -> None:
        """The rollout engines are done until the next sync: they stand by for it, the phase's
        memory mark, the parked trainer state back (``train.offload``)."""
        fault(self.faults.crash_at, it, "after generation")
        self.world.after_rollout(it, rec)
        version = stand_by_version(it, self.faults.skip_sync_at, segmented=not self.source.stands_by())
        if version is not None:
            self.cluster.stand_by(version=version)
        rec.peak["generate"] = self.cluster.memory_mark(wait=False)
        rec.reloaded = self.cluster.reload()

    def reward(self, exp: Experience) -> None:
        """The decoded responses, scored by the run's reward function (``RewardRunner``: in this
        process or its workers, every call within ``reward_timeout_s``), shaped by the algorithm
        (DAPO's overlong punishment)."""
        for s in exp.samples:  # an episode's: the whole conversation, each turn and observation decoded alone
            s.text = self.tok.decode(s.response) if s.episode is None else s.episode.text(self.source.codec)
        env = exp.column("env_reward")
        if all(r is not None for r in env):  # multi-turn: the environments scored the samples
            raw = list(env)
        else:
            raw = self.reward_runner([s.source.prompt for s in exp.samples], exp.column("text"),
                                     [s.source.answer for s in exp.samples])
        if self.cfg.reward is not None:
            raw = self.model_reward(exp, raw)
        responses = exp.column("response")
        shaped = self.algorithm.shape_scores(raw, responses)
        for s, r, shaped_r, cut in zip(exp.samples, raw, shaped, self.algorithm.truncated(responses, self.eos_id)):
            s.raw_reward, s.reward = r, shaped_r
            if s.episode is None:  # an episode's finish reason is its own (max_turns, env_error, ...)
                s.finish_reason = "length" if cut else "stop"

    def resample(self, it: int, exp: Experience) -> Experience:
        """Dynamic sampling: the groups without signal (every sample the same reward) dropped and
        more prompts drawn, generated and scored until the batch is full of groups with signal or
        ``max_draws`` rounds are spent (then filled with dropped groups)."""
        alg = self.cfg.algorithm
        kept, dropped, draws, gen_s = [], [], 0, 0.0
        while True:
            gen_s += exp.gen_seconds
            for g in exp.groups(alg.group_size):
                (kept if self.algorithm.has_signal(g.column("reward"), g.column("raw_reward")) else dropped).append(g)
            if len(kept) >= alg.prompts_per_iteration or draws == alg.dynamic_sampling.max_draws:
                break
            draws += 1
            exp = self.source.generate(it, draw_extra_prompts(self.cfg, self.splits, it, draws), draw=draws)
            self.reward(exp)
        filled = max(0, alg.prompts_per_iteration - len(kept))
        out = Experience.join(kept[:alg.prompts_per_iteration] + dropped[:filled], gen_s)
        out.dynamic_sampling = {"groups_with_signal": len(kept), "draws": draws, "filled_with_dropped": filled}
        return out

    def model_reward(self, exp: Experience, rule: list[float]) -> list[float]:
        """The reward model's score of every sequence (``HybridWorker.reward_scores``: each DP rank
        of its engine scores its share), combined with the rule's: ``rule_weight·rule +
        model_weight·model`` (docs/reward-models.md). Both parts are kept for the record."""
        r = self.cfg.reward
        model = self.model_scores(exp.column("prompt"), exp.column("response"))
        for s, a, m in zip(exp.samples, rule, model):
            s.rule_reward, s.model_reward = a, m
        return [r.rule_weight * a + r.model_weight * m for a, m in zip(rule, model)]

    def model_scores(self, prompts: list, responses: list) -> list[float]:
        """The reward model's score of each ``prompts[i] + responses[i]``, in order."""
        shares = {}
        for out in self.cluster.all("reward_scores", {"prompts": prompts, "responses": responses}, desc="reward model"):
            shares.setdefault(out["dp_rank"], out["scores"])
        return [x for k in sorted(shares) for x in shares[k]]

    def advantages(self, it: int, exp: Experience) -> dict:
        """The batch every trainer rank gets (``Experience.rank_batch``): the sequences, the rollout
        engine's log-probs and what the algorithm makes of the rewards (``Algorithm.batch_fields``;
        a driver estimator's advantages are kept on the samples too)."""
        fields = self.algorithm.batch_fields(exp.column("reward"), exp.column("truncated"))
        for s, a in zip(exp.samples, fields.get("advantages", [None] * len(exp))):
            s.advantage = a
        return exp.rank_batch(it, self.source.max_staleness, fields)

    def train(self, it: int, batch: dict, rec: IterationRecord) -> None:
        """The train world's phases: grow, the log-probs and the stale-weights check, the update
        (not when the check failed), shrink."""
        self.faults.hook(it, "train", self.cluster)
        self.world.before_train(it, rec, self.cluster)
        with rec.timed("logprobs"):
            rec.checked = self.cluster.collect(self.cluster.submit("logprobs", batch), "log-probs")
        rec.stale_tol, rec.stale_tol_source = self.stale.bound(rec.stale_gap), self.stale.source
        if rec.stale_check_passed:
            with rec.timed("update"):
                calls = self.cluster.submit("update")
                # the train phase's mark, queued behind the update: it is there when the update returns
                rec.peak["train"] = self.cluster.memory_mark(wait=False)
                self.source.during_update(calls)
                rec.stats = self.cluster.collect(calls, "train")
        self.world.after_train(it, rec, self.cluster)

    def record(self, exp: Experience, rec: IterationRecord) -> dict:
        """The iteration's record (``metrics.jsonl``), its rollouts and one line."""
        it = rec.iteration
        rec.replicas_lost, self.cluster.replica_events = self.cluster.replica_events, []
        for ev in rec.replicas_lost:  # rollout replicas that died: their prompts generated again by the others
            where, again = (("during a sync", "the sync run again over") if "during" in ev else
                            ("mid-generation", f"its {ev['requeued_prompts']} prompts generated again by"))
            self.say(f"it {it}: lost {', '.join(ev['lost'])} {where}; {again} the {ev['replicas_left']} "
                     f"replica(s) left ({ev['seconds']:.1f} s)")
        rec.rollout_time = self.cluster.rollout_time.take()
        out = rec.metrics(exp)
        self.state.emit(out, it)
        versions = [s.version for s in exp.samples]
        self.state.log.write_rollouts(it, exp.column("prompt"), exp.column("response"), exp.column("logprobs"),
                                      exp.column("reward"), texts={
                                          "prompt_texts": [s.source.prompt for s in exp.samples],
                                          "response_texts": exp.column("text"), "weight_versions": versions,
                                          **({"token_versions": exp.column("versions")} if exp.segmented else {})})
        self.say(rec.line(out))
        return out

    def checkpoint(self, it: int) -> None:
        every, root = self.cfg.checkpoint.save_every, self.state.out_dir / "checkpoints"
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
        self.state.emit({**rec, "eval_seconds": time.perf_counter() - t0}, it)
        model = f", reward model {rec['heldout_model_reward']:.3f}" if "heldout_model_reward" in rec else ""
        self.say(f"held-out greedy reward {when} iteration {it}: {r:.3f}{model} ({len(self.evaluator.prompts)} prompts)")

    # --- after the last iteration ----------------------------------------------------------------
    def finish(self) -> None:
        """The final policy synced, evaluated and saved; how the weight channel was used."""
        self.cluster.sync(version=self.last + 1)
        self.evaluate(self.last + 1, "after")
        s = self.cluster.save(self.state.out_dir / "final", {"iteration": self.last})
        self.say(f"final actor: {self.state.out_dir / 'final'} (HF safetensors + optimizer state, {s:.1f} s)")
        channel = channel_summary(self.cluster)
        self.state.log.write({"iteration": self.last + 1, "channel": channel}, self.last + 1)
        self.say(f"weight channel: opened {channel['opened']}x, {channel['moves']} syncs, process groups made "
                 f"per member process: {channel['groups_per_member']}")


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


def stand_by_version(it: int, skip_sync_at, segmented: bool) -> int | None:
    """The weights' version the rollout replicas record with the receive they post when iteration
    ``it``'s rollout is done (``Cluster.stand_by``): that of the next sync, ``it + 1`` — the weights
    this iteration's update makes, which iteration ``it + 1`` generates with (its sync is
    ``sync(version=it + 1)``). None: no receive posted now — no sync at ``it + 1``
    (``skip_sync_at``), or partial rollout's segments still in flight (a receive would hold them up)."""
    if it + 1 in skip_sync_at or segmented:
        return None
    return it + 1
