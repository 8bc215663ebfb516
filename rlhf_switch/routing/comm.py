"""The few communication calls a move needs, over either kind of process group.

A move between a trainer and a generation engine runs over a group the two sides form for the
purpose (a TCPStore + ``ProcessGroupGloo``/``ProcessGroupNCCL`` made inside vLLM's workers, which
already have a default world of their own). Such a group is not registered with
``torch.distributed``, so ``dist.isend(..., group=pg)`` cannot use it; its own ``send``/``recv``/
``allgather`` methods can. ``as_comm`` picks the right wrapper.

Every wait here takes a timeout (the executor derives it from the bytes waited for). A comm may
know its group's ``store`` (a registered group's own, or the one a bare group was made over):
after a failed move the ranks leave their reports there, so each can name the rank that is gone
(``executor.PeerLost``). ``close`` ends this rank's connections of a gloo group after a failure.

A comm posts point-to-point ops itself (``post``); a move's messages and agreement go through
its ``transport`` (``routing/transport.py``): plain point-to-point unless ``choose_transport``
found a better one for the group.
"""
from __future__ import annotations

import pickle
from datetime import timedelta

import torch
import torch.distributed as dist

from .tags import CLOSE_TAG, DEFAULT_TAG
from .transport import GLOO_TRANSPORTS, POINT_TO_POINT, P2P, Transport, find_transport


