"""PPO's critic in the elastic paths: a resize and a lost trainer's recovery move the
critic's whole training state (fp32 master, Adam moments, step, LR schedule, RNG) with the
trainer's — real Ray actors, real DeepSpeed engines (actor ZeRO-3, critic ZeRO-2), the loop.

- ``elastic.schedule`` DP2 -> DP1 before iteration 2: the critic's and the actor's state right
  after the resize equal, bit for bit (gathered whole), the state the old world saved just before
  it and a world built directly in DP1 from it loads; the run from there equals that resumed run
  (records and final actor and critic weights and moments, bit for bit).
- ``elastic.redundancy: host``: trainer rank 1 kill -9'd during iteration 1's train phase; the
  actor and the critic are restored from rank 0's host copies; the final actor and critic equal
  the uninterrupted run's bit for bit.
"""
from __future__ import annotations

import os
import shutil
import signal
import sys
from pathlib import Path

import pytest

from helpers import same_full_state

HERE = Path(__file__).resolve().parent
CRITIC_DP2 = {"engine": "deepspeed", "zero_stage": 2, "dp": 2}


def _config(out: Path, world: int) -> dict:
    """Tiny PPO: actor DeepSpeed ZeRO-3, critic ZeRO-2, torch rollout, all DP ``world``; no
    reference (kl_coef 0), 8 sequences an iteration in mini-batches of 4."""
    sys.path.insert(0, str(HERE))
    from helpers import small

    cfg = small("ppo_tiny.yaml", out, world=world, train={"engine": "deepspeed", "zero_stage": 3, "dp": world},
                rollout={"engine": "torch", "tp": 1, "dp": world}, critic={**CRITIC_DP2, "dp": world},
                checkpoint={"save_every": 0})
    cfg.pop("reference")
    cfg["algorithm"].update(kl_coef=0.0, iterations=3, prompts_per_iteration=8, group_size=1, mini_batch_size=4,
                            micro_batch_size=2, epochs=1)
    return cfg


def _entry(iteration: int, dp1: dict) -> dict:
    return {"iteration": iteration, "world_size": 1, "train": dp1["train"], "rollout": dp1["rollout"],
            "critic": dp1["critic"]}


def _final(out: Path):
    """The run's final actor and critic (weights and Adam moments, loaded whole)."""
    from rlhf_switch.engines.full_state import FullState
    from rlhf_switch.models import model_spec, value_spec

    hf = _config(out, 2)["model"]["hf_config"]
    return (FullState.load_dir(out / "final", model_spec(hf)),
            FullState.load_dir(out / "final" / "critic", value_spec(hf)))


def _steps(recs: list[dict]) -> list[dict]:
    return [r for r in recs if "reward_mean" in r]


KEYS = ("reward_mean", "policy_loss", "grad_norm", "vf_loss", "value_mean", "return_mean")


def _gather_at(ray, iteration: int, into: list):
    """A loop phase hook: the actor's and the critic's state, gathered whole, at the train phase of
    ``iteration`` (before its update)."""
    from test_elastic import _gathered

    def hook(it, phase, cluster):
        if it == iteration:
            into.append((_gathered(ray, cluster.workers), ray.get(
                [w.gathered_state.remote("critic") for w in cluster.workers], timeout=600)[0]))
    return hook


@pytest.mark.slow
def test_ppo_with_an_elastic_schedule_resizes_the_critic_too(ray_session, tmp_path):
    from test_elastic import _differences

    from recipes.ppo import run

    ray = ray_session
    cfg = _config(tmp_path / "elastic", 2)
    cfg["checkpoint"] = {"save_every": 2, "keep": 2}  # the state the old world holds before the resize
    dp1 = _config(tmp_path / "unused", 1)
    cfg["elastic"] = {"schedule": [_entry(2, dp1)]}
    after: list = []
    recs = run(cfg, quiet=True, phase_hook=_gather_at(ray, 2, after))
    (resize,) = [r["resize"] for r in recs if "resize" in r]
    assert "abandoned" not in resize, resize
    assert resize["iterations_during_build"] == 1 and resize["bytes_moved"] > 0
    actor_b, critic_b = resize["bytes_moved_by_engine"]  # the critic's moved over the same union group
    assert actor_b > 0 and critic_b > 0 and actor_b + critic_b == resize["bytes_moved"]
    steps = _steps(recs)
    assert [r["iteration"] for r in steps] == [0, 1, 2] and all(r["stale_check_passed"] for r in steps)

    direct = tmp_path / "direct"  # the same run, resumed at iteration 2 in DP1 from its checkpoint
    shutil.copytree(tmp_path / "elastic", direct)
    shutil.rmtree(direct / "final")
    dp1.update(output_dir=str(direct), checkpoint=cfg["checkpoint"])
    loaded: list = []
    theirs = _steps(run(dp1, quiet=True, resume=True, phase_hook=_gather_at(ray, 2, loaded)))
    assert [r["iteration"] for r in theirs] == [2]
    (moved_actor, moved_critic), (loaded_actor, loaded_critic) = after[0], loaded[0]
    # right after the resize: the state the old world saved before it, bit for bit — the critic's
    # (2 iterations of 2 mini-batches: step 4, Adam moments non-zero) and the actor's, scalars and RNG included
    assert moved_critic["scalars"]["step"] == 4 and any(t.abs().sum() > 0 for t in moved_critic["moments"]["exp_avg"].values())
    assert _differences(moved_critic, loaded_critic) == []
    assert _differences(moved_actor, loaded_actor) == []
    for k in KEYS:
        assert steps[2][k] == theirs[0][k], (k, steps[2][k], theirs[0][k])
    (actor, critic), (actor_ref, critic_ref) = _final(tmp_path / "elastic"), _final(direct)
    assert same_full_state(actor, actor_ref) and same_full_state(critic, critic_ref)
    print(f"\nPPO loop resize DP2 -> DP1 (actor ZeRO-3 + critic ZeRO-2): background {resize['background_s']:.1f} s, "
          f"stop-the-world {resize['stop_the_world_s']:.2f} s, {resize['bytes_moved']} B moved "
          f"(actor {actor_b}, critic {critic_b})")


