"""What one iteration reports: ``IterationRecord``, which the loop's phases fill in as they run, and
the record of ``metrics.jsonl`` and the iteration's line made of it. The record's keys are the
same whatever run mode filled it (docs/loop.md lists them): dashboards read them by name."""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

@dataclass
class IterationRecord:
    """One iteration's reports, by the phase that made each."""

    iteration: int
    started: float = field(default_factory=time.perf_counter)
    timings: dict[str, float] = field(default_factory=dict)   # seconds per named phase
    sync: dict | None = None             # the weight sync train -> rollout (Cluster.sync)
    copied: dict | None = None           # elastic.redundancy: host's refresh of the host copies
    offloaded: dict | None = None        # train.offload: the state parked during the rollout
    reloaded: dict | None = None         # ... and brought back after it
    peak: dict = field(default_factory=dict)   # per phase: a reader of the trainer ranks' memory mark
    checked: list[dict] = field(default_factory=list)  # every trainer rank's log-probs phase
    stats: list[dict] | None = None      # every trainer rank's update (None: nothing was updated)
    stale_tol: float | None = None       # the stale-weights check's bound this iteration
    stale_tol_source: str = ""
    rebalance: dict | None = None        # elastic.rebalance: the grown world and the moves
    lend: dict | None = None             # elastic.lend: whether the rollout took the trainer's devices
    replicas_lost: list[dict] = field(default_factory=list)  # rollout replicas lost, their work re-run
    rollout_time: dict | None = None     # the replicas' generating seconds vs the generations' wall time

    @contextmanager
    def timed(self, phase: str):
        """The wall time of one named phase (``phase_seconds``)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.timings[phase] = time.perf_counter() - t0

    @property
    def stale_gap(self) -> float:
        """The stale-weights check's number: the largest gap over every rank's compared tokens."""
        return max(s["stale_logprob_diff"] for s in self.checked)

    @property
    def stale_check_passed(self) -> bool:
        return self.stale_gap <= self.stale_tol

    def metrics(self, exp) -> dict:
        """The iteration's record for ``metrics.jsonl`` and the logging backends; ``exp``: the
        batch it trained on (``rl.experience.Experience``)."""
        peak = {p: read() for p, read in self.peak.items()}
        rec = {"iteration": self.iteration, **_rewards(exp), **_losses(self.stats)}
        rec.update(self._checks())
        rec.update(_generation(exp), **_switch(self.sync, self.reloaded, self.offloaded, self.copied),
                   **{f"peak_device_bytes_{p}": m["bytes"] for p, m in peak.items()},
                   peak_device_measure=peak["sync"]["measure"],
                   train_seconds=self.timings.get("logprobs", 0.0) + self.timings.get("update", 0.0),
                   # inside train: old/reference log-probs (and PPO values) vs the update, slowest worker
                   logprob_seconds=max(s["logprob_seconds"] for s in self.checked))
        rec.update(_update(self.stats))
        if exp.dynamic_sampling is not None:
            rec["dynamic_sampling"] = exp.dynamic_sampling
        episodes = [s.episode for s in exp.samples if s.episode is not None]
        if episodes:  # multi-turn: turns, tool calls and their success, finish reasons, environment seconds
            from rlhf_switch.agent.episode import episode_metrics

            rec["agent"] = {**episode_metrics(episodes), "turn_batches": exp.turn_batches,
                            # tokens the engines generated past a turn's stop id, cut: 0 when they stop there
                            "tokens_past_stop": exp.tokens_past_stop,
                            "model_tokens": sum(sum(s.loss_mask) for s in exp.samples),
                            # agent.failed_samples: exclude — samples the environment failed, no token trained
                            "excluded": sum(1 for s in exp.samples if s.episode is not None and s.episode.failed
                                            and not any(s.loss_mask))}
        seconds = time.perf_counter() - self.started
        rec.update(_versions(exp, self.iteration), samples_per_s=len(exp) / seconds if seconds > 0 else float("nan"))
        rec.update(_correction(self.stats))
        first = exp.samples[0]
        rec.update(truncated=sum(exp.column("truncated")), phase_seconds=dict(self.timings), iteration_seconds=seconds,
                   example={"prompt": first.source.prompt, "response": first.text, "answer": first.source.answer},
                   stale_tol_source=self.stale_tol_source)
        if self.rollout_time and self.rollout_time["busy_s"]:
            # rollout replicas: how much of the generations' wall time each one spent not generating
            # (rollout.pull_prompts: work stealing keeps it low when responses differ in length)
            idle = self.rollout_time["idle_share"]
            rec.update(replica_idle_share={str(r): v for r, v in sorted(idle.items())},
                       replica_idle_share_max=max(idle.values()))
        for key, value in (("rebalance", self.rebalance), ("lend", self.lend),
                           ("rollout_replicas_lost", self.replicas_lost)):
            if value:
                rec[key] = value
        return rec

    def _checks(self) -> dict:
        """The stale-weights check and the train–inference mismatch over the tokens generated with
        the trainer's weights (the ones the check compares): |Δlogp| max / mean / p99, the k3 KL,
        the sequences' IS ratios."""
        from rlhf_switch.rl.algorithms import mismatch_over_ranks

        out = mismatch_over_ranks([s["mismatch"] for s in self.checked if "mismatch" in s])
        return {**out, "stale_logprob_diff": self.stale_gap, "stale_check_passed": self.stale_check_passed,
                "stale_tol": self.stale_tol, "stale_check_tokens": out.get("mismatch_tokens", 0)}

    def line(self, rec: dict) -> str:
        """The iteration's line: reward, loss, generation, the switch, the checks, what the auto
        modes chose, the seconds."""
        loss = f"kl {rec['kl']:.2e}  loss {rec['policy_loss']:+.4f}  " if self.stats is not None else "no update  "
        return (f"it {self.iteration}: reward {rec['reward_mean']:.3f}  {loss}gen {rec['gen_tokens_per_s']:.0f} tok/s  "
                f"switch {self.sync['seconds'] * 1e3:.0f} ms ({self.sync['bytes_moved'] / 1024:.0f} KiB) / back "
                f"{self.reloaded['seconds'] * 1e3:.0f} ms  {stale_check_said(rec, self.stale_tol)}{self._chosen()}  "
                f"[{rec['iteration_seconds']:.1f} s]")

    def _chosen(self) -> str:
        """What ``elastic.lend`` and ``elastic.rebalance`` did this iteration, and why."""
        said = ""
        if self.lend is not None:
            said += f"  lend: {'lent' if self.lend['lent'] else 'own'} ({self.lend['why']})"
        if self.rebalance is not None:
            said += f"  rebalance: {'grown' if self.rebalance.get('grown') else 'static'}"
            if self.rebalance.get("why"):
                said += f" ({self.rebalance['why']})"
        return said


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


