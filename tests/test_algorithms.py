"""The algorithm registry (``rlhf_switch/rl/algorithm.py``, ``rl/choices.py``): every advantage
estimator and policy loss against hand-computed values and against its reference formula — the
paper's and the peer implementation's, named in each test — and the algorithm object the loop and
the trainer ranks share (DAPO's dynamic sampling and overlong handling, a user's own class).
Pure torch, one process: seconds."""
from __future__ import annotations

import math

import pytest
import torch
import yaml

from rlhf_switch.rl import algorithms as A
from rlhf_switch.rl.algorithm import Algorithm, OldPolicy, RankBatch, mini_batch_totals
from rlhf_switch.rl.choices import ALGORITHMS
from rlhf_switch.rl.estimators import CRITIC_FREE
from rlhf_switch.rl.config import ConfigError, load_config

from test_rl_pure import CONFIGS


SIZES = ("iterations", "prompts_per_iteration", "group_size", "mini_batch_size", "micro_batch_size",
         "logprob_micro_batch_size", "max_new_tokens", "lr", "temperature")


def config(name: str, **algorithm):
    """The FSDP2 tiny config with algorithm ``name``: its batch sizes, the algorithm's own defaults."""
    data = yaml.safe_load((CONFIGS / "grpo_tiny_fsdp.yaml").read_text())
    data["algorithm"] = {**{k: v for k, v in data["algorithm"].items() if k in SIZES}, "name": name, **algorithm}
    return load_config(data)


def algorithm_problems(cfg):
    """The algorithm block's refusals before a run (``rl.algorithm_rules``)."""
    from rlhf_switch.rl.algorithm_rules import algorithm_problems as problems

    return problems(cfg)


# --- advantage estimators ----------------------------------------------------------------------

def test_rloo_is_the_leave_one_out_mean_baseline():
    """RLOO (Ahmadian et al. 2024): A_i = r_i - mean_{j≠i} r_j; verl writes it as
    G/(G-1)·(r_i - mean) (``compute_rloo_outcome_advantage``)."""
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 1.0, 2.0, 2.0])
    adv = A.rloo_advantages(r, 4)
    assert torch.allclose(adv[:4], torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3]))
    assert torch.allclose(adv[4:], torch.tensor([3 - 5 / 3, 1 - 7 / 3, 2 - 2, 2 - 2]))
    grouped = r.view(2, 4)
    verl = (grouped * 4 / 3 - grouped.mean(1, keepdim=True) * 4 / 3).reshape(-1)
    assert torch.allclose(adv, verl)
    with pytest.raises(ValueError, match="group_size >= 2"):
        A.rloo_advantages(r, 1)


def test_dr_grpo_drops_the_std():
    """Dr. GRPO (Liu et al. 2025): A_i = r_i - mean (no division by the group's std)."""
    alg = Algorithm.build(config("dr_grpo", group_size=4).algorithm)
    assert alg.sequence_advantages([1.0, 0.0, 0.0, 0.0]) == [0.75, -0.25, -0.25, -0.25]
    grpo = Algorithm.build(config("grpo", group_size=4).algorithm).sequence_advantages([1.0, 0.0, 0.0, 0.0])
    assert grpo[0] == pytest.approx(0.75 / (0.5 + 1e-6))  # the unbiased std of (1, 0, 0, 0) is 0.5


def test_discounted_returns_are_reinforce_plus_plus_returns():
    """REINFORCE++ (Hu 2025): R_t = r_t + γ R_{t+1}; verl's loop resets the running return after
    the last response token (``compute_reinforce_plus_plus_outcome_advantage``)."""
    rewards = torch.tensor([[0.0, -0.1, 1.0, 0.0], [0.5, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1, 1, 0], [1.0, 0, 0, 0]])
    got = A.discounted_returns(rewards, mask, gamma=0.9)
    assert torch.allclose(got[0], torch.tensor([-0.1 * 0.9 + 0.81, -0.1 + 0.9, 1.0, 0.0]))
    assert torch.allclose(got[1], torch.tensor([0.5, 0.0, 0.0, 0.0]))
    running, verl = torch.zeros(2), torch.zeros_like(rewards)
    for t in reversed(range(4)):  # verl's loop, as it is written there
        running = rewards[:, t] + 0.9 * running
        verl[:, t] = running
        running = running * mask[:, t]
    assert torch.allclose(got * mask, verl * mask)


