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

*Handoff* (``handoff``: ``p2p`` | ``ipc``): ``p2p`` moves the bytes over the group, rank to rank.
``ipc`` (the colocated handoff, for members given as ``colocated`` pairs ``(worker rank, trainer
rank)`` on one device) runs two steps: the trainer's ranks gather, over the group, each worker's
fragments into packed buckets held by its colocated trainer rank (``train -> bucket_layout``,
``vps/layouts/buckets.py``); that rank then hands the worker one handle per bucket through the
channel's TCPStore (``routing/handoff.py``: CUDA IPC on a GPU, shared memory on CPU), and the
worker copies out of the buckets into its parameters with the plan's local copies
(``bucket_layout -> dst``) and says so through the store before the buckets are used again.
``resolve_handoff`` decides it from where the members sit (``auto``: ``ipc`` when every worker has
a trainer rank on its device).

What a sync used to do each time — a TCPStore and a gloo group per sync, both layouts pickled
into every worker, a plan per sync — is done once here; a sync is the move (one 32-byte agreement
plus the transfers) and the engine's cache reset.
"""
from __future__ import annotations

import os
import pickle
import threading
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist

from ..routing.comm import GroupComm, as_comm, bare_group, comm_device
from ..routing.executor import (
    DEFAULT_BUDGET,
    Deadlines,
    MoveError,
    MoveHooks,
    MoveReport,
    move,
)
from ..routing.verify import DEFAULT_FRACTION, check_mode
from ..vps.layout import Layout, LayoutError
from ..vps.layouts.buckets import bucket_layout
from ..vps.spec import itemsize
from ..timeouts import MOVE_S, STANDBY_S

HANDOFFS = ("auto", "p2p", "ipc")

# process groups made by weight channels in this process: a run makes one per member process
GROUPS_CREATED = 0


def node_address() -> str:
    """This process's node address as its peers on other nodes reach it: the node IP Ray reports
    (``ray.util.get_node_ip_address``, in a Ray actor or driver), else the address the host name
    resolves to. There is no loopback fallback: a store whose address only this host can reach
    would let a one-node test pass and strand every rank on another node, so an
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


def open_store(timeout_s: float = MOVE_S) -> tuple[dist.TCPStore, str, int]:
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
    timeout_s: float = MOVE_S    # any wait inside a move
    standby_s: float = STANDBY_S  # how long a member may stand ready before the others arrive
    verify: str = "off"          # off | sample | full: checksums of the moved pieces (routing/verify.py)
    verify_fraction: float = DEFAULT_FRACTION  # of each pair's pieces, with verify "sample"
    handoff: str = "p2p"         # p2p | ipc (resolved: see resolve_handoff)
    colocated: tuple = ()        # ipc: (worker rank, trainer rank) pairs on one device
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
    handoff: str = "p2p"
    handles_sent: int = 0          # ipc: bucket handles handed to colocated workers, over all moves
    handles_received: int = 0
    shared_bytes: int = 0          # sources moved into shared memory for mapped reads (share_sources), once each
    mapped_messages: int = 0       # receives copied through a mapping of the sender's memory, over all moves
    extra: dict = field(default_factory=dict)


@dataclass
class ChannelReport(MoveReport):
    """A member's part of one move. ``p2p``: the executor's report. ``ipc``: on a trainer rank the
    gather into the buckets (its bytes) and the handles it handed out; on a worker its copy out of
    the buckets (``bytes_local``; nothing over the group) and the handles it opened. ``phases``
    adds ``gather`` (the group move), ``handles`` (waiting for them / for the workers' copies)."""

    handoff: str = "p2p"
    handles: int = 0   # this move's bucket handles, handed out (trainer) or opened (worker)
    buckets: int = 0   # buckets behind them
    tensors: int = 0   # the parameters they fill (a worker's buffers): handles are per bucket, not these


