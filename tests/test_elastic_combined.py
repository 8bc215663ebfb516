"""One elastic resize that changes both the trainer world and the vLLM replicas: real Ray
(the module's session, logical devices), real DeepSpeed ZeRO-3 trainers, real vLLM CPU engines.

One GRPO run of 6 iterations, world 2 (ZeRO-3 DP2, vLLM TP1×2), with two schedule entries to
world 1 (ZeRO-3 DP1, vLLM TP1×1), before iterations 1 and 3, and a resize request back to world 2
(written right after the second resize; it becomes the entry before iteration 4):

- iteration 1: a new replica is killed while it starts (during iteration 0) — the entry is
  abandoned with one message naming both sides, the new trainer world is dropped with it, and
  iteration 1 runs in the current world (2 devices still held);
- iteration 3: built in the background during iteration 2 (the trainer world and the replicas),
  then one stop-the-world: the trainer's state right after it equals the state right before it bit
  for bit (gathered whole through the VPS), the replicas are filled by the move before they
  generate (the minimum bytes: the model once) and the stale-weights check passes on every
  iteration after it (vLLM's log-probs = the trainer's, < 1e-4); the old trainers and replicas are
  gone, and only then is device 1 released (its placement group removed — a new replica placed
  there would have died with it, yet the new one generates on);
- iteration 4, by request: the grow — device 1 held again from the build's start, two new TP1
  replicas on the two devices, the request answered ``done``, the state
  again equal bit for bit across the resize, the fill the model once per replica; the run finishes.
- Seconds are printed (``-s``), never asserted.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.slow


def _config(out: Path) -> dict:
    sys.path.insert(0, str(HERE))
    from test_elastic_vllm import replica_run

    one = {"world_size": 1, "train": {"engine": "deepspeed", "zero_stage": 3, "dp": 1},
           "rollout": {"engine": "vllm", "tp": 1, "dp": 1}}
    return replica_run(out, 6, [{"iteration": 1, **one}, {"iteration": 3, **one}])


def _devices_held(ray) -> int:
    """The device manager's placement groups alive (one single-bundle group per logical device)."""
    return sum(1 for g in ray.util.placement_group_table().values()
               if g["state"] == "CREATED" and list(g["bundles"].values()) == [{"CPU": 1.0, "GPU": 1.0}])


