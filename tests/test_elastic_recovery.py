"""A lost trainer without a checkpoint (``elastic.redundancy: host``).

Pure part: the buddy layout (``vps/layouts/buddy.py``) — every rank's own share and its buddy's,
packed in host buffers; any single lost rank's share survives, both an owner and its holder lost
is named before anything moves.
"""
from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace

import pytest

from helpers import same_full_state


def _survivors(layout, lost):
    from rlhf_switch.vps import Layout

    keep = [r for r in range(layout.world_size) if r not in lost]
    return Layout(layout.spec, [layout.fragments(r) for r in keep], [layout.buffers(r) for r in keep],
                  name=f"{layout.name} minus {sorted(lost)}")


def test_buddy_layout_keeps_every_single_lost_ranks_share():
    """For every named 4-rank layout with Adam state: the buddy layout is valid; rank h holds its
    own boxes and those of h-1 it does not hold already; the refresh into it sends each rank only
    its buddy's share; with any one rank lost the survivors' copies still cover the whole model,
    with two neighbours lost they do not, and ``lost_owners`` says which share is gone."""
    from catalogue import CONFIGS, TINY_LLAMA
    from rlhf_switch.vps import ADAM_FIELDS, PARAM, build_layout, llama_spec, plan_rank
    from rlhf_switch.vps.layout import LayoutError
    from rlhf_switch.vps.layouts.buddy import buddy_layout, lost_owners

    spec = llama_spec(TINY_LLAMA, name="tiny-llama")
    for name, config in CONFIGS.items():
        src = build_layout(spec, config, (PARAM, *ADAM_FIELDS))
        n = src.world_size
        buddy = buddy_layout(src).validate()
        for h in range(n):
            own = {(f.key, f.box) for f in src.fragments(h)}
            other = {(f.key, f.box) for f in src.fragments((h - 1) % n)}
            assert {(f.key, f.box) for f in buddy.fragments(h)} == own | other, (name, h)
            plan = plan_rank(src, buddy, h)
            assert plan.bytes_local == sum(b.numel * 4 for _, b in own), (name, h)
            assert plan.bytes_received == sum(b.numel * 4 for k, b in other - own
                                              if not any(k == k2 and b2.contains(b) for k2, b2 in own)), (name, h)
        for lost in range(n):
            _survivors(buddy, {lost}).validate(require_cover=True)
            assert lost_owners(n, {lost}) == []
        if name in ("zero3", "fsdp", "tp4"):  # every share on one rank only: neighbours 1, 2 lost, 1's is gone
            with pytest.raises(LayoutError, match="does not cover"):
                _survivors(buddy, {1, 2}).validate(require_cover=True)
            assert lost_owners(n, {1, 2}) == [1]


def test_buddy_shift_puts_copies_on_another_node():
    from rlhf_switch.vps.layouts.buddy import buddy_shift, holder_of, lost_owners

    assert buddy_shift(["a"] * 4) == 1
    assert buddy_shift(["a", "a", "b", "b"]) == 2
    assert buddy_shift(["a", "b", "a", "b"]) == 1
    assert [holder_of(r, 4, 2) for r in range(4)] == [2, 3, 0, 1]
    assert lost_owners(4, {0, 1}, shift=2) == [] and lost_owners(4, {0, 2}, shift=2) == [0, 2]


def test_both_owner_and_holder_lost_is_refused_before_anything_moves():
    """Ranks 1 and 2 of 4 lost: rank 1's only copy was on rank 2 — ``StateLost`` naming it,
    raised before any actor is touched (none is given here)."""
    from rlhf_switch.elastic.recovery import StateLost, recover

    with pytest.raises(StateLost, match=r"every host copy of rank\(s\) \[1\]") as e:
        recover(None, None, {}, None, range(4), [None] * 4, [1, 2])
    assert e.value.unrecoverable == [1]


# --- recover's decisions, with stand-ins for Ray, the devices and the world's build ----------------
#
# What ``recover`` decides is tested here in the pytest process: who is lost (a second loss, the
# ranks on a node gone, re-checked), what it refuses before anything moves, which devices the new
# world gets, what it asks the build and the move for, the record. Ray, the device manager and
# ``start_world``'s build are stood in for (they are not what is tested; the slow tests below run
# them for real). The stand-ins log every call, so a test sees what happened before a refusal.


class Clock:
    """``recovery.time``: a clock the stand-ins advance (each wait takes the seconds it names)."""

    def __init__(self, now: float = 100.0):
        self.now = now

    def perf_counter(self) -> float:
        return self.now


class Call:
    """``actor.method.options(concurrency_group=...).remote()``: its answer as the ref."""

    def __init__(self, log, rank, name, answer):
        self.log, self.rank, self.name, self.answer, self.group = log, rank, name, answer, None

    def options(self, concurrency_group=None):
        self.group = concurrency_group
        return self

    def remote(self):
        self.log.append((self.name, self.rank, self.group))
        return ("ref", self.rank, self.name, self.answer)


