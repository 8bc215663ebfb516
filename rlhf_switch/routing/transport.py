"""How a move's messages and its agreement travel between the ranks of a group.

The executor asks a group's transport (``Comm.transport``) for five things, and for nothing else
of the wire:

* ``start_agreement``: the move's one small all-gather before any byte moves;
* ``batch``: post one batch of point-to-point ops, in order (one ``Work`` per op);
* ``reads`` / ``min_read_bytes`` / ``schedule_key``: which directions may travel as *read
  messages* (the receiver copies the bytes out of the sender's memory: ``schedule._read_chunks``)
  — facts that shape a schedule, so they are part of its cache key;
* ``move_reads``: per move, how a read message is offered, posted and acknowledged;
* ``counts``: what it carried its own way so far (for ``MoveReport``), and ``close`` after a
  failed move.

``PointToPoint`` is the plain transport: every op a message of the comm's process group (gloo
or NCCL point-to-point), the agreement one collective, no read messages. Other transports are
plug-ins (``GLOO_TRANSPORTS``), each a ``module:function`` imported only when a group may use it:
``same_host.SameHost``, single copies between ranks of one host, is one — a gloo group of more
than one rank asks it (``Comm.choose_transport``); a CUDA run never imports it. A transport
belongs to its group, not to one ``Comm`` of it (a move may wrap the same group anew): each call
is given the comm to post over.
"""
from __future__ import annotations

import importlib
from datetime import timedelta
from typing import Hashable, NamedTuple

import torch

from .tags import DEFAULT_TAG


class P2P(NamedTuple):
    """One point-to-point op of a batch: send ``tensor`` to ``peer``, or receive it from them."""

    send: bool
    tensor: torch.Tensor
    peer: int
    tag: int = DEFAULT_TAG
    # a read message (``Transport.move_reads``): what the transport needs to post it
    read: object = None


class MoveReads:
    """A transport's read messages of one move, on one rank (``Transport.move_reads``).

    ``bound`` (the executor's view of the move's buffers) offers ``source(name)`` and
    ``destination(name)`` (this rank's buffers) and ``packed_block(op, packed)`` (a read send's
    block of the staging pool, packed now unless ``packed`` ahead). It may hold ``bound``; nothing
    of the move holds it back (a cycle would keep the buffers and the pool alive until the next
    garbage collection, and a move runs with the collector paused)."""

    def offer_ahead(self, sends) -> None:
        """Before the agreement: offer what of this rank's read sends (the program's ops, in
        posting order) can go with it."""

    def packs(self, op) -> bool:
        """Whether the read send ``op`` has anything to pack into its staging block (the
        executor packs those ahead while the agreement is in flight)."""
        raise NotImplementedError

    def p2p(self, op, packed: bool = False) -> P2P:
        """What the read message ``op`` (send or receive) posts in ``Transport.batch``."""
        raise NotImplementedError


class Transport:
    """How the ranks of one group exchange a move's messages (module docstring)."""

    schedule_key: Hashable = None  # what of it shapes a schedule (read messages); None: nothing

    def reads(self, sender: int, receiver: int) -> bool:
        """Whether ``receiver`` can read ``sender``'s memory (read messages between them; the same
        answer on every rank)."""
        return False

    @property
    def min_read_bytes(self) -> int:
        """The fewest bytes a direction carries to be worth read messages."""
        return 0

    def start_agreement(self, comm, values: list[int]):
        """``comm.start_all_gather_ints(values)`` by this transport's way: returns ``finish(timeout)``
        (every rank's row, in rank order) with ``finish.done()``."""
        raise NotImplementedError

    def batch(self, comm, ops: list[P2P]) -> list:
        """Post ``ops`` over ``comm`` as one batch, in this order; one ``Work`` per op."""
        raise NotImplementedError

    def move_reads(self, bound) -> MoveReads:
        """This move's read messages (only asked where its program has some)."""
        raise RuntimeError(f"a read message on {type(self).__name__}, which reads no peer's memory")

    def counts(self) -> dict[str, int]:
        """What it has carried its own way so far, by ``MoveReport`` field (a move reports the
        difference); empty: nothing."""
        return {}

    def mapped_by_peers(self) -> bool:
        """Whether a peer reads this rank's buffers in shared memory where they are (``share`` is
        then worth its copy)."""
        return False

    def share(self, tensors) -> int:
        """Make ``tensors`` (a sender's buffers) readable by its peers where they are; returns the
        bytes that cost. The plain transport: nothing to do."""
        return 0

    def close(self) -> None:
        """After a failed move (``Comm.close``): stop peers waiting on this rank by this transport's own way."""


class PointToPoint(Transport):
    """The plain transport: each op one message of the comm's group, the agreement one collective."""

    def start_agreement(self, comm, values):
        return comm.start_all_gather_ints(values)

    def batch(self, comm, ops):
        if any(op.read is not None for op in ops):  # schedules only read where a transport reads
            raise RuntimeError("a read message on the plain point-to-point transport")
        return comm.post(ops)


POINT_TO_POINT = PointToPoint()


# the transports a gloo group of more than one rank may take instead of the plain one, asked in
# this order: ``module:function``, ``function(comm, key, timeout)`` -> a ``Transport`` or None
# (none of its pairs can use it). Each is a collective of the group at its first call (every rank
# asks the same list at the same point), a lookup after. Imported at the first group that asks.
GLOO_TRANSPORTS = ("rlhf_switch.routing.same_host:for_group",)


def load_transport_finder(path: str):
    """The finder ``path`` (``module:function``) names, imported now."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def find_transport(finders, comm, key, timeout: timedelta | None = None) -> Transport:
    """The first transport of ``finders`` (``GLOO_TRANSPORTS``' form) that takes the group ``key``,
    else the plain one."""
    for path in finders:
        found = load_transport_finder(path)(comm, key, timeout)
        if found is not None:
            return found
    return POINT_TO_POINT
