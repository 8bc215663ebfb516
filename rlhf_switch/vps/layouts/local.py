"""The rank-local tensors that layout families hand to one another.

Tensor and pipeline parallelism decide which *local tensors* a rank has: a buffer of some local
shape whose dim-0 rows are filled by parts of global tensors (a column shard, a row shard, the
q/k/v rows of a fused QKV). Data parallelism then shards or replicates those local tensors. A part
always fills whole local rows, stored row-major, which is what lets a flat ZeRO range or a dim-0
FSDP chunk of the local buffer be turned back into global boxes.
"""
from __future__ import annotations

from math import prod
from typing import NamedTuple

from ..space import Box


class Part(NamedTuple):
    tensor: str
    box: Box  # in the global tensor
    row: int  # first local row it fills


class LocalTensor(NamedTuple):
    buffer: str
    shape: tuple[int, ...]  # local shape; dim 0 is what parts stack on
    parts: tuple[Part, ...]
    dtype: str  # of the tensors behind it (a shard of pure vocab padding has no parts, still a dtype)

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def row_numel(self) -> int:
        return self.numel // self.shape[0]


def whole(tensor: str, shape: tuple[int, ...], dtype: str, buffer: str | None = None) -> LocalTensor:
    return LocalTensor(buffer or tensor, tuple(shape), (Part(tensor, Box.full(shape), 0),), dtype)