# torch 2.13 deprecates ``all_gather_into_tensor`` (a FutureWarning per call) in favour of
# ``all_gather_single``, the same collective: use the new name where it exists
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Comm:
    rank: int
    size: int
    store: "dist.Store | None" = None  # where ranks leave failure reports (None: nobody to ask)
    device: torch.device = torch.device("cpu")
    gloo: bool = True
    transport: Transport = POINT_TO_POINT  # how a move's messages travel (``choose_transport``)

    def _group_key(self):
        """The process group object this comm sends over (what a transport is chosen per)."""
        return None

    def choose_transport(self, timeout: timedelta | None = None) -> Transport:
        """This group's transport: for a gloo group of more than one rank, the first of
        ``GLOO_TRANSPORTS`` that takes it (single copies between ranks of one host, ``same_host``,
        where its probe finds pairs that can use them, unless ``RLHF_SWITCH_SAME_HOST_COPY=0``),
        else plain point-to-point. A collective of the group at its first call (every rank calls it
        at the same point: the executor, before a move's agreement), a lookup after."""
        key = self._group_key()
        if self.gloo and self.size > 1 and key is not None:
            self.transport = find_transport(GLOO_TRANSPORTS, self, key, timeout)
        return self.transport

    def _allgather(self, outs: list[torch.Tensor], tensor: torch.Tensor):
        """Start an all-gather of equal-sized tensors; returns its ``Work``."""
        raise NotImplementedError

    def _alltoall(self, out: torch.Tensor, tensor: torch.Tensor):
        """Start an all-to-all of equal splits (``out`` and ``tensor``: ``size`` equal parts); its ``Work``."""
        raise NotImplementedError

    def all_gather_ints(self, values: list[int], timeout: timedelta | None = None) -> list[list[int]]:
        """Every rank's ``values`` (the same number of int64s on every rank), in one small collective."""
        return self.start_all_gather_ints(values)(timeout)

    def start_all_gather_ints(self, values: list[int]):
        """``all_gather_ints`` started: returns ``finish(timeout)``, which waits and returns the rows
        (work can be done meanwhile; ``finish.done()`` says whether the gather is in).

        On gloo an all-to-all of the row repeated per rank: the same result, and a 4-rank gloo
        all-gather of 32 B took 3.4–3.8 ms here against 0.5 ms for the all-to-all (2 cores; a
        barrier 0.35 ms) — a fixed cost of every move, a tenth of a 10M-parameter one."""
        mine = torch.tensor(values, dtype=torch.int64, device=self.device)
        if self.gloo:
            out = torch.empty(self.size * mine.numel(), dtype=torch.int64, device=self.device)
            work = self._alltoall(out, mine.repeat(self.size))
            rows = lambda: out.view(self.size, -1).tolist()  # noqa: E731
        else:
            outs = [torch.empty_like(mine) for _ in range(self.size)]
            work = self._allgather(outs, mine)
            rows = lambda: [o.tolist() for o in outs]  # noqa: E731

        def finish(timeout: timedelta | None = None) -> list[list[int]]:
            _wait(work, timeout)
            return rows()
        finish.done = work.is_completed  # whether ``finish`` would return at once
        return finish

    def all_gather_object(self, obj, timeout: timedelta | None = None) -> list:
        """Every rank's ``obj`` (pickled). On gloo both steps — the sizes, then the payloads padded
        to the longest — are all-to-alls of the rank's own part repeated per rank, as in
        ``start_all_gather_ints``: a training switch's layout exchange at 100M took 21–23 ms as two
        gloo all-gathers (6 % of the switch)."""
        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(self.device)
        sizes = [row[0] for row in self.all_gather_ints([payload.numel()], timeout)]
        longest = max(sizes)
        padded = torch.zeros(longest, dtype=torch.uint8, device=self.device)
        padded[:payload.numel()] = payload
        if self.gloo:
            out = torch.empty(self.size * longest, dtype=torch.uint8, device=self.device)
            _wait(self._alltoall(out, padded.repeat(self.size)), timeout)
            outs = out.view(self.size, longest)
        else:
            outs = [torch.empty_like(padded) for _ in range(self.size)]
            _wait(self._allgather(outs, padded), timeout)
        return [pickle.loads(o[:n].cpu().numpy().tobytes()) for o, n in zip(outs, sizes)]

    def close(self) -> None:
        """End this rank's connections in the group after a failed move (gloo only; best effort).

        A group that carried a failed move cannot carry another (messages of the failed one may
        still be pending on it, under the tag the next move would use), and peers blocked on this
        rank would otherwise wait for their own deadlines. gloo (torch 2.13) has no call that
        closes a group's connections — ``ProcessGroupGloo.abort`` leaves them open — but a wait
        that times out closes every connection of the group ("Application timeout caused pair
        closure"), and the peers' pending operations on it fail at once ("Connection closed by
        peer"). So: one receive nobody sends, on a tag nothing else uses (``CLOSE_TAG``), waited for
        1 ms."""
        if not self.gloo or self.size < 2:
            return
        self.transport.close()  # peers waiting on this rank by the transport's own way stop too
        try:
            self.irecv(torch.empty(1, dtype=torch.uint8), (self.rank + 1) % self.size, CLOSE_TAG).wait(
                timedelta(milliseconds=1))
        except Exception:  # noqa: BLE001 - the timeout is the point
            pass

    def isend(self, tensor: torch.Tensor, peer: int, tag: int = DEFAULT_TAG):
        raise NotImplementedError

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int = DEFAULT_TAG):
        raise NotImplementedError

    def post(self, ops: list[P2P]) -> list:
        """Post ``ops`` as one batch of plain point-to-point messages, in this order; one ``Work``
        per op (on NCCL the batch's single work, repeated). Messages between two ranks in one
        direction are matched in the order they are posted (NCCL ignores tags), and a batch is
        one NCCL group, so no op of it waits on another. gloo has no groups: its ops are posted
        one by one, in order."""
        return [(self.isend if op.send else self.irecv)(op.tensor, op.peer, op.tag) for op in ops]


def _wait(work, timeout: timedelta | None) -> None:
    if timeout is None:
        work.wait()
    else:
        work.wait(timeout)


