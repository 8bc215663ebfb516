"""More than one node: the loop on a Ray cluster of two nodes (both on this machine), started the
way an operator starts one.

The module starts its own cluster (``tests/ray_nodes.py``): ``ray start --head`` and ``ray start
--address`` as processes of their own, each node with its own temp dir, 2 CPUs and 2 logical GPUs,
token auth off, and an environment that holds nothing of the driver's — no ``PYTHONPATH``, no vLLM
or Hugging Face variables. The driver joins it by the config's ``ray_address``, so everything the
actors need travels in the job's ``runtime_env`` (``rlhf_switch.runtime_env``):

- ``rank_bundles`` (pure): rank -> bundle keeps each rollout replica's TP ranks on one node; no
  loopback address in the loop's code.
- ``pack`` keeps a run that fits on one node there; a TP2 replica that ``spread`` would cut
  across the nodes (grpo_tiny's world 2) is refused before any actor starts.
- GRPO as ``configs/grpo_tiny.yaml`` — real DeepSpeed ZeRO-3 and real vLLM TP2 — for 2
  iterations with ``spread`` on 4 logical devices: trainer ranks (DP4) and two vLLM TP2 engines
  on both nodes (as their own processes report it to Ray), each engine with its two ranks on its
  node, every store on the node address Ray reports, every sync checked by the stale-weights
  check, finite metrics; every actor imports the project's code shipped with the job
  (``py_modules``) and has vLLM's variables and a compiled-kernel cache keyed in its own process.
  Not grpo_tiny's DP2 + one TP2 engine: that engine's workers are vLLM's ``mp`` processes inside
  one replica actor, so on one node (vLLM's Ray executor, the only one that places TP workers on
  several nodes, is refused on CPU — PLATFORM.md); two engines, one per node, need 4 devices.
- ``rlhf-switch train`` joining the cluster, with a rollout engine that fails at its second
  generate (``tests/engine_faults.py``): the run ends with exit code 4 and one line naming the
  replica and the engine's own error, no traceback.

Both nodes report the same address (one machine): nodes are told apart by Ray's node id.
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest

from recipes.cluster import PlacementError, rank_bundles
from helpers import records, small

A, B = "a" * 56, "b" * 56  # two node ids


def test_rank_bundles_keeps_each_replica_on_one_node():
    assert rank_bundles([A, A, A, A], 2) == [0, 1, 2, 3]  # one node: the identity
    assert rank_bundles([A, A, B, B], 2) == [0, 1, 2, 3]  # packed in order: the identity
    assert rank_bundles([A, B, A, B], 2) == [0, 2, 1, 3]  # spread round-robin: regrouped by node
    assert rank_bundles([B, A, A, B], 2) == [0, 3, 1, 2]  # nodes in the order of their first bundle
    assert rank_bundles([A, B, A, B], 1) == [0, 2, 1, 3]
    with pytest.raises(PlacementError, match=r"ranks 0\.\.1 .*tp 2.* span nodes"):
        rank_bundles([A, B], 2)
    with pytest.raises(PlacementError, match=r"ranks 2\.\.3"):
        rank_bundles([A, A, A, B], 2)


def test_no_loopback_address_in_the_loop():
    """Every store and group of a run is on the node address Ray reports
    (``engines.channel.node_address``): no loopback or ``localhost`` literal anywhere in the
    package, the actors or the recipes — except ``launch.LocalWorld``, whose ranks are the
    driver's own child processes (the test and bench world, not the loop)."""
    import ast
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    found = [f"{path.relative_to(repo)}:{node.lineno}: {node.value!r}"
             for top in ("rlhf_switch", "actors", "recipes") for path in sorted((repo / top).rglob("*.py"))
             if path.relative_to(repo).as_posix() != "rlhf_switch/launch.py"
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Constant) and isinstance(node.value, str)
             and any(x in node.value for x in ("127.0.0.1", "localhost", "::1"))]
    assert found == []


def test_placement_is_pack_unless_the_config_says_spread(tmp_path):
    from rlhf_switch.rl.config import ConfigError, load_config

    cfg = small("grpo_tiny.yaml", tmp_path)
    assert load_config(cfg).placement == "pack"
    assert load_config({**cfg, "placement": "spread"}).placement == "spread"
    with pytest.raises(ConfigError, match="placement"):
        load_config({**cfg, "placement": "scatter"})


@pytest.fixture(scope="module")
def two_nodes():
    """Two nodes started as an operator starts them (``ray_nodes.operator_cluster``), shared by the
    module; yields (the nodes, {node id: address} as Ray reports them). Stopped at module end."""
    from ray_nodes import joined, operator_cluster

    with operator_cluster(2) as nodes:
        with joined(nodes.address) as ray:
            ids = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
        assert len(ids) == 2
        yield nodes, ids


