"""End to end over Ray: two GRPO iterations of a ``data:`` run — a tiny Llama ``model.path`` with
the BPE tokenizer beside it, the shipped GSM8K-format JSONL, prompts in the chat template,
``math_answer`` — on the cheapest engines (train FSDP2 DP2, rollout torch TP2). The rollouts are
written as text too, and the weight sync is verified every iteration."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def test_grpo_on_jsonl_data_from_model_path(ray_session, tmp_path):
    from recipes.grpo import run
    from rlhf_switch.testing.tiny_models import build_model_dir

    model = build_model_dir(tmp_path / "model")
    cfg = yaml.safe_load((REPO / "configs" / "gsm8k_tiny.yaml").read_text())
    cfg.update(output_dir=str(tmp_path / "run"), logging=[])
    cfg["model"]["path"] = str(model)
    cfg["data"].update(train_files=[str(REPO / "data/gsm8k_tiny/train.jsonl")],
                       heldout_files=[str(REPO / "data/gsm8k_tiny/test.jsonl")], num_heldout=8)
    cfg["sft"] = {"steps": 20, "lr": 1e-3, "batch_size": 8}
    cfg["eval"] = {"every": 0, "num_prompts": 8}
    cfg["checkpoint"] = {"save_every": 0, "keep": 1}
    cfg["algorithm"].update(iterations=2, prompts_per_iteration=2, group_size=4, mini_batch_size=8,
                            micro_batch_size=4, max_new_tokens=24)
    recs = [r for r in run(cfg, quiet=True) if "reward_mean" in r]
    assert [r["iteration"] for r in recs] == [0, 1]
    assert all(r["stale_check_passed"] and r["gen_tokens"] > 0 for r in recs), recs
    rollouts = [json.loads(x) for x in (tmp_path / "run" / "rollouts.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rollouts] == [0, 1]
    for r in rollouts:
        assert len(r["prompt_texts"]) == len(r["response_texts"]) == len(r["rewards"]) == 8
        assert all(p.startswith("<|im_start|>user\n") and p.endswith("<|im_start|>assistant\n")
                   for p in r["prompt_texts"])
        assert any(t.strip() for t in r["response_texts"]) and all(x in (0.0, 1.0) for x in r["rewards"])
    # the warm start trained from model.path's weights, fingerprinted by its files
    fp = json.loads((tmp_path / "run" / "init" / "warm_start.json").read_text())["fingerprint"]
    assert fp["model_path"] == str(model.resolve()) and "model.safetensors" in fp["model_files"]


def gsm8k_config(out: Path, model: Path, iterations: int, **blocks) -> dict:
    cfg = yaml.safe_load((REPO / "configs" / "gsm8k_tiny.yaml").read_text())
    cfg.update(output_dir=str(out), logging=[])
    cfg["model"]["path"] = str(model)
    cfg["data"].update(train_files=[str(REPO / "data/gsm8k_tiny/train.jsonl")],
                       heldout_files=[str(REPO / "data/gsm8k_tiny/test.jsonl")], num_heldout=8)
    cfg["sft"] = None
    cfg["eval"] = {"every": 0, "num_prompts": 8}
    cfg["checkpoint"] = {"save_every": 0, "keep": 1}
    cfg["algorithm"].update(iterations=iterations, prompts_per_iteration=2, group_size=4, mini_batch_size=8,
                            micro_batch_size=4, max_new_tokens=16)
    cfg.update(blocks)
    return cfg


@pytest.mark.vllm
def test_grpo_deepspeed_vllm_from_model_path_and_its_final_is_a_model_path(ray_session, tmp_path):
    """The main path of a user with a Hugging Face model and a JSONL dataset: a ``save_pretrained``
    directory with its tokenizer as ``model.path``, the chat template, DeepSpeed ZeRO-3 + vLLM TP2,
    3 iterations with the stale-weights check; ``final/`` (weights, config, tokenizer) loads in
    transformers and is the ``model.path`` of a new run, whose vLLM engine loads it with its
    tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from recipes.grpo import run
    from rlhf_switch.engines.full_state import FullState
    from rlhf_switch.models import model_spec
    from rlhf_switch.testing.tiny_models import build_model_dir

    model = build_model_dir(tmp_path / "model")
    layouts = dict(train={"engine": "deepspeed", "zero_stage": 3, "tp": 1, "pp": 1, "dp": 2},
                   rollout={"engine": "vllm", "tp": 2, "pp": 1, "dp": 1},
                   reference={"engine": "deepspeed", "zero_stage": 3, "tp": 1, "pp": 1, "dp": 2})
    recs = [r for r in run(gsm8k_config(tmp_path / "run", model, 3, **layouts), quiet=True) if "reward_mean" in r]
    assert [r["iteration"] for r in recs] == [0, 1, 2]
    assert all(r["stale_check_passed"] and r["gen_tokens"] > 0 for r in recs), recs
    rollouts = [json.loads(x) for x in (tmp_path / "run" / "rollouts.jsonl").read_text().splitlines()]
    assert all(any(t.strip() for t in r["response_texts"]) for r in rollouts)

    final = tmp_path / "run" / "final"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (final / name).is_file(), name
    hf = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32)
    config = json.loads((final / "config.json").read_text())
    saved = FullState.load_dir(final, model_spec(config), weights_only=True).master
    assert all(torch.equal(p, saved[n]) for n, p in hf.named_parameters())
    tok = AutoTokenizer.from_pretrained(final)
    assert tok.decode(tok.encode("12 + 30 = 42")) == "12 + 30 = 42" and tok.chat_template

    # final/ as the next run's model.path: vLLM loads it with its tokenizer, the sync still verified
    again = [r for r in run(gsm8k_config(tmp_path / "again", final, 1, **layouts), quiet=True) if "reward_mean" in r]
    assert [r["iteration"] for r in again] == [0] and again[0]["stale_check_passed"]


def test_grpo_raises_heldout_math_accuracy_on_the_real_path(ray_session, tmp_path):
    """The learning test on the real path, ``configs/gsm8k_tiny.yaml`` as shipped: a tiny Qwen2
    ``model.path`` with the locally trained BPE tokenizer, the generated GSM8K-format data in the
    chat template, SFT warm start (600 steps), then 15 GRPO iterations of 64 prompts × 8 samples:
    held-out greedy ``math_answer`` accuracy on 200 problems rises by at least 0.025 (measured
    over run seeds 0-3: 0.39 -> 0.445, 0.375 -> 0.46, 0.445 -> 0.475, 0.375 -> 0.46)."""
    from recipes.grpo import run
    from rlhf_switch.testing.tiny_models import build_model_dir

    model = build_model_dir(tmp_path / "model")
    cfg = yaml.safe_load((REPO / "configs" / "gsm8k_tiny.yaml").read_text())
    cfg.update(output_dir=str(tmp_path / "run"), logging=[], checkpoint={"save_every": 0})
    cfg["model"]["path"] = str(model)
    cfg["data"].update(train_files=[str(REPO / "data/gsm8k_tiny/train.jsonl")],
                       heldout_files=[str(REPO / "data/gsm8k_tiny/test.jsonl")])
    evals = [r for r in run(cfg, quiet=True) if "heldout_reward" in r]
    before, after = evals[0]["heldout_reward"], evals[-1]["heldout_reward"]
    assert evals[0]["iteration"] == 0 and evals[-1]["iteration"] == 15
    assert before > 0.2, f"the SFT warm start solves almost nothing ({before})"
    assert after >= before + 0.025, f"held-out math_answer {before:.3f} -> {after:.3f}: GRPO did not raise it by 0.025"
