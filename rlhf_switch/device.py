"""Where a run computes, as data: the device kind, the process-group backend for device tensors,
the compute dtype and the master (optimizer-state) dtype — resolved once when the world starts
and handed to every engine, so the GPU path is the CPU path with other values, not a branch.

    spec = resolve_device("auto", cuda_available=torch.cuda.is_available())
    spec.kind, spec.backend            # "cpu", "gloo"   or   "cuda", "nccl"
    spec.compute_dtype, spec.master_dtype   # cpu: float32, float32   cuda: bfloat16, float32

``device: auto`` is CUDA when the process that asks (a Ray actor, on its bundle) sees a GPU.
``device: cuda`` where none is visible is a ``ConfigError``, raised before anything starts. The
default compute dtype is bfloat16 on CUDA (with the fp32 master copy and Adam moments kept apart)
and float32 on CPU, whose kernels are ~26× slower in bf16 (PLATFORM.md); ``model.dtype`` sets it.

Pure: nothing here imports torch at module level or touches a device; ``cuda_available`` is an
argument, so every combination is a unit test on a machine without GPUs.
"""
from __future__ import annotations

from dataclasses import dataclass

DEVICE_KINDS = ("auto", "cpu", "cuda")
BACKENDS = {"cpu": "gloo", "cuda": "nccl"}
DEFAULT_COMPUTE_DTYPE = {"cpu": "float32", "cuda": "bfloat16"}
MASTER_DTYPE = "float32"  # the optimizer's copy of the weights and its moments: fp32 everywhere


class DeviceUnavailable(ValueError):
    """``device: cuda`` where no GPU is visible (message: what was asked, what was seen, what to do)."""


@dataclass(frozen=True)
class DeviceSpec:
    """One run's device, backend and dtypes (the same on every actor of the world)."""

    kind: str = "cpu"                 # "cpu" or "cuda" (never "auto": that is resolved)
    backend: str = "gloo"             # process groups that carry device tensors
    compute_dtype: str = "float32"    # weights the forward/backward and the rollout engine read
    master_dtype: str = MASTER_DTYPE  # the optimizer's copy and its moments

    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"

    @property
    def mixed(self) -> bool:
        """Compute in a narrower dtype than the master copy (bf16 compute + fp32 master)."""
        return self.compute_dtype != self.master_dtype

    def torch_device(self):
        """This process's device: ``cpu``, or its current CUDA device (a Ray actor sees the GPU(s)
        of its bundle only, first as ``cuda:0``)."""
        import torch

        return torch.device("cuda", torch.cuda.current_device()) if self.is_cuda else torch.device("cpu")

    def torch_dtype(self, which: str = "compute"):
        import torch

        return getattr(torch, self.compute_dtype if which == "compute" else self.master_dtype)


CPU = DeviceSpec()


def resolve_device(requested: str = "auto", cuda_available: bool = False,
                   compute_dtype: str | None = None) -> DeviceSpec:
    """The ``DeviceSpec`` for a config's ``device`` (``auto``/``cpu``/``cuda``) in a process that
    does (``cuda_available``) or does not see a GPU; ``compute_dtype``: ``model.dtype`` (None: the
    device's default). Raises ``DeviceUnavailable`` for ``cuda`` without a GPU."""
    if requested not in DEVICE_KINDS:
        raise ValueError(f"device: {requested!r} is not one of {', '.join(DEVICE_KINDS)}")
    if requested == "cuda" and not cuda_available:
        raise DeviceUnavailable(
            "device: cuda, but no GPU is visible here (torch.cuda.is_available() is False: a CPU-only torch, "
            "no driver, or CUDA_VISIBLE_DEVICES empty); use device: auto or device: cpu")
    kind = "cuda" if requested == "cuda" or (requested == "auto" and cuda_available) else "cpu"
    return DeviceSpec(kind, BACKENDS[kind], compute_dtype or DEFAULT_COMPUTE_DTYPE[kind], MASTER_DTYPE)


def cuda_available() -> bool:
    """Whether this process sees a GPU (what ``device: auto`` asks, in each actor)."""
    import torch

    return bool(torch.cuda.is_available())