def _rank_batch(**per_sequence) -> RankBatch:
    mask = torch.tensor([[1.0, 1, 1, 0], [1.0, 1, 0, 0], [1.0, 1, 1, 1], [1.0, 0, 0, 0]])
    return RankBatch(torch.zeros(4, 5, dtype=torch.long), mask, torch.zeros_like(mask), torch.ones(1), 4, 4,
                     **{k: torch.tensor(v) for k, v in per_sequence.items()})


class OneRank:
    dp, dp_group = 1, None


def test_reinforce_plus_plus_whitens_the_kl_shaped_returns():
    """REINFORCE++: the score on the last token, -kl_coef·KL on every token, returns, whitened
    over the batch (masked mean 0, unbiased variance 1)."""
    cfg = config("reinforce_pp", group_size=1, kl_coef=0.1, kl_estimator="k1").algorithm
    batch = _rank_batch(scores=[1.0, 0.0, 1.0, 0.0])
    old = torch.full((4, 4), -1.0) * batch.mask
    ref = torch.full((4, 4), -1.5) * batch.mask
    adv, returns = Algorithm.build(cfg).estimator.tokens(batch, OldPolicy(old, ref, None), cfg, OneRank(), None)
    kl = (old - ref) * batch.mask  # k1 = log π - log π_ref = 0.5 per token
    expected = A.discounted_returns(A.token_rewards(torch.tensor([1.0, 0, 1, 0]), batch.mask, kl, 0.1), batch.mask)
    assert torch.allclose(returns, expected)
    assert returns[0, 0].item() == pytest.approx(1.0 - 3 * 0.05)  # three tokens' penalties and the score
    assert A.masked_mean(adv, batch.mask).abs() < 1e-6
    assert A.masked_var(adv, batch.mask).item() == pytest.approx(1.0, abs=1e-5)
    assert torch.allclose(adv, A.masked_whiten(expected, batch.mask) * batch.mask)


def test_reinforce_plus_plus_baseline_centres_in_groups_then_whitens():
    """REINFORCE++-baseline (OpenRLHF ``reinforce_baseline``; verl
    ``reinforce_plus_plus_baseline``): the group mean subtracted, each token's value whitened over
    the batch."""
    cfg = config("reinforce_pp_baseline", group_size=2).algorithm
    alg = Algorithm.build(cfg)
    centred = alg.sequence_advantages([1.0, 0.0, 3.0, 1.0])
    assert centred == [0.5, -0.5, 1.0, -1.0]
    batch = _rank_batch(advantages=centred)
    adv, _ = alg.estimator.tokens(batch, OldPolicy(batch.mask * 0, None, None), cfg, OneRank(), None)
    assert torch.allclose(adv, A.masked_whiten(torch.tensor(centred)[:, None] * batch.mask, batch.mask) * batch.mask)


# --- policy losses -----------------------------------------------------------------------------

def test_seq_mean_token_sum_norm_divides_by_a_constant():
    """Dr. GRPO's aggregation: each sequence's token sum over the longest response allowed."""
    loss = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1, 1, 0], [1.0, 0, 0, 0]])
    assert A.aggregate(loss, mask, "seq-mean-token-sum-norm", norm_len=8).item() == pytest.approx((6 / 8 + 4 / 8) / 2)
    with pytest.raises(ValueError, match="needs norm_len"):
        A.aggregate(loss, mask, "seq-mean-token-sum-norm")


