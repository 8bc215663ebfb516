"""End to end: the RLHF loop over Ray with real engines (one Ray session for the whole module).

- GRPO with real DeepSpeed ZeRO-3 training and real vLLM rollout (TP2, mp workers): every
  iteration's weight sync is verified — the trainer's log-probs of the generated tokens equal
  vLLM's — and an iteration that generates without syncing is caught; the checkpoint left by the
  crash loads in transformers and in the loop's own checkpoint reader.
- A crash mid-run, then ``resume`` (no other option): the resumed run finishes the run exactly as
  the uninterrupted one (same rollouts, same losses, bit-identical final weights and Adam moments,
  each iteration's records once) — weights, Adam moments, step and LR schedule all came back
  through the VPS.
- Two different per-phase layouts (train ZeRO-3 DP4 / rollout TP2×DP2 and train TP2×DP2 /
  rollout TP4) produce the same first-iteration rollouts for the same seed.
- PPO with a critic (its own DeepSpeed ZeRO-2 engine) runs the same way.
- vLLM on devices of its own (``rollout.colocate: false``) runs the same way.
"""
from __future__ import annotations

import pytest
import torch
import yaml

from helpers import REPO, TINY, records, small

pytestmark = pytest.mark.slow


def test_grpo_deepspeed_vllm_sync_verified_and_stale_weights_caught(ray_session, tmp_path):
    from recipes.grpo import StaleWeightsError, run
    from rlhf_switch.engines.full_state import FullState, latest_checkpoint
    from rlhf_switch.vps import llama_spec

    out = tmp_path / "run"
    cfg = small("grpo_tiny.yaml", out)  # train DeepSpeed ZeRO-3 DP2, rollout vLLM TP2
    assert cfg["train"]["engine"] == "deepspeed" and cfg["rollout"]["engine"] == "vllm"
    with pytest.raises(StaleWeightsError, match="iteration 2"):
        run(cfg, quiet=True, skip_sync_at=(2,))
    recs = [r for r in records(out) if "reward_mean" in r]
    assert [r["iteration"] for r in recs] == [0, 1, 2]
    for rec in recs[:2]:  # synced: vLLM generated with exactly the trainer's weights
        assert rec["stale_check_passed"] and rec["stale_logprob_diff"] < 1e-4, rec
        assert rec["gen_tokens"] > 0 and rec["bytes_moved"] > 0 and rec["switch_train_to_rollout_s"] > 0
    assert recs[1]["kl"] > 0, "iteration 0's update did not move the policy away from the reference"
    assert not recs[2]["stale_check_passed"] and recs[2]["bytes_moved"] == 0
    # the train-inference mismatch in every record; the stale engine (one update behind) raises it
    # far above the synced iterations' (fp32: rounding only)
    for rec in recs:
        assert rec["stale_check_tokens"] == rec["mismatch_tokens"] == rec["gen_tokens"] > 0, rec
        assert rec["mismatch_logprob_diff_max"] == rec["stale_logprob_diff"]
    synced = max(max(r["mismatch_logprob_diff_p99"], r["mismatch_kl"]) for r in recs[:2])
    assert recs[2]["mismatch_logprob_diff_p99"] > 100 * synced and recs[2]["mismatch_kl"] > 100 * synced, recs
    # the crash left its last checkpoint (after iteration 1) complete and loadable
    last = latest_checkpoint(out / "checkpoints")
    assert last is not None and last.name == "step_2"
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(str(last))
    state = FullState.load_dir(last, llama_spec(TINY))
    assert state.scalars()["step"] == 2 and state.extra["iteration"] == 1
    for name, p in hf.named_parameters():
        assert torch.equal(p.detach(), state.master[name]), name
    assert any(t.abs().sum() > 0 for t in state.moments["exp_avg_sq"].values())
    assert (out / "tensorboard").is_dir() and any((out / "tensorboard").iterdir())


