"""Direct construction of a layout's buffers from global tensors, and reading fragments back.

This is the reference every move is checked against: ``materialize(layout, rank, tensor_of)``
builds what rank ``rank`` would hold if the destination layout were made from scratch. It is also
how a demo or test fills the source layout. The only place in ``vps`` that touches torch storage.
"""
from __future__ import annotations

from typing import Callable, Mapping

import torch

from .layout import Fragment, Layout
from .space import StateKey

TORCH_DTYPES = {
    "float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16,
    "float16": torch.float16, "int64": torch.int64, "int32": torch.int32, "int16": torch.int16,
    "int8": torch.int8, "uint8": torch.uint8,
}
DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}


def torch_dtype(name: str) -> torch.dtype:
    return TORCH_DTYPES[name]


def fragment_view(buffer: torch.Tensor, frag: Fragment) -> torch.Tensor:
    return torch.as_strided(buffer.view(-1), frag.box.shape, frag.strides, buffer.storage_offset() + frag.offset)


def allocate(layout: Layout, rank: int, fill: float | None = 0,
             device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    out = {}
    for name, b in layout.buffers(rank).items():
        t = torch.empty(b.numel, dtype=torch_dtype(b.dtype), device=device)
        if fill is not None:
            t.fill_(fill)
        out[name] = t
    return out


def materialize(layout: Layout, rank: int, tensor_of: Callable[[StateKey], torch.Tensor],
                fill: float = 0) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s buffers filled from global tensors (padding = ``fill``)."""
    bufs = allocate(layout, rank, fill)
    sources: dict[StateKey, torch.Tensor] = {}  # one tensor_of call per key, not per fragment
    for f in layout.fragments(rank):
        src = sources.get(f.key)
        if src is None:
            src = sources[f.key] = tensor_of(f.key)
        sl = tuple(slice(l, h) for l, h in zip(f.box.lo, f.box.hi))
        fragment_view(bufs[f.buffer], f).copy_(src[sl])
    return bufs


def coverage_masks(layout: Layout, rank: int) -> dict[str, torch.Tensor]:
    """Per buffer, a bool mask of the elements some fragment occupies (the rest is padding)."""
    masks = {n: torch.zeros(b.numel, dtype=torch.bool) for n, b in layout.buffers(rank).items()}
    for f in layout.fragments(rank):
        fragment_view(masks[f.buffer], f).fill_(True)
    return masks


def read_fragments(layout: Layout, rank: int, buffers: Mapping[str, torch.Tensor]):
    """Yield ``(fragment, view)`` for every fragment of ``rank``, reading the live buffers."""
    for f in layout.fragments(rank):
        yield f, fragment_view(buffers[f.buffer], f)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bits as integers, so comparisons are exact (NaN, -0.0 included)."""
    size = t.element_size()
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size])


def synthetic_tensor(spec_tensor, key: StateKey, seed: int = 0, dtype: str | None = None) -> torch.Tensor:
    """Deterministic random bits for one state key: every rank can rebuild any global tensor."""
    import zlib

    dt = torch_dtype(dtype or spec_tensor.dtype)
    g = torch.Generator().manual_seed(zlib.crc32(f"{seed}|{key.tensor}|{key.field}".encode()))
    if dt.is_floating_point:
        t = torch.randn(spec_tensor.shape, generator=g, dtype=torch.float32).to(dt)
    else:
        info = torch.iinfo(dt)
        t = torch.randint(info.min, info.max, spec_tensor.shape, generator=g, dtype=torch.int64).to(dt)
    return t
