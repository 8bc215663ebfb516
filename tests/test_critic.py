"""The PPO critic (actors/critic.py) on FSDP2 and DeepSpeed ZeRO-2 at DP2, against a one-process
value model with the same weights; ``ppo_batch`` against a hand computation."""
from __future__ import annotations

import importlib.util
import statistics

import pytest
import torch

from rlhf_switch.rl.algorithms import global_masked_whiten, ppo_batch

assert importlib.util.find_spec("deepspeed"), "deepspeed is not installed; `make test` installs it"

import critic_jobs as jobs  # noqa: E402

TOL = 1e-5




@pytest.mark.parametrize("engine,stage", [("fsdp2", 0), pytest.param("deepspeed", 2, marks=pytest.mark.heavy)])
def test_critic_matches_one_process(world2, engine, stage):
    results = world2.run(jobs.critic_vs_reference, engine, stage, timeout=300)
    for rank, r in enumerate(results):
        assert r["values_shape"] == (jobs.B, jobs.T - 1)
        assert r["values_diff"] < TOL, (rank, r["values_diff"])
        s, want = r["stats"], r["ref_stats"]
        assert s["tokens"] == want["tokens"]
        for k in ("vf_loss", "vf_clipfrac", "grad_norm"):
            assert abs(s[k] - want[k]) < TOL * max(1.0, abs(want[k])), (rank, k, s[k], want[k])
        assert 0 < want["vf_clipfrac"] < 1  # the clip is exercised on some tokens, not all
        assert r["values_moved"] > 1e-3  # the step did something ...
        assert r["values_after_diff"] < TOL, (rank, r["values_after_diff"])  # ... the one-process thing
        assert r["losses"][-1] < 0.9 * r["losses"][0], r["losses"]
    assert results[0]["state_keys"] == results[0]["ref_keys"]
    assert results[0]["state_diff"] < TOL
    assert results[1]["state_keys"] == []  # full tensors on DP rank 0 only


def test_global_whitening(world2):
    """Over two DP ranks: the whole batch's whitening (critic_jobs.whitening_matches); in one
    process without a process group (here: ``make mutate`` sees which function this test reaches,
    and the ranks arm the same mutant): masked_whiten itself."""
    for r in world2.run(jobs.whitening_matches):
        assert max(r["diff"], r["diff_unshifted"], r["diff_two"]) < 1e-6, r
        assert r["refused"] == "an unbiased variance needs at least 2 masked-in values, got 1"
    x, mask = torch.tensor([[1.0, 2.0, 9.0], [4.0, 0.0, 0.0]]), torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    # mean 7/3, unbiased variance 7/3
    want = torch.tensor([[-4 / 3, -1 / 3, 0.0], [5 / 3, 0.0, 0.0]]) / (7 / 3 + 0.5) ** 0.5
    torch.testing.assert_close(global_masked_whiten(x, mask, eps=0.5), want)
    torch.testing.assert_close(global_masked_whiten(x, mask, shift_mean=False, eps=0.5), (want + 7 / 3) * mask)


def test_value_model_from_actor_checkpoint(world2):
    r = world2.run(jobs.init_from_checkpoint)[0]
    assert r["trunk_diff"] == 0 and r["n_trunk"] > 0
    assert r["head_same"] and r["deterministic"] and r["zero_head"]
    assert 0 < r["head_std"] < 0.02
    assert "does not fit" in r["refused"] or "size mismatch" in r["refused"], r["refused"]


def test_ppo_batch_by_hand():
    """k1 KL in the reward, the score on the last response token, GAE (γ=1, λ=0.5), whitening."""
    old = torch.tensor([[-1.0, -0.5, -2.0, 0.0], [0.0, -0.3, -0.7, 0.0]])
    ref = torch.tensor([[-1.2, -0.4, -2.5, 0.0], [0.0, -0.1, -0.9, 0.0]])
    values = torch.tensor([[0.5, 0.2, 0.4, 9.0], [7.0, 0.1, -0.3, 0.0]])  # 9.0, 7.0: masked out
    mask = torch.tensor([[1.0, 1, 1, 0], [0, 1, 1, 0]])
    out = ppo_batch(old, ref, values, torch.tensor([1.0, -1.0]), mask, kl_coef=0.1, gamma=1.0, lam=0.5,
                    whiten=False)
    # row 0: kl = 0.2, -0.1, 0.5 -> rewards -0.02, 0.01, -0.05 + 1
    #   t2: δ = 0.95 - 0.4 = 0.55;  t1: δ = 0.01 + 0.4 - 0.2 = 0.21, A = 0.21 + 0.5·0.55 = 0.485
    #   t0: δ = -0.02 + 0.2 - 0.5 = -0.32, A = -0.32 + 0.5·0.485 = -0.0775
    # row 1 (position 0 is prompt): kl = -0.2, 0.2 -> rewards 0.02, -0.02 - 1
    #   t2: δ = -1.02 + 0.3 = -0.72;  t1: δ = 0.02 - 0.3 - 0.1 = -0.38, A = -0.38 - 0.36 = -0.74
    want_kl = [[0.2, -0.1, 0.5, 0], [0, -0.2, 0.2, 0]]
    want_r = [[-0.02, 0.01, 0.95, 0], [0, 0.02, -1.02, 0]]
    want_a = [[-0.0775, 0.485, 0.55, 0], [0, -0.74, -0.72, 0]]
    want_ret = [[0.4225, 0.685, 0.95, 0], [0, -0.64, -1.02, 0]]
    for key, want in (("kl", want_kl), ("rewards", want_r), ("advantages", want_a), ("returns", want_ret)):
        torch.testing.assert_close(out[key], torch.tensor(want), atol=1e-6, rtol=0, msg=key)
    white = ppo_batch(old, ref, values, torch.tensor([1.0, -1.0]), mask, kl_coef=0.1, gamma=1.0, lam=0.5)
    a = [-0.0775, 0.485, 0.55, -0.74, -0.72]
    mean, std = statistics.mean(a), statistics.stdev(a)  # unbiased, as masked_whiten
    got = white["advantages"][mask.bool()]
    torch.testing.assert_close(got, torch.tensor([(x - mean) / std for x in a]), atol=1e-5, rtol=0)
    assert white["advantages"][~mask.bool()].abs().max() == 0
    torch.testing.assert_close(white["returns"], out["returns"])  # returns are never whitened
    # no reference: no KL, only the score
    plain = ppo_batch(old, None, values, torch.tensor([1.0, -1.0]), mask, whiten=False)
    torch.testing.assert_close(plain["rewards"], torch.tensor([[0, 0, 1.0, 0], [0, 0, -1.0, 0]]))