def test_crash_then_resume_continues_exactly(ray_session, tmp_path):
    """A crash in iteration 2 of 3, and the newest checkpoint (after iteration 1) lost as well:
    ``resume=True`` with no other option finishes the run from the one after iteration 0 —
    iterations 1 and 2, not 3 more — to the uninterrupted run's ``final/`` (weights and Adam moments
    bit-identical), and ``metrics.jsonl`` / ``rollouts.jsonl`` hold each iteration once."""
    from recipes.grpo import run
    from safetensors.torch import load_file

    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    base = dict(train={"engine": "fsdp2", "dp": 2}, rollout={"engine": "torch", "tp": 2, "dp": 1},
                reference={"engine": "fsdp2", "dp": 2})
    run(small("grpo_tiny_fsdp.yaml", straight, **base), quiet=True)
    assert (straight / "grpo.png").stat().st_size > 10_000  # reward and time-per-phase plot
    with pytest.raises(RuntimeError, match="injected crash in iteration 2"):
        run(small("grpo_tiny_fsdp.yaml", crashed, **base), quiet=True, crash_at=(2,))
    assert not (crashed / "final").exists()
    (crashed / "checkpoints" / "step_2" / "COMPLETE").unlink()  # iteration 1's records are past the checkpoint now
    assert [r["iteration"] for r in records(crashed) if "reward_mean" in r] == [0, 1]
    resumed = run(small("grpo_tiny_fsdp.yaml", crashed, **base), quiet=True, resume=True)
    assert [r["iteration"] for r in resumed if "reward_mean" in r] == [1, 2]
    a = {r["iteration"]: r for r in records(straight) if "reward_mean" in r}
    b = [r for r in records(crashed) if "reward_mean" in r]
    assert [r["iteration"] for r in b] == [0, 1, 2]  # each once
    b = {r["iteration"]: r for r in b}
    for it in (0, 1, 2):
        for k in ("reward_mean", "policy_loss", "kl", "optimizer_steps"):
            assert a[it][k] == b[it][k], (it, k, a[it][k], b[it][k])
    # the evaluations and the channel record: the uninterrupted run's labels, each once
    def labels(out):
        return [(r["iteration"], r.get("eval", "channel")) for r in records(out) if "reward_mean" not in r]

    assert labels(crashed) == labels(straight) == [(0, "before"), (3, "after"), (3, "channel")]
    ra, rb = records(straight, "rollouts.jsonl"), records(crashed, "rollouts.jsonl")
    assert [r["iteration"] for r in rb] == [0, 1, 2]
    assert [r["responses"] for r in ra] == [r["responses"] for r in rb]
    wa, wb = load_file(str(straight / "final" / "model.safetensors")), load_file(str(crashed / "final" / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    oa = load_file(str(straight / "final" / "optimizer" / "moments.safetensors"))
    ob = load_file(str(crashed / "final" / "optimizer" / "moments.safetensors"))
    assert oa.keys() == ob.keys() and all(torch.equal(oa[k], ob[k]) for k in oa)
    assert torch.load(straight / "final" / "optimizer" / "trainer_state.pt", weights_only=False)["extra"] == \
        torch.load(crashed / "final" / "optimizer" / "trainer_state.pt", weights_only=False)["extra"] == {"iteration": 2}
    # resuming the finished run does nothing
    assert run(small("grpo_tiny_fsdp.yaml", crashed, **base), quiet=True, resume=True) == []


def test_two_layouts_same_first_iteration_rollouts(ray_session, tmp_path):
    from recipes.grpo import run

    one, two = tmp_path / "zero3_tp2x2", tmp_path / "tp2dp2_tp4"
    common = dict(checkpoint={"save_every": 0}, reference={"engine": "fsdp2", "dp": 4})
    c1 = small("grpo_tiny.yaml", one, world=4, train={"engine": "deepspeed", "zero_stage": 3, "dp": 4},
               rollout={"engine": "torch", "tp": 2, "dp": 2}, **common)
    c2 = small("grpo_tiny.yaml", two, world=4, train={"engine": "torch_tp", "tp": 2, "dp": 2},
               rollout={"engine": "torch", "tp": 4, "dp": 1}, **common)
    for c in (c1, c2):
        c["algorithm"]["micro_batch_size"] = 2
        run(c, iterations=1, quiet=True)
    r1, r2 = records(one, "rollouts.jsonl")[0], records(two, "rollouts.jsonl")[0]
    assert r1["prompts"] == r2["prompts"]
    assert r1["responses"] == r2["responses"]
    assert r1["rewards"] == r2["rewards"]
    for a, b in zip(r1["logprobs"], r2["logprobs"]):  # TP splits sum in other orders: ~1e-6
        assert all(abs(x - y) < 1e-4 for x, y in zip(a, b))
    for out in (one, two):
        rec = [r for r in records(out) if "reward_mean" in r][0]
        assert rec["stale_check_passed"], rec


def test_ppo_with_a_critic(ray_session, tmp_path):
    from recipes.ppo import run
    from safetensors.torch import load_file

    out = tmp_path / "ppo"
    cfg = small("ppo_tiny.yaml", out, train={"engine": "fsdp2", "dp": 2},
                rollout={"engine": "torch", "tp": 1, "dp": 2}, reference={"engine": "fsdp2", "dp": 2},
                critic={"engine": "deepspeed", "zero_stage": 2, "dp": 2}, checkpoint={"save_every": 1})
    cfg["algorithm"].update(iterations=2, prompts_per_iteration=8, group_size=1, mini_batch_size=4,
                            micro_batch_size=2, epochs=1)
    run(cfg, quiet=True)
    recs = [r for r in records(out) if "reward_mean" in r]
    assert len(recs) == 2
    # resume from the checkpoint after iteration 0: actor AND critic state (weights, Adam moments,
    # step) come back, so iteration 1 repeats exactly
    again = tmp_path / "ppo_again"
    run({**cfg, "output_dir": str(again)}, quiet=True, resume=str(out / "checkpoints" / "step_1"))
    redo = [r for r in records(again) if "reward_mean" in r]
    assert [r["iteration"] for r in redo] == [1]
    for k in ("reward_mean", "policy_loss", "vf_loss", "value_mean", "return_mean"):
        assert redo[0][k] == recs[1][k], (k, redo[0][k], recs[1][k])
    for rec in recs:
        assert rec["stale_check_passed"], rec
        for k in ("vf_loss", "value_mean", "return_mean", "policy_loss"):
            assert rec[k] == rec[k], f"{k} is NaN"
    critic = load_file(str(out / "final" / "critic" / "model.safetensors"))
    assert "score.weight" in critic and any(k.startswith("model.layers.") for k in critic)
    init = load_file(str(out / "init" / "model.safetensors"))
    # the critic's trunk started from the actor's warm start and was trained since
    assert not torch.equal(critic["model.layers.0.mlp.up_proj.weight"], init["model.layers.0.mlp.up_proj.weight"])


def test_grpo_raises_the_heldout_reward_from_the_sft_warm_start(ray_session, tmp_path):
    """The shipped FSDP2 config as it is (SFT warm start, 20 GRPO iterations of 16 prompts × 8
    samples, fixed seeds): the held-out greedy exact-match reward on 200 prompts rises by at
    least 0.05 (docs/benchmarks.md)."""
    from recipes.grpo import run

    out = tmp_path / "learn"
    cfg = yaml.safe_load((REPO / "configs" / "grpo_tiny_fsdp.yaml").read_text())
    cfg.update(output_dir=str(out), checkpoint={"save_every": 0})
    run(cfg, quiet=True)
    evals = [r for r in records(out) if "heldout_reward" in r]
    before, after = evals[0]["heldout_reward"], evals[-1]["heldout_reward"]
    assert evals[0]["iteration"] == 0 and evals[-1]["iteration"] == 20
    assert before > 0.1, f"the SFT warm start earns almost no reward ({before})"
    assert after >= before + 0.05, f"held-out reward {before:.3f} -> {after:.3f}: GRPO did not raise it by 0.05"


def test_grpo_with_vllm_on_devices_of_its_own(ray_session, tmp_path):
    """``rollout.colocate: false``: the trainer's (logical) device, then a bundle of its own for
    the vLLM replica (``recipes.cluster.resources``; one rank each, to stay small); the loop runs
    the same — every sync passes the stale-weights check."""
    from recipes.grpo import run

    out = tmp_path / "apart"
    cfg = small("grpo_tiny.yaml", out, world=1, train={"engine": "fsdp2", "dp": 1},
                reference={"engine": "fsdp2", "dp": 1}, rollout={"engine": "vllm", "tp": 1, "colocate": False},
                checkpoint={"save_every": 0})
    cfg["algorithm"]["iterations"] = 2
    run(cfg, quiet=True)
    recs = [r for r in records(out) if "reward_mean" in r]
    assert [r["iteration"] for r in recs] == [0, 1]
    for rec in recs:
        assert rec["stale_check_passed"] and rec["stale_logprob_diff"] < 1e-4 and rec["bytes_moved"] > 0, rec
