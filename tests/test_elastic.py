"""Elastic resize of a running trainer world over Ray: real Ray actors
(``HybridWorker``), real DeepSpeed ZeRO-3 engines, the module's Ray session (4 logical devices).

ZeRO-3 DP4 -> DP2 -> DP4. Each resize builds the new world's actors and engines (empty, in their
layout) in the background while the old world keeps training — the old world's steps completed
meanwhile are counted and > 0 — then one stop-the-world VPS move over the union of old and new
ranks carries the fp32 master, Adam moments, step, LR schedule and RNG, and the old actors go
(on the shrink, ranks 2 and 3 hold the only copy of their ZeRO-3 shards: they send, then leave).

- The state right after each resize equals the state right before it, bit for bit (both gathered
  whole on rank 0 through the VPS).
- The next training step of the resized world equals, bit for bit (losses, gradient norm and the
  whole state after it), the step of a world built directly in the new layout from a checkpoint
  of the same state (the ordinary resume path).
- A new actor that dies during the background build: one clear ``ResizeError``, the construction
  abandoned, the old world trains on.
- Background vs stop-the-world seconds are printed (``-s``), never asserted.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from helpers import same_full_state

assert importlib.util.find_spec("deepspeed"), "deepspeed is not installed; `make test` installs it"

HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.slow


def _config(out: Path, world: int) -> dict:
    sys.path.insert(0, str(HERE))
    from helpers import small

    cfg = small("grpo_tiny.yaml", out, world=world, train={"engine": "deepspeed", "zero_stage": 3, "dp": world},
                rollout={"engine": "torch", "tp": 1, "dp": world}, checkpoint={"save_every": 0})
    cfg.pop("reference")  # the resize moves the trainer only (docs/elastic.md): no KL, no reference
    cfg["algorithm"]["kl_coef"] = 0.0
    return cfg


def _batch(step: int, size: int = 8) -> dict:
    """A GRPO batch of random tokens and advantages, a function of ``step`` only."""
    g = torch.Generator().manual_seed(1000 + step)
    prompts = [torch.randint(3, 47, (3,), generator=g).tolist() for _ in range(size)]
    responses = [torch.randint(3, 47, (4,), generator=g).tolist() for _ in range(size)]
    return {"prompts": prompts, "responses": responses, "rollout_logprobs": [[0.0] * 4 for _ in range(size)],
            "advantages": torch.randn(size, generator=g).tolist()}


def _train(ray, workers, step: int) -> dict:
    return ray.get([w.train_on.remote(_batch(step)) for w in workers], timeout=600)[0]


def _gathered(ray, workers) -> dict:
    return ray.get([w.gathered_state.remote() for w in workers], timeout=600)[0]


def _differences(a: dict, b: dict) -> list[str]:
    bad = [f"master/{n}" for n in a["master"] if not torch.equal(a["master"][n], b["master"][n])]
    bad += [f"{f}/{n}" for f in a["moments"] for n in a["moments"][f]
            if not torch.equal(a["moments"][f][n], b["moments"][f][n])]
    sa, sb = a["scalars"], b["scalars"]
    bad += [k for k in ("step", "global_steps", "global_samples", "lr_scheduler") if sa[k] != sb[k]]
    if not torch.equal(sa["rng"], sb["rng"]):
        bad.append("rng")
    return bad


def _resize(ray, actor_cls, config: dict, devices, plan, old, step: int, ckpt: Path):
    """Build the new world in the background while ``old`` trains, then commit. Returns the
    result, the old world's steps during the build, the next step index and the state before."""
    from rlhf_switch.elastic.manager import start_world

    pending = start_world(ray, actor_cls, config, devices, plan)
    during = 0
    while not pending.ready():
        _train(ray, old, step)
        step, during = step + 1, during + 1
    before = _gathered(ray, old)
    # the new world's own (seeded, fresh) state is not the old one: only the move can make them equal
    assert _differences(before, _gathered(ray, pending.workers)) != []
    ray.get([w.save_checkpoint.remote(str(ckpt), {}) for w in old], timeout=600)  # for the direct world
    result = pending.commit(old)
    return result, during, step, before


