"""Device, backend and dtype as data (``rlhf_switch.device``), the checks on them before anything
starts (``rlhf_switch.problems.device_problems``) and the bundles and actor slots a config asks for
(``recipes.cluster.resources``) — pure functions, so every GPU combination is checked on CPU."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_loop_inputs import config, write
from recipes.cluster import Slot, lent_replicas, resources, resources_for
from rlhf_switch.problems import device_problems, run_problems, world_device
from rlhf_switch.device import CPU, DeviceSpec, DeviceUnavailable, resolve_device
from rlhf_switch.rl.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[1]
CUDA_REFUSAL = "device: cuda, but no GPU is visible here"


@pytest.mark.parametrize("requested, gpu, kind", [
    ("auto", False, "cpu"), ("auto", True, "cuda"),
    ("cpu", False, "cpu"), ("cpu", True, "cpu"),
    ("cuda", True, "cuda"),
])
def test_resolution_of_each_device_where_a_gpu_is_or_is_not_seen(requested, gpu, kind):
    spec = resolve_device(requested, cuda_available=gpu)
    assert spec.kind == kind
    assert spec.backend == {"cpu": "gloo", "cuda": "nccl"}[kind]
    # the device's default compute dtype; the master copy and moments are fp32 everywhere
    assert spec.compute_dtype == {"cpu": "float32", "cuda": "bfloat16"}[kind]
    assert spec.master_dtype == "float32"
    assert spec.mixed == (kind == "cuda")


def test_cuda_without_a_gpu_is_refused_and_model_dtype_overrides_the_default():
    with pytest.raises(DeviceUnavailable, match=CUDA_REFUSAL):
        resolve_device("cuda", cuda_available=False)
    with pytest.raises(ValueError, match="device: 'tpu' is not one of auto, cpu, cuda"):
        resolve_device("tpu")
    assert resolve_device("cuda", True, "float32") == DeviceSpec("cuda", "nccl", "float32", "float32")
    assert resolve_device("auto", False, "bfloat16").compute_dtype == "bfloat16"
    # the CPU spec every engine defaults to is what a CPU run resolves to
    assert resolve_device("auto", False) == CPU
    import torch

    assert CPU.torch_device() == torch.device("cpu") and CPU.torch_dtype() is torch.float32


def test_config_fields_and_their_defaults():
    cfg = load_config(config())
    assert cfg.device == "auto"
    assert load_config(config(**{"model.dtype": None})).model.dtype is None
    assert cfg.rollout.colocate is True and cfg.rollout.gpu_memory_utilization is None
    assert cfg.rollout.memory_utilization == 0.5  # colocated with training
    alone = load_config(config(**{"rollout": {"engine": "vllm", "tp": 2, "colocate": False}}))
    assert alone.rollout.memory_utilization == 0.9
    assert load_config(config(**{"rollout.gpu_memory_utilization": 0.3})).rollout.memory_utilization == 0.3
    for bad in (0, 1.5):
        with pytest.raises(ConfigError, match="rollout.gpu_memory_utilization"):
            load_config(config(**{"rollout.gpu_memory_utilization": bad}))
    with pytest.raises(ConfigError, match="device: Input should be 'auto', 'cpu' or 'cuda'"):
        load_config(config(device="gpu"))


def test_device_problems_before_anything_starts():
    fsdp = load_config(config(**{"model.dtype": None}))           # fsdp2 + torch rollout (fp32 only)
    ds_vllm = load_config(config("grpo_tiny.yaml", **{"model.dtype": None}))  # deepspeed + vllm
    # no GPU: cuda is refused, auto is cpu (float32), bf16 on cpu is refused
    assert device_problems(load_config(config(device="cuda")), cuda_available=False) == [
        resolve_refusal()]
    assert device_problems(fsdp, cuda_available=False) == []
    assert device_problems(load_config(config(**{"model.dtype": "bfloat16"})), False) == [
        "model.dtype: bfloat16 — the CPU loop trains in float32"]
    # a GPU: bf16 compute (the default) only where the engine runs it beside an fp32 master
    assert device_problems(ds_vllm, cuda_available=True) == []
    assert device_problems(fsdp, cuda_available=True) == [
        "rollout: engine torch computes in float32, not bfloat16 (model.dtype unset: device cuda's default); "
        "set model.dtype: float32 or use an engine that does"]
    tp = load_config(config(**{"model.dtype": "bfloat16", "train": {"engine": "torch_tp", "tp": 2},
                               "rollout": {"engine": "vllm", "tp": 2}}))
    assert device_problems(tp, cuda_available=True) == [
        "train: engine torch_tp computes in float32, not bfloat16 (model.dtype); set model.dtype: float32 or use "
        "an engine that does"]
    assert device_problems(load_config(config(**{"model.dtype": "float32"})), True) == []
    assert "float16" in device_problems(load_config(config("grpo_tiny.yaml", **{"model.dtype": "float16"})), True)[0]
    # a joined cluster: auto waits for the actors; cuda is taken at its word
    assert device_problems(load_config(config(device="cuda", ray_address="10.0.0.1:6379")), None) == []
    assert device_problems(load_config(config(device="auto", **{"model.dtype": "bfloat16"})), None) == []
    # ... and the world's resolution from an actor's view says the same
    with pytest.raises(ConfigError, match=CUDA_REFUSAL):
        world_device(load_config(config(device="cuda")), cuda_available=False)
    assert world_device(ds_vllm, cuda_available=True) == DeviceSpec("cuda", "nccl", "bfloat16", "float32")
    with pytest.raises(ConfigError, match="rollout: engine torch computes in float32"):
        world_device(fsdp, cuda_available=True)


def resolve_refusal() -> str:
    try:
        resolve_device("cuda", False)
    except DeviceUnavailable as e:
        return str(e)


def test_a_rollout_engine_inside_the_trainer_cannot_leave_its_devices():
    problems = run_problems(load_config(config(**{"rollout.colocate": False})))
    assert any(p.startswith("rollout.colocate: false needs a rollout engine of its own actors") for p in problems)


def test_bundles_and_actor_slots_per_config():
    # the torch rollout lives in the hybrid workers: one device per rank, half of it each... (as before)
    r = resources(2, 1, replica_placement=False)
    assert r.bundles == ({"CPU": 1, "GPU": 1},) * 2 and r.replicas == () and r.devices == 2
    assert r.workers == (Slot(0, 0.5, 0.5), Slot(1, 0.5, 0.5))
    # vLLM TP1 colocated: a replica beside each worker, half a device each (today's shape)
    r = resources(2, 1, replica_placement=True)
    assert r.replicas == (Slot(0, 0.4, 0.5), Slot(1, 0.4, 0.5)) and r.replica_devices == ((0,), (1,))
    # vLLM TP2 colocated on 4 devices: replica r starts on bundle 2r and its workers get the 2
    # whole devices of bundles 2r, 2r+1 (handed over: an actor holds a share of one bundle only)
    r = resources(4, 2, replica_placement=True)
    assert r.devices == 4 and r.replicas == (Slot(0, 0.4, 0.5), Slot(2, 0.4, 0.5))
    assert r.replica_devices == ((0, 1), (2, 3))
    # not colocated: the trainer's devices, then one bundle of TP whole devices per replica
    r = resources(4, 2, replica_placement=True, colocate=False)
    assert r.bundles == ({"CPU": 1, "GPU": 1},) * 4 + ({"CPU": 1, "GPU": 2},) * 2
    assert r.workers == tuple(Slot(i, 0.5, 1.0) for i in range(4))
    assert r.replicas == (Slot(4, 1, 2), Slot(5, 1, 2)) and r.replica_devices == () and r.devices == 8
    # elastic.lend: as many replicas again on the trainer's devices, beside the rank of each one's
    # first device, handed those devices; the bundles are the same
    r = resources(4, 2, replica_placement=True, colocate=False, lend=True)
    assert r.bundles == resources(4, 2, True, False).bundles
    assert r.replicas == (Slot(4, 1, 2), Slot(5, 1, 2), Slot(0, 0.4, 0.0), Slot(2, 0.4, 0.0))
    assert r.replica_devices == ((), (), (0, 1), (2, 3)) and lent_replicas(r, 4, colocate=False) == [2, 3]
    assert lent_replicas(resources(4, 2, True), 4, colocate=True) == []
    # every bundle holds what its actors take
    for res in (resources(4, 2, True), resources(4, 2, True, False), resources(2, 1, False),
                resources(4, 2, True, False, lend=True)):
        for b, bundle in enumerate(res.bundles):
            on = [s for s in res.workers + res.replicas if s.bundle == b]
            assert sum(s.num_gpus for s in on) <= bundle["GPU"] and sum(s.num_cpus for s in on) <= bundle["CPU"]
    # from a config
    assert resources_for(load_config(config("grpo_tiny.yaml"))) == resources(2, 2, True)


def test_device_cuda_without_a_gpu_exits_2_before_ray_with_one_message(tmp_path):
    """Through the CLI, in a fresh process that sees no GPU (CUDA_VISIBLE_DEVICES empty): exit 2,
    the refusal once, and nothing started (no Ray: it would print its own start-up lines)."""
    path = write(tmp_path, config(device="cuda", output_dir=str(tmp_path / "run")))
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-m", "recipes.cli", "train", path], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr
    assert out.stderr.count(CUDA_REFUSAL) == 1, out.stderr
    assert out.stderr.startswith("error: the config cannot run on world_size=2: 1 problem"), out.stderr
    assert "ray" not in out.stderr.lower() and not (tmp_path / "run").exists()


@pytest.mark.heavy  # left out of `make test-fast`
def test_fsdp2_bf16_compute_over_an_fp32_master(world2):
    """The one torch engine that runs ``compute_dtype`` bf16 (FSDP2's mixed precision), on CPU with
    a spec that asks for it: the layers compute in bf16, the sharded parameters the optimizer
    steps — and the adapter hands to the weight channel — stay fp32, and a step moves them."""
    import train_jobs_torch as jobs
    from test_loop_inputs import config as shipped

    cfg = dict(shipped()["model"]["hf_config"])
    for r in world2.run(jobs.fsdp2_mixed_precision, cfg):
        assert r["compute"] == {"input": "torch.bfloat16", "weight": "torch.bfloat16"}, r
        assert r["params"] == ["torch.float32"] and r["weights"] == ["float32"], r
        assert r["moved"] and r["loss"] == r["loss"], r


BARE_MACHINE = """import sys
for _name in ("ray", "vllm", "deepspeed"):  # not on the lent GPU machine: importing them fails
    sys.modules[_name] = None
"""


def _gpu_checks(tmp_path, *args: str) -> dict:
    """``tests/gpu_checks.py --device cpu ARGS`` in a fresh process where Ray, vLLM and DeepSpeed
    cannot be imported (a ``sitecustomize`` that the rollout process it spawns inherits), as on a
    bare GPU machine; its figures (``--json``), after checking that the table came last."""
    (tmp_path / "bare").mkdir(exist_ok=True)
    (tmp_path / "bare" / "sitecustomize.py").write_text(BARE_MACHINE)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "bare"), str(REPO)]))
    figures = tmp_path / f"gpu_checks{len(list(tmp_path.glob('*.json')))}.json"
    out = subprocess.run([sys.executable, str(REPO / "tests" / "gpu_checks.py"), "--device", "cpu", *args,
                          "--json", str(figures)], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    r = json.loads(figures.read_text())
    lines = out.stdout.rstrip().splitlines()
    assert lines[-len(r["rows"]) - 2:][:2] == ["| check | dtype | measured | ok |", "|---|---|---|---|"], out.stdout
    assert all(line.endswith("| yes |") for line in lines[-len(r["rows"]):]), out.stdout
    return r


def test_the_gpu_check_script_runs_its_checks_on_cpu(tmp_path):
    """``tests/gpu_checks.py`` (what a bare GPU machine runs) runs the same code on CPU: a trainer
    process (FSDP2, world of one) and a rollout process joined by a weight channel with the
    colocated handoff (shared memory here, CUDA IPC there), in bf16 compute over the fp32 master
    and in fp32: every sync bit-exact in the rollout engine (cold and warm, handles per bucket,
    nothing over the group), its log-probs within the dtype's tolerance of the trainer's forward,
    the optimizer state offloaded and reloaded bit for bit with the memory really released; the
    8B-shape handoff (1/8 as wide on CPU) bit-exact at every move. Then LoRA: the base once, then
    the adapters alone. Checks, not timings."""
    r = _gpu_checks(tmp_path, "--steps", "1")
    assert r["ok"] and r["handoff"] == "ipc" and r["colocated"] == [[1, 0]] and r["backend"] == "gloo"
    assert list(r["dtypes"]) == ["bfloat16", "float32"]
    for dtype, p in r["dtypes"].items():
        size = 4 if dtype == "float32" else 2
        assert p["compute_dtype"] == dtype and p["master_dtype"] == "float32" and p["sync"] == "full", p
        assert p["sync_differs"] == [] and p["warm_differs"] == [], p
        assert p["sync_bytes"] == p["warm_bytes"] == p["params"] * size, p
        # the worker's bytes come by handle, one per bucket, none over the group
        assert p["handoff"] == "ipc" and p["handles"] == p["buckets"] >= 1 and p["bytes_over_group_to_worker"] == 0
        assert 0 <= p["logprob_max_diff"] <= {"float32": 1e-4, "bfloat16": 5e-2}[dtype], p
        o, m = p["offload"], p["offload"]["memory"]
        # FSDP2's parameters are its fp32 master: the optimizer state that leaves is Adam's two moments
        assert o["changed"] == [] and o["released_now"] and o["moved"] == o["reloaded"] == o["moments_bytes"] \
            == 2 * 4 * p["params"], o
        assert o["released"] == o["taken"] and m["before"] - m["parked"] == o["released"] and m["reloaded"] == m["before"]
        assert len(p["losses"]) == 2 and p["losses"][1] < p["losses"][0], p["losses"]  # a step, then one after the reload
    b = r["big"]
    assert all(b["exact"]) and len(b["exact"]) == 4 and b["moved_bytes"] == b["bytes"] == 2 * b["params"], b
    assert b["shape"]["num_attention_heads"] == 32 and b["shape"]["num_key_value_heads"] == 8 and b["ratio"] > 0

    r = _gpu_checks(tmp_path, "--dtypes", "float32", "--steps", "1", "--lora", "8", "--big-layers", "0")
    p = r["dtypes"]["float32"]  # LoRA: the engine takes the base once, then each sync moves the adapters alone
    assert r["ok"] and "big" not in r and p["sync"] == "adapters" and p["sync_differs"] == p["warm_differs"] == []
    assert 0 < p["sync_bytes"] == p["warm_bytes"] < p["params"] * 4 // 20 < p["warm_start_bytes"], p
    assert p["offload"]["changed"] == [] and p["logprob_max_diff"] <= 1e-4, p