class TorchComm(Comm):
    """A group registered with torch.distributed (the default world or ``dist.new_group``)."""

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        backend = dist.get_backend(group)
        self.gloo = backend == "gloo"
        # gloo: the group's own send/recv (ranks in the group), as ``dist.isend`` ends up calling
        # after its argument checks — ~20 µs a message of Python that a 10M switch pays ~100 times
        self._pg = None
        if self.gloo:
            from torch.distributed.distributed_c10d import _get_default_group

            self._pg = group if group is not None else _get_default_group()
        if backend == "nccl":
            self.device = torch.device("cuda", torch.cuda.current_device())
        try:  # the group's own store (private API: without it failures name what this rank saw)
            from torch.distributed.distributed_c10d import _get_default_group, _get_process_group_store

            self.store = _get_process_group_store(group if group is not None else _get_default_group())
        except Exception:  # noqa: BLE001
            self.store = None

    def _group_key(self):
        return self._pg

    def _global(self, peer: int) -> int:
        return peer if self.group is None else dist.get_global_rank(self.group, peer)

    def isend(self, tensor, peer, tag=DEFAULT_TAG):
        if self._pg is not None:
            return self._pg.send([tensor], peer, tag)
        return dist.isend(tensor, self._global(peer), group=self.group, tag=tag)

    def irecv(self, tensor, peer, tag=DEFAULT_TAG):
        if self._pg is not None:
            return self._pg.recv([tensor], peer, tag)
        return dist.irecv(tensor, self._global(peer), group=self.group, tag=tag)

    def post(self, ops):
        if self.gloo or not ops:  # gloo's batch_isend_irecv is this same loop
            return super().post(ops)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend if op.send else dist.irecv, op.tensor,
                                                   self._global(op.peer), self.group, op.tag) for op in ops])
        return works if len(works) == len(ops) else works[-1:] * len(ops)  # NCCL: one work per batch

    def start_all_gather_ints(self, values):
        if self.gloo:
            return super().start_all_gather_ints(values)
        mine = torch.tensor(values, dtype=torch.int64, device=self.device)
        out = torch.empty(self.size * mine.numel(), dtype=torch.int64, device=self.device)
        work = _all_gather_single(out, mine, group=self.group, async_op=True)

        def finish(timeout=None):
            _wait(work, timeout)
            return out.view(self.size, -1).tolist()
        finish.done = work.is_completed
        return finish

    def _allgather(self, outs, tensor):
        return dist.all_gather(outs, tensor, group=self.group, async_op=True)

    def _alltoall(self, out, tensor):
        return dist.all_to_all_single(out, tensor, group=self.group, async_op=True)


class GroupComm(Comm):
    """A bare ``ProcessGroup`` object (e.g. ``dist.ProcessGroupGloo(store, rank, size, timeout)``);
    ``store``: the store it was made over (or any store all its members share), where a failed
    move's reports go."""

    def __init__(self, pg: dist.ProcessGroup, device: torch.device | str = "cpu", store: dist.Store | None = None):
        self.pg = pg
        self.rank = pg.rank()
        self.size = pg.size()
        self.device = torch.device(device)
        self.store = store
        self.gloo = isinstance(pg, dist.ProcessGroupGloo)

    def _group_key(self):
        return self.pg

    def isend(self, tensor, peer, tag=DEFAULT_TAG):
        return self.pg.send([tensor], peer, tag)

    def irecv(self, tensor, peer, tag=DEFAULT_TAG):
        return self.pg.recv([tensor], peer, tag)

    def post(self, ops):
        if self.gloo or not ops:
            return super().post(ops)
        # a bare NCCL group: one NCCL group call, as ``batch_isend_irecv`` makes for a registered
        # one (not run here: no GPU in CI)
        self.pg._start_coalescing(self.device)
        for op in ops:
            (self.pg.send if op.send else self.pg.recv)([op.tensor], op.peer, op.tag)
        return [self.pg._end_coalescing(self.device)] * len(ops)

    def _allgather(self, outs, tensor):
        return self.pg.allgather([outs], [tensor])

    def _alltoall(self, out, tensor):
        return self.pg.alltoall_base(out, tensor, [], [], dist.AllToAllOptions())


def as_comm(group, store: dist.Store | None = None) -> Comm:
    if isinstance(group, Comm):
        return group
    if group is None:
        return TorchComm(None)
    try:
        dist.get_rank(group)
    except (RuntimeError, ValueError):
        return GroupComm(group, store=store)
    return TorchComm(group)


def gloo_group(store: dist.Store, rank: int, size: int, timeout: timedelta) -> dist.ProcessGroup:
    """A gloo group of its own over ``store``, independent of any default world."""
    return bare_group("gloo", store, rank, size, timeout)


def bare_group(backend: str, store: dist.Store, rank: int, size: int, timeout: timedelta) -> dist.ProcessGroup:
    """A group of its own over ``store`` with ``backend`` (``gloo`` for CPU tensors, ``nccl`` for
    CUDA ones: ``rlhf_switch.device``), independent of any default world."""
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    if backend == "nccl":  # not run here: no GPU in CI
        if not dist.is_nccl_available():
            raise RuntimeError("backend nccl: this torch build has no NCCL (a CPU-only build); use device: cpu")
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    raise ValueError(f"backend {backend!r}: expected gloo or nccl")


def comm_device(backend: str) -> torch.device:
    """Where a group of ``backend`` sends from and receives into: this process's current CUDA
    device for NCCL, the CPU for gloo."""
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
