"""The run's weight channel, as the driver drives it: opened between the trainer ranks and the rollout
engine's workers (``open_channel``), the replicas' receive posted ahead (``stand_by``), each sync
(``sync``) and what a failed one lost (``_sync_failure``), its members and their counters.
``ChannelMixin`` is the part of ``Cluster`` that does it (``recipes.cluster.cluster``); the channel
itself is ``rlhf_switch.engines.channel``."""
from __future__ import annotations

import time

from recipes.cluster.calls import SyncFailed, wait_all
from rlhf_switch.timeouts import CONTROL_S, SYNC_S


class ChannelMixin:
    """``Cluster``'s weight channel (its state: ``channel_opened``, ``handoff``, ``_standing_by``)."""

    # --- the weight channel train -> rollout -------------------------------------------------------
    def open_channel(self, budget_bytes: int | None = None) -> None:
        """Form the weight channel between the trainer's ranks and the rollout workers: one process
        group, both layouts placed on it, handed out once. Called again only when a layout changes
        (it re-plans; the members' groups are made anew only then)."""
        from rlhf_switch.engines.channel import Endpoint, resolve_handoff
        from rlhf_switch.routing.executor import DEFAULT_BUDGET
        from rlhf_switch.vps.placement import place

        if self.in_world:  # the rollout engine lives on the trainer's ranks: a group of their world
            self.all("channel_open", desc="open weight channel")
        else:
            # the handoff first: an impossible ``ipc`` is refused before anything is opened
            self.handoff, colocated = resolve_handoff(self.cfg.rollout.handoff, self.member_devices(), self.world)
            src = next(x for x in self.all("channel_source", desc="describe weights") if x is not None)
            n, total = self.world, self.world + self.n_replicas * self.tp
            # the replicas' layout of what a sync moves (all weights; a LoRA run's adapters or merged weights)
            dst = self.ray.get(self.workers[0].channel_destination.remote(self.tp, self.n_replicas), timeout=CONTROL_S)
            if self.replicas:  # as the engines must be written (vLLM layers kept in a processed form)
                dst = self.ray.get(self.replicas[0].channel_destination.remote(dst), timeout=CONTROL_S) or dst
            host, port = self.ray.get(self.workers[0].channel_store.remote(), timeout=CONTROL_S)
            ep = Endpoint(host, port, total, 0, place(src, range(n), total), place(dst, range(n, total), total),
                          budget_bytes or DEFAULT_BUDGET, verify=self.cfg.verify,
                          verify_fraction=self.cfg.verify_fraction, handoff=self.handoff, colocated=colocated,
                          backend=self.device.backend)
            refs = [r.channel_open.remote(ep.at(n + i * self.tp)) for i, r in enumerate(self.replicas)]
            refs += [w.channel_open.remote(ep.at(rank)) for rank, w in enumerate(self.workers)]
            wait_all(self.ray, refs, "open weight channel", self.quiet)
        self.channel_opened += 1


    def member_devices(self) -> list[tuple[str, int]]:
        """Each channel member's device as ``(node, device)``: trainer rank ``i`` on device ``i``
        (its bundle's); replica ``r``'s worker ``t`` runs in the replica's actor process tree, on
        the node of its bundle, on device ``r·tp + t`` — one the trainer ranks share when
        colocated (``resources``), else one of its own after theirs. The colocated handoff needs
        both the same."""
        devices = [(self._node_of_rank(i), i) for i in range(self.world)]
        for r, slot in enumerate(self.resources.replicas):
            node = self._node_of_rank(r * self.tp, slot.bundle)
            # on the trainer's devices (colocated, or lent: elastic.lend) from its bundle's, else
            # on devices of its own after them
            first = slot.bundle if slot.bundle < self.world else self.world + (slot.bundle - self.world) * self.tp
            devices += [(node, first + t) for t in range(self.tp)]
        return devices


    def stand_by(self, version: int | None = None) -> None:
        """The rollout replicas post their receive now (call it when a rollout phase is over and
        the next use of the rollout engines is after a sync): their workers wait in the channel
        while the trainer trains — they are idle then anyway — so the next ``sync`` starts with
        only the trainer's ranks to reach (a receive posted ahead, as with NCCL). Ray runs a
        replica's calls in order, so nothing else reaches a replica before that sync."""
        if self.replicas and self._standing_by is None and self._incoming is None:
            self._standing_by = [r.channel_receive.remote(version) for r in self.replicas]


    def sync(self, version: int | None = None) -> dict:
        """Move the trainer's weights into the rollout engine(s) through the channel; returns the
        seconds the driver saw, bytes, and where the time went (slowest member's move, the
        replicas' receive including the cache reset). ``version``: the weights' version the replicas
        record (the loop's iteration; a receive posted ahead by ``stand_by`` carries its own)."""
        t0, t_wall = time.perf_counter(), time.time()
        recv, self._standing_by = self._standing_by or [r.channel_receive.remote(version) for r in self.replicas], None
        send = [w.sync_send.remote() for w in self.workers]
        try:
            out = self.ray.get(recv + send, timeout=SYNC_S)
        except Exception as e:  # noqa: BLE001 - which member is gone, then raise
            failure = self._sync_failure(recv, send, e)
            dead = self._dead(self.replicas)
            if dead and len(dead) < len(self.replicas) and all(n.startswith("rollout replica") for n in failure.lost):
                # only rollout replicas died: the run goes on with the others, and this sync again
                # fills them whole (the failed move may have written a part of their weights)
                self.drop_lost(dead, 0, during="sync")
                return self.sync(version)
            raise failure from e
        seconds = time.perf_counter() - t0
        senders, receivers = out[len(recv):], out[:len(recv)]
        reports = senders + [w for r in receivers for w in r["workers"]]
        entered = [r["phases"]["entered_at"] for r in reports]
        return {"seconds": seconds,
                "bytes_moved": sum(r["bytes_sent"] + r["bytes_local"] for r in senders),
                "bytes_sent": sum(r["bytes_sent"] for r in senders),
                "weights": senders[0].get("weights", "full"),  # what moved: full, or LoRA's adapters / merged
                # ipc: bucket handles handed to the workers (one per bucket) — 0 with p2p
                "handoff": self.handoff,
                "handles": sum(r.get("handles", 0) for r in senders),
                # where the time went: every member in the move (the replicas may have been
                # standing by since before the call), the trainers' agreement and move, their whole
                # call (describe + check + move), the replicas' RPC to their workers and cache reset
                "breakdown": {"stood_by": bool(receivers) and min(entered) < t_wall,
                              "all_members_in_s": max(entered) - t_wall,
                              "trainer_agree_s": max(r["phases"].get("agree", 0.0) for r in senders),
                              "trainer_move_s": max(r["seconds"] for r in senders),
                              "trainer_call_s": max(r["wall_seconds"] for r in senders),
                              "replica_rpc_s": max((w.get("rpc_s", 0.0) for r in receivers for w in r["workers"]),
                                                   default=0.0),
                              "cache_reset_s": max((w.get("reset_s", 0.0) for r in receivers for w in r["workers"]),
                                                   default=0.0),
                              # the workers' part of the move (ipc: waiting for the handles, the copy)
                              "worker_move_s": max((w["seconds"] for r in receivers for w in r["workers"]),
                                                   default=0.0)}}


    def channel_member(self, rank: int) -> str:
        """Who channel rank ``rank`` is: trainer ranks first, then each replica's workers."""
        if self.in_world or rank < self.world:
            return self._trainer_name(rank)
        return self._replica_name(*divmod(rank - self.world, self.tp))


    def _sync_failure(self, recv: list, send: list, error: Exception) -> SyncFailed:
        """Ask every member's call how it ended: dead actors are named by Ray; the survivors'
        ``PeerLost`` name the channel ranks they lost (``lost rank N`` / ``lost ranks [..]``)."""
        import re

        from ray.exceptions import ActorDiedError, GetTimeoutError, RayActorError

        calls = [(self._replica_name(i), ref) for i, ref in enumerate(recv)]
        calls += [(self._trainer_name(r), ref) for r, ref in enumerate(send)]
        dead, named, seen = [], set(), []
        for who, ref in calls:
            try:
                self.ray.get(ref, timeout=CONTROL_S)
            except (ActorDiedError, RayActorError) as e:
                dead.append(who)
                seen.append(f"{who}: died ({type(e).__name__})")
            except GetTimeoutError:
                seen.append(f"{who}: no answer within 120 s")
            except Exception as e:  # noqa: BLE001
                text = str(e)
                for one, many in re.findall(r"lost rank (\d+)|lost ranks \[([\d, ]+)\]", text):
                    named.update(int(x) for x in (one or many).split(",") if x.strip())
                line = next((ln for ln in text.splitlines() if "PeerLost" in ln), text.splitlines()[0] if text else "")
                seen.append(f"{who}: {line[:300]}")
        lost = dead or [self.channel_member(r) for r in sorted(named)]
        what = f"lost {', '.join(lost)}" if lost else f"no member named ({type(error).__name__}: {error})"
        return SyncFailed(f"weight sync failed: {what}. Members: " + "; ".join(seen), lost)


    def channel_stats(self) -> dict:
        """Every member's channel counters, open file descriptors and threads."""
        stats = self.ray.get([w.channel_stats.remote() for w in self.workers]
                             + [r.channel_stats.remote() for r in self.replicas], timeout=CONTROL_S)
        return {"trainers": stats[:self.world], "replicas": stats[self.world:]}

