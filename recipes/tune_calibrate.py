"""``rlhf-switch tune --calibrate``: short measured micro-runs on this machine -> a machine profile.

- matmul rate: fp32 ``torch.mm`` (the CPU loop trains in fp32) on one thread, the size of the tiny models' layers;
- memory bandwidth: a sum over a 256 MiB tensor (what a decode step does to its weights);
- a decoder layer's fixed cost: forward of the config's model on one short sequence, less its FLOPs;
- an optimizer step's fixed cost per tensor: AdamW (``foreach=False``, as the engines run it) and
  gradient clipping over the model's tensors;
- each training engine's own fixed costs: a micro-run of the real engine (DeepSpeed ZeRO-1/2/3,
  FSDP2, torch TP, torch PP) over 2 local processes with the config's shapes, as the loop runs
  it — a forward over the rollout batch's rows in micro-batches (the log-prob pass) and one
  optimizer step over a mini-batch in micro-batches — less what the terms above model for them;
- the switch's fixed cost per sync (``--switch-run DIR``: from a finished run's own metrics);
- gloo on 2 local processes (``rlhf_switch.launch.LocalWorld``): point-to-point ping-pong and
  all-gather / all-reduce, each at 4 KiB (latency) and 16 MiB (bandwidth);
- decode steps of the config's model, sampled with per-sequence seeds as the loop samples, at
  two batch sizes: the torch rollout engine in this process, and one real vLLM engine (TP1) in a
  child process when vLLM is installed — per step less the modelled bandwidth part = the
  engine's fixed cost per step and per sequence in the batch.

Every figure is the median of a few repeats after a warm-up: the typical cost, which is what a
run's averaged phases see (the least of the repeats — the machine's best — predicted every phase
of the validation runs too fast); the load average at the time is stored in the profile's
``origin``.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from rlhf_switch.tune.profile import Link, MachineProfile

SMALL, LARGE = 4 << 10, 16 << 20


def _typical(fn, repeats: int = 5) -> float:
    """The median of ``repeats`` timings after a warm-up."""
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def matmul_rate(dtype: torch.dtype, n: int = 512) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    reps = 8
    return 2 * n ** 3 * reps / _typical(lambda: [torch.mm(a, b) for _ in range(reps)])


def memory_bandwidth() -> float:
    x = torch.ones(64 << 20)  # 256 MiB fp32
    return x.numel() * 4 / _typical(lambda: x.sum())


def layer_overhead(hf_config: dict, flops: float) -> float:
    """Seconds per decoder-layer call beyond its FLOPs: a forward on a 1×8 batch."""
    from rlhf_switch.models import causal_lm
    from rlhf_switch.tune.workload import Workload

    model = causal_lm(hf_config, 0)
    ids = torch.randint(3, 40, (1, 8))
    with torch.no_grad():
        t = _typical(lambda: model(input_ids=ids, use_cache=False), 9)
    layers = int(hf_config["num_hidden_layers"])
    w = Workload(hf_config=hf_config, dtype="float32", rollout_batch=1, mini_batch=1, micro_batch=1, epochs=1,
                 prompt_tokens=8, new_tokens=0, has_reference=False, has_critic=False)
    return max(0.0, (t - w.forward_flops_per_token() * 8 / flops) / layers)


def optimizer_tensor_seconds(hf_config: dict) -> float:
    """One AdamW step (the engines' ``foreach=False``) plus gradient clipping over the model's
    tensors, per tensor (the tiny model's arithmetic is negligible beside the loop's turns)."""
    from rlhf_switch.engines.optim import AdamWConfig
    from rlhf_switch.models import causal_lm

    params = list(causal_lm(hf_config, 0).parameters())
    for p in params:
        p.grad = torch.randn_like(p)
    opt = AdamWConfig().make(params)

    def step():
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
    return _typical(step, 9) / len(params)


# --- gloo on 2 processes (jobs run on every rank of a LocalWorld) ---------------------------------

def comm_job(sizes: list[int], repeats: int = 7) -> dict:
    import torch.distributed as dist

    rank, out = dist.get_rank(), {}
    for size in sizes:
        x = torch.zeros(size // 4)
        gathered = torch.zeros(2 * (size // 4))

        def ping():
            if rank == 0:
                dist.send(x, 1)
                dist.recv(x, 1)
            else:
                dist.recv(x, 0)
                dist.send(x, 0)

        def gather():
            dist.all_gather_into_tensor(gathered, x)

        def reduce():
            dist.all_reduce(x)

        for name, fn in (("p2p", ping), ("all_gather", gather), ("all_reduce", reduce)):
            dist.barrier()
            t = _typical(fn, repeats)
            out[f"{name}_{size}"] = t / 2 if name == "p2p" else t  # one way of the round trip
    return out


def _link(m: dict, name: str, per_rank_bytes: float) -> Link:
    """Latency from the small message, bandwidth from the large one (its latency share is
    negligible; a difference of the two is not robust on a loaded machine). 2 ranks: one ring
    step; ``per_rank_bytes``: the share of the message a rank moves in that step."""
    small, large = m[f"{name}_{SMALL}"], m[f"{name}_{LARGE}"]
    return Link(bandwidth=LARGE * per_rank_bytes / max(large, 1e-9), latency=small)


def measure_comm() -> dict:
    from rlhf_switch.launch import LocalWorld

    with LocalWorld(2, timeout=300) as world:
        return world.run(comm_job, [SMALL, LARGE])[0]


# --- the training engines' own fixed costs (a micro-run of each real engine on 2 processes) ------

ENGINE_LAYOUTS = (dict(engine="deepspeed", zero_stage=1, dp=2), dict(engine="deepspeed", zero_stage=2, dp=2),
                  dict(engine="deepspeed", zero_stage=3, dp=2), dict(engine="fsdp2", dp=2),
                  dict(engine="torch_tp", tp=2), dict(engine="torch_pp", pp=2))


def engine_job(hf_config: dict, layouts: list[dict], micro: int, seq: int, rows: int, step_rows: int,
               logprob_micro: int | None = None) -> dict:
    """On every rank: build each engine over the 2 ranks and time, as the loop runs them, one
    forward of ``rows`` rows (in micro-batches of ``micro``: the log-prob pass) and one optimizer
    step over ``step_rows`` rows (its micro-batches: one mini-batch) — rank 0's median of 3."""
    from datetime import timedelta

    import torch.distributed as dist

    from rlhf_switch.engines.base import TrainingContext, training_engine
    from rlhf_switch.engines.optim import AdamWConfig
    from rlhf_switch.rl.config import TrainLayout

    torch.set_num_threads(1)
    ranks = tuple(range(dist.get_world_size()))
    out = {}
    for d in layouts:
        layout = TrainLayout(**d)
        # the rank's share: DP splits the rows; TP and PP ranks see all of them
        share = lambda n: max(1, n // layout.dp)  # noqa: E731
        ids = torch.randint(3, 40, (share(rows), seq), generator=torch.Generator().manual_seed(0))
        step_ids = ids[:share(step_rows)]
        m = min(micro, step_ids.shape[0])
        ctx = TrainingContext(hf_config, 0, ranks, AdamWConfig(max_grad_norm=1.0), micro_batch=m,
                              outputs_batch=logprob_micro, seq_len=seq, timeout=timedelta(seconds=300))
        eng = training_engine(layout.engine).build(layout, ctx)

        def forward():
            dist.barrier()
            eng.outputs(ids)

        def step():
            dist.barrier()
            eng.train_step(step_ids, m, lambda o, s: (o.float().mean(), {}))

        out[json.dumps(d, sort_keys=True)] = {"forward": _typical(forward, 3), "step": _typical(step, 3)}
        eng = None  # noqa: F841  (freed before the next engine is built)
    return out


def engine_fixed_costs(w, profile: MachineProfile, layout, forward_s: float, step_s: float) -> tuple[float, float]:
    """(per micro-batch forward, per optimizer step) fixed seconds of an engine on 2 ranks: what
    the profile's other terms leave unexplained of the measured forward over the workload's
    log-prob rows and of one step over a mini-batch, charged as the cost model charges these two
    terms (per micro-batch, forward and backward alike, inside a pipeline's bubble; per step). The
    model is linear in each term: its slope is read off the model itself."""
    import dataclasses

    from rlhf_switch.tune.cost import engine_key, engine_pass

    key = engine_key(layout)
    bare = dataclasses.replace(profile, compute_slots=None, engine_forward_s={}, engine_step_s={})

    def modelled(fwd: float, step: float, train: bool) -> float:
        p = dataclasses.replace(bare, engine_forward_s={key: fwd}, engine_step_s={key: step})
        rows = w.mini_batch if train else w.rollout_batch
        return engine_pass(w, p, layout, 2, rows, train=train, steps=1).total

    f0 = modelled(0.0, 0.0, False)
    fwd = max(0.0, (forward_s - f0) / (modelled(1.0, 0.0, False) - f0))
    s0 = modelled(fwd, 0.0, True)
    return fwd, max(0.0, (step_s - s0) / (modelled(fwd, 1.0, True) - s0))


def engine_costs(w, profile: MachineProfile) -> tuple[dict, dict]:
    """Per engine: the fixed costs of ``engine_fixed_costs`` from a micro-run with ``w``'s shapes
    (its micro-batch, mini-batch and rollout batch, prompt + new tokens)."""
    from rlhf_switch.launch import LocalWorld
    from rlhf_switch.rl.config import TrainLayout
    from rlhf_switch.tune.cost import engine_key

    with LocalWorld(2, timeout=900) as world:
        measured = world.run(engine_job, w.hf_config, [dict(d) for d in ENGINE_LAYOUTS], w.micro_batch, w.seq,
                             w.rollout_batch, w.mini_batch, w.logprob_micro_batch)[0]
    fwd, step = {}, {}
    for d in ENGINE_LAYOUTS:
        layout = TrainLayout(**d)
        m = measured[json.dumps(d, sort_keys=True)]
        key = engine_key(layout)
        fwd[key], step[key] = engine_fixed_costs(w, profile, layout, m["forward"], m["step"])
    return fwd, step


# --- decode ----------------------------------------------------------------------------------------

DECODE_BATCHES = (8, 64)


def _steps(generate, new: int) -> float:
    """Seconds per decode step: (time of ``new`` tokens − time of 1) / (new − 1)."""
    t1 = _typical(lambda: generate(1), 5)
    tn = _typical(lambda: generate(new), 5)
    return max(0.0, (tn - t1) / (new - 1))


def _per_batch(step_at: dict) -> tuple[float, float]:
    """(fixed, per sequence) seconds of a decode step from its time at two batch sizes."""
    (b1, t1), (b2, t2) = sorted(step_at.items())
    per_seq = max(0.0, (t2 - t1) / (b2 - b1))
    return max(0.0, t1 - b1 * per_seq), per_seq


def torch_decode_steps(hf_config: dict, prompt: int = 8, new: int = 17) -> dict[int, float]:
    """Step seconds per batch size, sampled with per-sequence seeds as the loop samples."""
    from rlhf_switch.engines.torch_rollout import TorchRollout
    from rlhf_switch.families import derive_spec

    eng = TorchRollout.from_hf_config(derive_spec(hf_config), hf_config)
    out = {}
    for batch in DECODE_BATCHES:
        prompts = [[1] + [5] * (prompt - 1) for _ in range(batch)]
        out[batch] = _steps(lambda n: eng.generate(prompts, n, temperature=1.0, seed=list(range(batch)),
                                                   eos_token_id=None), new)
    return out


def vllm_decode_steps(hf_config: dict, prompt: int = 8, new: int = 17, timeout: int = 400) -> dict[int, float] | None:
    """One vLLM TP1 engine in a child process (its own environment); None when vLLM is missing or fails."""
    try:
        import importlib.util
        if importlib.util.find_spec("vllm") is None:
            return None
    except ImportError:
        return None
    with tempfile.TemporaryDirectory() as d:
        from rlhf_switch.models import causal_lm

        causal_lm(hf_config, 0).save_pretrained(d)
        code = ("import json,sys; from recipes.tune_calibrate import _vllm_child; "
                f"print('RESULT', json.dumps(_vllm_child({d!r}, {prompt}, {new})))")
        # one thread, as a Ray actor of num_cpus=1 runs it (a 2-thread pool on a shared 2-core
        # machine waits at every barrier)
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                          os.environ.get("PYTHONPATH", "")]))
        try:
            p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired:
            return None
        lines = [line for line in p.stdout.splitlines() if line.startswith("RESULT ")]
        return {int(k): v for k, v in json.loads(lines[-1][7:]).items()} if lines else None


