"""The engine-free RLHF pieces: tasks and tokenizer, rewards and the plug-in point, the GRPO/PPO
math against hand-computed values and plain reference loops, and the run config's errors."""
from __future__ import annotations

import copy
import json
import math
import re
import typing
from pathlib import Path

import pytest
import torch
import yaml

from rlhf_switch.rl import algorithms as A
from rlhf_switch.problems import check_run, run_problems
from rlhf_switch.rl.algorithm_rules import algorithm_problems
from rlhf_switch.rl.config import Aggregation, ConfigError, KLEstimator, RunConfig, load_config
from rlhf_switch.rl.rewards import (RewardError, exact_match, load_reward_fn, partial_credit, score_samples)
from rlhf_switch.rl.tasks import (ENUMERATE_BELOW, TASKS, CharTokenizer, build_task, encode_prompt,
                                  longest_answer_tokens, longest_prompt_tokens, make_splits)

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
SHIPPED = ("grpo_tiny.yaml", "grpo_tiny_torch.yaml", "ppo_tiny.yaml")

# ---------------------------------------------------------------- tasks and tokenizer


def _solve(prompt: str) -> str:
    """An independent solver: what each task's answer must be."""
    body = prompt[:-1]
    if body.startswith("sort "):
        return ",".join(sorted(body[5:].split(",")))
    if body.startswith("rev "):
        return body[4:][::-1]
    a, b = body.split("+")
    return str(int(a) + int(b))


@pytest.mark.parametrize("name", sorted(TASKS))
def test_splits_deterministic_disjoint_and_correct(name):
    task = build_task(name, 1, 3)
    first, again = make_splits(task, 300, 50, seed=7), make_splits(task, 300, 50, seed=7)
    assert first == again
    assert make_splits(task, 300, 50, seed=8) != first
    assert len(first.train) == 300 and len(first.heldout) == 50
    train, heldout = {s.prompt for s in first.train}, {s.prompt for s in first.heldout}
    assert len(train) == 300 and len(heldout) == 50 and not train & heldout
    for s in first.train + first.heldout:
        assert s.answer == _solve(s.prompt), s
    # held-out is cut first: asking for more training data leaves it unchanged
    assert make_splits(task, 900, 50, seed=7).heldout == first.heldout


def test_small_spaces_are_used_up_and_overdraws_refused():
    task = build_task("sorting", 1, 1)  # "sort 0=" .. "sort 9="
    splits = make_splits(task, 7, 3, seed=0)
    assert sorted(s.prompt for s in splits.train + splits.heldout) == [f"sort {d}=" for d in range(10)]
    with pytest.raises(ValueError, match=r"only 10 distinct prompts.*7 \+ 4 = 11"):
        make_splits(task, 7, 4, seed=0)


def test_addition_draws_short_operands_too():
    prompts = [s.prompt for s in make_splits(build_task("addition", 1, 3), 500, 0, seed=0).train]
    lengths = {len(p.split("+")[0]) for p in prompts}
    assert lengths == {1, 2, 3}


# sha256 (first 16 hex digits) of make_splits(build_task(name, lo, hi), 300, 50, seed=3), held-out
# then train, each "prompt|answer" on a line: the splits of every config from before length_skew
UNSKEWED_SPLITS = {("addition", 1, 3): "1526ac224d05e860", ("sorting", 1, 6): "3a65f3bbcb0e454b",
                   ("reversal", 1, 4): "f97c765e8bbf28ec", ("reversal", 63, 127): "120c457bbd465896"}


@pytest.mark.parametrize("name, lo, hi", sorted(UNSKEWED_SPLITS))
def test_length_skew_zero_keeps_the_splits(name, lo, hi):
    import hashlib

    task = build_task(name, lo, hi)
    assert task.space_size() > ENUMERATE_BELOW  # sampled: the stream that draw makes
    assert task == build_task(name, lo, hi, length_skew=0.0)
    splits = make_splits(task, 300, 50, seed=3)
    text = "\n".join(f"{s.prompt}|{s.answer}" for s in splits.heldout + splits.train)
    assert hashlib.sha256(text.encode()).hexdigest()[:16] == UNSKEWED_SPLITS[(name, lo, hi)]


