"""The reward function over batches (``rlhf_switch.reward_workers``): batched and per-sample
functions, in the driver's process and in worker processes; a call that raises, returns a
non-number, runs past its time limit or kills its worker is refused with one message naming the
sample; the workers (and what they started) are gone afterwards. Fast: no Ray, no engines."""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from rlhf_switch.reward_workers import RewardRunner, default_workers
from rlhf_switch.rl.rewards import RewardError, batched, is_batched, score_samples

HERE = "test_reward_workers"  # these functions, as a config names them (tests/ is on every worker's path)
LONG_PROMPT = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. " * 2


@batched
def batch_sizes(prompts, responses, answers):
    """Each score: the response as a number plus 1000 × the size of the list this call got."""
    assert all(isinstance(x, list) for x in (prompts, responses, answers)), "a batched function gets lists"
    return [float(r) + 1000 * len(responses) for r in responses]


def digit(prompt, response, answer):
    return float(response)


def raises_on_x(prompt, response, answer):
    if response == "x":
        raise KeyError("no such answer table")
    return 0.0


@batched
def wrong_length(prompts, responses, answers):
    return [1.0]


def sleeps_on_slow(prompt, response, answer):
    if response == "slow":
        time.sleep(60)
    return 1.0


def hangs_with_a_child(prompt, response, answer):
    """Starts a process that outlives nothing: its pid in the answer's file, then hangs."""
    import subprocess

    child = subprocess.Popen(["sleep", "300"])
    Path(answer).write_text(str(child.pid))
    time.sleep(300)
    return 1.0


def exits(prompt, response, answer):
    os._exit(3)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a killed child not yet reaped by its (killed) parent is a zombie until init takes it
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(")")[-1].split()[0] != "Z"