class Rank:
    """A trainer actor of the old world: what it answers the recovery's calls."""

    def __init__(self, log, rank, torn=(), extra=({"iteration": 4},), pid=None):
        self.log, self.rank, self.answers = log, rank, {"host_copy_torn": list(torn),
                                                        "host_copy_extra": list(extra), "pid": pid}

    def __getattr__(self, name):
        if name not in ("host_copy_torn", "host_copy_extra", "pid"):
            raise AttributeError(name)
        return Call(self.log, self.rank, name, self.answers[name])

    def __repr__(self):
        return f"rank{self.rank}"


class Ray:
    """What ``recover`` and ``lost_ranks`` call of Ray."""

    def __init__(self, log, unanswered=()):
        self.log, self.unanswered = log, set(unanswered)

    def kill(self, actor):
        self.log.append(("kill", actor.rank))

    def get(self, refs, timeout=None):
        if isinstance(refs, tuple):  # one ref (lost_ranks asks each)
            answer = refs[3]
            if isinstance(answer, Exception):
                raise answer
            return answer
        self.log.append(("get", [r[2] for r in refs], timeout))
        return [r[3] for r in refs]

    def wait(self, refs, num_returns, timeout):
        self.log.append(("wait", num_returns, timeout))
        pending = [r for r in refs if r[1] in self.unanswered]
        return [r for r in refs if r not in pending], pending


class Devices:
    """The device manager: ``placed`` answers the devices still placed (after ``wait_s``)."""

    def __init__(self, log, clock, gone=()):
        self.log, self.clock, self.gone = log, clock, set(gone)

    def placed(self, ids, wait_s):
        self.log.append(("placed", list(ids), wait_s))
        self.clock.now += 2.0 if self.gone else 0.5
        return [d for d in ids if d not in self.gone]

    def release(self, ids):
        self.log.append(("release", list(ids)))


class Build:
    """``start_world``'s stand-in: logs what the new world is built of; building takes 7 s, the
    move 3 s; the new world's actors are ``new<rank>``."""

    def __init__(self, log, clock):
        self.log, self.clock = log, clock

    def __call__(self, ray, actor_cls, config, devices, plan, timeout_s, init_dir, device):
        assert isinstance(ray, Ray) and isinstance(devices, Devices)  # the run's own, handed on
        self.log.append(("start_world", actor_cls, dict(config), plan, timeout_s, init_dir, device))
        build = self

        class Pending:
            def wait(self):
                build.clock.now += 7.0
                build.log.append(("wait",))

            def commit(self, old_workers, timeout_s, source):
                build.clock.now += 3.0
                build.log.append(("commit", [w.rank for w in old_workers], timeout_s, source))
                members = [{"side": "old", "bytes_sent": 10 * (i + 1), "bytes_local": 1,
                            "parts": [{"bytes_sent": 10 * (i + 1), "bytes_local": 1}]} for i in range(2)]
                members.append({"side": "new", "bytes_sent": 0, "bytes_local": 5, "parts": [{"bytes_sent": 0,
                                                                                            "bytes_local": 5}]})
                return SimpleNamespace(workers=[f"new{r}" for r in range(plan.new_world)], stop_the_world_s=2.5,
                                       members=members)

        return Pending()


@pytest.fixture
def world(monkeypatch):
    """``make(n, gone=devices gone, torn/extra per rank)`` -> (ray, devices, workers, log); the
    old world's rank ``r`` is on device ``10 + r``; the clock starts at 100 s."""
    from rlhf_switch.elastic import recovery

    clock = Clock()
    build = Build([], clock)
    monkeypatch.setattr(recovery, "time", clock)
    monkeypatch.setattr(recovery, "start_world", build)

    def make(n, gone=(), torn=None, extra=None, unanswered=()):
        log = build.log = []  # each world its own log
        workers = [Rank(log, r, torn=(torn or {}).get(r, ()), extra=(extra or {}).get(r, ({"iteration": 4},)))
                   for r in range(n)]
        return Ray(log, unanswered), Devices(log, clock, gone), workers, log, clock

    return make


def test_a_node_loss_that_adds_lost_ranks_is_checked_again(world):
    """Rank 1 of 4 lost, then its device's neighbour goes with its node: rank 2 (device 12) is
    lost too, and rank 2 held rank 1's only copy — ``StateLost`` naming both ranks and rank 1's
    share, raised before the ranks on the gone node are killed or anything is built or released."""
    from rlhf_switch.elastic.recovery import StateLost, recover

    ray, devices, workers, log, _ = world(4, gone=[12])
    with pytest.raises(StateLost) as e:
        recover(ray, "Actor", {"world_size": 4}, devices, [10, 11, 12, 13], workers, [1],
                config_for=lambda n: {"world_size": n})  # a smaller world could be built: not the reason
    assert str(e.value) == ("trainer ranks [1, 2] of 4 are lost (devices [12] gone with their node) and so is every "
                            "host copy of rank(s) [1]: the state cannot be restored from the buddies")
    assert (e.value.lost, e.value.unrecoverable) == ([1, 2], [1])
    assert log == [("kill", 1), ("placed", [10, 11, 12, 13], 60.0)]


