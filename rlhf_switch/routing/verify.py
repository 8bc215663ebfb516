"""Verification of the bytes themselves: checksums computed where the bytes come from, checked where
they landed.

``move(..., verify="full" | "sample")`` ends, after every byte has landed (and been unpacked), with:

1. one small all-gather of this rank's verify settings (mode, fraction, seed): every rank must
   check the same pieces, or the check itself would be wrong — a disagreement raises
   ``VerifyError`` on every rank before any checksum travels;
2. the *source* of every checked piece checksums it from its source view (cast to the wire dtype,
   as the sender packs it) and sends the checksums of a pair's pieces to the destination in one
   small message per peer pair and direction (``VERIFY_TAG``); local pieces are checksummed on
   both sides of the copy on the rank itself;
3. the *destination* checksums the bytes that landed in its destination views and compares;
4. one small all-gather of the mismatch counts (and, only when some rank found one, an
   ``all_gather_object`` of the descriptions): every rank raises the same ``VerifyError``,
   naming the tensor, the box, the source rank and the destination rank of each corrupted piece.

*What a piece is.* The unit is the plan's transfer (``vps.planner.Transfer``: one box of one
state key from one rank's view to another rank's view), not the schedule's messages: the
transfers of a pair are the same list in the same order on both ends (the executor's agreement
proved it: the pair digests hash exactly these lists), they do not depend on the staging budget
or on how the schedule cuts, merges or stages them, and a box names what was corrupted in the
model's own terms.

*The checksum* is over the raw bytes, bitwise (NaN payloads, -0.0 exact): the bytes of the box's
elements in row-major order (cast to the wire dtype at the source, as the sender packs them),
read as int64 words ``w_i``, ``s1 = sum(w_i)`` and ``s2 = sum((i + 1) * w_i)``, both modulo 2^64
(torch's int64 arithmetic wraps). ``s1`` changes with any single flipped bit (a change of ±2^k
is never 0 modulo 2^64); ``s2`` adds position, so swapped or shifted elements (a wrong offset or
stride) change it too. It runs in torch on the buffers' own device as two int64 reductions of
the data (``checksum``: row and column sums of a ``[m, COLS]`` view give ``s2`` exactly), plus a
copy where the view is strided or not 8-byte aligned. Not cryptographic: it is made to catch
corruption and misplacement, not an adversary.

*Sampling* (``sample``): of each pair's list of pieces (and of the rank's local pieces) exactly
``ceil(fraction * n)`` are checked — at least one per pair that moves anything — those whose
hash of (plan digest, seed, source rank, destination rank, position in the pair's list) is
smallest. Every rank computes the same choice from what it knows. The seed is the caller's,
modulo 2^62 (the weight channel passes its count of moves, the same on every member; a loop may
pass its iteration), so successive moves check different pieces. Sampling can miss: a corrupted piece
that is not drawn passes unnoticed.
"""
from __future__ import annotations

import hashlib
import math
from itertools import groupby
from typing import Literal, Mapping, Sequence

import torch

from ..vps.materialize import torch_dtype
from ..vps.planner import Transfer
from .tags import VERIFY_TAG
from .transport import P2P

Mode = Literal["off", "sample", "full"]
MODES = ("off", "sample", "full")
DEFAULT_FRACTION = 0.1
MAX_REPORTED = 8  # mismatches described per rank


class VerifyError(RuntimeError):
    """A move's bytes did not arrive as they were sent (raised identically on every rank)."""


def check_mode(verify: str, fraction: float) -> None:
    if verify not in MODES:
        raise ValueError(f"verify must be one of {MODES}, not {verify!r}")
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"verify_fraction must be in (0, 1], not {fraction}")


# ------------------------------------------------------------------------------------ checksums

COLS = 1024  # words per row of the [rows, COLS] view the checksum reduces
_WEIGHTS: dict[torch.device, torch.Tensor] = {}


def _weights(n: int, device: torch.device) -> torch.Tensor:
    """``[1, 2, ..., n]`` (int64) on ``device``, from a cache."""
    w = _WEIGHTS.get(device)
    if w is None or w.numel() < n:
        w = _WEIGHTS[device] = torch.arange(1, max(n, 4 * COLS) + 1, dtype=torch.int64, device=device)
    return w[:n]


