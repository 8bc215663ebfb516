"""DeepSpeed ZeRO-1/2/3 as VPS layouts: the adapter's fragments are the engine's real tensors.

Real DeepSpeed engines (CPU accelerator, gloo, torch AdamW) on a 4-rank world. Every fragment the
adapter claims is read back from the engine's own buffers and compared bit for bit with
DeepSpeed's own gathers (``safe_get_full_fp32_param``, ``safe_get_full_optimizer_state``,
``GatheredParameters``); the pure ``mesh.zero`` layout must describe the same partitions.
"""
from __future__ import annotations

import importlib.util

import pytest

# a project dependency: missing it fails collection instead of skipping (nothing imported here)
assert importlib.util.find_spec("deepspeed"), "deepspeed is not installed; `make test` installs it"

import train_jobs_ds as jobs  # noqa: E402


@pytest.mark.parametrize("stage", [pytest.param(1, marks=pytest.mark.heavy), 2, 3])
def test_adapter_fragments_are_the_engine_tensors(world4, stage):
    results = world4.run(jobs.layout_truth, stage, timeout=300)
    assert all(r["bad"] == [] for r in results), [r["bad"][:3] for r in results]
    assert all(r["n_state"] > 0 and r["n_weights"] > 0 for r in results)


def test_zero3_persistent_parameters_are_their_partitions(world4):
    """ZeRO-3 with every parameter kept whole between steps (``persistence_threshold``): after
    steps the whole copies the forward reads equal the partitions the adapter describes."""
    results = world4.run(jobs.layout_truth, 3, None, 2, 10**6, timeout=300)
    assert all(r["bad"] == [] for r in results), [r["bad"][:3] for r in results]
    assert all(r["n_persistent"] > 0 and r["n_weights"] > 0 for r in results)


def test_zero3_on_a_subset_of_the_world(world4):
    """A ZeRO-3 engine on ranks 2 and 3 only (ranks 0 and 1 build nothing): DeepSpeed's world
    barriers and trace checks are kept inside the engine's group."""
    results = world4.run(jobs.layout_truth, 3, [2, 3], timeout=300)
    assert [r["bad"] for r in results] == [[], [], [], []]
    assert results[0].get("n_state") is None and results[2]["n_state"] > 0


@pytest.mark.parametrize("stage", [2, 3])
def test_an_engine_with_its_buffers_in_shared_memory_trains_alike(world4, stage):
    """``same_host.share`` on a live engine's weights and state (what a weight channel does with
    its senders' buffers, for mapped reads) moves storages under DeepSpeed: its steps must not
    notice — the same losses, weights and moments bit for bit, the buffers still shared."""
    for r in world4.run(jobs.trains_alike_when_shared, stage, timeout=300):
        assert r["losses"][0] == r["losses"][1] and r["differ"] == [] and r["shared"], r


@pytest.mark.parametrize("stage", [1, 3])
def test_pure_zero_layout_is_deepspeeds_partitioning(world4, stage):
    problems = world4.run(jobs.pure_layout_matches, stage, 4, timeout=300)
    assert problems == [[], [], [], []], problems


def test_refuses_a_stage_it_cannot_describe(world4):
    messages = world4.run(jobs.refuses_stage, 0)
    assert all("stage must be 1, 2 or 3" in m for m in messages), messages


@pytest.mark.parametrize("model_type,stage", [("qwen2", 3), ("qwen3", 3), ("qwen3_moe", 3),
                                              pytest.param("qwen3_moe", 2, marks=pytest.mark.heavy)])
def test_zero_of_other_families(world4, model_type, stage):
    """ZeRO over a tiny qwen2 (q/k/v biases), qwen3 (q/k norms) and qwen3_moe (stacked experts,
    described per expert): the adapter describes the family spec, every fragment is DeepSpeed's
    own tensor (gathered by DeepSpeed), the layout covers the model, and for the dense families
    the partitioning is the pure layout's."""
    results = world4.run(jobs.family_layout_truth, model_type, stage, timeout=300)
    extra = {"qwen2": "self_attn.q_proj.bias", "qwen3": "self_attn.q_norm.weight",
             "qwen3_moe": "mlp.experts.3.down_proj.weight"}[model_type]
    for rank, res in enumerate(results):
        assert res["bad"] == [] and res["n"] > 0, (rank, res["bad"][:5])
        assert res["losses"] == results[0]["losses"]
    held = set().union(*(r["tensors"] for r in results))
    assert f"model.layers.1.{extra}" in held
