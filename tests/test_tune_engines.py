"""``rlhf-switch tune`` models an engine from what its class says, never from its name: a user's
engine (``module:Class``) that subclasses a built-in one is costed exactly as that one, and a
bare one gets the interfaces' defaults (weights whole on every DP rank, gradients all-reduced, one
optimizer tensor per parameter, no paged KV cache). Pure functions, no process group."""
from __future__ import annotations

import math

import pytest

from rlhf_switch.engines.base import RolloutEngine, TrainingEngine
from rlhf_switch.engines.torch_engines import FSDP2Engine
from rlhf_switch.engines.vllm_rollout import VLLMRolloutEngine

from test_loop_inputs import config

HERE = __name__  # the module a config names these engines by (tests/ is on sys.path)


class MyFSDP2(FSDP2Engine):
    """A user's FSDP2: only its name differs."""


class MyVLLM(VLLMRolloutEngine):
    pass


class PlainEngine(TrainingEngine):
    """Says nothing about itself: the defaults (only its classmethods are asked here)."""


class PlainRollout(RolloutEngine):
    pass


@pytest.fixture(scope="module")
def grpo():
    from rlhf_switch.rl.config import load_config
    from rlhf_switch.tune import Workload

    cfg = load_config(config("grpo_tiny.yaml"))
    return cfg, Workload.from_config(cfg)


def test_a_subclass_of_a_builtin_engine_is_costed_as_that_engine(grpo):
    from rlhf_switch.rl.config import RolloutLayout, TrainLayout
    from rlhf_switch.tune import load_profile
    from rlhf_switch.tune.cost import decode_seconds, engine_key, engine_pass, train_layout
    from rlhf_switch.tune.memory import rollout_need, train_state_bytes

    _, w = grpo
    cpu = load_profile("cpu_local")
    mine, theirs = TrainLayout(engine=f"{HERE}:MyFSDP2", dp=2), TrainLayout(engine="fsdp2", dp=2)
    assert engine_key(mine) == engine_key(theirs) == "fsdp2"
    for train in (False, True):
        assert engine_pass(w, cpu, mine, 2, 8, train=train, steps=2) == \
            engine_pass(w, cpu, theirs, 2, 8, train=train, steps=2)
    assert train_state_bytes(w, mine) == train_state_bytes(w, theirs)
    assert train_layout(w, mine) == train_layout(w, theirs)
    mine_r, theirs_r = RolloutLayout(engine=f"{HERE}:MyVLLM", dp=2), RolloutLayout(engine="vllm", dp=2)
    assert rollout_need(w, mine_r) == rollout_need(w, theirs_r)
    assert decode_seconds(w, cpu, mine_r, 2) == decode_seconds(w, cpu, theirs_r, 2)


def test_an_engine_that_says_nothing_gets_the_plain_defaults(grpo):
    from rlhf_switch.rl.config import RolloutLayout, TrainLayout, model_dims
    from rlhf_switch.tune.cost import _dp_sharded, engine_pass
    from rlhf_switch.tune.enumerate import phase_layouts
    from rlhf_switch.tune.memory import MASTER_BYTES, ADAM_BYTES, rollout_bytes, rollout_need, train_state_bytes
    from rlhf_switch.tune.profile import Link, MachineProfile

    cfg, w = grpo
    plain = TrainLayout(engine=f"{HERE}:PlainEngine", dp=2)
    # replicated: every DP rank holds whole weights, gradients and optimizer state
    p, b = w.params(), w.bytes_per_param
    master = 0 if w.dtype == "float32" else MASTER_BYTES
    assert train_state_bytes(w, plain) == p * b + p * b + p * (master + ADAM_BYTES)
    assert not _dp_sharded(plain)
    # communication: one all-reduce of the gradients per step; the optimizer: one tensor per parameter
    link = Link(1e9, 1e-3)
    free = MachineProfile(name="t", origin="t", matmul_flops={"float32": 1e30}, memory_bandwidth=1e30,
                          device_memory=1e30, devices_per_node=8, p2p_intra=link, p2p_inter=link,
                          collective_intra=link, collective_inter=link, same_device=link, optimizer_tensor_s=1.0)
    cost = engine_pass(w, free, plain, 2, w.mini_batch, train=True, steps=1)
    weights = p * b
    assert cost.comm == pytest.approx(2 * (0.5 * weights / 1e9 + 1e-3))
    assert cost.compute == pytest.approx(len(w.spec.tensors), rel=1e-6)
    # enumerated at zero_stage 0 only
    layouts = phase_layouts("train", 2, model_dims(cfg.model), [f"{HERE}:PlainEngine"])
    assert layouts and {t.zero_stage for t in layouts} == {0}
    # a rollout engine without a paged KV cache needs its whole share's KV cache at once
    rollout = RolloutLayout(engine=f"{HERE}:PlainRollout", dp=2)
    rb = rollout_bytes(w, rollout)
    assert rollout_need(w, rollout) == rb["weights"] + rb["kv_cache"] > rb["weights"] + rb["kv_per_sequence"]
    assert math.isclose(rollout_need(w, RolloutLayout(engine=f"{HERE}:MyVLLM", dp=2)),
                        rb["weights"] + rb["kv_per_sequence"])


def test_each_engine_is_enumerated_at_the_zero_stages_it_runs(grpo):
    from rlhf_switch.rl.config import model_dims
    from rlhf_switch.tune.enumerate import phase_layouts

    cfg, _ = grpo
    dims = model_dims(cfg.model)
    stages = {e: {t.zero_stage for t in phase_layouts("train", 2, dims, [e])} for e in ("deepspeed", "fsdp2")}
    assert stages == {"deepspeed": {1, 2, 3}, "fsdp2": {0}}
    assert {r.zero_stage for r in phase_layouts("rollout", 2, dims, ["vllm", "torch"])} == {0}
