"""Execute a transition on real buffers over ``torch.distributed``.

``move`` is the whole protocol, in this order:

1. every rank plans its own part (``plan_rank``) and checks its buffers against both layouts;
   the schedule is cached per (both layouts' digests, rank, budget, what of the group's
   transport shapes it — which ranks can read each other's memory), so a repeated switch (the
   RL loop's every iteration) only re-checks the buffers;
2. one small all-gather of (error flag, plan digest, a signed sum of the per-peer digests), by
   the group's transport (``Transport.start_agreement``): if every rank is fine and they agree,
   go; otherwise one ``all_gather_object`` of (plan digest, per-peer digests, error) and *every*
   rank raises the same ``MoveError`` — before a byte has moved. While the gather is in flight,
   the staged sends of the first batches are packed into this rank's own staging pool (nothing
   a peer or the destination sees);
3. the messages, in the schedule's posting program (``Schedule.batches``): one batch per round
   (``Transport.batch``), every message under one tag. NCCL matches the messages of a pair by
   posting order alone, and so does gloo when every tag is the same — so CI on gloo runs
   exactly the discipline a GPU needs, and a pair whose two ends posted in different orders
   fails (or corrupts) on CPU too. The posting order and every message's size are part of the
   agreement (step 2), so ends that would not match refuse before a byte moves
   (``tests/test_posting_order.py``). Messages that are one contiguous range of the buffers on
   this rank's side go straight from/into them (zero copy); a staged step is packed into the
   staging pool (``Schedule.staged``, never over the budget) just before its batch is posted,
   and a batch whose staged steps need pool space first waits for the oldest staged steps
   (``StagedStep.retire``). Where the transport lets a receiver read its sender's memory, a
   direction may instead be one or a few *read messages* (``schedule._read_chunks``): the
   receiver copies the pieces out of the sender's buffers and packed block straight into its
   destination views, with nothing to unpack; the transport says how each is offered and
   posted (``Transport.move_reads``: with the agreement, where it can).
   The program runs compiled (``Schedule.program``, built once with the cached schedule): per
   message its buffer range or its staging block and copies, per piece two ``as_strided`` views
   and one ``copy_`` — no planning arithmetic in the timed move;
4. local copies (source view → destination view, strided or not, never through staging; dims
   merged where both views are one run, copies that continue each other per buffer pair merged
   into one), while messages are in flight (at the first wait for pool space, or after the last
   batch is posted) — they touch no byte a message reads or writes;
5. wait for everything, unpacking the staged receives;
6. with ``verify`` ``"full"`` or ``"sample"``: checksums of the moved pieces, computed at their
   sources and checked on the bytes that landed (``routing/verify.py``); a corrupted piece raises
   ``VerifyError`` on every rank.

Every wait has a deadline derived from the bytes it waits for (``Deadlines``). Source buffers
are only read, so a failed move loses no state. A move that fails after the agreement — a peer
died, or stopped answering — raises ``PeerLost`` on every surviving rank, naming the lost rank(s)
and what this rank was waiting for (see ``PeerLost``).

How bytes cross between ranks is the group's transport (``Comm.transport``,
``routing/transport.py``), chosen at the group's first move (``Comm.choose_transport``): plain
point-to-point, or single copies between ranks of one host (``routing/same_host.py``) where the
ranks can read each other's memory. The executor reads the same whichever it is.
"""
from __future__ import annotations

import gc
import hashlib
import json
import time
from collections import OrderedDict, deque
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Callable, Mapping

import torch
import torch.distributed as dist

from ..vps.layout import Layout, LayoutError
from ..vps.materialize import torch_dtype
from ..vps.planner import RankPlan, check_pair, plan_rank
from ..vps.spec import itemsize
from .comm import Comm, as_comm
from .schedule import Batch, Schedule, build_schedule, can_read
from .tags import MESSAGE_TAG
from .transport import P2P, Transport
from .verify import DEFAULT_FRACTION, VerifyError, check_mode, verify_move  # noqa: F401 - re-exported

DEFAULT_BUDGET = 64 << 20
DEFAULT_TIMEOUT = timedelta(minutes=5)


class MoveError(RuntimeError):
    """A move that did not happen: refused (identically on every rank) before any data moved,
    or — the subclass ``PeerLost`` — stopped because a peer was lost while it ran."""


@dataclass(frozen=True)
class Deadlines:
    """How long each wait of a move may take: ``clamp(floor_s + bytes / min_rate, floor_s, ceiling_s)``
    where ``bytes`` is what this rank has in flight when it waits (every posted message not yet
    waited for: an upper bound on what must pass before the awaited one completes).

    * ``floor_s`` (10 s): what even a tiny message may take (a loaded host, a slow scheduler);
    * ``min_rate`` (50 MB/s): the slowest transfer rate still called alive — far below any real
      link (loopback, TCP, NVLink), far above a stuck one;
    * ``ceiling_s`` (``None``: the move's ``timeout``, 5 minutes by default): no wait is longer,
      not even the floor;
    * ``arrival_s`` (``None``: the ceiling): the first agreement gather, where the ranks meet —
      a rank that is late (still computing) is not a transfer, so it gets this instead (a weight
      channel's receivers stand ready there for the trainer's whole step);
    * ``census_s`` (2 s): after a failure, how long a rank waits for the other ranks' reports to
      tell a dead peer from one that gave up (see ``PeerLost``).

    A dead peer is usually reported by gloo at once ("Connection closed by peer"); the deadline is
    what names it where gloo only hangs (a peer killed in the middle of a message: torch 2.13's gloo
    does not notice the closed connection until the wait times out)."""

    floor_s: float = 10.0
    min_rate: float = 50e6
    ceiling_s: float | None = None
    arrival_s: float | None = None
    census_s: float = 2.0

    def for_bytes(self, nbytes: int) -> float:
        ceiling = self.ceiling_s if self.ceiling_s is not None else DEFAULT_TIMEOUT.total_seconds()
        return min(max(self.floor_s + nbytes / self.min_rate, self.floor_s), ceiling)  # the ceiling wins

    @property
    def arrival(self) -> float:
        if self.arrival_s is not None:
            return self.arrival_s
        return self.ceiling_s if self.ceiling_s is not None else DEFAULT_TIMEOUT.total_seconds()


