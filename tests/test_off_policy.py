"""One-step off-policy rollout (``algorithm.off_policy``, ``rollout.mode: disaggregated``): the
importance weights against hand values and their peers' formulas, the config's refusals, each
sample's weight version, ``max_staleness: 0`` equal to the synchronous loop bit for bit, and a
real run with vLLM replicas on devices of their own generating while the trainer trains."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
import yaml

from rlhf_switch.rl import algorithms as A
from rlhf_switch.rl.config import ConfigError, load_config

from test_rl_pure import CONFIGS


def tiny(name: str = "grpo_tiny_fsdp.yaml", **changes) -> dict:
    cfg = yaml.safe_load((CONFIGS / name).read_text())
    for key, value in changes.items():
        *path, last = key.split(".")
        node = cfg
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value
    return cfg


def test_tis_truncates_and_icepop_masks_the_ratio():
    """TIS (Yao et al. 2025; verl ``rollout_is``): min(π_train/π_rollout, C); IcePop: the ratio
    inside [low, high], else 0 (tests/test_rl_paper.py has the sequence-level forms)."""
    lp = torch.tensor([[-1.0, -1.0, -1.0, -1.0]])
    behaviour = torch.tensor([[-1.1, -2.0, 0.0, -1.5]])  # ratios e^0.1, e, 1/e, e^0.5
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    tis = A.off_policy_weights(lp, behaviour, mask, "tis", cap=2.0)
    assert torch.allclose(tis, torch.tensor([[torch.e ** 0.1, 2.0, torch.e ** -1, 0.0]]))
    ice = A.off_policy_weights(lp, behaviour, mask, "icepop", low=0.5, high=2.0)
    assert torch.allclose(ice, torch.tensor([[torch.e ** 0.1, 0.0, 0.0, 0.0]]))  # e > 2 and 1/e < 0.5 leave the loss
    with pytest.raises(ValueError, match="unknown off-policy correction"):
        A.off_policy_weights(lp, behaviour, mask, "vtrace")


def test_off_policy_config_refusals():
    from rlhf_switch.problems import run_problems

    # K >= 2 batches in flight: agent runs only (tests/test_problems.py has the agent side)
    two = load_config(tiny("grpo_tiny_async.yaml", **{"algorithm.off_policy": {"max_staleness": 2}}))
    assert run_problems(two, skip=("reward",)) == [
        "algorithm.off_policy.max_staleness: 2 — a single-turn run carries one batch in flight (0 or 1); K >= 2 "
        "batches in flight are built for agent runs, whose episodes are played in threads of their own"]
    with pytest.raises(ConfigError, match="mode: colocated and colocate: False disagree"):
        load_config(tiny(**{"rollout.mode": "colocated", "rollout.colocate": False}))
    problems = run_problems(load_config(tiny(**{"algorithm.off_policy": {"max_staleness": 1}})), skip=("reward",))
    assert any("generation overlaps training only on rollout replicas of their own devices" in p for p in problems)
    ok = load_config(tiny("grpo_tiny_async.yaml"))
    assert ok.rollout.mode == "disaggregated" and ok.algorithm.off_policy.max_staleness == 1
    assert run_problems(ok, skip=("reward",)) == []


def _records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.mark.slow
def test_max_staleness_0_is_the_synchronous_loop_bit_for_bit(ray_session, tmp_path):
    """The same run with and without ``off_policy: {max_staleness: 0}``: the same records (losses,
    rewards, stale checks) and the same final weights, bit for bit; every sample records the
    version it was generated with — the trainer's own."""
    from safetensors.torch import load_file

    from recipes.common import warm_start
    from recipes.train import run

    init = warm_start(load_config(tiny()), tmp_path / "init", quiet=True)
    outs = {}
    for name, extra in (("sync", {}), ("k0", {"algorithm.off_policy": {"max_staleness": 0}})):
        out = tmp_path / name
        shutil.copytree(init, out / "init")
        run(tiny(output_dir=str(out), **{"eval.num_prompts": 16}, **extra), iterations=2, quiet=True)
        outs[name] = out
    a, b = ([r for r in _records(o) if "reward_mean" in r] for o in outs.values())
    for x, y in zip(a, b):
        for k in ("reward_mean", "policy_loss", "kl", "grad_norm", "stale_logprob_diff", "staleness_max"):
            assert x[k] == y[k], (k, x[k], y[k])
        assert x["staleness_max"] == 0
    wa, wb = (load_file(o / "final" / "model.safetensors") for o in outs.values())
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    rollouts = [json.loads(line) for line in (outs["k0"] / "rollouts.jsonl").read_text().splitlines()]
    assert [set(r["weight_versions"]) for r in rollouts] == [{0}, {1}]


