"""Single-copy messages between processes on one host: Linux cross-memory attach (CMA).

``SameHost`` is a transport (``routing/transport.py``): where the ranks of a gloo group can read
each other's memory, ``Comm.choose_transport`` gives the group this one instead of plain
point-to-point, and the executor posts through it as through any other.

gloo sends every byte through a loopback TCP socket: one kernel copy on the sending rank, one on
the receiving rank, both on the CPU the ranks share (2 cores, 4 ranks here). Between two
processes of one user on one host the receiver can instead copy the bytes straight out of the
sender's memory with ``process_vm_readv`` — one copy, done by the receiver only, as MPI
implementations do for large intra-node messages. Measured on this 2-core box: two concurrent
400 MB messages take 0.09–0.10 s this way against 0.19–0.28 s over gloo.

A message of at least ``MIN_BYTES`` between two ranks that can read each other's memory goes so:
the sender posts an offer — one gloo message on ``SAME_HOST_OFFER_TAG`` saying where its bytes
are and how many — and a receive of an 8-byte acknowledgement on ``SAME_HOST_ACK_TAG``; one
reader thread per peer on the receiving rank takes that peer's offers in order, copies each
message into the receive this rank posted for it, and acknowledges the offer. The sender's
``Work`` completes with the acknowledgement (its bytes may be reused after that: staging, the
source after the move), the receiver's when its reader has copied. Readers work apart from the main
thread's waits, so the order in which a rank waits for its messages cannot deadlock two ranks
that each wait on a send first (a copy does not wait for the receiver's ``wait``, as with gloo).

*Read messages.* Where a receiver can read its sender, a whole direction of a pair (at least
``MIN_BYTES``, no cast, destination runs of at least 256 B) is cut into read messages instead
(``schedule._read_chunks``): the sender offers the addresses of its buffers and of the block it
packed the short-run pieces into, and the receiver hands ``process_vm_readv`` the source runs and
its own destination runs as they are — strided pieces with long runs read in place, nothing
unpacked, one message per direction unless the packed part outgrows a quarter of the budget.
(FSDP DP4 -> vLLM TP4 at 100M: 102 messages a rank, each packed, sent over TCP and copied
twice, became 6.) Smaller directions stay on gloo: at 10M the same switch's directions of
~490 KB ran at 73–75 % of the floor as read messages and at 98–103 % over gloo (the reader
thread's wake-ups and the acknowledgement cost more than the few TCP messages they replace).

*Mapped reads.* A sender whose source buffers live in shared memory (``share``: the storage moved
there in place, every view following) offers, with each read message, where each of them can be
mapped (its file descriptor, seen by peers as ``/proc/<pid>/fd/<n>``). The receiver maps each
storage once and keeps the mapping while the sender keeps the storage, and copies the message as
strided ``copy_``s straight from the sender's views into its own: one copy of every byte, done by
the receiver, with neither packing on the sender (short runs: a row-parallel split of FSDP's row
shards is 768 B runs at 100M) nor the page pinning ``process_vm_readv`` does for every remote run.
The GPU counterpart is a CUDA IPC handle; gloo's same-host copies are CPU-only.

*The agreement.* Where every rank of the group can map every other, the move's agreement (its
one all-gather of 4 int64s a rank before anything moves) is written into shared memory, each rank
into its own page, and waited for with futexes (``_Board``), instead of a gloo all-to-all whose
rows reached the other ranks 2–4 ms (up to 16 ms) after the last was posted on this loaded box.
With a board, a read message whose sources peers map needs no gloo message either: its offer
is ready when the move starts, so the sender writes it on the board before its row, and the
receiver acknowledges by a count in its own page that the sender sleeps on (``_Board``).
``RLHF_SWITCH_SAME_HOST_BOARD=0`` keeps both on gloo.

Which peers a rank can read is found once per process group, by every rank together at its
first move (``for_group``): each rank shows a random token in its memory (and in a shared-memory
page), every rank tries to read (and to map) its peers' tokens, and the verdicts are gathered,
so both ends of every pair agree on the way each message goes. Anything that fails the probe —
another host, another PID namespace, a seccomp profile without ``process_vm_readv``, a non-Linux
system — stays on gloo. Control, acknowledgement and failures are gloo's (but for offers on the
board): a lost peer closes the connection the reader waits on, and the reader reports gloo's
text; a board wait checks that its peer still runs. ``RLHF_SWITCH_SAME_HOST_COPY=0`` turns it
off (every pair stays on gloo); ``RLHF_SWITCH_SAME_HOST_MAP=0`` turns mapped reads off
(``process_vm_readv`` for everything).
"""
from __future__ import annotations

import atexit
import ctypes
import os
import platform
import queue
import secrets
import sys
import threading
import time
import weakref
from datetime import timedelta

import torch

from .tags import MESSAGE_TAG, SAME_HOST_ACK_TAG, SAME_HOST_OFFER_TAG
from .transport import P2P, MoveReads, Transport

MIN_BYTES = 1 << 20  # below this the two control messages cost more than the copy saves
MIN_BYTES_ENV = "RLHF_SWITCH_SAME_HOST_MIN_BYTES"  # tests: 1 sends every message this way
ENV = "RLHF_SWITCH_SAME_HOST_COPY"
MAP_ENV = "RLHF_SWITCH_SAME_HOST_MAP"  # 0: no mapped reads (process_vm_readv for everything)
BOARD_ENV = "RLHF_SWITCH_SAME_HOST_BOARD"  # 0: the agreement (and read messages' offers) stay on gloo
ON_BOARD = "on the board"  # ``P2P.read`` of a read message's send whose offer is on the board (_Board)


class _Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_LIBC: dict[str, object] = {}