DEFAULT_DEADLINES = Deadlines()


class PeerLost(MoveError):
    """A move that stopped on this rank because a peer died or stopped answering.

    Raised by every surviving rank within the deadline of the wait it was in (plus the census,
    at most ``Deadlines.census_s``). Attributes:

    * ``rank``: this rank; ``lost``: the ranks named lost, sorted — ranks that left no report
      (dead, or stuck) among those some rank lost contact with; when no report could be read (no
      store), the peers this rank itself lost;
    * ``pending``: what this rank was waiting for when it stopped, e.g. ``"recv 4096 B from rank 3
      (tag 1048576)"`` or ``"agreement gather (32 B per rank)"``; ``cause``: gloo's own text;
    * ``reports``: what the other ranks said (rank -> text), ``elapsed_s`` since the move began,
      ``deadline_s``: the deadline of the wait that failed.

    The source buffers are untouched (a move only reads them); destination buffers may hold part
    of the new state. This rank's connections in the group are closed (``Comm.close``): re-form
    the group — with a replacement for the lost rank — and move again."""

    def __init__(self, message: str, *, rank: int, lost: list[int], pending: list[str], cause: str,
                 reports: dict[int, str], elapsed_s: float, deadline_s: float):
        super().__init__(message)
        self.rank, self.lost, self.pending, self.cause = rank, lost, pending, cause
        self.reports, self.elapsed_s, self.deadline_s = reports, elapsed_s, deadline_s


@dataclass
class MoveReport:
    rank: int
    transition: str
    bytes_sent: int
    bytes_received: int
    bytes_local: int
    min_bytes_received: int
    messages: int
    peak_staging_bytes: int  # measured: the largest staging allocation alive at once
    planned_peak_staging_bytes: int
    budget_bytes: int
    seconds: float
    dry_run: bool = False
    phases: dict = field(default_factory=dict)  # seconds per phase (prepare, agree, pack_ahead, post, local, wait, verify)
    verify: str = "off"
    pieces_verified: int = 0  # pieces this rank checked as their destination (local ones included)
    # the same-host transport's counts for this move (``Transport.counts``; 0 on plain point-to-point)
    same_host_messages: int = 0  # of ``messages``: sent or received as single copies
    read_messages: int = 0  # of those: read messages (a direction in one or a few reads: schedule._read_chunks)
    mapped_messages: int = 0  # receives copied through a mapping of the sender's shared memory
    board_messages: int = 0  # read messages (sends and receives) offered with the agreement, no gloo message

    def __str__(self) -> str:
        return (f"rank {self.rank}: {self.transition}: sent {self.bytes_sent} B, received "
                f"{self.bytes_received} B (minimum {self.min_bytes_received} B), local {self.bytes_local} B, "
                f"{self.messages} messages, peak staging {self.peak_staging_bytes} B of "
                f"{self.budget_bytes} B, {self.seconds * 1e3:.1f} ms")


@dataclass(frozen=True)
class MoveHooks:
    """Test-only points where a test watches or interferes with one move (``move(hooks=...)``);
    a real move passes none.

    * ``posting_order(schedule)``: the posting program to use instead of ``schedule.batches``
      (a deliberately mis-ordered one, which the agreement must refuse);
    * ``post(peer, send, nbytes)``: called for every message this rank posts, in posting order;
    * ``staged_receive(chunk, staging)``: called after a staged receive landed and before it is
      unpacked, with its bytes in the staging pool (to corrupt them in flight)."""

    posting_order: Callable[[Schedule], tuple[Batch, ...]] | None = None
    post: Callable[[int, bool, int], None] | None = None
    staged_receive: Callable[[object, torch.Tensor], None] | None = None


NO_HOOKS = MoveHooks()