def test_length_skew_makes_short_samples_common():
    lo, hi = 63, 127
    skewed = build_task("reversal", lo, hi, length_skew=3.5)
    splits = make_splits(skewed, 2000, 200, seed=0)
    assert splits == make_splits(skewed, 2000, 200, seed=0)
    lengths = sorted(len(s.answer) for s in splits.train + splits.heldout)
    assert all(lo <= n <= hi for n in lengths)
    for s in splits.train:
        assert s.answer == _solve(s.prompt)
    # uniform: mean 95; skew 3.5: mean ~79, median ~75, and still a tail to the longest
    mean, median = sum(lengths) / len(lengths), lengths[len(lengths) // 2]
    assert 75 < mean < 84 and 70 < median < 80 and lengths[-1] > 120, (mean, median, lengths[-1])
    uniform = [len(s.answer) for s in make_splits(build_task("reversal", lo, hi), 2000, 0, seed=0).train]
    assert sum(uniform) / len(uniform) > 90
    weights = skewed.length_weights()
    assert len(weights) == hi - lo + 1 and weights[0] == 1.0 and weights[-1] == pytest.approx(math.exp(-3.5))
    # addition: the skew is on each operand's digit count
    operands = [p.split("+")[0] for p in (s.prompt for s in
                make_splits(build_task("addition", 1, 3, length_skew=4.0), 2000, 0, seed=0).train)]
    counts = [sum(len(a) == n for a in operands) for n in (1, 2, 3)]
    assert counts[0] > counts[1] > counts[2] > 0
    # a listed (small) space holds every prompt once, whatever the skew
    small = make_splits(build_task("sorting", 1, 2, length_skew=5.0), 90, 20, seed=0)
    assert small == make_splits(build_task("sorting", 1, 2), 90, 20, seed=0)
    with pytest.raises(ValueError, match="need length_skew >= 0, got -1"):
        build_task("reversal", 1, 3, length_skew=-1)


def test_bad_task_arguments():
    with pytest.raises(ValueError, match="unknown task 'multiplication'; known tasks: addition"):
        build_task("multiplication")
    with pytest.raises(ValueError, match="min_len=3, max_len=2"):
        build_task("reversal", 3, 2)


def test_tokenizer_round_trip_and_vocab():
    tok = CharTokenizer()
    assert tok.vocab_size <= 64 and (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    for name in TASKS:
        for s in make_splits(build_task(name, 1, 4), 50, 10, seed=1).train:
            ids = tok.encode(s.prompt + s.answer, add_bos=True, add_eos=True)
            assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
            assert tok.decode(ids) == s.prompt + s.answer
    # decode is what a reward sees: stops at <eos>, drops padding, marks ids beyond the tokenizer
    assert tok.decode(tok.encode("357", add_eos=True) + tok.encode("99")) == "357"
    assert tok.decode([tok.pad_id] + tok.encode("1") + [63]) == "1?"
    with pytest.raises(ValueError, match=r"character 'A' at position 1 of 'xA'"):
        tok.encode("xA")


def test_prompt_longer_than_context_is_refused():
    tok = CharTokenizer()
    assert encode_prompt(tok, "12+34=", max_new_tokens=4, max_context=11) == tok.encode("12+34=", add_bos=True)
    with pytest.raises(ValueError, match=r"prompt '12\+34=' is 7 tokens; with max_new_tokens=5 that is 12 > "
                                         r"the model's context of 11"):
        encode_prompt(tok, "12+34=", max_new_tokens=5, max_context=11)
    task = build_task("addition", 1, 3)
    assert longest_prompt_tokens(task, tok) == len("<999+999=") and longest_answer_tokens(task, tok) == 5


# ---------------------------------------------------------------- rewards and the plug-in point


def test_exact_match_and_partial_credit():
    assert exact_match("12+345=", "357", "357") == 1.0
    assert exact_match("12+345=", "357 ", "357") == 0.0 and exact_match("12+345=", "", "357") == 0.0
    assert partial_credit("12+345=", "357", "357") == 1.0
    assert partial_credit("999+1=", "000", "1000") == pytest.approx(3 / 4)  # numbers right-aligned
    assert partial_credit("rev abc=", "cbx", "cba") == pytest.approx(2 / 3)
    assert partial_credit("rev abc=", "cbaaa", "cba") == pytest.approx(3 / 5)
    assert partial_credit("rev abc=", "", "cba") == 0.0


def _write_module(tmp_path, monkeypatch, name, source):
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))


