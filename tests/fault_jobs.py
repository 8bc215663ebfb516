"""Rank jobs for the fault tests: one rank of a ``LocalWorld`` kills itself (SIGKILL) at a chosen
point of a move; the others report what their move raised.

The kill points are armed by patching, in the dying rank's process only, the functions the
executor calls there (test-only; the executor has no hook for this):

* ``before_move``: right before ``move`` (the survivors fail in the agreement gather);
* ``before_first_send``: at the start of ``executor._run``, after the agreement, before it posts
  anything;
* ``mid_message``: a moment after posting its first large send (``MID_MESSAGE_DELAY_S``), while
  gloo is writing it — the survivor receiving it ends up with part of it;
* ``after_sends``: it posts its receives nowhere (they are held back), waits until every send it
  posted has completed (those that can: ``_HeldBack``), then dies with its receives outstanding;
* ``mid_copy``: right after posting its first large send as a same-host copy
  (``routing/same_host.py``), while its receiver copies out of its memory;
* ``taking_a_board_offer``: as its reader takes the first read message offered on the board
  (sources in shared memory), so its senders wait for acknowledgements that never come.

The gloo points patch gloo's send/recv: their tests run with same-host copies off.
"""
from __future__ import annotations

import os
import signal
import threading
import time

import torch
import torch.distributed as dist

from rank_jobs import garbage_like, tensor_source
from rlhf_switch.routing import Deadlines, PeerLost, executor, move
from rlhf_switch.routing import same_host
from rlhf_switch.routing.comm import TorchComm
from rlhf_switch.vps import Layout
from rlhf_switch.vps.materialize import allocate, bits, coverage_masks, materialize
from rlhf_switch.vps.planner import plan_rank

MID_MESSAGE_DELAY_S = 0.003
LARGE = 1 << 20  # a send at least this large is "a large message"


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class _HeldBack:
    """A receive that was never posted: waiting on it waits for this rank's sends, then dies.

    A peer posts its later receives only after its older staged steps finish, and some of those
    wait for a receive held back here: the sends that can complete do so at once, the others
    never will — so together they get ``SENDS_S`` at most."""

    SENDS_S = 1.0

    def __init__(self, sends: list):
        self.sends = sends

    def wait(self, timeout=None):
        from datetime import timedelta

        end = time.monotonic() + self.SENDS_S
        for w in self.sends:
            try:
                w.wait(timedelta(seconds=max(end - time.monotonic(), 0.001)))
            except Exception:  # noqa: BLE001 - a send its peer takes only after this rank receives
                break
        _die()


def _arm(point: str) -> None:
    if point == "before_first_send":
        executor._run = lambda *a, **k: _die()
    elif point == "mid_message":
        real = TorchComm.isend

        def isend(self, tensor, peer, tag=0):
            work = real(self, tensor, peer, tag)
            if tensor.numel() * tensor.element_size() >= LARGE:
                threading.Timer(MID_MESSAGE_DELAY_S, _die).start()
            return work
        TorchComm.isend = isend
    elif point == "after_sends":
        sends: list = []
        real = TorchComm.isend

        def isend(self, tensor, peer, tag=0):
            work = real(self, tensor, peer, tag)
            sends.append(work)
            return work
        TorchComm.isend = isend
        TorchComm.irecv = lambda self, tensor, peer, tag=0: _HeldBack(sends)
    elif point == "mid_copy":
        real_offer = same_host.SameHost._offer

        def offer(self, comm, peer, tensor, *control):
            work = real_offer(self, comm, peer, tensor, *control)
            _die()
            return work
        same_host.SameHost._offer = offer
    elif point == "taking_a_board_offer":
        same_host._Board.offer = lambda *a, **k: _die()
    elif point != "before_move":
        raise ValueError(point)


