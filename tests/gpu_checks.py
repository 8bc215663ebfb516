"""The colocated path on one device, run as far as one device allows: what a bare GPU machine runs.

    python tests/gpu_checks.py [--json FILE]            # cuda: bf16 and fp32, the 8B shape (32 layers)
    python tests/gpu_checks.py --device cpu             # the same code on CPU (test_device.py)

Two processes share the device, as a colocated run's trainer and rollout worker do: this one, the
trainer (FSDP2 over a world of one: NCCL on a GPU, gloo on CPU), and a rollout process it starts
(``torch.multiprocessing``, spawn) holding a torch rollout engine. They share one weight channel
(``engines/channel.py``: a gloo group over a TCPStore on 127.0.0.1, for the agreement and the
handshakes) with ``handoff: ipc``, resolved from where both processes say they are: each sync
packs the weights into buckets on the trainer's side, hands the rollout process one handle per
bucket (CUDA IPC on a GPU, shared memory on CPU: ``routing/handoff.py``) and the rollout process
copies out of them into its engine. No NCCL group joins the two: NCCL takes one GPU per rank.

Per compute dtype (``--dtypes``, default bf16 then fp32): a few training steps; a sync into the
rollout process, its engine's weights compared (per buffer, a digest of every covered element)
with the trainer's parameters cast to that dtype; the optimizer state offloaded to host memory
(pinned on a GPU; ``engines/offload.py``), the rollout engine's log-probs computed meanwhile and
compared with the trainer's own forward, the state reloaded and compared bit for bit with what
it was, device memory measured before, while parked and after (``torch.cuda.memory_allocated``
and ``max_memory_allocated``; on CPU the offload's own measure, ``live_state_bytes``); one more
step and a second (warm) sync, checked the same way. ``--lora R``: rank-R adapters on a frozen
base, the base moved once (the warm start), then each sync moves the adapters alone.

Then an 8B-shape handoff (Llama-3-8B tensor shapes; on CPU the same code on a model 1/8 as wide):
the trainer's bf16 weights (one buffer per tensor, as FSDP holds them) through the same channel
into the rollout engine's layout (fused qkv and gate_up) in the rollout process, timed cold and
warm against one device copy of the same bytes (``torch.empty_like(buf).copy_(buf)`` of one
contiguous buffer), every move checked against a direct construction of the destination.

Needs torch, transformers, numpy (and peft for ``--lora``); no vLLM, DeepSpeed, Ray or network.
Prints one table last (markdown), writes every figure to ``--json``; exit 1 when a check fails.
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import json
import socket
import sys
import time
import traceback
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_switch import SHAPES, fill_pattern, pattern_exact, timed_median  # noqa: E402
from rlhf_switch.device import resolve_device  # noqa: E402
from rlhf_switch.engines.channel import ChannelEnd, resolve_handoff  # noqa: E402
from rlhf_switch.engines.lora import WeightSync, canonical_name, only  # noqa: E402
from rlhf_switch.engines.offload import HostOffload, live_state_bytes, offloaded_state  # noqa: E402
from rlhf_switch.engines.torch_rollout import TorchRollout  # noqa: E402
from rlhf_switch.engines.torch_train import build_fsdp2  # noqa: E402
from rlhf_switch.engines.train_state import gather_layouts  # noqa: E402
from rlhf_switch.vps import EXP_AVG, EXP_AVG_SQ, ParallelConfig, build_layout, llama_spec, select  # noqa: E402
from rlhf_switch.vps.layouts.vllm import vllm_layout  # noqa: E402
from rlhf_switch.vps.materialize import allocate, bits, materialize, read_fragments  # noqa: E402
from rlhf_switch.vps.placement import place  # noqa: E402
from rlhf_switch.vps.spec import LoraSpec  # noqa: E402

# a small Llama: big enough for real kernels, small enough for any device
HF_CONFIG = dict(model_type="llama", vocab_size=4096, hidden_size=512, intermediate_size=1536,
                 num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                 max_position_embeddings=256, tie_word_embeddings=False, rms_norm_eps=1e-6,
                 pad_token_id=0, bos_token_id=1, eos_token_id=2)
# the 8B shape per device: Llama-3-8B's own on a GPU; on CPU every width 1/8 of it (the same heads)
BIG = {"cuda": SHAPES["8B"],
       "cpu": dict(hidden_size=512, num_attention_heads=32, num_key_value_heads=8, intermediate_size=1792,
                   vocab_size=16032, num_hidden_layers=32)}
TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2}  # the largest log-prob difference accepted
# seconds: any wait inside a move (a lost process ends the run within it, not at the device's
# time limit), and one command of the rollout process (its imports come before the first answer)
TIMEOUT_S, ANSWER_S = 120, 300
TRAINER, WORKER = 0, 1  # the channel's ranks


def logprobs_of(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return logits.float().log_softmax(-1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]


def covered_digests(layout, rank: int, buffers) -> dict[str, str]:
    """Per buffer of rank ``rank``, a digest of the bits of every element a fragment covers (in
    fragment order): equal digests on both sides of a move are equal bytes; padding is left out."""
    out: dict = {}
    for f, view in read_fragments(layout, rank, buffers):
        out.setdefault(f.buffer, hashlib.sha256()).update(bits(view).cpu().numpy().tobytes())
    return {n: h.hexdigest() for n, h in out.items()}


def where_am_i(device: torch.device) -> tuple:
    """This process's device as ``resolve_handoff`` compares them: the host and the GPU's UUID."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return socket.gethostname(), str(getattr(props, "uuid", device.index))
    return socket.gethostname(), "cpu"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def ensure_layouts(end: ChannelEnd, src, dst) -> None:
    """Set the channel's layouts where they differ from the ones it has (both sides call it with
    the same pair: setting the same pair again would only remake the buckets)."""
    if end.src is None or end.src.digest != src.digest or end.dst.digest != dst.digest:
        end.set_layouts(src, dst)


