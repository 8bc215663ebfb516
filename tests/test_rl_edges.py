"""The RL formulas (``rlhf_switch/rl/algorithms.py``) at their edges, with hand values: tensors of
different shapes refused with every name and shape, each function's defaults (its paper's values)
used when a caller gives none, empty inputs, the clamps and the masking band at their bounds, rows
without tokens and one-token responses, the value clip on both sides. Each test is there for one
kind of slip a mutation of the module showed no other test notices (``make mutate``,
docs/tests.md). Pure torch, one process: seconds."""
from __future__ import annotations

import math

import pytest
import torch

from rlhf_switch.rl import algorithms as A


# --- tensors of different shapes are refused, every one named -------------------------------------

def _shape_calls():
    """(function, the tensors it checks in the order its message names them, a call on them)."""
    s = torch.ones(2)
    return [
        ("discounted_returns", ("rewards", "mask"), lambda t: A.discounted_returns(**t)),
        ("off_policy_weights", ("logprobs", "behaviour_logprobs", "mask"), lambda t: A.off_policy_weights(**t)),
        ("policy_loss", ("logprobs", "old_logprobs", "advantages", "mask"), lambda t: A.policy_loss(**t)),
        ("gspo_loss", ("logprobs", "old_logprobs", "advantages", "mask"), lambda t: A.gspo_loss(**t)),
        ("cispo_loss", ("logprobs", "old_logprobs", "advantages", "mask"), lambda t: A.cispo_loss(**t)),
        ("kl_penalty", ("logprobs", "ref_logprobs"), lambda t: A.kl_penalty(**t)),
        ("token_rewards", ("kl", "mask"), lambda t: A.token_rewards(s, t["mask"], t["kl"], kl_coef=0.1)),
        ("gae", ("values", "rewards", "mask"), lambda t: A.gae(**t)),
        ("value_loss", ("values", "old_values", "returns", "mask"), lambda t: A.value_loss(**t)),
        ("ppo_batch", ("old_logprobs", "values", "mask"),
         lambda t: A.ppo_batch(t["old_logprobs"], None, t["values"], s, t["mask"])),
    ]


@pytest.mark.parametrize("fn, names, call", _shape_calls(), ids=[c[0] for c in _shape_calls()])
def test_tensors_of_different_shapes_are_refused_each_named(fn, names, call):
    for odd in names:
        tensors = {n: torch.ones(2, 4) if n == odd else torch.ones(2, 3) for n in names}
        want = "shapes differ: " + ", ".join(f"{n}={tuple(t.shape)}" for n, t in tensors.items())
        with pytest.raises(ValueError) as info:
            call(tensors)
        assert str(info.value) == want, (fn, odd)


# --- the errors say what is wrong, in full -------------------------------------------------------

def test_error_messages_in_full():
    def message(fn, *args, **kwargs):
        with pytest.raises(ValueError) as info:
            fn(*args, **kwargs)
        return str(info.value)

    one = torch.tensor([1.0])
    assert message(A.masked_var, one, one) == "an unbiased variance needs at least 2 masked-in values, got 1"
    assert message(A.rloo_advantages, torch.ones(5), 2) == "5 rewards do not split into groups of 2"
    loss, mask = torch.ones(1, 2), torch.ones(1, 2)
    assert message(A.aggregate, loss, mask, "seq-mean-token-sum-norm") == (
        "seq-mean-token-sum-norm needs norm_len (the longest response allowed)")
    assert message(A.aggregate, loss, mask, "sum") == (
        "unknown loss aggregation 'sum'; known: token-mean, seq-mean-token-mean, seq-mean-token-sum, "
        "seq-mean-token-sum-norm")
    assert message(A.kl_penalty, loss, loss, "k4") == "unknown KL estimator 'k4'; known: k1, k2, k3"
    assert message(A.off_policy_weights, loss, loss, mask, "vtrace") == (
        "unknown off-policy correction 'vtrace'; known: tis, icepop, seq_tis, seq_mask")
    assert message(A.overlong_penalty, torch.tensor([3]), 4, 0) == (
        "the overlong buffer must be within the response limit: 0 < 0 <= 4")
    assert message(A.overlong_penalty, torch.tensor([3]), 4, 5) == (
        "the overlong buffer must be within the response limit: 0 < 5 <= 4")


