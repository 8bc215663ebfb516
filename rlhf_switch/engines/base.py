"""The two engine interfaces — a training engine and a rollout engine — and one registry for each.

The loop, the weight channel and the elastic manager talk only to these interfaces. A
config's ``engine:`` names a registered engine (``deepspeed``, ``fsdp2``, ``torch_tp``, ``torch_pp``;
``vllm``, ``torch``) or ``module:Class`` — a user's own engine, imported by name like
``task.reward_fn``, so adding one needs no edit of this package. The pre-start checks
(``rlhf_switch.problems``) ask the engine class which layouts it runs (``layout_problems``)
instead of a hard-coded list.

Training engine (the trainer, the reference and the PPO critic alike — the critic is a training
engine whose model has a value head, ``head="value"``)::

    engine = Engine.build(layout, TrainingContext(...))   # collective over the world; None off its ranks
    engine.adapter                                        # its state as VPS fragments (weights, master, Adam)
    out = engine.outputs(ids)                             # [B, T-1]: log-probs of ids[:, 1:] (lm) or values
    engine.train_step(ids, micro, loss_fn)                # one optimizer step in micro-batches

Rollout engine, placed one of two ways (``placement``):

- ``"worker"``: one instance per rank of the colocated world, a replica's TP ranks sharing a group of
  that world (the small torch engine); its destination buffers are this process's tensors;
- ``"replica"``: one instance per replica, in its own actor, owning its own worker processes
  (vLLM); its workers join the weight channel themselves (``channel_open``/``channel_receive``).

Every engine's layout is data (``rollout_layout``, ``adapter``): the weight channel
(``engines/channel.py``) plans the move from them once and then only moves bytes.
"""
from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, ClassVar, Collection, Iterable, Mapping, Sequence

import torch

from ..device import CPU, DeviceSpec
from ..families import DEFAULT_CONTEXT, context_length
from ..vps.layout import Layout
from ..vps.layouts import ParallelConfig
from ..vps.spec import ModelSpec
from .optim import AdamWConfig

# a micro-batch's loss: (per-token outputs [b, T-1] with autograd, the rows of the step's batch it
# covers) -> (scalar loss already weighted for the step, floats to report)
LossFn = Callable[[torch.Tensor, slice], "tuple[torch.Tensor, dict[str, float]]"]


# the deadline of an engine's process groups and collectives (and of the loop's actors' world)
# unless a caller gives one: long enough for a slow first forward on a loaded CPU, short enough that
# a lost peer is an error within minutes rather than gloo's default half hour
DEFAULT_TIMEOUT = timedelta(seconds=120)


class EngineError(ValueError):
    """An engine name that cannot be resolved, or a class that is not an engine."""


# --- training engines -------------------------------------------------------------------------------

@dataclass(frozen=True)
class TrainingContext:
    """What every training engine is built from (the same on every rank of the world)."""

    hf_config: Mapping[str, Any]
    seed: int
    ranks: tuple[int, ...]            # the world ranks the engine lives on (ascending)
    optim: AdamWConfig = AdamWConfig()
    micro_batch: int = 1              # rows per forward
    outputs_batch: int | None = None  # rows per forward of ``outputs`` (no gradients); None: micro_batch
    seq_len: int = 0                  # the longest sequence it will see (prompt + response); 0: the model's context
    head: str = "lm"                  # "lm" (causal LM) or "value" (scalar value head: the critic)
    init_from: str | None = None      # head "value": an actor checkpoint whose trunk the critic starts from
    timeout: timedelta = DEFAULT_TIMEOUT
    device: DeviceSpec = CPU          # the run's device, backend and dtypes (rlhf_switch.device)
    lora: Any = None                  # a vps.spec.LoraSpec: train LoRA adapters, the base frozen (engines/lora.py)
    lora_dropout: float = 0.0         # LoRA's dropout in training forwards (none in ``outputs``)

    @property
    def context(self) -> int:
        return int(self.seq_len or context_length(self.hf_config))