# --- the rollout process -----------------------------------------------------------------------

class RolloutSide:
    """The rollout process's state: its channel end, its engine (or the 8B-shape buffers) and the
    commands the trainer sends it, one method each."""

    def __init__(self, conn, device: torch.device):
        self.conn, self.device = conn, device
        self.end: ChannelEnd | None = None
        self.engine: TorchRollout | None = None
        self.big: dict[str, torch.Tensor] | None = None

    def hello(self) -> tuple:
        return where_am_i(self.device)

    def join(self, host: str, port: int, handoff: str, colocated) -> dict:
        self.end = ChannelEnd.join(host, port, WORKER, 2, timeout_s=TIMEOUT_S, standby_s=TIMEOUT_S,
                                   handoff=handoff, colocated=colocated, backend="gloo")
        return self.end.stats()

    def build_engine(self, spec, hf_config: dict, dtype: str):
        self.engine = TorchRollout.from_hf_config(spec, hf_config, tp=1, tp_rank=0, group=None, dtype=dtype,
                                                  device=str(self.device))
        return self.engine.layout(1)

    def apply_adapters(self, on: bool) -> None:
        self.engine.set_apply_adapters(on)

    def allocate_big(self, dst) -> int:
        self.big = allocate(dst, WORKER, fill=float("nan"), device=self.device)
        return sum(t.nbytes for t in self.big.values())

    def move(self, src, dst, target: str) -> dict:
        """One move through the channel into the engine (``target`` "engine") or the 8B-shape
        buffers ("big"). What the move writes is set to NaN first, so every element checked
        afterwards came from this move; then ``ready`` goes back, so the trainer times the move
        alone."""
        ensure_layouts(self.end, src, dst)
        buffers = self.engine.buffers if target == "engine" else self.big
        if target == "engine":  # the covered elements only: a LoRA sync leaves the base alone
            for _, view in read_fragments(dst, WORKER, buffers):
                view.fill_(float("nan"))
        else:
            for t in buffers.values():
                t.fill_(float("nan"))
        synchronize(self.device)
        self.conn.send(("ok", "ready"))
        report = self.end.move({}, buffers)
        return asdict(report)

    def digests(self, layout) -> dict[str, str]:
        return covered_digests(layout, WORKER, self.engine.buffers)

    def big_exact(self, layout) -> bool:
        exact = pattern_exact(layout, self.big, self.device, rank=WORKER)
        if self.device.type == "cuda":  # the check's temporaries (an int64 copy of the largest tensor)
            torch.cuda.empty_cache()
        return exact

    @torch.no_grad()
    def logprobs(self, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.to(self.device)
        return logprobs_of(self.engine.forward(ids), ids).cpu()

    def free(self) -> int:
        self.engine = self.big = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            return torch.cuda.memory_allocated(self.device)
        return 0

    def stats(self) -> dict:
        return self.end.stats()


def rollout_main(conn, device_kind: str) -> None:
    """The rollout process: serves the trainer's commands (``(method, args)`` of ``RolloutSide``)
    until ``stop``; a failure goes back as its traceback."""
    device = torch.device("cuda", 0) if device_kind == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    side = RolloutSide(conn, device)
    while True:
        method, args = conn.recv()
        if method == "stop":
            break
        try:
            conn.send(("ok", getattr(side, method)(*args)))
        except Exception:  # noqa: BLE001 - to the trainer, which raises it
            conn.send(("error", traceback.format_exc()))
    if side.end is not None:
        side.end.close()


class RolloutProcess:
    """The trainer's side of the rollout process: commands down a pipe, answers back."""

    def __init__(self, device_kind: str):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=rollout_main, args=(child, device_kind), daemon=True)
        self.process.start()
        child.close()

    def send(self, method: str, *args) -> None:
        self.conn.send((method, args))

    def answer(self, timeout_s: float = ANSWER_S):
        try:
            if not self.conn.poll(timeout_s):
                raise RuntimeError(f"the rollout process gave no answer in {timeout_s:.0f} s")
            kind, value = self.conn.recv()
        except EOFError:
            self.process.join(5)
            raise RuntimeError(f"the rollout process ended (exit code {self.process.exitcode})") from None
        if kind == "error":
            raise RuntimeError("in the rollout process:\n" + value)
        return value

    def call(self, method: str, *args):
        self.send(method, *args)
        return self.answer()

    def stop(self) -> None:
        try:
            self.send("stop")
        except (OSError, BrokenPipeError):
            pass
        self.process.join(30)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)


