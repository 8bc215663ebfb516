"""End to end over Ray: two GRPO iterations of a ``data:`` run — a tiny Llama ``model.path`` with
the BPE tokenizer beside it, the shipped GSM8K-format JSONL, prompts in the chat template,
``math_answer`` — on the cheapest engines (train FSDP2 DP2, rollout torch TP2). The rollouts are
written as text too, and the weight sync is verified every iteration."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ray_session():
    import ray

    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in paths if p != str(REPO)])
    ray.init(address="local", num_cpus=4, num_gpus=4, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def test_grpo_on_jsonl_data_from_model_path(ray_session, tmp_path):
    from recipes.grpo import run
    from rlhf_switch.testing.tiny_model import build_tiny_llama_dir

    model = build_tiny_llama_dir(tmp_path / "model")
    cfg = yaml.safe_load((REPO / "configs" / "gsm8k_tiny.yaml").read_text())
    cfg.update(output_dir=str(tmp_path / "run"), tensorboard=False)
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
