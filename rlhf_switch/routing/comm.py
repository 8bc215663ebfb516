"""The few communication calls a move needs, over either kind of process group.

A move between a trainer and a generation engine runs over a group the two sides form for the
purpose (a TCPStore + ``ProcessGroupGloo``/``ProcessGroupNCCL`` made inside vLLM's workers, which
already have a default world of their own). Such a group is not registered with
``torch.distributed``, so ``dist.isend(..., group=pg)`` cannot use it; its own ``send``/``recv``/
``allgather`` methods can. ``as_comm`` picks the right wrapper.
"""
from __future__ import annotations

import pickle
from datetime import timedelta

import torch
import torch.distributed as dist


# torch 2.13 deprecates ``all_gather_into_tensor`` (a FutureWarning per call) in favour of
# ``all_gather_single``, the same collective: use the new name where it exists
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Comm:
    rank: int
    size: int

    def isend(self, tensor: torch.Tensor, peer: int, tag: int = 0):
        raise NotImplementedError

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int = 0):
        raise NotImplementedError

    def all_gather_object(self, obj) -> list:
        raise NotImplementedError

    def all_gather_ints(self, values: list[int]) -> list[list[int]] | None:
        """Every rank's ``values`` (the same number of int64s on every rank), in one small
        collective; ``None`` where this comm has no such collective (callers fall back)."""
        return None


class TorchComm(Comm):
    """A group registered with torch.distributed (the default world or ``dist.new_group``)."""

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)

    def _global(self, peer: int) -> int:
        return peer if self.group is None else dist.get_global_rank(self.group, peer)

    def isend(self, tensor, peer, tag=0):
        return dist.isend(tensor, self._global(peer), group=self.group, tag=tag)

    def irecv(self, tensor, peer, tag=0):
        return dist.irecv(tensor, self._global(peer), group=self.group, tag=tag)

    def all_gather_ints(self, values):
        device = torch.device("cpu")
        if dist.get_backend(self.group) == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        mine = torch.tensor(values, dtype=torch.int64, device=device)
        out = torch.empty(self.size * mine.numel(), dtype=torch.int64, device=device)
        _all_gather_single(out, mine, group=self.group)
        return out.view(self.size, -1).tolist()

    def all_gather_object(self, obj) -> list:
        out = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out


class GroupComm(Comm):
    """A bare ``ProcessGroup`` object (e.g. ``dist.ProcessGroupGloo(store, rank, size, timeout)``)."""

    def __init__(self, pg: dist.ProcessGroup, device: torch.device | str = "cpu"):
        self.pg = pg
        self.rank = pg.rank()
        self.size = pg.size()
        self.device = torch.device(device)

    def isend(self, tensor, peer, tag=0):
        return self.pg.send([tensor], peer, tag)

    def irecv(self, tensor, peer, tag=0):
        return self.pg.recv([tensor], peer, tag)

    def all_gather_ints(self, values):
        mine = torch.tensor(values, dtype=torch.int64, device=self.device)
        outs = [torch.empty_like(mine) for _ in range(self.size)]
        self.pg.allgather([outs], [mine]).wait()
        return [o.tolist() for o in outs]

    def all_gather_object(self, obj) -> list:
        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(self.device)
        size = torch.tensor([payload.numel()], dtype=torch.int64, device=self.device)
        sizes = [torch.zeros_like(size) for _ in range(self.size)]
        self.pg.allgather([sizes], [size]).wait()
        longest = int(max(s.item() for s in sizes))
        padded = torch.zeros(longest, dtype=torch.uint8, device=self.device)
        padded[:payload.numel()] = payload
        outs = [torch.empty_like(padded) for _ in range(self.size)]
        self.pg.allgather([outs], [padded]).wait()
        return [pickle.loads(o[:int(s.item())].cpu().numpy().tobytes()) for o, s in zip(outs, sizes)]


def as_comm(group) -> Comm:
    if isinstance(group, Comm):
        return group
    if group is None:
        return TorchComm(None)
    try:
        dist.get_rank(group)
    except (RuntimeError, ValueError):
        return GroupComm(group)
    return TorchComm(group)


def gloo_group(store: dist.Store, rank: int, size: int, timeout: timedelta) -> dist.ProcessGroup:
    """A gloo group of its own over ``store``, independent of any default world."""
    return dist.ProcessGroupGloo(store, rank, size, timeout)