def test_a_node_loss_that_leaves_every_copy_goes_on_in_a_smaller_world(world):
    """Rank 1 lost, then device 13 (rank 3) gone with its node: rank 1's copy is on rank 2, rank
    3's on rank 0 — the recovery goes on: ranks 1 and 3 killed, the gone device released, a world
    of ``config_for(3)`` on devices 10, 11, 12 built from the survivors 0 and 2's host copies."""
    from rlhf_switch.elastic import ResizePlan
    from rlhf_switch.elastic.manager import CONTROL
    from rlhf_switch.elastic.recovery import recover

    ray, devices, workers, log, clock = world(4, gone=[13])
    asked = []
    rec = recover(ray, "Actor", {"world_size": 4}, devices, [10, 11, 12, 13], workers, [1], init_dir="/init",
                  device="cpu", failed_at=99.0, timeout_s=300.0,
                  config_for=lambda n: asked.append(n) or {"world_size": n, "tag": "scaled"}, replace_wait_s=30.0)
    plan = ResizePlan((10, 12), (10, 11, 12))
    assert asked == [3]
    assert log == [("kill", 1), ("placed", [10, 11, 12, 13], 30.0), ("kill", 3),
                   ("host_copy_torn", 0, CONTROL), ("host_copy_torn", 2, CONTROL),
                   ("get", ["host_copy_torn", "host_copy_torn"], 60),
                   ("host_copy_extra", 0, CONTROL), ("host_copy_extra", 2, CONTROL),
                   ("get", ["host_copy_extra", "host_copy_extra"], 60),
                   ("release", [13]),
                   ("start_world", "Actor", {"world_size": 3, "tag": "scaled"}, plan, 300.0, "/init", "cpu"),
                   ("wait",), ("commit", [0, 2], 300.0, "host_copy")]
    assert rec.workers == ["new0", "new1", "new2"] and rec.plan == plan
    assert (rec.lost, rec.survivors, rec.devices, rec.devices_gone) == ([1, 3], [0, 2], [10, 11, 12], [13])
    assert (rec.detect_s, rec.build_s, rec.move_s, rec.seconds) == (3.0, 7.0, 2.5, 13.0)  # failed at 99, clock 100
    assert rec.extra == {"iteration": 4} and rec.bytes_moved == 32
    assert rec.event("zero3 dp4", "zero3 dp3") == {
        "kind": "trainer_lost", "lost_ranks": [1, 3], "survivors": [0, 2], "old": "zero3 dp4", "new": "zero3 dp3",
        "new_world": 3, "devices_gone": [13], "detect_s": 3.0, "build_s": 7.0, "move_s": 2.5, "seconds": 13.0,
        "bytes_moved": 32, "bytes_moved_by_engine": [32]}
    assert clock.now == 112.0


def test_a_lost_rank_is_replaced_on_its_device(world):
    """Every device still placed: the same world (the run's config, not ``config_for``'s) on the
    same devices, the lost rank's device given to its replacement; nothing released. Without
    ``failed_at`` the detection is timed from the call."""
    from rlhf_switch.elastic import ResizePlan
    from rlhf_switch.elastic.recovery import recover

    ray, devices, workers, log, _ = world(3, extra={r: ({"iteration": 7}, {"iteration": 7}) for r in range(3)})
    rec = recover(ray, "Actor", {"world_size": 3}, devices, [10, 11, 12], workers, [2],
                  config_for=lambda n: pytest.fail("no smaller world asked for"))
    assert [c for c in log if c[0] in ("kill", "release", "start_world", "commit")] == [
        ("kill", 2), ("start_world", "Actor", {"world_size": 3}, ResizePlan((10, 11), (10, 11, 12)), 600.0, None, None),
        ("commit", [0, 1], 600.0, "host_copy")]
    assert ("placed", [10, 11, 12], 60.0) in log
    assert (rec.lost, rec.survivors, rec.devices, rec.devices_gone, rec.extra) == ([2], [0, 1], [10, 11, 12], [],
                                                                                   {"iteration": 7})
    assert (rec.detect_s, rec.build_s, rec.seconds) == (0.5, 7.0, 10.5)


