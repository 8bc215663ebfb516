"""A machine profile: the rates and links the cost model divides by.

A profile is data (a frozen dataclass, saved as a small JSON): matmul FLOP/s per dtype, memory
bandwidth (decode reads every weight once per step), device memory, and three kinds of link, each
a bandwidth and a per-message latency — point to point (the switch's rank-to-rank moves, PP
activations), collectives (all-gather / reduce-scatter of ZeRO-3 / FSDP, TP all-reduces) inside a
node and across nodes, and a same-device copy (a colocated trainer and rollout worker: CUDA IPC
on GPU, shared memory on CPU). Two profiles ship:

- ``h100_ib.json``: an H100/H200-class node on InfiniBand from **published figures** (not
  measured here; each field's source is in its ``sources``);
- ``cpu_local.json``: this development machine, **measured** by ``rlhf-switch tune --calibrate``
  (``rlhf_switch.tune.calibrate``).

CPU-only fields: ``compute_slots`` — how many devices can compute at the same time (a CPU box
with 2 cores running 4 logical devices runs them 2 at a time; ``None``: every device is its own
chip) — and the fixed costs a GPU hides, per layer forward (``layer_overhead_s``) and per decode
step (``decode_step_overhead_s``, per rollout engine) and per tensor of an optimizer step
(``optimizer_tensor_s``: the engines run AdamW with ``foreach=False``, one loop turn per tensor),
and what each training engine adds on top (``engine_forward_s``, ``engine_step_s``), measured by
a micro-run of the real engine on 2 processes with the config's shapes; and the switch's fixed
cost per sync and channel member (``switch_member_s``, per rollout engine), from a run's own metrics.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

PROFILES = Path(__file__).resolve().parent / "profiles"
GIB = 1 << 30


@dataclass(frozen=True)
class Link:
    """``bandwidth`` bytes/s per rank, ``latency`` seconds per message (or per collective step)."""

    bandwidth: float
    latency: float

    def seconds(self, nbytes: float, messages: int = 1) -> float:
        return nbytes / self.bandwidth + messages * self.latency


@dataclass(frozen=True)
class MachineProfile:
    name: str
    origin: str                               # "published figures" or "measured: <when, how>"
    matmul_flops: dict[str, float]            # dtype -> achieved FLOP/s of one device
    memory_bandwidth: float                   # bytes/s of one device (decode reads the weights)
    device_memory: float                      # bytes of one device
    devices_per_node: int
    p2p_intra: Link
    p2p_inter: Link
    collective_intra: Link                    # ring bus bandwidth per rank, latency per ring step
    collective_inter: Link
    same_device: Link                         # colocated processes on one device
    compute_slots: int | None = None          # devices that compute at once (None: all)
    layer_overhead_s: float = 0.0             # fixed cost of one decoder layer's forward call
    decode_step_overhead_s: dict[str, float] = field(default_factory=dict)  # rollout engine -> s/step
    decode_sequence_s: dict[str, float] = field(default_factory=dict)       # rollout engine -> s/step/sequence
    optimizer_tensor_s: float = 0.0           # AdamW (foreach=False) + clipping, fixed cost per tensor per step
    # a training engine's own fixed costs beyond the above (hooks, DTensor dispatch, gathers'
    # bookkeeping), measured by a micro-run of the real engine: per micro-batch forward, per
    # optimizer step; keyed by the engine's profile key (TrainingEngine.profile_key: "deepspeed-z3", "fsdp2", ...)
    engine_forward_s: dict[str, float] = field(default_factory=dict)
    engine_step_s: dict[str, float] = field(default_factory=dict)
    # the switch's fixed cost per sync beyond its bytes (a Ray call to every member of the weight
    # channel, the rollout engine's RPC and prefix-cache reset), per member of the channel and per
    # rollout engine: a world of 4 calls twice the members of a world of 2; from a run's metrics
    switch_member_s: dict[str, float] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)

    def flops(self, dtype: str) -> float:
        if dtype in self.matmul_flops:
            return self.matmul_flops[dtype]
        return self.matmul_flops.get("float32", min(self.matmul_flops.values()))

    def engine_costs(self, key: str) -> tuple[float, float]:
        """(per forward micro-batch, per optimizer step) fixed seconds of a training engine."""
        return self.engine_forward_s.get(key, 0.0), self.engine_step_s.get(key, 0.0)

    def decode_overhead(self, key: str, batch: int = 0) -> float:
        """A decode step's fixed seconds for ``batch`` sequences (sampling, scheduling) of the
        rollout engine whose profile key is ``key`` (``RolloutEngine.profile_key``)."""
        return self.decode_step_overhead_s.get(key, 0.0) + batch * self.decode_sequence_s.get(key, 0.0)

    def slowdown(self, world: int) -> float:
        """How much slower each device computes when ``world`` of them share ``compute_slots``."""
        return 1.0 if self.compute_slots is None else max(1.0, world / self.compute_slots)

    def with_memory(self, gib: float | None) -> "MachineProfile":
        return self if gib is None else replace(self, device_memory=gib * GIB)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_dict(cls, d: dict) -> "MachineProfile":
        d = dict(d)
        for k in ("p2p_intra", "p2p_inter", "collective_intra", "collective_inter", "same_device"):
            d[k] = Link(**d[k])
        return cls(**d)


class ProfileError(ValueError):
    pass


def load_profile(path_or_name: str | Path) -> MachineProfile:
    """A profile from a JSON file, or a shipped one by name (``h100_ib``, ``cpu_local``)."""
    p = Path(path_or_name)
    if not p.exists() and (PROFILES / f"{path_or_name}.json").exists():
        p = PROFILES / f"{path_or_name}.json"
    try:
        return MachineProfile.from_dict(json.loads(p.read_text()))
    except FileNotFoundError:
        shipped = ", ".join(sorted(q.stem for q in PROFILES.glob("*.json")))
        raise ProfileError(f"profile {str(path_or_name)!r}: no such file (shipped: {shipped})") from None
    except (ValueError, TypeError, KeyError) as e:
        raise ProfileError(f"profile {p}: not a machine profile ({e})") from None


def save_profile(profile: MachineProfile, path: str | Path) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(profile.to_json() + "\n")
    return p


def h100_ib() -> MachineProfile:
    """An H100 SXM / H200 node of 8 GPUs on NVLink, 400 Gb/s InfiniBand per GPU: **published
    figures**, with an assumed model FLOP utilisation of 45 % of the dense bf16 peak."""
    mfu = 0.45
    return MachineProfile(
        name="h100_ib",
        origin="published figures (not measured here); compute = 45 % MFU of the dense peak (assumed)",
        matmul_flops={"bfloat16": 989e12 * mfu, "float16": 989e12 * mfu, "float32": 67e12 * mfu},
        memory_bandwidth=4.8e12 * 0.8,      # H200 HBM3e 4.8 TB/s, ~80 % reachable by decode kernels
        device_memory=141e9,                # H200; an H100 SXM has 80 GB (--device-memory 80)
        devices_per_node=8,
        p2p_intra=Link(450e9 * 0.8, 10e-6),         # NVLink 4: 900 GB/s bidirectional = 450 GB/s each way
        p2p_inter=Link(50e9 * 0.8, 20e-6),          # ConnectX-7 400 Gb/s = 50 GB/s per GPU
        collective_intra=Link(450e9 * 0.8, 10e-6),  # NCCL ring bus bandwidth inside an NVLink node
        collective_inter=Link(50e9 * 0.8, 30e-6),
        same_device=Link(4.8e12 * 0.4, 20e-6),      # CUDA IPC copy: one HBM read + one write
        sources={
            "matmul_flops": "NVIDIA H100 SXM datasheet: 989 TFLOP/s dense BF16 (1979 with sparsity), 67 TFLOP/s FP32",
            "memory_bandwidth": "NVIDIA H200 datasheet: 141 GB HBM3e, 4.8 TB/s (H100 SXM: 80 GB HBM3, 3.35 TB/s)",
            "p2p_intra": "NVIDIA NVLink 4 (H100/H200): 900 GB/s total bidirectional per GPU",
            "p2p_inter": "NVIDIA ConnectX-7 / Quantum-2 InfiniBand NDR: 400 Gb/s per GPU (8 per DGX H100 node)",
            "efficiencies": "assumed, not published: 45 % MFU, 80 % of link and HBM peaks",
        },
    )