class TrainingEngine(ABC):
    """One rank of a training engine. Every method is collective over the engine's ranks: call it
    on all of them with the same shapes."""

    name: str                  # e.g. "ZeRO3·DP2", shown in reports and errors
    spec: ModelSpec            # what the VPS knows of its model
    adapter: Any               # a TrainAdapter: its live tensors as VPS fragments
    head: str = "lm"
    dp: int = 1                # data-parallel size; each DP rank takes a contiguous share of a batch
    dp_rank: int = 0
    dp_group: Any = None       # the DP process group (None: DP 1, or the whole world)
    # whether ``train.offload`` may park its state in host memory between phases
    # (``engines/offload.py``): engines whose adapter it is tested with say so
    can_offload: bool = False
    # the compute dtypes it runs beside a float32 master copy (rlhf_switch.device); asked before
    # anything starts (recipes.common.device_problems)
    compute_dtypes: ClassVar[tuple[str, ...]] = ("float32",)
    # whether ``build`` takes ``ctx.lora`` (LoRA adapters on the causal LM, engines/lora.py)
    supports_lora: ClassVar[bool] = False

    @classmethod
    def keeps_small_params_whole(cls, layout: Any) -> bool:
        """Whether ``layout.persistence_threshold`` means something to this engine for ``layout``
        (parameters under it kept whole on every rank between steps: DeepSpeed ZeRO-3's)."""
        return False
    lora_dropout: float = 0.0  # > 0: ``outputs`` runs the model in eval mode (no dropout)

    # --- what it is, for the enumeration and the cost model (rlhf_switch.tune), which ask these
    # instead of comparing engine names. The defaults describe a plain engine: its weights whole on
    # every DP rank (split by TP and PP only), the gradients all-reduced, one optimizer tensor per
    # parameter. A user's engine (``module:Class``) is modelled as one unless it says otherwise.

    # the ``zero_stage`` values it runs (``tune`` enumerates each; DeepSpeed: 1, 2, 3)
    zero_stages: ClassVar[tuple[int, ...]] = (0,)
    # its optimizer steps all its parameters as one flat group (one tensor per step: ZeRO), not
    # one tensor per parameter
    steps_flat_group: ClassVar[bool] = False
    # where its weights are split (``state_shards``), it gathers them to compute and holds a
    # gathered layer (or the whole model, ``gathers_per_call``) beside its shards
    gathers_sharded_weights: ClassVar[bool] = False
    # the key of its fixed costs in a machine profile (``engine_forward_s``, ``engine_step_s``);
    # None: the name the config gives it
    profile_name: ClassVar[str | None] = None

    @classmethod
    def profile_key(cls, layout: Any) -> str:
        """The key of ``layout``'s fixed costs in a machine profile (``deepspeed-z3``, ``fsdp2``, ...)."""
        return cls.profile_name or layout.engine

    @classmethod
    def profile_keys(cls, layout: Any) -> tuple[str, ...]:
        """Every profile key whose fixed costs ``layout`` pays, summed: its own, and those of the
        engines it runs inside itself (a pipeline's stages running DTensor TP)."""
        return (cls.profile_key(layout),)

    @classmethod
    def parallel_config(cls, layout: Any) -> ParallelConfig:
        """Its weights' layout under ``layout`` as its adapter describes them to the weight channel
        (``param`` only): the source of a modelled switch."""
        return ParallelConfig(tp=layout.tp, pp=layout.pp, dp=layout.dp)

    @classmethod
    def shards_parameters(cls, layout: Any) -> bool:
        """Whether ``layout`` splits its parameters over DP (ZeRO-3, FSDP2), gathering them to compute."""
        return cls.parallel_config(layout).dp_shard != "replicate"

    @classmethod
    def state_shards(cls, layout: Any) -> tuple[int, int, int]:
        """Into how many parts ``layout`` splits its (weights, gradients, optimizer state): each
        device holds one part of each."""
        mp = layout.tp * layout.pp
        return mp, mp, mp

    @classmethod
    def gathers_per_call(cls, model_bytes: float) -> bool:
        """Whether its DP-sharded parameters (a model of ``model_bytes``) are gathered once per call
        (an ``outputs`` pass, an optimizer step) rather than for every micro-batch's forward and
        again for its backward."""
        return False

    @classmethod
    def gather_messages(cls, tensors: int, layers: int, head: str, model_bytes: float) -> int:
        """The collectives one gather of its DP-sharded parameters takes (``tensors`` tensors and
        ``layers`` decoder layers on a rank, a model of ``model_bytes``): default one per decoder
        layer and one for the rest."""
        return layers + 1

    @classmethod
    def step_collectives(cls, layout: Any) -> tuple[str, ...]:
        """The collectives over DP, each of all its weights' bytes, that one optimizer step of
        ``layout`` runs when its parameters are whole on every DP rank: default the gradients'
        all-reduce."""
        return ("all_reduce",)

    @classmethod
    def layout_problems(cls, phase: str, layout: Any, dims: Any, head: str = "lm") -> list[str]:
        """Why this engine cannot run ``layout`` (``tp``, ``pp``, ``dp``, ``zero_stage``) for the
        model ``dims`` (an ``rl.config.ModelDims``, or None when unknown) with ``head``: one line
        per reason, prefixed by ``phase``. Pure: checked before anything starts."""
        return []

    @classmethod
    @abstractmethod
    def build(cls, layout: Any, ctx: TrainingContext) -> "TrainingEngine | None":
        """Build the engine over ``ctx.ranks`` (collective over the WORLD: process groups are made
        by every world rank); ``None`` on ranks outside ``ctx.ranks``."""

    @abstractmethod
    def outputs(self, ids: torch.Tensor) -> torch.Tensor:
        """No grad. ``ids [B, T]`` (right-padded; this rank's share) -> ``[B, T-1]`` float32: the
        log-probs of ``ids[:, 1:]`` (head ``lm``) or the values of the states ``ids[:, :t+1]``
        (head ``value``). Micro-batches of ``ctx.outputs_batch`` rows (default ``ctx.micro_batch``)."""

    @abstractmethod
    def train_step(self, ids: torch.Tensor, micro: int, loss_fn: LossFn) -> dict:
        """One optimizer step over ``ids [B, T]`` (this rank's share) in micro-batches of ``micro``
        rows: per micro-batch ``s``, ``loss, stats = loss_fn(outputs with autograd, s)`` and its
        backward (gradients are the sum of the losses, averaged over DP by the engine); then
        clipping, the optimizer and the LR schedule. Returns ``{"grad_norm": float, "stats": [...]}``."""

    def freeze(self) -> None:
        """This engine never steps (the reference): inference mode where the engine has one."""

    # shared by engines whose model is one module called on token ids
    def _per_token(self, out: Any, ids: torch.Tensor) -> torch.Tensor:
        from ..rl.algorithms import logprobs_from_logits

        logits = out.logits if hasattr(out, "logits") else out
        if self.head == "value":
            return logits[:, :-1, 0].float()
        return logprobs_from_logits(logits[:, :-1], ids[:, 1:])