def test_recover_refuses_before_anything_moves(world):
    """Each refusal names what is lost and comes before the build: every rank lost; all ranks lost
    once a node's go too; a survivor's torn copy; survivors' copies of two refreshes; a smaller
    world that cannot be built (none asked for, or its config refused)."""
    from rlhf_switch.elastic.recovery import StateLost, WorldLost, recover

    def refused(n, lost, gone=(), error=StateLost, **kw):
        ray, devices, workers, log, _ = world(n, gone=gone, torn=kw.pop("torn", None), extra=kw.pop("extra", None))
        with pytest.raises(error) as e:
            recover(ray, "Actor", {"world_size": n}, devices, [10 + r for r in range(n)], workers, lost, **kw)
        assert not [c for c in log if c[0] in ("start_world", "release")], log
        return e.value, log

    e, log = refused(2, [1, 0])
    assert str(e) == ("trainer ranks [0, 1] of 2 are lost and so is every host copy of rank(s) [0, 1]: the state "
                      "cannot be restored from the buddies")
    assert (e.lost, e.unrecoverable, log) == ([0, 1], [0, 1], [])
    e, _ = refused(1, [0])
    assert (e.lost, e.unrecoverable) == ([0], [0])
    e, log = refused(2, [0], gone=[11])  # the other rank's node gone too: every rank lost
    assert str(e) == ("trainer ranks [0, 1] of 2 are lost (devices [11] gone with their node) and so is every host "
                      "copy of rank(s) [0, 1]: the state cannot be restored from the buddies")
    assert (e.lost, e.unrecoverable) == ([0, 1], [0, 1])
    e, log = refused(4, [1], gone=[11], error=WorldLost)  # the lost rank's own device gone: no new loss
    assert (e.lost, e.devices_gone) == ([1], [11]) and ("kill", 1) in log
    e, log = refused(4, [0], shift=2, gone=[12])  # with shift 2, rank 0's copy is on rank 2
    assert (e.lost, e.unrecoverable) == ([0, 2], [0, 2])
    e, log = refused(4, [2, 0], shift=2)  # ranks 0 and 2 hold each other's copies: refused at once
    assert (e.lost, e.unrecoverable, log) == ([0, 2], [0, 2], [])
    e, log = refused(4, [3], torn={1: ["actor"], 2: ["actor", "critic"]})
    assert str(e) == ("trainer ranks [3] of 4 are lost during a refresh of the host copies: the copies of rank(s) "
                      "[1, 2] are torn (actor), the state cannot be restored from the buddies")
    assert (e.lost, e.unrecoverable) == ([3], [1, 2])
    e, log = refused(4, [3], torn={2: ["critic", "actor"]})
    assert "the copies of rank(s) [2] are torn (critic)" in str(e)
    e, _ = refused(3, [0], extra={1: ({"iteration": 4},), 2: ({"iteration": 3},)})
    assert "are of different refreshes" in str(e) and (e.lost, e.unrecoverable) == ([0], [1, 2])
    e, log = refused(4, [1], gone=[11, 13], error=WorldLost)
    assert str(e) == ("trainer ranks [1, 3] of 4 are lost with devices [11, 13], which are not placed any more; the "
                      "2 devices left cannot take the run (no smaller world is built here)")
    assert (e.lost, e.devices_gone, e.unrecoverable) == ([1, 3], [11, 13], [])

    class Refused(ValueError):
        problems = ["train: dp=3 does not divide 8", "another"]

    def config_for(n):
        raise Refused("not this")

    e, _ = refused(4, [1], gone=[11], error=WorldLost, config_for=config_for)
    assert str(e).endswith("the 3 devices left cannot take the run (Refused: train: dp=3 does not divide 8)")
    e, _ = refused(4, [1], gone=[11], error=WorldLost, config_for=lambda n: 1 / 0)
    assert str(e).endswith("the 3 devices left cannot take the run (ZeroDivisionError: division by zero)")


def test_lost_ranks_are_the_dead_and_the_silent(world):
    """``lost_ranks`` asks every rank for its pid in the control group, waits ``deadline_s`` for
    all of them: a rank that does not answer is killed and lost, one that answers Ray's actor
    error is lost, the others are not."""
    from ray.exceptions import ActorDiedError, RayActorError

    from rlhf_switch.elastic.manager import CONTROL
    from rlhf_switch.elastic.recovery import lost_ranks

    ray, _, workers, log, _ = world(5, unanswered=[3])
    workers[1].answers["pid"] = RayActorError()
    workers[4].answers["pid"] = ActorDiedError()
    for r in (0, 2, 3):
        workers[r].answers["pid"] = 1000 + r
    assert lost_ranks(ray, workers, deadline_s=12.0) == [1, 3, 4]
    assert log == [("pid", r, CONTROL) for r in range(5)] + [("wait", 5, 12.0), ("kill", 3)]
    ray, _, workers, log, _ = world(2)
    workers[1].answers["pid"] = RuntimeError("not an actor's death")
    with pytest.raises(RuntimeError, match="not an actor's death"):
        lost_ranks(ray, workers)
    assert ("wait", 2, 300.0) in log


# --- over Ray: real actors, real DeepSpeed ZeRO-3, a real kill -9 ----------------------------------

def _kill_during(ray, workers, victim: int, step: int, after_s: float = 0.5) -> list:
    """Start training step ``step`` on every other rank (they wait for ``victim`` in the step's
    first collective), kill -9 rank ``victim``'s process, then ask it for the step too; returns
    how each rank's call ended (an exception or its result). The others are always mid-step when
    the kill comes: a timer after starting the victim's step too could fire after a fast step."""
    import os
    import signal
    import time

    from test_elastic import _batch

    pids = ray.get([w.pid.remote() for w in workers], timeout=120)
    refs = {r: w.train_on.remote(_batch(step)) for r, w in enumerate(workers) if r != victim}
    time.sleep(after_s)
    os.kill(pids[victim], signal.SIGKILL)
    refs[victim] = workers[victim].train_on.remote(_batch(step))
    refs = [refs[r] for r in range(len(workers))]
    ends = []
    for ref in refs:
        try:
            ends.append(ray.get(ref, timeout=300))
        except Exception as e:  # noqa: BLE001 - what the test looks at
            ends.append(e)
    return ends


