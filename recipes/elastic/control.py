"""Elastic control between the loop's iterations: one controller (``ElasticControl``) the recipe
calls at four points, and the steps it takes.

    elastic = ElasticControl(state)            # the run's RunState (recipes.loop.loop), shared with the loop
    cluster = Cluster(..., elastic.acquire(ray))  # the run's devices, when anything elastic may move them
    elastic.between_iterations(it)             # a due resize committed (stop-the-world), Ray's node
                                               # events recorded, a resize request taken, the next
                                               # resize's world started in the background
    elastic.refresh_host_copy(it)              # in the sync phase (elastic.redundancy: host)
    it = elastic.recover(error, it)            # an iteration failed: a lost trainer restored from the
                                               # buddies' host copies (or the newest checkpoint), or
                                               # the error raised

It reaches the run only through that state — the config in force and the cluster (which a resize
or a recovery replaces), where the run writes, ``emit``, ``say``, ``hook`` and ``drop_rerun`` —,
never the loop. What each step moves is ``rlhf_switch.elastic``'s (resize plans, background
worlds, host copies, recovery) and ``recipes.elastic.resize``'s (vLLM replicas with the trainer
world); this module decides when, records what happened (one run-log record per event) and answers
resize requests.
"""
from __future__ import annotations

import time

from recipes.cluster import Cluster
from recipes.common import resolve_resume, write_run_config
from recipes.elastic.nodes import snapshot_nodes, watch_nodes
from recipes.elastic.resize import rollout_layout, trainer_layout

NO_COPY = {"bytes": 0, "seconds": 0.0}  # elastic.redundancy: none — nothing refreshed


