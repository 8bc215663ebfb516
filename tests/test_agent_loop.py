"""Multi-turn rollouts in the real loop (``agent`` block, recipes/loop/workflow.py): FSDP2 DP2
training, the torch rollout engine on both ranks, the guessing game's environments in a pool of
Ray workers. Two short runs from one warm start:

- the game as shipped (configs/agent_guess_tiny.yaml): every sample is a multi-turn episode, the
  token-exactness check of every sample passes (the run would stop otherwise), the stale-weights
  check compares exactly the model's tokens (the environment's carry no loss and are not
  checked), the record says what the episodes did;
- an environment that raises on half the samples, with ``failed_samples: exclude`` (and LoRA):
  those samples end with ``env_error`` and carry no token into the loss, the run finishes.

Then a chat model's episodes, the game two steps ahead on vLLM replicas, and the game on a replica
lent the trainer's device.
"""
from __future__ import annotations

import json
import math
import shutil

import pytest
import yaml

from test_rl_pure import CONFIGS

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ray_session():
    """The module's Ray session: a CPU more than the other modules' (``start_local_ray``) for the
    environment workers (2 × 0.25) beside four devices' actors (two vLLM replicas of their own)."""
    from conftest import start_local_ray

    ray = start_local_ray(num_cpus=5)
    yield ray
    ray.shutdown()


def config(out, **agent) -> dict:
    cfg = yaml.safe_load((CONFIGS / "agent_guess_tiny.yaml").read_text())
    cfg.update(output_dir=str(out), sft={**cfg["sft"], "steps": 100})
    cfg["eval"].update(every=0, num_prompts=8)  # the held-out secret and 7 train ones (the config's eval.split: all)
    cfg["algorithm"].update(prompts_per_iteration=4, group_size=4, mini_batch_size=16)  # 16 games an iteration
    cfg["agent"].update(agent)
    return cfg


def records(recs):
    return [r for r in recs if "reward_mean" in r]


def _metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


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
        # the engine stopped every turn at its stop id (the guess's closing character): nothing to cut
        assert a["tokens_past_stop"] == 0
        # the check compared the model's tokens, every one of them, and nothing else
        assert r["stale_check_tokens"] == a["model_tokens"] > 0
        assert a["tokens_mean"] * a["n"] > a["model_tokens"]  # observations are in the sequences
        assert sum(a[f"finish/{k}"] for k in ("stop", "length", "max_turns", "env_error", "timeout")) == \
            pytest.approx(1.0)
        assert a["finish/env_error"] == 0.0
    rollouts = [json.loads(line) for line in (tmp_path / "game" / "rollouts.jsonl").read_text().splitlines()]
    assert any(">" in t or "<" in t or "x" in t for t in rollouts[0]["response_texts"])  # the environment's answers

    # half the samples' environment raises: they end with env_error and train on nothing. With
    # LoRA (the torch engine applies the adapters the channel moves): the engines' tokens and
    # log-probs are the adapted model's, which the stale-weights check compares
    shutil.copytree(init, tmp_path / "odd" / "init")
    bad = config(tmp_path / "odd", env="agent_envs:GuessFailsOnOdd", failed_samples="exclude")
    bad["model"]["lora"] = {"r": 8, "alpha": 16, "sync": "adapters"}
    recs = records(run(bad, iterations=2, quiet=True))
    assert all(r["weights_synced"] == "adapters" for r in recs)
    assert recs[1]["stale_check_passed"] and recs[1]["stale_check_tokens"] > 0  # after an update of the adapters
    a = recs[0]["agent"]
    assert 0.0 < a["finish/env_error"] < 1.0 and recs[0]["stale_check_passed"]
    assert math.isfinite(recs[0]["policy_loss"])
    assert a["excluded"] == round(a["finish/env_error"] * a["n"]) > 0
    assert recs[0]["stale_check_tokens"] == a["model_tokens"]  # the excluded samples' tokens are not checked either


def test_a_chat_models_episodes_in_the_loop(ray_session, tmp_path):
    """A data run with ``chat_template: true`` (a tiny Qwen2 over the shipped BPE tokenizer and its
    ChatML template): the prompt is the template's first turn, each observation the template's
    user message appended as tokens (agent.chat), every turn ends at the model's eos. Warmed up by
    the data run's own SFT (prompt -> a number), the model answers each of the environment's three
    "again"s; the token check and the stale check pass on every sample."""
    from recipes.common import warm_start
    from recipes.train import run
    from rlhf_switch.rl.config import load_config
    from rlhf_switch.testing.tiny_models import build_model_dir

    model = build_model_dir(tmp_path / "model")
    for split, secrets in (("train", range(1, 64)), ("test", range(1, 64, 8))):
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps({"question": "guess=", "answer": str(s)}) + "\n"
                                                          for s in secrets))
    cfg = config(tmp_path / "chat", env="agent_envs:Numbers", env_kwargs={}, max_turns=3, max_turn_tokens=6)
    del cfg["task"]
    cfg.update(model={"dtype": "float32", "path": str(model)}, sft={"steps": 150, "lr": 1.0e-3, "batch_size": 32},
               data={"train_files": [str(tmp_path / "train.jsonl")], "heldout_files": [str(tmp_path / "test.jsonl")],
                     "prompt_key": "question", "answer_key": "answer", "chat_template": True, "num_heldout": 8})
    cfg["algorithm"].update(max_new_tokens=64)
    warm_start(load_config(cfg), tmp_path / "chat" / "init", quiet=True)
    recs = records(run(cfg, iterations=1, quiet=True))
    a = recs[0]["agent"]
    assert recs[0]["stale_check_passed"] and recs[0]["stale_check_tokens"] == a["model_tokens"] > 0
    # three model turns each, batched together; every turn ended at the eos (no "length")
    assert a["turns_mean"] == 3.0 and a["turn_batches"] == [16, 16, 16] and a["finish/stop"] == 1.0
    rollouts = [json.loads(line) for line in (tmp_path / "chat" / "rollouts.jsonl").read_text().splitlines()]
    # two observations before the last turn, each the template's user message
    assert all(t.count("user\nagain") == 2 for t in rollouts[0]["response_texts"]), rollouts[0]["response_texts"][:2]