@contextmanager
def _refreshed_world(ray, tmp_path, world: int):
    """A ZeRO-3 DP``world`` trainer over Ray (devices ``0..world-1``), trained one step and its
    host copies refreshed once (``{"iteration": 1}``): yields ``(config, devices, held, refresh
    reports)``; ``held["workers"]`` are the actors killed at the end (a test that replaces the
    world puts the new ones there), and every device is released."""
    from test_elastic import _config, _train

    from recipes.cluster import Cluster
    from recipes.common import warm_start
    from rlhf_switch.elastic.manager import Devices
    from rlhf_switch.rl.config import load_config

    cfg = _config(tmp_path / "run", world)
    init = warm_start(load_config(cfg), tmp_path / "init", quiet=True)
    devices = Devices(ray)
    devices.acquire(range(world))
    cluster = Cluster(load_config(cfg), ray, quiet=True, devices=devices.slots(range(world)))
    held = {"workers": []}
    try:
        cluster.build(init, None)
        held["workers"] = cluster.workers
        _train(ray, cluster.workers, 0)
        refreshed = ray.get([w.redundancy_refresh.remote(1, {"iteration": 1}) for w in cluster.workers],
                            timeout=300)
        yield cfg, devices, held, refreshed
    finally:
        for w in held["workers"]:
            ray.kill(w)
        devices.release_all()


@pytest.mark.slow
def test_a_killed_trainer_is_restored_from_the_buddy_copies_bit_for_bit(ray_session, tmp_path):
    """ZeRO-3 DP4 over Ray: step 0, refresh (state S0), step 1 (state S1, the uninterrupted run);
    then rank 2 is kill -9'd during step 2. ``lost_ranks`` names it; ``recover`` builds a new DP4
    world (a replacement for rank 2) and moves the survivors' host copies into it: its state equals
    S0 bit for bit (not the engines' state when the kill came), and re-running step 1 gives the
    uninterrupted step 1 — losses, gradient norm and S1 — bit for bit. No checkpoint exists."""
    from test_elastic import _differences, _gathered, _train

    from actors.hybrid import remote_class
    from rlhf_switch.elastic.recovery import lost_ranks, recover

    ray = ray_session
    with _refreshed_world(ray, tmp_path, 4) as (cfg, devices, held, refreshed):
        alive = held["workers"]
        s0 = _gathered(ray, alive)
        first = _train(ray, alive, 1)
        s1 = _gathered(ray, alive)
        assert _differences(s0, s1) != []
        ends = _kill_during(ray, alive, victim=2, step=2)
        assert isinstance(ends[2], Exception), ends[2]
        lost = lost_ranks(ray, alive)
        assert lost == [2]
        rec = recover(ray, remote_class(num_cpus=0.5, num_gpus=0.5), cfg, devices, range(4), alive, lost)
        alive = held["workers"] = rec.workers
        assert rec.survivors == [0, 1, 3] and rec.bytes_moved > 0
        assert _differences(s0, _gathered(ray, alive)) == []
        again = _train(ray, alive, 1)
        for k in ("policy_loss", "grad_norm", "clipfrac", "steps"):
            assert again[k] == first[k], (k, again[k], first[k])
        assert _differences(s1, _gathered(ray, alive)) == []
        assert not (tmp_path / "run" / "checkpoints").exists()
        print(f"\nrefresh: {max(r['seconds'] for r in refreshed):.3f} s, "
              f"{sum(r['bytes_local'] + r['bytes_received'] for r in refreshed)} B copied "
              f"({sum(r['bytes_received'] for r in refreshed)} B from the buddies); recovery "
              f"{rec.seconds:.1f} s (detect {rec.detect_s:.1f}, build {rec.build_s:.1f}, move {rec.move_s:.2f}), "
              f"{rec.bytes_moved} B moved")


