"""End to end: the GRPO loop over Ray hybrid workers (FSDP2 DP2 train, torch rollout TP2) on 2
logical devices, a tiny model; the same with DeepSpeed ZeRO-3 DP2 as the trainer. Every iteration's weight sync is verified: the trainer's log-probs
of the generated tokens equal the rollout engine's (the stale-weights check). A third iteration
generates without syncing first; the check must catch it."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]


def digit_reward(prompt: str, response: str, answer: str) -> float:
    """A reward a randomly initialised model already earns some of (its samples vary in it), so
    the advantages are non-zero and the update really changes the weights between iterations."""
    return sum(c.isdigit() for c in response) / max(len(response), 1)


@pytest.mark.slow
@pytest.mark.parametrize("config", ["grpo_tiny_fsdp.yaml", "grpo_tiny_torch.yaml"])  # FSDP2 / DeepSpeed ZeRO-3
def test_grpo_iterations_over_ray_and_the_stale_weights_check(tmp_path, config):
    from recipes.grpo import StaleWeightsError, run

    cfg = yaml.safe_load((REPO / "configs" / config).read_text())
    cfg["output_dir"] = str(tmp_path / "run")
    cfg["algorithm"].update(iterations=3, prompts_per_iteration=2, group_size=4, mini_batch_size=8,
                            micro_batch_size=4, max_new_tokens=4, lr=1e-3)
    cfg["task"].update(num_train=50, num_heldout=10, reward_fn="test_grpo_loop:digit_reward")
    with pytest.raises(StaleWeightsError, match="iteration 2"):
        run(cfg, skip_sync_at=(2,))
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [0, 1, 2]
    for rec in records[:2]:  # synced: the rollout ran on exactly the trainer's weights
        assert rec["stale_check_passed"] and rec["stale_logprob_diff"] < 1e-4, rec
        assert rec["gen_tokens"] > 0 and rec["bytes_moved"] > 0 and rec["switch_train_to_rollout_s"] > 0
        for k in ("reward_mean", "policy_loss", "kl", "gen_tokens_per_s"):
            assert rec[k] == rec[k], f"{k} is NaN"
    assert records[1]["kl"] > 0, "iteration 0's update did not move the policy away from the reference"
    assert not records[2]["stale_check_passed"] and records[2]["bytes_moved"] == 0
