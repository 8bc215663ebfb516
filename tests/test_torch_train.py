"""Torch-native training engines (FSDP2, DTensor TP, TP×DP, pipeline stages, TP×PP) as VPS layouts.

4 gloo ranks (one world for the module), a tiny untied Llama with vocab 131 (FSDP2 shards come
out uneven: 33/33/33/32 rows over 4, 66/65 over 2) and 3 layers (PP2 splits them 2+1). Every
engine trains on the global batch, and every fragment its adapter describes is read back through
the fragment's own offset and strides and compared bit for bit with the global tensor obtained
independently (``full_tensor()``; for pipeline stages a one-process model trained the same way).
"""
from __future__ import annotations

import pytest
import torch

import train_jobs_torch as jobs
from rlhf_switch.engines.optim import AdamWConfig
from rlhf_switch.engines.pipeline import build_tp_pp
from rlhf_switch.engines.torch_train import build_tp, build_tp_dp, check_tp
from rlhf_switch.vps import ADAM_FIELDS, PARAM, ParallelConfig, build_layout, fsdp, llama_spec

TINY = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=131, max_position_embeddings=64, tie_word_embeddings=False)
SPEC = llama_spec(TINY)
# TP losses drift from one process by rounding that Adam amplifies (PLATFORM.md: ~1e-3 in 3 steps on
# a 58M model; measured here ~1e-7). 1e-4 leaves a wide margin yet is ~100× below what a move that
# lost state would show (the control: another seed's weights differ by ~1e-2).
LOSS_RTOL = 1e-4


def batches(n: int, seed: int = 0, batch: int = 4, seq: int = 16) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, TINY["vocab_size"], (batch, seq), generator=g) for _ in range(n)]


def fragments(layout, rank: int, keep=lambda key: True) -> list:
    return sorted(f for f in layout.fragments(rank) if keep(f.key))


def not_vocab(key) -> bool:
    """Our TP engines replicate embedding and LM head; Megatron's pure layout splits the vocabulary."""
    return SPEC[key.tensor].tp != "vocab"


def check_truth(results: list[dict], engines: dict[str, list[int]]) -> dict[str, list[dict]]:
    """Per engine name, its ranks' results; every fragment equal to the truth, equal losses."""
    by_engine: dict[str, list[dict]] = {}
    for rank, res in enumerate(results):
        by_engine.setdefault(res["name"], []).append(res)
    assert {n: len(v) for n, v in by_engine.items()} == {n: len(r) for n, r in engines.items()}
    for name, ranks in engines.items():
        for rank, res in zip(ranks, by_engine[name]):
            assert res["fragments"] > 0
            assert not res["mismatches"], f"{name} rank {rank}: fragments differ from the truth: {res['mismatches'][:5]}"
            assert res["losses"] == by_engine[name][0]["losses"], f"{name}: ranks report different losses"
    return by_engine


@pytest.mark.heavy  # left out of `make test-fast`
def test_fsdp2_dp4_fragments_hold_what_they_claim(world4):
    results = world4.run(jobs.layout_truth, TINY, [("fsdp2", [0, 1, 2, 3], {})], batches(2))
    check_truth(results, {"FSDP2·DP4": [0, 1, 2, 3]})
    weights, state = results[0]["layouts"]
    pure_w, pure_s = fsdp(SPEC, 4, (PARAM,)), fsdp(SPEC, 4, ADAM_FIELDS)
    for rank in range(4):  # FSDP2's own shards are exactly the pure fsdp layout's (padding aside)
        assert fragments(weights, rank) == fragments(pure_w, rank), f"rank {rank}"
        assert fragments(state, rank) == fragments(pure_s, rank), f"rank {rank}"
    # the last shard is short (vocab 131 = 33+33+33+32): only its real rows are declared
    assert weights.buffers(3)["param/lm_head.weight"].numel == 32 * 64
    assert pure_w.buffers(3)["param/lm_head.weight"].numel == 33 * 64