# --- the defaults are the papers' -------------------------------------------------------------------

def test_defaults_when_the_caller_gives_none():
    loss = torch.tensor([[1.0, 3.0, 100.0], [2.0, 2.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    assert A.aggregate(loss, mask).item() == pytest.approx(13 / 5)  # token-mean
    lp, ref = torch.tensor([-1.0]), torch.tensor([-1.5])
    assert A.kl_penalty(lp, ref).item() == pytest.approx(math.exp(-0.5) - 1 + 0.5)  # k3, unclamped
    # GAE with γ = 1, λ = 0.95: δ1 = 1 - 0.2 = 0.8; δ0 = 0.2 - 0.5 = -0.3, A0 = -0.3 + 0.95·0.8
    adv, ret = A.gae(torch.tensor([[0.5, 0.2]]), torch.tensor([[0.0, 1.0]]), torch.ones(1, 2))
    assert adv[0].tolist() == pytest.approx([0.46, 0.8]) and ret[0].tolist() == pytest.approx([0.96, 1.0])
    # token rewards: no KL unless a coefficient is given
    kl = torch.ones(1, 2)
    assert A.token_rewards(torch.tensor([1.0]), torch.ones(1, 2), kl).tolist() == [[0.0, 1.0]]
    # the value clip: ε = 0.2 (V 0.5 against V_old 1.0 clipped to 0.8; R = 0: ½·0.8²)
    one = torch.ones(1, 1)
    assert A.value_loss(0.5 * one, one, 0 * one, one)[0].item() == pytest.approx(0.32)


def test_off_policy_weight_defaults_tis_cap_2_and_band_half_to_5():
    ratios = [3.0, 0.6, 5.5, 1.0]
    lp, mask = torch.zeros(1, 4), torch.ones(1, 4)
    behaviour = -torch.log(torch.tensor([ratios]))
    assert A.off_policy_weights(lp, behaviour, mask).tolist()[0] == pytest.approx([2.0, 0.6, 2.0, 1.0])
    got = A.off_policy_weights(lp, behaviour, mask, "icepop").tolist()[0]
    assert got == pytest.approx([3.0, 0.6, 0.0, 1.0])


def test_gspo_defaults_are_the_papers_tiny_range():
    """GSPO's 3e-4 below 1: with A < 0 a sequence ratio of e^-0.2 is clipped up to 1 - 3e-4."""
    old, lp = torch.zeros(1, 2), torch.full((1, 2), -0.2)
    loss, st = A.gspo_loss(lp, old, -torch.ones(1, 2), torch.ones(1, 2))
    assert loss.item() == pytest.approx(1 - 3e-4) and st["clipfrac"].item() == 1.0


def test_cispo_defaults_clip_above_at_1_28_only():
    old, mask, adv = torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2)
    lp = torch.log(torch.tensor([[1.5, 0.3]]))
    loss, st = A.cispo_loss(lp, old, adv, mask)
    assert loss.item() == pytest.approx(-(1.28 * math.log(1.5) + 0.3 * math.log(0.3)) / 2, rel=1e-6)
    assert st["clipfrac"].item() == 0.5


# --- each option does what it says -------------------------------------------------------------------

def test_clip_eps_high_none_means_clip_eps_in_every_loss():
    old, mask, adv = torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1)
    lp = torch.tensor([[0.5]])  # r = e^0.5 = 1.65: above 1.2
    assert A.policy_loss(lp, old, adv, mask, 0.2, None)[0].item() == pytest.approx(-1.2)
    assert A.gspo_loss(lp, old, adv, mask, 0.2, None)[0].item() == pytest.approx(-1.2)
    # CISPO: -sg(w)·A·logp with w = 1.2
    assert A.cispo_loss(lp, old, adv, mask, 0.2, None)[0].item() == pytest.approx(-1.2 * 0.5)


def test_cispo_lower_bound_where_one_is_given():
    old, mask, adv = torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1)
    lp = torch.tensor([[math.log(0.5)]])
    loss, st = A.cispo_loss(lp, old, adv, mask, clip_eps=0.2, clip_eps_high=0.2)
    assert loss.item() == pytest.approx(-0.8 * math.log(0.5)) and st["clipfrac"].item() == 1.0