def _cma(name: str):
    """libc's cross-memory-attach call ``name`` (``process_vm_readv`` / ``process_vm_writev``,
    the same signature); None where there is none."""
    if name not in _LIBC:
        _LIBC[name] = None
        if sys.platform.startswith("linux"):
            try:
                fn = getattr(ctypes.CDLL("libc.so.6", use_errno=True), name)
                fn.argtypes = [ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.POINTER(_Iovec),
                               ctypes.c_ulong, ctypes.c_ulong]
                fn.restype = ctypes.c_ssize_t
                _LIBC[name] = fn
            except (OSError, AttributeError):
                pass
    return _LIBC[name]


def _readv():
    """libc's ``process_vm_readv`` (None where there is none)."""
    return _cma("process_vm_readv")


IOV_MAX = 1024  # Linux's UIO_MAXIOV: iovecs per side of one call


def _iovecs(table: torch.Tensor):
    return ctypes.cast(table.data_ptr(), ctypes.POINTER(_Iovec))


def read_runs(pid: int, remote: torch.Tensor, local: torch.Tensor) -> None:
    """Copy the runs ``remote`` (int64 [n, 2]: address, bytes) of process ``pid`` into the runs
    ``local`` of this one, in order (equal byte totals): ``IOV_MAX`` runs per side a call; the
    kernel walks the two lists apart and stops at the shorter, so they need not cut alike. A
    call that copies less (one moves at most ~2 GiB) is continued from where it stopped (the
    tables are trimmed in place)."""
    copy_runs("process_vm_readv", pid, remote, local)


def copy_runs(call: str, pid: int, remote: torch.Tensor, local: torch.Tensor) -> None:
    """``read_runs`` with either call: ``process_vm_readv`` copies ``remote`` into ``local``,
    ``process_vm_writev`` ``local`` into ``remote`` (``bench.cma_runs`` times both)."""
    fn = _cma(call)
    ri = li = 0
    while ri < remote.shape[0]:
        r, lo = remote[ri:ri + IOV_MAX], local[li:li + IOV_MAX]
        got = fn(pid, _iovecs(lo), lo.shape[0], _iovecs(r), r.shape[0], 0)
        if got <= 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{call} {'from' if call.endswith('readv') else 'to'} pid {pid}: "
                               f"{os.strerror(err) if got < 0 else 'copied nothing'}")
        remote, ri = _advance(remote, ri, r, got)
        local, li = _advance(local, li, lo, got)


def _advance(table: torch.Tensor, i: int, window: torch.Tensor, nbytes: int) -> tuple[torch.Tensor, int]:
    """``table`` from row ``i`` on, ``nbytes`` further: rows done skipped, a row half done trimmed."""
    ends = torch.cumsum(window[:, 1], 0)
    if int(ends[-1]) == nbytes:
        return table, i + window.shape[0]
    done = int(torch.searchsorted(ends, nbytes, right=True))
    part = nbytes - (int(ends[done - 1]) if done else 0)
    if part:  # the tables are the caller's scratch: trimmed in place
        table[i + done, 0] += part
        table[i + done, 1] -= part
    return table, i + done