def _death_during_the_build_abandons_it(ray, actor_cls, config, devices, old, step: int) -> int:
    """A new actor killed while its world is being built: one clear ``ResizeError``, the
    construction is abandoned (its actors gone) and the old world trains on."""
    from rlhf_switch.elastic import ResizeError, ResizePlan
    from rlhf_switch.elastic.manager import start_world

    pending = start_world(ray, actor_cls, config, devices, ResizePlan((0, 1, 2, 3), (0, 1)))
    victim = pending.workers[1]
    ray.kill(victim)
    with pytest.raises(ResizeError, match="abandoned, the old world trains on"):
        while not pending.ready():
            _train(ray, old, step)
            step += 1
    assert pending.workers == []
    _train(ray, old, step)
    assert _gathered(ray, old)["scalars"]["step"] == step + 1
    return step + 1


def _next_step_equals_a_direct_world(ray, cluster_cls, config, devices, plan, resized, step, init, ckpt):
    from rlhf_switch.rl.config import load_config

    direct = cluster_cls(load_config(config), ray, quiet=True, devices=devices.slots(plan.new_devices))
    try:
        direct.build(init, ckpt)
        assert _differences(_gathered(ray, resized), _gathered(ray, direct.workers)) == []
        mine, theirs = _train(ray, resized, step), _train(ray, direct.workers, step)
        for k in ("policy_loss", "grad_norm", "clipfrac", "steps"):
            assert mine[k] == theirs[k], (k, mine[k], theirs[k])
        assert _differences(_gathered(ray, resized), _gathered(ray, direct.workers)) == []
    finally:
        direct.shutdown()


def test_zero3_dp4_to_dp2_and_back_over_ray(ray_session, tmp_path):
    from actors.hybrid import remote_class
    from recipes.cluster import Cluster
    from recipes.common import warm_start
    from rlhf_switch.elastic import ResizePlan
    from rlhf_switch.elastic.manager import Devices
    from rlhf_switch.rl.config import load_config

    ray = ray_session
    cfg4, cfg2 = _config(tmp_path / "run4", 4), _config(tmp_path / "run2", 2)
    init = warm_start(load_config(cfg4), tmp_path / "init", quiet=True)
    devices = Devices(ray)
    devices.acquire(range(4))
    actor_cls = remote_class(num_cpus=0.5, num_gpus=0.5)
    cluster = Cluster(load_config(cfg4), ray, quiet=True, devices=devices.slots(range(4)))
    alive = []
    try:
        cluster.build(init, None)
        alive = cluster.workers
        _train(ray, alive, 0)  # Adam moments and the step are non-zero before the first resize
        step = 1
        step = _death_during_the_build_abandons_it(ray, actor_cls, cfg2, devices, alive, step)
        figures = []
        for name, new_cfg, plan in (("DP4 -> DP2", cfg2, ResizePlan((0, 1, 2, 3), (0, 1))),
                                    ("DP2 -> DP4", cfg4, ResizePlan((0, 1), (0, 1, 2, 3)))):
            ckpt = tmp_path / f"ckpt-{len(figures)}"
            result, during, step, before = _resize(ray, actor_cls, new_cfg, devices, plan, alive, step, ckpt)
            alive = result.workers
            assert during > 0, "the old world completed no step while the new one was built"
            assert before["scalars"]["step"] == step
            assert any(t.abs().sum() > 0 for t in before["moments"]["exp_avg"].values())
            assert _differences(before, _gathered(ray, alive)) == []
            old = [m for m in result.members if m["side"] == "old"]
            if plan.released:  # the leaving ranks held the only copy of their shards: they sent it
                assert all(m["bytes_sent"] > 0 for m in old[plan.new_world:])
            _next_step_equals_a_direct_world(ray, Cluster, new_cfg, devices, plan, alive, step, init, ckpt)
            step += 1
            figures.append(f"{name}: {during} old-world steps during the background build; background "
                           f"{result.background_s:.1f} s, stop-the-world {result.stop_the_world_s:.2f} s "
                           f"(slowest member move {max(m['move_s'] for m in result.members):.2f} s), "
                           f"release {result.release_s:.2f} s, {result.bytes_moved} B moved")
        print("\n" + "\n".join(figures))
    finally:
        for w in alive:
            ray.kill(w)
        devices.release_all()


