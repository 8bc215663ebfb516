"""Turn one rank's plan into a schedule: chunks under a staging budget, in deadlock-free rounds.

*Messages (chunks).* Transfers to one peer are cut, in the plan's canonical order, into
messages of at most ``budget // 4`` bytes (``budget // 2`` when a quarter cannot hold an
element); a transfer larger than that is cut into sub-boxes in row-major order. A message is a
run of pieces that is one contiguous range of the source buffer (sent straight from it: zero
copy), of the destination buffer (received straight into it), both, or neither (packed into /
unpacked from staging). Small pieces are merged into staged messages when the copies cost less
than the messages they save (``MERGE_BYTES``); the small messages left over (a norm between two
big slices) travel together after the peer's others. Both ends cut identically because both start from
the same transfer list and decide from the two views alone. Where the receiver can read the
sender's memory (same host: ``same_host.py``), a direction is cut into *read messages* instead
(``_read_chunks``): as few as the sender's packing allows, read straight into place.

*Rounds.* Pairs of ranks talk in the rounds of a round-robin tournament (the circle method):
in round ``k`` every rank has at most one partner, so no rank can wait on a peer that waits on
someone else. The round of a pair is a formula of the two ranks, so each rank orders its own
peers without knowing anyone else's plan and without any extra collective::

    n = world rounded up to even, m = n - 1
    round(a, b) = a            if b == m   (the fixed player)
                = (a + b) / 2  mod m        otherwise

*Posting order.* NCCL matches the messages between two ranks by the order they are posted in
(it has no tags). ``Schedule.batches`` is that order, decided by the plan alone: exchanges in (round, peer) order, and in each the steps in order; a step's two
messages go lower rank → higher rank first, then back, on both ends. So the two ends of a pair
post the same sequence of (direction, bytes) messages — whether each side stages a message or
sends/receives it in place changes neither its place nor its size. A round is one batch
(``batch_isend_irecv``), cut where a staged step must first wait for older ones to free the pool.

*Staging.* The staged steps of all exchanges share one pool laid out as a ring
(``Schedule.staged``): a step is packed and posted while older ones are in flight, and retires
the oldest when it does not fit. The schedule knows the exact peak before anything runs.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch

from ..vps.layout import LayoutError
from ..vps.planner import RankPlan, Transfer
from ..vps.space import Box, row_major_strides
from ..vps.spec import itemsize


class Piece(NamedTuple):
    transfer: Transfer
    box: Box  # inside transfer.box

    @property
    def nbytes(self) -> int:
        return self.box.numel * itemsize(self.transfer.dtype)

    def src_view(self) -> tuple[int, tuple[int, ...]]:
        t = self.transfer
        return t.src_offset + _delta(self.box, t.box, t.src_strides), t.src_strides

    def dst_view(self) -> tuple[int, tuple[int, ...]]:
        t = self.transfer
        return t.dst_offset + _delta(self.box, t.box, t.dst_strides), t.dst_strides


ALIGN = 8  # piece offsets inside a staging tensor, so any dtype can view its slice


class Chunk(NamedTuple):
    pieces: tuple[Piece, ...]
    offsets: tuple[int, ...]  # byte offset of each piece in the chunk's staging tensor (read: -1 in place)
    nbytes: int  # staging size, alignment included (read: the bytes it carries)
    stage_send: bool  # the sender packs into a staging tensor
    stage_recv: bool  # the receiver unpacks from a staging tensor
    # a read message (``_read_chunks``): the receiver copies it out of the sender's memory (same
    # host) straight into its destination views — pieces with long source runs from the source
    # buffers, the others from the sender's staging, where it packed ``packed`` bytes of them
    read: bool = False
    packed: int = 0


class Exchange(NamedTuple):
    round: int
    peer: int
    steps: tuple[tuple[Chunk | None, Chunk | None], ...]  # (send, recv) per step


class StagedStep(NamedTuple):
    """A step that stages something: where its bytes sit in the staging pool, and how many of the
    oldest steps still in flight must finish (and be unpacked) before it is packed and posted."""

    exchange: int  # index into Schedule.exchanges
    step: int  # index into that exchange's steps
    offset: int  # byte offset of the step's block in the pool: [recv chunk | send chunk]
    recv_bytes: int  # 0 when the step's receive is direct (or absent)
    send_bytes: int
    retire: int


class Message(NamedTuple):
    """One point-to-point message, as the executor posts it."""

    exchange: int  # index into Schedule.exchanges
    step: int  # index into that exchange's steps
    send: bool  # this rank sends the step's send chunk (else it receives the step's recv chunk)


class Batch(NamedTuple):
    """Messages posted together as one ``batch_isend_irecv``, in this order, after ``retire`` of
    the oldest staged steps in flight have finished (``StagedStep.retire`` of the batch's first
    step: that step's block of the pool must be free before it is packed)."""

    retire: int
    messages: tuple[Message, ...]


class Copy(NamedTuple):
    """One strided copy between a buffer view and another view: ``shape`` elements from
    ``src_buffer`` (element ``src_offset``, ``src_strides``) to ``dst_buffer`` (likewise). In a
    staged message one side is the staging pool (buffer ``None``, viewed as ``dtype``); a local
    copy has both sides in buffers. Dimensions that are one run on both sides are merged, and so
    are copies that continue each other (``merge_copies``)."""

    src_buffer: str | None
    src_offset: int
    src_strides: tuple[int, ...]
    dst_buffer: str | None
    dst_offset: int
    dst_strides: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: str  # what the staging side is viewed as (the transfer's dtype)


class Op(NamedTuple):
    """One message of a compiled posting program."""

    send: bool
    peer: int
    nbytes: int
    buffer: str | None  # direct: the buffer it is sent from / received into; None: staged
    offset: int  # direct: element offset in ``buffer``; staged: byte offset in the pool
    numel: int  # direct: elements of ``buffer`` (the message is one flat range of it)
    copies: tuple[Copy, ...]  # staged: packed before the send / unpacked after the receive
    step: int  # the staged step (index into ``Schedule.staged[0]``) it belongs to; -1: none
    chunk: "Chunk"  # what it carries (for tests' hooks and error messages)
    # a read message: sending, the source buffers it offers (``ReadSend``); receiving, where its
    # bytes are on both sides (``ReadRuns``); None: a message like any other
    read: "ReadSend | ReadRuns | None" = None


class ReadSend(NamedTuple):
    """What the sender of a read message offers: the addresses of the buffers read in place
    (``in_place``, ``read_names``), and where every source buffer of the message can be mapped
    (``sources``, ``source_names``) — when all of them can, it packs nothing (``same_host``)."""

    in_place: tuple[str, ...]
    sources: tuple[str, ...]


class ReadRuns(NamedTuple):
    """A read message's bytes, in order, as runs that are contiguous in the sender's memory
    (``remote``) and in the receiver's (``local``): the receiver hands both lists to
    ``process_vm_readv`` as they are (the kernel walks the two apart, so they need not cut
    alike). ``remote`` base 0 is the sender's staging block, base ``k`` the ``k``-th of
    ``src_names`` (the addresses its offer carries); ``local`` base ``k`` is ``dst_names[k]``.
    Byte offsets count from each buffer's first element; runs that continue each other are merged."""

    src_names: tuple[str, ...]
    dst_names: tuple[str, ...]
    remote: torch.Tensor  # int64 [n, 3]: (base, byte offset, bytes)
    local: torch.Tensor  # int64 [m, 3]
    nbytes: int
    # where the sender's buffers can be mapped (``same_host``, mapped reads): the message as
    # strided copies straight from ``sources`` (its source buffers, ``source_names``) into
    # ``dst_names``, one per run of pieces that continue each other
    sources: tuple[str, ...] = ()
    copies: tuple[Copy, ...] = ()


class ProgramBatch(NamedTuple):
    retire: int  # oldest staged steps to finish first (``Batch.retire``)
    ops: tuple[Op, ...]
    new_steps: tuple[int, ...]  # staged steps whose pool blocks this batch starts using


class Program(NamedTuple):
    """``Schedule.batches`` compiled for the executor (``Schedule.compile_program``)."""

    batches: tuple[ProgramBatch, ...]
    steps: tuple[tuple[int, int], ...]  # per staged step: (pool offset, bytes)
    pool_bytes: int
    pool_on: tuple[str, str] | None  # ("src" | "dst", buffer) whose device the pool lives on
    bytes_sent: int
    bytes_received: int
    bytes_local: int


@dataclass(frozen=True)
class Schedule:
    plan: RankPlan
    budget_bytes: int
    exchanges: tuple[Exchange, ...]
    local_runs: tuple = ()
    align: int = ALIGN  # staging blocks start at multiples of this (the largest item size)

    @functools.cached_property
    def staged(self) -> tuple[tuple[StagedStep, ...], int]:
        """The staging program and its peak (the pool's size), computed once.

        Steps that stage are laid out in one pool of ``budget_bytes`` as a ring, in execution
        order; a step whose block does not fit retires the oldest steps in flight until it does.
        A step needs at most two chunks of at most ``budget // 2`` bytes, so it always fits once
        everything older has retired, and a step only ever waits for older steps: the order
        (round, step) is the same on both ends of every pair, so no rank waits on a peer that
        waits on it. The executor follows this program exactly, so its peak is this peak."""
        out: list[StagedStep] = []
        alive: list[tuple[int, int]] = []  # (offset, size) of steps in flight, oldest first
        head = 0  # index of the oldest step in flight
        peak = 0
        cap = self.budget_bytes
        for ei, ex in enumerate(self.exchanges):
            for si, (send, recv) in enumerate(ex.steps):
                rb = _up(recv.nbytes, self.align) if recv is not None and recv.stage_recv else 0
                sb = (_up(send.packed if send.read else send.nbytes, self.align)
                      if send is not None and send.stage_send else 0)
                need = rb + sb
                if not need:
                    continue
                retire = 0
                while True:
                    live = alive[head:]
                    if not live:
                        at = 0
                        break
                    first, (last_off, last_size) = live[0][0], live[-1]
                    tail = last_off + last_size
                    if first <= last_off:  # not wrapped: free space after the tail and before the head
                        if tail + need <= cap:
                            at = tail
                            break
                        if need <= first:
                            at = 0
                            break
                    elif tail + need <= first:  # wrapped: free space between the tail and the head
                        at = tail
                        break
                    head += 1
                    retire += 1
                alive.append((at, need))
                peak = max(peak, at + need)
                out.append(StagedStep(ei, si, at, rb, sb, retire))
        return tuple(out), peak

    @functools.cached_property
    def batches(self) -> tuple[Batch, ...]:
        """The posting program (see the module docstring), computed once.

        One batch per exchange (a round: one peer), cut before every staged step that must retire
        older steps first — those waits are only ever for steps posted earlier, in the same
        (round, step) order on every rank, so they cannot deadlock, on gloo or on an NCCL stream.
        The two ends of a pair may cut at different steps (a sender that casts stages a message
        its peer receives in place): cuts group messages, they do not reorder them, and neither
        NCCL nor gloo needs the two ends' groups to coincide — only the order within the pair."""
        retire_at = {(st.exchange, st.step): st.retire for st in self.staged[0]}
        lower = [self.plan.rank < ex.peer for ex in self.exchanges]
        out: list[Batch] = []
        for ei, ex in enumerate(self.exchanges):
            retire, messages = 0, []
            for si, (send, recv) in enumerate(ex.steps):
                wait = retire_at.get((ei, si), 0)
                if wait:
                    if messages:
                        out.append(Batch(retire, tuple(messages)))
                    retire, messages = wait, []
                step = [Message(ei, si, True)] if send is not None else []
                if recv is not None:  # the lower rank's message of the step goes first
                    step.insert(len(step) if lower[ei] else 0, Message(ei, si, False))
                messages += step
            if messages:
                out.append(Batch(retire, tuple(messages)))
        return tuple(out)

    @functools.cached_property
    def message_digests(self) -> dict[int, int]:
        """``digest_messages(self.batches)``, computed once."""
        return self.digest_messages(self.batches)

    def digest_messages(self, batches: Sequence[Batch]) -> dict[int, int]:
        """Per peer, a hash of the messages between the two ranks in posting order — per message
        its direction (from the lower rank or not), bytes, and its pieces' boxes and offsets —
        the same on both ends when they will post the same sequence."""
        per_peer: dict[int, list] = {}
        for b in batches:
            for m in b.messages:
                ex = self.exchanges[m.exchange]
                chunk = ex.steps[m.step][0 if m.send else 1]
                lower_sends = m.send == (self.plan.rank < ex.peer)
                per_peer.setdefault(ex.peer, []).append(
                    (lower_sends, chunk.nbytes, chunk.read, chunk.offsets if chunk.read else (), tuple(p.box.lo + p.box.hi + (p.transfer.src_offset, p.transfer.dst_offset)
                                                      for p in chunk.pieces)))
        # CPython's hash of ints and tuples of them is the same in every process
        return {p: hash(tuple(seq)) & ((1 << 56) - 1) for p, seq in per_peer.items()}

    @functools.cached_property
    def program(self) -> "Program":
        """``compile_program(self.batches)``, computed once."""
        return self.compile_program(self.batches)

    def compile_program(self, batches: Sequence[Batch]) -> "Program":
        """``batches`` as the executor runs them: every message resolved to the buffer range it
        is sent from / received into, or to its staging block and the copies that pack / unpack
        it — plain integers, so a move does no planning arithmetic per piece (at 10M params the
        per-piece Python of the old executor was a third of a move's time on this box)."""
        staged, _ = self.staged
        step_of = {(st.exchange, st.step): i for i, st in enumerate(staged)}
        out = []
        for b in batches:
            ops, new_steps, seen = [], [], set()
            for m in b.messages:
                ex = self.exchanges[m.exchange]
                send, recv = ex.steps[m.step]
                chunk = send if m.send else recv
                si = step_of.get((m.exchange, m.step), -1)
                if si >= 0 and si not in seen:  # both messages of a step are in one batch
                    seen.add(si)
                    new_steps.append(si)
                if chunk.read:
                    ops.append(_read_op(m.send, ex.peer, chunk, staged[si] if m.send and chunk.packed else None, si))
                elif (chunk.stage_send if m.send else chunk.stage_recv):
                    st = staged[si]
                    base = st.offset + (st.recv_bytes if m.send else 0)
                    ops.append(Op(m.send, ex.peer, chunk.nbytes, None, base, 0,
                                  _stage_copies(chunk, base, m.send), si, chunk))
                else:
                    p = chunk.pieces[0]
                    t = p.transfer
                    buffer, off = (t.src_buffer, p.src_view()[0]) if m.send else (t.dst_buffer, p.dst_view()[0])
                    ops.append(Op(m.send, ex.peer, chunk.nbytes, buffer, off, chunk.nbytes // itemsize(t.dtype),
                                  (), -1, chunk))
            out.append(ProgramBatch(b.retire, tuple(ops), tuple(new_steps)))
        pool_on = None
        if staged:
            send, recv = self.exchanges[staged[0].exchange].steps[staged[0].step]
            pool_on = (("dst", recv.pieces[0].transfer.dst_buffer) if staged[0].recv_bytes
                       else ("src", send.pieces[0].transfer.src_buffer))
        plan = self.plan
        return Program(tuple(out), tuple((st.offset, st.recv_bytes + st.send_bytes) for st in staged),
                       self.staged[1], pool_on, plan.bytes_sent, plan.bytes_received, plan.bytes_local)

    @property
    def peak_staging_bytes(self) -> int:
        return self.staged[1]

    @property
    def messages(self) -> int:
        return sum((s is not None) + (r is not None) for ex in self.exchanges for s, r in ex.steps)

    def __str__(self) -> str:
        return (f"{self.plan}; {len(self.exchanges)} exchanges, {self.messages} messages, "
                f"peak staging {self.peak_staging_bytes} B (budget {self.budget_bytes} B)")


def pair_round(a: int, b: int, world_size: int) -> int:
    n = world_size + (world_size % 2)
    m = n - 1
    if a == m:
        return b
    if b == m:
        return a
    return (a + b) * ((m + 1) // 2) % m


def contiguous(shape: Sequence[int], strides: Sequence[int]) -> bool:
    return all(st == rs for n, st, rs in zip(shape, strides, row_major_strides(shape)) if n > 1)


def build_schedule(plan: RankPlan, budget_bytes: int, src_dtypes: dict[str, str] | None = None,
                   reads: frozenset[tuple[int, int]] = frozenset()) -> Schedule:
    """``src_dtypes``: this rank's source buffer dtypes (a sender casting to the wire dtype must
    stage); without it, sends are assumed not to need a cast. ``reads``: the (sender, receiver)
    directions of this rank's pairs that go as read messages (``_read_chunks``; both ends must be
    given the same: ``executor.read_directions``)."""
    by_peer_send: dict[int, list[Transfer]] = {}
    by_peer_recv: dict[int, list[Transfer]] = {}
    for t in plan.sends:
        by_peer_send.setdefault(t.dst, []).append(t)
    for t in plan.recvs:
        by_peer_recv.setdefault(t.src, []).append(t)
    biggest_item = max((itemsize(t.dtype) for t in plan.sends + plan.recvs), default=1)
    if budget_bytes // 2 < biggest_item:
        raise LayoutError(f"a staging budget of {budget_bytes} B cannot hold one element in each "
                          f"direction (needs >= {2 * biggest_item} B)")
    # a quarter of the budget per message when that holds an element: two steps fit in staging
    # at once, so the next step is packed and posted while the previous one is in flight
    cap = _down(budget_bytes // 4, biggest_item)
    if cap < biggest_item:
        cap = _down(budget_bytes // 2, biggest_item)
    exchanges = []
    for peer in sorted(set(by_peer_send) | set(by_peer_recv)):
        sends, recvs = by_peer_send.get(peer, []), by_peer_recv.get(peer, [])
        sends = _read_chunks(sends, cap) if (plan.rank, peer) in reads else _chunks(sends, cap, src_dtypes)
        recvs = _read_chunks(recvs, cap) if (peer, plan.rank) in reads else _chunks(recvs, cap, None)
        steps = tuple((sends[i] if i < len(sends) else None, recvs[i] if i < len(recvs) else None)
                      for i in range(max(len(sends), len(recvs))))
        exchanges.append(Exchange(pair_round(plan.rank, peer, plan.world_size), peer, steps))
    exchanges.sort(key=lambda e: (e.round, e.peer))
    return Schedule(plan, budget_bytes, tuple(exchanges), _local_runs(plan.local), biggest_item)


# staging copies worth one message less (see _joins). Measured with 4 gloo ranks on 2 cores
# (README): merging 16 pieces per peer into one packed+unpacked message saves 51 µs per
# message at 16 KiB pieces, 22 µs at 64 KiB, and loses from 256 KiB up — this is the break-even
MERGE_BYTES = 128 << 10


class _Run:
    """The message being built: its pieces, and per side the contiguous run they form (if any)."""

    __slots__ = ("pieces", "dtype", "nbytes", "src_end", "dst_end")

    def __init__(self, p: Piece, src_end, dst_end):
        self.pieces = [p]
        self.dtype = p.transfer.dtype
        self.nbytes = p.nbytes
        self.src_end = src_end  # (buffer, element offset just past the run) or None: staged
        self.dst_end = dst_end


def _ends(p: Piece):
    t = p.transfer
    n = p.box.numel
    src_end = dst_end = None
    if contiguous(p.box.shape, t.src_strides):
        src_end = (t.src_buffer, p.src_view()[0] + n)
    if contiguous(p.box.shape, t.dst_strides):
        dst_end = (t.dst_buffer, p.dst_view()[0] + n)
    return src_end, dst_end


def _chunks(transfers: list[Transfer], cap: int, src_dtypes: dict[str, str] | None) -> list[Chunk]:
    """Messages to or from one peer, cut identically on both ends (from the transfers alone).

    A message is a run of pieces that is one contiguous range of the source buffer (sent
    straight from it), of the destination buffer (received straight into it), both, or neither
    (packed into / unpacked from staging, as the old chunks were). Whether a side is direct
    depends only on the two views, which both ends know; a sender that must cast stages a
    message it could otherwise send directly (its own decision: the bytes on the wire are the
    same)."""
    out: list[Chunk] = []
    cur: _Run | None = None
    for t in transfers:
        per = itemsize(t.dtype)
        for box in split_box(t.box, cap // per):
            p = Piece(t, box)
            src_end, dst_end = _ends(p)
            if cur is not None and _joins(cur, p, src_end, dst_end, cap):
                _extend(cur, p, src_end, dst_end)
                continue
            if cur is not None:
                out.append(_close(cur, src_dtypes))
            cur = _Run(p, src_end, dst_end)
    if cur is not None:
        out.append(_close(cur, src_dtypes))
    return _small_together(out, cap, src_dtypes)


# A read message (same host: the receiver copies out of the sender's memory) reads a piece in
# place when its source runs are at least this long, else the sender packs it first. Every remote
# run costs page pinning, ~0.5 µs (`python -m bench.cma_runs`: 13 MB between two processes), and
# packing a 768 B run ~0.06 µs with warm buffers, 2-3x that with the cold sources of a switch; in
# whole switches (README) 4 KiB did as well as 8 or 16 KiB or better. Runs in the
# receiver's own destination views cost ~0.2 µs each: a direction whose destination runs are all
# at least READ_LOCAL_RUN_BYTES is read straight into place, one with shorter runs stays on
# per-message copies (shorter runs would also make run tables of millions of rows).
READ_RUN_BYTES = 4 << 10
READ_LOCAL_RUN_BYTES = 256


def _runs(shape: Sequence[int], strides: Sequence[int]) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    """A view of a box as contiguous runs: the run's length in elements, and the dimensions
    (sizes, strides) the runs are laid out over."""
    shape, (strides,) = coalesce(shape, (strides,))
    if strides[-1] == 1:
        return shape[-1], shape[:-1], strides[:-1]
    return 1, shape, strides


def run_bytes(shape: Sequence[int], strides: Sequence[int], per: int) -> int:
    """The length in bytes of the contiguous runs a view of a box is made of."""
    return _runs(shape, strides)[0] * per


def can_read(transfers: Sequence[Transfer]) -> bool:
    """Whether a direction's transfers can travel as read messages: every destination run long
    enough to be a run of its own (see ``READ_LOCAL_RUN_BYTES``)."""
    return all(run_bytes(t.box.shape, t.dst_strides, itemsize(t.dtype)) >= READ_LOCAL_RUN_BYTES
               for t in transfers)


def _read_chunks(transfers: list[Transfer], cap: int) -> list[Chunk]:
    """A direction's messages when its receiver reads them out of the sender's memory: as few as
    the sender's staging allows — every transfer whose source runs are long read in place (no
    staging, no size limit), the others packed by the sender, at most ``cap`` bytes of them per
    message. Nothing is staged on the receiving side: it reads into its destination views."""
    out: list[Chunk] = []
    pieces: list[Piece] = []
    offsets: list[int] = []
    packed = 0
    for t in transfers:
        per = itemsize(t.dtype)
        if run_bytes(t.box.shape, t.src_strides, per) >= READ_RUN_BYTES:
            pieces.append(Piece(t, t.box))
            offsets.append(-1)
            continue
        for box in split_box(t.box, cap // per):
            p = Piece(t, box)
            at = _aligned(packed)
            if at + p.nbytes > cap:
                out.append(_read_chunk(pieces, offsets, packed))
                pieces, offsets, at = [], [], 0
            pieces.append(p)
            offsets.append(at)
            packed = at + p.nbytes
    if pieces:
        out.append(_read_chunk(pieces, offsets, packed))
    return out


def _read_chunk(pieces: list[Piece], offsets: list[int], packed: int) -> Chunk:
    return Chunk(tuple(pieces), tuple(offsets), sum(p.nbytes for p in pieces), packed > 0, False, True, packed)


def read_names(chunk: Chunk) -> tuple[str, ...]:
    """The source buffers a read message reads in place, in the order its offer gives their addresses."""
    names: dict[str, None] = {}
    for p, o in zip(chunk.pieces, chunk.offsets):
        if o < 0:
            names.setdefault(p.transfer.src_buffer)
    return tuple(names)


def source_names(chunk: Chunk) -> tuple[str, ...]:
    """Every source buffer of a read message, in the order its offer says where each can be mapped."""
    return tuple(dict.fromkeys(p.transfer.src_buffer for p in chunk.pieces))


def _read_op(send: bool, peer: int, chunk: Chunk, step: "StagedStep | None", si: int) -> "Op":
    """A read message compiled: the sender packs its packed pieces into its block of the pool
    (``step``) and offers that block's and its buffers' addresses; the receiver's runs."""
    if send:
        offer = ReadSend(read_names(chunk), source_names(chunk))
        if step is None:
            return Op(True, peer, chunk.nbytes, None, -1, 0, (), -1, chunk, offer)
        base = step.offset + step.recv_bytes
        packed = [(p, o) for p, o in zip(chunk.pieces, chunk.offsets) if o >= 0]
        sub = Chunk(tuple(p for p, _ in packed), tuple(o for _, o in packed), chunk.packed, True, False)
        return Op(True, peer, chunk.nbytes, None, base, 0, _stage_copies(sub, base, True), si, chunk, offer)
    return Op(False, peer, chunk.nbytes, None, -1, 0, (), -1, chunk, read_runs_of(chunk))


def read_runs_of(chunk: Chunk) -> ReadRuns:
    """Where a read message's bytes are, on both sides (``ReadRuns``)."""
    src_names = read_names(chunk)
    dst_names: dict[str, int] = {}
    remote, local, copies = [], [], []
    for p, o in zip(chunk.pieces, chunk.offsets):
        t = p.transfer
        per = itemsize(t.dtype)
        (so, ss), (do, ds) = p.src_view(), p.dst_view()
        shape, (ss, ds) = coalesce(p.box.shape, (ss, ds))
        copies.append(Copy(t.src_buffer, so, ss, t.dst_buffer, do, ds, shape, t.dtype))
        if o >= 0:  # packed: one run of the sender's block, in the box's row-major order
            remote.append((0, torch.tensor([o], dtype=torch.int64), p.nbytes))
        else:
            off, strides = p.src_view()
            remote.append((1 + src_names.index(t.src_buffer),) + _view_runs(p.box.shape, strides, off, per))
        off, strides = p.dst_view()
        local.append((dst_names.setdefault(t.dst_buffer, len(dst_names)),) + _view_runs(p.box.shape, strides, off, per))
    return ReadRuns(src_names, tuple(dst_names), _merged_runs(remote), _merged_runs(local), chunk.nbytes,
                    source_names(chunk), tuple(merge_copies(copies)))


def _view_runs(shape: Sequence[int], strides: Sequence[int], offset: int, per: int) -> tuple[torch.Tensor, int]:
    """Where the contiguous runs of a view of a box start (bytes, in the box's row-major order)
    and how long each is."""
    run, outer, outer_strides = _runs(shape, strides)
    starts = torch.tensor([offset], dtype=torch.int64)
    for n, st in zip(outer, outer_strides):
        starts = (starts.unsqueeze(-1) + torch.arange(n, dtype=torch.int64) * st).reshape(-1)
    return starts * per, run * per


def _merged_runs(parts: list[tuple[int, torch.Tensor, int]]) -> torch.Tensor:
    """(base, starts, run length) per piece, as one int64 [n, 3] table of (base, offset, bytes),
    runs that continue the one before them (same base) merged."""
    base = torch.cat([torch.full_like(starts, b) for b, starts, _ in parts])
    off = torch.cat([starts for _, starts, _ in parts])
    lens = torch.cat([torch.full_like(starts, n) for _, starts, n in parts])
    head = torch.ones_like(base, dtype=torch.bool)
    head[1:] = (base[1:] != base[:-1]) | (off[1:] != off[:-1] + lens[:-1])
    group = torch.cumsum(head, 0) - 1
    merged = torch.zeros(int(head.sum()), dtype=torch.int64).index_add_(0, group, lens)
    return torch.stack([base[head], off[head], merged], 1).contiguous()


def _small_together(chunks: list[Chunk], cap: int, src_dtypes: dict[str, str] | None) -> list[Chunk]:
    """The messages of at most ``MERGE_BYTES // 2`` (norms, biases, short slices between big
    pieces that joined neither neighbour) moved to the end and merged into as few as fit ``cap``,
    staged where they must be: each byte costs at most two copies of at most ``MERGE_BYTES``
    per message saved — the break-even ``_joins`` prices. Kept as they were unless that makes
    fewer messages (staging pads pieces: with a tiny budget it can make more)."""
    small = [c for c in chunks if c.nbytes <= MERGE_BYTES // 2]
    if len(small) < 2:
        return chunks
    merged: list[Chunk] = []
    cur: _Run | None = None
    for c in small:
        for p in c.pieces:
            src_end, dst_end = _ends(p)
            if cur is not None and _size_with(cur, p, src_end, dst_end) + p.nbytes <= cap:
                _extend(cur, p, src_end, dst_end)
                continue
            if cur is not None:
                merged.append(_close(cur, src_dtypes))
            cur = _Run(p, src_end, dst_end)
    merged.append(_close(cur, src_dtypes))
    if len(merged) >= len(small):
        return chunks
    return [c for c in chunks if c.nbytes > MERGE_BYTES // 2] + merged


def _size_with(cur: _Run, p: Piece, src_end, dst_end) -> int:
    """The staging size of the message so far once ``p`` joins it (before ``p``'s own bytes)."""
    direct = cur.src_end is not None or cur.dst_end is not None
    ext_src, ext_dst = _continues(cur, p, src_end, dst_end)
    still_direct = (ext_src or ext_dst) and p.transfer.dtype == cur.dtype
    return cur.nbytes if still_direct else _aligned(_padded(cur.pieces) if direct else cur.nbytes)


def _continues(cur: _Run, p: Piece, src_end, dst_end) -> tuple[bool, bool]:
    """Whether ``p`` starts where the message's direct run ends, on the source and the
    destination side (dtypes aside)."""
    t = p.transfer
    ext_src = cur.src_end is not None and src_end is not None and cur.src_end == (t.src_buffer, p.src_view()[0])
    ext_dst = cur.dst_end is not None and dst_end is not None and cur.dst_end == (t.dst_buffer, p.dst_view()[0])
    return ext_src, ext_dst


def _extend(cur: _Run, p: Piece, src_end, dst_end) -> None:
    ext_src, ext_dst = _continues(cur, p, src_end, dst_end)
    same = p.transfer.dtype == cur.dtype
    src, dst = ext_src and same, ext_dst and same
    if src or dst:
        cur.nbytes += p.nbytes  # still one direct run on some side: unpadded
        cur.src_end = src_end if src else None  # the piece's own ends are the run's new ends
        cur.dst_end = dst_end if dst else None
    else:  # staged on both sides from now on: the padded layout, laid out again in _close
        cur.nbytes = _padded(cur.pieces) if (cur.src_end or cur.dst_end) else cur.nbytes
        cur.nbytes = _aligned(cur.nbytes) + p.nbytes
        cur.src_end = cur.dst_end = None
    cur.pieces.append(p)


def _padded(pieces) -> int:
    off = 0
    for q in pieces:
        off = _aligned(off) + q.nbytes
    return off


def _joins(cur: _Run, p: Piece, src_end, dst_end, cap: int) -> bool:
    """Whether ``p`` joins the message being built. A message per piece costs a message's fixed
    price (on gloo about what copying ~100 KiB costs); one staged message costs a copy of every
    byte on its staged sides. So ``p`` joins when it extends the message's direct runs, or when
    staging what that takes (the message so far on a side whose run ``p`` breaks, ``p`` itself
    on a side where it could have travelled directly) copies at most ``MERGE_BYTES``."""
    t = p.transfer
    direct = cur.src_end is not None or cur.dst_end is not None
    ext_src, ext_dst = _continues(cur, p, src_end, dst_end)
    still_direct = (ext_src or ext_dst) and t.dtype == cur.dtype
    if _size_with(cur, p, src_end, dst_end) + p.nbytes > cap:
        return False
    if still_direct and (ext_src or cur.src_end is None) and (ext_dst or cur.dst_end is None):
        # both direct runs (those it has) go on; a side already staged stages p too
        return (cur.src_end is not None or src_end is None or p.nbytes <= MERGE_BYTES) and \
               (cur.dst_end is not None or dst_end is None or p.nbytes <= MERGE_BYTES)
    # p breaks a run, or a dtype change breaks the unpadded layout: price the staging it costs
    if direct and t.dtype != cur.dtype:
        demote_src, demote_dst = cur.src_end is not None, cur.dst_end is not None
    else:
        demote_src = cur.src_end is not None and not ext_src
        demote_dst = cur.dst_end is not None and not ext_dst
    keep_src = cur.src_end is not None and not demote_src
    keep_dst = cur.dst_end is not None and not demote_dst
    cost = (cur.nbytes if demote_src else 0) + (cur.nbytes if demote_dst else 0)
    cost += (p.nbytes if src_end is not None and not keep_src else 0)
    cost += (p.nbytes if dst_end is not None and not keep_dst else 0)
    return cost <= MERGE_BYTES


def _close(run: _Run, src_dtypes: dict[str, str] | None) -> Chunk:
    pieces = tuple(run.pieces)
    offsets, off = [], 0
    padded = run.src_end is None and run.dst_end is None
    for p in pieces:
        off = _aligned(off) if padded else off
        offsets.append(off)
        off += p.nbytes
    cast = src_dtypes is not None and any(src_dtypes.get(p.transfer.src_buffer, p.transfer.dtype)
                                          != p.transfer.dtype for p in pieces)
    return Chunk(pieces, tuple(offsets), off, cast or run.src_end is None, run.dst_end is None)


def _aligned(n: int) -> int:
    return _up(n, ALIGN)


def _up(n: int, a: int) -> int:
    return -(-n // a) * a


def _down(n: int, a: int) -> int:
    return n // a * a


def _local_runs(local: Sequence[Transfer]) -> tuple[Copy, ...]:
    """The same-rank copies: each transfer straight from its source view to its destination
    view (strided or not: never through staging), grouped per (source buffer, destination
    buffer) pair and merged where one continues another on both sides (``merge_copies``)."""
    groups: dict[tuple[str, str], list[Copy]] = {}
    for t in local:
        shape, (ss, ds) = coalesce(t.box.shape, (t.src_strides, t.dst_strides))
        groups.setdefault((t.src_buffer, t.dst_buffer), []).append(
            Copy(t.src_buffer, t.src_offset, ss, t.dst_buffer, t.dst_offset, ds, shape, t.dtype))
    out: list[Copy] = []
    for copies in groups.values():
        copies.sort(key=lambda c: (c.src_offset, c.dst_offset))
        out += merge_copies(copies)
    return tuple(out)


def _stage_copies(chunk: Chunk, base: int, send: bool) -> tuple[Copy, ...]:
    """A staged message's pack (``send``: buffer views -> staging) or unpack copies; the
    staging side at byte ``base`` + the piece's offset, viewed as the transfer's dtype."""
    out = []
    for p, o in zip(chunk.pieces, chunk.offsets):
        t = p.transfer
        per = itemsize(t.dtype)
        assert (base + o) % per == 0, "staging offsets are aligned to the largest item size"
        stage = (base + o) // per
        if send:
            off, strides = p.src_view()
            shape, (bs, ss) = coalesce(p.box.shape, (strides, row_major_strides(p.box.shape)))
            out.append(Copy(t.src_buffer, off, bs, None, stage, ss, shape, t.dtype))
        else:
            off, strides = p.dst_view()
            shape, (ss, bs) = coalesce(p.box.shape, (row_major_strides(p.box.shape), strides))
            out.append(Copy(None, stage, ss, t.dst_buffer, off, bs, shape, t.dtype))
    return tuple(merge_copies(out))


def coalesce(shape: Sequence[int], strides: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], list[tuple[int, ...]]]:
    """``shape`` with its size-1 dimensions dropped and neighbouring dimensions merged where
    they are one run in every one of the views ``strides`` — the fewest dimensions that describe
    the same elements, so a copy walks long inner runs (a row-major block becomes one flat run)."""
    dims = [(n, [s[i] for s in strides]) for i, n in enumerate(shape) if n != 1]
    if not dims:
        return (1,), [(1,) for _ in strides]
    merged = [[dims[0][0], dims[0][1]]]
    for n, st in dims[1:]:
        last = merged[-1]
        if all(a == b * n for a, b in zip(last[1], st)):
            last[0], last[1] = last[0] * n, st
        else:
            merged.append([n, st])
    return tuple(n for n, _ in merged), [tuple(st[k] for _, st in merged) for k in range(len(strides))]


def merge_copies(copies: Sequence[Copy]) -> list[Copy]:
    """Consecutive copies merged where the next continues the previous along its first dimension
    on both sides (same buffers, same inner shape and strides): flat runs that meet, or blocks of
    rows that follow each other in both views, become one copy."""
    out: list[Copy] = []
    for c in copies:
        if out:
            a = out[-1]
            n = a.shape[0]
            if (a.src_buffer == c.src_buffer and a.dst_buffer == c.dst_buffer and a.dtype == c.dtype
                    and a.shape[1:] == c.shape[1:] and a.src_strides == c.src_strides
                    and a.dst_strides == c.dst_strides
                    and c.src_offset == a.src_offset + n * a.src_strides[0]
                    and c.dst_offset == a.dst_offset + n * a.dst_strides[0]):
                out[-1] = a._replace(shape=(n + c.shape[0],) + a.shape[1:])
                continue
        out.append(c)
    return out


def split_box(box: Box, max_numel: int) -> list[Box]:
    """Cut ``box`` into row-major sub-boxes of at most ``max_numel`` elements each."""
    if max_numel < 1:
        raise LayoutError("staging budget smaller than one element")
    if box.numel <= max_numel:
        return [box]
    inner = box.numel // box.shape[0]
    lo, hi = box.lo, box.hi
    if inner <= max_numel:
        rows = max_numel // inner
        return [Box((r,) + lo[1:], (min(r + rows, hi[0]),) + hi[1:]) for r in range(lo[0], hi[0], rows)]
    out = []
    for r in range(lo[0], hi[0]):
        slab = Box((0,) + lo[1:], (1,) + hi[1:])
        out += [Box((r,) + b.lo[1:], (r + 1,) + b.hi[1:]) for b in _split_inner(slab, max_numel)]
    return out


def _split_inner(slab: Box, max_numel: int) -> list[Box]:
    inner = Box(slab.lo[1:], slab.hi[1:])
    return [Box((0,) + b.lo, (1,) + b.hi) for b in split_box(inner, max_numel)]


def _delta(sub: Box, box: Box, strides: Sequence[int]) -> int:
    return sum((a - b) * s for a, b, s in zip(sub.lo, box.lo, strides))