def test_pp2_and_tp2_on_the_two_halves_of_the_world(world4):
    plans = [("pp", [0, 1], {}), ("tp", [2, 3], {})]
    results = world4.run(jobs.layout_truth, TINY, plans, batches(2))
    by_engine = check_truth(results, {"PP2": [0, 1], "TP2": [2, 3]})
    pp = by_engine["PP2"][0]
    # the stages' loss is the one-process model's, and (same microbatch accumulation) bit for bit
    assert pp["losses"] == pp["reference_losses"]
    assert by_engine["PP2"][0]["losses"] == pytest.approx(by_engine["TP2"][0]["losses"], rel=LOSS_RTOL)
    # replicated plain tensors (embedding, norms, LM head) hold the same bits on both TP ranks
    tp = by_engine["TP2"]
    assert tp[0]["plain_digests"] and tp[0]["plain_digests"] == tp[1]["plain_digests"]

    pp_w, pp_s, tp_w, tp_s = results[0]["layouts"]
    assert all(not pp_w.fragments(r) for r in (2, 3)) and all(not tp_w.fragments(r) for r in (0, 1))
    pure_pp = build_layout(SPEC, ParallelConfig(pp=2), (PARAM,) + ADAM_FIELDS)
    pure_tp = build_layout(SPEC, ParallelConfig(tp=2, vocab_divisible_by=1), (PARAM,) + ADAM_FIELDS)
    for stage in range(2):
        assert sorted(fragments(pp_w, stage) + fragments(pp_s, stage)) == fragments(pure_pp, stage)
        assert sorted(fragments(tp_w, 2 + stage, not_vocab) + fragments(tp_s, 2 + stage, not_vocab)) \
            == fragments(pure_tp, stage, not_vocab)


def test_tp2_dp2_fragments_hold_what_they_claim(world4):
    results = world4.run(jobs.layout_truth, TINY, [("tp_dp", [0, 1, 2, 3], {"tp": 2})], batches(2))
    check_truth(results, {"TP2·DP2": [0, 1, 2, 3]})
    weights, state = results[0]["layouts"]
    pure = build_layout(SPEC, ParallelConfig(tp=2, dp=2, dp_shard="fsdp", vocab_divisible_by=1),
                        (PARAM,) + ADAM_FIELDS)
    for rank in range(4):  # Megatron rank order: rank = dp_rank·2 + tp_rank
        assert sorted(fragments(weights, rank, not_vocab) + fragments(state, rank, not_vocab)) == \
            fragments(pure, rank, not_vocab), f"rank {rank}"


def test_tp2_pp2_fragments_hold_what_they_claim(world4):
    """TP inside pipeline stages: stage s, TP rank t on rank 2s + t (Megatron order)."""
    results = world4.run(jobs.layout_truth, TINY, [("tp_pp", [0, 1, 2, 3], {"tp": 2})], batches(2))
    by_engine = check_truth(results, {"TP2·PP2": [0, 1, 2, 3]})
    # each TP pair holds its stage's tensors: layers 0-1 + embedding, layer 2 + norm + LM head
    assert results[0]["reference_tensors"] == results[1]["reference_tensors"]
    assert results[2]["reference_tensors"] == results[3]["reference_tensors"]
    assert "model.embed_tokens.weight" in results[0]["reference_tensors"]
    assert "lm_head.weight" in results[2]["reference_tensors"]
    # replicated plain tensors (embedding, norms, LM head) hold the same bits on both TP ranks
    for a, b in ((0, 1), (2, 3)):
        assert results[a]["plain_digests"] and results[a]["plain_digests"] == results[b]["plain_digests"]
    # against the one-process model trained like the GPipe schedule: TP's split matmuls and
    # all-reduces round differently, so not bit for bit. Measured: the 2 losses equal, the
    # state up to 7e-6 absolute after 2 Adam steps (max in layers.1.mlp.gate_proj: Adam's first
    # steps turn a gradient's last-bit difference into up to ~lr·1e-3 of update). 1e-4 is >10×
    # that and ~100× below what a lost or misplaced state shows (another seed's weights: ~1e-2).
    tp_pp = by_engine["TP2·PP2"][0]
    assert tp_pp["losses"] == pytest.approx(tp_pp["reference_losses"], rel=LOSS_RTOL)
    assert max(r["reference_max_diff"] for r in results) <= 1e-4

    weights, state = results[0]["layouts"]
    pure = build_layout(SPEC, ParallelConfig(tp=2, pp=2, vocab_divisible_by=1), (PARAM,) + ADAM_FIELDS)
    for rank in range(4):
        assert sorted(fragments(weights, rank, not_vocab) + fragments(state, rank, not_vocab)) == \
            fragments(pure, rank, not_vocab), f"rank {rank}"