@pytest.mark.parametrize("fn, want", [(A.policy_loss, -0.5), (A.gspo_loss, -0.5), (A.cispo_loss, 0.5)])
def test_every_loss_passes_norm_len_to_dr_grpos_aggregation(fn, want):
    """Two sequences of 2 and 1 tokens, r = 1, logp = -1: per token -A (PPO, GSPO) or -A·logp = A
    (CISPO); each sequence's sum over norm_len = 4, then their mean."""
    lp, mask = torch.full((2, 2), -1.0), torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    adv = torch.tensor([[1.0, 1.0], [2.0, 2.0]])
    loss, _ = fn(lp, lp.clone(), adv, mask, 0.2, 0.2, "seq-mean-token-sum-norm", 4)
    assert loss.item() == pytest.approx(want)


def test_log_ratios_are_clamped_on_both_sides_and_not_when_told():
    old, mask = torch.zeros(1, 1), torch.ones(1, 1)
    for fn in (A.policy_loss, A.cispo_loss):
        _, st = fn(torch.tensor([[-30.0]]), old, torch.ones(1, 1), mask)
        assert st["ratio"].item() == pytest.approx(math.exp(-20.0), rel=1e-5), fn.__name__
        _, st = fn(torch.tensor([[30.0]]), old, torch.ones(1, 1), mask)
        assert st["ratio"].item() == pytest.approx(math.exp(20.0), rel=1e-5), fn.__name__
    loss, st = A.policy_loss(torch.tensor([[30.0]]), old, -torch.ones(1, 1), mask, log_ratio_clamp=None)
    assert loss.item() == pytest.approx(math.exp(30.0), rel=1e-5) and st["ratio"].item() == pytest.approx(math.exp(30.0), rel=1e-5)
    # GSPO's own guard: log s at most 10 (verl)
    loss, _ = A.gspo_loss(torch.full((1, 2), 10.5), torch.zeros(1, 2), -torch.ones(1, 2), torch.ones(1, 2), 0.2, 0.2)
    assert loss.item() == pytest.approx(math.exp(10.0), rel=1e-5)


def test_ratio_stats_approx_kl_is_old_minus_new_over_the_mask():
    lp = torch.tensor([[0.1, -0.2, 5.0]])
    _, st = A.policy_loss(lp, torch.zeros(1, 3), torch.ones(1, 3), torch.tensor([[1.0, 1.0, 0.0]]))
    assert st["approx_kl"].item() == pytest.approx(0.05)
    assert st["ratio"].item() == pytest.approx((math.exp(0.1) + math.exp(-0.2)) / 2)


def test_dual_clip_takes_any_c_above_1():
    """c = 1.5: a ratio of 3 with A = -1 costs min(max(3, 1.2), 1.5) = 1.5."""
    loss, st = A.policy_loss(torch.tensor([[math.log(3.0)]]), torch.zeros(1, 1), -torch.ones(1, 1), torch.ones(1, 1),
                             dual_clip=1.5)
    assert loss.item() == pytest.approx(1.5) and st["clipfrac"].item() == 1.0


def test_kl_clamp_bounds_negative_estimates_too():
    lp, ref = torch.tensor([-5.0, -1.0]), torch.tensor([8.0, -1.5])  # log r = 13, -0.5
    assert A.kl_penalty(lp, ref, "k1", clamp=10.0).tolist() == pytest.approx([-10.0, 0.5])


# --- the masking band and the sequence clamps at their bounds ----------------------------------------

@pytest.mark.parametrize("correction", ["icepop", "seq_mask"])
def test_a_ratio_exactly_at_the_band_edge_stays(correction):
    lp, behaviour, mask = torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2)  # ρ = 1 exactly
    assert A.off_policy_weights(lp, behaviour, mask, correction, low=1.0, high=2.0).tolist() == [[1.0, 1.0]]
    assert A.off_policy_weights(lp, behaviour, mask, correction, low=0.5, high=1.0).tolist() == [[1.0, 1.0]]
    assert A.off_policy_weights(lp, behaviour, mask, correction, low=1.5, high=2.0).tolist() == [[0.0, 0.0]]