class ModuleEngine(TrainingEngine):
    """A training engine that is one module called on token ids (FSDP2, DTensor TP, DeepSpeed):
    ``outputs`` and ``train_step`` are written once here over ``_forward`` / ``_backward`` /
    ``_optimizer_step``."""

    micro_batch: int = 1
    outputs_batch: int | None = None  # rows per forward of ``outputs``; None: micro_batch

    def _forward(self, ids: torch.Tensor) -> Any:
        return self.module(input_ids=ids, use_cache=False)

    def _backward(self, loss: torch.Tensor, last: bool) -> None:
        loss.backward()

    @abstractmethod
    def _optimizer_step(self) -> float:
        """Clip, step, schedule, zero the gradients; the global gradient norm before clipping."""

    @torch.no_grad()
    def outputs(self, ids: torch.Tensor) -> torch.Tensor:
        m = max(1, self.outputs_batch or self.micro_batch)
        with eval_mode(self.module) if self.lora_dropout else nullcontext():
            return torch.cat([self._per_token(self._forward(ids[i:i + m]), ids[i:i + m])
                              for i in range(0, ids.shape[0], m)])

    def train_step(self, ids: torch.Tensor, micro: int, loss_fn: LossFn) -> dict:
        chunks = [slice(i, min(i + micro, ids.shape[0])) for i in range(0, ids.shape[0], micro)]
        stats = []
        for i, s in enumerate(chunks):
            out = self._per_token(self._forward(ids[s]), ids[s])
            loss, st = loss_fn(out, s)
            self._backward(loss, last=i == len(chunks) - 1)
            stats.append(st)
        return {"grad_norm": self._optimizer_step(), "stats": stats}

    def freeze(self) -> None:
        self.module.eval()