@pytest.mark.slow
@pytest.mark.vllm
def test_one_step_off_policy_with_disaggregated_vllm_replicas(ray_session, tmp_path):
    """Two vLLM replicas on devices of their own generate iteration i+1's batch while the FSDP2
    trainer trains on iteration i's: from iteration 1 every sample is one version old (the
    replica's own count), its stale check is the version check, the update is corrected by TIS
    weights near 1. One replica is killed while it generates iteration 2's batch: its prompts are
    generated again by the other (with the same weights' version), the channel is formed again over
    it and the run finishes. A weight sync that does not happen is caught as a version two behind."""
    from recipes.common import warm_start
    from recipes.train import StaleWeightsError, run

    cfg = tiny("grpo_tiny_async.yaml", **{"eval.num_prompts": 16})
    init = warm_start(load_config(cfg), tmp_path / "init", quiet=True)
    for name in ("run", "skipped"):
        shutil.copytree(init, tmp_path / name / "init")
    killed = []

    def kill_replica_1(it, cluster):
        if it == 2:  # iteration 2's batch was just handed to both replicas: one dies generating it
            killed.append(cluster.replicas[1])
            ray_session.kill(cluster.replicas[1])

    recs = [r for r in run({**cfg, "output_dir": str(tmp_path / "run")}, iterations=3, quiet=True,
                           generate_hook=kill_replica_1) if "reward_mean" in r]
    assert [(r["weight_version_min"], r["staleness_max"]) for r in recs] == [(0, 0), (0, 1), (1, 1)]
    assert recs[0]["stale_check_passed"] and recs[0]["stale_logprob_diff"] < 1e-4
    assert all(0.5 < r["is_weight_mean"] < 2.0 for r in recs[1:])
    # the batch in flight was generated while the trainer trained: the wait for it is a part of its span
    assert all(r["phase_seconds"]["rollout_wait"] < r["gen_seconds"] for r in recs[1:])
    # the lost replica's half of the 128 samples was generated again, by the replica left
    assert killed and [len(r.get("rollout_replicas_lost", [])) for r in recs] == [0, 0, 1]
    lost = recs[2]["rollout_replicas_lost"][0]
    assert lost["lost"][0].startswith("rollout replica 1") and (lost["requeued_prompts"], lost["replicas_left"]) == (64, 1)
    rollouts = [json.loads(line) for line in (tmp_path / "run" / "rollouts.jsonl").read_text().splitlines()]
    assert len(rollouts[2]["weight_versions"]) == 128 and set(rollouts[2]["weight_versions"]) == {1}
    # the channel formed again over one replica; the final sync and evaluation ran through it
    channel = next(r["channel"] for r in _records(tmp_path / "run") if "channel" in r)
    assert channel["opened"] == 2 and len(channel["nodes"]["replicas"]) == 1, channel
    assert (tmp_path / "run" / "final").is_dir()
    one = tiny("grpo_tiny_async.yaml", world_size=1, **{"train.dp": 1, "reference.dp": 1, "rollout.dp": 1,
                                                        "eval.num_prompts": 16})
    with pytest.raises(StaleWeightsError, match="iteration 3: .* version 1, more than algorithm.off_policy"):
        run({**one, "output_dir": str(tmp_path / "skipped")}, iterations=4, quiet=True, skip_sync_at=(2,))