def read_from(pid: int, address: int, into: int, nbytes: int) -> None:
    """Copy ``nbytes`` from ``address`` in process ``pid`` to ``into`` in this one (ctypes drops the GIL)."""
    fn = _readv()
    done = 0
    while done < nbytes:
        local = _Iovec(into + done, nbytes - done)
        remote = _Iovec(address + done, nbytes - done)
        got = fn(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if got <= 0:
            err = ctypes.get_errno()
            raise OSError(err, f"process_vm_readv from pid {pid}: {os.strerror(err) if got < 0 else 'read nothing'}")
        done += got


def share(tensors, shm: str = "/dev/shm") -> int:
    """Move each CPU tensor's storage into shared memory, in place (every view of it, an engine's
    parameters into a flat buffer included, follows), so that same-host peers can map it and read
    it with mapped reads (module docstring); returns the bytes moved. Costs one copy of each
    storage, once; the memory then counts as shared memory (``shm``). A storage that is shared
    already is left as it is, and so is one that would leave ``shm`` less than a quarter free (a
    full ``/dev/shm`` is a SIGBUS at the first write, not an error): it stays on ``process_vm_readv``."""
    moved = 0
    for t in tensors:
        s = t.untyped_storage()
        if t.device.type != "cpu" or s.is_shared() or not s.nbytes():
            continue
        try:
            st = os.statvfs(shm)
        except OSError:
            return moved
        if s.nbytes() > st.f_bavail * st.f_frsize - st.f_blocks * st.f_frsize // 4:
            continue
        s.share_memory_()
        moved += s.nbytes()
    return moved


MAP_FIELDS = 4  # per source buffer of a read message's offer: fd, inode, byte offset, storage bytes
_UNMAPPED = (0, 0, 0, 0)


def mapping_of(t: torch.Tensor) -> tuple[int, int, int, int]:
    """Where a peer on this host can map ``t``: (its storage's file descriptor, that file's inode,
    ``t``'s byte offset in the storage, the storage's bytes); zeros when it cannot (not in shared
    memory, not on the CPU, or shared by file name rather than descriptor)."""
    if t.device.type != "cpu":
        return _UNMAPPED
    s = t.untyped_storage()
    if not s.is_shared():
        return _UNMAPPED
    try:
        fd, size = s._share_fd_cpu_()  # a shared storage's own descriptor (nothing is moved)
        inode = os.fstat(fd).st_ino
    except (RuntimeError, OSError):
        return _UNMAPPED
    offset = t.data_ptr() - s.data_ptr()
    if offset % t.element_size():
        return _UNMAPPED
    return fd, inode, offset, size


class _Mappings:
    """The storages of one peer this rank has mapped, by inode. A mapping is kept while the peer
    keeps the storage: mapping costs a page fault per 4 KiB page on first touch, which a switch
    that maps anew every time would pay every time. A miss first drops the mappings of storages
    the peer has let go (its descriptor gone or now another file), so a peer's freed buffers are
    not held here."""

    def __init__(self, pid: int):
        self.pid = pid
        self.maps: dict[int, tuple[int, torch.Tensor]] = {}  # inode -> (fd, the storage's bytes)

    def _path(self, fd: int) -> str:
        return f"/proc/{self.pid}/fd/{fd}"

    def get(self, fd: int, inode: int, size: int) -> torch.Tensor:
        hit = self.maps.get(inode)
        if hit is not None and hit[0] == fd and hit[1].numel() == size:
            return hit[1]
        self.sweep()
        # the sender holds the storage until this rank acknowledges, so the descriptor is that file
        m = torch.from_file(self._path(fd), shared=True, size=size, dtype=torch.uint8)
        if os.stat(self._path(fd)).st_ino != inode:
            raise RuntimeError(f"pid {self.pid}'s descriptor {fd} is no longer the storage it offered")
        self.maps[inode] = (fd, m)
        return m

    def clear(self) -> None:
        """Unmap every storage of the peer mapped so far."""
        self.maps.clear()

    def held(self) -> int:
        """How many of the peer's storages are mapped here."""
        return len(self.maps)

    def sweep(self) -> None:
        for inode, (fd, _) in list(self.maps.items()):
            try:
                alive = os.stat(self._path(fd)).st_ino == inode
            except OSError:
                alive = False
            if not alive:
                del self.maps[inode]


def _mapped_view(m: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    """The bytes of a mapped storage from ``offset`` on, as ``like``'s dtype."""
    per = like.element_size()
    return m[offset:offset + (m.numel() - offset) // per * per].view(like.dtype)


class _BoardSendWork:
    """A read message's send offered on the board: complete once the receiver's count of this
    rank's messages reaches it (``_Board.wait_acknowledged``)."""

    __slots__ = ("board", "peer", "count")

    def __init__(self, board, peer: int, count: int):
        self.board, self.peer, self.count = board, peer, count

    def wait(self, timeout: timedelta | None = None) -> bool:
        self.board.wait_acknowledged(self.peer, self.count, timeout)
        return True


class _SendWork:
    """The sends of one offer: complete once the receiver acknowledges its copies."""

    __slots__ = ("control", "ack", "keep")

    def __init__(self, control, ack, keep):
        self.control, self.ack, self.keep = control, ack, keep

    def wait(self, timeout: timedelta | None = None) -> bool:
        for w in (self.control, self.ack):
            w.wait() if timeout is None else w.wait(timeout)
        return True


class _RecvWork:
    """A receive: complete once this rank's reader for ``peer`` has copied the bytes in. The
    offer it takes is (address, bytes): one contiguous range of the sender's."""

    __slots__ = ("tensor", "nbytes", "done", "error", "peer", "slot")
    control_numel = 2 + MAP_FIELDS

    def __init__(self, tensor, peer):
        self.tensor, self.peer = tensor, peer
        self.slot: tuple[int, int] | None = None  # (move, index): where its offer is on the board
        self.nbytes = tensor.numel() * tensor.element_size()
        self.done = threading.Event()
        self.error: str | None = None

    def wait(self, timeout: timedelta | None = None) -> bool:
        if not self.done.wait(None if timeout is None else timeout.total_seconds()):
            raise RuntimeError(f"Timed out after {timeout} waiting for a same-host copy of "
                               f"{self.nbytes} B from rank {self.peer}")
        if self.error is not None:
            raise RuntimeError(self.error)
        return True

    def _offered(self, nbytes: int) -> None:
        if nbytes != self.nbytes:  # both ends follow one plan: a mismatch here is a bug, never silent
            raise RuntimeError(f"same-host copy from rank {self.peer}: {nbytes} B offered, {self.nbytes} B expected")

    def copy(self, pid: int, offer: list[int], maps: _Mappings) -> bool:
        """Copy the offered bytes in; whether they were read through a mapping."""
        address, nbytes, fd, inode, offset, size = offer
        self._offered(nbytes)
        if fd:  # the sender's bytes are in shared memory: copied out of its storage, mapped
            mine = self.tensor.view(-1).view(torch.uint8)
            mine.copy_(maps.get(fd, inode, size)[offset:offset + nbytes])
            return True
        read_from(pid, address, self.tensor.data_ptr(), nbytes)
        return False


class _ReadWork(_RecvWork):
    """A read message's receive (``schedule.ReadRuns``): its offer is the addresses of the
    sender's packed block and of its buffers read in place, where each of its source buffers can
    be mapped, then the bytes; the runs go from there straight into this rank's destination views
    — or, where the sender mapped them all, the copies go from its views into them."""

    __slots__ = ("runs", "dsts", "control_numel")

    def __init__(self, runs, dsts: tuple, peer: int):
        self.runs, self.dsts, self.peer = runs, dsts, peer
        self.tensor, self.nbytes = None, runs.nbytes
        self.slot = None
        self.control_numel = 2 + len(runs.src_names) + MAP_FIELDS * len(runs.sources)
        self.done = threading.Event()
        self.error = None

    def copy(self, pid: int, offer: list[int], maps: _Mappings) -> bool:
        self._offered(offer[-1])
        where = offer[1 + len(self.runs.src_names):-1]
        if where and where[0]:  # the sender mapped every source buffer and packed nothing
            self._copy_mapped(where, maps)
            return True
        remote, local = self.runs.remote, self.runs.local
        bases = torch.tensor([t.data_ptr() for t in self.dsts], dtype=torch.int64)
        theirs = torch.tensor(offer[:1 + len(self.runs.src_names)], dtype=torch.int64)
        read_runs(pid, torch.stack([theirs[remote[:, 0]] + remote[:, 1], remote[:, 2]], 1),
                  torch.stack([bases[local[:, 0]] + local[:, 1], local[:, 2]], 1))
        return False

    def _copy_mapped(self, where: list[int], maps: _Mappings) -> None:
        srcs: dict[tuple[str, torch.dtype], torch.Tensor] = {}
        dsts = dict(zip(self.runs.dst_names, self.dsts))
        for c in self.runs.copies:
            dst = dsts[c.dst_buffer]
            src = srcs.get((c.src_buffer, dst.dtype))
            if src is None:
                k = MAP_FIELDS * self.runs.sources.index(c.src_buffer)
                fd, inode, offset, size = where[k:k + MAP_FIELDS]
                src = srcs[c.src_buffer, dst.dtype] = _mapped_view(maps.get(fd, inode, size), offset, dst)
            torch.as_strided(dst, c.shape, c.dst_strides, dst.storage_offset() + c.dst_offset).copy_(
                torch.as_strided(src, c.shape, c.src_strides, src.storage_offset() + c.src_offset))


class _Reader:
    """One peer's incoming copies, in posting order, on a thread of their own. It asks gloo for
    the peer's next offer only once this rank has posted a receive the offer can be for, so no
    gloo receive is left pending between moves."""

    def __init__(self, comm, peer: int, pid: int, board: _Board | None = None):
        self.comm, self.peer, self.pid, self.board = comm, peer, pid, board
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.error: str | None = None
        self.maps = _Mappings(pid)
        self.mapped = 0  # receives copied through a mapping (only this thread counts)
        self.on_board = 0  # receives whose offer was on the board (only this thread counts)
        self.thread = threading.Thread(target=self._loop, name=f"same-host-reader-{peer}", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        ack = torch.zeros(1, dtype=torch.int64)
        while True:
            job = self.jobs.get()  # the receive the peer's next offer is for
            if job is None:
                return
            if self.error is None:
                try:
                    offer = self.board.offer(self.peer, *job.slot) if job.slot is not None else None
                    if offer is not None:  # offered on the board: no gloo message either way
                        self.mapped += job.copy(self.pid, offer, self.maps)
                        self.on_board += 1
                        job.done.set()
                        self.board.acknowledge(self.peer)
                        continue
                    offer = torch.empty(job.control_numel, dtype=torch.int64)  # where the peer's bytes are
                    self.comm.irecv(offer, self.peer, SAME_HOST_OFFER_TAG).wait()
                    self.mapped += job.copy(self.pid, offer.tolist(), self.maps)
                    job.done.set()
                    self.comm.isend(ack, self.peer, SAME_HOST_ACK_TAG).wait()
                    continue
                except Exception as e:  # noqa: BLE001 - gloo's text goes to the waiting rank
                    self.error = f"{type(e).__name__}: {e}"
            job.error = self.error
            job.done.set()

    def stop(self) -> None:
        self.jobs.put(None)

    def join(self, by: float) -> None:
        self.thread.join(max(0.0, by - time.monotonic()))


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


# futex(2): the one kernel call a wait on another process's word needs (no Python binding).
# x86-64 only: its stores are seen in program order (TSO), which the board relies on to publish a
# row before its sequence number without a fence Python cannot issue
_SYS_FUTEX = {"x86_64": 202}.get(platform.machine())
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # shared (not _PRIVATE): the word is in a file mapped by several processes
_libc = None


def _futex():
    global _libc
    if _SYS_FUTEX is None or not sys.platform.startswith("linux"):
        return None
    if _libc is None:
        try:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.syscall  # noqa: B018 - present, or no futex
        except (OSError, AttributeError):
            _libc = False
    return _libc or None


def _futex_wake(addr: int) -> None:
    """Wake every process sleeping on the int32 at ``addr``."""
    _futex().syscall(_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAKE, 0x7FFFFFFF, None, None, 0)


def _futex_wait(addr: int, seen: int, seconds: float) -> None:
    """Sleep up to ``seconds`` while the int32 at ``addr`` still holds ``seen`` (a write in
    between returns at once)."""
    ts = _Timespec(int(seconds), int(seconds % 1 * 1e9))
    _futex().syscall(_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAIT, ctypes.c_int32(seen), ctypes.byref(ts), None, 0)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie, killed and not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")


class _Board:
    """The move's agreement (``executor._agree``: a row of ``WIDTH`` int64s from every rank) as
    writes into shared memory instead of a gloo collective, where every rank of the group maps
    every other. Each rank owns a small shared tensor (the probe's, ``for_group``): its token,
    a sequence word, its row of the last two agreements (by parity), its acknowledgements of
    read messages (one count per sender) and its offers of the last two moves (by parity). A
    rank writes its offers and its row, then the agreement's number into its sequence word, and
    wakes whoever sleeps on that word (futex); it reads a peer's row once the peer's word has
    reached the same number.

    Why: a gloo all-to-all completes only after every rank's gloo thread has run again after the
    last rank posted — on 2 cores shared by 4 ranks that already copy, the last row landed on the
    other ranks 0.5–16 ms (median 2–4 ms) after it was posted (100M FSDP -> vLLM TP4, a tenth of
    the move). Here a row is there as soon as it is written, and a sleeping rank is woken by the
    writer's own call.

    *Offers on the board.* A read message whose sources peers map (nothing packed) is ready when
    its move starts, so its offer — where the receiver maps each source buffer — needs no message
    of its own: the sender writes the offers of all its read messages of the move (``post_offers``,
    in posting order per receiver; ``None`` for one it offers over gloo) before its row, and a
    receiver takes the j-th offer for it (``offer``) once the agreement is in. It acknowledges by
    counting, in its own page, the messages it has read from that sender (``acknowledge``); the
    sender's send completes when the count reaches it (``wait_acknowledged``). A read message
    then costs no gloo message at all — the offer's gloo hop took 3–5 ms to reach the reader on
    this loaded box, the acknowledgement's as long back (10M TP2·DP2 -> vLLM TP4's critical path).

    Parity is enough: a rank finishes agreement k only once every rank has written k, i.e. has
    finished move k - 1 (read every row and every offer of k - 1); so no rank writes k + 1's
    slots (k - 1's) while a peer may read them. The counts only grow: a group whose move failed
    is closed and carries no other. A peer that dies never writes: the waits check, every
    ``POLL_S``, that the peers they wait for still run (``PEER_GONE``); ``close`` (a failed move:
    ``Comm.close``) marks this rank's word closed, and the peers waiting on it stop at once, as
    gloo's waits do on a closed pair."""

    TOKEN, SEQ, ROWS = 0, 1, 2  # int64 slots: token, sequence (its low int32 is the futex word), rows
    WIDTH = 4
    ACKS = ROWS + 2 * WIDTH  # then one count per sender (low int32: futex word), then the offers
    OFFERS_NUMEL = 4096  # int64s per parity: [words used (-1: too many, all over gloo), entries]
    CLOSED = -1
    POLL_S = 0.1

    @classmethod
    def numel(cls, world: int) -> int:
        """The int64s of one rank's page in a group of ``world`` ranks."""
        return cls.ACKS + world + 2 * cls.OFFERS_NUMEL

    def __init__(self, rank: int, pids: list[int], mine: torch.Tensor, peers: dict[int, torch.Tensor]):
        self.rank, self.pids = rank, pids
        pages = dict(sorted({rank: mine, **peers}.items()))
        self.keep = list(pages.values())  # the mappings the addresses below point into
        base = {r: t.data_ptr() for r, t in pages.items()}
        self.seq_addrs = {r: a + 8 * self.SEQ for r, a in base.items()}
        self.seq_words = {r: ctypes.c_int32.from_address(a) for r, a in self.seq_addrs.items()}
        self.rows = {r: [(ctypes.c_int64 * self.WIDTH).from_address(a + 8 * (self.ROWS + self.WIDTH * i))
                         for i in (0, 1)] for r, a in base.items()}
        world = len(pids)
        # the count rank r keeps of this rank's messages it has read (this rank waits on it), and
        # the ones this rank keeps of each sender's
        self.acked_addrs = {r: a + 8 * (self.ACKS + rank) for r, a in base.items() if r != rank}
        self.acked = {r: ctypes.c_int32.from_address(a) for r, a in self.acked_addrs.items()}
        self.ack_addrs = {s: base[rank] + 8 * (self.ACKS + s) for s in base if s != rank}
        self.acks = {s: ctypes.c_int32.from_address(a) for s, a in self.ack_addrs.items()}
        first = self.ACKS + world
        self.boxes = {r: [t[first + i * self.OFFERS_NUMEL:first + (i + 1) * self.OFFERS_NUMEL] for i in (0, 1)]
                      for r, t in pages.items()}
        self.read_offers: dict[int, tuple[int, list | None]] = {}  # sender -> (move, its offers to this rank)
        self.peers = [r for r in self.rows if r != rank]  # in rank order
        self.seq = 0  # the last agreement this rank has written

    def post_offers(self, offers: dict[int, list[list[int] | None]]) -> bool:
        """Write this rank's offers of the next move (per receiver, its read messages in posting
        order: the offer's int64s, or ``None`` where it goes over gloo), before ``start``;
        whether they fit (if not, every read message of this rank's move goes over gloo)."""
        flat: list[int] = []
        for receiver, entries in offers.items():
            for e in entries:
                flat += [receiver, 0] if e is None else [receiver, len(e), *e]
        box = self.boxes[self.rank][(self.seq + 1) & 1]
        fits = len(flat) < self.OFFERS_NUMEL
        if fits and flat:
            box[1:1 + len(flat)] = torch.tensor(flat, dtype=torch.int64)
        box[0] = len(flat) if fits else -1
        return fits

    def offer(self, sender: int, k: int, j: int) -> list[int] | None:
        """``sender``'s offer of its ``j``-th read message to this rank in move ``k`` (agreement
        ``k`` is in: the offers were written before it); ``None``: it comes over gloo."""
        hit = self.read_offers.get(sender)  # only the reader of ``sender`` asks: one thread
        if hit is None or hit[0] != k:
            box = self.boxes[sender][k & 1]
            n = int(box[0])
            mine: list | None = None
            if n >= 0:
                flat, mine, i = box[1:1 + n].tolist(), [], 0
                while i < n:
                    receiver, length = flat[i], flat[i + 1]
                    if receiver == self.rank:
                        mine.append(flat[i + 2:i + 2 + length] if length else None)
                    i += 2 + length
            hit = self.read_offers[sender] = (k, mine)
        if hit[1] is None:
            return None
        if j >= len(hit[1]):  # both ends follow one plan: a bug, never silent
            raise RuntimeError(f"rank {sender} offered {len(hit[1])} read messages to rank {self.rank} "
                               f"in move {k}; a {j + 1}th was expected")
        return hit[1][j]

    def acknowledge(self, sender: int) -> None:
        """One more of ``sender``'s board-offered read messages read (its source may be reused)."""
        self.acks[sender].value += 1
        _futex_wake(self.ack_addrs[sender])

    def wait_acknowledged(self, receiver: int, count: int, timeout: timedelta | None) -> None:
        """Until ``receiver`` has read ``count`` of this rank's board-offered read messages."""
        end = None if timeout is None else time.monotonic() + timeout.total_seconds()
        self._wait(receiver, self.acked[receiver], self.acked_addrs[receiver], count, end, timeout,
                   "acknowledgement of a read message")

    def start(self, values: list[int]):
        """Write this rank's row of the next agreement; returns ``finish(timeout)`` (the rows of
        every rank, in rank order) with ``finish.done()``, as ``Comm.start_all_gather_ints``."""
        if self.seq_words[self.rank].value == self.CLOSED:
            raise RuntimeError("this rank closed its group after a failed move")
        k = self.seq = self.seq + 1
        self.rows[self.rank][k & 1][:] = values
        self.seq_words[self.rank].value = k  # after the row and offers: x86 publishes stores in order
        _futex_wake(self.seq_addrs[self.rank])

        def done() -> bool:
            return all(self.seq_words[p].value >= k for p in self.peers)

        def finish(timeout: timedelta | None = None) -> list[list[int]]:
            end = None if timeout is None else time.monotonic() + timeout.total_seconds()
            for p in self.peers:
                self._wait(p, self.seq_words[p], self.seq_addrs[p], k, end, timeout, "row of the agreement")
            return [list(row[k & 1]) for row in self.rows.values()]
        finish.done = done
        return finish

    def _wait(self, peer: int, word, addr: int, k: int, end: float | None, timeout, what: str) -> None:
        """Until ``word`` (an int32 of ``peer``'s page, at ``addr``) reaches ``k``."""
        closed = self.seq_words[peer]
        while True:
            if closed.value == self.CLOSED:
                raise PeerGone(f"{PEER_GONE}: rank {peer} closed the group (its move failed) "
                               f"before its {what}", peer)
            seen = word.value
            if seen >= k:
                return
            left = self.POLL_S if end is None else min(self.POLL_S, end - time.monotonic())
            if left <= 0:
                raise RuntimeError(f"Timed out after {timeout} waiting for rank {peer}'s {what} "
                                   f"(same-host board)")
            _futex_wait(addr, seen, left)
            if word.value == seen and not _alive(self.pids[peer]):
                raise PeerGone(f"{PEER_GONE}: rank {peer}'s process ({self.pids[peer]}) has "
                               f"exited before its {what}", peer)

    def close(self) -> None:
        """Mark this rank's word closed and wake its waiters (they raise ``PEER_GONE``), those
        waiting for its acknowledgements too."""
        self.seq_words[self.rank].value = self.CLOSED
        for addr in (self.seq_addrs[self.rank], *self.ack_addrs.values()):
            _futex_wake(addr)


PEER_GONE = "Connection closed (same-host board)"  # what executor._lost reads as a closed peer


class PeerGone(RuntimeError):
    """A board wait that stopped because ``peer`` exited or closed the group."""

    def __init__(self, message: str, peer: int):
        super().__init__(message)
        self.peer = peer


class SameHost(Transport):
    """The transport of a gloo group whose ranks on one host read each other's memory (module
    docstring): which peers of the group this rank reads from and which read from it; one reader
    per peer it reads from. Messages it does not take go over gloo as they would without it."""

    def __init__(self, comm, pids: list[int], can_read: list[int], min_bytes: int = MIN_BYTES,
                 can_map: list[int] | None = None):
        self.rank = comm.rank
        self.min_bytes = min_bytes
        self.pids = pids
        self.can_read = can_read  # per rank: bitmask of the ranks whose memory it can read
        self.can_map = can_map or [0] * len(pids)  # per rank: ... whose shared memory it can map
        self.schedule_key = (tuple(can_read), min_bytes)  # which directions are read messages
        self._readers: dict[int, _Reader] = {}
        self.board: _Board | None = None  # the agreement in shared memory (``for_group`` sets it)
        self.messages = 0  # posted as same-host copies (sends and receives) so far
        self._board_sent: dict[int, int] = {}  # per receiver: read messages offered on the board so far
        self._reads: tuple[int, dict[int, int]] = (0, {})  # (move, per sender: read receives posted in it)
        self.read_messages = 0  # of those: read messages

    @property
    def mapped_messages(self) -> int:
        """Receives copied through a mapping of the sender's shared memory so far (complete for
        every receive this rank has waited for)."""
        return sum(r.mapped for r in self._readers.values())

    @property
    def board_messages(self) -> int:
        """Read messages (sends and receives) offered on the board so far (complete for every
        receive this rank has waited for)."""
        return sum(self._board_sent.values()) + sum(r.on_board for r in self._readers.values())

    def counts(self) -> dict[str, int]:
        return {"same_host_messages": self.messages, "read_messages": self.read_messages,
                "mapped_messages": self.mapped_messages, "board_messages": self.board_messages}

    def reads(self, sender: int, receiver: int) -> bool:
        """Whether ``receiver`` can read ``sender``'s memory (the same answer on every rank)."""
        return bool(self.can_read[receiver] >> sender & 1)

    @property
    def min_read_bytes(self) -> int:
        return self.min_bytes

    def maps(self, sender: int, receiver: int) -> bool:
        """Whether ``receiver`` can map ``sender``'s shared memory (mapped reads; the same answer
        on every rank, so a sender offers a mapping only where it will be taken)."""
        return bool(self.can_map[receiver] >> sender & 1)

    def mapped_by_peers(self) -> bool:
        """Whether some peer can map this rank's shared memory (``share`` is then worth its copy)."""
        return any(m >> self.rank & 1 for r, m in enumerate(self.can_map) if r != self.rank)

    def share(self, tensors) -> int:
        """The module's ``share``: the sender's buffers into shared memory, where its peers map them."""
        return share(tensors)

    def start_agreement(self, comm, values: list[int]):
        """By the group's board where every rank maps every other (``_Board``), else gloo's collective."""
        if self.board is not None:
            return self.board.start(values)
        return comm.start_all_gather_ints(values)

    def move_reads(self, bound) -> _MoveReads:
        return _MoveReads(self, bound)

    def close(self) -> None:
        if self.board is not None:
            self.board.close()  # peers waiting on this rank's row or acknowledgements stop too

    def used(self, op_send: bool, peer: int, nbytes: int) -> bool:
        """Whether a message of ``nbytes`` to / from ``peer`` goes by a same-host copy (both ends
        compute the same answer from the gathered verdicts)."""
        if nbytes < self.min_bytes:
            return False
        receiver, sender = (peer, self.rank) if op_send else (self.rank, peer)
        return bool(self.can_read[receiver] >> sender & 1)

    def batch(self, comm, ops) -> list:
        """The ops that go by same-host copies (every read message; a message of at least
        ``min_bytes`` between ranks that read each other) posted first, in order, then the
        others over gloo, in order."""
        return [work if work is not None else (comm.isend if op.send else comm.irecv)(op.tensor, op.peer, op.tag)
                for op, work in zip(ops, self._post_copies(comm, ops))]

    def _post_copies(self, comm, ops) -> list:
        """Post the ops of one batch that go by same-host copies; per op its work, ``None`` for
        those left to gloo. Every send is an offer of its own. (Offering consecutive sends to one
        peer together — one control message and one acknowledgement for several — deadlocked
        moves with a small staging budget: a reader waiting for the rest of an offer stalls the
        peer's own staged steps. A grouped protocol must not make a reader wait for later
        receives, e.g. acknowledge once per peer at the end of the move.)"""
        works: list = [None] * len(ops)
        for i, op in enumerate(ops):
            if op.read is not None:  # a read message (schedule._read_chunks): this way always
                self.messages += 1
                self.read_messages += 1
                if op.read is ON_BOARD:
                    n = self._board_sent[op.peer] = self._board_sent.get(op.peer, 0) + 1
                    works[i] = _BoardSendWork(self.board, op.peer, n)
                elif op.send:
                    works[i] = self._offer(comm, op.peer, op.tensor, op.read)
                else:
                    work = _ReadWork(*op.read, op.peer)
                    if self.board is not None:  # the sender lists every read message on the board
                        work.slot = self._read_slot(op.peer)
                    works[i] = self._expect(comm, op.peer, work)
                continue
            if not self.used(op.send, op.peer, op.tensor.numel() * op.tensor.element_size()):
                continue
            self.messages += 1
            works[i] = (self._offer(comm, op.peer, op.tensor) if op.send
                        else self._expect(comm, op.peer, _RecvWork(op.tensor, op.peer)))
        return works

    def _offer(self, comm, peer: int, tensor: torch.Tensor, control: torch.Tensor | None = None) -> _SendWork:
        """Offer ``tensor``'s bytes (or, for a read message, the addresses in ``control``); the
        send completes once the receiver acknowledges its copy."""
        if control is None:
            where = mapping_of(tensor) if self.maps(self.rank, peer) else _UNMAPPED
            control = torch.tensor([tensor.data_ptr(), tensor.numel() * tensor.element_size(), *where],
                                   dtype=torch.int64)
        ack = torch.empty(1, dtype=torch.int64)
        return _SendWork(comm.isend(control, peer, SAME_HOST_OFFER_TAG), comm.irecv(ack, peer, SAME_HOST_ACK_TAG),
                         (tensor, control, ack))

    def _read_slot(self, sender: int) -> tuple[int, int]:
        """(this move, how many read messages from ``sender`` it posted before this one)."""
        k = self.board.seq
        if self._reads[0] != k:
            self._reads = (k, {})
        j = self._reads[1].get(sender, 0)
        self._reads[1][sender] = j + 1
        return k, j

    def _expect(self, comm, peer: int, work: _RecvWork) -> _RecvWork:
        reader = self._readers.get(peer)
        if reader is None:
            reader = self._readers[peer] = _Reader(comm, peer, self.pids[peer], self.board)
        if reader.error is not None:
            raise RuntimeError(f"an earlier same-host copy from rank {peer} failed: {reader.error}")
        reader.jobs.put(work)
        return work

    def forget_mappings(self) -> None:
        """Unmap every peer storage mapped so far (call between moves, never during one)."""
        for r in self._readers.values():
            r.maps.clear()

    def stop(self) -> None:
        """End the readers, each after the copies already asked of it."""
        for r in self._readers.values():
            r.stop()

    def join(self, by: float) -> None:
        """Wait until ``by`` (``time.monotonic``) at most for the stopped readers to end."""
        for r in self._readers.values():
            r.join(by)


_NOTHING = torch.empty(0, dtype=torch.uint8)


class _MoveReads(MoveReads):
    """The read messages of one move on this rank (``SameHost.move_reads``). A send offers
    the addresses of the sender's packed block and of its buffers read in place, and where the
    receiver can map each of its source buffers — when it can map them all, nothing is packed,
    and where the group has a board the offer goes with the agreement (``offer_ahead``); a
    receive is its runs and this rank's destination buffers, copied by the reader of its sender."""

    __slots__ = ("bound", "near", "on_board", "where")

    def __init__(self, near: SameHost, bound):
        self.near, self.bound = near, bound
        self.where: dict[str, tuple[int, ...]] = {}  # per source buffer: where peers can map it
        self.on_board: set[int] = set()  # id() of the read messages' sends offered on the board

    def mapped(self, op) -> list[int] | None:
        """For a read message's send: where the receiver can map each of its source buffers, when
        it can map them all (mapped reads: nothing is packed); else None."""
        near = self.near
        if not near.maps(near.rank, op.peer):
            return None
        out: list[int] = []
        for n in op.read.sources:
            w = self.where.get(n)
            if w is None:
                w = self.where[n] = mapping_of(self.bound.source(n))
            if not w[0]:
                return None
            out += w
        return out

    def packs(self, op) -> bool:
        return not self.mapped(op)

    def p2p(self, op, packed: bool = False) -> P2P:
        if op.send:
            if id(op) in self.on_board:  # its offer went with the agreement (``offer_ahead``)
                return P2P(True, _NOTHING, op.peer, MESSAGE_TAG, ON_BOARD)
            where = self.mapped(op)
            block = _NOTHING
            if op.offset >= 0 and where is None:
                block = self.bound.packed_block(op, packed)
            return P2P(True, block, op.peer, MESSAGE_TAG, torch.tensor(self.offer(op, where, block), dtype=torch.int64))
        return P2P(False, _NOTHING, op.peer, MESSAGE_TAG,
                   (op.read, tuple(self.bound.destination(n) for n in op.read.dst_names)))

    def offer(self, op, where: list[int] | None, block: torch.Tensor = _NOTHING) -> list[int]:
        """A read message's offer: the addresses of the packed block and of the buffers read in
        place, where each source buffer can be mapped (zeros: nowhere), the bytes."""
        out = [block.data_ptr() if block.numel() else 0]
        out += [self.bound.source(n).data_ptr() for n in op.read.in_place]
        out += where or [0] * (MAP_FIELDS * len(op.read.sources))
        return out + [op.nbytes]

    def offer_ahead(self, sends) -> None:
        """Where the group has a board (``_Board``): write the offers of this rank's read
        messages' ``sends`` (in posting order) there for the next agreement to publish — each one
        whose sources the receiver maps (nothing to pack: ready now), the others marked as offered
        over gloo — and remember which."""
        board = self.near.board
        if board is None:
            return
        offers: dict[int, list[list[int] | None]] = {}
        ids = set()
        for op in sends:
            where = self.mapped(op)
            offers.setdefault(op.peer, []).append(None if where is None else self.offer(op, where))
            if where is not None:
                ids.add(id(op))
        if offers and board.post_offers(offers):
            self.on_board = ids


_GROUPS: dict[int, tuple[weakref.ref, SameHost | None]] = {}  # id(process group) -> (it, its copies)


def for_group(comm, key, timeout: timedelta | None = None) -> SameHost | None:
    """The same-host copies of the gloo group ``key`` (its process group object), found at its
    first move: a collective every rank of the group runs at the same point (two gathers of a
    few integers, ``timeout`` each). None where no pair can use them. Readers stop when the
    group is collected."""
    hit = _GROUPS.get(id(key))
    if hit is not None and hit[0]() is key:
        return hit[1]
    enabled = _switched_on(ENV) and _readv() is not None
    mapping = enabled and _switched_on(MAP_ENV)
    token = secrets.randbits(62) + 1 if enabled else 0
    probe = torch.zeros(_Board.numel(comm.size), dtype=torch.int64)  # the token, then this rank's board
    probe[_Board.TOKEN] = token
    if mapping:  # in shared memory, the same token can be read and mapped
        try:
            probe.share_memory_()
        except RuntimeError:
            pass
    fd, inode, _, size = mapping_of(probe)  # zeros where it is not shared (a fresh tensor: offset 0)
    # the threshold travels too: both ends of a message must take the same way
    min_bytes = int(os.environ.get(MIN_BYTES_ENV, MIN_BYTES))
    rows = comm.all_gather_ints([os.getpid(), probe.data_ptr(), token, min_bytes, fd, inode, size], timeout)
    mine = mapped = 0
    maps: dict[int, torch.Tensor] = {}  # peer -> its probe, mapped
    if enabled:
        got = torch.zeros(1, dtype=torch.int64)
        for r, (pid, address, theirs, _, fd, inode, size) in enumerate(rows):
            if r == comm.rank or theirs == 0:
                continue
            try:
                got.zero_()
                read_from(pid, address, got.data_ptr(), 8)
            except OSError:
                continue
            if int(got) != theirs:  # that PID here is not that rank (another host or PID namespace)
                continue
            mine |= 1 << r
            if mapping and fd:
                try:
                    theirs_mapped = _Mappings(pid).get(fd, inode, size)[:8 * probe.numel()].view(torch.int64)
                except (RuntimeError, OSError):
                    continue
                if int(theirs_mapped[_Board.TOKEN]) == theirs:
                    mapped |= 1 << r
                    maps[r] = theirs_mapped
    # whether this rank would take the agreement by a board (with every rank's word: the env
    # switch set on one rank only must not split the group between the board and gloo)
    board_ok = int(_futex() is not None and _switched_on(BOARD_ENV))
    words = _mask_words(comm.size)
    gathered = comm.all_gather_ints([board_ok, *_to_words(mine, words), *_to_words(mapped, words)], timeout)
    can_read = [_from_words(v[1:1 + words]) for v in gathered]
    can_map = [_from_words(v[1 + words:]) for v in gathered]
    state = (SameHost(comm, [row[0] for row in rows], can_read, max(row[3] for row in rows), can_map)
             if any(can_read) else None)
    everyone = (1 << comm.size) - 1
    if (state is not None and all(v[0] for v in gathered)
            and all(m | 1 << r == everyone for r, m in enumerate(can_map))):
        # every rank maps every other (the same verdicts on every rank): the agreement goes by
        # the board; `probe` and the peers' stay mapped for it (otherwise nobody touches them again)
        state.board = _Board(comm.rank, state.pids, probe, maps)
    _GROUPS[id(key)] = (weakref.ref(key), state)
    weakref.finalize(key, _forget, id(key), state)
    return state


def _switched_on(env: str) -> bool:
    """Whether the switch ``env`` (on unless "0", "false" or "no") is on."""
    return os.environ.get(env, "1") not in ("0", "false", "no")


_MASK_BITS = 62  # bits of a rank bitmask per int64 of the verdicts' gather (no sign, no overflow)


def _mask_words(world: int) -> int:
    return max(1, -(-world // _MASK_BITS))


def _to_words(mask: int, words: int) -> list[int]:
    """A bitmask of ranks as ``words`` int64s of ``_MASK_BITS`` bits each (a group of more than 63
    ranks overflows one int64)."""
    return [mask >> (_MASK_BITS * i) & ((1 << _MASK_BITS) - 1) for i in range(words)]


def _from_words(words: list[int]) -> int:
    return sum(w << (_MASK_BITS * i) for i, w in enumerate(words))


def forget_mappings() -> None:
    """Every group's ``SameHost.forget_mappings``: a process about to free its peers' old buffers'
    memory for good (a benchmark between cases) need not wait for the next move to drop them."""
    for _, state in list(_GROUPS.values()):
        if state is not None:
            state.forget_mappings()


def _forget(key: int, state: SameHost | None) -> None:
    _GROUPS.pop(key, None)
    if state is not None:
        state.stop()


@atexit.register
def _stop_all() -> None:
    """At interpreter exit, end every reader before the interpreter stops its threads: a reader
    still inside gloo (the last acknowledgement's send, posted after its receive was done) when
    the interpreter ends it dies inside C++ code, which aborts the process ("terminate called
    without an active exception" after a clean run)."""
    states = [state for _, state in list(_GROUPS.values()) if state is not None]
    for state in states:
        state.stop()
    by = time.monotonic() + 2.0  # a reader still waiting for an offer that never comes is left
    for state in states:
        state.join(by)