@pytest.mark.vllm
def test_episodes_two_steps_ahead_on_disaggregated_vllm_replicas(ray_session, tmp_path):
    """``max_staleness: 2`` (and partial rollout) with two vLLM replicas of their own devices: iterations i+1 and i+2's
    episodes are played (turn after turn on the replicas, which pull the turns from one queue in
    chunks, the environments in the pool) while the trainer trains on iteration i's. A sync while episodes
    are in flight reaches the replicas between two rounds: a sample's later turns may carry the
    newer version; the oldest token of iteration i is at most 2 versions behind (the replica's own
    count), the environment's tokens carry none; the token check passes on every sample."""
    from recipes.common import warm_start
    from recipes.train import run
    from rlhf_switch.rl.config import load_config

    # turns batched continuously: every episode's turn goes into one queue per iteration the
    # replicas pull chunks of 3 from (recipes/cluster/turn_queue.py), the other iteration's chunks
    # and the syncs between them
    cfg = config(tmp_path / "ahead", turn_batching="continuous")
    # an evaluation after iteration 1: its sync and its greedy episodes run while iterations 2 and
    # 3's episodes are in flight
    cfg["eval"].update(every=2)
    cfg["rollout"] = {"engine": "vllm", "tp": 1, "pp": 1, "dp": 2, "mode": "disaggregated", "pull_prompts": 3}
    # partial rollout: each turn two tokens a call (a three-token guess is two calls, and a sync may
    # land between them)
    cfg["algorithm"]["off_policy"] = {"max_staleness": 2, "segment_tokens": 2}
    warm_start(load_config(cfg), tmp_path / "ahead" / "init", quiet=True)
    recs = records(run(cfg, iterations=4, quiet=True))
    # iterations 1 and 2 start with iteration 0's weights, iteration 3 with iteration 1's (each
    # sample's first turn; later turns may run after a sync and carry a newer version)
    assert [(r["weight_version_min"], r["staleness_max"]) for r in recs] == [(0, 0), (0, 1), (0, 2), (1, 2)]
    evals = [r for r in _metrics(tmp_path / "ahead") if "heldout_reward" in r]
    assert [e["iteration"] for e in evals] == [0, 2, 4], evals
    for r in recs:
        a = r["agent"]
        assert r["stale_check_passed"] and math.isfinite(r["policy_loss"]), r
        # more calls than turns: the guesses of two digits and their "," took two calls each
        assert a["n"] == 16 and a["turns_mean"] > 1 and sum(a["turn_batches"]) > round(16 * a["turns_mean"])
        assert a["tokens_past_stop"] == 0  # vLLM stopped every turn at the guess's closing character
    # the replicas' idle share, in the records whose window saw generations collected (with episodes
    # played ahead, a later iteration's may all have come back before its own record)
    idle = [r for r in recs if "replica_idle_share" in r]
    assert idle and all(set(r["replica_idle_share"]) == {"0", "1"} and 0 <= r["replica_idle_share_max"] <= 1
                        for r in idle)
    rollouts = [json.loads(line) for line in (tmp_path / "ahead" / "rollouts.jsonl").read_text().splitlines()]
    versions = [set(r["weight_versions"]) for r in rollouts]
    assert versions[:2] == [{0}, {0}] and 0 in versions[2] <= {0, 1, 2} and 1 in versions[3] <= {1, 2}, versions


@pytest.mark.vllm
def test_episodes_on_a_replica_lent_the_trainers_device(ray_session, tmp_path):
    """``elastic.lend: rollout`` in an agent run (one trainer rank, one vLLM replica of its own and
    one on the trainer's device, lent every iteration): every episode's turns go into the turn
    queue both replicas pull from, the lent one synced like the other (the stale-weights check
    passes on the model's tokens after an update)."""
    from recipes.common import warm_start
    from recipes.train import run
    from rlhf_switch.rl.config import load_config

    cfg = config(tmp_path / "lend", turn_batching="continuous")
    cfg.update(world_size=1, elastic={"lend": "rollout"})
    for block in ("train", "reference"):
        cfg[block]["dp"] = 1
    cfg["rollout"] = {"engine": "vllm", "tp": 1, "pp": 1, "dp": 1, "mode": "disaggregated", "pull_prompts": 2}
    warm_start(load_config(cfg), tmp_path / "lend" / "init", quiet=True)
    recs = records(run(cfg, iterations=2, quiet=True))
    for r in recs:
        assert r["lend"]["lent"] and r["lend"]["replicas"] == 2, r["lend"]
        assert r["stale_check_passed"] and r["stale_check_tokens"] == r["agent"]["model_tokens"] > 0
        assert r["agent"]["tokens_past_stop"] == 0
        # both replicas generated: the lent one's seconds are counted too
        assert set(r["replica_idle_share"]) == {"0", "1"}, r["replica_idle_share"]