@contextmanager
def gc_paused():
    """Python's cyclic garbage collector held off inside (as it was after). A move is a
    collective: a full collection that starts on one rank stalls every peer waiting on that rank
    — 165–175 ms with a 100M DeepSpeed engine in the heap, measured here on the second switch
    into an engine. Held off, it runs when allocations after the move next trigger it, where
    ranks are not waiting on each other mid-exchange (Megatron-LM's ``--manual-gc`` keeps
    collections off its collectives for the same reason). Also a decorator."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@gc_paused()
def move(src: Layout, dst: Layout, src_buffers: Mapping[str, torch.Tensor],
         dst_buffers: Mapping[str, torch.Tensor], *, group: dist.ProcessGroup | Comm | None = None,
         budget_bytes: int = DEFAULT_BUDGET, ranks_per_node: int | None = None,
         timeout: timedelta = DEFAULT_TIMEOUT, deadline: Deadlines | None = None,
         dry_run: bool = False, verify: str = "off", verify_fraction: float = DEFAULT_FRACTION,
         verify_seed: int = 0, refuse: str | None = None,
         hooks: MoveHooks | None = None) -> MoveReport | Schedule:
    """Move everything ``dst`` wants from ``src``'s buffers into ``dst``'s buffers on this rank.

    ``group`` is the default world, a registered group, a bare ``ProcessGroup`` (one formed
    between a trainer and an engine's workers) or a ``Comm``; layout rank ``r`` is group rank ``r``.
    With ``dry_run`` nothing is communicated: the schedule is returned (it states its peak
    staging memory and every message it would send); without a process group it plans rank 0.

    ``deadline`` says how long each wait may take (``Deadlines``: 10 s + 1 s per 50 MB in flight);
    ``timeout`` is its ceiling (where ``deadline.ceiling_s`` is unset). A peer lost while the
    move runs raises ``PeerLost`` here, on every surviving rank.
    ``verify``: ``"off"`` (nothing more), ``"full"`` (every piece's checksum, computed at its
    source, is checked on the bytes that landed) or ``"sample"`` (a ``verify_fraction`` of each
    pair's pieces, chosen from the plan digest and ``verify_seed``, the same on every rank); see
    ``routing/verify.py``. A mismatch raises ``VerifyError`` on every rank.
    ``refuse``: this rank's own reason not to go ahead (what it does next with the moved bytes
    cannot work — e.g. a colocated worker's buffers do not fit the handoff): every rank then
    raises ``MoveError`` in the agreement, before a byte moves.
    ``hooks``: test-only (``MoveHooks``).
    """
    check_mode(verify, verify_fraction)
    t_start = time.perf_counter()
    comm = as_comm(group) if not dry_run or dist.is_initialized() or group is not None else None
    rank = comm.rank if comm else 0
    world = comm.size if comm else src.world_size
    if src.world_size != world or dst.world_size != world:
        raise LayoutError(f"{src.name} is for {src.world_size} ranks and {dst.name} for "
                          f"{dst.world_size}; this process group has {world}")
    deadline = deadline or DEFAULT_DEADLINES
    if deadline.ceiling_s is None:
        deadline = replace(deadline, ceiling_s=(timeout or DEFAULT_TIMEOUT).total_seconds())
    hooks = hooks or NO_HOOKS
    transport = None
    if not dry_run:
        # the group's transport: chosen once per group, by every rank here (a collective at the
        # group's first move), before planning (which pairs read each other shapes the messages)
        # and before the agreement
        try:
            transport = _waiting(comm.choose_transport, deadline.arrival,
                                 "transport choice (at most two gathers of 24-56 B per rank)", None)
        except _WaitFailed as f:
            raise _lost(f, comm, src, dst, deadline, time.perf_counter() - t_start) from None
    schedule, error = None, None
    try:
        schedule = prepare(src, dst, rank, src_buffers, dst_buffers, budget_bytes, ranks_per_node, transport)
    except (LayoutError, ValueError, KeyError) as e:
        error = f"{type(e).__name__}: {e}"
    if refuse and error is None:
        error = refuse
    if dry_run:
        if error:
            raise MoveError(error)
        return schedule
    batches = schedule.batches if schedule else ()
    if schedule and hooks.posting_order is not None:
        batches = hooks.posting_order(schedule)
    t_prep = time.perf_counter()

    def agree(meanwhile=None):
        _agree(schedule.plan if schedule else None, _pair_agreement(schedule, batches), error, comm,
               src, dst, deadline, meanwhile)

    try:
        if schedule is None or error is not None:
            agree()  # raises MoveError on every rank
        before = transport.counts()
        report = _run(schedule, batches, src_buffers, dst_buffers, comm, deadline, agree, hooks)
        for name, n in transport.counts().items():
            setattr(report, name, n - before[name])
    except _WaitFailed as f:
        raise _lost(f, comm, src, dst, deadline, time.perf_counter() - t_start) from None
    report.phases = dict(prepare=t_prep - t_start, **report.phases)
    if verify != "off":
        t_verify = time.perf_counter()
        report.pieces_verified = verify_move(schedule, src_buffers, dst_buffers, comm, verify, verify_fraction,
                                             verify_seed, timeout or DEFAULT_TIMEOUT)
        report.verify, report.phases["verify"] = verify, time.perf_counter() - t_verify
    report.seconds = time.perf_counter() - t_start
    return report


_SCHEDULES: OrderedDict = OrderedDict()
_SCHEDULE_CACHE = 64


def prepare(src: Layout, dst: Layout, rank: int, src_buffers, dst_buffers, budget_bytes: int,
            ranks_per_node: int | None = None, transport: Transport | None = None) -> Schedule:
    """This rank's schedule, after checking the layouts and the buffers. Schedules are cached
    per (source digest, destination digest, rank, budget, ranks per node, what of the transport
    shapes it): a layout's digest covers everything it says, so an equal key means an equal
    plan; the buffers are checked on every call. ``transport``: the group's, where directions
    between ranks that read each other travel as read messages (``read_directions``); None:
    none do."""
    key = (src.digest, dst.digest, rank, budget_bytes, ranks_per_node,
           transport.schedule_key if transport is not None else None)
    schedule = _SCHEDULES.get(key)
    if schedule is None:
        check_pair(src, dst)
        _validated(src)
        _validated(dst)
        plan = plan_rank(src, dst, rank, ranks_per_node)
    _check_disjoint(rank, _check_buffers("source", src, rank, src_buffers)
                    + _check_buffers("destination", dst, rank, dst_buffers))
    if schedule is None:
        src_dtypes = {n: b.dtype for n, b in src.buffers(rank).items()}
        reads = read_directions(src, plan, transport) if transport is not None else frozenset()
        schedule = build_schedule(plan, budget_bytes, src_dtypes, reads)
        schedule.staged, schedule.batches, schedule.message_digests, schedule.program  # once, here, not in the timed move
        _SCHEDULES[key] = schedule
        while len(_SCHEDULES) > _SCHEDULE_CACHE:
            _SCHEDULES.popitem(last=False)
    else:
        _SCHEDULES.move_to_end(key)
    return schedule


def read_directions(src: Layout, plan: RankPlan, transport: Transport) -> frozenset[tuple[int, int]]:
    """The (sender, receiver) directions of this rank's pairs that travel as read messages: the
    receiver can read the sender's memory, they carry at least ``transport.min_read_bytes``, the
    sender's buffers hold the wire dtype (a read takes its bytes as they are) and every
    destination run is long enough (``schedule.can_read``). Both ends of a direction decide from
    the same facts (the gathered verdicts, the transfers, the source layout), so they agree."""
    by_direction: dict[tuple[int, int], list] = {}
    for t in plan.sends + plan.recvs:
        by_direction.setdefault((t.src, t.dst), []).append(t)
    out = set()
    for (sender, receiver), transfers in by_direction.items():
        if not transport.reads(sender, receiver):
            continue
        if sum(t.box.numel * itemsize(t.dtype) for t in transfers) < transport.min_read_bytes:
            continue
        dtypes = {n: b.dtype for n, b in src.buffers(sender).items()}
        if all(dtypes[t.src_buffer] == t.dtype for t in transfers) and can_read(transfers):
            out.add((sender, receiver))
    return frozenset(out)


_VALID: set[str] = set()


def _validated(layout: Layout) -> None:
    if layout.digest not in _VALID:
        layout.validate()
        _VALID.add(layout.digest)


_EXPECTED: OrderedDict = OrderedDict()


def _expected(layout: Layout, rank: int) -> tuple[tuple[str, torch.dtype, int, int], ...]:
    """(name, dtype, elements, bytes) of every buffer ``layout`` gives ``rank``: what the caller's
    buffers are checked against at every move, worked out once per layout and rank."""
    key = (layout.digest, rank)
    out = _EXPECTED.get(key)
    if out is None:
        out = _EXPECTED[key] = tuple((name, torch_dtype(b.dtype), b.numel, b.numel * itemsize(b.dtype))
                                     for name, b in layout.buffers(rank).items())
        while len(_EXPECTED) > 4 * _SCHEDULE_CACHE:
            _EXPECTED.popitem(last=False)
    return out


def _check_buffers(what: str, layout: Layout, rank: int, buffers: Mapping[str, torch.Tensor]) -> list[tuple]:
    """Refuse buffers that do not match ``layout`` (a missing one, another dtype, too few
    elements, not contiguous: every problem named at once); else their byte spans, for
    ``_check_disjoint``. One pass of a few tensor attributes per buffer: a move at 10M pays it
    for ~100 buffers."""
    spans = []
    for name, dtype, numel, nbytes in _expected(layout, rank):
        t = buffers.get(name)
        if t is None or t.dtype != dtype or t.numel() < numel or not t.is_contiguous():
            _refuse_buffers(what, layout, rank, buffers)
        if numel:
            start = t.data_ptr()
            spans.append((t.get_device(), start, start + nbytes, what, name))
    return spans


def _refuse_buffers(what: str, layout: Layout, rank: int, buffers: Mapping[str, torch.Tensor]) -> None:
    problems = []
    for name, b in layout.buffers(rank).items():
        t = buffers.get(name)
        if t is None:
            problems.append(f"missing {name!r}")
        elif not isinstance(t, torch.Tensor):  # e.g. a LocalState's declarations instead of its tensors
            problems.append(f"{name!r} is a {type(t).__name__}, not a tensor")
        elif t.dtype != torch_dtype(b.dtype):
            problems.append(f"{name!r} is {t.dtype}, layout says {b.dtype}")
        elif t.numel() < b.numel:
            problems.append(f"{name!r} has {t.numel()} elements, layout needs {b.numel}")
        elif not t.is_contiguous():
            problems.append(f"{name!r} is not contiguous")
    raise ValueError(f"{what} buffers of rank {rank} do not match {layout.name}: " + "; ".join(problems))


def _check_disjoint(rank: int, spans: list[tuple]) -> None:
    """Source and destination bytes (``_check_buffers``' spans of both) must not share memory:
    pieces are read while others are already written (local copies overlap the transfers), so
    an aliased buffer would be read after it was overwritten — a silently wrong result, refused
    here instead."""
    spans.sort()
    reach = None  # the span reaching furthest so far on this device: (device, end, side, name)
    for device, start, end, side, name in spans:
        if reach and reach[0] == device and start < reach[1] and reach[2] != side:
            a, b = (reach[3], name) if reach[2] == "source" else (name, reach[3])
            raise ValueError(f"rank {rank}: source buffer {a!r} and destination buffer {b!r} share memory; "
                             f"a move needs separate buffers (copy one side first)")
        if not reach or reach[0] != device or end > reach[1]:
            reach = (device, end, side, name)


_P = (1 << 61) - 1  # a Mersenne prime: the pair digests are summed modulo it


def _pair_agreement(schedule: Schedule | None, batches) -> dict[int, int]:
    """Per peer, what the two ends must agree on before a byte moves: the transfers between them
    (the plan's pair digest) and the messages they cut them into in posting order, with every
    message's size (``Schedule.message_digests``: a different budget on one end, or another
    posting order, changes it)."""
    if schedule is None:
        return {}
    msgs = schedule.message_digests if batches is schedule.batches else schedule.digest_messages(batches)
    return {p: hash((d, msgs.get(p, 0))) & ((1 << 56) - 1)
            for p, d in schedule.plan.pair_digests.items()}


def _agreement_row(plan: RankPlan | None, pair_digests: dict[int, int], error: str | None,
                   rank: int) -> list[int]:
    """(error?, plan digest as two 48-bit ints, signed sum of the pair digests). Every pair's
    digest enters the sum once with + (from its lower rank) and once with - (from its higher
    rank), mixed with the pair's ranks, so the sums of all ranks cancel exactly when every pair
    agrees and, short of a 2^-61 accident, do not when some pair does not."""
    if plan is None:
        return [1, 0, 0, 0]
    d = int(hashlib.sha256(plan.digest.encode()).hexdigest()[:24], 16)
    total = 0
    for p, dig in pair_digests.items():
        a, b = min(rank, p), max(rank, p)
        term = (dig * 0x9E3779B97F4A7C15 + a * 0x100000001B3 + b * 0xC2B2AE3D27D4EB4F + 1) % _P
        total = (total + (term if rank < p else -term)) % _P
    return [1 if error else 0, d >> 48, d & ((1 << 48) - 1), total]


def _agree(plan: RankPlan | None, pair_digests: dict[int, int], error: str | None, comm: Comm, src, dst,
           deadline: Deadlines = DEFAULT_DEADLINES, meanwhile=None) -> None:
    """Step 2 of the module docstring. ``meanwhile(done)``: work that writes nothing a peer or
    the destination sees (packing staged sends into this rank's own pool), done while the gather
    is in flight — the gather mostly waits for the last rank to arrive; ``done()`` says whether
    it is in (the work then stops: it must not delay the posting)."""
    rank, world = comm.rank, comm.size
    what = f"agreement gather ({4 * 8} B per rank)"
    row = _agreement_row(plan, pair_digests, error, rank)
    finish = _waiting(lambda t: comm.transport.start_agreement(comm, row), deadline.arrival, what, None)
    if meanwhile is not None:
        meanwhile(finish.done)
    rows = _waiting(finish, deadline.arrival, what, None)
    if not any(r[0] for r in rows) and len({(r[1], r[2]) for r in rows}) == 1 \
            and sum(r[3] for r in rows) % _P == 0:
        return  # everyone is fine and agrees: the common case, one 32-byte gather per rank
    # someone failed or disagrees (every rank saw the same rows, so every rank is here): gather
    # the details and raise the same error everywhere
    mine = (plan.digest if plan else None, pair_digests, error)
    everyone = _waiting(lambda t: comm.all_gather_object(mine, t), deadline.for_bytes(world * 4096),
                        "agreement details gather", None)
    errors = [(r, e) for r, (_, _, e) in enumerate(everyone) if e]
    if errors:
        msgs = {e for _, e in errors}
        if len(msgs) == 1 and len(errors) == world:
            detail = f"every rank: {msgs.pop()}"
        else:
            detail = "; ".join(f"rank {r}: {e}" for r, e in errors)
        raise MoveError(f"move {src.name} -> {dst.name} refused before any data moved: {detail}")
    digests = {}
    for r, (d, _, _) in enumerate(everyone):
        digests.setdefault(d, []).append(r)
    if len(digests) > 1:
        detail = "; ".join(f"ranks {rs} planned {d}" for d, rs in digests.items())
        raise MoveError(f"plan digest mismatch, refusing to move {src.name} -> {dst.name}: {detail} "
                        f"(the ranks were given different layouts or library versions)")
    for p, d in pair_digests.items():
        theirs = everyone[p][1].get(rank)
        if theirs != d:
            raise MoveError(f"rank {rank} and rank {p} disagree on the transfers between them, or on "
                            f"their messages and posting order ({d} vs {theirs}); refusing to move "
                            f"{src.name} -> {dst.name}")
    bad = sorted({(min(r, p), max(r, p)) for r, (_, pairs, _) in enumerate(everyone)
                  for p, d in pairs.items() if everyone[p][1].get(r) != d})
    if bad:  # ranks whose own pairs agree refuse too: their peers will not take part
        raise MoveError(f"ranks {bad} disagree on the transfers between them, or on their messages and "
                        f"posting order; refusing to move "
                        f"{src.name} -> {dst.name}")


def _view(buffers, name: str, offset: int, shape, strides) -> torch.Tensor:
    buf = buffers[name]
    return torch.as_strided(buf, shape, strides, buf.storage_offset() + offset)


class _Bound:
    """This move's buffers and staging pool, for the compiled program's copies: one
    ``as_strided`` view per side of a copy, nothing else per piece."""

    __slots__ = ("src", "dst", "pool", "typed", "staged_receive")

    def __init__(self, src_buffers, dst_buffers, pool, staged_receive=None):
        self.src = {n: (t, t.storage_offset()) for n, t in src_buffers.items()}
        self.dst = {n: (t, t.storage_offset()) for n, t in dst_buffers.items()}
        self.pool = pool
        self.typed: dict[str, torch.Tensor] = {}
        self.staged_receive = staged_receive  # test-only: ``MoveHooks.staged_receive``

    def source(self, name: str) -> torch.Tensor:
        return self.src[name][0]

    def destination(self, name: str) -> torch.Tensor:
        return self.dst[name][0]

    def _side(self, side, name, offset, strides, shape, dtype):
        if name is None:  # the staging pool, viewed as the transfer's dtype
            t = self.typed.get(dtype)
            if t is None:
                t = self.typed[dtype] = self.pool.view(torch_dtype(dtype))
            return torch.as_strided(t, shape, strides, offset)
        buf, base = side[name]
        return torch.as_strided(buf, shape, strides, base + offset)

    def copy(self, c) -> None:
        self._side(self.dst, c.dst_buffer, c.dst_offset, c.dst_strides, c.shape, c.dtype).copy_(
            self._side(self.src, c.src_buffer, c.src_offset, c.src_strides, c.shape, c.dtype))

    def p2p(self, op, packed: bool = False) -> P2P:
        """What ``op`` (not a read message: ``Transport.move_reads``) posts: its message tensor."""
        return P2P(op.send, self.message(op, packed), op.peer, MESSAGE_TAG)

    def message(self, op, packed: bool = False) -> torch.Tensor:
        """The tensor ``op`` is sent from / received into (packed first when it is a staged send,
        unless it was ``packed`` ahead)."""
        if op.buffer is not None:
            buf, base = (self.src if op.send else self.dst)[op.buffer]
            return torch.as_strided(buf, (op.numel,), (1,), base + op.offset)
        if op.send and not packed:
            self.pack(op)
        return self.pool[op.offset:op.offset + op.nbytes]

    def packed_block(self, op, packed: bool = False) -> torch.Tensor:
        """A read message's send: its block of the staging pool (the pieces not read in place),
        packed first unless it was ``packed`` ahead."""
        if not packed:
            self.pack(op)
        return self.pool[op.offset:op.offset + op.chunk.packed]

    def pack(self, op) -> None:
        for c in op.copies:
            self.copy(c)

    def unpack(self, op) -> None:
        if self.staged_receive is not None:
            self.staged_receive(op.chunk, self.pool[op.offset:op.offset + op.nbytes])
        for c in op.copies:
            self.copy(c)


class _WaitFailed(Exception):
    """A wait (or a post) of a move that failed: what it was, with which peer (``None``: a
    collective), gloo's text, the deadline it had and everything still outstanding on this rank."""

    def __init__(self, what: str, peer: int | None, cause: str, deadline_s: float, pending: list[str]):
        super().__init__(what)
        self.what, self.peer, self.cause, self.deadline_s, self.pending = what, peer, cause, deadline_s, pending


def _waiting(fn, deadline_s: float, what: str, peer: int | None, pending=None):
    try:
        return fn(timedelta(seconds=deadline_s))
    except Exception as e:  # noqa: BLE001 - gloo raises RuntimeError / DistBackendError, with its text
        peer = getattr(e, "peer", peer)  # a wait on every rank that knows whom it lost (PeerGone)
        raise _WaitFailed(what, peer, f"{type(e).__name__}: {e}", deadline_s,
                          [what] + [d for d in (pending() if pending else []) if d != what]) from None


class _Outstanding:
    """The messages this rank has posted and not yet waited for: what a failure was waiting on,
    and the bytes in flight that each wait's deadline is derived from."""

    def __init__(self, comm: Comm, deadline: Deadlines, on_post=None):
        self.comm, self.transport, self.deadline = comm, comm.transport, deadline
        self.on_post = on_post  # test-only: ``MoveHooks.post``
        self.works: dict[int, tuple[object, bool, int, int]] = {}  # token -> (work, send?, bytes, peer)
        self.bytes = 0
        self.posted = 0  # tokens handed out (on NCCL the messages of a batch share one work)

    @staticmethod
    def _what(send: bool, nbytes: int, peer: int) -> str:
        return f"{'send' if send else 'recv'} {nbytes} B {'to' if send else 'from'} rank {peer} (tag {MESSAGE_TAG})"

    def pending(self) -> list[str]:  # only on failure: the descriptions are made here, not per message
        return [self._what(s, n, p) for _, s, n, p in self.works.values()]

    def post_batch(self, ops: list[P2P], sizes: list[int]) -> range:
        """Post ``ops`` (of ``sizes`` bytes) in this order as one batch; tokens to ``wait`` for."""
        if self.on_post is not None:
            for op, n in zip(ops, sizes):
                self.on_post(op.peer, op.send, n)
        try:
            works = self.transport.batch(self.comm, ops)
        except Exception as e:  # noqa: BLE001 - gloo raises RuntimeError / DistBackendError, with its text
            what = self._what(ops[0].send, sizes[0], ops[0].peer) + (
                f" and {len(ops) - 1} more in its batch" if len(ops) > 1 else "")
            raise _WaitFailed(what, ops[0].peer, f"{type(e).__name__}: {e}", 0.0,
                              [what] + self.pending()) from None
        first = self.posted + 1
        for op, n, work in zip(ops, sizes, works):
            self.posted += 1
            self.works[self.posted] = (work, op.send, n, op.peer)
            self.bytes += n
        return range(first, self.posted + 1)

    def wait(self, token: int) -> None:
        work, send, nbytes, peer = self.works[token]
        _waiting(work.wait, self.deadline.for_bytes(self.bytes), self._what(send, nbytes, peer), peer,
                 self.pending)
        del self.works[token]
        self.bytes -= nbytes


# The staging pool of the last completed move, per CPU device, kept for the next one: a fresh
# CPU allocation of tens of MiB is new pages, faulted in on first touch every move — measured here
# (one thread): 64 MiB fresh + filled 26.8 ms vs 8.7 ms reused, 12 MiB 5.2 vs 1.2 ms. Holds at most
# one pool (<= its move's budget) per device between moves; a move takes it out of the map while it
# runs, so two concurrent moves never share one. GPU pools are left to the CUDA caching allocator.
_POOLS: dict[torch.device, torch.Tensor] = {}


def _take_pool(device: torch.device, nbytes: int, budget_bytes: int) -> torch.Tensor:
    """A staging pool of ``nbytes`` on ``device``: the kept one when it is big enough and no
    bigger than this move's budget (a move never holds more staging than its budget), else new."""
    if device.type == "cpu":
        kept = _POOLS.pop(device, None)
        if kept is not None and nbytes <= kept.numel() <= budget_bytes:
            return kept[:nbytes]
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def _give_pool(pool: torch.Tensor) -> None:
    if pool.device.type == "cpu":
        base = pool._base if pool._base is not None else pool
        kept = _POOLS.get(pool.device)
        if kept is None or base.numel() >= kept.numel():
            _POOLS[pool.device] = base


def _copy_local(schedule: Schedule, src_buffers, dst_buffers, bound: _Bound | None = None) -> None:
    """Every same-rank copy of ``schedule``, view to view (step 4; the colocated handoff's path too)."""
    bound = bound or _Bound(src_buffers, dst_buffers, None)
    for c in schedule.local_runs:
        bound.copy(c)


def _run(schedule: Schedule, batches: tuple[Batch, ...], src_buffers, dst_buffers, comm: Comm,
         deadline: Deadlines, agree=None, hooks: MoveHooks = NO_HOOKS) -> MoveReport:
    """Steps 2–5 of the module docstring: ``agree(meanwhile)`` (the agreement; ``None``: none),
    then ``batches`` posted in order, each as one batch; staged steps packed into / unpacked from
    the pool at ``Schedule.staged``'s offsets. Runs the compiled program
    (``Schedule.compile_program``): per piece only its two views and a copy.

    The staged sends of the batches before the first that must retire older steps are packed
    while the agreement gather is in flight, until it is in (the rest are packed when posted, so
    packing never delays the posting): their pool blocks are all free at once (that is what
    retiring nothing means), the pool is this rank's own, and the sources are only read — so a
    refused move has still written nothing a peer or the destination sees."""
    plan = schedule.plan
    prog = schedule.program if batches is schedule.batches else schedule.compile_program(batches)
    out = _Outstanding(comm, deadline, hooks.post)
    t_start = time.perf_counter()
    pool = None
    if prog.pool_on is not None:
        side, name = prog.pool_on
        device = (dst_buffers if side == "dst" else src_buffers)[name].device
        pool = _take_pool(device, prog.pool_bytes, schedule.budget_bytes)  # NCCL needs it on the GPU
    bound = _Bound(src_buffers, dst_buffers, pool, hooks.staged_receive)
    read_ops = [op for batch in prog.batches for op in batch.ops if op.read is not None]
    # the transport's part in this move's read messages (it holds ``bound``; ``bound`` does not
    # hold it: no reference cycle keeps the buffers or the pool alive after the move)
    reading = comm.transport.move_reads(bound) if read_ops else None
    packed: set[int] = set()  # id() of the staged sends packed ahead
    t_pack = 0.0

    def pack_ahead(done=lambda: False):
        nonlocal t_pack
        tp = time.perf_counter()
        for batch in prog.batches:
            if batch.retire:  # its pool blocks are not free yet
                break
            for op in batch.ops:
                if op.send and op.step >= 0 and (op.read is None or reading.packs(op)):
                    if done():
                        t_pack = time.perf_counter() - tp
                        return
                    bound.pack(op)
                    packed.add(id(op))
        t_pack = time.perf_counter() - tp

    if agree is not None:
        if read_ops:  # before the agreement, which may carry their offers
            reading.offer_ahead([op for op in read_ops if op.send])
        agree(pack_ahead)
    t0 = time.perf_counter()
    t_local = 0.0
    local_done = False

    def copy_local():
        nonlocal local_done, t_local
        if not local_done:
            local_done = True
            tl = time.perf_counter()
            _copy_local(schedule, src_buffers, dst_buffers, bound)
            t_local = time.perf_counter() - tl

    peak = alive_bytes = messages = 0
    budget = schedule.budget_bytes
    inflight: deque = deque()  # staged steps in flight, oldest first: [tokens, staged recv op, size]
    direct: list[int] = []  # tokens of the messages that use no staging

    # read messages' receives first, in one batch: the transport copies each as soon as its
    # offer is there — which, where the offer went with the agreement, is now — and waits for no
    # message of this rank's (a direction is all read messages or none, so the receives from one
    # sender keep their order)
    read_recvs = [op for op in read_ops if not op.send]
    if read_recvs:
        direct += out.post_batch([reading.p2p(op) for op in read_recvs], [op.nbytes for op in read_recvs])
        messages += len(read_recvs)

    def retire():
        nonlocal alive_bytes
        tokens, recv, size = inflight.popleft()
        for tok in tokens:
            out.wait(tok)
        if recv is not None:
            bound.unpack(recv)
        alive_bytes -= size

    for batch in prog.batches:
        if batch.retire:
            copy_local()  # where the program first blocks: the batches posted so far travel meanwhile
        for _ in range(batch.retire):
            retire()
        records = {}
        for si in batch.new_steps:  # the step's block of the pool: [recv chunk | send chunk]
            offset, size = prog.steps[si]
            records[si] = rec = [[], None, size]
            inflight.append(rec)
            alive_bytes += size
            peak = max(peak, offset + size)
            if alive_bytes > budget:  # a broken promise is a bug, never a silent one
                raise AssertionError(f"staging holds {alive_bytes} B over the {budget} B budget")
        ops, sizes, owners = [], [], []
        for op in batch.ops:
            if op.read is not None and not op.send:
                continue  # posted above
            ops.append(bound.p2p(op, id(op) in packed) if op.read is None else reading.p2p(op, id(op) in packed))
            sizes.append(op.nbytes)
            if op.step >= 0:  # staged on this side: retired with its step
                rec = records[op.step]
                owners.append(rec[0])
                if not op.send:
                    rec[1] = op
            else:
                owners.append(direct)
        for tok, owner in zip(out.post_batch(ops, sizes), owners):
            owner.append(tok)
        messages += len(ops)
    t_posted = time.perf_counter()
    local_while_posting = t_local  # 0 unless a batch had to wait
    copy_local()
    while inflight:
        retire()
    for tok in direct:
        out.wait(tok)
    t_end = time.perf_counter()
    if peak > budget:
        raise AssertionError(f"staging peaked at {peak} B over the {budget} B budget")
    if pool is not None:
        _give_pool(pool)  # only after a move that completed: no message of it still uses the pool
    return MoveReport(plan.rank, plan.transition, prog.bytes_sent, prog.bytes_received, prog.bytes_local,
                      plan.min_bytes_received, messages, peak, prog.pool_bytes, budget, t_end - t0,
                      phases=dict(agree=t0 - t_start - t_pack, pack_ahead=t_pack,
                                  post=t_posted - t0 - local_while_posting, local=t_local,
                                  wait=t_end - t_posted - (t_local - local_while_posting)))


def _report_key(rank: int) -> str:
    # one key per rank and group: a group that carried a failed move is closed (``Comm.close``)
    # and never carries another, so these keys are written at most once per group
    return f"vps-move/failed/{rank}"


def _lost(f: _WaitFailed, comm: Comm, src: Layout, dst: Layout, deadline: Deadlines, elapsed: float) -> PeerLost:
    """Turn a failed wait into ``PeerLost``: leave this rank's report in the group's store, close
    this rank's connections (peers blocked on it fail at once instead of at their deadlines),
    then read the others' reports. A rank that reported is alive (it reports before it closes its
    connections), so a rank some rank lost contact with that left no report is the lost one;
    a rank whose connection closed without a report is dead, so the census ends as soon as every
    rank has either reported or been seen closing; otherwise it waits up to ``census_s``."""
    rank, world = comm.rank, comm.size
    closed = "Connection closed" in f.cause or "Connection reset" in f.cause
    timed_out = "Timed out" in f.cause or "timed out" in f.cause or "Timeout" in f.cause
    how = "closed" if closed else "timed out" if timed_out else "failed"
    mine = {"peer": f.peer, "how": how, "what": f.what, "cause": f.cause[:300]}
    store = comm.store
    if store is not None:
        try:
            store.set(_report_key(rank), json.dumps(mine))
        except Exception:  # noqa: BLE001 - a store on a lost host: fall back to what this rank saw
            store = None
    comm.close()
    reports: dict[int, dict] = {rank: mine}
    if store is not None:
        end = time.monotonic() + deadline.census_s
        while True:
            for r in range(world):
                if r in reports:
                    continue
                try:
                    if store.check([_report_key(r)]):
                        reports[r] = json.loads(store.get(_report_key(r)))
                except Exception:  # noqa: BLE001
                    end = 0
                    break
            seen_closed = {d["peer"] for d in reports.values() if d["peer"] is not None and d["how"] == "closed"}
            if all(r in reports or r in seen_closed for r in range(world)) or time.monotonic() >= end:
                break
            time.sleep(0.02)
        silent = [r for r in range(world) if r not in reports]
        blamed = {d["peer"] for d in reports.values() if d["peer"] is not None}
        lost = sorted(r for r in silent if r in blamed) or silent or sorted(blamed)
    else:
        silent = []
        lost = [f.peer] if f.peer is not None else []
    def said(d):
        return f"{d['how']} on {d['what']}" + (f" (with rank {d['peer']})" if d["peer"] is not None else "")
    others = "; ".join(f"rank {r}: {said(d)}" for r, d in sorted(reports.items()) if r != rank)
    pending = f.pending[:8] + ([f"... {len(f.pending) - 8} more"] if len(f.pending) > 8 else [])
    who = (f"lost rank {lost[0]}" if len(lost) == 1 else f"lost ranks {lost}") if lost else "lost a peer"
    msg = (f"move {src.name} -> {dst.name} failed on rank {rank} after {elapsed:.2f} s: {who}. "
           f"Rank {rank} {said(mine)}, deadline {f.deadline_s:.1f} s: {f.cause[:300]}. "
           f"Still pending on rank {rank}: {', '.join(pending)}.")
    if others:
        msg += f" Reports: {others}."
    if silent:
        msg += (f" No report within {deadline.census_s:.1f} s from rank(s) {silent} (dead, or still "
                f"blocked in their own waits).")
    elif store is None:
        msg += " (No store to compare reports: the rank named is the peer this rank lost contact with.)"
    msg += " Source buffers are untouched; re-form the group and move again."
    return PeerLost(msg, rank=rank, lost=lost, pending=f.pending, cause=f.cause,
                    reports={r: said(d) for r, d in reports.items() if r != rank},
                    elapsed_s=elapsed, deadline_s=f.deadline_s)
