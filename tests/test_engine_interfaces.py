"""Engines behind the two interfaces, end to end over Ray (one Ray session for the module).

- A user's own training and rollout engines, defined in THIS file and named in the config as
  ``module:Class``, run GRPO with the stale-weights check passing — no file of the package edited;
  the run's weight channel was opened once and every member process made one process group.
- The weight channel into vLLM (a pipeline-parallel PP2 trainer's stages into vLLM TP2): one
  process group per member for the whole run, 50 consecutive syncs without growth in open file
  descriptors or threads anywhere, and after them vLLM generates with exactly the trainer's weights.
- A channel member lost (a vLLM replica's actor, a trainer's actor): the sync fails naming it.
- Pipeline-parallel trainers in the loop (PP2 at world 2, TP2×PP2 at world 4, into the torch
  engine): the stale-weights check passes every iteration and the first iteration's losses and
  gradient norm equal an FSDP2 trainer's from the same warm start.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from helpers import records
from rlhf_switch.engines.torch_engines import FSDP2Engine
from rlhf_switch.engines.torch_rollout import TorchRolloutEngine

HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.slow
COUNTS = "RLHF_SWITCH_TEST_ENGINE_CALLS"


# --- a user's own engines: thin subclasses that count their calls (in the actors' processes) ---

def _count(what: str) -> None:
    with open(os.path.join(os.environ[COUNTS], f"{what}.{os.getpid()}"), "a") as f:
        f.write("1\n")


class CountingTrainer(FSDP2Engine):
    def outputs(self, ids):
        _count("outputs")
        return super().outputs(ids)

    def train_step(self, ids, micro, loss_fn):
        _count("train_step")
        return super().train_step(ids, micro, loss_fn)


class CountingRollout(TorchRolloutEngine):
    def generate(self, prompts, max_new_tokens, temperature, seeds, stop_ids):
        _count("generate")
        return super().generate(prompts, max_new_tokens, temperature, seeds, stop_ids)

    def weights_updated(self):
        _count("weights_updated")


def _calls(directory: Path, what: str) -> dict[str, int]:
    return {p.suffix[1:]: len(p.read_text().splitlines()) for p in directory.glob(f"{what}.*")}


@pytest.fixture(scope="module")
def ray_session(tmp_path_factory):
    from conftest import start_local_ray

    # the actors import this file's engines by name (tests/ is on their PYTHONPATH), and count
    # into this directory
    os.environ[COUNTS] = str(tmp_path_factory.mktemp("engine-calls"))
    ray = start_local_ray(**{COUNTS: os.environ[COUNTS]})
    yield ray
    ray.shutdown()


def _small(out: Path, world: int = 2, **blocks) -> dict:
    sys.path.insert(0, str(HERE))
    from helpers import small

    cfg = small("grpo_tiny_fsdp.yaml", out, world=world, **blocks)
    cfg["algorithm"].update(iterations=2, micro_batch_size=2)
    cfg["checkpoint"] = {"save_every": 0, "keep": 1}
    return cfg


def _sync_names_the_dead(ray, cluster, actor, name: str) -> None:
    """Kill ``actor``: the next sync fails on every surviving member, naming the lost one, well
    within the move's deadline."""
    from recipes.cluster import SyncFailed

    ray.kill(actor)
    t0 = time.perf_counter()
    with pytest.raises(SyncFailed) as e:
        cluster.sync()
    assert e.value.lost and e.value.lost[0].startswith(name), str(e.value)
    assert time.perf_counter() - t0 < 60, time.perf_counter() - t0


def test_user_engines_named_module_class(ray_session, tmp_path):
    from recipes.grpo import run

    out = tmp_path / "run"
    cfg = _small(out, train={"engine": "test_engine_interfaces:CountingTrainer", "dp": 2},
                 rollout={"engine": "test_engine_interfaces:CountingRollout", "tp": 2, "dp": 1})
    cfg["verify"] = "full"  # the run config's verify reaches the weight channel: every sync checked
    run(cfg, quiet=True)
    recs = records(out)
    its = [r for r in recs if "reward_mean" in r]
    assert [r["iteration"] for r in its] == [0, 1]
    assert all(r["stale_check_passed"] and r["stale_logprob_diff"] < 1e-4 for r in its), its
    calls = Path(os.environ[COUNTS])
    # each of the 2 trainer processes: old log-probs and one step per iteration; each rollout
    # worker: every sync told it, every generation (iterations, evaluations) went through it
    train_steps, outputs = _calls(calls, "train_step"), _calls(calls, "outputs")
    assert len(train_steps) == 2 and set(train_steps.values()) == {2}, train_steps
    assert len(outputs) == 2 and set(outputs.values()) == {2}, outputs
    syncs = 2 + 1  # every iteration, and before the final evaluation
    assert set(_calls(calls, "weights_updated").values()) == {syncs}
    assert len(_calls(calls, "generate")) == 2
    channel = next(r["channel"] for r in recs if "channel" in r)
    assert channel["opened"] == 1 and channel["groups_per_member"] == [1] and channel["moves"] == syncs, channel
    assert channel["pieces_verified"] > 0, channel


