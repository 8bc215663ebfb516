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
from rlhf_switch.rl.algorithm import Algorithm, OldPolicy, RankBatch, loss_weight, mini_batch_totals, pad_batch
from rlhf_switch.rl.choices import ALGORITHMS
from rlhf_switch.rl.estimators import CRITIC_FREE, Estimator
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
    values = cfg.algorithm.values()  # what the paper rules read: every field, the estimator's own too
    assert set(values) == set(type(cfg.algorithm).model_fields) | {"baseline_scale"} and values["baseline_scale"] == 0.5
    assert values["clip_eps"] == cfg.algorithm.clip_eps and "baseline_scale" not in config("grpo").algorithm.values()
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
    # an estimator that does not import: the block loads (without fields of its own) and the check says why
    missing = load_config({**data, "algorithm": {**{k: v for k, v in data["algorithm"].items() if k != "baseline_scale"},
                                                 "advantage": "no_such_module:Estimator"}})
    assert set(missing.algorithm.values()) == set(type(missing.algorithm).model_fields)
    (problem,) = algorithm_problems(missing)
    assert problem.startswith("algorithm.advantage 'no_such_module:Estimator' cannot be imported")


# --- the registries and the rules, called at test time --------------------------------------------
# (PAPER_RULES and the registered estimators are built when the modules are imported; these tests
# call the builders themselves, so a slip in one shows here and not only in a table built before it)

def test_paper_rule_builders():
    from rlhf_switch.rl.choices import _at_most, _equals, off_paper

    rule = _equals("kl_coef", 0.0)
    assert (rule.field, rule.paper) == ("kl_coef", "0.0")
    assert rule.holds({"kl_coef": 0.0}) and not rule.holds({"kl_coef": 0.1}) and not rule.holds({})
    rule = _at_most("clip_eps", 1e-3, "3e-4 (at most 1e-3)")
    assert (rule.field, rule.paper) == ("clip_eps", "3e-4 (at most 1e-3)")
    assert rule.holds({"clip_eps": 1e-3}) and rule.holds({"clip_eps": 3e-4})
    assert not rule.holds({"clip_eps": 2e-3}) and not rule.holds({"clip_eps": None}) and not rule.holds({})
    broken = off_paper("gspo", {"clip_eps": 0.2, "clip_eps_high": 4e-4, "loss_aggregation": "token-mean",
                                "kl_coef": 0.0})
    assert [(r.field, value) for r, value in broken] == [("clip_eps", 0.2), ("loss_aggregation", "token-mean")]
    assert off_paper("grpo", {"clip_eps": 0.9}) == [] and off_paper("my_pkg:Algo", {}) == []


def test_register_estimator_refuses_a_nameless_or_taken_name():
    from rlhf_switch.rl.estimators import ESTIMATORS, Estimator, register_estimator

    class Nameless(Estimator):
        pass

    class Taken(Estimator):
        name = "group"

    class Fresh(Estimator):
        name = "test_fresh"

    with pytest.raises(ValueError) as info:
        register_estimator(Nameless)
    assert str(info.value) == "an estimator needs a name of its own: Nameless has ''"
    with pytest.raises(ValueError, match="an estimator needs a name of its own: Taken has 'group'"):
        register_estimator(Taken)
    assert ESTIMATORS["group"].__name__ == "GroupAdvantages"
    try:
        assert register_estimator(Fresh) is Fresh and ESTIMATORS["test_fresh"] is Fresh
    finally:
        ESTIMATORS.pop("test_fresh", None)


