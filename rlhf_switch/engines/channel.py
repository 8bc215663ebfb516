"""The weight channel: one long-lived path from the trainer's ranks into the rollout engines.

Built once when the engines start, used at every phase boundary::

    end = ChannelEnd.join(host, port, rank, world_size)       # or ChannelEnd.over(group)
    end.set_layouts(src, dst)                                 # placed on the channel's ranks
    end.move(src_buffers, dst_buffers)                        # every iteration: bytes only

Members are the trainer's ranks (``0..n-1``, they send) and the rollout side's workers — for a
replica engine (vLLM) its worker processes (``n..``), which receive in place; for a rollout engine
that lives inside the trainer's processes (the torch engine) the same ranks, which then send and
receive. ``ChannelEnd`` is the same object in every member process: a process group made once
(``join``: a gloo group over a TCPStore that trainer rank 0 hosts on its own node's address;
``over``: a group of the trainer's world), both layouts set once, and the executor's schedule,
cached by the layouts' digests, planned on the first move. ``set_layouts`` again re-plans when a
layout changes (a rebuilt engine, a resized world); the group stays.

*Verification* (``verify``: ``off`` | ``sample`` | ``full``, with ``verify_fraction``): a channel
setting, carried by the ``Endpoint`` to every member so they all check the same pieces, and
overridable per move (``move(..., verify=...)``, the same on every member). Sampling draws from
the plan digest and the channel's count of moves (``verify_seed``, the same on every member:
each move is collective), so successive syncs check different pieces. A corrupted piece raises
``VerifyError`` on every member (``routing/verify.py``).

What a sync used to do each time — a TCPStore and a gloo group per sync, both layouts pickled
into every worker, a plan per sync — is done once here; a sync is the move (one 32-byte agreement
plus the transfers) and the engine's cache reset.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any, Mapping

import torch
import torch.distributed as dist

from ..routing.comm import GroupComm, as_comm, bare_group, comm_device
from ..routing.executor import DEFAULT_BUDGET, Deadlines, MoveReport, move
from ..routing.verify import DEFAULT_FRACTION, check_mode
from ..vps.layout import Layout, LayoutError

# process groups made by weight channels in this process: a run makes one per member process
GROUPS_CREATED = 0


def node_address() -> str:
    """This process's node address as its peers on other nodes reach it: the node IP Ray reports
    (``ray.util.get_node_ip_address``, in a Ray actor or driver), else the address the host name
    resolves to. There is no loopback fallback: a store whose address only this host can reach
    would let a one-node test pass and strand every rank on another node (issue 13), so an
    unresolvable host name is an error here, before anyone waits on the store."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    import socket

    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError as e:
        raise RuntimeError(f"cannot tell this node's address (host name {socket.gethostname()!r} does not "
                           f"resolve: {e}); run under Ray, which reports each node's IP") from None


def node_of_this_process() -> dict:
    """Where this process runs, as Ray reports it: its node's id (``None`` outside Ray), that
    node's address and the process id — what a run records for each of its actors (two Ray nodes
    on one machine share an address but not an id)."""
    node_id = None
    try:
        import ray

        if ray.is_initialized():
            node_id = ray.get_runtime_context().get_node_id()
    except ImportError:
        pass
    return {"node_id": node_id, "address": node_address(), "pid": os.getpid()}


def open_store(timeout_s: float = 300.0) -> tuple[dist.TCPStore, str, int]:
    """A TCPStore on a free port of this node (port 0: the OS picks; a port chosen elsewhere may
    collide and silently join another world). Returns (store, address, port) to hand out."""
    host = node_address()
    store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
    return store, host, store.port