def _vllm_child(model_dir: str, prompt: int, new: int) -> dict[int, float]:
    from rlhf_switch import compat
    from rlhf_switch.engines.vllm_rollout import VLLMRollout
    from rlhf_switch.families import derive_spec

    compat.set_vllm_env_defaults()
    compat.vllm_engine_core_in_this_process()
    hf = json.loads((Path(model_dir) / "config.json").read_text())
    r = VLLMRollout(model_dir, derive_spec(hf), tp=1, max_model_len=64)
    out = {}
    try:
        for batch in DECODE_BATCHES:
            prompts = [[1] + [5] * (prompt - 1) for _ in range(batch)]
            out[batch] = _steps(lambda n: r.generate(prompts, n, greedy=False, seed=list(range(batch)),
                                                     temperature=1.0, eos_token_id=None), new)
        return out
    finally:
        r.shutdown()


# --- the profile -----------------------------------------------------------------------------------

def switch_member_seconds(run_dir: str | Path, profile: MachineProfile) -> tuple[str, float]:
    """(the rollout engine's profile key, seconds) of a switch's fixed cost per sync and channel member — a Ray call
    to every member, the rollout engine's RPC and prefix-cache reset — from a finished
    ``rlhf-switch train`` run: the median of its ``switch_train_to_rollout_s`` (iteration 0, the
    warm-up, left out) less what the profile models for its bytes, over the channel's members."""

    from rlhf_switch.engines.base import rollout_engine
    from rlhf_switch.rl.config import load_config
    from rlhf_switch.tune.cost import channel_members, switch_cost
    from rlhf_switch.tune.workload import Workload

    d = Path(run_dir)
    cfg = load_config(d / "config.yaml")
    recs = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
    syncs = [r["switch_train_to_rollout_s"] for r in recs if "switch_train_to_rollout_s" in r and r.get("iteration", 0) >= 1]
    if not syncs:
        raise ValueError(f"{d / 'metrics.jsonl'}: no switch_train_to_rollout_s after iteration 0")
    import dataclasses

    bytes_only = dataclasses.replace(profile, switch_member_s={})  # the fixed cost is what is sought
    modelled = switch_cost(Workload.from_config(cfg), bytes_only, cfg.train, cfg.rollout).seconds
    members = channel_members(cfg.train, cfg.rollout)
    key = rollout_engine(cfg.rollout.engine).profile_key(cfg.rollout)
    return key, max(0.0, statistics.median(syncs) - modelled) / members