def test_resize_plan_ranks_and_devices():
    from rlhf_switch.elastic import ResizeError, ResizePlan

    shrink = ResizePlan((0, 1, 2, 3), (0, 1))
    assert (shrink.union_size, shrink.added, shrink.released) == (6, (), (2, 3))
    assert [shrink.union_rank("old", r) for r in range(4)] == [0, 1, 2, 3]
    assert [shrink.union_rank("new", r) for r in range(2)] == [4, 5]
    grow = ResizePlan((0, 1), (0, 1, 2, 3))
    assert (grow.added, grow.released) == ((2, 3), ())
    assert grow.endpoint("10.0.0.1", 1234, "new", 3).rank == 5
    with pytest.raises(ResizeError, match="twice"):
        ResizePlan((0, 1), (1, 1))
    with pytest.raises(ResizeError, match="no device"):
        ResizePlan((0, 1), ())
    with pytest.raises(ResizeError, match="new rank 2"):
        shrink.union_rank("new", 2)


def test_grpo_with_an_elastic_schedule_continues_as_the_new_layout_from_that_iteration(ray_session, tmp_path):
    """``elastic.schedule`` in the loop: GRPO on ZeRO-3 DP4 (torch rollout DP4), resized to DP2
    before iteration 2 — the DP2 world built during iteration 1. The run equals one resumed from
    the same run's iteration-2 checkpoint directly in DP2: the same rewards and losses, and the
    final weights and Adam moments bit for bit."""
    import shutil

    from recipes.grpo import run
    from rlhf_switch.engines.full_state import FullState
    from rlhf_switch.models import model_spec

    def config(out: Path, world: int) -> dict:
        cfg = _config(out, world)
        cfg["algorithm"].update(iterations=4, prompts_per_iteration=4, micro_batch_size=2)  # fits DP4 and DP2
        cfg["checkpoint"] = {"save_every": 2, "keep": 2}
        return cfg

    cfg = config(tmp_path / "elastic", 4)
    dp2 = config(tmp_path / "unused", 2)
    cfg["elastic"] = {"schedule": [{"iteration": 2, "world_size": 2, "train": dp2["train"], "rollout": dp2["rollout"]}]}
    recs = run(cfg, quiet=True)
    (resize,) = [r["resize"] for r in recs if "resize" in r]
    assert "abandoned" not in resize, resize
    assert resize["iterations_during_build"] == 1 and resize["bytes_moved"] > 0
    steps = [r for r in recs if "reward_mean" in r]
    assert [r["iteration"] for r in steps] == [0, 1, 2, 3] and all(r["stale_check_passed"] for r in steps)

    direct = tmp_path / "direct"  # the same run, resumed at iteration 2 in DP2 from its checkpoint
    shutil.copytree(tmp_path / "elastic", direct)
    shutil.rmtree(direct / "final")
    dp2["output_dir"] = str(direct)
    theirs = [r for r in run(dp2, quiet=True, resume=True) if "reward_mean" in r]
    assert [r["iteration"] for r in theirs] == [2, 3]
    for a, b in zip(steps[2:], theirs):
        assert (a["reward_mean"], a["policy_loss"], a["grad_norm"]) == (b["reward_mean"], b["policy_loss"], b["grad_norm"])
    spec = model_spec(cfg["model"]["hf_config"])
    mine, ref = (FullState.load_dir(p / "final", spec) for p in (tmp_path / "elastic", direct))
    assert same_full_state(ref, mine)
    print(f"\nloop resize DP4 -> DP2: background {resize['background_s']:.1f} s "
          f"(waited {resize['waited_for_build_s']:.1f} s at the boundary), stop-the-world "
          f"{resize['stop_the_world_s']:.2f} s")


def test_a_bad_elastic_schedule_is_one_config_error(tmp_path):
    from rlhf_switch.problems import check_run
    from rlhf_switch.rl.config import ConfigError, load_config

    cfg = _config(tmp_path, 4)
    dp2 = _config(tmp_path, 2)
    entry = {"iteration": 2, "world_size": 2, "train": dp2["train"], "rollout": dp2["rollout"]}
    ok = load_config({**cfg, "elastic": {"schedule": [entry]}})
    assert ok.at_iteration(1).world_size == 4 and ok.at_iteration(2).world_size == 2
    assert ok.at_iteration(2).train.dp == 2 and ok.at_iteration(2).elastic is None
    with pytest.raises(ConfigError) as e:
        check_run(load_config({**cfg, "elastic": {"schedule": [entry, {**entry, "iteration": 1},
                                                               {**entry, "iteration": 3, "rollout": {"engine": "vllm", "tp": 1, "dp": 2}}]}}))
    text = str(e.value) + " ".join(e.value.problems)
    assert "increasing iteration order" in text and "a resize does not change the engine" in text
    with pytest.raises(ConfigError) as e:  # a layout that does not fit the entry's own world
        check_run(load_config({**cfg, "elastic": {"schedule": [{**entry, "world_size": 3}]}}))
    assert any(p.startswith("elastic.schedule[0]:") for p in e.value.problems), e.value.problems