@dataclass(frozen=True)
class Endpoint:
    """Everything a member needs to join a channel: where its store is, how many members there
    are, the first rank of this member's block (a replica's workers take ``first_rank + tp_rank``)
    and both layouts, already placed on the channel's ranks."""

    host: str
    port: int
    world_size: int
    first_rank: int
    src: Layout
    dst: Layout
    budget_bytes: int = DEFAULT_BUDGET
    timeout_s: float = 300.0     # any wait inside a move
    standby_s: float = 3600.0    # how long a member may stand ready before the others arrive
    verify: str = "off"          # off | sample | full: checksums of the moved pieces (routing/verify.py)
    verify_fraction: float = DEFAULT_FRACTION  # of each pair's pieces, with verify "sample"
    backend: str = "gloo"        # the group's: nccl where the weights are CUDA tensors (rlhf_switch.device)

    def at(self, first_rank: int) -> "Endpoint":
        from dataclasses import replace

        return replace(self, first_rank=first_rank)


@dataclass
class ChannelStats:
    rank: int
    world_size: int
    groups_created: int            # by channels in this process, ever
    moves: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    last_move_s: float = 0.0
    open_s: float = 0.0            # group creation (once)
    plans: int = 0                 # layout pairs set (1 unless re-planned)
    pieces_verified: int = 0       # pieces checked here as their destination, over all moves
    extra: dict = field(default_factory=dict)


