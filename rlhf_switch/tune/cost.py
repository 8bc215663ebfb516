"""Seconds per phase of one iteration, from a workload, a combination of layouts and a machine
profile. Named ``cost`` (not ``time``) so it never shadows the standard library.

- **compute**: FLOPs (2 per multiplied parameter per token, ×3 with the backward) over the
  profile's matmul rate, per device; a pipeline's bubble as GPipe's ``(m + pp − 1) / m``; a fixed
  cost per decoder-layer call (what a GPU hides, what a CPU pays in Python and kernel starts);
  the optimizer step: its bytes over memory bandwidth plus a fixed cost per tensor (DeepSpeed
  steps one flat group, the torch engines loop over their tensors).
- **engine communication** (no overlap with compute assumed): ZeRO-3 / FSDP2 all-gather the
  weights for every micro-batch's forward and again for its backward, and reduce-scatter the
  gradients (one message per tensor for DeepSpeed, per decoder layer for FSDP2); ZeRO-1/2
  all-reduce / reduce-scatter the gradients and all-gather the weights once per optimizer step;
  TP all-reduces the activations twice per layer forward and twice per backward; PP sends the
  activations across each stage boundary. Ring collectives: ``(n − 1)/n`` of the bytes per rank
  (all-reduce twice that), ``n − 1`` latency steps; the link is intra-node when the group fits in
  a node.
- **decode** per replica: each step reads the replica's weights (/tp) and KV cache from memory or
  multiplies them, whichever is slower, plus TP all-reduces and the engine's fixed cost per step;
  a batch larger than vLLM's KV cache runs in waves (``memory``).
- **switch**: the planner's own per-rank plan (``vps.plan_rank``) of the trainer's layout into
  the rollout engine's (placed on separate ranks when the engine runs its own workers, as the
  weight channel places them): per rank, over its peers (one per round), the larger of sent and
  received bytes over that link with one message per staging chunk, plus local copies; the
  slowest rank of a sample (the layouts stay lazy: ``vps.placement.place_lazy``, so a 235B move
  on 1024 ranks plans in seconds and a few GB, as ``bench/plan_scale.py`` does); plus the
  profile's fixed cost per sync and channel member of the rollout engine (``switch_member_s``:
  Ray calls, the engine's RPC and prefix-cache reset), times the channel's members.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..engines.base import rollout_engine, training_engine
from ..rl.config import PhaseLayout
from ..vps import build_layout, plan_rank
from ..vps.layout import Layout
from ..vps.placement import place_lazy
from .enumerate import Combination
from .memory import STAGING_BYTES, MemoryEstimate, _shards
from .profile import Link, MachineProfile
from .workload import Workload

SAMPLED_RANKS = 4  # above 2× this many ranks of the move, the switch is planned for a sample of ranks
# A DP-sharded trainer (ZeRO-3, FSDP2) holds a slice of every tensor on every rank: one rank's plan
# asks every rank class for its slice (dp × tensors fragments: 37 M for a 235B MoE on 1024 ranks,
# GBs). Above this many, the switch of such a pair is the closed form of that plan (``_sharded_switch``).
PLANNED_SHARD_FRAGMENTS = 2_000_000


def ring_link(profile: MachineProfile, size: int, stride: int, kind: str = "collective") -> Link:
    intra = size * stride <= profile.devices_per_node
    if kind == "p2p":
        return profile.p2p_intra if intra else profile.p2p_inter
    return profile.collective_intra if intra else profile.collective_inter


def ring_seconds(link: Link, nbytes: float, n: int, op: str, calls: float = 1) -> float:
    """``calls`` collectives of ``nbytes`` (the full tensor) over ``n`` ranks."""
    if n <= 1 or calls <= 0:
        return 0.0
    factor = 2 if op == "all_reduce" else 1
    return calls * factor * ((n - 1) / n * nbytes / link.bandwidth + (n - 1) * link.latency)


@dataclass(frozen=True)
class PassCost:
    compute: float
    comm: float

    @property
    def total(self) -> float:
        return self.compute + self.comm


def engine_key(layout: PhaseLayout) -> str:
    """The profile's key of a training engine's fixed costs: ``deepspeed-z3``, ``fsdp2``, ..."""
    return training_engine(layout.engine).profile_key(layout)


def engine_pass(w: Workload, profile: MachineProfile, layout: PhaseLayout, world: int, sequences: int,
                train: bool, steps: int = 1, head: str = "lm") -> PassCost:
    """Forward (``train`` False) or forward+backward+optimizer over ``sequences`` sequences
    (in ``steps`` optimizer steps) of one training engine's layout."""
    d, b = w.dims, w.bytes_per_param
    tp, pp, dp = layout.tp, layout.pp, layout.dp
    engine = training_engine(layout.engine)
    per_rank = sequences / dp
    micro = max(1, min(w.micro_batch, w.mini_batch // dp))
    if not train and pp == 1 and w.logprob_micro_batch:  # (a pipeline's buffers are sized for micro_batch)
        micro = max(1, min(w.logprob_micro_batch, math.ceil(per_rank)))
    n_micro = math.ceil(per_rank / micro)
    slow = profile.slowdown(world)
    mult = 3 if train else 1
    flops = w.forward_flops_per_token() * w.seq * per_rank * mult / (tp * pp)
    layers = math.ceil(d.num_layers / pp)
    compute = flops / profile.flops(w.dtype) * slow + n_micro * layers * mult * profile.layer_overhead_s * slow
    costs = [profile.engine_costs(key) for key in engine.profile_keys(layout)]
    fwd_fixed, step_fixed = sum(c[0] for c in costs), sum(c[1] for c in costs)
    compute += (n_micro * fwd_fixed * mult + (steps * step_fixed if train else 0.0)) * slow
    if pp > 1:  # GPipe: the stages idle for pp - 1 micro-batch slots
        per_step_micro = max(1, n_micro // max(1, steps))
        compute *= (per_step_micro + pp - 1) / per_step_micro
    params = w.params(head)
    weights = params * b / (tp * pp)
    if train:  # the optimizer: AdamW reads param, grad and two moments and writes three (fp32)
        _, _, opt_shards = _shards(layout)
        tensors = 1 if engine.steps_flat_group else math.ceil(len(w.spec.tensors) / pp)
        compute += steps * (tensors * profile.optimizer_tensor_s * slow
                            + params / opt_shards * 28 / profile.memory_bandwidth * slow)
    dp_link = ring_link(profile, dp, tp)
    comm = 0.0
    if dp > 1 and engine.shards_parameters(layout):
        msgs = engine.gather_messages(len(w.spec.tensors), layers, head, params * b)
        if engine.gathers_per_call(params * b):
            gathers = steps if train else 1
        else:
            gathers = n_micro * (2 if train else 1)
        comm += _gather_cost(dp_link, weights, dp, gathers, msgs)
        if train:
            comm += _gather_cost(dp_link, weights, dp, n_micro, msgs)  # reduce-scatter of the gradients
    elif dp > 1 and train:
        comm += sum(ring_seconds(dp_link, weights, dp, op, steps) for op in engine.step_collectives(layout))
    if tp > 1:
        act = micro * w.seq * d.hidden_size * b
        comm += ring_seconds(ring_link(profile, tp, 1), act, tp, "all_reduce", n_micro * layers * 2 * (2 if train else 1))
    if pp > 1:
        act = micro * w.seq * d.hidden_size * b
        link = ring_link(profile, 2, dp * tp, "p2p")
        comm += n_micro * (pp - 1) * (2 if train else 1) * link.seconds(act)
    return PassCost(compute, comm)


def _gather_cost(link: Link, nbytes: float, n: int, calls: int, msgs: int) -> float:
    """``calls`` gathers of all ``nbytes`` in ``msgs`` collectives each (bytes once, latency per message)."""
    return calls * ((n - 1) / n * nbytes / link.bandwidth + msgs * (n - 1) * link.latency)


def decode_seconds(w: Workload, profile: MachineProfile, layout: PhaseLayout, world: int,
                   concurrent: int | None = None) -> float:
    """Prefill of the prompts and ``new_tokens`` decode steps of the slowest replica, in waves
    of ``concurrent`` sequences (what its KV cache holds; default: the whole share at once)."""
    share = math.ceil(w.rollout_batch / layout.dp)
    batch = min(share, concurrent or share)
    return math.ceil(share / batch) * _wave_seconds(w, profile, layout, world, batch)


def _wave_seconds(w: Workload, profile: MachineProfile, layout: PhaseLayout, world: int, batch: int) -> float:
    d, b = w.dims, w.bytes_per_param
    tp = layout.tp
    slow = profile.slowdown(world)
    rate, mem = profile.flops(w.dtype) / slow, profile.memory_bandwidth / slow
    weight_bytes = w.params() * b / tp
    overhead = profile.decode_overhead(rollout_engine(layout.engine).profile_key(layout), batch) * slow
    tp_link = ring_link(profile, tp, 1)
    prefill = 2 * w.matmul_params * batch * w.prompt_tokens / tp / rate + weight_bytes / mem + overhead
    kv_heads = max(1, d.num_kv_heads // tp)
    total = prefill + ring_seconds(tp_link, batch * w.prompt_tokens * d.hidden_size * b, tp, "all_reduce", 2 * d.num_layers)
    for step in range(w.new_tokens):
        ctx = w.prompt_tokens + step
        kv = batch * ctx * d.num_layers * 2 * kv_heads * w.head_dim * b
        step_s = max(weight_bytes / mem, 2 * w.matmul_params * batch / tp / rate) + kv / mem + overhead
        step_s += ring_seconds(tp_link, batch * d.hidden_size * b, tp, "all_reduce", 2 * d.num_layers)
        total += step_s
    return total


# ----------------------------------------------------------------------------- the switch


def train_layout(w: Workload, layout: PhaseLayout) -> Layout:
    """The trainer's weights as the engines describe them to the channel (``param`` only)."""
    return build_layout(w.spec, training_engine(layout.engine).parallel_config(layout))


@dataclass(frozen=True)
class SwitchCost:
    seconds: float        # the slowest planned rank's
    rank_bytes: int       # the most bytes one planned rank sends or receives (the planner's)
    messages: int         # the slowest rank's messages (one per staging chunk per peer)
    ranks_planned: int


def switch_cost(w: Workload, profile: MachineProfile, train: PhaseLayout, rollout: PhaseLayout) -> SwitchCost:
    n = train.size
    cls = rollout_engine(rollout.engine)
    if (cls.placement == "replica" and _dp_sharded(train) and train.tp == train.pp == 1
            and train.dp * len(w.spec.tensors) > PLANNED_SHARD_FRAGMENTS):
        return _sharded_switch(w, profile, train, rollout)
    src = train_layout(w, train)
    dst = cls.rollout_layout(w.spec, rollout.tp, rollout.dp, w.dtype)
    if cls.placement == "replica":  # the engine's workers are other processes on the same devices
        # lazily: one rank's plan builds only the rank classes it meets (a 235B move on 1024 ranks)
        src, dst, world, per_node = place_lazy(src, range(n), 2 * n), place_lazy(dst, range(n, 2 * n), 2 * n), 2 * n, None
    else:
        world, per_node = n, profile.devices_per_node
    device = (lambda r: r % n)
    if world <= 2 * SAMPLED_RANKS:
        ranks = list(range(world))
    else:  # first and last of each side (sender classes repeat along DP; a 235B plan is GBs per rank)
        ranks = sorted({0, n - 1} | ({n, 2 * n - 1} if world > n else {n // 2}))
    worst, most = SwitchCost(0.0, 0, 0, len(ranks)), 0
    for r in ranks:
        p = plan_rank(src, dst, r, per_node)
        most = max(most, p.bytes_sent, p.bytes_received)
        peers: dict[int, list[int]] = {}
        for t in p.sends:
            peers.setdefault(t.dst, [0, 0])[0] += t.nbytes
        for t in p.recvs:
            peers.setdefault(t.src, [0, 0])[1] += t.nbytes
        seconds, msgs = 0.0, 0
        budget = STAGING_BYTES // 2
        for peer, (sent, got) in peers.items():
            nbytes = max(sent, got)
            chunks = max(1, math.ceil(nbytes / budget))
            if device(peer) == device(r):
                link = profile.same_device
            elif device(peer) // profile.devices_per_node == device(r) // profile.devices_per_node:
                link = profile.p2p_intra
            else:
                link = profile.p2p_inter
            seconds += link.seconds(nbytes, chunks)
            msgs += chunks
        seconds += p.bytes_local / profile.same_device.bandwidth
        if seconds > worst.seconds:
            worst = SwitchCost(seconds, 0, msgs, len(ranks))
    plan_rank.cache_clear()  # the plans are summarised above; at 235B × 1024 ranks each is large
    # every rank agrees on the plan's digest before a byte moves (one small gather)
    agree = ring_seconds(ring_link(profile, world, 1), 32 * world, world, "all_gather")
    fixed = switch_fixed_seconds(profile, train, rollout)
    return SwitchCost(worst.seconds + agree + fixed, most, worst.messages, worst.ranks_planned)


def channel_members(train: PhaseLayout, rollout: PhaseLayout) -> int:
    """Members of the weight channel: the trainer's ranks, plus the rollout engine's workers when
    they are processes of their own (placement ``replica``: one per trainer device)."""
    return train.size * (2 if rollout_engine(rollout.engine).placement == "replica" else 1)


def switch_fixed_seconds(profile: MachineProfile, train: PhaseLayout, rollout: PhaseLayout) -> float:
    """A sync's cost beyond its bytes — a Ray call to every member, the engine's RPC, the cache
    reset — at the profile's measured seconds per member."""
    key = rollout_engine(rollout.engine).profile_key(rollout)
    return profile.switch_member_s.get(key, 0.0) * channel_members(train, rollout)


def _dp_sharded(layout: PhaseLayout) -> bool:
    return training_engine(layout.engine).shards_parameters(layout)


def _sharded_switch(w: Workload, profile: MachineProfile, train: PhaseLayout, rollout: PhaseLayout) -> SwitchCost:
    """The plan of a DP-sharded trainer (``n`` ranks, no TP/PP) into rollout workers on the same
    ``n`` devices, in closed form: every trainer rank holds 1/n of every tensor, which each rollout
    worker needs 1/tp of, so each trainer rank sends every worker (and each worker receives from
    every trainer rank) ``bytes / n / tp`` — n peers a side, one on its own device, the rest of its
    node intra-node, the others across nodes. Tested against the planner on small worlds."""
    n, tp = train.size, rollout.tp
    per_peer = w.params() * w.bytes_per_param / n / tp
    chunks = max(1, math.ceil(per_peer / (STAGING_BYTES // 2)))
    node = min(n, profile.devices_per_node)
    seconds = (profile.same_device.seconds(per_peer, chunks) + (node - 1) * profile.p2p_intra.seconds(per_peer, chunks)
               + (n - node) * profile.p2p_inter.seconds(per_peer, chunks))
    agree = ring_seconds(ring_link(profile, 2 * n, 1), 32 * 2 * n, 2 * n, "all_gather")
    fixed = switch_fixed_seconds(profile, train, rollout)
    return SwitchCost(seconds + agree + fixed, int(per_peer * n), n * chunks, 0)


# ----------------------------------------------------------------------------- one iteration


PHASE_COLUMNS = ("switch", "rollout", "logprob", "update")


def iteration_seconds(w: Workload, profile: MachineProfile, combo: Combination,
                      switch: SwitchCost | None = None, memory: MemoryEstimate | None = None) -> dict[str, float]:
    """Seconds per phase: ``switch`` (train → rollout; nothing moves back), ``rollout`` (generate),
    ``logprob`` (old log-probs on the trainer, reference log-probs, PPO values) and ``update``
    (the policy's and the critic's optimizer steps); ``total`` their sum."""
    world = combo.train.size
    B = w.rollout_batch
    steps = w.epochs * B // w.mini_batch
    logprob = engine_pass(w, profile, combo.train, world, B, train=False).total
    if combo.reference is not None:
        logprob += engine_pass(w, profile, combo.reference, world, B, train=False).total
    update = engine_pass(w, profile, combo.train, world, w.epochs * B, train=True, steps=steps).total
    if combo.critic is not None:
        logprob += engine_pass(w, profile, combo.critic, world, B, train=False, head="value").total
        update += engine_pass(w, profile, combo.critic, world, w.epochs * B, train=True, steps=steps, head="value").total
    switch = switch or switch_cost(w, profile, combo.train, combo.rollout)
    concurrent = memory.concurrent_sequences if memory is not None else None
    out = {"switch": switch.seconds, "rollout": decode_seconds(w, profile, combo.rollout, world, concurrent),
           "logprob": logprob, "update": update}
    out["total"] = sum(out[k] for k in PHASE_COLUMNS)
    return out