@contextmanager
def eval_mode(module: Any):
    """``module`` in eval mode for the block (LoRA's dropout off: the log-probs the rollout engine,
    which has no dropout, must reproduce), then back to the mode it was in."""
    was = module.training
    module.train(False)
    try:
        yield
    finally:
        module.train(was)


# --- rollout engines --------------------------------------------------------------------------------

@dataclass(frozen=True)
class RolloutContext:
    """What every rollout engine is built from."""

    hf_config: Mapping[str, Any]
    spec: ModelSpec
    model_dir: str                    # a HF checkpoint directory of the starting weights
    tp: int
    replicas: int
    replica: int
    seed: int = 0
    max_model_len: int = DEFAULT_CONTEXT
    tp_rank: int = 0                  # placement "worker": this rank's place in its replica
    group: Any = None                 # placement "worker": the replica's TP group (None at TP 1)
    options: Mapping[str, Any] = field(default_factory=dict)
    device: DeviceSpec = CPU          # the run's device, backend and dtypes (rlhf_switch.device)
    memory_utilization: float = 0.5   # its share of each device's memory (vLLM's gpu_memory_utilization)


def stop_set(eos_token_id: int | None, stop_ids: Iterable[int] = ()) -> list[int]:
    """The ids a response ends at (``RolloutEngine.generate``'s ``stop_ids``): ``stop_ids`` and the
    model's eos (None: no eos), each once, in order."""
    return sorted({int(t) for t in stop_ids} | ({int(eos_token_id)} if eos_token_id is not None else set()))