def _gone(pids, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while any(_alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _pids(runner: RewardRunner) -> list[int]:
    return [w.process.pid for w in runner._pool]


RESPONSES = [str(i) for i in range(10)]


@pytest.mark.parametrize("workers", [0, 1, 3])
def test_a_batched_function_gets_lists_and_its_scores_are_used_in_order(workers):
    assert is_batched(batch_sizes) and not is_batched(digit)
    with RewardRunner(f"{HERE}:batch_sizes", workers=workers) as reward:
        scores = reward(["p"] * 10, RESPONSES, ["a"] * 10)
    # one call over the batch, or one per worker over contiguous parts of 4, 3 and 3 samples
    sizes = {0: [10] * 10, 1: [10] * 10, 3: [4] * 4 + [3] * 6}[workers]
    assert scores == [i + 1000.0 * n for i, n in enumerate(sizes)]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_per_sample_function_still_works(workers):
    with RewardRunner(f"{HERE}:digit", workers=workers) as reward:
        assert reward(["p"] * 10, RESPONSES, ["a"] * 10) == [float(i) for i in range(10)]
        assert reward(["p"], ["7"], ["a"]) == [7.0]  # the workers stay for the next batch
        assert reward([], [], []) == []


def test_the_shipped_rewards_run_in_the_driver_others_in_a_worker():
    assert default_workers("rlhf_switch.rl.rewards:exact_match") == 0
    assert default_workers(f"{HERE}:digit") == 1
    with RewardRunner("rlhf_switch.rl.rewards:exact_match") as reward:
        assert reward.workers == 0 and reward._pool == []
        assert reward(["1+1="] * 2, ["2", "3"], ["2", "2"]) == [1.0, 0.0]
    with RewardRunner(f"{HERE}:digit") as reward:
        assert reward.workers == 1 and len(reward._pool) == 1


@pytest.mark.parametrize("workers", [0, 2])
def test_a_reward_that_raises_names_the_sample(workers):
    reward = RewardRunner(f"{HERE}:raises_on_x", workers=workers)
    pids = _pids(reward)
    with pytest.raises(RewardError) as info:
        reward(["p0", "p1", LONG_PROMPT, "p3"], ["a", "b", "x", "d"], ["0", "1", "2", "3"])
    message = str(info.value)
    assert message.startswith(f"reward function {HERE}:raises_on_x on sample 2 (prompt="), message
    assert f"prompt={LONG_PROMPT[:80]!r}... ({len(LONG_PROMPT)} chars), response='x', answer='2')" in message
    assert "raised KeyError: 'no such answer table' (test_reward_workers.py:" in message
    assert "\n" not in message  # one line
    assert _gone(pids)
    if workers:  # a pool that failed is closed: later calls are refused, not silently rerun
        with pytest.raises(RewardError, match="its workers were stopped after an earlier error"):
            reward(["p"], ["a"], ["a"])
    reward.close()


@pytest.mark.parametrize("workers", [0, 1])
def test_a_batched_reward_of_the_wrong_length_is_refused(workers):
    with RewardRunner(f"{HERE}:wrong_length", workers=workers) as reward:
        with pytest.raises(RewardError, match=r"\(batched\) on samples 0\.\.2, the first sample 0 "
                                              r"\(prompt='p', response='r', answer='a'\) returned 1 scores for 3 samples"):
            reward(["p"] * 3, ["r"] * 3, ["a"] * 3)


def test_a_reward_past_its_time_limit_is_stopped_at_the_limit_and_progress_is_said():
    said: list[str] = []
    reward = RewardRunner(f"{HERE}:sleeps_on_slow", workers=2, timeout_s=2.0, say=said.append, progress_every_s=0.5)
    reward.wait_ready()  # the workers' start-up is not the call's time
    pids = _pids(reward)
    t0 = time.monotonic()
    with pytest.raises(RewardError) as info:
        reward(["p0", "p1", "p2", "p3"], ["a", "b", "slow", "d"], ["q"] * 4)
    took = time.monotonic() - t0
    assert 2.0 <= took < 2.0 + 5.0, took  # the limit, its polling and the kill (slack for a loaded machine)
    assert str(info.value) == (f"reward function {HERE}:sleeps_on_slow: its call on sample 2 (prompt='p2', "
                               f"response='slow', answer='q') did not return within 2 s (reward_timeout_s); its "
                               f"worker process was stopped")
    assert said and said[0].startswith("reward: 2/4 samples scored after "), said  # the other worker's two
    assert _gone(pids)


@batched
def sleeps_batched(prompts, responses, answers):
    time.sleep(60)
    return [1.0] * len(prompts)


def test_a_batched_call_past_its_time_limit_names_its_samples():
    reward = RewardRunner(f"{HERE}:sleeps_batched", workers=2, timeout_s=1.0)
    reward.wait_ready()
    with pytest.raises(RewardError, match=rf"^reward function {HERE}:sleeps_batched: its batched call on samples "
                                          rf"(0\.\.1|2\.\.3), the first sample (0|2) \(prompt='p[02]', response='r', "
                                          rf"answer='a'\) did not return within 1 s"):
        reward(["p0", "p1", "p2", "p3"], ["r"] * 4, ["a"] * 4)
    assert _gone(_pids(reward))


def test_in_the_driver_a_call_over_the_limit_is_refused_when_it_returns():
    def slowish(prompt, response, answer):
        time.sleep(0.3)
        return 1.0

    with pytest.raises(RewardError, match=r"on sample 0 \(prompt='p'.*took 0\.\d s, over the limit of 0\.1 s"):
        score_samples(slowish, ["p"], ["r"], ["a"], timeout_s=0.1)


class Clock:
    """``rlhf_switch.rl.rewards.time`` in the driver's process: a call takes the seconds its
    response names (the reward function advances the clock)."""

    def __init__(self):
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now


CLOCK = Clock()


def takes(prompt, response, answer):
    CLOCK.now += float(response)
    return 1.0


@batched
def takes_all(prompts, responses, answers):
    CLOCK.now += sum(float(r) for r in responses)
    return [2.0] * len(responses)


def test_in_the_driver_the_limit_is_per_call_not_per_batch(monkeypatch):
    """``reward_timeout_s`` bounds each call: three calls of 0.6 s under a limit of 1 s pass
    (1.8 s in all); a call of 1.1 s after one of 0.2 s is refused, naming it — per-sample calls and
    a batched call alike, with ``RewardRunner(workers=0)`` as with ``score_samples``."""
    from rlhf_switch.rl import rewards

    monkeypatch.setattr(rewards, "time", CLOCK)
    assert score_samples(takes, ["p"] * 3, ["0.6"] * 3, ["a"] * 3, timeout_s=1.0) == [1.0, 1.0, 1.0]
    assert score_samples(takes, ["p"] * 2, ["1.0", "1.0"], ["a"] * 2, timeout_s=1.0) == [1.0, 1.0]  # at the limit
    with pytest.raises(RewardError) as e:
        score_samples(takes, ["p0", "p1", "p2"], ["0.2", "1.1", "0.1"], ["a"] * 3, first=10, timeout_s=1.0)
    assert str(e.value) == ("reward function test_reward_workers:takes on sample 11 (prompt='p1', response='1.1', "
                            "answer='a') took 1.1 s, over the limit of 1 s (reward_timeout_s; in the driver's process "
                            "a call is refused after it returns — reward_workers >= 1 stops it at the limit)")
    assert score_samples(takes_all, ["p"] * 3, ["0.3"] * 3, ["a"] * 3, timeout_s=1.0) == [2.0] * 3
    with pytest.raises(RewardError, match=r"\(batched\) on samples 0\.\.3, the first sample 0 .* took 1\.2 s, over "
                                          r"the limit of 1 s"):
        score_samples(takes_all, ["p"] * 4, ["0.3"] * 4, ["a"] * 4, timeout_s=1.0)
    assert score_samples(takes, ["p"] * 2, ["5", "5"], ["a"] * 2) == [1.0, 1.0]  # no limit given
    with RewardRunner(f"{HERE}:takes", workers=0, timeout_s=1.0) as reward:
        assert reward(["p"] * 3, ["0.6"] * 3, ["a"] * 3) == [1.0, 1.0, 1.0]
        with pytest.raises(RewardError, match=r"on sample 1 .* took 1\.1 s, over the limit of 1 s"):
            reward(["p"] * 2, ["0.2", "1.1"], ["a"] * 2)


def sleeps_response_seconds(prompt, response, answer):
    time.sleep(float(response))
    return float(response)


def test_in_a_worker_the_limit_is_per_call_not_per_batch():
    """In a worker process each call is timed from its own start: six calls of 0.5 s under a
    limit of 2 s (3 s in all) pass, and so does a second batch after a pause longer than the
    limit (the last batch's call times are not this one's)."""
    with RewardRunner(f"{HERE}:sleeps_response_seconds", workers=1, timeout_s=2.0) as reward:
        reward.wait_ready()
        t0 = time.monotonic()
        assert reward(["p"] * 6, ["0.5"] * 6, ["a"] * 6) == [0.5] * 6
        assert time.monotonic() - t0 >= 3.0  # one worker: the calls ran one after the other
        time.sleep(2.5)
        assert reward(["p"] * 2, ["0.5", "0.25"], ["a"] * 2) == [0.5, 0.25]


def test_what_a_stopped_reward_started_is_stopped_too(tmp_path):
    pid_file = tmp_path / "child.pid"
    reward = RewardRunner(f"{HERE}:hangs_with_a_child", workers=1, timeout_s=3.0)
    reward.wait_ready()
    pids = _pids(reward)
    with pytest.raises(RewardError, match="did not return within 3 s"):
        reward(["p"], ["r"], [str(pid_file)])
    child = int(pid_file.read_text())
    assert _gone(pids + [child]), "the worker's own child outlived it"


def test_a_worker_that_dies_is_named_with_its_sample():
    with pytest.raises(RewardError, match=rf"reward function {HERE}:exits: its worker process exited with code 3 "
                                          rf"while scoring sample 0 \(prompt='p'"):
        RewardRunner(f"{HERE}:exits", workers=1)(["p"], ["r"], ["a"])



MARK = False  # set in the driver by a test: a forked worker would inherit it, a spawned one does not


def _nothing():
    pass


def fresh_and_may_start_processes(prompt, response, answer):
    """1.0 when this worker did not inherit the driver's state (spawned, never forked) and may
    start a process of its own (not daemonic: a reward function may use multiprocessing)."""
    import multiprocessing as mp

    child = mp.get_context("fork").Process(target=_nothing)
    child.start()
    child.join()
    return 0.0 if MARK else 1.0


def quits(prompt, response, answer):
    os._exit(0)


def test_a_worker_is_spawned_fresh_and_may_start_processes_of_its_own(monkeypatch):
    import sys

    monkeypatch.setattr(sys.modules[__name__], "MARK", True)
    with RewardRunner(f"{HERE}:fresh_and_may_start_processes", workers=1) as reward:
        assert reward(["p"], ["r"], ["a"]) == [1.0]


def test_a_worker_that_exits_cleanly_in_a_call_is_named_with_its_code_and_sample():
    with pytest.raises(RewardError, match=rf"^reward function {HERE}:quits: its worker process exited with code 0 "
                                          rf"while scoring sample 0 \(prompt='p'"):
        RewardRunner(f"{HERE}:quits", workers=1)(["p"], ["r"], ["a"])


def test_closing_gives_the_workers_their_grace_to_exit_on_their_own():
    reward = RewardRunner(f"{HERE}:digit", workers=2)
    assert reward(["p"] * 2, ["1", "2"], ["a"] * 2) == [1.0, 2.0]
    reward.close()
    assert [w.process.exitcode for w in reward._pool] == [0, 0]  # asked to exit and did: not killed
    assert RewardRunner(f"{HERE}:digit", workers=0).progress_every_s == 10.0  # docs/models-and-data.md

def test_a_function_that_does_not_load_in_the_worker():
    with pytest.raises(RewardError, match=f"reward function '{HERE}:nope': '{HERE}' has no attribute 'nope'"):
        RewardRunner(f"{HERE}:nope", workers=1).wait_ready()


def test_closing_leaves_no_process():
    reward = RewardRunner(f"{HERE}:digit", workers=2)
    assert reward(["p"] * 3, ["1", "2", "3"], ["a"] * 3) == [1.0, 2.0, 3.0]
    pids = _pids(reward)
    assert all(_alive(p) for p in pids)
    reward.close()
    assert _gone(pids, within_s=3.0)
    reward.close()  # twice is fine


def test_the_pre_start_check_calls_the_reward_as_the_run_does():
    """The ``reward`` check runs the function where the run will (a worker, here) and with the
    run's limit: a reward that raises, or hangs, is refused before anything starts."""
    from rlhf_switch.problems import run_problems
    from rlhf_switch.rl.config import load_config
    from test_loop_inputs import config

    ok = load_config(config(**{"task.reward_fn": f"{HERE}:batch_sizes_of_answers", "task.reward_timeout_s": 30}))
    assert run_problems(ok) == []
    slow = load_config(config(**{"task.reward_fn": f"{HERE}:sleeps_on_empty", "task.reward_timeout_s": 1}))
    t0 = time.monotonic()
    (problem,) = run_problems(slow)
    assert time.monotonic() - t0 < 30
    assert problem.startswith(f"task.reward_fn: reward function {HERE}:sleeps_on_empty: its call on sample 1 "), problem
    assert "did not return within 1 s (reward_timeout_s)" in problem


@batched
def batch_sizes_of_answers(prompts, responses, answers):
    assert isinstance(responses, list) and len(responses) == 2  # the check's two samples, in one call
    return [float(r == a) for r, a in zip(responses, answers)]


def sleeps_on_empty(prompt, response, answer):
    if response == "":  # the check's second sample
        time.sleep(60)
    return 1.0


# --- the worker's side and the helpers, in this process ------------------------------------------
# (a worker runs ``_serve`` in a process of its own, where mutation testing cannot see which test
# reached it: these call it here, over a real pipe)


def raises_system_exit(prompt, response, answer):
    raise SystemExit(3)


def kills_itself(prompt, response, answer):
    import signal

    os.kill(os.getpid(), signal.SIGKILL)


def _serve_here(monkeypatch, spec: str, jobs: list, slot: int = 1, setpgrp=None):
    """Run a worker's loop (``_serve``) in this process over a real pipe: ``jobs`` sent first,
    then the end. Returns (the worker's messages, its slot of the progress array, the process
    group and signal calls it made)."""
    import multiprocessing as mp
    import signal

    from rlhf_switch import reward_workers as rw

    calls = []

    def no_setpgrp():
        calls.append("setpgrp")
        if setpgrp is not None:
            raise setpgrp

    monkeypatch.setattr(rw.os, "setpgrp", no_setpgrp)  # not this process's own group
    monkeypatch.setattr(rw.signal, "signal", lambda sig, handler: calls.append((sig, handler)))
    here, there = mp.Pipe()
    for job in jobs:
        here.send(job)
    here.send(None)
    progress = mp.RawArray("d", rw.FIELDS * 3)
    rw._serve(spec, there, progress, slot)
    out = []
    while here.poll():
        out.append(here.recv())
    assert calls == ["setpgrp", (signal.SIGINT, signal.SIG_IGN)]
    return out, list(progress[rw.FIELDS * slot:rw.FIELDS * (slot + 1)]), list(progress)


def test_a_worker_scores_each_part_it_is_sent_and_says_where_it_is(monkeypatch):
    """``_serve``: ``("ready", batched)`` once the function is imported, then one ``("ok", scores)``
    per part; its slot of the shared array holds the index of the call it started last, when, and
    how many samples it scored (the other slots untouched)."""
    t0 = time.monotonic()
    out, mine, every = _serve_here(monkeypatch, f"{HERE}:digit", [(5, ["p", "p"], ["3", "4"], ["a", "a"]),
                                                                  (9, ["p"], ["8"], ["a"])])
    assert out == [("ready", False), ("ok", [3.0, 4.0]), ("ok", [8.0])]
    index, started, scored = mine
    assert (index, scored) == (9, 3) and t0 <= started <= time.monotonic()
    assert every[:3] == [0.0] * 3 and every[6:] == [0.0] * 3
    out, mine, _ = _serve_here(monkeypatch, f"{HERE}:batch_sizes", [(4, ["p"] * 2, ["1", "2"], ["a"] * 2)], slot=0,
                               setpgrp=OSError("not allowed"))
    assert out == [("ready", True), ("ok", [2001.0, 2002.0])] and (mine[0], mine[2]) == (4, 2)


def test_a_worker_answers_each_failure_as_an_error_and_goes_on(monkeypatch):
    out, _, _ = _serve_here(monkeypatch, f"{HERE}:raises_on_x", [(3, ["p", "q"], ["a", "x"], ["0", "1"]),
                                                                 (5, ["p"], ["a"], ["0"])])
    assert out[0] == ("ready", False) and out[2] == ("ok", [0.0])
    kind, message = out[1]
    assert kind == "error" and message.startswith(f"reward function {HERE}:raises_on_x on sample 4 (prompt='q', "
                                                  f"response='x', answer='1') raised KeyError: 'no such answer table'")
    out, _, _ = _serve_here(monkeypatch, f"{HERE}:raises_system_exit", [(6, ["p", "q"], ["a", "b"], ["0", "1"])])
    assert out == [("ready", False), ("error", f"reward function {HERE}:raises_system_exit on samples 6..7: "
                                               f"SystemExit: 3")]
    out, _, _ = _serve_here(monkeypatch, f"{HERE}:nope", [(0, ["p"], ["a"], ["0"])])
    ((kind, message),) = out  # no ready: the worker ends
    assert kind == "error" and message.startswith(f"reward function '{HERE}:nope': '{HERE}' has no attribute 'nope'")


def test_a_worker_ends_when_the_driver_is_gone(monkeypatch):
    """The driver's end of the pipe closed (``EOFError`` or ``OSError`` on receiving): the worker
    returns, after answering what it was sent before."""
    import multiprocessing as mp

    from rlhf_switch import reward_workers as rw

    monkeypatch.setattr(rw.os, "setpgrp", lambda: None)
    monkeypatch.setattr(rw.signal, "signal", lambda sig, handler: None)
    for gone in (EOFError, OSError):
        jobs, sent = [(0, ["p"], ["1"], ["a"])], []

        class Driver:  # one job, then gone
            def send(self, msg):
                sent.append(msg)

            def recv(self):
                if jobs:
                    return jobs.pop()
                raise gone

        rw._serve(f"{HERE}:digit", Driver(), mp.RawArray("d", 3), 0)
        assert sent == [("ready", False), ("ok", [1.0])]


def test_shared_watch_writes_its_own_slot():
    import multiprocessing as mp

    from rlhf_switch.reward_workers import FIELDS, SharedWatch

    assert FIELDS == 3
    progress = mp.RawArray("d", 9)
    watch = SharedWatch(progress, 2)
    t0 = time.monotonic()
    watch.started(17)
    watch.scored(4)
    watch.scored(2)
    assert progress[6] == 17 and t0 <= progress[7] <= time.monotonic() and progress[8] == 6
    assert list(progress[:6]) == [0.0] * 6


def test_parts_cut_a_batch_into_contiguous_nearly_equal_parts():
    from rlhf_switch.reward_workers import _parts

    assert _parts(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert _parts(9, 3) == [(0, 3), (3, 6), (6, 9)]
    assert _parts(2, 3) == [(0, 1), (1, 2)]  # never an empty part
    assert _parts(5, 1) == [(0, 5)]
    assert _parts(5, 2) == [(0, 3), (3, 5)]


def test_kill_takes_the_process_group_of_a_worker_that_leads_one():
    """A worker leads its own process group (``_serve``: ``setpgrp``): ``_kill`` takes the group,
    what the reward function started with it; a process that leads none is killed alone."""
    import subprocess
    import sys

    from rlhf_switch.reward_workers import _kill

    script = ("import subprocess, time; c = subprocess.Popen(['sleep', '300']); print(c.pid, flush=True); "
              "time.sleep(300)")
    leader = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, start_new_session=True,
                              text=True)
    child = int(leader.stdout.readline())
    _kill(leader)
    assert leader.wait(timeout=30) == -9 and _gone([child])
    plain = subprocess.Popen(["sleep", "300"])  # in this process's group: only it is killed
    _kill(plain)
    assert plain.wait(timeout=30) == -9


def test_start_without_main_hides_the_drivers_main_while_the_child_starts():
    import sys

    from rlhf_switch.reward_workers import _start_without_main

    main = sys.modules["__main__"]
    seen = []

    class Process:
        def start(self):
            seen.append(sys.modules["__main__"])

    _start_without_main(Process())
    (bare,) = seen
    assert bare is not main and bare.__name__ == "__main__" and not hasattr(bare, "__file__")
    assert sys.modules["__main__"] is main

    class Fails:
        def start(self):
            raise RuntimeError("cannot start")

    with pytest.raises(RuntimeError, match="cannot start"):
        _start_without_main(Fails())
    assert sys.modules["__main__"] is main


def test_a_runner_refuses_bad_settings_and_says_where_it_runs():
    with pytest.raises(ValueError, match=r"^workers must be >= 0 and timeout_s > 0, got -1, 60\.0$"):
        RewardRunner(f"{HERE}:digit", workers=-1)
    with pytest.raises(ValueError, match=r"^workers must be >= 0 and timeout_s > 0, got 0, 0\.0$"):
        RewardRunner(f"{HERE}:digit", workers=0, timeout_s=0)
    with RewardRunner(f"{HERE}:digit", workers=0, timeout_s=2.5) as reward:
        assert repr(reward) == f"{HERE}:digit in this process, each call limited to 2.5 s"
        assert reward._poll_s() == 0.5 and reward.timeout_s == 2.5 and reward.say is None
        with pytest.raises(ValueError, match=r"^prompts, responses and answers must be equally long, got 1, 2, 1$"):
            reward(["p"], ["1", "2"], ["a"])
    reward = RewardRunner(f"{HERE}:digit", workers=2, timeout_s=1.2)
    try:
        assert repr(reward) == f"{HERE}:digit in 2 worker processes, each call limited to 1.2 s"
        assert reward._poll_s() == pytest.approx(0.3)
        with pytest.raises(ValueError, match="equally long, got 2, 2, 1"):
            reward(["p", "q"], ["1", "2"], ["a"])
    finally:
        reward.close()
    with RewardRunner(f"{HERE}:digit", workers=1) as reward:
        assert repr(reward) == f"{HERE}:digit in 1 worker process, each call limited to 60 s"


def test_a_worker_killed_by_a_signal_is_named_with_its_sample():
    with pytest.raises(RewardError) as e:
        RewardRunner(f"{HERE}:kills_itself", workers=1)(["p0", "p1"], ["r0", "r1"], ["a", "a"])
    assert str(e.value) == (f"reward function {HERE}:kills_itself: its worker process was killed by signal 9 "
                            f"(SIGKILL) while scoring sample 0 (prompt='p0', response='r0', answer='a')")


def test_after_an_error_the_workers_are_killed_without_waiting():
    """A failed call does not wait for its workers (one may be stuck in a call): each is killed at
    once (SIGKILL), even one idle on its pipe that would have exited when asked."""
    import signal

    reward = RewardRunner(f"{HERE}:raises_on_x", workers=1)
    reward.wait_ready()
    with pytest.raises(RewardError, match="on sample 0"):
        reward(["p"], ["x"], ["a"])
    (w,) = reward._pool
    assert w.process.exitcode == -signal.SIGKILL


def _module(tmp_path, monkeypatch, name: str, body: str) -> str:
    """A reward module ``name`` in ``tmp_path`` (on the workers' path) whose import runs ``body``."""
    (tmp_path / f"{name}.py").write_text(f"{body}\n\n\ndef score(prompt, response, answer):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # spawned workers get the driver's sys.path
    return f"{name}:score"


def test_a_worker_that_dies_while_importing_the_function_is_named(tmp_path, monkeypatch):
    spec = _module(tmp_path, monkeypatch, "dies_on_import_reward", "import os\nos._exit(3)")
    with pytest.raises(RewardError) as e:
        RewardRunner(spec, workers=1).wait_ready()
    assert str(e.value) == f"reward function {spec}: its worker process exited with code 3 while importing it"


def test_a_worker_that_does_not_import_the_function_in_time_is_stopped(tmp_path, monkeypatch):
    """The import's limit is the larger of the call limit and ``LOAD_LIMIT_S`` (1 s each here)."""
    from rlhf_switch import reward_workers

    monkeypatch.setattr(reward_workers, "LOAD_LIMIT_S", 1.0)
    spec = _module(tmp_path, monkeypatch, "hangs_on_import_reward", "import time\ntime.sleep(120)")
    reward = RewardRunner(spec, workers=1, timeout_s=0.5)
    pids = _pids(reward)
    with pytest.raises(RewardError) as e:
        reward.wait_ready()
    assert str(e.value) == f"reward function {spec}: its worker process did not import it within 1 s"
    assert _gone(pids)


def test_a_worker_that_is_done_is_not_timed_while_another_works():
    """Each worker's part is taken as soon as it is done: worker 1 (samples 3, 4: no wait) is done
    long before worker 0 (samples 0..2: 1 s each, 3 s in all, each call under the 2 s limit), and
    its last call's start is not held against the limit while worker 0 goes on."""
    with RewardRunner(f"{HERE}:sleeps_response_seconds", workers=2, timeout_s=2.0) as reward:
        reward.wait_ready()
        assert reward(["p"] * 5, ["1", "1", "1", "0", "0"], ["a"] * 5) == [1.0, 1.0, 1.0, 0.0, 0.0]


def test_progress_is_said_every_progress_every_s_of_a_call_and_never_without_say():
    """A progress line comes once ``progress_every_s`` of the call has passed while a worker is
    still at it, says the seconds since the call began (by the call's clock: at most what the
    test measured), and none comes before, or at all without ``say``."""
    import re

    said: list[str] = []
    with RewardRunner(f"{HERE}:sleeps_response_seconds", workers=1, timeout_s=30.0, say=said.append,
                      progress_every_s=60.0) as reward:
        reward.wait_ready()
        assert reward(["p"], ["1"], ["a"]) == [1.0]
        assert said == []
        reward.progress_every_s = 0.2
        t0 = time.monotonic()
        assert reward(["p"] * 2, ["0.6", "0.6"], ["a"] * 2) == [0.6, 0.6]
        took = time.monotonic() - t0
    assert said, "1.2 s of calls said nothing at one line per 0.2 s"
    for line in said:
        m = re.fullmatch(rf"reward: [012]/2 samples scored after (\d+) s \({HERE}:sleeps_response_seconds in 1 "
                         rf"worker process, each call limited to 30 s\)", line)
        assert m and int(m.group(1)) <= took + 1, (line, took)
    with RewardRunner(f"{HERE}:sleeps_response_seconds", workers=1, say=None, progress_every_s=0.0) as reward:
        assert reward(["p"], ["0.6"], ["a"]) == [0.6]