def resolve_handoff(option: str, devices: Sequence, senders: int) -> tuple[str, tuple]:
    """The handoff a channel uses, from where its members sit: ``devices[r]`` is channel rank
    ``r``'s device (any comparable label that includes the host, e.g. ``(node, device)``); ranks
    ``0..senders-1`` are the trainer's, the rest the rollout workers. Returns ``(handoff,
    colocated)`` with ``colocated`` the ``(worker, trainer rank)`` pairs (the lowest trainer rank
    on the worker's device). ``auto``: ``ipc`` when every worker has one, else ``p2p``; ``ipc``
    where some worker has none: ``ValueError`` naming them (before anything is opened)."""
    if option not in HANDOFFS:
        raise ValueError(f"handoff {option!r}: expected one of {', '.join(HANDOFFS)}")
    if option == "p2p":
        return "p2p", ()
    first: dict = {}
    for r in range(senders):
        first.setdefault(devices[r], r)
    pairs = tuple((w, first[devices[w]]) for w in range(senders, len(devices)) if devices[w] in first)
    alone = [w for w in range(senders, len(devices)) if devices[w] not in first]
    if not alone and len(devices) > senders:
        return "ipc", pairs
    if option == "auto":
        return "p2p", ()
    raise ValueError(f"handoff ipc: channel ranks {alone} (on {[devices[w] for w in alone]}) have no trainer "
                     f"rank on their device; use handoff p2p or auto")


