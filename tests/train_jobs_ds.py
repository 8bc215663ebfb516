"""Rank jobs for tests/test_deepspeed.py: real DeepSpeed ZeRO engines on a LocalWorld's ranks."""
from __future__ import annotations

import torch
import torch.distributed as dist

from rlhf_switch.engines.deepspeed_zero import build_zero_trainer
from rlhf_switch.engines.optim import AdamWConfig
from rlhf_switch.engines.train_state import gather_layouts
from rlhf_switch.vps import EXP_AVG, EXP_AVG_SQ, MASTER, PARAM, llama_spec
from rlhf_switch.vps.materialize import fragment_view

MODEL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=64, vocab_size=96, tie_word_embeddings=False, max_position_embeddings=64)
OPTIM = AdamWConfig(lr=3e-3, weight_decay=0.01, warmup_steps=3)
BATCH, SEQ = 4, 12


def tiny_llama(seed: int, **overrides):
    """The same HF model every engine family builds (sdpa attention, fp32, seeded)."""
    from rlhf_switch.engines.torch_train import hf_model

    cfg = {**MODEL, **overrides}
    return hf_model(cfg, seed), llama_spec(cfg, name="tiny")


def batch(step: int, vocab: int = MODEL["vocab_size"]) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, vocab, (BATCH, SEQ), generator=g)


def zero(stage: int, ranks=None, seed: int = 0, persistence_threshold: int = 0, **overrides):
    model, spec = tiny_llama(seed, **overrides)
    dp = len(ranks) if ranks is not None else dist.get_world_size()
    return build_zero_trainer(model, spec, stage, micro_batch=BATCH // dp, ranks=ranks, optim=OPTIM,
                              persistence_threshold=persistence_threshold)


def full_state(trainer) -> dict:
    """Every parameter's fp32 master and Adam moments, gathered by DeepSpeed's own API (collective
    over the engine's ranks) — the independent truth the adapter's fragments are checked against."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out = {}
    for p, name in trainer.engine.param_names.items():
        out[(name, MASTER)] = safe_get_full_fp32_param(p).clone()
        out[(name, EXP_AVG)] = safe_get_full_optimizer_state(p, "exp_avg").clone()
        out[(name, EXP_AVG_SQ)] = safe_get_full_optimizer_state(p, "exp_avg_sq").clone()
    return out


def full_weights(trainer) -> dict:
    import deepspeed

    out = {}
    for p, name in trainer.engine.param_names.items():
        with deepspeed.zero.GatheredParameters([p], enabled=trainer.adapter.stage == 3):
            out[(name, PARAM)] = p.data.clone()
    return out


def read_back(local) -> dict:
    """The adapter's claim, read from its buffers: {(tensor, field): [(box, values)]}."""
    out = {}
    for f in local.fragments:
        v = fragment_view(local.tensors[f.buffer], f)
        out.setdefault((f.key.tensor, f.key.field), []).append((f.box, v.clone()))
    return out


def mismatches(claims: dict, truth: dict) -> list[str]:
    bad = []
    for key, pieces in claims.items():
        for box, values in pieces:
            want = truth[key][box.slices]
            if not torch.equal(values, want):
                bad.append(f"{key} {box}")
    return bad


def layout_truth(stage: int, ranks=None, steps: int = 2, persistence_threshold: int = 0) -> dict:
    trainer = zero(stage, ranks, persistence_threshold=persistence_threshold)
    state = weights = None
    if trainer is not None:
        for s in range(steps):
            trainer.train_step(batch(s))
        state, weights = trainer.adapter.state(), trainer.adapter.weights()
    spec = tiny_llama(0)[1]
    (state_layout, weights_layout), _ = gather_layouts(
        [(spec, state) if state else None, (spec, weights) if weights else None], ["state", "weights"])
    state_layout.validate()
    weights_layout.validate()
    if trainer is None:
        return {"bad": [], "layout": None}
    bad = mismatches(read_back(state), full_state(trainer)) + mismatches(read_back(weights), full_weights(trainer))
    frags = sorted((f.key, f.box, f.offset) for r in range(state_layout.world_size)
                   for f in state_layout.fragments(r) if r == dist.get_rank())
    return {"bad": bad, "state_fragments": frags, "n_state": len(state.fragments),
            "n_weights": len(weights.fragments),
            "n_persistent": len(getattr(trainer.engine.optimizer, "persistent_parameters", ()))}