def test_grpo_trainer_world_and_vllm_replicas_resized_together(ray_session, tmp_path):
    from recipes.grpo import run
    from rlhf_switch.models import model_spec
    from test_elastic import _differences, _gathered
    from test_elastic_vllm import _minimum
    from rlhf_switch.elastic.requests import read_answer, request_resize
    from helpers import records

    ray = ray_session
    seen: dict = {"states": {}, "devices": {}}

    def hook(it, phase, cluster):
        if it == 0 and phase == "train":  # the first entry's new replica dies while it starts
            ray.kill(cluster._incoming.actors[0])
        if phase in ("before_resize", "after_resize"):
            seen["states"][(it, phase)] = _gathered(ray, cluster.workers)
            seen["devices"][(it, phase)] = _devices_held(ray)
        if (it, phase) == (3, "after_resize"):  # back to world 2, from outside the config
            seen["request"] = request_resize(tmp_path / "run", world_size=2, train=cfg["train"],
                                             rollout=cfg["rollout"])

    cfg = _config(tmp_path / "run")
    recs = run(cfg, quiet=True, phase_hook=hook)
    steps = [r for r in recs if "reward_mean" in r]
    assert [r["iteration"] for r in steps] == list(range(6))
    for r in steps:  # every iteration, before and after the resize: vLLM ran on the trainer's weights
        assert r["stale_check_passed"] and r["stale_logprob_diff"] < 1e-4, r
        assert r["gen_tokens"] > 0
    abandoned, done, grown = [r["resize"] for r in recs if "resize" in r]
    # iteration 1: one message, both sides dropped, the current world trained on
    assert "both the new trainer world and its rollout replicas abandoned" in abandoned["abandoned"], abandoned
    assert "rollout replicas failed" in abandoned["abandoned"], abandoned
    assert seen["devices"][(1, "before_resize")] == seen["devices"][(1, "after_resize")] == 2
    # iteration 3: both sides at once
    assert "abandoned" not in done, done
    assert done["part"] == "trainer+rollout", done
    assert done["old"].startswith("world 2, train {") and "'dp': 2" in done["old"], done
    assert done["old"].endswith("rollout vllm TP1×2"), done
    assert done["new"].startswith("world 1, train {"), done
    assert done["new"].endswith("rollout vllm TP1×1"), done
    assert done["iterations_during_build"] >= 1  # iteration 2 ran while both were built
    assert _differences(seen["states"][(3, "before_resize")], seen["states"][(3, "after_resize")]) == []
    assert (done["old_replicas"], done["new_replicas"], done["old_replicas_gone"]) == (2, 1, 2)
    assert done["devices_released"] == [1]
    assert (seen["devices"][(3, "before_resize")], seen["devices"][(3, "after_resize")]) == (2, 1)
    spec = model_spec(cfg["model"]["hf_config"])
    assert done["fill_bytes_moved"] == _minimum(spec, 1, 1) == spec.numel * 4 == steps[3]["bytes_moved"]
    assert done["trainer_bytes_moved"] > 0
    assert done["bytes_moved"] == done["trainer_bytes_moved"] + done["fill_bytes_moved"]
    assert done["background_s"] == max(done["trainer_background_s"], done["replicas_background_s"])
    # iteration 4: the grow back to world 2, vLLM TP1×2, by request
    assert "abandoned" not in grown and grown["kind"] == "requested", grown
    answer = read_answer(tmp_path / "run")
    assert (answer["id"], answer["status"], answer["iteration"]) == (seen["request"], "done", 4), answer
    assert (grown["old"], grown["new"]) == (done["new"], done["old"]), grown
    assert grown["iterations_during_build"] >= 1
    assert _differences(seen["states"][(4, "before_resize")], seen["states"][(4, "after_resize")]) == []
    assert (grown["old_replicas"], grown["new_replicas"], grown["old_replicas_gone"]) == (1, 2, 1)
    assert grown["devices_released"] == []
    # device 1 held again since the build started (during iteration 3), kept after the boundary
    assert (seen["devices"][(4, "before_resize")], seen["devices"][(4, "after_resize")]) == (2, 2)
    assert grown["fill_bytes_moved"] == _minimum(spec, 1, 2) == 2 * spec.numel * 4 == steps[4]["bytes_moved"]
    (summary,) = [r["channel"] for r in records(tmp_path / "run") if "channel" in r]
    assert summary["members"] == 2 + 2  # 2 trainer ranks + 2 replicas of TP1
    assert (tmp_path / "run" / "final").is_dir()
    print(f"\nworld 2 (ZeRO-3 DP2, vLLM TP1×2) -> world 1 (ZeRO-3 DP1, vLLM TP1×1): built in the background in "
          f"{done['background_s']:.1f} s (trainer {done['trainer_background_s']:.1f} s, replicas "
          f"{done['replicas_background_s']:.1f} s; {done['iterations_during_build']} iteration(s) meanwhile, "
          f"{done['waited_for_build_s']:.1f} s waited), stop-the-world {done['stop_the_world_s']:.2f} s (trainer "
          f"move {done['trainer_move_s']:.2f} s, {done['trainer_bytes_moved']} B; channel + fill "
          f"{done['replica_swap_s']:.2f} s, fill sync {done['fill_sync_s']:.2f} s, {done['fill_bytes_moved']} B), "
          f"old actors shut down in {done['release_s']:.2f} s")
    print(f"world 1 -> world 2 (ZeRO-3 DP2, vLLM TP1×2): built in the background in {grown['background_s']:.1f} s "
          f"(trainer {grown['trainer_background_s']:.1f} s, replicas {grown['replicas_background_s']:.1f} s; "
          f"{grown['waited_for_build_s']:.1f} s waited), stop-the-world {grown['stop_the_world_s']:.2f} s (trainer "
          f"move {grown['trainer_move_s']:.2f} s, {grown['trainer_bytes_moved']} B; channel + fill "
          f"{grown['replica_swap_s']:.2f} s, fill sync {grown['fill_sync_s']:.2f} s, {grown['fill_bytes_moved']} B), "
          f"old actors shut down in {grown['release_s']:.2f} s")


def test_a_combined_entry_is_checked_before_ray(tmp_path):
    """A schedule entry (or a resize request) that changes the trainer world beside vLLM replicas
    is accepted; one whose replicas do not fit the new world is one ConfigError before Ray."""
    from rlhf_switch.problems import check_resize_request
    from rlhf_switch.problems import check_run
    from rlhf_switch.rl.config import ConfigError, load_config

    cfg = _config(tmp_path / "run")
    ok = load_config(cfg)
    check_run(ok)
    assert [(ok.at_iteration(i).world_size, ok.at_iteration(i).rollout.dp) for i in (0, 1, 3)] == [(2, 2), (1, 1), (1, 1)]
    bad = {**cfg["elastic"]["schedule"][1], "rollout": {"engine": "vllm", "tp": 2, "dp": 1}}  # TP2 on 1 device
    with pytest.raises(ConfigError) as e:
        check_run(load_config({**cfg, "elastic": {"schedule": [bad]}}))
    assert e.value.problems == ["elastic.schedule[0]: rollout: tp·pp·dp = 2·1·1 = 2, but world_size = 1 (every "
                                "phase is colocated on all devices)"], e.value.problems
    run = load_config({**cfg, "elastic": {}})
    new, entry = check_resize_request(run, {"id": "a", **{k: cfg["elastic"]["schedule"][1][k]
                                                      for k in ("world_size", "train", "rollout")}}, 1, 4, 2)
    assert (entry.world_size, new.at_iteration(1).train.dp, new.at_iteration(1).rollout.dp) == (1, 1, 1)
    with pytest.raises(ConfigError) as e:
        check_resize_request(run, {"id": "b", "world_size": 1, "train": bad["train"], "rollout": bad["rollout"]}, 1, 4, 2)
    assert any("tp·pp·dp = 2·1·1 = 2, but world_size = 1" in p for p in e.value.problems), e.value.problems