def test_engines_on_interleaved_subsets(world4):
    """FSDP2 on ranks 1 and 3 while a pipeline runs on 0 and 2."""
    plans = [("fsdp2", [1, 3], {}), ("pp", [0, 2], {})]
    results = world4.run(jobs.layout_truth, TINY, plans, batches(2, seed=1))
    by_engine = check_truth(results, {"FSDP2·DP2": [1, 3], "PP2": [0, 2]})
    assert by_engine["PP2"][0]["losses"] == by_engine["PP2"][0]["reference_losses"]
    weights = results[0]["layouts"][0]
    pure = fsdp(SPEC, 2)
    assert fragments(weights, 1) == fragments(pure, 0) and fragments(weights, 3) == fragments(pure, 1)


def test_move_fsdp2_dp4_to_tp2_dp2_then_both_train_alike(world4):
    data = batches(4, seed=2)
    results = world4.run(jobs.move_fsdp2_to_tp_dp, TINY, data[:2], data[2:])
    for rank, res in enumerate(results):
        assert res["tensors"] == 3 * len(SPEC.tensors)
        assert not res["unequal"], f"rank {rank}: state differs after the move: {res['unequal'][:5]}"
        warm = AdamWConfig().lr * 3 / 4  # after 2 of 4 warmup steps
        assert res["scalars_equal"] and res["lr"] == pytest.approx(warm), f"rank {rank}: step/LR not carried"
        assert res["bytes_received"] == res["min_bytes"]
        assert res["dst_losses"] == pytest.approx(res["src_losses"], rel=LOSS_RTOL)
        gap = max(abs(c - s) / s for c, s in zip(res["control_losses"], res["src_losses"]))
        assert gap > 10 * LOSS_RTOL, "an engine that got no state trains alike too: the test proves nothing"


def test_tp_that_does_not_divide_kv_heads_is_refused_before_anything_is_built():
    # no process group exists in this (driver) process: reaching one would be a different error
    with pytest.raises(ValueError, match="num_key_value_heads=2"):
        build_tp(TINY, 0, [0, 1, 2, 3])
    with pytest.raises(ValueError, match="num_key_value_heads=2"):
        build_tp_dp(TINY, 0, [0, 1, 2, 3], tp=4)
    with pytest.raises(ValueError, match="num_key_value_heads=2"):
        build_tp_pp(TINY, 0, [0, 1, 2, 3, 4, 5, 6, 7], tp=4)
    check_tp(TINY, 2)


def test_refusals_leave_every_rank_free(world4):
    for rank, errors in enumerate(world4.run(jobs.refusals, TINY)):
        tp, pp, fsdp2, world = errors
        assert "num_key_value_heads=2" in tp, f"rank {rank}: {tp}"
        assert "ascending" in pp and "ascending" in fsdp2, f"rank {rank}: {errors}"
        assert world == "world ok: 4"


# --- other model families -------------------------------------------------------------------------