class ChannelEnd:
    """One member's end of a weight channel (see the module docstring)."""

    def __init__(self, group: Any, rank: int, world_size: int, *, store: Any = None,
                 timeout_s: float = MOVE_S, budget_bytes: int = DEFAULT_BUDGET, open_s: float = 0.0,
                 standby_s: float | None = None, deadline: Deadlines | None = None,
                 verify: str = "off", verify_fraction: float = DEFAULT_FRACTION,
                 handoff: str = "p2p", colocated: Sequence = (), backend: str = "gloo",
                 share_sources: bool = False):
        check_mode(verify, verify_fraction)
        if handoff not in ("p2p", "ipc"):
            raise ValueError(f"a channel's handoff is p2p or ipc (resolve 'auto' first), not {handoff!r}")
        if handoff == "ipc" and store is None:
            raise ValueError("handoff ipc needs the channel's store for the handles (a joined channel)")
        self.group, self.rank, self.world_size, self._store = group, rank, world_size, store
        self.handoff = handoff
        self.colocated = {int(w): int(t) for w, t in colocated}  # worker rank -> its trainer rank
        self._handoff_store = dist.PrefixStore("vps-handoff", store) if handoff == "ipc" else None
        self._gather = self._own = None  # ipc: the bucket layouts (held by trainer ranks / by the workers)
        self._buckets = None  # ipc, a trainer rank holding buckets: made at the first move, reused
        # ipc, that trainer rank: each worker's handles, exported once per set of buckets. The same
        # bytes every sync, so the worker maps them once; a CUDA storage exported again would carry
        # a new IPC event and reference counter, and the worker would unmap and map it every sync
        self._exported: dict[int, bytes] | None = None
        self._opened = None  # ipc, a worker: (the handles' bytes, the buckets they map)
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
        # after a move, this member's CPU sources into shared memory where a peer of its host can
        # map them: later moves are mapped reads (routing/same_host.py). For a channel whose moves
        # repeat from the same buffers (a weight sync); a one-off move would only pay the copy
        self.share_sources = share_sources
        self._attempts = 0  # moves attempted: the default seed of a sampled verification
        self.src: Layout | None = None
        self.dst: Layout | None = None
        self._stats = ChannelStats(rank, world_size, GROUPS_CREATED, open_s=open_s, handoff=handoff)

    @classmethod
    def join(cls, host: str, port: int, rank: int, world_size: int, *, store: Any = None,
             timeout_s: float = MOVE_S, budget_bytes: int = DEFAULT_BUDGET,
             standby_s: float = STANDBY_S, verify: str = "off",
             verify_fraction: float = DEFAULT_FRACTION, handoff: str = "p2p",
             colocated: Sequence = (), backend: str = "gloo", share_sources: bool = False) -> "ChannelEnd":
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
                   verify=verify, verify_fraction=verify_fraction, handoff=handoff, colocated=colocated,
                   backend=backend, share_sources=share_sources)

    @classmethod
    def over(cls, ranks: list[int] | None = None, *, timeout_s: float = MOVE_S,
             budget_bytes: int = DEFAULT_BUDGET, verify: str = "off",
             verify_fraction: float = DEFAULT_FRACTION, share_sources: bool = False) -> "ChannelEnd":
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
                   open_s=time.perf_counter() - t0, verify=verify, verify_fraction=verify_fraction,
                   share_sources=share_sources)

    @property
    def comm(self):
        """The channel's group as the executor's comm (with its store for failure reports): a
        collective of the members that is not a weight sync — the elastic resize moves a whole
        training state over a channel joined by the old and new trainer ranks."""
        return self._comm

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
        if self.handoff == "ipc":
            holding = {r for r in range(dst.world_size) if dst.fragments(r)}
            missing = sorted(holding - set(self.colocated))
            if missing:
                raise LayoutError(f"handoff ipc: destination ranks {missing} of {dst.name} have no colocated "
                                  f"trainer rank; nothing was moved")
            self._gather = bucket_layout(dst, self.colocated, self.budget_bytes)
            self._own = bucket_layout(dst, {w: w for w in self.colocated}, self.budget_bytes)
            self._buckets = self._opened = self._exported = None
        self.src, self.dst = src, dst
        self._stats.plans += 1

    @torch.no_grad()
    def move(self, src_buffers: Mapping[str, torch.Tensor], dst_buffers: Mapping[str, torch.Tensor], *,
             verify: str | None = None, verify_fraction: float | None = None,
             verify_seed: int | None = None, hooks: MoveHooks | None = None) -> MoveReport:
        """This member's part of one move (collective over the channel). ``verify`` /
        ``verify_fraction``: this move's, instead of the channel's (pass the same on every
        member); ``verify_seed``: the sample's seed, by default the channel's count of moves.
        ``hooks``: test-only, the executor's (``MoveHooks``; p2p handoff only)."""
        if self.src is None:
            raise RuntimeError("the weight channel has no layouts yet: call set_layouts first")
        t_enter = time.time()  # wall clock: comparable across the members' processes on one host
        seed = self._attempts if verify_seed is None else verify_seed
        self._attempts += 1  # every move attempted, failed ones too: every member counts alike
        if self.handoff == "ipc":
            report = self._move_ipc(src_buffers, dst_buffers, self._attempts - 1, verify=verify or self.verify,
                                    verify_fraction=self.verify_fraction if verify_fraction is None
                                    else verify_fraction, verify_seed=seed)
            report.phases["entered_at"] = t_enter
            self._count(report)
            return report
        report = move(self.src, self.dst, src_buffers, dst_buffers, group=self._comm,
                      budget_bytes=self.budget_bytes, timeout=self.timeout, deadline=self.deadline,
                      verify=verify or self.verify,
                      verify_fraction=self.verify_fraction if verify_fraction is None else verify_fraction,
                      verify_seed=seed, hooks=hooks)
        report.phases["entered_at"] = t_enter
        self._count(report)
        transport = self._comm.transport
        if self.share_sources and report.same_host_messages and transport.mapped_by_peers():
            self._stats.shared_bytes += transport.share(src_buffers.values())
        return report

    def _count(self, report: MoveReport) -> None:
        s = self._stats
        s.moves += 1
        s.pieces_verified += report.pieces_verified
        s.bytes_sent += report.bytes_sent
        s.bytes_received += report.bytes_received
        s.mapped_messages += report.mapped_messages
        s.last_move_s = report.seconds
        if isinstance(report, ChannelReport) and report.handoff == "ipc":
            if self.rank in self.colocated:
                s.handles_received += report.handles
            else:
                s.handles_sent += report.handles

    def _wait(self, store, key: str, nbytes: int, peer: int, what: str) -> None:
        """Wait for ``key`` as long as the move's deadlines allow for ``nbytes``; else ``PeerLost``
        naming ``peer`` (the member that should have written it)."""
        from ..routing.executor import PeerLost

        limit = self.deadline.for_bytes(nbytes)
        try:
            store.wait([key], timedelta(seconds=limit))
        except Exception as e:  # noqa: BLE001 - the store's timeout (its type differs across versions)
            raise PeerLost(f"rank {self.rank}: handoff ipc: lost rank {peer}: no {what} within {limit:.0f} s",
                           rank=self.rank, lost=[peer], pending=[key], cause=f"{type(e).__name__}: {e}",
                           reports={}, elapsed_s=limit, deadline_s=limit) from None

    def _move_ipc(self, src_buffers, dst_buffers, seq: int, **verify) -> ChannelReport:
        """The colocated handoff (module docstring): gather into the buckets over the group, then
        the handles through the store, the workers' local copies, their word that they are done."""
        from ..routing import handoff

        t0 = time.perf_counter()
        mine = sorted(w for w, t in self.colocated.items() if t == self.rank)  # workers whose buckets I hold
        if mine and self._buckets is None:
            device = next(iter(src_buffers.values())).device if src_buffers else torch.device("cpu")
            self._buckets = handoff.allocate(self._gather, self.rank, device)
        worker = self.rank in self.colocated
        # a worker whose buffers cannot take its buckets refuses in the gather's agreement: every
        # member raises there, before a byte moves
        refuse = handoff.check_destination(self.dst, self.rank, dst_buffers) if worker else None
        gather = move(self.src, self._gather, src_buffers, self._buckets if mine else {}, group=self._comm,
                      budget_bytes=self.budget_bytes, timeout=self.timeout, deadline=self.deadline,
                      refuse=refuse, **verify)
        t_gather = time.perf_counter()
        store, report = self._handoff_store, None
        if mine:  # hand each colocated worker its buckets' handles, then wait for its copy
            handoff.settle(self._buckets)
            if self._exported is None:  # worker w's buckets, as both bucket layouts name them
                self._exported = {w: pickle.dumps(handoff.export({n: self._buckets[n] for n in self._own.buffers(w)}))
                                  for w in mine}
            handles = 0
            for w in mine:
                store.set(f"{seq}/handles/{w}", self._exported[w])
                handles += len(self._own.buffers(w))
            failed = {}
            for w in mine:
                # the worker's copy of its bytes: the move's deadline for them, then it is lost
                # ("lost rank N": Cluster names the member)
                nbytes = sum(b.numel * itemsize(b.dtype) for b in self._own.buffers(w).values())
                self._wait(store, f"{seq}/done/{w}", nbytes, w, "word that it copied out of the buckets")
                word = store.get(f"{seq}/done/{w}").decode()
                if word != "ok":
                    failed[w] = word
                for k in (f"{seq}/handles/{w}", f"{seq}/done/{w}"):
                    store.delete_key(k)
            if failed:
                raise MoveError("handoff ipc: " + "; ".join(f"worker rank {w} failed its copy out of the "
                                                            f"buckets: {e}" for w, e in sorted(failed.items())))
            report = ChannelReport(**vars(gather), handoff="ipc", handles=handles, buckets=len(self._buckets))
        elif worker:  # open my buckets' handles, copy out of them into my buffers, say so
            self._wait(store, f"{seq}/handles/{self.rank}", 0, self.colocated[self.rank], "the handles of its buckets")
            raw = store.get(f"{seq}/handles/{self.rank}")
            handles = pickle.loads(raw)
            t_handles = time.perf_counter()
            try:
                # the trainer reuses its buckets, so the same handles come every sync: map them
                # once (a new set — re-planned, re-allocated — replaces the old mapping)
                if self._opened is None or self._opened[0] != raw:
                    self._opened = None
                    self._opened = (raw, handoff.open_handles(handles))
                buckets = self._opened[1]
                local = handoff.copy_local(self._own, self.dst, self.rank, buckets, dst_buffers, self.budget_bytes)
                handoff.settle(dst_buffers)
            except BaseException as e:
                store.set(f"{seq}/done/{self.rank}", f"{type(e).__name__}: {e}"[:2000])
                raise
            store.set(f"{seq}/done/{self.rank}", "ok")
            fields = dict(vars(local), phases={**local.phases, "handles": t_handles - t_gather},
                          verify=gather.verify, pieces_verified=gather.pieces_verified)
            report = ChannelReport(**fields, handoff="ipc", handles=len(handles), buckets=len(handles),
                                   tensors=len(self.dst.buffers(self.rank)))
        else:  # a trainer rank that only sends into others' buckets
            report = ChannelReport(**vars(gather), handoff="ipc")
        report.phases["gather"] = t_gather - t0
        report.seconds = time.perf_counter() - t0
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
        self._store = self._handoff_store = None
        self._buckets = self._opened = self._exported = None
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