def test_load_reward_fn(tmp_path, monkeypatch):
    assert load_reward_fn("rlhf_switch.rl.rewards:exact_match") is exact_match
    _write_module(tmp_path, monkeypatch, "my_rewards", "class Scorer:\n    @staticmethod\n"
                  "    def score(p, r, a):\n        return len(r)\nNOT_A_FUNCTION = 3\n")
    assert load_reward_fn("my_rewards:Scorer.score")("", "abc", "") == 3
    cases = {
        "no_colon": "must be written 'module:function'",
        "no_such_module_xyz:f": "no module named 'no_such_module_xyz'",
        "my_rewards:scor": "'my_rewards' has no attribute 'scor'; callables there: Scorer",
        "my_rewards:Scorer.nope": "'my_rewards:Scorer' has no attribute 'nope'",
        "my_rewards:NOT_A_FUNCTION": "is a int, not callable",
    }
    for spec, message in cases.items():
        with pytest.raises(RewardError, match=message.replace("(", r"\(")) as info:
            load_reward_fn(spec)
        assert repr(spec) in str(info.value)


def test_load_reward_fn_reports_errors_inside_the_module(tmp_path, monkeypatch):
    _write_module(tmp_path, monkeypatch, "broken_rewards", "import not_installed_dep_xyz\n")
    with pytest.raises(RewardError, match="importing 'broken_rewards' failed: No module named 'not_installed_dep_xyz'"):
        load_reward_fn("broken_rewards:f")
    _write_module(tmp_path, monkeypatch, "raising_rewards", "raise RuntimeError('boom at import')\n")
    with pytest.raises(RewardError, match="importing 'raising_rewards' raised RuntimeError: boom at import"):
        load_reward_fn("raising_rewards:f")


def test_score_samples_names_the_function_and_the_sample():
    assert score_samples(exact_match, ["1+1=", "1+2="], ["2", "4"], ["2", "3"]) == [1.0, 0.0]
    assert score_samples(lambda p, r, a: r == a, ["x"], ["y"], ["y"]) == [1.0]

    def picky(prompt, response, answer):
        return 1.0 / len(response)

    with pytest.raises(RewardError) as info:
        score_samples(picky, ["1+1=", "2+2="], ["2", ""], ["2", "4"])
    message = str(info.value)
    assert "test_rl_pure:test_score_samples_names_the_function_and_the_sample.<locals>.picky" in message
    assert "sample 1 (prompt='2+2=', response='', answer='4') raised ZeroDivisionError" in message
    for bad, shown in ((None, "None (NoneType)"), ("1.0", "'1.0' (str)")):
        with pytest.raises(RewardError, match=re.escape(f"returned {shown}, not a number")):
            score_samples(lambda p, r, a: bad, ["p"], ["r"], ["a"])
    with pytest.raises(RewardError, match="returned nan, not a finite number"):
        score_samples(lambda p, r, a: math.nan, ["p"], ["r"], ["a"])


# ---------------------------------------------------------------- algorithms


def test_masked_mean_var_whiten():
    x = torch.tensor([[1.0, 2.0, float("nan")], [3.0, 4.0, 5.0]])
    m = torch.tensor([[1, 1, 0], [1, 1, 1]])
    assert A.masked_mean(x, m).item() == pytest.approx(3.0)  # the masked nan does not leak
    assert A.masked_mean(x, m, dim=-1).tolist() == pytest.approx([1.5, 4.0])
    assert A.masked_mean(x, torch.zeros_like(m)).item() == 0.0
    kept = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    assert A.masked_var(x, m).item() == pytest.approx(kept.var().item())
    assert A.masked_var(x, m, unbiased=False).item() == pytest.approx(kept.var(unbiased=False).item())
    w = A.masked_whiten(x, m)
    assert w[m.bool()].tolist() == pytest.approx(((kept - 3) / kept.var().sqrt()).tolist(), rel=1e-6)
    assert w[1 - m == 1].tolist() == [0.0]
    # scale only (verl's shift_mean=False): the mean is added back, the spread is still whitened
    unshifted = A.masked_whiten(x, m, shift_mean=False)[m.bool()]
    assert unshifted.mean().item() == pytest.approx(3.0) and unshifted.var().item() == pytest.approx(1.0)


def test_grpo_advantages_hand_values():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    adv = A.grpo_advantages(rewards, group_size=4)
    s = 0.5 / math.sqrt(1 / 3)  # group 1: mean .5, unbiased std sqrt(1/3)
    assert adv.tolist() == pytest.approx([s, -s, -s, s, 0, 0, 0, 0], rel=1e-5)
    assert A.grpo_advantages(rewards, 4, norm_by_std=False).tolist() == [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]
    assert A.grpo_advantages(rewards.view(2, 4), 4).shape == (2, 4)
    with pytest.raises(ValueError, match="group_size >= 2"):
        A.grpo_advantages(rewards, 1)
    with pytest.raises(ValueError, match="8 rewards do not split into groups of 3"):
        A.grpo_advantages(rewards, 3)


