"""The RL maths as plain torch functions — the formulas of verl, OpenRLHF, TRL and the papers each
names. ``rl/algorithm.py`` assembles them into the algorithm a run uses.

Shapes: per-sequence tensors are ``[B]``; per-token tensors are ``[B, T]`` over the *response*
tokens only (prompt positions are not included), with ``mask[b, t] = 1`` on a real response token
and 0 on padding. ``logprobs[b, t]`` is the log-probability of response token ``t`` given
everything before it. Masked positions never count in a result; keep them finite all the same (a
``nan`` there would still reach the gradients through ``torch.where``'s backward).

Advantages: ``grpo_advantages`` (a group's mean, and std), ``rloo_advantages`` (leave-one-out
mean), ``discounted_returns`` (REINFORCE++), ``gae`` on a critic's values (PPO); ``masked_whiten``
and ``global_masked_whiten`` (over a DP group). Policy losses: ``policy_loss`` (PPO-clip, with
DAPO's clip-higher), ``gspo_loss`` (a sequence-level ratio), ``cispo_loss`` (a clipped,
stop-gradient importance weight); ``aggregate`` reduces any of them. The KL to a reference:
``kl_penalty`` (k1, k2, k3), in the loss or as a per-token reward (``token_rewards``).
``overlong_penalty``: DAPO's soft punishment of responses near the length limit.
"""
from __future__ import annotations

import torch

from .choices import AGGREGATIONS, KL_ESTIMATORS, Aggregation, KLEstimator  # noqa: F401 - re-exported