@pytest.mark.slow
@pytest.mark.vllm
def test_a_replica_lost_while_standing_by_is_dropped_and_the_sync_refills_the_other(ray_session, tmp_path):
    """The synchronous loop with two vLLM replicas; replica 1 is killed after its rollout, while it
    stands by in the weight channel. The next sync fails part-way (it may have written some of the
    other replica's weights), the dead replica is dropped, the channel formed again and the sync
    run again: the replica left generates iteration 1's whole batch with the trainer's weights —
    the stale-weights check compares every sample's log-probs with the trainer's."""
    from recipes.common import warm_start
    from recipes.train import run

    cfg = tiny("grpo_tiny_async.yaml", output_dir=str(tmp_path / "run"),
               **{"eval.num_prompts": 16, "algorithm.off_policy": {"max_staleness": 0}})
    shutil.copytree(warm_start(load_config(cfg), tmp_path / "init", quiet=True), tmp_path / "run" / "init")

    def kill_replica_1(it, phase, cluster):
        if (it, phase) == (0, "train"):  # its receive for iteration 1's sync is posted
            ray_session.kill(cluster.replicas[1])

    recs = [r for r in run(cfg, iterations=2, quiet=True, phase_hook=kill_replica_1) if "reward_mean" in r]
    assert "rollout_replicas_lost" not in recs[0]
    (lost,) = recs[1]["rollout_replicas_lost"]
    assert lost["during"] == "sync" and lost["lost"][0].startswith("rollout replica 1") and lost["replicas_left"] == 1
    assert all(r["stale_check_passed"] and r["stale_logprob_diff"] < 1e-4 for r in recs), recs
    assert [r["weight_version_min"] for r in recs] == [0, 1]


def test_partial_rollout_config():
    assert load_config(tiny("grpo_tiny_async.yaml", **{"algorithm.off_policy": {
        "max_staleness": 1, "segment_tokens": 2}})).algorithm.off_policy.segment_tokens == 2
    from rlhf_switch.rl.algorithm_rules import algorithm_problems

    assert algorithm_problems(load_config(tiny("grpo_tiny_async.yaml", **{"algorithm.off_policy": {
        "max_staleness": 0, "segment_tokens": 2}}))) == [
        "algorithm.off_policy.segment_tokens: 2 — partial rollout interrupts the batch in flight: max_staleness: 1"]


@pytest.mark.slow
@pytest.mark.vllm
def test_partial_rollout_continues_interrupted_samples_with_the_new_weights(ray_session, tmp_path):
    """One-step off-policy with ``segment_tokens: 1``: the batch in flight is handed out a token at
    a time while the update runs (the test holds each later round back 3 s, so the update lands
    first). The samples it interrupted continue after the sync with the new weights: their tokens
    record two versions, in order, and the stale-weights check compares the tokens generated with
    the trainer's own weights against the trainer's log-probs."""
    import time

    from recipes.common import warm_start
    from recipes.train import run

    cfg = tiny("grpo_tiny_async.yaml", world_size=1, output_dir=str(tmp_path / "run"),
               **{"train.dp": 1, "reference.dp": 1, "rollout.dp": 1, "eval.num_prompts": 16,
                  "algorithm.off_policy": {"max_staleness": 1, "correction": "tis", "segment_tokens": 1}})
    shutil.copytree(warm_start(load_config(cfg), tmp_path / "init", quiet=True), tmp_path / "run" / "init")
    recs = [r for r in run(cfg, iterations=3, quiet=True, generate_hook=lambda it, cluster: time.sleep(3))
            if "reward_mean" in r]
    assert [(r["weight_version_min"], r["staleness_max"]) for r in recs] == [(0, 0), (0, 1), (1, 1)]
    assert all(r["samples_interrupted"] > 0 for r in recs[1:]), [r.get("samples_interrupted") for r in recs]
    assert all(r["stale_check_passed"] and r["stale_logprob_diff"] < 1e-4 for r in recs), recs
    rollouts = [json.loads(line) for line in (tmp_path / "run" / "rollouts.jsonl").read_text().splitlines()]
    for it, ro in zip((1, 2), rollouts[1:]):
        for tv, resp in zip(ro["token_versions"], ro["responses"]):
            assert len(tv) == len(resp) and tv == sorted(tv) and set(tv) <= {it - 1, it}, (it, tv)
        assert any(set(tv) == {it - 1, it} for tv in ro["token_versions"])