class RolloutEngine(ABC):
    """One rollout engine: a TP worker (placement ``worker``) or a whole replica (``replica``)."""

    placement: ClassVar[str] = "worker"
    name: str = "rollout"
    compute_dtypes: ClassVar[tuple[str, ...]] = ("float32",)  # as TrainingEngine.compute_dtypes
    # a LoRA run's sync may move only the adapters into it: it keeps the frozen base and applies
    # them itself (``weight_sync("adapters")``); else it takes merged weights (engines/lora.py)
    takes_adapters: ClassVar[bool] = False

    # whether an elastic resize takes it (its layout changed in a running world, or it follows the
    # trainer world's: placement "worker")
    resizable: ClassVar[bool] = False

    # it decodes a batch larger than its KV cache in waves (paged attention and a scheduler: vLLM);
    # else it needs the KV cache of its replica's whole share of the batch at once
    paged_kv: ClassVar[bool] = False
    # the key of its fixed costs in a machine profile (``decode_step_overhead_s``,
    # ``decode_sequence_s``, ``switch_member_s``); None: the name the config gives it
    profile_name: ClassVar[str | None] = None

    # the options ``rollout.options`` may give this engine (handed to ``build`` as ``ctx.options``),
    # each with the values it takes
    options: ClassVar[Mapping[str, tuple]] = {}

    @classmethod
    def layout_problems(cls, phase: str, layout: Any, dims: Any) -> list[str]:
        problems = []
        for key, value in dict(getattr(layout, "options", None) or {}).items():
            if key not in cls.options:
                takes = ", ".join(cls.options) or "none"
                problems.append(f"{phase}.options.{key}: not an option of this engine (it takes: {takes})")
            elif value not in cls.options[key]:
                problems.append(f"{phase}.options.{key}: {value!r} — one of {', '.join(map(str, cls.options[key]))}")
        if layout.pp > 1:
            problems.append(f"{phase}: rollout engines run tensor parallel replicas only; pp={layout.pp} "
                            f"must be 1 (use tp and dp)")
        if layout.zero_stage:
            problems.append(f"{phase}: rollout engines hold whole (TP-sharded) weights; "
                            f"zero_stage={layout.zero_stage} must be 0")
        return problems

    @classmethod
    def profile_key(cls, layout: Any) -> str:
        """The key of ``layout``'s fixed costs in a machine profile."""
        return cls.profile_name or layout.engine

    @classmethod
    def process_env(cls, verbose: bool = False) -> dict[str, str]:
        """Environment variables this engine's processes need when they start (defaults: a user's
        own value in the driver's environment wins). They travel in the run's Ray ``runtime_env``
        (``rlhf_switch.runtime_env``) to every actor on every node. ``verbose``: the engine's own
        INFO logs too."""
        return {}

    @classmethod
    def rollout_layout(cls, spec: ModelSpec, tp: int, replicas: int, dtype: str = "float32") -> Layout:
        """Where every replica's weights live (rank = replica·tp + tp rank): the destination of the
        weight channel. Default: vLLM's per-worker layout."""
        from ..vps.layouts.vllm import vllm_layout

        return vllm_layout(spec, tp, replicas, dtype)

    @classmethod
    @abstractmethod
    def build(cls, ctx: RolloutContext) -> "RolloutEngine":
        ...

    @abstractmethod
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float,
                 seeds: Sequence[int], stop_ids: Collection[int]) -> tuple[list[list[int]], list[list[float]]]:
        """Tokens and their log-probs (raw model distribution) per prompt; ``seeds``: one per
        prompt, so a sample does not depend on the replica or batch it ran in. A response ends
        after its first token in ``stop_ids`` (returned with it: the model's eos, and an agent
        turn's own stop ids such as a tool call's closing token), else after ``max_new_tokens``."""

    # placement "worker": the destination buffers are this process's tensors
    def buffers(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError(f"{type(self).__name__} has no local buffers (placement {self.placement!r})")

    def weights_updated(self) -> None:
        """After the channel wrote new weights: drop anything computed with the old ones."""

    def weight_sync(self, mode: str) -> None:
        """What every later sync writes (``engines.lora.WeightSync.mode``): ``full`` or ``merged``
        into its weights, ``adapters`` into its adapter buffers (``takes_adapters`` engines)."""
        if mode == "adapters" and not self.takes_adapters:
            raise ValueError(f"{type(self).__name__} does not take LoRA adapters; sync merged weights")

    # placement "replica": the engine's own workers join the channel
    def channel_destination(self, layout: "Any") -> "Any":
        """``layout`` (the rollout layout of what a sync moves, every replica's) as this engine's
        workers must be written — e.g. vLLM layers it keeps in a processed form in that form
        (``engines/vllm_processed.py``). Default: as it is."""
        return layout

    def channel_open(self, endpoint: "Any") -> None:
        raise NotImplementedError(f"{type(self).__name__} does not join a channel itself (placement {self.placement!r})")

    def channel_receive(self) -> list[dict]:
        raise NotImplementedError

    def channel_close(self) -> None:
        pass

    def channel_stats(self) -> list[dict]:
        return []

    # where the platform has it (vLLM on GPU): free weights and KV cache between rollouts
    def sleep(self) -> bool:
        return False

    def wake_up(self) -> bool:
        return False

    def shutdown(self) -> None:
        pass


# --- registries -------------------------------------------------------------------------------------

# built-in engines by name -> "module:Class" (imported on first use: naming an engine must not
# import DeepSpeed or vLLM)
_TRAINING: dict[str, str | type] = {
    "fsdp2": "rlhf_switch.engines.torch_engines:FSDP2Engine",
    "torch_tp": "rlhf_switch.engines.torch_engines:TorchTPEngine",
    "torch_pp": "rlhf_switch.engines.torch_engines:TorchPPEngine",
    "deepspeed": "rlhf_switch.engines.deepspeed_engine:DeepSpeedEngine",
}
_ROLLOUT: dict[str, str | type] = {
    "torch": "rlhf_switch.engines.torch_rollout:TorchRolloutEngine",
    "vllm": "rlhf_switch.engines.vllm_rollout:VLLMRolloutEngine",
}


def training_engine_names() -> list[str]:
    return sorted(_TRAINING)


def rollout_engine_names() -> list[str]:
    return sorted(_ROLLOUT)


def _import(path: str, kind: str) -> type:
    module, _, attr = path.partition(":")
    if not module or not attr:
        raise EngineError(f"{kind} engine {path!r}: expected a registered name or 'module:Class'")
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise EngineError(f"{kind} engine {path!r}: cannot import {module!r}: {e}") from None
    try:
        return getattr(mod, attr)
    except AttributeError:
        raise EngineError(f"{kind} engine {path!r}: module {module!r} has no {attr!r}") from None


def _resolve(name: str, table: dict, base: type, kind: str) -> type:
    entry = table.get(name)
    if entry is None and ":" not in name:
        raise EngineError(f"unknown {kind} engine {name!r} (registered: {', '.join(sorted(table))}; "
                          f"or give your own as 'module:Class')")
    cls = _import(entry if isinstance(entry, str) else name, kind) if not isinstance(entry, type) else entry
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise EngineError(f"{kind} engine {name!r} is {cls!r}, not a subclass of "
                          f"rlhf_switch.engines.base.{base.__name__}")
    return cls


def training_engine(name: str) -> type[TrainingEngine]:
    """The training-engine class a config's ``engine:`` names (registered name or ``module:Class``)."""
    return _resolve(name, _TRAINING, TrainingEngine, "training")


def rollout_engine(name: str) -> type[RolloutEngine]:
    """The rollout-engine class a config's ``engine:`` names (registered name or ``module:Class``)."""
    return _resolve(name, _ROLLOUT, RolloutEngine, "rollout")


def phase_engine_problems(phase: str, layout, dims) -> list[str]:
    """Why ``phase``'s engine (resolved through the registry) cannot run ``layout`` for the model
    ``dims``: the engine's own ``layout_problems``, or the name it could not resolve. The one check
    the loop's pre-start checks and ``tune``'s enumeration both ask."""
    try:
        if phase == "rollout":
            return rollout_engine(layout.engine).layout_problems(phase, layout, dims)
        head = "value" if phase == "critic" else "lm"
        cls = training_engine(layout.engine)
        problems = cls.layout_problems(phase, layout, dims, head=head)
        if getattr(layout, "persistence_threshold", 0) and not cls.keeps_small_params_whole(layout):
            problems.append(f"{phase}.persistence_threshold: {layout.persistence_threshold} — engine {layout.engine} with "
                            f"zero_stage {layout.zero_stage} keeps no small parameters whole (DeepSpeed ZeRO-3's "
                            f"stage3_param_persistence_threshold)")
        return problems
    except EngineError as e:
        return [f"{phase}.engine: {e}"]