def test_a_resize_requested_by_api_call_takes_the_schedule_path(ray_session, tmp_path):
    """``rlhf_switch.elastic.requests``: a running GRPO loop (ZeRO-3 DP4, torch rollout, an empty
    ``elastic`` block) is asked from another thread for a world it cannot run — refused with the
    config's own message, the run trains on — then for DP2: taken at the next iteration boundary,
    built during that iteration and committed before the next, as an ``elastic.schedule`` entry."""
    import threading

    from PIL import Image

    from recipes.grpo import run
    from rlhf_switch.elastic import ResizeError
    from rlhf_switch.elastic.requests import request_resize, wait_answer

    out = tmp_path / "api"
    cfg = _config(out, 4)
    cfg["algorithm"].update(iterations=3, prompts_per_iteration=4, micro_batch_size=2)  # fits DP4 and DP2
    cfg["elastic"] = {}
    dp2 = _config(tmp_path / "unused", 2)
    with pytest.raises(ResizeError, match="no such directory"):
        request_resize(out, world_size=2, train=dp2["train"], rollout=dp2["rollout"])
    out.mkdir(parents=True)
    bad = request_resize(out, world_size=3, train=dp2["train"], rollout=dp2["rollout"])  # DP2 on 3 devices
    with pytest.raises(ResizeError, match="still waiting"):
        request_resize(out, world_size=2, train=dp2["train"], rollout=dp2["rollout"])
    answers: list[dict] = []

    def client():  # another caller of the running loop
        answers.append(wait_answer(out, bad))
        good = request_resize(out, world_size=2, train=dp2["train"], rollout=dp2["rollout"])
        answers.append(wait_answer(out, good))
        answers.append(wait_answer(out, good, statuses=("done", "abandoned")))

    t = threading.Thread(target=client, daemon=True)
    t.start()
    recs = run(cfg, quiet=True)
    t.join(timeout=60)
    refused, accepted, done = answers
    assert refused["status"] == "refused" and refused["iteration"] == 0
    assert any("elastic.schedule[0]" in p and "3" in p for p in refused["problems"]), refused
    assert (accepted["status"], accepted["iteration"], done["status"], done["iteration"]) == ("accepted", 2, "done", 2)
    (note,) = [r for r in recs if "event" in r]
    assert note["iteration"] == 0 and note["event"]["kind"] == "request_refused"
    (resize,) = [r["resize"] for r in recs if "resize" in r]
    assert resize["kind"] == "requested" and "abandoned" not in resize, resize
    assert resize["iterations_during_build"] == 1 and resize["bytes_moved"] > 0
    assert "world 2" in resize["new"] and done["event"]["new"] == resize["new"]
    steps = [r for r in recs if "reward_mean" in r]
    assert [r["iteration"] for r in steps] == [0, 1, 2] and all(r["stale_check_passed"] for r in steps)
    described = Image.open(out / "grpo.png").text["Description"]
    assert "iteration 0: resize request refused" in described and "iteration 2: requested resize" in described
    # the accepted request is an entry of the run's config.yaml (a --resume of it resizes too)
    from rlhf_switch.rl.config import load_config

    (entry,) = load_config(out / "config.yaml").elastic.schedule
    assert (entry.iteration, entry.world_size, entry.train.dp) == (2, 2, 2)


