"""Bucket layouts: a rank's fragments packed densely into a few flat buffers ("buckets").

The colocated handoff (``routing/handoff.py``) hands a rollout worker its weights as handles to a
few packed buckets — one handle per bucket, not per tensor. What sits where in those buckets is a
layout of its own, pure data like every other:

- ``bucket_layout(dst, holders, budget_bytes)``: for each destination rank ``w`` of ``dst`` (a
  rollout layout placed on a channel's ranks), ``w``'s fragments, each box stored row-major and
  dense, packed in ``w``'s fragment order into buffers ``bucket/<w>/<i>`` of one dtype and at most
  ``budget_bytes`` each (a box larger than that is cut into pieces that fit), held by rank
  ``holders[w]``.

The same buckets are described twice, with only the holder changed: held by the trainer rank
colocated with ``w`` (the trainer's ranks gather into them: ``train -> bucket_layout(dst, colocated)``,
a move over the channel's group), and held by ``w`` itself (the worker copies out of them:
``bucket_layout(dst, identity) -> dst``, local copies only). Both cover the model whenever
``dst`` does, so the planner and executor treat them like any layout.
"""
from __future__ import annotations

from typing import Iterator, Mapping

from ..layout import BufferSpec, Fragment, Layout, LayoutError
from ..space import Box
from ..spec import itemsize

PREFIX = "bucket/"


def bucket_name(worker: int, index: int) -> str:
    return f"{PREFIX}{worker}/{index}"


def _dense_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    return tuple(reversed(strides))


def _pieces(box: Box, elem: int, cap: int) -> Iterator[Box]:
    """``box`` cut into boxes of at most ``cap`` bytes, in row-major order: whole rows of dim 0
    where a row fits, else each row cut the same way along the next dimension."""
    if box.numel * elem <= cap:
        yield box
        return
    if len(box.lo) == 1:
        step = max(1, cap // elem)
        for lo in range(box.lo[0], box.hi[0], step):
            yield Box((lo,), (min(lo + step, box.hi[0]),))
        return
    row = Box(box.lo[1:], box.hi[1:])
    row_bytes = row.numel * elem
    if row_bytes <= cap:
        step = cap // row_bytes
        for lo in range(box.lo[0], box.hi[0], step):
            yield Box((lo,) + box.lo[1:], (min(lo + step, box.hi[0]),) + box.hi[1:])
        return
    for i in range(box.lo[0], box.hi[0]):
        for sub in _pieces(row, elem, cap):
            yield Box((i,) + sub.lo, (i + 1,) + sub.hi)


def worker_buckets(dst: Layout, worker: int, budget_bytes: int) -> tuple[tuple[Fragment, ...], dict[str, BufferSpec]]:
    """Rank ``worker``'s fragments of ``dst`` packed into buckets: (bucket fragments, bucket buffers)."""
    if budget_bytes <= 0:
        raise LayoutError(f"the bucket budget must be positive, not {budget_bytes}")
    bufs = dst.buffers(worker)
    frags: list[Fragment] = []
    sizes: dict[str, int] = {}  # bucket -> elements used
    dtypes: dict[str, str] = {}
    open_bucket: dict[str, str] = {}  # dtype -> the bucket being filled
    for f in dst.fragments(worker):
        dtype = bufs[f.buffer].dtype
        elem = itemsize(dtype)
        if elem > budget_bytes:
            raise LayoutError(f"a bucket of {budget_bytes} B cannot hold one {dtype} element")
        for piece in _pieces(f.box, elem, budget_bytes):
            name = open_bucket.get(dtype)
            if name is None or (sizes[name] + piece.numel) * elem > budget_bytes:
                name = open_bucket[dtype] = bucket_name(worker, len(sizes))
                sizes[name], dtypes[name] = 0, dtype
            frags.append(Fragment(f.key, piece, name, sizes[name], _dense_strides(piece.shape)))
            sizes[name] += piece.numel
    return tuple(frags), {n: BufferSpec(sizes[n], dtypes[n]) for n in sizes}


def bucket_layout(dst: Layout, holders: Mapping[int, int], budget_bytes: int) -> Layout:
    """The buckets of every rank ``w`` in ``holders`` (its fragments of ``dst``, see
    ``worker_buckets``), held by rank ``holders[w]`` of ``dst``'s world (one rank may hold
    several workers' buckets: their names differ)."""
    world = dst.world_size
    frags: list[list[Fragment]] = [[] for _ in range(world)]
    bufs: list[dict[str, BufferSpec]] = [{} for _ in range(world)]
    for w, holder in sorted(holders.items()):
        if not (0 <= w < world and 0 <= holder < world):
            raise LayoutError(f"bucket holder {holder} of rank {w} is outside a world of {world}")
        f, b = worker_buckets(dst, w, budget_bytes)
        frags[holder].extend(f)
        bufs[holder].update(b)
    pairs = ",".join(f"{w}>{h}" for w, h in sorted(holders.items()))
    return Layout(dst.spec, [tuple(f) for f in frags], bufs, f"buckets({dst.name})",
                  f"buckets({dst.digest},{pairs},{budget_bytes})")