def checksum(t: torch.Tensor) -> torch.Tensor:
    """``[s1, s2]`` (int64, on ``t``'s device) of ``t``'s raw bytes in row-major element order,
    read as int64 words ``w_i`` (a last partial word zero-padded): ``s1 = sum w_i``,
    ``s2 = sum (i + 1) w_i``, modulo 2^64. The words are viewed as ``[m, COLS]``; with row sums
    ``R_j`` and column sums ``C_k``, ``s2 = COLS * sum j R_j + sum (k + 1) C_k`` exactly, so the
    data itself is only reduced twice (no int64 copy, no product over the data): that is what
    makes it cheap. Bitwise: NaN payloads and -0.0 count as their bits."""
    flat = t.reshape(-1)  # a copy only when ``t`` is a strided view
    raw = flat.view(torch.uint8)
    if raw.storage_offset() % 8 or raw.data_ptr() % 8:
        raw = raw.clone()  # an int64 view needs 8-byte alignment; the checksum must not depend on it
    nb = raw.numel()
    n8 = nb - nb % 8
    words = raw[:n8].view(torch.int64)
    nw = words.numel()
    m = nw // COLS
    dev = t.device
    s1 = torch.zeros((), dtype=torch.int64, device=dev)
    s2 = torch.zeros((), dtype=torch.int64, device=dev)
    if m:
        full = words[:m * COLS].view(m, COLS)
        rows, cols = full.sum(1), full.sum(0)
        s1 += rows.sum()
        s2 += COLS * ((rows * _weights(m, dev)).sum() - s1) + (cols * _weights(COLS, dev)).sum()
    rest = words[m * COLS:]
    if rest.numel():
        r1 = rest.sum()
        s1 += r1
        s2 += (rest * _weights(rest.numel(), dev)).sum() + m * COLS * r1
    if n8 < nb:  # the last partial word, zero-padded, at position nw
        tail = torch.zeros(8, dtype=torch.uint8, device=dev)
        tail[:nb - n8] = raw[n8:]
        w = tail.view(torch.int64)[0]
        s1 += w
        s2 += (nw + 1) * w
    return torch.stack((s1, s2))


def _view(buffers, name: str, offset: int, shape, strides) -> torch.Tensor:
    buf = buffers[name]
    return torch.as_strided(buf, shape, strides, buf.storage_offset() + offset)


def source_checksum(t: Transfer, src_buffers) -> torch.Tensor:
    """The checksum of what the sender sends: its source view, cast to the wire dtype."""
    v = _view(src_buffers, t.src_buffer, t.src_offset, t.box.shape, t.src_strides)
    return checksum(v.to(torch_dtype(t.dtype)))  # no copy where it is the wire dtype already


def destination_checksum(t: Transfer, dst_buffers) -> torch.Tensor:
    """The checksum of what landed: the destination view."""
    return checksum(_view(dst_buffers, t.dst_buffer, t.dst_offset, t.box.shape, t.dst_strides))


# ------------------------------------------------------------------------------------- sampling

_M64 = (1 << 64) - 1


def _mix(z: int) -> int:
    """splitmix64's finaliser: a well-spread 64-bit hash of a 64-bit int."""
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def sampled(n: int, fraction: float, digest: str, seed: int, src: int, dst: int) -> list[int]:
    """The positions (ascending) of the checked pieces among the ``n`` pieces that ``src`` sends
    ``dst`` (both ends compute the same): all of them at ``fraction`` 1, else the
    ``ceil(fraction * n)`` with the smallest hash of (plan digest, seed, src, dst, position)."""
    if fraction >= 1.0 or n == 0:
        return list(range(n))
    k = min(n, math.ceil(fraction * n))
    base = int.from_bytes(hashlib.blake2b(f"{digest}|{seed}|{src}|{dst}".encode(), digest_size=8).digest(), "big")
    order = sorted(range(n), key=lambda i: _mix(base ^ _mix(i)))
    return sorted(order[:k])


def checked(plan, fraction: float, seed: int) -> tuple[dict[int, list[Transfer]], dict[int, list[Transfer]],
                                                        list[Transfer]]:
    """This rank's checked pieces: (peer -> the pieces it sends the peer, peer -> those it
    receives from the peer, its local pieces), in the pairs' canonical order."""
    rank, digest = plan.rank, plan.digest

    def pick(ts: Sequence[Transfer], s: int, d: int) -> list[Transfer]:
        return [ts[i] for i in sampled(len(ts), fraction, digest, seed, s, d)]

    sends = {p: pick(tuple(ts), rank, p) for p, ts in groupby(plan.sends, key=lambda t: t.dst)}
    recvs = {p: pick(tuple(ts), p, rank) for p, ts in groupby(plan.recvs, key=lambda t: t.src)}
    return sends, recvs, pick(plan.local, rank, rank)