def pure_layout_matches(stage: int, dp: int) -> list[str]:
    """The adapter's state fragments against the pure ``mesh.zero`` layout (same boxes at the same
    offsets; buffer names differ): the layout file encodes DeepSpeed's real partitioning."""
    from rlhf_switch.vps.layouts.mesh import zero as zero_layout

    trainer = zero(stage)
    trainer.train_step(batch(0))
    spec = tiny_llama(0)[1]
    pure = zero_layout(spec, dp, stage, fields=(MASTER, EXP_AVG, EXP_AVG_SQ))
    rank = dist.get_rank()
    mine = sorted((f.key, f.box, f.offset) for f in trainer.adapter.state().fragments)
    want = sorted((f.key, f.box, f.offset) for f in pure.fragments(rank))
    if mine == want:
        return []
    return [f"rank {rank}: engine {len(mine)} fragments, pure layout {len(want)}; first differences: "
            f"{[m for m in mine if m not in want][:2]} vs {[w for w in want if w not in mine][:2]}"]


def refuses_stage(stage: int) -> str:
    model, spec = tiny_llama(0)
    try:
        build_zero_trainer(model, spec, stage, micro_batch=1)
    except ValueError as e:
        return str(e)
    return "built"


def family_layout_truth(model_type: str, stage: int, steps: int = 2) -> dict:
    """A ZeRO engine over the family's HF model (``testing.tiny_models``), its adapter's spec the
    family spec: every fragment against DeepSpeed's own gathers, and the pure ``mesh.zero`` layout
    of that spec against the adapter's partitioning."""
    from rlhf_switch.models import build_model, model_spec
    from rlhf_switch.testing.tiny_models import tiny_config
    from rlhf_switch.vps.layouts.mesh import zero as zero_layout

    cfg = tiny_config(model_type, vocab_size=MODEL["vocab_size"])
    model, spec = build_model(cfg, 0), model_spec(cfg)
    dp = dist.get_world_size()
    trainer = build_zero_trainer(model, spec, stage, micro_batch=BATCH // dp, optim=OPTIM)
    losses = [trainer.train_step(batch(s)) for s in range(steps)]
    state, weights = trainer.adapter.state(), trainer.adapter.weights()
    truth = per_expert({**full_state(trainer), **full_weights(trainer)})
    bad = mismatches(read_back(state), truth) + mismatches(read_back(weights), truth)
    if model_type != "qwen3_moe":  # ZeRO-3 partitions a stacked expert parameter as one, not per expert
        pure = zero_layout(spec, dp, stage, fields=(MASTER, EXP_AVG, EXP_AVG_SQ))
        mine = sorted((f.key, f.box, f.offset) for f in state.fragments)
        if mine != sorted((f.key, f.box, f.offset) for f in pure.fragments(dist.get_rank())):
            bad.append(f"rank {dist.get_rank()}: the adapter's state fragments are not the pure zero layout's")
    (state_layout,), _ = gather_layouts([(spec, state)], ["state"])
    state_layout.validate()  # the ranks together cover every tensor of the spec
    tensors = {f.key.tensor for f in state.fragments}
    return {"bad": bad, "losses": losses, "n": len(state.fragments), "tensors": sorted(tensors)}


def per_expert(truth: dict) -> dict:
    """``truth`` with each stacked expert parameter also as its per-expert tensors (slices)."""
    from rlhf_switch.families import stacked_experts

    out = dict(truth)
    for (name, field_), t in truth.items():
        for tensor, e, lo, hi in stacked_experts(name, tuple(t.shape)) or ():
            out[(tensor, field_)] = t[e, lo:hi]
    return out


def trains_alike_when_shared(stage: int, steps: int = 3) -> dict:
    """Two engines built alike; one has its weights and (after its first step) its state moved
    into shared memory in place (``same_host.share``, as a weight channel does with its senders').
    Every step's loss and the final weights and state, by DeepSpeed's own gathers, must be equal
    bit for bit, and the buffers still shared after the steps (DeepSpeed kept them)."""
    from rlhf_switch.routing import same_host

    runs = []
    for share in (False, True):
        trainer = zero(stage)
        if share:
            assert same_host.share(trainer.adapter.weights().tensors.values()) > 0
        losses = []
        for step in range(steps):
            losses.append(trainer.train_step(batch(step)))
            if share and step == 0:  # Adam's moments exist from the first step on
                assert same_host.share(trainer.adapter.state().tensors.values()) > 0
        shared = [t.untyped_storage().is_shared() for t in trainer.adapter.state().merge(
            trainer.adapter.weights()).tensors.values()]
        runs.append((losses, full_state(trainer), full_weights(trainer), shared))
        del trainer
    (la, sa, wa, _), (lb, sb, wb, shared) = runs
    differ = [f"{k}" for k in sa if not torch.equal(sa[k], sb[k])] + [f"{k}" for k in wa if not torch.equal(wa[k], wb[k])]
    return {"losses": (la, lb), "differ": differ, "shared": all(shared) and len(shared) > 0}
