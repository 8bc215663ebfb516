"""``recipes.loop.record``: the iteration's record (``metrics.jsonl``) and line, from what the loop's
phases put in an ``IterationRecord``, against hand values of what docs/loop.md ("An iteration's
record", "The train–inference mismatch", "Correcting for the rollout engine's policy") and
docs/agents.md ("The record") say each key is. Inputs are shaped as the loop fills them
(``recipes/loop/loop.py``): every trainer rank's log-probs and update reports (TP peers of one DP
rank report the same rows), the sync's, offload's and redundancy's reports, the memory readers."""
from __future__ import annotations

import math

import pytest

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


# ---------------------------------------------------------------- a whole iteration's record


IT = 5
# every trainer rank's log-probs phase: DP 2 × TP 2 (TP peers report their DP rank's rows);
# log π_train − log π_rollout of the fresh tokens: DP rank 0 [0.001, −0.002] (one sequence), DP rank 1 [0.004]
LOG_RATIOS = {0: ([0.001, -0.002], [-0.001]), 1: ([0.004], [0.004])}


def checked(gaps=(0.002, 0.002, 0.004, 0.004), seconds=(0.3, 0.35, 0.5, 0.45), ratios=LOG_RATIOS) -> list[dict]:
    import torch

    out = []
    for rank, (gap, s) in enumerate(zip(gaps, seconds)):
        entry = {"stale_logprob_diff": gap, "logprob_seconds": s}
        if ratios is not None:
            tok, seq = ratios[rank // 2]
            entry["mismatch"] = {"dp_rank": rank // 2, "log_ratio": torch.tensor(tok),
                                 "seq_log_ratio": torch.tensor(seq)}
        out.append(entry)
    return out


def stats(**extra) -> list[dict]:
    """Every trainer rank's update report (DP 2 × TP 2): the loss terms of the rank's rows, the
    all-reduced grad norm and step count (the same on every rank)."""
    per_dp = [{"policy_loss": 0.2, "kl": 0.01, "clipfrac": 0.1}, {"policy_loss": -0.1, "kl": 0.03, "clipfrac": 0.3}]
    seconds = (0.5, 0.7, 0.6, 0.4)
    return [{**per_dp[r // 2], "grad_norm": 1.5, "steps": 4, "update_seconds": seconds[r], "dp_rank": r // 2,
             "tokens": (8, 6)[r // 2], **{k: v[r // 2] if isinstance(v, tuple) else v for k, v in extra.items()}}
            for r in range(4)]


def record(it: int = IT, **kw) -> IterationRecord:
    """A record as a synchronous iteration's phases fill it (``Loop.iteration``)."""
    fields = dict(started=100.0,
                  timings={"rollout_wait": 0.0, "sync": 0.2, "rollout": 1.5, "reward": 0.1, "advantages": 0.01,
                           "logprobs": 0.6, "update": 0.9},
                  sync={"seconds": 0.25, "bytes_moved": 4096, "bytes_sent": 2048},
                  copied={"bytes": 512, "seconds": 0.03},
                  offloaded={"bytes": 1000, "bytes_per_rank": 250, "released_bytes": 900, "seconds": 0.05},
                  reloaded={"bytes": 1000, "bytes_per_rank": 250, "seconds": 0.12},
                  peak={"sync": lambda: {"bytes": 100, "measure": "cuda"},
                        "generate": lambda: {"bytes": 300, "measure": "cuda"},
                        "train": lambda: {"bytes": 200, "measure": "cuda"}},
                  checked=checked(), stats=stats(), stale_tol=1e-2, stale_tol_source="float32")
    fields.update(kw)
    return IterationRecord(it, **fields)


def batch(segmented: bool = False) -> Experience:
    """Iteration 5's batch: two prompts, two samples each, uneven lengths, one and two versions."""
    return Experience([sample(0, [5, 5, 5], 1.0, text="7", source=Sample("3+4=", "7")),
                       sample(0, [4, 4, 5, 5, 5], 0.0, "length", text="77777"),
                       sample(1, [4, 4, 4, 4], 0.5),
                       sample(1, [5, 5], -0.5, "length")], gen_seconds=2.0, segmented=segmented)


def clock(monkeypatch, now: float) -> None:
    import time

    monkeypatch.setattr(time, "perf_counter", lambda: now)


def test_the_record_of_an_iteration(monkeypatch):
    import math

    clock(monkeypatch, 110.0)  # 10 s after the iteration started
    rec = record().metrics(batch(segmented=True))
    expected = {
        "iteration": 5, "reward_mean": (1.0 + 0.0 + 0.5 - 0.5) / 4,
        # the update: the mean over the ranks' rows (TP peers alike), the all-reduced grad norm, the slowest rank
        "policy_loss": (0.2 - 0.1) / 2, "kl": 0.02, "clipfrac": 0.2, "grad_norm": 1.5, "optimizer_steps": 4,
        "update_seconds": 0.7,
        # the stale-weights check: the largest gap of every rank, within the bound; 3 tokens compared
        "stale_logprob_diff": 0.004, "stale_check_passed": True, "stale_tol": 1e-2, "stale_tol_source": "float32",
        "stale_check_tokens": 3, "mismatch_tokens": 3, "mismatch_sequences": 2,
        "mismatch_logprob_diff_max": 0.004, "mismatch_logprob_diff_mean": (0.001 + 0.002 + 0.004) / 3,
        "mismatch_logprob_diff_p99": 0.002 + 0.98 * (0.004 - 0.002),  # linear between the 2nd and 3rd of 3
        "mismatch_kl": sum(math.expm1(x) - x for x in (0.001, -0.002, 0.004)) / 3,
        "mismatch_seq_ratio_mean": (math.exp(-0.001) + math.exp(0.004)) / 2,
        "mismatch_seq_ratio_min": math.exp(-0.001), "mismatch_seq_ratio_max": math.exp(0.004),
        # the generation: 3 + 5 + 4 + 2 tokens in 2 s, two cut at the length limit
        "gen_tokens": 14, "gen_seconds": 2.0, "gen_tokens_per_s": 7.0, "truncated": 2,
        "weight_version_min": 4, "staleness_max": 1, "samples_interrupted": 1,
        "switch_train_to_rollout_s": 0.25, "switch_rollout_to_train_s": 0.12, "bytes_moved": 4096, "bytes_sent": 2048,
        "weights_synced": "full", "handoff": "p2p", "handles": 0, "switch_breakdown": {},
        "offload_bytes": 1000, "offload_bytes_per_rank": 250, "offload_released_bytes": 900, "offload_seconds": 0.05,
        "reload_bytes": 1000, "reload_bytes_per_rank": 250, "reload_seconds": 0.12,
        "redundancy_bytes": 512, "redundancy_seconds": 0.03,
        "peak_device_bytes_sync": 100, "peak_device_bytes_generate": 300, "peak_device_bytes_train": 200,
        "peak_device_measure": "cuda",
        "train_seconds": 0.6 + 0.9, "logprob_seconds": 0.5,
        "iteration_seconds": 10.0, "samples_per_s": 0.4,
        "phase_seconds": {"rollout_wait": 0.0, "sync": 0.2, "rollout": 1.5, "reward": 0.1, "advantages": 0.01,
                          "logprobs": 0.6, "update": 0.9},
        "example": {"prompt": "3+4=", "response": "7", "answer": "7"},
    }
    assert set(rec) == set(expected)
    for key, value in expected.items():  # within float32's rounding: the ranks' log-ratios are float32
        assert rec[key] == (value if isinstance(value, (str, dict, bool)) else pytest.approx(value, rel=1e-6)), key
    # the line: reward, loss, generation, the switch, the check, the seconds
    assert record().line(rec) == (
        "it 5: reward 0.250  kl 2.00e-02  loss +0.0500  gen 7 tok/s  switch 250 ms (4 KiB) / back 120 ms  "
        f"stale check passed (3 tokens, Δlogp max 4.0e-03, p99 4.0e-03, mismatch KL {expected['mismatch_kl']:.1e})  "
        "[10.0 s]")
    assert f"{expected['mismatch_kl']:.1e}" == "3.5e-06"  # 0.5·(1e-6 + 4e-6 + 16e-6)/3 to first order


def test_a_record_is_not_changed_by_writing_it(monkeypatch):
    """The phases' timings are copied into the record: a later phase does not rewrite it."""
    clock(monkeypatch, 110.0)
    r = record()
    rec = r.metrics(batch())
    r.timings["checkpoint"] = 1.0
    assert "checkpoint" not in rec["phase_seconds"]


def test_the_sync_reports_what_kind_of_move_it_was(monkeypatch):
    clock(monkeypatch, 110.0)
    sync = {"seconds": 0.5, "bytes_moved": 2048, "bytes_sent": 0, "weights": "adapters", "handoff": "ipc",
            "handles": 3, "breakdown": {"pack": 0.1, "send": 0.4}}
    rec = record(sync=sync).metrics(batch())
    assert (rec["weights_synced"], rec["handoff"], rec["handles"], rec["switch_breakdown"]) == (
        "adapters", "ipc", 3, {"pack": 0.1, "send": 0.4})
    assert (rec["switch_train_to_rollout_s"], rec["bytes_moved"], rec["bytes_sent"]) == (0.5, 2048, 0)
    assert "switch 500 ms (2 KiB) / back 120 ms" in record(sync=sync).line(rec)
    # seconds in ms and bytes in KiB as the line rounds them: 1.5 s, 1000 KiB
    slow = record(sync={"seconds": 1.5, "bytes_moved": 1024 * 1000, "bytes_sent": 0},
                  reloaded={"bytes": 0, "bytes_per_rank": 0, "seconds": 2.5})
    assert "switch 1500 ms (1000 KiB) / back 2500 ms  " in slow.line(slow.metrics(batch()))


def test_a_batch_with_a_reward_model_records_both_parts(monkeypatch):
    clock(monkeypatch, 110.0)
    exp = batch()
    for s, rule, model in zip(exp.samples, (1.0, 0.0, 1.0, 0.0), (0.2, 0.4, -0.1, 0.3)):
        s.rule_reward, s.model_reward, s.reward = rule, model, 0.5 * rule + 0.5 * model
    rec = record().metrics(exp)
    assert rec["rule_reward_mean"] == pytest.approx(0.5)
    assert rec["model_reward_mean"] == pytest.approx(0.2)
    assert rec["reward_mean"] == pytest.approx((0.6 + 0.2 + 0.45 + 0.15) / 4)
    # without a reward model neither is recorded
    assert not {"rule_reward_mean", "model_reward_mean"} & set(record().metrics(batch()))


def test_the_stale_check_is_the_largest_gap_of_every_rank():
    r = record(checked=checked(gaps=(1e-6, 3e-4, 2e-5, 0.0)), stale_tol=1e-4)
    assert r.stale_gap == 3e-4 and not r.stale_check_passed
    assert record(checked=checked(gaps=(1e-4, 0.0, 5e-5, 5e-5)), stale_tol=1e-4).stale_check_passed  # at the bound
    assert record(checked=checked(gaps=(2e-5,) * 4), stale_tol=1e-4).stale_check_passed


def test_a_failed_check_records_no_update(monkeypatch):
    """The stale-weights check stopped the update: no loss keys, the train time is the log-probs',
    the line says so."""
    clock(monkeypatch, 104.0)
    r = record(checked=checked(gaps=(0.3, 0.3, 0.01, 0.01)), stale_tol=1e-4, stats=None,
               timings={"sync": 0.2, "logprobs": 0.6})
    rec = r.metrics(batch())
    assert not {"policy_loss", "kl", "clipfrac", "grad_norm", "optimizer_steps", "update_seconds",
                "is_weight_mean"} & set(rec)
    assert rec["stale_check_passed"] is False and rec["stale_logprob_diff"] == 0.3
    assert rec["train_seconds"] == 0.6 and rec["samples_per_s"] == 1.0
    line = r.line(rec)
    assert line.startswith("it 5: reward 0.250  no update  gen 7 tok/s  ")
    assert "stale check FAILED (> 0.0001) (3 tokens, Δlogp max 3.0e-01, p99 4.0e-03" in line
    assert line.endswith("[4.0 s]")


def test_stale_check_said_without_compared_tokens():
    """Every sample older than the trainer's weights: nothing compared, nothing to pass or fail."""
    said = R.stale_check_said({"stale_check_tokens": 0, "stale_check_passed": True}, 1e-4)
    assert said == "stale check: no token compared (every sample older than the trainer's weights)"
    assert R.stale_check_said({}, 1e-4) == said
    rec = {"stale_check_tokens": 12, "stale_check_passed": False, "stale_logprob_diff": 0.25,
           "mismatch_logprob_diff_p99": 0.125, "mismatch_kl": 0.0625}
    assert R.stale_check_said(rec, 5e-4) == ("stale check FAILED (> 0.0005) (12 tokens, Δlogp max 2.5e-01, "
                                             "p99 1.2e-01, mismatch KL 6.2e-02)")
    rec["stale_check_passed"] = True
    assert R.stale_check_said(rec, 5e-4).startswith("stale check passed (12 tokens")


def test_a_batch_all_older_than_the_trainers_weights(monkeypatch):
    """One step ahead, every sample one version old: the ranks compared no token."""
    clock(monkeypatch, 110.0)
    r = record(checked=checked(gaps=(0.0,) * 4, ratios={0: ([], []), 1: ([], [])}))
    rec = r.metrics(batch())
    assert (rec["stale_check_tokens"], rec["mismatch_tokens"], rec["stale_logprob_diff"]) == (0, 0, 0.0)
    assert rec["stale_check_passed"] is True
    assert "stale check: no token compared" in r.line(rec)


def test_the_correction_weight_is_the_mean_over_the_batchs_tokens(monkeypatch):
    """``is_weight_mean``: Σ weights over Σ tokens, each DP rank once (its TP peers report the same
    rows); ``is_masked_tokens``: the tokens a mask took out, each DP rank once."""
    clock(monkeypatch, 110.0)
    rec = record(stats=stats(is_weight_sum=(7.6, 6.3), is_masked_tokens=(1, 2))).metrics(batch())
    assert rec["is_weight_mean"] == pytest.approx((7.6 + 6.3) / (8 + 6))
    assert rec["is_masked_tokens"] == 3
    # reports without a DP rank (one trainer rank each) each count
    alone = [{"is_weight_sum": 3.0, "tokens": 4, "is_masked_tokens": 1},
             {"is_weight_sum": 1.0, "tokens": 4, "is_masked_tokens": 0}]
    assert R._correction(alone) == {"is_weight_mean": 0.5, "is_masked_tokens": 1}
    no_tokens = R._correction([{"is_weight_sum": 0.0, "tokens": 0, "is_masked_tokens": 0, "dp_rank": 0}])
    assert math.isnan(no_tokens["is_weight_mean"]) and no_tokens["is_masked_tokens"] == 0
    # no correction (none, or the update did not run): no keys
    assert R._correction(stats()) == {} and R._correction(None) == {} and R._correction([]) == {}


def test_a_critics_update_keys(monkeypatch):
    clock(monkeypatch, 110.0)
    rec = record(stats=stats(vf_loss=0.75, vf_clipfrac=0.125, value_mean=-0.5, return_mean=0.25)).metrics(batch())
    assert (rec["vf_loss"], rec["vf_clipfrac"], rec["value_mean"], rec["return_mean"]) == (0.75, 0.125, -0.5, 0.25)
    assert not {"vf_loss", "vf_clipfrac", "value_mean", "return_mean"} & set(R._update(stats()))
    assert R._update(None) == {} and R._update([]) == {} and R._losses(None) == {} and R._losses([]) == {}
    only_vf = R._update([{"update_seconds": 0.1, "steps": 2, "vf_loss": 0.5}])
    assert only_vf == {"update_seconds": 0.1, "optimizer_steps": 2, "vf_loss": 0.5}


def test_zero_seconds_give_nan_rates(monkeypatch):
    clock(monkeypatch, 100.0)  # the record read the instant the iteration started
    exp = batch()
    exp.gen_seconds = 0.0
    rec = record().metrics(exp)
    assert math.isnan(rec["gen_tokens_per_s"]) and math.isnan(rec["samples_per_s"]) and rec["gen_tokens"] == 14
    assert rec["iteration_seconds"] == 0.0
    clock(monkeypatch, 100.5)  # half a second: a rate, not NaN
    assert record().metrics(exp)["samples_per_s"] == 8.0
    assert R._generation(Experience([sample(0, [1, 1, 1])], gen_seconds=0.5)) == {  # under a second is a rate too
        "gen_tokens": 3, "gen_seconds": 0.5, "gen_tokens_per_s": 6.0}


def test_what_the_loop_did_besides(monkeypatch):
    """Dynamic sampling, rebalance, lend, lost replicas and the replicas' idle shares appear only
    when the run has them; the line says what lend and rebalance chose, and why."""
    clock(monkeypatch, 110.0)
    exp = batch()
    plain = record().metrics(exp)
    assert not {"dynamic_sampling", "rebalance", "lend", "rollout_replicas_lost", "replica_idle_share",
                "replica_idle_share_max", "agent"} & set(plain)
    exp.dynamic_sampling = {"groups_with_signal": 2, "draws": 1, "filled_with_dropped": 0}
    lost = [{"lost": ["replica 1"], "requeued_prompts": 2, "replicas_left": 1, "seconds": 0.5}]
    r = record(rebalance={"grown": True, "why": "2 idle devices"}, lend={"lent": True, "why": "rollout-bound"},
               replicas_lost=lost, rollout_time={"busy_s": 3.0, "idle_share": {1: 0.25, 0: 0.1}})
    rec = r.metrics(exp)
    assert rec["dynamic_sampling"] == exp.dynamic_sampling
    assert rec["rebalance"] == {"grown": True, "why": "2 idle devices"} and rec["lend"]["lent"] is True
    assert rec["rollout_replicas_lost"] == lost
    assert rec["replica_idle_share"] == {"0": 0.1, "1": 0.25} and list(rec["replica_idle_share"]) == ["0", "1"]
    assert rec["replica_idle_share_max"] == 0.25
    assert r.line(rec).endswith("  lend: lent (rollout-bound)  rebalance: grown (2 idle devices)  [10.0 s]")
    # replicas that generated nothing have no idle share; empty reports are left out
    quiet = record(rollout_time={"busy_s": 0.0, "idle_share": {0: 1.0}}, rebalance={}, lend={}, replicas_lost=[])
    assert not {"replica_idle_share", "replica_idle_share_max", "rebalance", "lend",
                "rollout_replicas_lost"} & set(quiet.metrics(batch()))


def test_chosen_says_what_lend_and_rebalance_did():
    assert record()._chosen() == ""
    assert record(lend={"lent": False, "why": "train-bound"})._chosen() == "  lend: own (train-bound)"
    assert record(rebalance={"grown": False})._chosen() == "  rebalance: static"
    assert record(rebalance={"grown": False, "why": ""})._chosen() == "  rebalance: static"
    assert record(rebalance={"why": "no idle device"})._chosen() == "  rebalance: static (no idle device)"
    both = record(lend={"lent": True, "why": "a"}, rebalance={"grown": True})
    assert both._chosen() == "  lend: lent (a)  rebalance: grown"


def test_an_agent_batch_records_its_episodes(monkeypatch):
    """docs/agents.md: the record's ``agent`` entry has the episodes' metrics, the turn batches,
    the tokens cut past a stop id, the model's tokens (what the stale check compares in a
    synchronous run) and the samples excluded (failed, ``failed_samples: exclude``: no token trained)."""
    from rlhf_switch.agent.episode import Episode

    clock(monkeypatch, 110.0)

    def ep(finish: str, n: int, turns: int, reward: float) -> Episode:
        return Episode("s", [1, 2], response_ids=list(range(n)), turns=turns, reward=reward, finish_reason=finish,
                       env_seconds=0.5)

    samples = [
        sample(0, [5, 5, -1, -1, 5], 1.0, "stop", episode=ep("stop", 5, 2, 1.0)),             # 3 model tokens
        sample(0, [5, -1, 5, 5], 0.0, "max_turns", episode=ep("max_turns", 4, 2, 0.0)),       # 3
        sample(1, [5, 5, -1], 0.0, "env_error", mask=[0, 0, 0], episode=ep("env_error", 3, 1, 0.0)),  # excluded
        sample(1, [5, 5, -1], 0.0, "timeout", episode=ep("timeout", 3, 1, 0.0)),  # failed, but trained on: 2
        sample(2, [], 0.0, "env_error", episode=ep("env_error", 0, 0, 0.0)),      # failed before the first turn
        sample(2, [5, 5, 5, 5], 1.0, "stop", episode=ep("stop", 4, 1, 1.0)),      # 4
    ]
    exp = Experience(samples, gen_seconds=1.0)
    exp.turn_batches, exp.tokens_past_stop = [6, 5, 2], 3
    agent = record().metrics(exp)["agent"]
    assert agent["model_tokens"] == 3 + 3 + 0 + 2 + 0 + 4
    assert agent["excluded"] == 2
    assert (agent["turn_batches"], agent["tokens_past_stop"], agent["n"]) == ([6, 5, 2], 3, 6)
    assert agent["turns_mean"] == pytest.approx(7 / 6) and agent["finish/env_error"] == pytest.approx(2 / 6)
    # a failed sample all of whose tokens were already masked is excluded; one with model tokens is not
    zeroed = [sample(0, [-1], 0.0, "env_error", episode=ep("env_error", 1, 0, 0.0))]
    assert record().metrics(Experience(zeroed, gen_seconds=1.0))["agent"]["excluded"] == 1
    ok = [sample(0, [-1, -1], 0.0, "stop", episode=ep("stop", 2, 0, 0.0))]  # not failed: never excluded
    assert record().metrics(Experience(ok, gen_seconds=1.0))["agent"]["excluded"] == 0


def test_timed_records_each_phases_wall_time_even_when_it_fails(monkeypatch):
    import time

    ticks = iter([10.0, 12.5, 20.0, 20.25])
    monkeypatch.setattr(time, "perf_counter", lambda: next(ticks))
    r = IterationRecord(0, started=0.0)
    with r.timed("rollout"):
        pass
    with pytest.raises(RuntimeError):
        with r.timed("update"):
            raise RuntimeError("a rank died")
    assert r.timings == {"rollout": 2.5, "update": 0.25}


def test_one_trainer_rank_and_a_record_without_train_phases(monkeypatch):
    """DP 1, TP 1: one update report. A record whose phases did not time a log-probs or update
    phase (``timings`` holds what ran) has a train time of 0."""
    clock(monkeypatch, 110.0)
    one = [{"policy_loss": -0.25, "kl": 0.5, "clipfrac": 0.0, "grad_norm": 2.0, "steps": 1, "update_seconds": 0.3,
            "tokens": 14, "dp_rank": 0}]
    rec = record(stats=one, checked=checked()[:1], timings={"sync": 0.2}).metrics(batch())
    assert (rec["policy_loss"], rec["kl"], rec["clipfrac"], rec["grad_norm"], rec["optimizer_steps"],
            rec["update_seconds"]) == (-0.25, 0.5, 0.0, 2.0, 1, 0.3)
    assert rec["train_seconds"] == 0.0 and rec["stale_logprob_diff"] == 0.002 and rec["logprob_seconds"] == 0.3
    assert record(timings={"update": 0.9}).metrics(batch())["train_seconds"] == 0.9