def _rewards(exp) -> dict:
    rewards = exp.column("reward")
    out = {"reward_mean": sum(rewards) / len(rewards)}
    model = [r for r in exp.column("model_reward") if r is not None]
    if model:  # a reward model: both parts of the reward
        rule = exp.column("rule_reward")
        out.update(rule_reward_mean=sum(rule) / len(rule), model_reward_mean=sum(model) / len(model))
    return out


def _losses(stats: list[dict] | None) -> dict:
    if not stats:
        return {}
    return {**{k: sum(s[k] for s in stats) / len(stats) for k in ("policy_loss", "kl", "clipfrac")},
            "grad_norm": stats[0]["grad_norm"]}


def _generation(exp) -> dict:
    n_tokens, gen_s = sum(len(r) for r in exp.column("response")), exp.gen_seconds
    return {"gen_tokens": n_tokens, "gen_seconds": gen_s,
            "gen_tokens_per_s": n_tokens / gen_s if gen_s > 0 else float("nan")}


def _switch(sync: dict, back: dict, off: dict, copied: dict) -> dict:
    """The phase boundary's moves: the sync, the state parked and brought back, the host copies."""
    return {
        "switch_train_to_rollout_s": sync["seconds"],
        # the weights stay where they are in the trainer; the parked state (train.offload) comes back
        "switch_rollout_to_train_s": back["seconds"],
        # train.offload: bytes and seconds of each move (per rank: the rank's own state)
        "offload_bytes": off["bytes"], "offload_bytes_per_rank": off["bytes_per_rank"],
        "offload_released_bytes": off["released_bytes"], "offload_seconds": off["seconds"],
        "reload_bytes": back["bytes"], "reload_bytes_per_rank": back["bytes_per_rank"], "reload_seconds": back["seconds"],
        # elastic.redundancy: host — the refresh of the buddies' host copies
        "redundancy_bytes": copied["bytes"], "redundancy_seconds": copied["seconds"],
        "bytes_moved": sync["bytes_moved"], "bytes_sent": sync["bytes_sent"],
        "weights_synced": sync.get("weights", "full"),  # full, or a LoRA run's adapters / merged weights
        # rollout.handoff ipc: bucket handles handed to the workers (one per bucket)
        "handoff": sync.get("handoff", "p2p"), "handles": sync.get("handles", 0),
        "switch_breakdown": sync.get("breakdown", {}),
    }


def _update(stats: list[dict] | None) -> dict:
    if not stats:
        return {}
    first = stats[0]
    return {"update_seconds": max(s["update_seconds"] for s in stats), "optimizer_steps": first["steps"],
            **{k: first[k] for k in ("vf_loss", "vf_clipfrac", "value_mean", "return_mean") if k in first}}


def _versions(exp, it: int) -> dict:
    """The weights' versions the batch was generated with (the trainer's is ``it``): its model
    tokens'. An environment's tokens (version -1) have none, so an observation between two turns
    does not interrupt a sample, and a sample its environment failed before the model's first
    turn does not make the batch look ``it + 1`` versions old; ``None`` when no sample has a
    model token."""
    out = {}
    if exp.segmented:  # partial rollout: the samples whose generation a weight update interrupted
        out["samples_interrupted"] = sum(len(set(s.model_versions)) > 1 for s in exp.samples)
    oldest = min((s.version for s in exp.samples if s.version >= 0), default=None)
    out.update(weight_version_min=oldest, staleness_max=None if oldest is None else it - oldest)
    return out


def _correction(stats: list[dict] | None) -> dict:
    """off_policy.correction: the mean weight over the whole batch (each DP rank once) and the
    tokens a mask took out."""
    if not stats or "is_weight_sum" not in stats[0]:
        return {}
    shares = list({s.get("dp_rank", i): s for i, s in enumerate(stats)}.values())
    tokens = sum(s["tokens"] for s in shares)
    return {"is_weight_mean": sum(s["is_weight_sum"] for s in shares) / tokens if tokens else float("nan"),
            "is_masked_tokens": sum(s["is_masked_tokens"] for s in shares)}