@pytest.mark.slow
def test_a_survivor_answers_while_its_main_call_is_stuck_and_a_torn_copy_is_refused(ray_session, tmp_path):
    """ZeRO-3 DP2 over Ray, refreshed once; then rank 0 alone refreshes again: its move waits for
    rank 1 in the world's collective (until the gloo timeout), its host copy half written.
    Meanwhile the recovery's calls answer from the actors' control concurrency group:
    ``lost_ranks`` finds nobody lost while that refresh is still pending, rank 0 says its copy
    is torn, and ``recover`` (rank 1 lost) refuses it with ``StateLost`` before building anything."""
    import time

    from actors.hybrid import remote_class
    from rlhf_switch.elastic.manager import CONTROL
    from rlhf_switch.elastic.recovery import StateLost, lost_ranks, recover

    ray = ray_session
    with _refreshed_world(ray, tmp_path, 2) as (cfg, devices, held, _):
        workers = held["workers"]

        def torn() -> list:
            return ray.get([w.host_copy_torn.options(concurrency_group=CONTROL).remote() for w in workers],
                           timeout=60)

        assert torn() == [[], []]
        assert ray.get([w.host_copy_extra.options(concurrency_group=CONTROL).remote() for w in workers],
                       timeout=60) == [[{"iteration": 1}]] * 2
        stuck = workers[0].redundancy_refresh.remote(1, {"iteration": 2})
        deadline = time.monotonic() + 60
        while not torn()[0]:  # rank 0's refresh has entered its move
            assert time.monotonic() < deadline, "rank 0's refresh never started its move"
            time.sleep(0.1)
        assert lost_ranks(ray, workers, deadline_s=60) == []
        assert ray.wait([stuck], timeout=0)[0] == []  # answered while the refresh still waits for rank 1
        assert torn()[1] == []
        with pytest.raises(StateLost, match="torn") as e:
            recover(ray, remote_class(num_cpus=0.5, num_gpus=0.5), cfg, devices, range(2), workers, [1])
        assert e.value.unrecoverable == [0]


@pytest.mark.slow
def test_grpo_with_host_redundancy_survives_a_killed_trainer_without_a_checkpoint(ray_session, tmp_path):
    """``elastic.redundancy: host`` in the loop: GRPO on ZeRO-3 DP2 (torch rollout), trainer rank
    1 kill -9'd by pid during iteration 1's train phase. The loop finds it lost, restores the
    state of iteration 1's refresh from rank 0's host copy into a new DP2 world (a replacement
    actor) and runs iteration 1 again: the state at the re-run's train phase equals the state at
    the first attempt's bit for bit, no checkpoint exists or is read, and the run — rewards,
    losses, the final weights and Adam moments — equals the uninterrupted run bit for bit. Both
    ranks killed (no copy survives) in a run that saves checkpoints: the loop falls back to the
    newest checkpoint, says so, and ends with the same weights too."""
    import os
    import signal

    from test_elastic import _config, _differences, _gathered

    from recipes.grpo import run
    from rlhf_switch.engines.full_state import FullState
    from rlhf_switch.models import model_spec

    ray = ray_session

    def config(out):
        cfg = _config(out, 2)
        cfg["elastic"] = {"redundancy": "host"}
        return cfg

    seen = {}

    def kill_in_train(it, phase, cluster):
        if it != 1:
            return
        seen.setdefault("states", []).append(_gathered(ray, cluster.workers))
        if len(seen["states"]) == 1:
            # killed as the train phase starts, before the train call reaches it: the iteration is
            # half done (synced, copied, generated) whatever the machine's speed
            os.kill(ray.get(cluster.workers[1].pid.remote(), timeout=60), signal.SIGKILL)

    mine = run(config(tmp_path / "killed"), quiet=True, phase_hook=kill_in_train)
    (event,) = [r["recovery"] for r in mine if "recovery" in r]
    assert event["kind"] == "trainer_lost" and event["lost_ranks"] == [1] and event["survivors"] == [0]
    assert event["restored_iteration"] == 1 and "fell_back_to" not in event and event["bytes_moved"] > 0
    assert len(seen["states"]) == 2 and _differences(*seen["states"]) == []
    assert not (tmp_path / "killed" / "checkpoints").exists()
    ref = run(config(tmp_path / "whole"), quiet=True)
    steps, theirs = ([r for r in recs if "reward_mean" in r] for recs in (mine, ref))
    assert [r["iteration"] for r in steps] == [0, 1, 2] == [r["iteration"] for r in theirs]
    for a, b in zip(steps, theirs):
        assert (a["reward_mean"], a["policy_loss"], a["grad_norm"]) == (b["reward_mean"], b["policy_loss"], b["grad_norm"])
        assert a["redundancy_bytes"] > 0

    # both ranks lost in iteration 2 (rank 0's copy was on rank 1 and the other way round): the
    # newest checkpoint (iteration 1's), said so, and iteration 2 again — the same run too
    both = config(tmp_path / "both")
    both["checkpoint"] = {"save_every": 1, "keep": 2}

    def kill_both(it, phase, cluster):
        if it == 2 and "both" not in seen:
            seen["both"] = ray.get([w.pid.remote() for w in cluster.workers], timeout=60)
            for pid in seen["both"]:
                os.kill(pid, signal.SIGKILL)

    fell = run(both, quiet=True, phase_hook=kill_both)
    (back,) = [r["recovery"] for r in fell if "recovery" in r]
    assert back["lost_ranks"] == [0, 1] and back["fell_back_to"].endswith("step_2")
    assert [r["iteration"] for r in fell if "reward_mean" in r] == [0, 1, 2]
    spec = model_spec(config(tmp_path)["model"]["hf_config"])
    a, b, c = (FullState.load_dir(p / "final", spec) for p in (tmp_path / "killed", tmp_path / "whole",
                                                               tmp_path / "both"))
    assert same_full_state(a, b) and same_full_state(c, b)
    print(f"\nloop: refresh {max(r['redundancy_seconds'] for r in steps):.3f} s, {steps[0]['redundancy_bytes']} B "
          f"per iteration; recovery {event['seconds']:.1f} s (detect {event['detect_s']:.1f}, of which probe "
          f"{event['probe_s']:.1f}; build {event['build_s']:.1f} s, move "
          f"{event['move_s']:.2f} s), {event['bytes_moved']} B; both ranks lost: back on the checkpoint in "
          f"{back['seconds']:.1f} s")