def test_grpo_advantages_against_a_loop():
    g = torch.Generator().manual_seed(0)
    rewards = torch.randint(0, 3, (5 * 6,), generator=g).float()
    adv = A.grpo_advantages(rewards, 6, eps=1e-6)
    for i in range(5):
        group = rewards[i * 6:(i + 1) * 6].tolist()
        mean = sum(group) / 6
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / 5)
        for j, r in enumerate(group):
            assert adv[i * 6 + j].item() == pytest.approx((r - mean) / (std + 1e-6), rel=1e-5, abs=1e-6)


def test_per_token_and_aggregation_modes():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    assert A.per_token(torch.tensor([2.0, -1.0, 5.0]), mask).tolist() == [[2, 2, 0], [-1, -1, -1], [0, 0, 0]]
    loss = torch.tensor([[1.0, 3.0, 100.0], [2.0, 2.0, 5.0], [7.0, 7.0, 7.0]])
    assert A.aggregate(loss, mask, "token-mean").item() == pytest.approx(13 / 5)
    assert A.aggregate(loss, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 3) / 2)
    assert A.aggregate(loss, mask, "seq-mean-token-sum").item() == pytest.approx((4 + 9) / 2)
    with pytest.raises(ValueError, match="unknown loss aggregation 'sum'"):
        A.aggregate(loss, mask, "sum")


def test_policy_loss_hand_values():
    # ratios 1.5, 1.5, 0.5, 0.5 against advantages +1, -1, +1, -1 with ε = 0.2
    logp = torch.log(torch.tensor([[1.5, 1.5, 0.5, 0.5]]))
    old = torch.zeros(1, 4)
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]])
    loss, stats = A.policy_loss(logp, old, adv, torch.ones(1, 4), clip_eps=0.2)
    # per token: max(-1.5, -1.2) = -1.2 (clipped), 1.5, -0.5, max(0.5, 0.8) = 0.8 (clipped)
    assert loss.item() == pytest.approx((-1.2 + 1.5 - 0.5 + 0.8) / 4)
    assert stats["clipfrac"].item() == pytest.approx(0.5)
    assert stats["ratio"].item() == pytest.approx(1.0)
    # clip-higher: ε_high = 0.6 lets the ratio-1.5 token with A > 0 through unclipped
    loss_high, _ = A.policy_loss(logp, old, adv, torch.ones(1, 4), clip_eps=0.2, clip_eps_high=0.6)
    assert loss_high.item() == pytest.approx((-1.5 + 1.5 - 0.5 + 0.8) / 4)


def test_policy_loss_against_a_loop_and_its_gradient():
    g = torch.Generator().manual_seed(1)
    B, T, eps = 4, 6, 0.2
    logp = (-torch.rand(B, T, generator=g) * 3).requires_grad_()
    old = logp.detach() + 0.3 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, T, generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.3).long()
    mask[:, 0] = 1
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        loss, _ = A.policy_loss(logp, old, adv, mask, eps, aggregation=mode)
        per_seq, tokens = [], []
        for b in range(B):
            row = []
            for t in range(T):
                if mask[b, t]:
                    r = math.exp(logp[b, t].item() - old[b, t].item())
                    a = adv[b, t].item()
                    row.append(max(-a * r, -a * min(max(r, 1 - eps), 1 + eps)))
            tokens += row
            per_seq.append(sum(row) / len(row) if mode == "seq-mean-token-mean" else sum(row))
        expected = sum(tokens) / len(tokens) if mode == "token-mean" else sum(per_seq) / B
        assert loss.item() == pytest.approx(expected, rel=1e-5)
    loss, _ = A.policy_loss(logp, old, adv, mask, eps)
    loss.backward()
    assert (logp.grad[mask == 0] == 0).all()  # padding gets no gradient
    # at ratio 1 (first step of an update), the gradient is the plain policy gradient -A·∇logp / N
    fresh = logp.detach().clone().requires_grad_()
    A.policy_loss(fresh, fresh.detach(), adv, mask, eps)[0].backward()
    assert torch.allclose(fresh.grad, -adv * mask / mask.sum())


