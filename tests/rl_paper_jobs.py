"""The papers' RL maths written a second time, independently of ``rlhf_switch/rl``, and the jobs
``tests/test_rl_paper.py`` runs on one process and on two gloo ranks.

``oracle_loss`` is each algorithm's whole-batch objective as its paper (or verl, where named)
writes it, token by token in plain Python loops over the batch — no function of the project's is
called — so a bug in a shared helper of ``rl/algorithms.py`` cannot hide in both. ``TableEngine``
is the smallest training engine with the project's interface: a bigram table of logits (``W[a, b]``:
the logit of token ``b`` after token ``a``) trained by plain SGD, averaging gradients over DP as
the real engines do. ``update_step`` runs ``Algorithm.update`` on one rank's share of ``BATCH``;
``oracle_step`` takes one SGD step on the oracle's whole-batch loss: the two must land on the same
table whether the update ran on one rank or on two.

The batch: three prompts of two samples each (groups of 2), responses of 3, 1, 4, 2, 4 and 3
tokens, prompts of 2 or 3 tokens; on two DP ranks the middle group spans both ranks' shares.

PPO adds a critic: ``ValueTableEngine`` (``V[a]``: the value of the state whose last token is
``a``) under the project's own ``actors.critic.Critic``, so ``update_step`` runs the critic's real
update; the oracle writes out the KL-shaped per-token rewards, GAE, the whitening and the clipped
value loss, and both tables — the policy's and the values' — must land where its step lands. The
old values (the critic's at rollout time) sit ``VALUE_SHIFT`` away from the table's current ones,
as after an earlier mini-batch, so the value clip acts on some tokens.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

V = 8          # vocabulary of the bigram table
PAD = 0
PROMPTS = [[1, 3], [1, 3], [1, 4, 5], [1, 4, 5], [1, 6], [1, 6]]
RESPONSES = [[5, 6, 2], [7], [3, 3, 6, 2], [6, 2], [2, 5, 7, 4], [4, 4, 2]]
SCORES = [1.0, 0.0, 0.5, 0.5, 0.0, 1.0]   # the middle group has no signal
GROUP = 2
MAX_NEW = 4
LR = 0.5
# per response token, how far the old policy's log-prob sits from the table's (ratio r = e^-δ):
# some inside PPO's [0.8, 1.2], some outside on either side, one far out for the dual clip
OLD_SHIFT = [[0.10, -0.30, 0.05], [0.25], [-0.05, 1.50, 0.0, -0.20], [0.30, -0.10], [0.0, 0.20, -0.25, 0.15],
             [-1.50, 0.05, 0.10]]
# GSPO: one shift per sequence (its ratio exp(mean δ) in or out of the paper's tiny range)
GSPO_SHIFT = [-2e-4, 5e-4, 0.0, 1e-3, -1e-3, 3e-4]
# the reference's log-prob over the table's: one token 3 nats above (k3 = e^3 - 4 ≈ 16: clamped at 10)
REF_SHIFT = [[0.2, -0.1, 0.0], [0.4], [0.1, 0.0, 3.0, -0.3], [-0.2, 0.1], [0.05, -0.15, 0.3, 0.0], [0.0, 0.25, -0.1]]
# the rollout engine's log-prob over the old policy's, and which samples are fresh (the trainer's version)
ROLLOUT_SHIFT = [[0.05, -0.02, 0.9], [-0.4], [0.0, 0.02, -0.01, 0.3], [0.7, -0.8], [0.01, 0.0, 0.0, -0.05],
                 [0.2, 0.3, 0.1]]
FRESH = [True, False, True, True, False, True]
# the critic's old values over its current ones (PPO): some inside the value clip of 0.2, some outside
VALUE_SHIFT = [[0.05, -0.3, 0.1], [0.4], [0.0, 0.15, -0.25, 0.1], [-0.1, 0.3], [0.2, -0.05, 0.0, 0.35],
               [-0.4, 0.1, 0.05]]


def positions(b: int) -> list[int]:
    """The columns (of the ``[B, T-1]`` log-prob grid) of sequence ``b``'s response tokens."""
    p = len(PROMPTS[b])
    return [p - 1 + t for t in range(len(RESPONSES[b]))]


def table(seed: int = 0) -> torch.Tensor:
    return torch.randn(V, V, generator=torch.Generator().manual_seed(seed)) * 0.5


