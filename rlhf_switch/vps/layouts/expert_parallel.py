"""Expert parallelism (Megatron MoE): experts split over an EP group carved out of DP.

With DP size ``D`` and EP size ``E`` (``E`` divides ``D``), DP rank ``d`` is EP rank ``d % E``
and expert-DP rank ``d // E``. EP rank ``e`` holds experts ``[e·X/E, (e+1)·X/E)`` of every MoE
layer, whole (TP may still split each expert); the dense tensors (attention, router, norms,
embeddings) stay on every DP rank. DP sharding then spreads dense tensors over all ``D`` ranks
and expert tensors over the ``D/E`` ranks holding the same experts, each in its own flat buffer.
Worked example, 8 experts, DP4·EP2: ranks with dp 0, 2 hold experts 0–3; dp 1, 3 hold 4–7.
"""
from __future__ import annotations

from ..layout import LayoutError
from ..spec import ModelSpec, TensorSpec


def check_ep(spec: ModelSpec, ep: int) -> None:
    if ep == 1:
        return
    if not spec.num_experts:
        raise LayoutError(f"EP={ep} needs a mixture-of-experts model; {spec.name!r} has no experts")
    if spec.num_experts % ep:
        raise LayoutError(f"EP={ep} does not divide num_experts={spec.num_experts}")


def keep_experts(spec: ModelSpec, tensors: list[tuple[TensorSpec, str]], ep: int, ep_rank: int):
    if ep == 1:
        return tensors
    per = spec.num_experts // ep
    return [(t, b) for t, b in tensors if t.expert is None or t.expert // per == ep_rank]


def shard_dense_and_experts(shard, local: list, spec: ModelSpec, dp: int, dp_rank: int, ep: int, **kw):
    """Apply the DP sharding ``shard`` to dense local tensors over DP and to expert local tensors
    over expert-DP. Flat buffers of the two groups get distinct names."""
    if ep == 1:
        return shard(local, dp, dp_rank, **kw)
    is_expert = [any(spec[p.tensor].expert is not None for p in lt.parts) for lt in local]
    dense = [lt for lt, x in zip(local, is_expert) if not x]
    experts = [lt for lt, x in zip(local, is_expert) if x]
    pieces, numels = shard(dense, dp, dp_rank, **kw)
    if experts:
        flat = {"buffer": f"{shard.__name__}.experts.flat"} if shard.__name__ in ("zero", "zero3") else {}
        more, more_numels = shard(experts, dp // ep, dp_rank // ep, **kw, **flat)
        pieces = pieces + more
        numels = {**numels, **more_numels}
    return pieces, numels