def test_kl_estimators_hand_values_and_unbiasedness():
    logp, ref = torch.log(torch.tensor([0.5])), torch.log(torch.tensor([0.25]))
    assert A.kl_penalty(logp, ref, "k1").item() == pytest.approx(math.log(2))
    assert A.kl_penalty(logp, ref, "k2").item() == pytest.approx(0.5 * math.log(2) ** 2)
    assert A.kl_penalty(logp, ref, "k3").item() == pytest.approx(0.5 - 1 + math.log(2))
    assert A.kl_penalty(torch.tensor([0.0]), torch.tensor([-30.0]), "k3", clamp=10).item() == 10.0
    # over the whole distribution p, E_p[k1] = E_p[k3] = KL(p || q); k3 is never negative
    p = torch.softmax(torch.tensor([0.3, -1.0, 2.0, 0.1]), 0)
    q = torch.softmax(torch.tensor([1.0, 0.5, -0.5, 0.0]), 0)
    kl = (p * (p.log() - q.log())).sum()
    for est in ("k1", "k3"):
        assert (p * A.kl_penalty(p.log(), q.log(), est)).sum().item() == pytest.approx(kl.item(), rel=1e-5)
    assert (A.kl_penalty(p.log(), q.log(), "k3") >= 0).all()
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'"):
        A.kl_penalty(logp, ref, "k4")
    with pytest.raises(ValueError, match=r"shapes differ: logprobs=\(1,\), ref_logprobs=\(2,\)"):
        A.kl_penalty(logp, torch.zeros(2))


def test_entropy_and_logprobs_from_logits():
    assert A.entropy_from_logits(torch.zeros(3, 8)).tolist() == pytest.approx([math.log(8)] * 3)
    logits = torch.randn(2, 5, 11, generator=torch.Generator().manual_seed(2))
    p = torch.softmax(logits, -1)
    assert torch.allclose(A.entropy_from_logits(logits), -(p * p.log()).sum(-1), atol=1e-6)
    huge = torch.tensor([[1000.0, 0.0, -1000.0]])
    assert A.entropy_from_logits(huge).item() == pytest.approx(0.0, abs=1e-6)
    tokens = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(3))
    expected = torch.log(p.gather(-1, tokens[..., None])[..., 0])
    assert torch.allclose(A.logprobs_from_logits(logits, tokens), expected, atol=1e-6)


def test_token_rewards_put_the_score_on_the_last_token():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    assert A.last_token_index(mask).tolist() == [1, 2, -1]
    r = A.token_rewards(torch.tensor([1.0, 2.0, 3.0]), mask, kl=torch.ones(3, 3), kl_coef=0.1)
    torch.testing.assert_close(r, torch.tensor([[-0.1, 0.9, 0], [-0.1, -0.1, 1.9], [0, 0, 0]]))
    assert A.token_rewards(torch.tensor([1.0, 2.0, 3.0]), mask).tolist() == [[0, 1, 0], [0, 0, 2], [0, 0, 0]]


def test_gae_hand_values():
    values = torch.tensor([[0.5, 0.5, 0.5]])
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    mask = torch.ones(1, 3)
    adv, ret = A.gae(values, rewards, mask, gamma=1.0, lam=1.0)  # Monte Carlo: return-to-go minus V
    assert adv.tolist() == [[0.5, 0.5, 0.5]] and ret.tolist() == [[1.0, 1.0, 1.0]]
    adv, ret = A.gae(values, rewards, mask, gamma=0.5, lam=0.5)
    # δ = [-.25, -.25, .5]; A2 = .5, A1 = -.25 + .25·.5 = -.125, A0 = -.25 + .25·(-.125)
    torch.testing.assert_close(adv, torch.tensor([[-0.28125, -0.125, 0.5]]))
    torch.testing.assert_close(ret, torch.tensor([[0.21875, 0.375, 1.0]]))


def _gae_loop(values, rewards, mask, gamma, lam):
    """Textbook GAE on each row's masked-in tokens, compacted into one episode."""
    adv, ret = torch.zeros_like(values), torch.zeros_like(values)
    for b in range(values.shape[0]):
        idx = [t for t in range(values.shape[1]) if mask[b, t]]
        running, next_v = 0.0, 0.0
        for t in reversed(idx):
            delta = rewards[b, t].item() + gamma * next_v - values[b, t].item()
            running = delta + gamma * lam * running
            adv[b, t], ret[b, t] = running, running + values[b, t].item()
            next_v = values[b, t].item()
    return adv, ret