def test_gspo_uses_one_ratio_per_sequence_and_its_gradient_is_the_sequence_objective():
    """GSPO (Zheng et al. 2025): s_i = exp(mean_t log π/π_old); GSPO-token carries s_i with each
    token's own gradient, so without clipping d loss / d logp_t = -A_i·s_i/|y_i| (verl
    ``compute_policy_loss_gspo``), the gradient of the sequence-level objective -A_i·s_i."""
    old = torch.tensor([[-1.0, -2.0, -0.5]])
    lp = (old + torch.tensor([[0.1, 0.3, 0.0]])).requires_grad_()
    mask, adv = torch.tensor([[1.0, 1.0, 0.0]]), torch.tensor([[2.0, 2.0, 2.0]])
    loss, st = A.gspo_loss(lp, old, adv, mask, clip_eps=0.5, clip_eps_high=0.5)
    s = math.exp((0.1 + 0.3) / 2)
    assert loss.item() == pytest.approx(-2.0 * s)  # seq-mean-token-mean of -A·s on both tokens
    loss.backward()
    assert torch.allclose(lp.grad, torch.tensor([[-2.0 * s / 2, -2.0 * s / 2, 0.0]]))
    seq = lp.detach().clone().requires_grad_()
    (-2.0 * torch.exp(((seq - old) * mask).sum() / 2)).backward()  # the sequence-level objective
    assert torch.allclose(lp.grad, seq.grad)
    # the paper's tiny range: s = exp(0.2) is far out of [1-3e-4, 1+4e-4] -> clipped, no gradient
    lp.grad = None
    loss, st = A.gspo_loss(lp, old, adv, mask)
    assert loss.item() == pytest.approx(-2.0 * (1 + 4e-4)) and st["clipfrac"].item() == 1.0
    loss.backward()
    assert lp.grad.abs().sum() == 0


def test_cispo_clips_the_weight_and_keeps_every_tokens_gradient():
    """CISPO (MiniMax-M1, 2025): -sg(clip(r, 1-ε_low, 1+ε_high))·A·logp. A token whose ratio is
    above 1+ε_high keeps a gradient (weight 1+ε_high), where PPO-clip gives it none."""
    old = torch.tensor([[-1.0, -1.0]])
    lp = (old + torch.tensor([[0.5, 0.0]])).requires_grad_()  # token 0: r = e^0.5 = 1.65 > 1.28
    mask, adv = torch.ones(1, 2), torch.ones(1, 2)
    loss, st = A.cispo_loss(lp, old, adv, mask, clip_eps=1.0, clip_eps_high=0.28)
    assert loss.item() == pytest.approx(-(1.28 * -0.5 + 1.0 * -1.0) / 2)
    assert st["clipfrac"].item() == 0.5
    loss.backward()
    assert torch.allclose(lp.grad, torch.tensor([[-1.28 / 2, -1.0 / 2]]))
    ppo = lp.detach().clone().requires_grad_()
    A.policy_loss(ppo, old, adv, mask, clip_eps=0.2, clip_eps_high=0.28)[0].backward()
    assert ppo.grad[0, 0] == 0 and ppo.grad[0, 1] != 0


def test_every_named_algorithm_builds_its_pieces():
    for name in CRITIC_FREE:
        alg = Algorithm.build(config(name, group_size=4).algorithm)
        estimator, loss = ALGORITHMS[name]
        assert type(alg.estimator).__name__.lower().startswith(estimator.replace("_", "")[:4]), (name, alg.estimator)
        assert alg.policy_loss.__name__.startswith(loss.split("_")[0]) and not alg.needs_critic
        assert alg.kl_in_loss == (name not in ("reinforce_pp", "rloo")), name


# --- DAPO's options, usable with any group estimator -----------------------------------------------

def test_overlong_penalty_hand_values():
    """DAPO eq. 13: 0 up to L_max - L_cache, linear to -1 at L_max, -1 beyond."""
    got = A.overlong_penalty(torch.tensor([4, 5, 6, 8, 9]), max_len=8, buffer_len=4)
    assert got.tolist() == [0.0, -0.25, -0.5, -1.0, -1.0]
    assert A.overlong_penalty(torch.tensor([6]), 8, 4, factor=0.5).tolist() == [-0.25]


def test_dapo_shapes_masks_and_drops_groups():
    cfg = config("dapo", max_new_tokens=8, overlong={"buffer_len": 4, "mask_truncated": True}).algorithm
    assert (cfg.clip_eps, cfg.clip_eps_high, cfg.kl_coef, cfg.loss_aggregation) == (0.2, 0.28, 0.0, "token-mean")
    alg = Algorithm.build(cfg)
    eos = 2
    responses = [[5, 2], [5] * 5 + [2], [5] * 8, [5] * 7 + [2]]  # lengths 2, 6, 8 (cut), 8
    assert alg.truncated(responses, eos) == [False, False, True, False]
    assert alg.shape_scores([1.0, 1.0, 0.0, 1.0], responses) == [1.0, 0.5, -1.0, 0.0]
    fields = alg.batch_fields([1.0, 0.0, 1.0, 0.0] * 2, [False, False, True, False] * 2)
    assert fields["keep"] == [1.0, 1.0, 0.0, 1.0] * 2
    assert alg.has_signal([1.0, 0.0]) and not alg.has_signal([0.5, 0.5, 0.5])


