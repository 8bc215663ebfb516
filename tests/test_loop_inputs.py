"""Bad input to the RLHF loop gets one clear message before Ray or any engine starts; checkpoints
are complete or recognisably not (fast: no Ray, no engines)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

REPO = Path(__file__).resolve().parents[1]


def raising_reward(prompt: str, response: str, answer: str) -> float:
    raise KeyError("no such answer table")


def config(**changes) -> dict:
    cfg = yaml.safe_load((REPO / "configs" / "grpo_tiny_fsdp.yaml").read_text())
    for path, value in changes.items():
        node = cfg
        *parents, leaf = path.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = value
    return cfg


def write(tmp_path: Path, cfg: dict) -> str:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def cli(tmp_path, cfg, capsys) -> tuple[int, str]:
    from recipes.cli import main

    rc = main(["train", write(tmp_path, cfg)])
    return rc, capsys.readouterr().err


def test_unknown_field_is_named_with_a_suggestion(tmp_path, capsys):
    cfg = config()
    cfg["algorithm"]["group_sise"] = 4
    rc, err = cli(tmp_path, cfg, capsys)
    assert rc == 2
    assert "algorithm.group_sise: unknown field" in err and "did you mean 'group_size'" in err


def test_impossible_layout_is_refused_before_anything_starts(tmp_path, capsys):
    rc, err = cli(tmp_path, config(**{"rollout.tp": 3, "rollout.dp": 1}), capsys)
    assert rc == 2
    assert "rollout: tp·pp·dp = 3·1·1 = 3, but world_size = 2" in err
    assert "rollout: tp=3 does not divide num_attention_heads" in err


def test_a_reward_function_that_raises(tmp_path, capsys):
    rc, err = cli(tmp_path, config(**{"task.reward_fn": "test_loop_inputs:raising_reward"}), capsys)
    assert rc == 2
    assert "task.reward_fn" in err and "raising_reward" in err and "KeyError" in err and "no such answer table" in err


def test_a_prompt_longer_than_the_context(tmp_path, capsys):
    rc, err = cli(tmp_path, config(**{"model.hf_config.max_position_embeddings": 8}), capsys)
    assert rc == 2
    assert "max_position_embeddings=8" in err and "longest prompt" in err


def test_what_the_loop_does_not_run_is_refused_up_front():
    from recipes.loop import prepare
    from rlhf_switch.rl.config import ConfigError

    # every phase's engine is asked, through the registry, whether it runs its layout
    with pytest.raises(ConfigError) as e:
        prepare(config(**{"train": {"engine": "torch_pp", "pp": 1, "dp": 2},
                          "reference": {"engine": "deepspeed", "zero_stage": 0, "dp": 2},
                          "rollout": {"engine": "sglang", "tp": 2}}))
    text = str(e.value)
    assert "train: engine torch_pp runs dp=1 only (got dp=2" in text, text
    assert "reference: engine deepspeed needs zero_stage 1, 2 or 3, got 0" in text, text
    assert "rollout.engine: unknown rollout engine 'sglang' (registered: torch, vllm; or give your own as " \
           "'module:Class')" in text, text
    with pytest.raises(ConfigError, match="train.engine: training engine 'no_such_module:Engine': cannot import"):
        prepare(config(**{"train.engine": "no_such_module:Engine"}))
    with pytest.raises(ConfigError, match="not a subclass of rlhf_switch.engines.base.TrainingEngine"):
        prepare(config(**{"train.engine": "test_loop_inputs:raising_reward"}))
    ppo = yaml.safe_load((REPO / "configs" / "ppo_tiny.yaml").read_text())
    ppo["world_size"] = 4
    for phase in ("rollout", "reference"):
        ppo[phase]["dp"] = 4
    ppo["train"] = {"engine": "torch_tp", "tp": 2, "dp": 2}
    ppo["critic"]["dp"] = 4
    with pytest.raises(ConfigError, match=r"critic: dp=4 must equal train.dp=2"):
        prepare(ppo)


def test_unknown_command_and_missing_config(capsys):
    from recipes.cli import main

    assert main(["serve"]) == 2 and "unknown command 'serve'" in capsys.readouterr().err
    assert main(["train"]) == 2 and "give a config file" in capsys.readouterr().err


def test_checkpoint_round_trip_and_incomplete_ones(tmp_path):
    from transformers import LlamaForCausalLM

    from rlhf_switch.engines.full_state import FullState, latest_checkpoint
    from rlhf_switch.engines.torch_train import hf_model
    from rlhf_switch.vps import llama_spec

    hf = config()["model"]["hf_config"]
    model = hf_model(hf, seed=3)
    spec = llama_spec(model.config)
    weights = {n: p.detach() for n, p in model.named_parameters()}
    moments = {"exp_avg": {n: torch.randn_like(p) for n, p in weights.items()},
               "exp_avg_sq": {n: torch.rand_like(p) for n, p in weights.items()}}
    scalars = {"step": 7, "lr_scheduler": {"last_epoch": 7}, "rng": torch.get_rng_state()}
    root = tmp_path / "checkpoints"
    FullState(spec, weights, moments, scalars).save_dir(root / "step_7", hf, extra={"iteration": 6})
    back = FullState.load_dir(root / "step_7", spec)
    assert back.scalars()["step"] == 7 and back.extra == {"iteration": 6}
    assert all(torch.equal(back.master[n], w) for n, w in weights.items())
    assert all(torch.equal(back.moments[f][n], moments[f][n]) for f in moments for n in weights)
    loaded = LlamaForCausalLM.from_pretrained(str(root / "step_7"))
    assert all(torch.equal(p.detach(), weights[n]) for n, p in loaded.named_parameters())
    # a save that died half-way: skipped by latest_checkpoint, refused by load_dir
    FullState(spec, weights, moments, scalars).save_dir(root / "step_9", hf)
    (root / "step_9" / "COMPLETE").unlink()
    assert latest_checkpoint(root) == root / "step_7"
    with pytest.raises(FileNotFoundError, match="incomplete checkpoint"):
        FullState.load_dir(root / "step_9", spec)
    with pytest.raises(ValueError, match="another model"):
        FullState.load_dir(root / "step_7", llama_spec({**hf, "intermediate_size": 64}))