@pytest.mark.slow
def test_host_redundancy_with_an_elastic_schedule_survives_kills_around_the_resize(ray_session, tmp_path):
    """``elastic.redundancy: host`` with ``elastic.schedule``: GRPO ZeRO-3 DP4 resized to DP2 before
    iteration 1 (the DP2 world built during iteration 0). Rank 1 is kill -9'd during iteration 0's
    train phase, while the DP2 world is being built: the build is abandoned (one record, re-planned),
    the DP4 world recovered from the host copies, iteration 0 runs again and the DP2 world is built
    again. Rank 1 of the DP2 world is kill -9'd during iteration 1 (the first after the resize): it
    is restored from the DP2 world's own copies (its first refresh) into a new DP2 world. No
    checkpoint; the state at each re-run's train phase equals the first attempt's bit for bit, and
    the run — rewards, losses, final weights and Adam moments — equals the uninterrupted run with
    the same schedule bit for bit."""
    import os
    import signal

    from test_elastic import _config, _differences, _gathered

    from recipes.grpo import run
    from rlhf_switch.engines.full_state import FullState
    from rlhf_switch.models import model_spec

    ray = ray_session

    def config(out):
        cfg = _config(out, 4)
        cfg["algorithm"].update(iterations=2, prompts_per_iteration=4, micro_batch_size=2)  # fits DP4 and DP2
        dp2 = _config(out, 2)
        cfg["elastic"] = {"redundancy": "host", "schedule": [{"iteration": 1, "world_size": 2, "train": dp2["train"],
                                                              "rollout": dp2["rollout"]}]}
        return cfg

    states, kills = {}, []

    def kill_in_train(it, phase, cluster):
        if phase != "train" or it > 1:
            return
        states.setdefault(it, []).append(_gathered(ray, cluster.workers))
        if it not in [k for k, _ in kills]:
            kills.append((it, cluster.world))
            os.kill(ray.get(cluster.workers[1].pid.remote(), timeout=60), signal.SIGKILL)

    mine = run(config(tmp_path / "killed"), quiet=True, phase_hook=kill_in_train)
    assert kills == [(0, 4), (1, 2)]
    abandoned, done = [r["resize"] for r in mine if "resize" in r]
    assert abandoned["replanned"] and "was being built" in abandoned["abandoned"], abandoned
    assert "abandoned" not in done and done["iterations_during_build"] == 1 and done["new"].startswith("world 2")
    first, second = [r["recovery"] for r in mine if "recovery" in r]
    for event, at, world in ((first, 0, 4), (second, 1, 2)):
        assert event["lost_ranks"] == [1] and event["restored_iteration"] == at and event["new_world"] == world
        assert "fell_back_to" not in event and event["bytes_moved"] > 0
    assert all(len(states[it]) == 2 and _differences(*states[it]) == [] for it in (0, 1))
    assert not (tmp_path / "killed" / "checkpoints").exists()
    ref = run(config(tmp_path / "whole"), quiet=True)
    steps, theirs = ([r for r in recs if "reward_mean" in r] for recs in (mine, ref))
    assert [r["iteration"] for r in steps] == [0, 1] == [r["iteration"] for r in theirs]
    for a, b in zip(steps, theirs):
        assert (a["reward_mean"], a["policy_loss"], a["grad_norm"]) == (b["reward_mean"], b["policy_loss"], b["grad_norm"])
    spec = model_spec(config(tmp_path)["model"]["hf_config"])
    a, b = (FullState.load_dir(p / "final", spec) for p in (tmp_path / "killed", tmp_path / "whole"))
    assert same_full_state(a, b)
    print("\nschedule + redundancy: " + "; ".join(
        f"recovery {when} {e['seconds']:.1f} s (detect {e['detect_s']:.1f}, build {e['build_s']:.1f}, move "
        f"{e['move_s']:.2f} s, {e['bytes_moved']} B)" for when, e in (("during the DP2 build", first),
                                                                   ("after the resize", second))))