def test_sequence_ratios_are_clamped_at_e_to_the_20_on_both_sides():
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    up = A.off_policy_weights(torch.tensor([[13.0, 12.0, 99.0]]), torch.zeros(1, 3), mask, "seq_tis", cap=1e12)
    assert up[0, :2].tolist() == pytest.approx([math.exp(20.0)] * 2, rel=1e-6) and up[0, 2] == 0
    down = A.off_policy_weights(torch.tensor([[-13.0, -12.0, 0.0]]), torch.zeros(1, 3), mask, "seq_mask",
                                low=1e-12, high=1.0)
    assert down[0, :2].tolist() == pytest.approx([math.exp(-20.0)] * 2, rel=1e-5) and down[0, 2] == 0


def test_mismatch_statistics_at_their_edges():
    assert A.mismatch_stats(torch.zeros(0), torch.zeros(0)) == {
        "tokens": 0, "sequences": 0, "logprob_diff_max": 0.0, "logprob_diff_mean": 0.0, "logprob_diff_p99": 0.0,
        "kl": 0.0, "seq_ratio_mean": 1.0, "seq_ratio_min": 1.0, "seq_ratio_max": 1.0}
    st = A.mismatch_stats(torch.tensor([0.5]), torch.tensor([25.0, -25.0, 0.0]))
    assert st["seq_ratio_max"] == pytest.approx(math.exp(20.0)) and st["seq_ratio_min"] == pytest.approx(math.exp(-20.0))
    assert st["seq_ratio_mean"] == pytest.approx((math.exp(20.0) + math.exp(-20.0) + 1.0) / 3)
    assert A.mismatch_over_ranks([]) == {f"mismatch_{k}": v for k, v in A.mismatch_stats(torch.zeros(0),
                                                                                       torch.zeros(0)).items()}
    shares = [{"dp_rank": 1, "log_ratio": [0.0, 0.1], "seq_log_ratio": [0.3, -0.1]},
              {"dp_rank": 0, "log_ratio": [0.2], "seq_log_ratio": [0.2, 0.0]}]
    merged = A.mismatch_over_ranks(shares)
    assert (merged["mismatch_tokens"], merged["mismatch_sequences"]) == (3, 4)
    assert merged["mismatch_seq_ratio_max"] == pytest.approx(math.exp(0.3))
    assert merged["mismatch_seq_ratio_mean"] == pytest.approx(sum(map(math.exp, (0.2, 0.0, 0.3, -0.1))) / 4)


# --- small batches: exactly two values, one token, rows without tokens, no spread ---------------------

def test_small_batches():
    # exactly two masked-in values: the unbiased variance exists
    assert A.masked_var(torch.tensor([1.0, 3.0, 100.0]), torch.tensor([1, 1, 0])).item() == pytest.approx(2.0)
    # values without spread whiten to 0, not nan (the eps under the root)
    assert A.masked_whiten(torch.full((1, 3), 2.0), torch.ones(1, 3)).tolist() == [[0.0, 0.0, 0.0]]
    # one-token responses
    assert A.discounted_returns(torch.tensor([[2.0]]), torch.ones(1, 1)).tolist() == [[2.0]]
    adv, ret = A.gae(torch.tensor([[0.5]]), torch.tensor([[1.0]]), torch.ones(1, 1))
    assert (adv.item(), ret.item()) == (0.5, 1.0)
    # the score lands on the last token, also when that is position 0; a row without tokens gets nothing
    mask = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 1.0, 1.0]])
    scores = torch.tensor([1.0, 2.0, 3.0])
    want = [[1.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 3.0]]
    assert A.token_rewards(scores, mask).tolist() == want
    assert A.token_rewards(scores, mask, None, kl_coef=0.1).tolist() == want  # a coefficient without a KL
    # the overlong buffer may be one token, or the whole limit
    assert A.overlong_penalty(torch.tensor([2, 3, 4, 5]), max_len=4, buffer_len=1).tolist() == [0.0, 0.0, -1.0, -1.0]
    assert A.overlong_penalty(torch.tensor([0, 2, 4]), max_len=4, buffer_len=4).tolist() == [0.0, -0.5, -1.0]


def test_last_token_index_stays_on_the_masks_device():
    """The meta device stands in for a GPU: positions made on the CPU would not meet the mask."""
    assert A.last_token_index(torch.ones(2, 3, device="meta")).device.type == "meta"


# --- the value clip, on both sides -------------------------------------------------------------------