def test_gae_against_a_loop_with_padding_and_holes():
    g = torch.Generator().manual_seed(4)
    values, rewards = torch.randn(5, 7, generator=g), torch.randn(5, 7, generator=g)
    mask = torch.ones(5, 7)
    mask[0, 4:] = 0          # right padding
    mask[1, 2] = 0           # a hole (e.g. a tool-output token)
    mask[2] = 0              # no response at all
    mask[3, 0] = 0           # left padding
    for gamma, lam in ((1.0, 0.95), (0.9, 0.8)):
        adv, ret = A.gae(values, rewards, mask, gamma, lam)
        want_adv, want_ret = _gae_loop(values, rewards, mask, gamma, lam)
        assert torch.allclose(adv, want_adv, atol=1e-6) and torch.allclose(ret, want_ret, atol=1e-6)


def test_value_loss_hand_values():
    ones = torch.ones(1, 1)
    loss, stats = A.value_loss(1.5 * ones, 1.0 * ones, 2.0 * ones, ones, clip_eps=0.2)
    # clipped value 1.2: max(.5², .8²) / 2
    assert loss.item() == pytest.approx(0.32) and stats["vf_clipfrac"].item() == 1.0
    loss, stats = A.value_loss(1.1 * ones, 1.0 * ones, 2.0 * ones, ones, clip_eps=0.2)
    assert loss.item() == pytest.approx(0.5 * 0.81) and stats["vf_clipfrac"].item() == 0.0
    loss, _ = A.value_loss(1.5 * ones, 1.0 * ones, 2.0 * ones, ones, clip_eps=None)
    assert loss.item() == pytest.approx(0.125)


def test_config_literals_match_the_algorithms():
    assert typing.get_args(Aggregation) == A.AGGREGATIONS
    assert typing.get_args(KLEstimator) == A.KL_ESTIMATORS


# ---------------------------------------------------------------- config


def _shipped(name: str = "grpo_tiny.yaml") -> dict:
    return yaml.safe_load((CONFIGS / name).read_text())


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_configs_load_and_fit(name):
    cfg = load_config(CONFIGS / name)
    check_run(cfg)
    assert cfg.world_size == 2 and cfg.task.reward_fn == "rlhf_switch.rl.rewards:exact_match"
    assert load_config(cfg.model_dump()) == cfg  # a saved config reloads to the same run


def test_shipped_config_details():
    grpo, torch_cfg, ppo = (load_config(CONFIGS / n) for n in SHIPPED)
    assert (grpo.train.engine, grpo.train.zero_stage, grpo.train.dp) == ("deepspeed", 3, 2)
    assert (grpo.rollout.engine, grpo.rollout.tp) == ("vllm", 2) and torch_cfg.rollout.engine == "torch"
    assert grpo.algorithm.name == "grpo" and grpo.critic is None and grpo.algorithm.rollout_batch_size == 512
    assert ppo.algorithm.name == "ppo" and ppo.critic is not None and ppo.algorithm.kl_estimator == "k1"
    assert list(ppo.phases()) == ["train", "rollout", "reference", "critic"]