# ------------------------------------------------------------------------------------ the check

SEED_BITS = 62  # a seed is taken modulo 2^62: it travels in the settings row as an int64


def _settings_row(verify: str, fraction: float, seed: int) -> list[int]:
    return [MODES.index(verify), round(fraction * 1_000_000), seed]


def _describe(t: Transfer, expected, got) -> str:
    return (f"rank {t.dst} received {t.key}{t.box} (buffer {t.dst_buffer!r}) from rank {t.src}: "
            f"checksum {_hex(expected)} was sent, {_hex(got)} arrived")


def _hex(pair) -> str:
    return "/".join(f"{v & _M64:016x}" for v in pair)


def verify_move(schedule, src_buffers: Mapping[str, torch.Tensor], dst_buffers: Mapping[str, torch.Tensor],
                comm, verify: str, fraction: float, seed: int, timeout) -> int:
    """Check a finished move (see the module docstring); collective over ``comm``. Returns the
    number of pieces this rank checked as a destination; raises ``VerifyError`` on every rank
    when some piece arrived corrupted, or when the ranks disagree on what to check."""
    plan = schedule.plan
    if verify == "full":
        fraction = 1.0
    # the seed the ranks agree on is the one they sample with (seeds equal modulo 2^62 passed the
    # agreement and then drew different pieces)
    seed &= (1 << SEED_BITS) - 1
    mine = _settings_row(verify, fraction, seed)
    rows = comm.all_gather_ints(mine)
    if any(list(r) != mine for r in rows):
        detail = "; ".join(f"rank {r}: verify={MODES[row[0]]}, fraction {row[1] / 1e6}, seed {row[2]}"
                           for r, row in enumerate(rows))
        raise VerifyError(f"verification of {plan.transition}: the ranks disagree on what to check "
                          f"({detail}); the bytes were moved but not checked")
    sends, recvs, local = checked(plan, fraction, seed)
    ops, incoming = [], {}  # one message per peer and direction, all in one batch (NCCL-safe)
    for p, ts in sends.items():
        if ts:
            ops.append(P2P(True, torch.stack([source_checksum(t, src_buffers) for t in ts]), p, VERIFY_TAG))
    for p, ts in recvs.items():
        if ts:
            device = dst_buffers[ts[0].dst_buffer].device
            incoming[p] = torch.empty((len(ts), 2), dtype=torch.int64, device=device)
            ops.append(P2P(False, incoming[p], p, VERIFY_TAG))
    works = comm.transport.batch(comm, ops)  # the ops hold the outgoing tensors alive until sent
    problems: list[str] = []
    n_bad = 0
    # local pieces while the checksums travel
    for t in local:
        exp, got = source_checksum(t, src_buffers), destination_checksum(t, dst_buffers)
        if not torch.equal(exp, got):
            n_bad += 1
            if len(problems) < MAX_REPORTED:
                problems.append(_describe(t, exp.tolist(), got.tolist()))
    for w in works:
        w.wait(timeout)
    for p, ts in recvs.items():
        got = torch.stack([destination_checksum(t, dst_buffers) for t in ts])
        bad = (got != incoming[p]).any(dim=1)
        if bool(bad.any()):
            exp_l, got_l = incoming[p].tolist(), got.tolist()
            for i in bad.nonzero().flatten().tolist():
                n_bad += 1
                if len(problems) < MAX_REPORTED:
                    problems.append(_describe(ts[i], exp_l[i], got_l[i]))
    checked_here = len(local) + sum(len(ts) for ts in recvs.values())
    counts = comm.all_gather_ints([n_bad, checked_here])
    if any(c[0] for c in counts):
        everyone = comm.all_gather_object(problems)
        total_bad = sum(c[0] for c in counts)
        total = sum(c[1] for c in counts)
        lines = [d for ds in everyone for d in ds]
        more = total_bad - len(lines)
        raise VerifyError(f"verify={verify}: the move {plan.transition} delivered {total_bad} corrupted "
                          f"piece(s) of {total} checked: " + "; ".join(lines)
                          + (f"; and {more} more" if more > 0 else ""))
    return checked_here
