"""Host offload as a layout: every rank keeps what it holds of another layout, in host buffers of
its own.

``host_layout(layout)`` gives each rank the same boxes it holds in ``layout`` — so the move
between the two is local copies only, no byte crosses ranks — packed densely: the fragments of
buffer ``B`` go, in ``layout``'s order, one after another into host buffer ``host/B`` as
row-major blocks. Alignment padding and bytes no fragment describes are not carried (an engine's
buffer of 1000 elements with 998 described becomes a host buffer of 998). E.g. a ZeRO-3 rank's
fp32 partition ``master/g0`` holding flat ``[0, 6)`` of ``a`` [2, 4] and all of ``b`` [3] is
``host/master/g0`` of 9 elements: ``a`` rows [0, 1) at 0, ``a`` [1, 2) × cols [0, 2) at 4, ``b`` at 6.

Pure metadata like every layout: where the host buffers are (pinned CPU memory on a GPU machine,
plain CPU tensors on CPU) is the engine's business (``engines/offload.py``).
"""
from __future__ import annotations

from ..layout import BufferSpec, Fragment, Layout
from ..space import row_major_strides

HOST_PREFIX = "host/"


def host_layout(layout: Layout, name: str | None = None) -> Layout:
    """``layout``'s fragments, each rank's packed into host buffers of its own (module doc)."""
    fragments, buffers = [], []
    for rank in range(layout.world_size):
        declared = layout.buffers(rank)
        mine, sizes = [], {}
        for f in layout.fragments(rank):
            buffer = HOST_PREFIX + f.buffer
            offset = sizes.get(buffer, 0)
            mine.append(Fragment(f.key, f.box, buffer, offset, row_major_strides(f.box.shape)))
            sizes[buffer] = offset + f.box.numel
        fragments.append(tuple(mine))
        buffers.append({b: BufferSpec(n, declared[b[len(HOST_PREFIX):]].dtype) for b, n in sizes.items()})
    return Layout(layout.spec, fragments, buffers, name=name or f"host({layout.name})")