def test_a_masked_sequence_leaves_the_loss_but_not_the_stale_check():
    batch = {"prompts": [[1, 3], [1, 4]], "responses": [[5, 6], [7]], "rollout_logprobs": [[-1.0, -1.0], [-1.0]],
             "advantages": [1.0, -1.0], "keep": [1.0, 0.0]}
    cfg = config("dapo", group_size=2, prompts_per_iteration=1, mini_batch_size=2, micro_batch_size=2).algorithm
    rows = RankBatch.of(batch, 1, 0, 0, cfg, torch.device("cpu"))
    assert rows.response_mask.sum() == 3 and rows.mask.sum() == 2 and rows.mask[1].sum() == 0
    assert mini_batch_totals(batch["prompts"], batch["responses"], 0, 1, 2, "token-mean", batch["keep"]).tolist() == [2.0]


# --- a user's own algorithm -----------------------------------------------------------------------

class HalfAdvantages(Algorithm):
    """A user's algorithm (``algorithm.name: test_algorithms:HalfAdvantages``): GRPO's pieces,
    every advantage halved."""

    def sequence_advantages(self, scores):
        return [a / 2 for a in super().sequence_advantages(scores)]


def test_a_users_algorithm_class_and_pieces():
    alg = Algorithm.build(config("test_algorithms:HalfAdvantages", group_size=2).algorithm)
    grpo = 0.5 / (2 ** 0.5 / 2 + 1e-6)  # (1 - mean) / (unbiased std + eps) for the group (1, 0)
    assert isinstance(alg, HalfAdvantages) and alg.sequence_advantages([1.0, 0.0]) == pytest.approx([grpo / 2, -grpo / 2])
    alg = Algorithm.build(config("grpo", group_size=2, advantage="rloo", policy_loss="cispo").algorithm)
    # RLOO's rewards carry the KL: its advantages are made on the trainer ranks, not in the driver
    assert alg.sequence_advantages([1.0, 0.0]) is None and type(alg.estimator).__name__ == "RlooAdvantages"
    assert alg.policy_loss.__name__ == "cispo_policy_loss" and not alg.kl_in_loss
    with pytest.raises(ValueError, match="algorithm.name 'test_algorithms:config' is not a subclass"):
        Algorithm.build(config("test_algorithms:config").algorithm)
    with pytest.raises(ValueError, match="cannot be imported: ModuleNotFoundError"):
        Algorithm.build(config("no_such_module:Algo").algorithm)


def test_bad_algorithm_blocks_are_refused_with_one_line_each():
    assert algorithm_problems(config("grpo", group_size=1)) == [
        "algorithm.group_size: 1 — the group estimator compares the samples of a prompt with each other: it needs "
        "group_size >= 2"]
    assert algorithm_problems(config("reinforce_pp", group_size=1, dynamic_sampling={}, norm_adv_by_std=False)) == [
        "algorithm.norm_adv_by_std: the group estimator's; reinforce_pp uses reinforce_pp, which does not read it",
        "algorithm.dynamic_sampling: drops groups whose samples all got the same reward; the reinforce_pp estimator "
        "does not work on groups"]
    with pytest.raises(ConfigError, match="algorithm.policy_loss: unknown policy loss 'clip'"):
        config("grpo", policy_loss="clip")


# --- the loop, with real engines --------------------------------------------------------------------

