"""Data parallelism over a rank's local tensors: replicate, or shard the way real engines do.

=========  ======================================================================================
replicate  every DP rank holds the local tensors whole (DDP; ZeRO-1/2's bit16 params)
fsdp       each local tensor split on dim 0 with torch.chunk semantics (FSDP2 ``Shard(0)``): rank i
           holds rows ``[i·c, (i+1)·c)``, ``c = ceil(rows/dp)``, in a buffer padded to ``c`` rows
zero3      each local tensor flattened and split on its own (DeepSpeed ZeRO-3 ``ds_tensor``):
           ``P = ceil(numel/dp)``, rank i holds flat ``[i·P, (i+1)·P)``; a rank's partitions are
           concatenated, ``P`` each (padding included), in one flat buffer
zero       all local tensors concatenated in order, padded to a multiple of ``alignment·dp``
           and split in ``dp`` equal ranges (DeepSpeed ZeRO-1/2 flat fp32 partition)
=========  ======================================================================================

Each function returns ``(pieces, buffers)``: pieces are ``(tensor, box, buffer, offset, strides)``
and buffers map a name to its element count.
"""
from __future__ import annotations

import functools
from math import prod

from ..space import Box, flat_range_to_boxes, row_major_strides
from .local import LocalTensor

DP_SHARDINGS = ("replicate", "fsdp", "zero3", "zero")

Piece = tuple[str, Box, str, int, tuple[int, ...]]


# Every layer of a stage has the same part boxes (and a rank the same flat range of each), so at
# 70B scale these two caches turn tens of thousands of splits into a few hundred. Boxes are
# immutable, so sharing them between layers' fragments changes no value.
@functools.lru_cache(maxsize=1 << 14)
def _box_geometry(box: Box) -> tuple[int, tuple[int, ...]]:
    """(numel, row-major strides) of a part's box."""
    return box.numel, row_major_strides(box.shape)


@functools.lru_cache(maxsize=1 << 14)
def _split_part(box: Box, start: int, stop: int) -> tuple[tuple[Box, int], ...]:
    """The sub-boxes of ``box``'s flat range ``[start, stop)``, each with its flat start
    relative to ``start`` (they tile the range in flat order)."""
    out, first = [], 0
    for sub in flat_range_to_boxes(box.shape, start, stop, box.lo):
        out.append((sub, first))
        first += sub.numel
    return tuple(out)


def _parts_in_flat(lt: LocalTensor, lo: int, hi: int, buffer: str, base: int,
                   out: list[Piece] | None = None, row: int | None = None) -> list[Piece]:
    """Pieces of ``lt``'s flat range ``[lo, hi)``, placed at ``base + (flat - lo)`` of ``buffer``
    (appended to ``out`` when given; ``row`` is ``lt.row_numel`` when the caller has it)."""
    if out is None:
        out = []
    if row is None:
        row = lt.row_numel
    for p in lt.parts:
        numel, strides = _box_geometry(p.box)
        p_lo = p.row * row
        p_hi = p_lo + numel
        # max/min spelled out: this runs once per local tensor per rank
        a = lo if lo > p_lo else p_lo
        b = hi if hi < p_hi else p_hi
        if a >= b:
            continue
        if a == p_lo and b == p_hi:  # the whole part: the common case
            out.append((p.tensor, p.box, buffer, base + a - lo, strides))
            continue
        at = base + a - lo
        for sub, first in _split_part(p.box, a - p_lo, b - p_lo):
            out.append((p.tensor, sub, buffer, at + first, strides))
    return out


def replicate(local: list[LocalTensor], dp: int, rank: int) -> tuple[list[Piece], dict[str, int]]:
    pieces = []
    for lt in local:
        row = lt.row_numel
        for p in lt.parts:
            pieces.append((p.tensor, p.box, lt.buffer, p.row * row, _box_geometry(p.box)[1]))
    return pieces, {lt.buffer: lt.numel for lt in local}


def fsdp(local: list[LocalTensor], dp: int, rank: int) -> tuple[list[Piece], dict[str, int]]:
    pieces: list[Piece] = []
    buffers: dict[str, int] = {}
    for lt in local:
        rows = lt.shape[0]
        c = -(-rows // dp)
        lo, hi = min(rank * c, rows), min((rank + 1) * c, rows)
        buffers[lt.buffer] = c * lt.row_numel
        pieces += _parts_in_flat(lt, lo * lt.row_numel, hi * lt.row_numel, lt.buffer, 0)
    return pieces, buffers


def zero3(local: list[LocalTensor], dp: int, rank: int, buffer: str = "zero3.flat") -> tuple[list[Piece], dict[str, int]]:
    pieces: list[Piece] = []
    base = 0
    for lt in local:
        shape = lt.shape
        n = prod(shape)  # lt.numel and lt.row_numel, without two property calls per tensor
        P = -(-n // dp)
        lo, hi = rank * P, (rank + 1) * P
        if hi > n:  # min(., n) of both ends
            hi = n
            if lo > n:
                lo = n
        _parts_in_flat(lt, lo, hi, buffer, base, pieces, n // shape[0])
        base += P
    return pieces, {buffer: base}


def zero(local: list[LocalTensor], dp: int, rank: int, alignment: int = 2,
         buffer: str = "zero.flat") -> tuple[list[Piece], dict[str, int]]:
    total = sum(lt.numel for lt in local)
    m = alignment * dp
    P = -(-total // m) * m // dp
    lo, hi = rank * P, (rank + 1) * P
    pieces: list[Piece] = []
    start = 0
    for lt in local:
        end = start + lt.numel
        a, b = max(lo, start), min(hi, end)
        if a < b:
            pieces += _parts_in_flat(lt, a - start, b - start, buffer, a - lo)
        start = end
    return pieces, {buffer: P}
