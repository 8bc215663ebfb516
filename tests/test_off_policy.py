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
    """TIS (Yao et al. 2025; verl ``rollout_is``): min(π_train/π_rollout, C); IcePop: 1 inside
    [low, high], else 0."""
    lp = torch.tensor([[-1.0, -1.0, -1.0, -1.0]])
    behaviour = torch.tensor([[-1.0, -2.0, 0.0, -1.5]])  # ratios 1, e, 1/e, e^0.5
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    tis = A.off_policy_weights(lp, behaviour, mask, "tis", cap=2.0)
    assert torch.allclose(tis, torch.tensor([[1.0, 2.0, torch.e ** -1, 0.0]]))
    ice = A.off_policy_weights(lp, behaviour, mask, "icepop", low=0.5, high=2.0)
    assert ice.tolist() == [[1.0, 0.0, 0.0, 0.0]]  # e > 2 and 1/e < 0.5 leave the loss
    with pytest.raises(ValueError, match="unknown off-policy correction"):
        A.off_policy_weights(lp, behaviour, mask, "vtrace")


def test_off_policy_config_refusals():
    from rlhf_switch.problems import run_problems

    with pytest.raises(ConfigError, match="max_staleness: 2 — one batch in flight is built"):
        load_config(tiny(**{"algorithm.off_policy": {"max_staleness": 2}}))
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
    from recipes.loop import run

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
    """A vLLM replica on a device of its own generates iteration i+1's batch while the FSDP2
    trainer trains on iteration i's: from iteration 1 every sample is one version old (the
    replica's own count), its stale check is the version check, the update is corrected by TIS
    weights near 1; a weight sync that does not happen is caught as a version two behind."""
    from recipes.common import warm_start
    from recipes.loop import StaleWeightsError, run

    cfg = tiny("grpo_tiny_async.yaml", world_size=1, **{"train.dp": 1, "reference.dp": 1, "rollout.dp": 1,
                                                        "eval.num_prompts": 16})
    init = warm_start(load_config(cfg), tmp_path / "init", quiet=True)
    for name in ("run", "skipped"):
        shutil.copytree(init, tmp_path / name / "init")
    recs = [r for r in run({**cfg, "output_dir": str(tmp_path / "run")}, iterations=3, quiet=True) if "reward_mean" in r]
    assert [(r["weight_version_min"], r["staleness_max"]) for r in recs] == [(0, 0), (0, 1), (1, 1)]
    assert recs[0]["stale_check_passed"] and recs[0]["stale_logprob_diff"] < 1e-4
    assert all(0.5 < r["is_weight_mean"] < 2.0 for r in recs[1:])
    # the batch in flight was generated while the trainer trained: the wait for it is a part of its span
    assert all(r["phase_seconds"]["rollout_wait"] < r["gen_seconds"] for r in recs[1:])
    with pytest.raises(StaleWeightsError, match="iteration 3: .* version 1, more than algorithm.off_policy"):
        run({**cfg, "output_dir": str(tmp_path / "skipped")}, iterations=4, quiet=True, skip_sync_at=(2,))