def test_all_fields_are_every_estimators_declared_once():
    from pydantic import Field

    from rlhf_switch.rl.estimators import CRITIC_FIELDS, ESTIMATORS, Estimator, all_fields

    got = all_fields()
    assert set(got) == {"norm_adv_by_std", "adv_eps", "gamma", "lam", "whiten_advantages", *CRITIC_FIELDS}
    assert got["lam"] is ESTIMATORS["gae"].fields["lam"] and got["critic_lr"] is CRITIC_FIELDS["critic_lr"]

    class OtherGamma(Estimator):
        name, fields = "test_other_gamma", {"gamma": (float, Field(0.5))}

    ESTIMATORS[OtherGamma.name] = OtherGamma
    try:
        with pytest.raises(ValueError) as info:
            all_fields()
        assert str(info.value).startswith("estimators declare algorithm.gamma differently: ")
        assert "default=1.0" in str(info.value) and "default=0.5" in str(info.value)
    finally:
        ESTIMATORS.pop(OtherGamma.name)


# --- an algorithm whose config block has only what the algorithm reads ----------------------------

def test_an_algorithm_on_a_bare_config_object():
    """``Algorithm`` reads DAPO's and the off-policy options only where the config object has them
    (a user's own config object need not)."""
    from types import SimpleNamespace

    cfg = SimpleNamespace(name="grpo", group_size=2, norm_adv_by_std=True, adv_eps=1e-6, max_new_tokens=4)
    alg = Algorithm(cfg)
    assert alg.has_signal([1.0, 0.0]) and not alg.has_signal([1.0, 1.0], raw=[1.0, 1.0])
    assert alg.shape_scores([1.0, 0.5], [[5] * 4, [5]]) == [1.0, 0.5]
    assert alg.batch_fields([1.0, 0.0]) == {"advantages": pytest.approx([0.7071058, -0.7071058])}
    adv = torch.ones(1, 2)
    batch = RankBatch(torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 2), torch.zeros(1, 2), torch.ones(1), 1, 1)
    assert alg.correct_off_policy(adv, batch, OldPolicy(torch.zeros(1, 2), None, None)) == (adv, {})


def test_shape_scores_with_and_without_the_penalty():
    responses = [[5] * 8, [5] * 6, [5] * 2]  # max_new_tokens 8, buffer 4: penalties -1, -0.5, 0
    plain = Algorithm.build(config("grpo", max_new_tokens=8).algorithm)
    assert plain.shape_scores([1.0, 1.0, 0.0], responses) == [1.0, 1.0, 0.0]
    half = Algorithm.build(config("dapo", max_new_tokens=8, overlong={"buffer_len": 4, "penalty": 0.5}).algorithm)
    assert half.shape_scores([1.0, 1.0, 0.0], responses) == [0.5, 0.75, 0.0]
    off = Algorithm.build(config("dapo", max_new_tokens=8, overlong={"buffer_len": 4, "penalty": 0.0}).algorithm)
    assert off.shape_scores([1.0, 1.0, 0.0], responses) == [1.0, 1.0, 0.0]


def test_rloo_without_a_reference_has_no_kl_in_its_rewards():
    cfg = config("rloo", group_size=2, kl_coef=0.1).algorithm
    batch = _rank_batch(scores=[1.0, 0.0, 3.0, 1.0])
    adv, _ = Algorithm.build(cfg).estimator.tokens(batch, OldPolicy(batch.mask * 0, None, None), cfg, OneRank0(), None)
    assert torch.allclose(adv, torch.tensor([1.0, -1.0, 2.0, -2.0])[:, None] * batch.mask)


class OneRank0(OneRank):
    dp_rank = 0


# --- the batch one trainer rank holds --------------------------------------------------------------

def test_pad_batch_ids_targets_and_mask():
    ids, targets, mask = pad_batch([[1, 3], [1, 4, 5]], [[6, 2], [7]], pad_id=0)
    assert ids.tolist() == [[1, 3, 6, 2], [1, 4, 5, 7]] and ids.dtype == torch.long
    assert targets.tolist() == [[3, 6, 2], [4, 5, 7]]
    assert mask.tolist() == [[0.0, 1.0, 1.0], [0.0, 0.0, 1.0]] and mask.dtype == torch.float32


