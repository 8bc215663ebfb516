"""Memory per device, per phase: what a layout keeps resident and what a phase adds on top.

Per training engine (trainer, critic; the reference keeps weights only), with ``P`` the model's
parameters, ``b`` the bytes of its dtype and the shards each layout makes:

| engine | weights | gradients | fp32 master + Adam (4 + 8 B/param) |
|---|---|---|---|
| deepspeed ZeRO-1 | P·b | P·b | /dp |
| deepspeed ZeRO-2 | P·b | /dp | /dp |
| deepspeed ZeRO-3, fsdp2 | /dp (+ one layer gathered; fsdp2 of a model ≤ 1 GiB: + all of it) | /dp | /dp |
| torch_tp (TP×FSDP2) | /tp/dp | /tp/dp | /tp/dp |
| torch_pp | /pp/tp (largest stage) | same | same |

The fp32 master is 0 when the model trains in float32 (the weights are the master). Activations:
one micro-batch's forward saved for backward, ~18·b bytes per token per hidden unit per local
layer (attention, MLP and norms inputs, no recomputation) plus the fp32 logits (twice: log-softmax
and its gradient), split by TP. The rollout phase holds its weights (/tp) and a KV cache at full
sequence length: the small torch engine batches its replica's whole share of the rollout batch
at once; vLLM (paged attention, a scheduler) fills the memory left with as many sequences as fit
and decodes the rest in further waves, refusing only when not one sequence fits. vLLM sleeps
during training where the platform has it (GPU), so the peak is the resident training state plus
the larger of the two phases' working sets, plus the switch's staging budget. No engine here offloads to the host, so
nothing is modelled as moved away.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..engines.base import rollout_engine, training_engine
from ..rl.config import PhaseLayout
from .enumerate import Combination
from .workload import Workload

STAGING_BYTES = 2 * (64 << 20)  # the executor's default budget (routing.executor.DEFAULT_BUDGET), send + receive
ADAM_BYTES = 8                  # exp_avg + exp_avg_sq, fp32
MASTER_BYTES = 4


def _shards(layout: PhaseLayout) -> tuple[float, float, float]:
    """(weights, gradients, optimizer state) divisors of one layout: what its engine says."""
    return training_engine(layout.engine).state_shards(layout)


def _stage_share(w: Workload, layout: PhaseLayout) -> float:
    """The largest pipeline stage's share of the parameters (stage 0 also holds the embeddings)."""
    if layout.pp == 1:
        return 1.0
    per_layer, total = w.layer_params(), w.params()
    layers = -(-w.dims.num_layers // layout.pp)
    rest = total - per_layer * w.dims.num_layers  # embeddings, head, final norm
    return min(1.0, (per_layer * layers + rest / 2) / total) * layout.pp


def train_state_bytes(w: Workload, layout: PhaseLayout, head: str = "lm", trains: bool = True) -> float:
    """Resident bytes per device of a training engine (``trains=False``: the reference, weights only)."""
    p, b = w.params(head) * _stage_share(w, layout), w.bytes_per_param
    engine = training_engine(layout.engine)
    ws, gs, os_ = _shards(layout)
    weights = p * b / ws
    if ws > 1 and engine.gathers_sharded_weights and engine.gathers_per_call(w.params(head) * b):
        weights += p * b / (layout.tp * layout.pp)  # a small model is held gathered for a whole call
    elif ws > 1 and engine.gathers_sharded_weights:
        weights += w.layer_params() * b / (layout.tp * layout.pp) * 2  # a gathered layer (+ the prefetched one)
    if not trains:
        return weights
    master = 0 if w.dtype == "float32" else MASTER_BYTES
    return weights + p * b / gs + p * (master + ADAM_BYTES) / os_


def activation_bytes(w: Workload, layout: PhaseLayout) -> float:
    d = w.dims
    micro = min(w.micro_batch, max(1, w.mini_batch // layout.dp))
    tokens = micro * w.seq
    layers = -(-d.num_layers // layout.pp)
    hidden = tokens * d.hidden_size * layers * 18 * w.bytes_per_param / layout.tp
    logits = tokens * d.vocab_size * 4 * 2 / layout.tp
    return hidden + logits


def rollout_bytes(w: Workload, layout: PhaseLayout) -> dict[str, float]:
    """Per worker: ``weights``, ``kv_cache`` of its replica's whole share of the rollout batch,
    ``kv_per_sequence`` (one sequence at full length) and ``sequences`` (that share)."""
    d = w.dims
    per_replica = -(-w.rollout_batch // layout.dp)
    kv_heads = max(1, d.num_kv_heads // layout.tp)  # vLLM replicates KV heads when TP exceeds them
    per_seq = w.seq * d.num_layers * 2 * kv_heads * w.head_dim * w.bytes_per_param
    return {"weights": w.params() * w.bytes_per_param / layout.tp, "kv_cache": per_replica * per_seq,
            "kv_per_sequence": per_seq, "sequences": per_replica}


def rollout_need(w: Workload, layout: PhaseLayout) -> float:
    """The least a rollout layout needs per device: weights and one sequence's KV cache (paged
    engines) or the whole batch's."""
    rb = rollout_bytes(w, layout)
    return rb["weights"] + (rb["kv_per_sequence"] if rollout_engine(layout.engine).paged_kv else rb["kv_cache"])


@dataclass(frozen=True)
class MemoryEstimate:
    train_state: float
    reference: float
    critic: float
    activations: float
    rollout_weights: float
    kv_cache: float
    staging: float
    concurrent_sequences: int = 0   # per replica, decoded at once (paged engines: what the KV cache holds)
    sequences: int = 0              # per replica in all

    @property
    def rollout_waves(self) -> int:
        return -(-self.sequences // self.concurrent_sequences) if self.concurrent_sequences else 0

    @property
    def resident(self) -> float:
        return self.train_state + self.reference + self.critic

    @property
    def peak(self) -> float:
        return self.resident + max(self.activations, self.rollout_weights + self.kv_cache) + self.staging


def estimate_memory(w: Workload, combo: Combination, device_memory: float = float("inf")) -> MemoryEstimate:
    """Per device. A paged rollout engine's KV cache is what ``device_memory`` leaves beside the
    resident state, its weights and the staging budget, up to the whole batch (at least one
    sequence: below that the peak exceeds the device and the combination is refused)."""
    ro = rollout_bytes(w, combo.rollout)
    acts = activation_bytes(w, combo.train)
    critic = 0.0
    if combo.critic is not None:
        critic = train_state_bytes(w, combo.critic, head="value")
        acts = max(acts, activation_bytes(w, combo.critic))
    train = train_state_bytes(w, combo.train)
    ref = train_state_bytes(w, combo.reference, trains=False) if combo.reference is not None else 0.0
    n, per_seq = int(ro["sequences"]), ro["kv_per_sequence"]
    concurrent = n
    if rollout_engine(combo.rollout.engine).paged_kv:
        free = device_memory - (train + ref + critic + ro["weights"] + STAGING_BYTES)
        concurrent = max(1, min(n, int(free // per_seq))) if free < float("inf") else n
    return MemoryEstimate(train_state=train, reference=ref, critic=critic, activations=acts,
                          rollout_weights=ro["weights"], kv_cache=concurrent * per_seq, staging=STAGING_BYTES,
                          concurrent_sequences=concurrent, sequences=n)
