"""Pipeline parallelism: which tensors stage ``s`` of ``pp`` holds.

Layers are split into contiguous runs (evenly, earlier stages taking the remainder, or as given
by ``stage_layers``); tensors anchored ``first`` (the embedding) go to stage 0 and those anchored
``last`` (final norm, LM head) to the last stage. With tied embeddings the last stage also holds
the embedding tensor — in a buffer named ``lm_head.weight`` — so it is a replica of the same
state key on two stages, moved once and read by both.
"""
from __future__ import annotations

from ..layout import LayoutError
from ..spec import ModelSpec, TensorSpec

TIED_HEAD_BUFFER = "lm_head.weight"
EMBEDDING = "model.embed_tokens.weight"


def stage_bounds(num_layers: int, pp: int, stage_layers: tuple[int, ...] | None = None) -> list[tuple[int, int]]:
    if stage_layers is None:
        if pp > max(num_layers, 1):
            raise LayoutError(f"PP={pp} is larger than the model's {num_layers} layers")
        base, extra = divmod(num_layers, pp)
        stage_layers = tuple(base + (1 if s < extra else 0) for s in range(pp))
    if len(stage_layers) != pp or sum(stage_layers) != num_layers or min(stage_layers) < 0:
        raise LayoutError(f"stage_layers={stage_layers} must give {pp} stages summing to {num_layers} layers")
    bounds, lo = [], 0
    for n in stage_layers:
        bounds.append((lo, lo + n))
        lo += n
    return bounds


def stage_tensors(spec: ModelSpec, pp: int, stage: int,
                  stage_layers: tuple[int, ...] | None = None) -> list[tuple[TensorSpec, str]]:
    """[(tensor, buffer name)] on ``stage``, in model order."""
    lo, hi = stage_bounds(spec.num_layers, pp, stage_layers)[stage] if spec.num_layers else (0, 0)
    first, last = stage == 0, stage == pp - 1
    out = []
    for t in spec.tensors:
        if t.layer is not None:
            keep = lo <= t.layer < hi
        else:
            keep = last if t.anchor == "last" else first
        if keep:
            out.append((t, t.name))
    if spec.tied_lm_head and last and not first and EMBEDDING in spec:
        out.append((spec[EMBEDDING], TIED_HEAD_BUFFER))
    return out


def all_stage_tensors(spec: ModelSpec, pp: int,
                      stage_layers: tuple[int, ...] | None = None) -> list[list[tuple[TensorSpec, str]]]:
    """``[stage_tensors(spec, pp, s) for s in range(pp)]`` in one pass over the model."""
    bounds = stage_bounds(spec.num_layers, pp, stage_layers) if spec.num_layers else [(0, 0)] * pp
    stage_of = {}  # layer -> stage
    for s, (lo, hi) in enumerate(bounds):
        for layer in range(lo, hi):
            stage_of[layer] = s
    out: list[list[tuple[TensorSpec, str]]] = [[] for _ in range(pp)]
    for t in spec.tensors:
        if t.layer is not None:
            s = stage_of.get(t.layer)
            if s is None:  # a layer no stage holds (num_layers of 0)
                continue
        else:
            s = pp - 1 if t.anchor == "last" else 0
        out[s].append((t, t.name))
    if spec.tied_lm_head and pp > 1 and EMBEDDING in spec:
        out[pp - 1].append((spec[EMBEDDING], TIED_HEAD_BUFFER))
    return out
