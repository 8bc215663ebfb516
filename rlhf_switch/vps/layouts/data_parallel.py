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

from ..space import Box, flat_range_to_boxes, row_major_strides
from .local import LocalTensor

DP_SHARDINGS = ("replicate", "fsdp", "zero3", "zero")

Piece = tuple[str, Box, str, int, tuple[int, ...]]


def _parts_in_flat(lt: LocalTensor, lo: int, hi: int, buffer: str, base: int) -> list[Piece]:
    """Pieces of ``lt``'s flat range ``[lo, hi)``, placed at ``base + (flat - lo)`` of ``buffer``."""
    out: list[Piece] = []
    row = lt.row_numel
    for p in lt.parts:
        p_lo = p.row * row
        p_hi = p_lo + p.box.numel
        a, b = max(lo, p_lo), min(hi, p_hi)
        if a >= b:
            continue
        strides = row_major_strides(p.box.shape)
        if a == p_lo and b == p_hi:  # the whole part: the common case
            out.append((p.tensor, p.box, buffer, base + a - lo, strides))
            continue
        first = a  # sub-boxes tile [a, b) in flat order
        for sub in flat_range_to_boxes(p.box.shape, a - p_lo, b - p_lo, p.box.lo):
            out.append((p.tensor, sub, buffer, base + first - lo, strides))
            first += sub.numel
    return out


def replicate(local: list[LocalTensor], dp: int, rank: int) -> tuple[list[Piece], dict[str, int]]:
    pieces = [(p.tensor, p.box, lt.buffer, p.row * lt.row_numel, row_major_strides(p.box.shape))
              for lt in local for p in lt.parts]
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
        n = lt.numel
        P = -(-n // dp)
        lo, hi = min(rank * P, n), min((rank + 1) * P, n)
        pieces += _parts_in_flat(lt, lo, hi, buffer, base)
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