class ElasticControl:
    """The loop's elastic state: the schedule still ahead, the world being built for the next
    resize (``pending``), the resize requests accepted, Ray's nodes as last seen and the iteration
    of the last host-copy refresh. Changes ``state.cluster`` and ``state.cfg`` where a resize or a
    recovery changes the world."""

    def __init__(self, state):
        cfg = state.cfg
        self.state, self.elastic = state, cfg.elastic
        self.schedule = [e for e in (cfg.elastic.schedule if cfg.elastic else []) if state.first < e.iteration <= state.last]
        self.redundancy = cfg.elastic.redundancy if cfg.elastic else "none"
        self.ray = self.devices = self.pending = self.nodes_seen = None
        self.requested: dict[int, dict] = {}  # iteration -> the resize request that scheduled it
        self.refreshed_at: int | None = None  # the iteration of the last host-copy refresh
        self.recovered: list[dict] = []       # recovery events since the last node watch

    def most_devices(self) -> int:
        """The most devices any world of the run uses (Ray is started for them)."""
        now = self.state.cfg.at_iteration(self.state.first)
        return max([now.world_size] + [e.world_size for e in self.schedule])

    def acquire(self, ray):
        """The device manager, where anything may resize the world or replace a rank: a schedule,
        resize requests (torch rollout or colocated vLLM replicas), a lost trainer's replacement."""
        from rlhf_switch.elastic.manager import Devices

        from rlhf_switch.engines.base import rollout_engine

        cfg, self.ray = self.state.cfg, ray
        rollout = rollout_engine(cfg.rollout.engine)
        if cfg.elastic is not None and (cfg.elastic.schedule or self.redundancy == "host"
                                        or (rollout.resizable and (rollout.placement == "worker" or cfg.rollout.colocate))):
            self.devices = Devices(ray)
            self.devices.acquire(range(cfg.at_iteration(self.state.first).world_size))
        return self.devices

    def started(self) -> None:
        """The first world is up: Ray's nodes as they are now (node events are changes from it)."""
        if self.elastic is not None:
            self.nodes_seen = snapshot_nodes(self.ray)

    # --- between iterations ----------------------------------------------------------------------
    def between_iterations(self, it: int) -> None:
        """Before iteration ``it``: the resize due now, node events, a resize request, and the
        background build of the next resize (started one iteration ahead)."""
        state = self.state
        if self.schedule and self.schedule[0].iteration == it:  # the resize due now: stop-the-world
            state.hook(it, "before_resize")
            if self.pending is None:  # its build abandoned for a recovery that restored this iteration
                self.pending = self._start_resize(self.schedule[0], it)
            rec = self._commit_resize(self.pending, self.schedule.pop(0), it, self.requested.pop(it, None))
            state.hook(it, "after_resize")
            self.pending = None
            state.emit(rec, it)
            if "abandoned" not in rec["resize"]:
                # the new world's actors hold no host copies until its first refresh (this
                # iteration's, after the sync): a loss before it falls back to the checkpoint
                self.refreshed_at = None
        if self.elastic is not None:
            self.nodes_seen, notes = watch_nodes(state.out_dir, state.cfg, self.nodes_seen, self.ray, it, state.say,
                                                 self.recovered)
            self.recovered = []
            for note in notes:
                state.emit(note, it)
            note = self._take_request(it)
            if note is not None:
                state.emit(note, it)
        if self.schedule and self.pending is None and self.schedule[0].iteration - 1 <= it:
            self.pending = self._start_resize(self.schedule[0], it)

    def refresh_host_copy(self, it: int) -> dict:
        """``elastic.redundancy: host``: the trainer's state as of now kept by a buddy rank."""
        if self.redundancy != "host":
            return NO_COPY
        copied = self.state.cluster.refresh_host_copy({"iteration": it})
        self.refreshed_at = it
        return copied

    def _take_request(self, it: int) -> dict | None:
        """A pending resize request (``elastic.requests``) checked as an ``elastic.schedule``
        entry at ``it + 1`` and, if it passes, made one (built during ``it``, committed before
        ``it + 1``). The config in force becomes the one with the entry; a refused request
        returns the record saying why — the run trains on."""
        from rlhf_switch.elastic import requests
        from rlhf_switch.problems import check_resize_request
        from rlhf_switch.rl.config import ConfigError

        state = self.state
        req = requests.take_request(state.out_dir)
        if req is None:
            return None
        held = None
        if self.devices is not None:
            res = self.ray.cluster_resources()
            held = int(min(res.get("GPU", 0), res.get("CPU", 0)))
        try:
            new, entry = check_resize_request(state.cfg, req, it + 1, state.last, held)
        except ConfigError as e:
            requests.answer(state.out_dir, req, "refused", str(e), problems=e.problems, iteration=it)
            state.say(str(e))
            return {"iteration": it, "event": {"kind": "request_refused", "request": req, "problems": e.problems}}
        self.schedule.append(entry)
        self.schedule.sort(key=lambda e: e.iteration)
        self.requested[entry.iteration] = req
        state.cfg = new
        write_run_config(state.out_dir, new)  # the accepted entry in the run's config.yaml: a resume resizes too
        requests.answer(state.out_dir, req, "accepted", f"resize to {entry.world_size} devices before iteration "
                        f"{entry.iteration}; the new world is built during iteration {it}", iteration=entry.iteration)
        state.say(f"resize request {req.get('id')} accepted: {entry.world_size} devices before iteration "
                 f"{entry.iteration}")
        return None

    # --- resizes ---------------------------------------------------------------------------------
    def _start_resize(self, entry, it: int):
        """Start building the world of ``entry`` in the background (its actors on devices
        ``0..world_size-1``) while iteration ``it`` runs on the current world."""
        from actors.hybrid import remote_class
        from rlhf_switch.elastic import ResizePlan
        from rlhf_switch.elastic.manager import start_world

        cluster, init_dir = self.state.cluster, self.state.init_dir
        new = self.state.cfg.at_iteration(entry.iteration)
        if not cluster.in_world:  # vLLM replicas: their layout, or the trainer world with them
            if (new.world_size, new.train, new.reference) == (cluster.world, cluster.cfg.train, cluster.cfg.reference):
                pending = cluster.start_replicas(new, init_dir)
                pending.started_at, pending.config = it, new
                return pending
            from recipes.elastic.resize import start_combined_resize

            return start_combined_resize(self.ray, cluster, new, self.devices, init_dir, it)
        plan = ResizePlan(tuple(range(cluster.world)), tuple(range(new.world_size)))
        pending = start_world(self.ray, remote_class(num_cpus=0.5, num_gpus=0.5), new.model_dump(), self.devices, plan,
                              init_dir=str(init_dir), device=cluster.device)
        pending.started_at, pending.config = it, new
        return pending

    def _commit_resize(self, pending, entry, it: int, request=None) -> dict:
        """The stop-the-world before iteration ``it``: wait for the background build if it is not
        done, move the state over the union of old and new ranks, adopt the new world. A build
        that failed is abandoned with one message and the run goes on in the current world.
        ``request``: the resize request this entry came from, answered here."""
        from rlhf_switch.elastic import ResizeError

        cluster = self.state.cluster
        if not cluster.in_world:
            from recipes.elastic.resize import PendingCombined

            if isinstance(pending, PendingCombined):
                return self._commit_combined_resize(pending, it, request)
            return self._commit_rollout_resize(pending, it, request)
        old = trainer_layout(cluster.cfg)
        t0 = time.perf_counter()
        try:
            pending.wait()
            waited = time.perf_counter() - t0
            result = pending.commit(cluster.workers)
        except ResizeError as e:
            return self._abandoned(it, str(e), request)
        cluster.adopt(pending.config, result.workers, self.devices.slots(result.plan.new_devices))
        event = {"kind": "requested" if request else "planned", "old": old, "new": trainer_layout(cluster.cfg),
                 "iterations_during_build": it - pending.started_at,
                 **({"reason": request["reason"]} if request and request.get("reason") else {}),
                 "background_s": result.background_s, "waited_for_build_s": waited,
                 "stop_the_world_s": result.stop_the_world_s, "release_s": result.release_s,
                 "bytes_moved": result.bytes_moved, "bytes_moved_by_engine": result.bytes_moved_by_engine}
        return self._resized(it, event, f"built in the background in {result.background_s:.1f} s", request)

    def _commit_rollout_resize(self, pending, it: int, request) -> dict:
        """Before iteration ``it``: the new replicas take over (``Cluster.swap_replicas``: the
        weight channel re-formed over the trainer ranks and them, one sync fills them, the old
        ones shut down). New replicas that cannot be taken: abandoned with one message, the old
        ones generate on."""
        cluster = self.state.cluster
        old = rollout_layout(cluster.cfg)
        try:
            swap = cluster.swap_replicas()
        except ValueError as e:
            return self._abandoned(it, str(e), request, part="rollout ")
        event = {"kind": "requested" if request else "planned", "part": "rollout", "old": old,
                 "new": rollout_layout(cluster.cfg), "iterations_during_build": it - pending.started_at, **swap}
        return self._resized(it, event, f"new replicas started in the background in {swap['background_s']:.1f} s",
                             request, part="rollout ")

    def _commit_combined_resize(self, pending, it: int, request) -> dict:
        """Before iteration ``it``: the new trainer world and its new vLLM replicas take over in one
        stop-the-world (``recipes/elastic/resize.py``); either side not built: both abandoned, one message."""
        from recipes.elastic.resize import commit_combined_resize

        event = commit_combined_resize(self.ray, self.state.cluster, pending, self.devices, it)
        if request is not None:
            event["kind"] = "requested"
            if request.get("reason"):
                event["reason"] = request["reason"]
        if "abandoned" in event:
            return self._abandoned(it, event.pop("abandoned"), request, event=event)
        return self._resized(it, event, f"built in the background in {event['background_s']:.1f} s", request,
                             moved=f" (trainer move {event['trainer_move_s']:.2f} s, replicas filled "
                                   f"{event['fill_sync_s']:.2f} s)")

    def _abandoned(self, it: int, why: str, request, part: str = "", event: dict | None = None) -> dict:
        """A resize before iteration ``it`` that did not happen: said in one line, the request (if
        it came from one) answered ``abandoned``, and its record (``event``: what is known of it)."""
        from rlhf_switch.elastic import requests

        self.state.say(f"{part}resize before iteration {it} abandoned: {why}")
        if request is not None:
            requests.answer(self.state.out_dir, request, "abandoned", why, iteration=it)
        return {"iteration": it, "resize": {"kind": "requested" if request else "planned", **(event or {}),
                                            "abandoned": why}}

    def _resized(self, it: int, event: dict, built: str, request, part: str = "", moved: str = "") -> dict:
        """A resize done before iteration ``it``: the request (if any) answered ``done`` with its
        event, one line said (``built``: how the new side was started; ``moved``: the
        stop-the-world's parts), and the run-log record."""
        from rlhf_switch.elastic import requests

        old, new = event["old"], event["new"]
        if request is not None:
            requests.answer(self.state.out_dir, request, "done", f"{part}resized before iteration {it}: {old} -> {new}",
                            iteration=it, event=event)
        self.state.say(f"{part}resized before iteration {it}: {old} -> {new}; {built} "
                      f"({event['iterations_during_build']} iteration(s) meanwhile, {event['waited_for_build_s']:.1f} s "
                      f"waited), stop-the-world {event['stop_the_world_s']:.2f} s{moved}, {event['bytes_moved']} B moved")
        return {"iteration": it, "resize": event, "resize_stop_the_world_s": event["stop_the_world_s"],
                "resize_background_s": event["background_s"]}

    # --- a failed iteration ----------------------------------------------------------------------
    def recover(self, error: Exception, it: int) -> int:
        """Iteration ``it`` failed. ``elastic.redundancy: host`` and a trainer lost: the next
        resize's build abandoned, the trainer recovered (``_recover_trainer``), the schedule
        trimmed to the devices left, the re-run iterations' records dropped; returns the iteration
        to run again. Anything else: ``error`` is raised."""
        if self.redundancy != "host":
            raise error
        state = self.state
        failed_at, world = time.perf_counter(), state.cluster.world
        if self.pending is not None:  # the next resize's new world, being built: it goes first
            state.emit(self._abandon_build(self.schedule[0], error, it), it)
        it, rec = self._recover_trainer(error, failed_at)
        self.refreshed_at = None  # the recovered world's actors hold no host copies until its first refresh
        if state.cluster.world < world:  # shrunk to the devices left: the resizes that need more are dropped
            for note in self._drop_entries(state.cluster.world, it):
                state.emit(note, it)
        state.drop_rerun(it)
        state.emit(rec, it)
        self.recovered.append(rec["recovery"])
        return it

    def _abandon_build(self, entry, error: Exception, it: int) -> dict:
        """An iteration failed while the new world of ``entry`` was being built: the build is
        abandoned before the recovery — its actors killed (each holds half of a kept device, which
        a lost rank's replacement may need), the devices it added released. The entry stays in the
        schedule: the recovery runs an iteration at or before the one the build started in again,
        and the build starts again there (re-planned). Returns the record (``abandoned``, ``replanned``)."""
        self.pending.abandon()
        self.pending = None
        why = (f"iteration {it} failed ({type(error).__name__}) while the new world was being built; its actors "
               f"killed, its added devices released; built again when iteration {entry.iteration - 1} runs again")
        return self._abandoned(entry.iteration, why, None, event={"replanned": True})

    def _drop_entries(self, world: int, it: int) -> list[dict]:
        """A recovery shrank the run to ``world`` devices (a node lost): the schedule entries that
        need more devices are dropped — their build would wait for devices that are gone —, each
        recorded (its request, if any, answered ``abandoned``)."""
        notes = []
        for entry in [e for e in self.schedule if e.world_size > world]:
            self.schedule.remove(entry)
            why = (f"the recovery before iteration {it} left the run {world} devices, the resize needs "
                   f"{entry.world_size}; dropped, the run trains on in the recovered world")
            notes.append(self._abandoned(entry.iteration, why, self.requested.pop(entry.iteration, None)))
        return notes

    def _recover_trainer(self, error: Exception, failed_at: float) -> tuple[int, dict]:
        """When a trainer actor is lost (dead, or no answer within the deadline), restore the
        state of the last refresh from the survivors' host copies (``rlhf_switch.elastic.recovery``)
        into a new world — the same size with a replacement on each lost rank's device, or, where
        devices went with a lost node, the devices left with the layouts scaled along DP
        (``problems.scaled_run``; the run goes on in it) — and return (iteration to run again,
        run-log record); both an owner and its copy's holder lost, or no valid smaller world: the
        newest checkpoint (``_fall_back_to_checkpoint``). No trainer lost: ``error`` is raised."""
        from actors.hybrid import remote_class
        from rlhf_switch.elastic.recovery import StateLost, WorldLost, lost_ranks, recover
        from rlhf_switch.problems import scaled_run

        state, cluster = self.state, self.state.cluster
        probe_s = time.perf_counter()
        lost = lost_ranks(self.ray, cluster.workers)
        probe_s = time.perf_counter() - probe_s
        if not lost:
            raise error
        state.say(f"trainer rank(s) {lost} lost ({type(error).__name__}: {str(error).splitlines()[0][:200]})")
        old, old_cfg, where = trainer_layout(cluster.cfg), cluster.cfg, cluster.rank_nodes()
        smaller = {}

        def config_for(world: int) -> dict:
            smaller["cfg"] = scaled_run(old_cfg, world)
            return smaller["cfg"].model_dump()

        try:
            if self.refreshed_at is None:
                raise StateLost("the trainer was lost before its state was first copied to the buddies", lost, lost)
            rec = recover(self.ray, remote_class(num_cpus=0.5, num_gpus=0.5), old_cfg.model_dump(), self.devices,
                          range(cluster.world), cluster.workers, lost, shift=cluster.buddy_shift,
                          init_dir=str(state.init_dir), device=cluster.device, failed_at=failed_at,
                          config_for=config_for)
        except (StateLost, WorldLost) as e:
            return self._fall_back_to_checkpoint(e, failed_at)
        # the iteration the copies were refreshed at (a loss at the very end of a refresh: the copies
        # are complete and newer than the last refresh the driver saw return)
        restored = int(rec.extra.get("iteration", self.refreshed_at))
        new_cfg = smaller["cfg"] if rec.devices_gone else old_cfg
        self.devices.renumber(rec.devices)  # the run's world stays on devices 0..n-1
        cluster.adopt(new_cfg, rec.workers, self.devices.slots(range(new_cfg.world_size)))
        how = (f"devices {rec.devices_gone} gone with their node: shrunk to the {new_cfg.world_size} left, layouts "
               f"scaled along DP" if rec.devices_gone else f"a replacement for rank(s) {rec.lost}")
        event = rec.event(old, f"{trainer_layout(new_cfg)} ({how})")
        # probe_s: of detect_s, the actors asked (lost_ranks); the rest waits on Ray's placement of the devices
        event.update(restored_iteration=restored, lost_nodes=sorted({where[r] for r in rec.lost}), probe_s=probe_s,
                     action=f"recovered to {new_cfg.world_size} devices from the host copies" +
                            (" (a smaller world)" if rec.devices_gone else ""))
        state.say(f"recovered without a checkpoint in {rec.seconds:.1f} s onto {trainer_layout(new_cfg)} ({how}; "
                 f"build {rec.build_s:.1f} s, move {rec.move_s:.2f} s, {rec.bytes_moved} B from the survivors' host "
                 f"copies); iteration {restored} runs again")
        return restored, {"iteration": restored, "recovery": event, "recovery_seconds": rec.seconds}

    def _fall_back_to_checkpoint(self, lost, failed_at: float) -> tuple[int, dict]:
        """The state a lost trainer held is gone from every host copy, or no smaller world takes
        it (``WorldLost``): a new world of the same size from the newest checkpoint of the run
        (none, or the run's devices not all placed: a clear error)."""
        from rlhf_switch.elastic.recovery import WorldLost

        state = self.state
        try:
            ckpt, at = resolve_resume(True, state.out_dir, state.iterations)
        except FileNotFoundError:
            raise RuntimeError(f"trainer lost and not recoverable: {lost}; and the run has no checkpoint to fall "
                               f"back to (checkpoint.save_every)") from lost
        cfg = state.cluster.cfg
        missing = sorted(set(range(cfg.world_size)) - set(self.devices.placed(range(cfg.world_size))))
        if missing:  # a lost node's devices: the checkpoint needs the run's whole world back
            raise RuntimeError(f"trainer lost and not recoverable: {lost}; and devices {missing} of the run's "
                               f"{cfg.world_size} are not placed any more, so the checkpoint {ckpt} has no world "
                               f"to load into") from lost
        state.say(f"{lost}: falling back to the newest checkpoint {ckpt} (iteration {at}); iteration {at + 1} "
                 f"runs again")
        state.cluster.shutdown(graceful=False)
        state.cluster = Cluster(cfg, self.ray, state.quiet, devices=self.devices.slots(range(cfg.world_size)))
        state.cluster.build(state.init_dir, ckpt)
        event = {"kind": "trainer_lost", "lost_ranks": lost.lost, "unrecoverable": lost.unrecoverable,
                 **({"devices_gone": lost.devices_gone} if isinstance(lost, WorldLost) else {}),
                 "fell_back_to": str(ckpt), "restored_iteration": at + 1, "seconds": time.perf_counter() - failed_at}
        return at + 1, {"iteration": at + 1, "recovery": event, "recovery_seconds": event["seconds"]}

    # --- the end ---------------------------------------------------------------------------------
    def close(self, graceful: bool) -> None:
        """A build still running abandoned, the run's actors stopped, its devices released."""
        if self.pending is not None:
            self.pending.abandon()
        if self.state.cluster is not None:
            self.state.cluster.shutdown(graceful=graceful)
        if self.devices is not None:
            self.devices.release_all()