def test_an_elastic_schedule_with_vllm_changes_the_rollout_layout(tmp_path):
    """With vLLM replicas an entry may change their layout (TP × replicas), on the same trainer
    world or with it (tests/test_elastic_combined.py runs one); one that changes the engine is
    refused before Ray; the device count is checked as for every entry (a replica of TP t takes t
    devices of the world)."""
    from rlhf_switch.problems import check_run
    from rlhf_switch.rl.config import ConfigError, load_config

    cfg = {**_config(tmp_path, 2), "rollout": {"engine": "vllm", "tp": 1, "dp": 2}}
    tp2 = {"iteration": 2, "world_size": 2, "train": cfg["train"], "rollout": {"engine": "vllm", "tp": 2, "dp": 1}}
    ok = load_config({**cfg, "elastic": {"schedule": [tp2, {**tp2, "iteration": 3, "rollout": cfg["rollout"]}]}})
    check_run(ok)
    assert [(ok.at_iteration(i).rollout.tp, ok.at_iteration(i).rollout.dp) for i in (1, 2, 3)] == [(1, 2), (2, 1), (1, 2)]
    dp4 = _config(tmp_path, 4)  # the trainer world beside the replicas: accepted (one combined resize)
    load_config({**cfg, "elastic": {"schedule": [{**tp2, "world_size": 4, "train": dp4["train"],
                                                  "rollout": {"engine": "vllm", "tp": 2, "dp": 2}}]}})
    for entry, want in (
            ({**tp2, "rollout": {"engine": "torch", "tp": 1, "dp": 2}},
             "elastic.schedule[0].rollout.engine: torch — the run's rollout engine is vllm"),):
        with pytest.raises(ConfigError) as e:
            check_run(load_config({**cfg, "elastic": {"schedule": [entry]}}))
        assert any(p.startswith(want) for p in e.value.problems), (want, e.value.problems)
    with pytest.raises(ConfigError) as e:  # 4 devices of TP1 replicas on a world of 2
        check_run(load_config({**cfg, "elastic": {"schedule": [{**tp2, "rollout": {"engine": "vllm", "tp": 1,
                                                                                       "dp": 4}}]}}))
    assert any(p.startswith("elastic.schedule[0]: rollout: tp·pp·dp = 1·1·4 = 4, but world_size = 2")
               for p in e.value.problems), e.value.problems
    # a resize request is the same entry: the vLLM layout alone is accepted, another engine refused
    from rlhf_switch.problems import check_resize_request

    run = load_config({**cfg, "elastic": {}})
    new, entry = check_resize_request(run, {"id": "a", **{k: tp2[k] for k in ("world_size", "train", "rollout")}}, 1, 2, 2)
    assert (entry.iteration, new.at_iteration(1).rollout.tp, new.at_iteration(1).train == run.train) == (1, 2, True)
    with pytest.raises(ConfigError) as e:
        check_resize_request(run, {"id": "b", "world_size": 2, "train": cfg["train"],
                              "rollout": {"engine": "torch", "tp": 1, "dp": 2}}, 1, 2, 2)
    assert any("a resize does not change the engine" in p for p in e.value.problems), e.value.problems


def test_a_bad_resize_request_is_one_config_error(tmp_path):
    """A resize request is checked as the schedule entry it would become (the config's own
    validators and fit checks) plus what only the running loop knows; every problem at once."""
    from rlhf_switch.problems import check_resize_request
    from rlhf_switch.rl.config import ConfigError, load_config

    cfg = _config(tmp_path, 4)
    cfg["algorithm"].update(iterations=3, prompts_per_iteration=4, micro_batch_size=2)
    cfg = load_config({**cfg, "elastic": {}})
    dp2 = _config(tmp_path, 2)
    good = {"id": "x", "world_size": 2, "train": dp2["train"], "rollout": dp2["rollout"]}
    new, entry = check_resize_request(cfg, good, 1, 2, 4)
    assert (entry.iteration, new.at_iteration(0).world_size, new.at_iteration(1).world_size) == (1, 4, 2)
    for request, it, held, expected in (
            ({**good, "world_size": 3}, 1, 4, ["elastic.schedule[0]: train: tp·pp·dp = 1·1·2 = 2, but world_size = 3"]),
            ({**good, "rollout": {"engine": "vllm", "tp": 1, "dp": 2}, "foo": 1}, 1, 4,
             ["resize request: unknown keys ['foo']", "elastic.schedule[0].rollout.engine: vllm"]),
            (good, 3, 4, ["resize request: the run ends at iteration 2"]),
            (good, 1, None, ["resize request: this run has no elastic device manager"]),
            (good, 1, 1, ["resize request: world_size 2 — Ray holds 1 devices"]),
            ({"id": None, "unreadable": "JSONDecodeError"}, 1, 4, ["resize request: unreadable (JSONDecodeError)"])):
        with pytest.raises(ConfigError, match="resize request refused") as e:
            check_resize_request(cfg, request, it, 2, held)
        for want in expected:
            assert any(p.startswith(want) for p in e.value.problems), (want, e.value.problems)