@pytest.mark.slow
def test_each_kind_of_estimator_and_loss_runs_the_loop(ray_session, tmp_path):
    """RLOO, REINFORCE++ (a per-token estimator whitened across the two DP ranks), GSPO and DAPO
    (dynamic sampling, overlong punishment) through the real loop — FSDP2 DP2 training, the torch
    rollout engine — two iterations each from one warm start: every stale-weights check passes,
    the updates are finite, DAPO's record says what it drew. Then a user's estimator from outside
    the package (``tests/user_pkg``) with a critic, through the same loop."""
    import shutil

    from recipes.common import warm_start
    from recipes.train import run

    init = warm_start(config("grpo"), tmp_path / "init", quiet=True)
    for name in ("rloo", "reinforce_pp", "gspo", "dapo"):
        cfg = config(name).model_dump()
        cfg.update(output_dir=str(tmp_path / name), eval={"every": 0, "num_prompts": 16})
        shutil.copytree(init, tmp_path / name / "init")
        recs = [r for r in run(cfg, iterations=2, quiet=True) if "reward_mean" in r]
        assert [r["iteration"] for r in recs] == [0, 1], name
        for r in recs:
            assert r["stale_check_passed"] and math.isfinite(r["policy_loss"]) and r["optimizer_steps"] > 0, (name, r)
        if name == "dapo":
            assert all(set(r["dynamic_sampling"]) == {"groups_with_signal", "draws", "filled_with_dropped"}
                       for r in recs)
    # an estimator from outside the package, with a critic: the run builds the critic it declares,
    # trains it on the targets the estimator gives, and reads the field it adds
    cfg = config("grpo", advantage=USER_ESTIMATOR, baseline_scale=0.5).model_dump()
    cfg.update(output_dir=str(tmp_path / "user"), eval={"every": 0, "num_prompts": 16},
               critic={"engine": "fsdp2", "dp": 2})
    shutil.copytree(init, tmp_path / "user" / "init")
    recs = [r for r in run(cfg, iterations=2, quiet=True) if "reward_mean" in r]
    assert [r["iteration"] for r in recs] == [0, 1]
    for r in recs:
        assert r["stale_check_passed"] and math.isfinite(r["policy_loss"]) and math.isfinite(r["vf_loss"]), r
    assert recs[0]["value_mean"] != recs[1]["value_mean"], "the critic did not learn"


# --- an estimator from outside the package ----------------------------------------------------------

USER_ESTIMATOR = "user_pkg.estimators:CriticBaseline"


def test_an_estimator_from_outside_the_package_declares_its_needs_and_fields():
    """One file of a user's (``tests/user_pkg/estimators.py``): its declared field is a field of the
    block, its critic is required, and its advantages are what it computes."""
    data = yaml.safe_load((CONFIGS / "ppo_tiny.yaml").read_text())
    data["algorithm"].update(name="grpo", advantage=USER_ESTIMATOR, group_size=2, baseline_scale=0.5,
                             off_policy=None)
    for key in ("gamma", "lam", "whiten_advantages"):
        data["algorithm"].pop(key, None)
    cfg = load_config(data)
    assert cfg.algorithm.baseline_scale == 0.5 and cfg.algorithm.critic_lr == data["algorithm"]["critic_lr"]
    assert algorithm_problems(cfg) == []
    alg = Algorithm.build(cfg.algorithm)
    assert alg.needs_critic and alg.kl_in_loss and alg.sequence_advantages([1.0, 0.0]) is None
    batch = _rank_batch(scores=[1.0, 0.0, 1.0, 0.0])
    values = torch.full((4, 4), 0.4) * batch.mask
    adv, returns = alg.estimator.tokens(batch, OldPolicy(batch.mask * 0, None, values), cfg.algorithm, OneRank(), None)
    assert torch.allclose(adv, (torch.tensor([1.0, 0, 1, 0])[:, None] - 0.2) * batch.mask)
    assert torch.allclose(returns, torch.tensor([1.0, 0, 1, 0])[:, None] * batch.mask)
    # its needs and fields are checked as a built-in's are
    no_critic = load_config({**data, "critic": None})
    assert any(p.startswith("critic: grpo's estimator (user_pkg.estimators:CriticBaseline) uses a critic")
               for p in algorithm_problems(no_critic))
    with pytest.raises(ConfigError, match="algorithm.baseline_scale: Input should be greater than 0"):
        load_config({**data, "algorithm": {**data["algorithm"], "baseline_scale": -1.0}})
    with pytest.raises(ConfigError, match="algorithm.baseline_scal: unknown field in algorithm; did you mean "
                                          "'baseline_scale'"):
        load_config({**data, "algorithm": {**data["algorithm"], "baseline_scal": 1.0}})