@pytest.mark.slow
def test_ppo_with_host_redundancy_restores_the_critic_too(ray_session, tmp_path):
    from recipes.ppo import run

    ray = ray_session

    def config(out):
        cfg = _config(out, 2)
        cfg["elastic"] = {"redundancy": "host"}
        return cfg

    killed = []

    def kill_in_train(it, phase, cluster):
        if it == 1 and not killed:  # as the train phase starts: synced, copied, generated
            killed.append(ray.get(cluster.workers[1].pid.remote(), timeout=60))
            os.kill(killed[0], signal.SIGKILL)

    mine = run(config(tmp_path / "killed"), quiet=True, phase_hook=kill_in_train)
    (event,) = [r["recovery"] for r in mine if "recovery" in r]
    assert event["lost_ranks"] == [1] and event["restored_iteration"] == 1 and "fell_back_to" not in event
    assert not (tmp_path / "killed" / "checkpoints").exists()
    actor_b, critic_b = event["bytes_moved_by_engine"]  # both from rank 0's host copies
    assert actor_b > 0 and critic_b > 0 and actor_b + critic_b == event["bytes_moved"]
    whole = run(config(tmp_path / "whole"), quiet=True)
    steps, theirs = _steps(mine), _steps(whole)
    assert [r["iteration"] for r in steps] == [0, 1, 2] == [r["iteration"] for r in theirs]
    for a, b in zip(steps, theirs):
        assert all(a[k] == b[k] for k in KEYS), [(k, a[k], b[k]) for k in KEYS]
    (actor, critic), (actor_ref, critic_ref) = _final(tmp_path / "killed"), _final(tmp_path / "whole")
    assert same_full_state(actor, actor_ref) and same_full_state(critic, critic_ref)
    print(f"\nPPO loop: host copies {steps[0]['redundancy_bytes']} B per iteration (actor + critic); recovery "
          f"{event['seconds']:.1f} s (build {event['build_s']:.1f} s, move {event['move_s']:.2f} s), "
          f"{event['bytes_moved']} B (actor {actor_b}, critic {critic_b})")


def test_ppo_elastic_config_takes_the_critic(tmp_path):
    """The critic refusals are gone (schedule, on_node_change: resize, redundancy: host); a
    schedule entry must give a critic block exactly when the run has one — one clear message."""
    from rlhf_switch.elastic.nodes import grown_request
    from rlhf_switch.problems import check_run
    from rlhf_switch.rl.config import ConfigError, load_config

    cfg, dp1 = _config(tmp_path, 2), _config(tmp_path, 1)
    ok = load_config({**cfg, "elastic": {"schedule": [_entry(2, dp1)]}})
    assert ok.at_iteration(1).critic.dp == 2 and ok.at_iteration(2).critic.dp == 1
    assert load_config({**cfg, "elastic": {"redundancy": "host"}}).elastic.redundancy == "host"
    grow = load_config({**cfg, "elastic": {"on_node_change": "resize"}})
    assert grown_request(grow.model_dump(), 4)["critic"]["dp"] == 4
    no_critic = {k: v for k, v in _entry(2, dp1).items() if k != "critic"}
    with pytest.raises(ConfigError) as e:
        check_run(load_config({**cfg, "elastic": {"schedule": [no_critic]}}))
    assert e.value.problems == ["elastic.schedule[0].critic: give a critic block exactly when the run has one (PPO)"]
    sys.path.insert(0, str(HERE))
    from test_elastic import _config as grpo_config

    grpo = grpo_config(tmp_path, 2)
    g1 = grpo_config(tmp_path, 1)
    with pytest.raises(ConfigError) as e:
        check_run(load_config({**grpo, "elastic": {"schedule": [{"iteration": 2, "world_size": 1, "train": g1["train"],
                                                                 "rollout": g1["rollout"], "critic": CRITIC_DP2}]}}))
    assert e.value.problems[0] == "elastic.schedule[0].critic: give a critic block exactly when the run has one (PPO)"
    assert not any("critic block" in p for p in e.value.problems[1:])  # the rest: that critic's layout in the entry's world
