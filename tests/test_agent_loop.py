"""Multi-turn rollouts in the real loop (``agent`` block, recipes/loop/workflow.py): FSDP2 DP2
training, the torch rollout engine on both ranks, the guessing game's environments in a pool of
Ray workers. Two short runs from one warm start:

- the game as shipped (configs/agent_guess_tiny.yaml): every sample is a multi-turn episode, the
  token-exactness check of every sample passes (the run would stop otherwise), the stale-weights
  check compares exactly the model's tokens (the environment's carry no loss and are not
  checked), the record says what the episodes did;
- an environment that raises on half the samples, with ``failed_samples: exclude``: those
  samples end with ``env_error`` and carry no token into the loss, the run finishes.
"""
from __future__ import annotations

import json
import math
import shutil

import pytest
import yaml

from test_rl_pure import CONFIGS

pytestmark = pytest.mark.slow


def config(out, **agent) -> dict:
    cfg = yaml.safe_load((CONFIGS / "agent_guess_tiny.yaml").read_text())
    cfg.update(output_dir=str(out), eval={"every": 0, "num_prompts": 8}, sft={**cfg["sft"], "steps": 100})
    cfg["algorithm"].update(prompts_per_iteration=4)
    cfg["agent"].update(agent)
    return cfg


def records(recs):
    return [r for r in recs if "reward_mean" in r]


def test_multi_turn_episodes_train_on_exactly_the_models_tokens(ray_session, tmp_path):
    from recipes.common import warm_start
    from recipes.train import run
    from rlhf_switch.rl.config import load_config

    init = warm_start(load_config(config(tmp_path / "game")), tmp_path / "game" / "init", quiet=True)
    recs = records(run(config(tmp_path / "game"), iterations=2, quiet=True))
    assert [r["iteration"] for r in recs] == [0, 1]
    for r in recs:
        a = r["agent"]
        assert r["stale_check_passed"] and math.isfinite(r["policy_loss"]), r
        assert a["n"] == 16 and a["turns_mean"] > 1 and len(a["turn_batches"]) > 1 and a["turn_batches"][0] == 16
        # the check compared the model's tokens, every one of them, and nothing else
        assert r["stale_check_tokens"] == a["model_tokens"] > 0
        assert a["tokens_mean"] * a["n"] > a["model_tokens"]  # observations are in the sequences
        assert sum(a[f"finish/{k}"] for k in ("stop", "length", "max_turns", "env_error", "timeout")) == \
            pytest.approx(1.0)
        assert a["finish/env_error"] == 0.0
    rollouts = [json.loads(line) for line in (tmp_path / "game" / "rollouts.jsonl").read_text().splitlines()]
    assert any(">" in t or "<" in t or "x" in t for t in rollouts[0]["response_texts"])  # the environment's answers

    # half the samples' environment raises: they end with env_error and train on nothing
    shutil.copytree(init, tmp_path / "odd" / "init")
    bad = config(tmp_path / "odd", env="agent_envs:GuessFailsOnOdd", failed_samples="exclude")
    recs = records(run(bad, iterations=1, quiet=True))
    a = recs[0]["agent"]
    assert 0.0 < a["finish/env_error"] < 1.0 and recs[0]["stale_check_passed"]
    assert math.isfinite(recs[0]["policy_loss"])
    assert a["excluded"] == round(a["finish/env_error"] * a["n"]) > 0
    assert recs[0]["stale_check_tokens"] == a["model_tokens"]  # the excluded samples' tokens are not checked either
