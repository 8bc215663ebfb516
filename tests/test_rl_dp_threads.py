"""The RL maths that runs only where a DP group has more than one rank — ``global_masked_whiten``,
``ppo_batch``'s whitening, the estimators' gathers and whitening over DP — on two ranks that are
threads of the pytest process (``thread_world``: real gloo collectives), so that ``make mutate``
sees which test reaches them (a spawned rank's code has no test for mutmut). Every expected value
is worked out by hand (or with ``statistics`` on the hand-listed values), never by the code under
test."""
from __future__ import annotations

import math
import statistics
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from rlhf_switch.rl.algorithm import OldPolicy
from rlhf_switch.rl.algorithms import global_masked_whiten, ppo_batch
from rlhf_switch.rl.estimators import ESTIMATORS
from thread_world import run_on_threads


@pytest.fixture
def default_group():
    """``global_masked_whiten`` whitens over ``group`` only where a default process group exists
    (as in a run); a one-rank default group of this process, the thread ranks' group beside it."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _on_two_ranks(job):
    out = run_on_threads(2, lambda r, comm: job(r, comm.pg))
    for r in out:
        assert not isinstance(r, str), r  # a rank's exception, as thread_world reports it
    return out


def _whitened(xs, eps=1e-8):
    mean, var = statistics.mean(xs), statistics.variance(xs)  # unbiased, as masked_whiten
    return [(x - mean) / math.sqrt(var + eps) for x in xs]


# rank 0 holds 1, 2, 4 (and 100 masked out), rank 1 holds 5: mean 3, unbiased variance 10/3
VALUES = [torch.tensor([[1.0, 2.0, 100.0], [4.0, 100.0, 100.0]]), torch.tensor([[5.0, 100.0]])]
MASKS = [torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]]), torch.tensor([[1.0, 0.0]])]
DEV = [[[-2.0, -1.0, 0.0], [1.0, 0.0, 0.0]], [[2.0, 0.0]]]


def test_global_whitening_over_two_ranks_by_hand(default_group):
    def job(r, pg):
        v, m = VALUES[r], MASKS[r]
        return (global_masked_whiten(v, m, group=pg, eps=0.5), global_masked_whiten(v, m, group=pg, shift_mean=False,
                                                                                    eps=0.5),
                global_masked_whiten(v.to(torch.float64), m, group=pg))
    for r, (white, scaled, default_eps) in enumerate(_on_two_ranks(job)):
        dev = torch.tensor(DEV[r])
        want = dev / math.sqrt(10 / 3 + 0.5)
        torch.testing.assert_close(white, want, atol=1e-6, rtol=0)
        torch.testing.assert_close(scaled, (want + 3.0) * MASKS[r], atol=1e-6, rtol=0)
        assert scaled.dtype == default_eps.dtype == torch.float32  # float32 whatever comes in
        torch.testing.assert_close(default_eps, dev / math.sqrt(10 / 3 + 1e-8), atol=1e-6, rtol=0)


def test_global_whitening_needs_two_values_over_every_rank(default_group):
    two = _on_two_ranks(lambda r, pg: global_masked_whiten(torch.tensor([[float(r), 7.0]]), torch.tensor([[1.0, 0.0]]),
                                                           group=pg, eps=0.0))
    # values 0 and 1 (one a rank): mean 1/2, unbiased variance 1/2
    for r, got in enumerate(two):
        torch.testing.assert_close(got, torch.tensor([[(r - 0.5) / math.sqrt(0.5), 0.0]]))
    one = run_on_threads(2, lambda r, comm: global_masked_whiten(torch.ones(1, 2), torch.tensor([[1.0 - r, 0.0]]),
                                                                 group=comm.pg))
    assert one == ["ValueError: an unbiased variance needs at least 2 masked-in values, got 1"] * 2


# test_critic.test_ppo_batch_by_hand's batch, one row a rank: its advantages before whitening are
# -0.0775, 0.485, 0.55 (row 0) and -0.74, -0.72 (row 1; position 0 is prompt)
OLD = torch.tensor([[-1.0, -0.5, -2.0, 0.0], [0.0, -0.3, -0.7, 0.0]])
REF = torch.tensor([[-1.2, -0.4, -2.5, 0.0], [0.0, -0.1, -0.9, 0.0]])
VALS = torch.tensor([[0.5, 0.2, 0.4, 9.0], [7.0, 0.1, -0.3, 0.0]])
MASK = torch.tensor([[1.0, 1, 1, 0], [0, 1, 1, 0]])
SCORES = torch.tensor([1.0, -1.0])
RAW = [-0.0775, 0.485, 0.55, -0.74, -0.72]
RETURNS = torch.tensor([[0.4225, 0.685, 0.95, 0], [0, -0.64, -1.02, 0]])


def _global_advantages(r):
    white = _whitened(RAW)
    row = [white[:3] + [0.0], [0.0] + white[3:] + [0.0]][r]
    return torch.tensor([row])


def test_ppo_batch_whitens_over_the_dp_group(default_group):
    def job(r, pg):
        s = slice(r, r + 1)
        return ppo_batch(OLD[s], REF[s], VALS[s], SCORES[s], MASK[s], kl_coef=0.1, gamma=1.0, lam=0.5, group=pg)
    for r, out in enumerate(_on_two_ranks(job)):
        torch.testing.assert_close(out["advantages"], _global_advantages(r), atol=1e-5, rtol=0)
        torch.testing.assert_close(out["returns"], RETURNS[r:r + 1], atol=1e-6, rtol=0)  # never whitened


def _engine(r, pg):
    return SimpleNamespace(dp=2, dp_rank=r, dp_group=pg)


def test_gae_estimator_whitens_over_the_critics_dp_group(default_group):
    cfg = SimpleNamespace(kl_coef=0.1, kl_estimator="k1", kl_clamp=None, gamma=1.0, lam=0.5, whiten_advantages=True)

    def job(r, pg):
        s = slice(r, r + 1)
        batch = SimpleNamespace(scores=SCORES[s], mask=MASK[s])
        # the actor's group is not the critic's: only the critic's may be used
        return ESTIMATORS["gae"]().tokens(batch, OldPolicy(OLD[s], REF[s], VALS[s]), cfg, _engine(r, None),
                                          _engine(r, pg))
    for r, (adv, returns) in enumerate(_on_two_ranks(job)):
        torch.testing.assert_close(adv, _global_advantages(r), atol=1e-5, rtol=0)
        torch.testing.assert_close(returns, RETURNS[r:r + 1], atol=1e-6, rtol=0)


# RLOO over one group of 4 split between two ranks: scores 1, 0 | 0, 0; k1 KL per sequence 0.5, 0 |
# 0, 1.0 (rank 1's first sequence has a KL of 5 on a token it did not generate: not counted)
RLOO_SCORES = [torch.tensor([1.0, 0.0]), torch.tensor([0.0, 0.0])]
RLOO_MASK = [torch.tensor([[1.0, 1.0], [1.0, 1.0]]), torch.tensor([[1.0, 0.0], [1.0, 1.0]])]
RLOO_OLD = [torch.full((2, 2), -1.0), torch.full((2, 2), -1.0)]
RLOO_REF = [torch.tensor([[-1.5, -1.0], [-1.0, -1.0]]), torch.tensor([[-1.0, -6.0], [-1.25, -1.75]])]


def _rloo(r, pg, with_ref, kl_coef):
    cfg = SimpleNamespace(kl_coef=kl_coef, kl_estimator="k1", kl_clamp=None, group_size=4)
    batch = SimpleNamespace(scores=RLOO_SCORES[r], mask=RLOO_MASK[r], response_mask=RLOO_MASK[r])
    old = OldPolicy(RLOO_OLD[r], RLOO_REF[r] if with_ref else None, None)
    adv, target = ESTIMATORS["rloo"]().tokens(batch, old, cfg, _engine(r, pg), None)
    assert target is None
    return adv


@pytest.mark.parametrize("with_ref, kl_coef, want", [
    # rewards 1 - 0.2·0.5, 0 | 0, 0 - 0.2·1.0 = 0.9, 0 | 0, -0.2 (sum 0.7): A_i = r_i - (0.7 - r_i)/3
    (True, 0.2, [0.9 + 0.2 / 3, -0.7 / 3, -0.7 / 3, -0.2 - 0.9 / 3]),
    # no KL: rewards 1, 0 | 0, 0 -> 1, -1/3 | -1/3, -1/3
    (False, 0.2, [1.0, -1 / 3, -1 / 3, -1 / 3]),
    (True, 0.0, [1.0, -1 / 3, -1 / 3, -1 / 3]),
])
def test_rloo_estimator_takes_the_leave_one_out_mean_across_ranks(with_ref, kl_coef, want):
    for r, adv in enumerate(_on_two_ranks(lambda r, pg: _rloo(r, pg, with_ref, kl_coef))):
        mine = torch.tensor(want[2 * r:2 * r + 2])
        torch.testing.assert_close(adv, mine[:, None] * RLOO_MASK[r], atol=1e-6, rtol=0)
        assert adv.dtype == torch.float32


def test_group_whitened_estimator_whitens_over_every_rank(default_group):
    # rank 0: advantages 1 (2 tokens) and -1 (1 token); rank 1: 0.5 (2 tokens, a third masked out)
    adv = [torch.tensor([1.0, -1.0]), torch.tensor([0.5])]
    mask = [torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]]), torch.tensor([[1.0, 1.0, 0.0]])]

    def job(r, pg):
        batch = SimpleNamespace(advantages=adv[r], mask=mask[r])
        return ESTIMATORS["group_whitened"]().tokens(batch, None, None, _engine(r, pg), None)
    white = _whitened([1.0, 1.0, -1.0, 0.5, 0.5])
    want = [torch.tensor([[white[0], white[1], 0.0], [white[2], 0.0, 0.0]]), torch.tensor([[white[3], white[4], 0.0]])]
    for r, (got, target) in enumerate(_on_two_ranks(job)):
        assert target is None
        torch.testing.assert_close(got, want[r], atol=1e-6, rtol=0)


def test_reinforce_pp_estimator_whitens_its_returns_over_every_rank(default_group):
    # γ = 0.5, k1 KL at 0.1 on rank 0's first token (old -1, ref -2): rewards -0.1, 0, 1 -> returns
    # 0.15, 0.5, 1; rank 1 (no KL, score -1 on its last token, position 1): returns -0.5, -1
    cfg = SimpleNamespace(kl_coef=0.1, kl_estimator="k1", kl_clamp=None, gamma=0.5)
    mask = [torch.tensor([[1.0, 1.0, 1.0]]), torch.tensor([[1.0, 1.0, 0.0]])]
    ref = [torch.tensor([[-2.0, -1.0, -1.0]]), torch.full((1, 3), -1.0)]

    def job(r, pg):
        batch = SimpleNamespace(scores=torch.tensor([1.0 - 2 * r]), mask=mask[r])
        return ESTIMATORS["reinforce_pp"]().tokens(batch, OldPolicy(torch.full((1, 3), -1.0), ref[r], None), cfg,
                                                   _engine(r, pg), None)
    returns = [[0.15, 0.5, 1.0], [-0.5, -1.0, 0.0]]
    white = _whitened([0.15, 0.5, 1.0, -0.5, -1.0])
    want = [[white[:3]], [white[3:] + [0.0]]]
    for r, (got, target) in enumerate(_on_two_ranks(job)):
        torch.testing.assert_close(got, torch.tensor(want[r]), atol=1e-5, rtol=0)
        torch.testing.assert_close(target, torch.tensor([returns[r]]), atol=1e-6, rtol=0)


def test_over_dp_gathers_in_rank_order_in_the_callers_dtype():
    from rlhf_switch.rl.estimators import _over_dp

    def job(r, pg):
        return _over_dp(torch.tensor([10.0 * r + 1, 10.0 * r + 2]), _engine(r, pg))
    for got in _on_two_ranks(job):
        assert got.dtype == torch.float32 and got.tolist() == [1.0, 2.0, 11.0, 12.0]