class ChannelEnd:
    """One member's end of a weight channel (see the module docstring)."""

    def __init__(self, group: Any, rank: int, world_size: int, *, store: Any = None,
                 timeout_s: float = 300.0, budget_bytes: int = DEFAULT_BUDGET, open_s: float = 0.0,
                 standby_s: float | None = None, deadline: Deadlines | None = None,
                 verify: str = "off", verify_fraction: float = DEFAULT_FRACTION, backend: str = "gloo"):
        check_mode(verify, verify_fraction)
        self.group, self.rank, self.world_size, self._store = group, rank, world_size, store
        # the move's comm, made once; it knows the channel's store, where a failed move's reports
        # go (``PeerLost`` then names the member that is gone)
        self._comm = (GroupComm(group, comm_device(backend), store=dist.PrefixStore("vps-weight-channel", store))
                      if store is not None else as_comm(group))
        self.timeout = timedelta(seconds=timeout_s)
        # each wait of a move: 10 s + 1 s per 50 MB in flight, at most ``timeout_s``; the first
        # gather (where a receiver stands by for the trainer's step) waits up to ``standby_s``
        base = deadline or Deadlines()
        self.deadline = Deadlines(base.floor_s, base.min_rate, timeout_s,
                                  standby_s if standby_s is not None else base.arrival_s, base.census_s)
        self.budget_bytes = budget_bytes
        self.verify, self.verify_fraction = verify, verify_fraction
        self._attempts = 0  # moves attempted: the default seed of a sampled verification
        self.src: Layout | None = None
        self.dst: Layout | None = None
        self._stats = ChannelStats(rank, world_size, GROUPS_CREATED, open_s=open_s)

    @classmethod
    def join(cls, host: str, port: int, rank: int, world_size: int, *, store: Any = None,
             timeout_s: float = 300.0, budget_bytes: int = DEFAULT_BUDGET,
             standby_s: float = 3600.0, verify: str = "off",
             verify_fraction: float = DEFAULT_FRACTION, backend: str = "gloo") -> "ChannelEnd":
        """Join the channel's own group (``backend``: gloo, or nccl for CUDA weights; collective
        over its ``world_size`` members) over the TCPStore at ``host:port`` (``store``: the store
        itself, on the member that hosts it).
        The group's collectives wait up to ``standby_s``: a rollout engine stands ready in its
        receive (the move's first collective) while the trainer is still training; the move's
        transfers wait up to ``timeout_s``."""
        global GROUPS_CREATED
        t0 = time.perf_counter()
        timeout = timedelta(seconds=timeout_s)
        if store is None:
            store = dist.TCPStore(host, port, world_size + 1, is_master=False, timeout=timeout)
        group = bare_group(backend, dist.PrefixStore("vps-weight-channel", store), rank, world_size,
                           timedelta(seconds=max(timeout_s, standby_s)))
        GROUPS_CREATED += 1
        return cls(group, rank, world_size, store=store, timeout_s=timeout_s, budget_bytes=budget_bytes,
                   open_s=time.perf_counter() - t0, standby_s=max(timeout_s, standby_s),
                   verify=verify, verify_fraction=verify_fraction, backend=backend)

    @classmethod
    def over(cls, ranks: list[int] | None = None, *, timeout_s: float = 300.0,
             budget_bytes: int = DEFAULT_BUDGET, verify: str = "off",
             verify_fraction: float = DEFAULT_FRACTION) -> "ChannelEnd":
        """A channel inside an existing world (trainer and rollout engine in the same processes):
        its own group of that world's ``ranks`` (all by default; collective over the world)."""
        global GROUPS_CREATED
        t0 = time.perf_counter()
        ranks = list(range(dist.get_world_size())) if ranks is None else list(ranks)
        group = dist.new_group(ranks, timeout=timedelta(seconds=timeout_s))
        GROUPS_CREATED += 1
        if dist.get_rank() not in ranks:
            raise ValueError(f"rank {dist.get_rank()} is not a member of the channel over {ranks}")
        return cls(group, dist.get_rank(group), len(ranks), timeout_s=timeout_s, budget_bytes=budget_bytes,
                   open_s=time.perf_counter() - t0, verify=verify, verify_fraction=verify_fraction)

    def set_layouts(self, src: Layout, dst: Layout) -> None:
        """The source and destination layouts, placed on the channel's ranks (the same on every
        member). The first move plans them; the executor keeps the schedule."""
        for what, layout in (("source", src), ("destination", dst)):
            if layout.world_size != self.world_size:
                raise LayoutError(f"the channel has {self.world_size} members; the {what} layout "
                                  f"{layout.name} is for {layout.world_size} ranks")
        if src.spec.digest != dst.spec.digest:
            raise LayoutError(f"cannot move {src.name} of model {src.spec.name!r} into {dst.name} of "
                              f"model {dst.spec.name!r}: different models; nothing was moved")
        self.src, self.dst = src, dst
        self._stats.plans += 1

    @torch.no_grad()
    def move(self, src_buffers: Mapping[str, torch.Tensor], dst_buffers: Mapping[str, torch.Tensor], *,
             verify: str | None = None, verify_fraction: float | None = None,
             verify_seed: int | None = None) -> MoveReport:
        """This member's part of one move (collective over the channel). ``verify`` /
        ``verify_fraction``: this move's, instead of the channel's (pass the same on every
        member); ``verify_seed``: the sample's seed, by default the channel's count of moves."""
        if self.src is None:
            raise RuntimeError("the weight channel has no layouts yet: call set_layouts first")
        t_enter = time.time()  # wall clock: comparable across the members' processes on one host
        seed = self._attempts if verify_seed is None else verify_seed
        self._attempts += 1  # every move attempted, failed ones too: every member counts alike
        report = move(self.src, self.dst, src_buffers, dst_buffers, group=self._comm,
                      budget_bytes=self.budget_bytes, timeout=self.timeout, deadline=self.deadline,
                      verify=verify or self.verify,
                      verify_fraction=self.verify_fraction if verify_fraction is None else verify_fraction,
                      verify_seed=seed)
        report.phases["entered_at"] = t_enter
        s = self._stats
        s.moves += 1
        s.pieces_verified += report.pieces_verified
        s.bytes_sent += report.bytes_sent
        s.bytes_received += report.bytes_received
        s.last_move_s = report.seconds
        return report

    def stats(self) -> dict:
        """Counters, and this process's open file descriptors and threads (a channel that leaked
        would grow them at every sync)."""
        s = asdict(self._stats)
        s["groups_created"] = GROUPS_CREATED
        s["open_fds"] = _open_fds()
        s["threads"] = threading.active_count()
        s["os_threads"] = _os_threads()
        return s

    def close(self) -> None:
        self.group = self._comm = None
        self._store = None
        self.src = self.dst = None


def _open_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return -1


def _os_threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return -1