def move_with_a_death(dying: int, point: str, src: Layout, dst: Layout, deadline: Deadlines,
                      budget_bytes: int, seed: int = 0, shared: bool = False) -> dict:
    """Every rank moves ``src`` -> ``dst``; rank ``dying`` dies at ``point``. Returns, per surviving
    rank, what its move raised and how long it took, whether its source buffers are bit-identical
    to before, and how much of what the dead rank was sending it arrived intact. ``shared``:
    sources in shared memory (``same_host.share``: mapped reads, offers on the board)."""
    rank = dist.get_rank()
    tensor_of = tensor_source(src, seed)
    src_bufs = materialize(src, rank, tensor_of)
    if shared:
        same_host.share(src_bufs.values())
    src_copy = {n: t.clone() for n, t in src_bufs.items()}
    dst_bufs = garbage_like(allocate(dst, rank, fill=None), seed + 1000 + rank)
    if rank == dying:
        _arm(point)
    dist.barrier()  # enter the move together: its elapsed time is the move's alone
    if rank == dying and point == "before_move":
        _die()
    t0 = time.perf_counter()
    try:
        move(src, dst, src_bufs, dst_bufs, budget_bytes=budget_bytes, deadline=deadline)
        error, lost, deadline_s, reports = None, [], None, {}
    except PeerLost as e:
        error, lost, deadline_s, reports = f"{type(e).__name__}: {e}", e.lost, e.deadline_s, e.reports
    elapsed = time.perf_counter() - t0
    # what the dead rank was to send this rank: how much of it arrived (a partial message shows the
    # kill landed in the middle of one)
    expected = materialize(dst, rank, tensor_of)
    from_dead = arrived = 0
    for t in plan_rank(src, dst, rank).recvs:
        if t.src == dying:
            got = executor._view(dst_bufs, t.dst_buffer, t.dst_offset, t.box.shape, t.dst_strides)
            want = executor._view(expected, t.dst_buffer, t.dst_offset, t.box.shape, t.dst_strides)
            from_dead += got.numel()
            arrived += int((bits(got) == bits(want)).sum())
    return {"rank": rank, "error": error, "lost": lost, "elapsed_s": elapsed, "deadline_s": deadline_s,
            "reports": reports,
            "source_intact": all(torch.equal(bits(t), bits(src_copy[n])) for n, t in src_bufs.items()),
            "from_dead_elements": from_dead, "from_dead_arrived": arrived}


def channel_move_with_a_death(dying: int | None, src: Layout, dst: Layout, seed: int = 0) -> dict:
    """The same through a weight channel (``ChannelEnd.join``: a bare gloo group over rank 0's
    store, the move's census through that store); ``dying`` dies before its first send (None:
    nobody dies, and the move is checked bit for bit)."""
    from rlhf_switch.engines.channel import ChannelEnd, open_store

    rank = dist.get_rank()
    store, host, port = open_store(60) if rank == 0 else (None, None, None)
    addr = [(host, port)]
    dist.broadcast_object_list(addr, src=0)
    end = ChannelEnd.join(addr[0][0], addr[0][1], rank, dist.get_world_size(), store=store,
                          timeout_s=60, budget_bytes=1 << 20, standby_s=60)
    end.set_layouts(src, dst)
    tensor_of = tensor_source(src, seed)
    src_bufs = materialize(src, rank, tensor_of)
    src_copy = {n: t.clone() for n, t in src_bufs.items()}
    dst_bufs = garbage_like(allocate(dst, rank, fill=None), seed + 1000 + rank)
    if rank == dying:
        _arm("before_first_send")
    dist.barrier()
    t0 = time.perf_counter()
    try:
        end.move(src_bufs, dst_bufs)
        error, lost = None, []
    except PeerLost as e:
        error, lost = f"{type(e).__name__}: {e}", e.lost
    elapsed = time.perf_counter() - t0
    expected = materialize(dst, rank, tensor_of)
    masks = coverage_masks(dst, rank)  # padding is not the move's to write
    exact = all(torch.equal(bits(dst_bufs[n])[masks[n]], bits(expected[n])[masks[n]]) for n in dst_bufs)
    if error is None:
        dist.barrier()  # rank 0 hosts the store: it stays until everyone is done with it
    elif rank == 0:
        time.sleep(3)  # the others' census reads the store it hosts
    return {"error": error, "lost": lost, "elapsed_s": elapsed, "exact": exact,
            "source_intact": all(torch.equal(bits(t), bits(src_copy[n])) for n, t in src_bufs.items())}


def close_while_a_peer_sends_checksums() -> str:
    """On a group of its own: rank 1 sends rank 0 a pair's checksums (``VERIFY_TAG``, as
    ``verify_move`` does once its own move is done) that rank 0 never receives; rank 0 then
    closes the group (``Comm.close``, as after a failed move: a receive that must time out).
    Returns what each rank saw: rank 0 that it closed, rank 1 how its send ended."""
    from datetime import timedelta

    from rank_jobs import bare_gloo_group

    from rlhf_switch.routing.comm import GroupComm
    from rlhf_switch.routing.tags import VERIFY_TAG
    from rlhf_switch.routing.transport import P2P

    group, store = bare_gloo_group()
    comm = GroupComm(group, store=store)
    if comm.rank == 1:
        work = comm.post([P2P(True, torch.arange(4, dtype=torch.int64).view(2, 2), 0, VERIFY_TAG)])[0]
        store.set("checksums sent", "1")
        try:
            work.wait(timedelta(seconds=30))
            return "send completed"
        except Exception as e:  # noqa: BLE001 - the test reads gloo's text
            return f"{type(e).__name__}: {e}"
    store.wait(["checksums sent"])
    time.sleep(0.3)  # the checksums are at rank 0 before its close's receive is posted
    comm.close()
    return "closed"