def test_weight_channel_pp_stages_into_vllm_50_syncs(ray_session, tmp_path):
    """One group per member for the whole run; 50 syncs leave no descriptor or thread behind;
    vLLM then generates with the trainer's weights (the trainer's log-probs equal vLLM's)."""
    from recipes.cluster import Cluster
    from recipes.common import warm_start
    from rlhf_switch.rl.config import load_config

    out = tmp_path / "chan"
    cfg = load_config(_small(out, train={"engine": "torch_pp", "pp": 2, "dp": 1},
                             rollout={"engine": "vllm", "tp": 2, "dp": 1}))
    init = warm_start(cfg, out / "init", quiet=True)
    cluster = Cluster(cfg, ray_session, quiet=True)
    try:
        cluster.build(init, None)
        for _ in range(5):  # first syncs plan and warm up
            cluster.sync()
        before = cluster.channel_stats()
        reports = [cluster.sync() for _ in range(45)]
        after = cluster.channel_stats()
        members = lambda s: s["trainers"] + [w for r in s["replicas"] for w in r["workers"]]  # noqa: E731
        assert len(members(after)) == 2 + 2
        for b, a in zip(members(before), members(after)):
            assert a["groups_created"] == 1 and a["plans"] == 1, a
            assert a["moves"] == b["moves"] + 45 == 50
            assert a["open_fds"] <= b["open_fds"] and a["os_threads"] <= b["os_threads"], (b, a)
        for b, a in zip(before["replicas"], after["replicas"]):
            assert a["actor"]["open_fds"] <= b["actor"]["open_fds"], (b, a)
            assert a["actor"]["os_threads"] <= b["actor"]["os_threads"], (b, a)
        assert cluster.channel_opened == 1
        assert all(r["bytes_moved"] == reports[0]["bytes_moved"] > 0 for r in reports)
        # the stale-weights check on a generated batch
        prompts = [[1, 5 + i, 7, 9] for i in range(8)]
        tokens, lps = cluster.generate(prompts, list(range(8)), 4, 1.0)
        stats = cluster.all("train_on", {"prompts": prompts, "responses": tokens, "rollout_logprobs": lps,
                                         "advantages": [0.0] * 8})
        assert max(s["stale_logprob_diff"] for s in stats) < 1e-4, stats
        # a member lost: the rollout replica's actor (and with it its vLLM workers) dies
        _sync_names_the_dead(ray_session, cluster, cluster.replicas[0], "rollout replica 0 (node ")
    finally:
        cluster.shutdown(graceful=False)


def test_sync_names_a_trainer_rank_that_died(ray_session, tmp_path):
    """The colocated channel (torch rollout in the trainer's processes): one trainer actor dies;
    the sync fails naming it (Ray reports the dead actor; the survivor's move sees the peer go)."""
    from recipes.cluster import Cluster
    from recipes.common import warm_start
    from rlhf_switch.rl.config import load_config

    out = tmp_path / "dead"
    cfg = load_config(_small(out, train={"engine": "fsdp2", "dp": 2}, rollout={"engine": "torch", "tp": 1, "dp": 2}))
    init = warm_start(cfg, out / "init", quiet=True)
    cluster = Cluster(cfg, ray_session, quiet=True)
    try:
        cluster.build(init, None)
        assert cluster.sync()["bytes_moved"] > 0
        _sync_names_the_dead(ray_session, cluster, cluster.workers[1], "trainer rank 1 (node ")
    finally:
        cluster.shutdown(graceful=False)


@pytest.mark.parametrize("world,pipeline,flat", [
    (2, {"engine": "torch_pp", "pp": 2, "dp": 1}, {"engine": "fsdp2", "dp": 2}),
    (4, {"engine": "torch_pp", "tp": 2, "pp": 2, "dp": 1}, {"engine": "fsdp2", "dp": 4}),
], ids=["PP2", "TP2xPP2"])
def test_pipeline_trainer_in_the_loop_equals_fsdp2(ray_session, tmp_path, world, pipeline, flat):
    from recipes.grpo import run

    got = {}
    for name, train in (("pipeline", pipeline), ("fsdp2", flat)):
        out = tmp_path / name
        run(_small(out, world=world, train=train, rollout={"engine": "torch", "tp": 2, "dp": world // 2},
                   reference={"engine": "fsdp2", "dp": world}), quiet=True)
        got[name] = [r for r in records(out) if "reward_mean" in r]
    for rec in got["pipeline"]:
        assert rec["stale_check_passed"] and rec["stale_logprob_diff"] < 1e-4, rec
    p, f = got["pipeline"][0], got["fsdp2"][0]
    # the same warm start and seeds: the same rollouts; the same micro-batches of rows
    assert p["example"] == f["example"] and p["reward_mean"] == f["reward_mean"]
    for key in ("policy_loss", "kl", "grad_norm"):
        assert abs(p[key] - f[key]) <= 1e-5 * max(1.0, abs(f[key])), (key, p[key], f[key])


def test_vllm_chat_template_warmup_warning_is_dropped_only_while_an_engine_starts(caplog):
    """``compat.quiet_vllm_chat_template_warmup``: vLLM's "Chat template warmup failed" (with its
    traceback, logged by ``vllm.renderers.base`` when an engine starts without a tokenizer) is not
    shown while the engine starts; the same logger's other records, and that record outside the
    scope, pass."""
    import logging

    from rlhf_switch import compat

    log = logging.getLogger("vllm.renderers.base")
    with caplog.at_level(logging.WARNING, logger="vllm.renderers.base"):
        with compat.quiet_vllm_chat_template_warmup():
            log.warning("Chat template warmup failed", exc_info=False)
            log.warning("something else")
        log.warning("Chat template warmup failed")
    assert [r.getMessage() for r in caplog.records] == ["something else", "Chat template warmup failed"]