def value_table(seed: int = 1) -> torch.Tensor:
    return torch.randn(V, generator=torch.Generator().manual_seed(seed)) * 0.5


def bigram_logprobs(W: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``[B, T-1]``: log softmax of ``W[ids[:, t]]`` at ``ids[:, t+1]``."""
    return torch.log_softmax(W[ids[:, :-1]], dim=-1).gather(-1, ids[:, 1:, None])[..., 0]


def padded_ids(rows=None) -> torch.Tensor:
    rows = list(range(len(PROMPTS))) if rows is None else rows
    seqs = [PROMPTS[b] + RESPONSES[b] for b in rows]
    T = max(len(s) for s in seqs)
    return torch.tensor([s + [PAD] * (T - len(s)) for s in seqs])


class TableEngine:
    """A training engine over the bigram table (``engines.base.TrainingEngine``'s methods the
    algorithm calls): ``outputs`` the log-probs, ``train_step`` micro-batches with the loss's
    backward, gradients averaged over DP (all-reduce / dp, as DDP, FSDP and ZeRO do), one SGD step."""

    def __init__(self, W: torch.Tensor, dp: int = 1, dp_rank: int = 0, dp_group=None):
        self.W = torch.nn.Parameter(W.clone())
        self.dp, self.dp_rank, self.dp_group = dp, dp_rank, dp_group  # None: the whole world

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return bigram_logprobs(self.W, ids)

    def outputs(self, ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.forward(ids)

    def train_step(self, ids: torch.Tensor, micro: int, loss_fn) -> dict:
        self.W.grad = None
        stats = []
        for s in range(0, ids.shape[0], micro):
            sl = slice(s, s + micro)
            loss, st = loss_fn(self.forward(ids[sl]), sl)
            loss.backward()
            stats.append(st)
        grad = self.W.grad
        if self.dp > 1:
            dist.all_reduce(grad, group=self.dp_group)
            grad /= self.dp
        with torch.no_grad():
            self.W -= LR * grad
        return {"grad_norm": float(grad.norm()), "stats": stats}


class ValueTableEngine(TableEngine):
    """A value-head engine (what ``actors.critic.Critic`` drives) over a table ``W[a]``: the value
    of the state whose last token is ``a``, ``[B, T-1]`` as the critic's values are."""

    head, adapter, spec = "value", None, None

    def __init__(self, W: torch.Tensor, dp: int = 1, dp_rank: int = 0, dp_group=None):
        super().__init__(W, dp, dp_rank, dp_group)
        self.name = f"value table DP{dp}"

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.W[ids[:, :-1]]


# --- the batch and the old/reference/rollout policies ------------------------------------------

def policies(W: torch.Tensor, name: str, values: torch.Tensor | None = None) -> dict[str, list[list[float]]]:
    """Per response token (as ``RESPONSES``): the table's log-prob, the old policy's, the
    reference's and the rollout engine's; with a value table, the critic's old values."""
    lp = bigram_logprobs(W, padded_ids())
    out = {"lp": [], "old": [], "ref": [], "rollout": [], "values": []}
    for b in range(len(PROMPTS)):
        cur = [float(lp[b, c]) for c in positions(b)]
        old = ([x - GSPO_SHIFT[b] for x in cur] if name == "gspo" else
               [x - d for x, d in zip(cur, OLD_SHIFT[b])])
        out["lp"].append(cur)
        out["old"].append(old)
        out["ref"].append([x + d for x, d in zip(cur, REF_SHIFT[b])])
        out["rollout"].append([x + d for x, d in zip(old, ROLLOUT_SHIFT[b])])
        if values is not None:  # V of the state before each response token: its predecessor's entry
            seq = PROMPTS[b] + RESPONSES[b]
            out["values"].append([float(values[seq[c]]) + d for c, d in zip(positions(b), VALUE_SHIFT[b])])
    return out


def grid(per_token: list[list[float]], rows: list[int]) -> torch.Tensor:
    """Per-token values of ``rows`` on their ``[b, T-1]`` grid (0 off the responses)."""
    T = padded_ids(rows).shape[1]
    out = torch.zeros(len(rows), T - 1)
    for i, b in enumerate(rows):
        for c, v in zip(positions(b), per_token[b]):
            out[i, c] = v
    return out


def batch(cfg, pol: dict) -> dict:
    """The batch the driver sends every trainer rank (``recipes.loop.Loop.advantages``)."""
    from rlhf_switch.rl.algorithm import Algorithm

    return {"prompts": PROMPTS, "responses": RESPONSES, "rollout_logprobs": pol["rollout"], "fresh": FRESH,
            **Algorithm.build(cfg).batch_fields(SCORES)}


# --- the update, as the project runs it ---------------------------------------------------------

def update_step(cfg_data: dict, W: torch.Tensor, dp: int = 1, dp_rank: int | None = None,
                dp_group=None) -> torch.Tensor:
    """``Algorithm.update`` on DP rank ``dp_rank``'s share (on a gloo world of ``dp`` ranks when
    ``dp > 1``, or on ``dp_group``; the rank is the process's own there); the table after the step
    — with a critic, the value table after its step as one more row."""
    return _update(cfg_data, W, dp, dp_rank, dp_group)[0]


def update_record(cfg_data: dict, W: torch.Tensor) -> dict:
    """What ``Algorithm.update`` returns on one rank: its stats for the run's record."""
    return _update(cfg_data, W)[1]


def _update(cfg_data: dict, W: torch.Tensor, dp: int = 1, dp_rank: int | None = None, dp_group=None):
    from actors.critic import Critic
    from rlhf_switch.rl.algorithm import Algorithm, OldPolicy, RankBatch
    from rlhf_switch.rl.config import load_config

    cfg = load_config(cfg_data).algorithm
    if dp_rank is None:
        dp_rank = dist.get_rank(dp_group) if dp > 1 else 0
    alg = Algorithm.build(cfg)
    values = value_table() if alg.needs_critic else None
    pol = policies(W, cfg.name, values)
    rows = RankBatch.of(batch(cfg, pol), dp, dp_rank, PAD, cfg, torch.device("cpu"))
    per = len(PROMPTS) // dp
    mine = list(range(dp_rank * per, (dp_rank + 1) * per))
    critic = Critic(ValueTableEngine(values, dp, dp_rank, dp_group)) if values is not None else None
    old = OldPolicy(grid(pol["old"], mine), grid(pol["ref"], mine),
                    grid(pol["values"], mine) if values is not None else None)
    engine = TableEngine(W, dp, dp_rank, dp_group)
    record = alg.update(engine, critic, rows, old)
    tables = engine.W.detach().clone() if critic is None else torch.cat([engine.W.detach(), critic.engine.W.detach()[None]])
    return tables, record


def update_step_in_pairs(cfg_data: dict, W: torch.Tensor) -> torch.Tensor:
    """``update_step`` on a world of 4 ranks as two DP groups of 2 ({0, 1} and {2, 3}, as beside a
    TP or PP peer): every collective of the update must stay inside its rank's own DP group."""
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes both
    return update_step(cfg_data, W, 2, dp_group=pairs[dist.get_rank() // 2])


# --- the papers' objectives, written out -------------------------------------------------------

def _mean(xs):
    return sum(xs) / len(xs)


def _std_unbiased(xs):
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def _kl(est: str, lp, ref, clamp):
    """Schulman's estimators of KL(π‖π_ref) at one token, ``log r = ref - lp``, clamped."""
    log_r = ref - lp
    k = {"k1": -log_r, "k2": 0.5 * log_r ** 2, "k3": torch.exp(torch.as_tensor(log_r)) - 1 - log_r}[est]
    return torch.clamp(torch.as_tensor(k), -clamp, clamp) if clamp is not None else torch.as_tensor(k)


def group_advantages(rewards: list[float], norm_by_std: bool, eps: float = 1e-6, leave_one_out: bool = False):
    """GRPO (DeepSeekMath eq. 3: (r - mean) / std, unbiased as verl and TRL compute it), Dr. GRPO
    (no std) and RLOO (r_i minus the mean of the other G-1)."""
    out = []
    for g in range(0, len(rewards), GROUP):
        rs = rewards[g:g + GROUP]
        for i, r in enumerate(rs):
            if leave_one_out:
                out.append(r - (sum(rs) - r) / (len(rs) - 1))
            elif norm_by_std:
                out.append((r - _mean(rs)) / (_std_unbiased(rs) + eps))
            else:
                out.append(r - _mean(rs))
    return out


def _whiten(values: list[list[float]]) -> list[list[float]]:
    """Over every token of the batch: (x - mean) / sqrt(unbiased var + 1e-8)."""
    flat = [v for row in values for v in row]
    m = _mean(flat)
    var = sum((v - m) ** 2 for v in flat) / (len(flat) - 1)
    return [[(v - m) / math.sqrt(var + 1e-8) for v in row] for row in values]


def correction_weights(cfg, pol) -> list[list[float]]:
    """The off-policy weight of every token: ρ = π_old/π_rollout per token, or Π_t ρ_t per sequence."""
    op = cfg.off_policy
    out = []
    for b in range(len(PROMPTS)):
        rho = [math.exp(o - r) for o, r in zip(pol["old"][b], pol["rollout"][b])]
        seq = math.exp(max(-20.0, min(20.0, sum(o - r for o, r in zip(pol["old"][b], pol["rollout"][b])))))
        if op.correction == "tis":
            w = [min(x, op.cap) for x in rho]
        elif op.correction == "icepop":
            w = [x if op.low <= x <= op.high else 0.0 for x in rho]
        elif op.correction == "seq_tis":
            w = [min(seq, op.cap)] * len(rho)
        elif op.correction == "seq_mask":
            w = [seq if op.low <= seq <= op.high else 0.0] * len(rho)
        else:
            w = [1.0] * len(rho)
        if op.correct == "stale" and FRESH[b]:
            w = [1.0] * len(rho)
        out.append(w)
    return out


def _gae(rewards: list[float], values: list[float], gamma: float, lam: float) -> list[float]:
    """GAE (Schulman et al. 2016) on one response: δ_t = r_t + γ·V_{t+1} - V_t with V = 0 after
    the last token, A_t = δ_t + γλ·A_{t+1}."""
    out, next_v, next_a = [0.0] * len(rewards), 0.0, 0.0
    for t in reversed(range(len(rewards))):
        next_a = rewards[t] + gamma * next_v - values[t] + gamma * lam * next_a
        out[t], next_v = next_a, values[t]
    return out


def ppo_targets(cfg, pol) -> tuple[list[list[float]], list[list[float]]]:
    """PPO's advantages and the critic's targets (InstructGPT's per-token reward: -β·KL on every
    token, the score on the last; GAE on the old values; the advantages whitened over the batch,
    the returns A + V not)."""
    adv, returns = [], []
    for b in range(len(PROMPTS)):
        r = [-cfg.kl_coef * float(_kl(cfg.kl_estimator, o, f, cfg.kl_clamp)) for o, f in zip(pol["old"][b], pol["ref"][b])]
        r[-1] += SCORES[b]
        a = _gae(r, pol["values"][b], cfg.gamma, cfg.lam)
        adv.append(a)
        returns.append([x + v for x, v in zip(a, pol["values"][b])])
    return (_whiten(adv) if cfg.whiten_advantages else adv), returns


def oracle_advantages(cfg, pol) -> tuple[list[list[float]], list[list[float]] | None]:
    """Every token's advantage, from the rollout-time policies ``pol`` of the whole batch (they do
    not change while the update steps), off-policy weights applied; and PPO's critic targets."""
    name, B = cfg.name, len(PROMPTS)
    old, ref = pol["old"], pol["ref"]
    beta, clamp = cfg.kl_coef, cfg.kl_clamp
    returns = None
    if name in ("grpo", "dapo", "gspo", "cispo"):
        adv = [[a] * len(RESPONSES[b]) for b, a in enumerate(group_advantages(SCORES, True))]
    elif name == "dr_grpo":
        adv = [[a] * len(RESPONSES[b]) for b, a in enumerate(group_advantages(SCORES, False))]
    elif name == "rloo":  # the KL (k1, old vs reference) in each sequence's reward, then leave-one-out
        rewards = [SCORES[b] - beta * sum(float(_kl(cfg.kl_estimator, o, r, clamp)) for o, r in zip(old[b], ref[b]))
                   for b in range(B)]
        adv = [[a] * len(RESPONSES[b]) for b, a in enumerate(group_advantages(rewards, False, leave_one_out=True))]
    elif name == "reinforce_pp":  # -β·KL on every token, the score on the last; returns; whitened
        rets = []
        for b in range(B):
            r = [-beta * float(_kl(cfg.kl_estimator, o, f, clamp)) for o, f in zip(old[b], ref[b])]
            r[-1] += SCORES[b]
            rets.append([sum(r[t:]) for t in range(len(r))])
        adv = _whiten(rets)
    elif name == "reinforce_pp_baseline":
        centred = group_advantages(SCORES, False)
        adv = _whiten([[centred[b]] * len(RESPONSES[b]) for b in range(B)])
    elif name == "ppo":
        adv, returns = ppo_targets(cfg, pol)
    else:
        raise ValueError(name)
    w = correction_weights(cfg, pol) if cfg.off_policy is not None else [[1.0] * len(r) for r in RESPONSES]
    return [[a * x for a, x in zip(ra, rw)] for ra, rw in zip(adv, w)], returns


def oracle_terms(cfg, pol, W: torch.Tensor, rows, values: torch.Tensor | None = None) -> dict:
    """The objective's terms over the sequences ``rows`` (a mini- or micro-batch) at table ``W``
    (autograd through it) and, for PPO, value table ``values``: ``policy`` (the policy loss,
    aggregated as the config says), ``kl`` (the KL to the reference, aggregated alike; a term of
    the loss where the algorithm puts it there), ``value`` (PPO's clipped value loss), ``loss``
    (their sum), and the token shares ``clipfrac`` / ``vf_clipfrac`` of the clipped branches."""
    name = cfg.name
    adv, returns = oracle_advantages(cfg, pol)
    lp_grid = bigram_logprobs(W, padded_ids())
    lp = {b: [lp_grid[b, c] for c in positions(b)] for b in rows}
    old, ref = pol["old"], pol["ref"]
    beta, clamp = cfg.kl_coef, cfg.kl_clamp

    per_token, clipped_tokens = [], []
    low, high = cfg.clip_eps, cfg.clip_eps if cfg.clip_eps_high is None else cfg.clip_eps_high
    for b in rows:
        row = []
        if name == "gspo":  # the sequence's ratio, exp of its tokens' mean log-ratio (its own length)
            s = torch.exp(sum(lp[b][t] - old[b][t] for t in range(len(lp[b]))) / len(lp[b]))
        for t in range(len(lp[b])):
            A = adv[b][t]
            if name == "cispo":
                r = math.exp(float(lp[b][t].detach()) - old[b][t])
                row.append(-min(max(r, 1 - low), 1 + high) * A * lp[b][t])
                clipped_tokens.append(not 1 - low <= r <= 1 + high)
                continue
            r = s if name == "gspo" else torch.exp(lp[b][t] - old[b][t])
            plain, clipped = -A * r, -A * torch.clamp(r, 1 - low, 1 + high)
            loss, took = torch.maximum(plain, clipped), bool(clipped > plain)
            if cfg.dual_clip is not None and A < 0:
                took = took or bool(-cfg.dual_clip * A < loss)
                loss = torch.minimum(loss, torch.tensor(-cfg.dual_clip * A))
            row.append(loss)
            clipped_tokens.append(took)
        per_token.append(row)

    def aggregate(values):
        mode = cfg.loss_aggregation
        if mode == "token-mean":
            flat = [v for row in values for v in row]
            return sum(flat) / len(flat)
        if mode == "seq-mean-token-mean":
            return sum(sum(row) / len(row) for row in values) / len(values)
        if mode == "seq-mean-token-sum":
            return sum(sum(row) for row in values) / len(values)
        if mode == "seq-mean-token-sum-norm":  # Dr. GRPO: each sum over the budget, mean over sequences
            return sum(sum(row) / MAX_NEW for row in values) / len(values)
        raise ValueError(mode)

    out = {"policy": aggregate(per_token), "clipfrac": _mean(clipped_tokens),
           "kl": aggregate([[_kl(cfg.kl_estimator, lp[b][t], ref[b][t], clamp) for t in range(len(lp[b]))]
                            for b in rows])}
    out["loss"] = out["policy"]
    if beta and name in ("grpo", "dapo", "dr_grpo", "gspo", "cispo", "reinforce_pp_baseline"):  # KL in the loss
        out["loss"] = out["loss"] + beta * out["kl"]
    if name == "ppo":  # the critic's clipped value loss: ½·max((V - R)², (V_old + clip(V - V_old, ±ε) - R)²)
        value_loss, vf_clipped = [], []
        for b in rows:
            seq, row = PROMPTS[b] + RESPONSES[b], []
            for t, c in enumerate(positions(b)):
                v, v_old, R = values[seq[c]], pol["values"][b][t], returns[b][t]
                err = (v - R) ** 2
                if cfg.value_clip_eps is not None:
                    clipped = (v_old + torch.clamp(v - v_old, -cfg.value_clip_eps, cfg.value_clip_eps) - R) ** 2
                    vf_clipped.append(bool(clipped > err))
                    err = torch.maximum(err, clipped)
                row.append(0.5 * err)
            value_loss.append(row)
        out["value"] = aggregate(value_loss)
        out["vf_clipfrac"] = _mean(vf_clipped) if vf_clipped else 0.0
        out["loss"] = out["loss"] + out["value"]
    return out


def oracle_step(cfg_data: dict, W: torch.Tensor) -> torch.Tensor:
    """SGD steps of ``LR`` on the oracle's objective, one per mini-batch of ``mini_batch_size``
    sequences in order, ``epochs`` passes, the old policies and the advantages those of the
    rollout: where ``update_step`` must land (PPO: both tables, the value table as one more row;
    the policy's loss and the critic's share no weight)."""
    from rlhf_switch.rl.config import load_config

    cfg = load_config(cfg_data).algorithm
    values = value_table() if cfg.name == "ppo" else None
    pol = policies(W, cfg.name, values)
    mini = cfg.train_batch_size
    for _ in range(cfg.epochs):
        for start in range(0, len(PROMPTS), mini):
            Wp = W.clone().requires_grad_()
            Vp = values.clone().requires_grad_() if values is not None else None
            oracle_terms(cfg, pol, Wp, range(start, start + mini), Vp)["loss"].backward()
            W = (W - LR * Wp.grad).detach()
            if values is not None:
                values = (values - LR * Vp.grad).detach()
    return W if values is None else torch.cat([W, values[None]])


def oracle_record(cfg_data: dict, W: torch.Tensor) -> dict:
    """What ``Algorithm.update`` reports for a config of one optimizer step in micro-batches of
    ``micro_batch_size``, on one rank: each micro-batch's policy loss, KL and clip share, averaged;
    the step's gradient norm; the critic's whole-batch value loss and clip share; the mean old
    value and return; the off-policy weights' sum and how many are 0; the tokens; the k3 KL of the
    old policy to the reference."""
    from rlhf_switch.rl.config import load_config

    cfg = load_config(cfg_data).algorithm
    assert cfg.train_batch_size == len(PROMPTS) and cfg.epochs == 1, "one optimizer step"
    values = value_table() if cfg.name == "ppo" else None
    pol = policies(W, cfg.name, values)
    micro = [range(s, s + cfg.micro_batch_size) for s in range(0, len(PROMPTS), cfg.micro_batch_size)]
    parts = [oracle_terms(cfg, pol, W, rows, values) for rows in micro]
    Wp = W.clone().requires_grad_()
    whole = oracle_terms(cfg, pol, Wp, range(len(PROMPTS)), values)
    whole["loss"].backward()
    tokens = [(b, t) for b in range(len(PROMPTS)) for t in range(len(RESPONSES[b]))]
    out = {"policy_loss": _mean([float(p["policy"]) for p in parts]), "kl": _mean([float(p["kl"]) for p in parts]),
           "clipfrac": _mean([p["clipfrac"] for p in parts]), "grad_norm": float(Wp.grad.norm()),
           "tokens": len(tokens), "dp_rank": 0,
           "old_vs_ref_kl": _mean([float(_kl("k3", pol["old"][b][t], pol["ref"][b][t], None)) for b, t in tokens])}
    if cfg.off_policy is not None and cfg.off_policy.correction != "none":
        w = correction_weights(cfg, pol)
        out.update(is_weight_sum=sum(w[b][t] for b, t in tokens), is_masked_tokens=sum(w[b][t] == 0 for b, t in tokens))
    if values is not None:
        returns = oracle_advantages(cfg, pol)[1]
        out.update(vf_loss=float(whole["value"]), vf_clipfrac=whole["vf_clipfrac"],
                   value_mean=_mean([pol["values"][b][t] for b, t in tokens]),
                   return_mean=_mean([returns[b][t] for b, t in tokens]))
    return out