# --- the trainer's side ------------------------------------------------------------------------

def handoff_move(end: ChannelEnd, rollout: RolloutProcess, src, dst, src_buffers, target: str,
                 device: torch.device) -> tuple[dict, dict, float]:
    """One move of ``src`` (the trainer's, rank 0) into ``dst`` (the rollout process's, rank 1)
    through the channel, timed on the trainer from when both stand ready to the rollout process's
    word that it has copied out of the buckets. Returns (trainer's report, worker's, seconds)."""
    ensure_layouts(end, src, dst)
    rollout.send("move", src, dst, target)
    assert rollout.answer() == "ready"
    synchronize(device)
    t0 = time.perf_counter()
    mine = end.move(src_buffers, {})
    seconds = time.perf_counter() - t0
    return asdict(mine), rollout.answer(), seconds


def storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """A host copy of every byte of the storage behind ``t`` (padding no fragment describes
    included); on the host, so the device memory measured around the offload is the engine's."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage()).to("cpu", copy=True)


def memory(device: torch.device, adapter) -> int:
    """The trainer's memory as this device measures it: the CUDA allocator's allocated bytes; on
    CPU the bytes of the engine's state and weights buffers (``live_state_bytes``)."""
    if device.type == "cuda":
        synchronize(device)
        return torch.cuda.memory_allocated(device)
    return live_state_bytes(adapter)


