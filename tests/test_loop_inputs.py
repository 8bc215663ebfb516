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


def sleeping_reward(prompt: str, response: str, answer: str) -> float:
    """Past any test's time limit: a run must stop it (``reward_timeout_s``), not wait."""
    import time

    time.sleep(60)
    return 1.0


def config(name: str = "grpo_tiny_fsdp.yaml", **changes) -> dict:
    """A shipped config with ``changes`` (dotted paths) applied."""
    cfg = yaml.safe_load((REPO / "configs" / name).read_text())
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
    from recipes.train import prepare
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


# --- the command line --------------------------------------------------------------------------------

def test_help_is_usage_and_every_flag_is_explained(capsys):
    from recipes.cli import main, parser

    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: rlhf-switch") and "train" in out and "give a config file" not in out
    assert main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    usage = out.split("\n\n")[0]
    assert usage.startswith("usage: rlhf-switch train") and "recipes." not in usage, usage
    for flag in ("--iterations N", "--output-dir DIR", "--resume [DIR]", "--stale-tol T", "--quiet", "--verbose"):
        assert flag in out, flag
    assert "TOTAL number of iterations" in out and "give a config file" not in out
    _, train = parser()
    assert all(a.help for a in train._actions), [a.dest for a in train._actions if not a.help]
    assert main([]) == 2  # no command: the usage, on stderr
    assert capsys.readouterr().err.startswith("usage: rlhf-switch")
    from recipes.grpo import main as grpo_main

    with pytest.raises(SystemExit) as e:
        grpo_main(["--help"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("usage: python -m recipes.grpo")


# --- resume: the run's total, finished runs, records once -------------------------------------------

def _checkpoint(path: Path, iteration: int, critic: bool = False) -> Path:
    from rlhf_switch.engines.full_state import FullState
    from rlhf_switch.vps import llama_spec

    hf = config()["model"]["hf_config"]
    FullState(llama_spec(hf), scalars={"step": iteration + 1}).save_dir(path, hf, extra={"iteration": iteration})
    if critic:
        FullState(llama_spec(hf), scalars={"step": iteration + 1}).save_dir(path / "critic")
    return path


def test_resume_of_a_finished_run_says_so_without_starting_ray(tmp_path, capsys, monkeypatch):
    import recipes.train as loop
    from recipes.cli import main

    def must_not_run(*a, **k):
        raise AssertionError("a finished run started something")

    monkeypatch.setattr(loop, "start_ray", must_not_run)
    monkeypatch.setattr(loop, "warm_start", must_not_run)
    out = tmp_path / "run"
    _checkpoint(out / "checkpoints" / "step_2", 1)
    _checkpoint(out / "final", 2)  # the last of 3 iterations
    cfg = write(tmp_path, config(output_dir=str(out), **{"algorithm.iterations": 3}))
    assert main(["train", cfg, "--resume"]) == 0
    said = capsys.readouterr().out
    assert "the run is finished" in said and "final holds iteration 2 (3 iterations)" in said, said
    assert main(["train", cfg, "--resume", "--iterations", "2"]) == 0  # a lowered total: finished too
    assert "beyond the 2 asked for" in capsys.readouterr().out
    assert main(["train", cfg, "--resume", str(out / "checkpoints" / "step_2"), "--iterations", "2"]) == 0
    assert "the run is finished" in capsys.readouterr().out
    assert loop.run(cfg, resume=True, quiet=True) == []
    import ray

    assert not ray.is_initialized()


def test_resume_point_is_the_newest_checkpoint_up_to_the_total(tmp_path):
    from recipes.common import RunFinished, resolve_resume

    out = tmp_path / "run"
    assert resolve_resume(None, out, 5) is None
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        resolve_resume(True, out, 5)
    step2, step4 = _checkpoint(out / "checkpoints" / "step_2", 1), _checkpoint(out / "checkpoints" / "step_4", 3)
    assert resolve_resume(True, out, 5) == (step4, 3)
    (step4 / "COMPLETE").unlink()  # a save that died: the one before it
    assert resolve_resume(True, out, 5) == (step2, 1)
    final = _checkpoint(out / "final", 4)
    with pytest.raises(RunFinished, match="holds iteration 4"):
        resolve_resume(True, out, 5)
    assert resolve_resume(True, out, 8) == (final, 4)  # the total raised: continue from final/
    _checkpoint(out / "checkpoints" / "step_6", 5)  # ... and that continuation crashed later
    assert resolve_resume(True, out, 8) == (out / "checkpoints" / "step_6", 5)
    assert resolve_resume(str(step2), out, 5) == (step2, 1)
    # PPO: a checkpoint whose critic/ is missing (a save that died between the two) is skipped
    ppo = tmp_path / "ppo"
    with_critic = _checkpoint(ppo / "checkpoints" / "step_1", 0, critic=True)
    _checkpoint(ppo / "checkpoints" / "step_2", 1)
    assert resolve_resume(True, ppo, 5, parts=("critic",)) == (with_critic, 0)
    with pytest.raises(FileNotFoundError, match="critic/"):
        resolve_resume(str(ppo / "checkpoints" / "step_2"), ppo, 5, parts=("critic",))


def test_checkpoint_config_names_the_dtype_without_the_deprecated_attribute(tmp_path, capfd):
    import json

    from transformers import LlamaConfig

    from rlhf_switch.engines.full_state import write_hf_config

    write_hf_config(tmp_path, {**config()["model"]["hf_config"], "torch_dtype": "float32"})
    assert LlamaConfig.from_pretrained(str(tmp_path)).dtype == torch.float32
    assert "torch_dtype" not in capfd.readouterr().err  # transformers 5: "`torch_dtype` is deprecated!"
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["dtype"] == written["torch_dtype"] == "float32"


def test_rays_token_auth_notice_is_dropped_while_the_embedded_instance_starts(caplog):
    import logging

    from recipes.cluster import quiet_default_token_auth_notice

    logger = logging.getLogger("ray._private.authentication.authentication_token_setup")
    notice = ("Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled to opt out. "
              "For more information, see https://docs.ray.io/en/latest/ray-security/token-auth.html")
    with caplog.at_level(logging.WARNING, logger=logger.name):
        with quiet_default_token_auth_notice():
            logger.warning(notice)
            logger.warning("Token authentication is disabled for this Ray cluster.")  # other lines pass
        logger.warning(notice)  # outside ray.init of the embedded instance: untouched
    assert [r.getMessage()[:45] for r in caplog.records] == ["Token authentication is disabled for this Ray",
                                                              "Token authentication is enabled for this Ray "]


def test_stale_tolerance_by_dtype():
    """The stale check's bound: given; 1e-4 in float32; in bf16/fp16 calibrated once on the first
    iteration's gap (4x, at least 1e-4), and a first gap beyond the dtype's ceiling not calibrated on."""
    from recipes.common import StaleTolerance

    assert StaleTolerance(3e-3, "bfloat16").bound(0.2) == 3e-3
    fp32 = StaleTolerance(None, "float32")
    assert fp32.value == 1e-4 and fp32.bound(5.0) == 1e-4 and fp32.source == "float32"
    bf16 = StaleTolerance(None, "bfloat16")
    assert bf16.value is None
    assert bf16.bound(0.03) == pytest.approx(0.12) and bf16.bound(0.5) == pytest.approx(0.12)  # once, then fixed
    assert "first iteration's 0.03" in bf16.source
    assert StaleTolerance(None, "bfloat16").bound(1e-6) == 1e-4
    wild = StaleTolerance(None, "float16")
    assert wild.bound(3.0) == 0.1 and "not calibrated on" in wild.source