@pytest.mark.parametrize("model_type,plans", [
    # qwen2: FSDP2 on one half, DTensor TP2 on the other (its q/k/v biases split with the weights)
    ("qwen2", [("fsdp2", [0, 1], {}), ("tp", [2, 3], {})]),
    ("qwen3", [("fsdp2", [0, 1, 2, 3], {})]),  # per-head q/k norms, replicated in the spec
    # TP: each rank's q/k norms see its own heads; their gradients are summed over TP
    pytest.param("qwen3", [("fsdp2", [0, 1], {}), ("tp", [2, 3], {})], marks=pytest.mark.heavy),
    ("qwen3_moe", [("fsdp2", [0, 1, 2, 3], {})]),  # stacked experts: one whole expert per rank
    # pipeline stages of Llama-shaped layers: qwen2's and mistral's (no sliding window) run as they are
    ("qwen2", [("pp", [0, 1], {}), ("fsdp2", [2, 3], {})]),
    ("mistral", [("pp", [0, 1], {}), ("tp", [2, 3], {})]),
    ("qwen3", [("tp_pp", [0, 1, 2, 3], {"tp": 2})]),  # TP inside the stages: q/k norm gradients summed
])
def test_engines_of_other_families(world4, model_type, plans):
    """The engines wrap the family's HF model; the adapter's spec is the family spec (derived from
    the model), every fragment holds what it claims, FSDP2's shards are the pure layout's, and the
    engines train one model (equal losses; a pipeline's bit for bit a one-process run's)."""
    from rlhf_switch.models import model_spec
    from rlhf_switch.testing.tiny_models import tiny_config

    cfg = tiny_config(model_type, vocab_size=TINY["vocab_size"])
    results = world4.run(jobs.layout_truth, cfg, plans, batches(2))
    names = {"fsdp2": "FSDP2·DP", "tp": "TP", "pp": "PP", "tp_pp": "TP2·PP"}
    engines = {names[kind] + str(len(ranks) // kw.get("tp", 1)): ranks for kind, ranks, kw in plans}
    by_engine = check_truth(results, engines)
    spec = model_spec(cfg)
    i, (_, fsdp_ranks, _) = next((i, p) for i, p in enumerate(plans) if p[0] == "fsdp2") \
        if any(p[0] == "fsdp2" for p in plans) else (0, plans[0])
    weights = results[0]["layouts"][2 * i]  # the plan's weights
    assert weights.spec == spec
    pure = fsdp(spec, len(fsdp_ranks), (PARAM,))
    for dp_rank, rank in enumerate(fsdp_ranks if plans[i][0] == "fsdp2" else ()):  # world rank = layout rank
        if model_type == "qwen3_moe":  # FSDP2 shards the stacked experts: rank r holds expert r whole
            held = {f.key.tensor for f in weights.fragments(rank) if ".experts." in f.key.tensor}
            assert held == {f"model.layers.{layer}.mlp.experts.{dp_rank}.{w}_proj.weight"
                            for layer in range(2) for w in ("gate", "up", "down")}, f"rank {rank}"
        else:
            assert fragments(weights, rank) == fragments(pure, dp_rank), f"rank {rank}"
    if model_type == "qwen2":  # rank 3 (TP rank 1) holds the second half of every k bias
        tp_weights = results[0]["layouts"][2]
        k_bias = [f for f in tp_weights.fragments(3) if f.key.tensor == "model.layers.0.self_attn.k_proj.bias"]
        assert [(f.box.lo, f.box.hi) for f in k_bias] == [((32,), (64,))]
    if "tp" in [kind for kind, _, _ in plans]:  # replicated tensors stay bit-identical over TP
        assert results[2]["plain_digests"] and results[2]["plain_digests"] == results[3]["plain_digests"]
    if "PP2" in by_engine:
        assert by_engine["PP2"][0]["losses"] == by_engine["PP2"][0]["reference_losses"]
    if "TP2·PP2" in by_engine:  # TP rounds differently from the one-process run, slightly
        res = by_engine["TP2·PP2"][0]
        assert res["losses"] == pytest.approx(res["reference_losses"], rel=LOSS_RTOL)
        assert "model.layers.0.self_attn.q_norm.weight" in res["reference_tensors"]  # stage 0 holds layer 0
        assert res["reference_max_diff"] < 1e-4
    losses = [v[0]["losses"] for v in by_engine.values()]
    assert all(x == pytest.approx(losses[0], rel=LOSS_RTOL) for x in losses)  # FSDP2 and TP: one model
