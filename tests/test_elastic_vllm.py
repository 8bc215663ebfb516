"""Elastic resize of the rollout side: the vLLM replicas of a running GRPO loop change
their layout (TP1×2 -> TP2×1 on the same 2-device trainer world) at an iteration boundary — real
Ray (the module's session, logical devices), real DeepSpeed ZeRO-3 trainers, real vLLM CPU engines.

- The new replicas start in the background during the iteration before the entry (counted: > 0
  iterations ran meanwhile); at the boundary the weight channel is re-formed over the trainer
  ranks and them and one sync fills them — the minimum bytes: the model once per new replica —
  before they generate; the old replica actors are gone after it (Ray reports them dead).
- The stale-weights check passes on every iteration, after the change too (vLLM's log-probs of
  the generated tokens = the trainer's, < 1e-4), and the run finishes.
- Seconds are printed (``-s``), never asserted.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.slow


def replica_run(out: Path, iterations: int, schedule: list[dict]) -> dict:
    """GRPO of ZeRO-3 DP2 with two vLLM TP1 replicas and ``schedule`` (also
    tests/test_elastic_combined.py's)."""
    sys.path.insert(0, str(HERE))
    from helpers import small

    cfg = small("grpo_tiny.yaml", out, world=2, train={"engine": "deepspeed", "zero_stage": 3, "dp": 2},
                rollout={"engine": "vllm", "tp": 1, "dp": 2}, checkpoint={"save_every": 0})
    cfg.pop("reference")  # no KL: the trainer and the replicas are what these tests are about
    cfg["algorithm"].update(kl_coef=0.0, iterations=iterations)
    cfg["elastic"] = {"schedule": schedule}
    return cfg


def _config(out: Path) -> dict:
    return replica_run(out, 3, [{"iteration": 2, "world_size": 2, "train": {"engine": "deepspeed", "zero_stage": 3,
                                                                            "dp": 2},
                                 "rollout": {"engine": "vllm", "tp": 2, "dp": 1}}])


def _minimum(spec, tp: int, replicas: int) -> int:
    """The fewest bytes any plan moves into vLLM replicas of TP ``tp`` from ranks of their own."""
    from rlhf_switch.vps.layouts.vllm import vllm_layout
    from rlhf_switch.vps.placement import place
    from rlhf_switch.vps.planner import minimum_bytes_received

    dst = vllm_layout(spec, tp, replicas, "float32")
    total = 1 + dst.world_size
    src, dst = place(vllm_layout(spec, 1, 1, "float32"), [0], total), place(dst, range(1, total), total)
    return sum(minimum_bytes_received(src, dst, r) for r in range(total))


def test_grpo_vllm_replicas_change_layout_in_a_running_loop(ray_session, tmp_path):
    from recipes.grpo import run
    from rlhf_switch.models import model_spec
    from helpers import records

    cfg = _config(tmp_path / "run")
    recs = run(cfg, quiet=True)
    steps = [r for r in recs if "reward_mean" in r]
    assert [r["iteration"] for r in steps] == [0, 1, 2]
    for r in steps:  # every iteration, before and after the change: vLLM ran on the trainer's weights
        assert r["stale_check_passed"] and r["stale_logprob_diff"] < 1e-4, r
        assert r["gen_tokens"] > 0
    (resize,) = [r["resize"] for r in recs if "resize" in r]
    assert "abandoned" not in resize, resize
    assert (resize["kind"], resize["part"], resize["old"], resize["new"]) == (
        "planned", "rollout", "vllm TP1×2", "vllm TP2×1")
    assert resize["iterations_during_build"] >= 1  # iteration 1 ran while the new replicas started
    assert (resize["old_replicas"], resize["new_replicas"], resize["old_replicas_gone"]) == (2, 1, 2)
    # bytes = the planner's minimum into the replicas' layout (every element each worker holds, once:
    # a TP2 worker holds the norms whole), from trainer ranks that hold none of it
    spec = model_spec(cfg["model"]["hf_config"])
    assert steps[0]["bytes_moved"] == _minimum(spec, 1, 2) == 2 * spec.numel * 4  # into TP1×2
    assert resize["bytes_moved"] == _minimum(spec, 2, 1) == steps[2]["bytes_moved"]  # the fill, then into TP2×1
    assert spec.numel * 4 < _minimum(spec, 2, 1) < 2 * spec.numel * 4
    (summary,) = [r["channel"] for r in records(tmp_path / "run") if "channel" in r]
    assert summary["opened"] == 2 and summary["members"] == 2 + 2  # 2 trainer ranks + 1 replica of TP2
    assert len(summary["nodes"]["replicas"]) == 1
    assert (tmp_path / "run" / "final").is_dir()
    print(f"\nvLLM TP1×2 -> TP2×1: new replicas started in {resize['background_s']:.1f} s in the background "
          f"({resize['iterations_during_build']} iteration(s) meanwhile, {resize['waited_for_build_s']:.1f} s "
          f"waited at the boundary), stop-the-world {resize['stop_the_world_s']:.2f} s (fill sync "
          f"{resize['fill_sync_s']:.2f} s, {resize['bytes_moved']} B), old replicas shut down in "
          f"{resize['release_s']:.2f} s")


def test_a_new_replica_lost_while_starting_leaves_the_old_ones_generating(ray_session, tmp_path):
    """``Cluster.start_replicas`` / ``swap_replicas`` on their own: a new replica killed while its
    engine starts — the swap says so in one ``ValueError``, the new replicas are gone, the channel
    is formed again over the old replicas, and they go on: synced, they generate with exactly the
    trainer's weights (the stale-weights check of a training step passes)."""
    import torch

    from recipes.cluster import Cluster
    from recipes.common import warm_start
    from rlhf_switch.rl.config import load_config

    cfg = load_config(_config(tmp_path / "run"))
    cluster = Cluster(cfg.at_iteration(0), ray_session, quiet=True)
    try:
        init = warm_start(cluster.cfg, tmp_path / "init", True)
        cluster.build(init, None)
        old = list(cluster.replicas)
        incoming = cluster.start_replicas(cfg.at_iteration(2), init)
        ray_session.kill(incoming.actors[0])
        with pytest.raises(ValueError, match="new rollout replicas were not taken.*old replicas generate on"):
            cluster.swap_replicas()
        assert cluster.replicas == old and (cluster.tp, cluster.n_replicas) == (1, 2)
        assert cluster._gone(incoming.actors) == 1  # TP2×1: the one new replica
        cluster.sync()
        prompts = [[1, 5 + i, 7] for i in range(8)]
        responses, lps = cluster.generate(prompts, list(range(8)), 4, 1.0)
        stats = cluster.all("train_on", {"prompts": prompts, "responses": responses, "rollout_logprobs": lps,
                                         "advantages": torch.linspace(-1, 1, 8).tolist()})
        assert max(s["stale_logprob_diff"] for s in stats) < 1e-4
    finally:
        cluster.shutdown()
