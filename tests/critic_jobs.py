"""Rank jobs for tests/test_critic.py: the PPO critic (actors/critic.py) on a LocalWorld's ranks,
checked against a one-process value model with the same weights."""
from __future__ import annotations

import tempfile

import torch
import torch.distributed as dist

from actors.critic import Critic, CriticLayout, value_model
from rlhf_switch.engines.optim import AdamWConfig
from rlhf_switch.rl.algorithms import global_masked_whiten, masked_whiten, value_loss

MODEL = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=256, vocab_size=64, tie_word_embeddings=False, max_position_embeddings=64)
SEED = 5
OPTIM = AdamWConfig(lr=1e-3, weight_decay=0.01)
B, T, MICRO = 8, 10, 2  # global batch; DP2 -> 4 rows per rank in 2 micro-batches


def data():
    """A global batch: ids, a response mask with uneven lengths (the two DP halves have different
    token counts), fixed returns and perturbed old values."""
    g = torch.Generator().manual_seed(123)
    ids = torch.randint(0, MODEL["vocab_size"], (B, T), generator=g)
    mask = torch.zeros(B, T - 1)
    for b in range(B):
        start = 2 + b % 3
        end = start + 1 + (b * 5) % (T - 1 - start)  # at least one response token
        mask[b, start:end] = 1
    returns = torch.randn(B, T - 1, generator=g)
    noise = 0.3 * torch.randn(B, T - 1, generator=g)
    return ids, mask, returns, noise


def _ref_values(model, ids):
    return model(input_ids=ids, use_cache=False).logits[:, :-1, 0].float()


def critic_vs_reference(engine: str, stage: int = 0, more_steps: int = 4) -> dict:
    """values == the one-process model's; one DP2 update == one full-batch update of the
    one-process model (loss, clipfrac, grad norm, weights, values after); then a few more updates
    on the same returns lower the loss."""
    critic = Critic.build(CriticLayout(engine=engine, zero_stage=stage, dp=dist.get_world_size()), MODEL, SEED,
                          micro_batch=MICRO, optim=OPTIM)
    ref = value_model(MODEL, SEED)
    ref_opt = OPTIM.make(ref.parameters())
    ids, mask, returns, noise = data()
    out: dict = {"name": critic.name}

    # values: every rank asks for the whole batch and must get the reference's values
    v0 = critic.values(ids)
    with torch.no_grad():
        r0 = _ref_values(ref, ids)
    out["values_shape"] = tuple(v0.shape)
    out["values_diff"] = float((v0 - r0).abs().max())
    old = r0 + noise

    # one update, DP2 on each rank's half vs one process on the whole batch
    sl = critic.local_slice
    stats = critic.update(sl(ids), sl(mask), sl(returns), sl(old), clip_eps=0.2, micro_batch=MICRO)
    loss, st = value_loss(_ref_values(ref, ids), old, returns, mask, clip_eps=0.2)
    loss.backward()
    ref_gn = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), float("inf"), foreach=False))
    ref_opt.step()
    ref_opt.zero_grad(set_to_none=True)
    out["stats"] = stats
    out["ref_stats"] = {"vf_loss": float(loss), "vf_clipfrac": float(st["vf_clipfrac"]), "grad_norm": ref_gn,
                        "tokens": int(mask.sum())}
    v1 = critic.values(ids)
    with torch.no_grad():
        r1 = _ref_values(ref, ids)
    out["values_after_diff"] = float((v1 - r1).abs().max())
    out["values_moved"] = float((v1 - v0).abs().max())
    full = critic.state_dict_full()
    ref_params = dict(ref.named_parameters())
    out["state_keys"] = sorted(full)
    out["state_diff"] = max((float((full[k] - ref_params[k].detach()).abs().max()) for k in full), default=None)
    out["ref_keys"] = sorted(ref_params)

    # a few more steps on the same returns (old values fixed, as in PPO epochs)
    losses = [stats["vf_loss"]]
    for _ in range(more_steps):
        losses.append(critic.update(sl(ids), sl(mask), sl(returns), sl(old), clip_eps=0.2)["vf_loss"])
    out["losses"] = losses
    return out


def whitening_matches() -> dict:
    """global_masked_whiten over DP ranks == masked_whiten of the concatenated batch: as the
    critic's batch is whitened, scale only (``shift_mean=False``) with another eps, with two
    masked-in values in the whole batch (one per rank: the fewest an unbiased variance takes), and
    the refusal of one value in the whole batch."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(B, T - 1, generator=g)
    mask = data()[1]
    per = B // dist.get_world_size()
    r = dist.get_rank()
    mine = slice(r * per, (r + 1) * per)
    out = {"diff": float((global_masked_whiten(x[mine], mask[mine]) - masked_whiten(x, mask)[mine]).abs().max())}
    unshifted = global_masked_whiten(x[mine], mask[mine], shift_mean=False, eps=0.5)
    out["diff_unshifted"] = float((unshifted - masked_whiten(x, mask, shift_mean=False, eps=0.5)[mine]).abs().max())
    two = torch.zeros_like(mask)
    two[0, 3] = two[per, 5] = 1.0  # one on each rank's share
    out["diff_two"] = float((global_masked_whiten(x[mine], two[mine]) - masked_whiten(x, two)[mine]).abs().max())
    one = torch.zeros_like(mask)
    one[0, 3] = 1.0
    try:
        global_masked_whiten(x[mine], one[mine])
        out["refused"] = None
    except ValueError as e:
        out["refused"] = str(e)
    return out


def init_from_checkpoint() -> dict:
    """value_model(init_from=dir): the trunk is the causal LM's, the head the seeded one; a
    checkpoint of another shape is refused (rank 0 only; the others return None)."""
    if dist.get_rank() != 0:
        return None
    from rlhf_switch.engines.torch_train import hf_model

    actor = hf_model(MODEL, 11)
    with tempfile.TemporaryDirectory() as d:
        actor.save_pretrained(d, safe_serialization=True)
        critic = value_model(MODEL, SEED, init_from=d)
        plain = value_model(MODEL, SEED)
        trunk = {k: v for k, v in actor.state_dict().items() if k.startswith("model.")}
        mine = critic.state_dict()
        trunk_diff = max(float((mine[k] - v).abs().max()) for k, v in trunk.items())
        head_same = torch.equal(critic.score.weight, plain.score.weight) and torch.equal(critic.score.bias,
                                                                                     plain.score.bias)
        try:
            value_model({**MODEL, "intermediate_size": 128}, SEED, init_from=d)
            refused = ""
        except (ValueError, RuntimeError) as e:
            refused = str(e)[:200]
    zero_head = value_model(MODEL, SEED, head_std=0.0)
    return {"trunk_diff": trunk_diff, "n_trunk": len(trunk), "head_same": head_same, "refused": refused,
            "zero_head": bool((zero_head.score.weight == 0).all()), "head_std": float(plain.score.weight.std()),
            "deterministic": all(torch.equal(a, b) for a, b in zip(plain.parameters(),
                                                                  value_model(MODEL, SEED).parameters()))}