def colocated_sync(end: ChannelEnd, rollout: RolloutProcess, device_kind: str, dtype: str, steps: int,
                   lora_r: int) -> dict:
    """One compute dtype: train, sync into the rollout process, offload while it computes, reload,
    compare; one more step and a warm sync (module docstring)."""
    spec = resolve_device(device_kind, torch.cuda.is_available(), dtype)
    device = spec.torch_device()
    if device.type == "cuda":  # this phase's peak, not the one before
        torch.cuda.reset_peak_memory_stats(device)
    lora = LoraSpec(lora_r, 2.0 * lora_r, ("q_proj", "k_proj", "v_proj", "o_proj")) if lora_r else None
    trainer = build_fsdp2(HF_CONFIG, 0, [0], device=spec, lora=lora)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, HF_CONFIG["vocab_size"], (8, 64), generator=gen).to(device)
    losses = [trainer.train_step(ids) for _ in range(steps)]
    model = trainer.spec
    engine_layout = rollout.call("build_engine", model, HF_CONFIG, spec.compute_dtype)
    full_dst = place(engine_layout, [WORKER], 2)

    def placed(sub_spec, weights, dst):
        (src,), _ = gather_layouts([(sub_spec, weights)], ["train"])
        return place(src, [TRAINER], 2), place(dst, [WORKER], 2)

    def weights_exact() -> list[str]:
        """The engine's buffers whose covered elements differ from the trainer's parameters, cast
        to the engine's dtype (the truth without the layouts' arithmetic)."""
        truth = {canonical_name(n): (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu()
                 for n, p in trainer.module.named_parameters()}
        want = materialize(full_dst, WORKER, lambda k: truth[k.tensor].to(spec.torch_dtype()))
        mine, theirs = covered_digests(full_dst, WORKER, want), rollout.call("digests", full_dst)
        return sorted(n for n in mine if mine[n] != theirs.get(n))

    sync = WeightSync.choose(model, "adapters" if lora else "auto", True, spec.compute_dtype)
    moves = []
    if lora is not None:  # the warm start: the frozen base, once
        base = [t.name for t in model.tensors if not model.is_adapter(t.name)]
        weights = only(trainer.adapter.weights(), base)
        moves.append((*placed(model.subset(base, "base"), weights, select(engine_layout, base, "base")), weights))
    rollout.call("apply_adapters", sync.mode == "adapters")
    weights = sync.source(trainer.adapter)
    moves.append((*placed(sync.spec_of(model), weights, sync.destination(engine_layout)), weights))
    first = [handoff_move(end, rollout, src, dst, w.tensors, "engine", device) for src, dst, w in moves]
    cold_differs = weights_exact()

    # the optimizer state to host memory while the rollout engine computes, then back
    parked = offloaded_state(trainer.adapter, "optimizer")
    before = {n: storage_bytes(t) for n, t in parked.tensors.items()}
    moments = sum((s[f].to_local() if hasattr(s[f], "to_local") else s[f]).nbytes
                  for s in trainer.optimizer.state.values() for f in (EXP_AVG, EXP_AVG_SQ))
    mem = {"before": memory(device, trainer.adapter)}
    if device.type == "cuda":
        mem["peak_training"] = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    offload = HostOffload(trainer.adapter, "optimizer")
    out = offload.offload()
    released_now = all(t.untyped_storage().nbytes() == 0 for t in parked.tensors.values())
    mem["parked"] = memory(device, trainer.adapter)
    got = rollout.call("logprobs", ids.cpu())  # the rollout engine's forward while the state is away
    back = offload.reload()
    mem["reloaded"] = memory(device, trainer.adapter)
    if device.type == "cuda":
        mem["peak_offload_reload"] = torch.cuda.max_memory_allocated(device)
    after = {n: storage_bytes(t) for n, t in offloaded_state(trainer.adapter, "optimizer").tensors.items()}
    changed = sorted(n for n in before if not torch.equal(before[n], after[n]))
    with torch.no_grad():
        ref = logprobs_of(trainer.module(input_ids=ids).logits, ids).cpu()

    # training goes on from the reloaded state; the next sync reuses the buckets and the mapping
    losses.append(trainer.train_step(ids))
    src, dst, w = moves[-1]
    warm = handoff_move(end, rollout, src, dst, sync.source(trainer.adapter).tensors, "engine", device)
    warm_differs = weights_exact()
    rollout.call("free")
    diff = (got - ref).abs()
    return {
        "backend": spec.backend, "compute_dtype": spec.compute_dtype, "master_dtype": spec.master_dtype,
        "params": model.numel, "losses": [round(float(x), 4) for x in losses], "sync": sync.mode,
        "sync_bytes": first[-1][1]["bytes_local"], "warm_bytes": warm[1]["bytes_local"],
        "sync_seconds": first[-1][2], "warm_seconds": warm[2], "warm_start_bytes":
            sum(m[1]["bytes_local"] for m in first[:-1]),
        "handoff": first[-1][0]["handoff"], "buckets": first[-1][0]["buckets"], "handles": first[-1][1]["handles"],
        "bytes_over_group_to_worker": first[-1][1]["bytes_received"] + warm[1]["bytes_received"],
        "trainer_reports": [m[0] for m in first] + [warm[0]], "worker_reports": [m[1] for m in first] + [warm[1]],
        "sync_differs": cold_differs, "warm_differs": warm_differs,
        "logprob_max_diff": float(diff.max()), "logprob_mean_diff": float(diff.mean()),
        "tolerance": TOLERANCE[spec.compute_dtype],
        "offload": {"moved": out.bytes_moved, "reloaded": back.bytes_moved, "moments_bytes": moments,
                    "released": out.bytes_released, "taken": back.bytes_released, "released_now": released_now,
                    "pinned": all(t.is_pinned() for t in offload.host.values()), "changed": changed,
                    "memory": mem, "measure": "torch.cuda.memory_allocated" if device.type == "cuda"
                    else "live_state_bytes", "seconds": [out.seconds, back.seconds]},
    }


def big_handoff(end: ChannelEnd, rollout: RolloutProcess, device_kind: str, layers: int, repeats: int) -> dict:
    """The 8B shape (module docstring): ``layers`` of its layers, bf16, the trainer's per-tensor
    buffers into the rollout engine's layout through the channel, against one device copy."""
    device = resolve_device(device_kind, torch.cuda.is_available()).torch_device()
    gc.collect()  # the small model's trainers, before 16 GB of buffers
    if device.type == "cuda":
        torch.cuda.empty_cache()
    shape = {**BIG[device_kind], "num_hidden_layers": layers}
    spec = llama_spec({**shape, "torch_dtype": "bfloat16"}, name=f"llama-8B-shape-{layers}L")
    src, dst = place(build_layout(spec, ParallelConfig(dp=1, dp_shard="fsdp")), [TRAINER], 2), \
        place(vllm_layout(spec, 1), [WORKER], 2)
    nbytes = sum(f.box.numel for f in dst.fragments(WORKER)) * 2
    # the baseline first, before the handoff's buffers take the memory: one copy of the same bytes
    one = torch.empty(nbytes, dtype=torch.uint8, device=device)
    copy_s = timed_median(lambda: torch.empty_like(one).copy_(one), str(device), repeats)
    one = None  # freed before the handoff's buffers
    if device.type == "cuda":
        torch.cuda.empty_cache()
    src_buffers = allocate(src, TRAINER, fill=None, device=device)
    fill_pattern(src, src_buffers, device, rank=TRAINER)
    if device.type == "cuda":  # the fill's temporaries, before the buckets
        torch.cuda.empty_cache()
    rollout.call("allocate_big", dst)
    moves, exact = [], []
    for _ in range(1 + repeats):  # the first is cold: buckets made, handles mapped
        moves.append(handoff_move(end, rollout, src, dst, src_buffers, "big", device))
        exact.append(rollout.call("big_exact", dst))
    stats = rollout.call("stats")
    del src_buffers
    rollout.call("free")
    warm = sorted(m[2] for m in moves[1:])
    warm_s = warm[len(warm) // 2]
    return {"shape": shape, "true_layers": SHAPES["8B"]["num_hidden_layers"], "params": spec.numel,
            "bytes": nbytes, "moved_bytes": moves[-1][1]["bytes_local"], "buckets": moves[-1][0]["buckets"],
            "cold_seconds": moves[0][2], "warm_seconds": warm_s, "all_seconds": [m[2] for m in moves],
            "gather_seconds": [m[0]["phases"]["gather"] for m in moves],
            "copy_seconds": copy_s, "ratio": warm_s / copy_s, "exact": exact,
            "worker_handles_received": stats["handles_received"]}


# --- the table ---------------------------------------------------------------------------------

def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _yes(differing: list[str]) -> str:
    """``yes``, or how many buffers differ and the first of them."""
    if not differing:
        return "yes"
    return f"NO, {len(differing)} differ ({', '.join(differing[:2])}{', ...' if len(differing) > 2 else ''})"


def rows(r: dict) -> list[tuple[str, str, str, bool]]:
    """(check, dtype, what was measured, passed) per check."""
    cuda = r["device_kind"] == "cuda"
    carrier = "CUDA IPC" if cuda else "shared memory"
    out = []
    for dtype, p in r["dtypes"].items():
        short = {"bfloat16": "bf16", "float32": "fp32"}[dtype]
        if "error" in p:
            out.append(("colocated sync", short, p["error"], False))
            continue
        losses = p["losses"]
        out.append((f"FSDP2 training, world of one ({r['backend']})", short,
                    f"loss {losses[0]:.2f} → {losses[-1]:.2f} over {len(losses)} steps (the last after the reload)",
                    losses[-1] < losses[0]))
        warm_start = f", warm start {p['warm_start_bytes']:,} B" if p["warm_start_bytes"] else ""
        out.append((f"sync ({p['sync']}) into the rollout process, handoff {p['handoff']} ({carrier})", short,
                    f"{p['sync_bytes']:,} B, {p['buckets']} bucket(s){warm_start}; {p['sync_seconds'] * 1e3:.1f} ms "
                    f"cold, {p['warm_seconds'] * 1e3:.1f} ms warm; bit-exact: {_yes(p['sync_differs'])}, "
                    f"warm {_yes(p['warm_differs'])}",
                    p["handoff"] == "ipc" and not p["sync_differs"] and not p["warm_differs"]
                    and p["bytes_over_group_to_worker"] == 0))
        out.append(("log-probs, rollout process vs trainer", short,
                    f"max {p['logprob_max_diff']:.2g}, mean {p['logprob_mean_diff']:.2g} (tol {p['tolerance']:g})",
                    p["logprob_max_diff"] <= p["tolerance"]))
        o, m = p["offload"], p["offload"]["memory"]
        peak = (f"; peak {_mib(m['peak_training'])} training, {_mib(m['peak_offload_reload'])} offload to reload"
                if cuda else "")
        out.append((f"optimizer offload to {'pinned ' if cuda else ''}host, reload", short,
                    f"{o['moved']:,} B each way; {o['measure']} {_mib(m['before'])} → {_mib(m['parked'])} → "
                    f"{_mib(m['reloaded'])}{peak}; state bit-exact: {_yes(o['changed'])}",
                    offload_ok(o, cuda)))
    b = r.get("big")
    if b is not None:
        if "error" in b:
            out.append(("8B-shape handoff", "bf16", b["error"], False))
        else:
            s = b["shape"]
            what = ("8B shape" if cuda else "8B heads, 1/8 width") + \
                f", {s['num_hidden_layers']} of {b['true_layers']} layers"
            out.append((f"{what}: handoff {r['handoff']} ({carrier}) vs one device copy", "bf16",
                        f"{b['bytes'] / 1e9:.2f} GB, {b['buckets']} bucket(s); {b['warm_seconds'] * 1e3:.1f} ms warm "
                        f"({b['cold_seconds'] * 1e3:.1f} cold) vs {b['copy_seconds'] * 1e3:.1f} ms: "
                        f"{b['ratio']:.2f}×; bit-exact: {'yes' if all(b['exact']) else b['exact']}",
                        all(b["exact"]) and b["moved_bytes"] == b["bytes"]))
    return out


def offload_ok(o: dict, cuda: bool) -> bool:
    """The state came back as it was and the memory really left: on CPU the live bytes fell by
    exactly what was released; on a GPU the allocator's by at least that (it rounds blocks up),
    from pinned host buffers."""
    m = o["memory"]
    common = (not o["changed"] and o["released_now"] and o["moved"] == o["reloaded"] == o["moments_bytes"]
              and o["released"] == o["taken"] >= o["moments_bytes"])
    if cuda:
        return common and o["pinned"] and m["before"] - m["parked"] >= o["released"] and \
            m["reloaded"] - m["parked"] >= o["taken"]
    return common and m["before"] - m["parked"] == o["released"] and m["reloaded"] == m["before"]


def table(r: dict) -> str:
    lines = ["| check | dtype | measured | ok |", "|---|---|---|---|"]
    lines += [f"| {c} | {d} | {m} | {'yes' if ok else '**NO**'} |" for c, d, m, ok in rows(r)]
    return "\n".join(lines)


# --- main --------------------------------------------------------------------------------------

def run(device_kind: str, dtypes: list[str], steps: int, lora_r: int, big_layers: int, repeats: int) -> dict:
    device = resolve_device(device_kind, torch.cuda.is_available()).torch_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    rollout = RolloutProcess(device_kind)
    r = {"device_kind": device_kind, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
         "torch": torch.__version__, "cuda": torch.version.cuda, "dtypes": {}}
    backend = resolve_device(device_kind, torch.cuda.is_available()).backend
    r["backend"] = backend
    port = _free_port()
    dist.init_process_group(backend, rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")
    end = None
    try:
        # colocation from where both processes are, as a run resolves it
        places = [where_am_i(device), rollout.call("hello")]
        handoff, colocated = resolve_handoff("auto", places, 1)
        r.update(handoff=handoff, colocated=[list(c) for c in colocated], places=[list(p) for p in places])
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=TIMEOUT_S))
        rollout.send("join", "127.0.0.1", store.port, handoff, colocated)
        end = ChannelEnd.join("127.0.0.1", store.port, TRAINER, 2, store=store, timeout_s=TIMEOUT_S,
                              standby_s=TIMEOUT_S, handoff=handoff, colocated=colocated, backend="gloo")
        rollout.answer()
        failed = None
        for dtype in dtypes:
            r["dtypes"][dtype] = _phase(lambda: colocated_sync(end, rollout, device_kind, dtype, steps, lora_r), failed)
            failed = failed or r["dtypes"][dtype].get("error")
        if big_layers:
            r["big"] = _phase(lambda: big_handoff(end, rollout, device_kind, big_layers, repeats), failed)
    finally:
        rollout.stop()  # first: the buckets it maps are released before this process frees them
        if end is not None:
            end.close()
        dist.destroy_process_group()
    return r


def _phase(fn, failed: str | None) -> dict:
    """A phase's figures, or its error (the traceback to stderr); not run after a failed one (the
    channel may be mid-move)."""
    if failed:
        return {"error": "not run: an earlier check failed"}
    t0 = time.perf_counter()
    try:
        return {**fn(), "phase_seconds": time.perf_counter() - t0}
    except Exception as e:  # noqa: BLE001 - reported in the table, the traceback on stderr
        traceback.print_exc()
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--dtypes", default="bfloat16,float32", help="compute dtypes, in order")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--lora", type=int, default=0, metavar="R", help="train rank-R adapters and sync them alone")
    ap.add_argument("--big-layers", type=int, default=None,
                    help="layers of the 8B shape (default: all 32 on cuda, 2 on cpu; 0: skip it)")
    ap.add_argument("--repeats", type=int, default=3, help="warm 8B-shape moves and baseline copies timed")
    ap.add_argument("--json", default=None, help="write every figure here")
    a = ap.parse_args(argv)
    layers = a.big_layers if a.big_layers is not None else (32 if a.device == "cuda" else 2)
    t0 = time.perf_counter()
    r = run(a.device, a.dtypes.split(","), a.steps, a.lora, layers, a.repeats)
    r["rows"] = [list(x) for x in rows(r)]
    r["ok"] = all(ok for *_, ok in r["rows"])
    r["seconds"] = time.perf_counter() - t0
    if a.json:
        Path(a.json).write_text(json.dumps(r, indent=1, default=str))
    print(f"\n{r['device']}, torch {r['torch']}, CUDA {r['cuda']}; trainer and rollout in two processes, "
          f"handoff {r.get('handoff')}; {r['seconds']:.0f} s\n")
    print(table(r), flush=True)
    return 0 if r["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