def calibrate(w, with_vllm: bool = True, log=print, switch_runs: tuple = ()) -> MachineProfile:
    """Measure this machine with the workload's model and shapes (a ``Workload``); one thread per
    process, as the loop's workers run. ``switch_runs``: finished run directories whose switch
    timings give each rollout engine's fixed cost per sync and channel member (``switch_member_seconds``)."""
    hf_config = w.hf_config
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        load = os.getloadavg()[0]
        t0 = time.perf_counter()
        f32 = matmul_rate(torch.float32)
        mem = memory_bandwidth()
        overhead = layer_overhead(hf_config, f32)
        opt_tensor = optimizer_tensor_seconds(hf_config)
        log(f"matmul fp32 {f32 / 1e9:.1f} GFLOP/s; memory {mem / 1e9:.1f} GB/s; "
            f"decoder layer call {overhead * 1e3:.2f} ms; "
            f"optimizer {opt_tensor * 1e6:.0f} µs per tensor")
        comm = measure_comm()
        p2p = _link(comm, "p2p", 1.0)
        # the cost model's ring: all-gather of the whole (2×SMALL, 2×LARGE here) tensor moves half
        # of it per rank in one step; all-reduce moves 2·(n−1)/n = 1× its bytes in two steps
        gather = _link(comm, "all_gather", 1.0)
        reduce = _link(comm, "all_reduce", 1.0)
        collective = Link(bandwidth=(gather.bandwidth + reduce.bandwidth) / 2,
                          latency=(gather.latency + reduce.latency / 2) / 2)
        log(f"gloo p2p {p2p.bandwidth / 1e9:.2f} GB/s + {p2p.latency * 1e6:.0f} µs; collectives "
            f"{collective.bandwidth / 1e9:.2f} GB/s + {collective.latency * 1e6:.0f} µs per step")
        w_bytes = _model_bytes(hf_config)
        fixed, per_seq = _per_batch(torch_decode_steps(hf_config))
        decode = {"torch": max(0.0, fixed - w_bytes / mem)}
        decode_seq = {"torch": per_seq}
        log(f"torch rollout decode step {fixed * 1e3:.2f} ms + {per_seq * 1e6:.0f} µs per sequence")
        if with_vllm:
            v = vllm_decode_steps(hf_config)
            if v is not None:
                fixed, per_seq = _per_batch(v)
                decode["vllm"], decode_seq["vllm"] = max(0.0, fixed - w_bytes / mem), per_seq
                log(f"vLLM TP1 decode step {fixed * 1e3:.2f} ms + {per_seq * 1e6:.0f} µs per sequence")
            else:
                log("vLLM: not measured (not installed or failed); its decode uses the torch engine's figure")
        cores = os.cpu_count() or 1
        partial = MachineProfile(
            name="partial", origin="", matmul_flops={"float32": f32}, memory_bandwidth=mem, device_memory=1e12,
            devices_per_node=1 << 16, p2p_intra=p2p, p2p_inter=p2p, collective_intra=collective,
            collective_inter=collective, same_device=p2p, layer_overhead_s=overhead, optimizer_tensor_s=opt_tensor)
        engine_fwd, engine_step = engine_costs(w, partial)
        log("training engines, fixed ms per forward / per optimizer step: " + ", ".join(
            f"{k} {engine_fwd[k] * 1e3:.1f} / {engine_step[k] * 1e3:.1f}" for k in engine_fwd))
        switch_member = {}
        for run in switch_runs:
            engine, member_s = switch_member_seconds(run, partial)
            switch_member[engine] = member_s
            log(f"switch fixed cost per sync and channel member ({engine} rollout, from {run}): {member_s * 1e3:.2f} ms")
        when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        return MachineProfile(
            name="cpu_local",
            origin=f"measured by rlhf-switch tune --calibrate on {when}, {cores} cores, load average {load:.2f} "
                   f"at start, {time.perf_counter() - t0:.0f} s",
            matmul_flops={"float32": f32}, memory_bandwidth=mem,
            device_memory=_host_memory() / max(1, cores), devices_per_node=1 << 16,
            p2p_intra=p2p, p2p_inter=p2p, collective_intra=collective, collective_inter=collective,
            same_device=p2p, compute_slots=cores, layer_overhead_s=overhead, decode_step_overhead_s=decode,
            decode_sequence_s=decode_seq,
            optimizer_tensor_s=opt_tensor, engine_forward_s=engine_fwd, engine_step_s=engine_step,
            switch_member_s=switch_member, sources={"all": "measured (the median of 3-9 repeats), one thread per process, gloo over loopback"})
    finally:
        torch.set_num_threads(threads)


def _model_bytes(hf_config: dict) -> float:
    from rlhf_switch.families import derive_spec
    return derive_spec(hf_config).numel * 4.0


def _host_memory() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 8 << 30