def test_long_generation_config():
    """configs/grpo_20m_long.yaml (bench.async_rollout's long-generation job) passes every check
    before Ray, and is what its header says: ~20M parameters, 64-128-token answers of skewed
    lengths, partial credit."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = load_config(CONFIGS / "grpo_20m_long.yaml")
    assert run_problems(cfg) == []
    assert load_config(cfg.model_dump()) == cfg
    assert (cfg.rollout.mode, cfg.rollout.dp, cfg.train.engine) == ("disaggregated", 2, "fsdp2")
    assert cfg.task.reward_fn == "rlhf_switch.rl.rewards:partial_credit" and cfg.task.length_skew > 0
    tok, task = CharTokenizer(), build_task(cfg.task.name, cfg.task.min_len, cfg.task.max_len, cfg.task.length_skew)
    assert len(tok.encode(task.longest().answer, add_eos=True)) == cfg.algorithm.max_new_tokens == 128
    assert len(tok.encode("z" * cfg.task.min_len, add_eos=True)) == 64
    hf = cfg.model.hf_dict()
    assert hf["max_position_embeddings"] >= longest_prompt_tokens(task, tok) + cfg.algorithm.max_new_tokens
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in hf.items() if k != "model_type"}))
    assert sum(p.numel() for p in model.parameters()) == 20_717_056  # the count in the header
    assert "20,717,056" in (CONFIGS / "grpo_20m_long.yaml").read_text()
    with pytest.raises(ConfigError, match="length_skew"):
        load_config({**cfg.model_dump(), "task": {**cfg.task.model_dump(), "length_skew": -1.0}})
    # the warm start's cache key names the skew; an unskewed task's key is the one of before it existed
    from rlhf_switch.rl.sft import fingerprint

    assert fingerprint(cfg)["task"]["length_skew"] == 3.5
    assert "length_skew" not in fingerprint(load_config(CONFIGS / "grpo_tiny_async.yaml"))["task"]


def test_unknown_field_bad_type_and_bad_values_are_listed_one_per_field():
    data = _shipped()
    data["train"]["zero_stag"] = 3
    data["algorithm"]["gamma"] = 0.9          # a PPO field in a GRPO block
    data["algorithm"]["lr"] = "fast"
    data["rollout"]["engine"] = "vllm tp2"      # not a name (nor module:Class)
    data["mystery"] = 1
    with pytest.raises(ConfigError) as info:
        load_config(data)
    message, problems = str(info.value), info.value.problems
    assert message.startswith("config: 4 problems")
    assert any(p.startswith("train.zero_stag: unknown field in train; did you mean 'zero_stage'?") for p in problems)
    assert any(p.startswith("algorithm.lr: Input should be a valid number") and "(got 'fast')" in p for p in problems)
    assert any(p.startswith("rollout.engine: String should match pattern") for p in problems)
    assert any(p.startswith("mystery: unknown field") for p in problems)
    # a field of another estimator's is a rule across fields: the pre-start checks refuse it
    del data["train"]["zero_stag"], data["mystery"]
    data["algorithm"]["lr"], data["rollout"]["engine"] = 1e-4, "vllm"
    assert algorithm_problems(load_config(data)) == [
        "algorithm.gamma: the gae, reinforce_pp estimator's; grpo uses group, which does not read it"]
    data["algorithm"]["gama"] = 0.9
    with pytest.raises(ConfigError, match=r"algorithm.gama: unknown field in algorithm; did you mean 'gamma'\?"):
        load_config(data)


def test_algorithm_name_and_phase_blocks():
    data = _shipped()
    data["algorithm"]["name"] = "dpo"
    with pytest.raises(ConfigError, match=r"algorithm.name: unknown algorithm 'dpo'; did you mean '\w+'\? \(known: grpo, "):
        load_config(data)
    data = _shipped("ppo_tiny.yaml")
    del data["critic"], data["reference"]
    assert algorithm_problems(load_config(data)) == [
        "critic: ppo's estimator (gae) uses a critic: give a critic block (engine and layout of the value model)",
        "reference: algorithm.kl_coef=0.05 needs a reference block (or set kl_coef: 0)"]
    data = _shipped()
    data["critic"] = dict(data["train"])
    assert algorithm_problems(load_config(data)) == [
        "critic: grpo has no critic (its estimator group uses none); remove the block"]
    data = _shipped()
    data["model"]["path"] = "/some/dir"
    with pytest.raises(ConfigError, match="model: give exactly one of hf_config"):
        load_config(data)
    del data["model"]["path"], data["model"]["hf_config"]["num_attention_heads"]
    with pytest.raises(ConfigError, match="model.hf_config: missing num_attention_heads"):
        load_config(data)


def test_impossible_layout_lists_every_problem():
    data = _shipped()
    data["world_size"] = 4
    data["train"] = {"engine": "deepspeed", "zero_stage": 3, "tp": 3, "dp": 1}
    data["rollout"] = {"engine": "vllm", "tp": 8, "pp": 2, "dp": 1}
    data["reference"] = {"engine": "fsdp2", "zero_stage": 2, "dp": 4}
    data["algorithm"]["prompts_per_iteration"] = 6
    data["algorithm"]["mini_batch_size"] = 32
    with pytest.raises(ConfigError) as info:
        check_run(load_config(data))
    message = str(info.value)
    assert message.startswith("the config cannot run on world_size=4:")
    expected = [
        "train: tp·pp·dp = 3·1·1 = 3, but world_size = 4",
        "train: tp=3 does not divide num_attention_heads=4",
        "train: tp=3 does not divide num_key_value_heads=2",
        "train: tp=3 does not divide intermediate_size=256",
        "rollout: tp·pp·dp = 8·2·1 = 16, but world_size = 4",
        "rollout: tp=8 does not divide num_attention_heads=4",
        "algorithm.mini_batch_size=32 does not divide the rollout batch prompts_per_iteration·group_size = 48",
    ]
    for line in expected:
        assert line in message, line
    assert len(info.value.problems) == len(message.splitlines()) - 1
    # what each engine runs is the engine's to say (asked through the registry by the loop)

    engine_problems = run_problems(load_config(data))
    for line in ["train: engine deepspeed is ZeRO data parallelism (tp=1, pp=1)",
                 "rollout: rollout engines run tensor parallel replicas only; pp=2 must be 1",
                 "reference: engine fsdp2 runs zero_stage=0 only (got zero_stage=2; for zero_stage > 0 use "
                 "engine deepspeed)"]:
        assert any(p.startswith(line) for p in engine_problems), (line, engine_problems)


def test_tp_versus_kv_heads_per_engine():
    # the second world-4 layout pair: train TP2×DP2 / rollout TP4 (above the 2 KV heads: vLLM replicates)
    data = _shipped()
    data["world_size"] = 4
    data["train"] = {"engine": "torch_tp", "tp": 2, "dp": 2}
    data["reference"] = {"engine": "torch_tp", "tp": 2, "dp": 2}
    data["rollout"] = {"engine": "vllm", "tp": 4}
    check_run(load_config(data))
    data["train"] = {"engine": "torch_tp", "tp": 4}   # a training engine splits KV heads: 4 ∤ 2
    data["model"]["hf_config"]["num_key_value_heads"] = 4
    data["model"]["hf_config"]["num_attention_heads"] = 12
    data["rollout"] = {"engine": "vllm", "tp": 4}
    assert run_problems(load_config(data)) == []
    data["model"]["hf_config"]["num_key_value_heads"] = 3
    problems = run_problems(load_config(data))
    assert "train: tp=4 does not divide num_key_value_heads=3" in problems
    assert "rollout: tp=4 is above num_key_value_heads=3 and must then be a multiple of it" in problems


def test_model_task_and_reward_fit():
    data = _shipped()
    data["model"]["hf_config"].update(vocab_size=32, max_position_embeddings=10, eos_token_id=5)
    data["algorithm"]["max_new_tokens"] = 3
    data["task"]["reward_fn"] = "no_such_module_xyz:score"
    data["task"]["num_train"] = 20000
    problems = run_problems(load_config(data))
    assert problems == [
        "task: addition with max_len=2 has 10000 distinct prompts; num_train + num_heldout = 20200",
        "algorithm.max_new_tokens=3 cannot hold the task's longest answer (4 tokens with <eos>)",
        # 7 prompt tokens + 3 new = 10 fits a context of exactly 10: no problem reported for it
        "model: vocab_size=32 is smaller than the tokenizer's 47 ids",
        "model: eos_token_id=5, but the tokenizer's is 2",
        "task.reward_fn: reward function 'no_such_module_xyz:score': no module named 'no_such_module_xyz' "
        "(is it on PYTHONPATH / installed?)",
    ]
    data["model"]["hf_config"].update(max_position_embeddings=9)
    assert ("model: the task's longest prompt is 7 tokens; with max_new_tokens=3 that is 10 > "
            "max_position_embeddings=9") in run_problems(load_config(data), skip=("reward",))


def test_model_path_is_read_without_transformers(tmp_path):
    data = _shipped()
    (tmp_path / "config.json").write_text(json.dumps(data["model"]["hf_config"]))
    data["model"] = {"path": str(tmp_path)}
    assert run_problems(load_config(data)) == []
    data["model"] = {"path": str(tmp_path / "missing")}
    assert f"model.path: no config.json at {tmp_path / 'missing' / 'config.json'}" in run_problems(load_config(data))


def test_yaml_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "absent.yaml")
    (tmp_path / "broken.yaml").write_text("train: {engine: deepspeed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(tmp_path / "broken.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="the top level must be a mapping of fields, got list"):
        load_config(tmp_path / "list.yaml")
    good = copy.deepcopy(_shipped())
    (tmp_path / "good.yaml").write_text(yaml.safe_dump(good))
    assert isinstance(load_config(str(tmp_path / "good.yaml")), RunConfig)


def test_a_task_whose_lengths_cross_is_one_pre_start_problem():
    data = _shipped()
    data["task"].update(min_len=3, max_len=2)
    problems = run_problems(load_config(data), skip=("reward",))
    assert problems == ["task: min_len=3 is above max_len=2"]