def test_loss_weight_counts_tokens_or_sequences_with_tokens():
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    assert loss_weight(mask, "token-mean").item() == 3.0
    for mode in ("seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
        assert loss_weight(mask, mode).item() == 2.0


def test_mini_batch_totals_over_ranks_and_steps():
    """Rank r holds rows [r·per, (r+1)·per); step s takes local_mini of each rank's rows."""
    prompts = [[1]] * 8
    responses = [[5] * n for n in (1, 2, 3, 4, 5, 6, 7, 8)]
    # dp 2, per 4, local_mini 2: step 0 = rows 0, 1 | 4, 5; step 1 = rows 2, 3 | 6, 7
    got = mini_batch_totals(prompts, responses, 0, 2, 2, "token-mean")
    assert got.tolist() == [1 + 2 + 5 + 6, 3 + 4 + 7 + 8] and got.dtype == torch.float64
    keep = [1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0]
    assert mini_batch_totals(prompts, responses, 0, 2, 2, "token-mean", keep).tolist() == [1 + 6, 3 + 4 + 7 + 8]
    assert mini_batch_totals(prompts, responses, 0, 2, 2, "seq-mean-token-mean", keep).tolist() == [2, 4]


def _two_samples(**extra):
    return {"prompts": [[1, 3], [1, 4]], "responses": [[5, 6], [7]], "rollout_logprobs": [[-1.0, -2.0], [-0.5]],
            **extra}


def _cfg(**algorithm):
    return config("grpo", group_size=2, prompts_per_iteration=1, mini_batch_size=2, micro_batch_size=2,
                  **algorithm).algorithm


def test_rank_batch_of_a_batch():
    rows = RankBatch.of(_two_samples(scores=[1, 0], keep=[1.0, 0.0], fresh=[True, [False]]), 1, 0, 0, _cfg(),
                        torch.device("cpu"))
    assert rows.ids.tolist() == [[1, 3, 5, 6], [1, 4, 7, 0]]
    assert rows.response_mask.tolist() == [[0.0, 1.0, 1.0], [0.0, 1.0, 0.0]]
    assert rows.mask.tolist() == [[0.0, 1.0, 1.0], [0.0, 0.0, 0.0]]  # the second sample kept out of the loss
    assert rows.rollout_logprobs.tolist() == [[0.0, -1.0, -2.0], [0.0, -0.5, 0.0]]
    assert rows.totals.tolist() == [2.0]  # the kept-out sample weighs nothing
    # a reward function's integer scores become float32, as the losses compute in
    assert rows.scores.tolist() == [1.0, 0.0] and rows.scores.dtype == torch.float32 and rows.advantages is None
    assert rows.fresh.tolist() == [[False, True, True], [False, False, False]]
    assert rows.checked_mask.tolist() == [[0.0, 1.0, 1.0], [0.0, 0.0, 0.0]]
    # per generated token (partial rollout: the versions a sample's tokens were made with)
    rows = RankBatch.of(_two_samples(advantages=[0.5, -0.5], fresh=[[False, True], [True]]), 1, 0, 0, _cfg(),
                        torch.device("cpu"))
    assert rows.fresh.tolist() == [[False, False, True], [False, True, False]] and rows.scores is None
    # no fresh flags: every token is checked
    rows = RankBatch.of(_two_samples(advantages=[0.5, -0.5]), 1, 0, 0, _cfg(), torch.device("cpu"))
    assert rows.fresh is None and rows.checked_mask.tolist() == rows.response_mask.tolist()


def test_rank_batch_of_each_rank_and_the_micro_batch():
    batch = {"prompts": [[1, 3]] * 4, "responses": [[5], [5, 6], [6], [6, 5, 2]], "rollout_logprobs": [[-1.0]] * 4,
             "advantages": [1.0, 2.0, 3.0, 4.0]}
    cfg = config("grpo", group_size=2, prompts_per_iteration=2, mini_batch_size=4, micro_batch_size=8).algorithm
    ranks = [RankBatch.of(batch, 2, r, 0, cfg, torch.device("cpu")) for r in (0, 1)]
    assert [r.advantages.tolist() for r in ranks] == [[1.0, 2.0], [3.0, 4.0]]
    assert [r.mask.sum(-1).tolist() for r in ranks] == [[1.0, 2.0], [1.0, 3.0]]
    assert [r.totals.tolist() for r in ranks] == [[7.0], [7.0]]  # the whole mini-batch's tokens, on each rank
    # a micro-batch larger than the rank's mini-batch shrinks to it (an integer: a row count)
    assert ranks[0].local_mini == 2 and ranks[0].micro == 2 and isinstance(ranks[0].micro, int)


def test_rank_batch_of_refuses_what_does_not_divide():
    def refused(batch, dp, **algorithm):
        with pytest.raises(ValueError) as info:
            RankBatch.of(batch, dp, 0, 0, config("grpo", **algorithm).algorithm, torch.device("cpu"))
        return str(info.value)

    six = {"prompts": [[1]] * 6, "responses": [[5]] * 6, "rollout_logprobs": [[-1.0]] * 6, "advantages": [0.0] * 6}
    assert refused(six, 1, group_size=2, prompts_per_iteration=3, mini_batch_size=4) == (
        "batch 6, mini-batch 4 and DP 1 do not divide")
    assert refused(six, 2, group_size=2, prompts_per_iteration=3, mini_batch_size=3) == (
        "batch 6, mini-batch 3 and DP 2 do not divide")
    assert refused(six, 1, group_size=2, prompts_per_iteration=3, mini_batch_size=3, micro_batch_size=2) == (
        "micro_batch_size 2 does not divide the per-rank mini-batch 3")


def test_rank_batch_of_keeps_every_tensor_on_the_device():
    """The meta device stands in for a GPU: a tensor made on the CPU would not follow."""
    rows = RankBatch.of(_two_samples(advantages=[0.5, -0.5], keep=[1.0, 0.0], fresh=[True, False]), 1, 0, 0, _cfg(),
                        torch.device("meta"))
    for name in ("ids", "mask", "response_mask", "rollout_logprobs", "advantages", "fresh"):
        assert getattr(rows, name).device.type == "meta", name


def test_a_rank_batch_made_by_hand_checks_every_generated_token():
    mask = torch.tensor([[1.0, 0.0]])
    rows = RankBatch(torch.zeros(1, 3, dtype=torch.long), mask, torch.zeros(1, 2), torch.ones(1), 1, 1)
    assert rows.response_mask is mask and rows.checked_mask is mask


# --- the off-policy correction and the update's own checks ----------------------------------------

def test_correct_off_policy_by_hand():
    """IcePop over [0.8, 1.3] on a batch of a fresh and a stale sample: ρ = 1.1, 2.0 | 0.5 (and a
    padding position): weights 1.1, 0 | 0 with ``correct: all``; the fresh sample keeps 1 with
    ``stale``; ``none`` leaves the advantages alone."""
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    rows = RankBatch(torch.zeros(2, 3, dtype=torch.long), mask, torch.zeros(2, 2), torch.ones(1), 2, 2,
                     fresh=torch.tensor([[True, True], [False, False]]))
    old = OldPolicy(torch.log(torch.tensor([[1.1, 2.0], [0.5, 1.0]])), None, None)
    adv = torch.tensor([[1.0, 2.0], [3.0, 4.0]])

    def corrected(correct, correction="icepop"):
        cfg = config("grpo", off_policy={"max_staleness": 1, "correction": correction, "correct": correct, "low": 0.8,
                                         "high": 1.3}).algorithm
        return Algorithm.build(cfg).correct_off_policy(adv, rows, old)

    got, stats = corrected("all")
    assert torch.allclose(got, torch.tensor([[1.1, 0.0], [0.0, 0.0]]))
    assert stats == {"is_weight_sum": pytest.approx(1.1), "is_masked_tokens": 2}
    got, stats = corrected("stale")
    assert torch.allclose(got, torch.tensor([[1.0, 2.0], [0.0, 0.0]]))
    assert stats == {"is_weight_sum": pytest.approx(2.0), "is_masked_tokens": 1}
    assert corrected("all", "none") == (adv, {})


def test_a_critic_algorithm_refuses_to_update_without_a_critic():
    cfg = load_config({**yaml.safe_load((CONFIGS / "ppo_tiny.yaml").read_text())}).algorithm
    alg = Algorithm.build(cfg)
    rows = _rank_batch(scores=[1.0, 0.0, 1.0, 0.0])
    values = torch.zeros_like(rows.mask)
    for critic, old in ((None, OldPolicy(values, None, values)), (object(), OldPolicy(values, None, None))):
        with pytest.raises(ValueError) as info:
            alg.update(None, critic, rows, old)
        assert str(info.value) == "ppo needs a critic's values"


def my_loss(lp, old_lp, adv, mask, cfg):
    """A user's policy loss (``algorithm.policy_loss: test_algorithms:my_loss``): -A·logp."""
    return A.aggregate(-adv * lp, mask), {"clipfrac": torch.zeros(())}


def test_user_pieces_that_do_not_import_say_which_field_named_them():
    alg = Algorithm.build(config("grpo", policy_loss="test_algorithms:my_loss").algorithm)
    assert alg.policy_loss is my_loss
    with pytest.raises(ValueError) as info:
        Algorithm.build(config("grpo", policy_loss="test_algorithms:no_loss").algorithm)
    assert str(info.value).startswith("algorithm.policy_loss 'test_algorithms:no_loss' cannot be imported: AttributeError")
    with pytest.raises(ValueError) as info:
        Algorithm.build(config("no_such_module:Algo").algorithm)
    assert str(info.value).startswith("algorithm.name 'no_such_module:Algo' cannot be imported: ModuleNotFoundError")


class RecordingEngine:
    """A training engine that only runs the loss: every micro-batch's weighted loss, at log-probs
    equal to the old ones (ratio 1)."""

    dp, dp_rank, dp_group = 1, 0, None

    def __init__(self, old: torch.Tensor):
        self.old, self.losses = old, []

    def train_step(self, ids, micro, loss_fn):
        stats = []
        for s in range(0, ids.shape[0], micro):
            sl = slice(s, s + micro)
            loss, st = loss_fn(self.old[sl].clone().requires_grad_(), sl)
            self.losses.append(float(loss.detach()))
            stats.append(st)
        return {"grad_norm": 1.0, "stats": stats}


@pytest.mark.parametrize("lengths, advantages", [((1,), (0.5,)), ((1, 3), (0.5, -1.0))])
def test_micro_batch_losses_add_up_to_the_whole_batch_loss(lengths, advantages):
    """token-mean at ratio 1: the loss is -mean_tokens(A); micro-batches of one sequence each carry
    their tokens' share of it (a batch of one token: all of it)."""
    mask = torch.tensor([[1.0] * n + [0.0] * (3 - n) for n in lengths])
    rows = RankBatch(torch.zeros(len(lengths), 4, dtype=torch.long), mask, torch.zeros_like(mask),
                     torch.tensor([float(sum(lengths))]), len(lengths), 1)
    cfg = config("grpo", kl_coef=0.0).algorithm
    old = torch.full_like(mask, -1.0)
    engine = RecordingEngine(old)
    adv = torch.tensor(advantages)[:, None] * mask
    alg = Algorithm.build(cfg)
    alg.estimator.tokens = lambda *args: (adv, None)  # the advantages as given
    record = alg.update(engine, None, rows, OldPolicy(old, None, None))
    want = -sum(a * n for a, n in zip(advantages, lengths)) / sum(lengths)
    assert sum(engine.losses) == pytest.approx(want)
    assert record["policy_loss"] == pytest.approx(sum(-a for a in advantages) / len(lengths))  # per micro-batch
    assert record["tokens"] == sum(lengths) and record["old_vs_ref_kl"] == 0.0


# --- the algorithm block's rules, every message in full ---------------------------------------------

class GroupReference(Estimator):
    """A user's estimator (``test_algorithms:GroupReference``): compares a group's samples and
    needs the reference's log-probs."""

    groups, reference = True, True


def _problems(name="grpo", critic=None, reference=True, **algorithm):
    data = yaml.safe_load((CONFIGS / "grpo_tiny_fsdp.yaml").read_text())
    data["algorithm"] = {**{k: v for k, v in data["algorithm"].items() if k in SIZES}, "name": name, **algorithm}
    if critic:
        data["critic"] = dict(data["train"])
    if not reference:
        data["reference"] = None
    return algorithm_problems(load_config(data))


def test_the_rules_name_a_users_estimator_by_its_config_name():
    est = "test_algorithms:GroupReference"
    assert _problems(advantage=est, critic=True, reference=False, group_size=1, kl_coef=0.0, gamma=0.9) == [
        f"algorithm.gamma: the gae, reinforce_pp estimator's; grpo uses {est}, which does not read it",
        f"critic: grpo has no critic (its estimator {est} uses none); remove the block",
        f"reference: the {est} estimator needs a reference block",
        f"algorithm.group_size: 1 — the {est} estimator compares the samples of a prompt with each other: it needs "
        f"group_size >= 2"]
    user = "user_pkg.estimators:CriticBaseline"
    assert _problems(advantage=user, critic=True, dynamic_sampling={}) == [
        f"algorithm.dynamic_sampling: drops groups whose samples all got the same reward; the {user} estimator "
        f"does not work on groups"]


def test_the_rules_at_their_edges():
    assert _problems(kl_coef=0.0, reference=False) == []  # no KL, an estimator without a reference: none needed
    assert _problems(kl_coef=0.05, reference=False) == [
        "reference: algorithm.kl_coef=0.05 needs a reference block (or set kl_coef: 0)"]
    assert _problems("dapo", max_new_tokens=8, overlong={"buffer_len": 8}) == []
    assert _problems("dapo", max_new_tokens=8, overlong={"buffer_len": 9}) == [
        "algorithm.overlong.buffer_len: 9 is more than max_new_tokens=8"]
    assert _problems(off_policy={"max_staleness": 0}) == []
    assert _problems(off_policy={"max_staleness": 1, "low": 1.0, "high": 1.0}) == [
        "algorithm.off_policy.low: 1.0 is not below high: 1.0 (the band ρ must fall in)"]
    # an estimator's second field is checked even where its first is read (gamma by reinforce_pp)
    assert _problems("reinforce_pp", group_size=1, lam=0.5) == [
        "algorithm.lam: the gae estimator's; reinforce_pp uses reinforce_pp, which does not read it"]
    assert _problems("dapo", kl_coef=0.001) == [
        "algorithm.kl_coef: 0.001 — dapo's paper has 0.0; remove the field to take dapo's setting, or list it in "
        "algorithm.off_paper to keep yours"]
    assert _problems("dapo", off_paper=["lr", "epochs"])[0].startswith("algorithm.off_paper: lr, epochs — not a setting")


def test_shown_writes_a_value_as_the_config_does():
    from rlhf_switch.rl.choices import shown
    from rlhf_switch.rl.config import DynamicSampling

    assert [shown(None), shown("token-mean"), shown(0.5), shown(True)] == ["null", "'token-mean'", "0.5", "True"]
    assert shown(DynamicSampling()) == "{'max_draws': 4, 'filter_on': 'reward'}"


def test_an_estimator_computes_nothing_it_does_not_define():
    est = GroupReference()
    assert est.sequence([1.0, 0.0], None) is None  # per token, on the trainer ranks
    with pytest.raises(NotImplementedError, match=r"^GroupReference\.tokens$"):
        est.tokens(None, None, None, None, None)


# --- the estimators at their edges (each a mutant of rl/estimators.py that no test told apart) ---------

def test_estimator_class_refuses_an_unknown_name_and_a_class_that_is_not_an_estimator():
    from rlhf_switch.rl.estimators import estimator_class

    with pytest.raises(ValueError) as info:
        estimator_class("nope")
    assert str(info.value) == ("unknown advantage estimator 'nope' (known: group, rloo, group_whitened, reinforce_pp, "
                               "gae; or your own as 'module:Class')")
    with pytest.raises(ValueError) as info:
        estimator_class("fractions:Fraction")  # a class, but no Estimator
    assert str(info.value) == ("algorithm.advantage 'fractions:Fraction' is not a subclass of "
                               "rlhf_switch.rl.estimators.Estimator")
    with pytest.raises(ValueError, match="is not a subclass"):
        estimator_class("math:pi")  # not a class at all


def test_only_a_critic_estimator_reads_the_critic_fields():
    from rlhf_switch.rl.estimators import CRITIC_FIELDS, ESTIMATORS

    assert set(ESTIMATORS["group"].fields_read()) == {"norm_adv_by_std", "adv_eps"}
    assert set(ESTIMATORS["rloo"].fields_read()) == set()
    assert set(ESTIMATORS["gae"].fields_read()) == {"gamma", "lam", "whiten_advantages", *CRITIC_FIELDS}


def test_group_estimator_divides_by_the_std_plus_the_configs_eps():
    """Scores 1, 0: mean 1/2, unbiased std √½; adv_eps 1: ±½ / (√½ + 1)."""
    from types import SimpleNamespace

    from rlhf_switch.rl.estimators import ESTIMATORS

    cfg = SimpleNamespace(group_size=2, norm_adv_by_std=True, adv_eps=1.0)
    want = 0.5 / (math.sqrt(0.5) + 1.0)
    assert ESTIMATORS["group"]().sequence([1.0, 0.0], cfg) == pytest.approx([want, -want])


def test_reinforce_pp_estimator_clamps_the_kl_as_configured_and_runs_without_a_reference():
    """One sequence of 2 tokens, γ 1, score 1. k1 KL of 3 on the first token (old -1, ref -4),
    clamped to 0.5, at kl_coef 0.2: rewards -0.1, 1 -> returns 0.9, 1. Without a reference: 1, 1."""
    from types import SimpleNamespace

    from rlhf_switch.rl.estimators import ESTIMATORS

    cfg = SimpleNamespace(kl_coef=0.2, kl_estimator="k1", kl_clamp=0.5, gamma=1.0)
    batch = SimpleNamespace(scores=torch.tensor([1.0]), mask=torch.ones(1, 2))
    old, ref = torch.full((1, 2), -1.0), torch.tensor([[-4.0, -1.0]])
    _, returns = ESTIMATORS["reinforce_pp"]().tokens(batch, OldPolicy(old, ref, None), cfg, OneRank(), None)
    assert returns.tolist() == [pytest.approx([0.9, 1.0])]
    adv, returns = ESTIMATORS["reinforce_pp"]().tokens(batch, OldPolicy(old, None, None), cfg, OneRank(), None)
    assert returns.tolist() == [[1.0, 1.0]] and adv.tolist() == [[0.0, 0.0]]  # two equal returns whiten to 0


# --- the algorithm block's rules at their edges (mutants of rl/algorithm_rules.py no test told apart) --

def test_an_estimator_that_does_not_resolve_is_one_problem_prefixed_once():
    from types import SimpleNamespace

    def only(estimator):
        return algorithm_problems(SimpleNamespace(algorithm=SimpleNamespace(estimator=estimator)))

    assert only("nope") == ["algorithm: unknown advantage estimator 'nope' (known: group, rloo, group_whitened, "
                            "reinforce_pp, gae; or your own as 'module:Class')"]
    assert only("fractions:Fraction") == ["algorithm.advantage 'fractions:Fraction' is not a subclass of "
                                          "rlhf_switch.rl.estimators.Estimator"]


def test_a_field_another_estimator_reads_passes_at_its_default_factorys_value():
    """A field whose default comes from a factory (a user's estimator may declare one) is at its
    default when it equals the factory's value; another value is refused."""
    from types import SimpleNamespace

    from pydantic import Field

    from rlhf_switch.rl.algorithm_rules import _unread_fields
    from rlhf_switch.rl.estimators import ESTIMATORS, Estimator

    class WithFactory(Estimator):
        name, fields = "test_with_factory", {"stops": (list, Field(default_factory=lambda: ["\n"]))}

    ESTIMATORS[WithFactory.name] = WithFactory
    try:
        a = SimpleNamespace(name="grpo", estimator="group", stops=["\n"])
        assert _unread_fields(a, ESTIMATORS["group"]) == []
        a.stops = []
        assert _unread_fields(a, ESTIMATORS["group"]) == [
            "algorithm.stops: the test_with_factory estimator's; grpo uses group, which does not read it"]
    finally:
        ESTIMATORS.pop(WithFactory.name)


# --- a multi-turn sample's environment tokens ---------------------------------------------------------

class LogitsPolicy:
    """The smallest trainable policy for ``Algorithm.update``: its parameters are the logits of
    every position of the batch itself (one micro-batch, DP 1); each step's gradient is kept."""

    dp, dp_rank, dp_group = 1, 0, None

    def __init__(self, rows: int, length: int, vocab: int = 11):
        self.logits = torch.randn(rows, length, vocab, generator=torch.Generator().manual_seed(0)).requires_grad_()
        self.grads: list[torch.Tensor] = []

    def logprobs(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]

    def train_step(self, ids, micro, loss_fn):
        assert micro == ids.shape[0] == self.logits.shape[0]
        loss, stats = loss_fn(self.logprobs(ids), slice(0, ids.shape[0]))
        loss.backward()
        self.grads.append(self.logits.grad.clone())
        self.logits.grad = None
        return {"grad_norm": 0.0, "stats": [stats]}


@pytest.mark.parametrize("name", CRITIC_FREE)
def test_environment_tokens_carry_no_gradient_in_any_algorithms_update(name):
    """A multi-turn sample's response holds the environment's tokens (``loss_mask`` 0) between the
    model's: every critic-free algorithm's update — its loss, its KL, GSPO's sequence ratio — puts
    no gradient on the logits that predict them, and some on every model token's."""
    cfg = config(name, group_size=2, prompts_per_iteration=1, mini_batch_size=2, micro_batch_size=2,
                 kl_coef=0.1).algorithm
    alg = Algorithm.build(cfg)
    responses, loss_mask = [[5, 6, 7, 8, 9], [5, 7, 6]], [[1, 1, 0, 0, 1], [1, 0, 1]]
    policy = LogitsPolicy(2, 2 + 5)
    ids = torch.tensor([[1, 3] + responses[0], [1, 3] + responses[1] + [0, 0]])
    with torch.no_grad():
        now = policy.logprobs(ids)
    # the rollout's log-probs a little off the trainer's (ratios not 1), the reference further off
    noise = torch.linspace(-0.05, 0.05, now.numel()).view_as(now)
    batch = {"prompts": [[1, 3], [1, 3]], "responses": responses, "loss_mask": loss_mask,
             "rollout_logprobs": [(now[r, 1:1 + len(x)] + 0.02).tolist() for r, x in enumerate(responses)],
             **alg.batch_fields([1.0, 0.0], [False, False])}
    rows = RankBatch.of(batch, 1, 0, 0, cfg, torch.device("cpu"))
    assert rows.mask.tolist() == [[0, 1, 1, 0, 0, 1], [0, 1, 0, 1, 0, 0]]
    old = OldPolicy(old=((now + noise) * rows.response_mask).detach(), ref=((now - 2 * noise) * rows.response_mask),
                    values=None)
    alg.update(policy, None, rows, old)
    per_position = policy.grads[0][:, :-1].abs().sum(-1)  # position t predicts ids[:, t + 1]
    # the environment's tokens: response tokens 2, 3 of row 0 and 1 of row 1, predicted at positions
    # 1 + k (the prompt is 2 tokens)
    assert [per_position[0, 3].item(), per_position[0, 4].item(), per_position[1, 2].item()] == [0.0, 0.0, 0.0], name
    assert (per_position[rows.mask == 1] > 0).all(), name
