"""Model families: the spec comes from the model, unknown families are refused, and TP rules
cover a MoE model's experts whatever their shapes.

- the derived spec (``models.model_spec``) against a real tiny model of each family and head:
  names, shapes and order equal ``named_parameters()`` (a MoE layer's stacked experts expand to
  the per-expert tensors ``save_pretrained`` writes, checked against its file);
- ``llama_spec`` (hand-written) equals the derived spec for Llama configs;
- ``family_problems`` names what it refuses;
- Megatron TP with fused buffers covers a MoE model (the ``w2`` rule: each member split by its own
  role) — the outside check's case, and hypothesis over random shapes, TP and DP.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlhf_switch.families import FAMILIES, family_problems
from rlhf_switch.models import build_model, model_spec
from rlhf_switch.testing.tiny_models import save_tiny_model, tiny_config
from rlhf_switch.vps import LayoutError, ParallelConfig, build_layout, llama_spec
from rlhf_switch.vps.spec import qwen3_moe_spec

FAMILY_NAMES = tuple(FAMILIES)


def expected_tensors(model) -> list[tuple[str, tuple[int, ...]]]:
    """``named_parameters()`` with a stacked expert tensor written per expert, as transformers'
    ``save_pretrained`` does (``gate_up_proj`` [E, 2I, H] = per expert [gate; up])."""
    out = []
    for name, p in model.named_parameters():
        shape = tuple(p.shape)
        if name.endswith("mlp.experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            for e in range(shape[0]):
                out += [(f"{base}{e}.gate_proj.weight", (shape[1] // 2, shape[2])),
                        (f"{base}{e}.up_proj.weight", (shape[1] // 2, shape[2]))]
        elif name.endswith("mlp.experts.down_proj"):
            base = name[: -len("down_proj")]
            out += [(f"{base}{e}.down_proj.weight", shape[1:]) for e in range(shape[0])]
        else:
            out.append((name, shape))
    return out


@pytest.mark.parametrize("head", ["lm", "value"])
@pytest.mark.parametrize("model_type", FAMILY_NAMES)
def test_spec_is_the_models_named_parameters(model_type, head):
    cfg = tiny_config(model_type)
    spec = model_spec(cfg, head)
    model = build_model(cfg, 0, head)
    assert [(t.name, t.shape) for t in spec.tensors] == expected_tensors(model)
    assert all(t.dtype == "float32" for t in spec.tensors)
    assert spec.attention.num_heads == 2 and spec.attention.head_dim == 32
    roles = {t.name.split(".", 3)[-1]: t.tp for t in spec.tensors if t.layer == 0}
    assert roles["self_attn.q_proj.weight"] == "column" and roles["self_attn.o_proj.weight"] == "row"
    if model_type == "qwen2":
        assert roles["self_attn.k_proj.bias"] == "column"
        assert any(g.buffer.endswith("qkv_proj.bias") and g.style == "qkv" for g in spec.fused)
    if model_type.startswith("qwen3"):
        assert roles["self_attn.q_norm.weight"] == roles["self_attn.k_norm.weight"] == "replicate"
    if model_type == "qwen3_moe" and head == "lm":
        assert spec.num_experts == 4 and roles["mlp.gate.weight"] == "replicate"
        assert roles["mlp.experts.3.down_proj.weight"] == "row"
        assert {t.expert for t in spec.tensors if ".experts." in t.name} == {0, 1, 2, 3}
        # the same tensors as the hand-written planning spec (its order puts the router first)
        hand = qwen3_moe_spec(tiny_config(model_type))
        assert {(t.name, t.shape, t.tp, t.layer, t.expert) for t in hand.tensors} == \
            {(t.name, t.shape, t.tp, t.layer, t.expert) for t in spec.tensors}
        assert set(hand.fused) == set(spec.fused)
    if head == "value":
        assert spec.tensors[-2].name == "score.weight" and "lm_head.weight" not in spec


@pytest.mark.parametrize("overrides", [{}, dict(attention_bias=True, mlp_bias=True), dict(tie_word_embeddings=True),
                                       dict(num_key_value_heads=1, vocab_size=1000)])
def test_llama_spec_equals_the_derived_spec(overrides):
    cfg = tiny_config("llama", **overrides)
    assert llama_spec(cfg) == model_spec(cfg)
    legacy = {k: v for k, v in cfg.items() if k != "model_type"}  # configs written before families
    assert model_spec(legacy) == llama_spec(legacy)


def test_family_problems_name_what_is_refused():
    assert family_problems(tiny_config("qwen3")) == []
    assert family_problems({k: v for k, v in tiny_config("llama").items() if k != "model_type"}) == []
    (msg,) = family_problems(dict(tiny_config("llama"), model_type="gpt_neox"))
    assert "model_type 'gpt_neox' is not supported" in msg and "qwen3_moe" in msg
    with pytest.raises(ValueError, match="model_type 'gpt_neox'"):
        model_spec(dict(tiny_config("llama"), model_type="gpt_neox"))
    (msg,) = family_problems(tiny_config("mistral", sliding_window=64))
    assert "'mistral': sliding_window=64 is not supported" in msg
    assert family_problems(tiny_config("qwen2", sliding_window=64, use_sliding_window=False)) == []
    assert family_problems(tiny_config("qwen2", sliding_window=64, use_sliding_window=True))


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3_moe"])
def test_save_tiny_model_writes_the_specs_tensors(model_type, tmp_path):
    import json

    from safetensors.torch import load_file

    model = save_tiny_model(model_type, str(tmp_path), seed=3)
    written = load_file(str(tmp_path / "model.safetensors"))
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == model_type and config["vocab_size"] == 384
    spec = model_spec(config)
    assert {t.name: t.shape for t in spec.tensors} == {k: tuple(v.shape) for k, v in written.items()}
    if model_type == "qwen3_moe":  # per expert [gate; up] of the stacked tensor, down as is
        assert spec.num_experts == 4  # config.json says num_local_experts (transformers 5)
        experts = model.model.layers[1].mlp.experts
        assert torch.equal(written["model.layers.1.mlp.experts.2.up_proj.weight"], experts.gate_up_proj[2, 32:])
        assert torch.equal(written["model.layers.1.mlp.experts.2.down_proj.weight"], experts.down_proj[2])


# --- Megatron TP over MoE experts -----------------------------------------------------------------

OUTSIDE_CASE = dict(hidden_size=7, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, head_dim=4,
                    num_experts=4, moe_intermediate_size=4, vocab_size=16)


def test_tp_fused_experts_cover_the_model():
    """The outside check's case: TP2·DP2 with fused gate-up used to split the row-parallel
    ``down_proj`` on dim 0 too, and lost 4 of its 28 elements."""
    spec = qwen3_moe_spec(OUTSIDE_CASE)
    layout = build_layout(spec, ParallelConfig(tp=2, dp=2, fuse_gate_up=True)).validate()
    w2 = [lt for lt in layout.fragments(0) if lt.buffer.endswith("experts.w2_weight")]
    assert [f.box.lo[1] for f in w2] == [0] * 4 and all(f.box.shape == (7, 2) for f in w2)


def test_layout_not_covering_the_model_is_refused_when_built(monkeypatch):
    """A TP rule that loses elements is refused by ``build_layout`` itself, naming the tensor."""
    from rlhf_switch.vps.layouts import tensor_parallel
    from rlhf_switch.vps.layouts.local import LocalTensor

    right = tensor_parallel._fused

    def drops_last_part(spec, g, tp, rank):  # a broken rule: the last member's rows go missing
        lt = right(spec, g, tp, rank)
        return LocalTensor(lt.buffer, lt.shape, lt.parts[:-1], lt.dtype)

    monkeypatch.setattr(tensor_parallel, "_fused", drops_last_part)
    with pytest.raises(LayoutError, match=r"does not cover the model: .*experts\.3\.down_proj\.weight .*"
                                          r"TP ranks hold 0 of its 28 elements"):
        build_layout(qwen3_moe_spec(OUTSIDE_CASE), ParallelConfig(tp=2, dp=2, fuse_gate_up=True))


@st.composite
def moe_case(draw):
    tp = draw(st.sampled_from([1, 2, 4]))
    kv = tp * draw(st.integers(1, 2))
    cfg = dict(hidden_size=draw(st.integers(1, 9)), num_hidden_layers=draw(st.integers(1, 2)),
               num_attention_heads=kv * draw(st.integers(1, 2)), num_key_value_heads=kv,
               head_dim=draw(st.integers(1, 3)), num_experts=draw(st.integers(1, 5)),
               moe_intermediate_size=tp * draw(st.integers(1, 3)), vocab_size=draw(st.integers(1, 40)))
    dp = draw(st.sampled_from([1, 2, 4]))
    ep = draw(st.sampled_from([e for e in (1, 2, 4) if dp % e == 0 and cfg["num_experts"] % e == 0]))
    shard = draw(st.sampled_from(["replicate", "fsdp", "zero", "zero3"]))
    return cfg, ParallelConfig(tp=tp, dp=dp, ep=ep, dp_shard=shard, fuse_qkv=draw(st.booleans()),
                               fuse_gate_up=draw(st.booleans()), vocab_divisible_by=1)


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(moe_case())
def test_tp_layouts_cover_random_moe_models(case):
    cfg, parallel = case
    build_layout(qwen3_moe_spec(cfg), parallel).validate()


# --- engines refuse families they cannot run ------------------------------------------------------

def test_engines_refuse_families_they_cannot_run_naming_the_model_type():
    from rlhf_switch.engines.base import rollout_engine, training_engine
    from rlhf_switch.rl.config import ModelDims, PhaseLayout

    def problems(engine, model_type, rollout=False, **layout):
        dims = ModelDims.from_hf_config(tiny_config(model_type))
        lay = PhaseLayout(**layout)
        if rollout:
            return rollout_engine(engine).layout_problems("rollout", lay, dims)
        return training_engine(engine).layout_problems("train", lay, dims, head="lm")

    for model_type in ("llama", "mistral", "qwen2", "qwen3"):
        assert problems("fsdp2", model_type, dp=2) == []
        assert problems("deepspeed", model_type, dp=2, zero_stage=3) == []
        assert problems("vllm", model_type, rollout=True, tp=2) == []
    assert problems("fsdp2", "qwen3_moe", dp=2) == []  # whole experts per rank, described per expert
    assert problems("deepspeed", "qwen3_moe", dp=2, zero_stage=3) == []  # flat ranges cut per expert
    for engine, layout in (("torch_tp", dict(tp=2)), ("torch_pp", dict(pp=2))):
        (msg,) = problems(engine, "qwen3_moe", **layout)
        assert f"engine {engine} cannot run model_type 'qwen3_moe'" in msg, msg
    assert problems("torch_tp", "qwen2", tp=2) == problems("torch_tp", "qwen3", tp=2) == []
    assert problems("torch_pp", "qwen2", pp=2) == problems("torch_pp", "qwen3", pp=2, tp=2) == []
    for model_type in ("mistral", "qwen2", "qwen3"):
        assert problems("torch", model_type, rollout=True, tp=2) == []
    (msg,) = problems("torch", "qwen3_moe", rollout=True, tp=2)
    assert "engine torch rollout cannot run model_type 'qwen3_moe'" in msg
    assert problems("vllm", "qwen3_moe", rollout=True, tp=2) == []


def test_torch_rollout_refuses_a_spec_with_tensors_its_forward_does_not_read():
    from rlhf_switch.engines.torch_rollout import TorchRollout

    with pytest.raises(NotImplementedError, match=r"not 'qwen3_moe' \(it has model\.layers\.0\.mlp\.experts\.0"):
        TorchRollout(model_spec(tiny_config("qwen3_moe")))
    TorchRollout(model_spec(tiny_config("llama", attention_bias=True, mlp_bias=True)))  # biases: it reads them


def test_config_check_names_an_unknown_model_type():
    from rlhf_switch.problems import family_problems_of
    from rlhf_switch.rl.config import ModelConfig

    (msg,) = family_problems_of(ModelConfig(hf_config=dict(tiny_config("llama"), model_type="gemma")))
    assert msg.startswith("model: model_type 'gemma' is not supported")
    assert family_problems_of(ModelConfig(hf_config=tiny_config("qwen3_moe"))) == []


def test_config_check_splits_the_experts_width_by_tp():
    """TP splits the MoE experts' ``moe_intermediate_size`` as it splits a dense MLP: a TP that
    does not divide it is refused by the config check (before any layout is built)."""
    from rlhf_switch.problems import model_split_problems
    from rlhf_switch.rl.config import ModelDims, RolloutLayout

    dims = ModelDims.from_hf_config(tiny_config("qwen3_moe", moe_intermediate_size=6, num_key_value_heads=4,
                                                num_attention_heads=4))
    layout = RolloutLayout(engine="vllm", tp=4, pp=1, dp=1)
    assert model_split_problems("rollout", layout, dims) == [
        "rollout: tp=4 does not divide moe_intermediate_size=6"]
    assert model_split_problems("rollout", RolloutLayout(engine="vllm", tp=2, pp=1, dp=1), dims) == []


def test_weights_check_reads_a_family_checkpoint(tmp_path):
    """``model.path`` with a qwen3_moe checkpoint: the per-expert tensors it holds are the spec's."""
    import json

    from rlhf_switch.problems import weights_problems
    from rlhf_switch.rl.config import ModelConfig

    save_tiny_model("qwen3_moe", str(tmp_path))
    assert weights_problems(ModelConfig(path=str(tmp_path))) == []
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(cfg, moe_intermediate_size=64)))
    problems = weights_problems(ModelConfig(path=str(tmp_path)))
    assert any("experts.0.gate_proj.weight of shape [32, 64], config.json implies [64, 64]" in p for p in problems)


def test_checkpoint_config_names_the_family(tmp_path):
    """The trainer's checkpoints (what a vLLM engine starts from) say the family's class."""
    import json

    from rlhf_switch.engines.full_state import write_hf_config

    cfg = tiny_config("qwen3_moe")
    write_hf_config(tmp_path, cfg)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["model_type"] == "qwen3_moe" and written["architectures"] == ["Qwen3MoeForCausalLM"]
    assert model_spec(written) == model_spec(cfg)