def placed(address: str, cfg: dict) -> dict:
    """Where ``Cluster`` puts the actors of ``cfg`` (no engine is built) on the cluster at
    ``address``, joined as the run joins it; then frees them."""
    from recipes.cluster import Cluster, run_runtime_env
    from rlhf_switch.rl.config import load_config
    from ray_nodes import joined

    config = load_config({**cfg, "ray_address": address})
    with joined(address, run_runtime_env(config)) as ray:
        try:
            cluster = Cluster(config, ray, quiet=True)
            try:
                return cluster.nodes()
            finally:
                cluster.shutdown(graceful=False)
        finally:  # also after a refused placement (Cluster removed its group)
            wait_freed(ray)


def wait_freed(ray, timeout_s: float = 60.0) -> None:
    """Until Ray's resource view has every GPU free again. A removed placement group's resources
    come back after a moment: a SPREAD group made before then finds one node busy and, being best
    effort, packs onto the other (seen with ray 2.60)."""
    import time

    deadline = time.monotonic() + timeout_s
    while ray.available_resources().get("GPU", 0) < ray.cluster_resources()["GPU"]:
        assert time.monotonic() < deadline, "the placement group's resources did not come back"
        time.sleep(0.2)


def node_ids(members: list[dict]) -> list[str]:
    return [m["node_id"] for m in members]


@pytest.mark.slow
def test_pack_stays_on_one_node_and_spread_never_cuts_a_replica(two_nodes, tmp_path):
    nodes, ids = two_nodes
    where = placed(nodes.address, small("grpo_tiny.yaml", tmp_path, placement="pack",
                                        rollout={"engine": "vllm", "tp": 1, "dp": 2}))
    assert where["n_nodes"] == 1 and where["placement"] == "pack"
    for m in where["trainers"] + where["replicas"]:  # the address each actor's stores use
        assert m["address"] == ids[m["node_id"]]
    # spread would put grpo_tiny's two devices, one TP2 replica, on the two nodes: refused
    with pytest.raises(PlacementError, match="tp 2"):
        placed(nodes.address, small("grpo_tiny.yaml", tmp_path, placement="spread"))


def where_from(actor) -> tuple:
    """(the file ``rlhf_switch`` was imported from, vLLM's KV-cache variable, the inductor cache) in
    ``actor``'s own process."""
    return actor.__ray_call__.remote(lambda self: (
        __import__("rlhf_switch").__file__, __import__("os").environ.get("VLLM_CPU_KVCACHE_SPACE"),
        __import__("os").environ.get("TORCHINDUCTOR_CACHE_DIR")))


