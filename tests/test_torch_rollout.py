"""The torch rollout engine: vLLM's per-rank layout, fed by real moves from trainer layouts.

4 gloo ranks (one world for the module). A tiny HF Llama is saved once as safetensors; every rank
reads slices of it into a trainer layout (FSDP DP4, or TP2·DP2 with ZeRO-3 shards), moves them
into engines of TP 1 (×4 replicas), 2 (×2) and 4 (one KV head per rank, replicated), and checks
the engine against the HF model on the same rank: logits to 1e-5, greedy tokens exactly.
"""
from __future__ import annotations

import pytest
import torch

import rollout_jobs
from rlhf_switch.vps import ParallelConfig, build_layout, fsdp, llama_spec

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=250, max_position_embeddings=128)  # 250: not a multiple of 64
PROMPTS = [[1, 17, 200, 249, 3], [1, 128, 127, 64, 65, 9, 0, 191, 192], [1, 5]]  # ids at every vocab-shard edge
NEW = 8


def _save(tmp_path_factory, tied: bool) -> tuple[str, object]:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**TINY, tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    path = str(tmp_path_factory.mktemp("tied" if tied else "untied"))
    model.save_pretrained(path)  # model.safetensors (+ config.json); tied: no lm_head.weight
    return path, cfg


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (model dir, spec, trainer layouts on 4 ranks)."""
    out = {}
    for tied in (False, True):
        path, cfg = _save(tmp_path_factory, tied)
        spec = llama_spec(cfg)
        assert spec.tied_lm_head == tied
        trainers = {"fsdp": fsdp(spec, 4),
                    "tp2·dp2[zero3]": build_layout(spec, ParallelConfig(tp=2, dp=2, dp_shard="zero3"))}
        out["tied" if tied else "untied"] = (path, spec, trainers)
    return out


CASES = [  # (model, trainer layout, engine TP): TP4 > 2 KV heads replicates them
    ("untied", "fsdp", 2), ("untied", "tp2·dp2[zero3]", 4), ("untied", "fsdp", 1),
    ("tied", "tp2·dp2[zero3]", 2), ("tied", "fsdp", 4),
]


@pytest.mark.parametrize("model,trainer,tp", [pytest.param(*CASES[0], marks=pytest.mark.heavy), *CASES[1:]])
def test_engine_fed_by_a_move_matches_hf(world4, models, model, trainer, tp):
    path, _, trainers = models[model]
    results = world4.run(rollout_jobs.logits_vs_hf, path, trainers[trainer], tp, PROMPTS, NEW)
    for r, res in enumerate(results):
        assert res["exact_buffers"], f"rank {r}: engine buffers differ from a direct vLLM-layout build"
        assert res["logit_diff"] < 1e-5, f"rank {r} (TP{tp}): logits differ from HF by {res['logit_diff']}"
        assert res["tokens"] == res["hf_tokens"], f"rank {r} (TP{tp}): greedy tokens differ from HF"
        assert res["logprob_diff"] < 1e-5, f"rank {r}: KV-cache decoding differs from a full forward"


@pytest.mark.parametrize("model,trainer,tp", [pytest.param("untied", "tp2·dp2[zero3]", 2, marks=pytest.mark.heavy),
                                               ("tied", "fsdp", 4)])
def test_second_move_leaves_no_stale_weights(world4, models, model, trainer, tp):
    path, _, trainers = models[model]
    results = world4.run(rollout_jobs.no_stale_weights, path, trainers[trainer], tp, PROMPTS, NEW)
    for r, res in enumerate(results):
        assert res["in_place"], f"rank {r}: the engine's buffers were replaced, not written"
        assert res["exact_buffers"], f"rank {r}: buffers after the second move differ from the new weights"
        assert res["before"] < 1e-5 and res["after"] < 1e-5, f"rank {r}: {res}"
        assert res["old_vs_new"] > 1e-3, f"rank {r}: training did not change the logits; the test proves nothing"
        assert res["tokens"] == res["hf_tokens"], f"rank {r}: greedy tokens differ from the updated HF model"


@pytest.mark.parametrize("tp", [2, pytest.param(4, marks=pytest.mark.heavy)])
def test_sampling_is_identical_on_every_tp_rank_and_repeatable(world4, models, tp):
    path, _, trainers = models["untied"]
    results = world4.run(rollout_jobs.sampled, path, trainers["fsdp"], tp, PROMPTS[:2], NEW, 7)
    for r, res in enumerate(results):
        assert res["a"] == res["b"], f"rank {r}: two runs with the same seed differ"
        assert res["logprob_diff"] < 1e-5
    replicas = [results[i:i + tp] for i in range(0, 4, tp)]
    for rep in replicas:  # every TP rank of a replica returns the same tokens and logprobs
        assert all(res["a"] == rep[0]["a"] for res in rep)
    # same weights, same seed: the replicas agree too; another seed draws other tokens
    assert all(res["a"] == results[0]["a"] for res in results)
    assert results[0]["c"][0] != results[0]["a"][0]


BATCH = PROMPTS + [[1], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [1, 249, 3, 64]]  # lengths 5, 9, 2, 1, 13, 4
SEEDS = [11, 5, 11, 1000003, 0, 42]  # a seed shared by two prompts: each row still has its own generator


@pytest.mark.parametrize("model,trainer,tp", [("untied", "fsdp", 1),
                                              *(pytest.param(*c, marks=pytest.mark.heavy)
                                                for c in [("untied", "tp2·dp2[zero3]", 2), ("tied", "fsdp", 2)])])
def test_batched_decoding_equals_one_at_a_time(world4, models, model, trainer, tp):
    """All prompts of a call decoded together (left-padded, one KV cache, one all-reduce per layer
    per step) give each (prompt, seed) the tokens and logprobs of decoding it alone, greedy and
    sampled, with rows of different lengths and some stopping at EOS (or another stop id) mid-batch;
    and on every rank."""
    path, _, trainers = models[model]
    results = world4.run(rollout_jobs.batched_vs_reference, path, trainers[trainer], tp, BATCH, NEW, SEEDS)
    for r, res in enumerate(results):
        for mode in ("greedy", "sampled"):
            m = res[mode]
            ref_tokens = m["ref"][0]
            stopped = [len(t) < NEW for t in ref_tokens]
            assert any(stopped) and not all(stopped), f"{mode}: EOS {m['eos']} must stop some rows only: {ref_tokens}"
            assert m["got"][0] == ref_tokens, f"rank {r} TP{tp} {mode}: batched tokens differ from one at a time"
            assert m["rev"][0] == ref_tokens, f"rank {r} TP{tp} {mode}: a sample depends on its batch order"
            assert m["lp_diff"] < 1e-5, f"rank {r} TP{tp} {mode}: logprobs differ by {m['lp_diff']}"
            assert m["vs_forward"] < 1e-5, f"rank {r} TP{tp} {mode}: batched cache vs full forward {m['vs_forward']}"
            # with a stop id beside the eos, row 1 ends at step 2 at the latest
            assert m["stops"]["got"] == m["stops"]["ref"] and len(m["stops"]["ref"][1]) <= 3, (mode, m["stops"])
        assert res["greedy"]["got"] == results[0]["greedy"]["got"]
        assert res["sampled"]["got"][0] == results[0]["sampled"]["got"][0]  # same seeds: every rank, replica


# --- other dense families: qwen2 (q/k/v biases), qwen3 (per-head q/k norms) ------------------------

@pytest.fixture(scope="module")
def family_models(tmp_path_factory):
    """model_type -> (model dir, spec): GQA 4 heads / 2 KV heads (TP4 replicates KV heads), every
    bias and norm random (``testing.tiny_models``), vocab 250."""
    from rlhf_switch.models import model_spec
    from rlhf_switch.testing.tiny_models import save_tiny_model, tiny_config

    out = {}
    for model_type in ("qwen2", "qwen3"):
        overrides = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2)
        path = str(tmp_path_factory.mktemp(model_type))
        save_tiny_model(model_type, path, vocab_size=TINY["vocab_size"], seed=2, **overrides)
        out[model_type] = (path, model_spec(tiny_config(model_type, TINY["vocab_size"], **overrides)))
    return out


@pytest.mark.heavy  # left out of `make test-fast`
@pytest.mark.parametrize("model_type,tp", [("qwen2", 2), ("qwen2", 4), ("qwen3", 2), ("qwen3", 4)])
def test_engine_of_other_families_matches_hf(world4, family_models, model_type, tp):
    path, spec = family_models[model_type]
    trainer = build_layout(spec, ParallelConfig(tp=2, dp=2, dp_shard="zero3"))
    results = world4.run(rollout_jobs.logits_vs_hf, path, trainer, tp, PROMPTS, NEW)
    for r, res in enumerate(results):
        assert res["exact_buffers"], f"rank {r}: engine buffers differ from a direct vLLM-layout build"
        assert res["logit_diff"] < 1e-5, f"rank {r} (TP{tp}): logits differ from HF by {res['logit_diff']}"
        assert res["tokens"] == res["hf_tokens"], f"rank {r} (TP{tp}): greedy tokens differ from HF"
