"""The coordinate space: state keys, boxes, and flat ranges of row-major tensors.

Every piece of training state has one address: a ``StateKey`` (tensor name, field) and a
position inside the tensor's global shape. A ``Box`` is a half-open hyper-rectangle of those
positions. Everything here is plain integers; nothing allocates or imports torch.
"""
from __future__ import annotations

from math import prod
from operator import add, sub
from typing import NamedTuple, Sequence

# Fields of the training state. All fields of one tensor share its geometry; they differ only
# in dtype and in which ranks hold them (ZeRO-1/2 keep `param` whole on every rank but
# partition `master` and the Adam moments).
PARAM = "param"
MASTER = "master"
EXP_AVG = "exp_avg"
EXP_AVG_SQ = "exp_avg_sq"
ADAM_FIELDS = (MASTER, EXP_AVG, EXP_AVG_SQ)


class StateKey(NamedTuple):
    tensor: str
    field: str = PARAM

    def __str__(self) -> str:
        return self.tensor if self.field == PARAM else f"{self.tensor}[{self.field}]"


# A NamedTuple's generated ``__new__`` is a Python-level function. The hot paths (intersections,
# fragments, transfers: ~10^5 of each for one 70B plan) build the identical object with
# ``tuple.__new__(Cls, fields)`` directly, at about half the cost.
tuple_new = tuple.__new__


class Box(NamedTuple):
    """Half-open box ``[lo[d], hi[d])`` in a tensor's global coordinates."""

    lo: tuple[int, ...]
    hi: tuple[int, ...]

    @staticmethod
    def full(shape: Sequence[int]) -> "Box":
        hi = tuple(map(int, shape))
        return tuple_new(Box, ((0,) * len(hi), hi))

    # shape/numel/shift run hundreds of thousands of times when building and planning 70B
    # layouts: map() over operator functions avoids a generator frame per call
    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(map(sub, self.hi, self.lo))

    @property
    def numel(self) -> int:
        return prod(map(sub, self.hi, self.lo))

    @property
    def empty(self) -> bool:
        return any(h <= l for l, h in zip(self.lo, self.hi))

    def intersect(self, other: "Box") -> "Box | None":
        # hot path of planning (hundreds of thousands of calls at 70B scale): no generators
        slo, shi, olo, ohi = self.lo, self.hi, other.lo, other.hi
        lo, hi = [], []
        for i in range(len(slo)):
            a = slo[i] if slo[i] > olo[i] else olo[i]
            b = shi[i] if shi[i] < ohi[i] else ohi[i]
            if b <= a:
                return None
            lo.append(a)
            hi.append(b)
        return tuple_new(Box, (tuple(lo), tuple(hi)))

    @property
    def slices(self) -> tuple[slice, ...]:
        """The box as an index into its tensor: ``full[box.slices]``."""
        return tuple(map(slice, self.lo, self.hi))

    def contains(self, other: "Box") -> bool:
        return all(a <= c and d <= b for a, b, c, d in zip(self.lo, self.hi, other.lo, other.hi))

    def shift(self, delta: Sequence[int]) -> "Box":
        return tuple_new(Box, (tuple(map(add, self.lo, delta)), tuple(map(add, self.hi, delta))))

    def __str__(self) -> str:
        return "[" + ",".join(f"{l}:{h}" for l, h in zip(self.lo, self.hi)) + "]"


def row_major_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= s
    return tuple(reversed(strides))


def flat_range_to_boxes(shape: Sequence[int], start: int, stop: int,
                        origin: Sequence[int] | None = None) -> list[Box]:
    """Split the flat range ``[start, stop)`` of a row-major tensor into boxes, in flat order.

    A flat range is a ragged head (a partial innermost row, then partial outer blocks), a run of
    whole blocks, and a ragged tail, so it needs at most ``2*ndim - 1`` boxes. This is the shape of
    every ZeRO partition boundary.

    Worked example, shape (3, 4), range [2, 9): ``[0:1, 2:4]`` (head), ``[1:2, 0:4]`` (whole
    row), ``[2:3, 0:1]`` (tail).
    """
    shape = tuple(int(s) for s in shape)
    if not shape:
        return [Box((), ())] if start < stop <= 1 and start == 0 else []
    total = 1
    for s in shape:
        total *= s
    if not (0 <= start <= stop <= total):
        raise ValueError(f"flat range [{start}, {stop}) is outside a tensor of {total} elements")
    out: list[Box] = []
    _split(shape, start, stop, (), out)
    if origin is not None and any(origin):
        out = [b.shift(origin) for b in out]
    return out


def _split(shape: tuple[int, ...], start: int, stop: int, prefix: tuple[int, ...], out: list[Box]) -> None:
    # Invariant: [start, stop) indexes the sub-tensor `shape` that sits at coordinates `prefix`.
    if start >= stop:
        return
    top = tuple(p + 1 for p in prefix)
    if len(shape) == 1:
        out.append(Box(prefix + (start,), top + (stop,)))
        return
    inner = 1
    for s in shape[1:]:
        inner *= s
    first, last = start // inner, (stop - 1) // inner
    rest = tuple(0 for _ in shape[1:])
    if first == last:  # stays inside one outer slice
        _split(shape[1:], start - first * inner, stop - first * inner, prefix + (first,), out)
        return
    if start % inner:  # ragged head inside slice `first`
        _split(shape[1:], start - first * inner, inner, prefix + (first,), out)
        first += 1
    whole_end = last + 1 if stop % inner == 0 else last
    if whole_end > first:  # whole slices
        out.append(Box(prefix + (first,) + rest, top + (whole_end,) + shape[1:]))
    if stop % inner:  # ragged tail inside slice `last`
        _split(shape[1:], 0, stop - last * inner, prefix + (last,), out)