@pytest.mark.slow
def test_each_worker_keys_its_kernel_caches_in_its_own_process(two_nodes):
    """The job's setup hook keys the compiled-kernel caches in each worker, from that worker's own
    environment: an actor whose environment emulates AVX2 gets other directories than its
    neighbours on the same nodes, each named by the ISA in effect there."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from recipes.cluster import run_runtime_env
    from rlhf_switch.rl.config import load_config
    from ray_nodes import joined

    nodes, ids = two_nodes
    emulated = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    cfg = load_config(small("grpo_tiny.yaml", Path("/nonexistent"), ray_address=nodes.address))
    with joined(nodes.address, run_runtime_env(cfg)) as ray:
        caches = ray.remote(num_cpus=0)(lambda: {k: __import__("os").environ.get(k)
                                                for k in ("TORCHINDUCTOR_CACHE_DIR", "VLLM_CACHE_ROOT")})
        got = {}
        for node in ids:
            on = NodeAffinitySchedulingStrategy(node, soft=False)
            got[node] = ray.get([caches.options(scheduling_strategy=on).remote(),
                                 caches.options(scheduling_strategy=on, runtime_env={"env_vars": emulated}).remote()],
                                timeout=300)
    for plain, avx2 in got.values():
        assert plain == got[next(iter(ids))][0], got  # one machine: one key
        for k in plain:
            assert plain[k] != avx2[k] and Path(avx2[k]).parent.name.startswith("avx2-"), (plain, avx2)


@pytest.mark.slow
def test_grpo_deepspeed_vllm_tp2_spread_over_two_nodes(two_nodes, tmp_path):
    from recipes.grpo import run

    nodes, ids = two_nodes
    out = tmp_path / "run"
    zero3_dp4 = {"engine": "deepspeed", "zero_stage": 3, "tp": 1, "pp": 1, "dp": 4}
    cfg = small("grpo_tiny.yaml", out, world=4, placement="spread", train=zero3_dp4, reference=zero3_dp4,
                rollout={"engine": "vllm", "tp": 2, "pp": 1, "dp": 2}, checkpoint={"save_every": 0, "keep": 1},
                ray_address=nodes.address)
    cfg["algorithm"].update(iterations=2, micro_batch_size=2)  # 8 sequences per mini-batch over 4 ranks
    seen = {}

    def hook(it, cluster):  # as iteration 0's batch goes to the engines: answered after it (in order)
        if it == 0 and "actors" not in seen:
            seen["actors"] = cluster.ray.get([where_from(a) for a in cluster.workers + cluster.replicas], timeout=600)

    recs = [r for r in run(cfg, quiet=True, generate_hook=hook) if "reward_mean" in r]
    assert [r["iteration"] for r in recs] == [0, 1]
    for rec in recs:
        # the vLLM engines on both nodes generated with exactly the weights the trainer sent them
        assert rec["stale_check_passed"] and rec["bytes_moved"] > 0, rec
        for k in ("reward_mean", "policy_loss", "kl", "grad_norm", "stale_logprob_diff"):
            assert math.isfinite(rec[k]), (k, rec[k])
    assert recs[1]["kl"] > 0  # iteration 0's update reached the policy
    where = next(r["channel"]["nodes"] for r in records(out) if "channel" in r)
    assert where["placement"] == "spread" and where["n_nodes"] == 2
    t = node_ids(where["trainers"])
    assert set(t) == set(ids), where  # trainer ranks on both nodes
    assert t[0] == t[1] != t[2] == t[3], where  # each TP2 engine's ranks on one node
    assert node_ids(where["replicas"]) == [t[0], t[2]], where  # engine r (its workers) with ranks 2r, 2r+1
    for m in where["trainers"] + where["replicas"]:  # the address each actor's stores used
        assert m["address"] == ids[m["node_id"]]
    # every actor: the code shipped with the job (unpacked under its node's temp dir), vLLM's
    # variables from the job, the inductor cache keyed in its own process (one machine: this one's)
    from rlhf_switch.runtime_env import use_kernel_caches_of_this_machine

    cache = use_kernel_caches_of_this_machine({})["TORCHINDUCTOR_CACHE_DIR"]
    temp_dirs = [str(n.temp_dir) for n in nodes.nodes]
    for code, kv_cache, inductor in seen["actors"]:
        assert any(code.startswith(d) for d in temp_dirs) and "py_modules_files" in code, code
        assert kv_cache == "1" and inductor == cache, (kv_cache, inductor)
    print("rank -> bundle:", where["rank_bundles"], "nodes:", [n[:8] for n in t])


@pytest.mark.slow
def test_a_rollout_engine_failing_mid_run_ends_the_cli_run_with_one_line(two_nodes, tmp_path):
    """``rlhf-switch train`` (a process of its own) joins the cluster by ``ray_address``; replica 0's
    engine raises at its second generate: exit code 4 and one line on stderr naming the replica, its
    node and the engine's own error — no traceback."""
    import os
    import re
    import subprocess
    import sys

    import yaml

    from engine_faults import MESSAGE
    from helpers import REPO

    nodes, ids = two_nodes
    dp1 = {"engine": "deepspeed", "zero_stage": 3, "tp": 1, "pp": 1, "dp": 1}  # one device: the least to start
    cfg = small("grpo_tiny.yaml", tmp_path / "run", world=1, ray_address=nodes.address, train=dp1, reference=dp1,
                rollout={"engine": "engine_faults:VLLMFailingMidRun", "tp": 1, "dp": 1},
                checkpoint={"save_every": 0, "keep": 1})
    cfg["algorithm"]["iterations"] = 2
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")]), "RAY_AUTH_MODE": "disabled"}
    done = subprocess.run([sys.executable, "-m", "recipes.cli", "train", str(path), "--quiet"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 4, done.stderr[-4000:]
    node = "|".join(f"{re.escape(a)} {i[:8]}" for i, a in ids.items())
    assert re.fullmatch(rf"error: rollout replica 0 \(node ({node})\) failed while generating: RuntimeError: "
                        rf"{re.escape(MESSAGE)}", lines[-1]), lines[-1]
    # the driver's own lines (those of the actors Ray forwards start "(Name pid=N)"): no traceback
    own = [line for line in lines if not re.match(r"^(\x1b\[\d+m)?\(\S+ pid=\d+", line)]
    assert not any("Traceback" in line for line in own), "\n".join(own[-40:])
    print("the run's last lines on stderr:", *lines[-3:], sep="\n  ")
