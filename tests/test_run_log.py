"""The run's PNG marks the elastic events of its metrics log (``recipes.run_log``): a planned
resize, a lost trainer recovered, a resize abandoned — each a vertical line on the iteration axis
with its old → new layout and stop-the-world seconds, listed in the PNG's ``Description`` text."""
from __future__ import annotations

import json
from pathlib import Path


def _iteration(it: int) -> dict:
    return {"iteration": it, "reward_mean": 0.1 * it, "switch_train_to_rollout_s": 0.1, "gen_seconds": 1.0,
            "train_seconds": 0.5}


def _log(out: Path, events: bool) -> list[dict]:
    """A run log written by ``MetricsLog`` as the loop writes it (the resize record is the one
    ``recipes.elastic.control.ElasticControl`` writes)."""
    from recipes.run_log import MetricsLog

    log = MetricsLog(out, [])
    for it in range(6):
        if events and it == 2:
            log.write({"iteration": 2, "resize": {
                "kind": "planned", "old": "world 4, train {'engine': 'deepspeed', 'zero_stage': 3, 'dp': 4}",
                "new": "world 2, train {'engine': 'deepspeed', 'zero_stage': 3, 'dp': 2}",
                "background_s": 12.0, "stop_the_world_s": 0.25, "bytes_moved": 5_000_000},
                "resize_stop_the_world_s": 0.25}, it)
        if events and it == 4:
            log.write({"iteration": 4, "recovery": {"kind": "trainer_lost", "old": "world 2", "new": "world 2",
                                                    "stop_the_world_s": 1.5}}, it)
            log.write({"iteration": 4, "resize": {"kind": "planned", "abandoned": "a new actor died"}}, it)
        log.write(_iteration(it), it)
    log.write({"iteration": 6, "heldout_reward": 0.2, "eval": "after"}, 6)
    log.close()
    return log.records()


def test_the_png_marks_every_elastic_event(tmp_path):
    import numpy as np
    from PIL import Image

    from recipes.run_log import plot_run, run_events

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    records = _log(tmp_path / "a", events=True)
    events = run_events(records)
    assert [(e["iteration"], e["kind"]) for e in events] == [(2, "planned"), (4, "trainer_lost"), (4, "planned")]
    assert events[0]["label"] == "planned resize\n4× deepspeed z3 DP4 → 2× deepspeed z3 DP2\nstop-the-world 0.25 s"
    assert events[1]["label"].startswith("trainer lost\nworld 2 → world 2")
    assert events[2]["label"] == "planned resize (abandoned)"

    png = plot_run(records, tmp_path / "a" / "run.png", "GRPO")
    described = Image.open(png).text["Description"]
    assert described.startswith("events: iteration 2: planned resize, 4× deepspeed z3 DP4 → 2× deepspeed z3 DP2, "
                                "stop-the-world 0.25 s; iteration 4: trainer lost"), described
    # the same run without the events: no markers, a different picture
    plain = plot_run(_log(tmp_path / "b", events=False), tmp_path / "b" / "run.png", "GRPO")
    assert Image.open(plain).text["Description"] == "events: none"
    a, b = (np.asarray(Image.open(p).convert("RGB")) for p in (png, plain))
    assert a.shape == b.shape and (a != b).any()


def test_a_recovery_drops_the_records_of_the_iterations_it_runs_again(tmp_path):
    """A lost trainer restored to iteration 3 runs 3 and 4 again: their iteration records and
    rollouts leave the files, the events (resize at 2, the recovery itself) and evaluations stay,
    so after the re-run each iteration is in metrics.jsonl once."""
    from recipes.run_log import MetricsLog

    log = MetricsLog(tmp_path, [])
    for it in range(5):
        if it == 2:
            log.write({"iteration": 2, "resize": {"kind": "planned"}}, it)
        log.write(_iteration(it), it)
        log.write_rollouts(it, [[1]], [[2]], [[-0.5]], [1.0])
    log.write({"iteration": 4, "heldout_reward": 0.3, "eval": "before"}, 4)
    log.write({"iteration": 3, "recovery": {"kind": "trainer_lost"}}, 3)
    log.drop_rerun(3)
    for it in (3, 4):  # the re-run
        log.write(_iteration(it), it)
        log.write_rollouts(it, [[1]], [[2]], [[-0.5]], [1.0])
    recs = log.records()
    iterations = [r["iteration"] for r in recs if "reward_mean" in r]
    assert iterations == [0, 1, 2, 3, 4]
    assert [r["iteration"] for r in recs if "resize" in r or "recovery" in r] == [2, 3]
    assert [r["iteration"] for r in recs if "eval" in r] == [4]
    rollouts = [json.loads(line)["iteration"]
                for line in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
    assert rollouts == [0, 1, 2, 3, 4]


def test_resume_keeps_every_iteration_before_the_first_it_runs(tmp_path):
    """An interrupted run logged iterations 0-4 (and half a line as it died); its checkpoint is
    iteration 2's, so the resumed run starts at 3 (``resume_from=3``): iterations 0, 1 and 2 stay
    in both files — not one fewer — 3 and 4 go, and after the resumed run writes 3-5 every
    iteration is there once, in order."""
    from recipes.run_log import MetricsLog

    log = MetricsLog(tmp_path, [])
    log.write({"iteration": 0, "heldout_reward": 0.1, "eval": "before"}, 0)
    for it in range(5):
        log.write(_iteration(it), it)
        log.write_rollouts(it, [[1]], [[2]], [[-0.5]], [1.0])
    log.close()
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"iteration": 5, "rew')  # the crash
    resumed = MetricsLog(tmp_path, [], resume_from=3)
    assert [(r["iteration"], "eval" in r) for r in resumed.records()] == [(0, True), (0, False), (1, False), (2, False)]

    def rollouts() -> list[int]:
        return [json.loads(line)["iteration"] for line in (tmp_path / "rollouts.jsonl").read_text().splitlines()]

    assert rollouts() == [0, 1, 2]
    for it in range(3, 6):
        resumed.write(_iteration(it), it)
        resumed.write_rollouts(it, [[1]], [[2]], [[-0.5]], [1.0])
    assert [r["iteration"] for r in resumed.records() if "reward_mean" in r] == [0, 1, 2, 3, 4, 5]
    assert rollouts() == [0, 1, 2, 3, 4, 5]
    assert not list(tmp_path.glob("*.tmp"))
    # resuming from the very start keeps nothing; a new run starts both files empty
    assert MetricsLog(tmp_path, [], resume_from=0).records() == [] and rollouts() == []
    (tmp_path / "metrics.jsonl").write_text(json.dumps(_iteration(0)) + "\n")
    assert MetricsLog(tmp_path, []).records() == []