def test_host_redundancy_is_refused_where_it_cannot_run(tmp_path):
    from test_elastic import _config

    from rlhf_switch.problems import CHECKS, run_problems
    from rlhf_switch.rl.config import ConfigError, load_config

    def elastic_problems(data):  # the pre-start check "elastic" alone
        return run_problems(load_config(data), skip=tuple(n for n in CHECKS if n != "elastic"))

    cfg = _config(tmp_path, 2)
    assert load_config({**cfg, "elastic": {"redundancy": "host"}}).elastic.redundancy == "host"
    assert elastic_problems({**cfg, "elastic": {"redundancy": "host"}}) == []
    assert load_config(cfg).elastic is None
    bad = {**cfg, "world_size": 1, "train": {**cfg["train"], "dp": 1}, "rollout": {**cfg["rollout"], "dp": 1},
           "elastic": {"redundancy": "host", "schedule": [{"iteration": 1, "world_size": 2, "train": cfg["train"],
                                                           "rollout": cfg["rollout"]}]}}
    text = " ".join(elastic_problems(bad))
    assert "world_size >= 2" in text and "not supported together" not in text
    assert "elastic.schedule[0].world_size" not in text  # the entry's world (2) keeps copies
    # a schedule and resize requests (a node added) with redundancy: every world of the run >= 2
    dp1 = {**cfg, "world_size": 1, "train": {**cfg["train"], "dp": 1}, "rollout": {**cfg["rollout"], "dp": 1}}
    both = {**cfg, "elastic": {"redundancy": "host", "on_node_change": "resize",
                               "schedule": [{"iteration": 2, "world_size": 4, "train": {**cfg["train"], "dp": 4},
                                             "rollout": {**cfg["rollout"], "dp": 4}}]}}
    assert load_config(both).elastic.schedule[0].world_size == 4 and elastic_problems(both) == []
    both["elastic"]["schedule"].append({"iteration": 3, "world_size": 1, "train": dp1["train"],
                                        "rollout": dp1["rollout"]})
    assert elastic_problems(both) == ["elastic.schedule[1].world_size: 1 — elastic.redundancy: host needs every world "
                                      "of the run >= 2 (a rank's copy is kept by another rank)"]
    with pytest.raises(ConfigError, match="redundancy"):
        load_config({**cfg, "elastic": {"redundancy": "disk"}})


def test_the_survivors_copies_must_be_of_one_refresh():
    """A loss at the very end of a refresh can leave one survivor's copy complete (its buddy share
    came from a rank that had sent it) and another's never started: ``refreshed_alike`` names the
    refresh they share — the iteration the loop runs again — or refuses a mix with ``StateLost``."""
    from rlhf_switch.elastic.recovery import StateLost, refreshed_alike

    assert refreshed_alike([0, 2], [[{"iteration": 3}], [{"iteration": 3}]], [1]) == {"iteration": 3}
    assert refreshed_alike([0, 2, 3], [[{"iteration": 3}] * 2] * 3, [1]) == {"iteration": 3}  # PPO: two copies
    with pytest.raises(StateLost, match="different refreshes") as e:
        refreshed_alike([0, 2], [[{"iteration": 3}], [{"iteration": 2}]], [1])
    assert e.value.lost == [1] and e.value.unrecoverable == [0, 2]


def test_refreshed_alike_names_the_mix_and_reads_the_first_copy():
    """The message says which copies differ — one survivor's engines, or the survivors (each
    refresh named once, with a survivor holding it) —; the refresh returned is the first copy's,
    and nothing where the survivors hold no copy."""
    from rlhf_switch.elastic.recovery import StateLost, refreshed_alike

    with pytest.raises(StateLost) as e:
        refreshed_alike([0, 2, 3], [[{"iteration": 3}], [{"iteration": 2}], [{"iteration": 3}]], [1])
    assert str(e.value) == ("trainer ranks [1] are lost during a refresh of the host copies: the survivors' copies "
                            "(rank 3: [{'iteration': 3}], rank 2: [{'iteration': 2}]) are of different refreshes; the "
                            "state cannot be restored from the buddies")
    with pytest.raises(StateLost) as e:
        refreshed_alike([0, 2], [[{"iteration": 3}] * 2, [{"iteration": 3}, {"iteration": 2}]], [1])
    assert str(e.value) == ("trainer ranks [1] are lost during a refresh of the host copies: rank 2's engines' copies "
                            "([{'iteration': 3}, {'iteration': 2}]) are of different refreshes; the state cannot be "
                            "restored from the buddies")
    assert refreshed_alike([3], [[{"iteration": 5, "draw": 1}]], [0]) == {"iteration": 5, "draw": 1}
    assert refreshed_alike([0, 1], [[], []], [2]) == {}
    assert refreshed_alike([], [], [0]) == {}


def test_recovery_refuses_critic_copies_from_different_refreshes():
    """PPO keeps two host copies per rank (the actor's, then the critic's, refreshed one after the
    other). The survivors' actor copies agreeing is not enough: critic copies of different
    refreshes across survivors, or one survivor's actor and critic copies of different refreshes
    (a loss between the two refreshes), are a state pieced from two iterations — refused."""
    from rlhf_switch.elastic.recovery import StateLost, refreshed_alike

    both = [{"iteration": 3}, {"iteration": 3}]
    assert refreshed_alike([0, 2], [both, both], [1]) == {"iteration": 3}
    stale_critic = [{"iteration": 3}, {"iteration": 2}]
    for extras in ([both, stale_critic], [stale_critic, both], [stale_critic, stale_critic]):
        with pytest.raises(StateLost, match="different refreshes") as e:
            refreshed_alike([0, 2], extras, [1])
        assert e.value.lost == [1] and e.value.unrecoverable == [0, 2], extras