def _check_same_shape(**tensors: torch.Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        raise ValueError("shapes differ: " + ", ".join(f"{n}={s}" for n, s in shapes.items()))


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    # where() rather than values * mask: a masked-out nan/inf must not leak into the sum
    picked = torch.where(mask.bool(), values, torch.zeros_like(values))
    return picked.sum() if dim is None else picked.sum(dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean over positions where ``mask`` is set; 0 (not nan) where there are none."""
    count = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance over the masked positions (all of them together), Bessel-corrected by default as
    in verl/TRL."""
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        n = mask.sum()
        if n < 2:
            raise ValueError(f"an unbiased variance needs at least 2 masked-in values, got {int(n)}")
        var = var * n / (n - 1)
    return var


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True,
                  eps: float = 1e-8) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps)`` over the masked positions; ``shift_mean=False`` adds the
    mean back (scale only). Masked-out positions come back as 0."""
    mean = masked_mean(values, mask)
    whitened = (values - mean) * torch.rsqrt(masked_var(values, mask) + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask.bool(), whitened, torch.zeros_like(whitened))


def grpo_advantages(rewards: torch.Tensor, group_size: int, norm_by_std: bool = True,
                    eps: float = 1e-6) -> torch.Tensor:
    """One advantage per sample: its reward minus its group's mean, over the group's (unbiased)
    std + eps when ``norm_by_std`` (Dr. GRPO drops that division). ``rewards`` is ``[N·G]`` with
    prompt ``i``'s ``G`` samples at ``[i·G, (i+1)·G)`` — the order vLLM returns ``n=G`` samples in
    — or already ``[N, G]``; the result has the input's shape. A group whose samples all got the
    same reward has advantage 0 everywhere: it carries no signal."""
    if group_size < 2:
        raise ValueError(f"GRPO needs group_size >= 2 (one sample has nothing to be compared with), got {group_size}")
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    grouped = rewards.reshape(-1, group_size).float()
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if norm_by_std:
        centred = centred / (grouped.std(dim=1, keepdim=True) + eps)
    return centred.reshape(rewards.shape)


def rloo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024, "Back to Basics"): each sample's reward minus the mean of the
    *other* samples of its group, ``r_i - (Σ_j r_j - r_i)/(G-1) = G/(G-1)·(r_i - mean)`` (verl's
    ``compute_rloo_outcome_advantage``). Same layout as ``grpo_advantages``."""
    if group_size < 2:
        raise ValueError(f"RLOO needs group_size >= 2 (a leave-one-out baseline), got {group_size}")
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    grouped = rewards.reshape(-1, group_size).float()
    others = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)
    return (grouped - others).reshape(rewards.shape)


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """``R_t = r_t + γ·R_{t+1}`` over each row's response tokens (``R`` after the last one is 0),
    0 off the mask: REINFORCE++'s returns (Hu 2025; verl's
    ``compute_reinforce_plus_plus_outcome_advantage`` before its whitening)."""
    _check_same_shape(rewards=rewards, mask=mask)
    rewards, keep = rewards.float(), mask.bool()
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        running = torch.where(keep[:, t], rewards[:, t] + gamma * running, running)
        returns[:, t] = torch.where(keep[:, t], running, torch.zeros_like(running))
    return returns


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer_len: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13): 0 for a response of at most
    ``max_len - buffer_len`` tokens, then falling linearly to ``-factor`` at ``max_len`` (and
    staying there): ``factor · ((max_len - buffer_len) - L) / buffer_len``, added to the reward."""
    if not 0 < buffer_len <= max_len:
        raise ValueError(f"the overlong buffer must be within the response limit: 0 < {buffer_len} <= {max_len}")
    over = (lengths.float() - (max_len - buffer_len)).clamp(min=0, max=buffer_len)
    return -factor * over / buffer_len


OFF_POLICY_CORRECTIONS = ("tis", "icepop", "seq_tis", "seq_mask")


def off_policy_weights(logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor,
                       correction: str = "tis", cap: float = 2.0, low: float = 0.5, high: float = 5.0) -> torch.Tensor:
    """Importance weights of samples generated by another policy (the rollout engine:
    ``behaviour_logprobs``, per token) for the trainer's (``logprobs``), detached, ``[B, T]``, 0
    off the mask. With ``ρ_t = π/π_behaviour`` per token and ``ρ_seq = Π_t ρ_t`` per sequence:

    - ``tis``: ``min(ρ_t, cap)`` — truncated importance sampling (Yao et al. 2025, "Your efficient
      RL framework secretly brings you off-policy RL training"; verl's token-level ``rollout_is``);
    - ``icepop``: ``ρ_t`` where ``low <= ρ_t <= high``, else 0 — the token leaves the loss; inside
      the band the ratio itself is kept (IcePop, inclusionAI 2025: masked importance sampling at
      the token level);
    - ``seq_tis``: ``min(ρ_seq, cap)`` on every token of the sequence (sequence-level truncated IS;
      verl's ``rollout_is: sequence``);
    - ``seq_mask``: ``ρ_seq`` where ``low <= ρ_seq <= high``, else 0 on every token of the sequence
      (sequence-level masked IS: the whole sample leaves the loss).

    The sequence ratio is a product over the sequence's masked-in tokens, computed as
    ``exp(Σ log ρ_t)`` with the sum clamped to ±20 (``exp`` stays finite; such a sequence is
    truncated or masked either way)."""
    _check_same_shape(logprobs=logprobs, behaviour_logprobs=behaviour_logprobs, mask=mask)
    log_ratio = logprobs.detach().float() - behaviour_logprobs.float()
    keep = mask.bool()
    if correction in ("tis", "icepop"):
        ratio = torch.exp(torch.where(keep, log_ratio, torch.zeros_like(log_ratio)))
    elif correction in ("seq_tis", "seq_mask"):
        seq = masked_sum(log_ratio, mask, dim=-1).clamp(-20.0, 20.0)
        ratio = torch.exp(seq)[:, None].expand(mask.shape)
    else:
        raise ValueError(f"unknown off-policy correction {correction!r}; known: {', '.join(OFF_POLICY_CORRECTIONS)}")
    if correction in ("tis", "seq_tis"):
        w = ratio.clamp(max=cap)
    else:
        w = torch.where((ratio >= low) & (ratio <= high), ratio, torch.zeros_like(ratio))
    return torch.where(keep, w, torch.zeros_like(w))


def mismatch_stats(log_ratios: torch.Tensor, seq_log_ratios: torch.Tensor) -> dict[str, float]:
    """How far the trainer's log-probs are from the rollout engine's, over the tokens generated
    with the trainer's own weights: ``log_ratios`` (1-d, ``log π_train - log π_rollout`` per
    token, every rank's together) and ``seq_log_ratios`` (1-d, each sequence's sum of them).

    ``logprob_diff_max`` / ``_mean`` / ``_p99``: of ``|log_ratio|`` (the stale check reads the
    max); ``kl``: the k3 estimate of KL(π_rollout ‖ π_train) from the rollout's samples,
    ``mean(ρ - 1 - log ρ)`` (verl's ``rollout_corr`` k3, never negative); ``seq_ratio_mean`` /
    ``_min`` / ``_max``: of ``ρ_seq = exp(Σ log ρ_t)`` per sequence, the weight a sequence-level
    correction would start from (``exp`` of the sum clamped to ±20). Empty inputs give 0 and a
    count of 0: nothing was compared."""
    lr = log_ratios.detach().double().reshape(-1)
    seq = seq_log_ratios.detach().double().reshape(-1)
    out = {"tokens": int(lr.numel()), "sequences": int(seq.numel())}
    if lr.numel():
        diff = lr.abs()
        out.update(logprob_diff_max=float(diff.max()), logprob_diff_mean=float(diff.mean()),
                   logprob_diff_p99=float(torch.quantile(diff, 0.99)), kl=float((torch.expm1(lr) - lr).mean()))
    else:
        out.update(logprob_diff_max=0.0, logprob_diff_mean=0.0, logprob_diff_p99=0.0, kl=0.0)
    if seq.numel():
        ratio = torch.exp(seq.clamp(-20.0, 20.0))
        out.update(seq_ratio_mean=float(ratio.mean()), seq_ratio_min=float(ratio.min()), seq_ratio_max=float(ratio.max()))
    else:
        out.update(seq_ratio_mean=1.0, seq_ratio_min=1.0, seq_ratio_max=1.0)
    return out


def mismatch_over_ranks(shares: list[dict]) -> dict[str, float]:
    """``mismatch_stats`` over every DP rank's share (``actors.hybrid.mismatch_share``: ranks of
    one DP index — TP or PP peers — report the same rows and count once), keys prefixed
    ``mismatch_`` as the run's record has them."""
    by_rank: dict[int, dict] = {}
    for share in shares:
        by_rank.setdefault(int(share["dp_rank"]), share)
    parts = [by_rank[r] for r in sorted(by_rank)]
    stats = mismatch_stats(torch.cat([torch.as_tensor(p["log_ratio"]).reshape(-1) for p in parts]) if parts
                           else torch.zeros(0),
                           torch.cat([torch.as_tensor(p["seq_log_ratio"]).reshape(-1) for p in parts]) if parts
                           else torch.zeros(0))
    return {f"mismatch_{k}": v for k, v in stats.items()}


def per_token(per_sequence: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` -> ``[B, T]``: each sequence's value on every one of its response tokens, 0 on padding."""
    spread = per_sequence[:, None].expand(mask.shape)
    return torch.where(mask.bool(), spread, torch.zeros_like(spread))


def aggregate(loss: torch.Tensor, mask: torch.Tensor, mode: Aggregation = "token-mean",
              norm_len: int | None = None) -> torch.Tensor:
    """Reduce a ``[B, T]`` per-token loss to a scalar.

    ``token-mean``: every token of the batch weighs the same (DAPO; long answers weigh more).
    ``seq-mean-token-mean``: mean per sequence, then over sequences (original GRPO).
    ``seq-mean-token-sum``: sum per sequence, then mean over sequences.
    ``seq-mean-token-sum-norm``: sum per sequence over a constant ``norm_len`` (the longest
    response allowed), then mean over sequences — Dr. GRPO's, which removes the per-response length
    normalisation (Liu et al. 2025, "Understanding R1-Zero-Like Training": ``1/G Σ_i Σ_t`` over a
    constant; the authors' code divides each sum by the generation budget and averages over the
    batch). verl's mode of the same name sums over the sequences instead of averaging them
    (``Σ_i Σ_t / T``): B times this value for a batch of B sequences — the same direction, a step
    B times larger. Sequences without tokens are left out of the sequence means."""
    if mode == "token-mean":
        return masked_mean(loss, mask)
    per_seq = masked_sum(loss, mask, dim=-1)
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / mask.sum(-1).clamp(min=1)
    elif mode == "seq-mean-token-sum-norm":
        if not norm_len:
            raise ValueError("seq-mean-token-sum-norm needs norm_len (the longest response allowed)")
        per_seq = per_seq / norm_len
    elif mode != "seq-mean-token-sum":
        raise ValueError(f"unknown loss aggregation {mode!r}; known: {', '.join(AGGREGATIONS)}")
    has_tokens = mask.sum(-1) > 0
    return masked_mean(per_seq, has_tokens)


LOG_RATIO_CLAMP = 20.0  # verl's bound on log π/π_old before the exp


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, clip_eps: float = 0.2, clip_eps_high: float | None = None,
                aggregation: Aggregation = "token-mean", norm_len: int | None = None,
                dual_clip: float | None = None, log_ratio_clamp: float | None = LOG_RATIO_CLAMP
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-clip: ``max(-A·r, -A·clip(r, 1-ε_low, 1+ε_high))`` per token with ``r = exp(logp -
    old_logp)``, aggregated. ``clip_eps_high`` (DAPO's clip-higher) defaults to ``clip_eps``.
    ``dual_clip`` c > 1 (Ye et al. 2020; verl's ``clip_ratio_c``): where ``A < 0`` the per-token
    loss is also capped at ``-c·A``, so a token whose ratio ran far above 1 cannot dominate.
    ``log_ratio_clamp``: ``logp - old_logp`` clamped to ±that before the ``exp`` (verl: 20), a
    guard against an overflowing ratio that changes nothing in the normal range.
    Returns the loss and detached stats: ``clipfrac`` (tokens where the clipped branch was taken),
    ``approx_kl`` (``mean(old - new)``, k1 from the old policy) and ``ratio`` (mean)."""
    _check_same_shape(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask)
    high = clip_eps if clip_eps_high is None else clip_eps_high
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(_clamped(log_ratio, log_ratio_clamp))
    per_token_loss, clipped = _pessimistic(ratio, advantages, clip_eps, high, dual_clip)
    loss = aggregate(per_token_loss, mask, aggregation, norm_len)
    return loss, _ratio_stats(log_ratio, ratio, clipped, mask)


def _clamped(log_ratio: torch.Tensor, bound: float | None) -> torch.Tensor:
    return log_ratio if bound is None else log_ratio.clamp(-bound, bound)


def _pessimistic(ratio: torch.Tensor, advantages: torch.Tensor, low: float, high: float,
                 dual_clip: float | None = None):
    """PPO's per-token ``max(-A·r, -A·clip(r, 1-low, 1+high))`` (with ``dual_clip`` c: at most
    ``-c·A`` where ``A < 0``), and where a clipped branch won."""
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - low, 1.0 + high)
    loss = torch.maximum(unclipped, clipped)
    took_clip = clipped > unclipped
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1 (a cap at c·|A| for negative advantages), got {dual_clip}")
        capped = torch.minimum(loss, -advantages * dual_clip)
        negative = advantages < 0
        took_clip = took_clip | (negative & (capped < loss))
        loss = torch.where(negative, capped, loss)
    return loss, took_clip


def _ratio_stats(log_ratio: torch.Tensor, ratio: torch.Tensor, clipped: torch.Tensor,
                 mask: torch.Tensor) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        return {"clipfrac": masked_mean(clipped.float(), mask), "approx_kl": masked_mean(-log_ratio, mask),
                "ratio": masked_mean(ratio, mask)}


def gspo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
              mask: torch.Tensor, clip_eps: float = 3e-4, clip_eps_high: float | None = 4e-4,
              aggregation: Aggregation = "seq-mean-token-mean", norm_len: int | None = None
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"), in its token form: the
    importance ratio of a whole sequence, ``s_i = exp(mean_t (logp - old_logp))`` (the geometric
    mean of its tokens' ratios), clipped to ``[1-ε_low, 1+ε_high]`` in PPO's pessimistic max; each
    token carries ``s_i`` with the gradient of its own log-prob (``logp - sg(logp) + sg(log s_i)``,
    the paper's GSPO-token, equal to GSPO for per-sequence advantages). The paper's clip range is
    tiny (3e-4 / 4e-4) because a sequence ratio moves far less than a token's. The paper and verl
    aggregate per sequence, then over sequences (``seq-mean-token-mean``, the default here).
    ``clipfrac``: tokens whose sequence took the clipped branch."""
    _check_same_shape(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask)
    high = clip_eps if clip_eps_high is None else clip_eps_high
    log_ratio = logprobs - old_logprobs
    seq_log_ratio = masked_sum(log_ratio, mask, dim=-1) / mask.sum(-1).clamp(min=1)
    # every token: the sequence's ratio as its value, its own log-prob's gradient
    log_s = logprobs - logprobs.detach() + seq_log_ratio.detach()[:, None]
    ratio = torch.exp(log_s.clamp(max=10.0))  # verl's guard against an overflowing exp
    per_token_loss, clipped = _pessimistic(ratio, advantages, clip_eps, high)
    loss = aggregate(per_token_loss, mask, aggregation, norm_len)
    return loss, _ratio_stats(log_ratio, ratio, clipped, mask)


def cispo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
               mask: torch.Tensor, clip_eps: float = 1.0, clip_eps_high: float | None = 0.28,
               aggregation: Aggregation = "token-mean", norm_len: int | None = None,
               log_ratio_clamp: float | None = LOG_RATIO_CLAMP) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO (MiniMax-M1, Chen et al. 2025): ``-sg(clip(r, 1-ε_low, 1+ε_high)) · A · logp`` per
    token. The importance weight is clipped and carries no gradient; every token's log-prob keeps
    its gradient (PPO-clip drops the tokens whose ratio left the range — often the rare tokens that
    matter for reasoning). The paper sets no lower bound (``clip_eps`` 1.0: the weight is at least
    0) and tunes ``ε_high``. ``clipfrac``: tokens whose weight was clipped."""
    _check_same_shape(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask)
    high = clip_eps if clip_eps_high is None else clip_eps_high
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(_clamped(log_ratio, log_ratio_clamp))
    weight = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + high).detach()
    per_token_loss = -advantages * weight * logprobs
    loss = aggregate(per_token_loss, mask, aggregation, norm_len)
    return loss, _ratio_stats(log_ratio, ratio, weight != ratio.detach(), mask)


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: KLEstimator = "k3",
               clamp: float | None = None) -> torch.Tensor:
    """Per-token estimate of KL(π ‖ π_ref) from samples of π (Schulman, "Approximating KL
    divergence"), with ``log_r = ref_logp - logp``:

    ``k1 = -log_r`` (unbiased, high variance, can be negative),
    ``k2 = log_r² / 2`` (biased, low variance),
    ``k3 = (exp(log_r) - 1) - log_r`` (unbiased, low variance, never negative; verl's
    ``low_var_kl``, which also clamps it to ±10). ``clamp``: the estimate clamped to ±that (the
    run's ``algorithm.kl_clamp``, 10 by default: one token whose log-ratio is ~13 would otherwise
    add ~5e5); None: unclamped, Schulman's estimators as they are."""
    _check_same_shape(logprobs=logprobs, ref_logprobs=ref_logprobs)
    log_r = ref_logprobs - logprobs
    if estimator == "k1":
        kl = -log_r
    elif estimator == "k2":
        kl = 0.5 * log_r ** 2
    elif estimator == "k3":
        kl = torch.expm1(log_r) - log_r
    else:
        raise ValueError(f"unknown KL estimator {estimator!r}; known: {', '.join(KL_ESTIMATORS)}")
    return kl if clamp is None else kl.clamp(-clamp, clamp)


def logprobs_from_logits(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``log softmax(logits)[token]``: ``logits [..., V]`` at the positions that *predict*
    ``tokens [...]`` (for a causal LM, the logits one position before each response token)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of ``softmax(logits)`` over the last dim: ``logsumexp(z) - Σ softmax(z)·z`` —
    stable for large logits, where ``-Σ p log p`` would meet ``0 · -inf``."""
    logits = logits.float()
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(-1)


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """Index of each row's last masked-in token (``[B]``); -1 for a row with none."""
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    return torch.where(mask.bool(), positions, torch.full_like(positions, -1)).max(-1).values


def token_rewards(scores: torch.Tensor, mask: torch.Tensor, kl: torch.Tensor | None = None,
                  kl_coef: float = 0.0) -> torch.Tensor:
    """PPO's per-token reward ``[B, T]``: ``-kl_coef · kl`` on every response token, plus the
    sequence's score on its *last* response token (the reward model judges the whole answer, so
    that is where it arrives; GAE carries it back). Rows without tokens get nothing."""
    rewards = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    if kl is not None and kl_coef:
        _check_same_shape(kl=kl, mask=mask)
        rewards = rewards - kl_coef * torch.where(mask.bool(), kl.float(), torch.zeros_like(rewards))
    last = last_token_index(mask)
    rows = torch.nonzero(last >= 0).squeeze(-1)
    rewards[rows, last[rows]] += scores.float()[rows]
    return rewards


def gae(values: torch.Tensor, rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
        lam: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the response tokens:
    ``δ_t = r_t + γ·V_{t+1} - V_t``, ``A_t = δ_t + γλ·A_{t+1}``, ``returns = A + V``, with
    ``V`` after the last response token = 0 (the episode ends there). Masked-out positions are
    skipped, not treated as steps — the recursion carries ``V_{t+1}`` and ``A_{t+1}`` across them
    (verl's form, which also handles masks with holes) — and come back as 0 in both outputs.
    Not whitened: call ``masked_whiten`` on the advantages as the recipe wants."""
    _check_same_shape(values=values, rewards=rewards, mask=mask)
    values, rewards, keep = values.detach().float(), rewards.detach().float(), mask.bool()
    next_value = torch.zeros_like(values[:, 0])
    next_advantage = torch.zeros_like(values[:, 0])
    advantages = torch.zeros_like(values)
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        k = keep[:, t]
        advantages[:, t] = torch.where(k, advantage, torch.zeros_like(advantage))
        next_value = torch.where(k, values[:, t], next_value)
        next_advantage = torch.where(k, advantage, next_advantage)
    returns = torch.where(keep, advantages + values, torch.zeros_like(values))
    return advantages, returns


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip_eps: float | None = 0.2, aggregation: Aggregation = "token-mean"
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss ``½·max((V - R)², (V_old + clip(V - V_old, ±ε) - R)²)``, aggregated
    (``clip_eps=None``: plain ``½(V - R)²``). Stats: ``vf_clipfrac`` (tokens where the clipped
    error was the larger)."""
    _check_same_shape(values=values, old_values=old_values, returns=returns, mask=mask)
    unclipped = (values - returns) ** 2
    if clip_eps is None:
        per_token_loss = unclipped
        clipfrac = torch.zeros(())
    else:
        clipped_values = old_values + torch.clamp(values - old_values, -clip_eps, clip_eps)
        clipped = (clipped_values - returns) ** 2
        per_token_loss = torch.maximum(unclipped, clipped)
        with torch.no_grad():
            clipfrac = masked_mean((clipped > unclipped).float(), mask)
    return 0.5 * aggregate(per_token_loss, mask, aggregation), {"vf_clipfrac": clipfrac}


def global_masked_whiten(values: torch.Tensor, mask: torch.Tensor, group=None, shift_mean: bool = True,
                         eps: float = 1e-8) -> torch.Tensor:
    """``masked_whiten`` with the mean and (unbiased) variance of the masked positions of *every*
    rank of ``group`` (sums all-reduced over it): each DP rank whitens its share of the batch as
    one process would whiten the whole batch. Without an initialised process group (or a group of
    one) it is ``masked_whiten``. Collective: every rank of ``group`` must call it."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return masked_whiten(values, mask, shift_mean=shift_mean, eps=eps)
    values = values.float()
    sums = torch.stack([masked_sum(values, mask), mask.float().sum()]).double()
    dist.all_reduce(sums, group=group)
    n = sums[1]
    if n < 2:
        raise ValueError(f"an unbiased variance needs at least 2 masked-in values, got {int(n)}")
    mean = (sums[0] / n).float()
    sq = masked_sum((values - mean) ** 2, mask).double().reshape(1)
    dist.all_reduce(sq, group=group)
    var = (sq[0] / (n - 1)).float()
    whitened = (values - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask.bool(), whitened, torch.zeros_like(whitened))


def ppo_batch(old_logprobs: torch.Tensor, ref_logprobs: torch.Tensor | None, values: torch.Tensor,
              scores: torch.Tensor, mask: torch.Tensor, *, kl_coef: float = 0.05,
              kl_estimator: KLEstimator = "k1", kl_clamp: float | None = None, gamma: float = 1.0,
              lam: float = 0.95, whiten: bool = True, group=None) -> dict[str, torch.Tensor]:
    """Everything PPO needs from one rollout batch, per token ``[B, T]`` (this rank's share):

    ``kl`` = ``kl_penalty(old, ref, kl_estimator, kl_clamp)`` (0 without a reference); ``rewards`` =
    ``token_rewards``: ``-kl_coef·kl`` on every response token plus the sequence's ``scores[b]``
    on its last one; ``advantages``/``returns`` from ``gae`` on the critic's ``values`` (the
    returns are the critic's targets and are never whitened); the advantages then whitened over
    the *global* batch (``global_masked_whiten`` over ``group``, collective) when ``whiten``.
    Masked-out positions are 0 in every output."""
    _check_same_shape(old_logprobs=old_logprobs, values=values, mask=mask)
    if ref_logprobs is None:
        kl = torch.zeros_like(old_logprobs, dtype=torch.float32)
    else:
        kl = kl_penalty(old_logprobs.float(), ref_logprobs.float(), kl_estimator, kl_clamp)
    kl = torch.where(mask.bool(), kl, torch.zeros_like(kl))
    rewards = token_rewards(scores, mask, kl, kl_coef)
    advantages, returns = gae(values, rewards, mask, gamma=gamma, lam=lam)
    if whiten:
        advantages = global_masked_whiten(advantages, mask, group=group)
    return {"kl": kl, "rewards": rewards, "advantages": advantages, "returns": returns}