def test_value_loss_clips_on_both_sides_around_the_old_value():
    one = torch.ones(1, 1)
    # V = 0.5 fell 0.5 below V_old = 1: clipped to 0.8; R = 0: max(0.25, 0.64) / 2
    loss, st = A.value_loss(0.5 * one, one, 0 * one, one, clip_eps=0.2)
    assert loss.item() == pytest.approx(0.32) and st["vf_clipfrac"].item() == 1.0
    # V = 0.9 inside the range: no clip; R = 0: 0.81 / 2
    loss, st = A.value_loss(0.9 * one, one, 0 * one, one, clip_eps=0.2)
    assert loss.item() == pytest.approx(0.405) and st["vf_clipfrac"].item() == 0.0
    # unclipped: no clip fraction either
    loss, st = A.value_loss(0.5 * one, one, 0 * one, one, clip_eps=None)
    assert loss.item() == pytest.approx(0.125) and st["vf_clipfrac"].item() == 0.0


def test_value_loss_aggregates_as_told():
    values, mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]]), torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    zeros = torch.zeros(2, 2)
    assert A.value_loss(values, zeros, zeros, mask, None)[0].item() == pytest.approx(0.5)
    assert A.value_loss(values, zeros, zeros, mask, None, "seq-mean-token-sum")[0].item() == pytest.approx(0.75)


# --- ppo_batch's defaults and dtypes -----------------------------------------------------------------

def test_ppo_batch_defaults_are_instructgpts_k1_at_005_and_gae_1_095_whitened():
    """One sequence of two tokens: old -1, -1 and ref -1.5, -1 (k1: 0.5, 0); values 0.5, 0.2; score 1.
    Rewards -0.05·0.5, 1; δ1 = 1 - 0.2 = 0.8 = A1; δ0 = -0.025 + 0.2 - 0.5 = -0.325,
    A0 = -0.325 + 0.95·0.8 = 0.435; returns A + V = 0.935, 1.0. Two values whitened: ∓1/√2."""
    old, ref = torch.tensor([[-1.0, -1.0]]), torch.tensor([[-1.5, -1.0]])
    values, mask, score = torch.tensor([[0.5, 0.2]]), torch.ones(1, 2), torch.tensor([1.0])
    raw = A.ppo_batch(old, ref, values, score, mask, whiten=False)
    assert raw["kl"][0].tolist() == pytest.approx([0.5, 0.0])
    assert raw["rewards"][0].tolist() == pytest.approx([-0.025, 1.0])
    assert raw["advantages"][0].tolist() == pytest.approx([0.435, 0.8])
    assert raw["returns"][0].tolist() == pytest.approx([0.935, 1.0])
    white = A.ppo_batch(old, ref, values, score, mask)
    assert white["advantages"][0].tolist() == pytest.approx([-1 / math.sqrt(2), 1 / math.sqrt(2)], abs=1e-6)


def test_ppo_batch_and_token_rewards_are_float32_whatever_comes_in():
    """Without a reference the KL is zeros of the same dtype as with one (float32); the rewards
    are float32 even where torch's default dtype is float64."""
    old = torch.zeros(1, 2, dtype=torch.float64)
    out = A.ppo_batch(old, None, old, torch.tensor([1.0]), torch.ones(1, 2), whiten=False)
    assert out["kl"].dtype == torch.float32
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        rewards = A.token_rewards(torch.tensor([1.0]), torch.ones(1, 2))
    finally:
        torch.set_default_dtype(default)
    assert rewards.dtype == torch.float32 and rewards.tolist() == [[0.0, 1.0]]


def test_global_whitening_without_a_process_group_is_masked_whitening_as_told():
    """No process group (one process): ``masked_whiten`` with the caller's ``shift_mean`` and
    ``eps``. Values 1, 3 (9 masked out): mean 2, unbiased variance 2; eps 2 -> ∓1/2."""
    x, mask = torch.tensor([[1.0, 3.0, 9.0]]), torch.tensor([[1.0, 1.0, 0.0]])
    assert A.global_masked_whiten(x, mask, eps=2.0).tolist() == [[-0.5, 0.5, 0.0]]
    assert A.global_masked_whiten(x, mask, shift_mean=False, eps=2.0).tolist() == [[1.5, 2.5, 0.0]]
