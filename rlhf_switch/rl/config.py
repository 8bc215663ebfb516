"""The run config: typed (pydantic v2), strict, and checked against the world before anything starts.

One YAML file per run (see ``configs/``)::

    world_size: 2                  # devices every phase is colocated on (logical ones on CPU)
    device: auto                   # auto | cpu | cuda (rlhf_switch.device: backend, dtypes)
    model: {hf_config: {...}}      # a tiny LlamaConfig as a dict, or {path: dir with config.json}
    train:     {engine: deepspeed, zero_stage: 3, dp: 2}   # offload: none | optimizer | all
    rollout:   {engine: vllm, tp: 2}
    reference: {engine: deepspeed, zero_stage: 3, dp: 2}
    critic:    {...}               # PPO only
    task:      {name: addition, max_len: 2}   # generated prompts, or instead:
    data:      {train_files: [train.jsonl], heldout_files: [test.jsonl], chat_template: true}
    algorithm: {name: grpo, group_size: 8, ...}

``load_config(path_or_dict)`` returns a ``RunConfig`` or raises one ``ConfigError`` listing every
bad field by its path (``train.zero_stage: ...``); an unknown field is an error (typos must not
be silently ignored), with the closest known name suggested. The models here keep each field's
type and range, a block's one-of choices (a model's source, the prompts' source) and old spellings
normalised; every rule across fields or blocks — an algorithm's paper, every phase's layout covers
the world and divides the model and the batch, the tokenizer fits the model, the engines run their
layouts, the elastic schedule, the reward function runs — is a pre-start check
(``rlhf_switch.problems.check_run``), again with one error listing every problem. ``ConfigError``
comes from here and from there only.

Layout rule: each phase spans the whole world: ``tp·pp·dp == world_size`` for ``train``,
``rollout``, ``reference`` and ``critic`` alike — all colocated on the same devices, unless
``rollout.colocate: false`` gives the rollout replicas as many devices of their own.
"""
from __future__ import annotations

import difflib
import json
import os
import typing
from dataclasses import dataclass
from pathlib import Path
import re
from typing import Annotated, Any, ClassVar, Literal, Mapping

import yaml
from pydantic import (BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, create_model, field_validator,
                      model_validator)

from ..families import context_length
from .choices import ALGORITHM_DEFAULTS, ALGORITHMS, POLICY_LOSSES, Aggregation, KLEstimator, off_paper, shown
from .estimators import ESTIMATORS, estimator_class
from .estimators import all_fields as all_estimator_fields
from .rewards import DEFAULT_MATH_REWARD, DEFAULT_REWARDS, parse_reward_spec
from .tasks import CharTokenizer, build_task, longest_prompt_tokens

# an engine is a registered name (training: deepspeed, fsdp2, torch_tp, torch_pp; rollout: vllm,
# torch) or "module:Class" — a user's own engine. Which names exist and which layouts each engine
# runs is the engines' registry's to say (rlhf_switch.engines.base), asked before anything starts
# (rlhf_switch.problems); here only the form is checked, so loading a config imports no engine.
EngineName = Annotated[str, Field(min_length=1, pattern=r"^[A-Za-z_][\w.]*(:[A-Za-z_]\w*)?$")]
# a user's own class or function, imported by name: "package.module:Name"
USER_CLASS = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
PHASES = ("train", "rollout", "reference", "critic")
LoggingBackend = Literal["tensorboard", "wandb", "mlflow"]  # recipes/run_log.py BACKENDS


class ConfigError(ValueError):
    """A config that cannot run: ``problems`` lists each reason, the message shows them all."""

    def __init__(self, header: str, problems: list[str]):
        self.problems = list(problems)
        super().__init__(header + "".join(f"\n  - {p}" for p in self.problems))


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class PhaseLayout(Strict):
    """How one phase spreads over the world: ZeRO stage (DeepSpeed only), tensor, pipeline and
    data parallel sizes."""

    zero_stage: int = Field(0, ge=0, le=3)
    tp: int = Field(1, ge=1)
    pp: int = Field(1, ge=1)
    dp: int = Field(1, ge=1)

    @property
    def size(self) -> int:
        return self.tp * self.pp * self.dp


class TrainLayout(PhaseLayout):
    """A phase that runs forward (and backward) in a training engine: train, reference, critic.
    ``persistence_threshold`` (DeepSpeed ZeRO-3 only): parameters of fewer elements stay whole on
    every rank between steps instead of being fetched and released around each submodule
    (DeepSpeed's ``stage3_param_persistence_threshold``; ``engines/deepspeed_zero.py``); 0: every
    parameter partitioned — what ZeRO-3 is for on a model that does not fit whole."""

    engine: EngineName
    persistence_threshold: int = Field(0, ge=0)



class TrainerLayout(TrainLayout):
    """The ``train`` block: the policy's training engine, and what of its state leaves the device
    while the rollout engine generates (``engines/offload.py``): ``none``; ``optimizer`` — the
    Adam moments and the fp32 master where the engine keeps one apart from its weights, into host
    memory after the weight sync and back before the update; ``all`` — its weights too."""

    offload: Literal["none", "optimizer", "all"] = "none"


class RolloutLayout(PhaseLayout):
    engine: EngineName
    # how the weight channel hands the trainer's weights to the rollout workers
    # (engines/channel.py): p2p = over the channel's group; ipc = the colocated handoff (a
    # trainer rank on each worker's device hands it shared buckets by handle: CUDA IPC / shared
    # memory); auto = ipc where every worker has a trainer rank on its device, else p2p
    handoff: Literal["auto", "p2p", "ipc"] = "p2p"
    # the rollout engine shares its devices with the trainer (one placement-group bundle per
    # device, both actors on it); false: its own devices (engines of placement "replica" only).
    # The config may say it as ``mode: colocated | disaggregated`` instead
    colocate: bool = True
    # how a generation's prompts go to the replicas (engines of placement "replica"): 0 — one
    # contiguous share each, sent at once; N > 0 — work stealing: chunks of N prompts, each replica
    # given the next one as soon as it returns one (recipes/cluster/replicas.py)
    pull_prompts: int = Field(0, ge=0)
    # vLLM's share of each device's memory (weights + KV cache); None: 0.5 colocated, 0.9 alone
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    # the engine's own options, handed to it as they are (the engine says which it takes: vllm's
    # cpu_kernels: plain | vllm and processed_weights: auto | loader | refuse, docs/weight-channel.md)
    options: dict[str, Any] = {}

    @model_validator(mode="before")
    @classmethod
    def _mode(cls, data: Any) -> Any:
        """``mode: colocated | disaggregated`` is ``colocate: true | false`` (one of them)."""
        if not isinstance(data, Mapping) or "mode" not in data:
            return data
        data = dict(data)
        mode = data.pop("mode")
        if mode not in ("colocated", "disaggregated"):
            raise ValueError(f"mode: {mode!r} — colocated (the trainer's devices) or disaggregated (devices of "
                             f"its own)")
        if "colocate" in data and data["colocate"] != (mode == "colocated"):
            raise ValueError(f"mode: {mode} and colocate: {data['colocate']} disagree; give one of them")
        data["colocate"] = mode == "colocated"
        return data

    @property
    def mode(self) -> str:
        return "colocated" if self.colocate else "disaggregated"

    @property
    def memory_utilization(self) -> float:
        """``gpu_memory_utilization``, or its default for this placement."""
        if self.gpu_memory_utilization is not None:
            return self.gpu_memory_utilization
        return 0.5 if self.colocate else 0.9


class RewardModelConfig(TrainLayout):
    """``reward:`` a learned reward model beside the rule reward (docs/reward-models.md):
    ``model_path`` is a HF directory of the family's value model — ``…ForTokenClassification``
    with one label (what ``rlhf-switch rm`` writes) or ``…ForSequenceClassification`` (no bias) —
    whose tokenizer is the policy's. It runs in a training engine of its own layout (``engine``,
    ``zero_stage``, ``tp``, ``pp``, ``dp`` as the phase blocks; engines with value heads: fsdp2,
    deepspeed), frozen like the reference, and scores every rollout at the last token of prompt +
    response. The reward the algorithm gets is ``rule_weight · rule reward + model_weight · model
    score``; ``micro_batch_size``: sequences per forward (default: the log-prob passes')."""

    model_path: str = Field(min_length=1)
    rule_weight: float = 1.0
    model_weight: float = 1.0
    micro_batch_size: int | None = Field(None, ge=1)


# the attention and MLP projections of every family (peft's names for Llama-shaped models)
DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraConfig(Strict):
    """LoRA on the actor (docs/lora.md): the training engine trains rank-``r`` adapters on the
    ``target_modules`` of every decoder layer (peft's ``LoraConfig``: ``lora_alpha`` = ``alpha``,
    ``lora_dropout`` = ``dropout``) and freezes the base; the reference is the base. ``sync``:
    what the weight channel moves into the rollout engine — ``adapters`` (A and B; the rollout
    engine applies them beside its own copy of the base), ``merged`` (the adapted weights
    ``W + (alpha/r)·B·A``), or ``auto``: whichever is fewer bytes among those the rollout engine
    takes."""

    r: int = Field(8, ge=1)
    alpha: float = Field(16.0, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] = Field(default_factory=lambda: list(DEFAULT_LORA_TARGETS), min_length=1)
    sync: Literal["auto", "adapters", "merged"] = "auto"

    def spec(self):
        """The adapters as the VPS describes them (``vps.spec.LoraSpec``)."""
        from ..vps.spec import LoraSpec

        return LoraSpec(self.r, float(self.alpha), tuple(self.target_modules))


class ModelConfig(Strict):
    """The actor's architecture: ``hf_config`` (an HF config as a dict, its ``model_type`` one of
    ``families.FAMILIES``, Llama when absent; the reference and the critic's trunk share it) or
    ``path`` (a local directory with ``config.json``, and for ``data:`` runs the tokenizer unless
    ``tokenizer`` names another directory)."""

    hf_config: dict[str, Any] | None = None
    path: str | None = None
    tokenizer: str | None = None  # a data: run's tokenizer directory; default: path
    # the compute dtype (the forward/backward and the rollout engine); the optimizer's master copy
    # and moments stay float32. None: the device's default (rlhf_switch.device: bfloat16 on cuda,
    # float32 on cpu)
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    lora: LoraConfig | None = None  # the actor trains LoRA adapters on this model (docs/lora.md)

    @field_validator("hf_config")
    @classmethod
    def _has_dims(cls, cfg: dict[str, Any] | None) -> dict[str, Any] | None:
        if cfg is None:
            return cfg
        missing = [k for k in ModelDims.REQUIRED if k not in cfg]
        if missing:
            raise ValueError(f"missing {', '.join(missing)}")
        bad = [f"{k}={cfg[k]!r}" for k in ModelDims.REQUIRED + ModelDims.OPTIONAL
               if k in cfg and cfg[k] is not None and not (isinstance(cfg[k], int) and cfg[k] > 0)]
        if bad:
            raise ValueError(f"must be positive integers: {', '.join(bad)}")
        return cfg

    @model_validator(mode="after")
    def _one_source(self) -> "ModelConfig":
        if (self.hf_config is None) == (self.path is None):
            raise ValueError("model: give exactly one of hf_config (a dict) or path (a directory)")
        return self

    def hf_dict(self) -> dict[str, Any]:
        """The model's HF config fields (its ``model_type`` names the family): the inline dict, or
        ``path``'s ``config.json`` read as JSON (nothing downloaded, transformers not imported)."""
        if self.hf_config is not None:
            return dict(self.hf_config)
        config_json = Path(self.path) / "config.json"
        if not config_json.is_file():
            raise ConfigError("model", [f"model.path: no config.json at {config_json}"])
        return json.loads(config_json.read_text())


class TaskConfig(Strict):
    """A generated task (``rlhf_switch.rl.tasks``). Its own ``seed`` (not the run's) fixes the
    prompts, so runs with different seeds are evaluated on the same held-out set."""

    # calc and guess are the agent tasks (rlhf_switch.agent): run them with an ``agent`` block
    name: Literal["addition", "sorting", "reversal", "calc", "guess"]
    min_len: int = Field(1, ge=1)
    max_len: int = Field(3, ge=1)
    # P(length n) ∝ exp(-length_skew·(n-min_len)/(max_len-min_len)): 0 = uniform; > 0 = mostly
    # short with a tail to max_len. Sampled spaces only: a small one is listed whole (tasks.py)
    length_skew: float = Field(0.0, ge=0, allow_inf_nan=False)
    num_train: int = Field(2000, ge=1)
    num_heldout: int = Field(200, ge=1)
    seed: int = 0
    reward_fn: str | None = None  # "module:function"; None -> the task's exact match
    # where it runs (rlhf_switch.reward_workers): 0 = the driver's process; N = N worker processes,
    # whose calls the timeout stops; None = 0 for the shipped rewards, 1 for any other function
    reward_workers: int | None = Field(None, ge=0)
    reward_timeout_s: float = Field(60.0, gt=0)  # the longest one call of it may take

    @field_validator("reward_fn")
    @classmethod
    def _reward_spec_shape(cls, spec: str | None) -> str | None:
        if spec is not None:
            parse_reward_spec(spec)
        return spec

    @model_validator(mode="after")
    def _resolve(self) -> "TaskConfig":
        if self.reward_fn is None:
            # written back so a saved config names the reward it actually ran with
            self.__dict__["reward_fn"] = DEFAULT_REWARDS[self.name]
        return self


class DataConfig(Strict):
    """Prompts and answers from files (``rlhf_switch.rl.data``), the alternative to ``task``:
    ``.jsonl``, ``.json`` or ``.parquet`` files with a string ``prompt_key`` and ``answer_key``
    per record. Prompts are rendered with the tokenizer's chat template when ``chat_template``;
    those longer than ``max_prompt_tokens`` (and than the context minus ``max_new_tokens``) are
    dropped and counted. ``num_heldout`` caps the held-out prompts (the first ones, in file order)."""

    train_files: list[str] = Field(min_length=1)
    heldout_files: list[str] = Field(min_length=1)
    prompt_key: str = Field("question", min_length=1)
    answer_key: str = Field("answer", min_length=1)
    chat_template: bool = False
    max_prompt_tokens: int | None = Field(None, ge=1)
    num_heldout: int | None = Field(None, ge=1)
    reward_fn: str = DEFAULT_MATH_REWARD  # "module:function"
    reward_workers: int | None = Field(None, ge=0)  # as in TaskConfig
    reward_timeout_s: float = Field(60.0, gt=0)

    @field_validator("reward_fn")
    @classmethod
    def _reward_spec_shape(cls, spec: str) -> str:
        parse_reward_spec(spec)
        return spec


class OffPolicy(Strict):
    """``algorithm.off_policy``: train on samples generated with weights up to ``max_staleness``
    updates old, and correct the update for the rollout engine's policy. 1: one-step off-policy —
    rollout replicas of their own devices (``rollout.mode: disaggregated``) generate the next batch
    while the trainer trains on this one, the weights synced between their requests; each sample
    records the weight version it was generated with (the replica's own count, checked against
    what the driver expects). 0: the synchronous loop (bit for bit, with ``correction: none``).

    ``correction`` of the update for the gap between the policy that generated a sample (the
    rollout engine: older weights, and another implementation of the same ones — the
    train-inference mismatch) and the trainer's, with ``ρ = π_train/π_rollout``
    (``rl.algorithms.off_policy_weights``): ``tis`` — each token's loss times ``min(ρ_t, cap)``
    (truncated importance sampling, Yao et al. 2025); ``icepop`` — ``ρ_t`` inside ``[low,
    high]``, 0 outside (the token leaves the loss; IcePop, inclusionAI 2025); ``seq_tis`` —
    ``min(ρ_seq, cap)`` on every token of the sequence, ``ρ_seq = Π_t ρ_t``; ``seq_mask`` —
    ``ρ_seq`` inside ``[low, high]``, else the whole sequence leaves the loss (masked IS);
    ``none``. Default: ``tis`` with a batch in flight (``max_staleness: 1``), ``none`` without.
    ``correct``: which tokens — ``all`` (the papers' and verl's: every token, the mismatch of fresh
    samples too) or ``stale`` (only tokens generated with older weights than the trainer's).

    ``segment_tokens`` K > 0: partial rollout — the batch in flight is generated K tokens at a
    time while the trainer trains; the update landing interrupts it, and its unfinished samples
    continue with the new weights after the next sync (each token records the version it was
    generated with); in an agent run each model turn is generated K tokens a call (a sync may land
    between two: ``agent.workflow``). 0: each sample in one request."""

    max_staleness: int = Field(1, ge=0)
    correction: Literal["tis", "icepop", "seq_tis", "seq_mask", "none"] | None = None
    correct: Literal["all", "stale"] = "all"
    cap: float = Field(2.0, gt=0)
    low: float = Field(0.5, gt=0)
    high: float = Field(5.0, gt=0)
    segment_tokens: int = Field(0, ge=0)

    # the names these fields had when only tis and icepop existed (configs and run directories of that time)
    OLD_NAMES: ClassVar[dict[str, str]] = {"tis_cap": "cap", "icepop_low": "low", "icepop_high": "high"}

    @model_validator(mode="before")
    @classmethod
    def _old_names(cls, data: Any) -> Any:
        if not isinstance(data, Mapping) or not any(k in data for k in cls.OLD_NAMES):
            return data
        data = dict(data)
        for old, new in cls.OLD_NAMES.items():
            if old in data:
                if new in data:
                    raise ValueError(f"{old} and {new} are one setting ({old} is its old name); give {new} only")
                data[new] = data.pop(old)
        return data

    @model_validator(mode="after")
    def _default_correction(self) -> "OffPolicy":
        if self.correction is None:  # written back, so a saved config names the correction it ran with
            self.__dict__["correction"] = "tis" if self.max_staleness else "none"
        return self



class AlgorithmBase(Strict):
    """What GRPO and PPO share. Per iteration: ``prompts_per_iteration`` prompts, ``group_size``
    samples each (the rollout batch), then ``epochs`` passes over it in optimizer steps of
    ``mini_batch_size`` sequences (default: the whole rollout batch, one step), each split over
    the train DP ranks and run ``micro_batch_size`` sequences per forward. The passes without
    gradients before the update (the old and the reference log-probs, PPO's values) run
    ``logprob_micro_batch_size`` sequences per forward (default: ``micro_batch_size``; they hold no
    activations for a backward, so a larger batch costs little memory and saves per-forward work —
    each of DeepSpeed ZeRO-3's forwards gathers every layer). ``iterations`` is the
    run's total (iterations 0 .. iterations-1), which a resumed run finishes."""

    iterations: int = Field(20, ge=1)
    prompts_per_iteration: int = Field(8, ge=1)
    mini_batch_size: int | None = Field(None, ge=1)
    micro_batch_size: int = Field(1, ge=1)
    logprob_micro_batch_size: int | None = Field(None, ge=1)
    epochs: int = Field(1, ge=1)
    lr: float = Field(1e-5, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float | None = Field(1.0, gt=0)
    clip_eps: float = Field(0.2, gt=0, le=1)
    clip_eps_high: float | None = Field(None, gt=0)
    loss_aggregation: Aggregation = "token-mean"
    # PPO's dual clip c > 1 (Ye et al. 2020; verl's clip_ratio_c = 3): where A < 0 a token's loss is
    # at most -c·A. None: off (the PPO paper's)
    dual_clip: float | None = Field(None, gt=1)
    kl_coef: float = Field(0.0, ge=0)
    # every per-token KL estimate clamped to ±this (verl's bound on k3, low_var_kl): one token the
    # reference finds unlikely cannot dominate the loss or the reward. None: unclamped
    kl_clamp: float | None = Field(10.0, gt=0)
    max_new_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    off_policy: OffPolicy | None = None

    @property
    def max_staleness(self) -> int:
        """How many updates old a sample may be: ``off_policy.max_staleness``, 0 without it."""
        return self.off_policy.max_staleness if self.off_policy is not None else 0

    @property
    def rollout_batch_size(self) -> int:
        return self.prompts_per_iteration * self.group_size

    @property
    def train_batch_size(self) -> int:
        return self.mini_batch_size or self.rollout_batch_size


class DynamicSampling(Strict):
    """DAPO's dynamic sampling (Yu et al. 2025): a group whose samples all got the same reward
    carries no signal for a group estimator, so it is dropped and more prompts are drawn (their own
    seeded stream, so a run stays a function of its seed) until the batch holds
    ``prompts_per_iteration`` groups with signal — at most ``max_draws`` extra rounds. Still short
    then: the batch is filled with dropped groups (zero advantage), and the record says how many."""

    max_draws: int = Field(4, ge=1)
    # which reward a group must differ in: the reward (the reward function's — DAPO's accuracy — or
    # the combined rule and model reward) before any shaping, as DAPO filters; or the shaped one
    # (after the overlong punishment)
    filter_on: Literal["reward", "shaped"] = "reward"


class Overlong(Strict):
    """DAPO's handling of responses at the length limit (``max_new_tokens``): ``buffer_len``
    (None: a quarter of ``max_new_tokens``) — the soft punishment, a penalty falling linearly from 0
    to ``-penalty`` over the last ``buffer_len`` tokens, added to the reward (``penalty: 0``: off);
    ``mask_truncated`` — a response cut at the limit without its end token adds nothing to the loss
    (overlong filtering)."""

    buffer_len: int | None = Field(None, ge=1)
    penalty: float = Field(1.0, ge=0)
    mask_truncated: bool = False


class AlgorithmFields(AlgorithmBase):
    """The ``algorithm`` block's fields every algorithm has. ``name``: a registered algorithm
    (``rl.choices.ALGORITHMS``: its estimator and policy loss) or a user's ``module:Class`` (a
    subclass of ``rl.algorithm.Algorithm``); each algorithm's defaults come from its paper
    (``rl.choices.ALGORITHM_DEFAULTS``), a field given in the config is used as given (the paper's
    range is checked before the run: ``rl.algorithm_rules``). ``advantage`` and ``policy_loss``
    replace the algorithm's pieces by a registered name or ``module:Name``. ``dynamic_sampling``
    and ``overlong``: DAPO's options, usable with any group estimator. ``AlgorithmConfig`` adds the
    fields the registered estimators declare (``rl.estimators``); a user's estimator may declare
    fields of its own, which the block then takes too."""

    model_config = ConfigDict(extra="allow", validate_assignment=True)

    name: str
    advantage: str | None = None
    policy_loss: str | None = None
    group_size: int = Field(8, ge=1)
    kl_coef: float = Field(0.001, ge=0)
    kl_estimator: KLEstimator = "k3"
    dynamic_sampling: DynamicSampling | None = None
    overlong: Overlong | None = None
    # fields whose value leaves the algorithm's paper on purpose (rl.choices.PAPER_RULES): used as
    # given, with a note at start, instead of refused
    off_paper: list[str] = []

    @model_validator(mode="before")
    @classmethod
    def _algorithm_defaults(cls, data: Any) -> Any:
        """The algorithm's paper defaults under the config's fields, and a user estimator's own
        fields (its declared defaults, checked against its declared types); any other field the
        block does not know is refused, the closest known name suggested."""
        if not isinstance(data, Mapping):
            return data
        data = {**ALGORITHM_DEFAULTS.get(data.get("name"), {}), **data}
        own = _user_estimator_fields(data)
        known = set(cls.model_fields) | set(own)
        unknown = sorted(k for k in data if k not in known)
        if unknown:
            raise ValueError("\n".join(_unknown_field(f"algorithm.{k}", k, sorted(known), "algorithm") for k in unknown))
        for field, (kind, info) in own.items():
            value = data.get(field, info.get_default(call_default_factory=True))
            try:
                data[field] = TypeAdapter(Annotated[kind, info]).validate_python(value)
            except ValidationError as e:
                raise ValueError(f"algorithm.{field}: {e.errors(include_url=False)[0]['msg']} (got {_shorten(value)})") \
                    from None
        return data

    @field_validator("name")
    @classmethod
    def _known_or_user_class(cls, name: str) -> str:
        if name in ALGORITHMS or USER_CLASS.match(name):
            return name
        close = difflib.get_close_matches(name, tuple(ALGORITHMS), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown algorithm {name!r}{hint} (known: {', '.join(ALGORITHMS)}; or your own as "
                         f"'module:Class')")

    @field_validator("advantage", "policy_loss")
    @classmethod
    def _piece_form(cls, piece: str | None, info) -> str | None:
        known = tuple(ESTIMATORS) if info.field_name == "advantage" else POLICY_LOSSES
        if piece is None or piece in known or USER_CLASS.match(piece):
            return piece
        raise ValueError(f"unknown {info.field_name.replace('_', ' ')} {piece!r} (known: {', '.join(known)}; "
                         f"or your own as 'module:Name')")

    @model_validator(mode="after")
    def _resolve(self) -> "AlgorithmFields":
        if self.overlong is not None and self.overlong.buffer_len is None:  # written back: a saved config says it
            self.overlong.__dict__["buffer_len"] = max(1, self.max_new_tokens // 4)
        return self

    @property
    def estimator(self) -> str:
        """The advantage estimator's name: ``advantage``, else the algorithm's (a user's
        ``Algorithm`` subclass starts from GRPO's)."""
        return self.advantage or ALGORITHMS.get(self.name, ALGORITHMS["grpo"])[0]

    def values(self) -> dict[str, Any]:
        """Every field's value, a user estimator's own fields too."""
        return {**{f: getattr(self, f) for f in type(self).model_fields}, **(self.model_extra or {})}

    def off_paper_notes(self) -> list[str]:
        """One line per field ``off_paper`` keeps outside the algorithm's paper (said at start)."""
        return [f"algorithm.{rule.field}: {shown(value)} — {self.name}'s paper has {rule.paper}; kept, as "
                f"algorithm.off_paper says" for rule, value in off_paper(self.name, self.values())]


def _user_estimator_fields(data: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """The fields a user's estimator (``advantage: module:Class``) declares beyond the block's
    (none where it does not import: the algorithm check says why)."""
    advantage = data.get("advantage")
    if not (isinstance(advantage, str) and USER_CLASS.match(advantage)):
        return {}
    try:
        cls = estimator_class(advantage)
    except ValueError:
        return {}
    return {k: v for k, v in cls.fields_read().items() if k not in AlgorithmConfig.model_fields}


# the block: the shared fields and every registered estimator's declared ones (rl.estimators)
AlgorithmConfig = create_model("AlgorithmConfig", __base__=AlgorithmFields, __module__=__name__,
                               **all_estimator_fields())


class SftConfig(Strict):
    """The supervised warm start on the task's train split (prompt → answer + ``<eos>``)."""

    steps: int = Field(200, ge=0)
    lr: float = Field(1e-3, gt=0)
    batch_size: int = Field(32, ge=1)


class CheckpointConfig(Strict):
    """``save_every`` iterations (0: only at the end) the trainer's whole state is written to
    ``<output_dir>/checkpoints/step_<N>`` (a HF checkpoint + Adam moments + step), keeping the last
    ``keep``; the final actor always goes to ``<output_dir>/final``."""

    save_every: int = Field(0, ge=0)
    keep: int = Field(2, ge=1)


class EvalConfig(Strict):
    """Greedy decoding of the first ``num_prompts`` held-out prompts with the rollout engine,
    scored by the task's reward, before iteration 0, every ``every`` iterations and at the end
    (``every: 0``: before and at the end only). ``split: all``: the first ``num_prompts`` of the
    held-out prompts followed by the train ones (a task whose prompts are all alike, such as the
    guessing game's, where held-out only means not trained on)."""

    every: int = Field(0, ge=0)
    num_prompts: int = Field(64, ge=1)
    split: Literal["heldout", "all"] = "heldout"

    def samples(self, splits) -> list:
        """The samples evaluated, of ``splits`` (``rl.tasks.Splits``)."""
        pool = list(splits.heldout) + (list(splits.train) if self.split == "all" else [])
        return pool[: self.num_prompts]


class ElasticEntry(Strict):
    """One planned resize (``elastic.schedule``): from iteration ``iteration`` on, the run uses
    ``world_size`` devices and these layouts (the phase blocks' form); the new world is built in
    the background during the iteration before it (recipes/loop.py)."""

    iteration: int = Field(ge=1)
    world_size: int = Field(ge=1)
    train: TrainerLayout
    rollout: RolloutLayout
    reference: TrainLayout | None = None
    critic: TrainLayout | None = None  # PPO: given exactly when the run has a critic


class ElasticConfig(Strict):
    schedule: list[ElasticEntry] = []
    # host: every trainer rank's state also kept in host memory by a buddy rank (another node's
    # where placement allows), refreshed at each train -> rollout boundary; a lost trainer is
    # restored from those copies without a checkpoint (rlhf_switch/elastic/recovery.py)
    redundancy: Literal["none", "host"] = "none"
    # what the loop does when Ray reports a node added or lost (polled at every iteration
    # boundary, rlhf_switch/elastic/nodes.py): record it as an event, or also turn a node added
    # into a resize request to the devices now available (layouts scaled along DP; the request's
    # checks apply). A node lost is recorded; its trainers are redundancy: host's job (restored
    # onto the devices left, layouts scaled along DP, when theirs went with the node)
    on_node_change: Literal["record", "resize"] = "record"
    # update: the rollout replicas' devices (rollout.mode: disaggregated) join the trainer world for
    # the log-probs and the update of every iteration — a second trainer world over both, its layouts
    # scaled along DP, the state moved into it and back (recipes/elastic/rebalance.py); auto: only in the
    # iterations where that last took less time than training alone (measured both ways); off: not
    rebalance: Literal["off", "update", "auto"] = "off"
    # the other way — rollout: the trainer's devices (idle while the synchronous loop waits for
    # samples) generate too: replicas lent them (rollout.mode: disaggregated; as many as the
    # replicas of their own, beside the trainer ranks) take a share of every rollout's prompts;
    # auto: only in the iterations where that last took less time (measured both ways); off: not
    lend: Literal["off", "rollout", "auto"] = "off"


class EnvPoolConfig(Strict):
    """Where an agent run's environments run (``rlhf_switch.agent.config.build_pool``): Ray worker
    actors, or this process (``in_process``)."""

    num_workers: int = Field(2, ge=1)
    num_cpus: float = Field(0.25, gt=0)
    timeout_s: float = Field(30.0, gt=0)
    start_timeout_s: float = Field(120.0, gt=0)
    max_concurrency: int = Field(32, ge=1)
    in_process: bool = False


class AgentConfig(Strict):
    """Multi-turn rollouts (``rlhf_switch.agent``; docs/agents.md): each sample an episode with the
    environment ``env`` (a registered name or ``module:Class``: whether it imports is a pre-start
    check, so loading a config imports no environment)."""

    env: str = Field(min_length=1)
    env_kwargs: dict = Field(default_factory=dict)
    max_turns: int = Field(..., ge=1)
    max_total_tokens: int | None = Field(None, ge=1)  # null: the run's algorithm.max_new_tokens
    max_turn_tokens: int | None = Field(None, ge=1)
    failed_samples: Literal["zero", "exclude"] = "zero"
    # how the episodes' turns are batched for the engines (agent.workflow): rounds (every episode
    # still running waiting for the model; batches independent of timing) or continuous (whenever
    # no batch is generating: no episode waits for another's environment call)
    turn_batching: Literal["rounds", "continuous"] = "rounds"
    # with data.chat_template (a chat model, agent.chat): the role an observation's message has
    # (user, or tool for templates that render tool results)
    observation_role: str = Field("user", min_length=1)
    # with data.chat_template: the system message before each prompt (null: the template's default);
    # the environment's tools (its class's chat_tools) are declared in the same first turn
    system: str | None = None
    pool: EnvPoolConfig = Field(default_factory=EnvPoolConfig)


class RunConfig(Strict):
    world_size: int = Field(ge=1)
    # where every engine computes (rlhf_switch.device): auto = cuda when the actors see a GPU
    device: Literal["auto", "cpu", "cuda"] = "auto"
    seed: int = 0
    output_dir: str = "runs/default"
    ray_address: str | None = None  # None: an embedded Ray (address="local"), never a stale cluster
    # how the placement group's bundles (one per logical device) go onto Ray's nodes: pack (fill a
    # node first; one node when it fits) or spread (across nodes). Either way a rollout replica's
    # tp devices stay on one node (recipes/cluster.py)
    placement: Literal["pack", "spread"] = "pack"
    # where each metrics record also goes (recipes/run_log.py): tensorboard (<output_dir>/tensorboard),
    # wandb (the wandb extra; WANDB_* settings), mlflow (the mlflow extra; MLFLOW_TRACKING_URI, else
    # <output_dir>/mlflow.db). The old `tensorboard: true|false` is read as [tensorboard] | []
    logging: list[LoggingBackend] = ["tensorboard"]
    checkpoint: CheckpointConfig = CheckpointConfig()
    eval: EvalConfig = EvalConfig()
    model: ModelConfig
    train: TrainerLayout
    rollout: RolloutLayout
    reference: TrainLayout | None = None
    critic: TrainLayout | None = None
    task: TaskConfig | None = None  # exactly one of task (generated prompts) and data (files)
    data: DataConfig | None = None
    algorithm: AlgorithmConfig
    sft: SftConfig | None = None
    # checksums of every weight sync's bytes (routing/verify.py): off, sample (verify_fraction of
    # each rank pair's pieces, a different draw every sync) or full; a corrupted piece fails the sync
    verify: Literal["off", "sample", "full"] = "off"
    verify_fraction: float = Field(0.1, gt=0, le=1)
    elastic: ElasticConfig | None = None  # planned resizes of the run's world (rlhf_switch/elastic)
    reward: RewardModelConfig | None = None  # a learned reward model (docs/reward-models.md)
    # multi-turn rollouts: each sample an episode with an environment (docs/agents.md); absent: one
    # prompt, one completion
    agent: AgentConfig | None = None

    @model_validator(mode="before")
    @classmethod
    def _old_tensorboard_switch(cls, data: Any) -> Any:
        """``tensorboard: true|false`` (before ``logging``; every run directory's config.yaml of
        that time has it) is ``logging: [tensorboard]`` or ``logging: []``."""
        if not isinstance(data, Mapping) or "tensorboard" not in data:
            return data
        data = dict(data)
        old = data.pop("tensorboard")
        if "logging" in data:
            raise ValueError("tensorboard: the old switch, beside logging — give logging only "
                             "(logging: [tensorboard] or logging: [])")
        if not isinstance(old, bool):
            raise ValueError(f"tensorboard: {old!r} — the old switch is true or false; write logging: [tensorboard] "
                             f"or logging: []")
        data["logging"] = ["tensorboard"] if old else []
        return data

    @field_validator("logging")
    @classmethod
    def _each_backend_once(cls, backends: list[str]) -> list[str]:
        twice = sorted({b for b in backends if backends.count(b) > 1})
        if twice:
            raise ValueError(f"{', '.join(twice)} named more than once")
        return backends

    def at_iteration(self, iteration: int) -> "RunConfig":
        """The config in force at ``iteration``: the last ``elastic.schedule`` entry at or before
        it applied (world size and layouts), else this one. Its own schedule is dropped."""
        entries = [e for e in (self.elastic.schedule if self.elastic else []) if e.iteration <= iteration]
        update: dict[str, Any] = {"elastic": None}
        if entries:
            e = entries[-1]
            update.update(world_size=e.world_size, train=e.train, rollout=e.rollout, reference=e.reference,
                          critic=e.critic)
        return self.model_copy(update=update)

    @model_validator(mode="after")
    def _one_prompt_source(self) -> "RunConfig":
        if (self.task is None) == (self.data is None):
            raise ValueError("task/data: give exactly one of task (generated prompts) or data (prompt files)")
        return self

    def phases(self) -> dict[str, PhaseLayout]:
        """The layouts this run uses, by phase name."""
        return {p: getattr(self, p) for p in PHASES if getattr(self, p) is not None}

    @property
    def prompt_source(self) -> str:
        """``"task"`` or ``"data"``: the block the prompts (and the reward) come from."""
        return "task" if self.task is not None else "data"

    @property
    def reward_fn(self) -> str:
        """The reward function's ``module:function``, from ``task`` or ``data``."""
        return (self.task or self.data).reward_fn

    @property
    def reward_workers(self) -> int | None:
        """The reward function's worker processes (``task`` or ``data``; None: its default)."""
        return (self.task or self.data).reward_workers

    @property
    def reward_timeout_s(self) -> float:
        """The longest one call of the reward function may take (``task`` or ``data``)."""
        return (self.task or self.data).reward_timeout_s


# ---------------------------------------------------------------- loading and error messages


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation may hold (through Optional, Union, Annotated)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def _tag_of(model: type[BaseModel]) -> Any:
    """The union tag a model is chosen by: its ``TAG``, else its ``name`` field's one literal."""
    if getattr(model, "TAG", None):
        return model.TAG
    field = model.model_fields.get("name")
    args = typing.get_args(field.annotation) if field is not None else ()
    return args[0] if len(args) == 1 else None


def _walk(loc: tuple, root: type[BaseModel] | None = None) -> tuple[str, list[type[BaseModel]]]:
    """A pydantic error location as the user wrote it (``algorithm.gamma``, without pydantic's
    union tag ``grpo``), and the model(s) found at its end (``root``: the config's top model,
    ``RunConfig`` unless another)."""
    shown: list[str] = []
    models: list[type[BaseModel]] = [root or RunConfig]
    for part in loc:
        variant = [m for m in models if len(models) > 1 and _tag_of(m) == part]
        if variant:
            models = variant
            continue
        if isinstance(part, int):
            shown.append(f"[{part}]")
            models = []
            continue
        shown.append(f".{part}" if shown else str(part))
        fields = [m.model_fields[part] for m in models if part in m.model_fields]
        models = _models_in(fields[0].annotation) if fields else []
    return "".join(shown), models


def _shorten(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _unknown_field(path: str, key: str, known: list[str], parent_path: str) -> str:
    """``path: unknown field in <parent>; did you mean 'x'? (known: ...)``."""
    close = difflib.get_close_matches(key, known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    where = f" in {parent_path}" if parent_path else ""
    return f"{path}: unknown field{where}{hint} (known: {', '.join(known)})"


def _format_error(err: Mapping[str, Any], root: type[BaseModel] | None = None) -> list[str]:
    loc = tuple(err["loc"])
    kind = err["type"]
    if kind == "extra_forbidden":
        path, _ = _walk(loc, root)
        parent_path, parents = _walk(loc[:-1], root)
        return [_unknown_field(path, str(loc[-1]), sorted({f for m in parents for f in m.model_fields}), parent_path)]
    path, models = _walk(loc, root)
    if kind == "value_error":
        # our own validators: one problem per line, most already starting with their field's path
        lines = str(err["ctx"]["error"]).split("\n")
        return [line if not path or line.startswith((f"{path}:", f"{path}.")) else f"{path}: {line}" for line in lines]
    if kind in ("union_tag_not_found", "union_tag_invalid"):
        tags = [str(_tag_of(m)) for m in models]
        got = "" if kind == "union_tag_not_found" else f" (got {_shorten(err['ctx'].get('tag'))})"
        return [f"{path}: name must be one of {', '.join(tags)}{got}"]
    got = "" if kind == "missing" else f" (got {_shorten(err.get('input'))})"
    return [f"{path or '(top level)'}: {err['msg']}{got}"]


def format_validation_error(error: ValidationError, root: type[BaseModel] | None = None) -> list[str]:
    """One line per bad field, ``path: what is wrong (got value)`` (``root``: the config's top
    model, ``RunConfig`` unless another)."""
    return [line for err in error.errors(include_url=False) for line in _format_error(err, root)]


def _read_yaml(path: Path) -> Any:
    if not path.is_file():
        raise ConfigError(f"config {path}", [f"no such file: {path}"])
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"config {path}", [f"not valid YAML: {e}"]) from None


def load_config(source: str | os.PathLike | Mapping[str, Any], root: type[BaseModel] | None = None,
                overrides: Mapping[str, Any] | None = None):
    """A ``RunConfig`` (or ``root``: another run's config model, e.g. ``rlhf-switch rm``'s) from a
    YAML file or an already-parsed dict, ``overrides`` (dotted field paths, e.g. a command line's
    ``{"algorithm.iterations": 40}``) applied first; ``ConfigError`` lists every bad field by its
    path."""
    root = root or RunConfig
    name = "config" if isinstance(source, Mapping) else f"config {source}"
    data = source if isinstance(source, Mapping) else _read_yaml(Path(source))
    if not isinstance(data, Mapping):
        raise ConfigError(name, [f"the top level must be a mapping of fields, got {type(data).__name__}"])
    data = dict(data)
    for path, value in (overrides or {}).items():
        *parents, last = path.split(".")
        node = data
        for part in parents:
            node[part] = dict(node.get(part) or {})
            node = node[part]
        node[last] = value
    try:
        return root.model_validate(data)
    except ValidationError as e:
        problems = format_validation_error(e, root)
        raise ConfigError(f"{name}: {len(problems)} problem{'s' * (len(problems) != 1)}", problems) from None


# ---------------------------------------------------------------- the model's and the task's sizes


@dataclass(frozen=True)
class ModelDims:
    """The numbers of a Llama-shaped config the fit check needs."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    max_context: int
    special_ids: Mapping[str, int]
    tie_word_embeddings: bool = False
    model_type: str = "llama"  # families.py: what the engines' layout_problems refuse by family
    moe_intermediate_size: int | None = None  # MoE experts' width: TP splits it as it splits the MLP's

    REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
    OPTIONAL = ("num_key_value_heads", "max_position_embeddings")

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any]) -> "ModelDims":
        heads = int(cfg["num_attention_heads"])
        return cls(hidden_size=int(cfg["hidden_size"]), num_layers=int(cfg["num_hidden_layers"]),
                   num_heads=heads, num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                   intermediate_size=int(cfg["intermediate_size"]), vocab_size=int(cfg["vocab_size"]),
                   max_context=context_length(cfg),
                   special_ids={k: cfg[k] for k in ("pad_token_id", "bos_token_id", "eos_token_id")
                                if cfg.get(k) is not None},
                   tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                   model_type=str(cfg.get("model_type") or "llama"),
                   moe_intermediate_size=int(cfg["moe_intermediate_size"]) if cfg.get("moe_intermediate_size") else None)


def scaled_along_dp(now: Mapping[str, Any], world: int) -> dict:
    """The fields of a run config (``RunConfig.model_dump()`` data) that change for a world of
    ``world`` devices: ``world_size`` and the train, rollout, reference and critic layouts scaled
    along DP (tp and pp kept). Not checked here: loading the changed config checks it."""
    def scaled(block):
        if block is None:
            return None
        b = dict(block)
        b["dp"] = max(1, world // (int(b.get("tp", 1)) * int(b.get("pp", 1) or 1)))
        return b

    out = {"world_size": int(world), "train": scaled(now["train"]), "rollout": scaled(now["rollout"])}
    for phase in ("reference", "critic"):
        if now.get(phase) is not None:
            out[phase] = scaled(now[phase])
    return out


def model_dims(model: ModelConfig) -> ModelDims:
    """The dimensions of the run's model (``ModelConfig.hf_dict``)."""
    cfg = model.hf_dict()
    missing = [k for k in ModelDims.REQUIRED if k not in cfg]
    if missing:
        raise ConfigError("model", [f"model.path: {Path(model.path) / 'config.json'} lacks {', '.join(missing)}"])
    return ModelDims.from_hf_config(cfg)


def task_prompt_tokens(cfg: RunConfig) -> int:
    """The longest prompt of a ``task:`` run's task, in the character tokenizer's ids."""
    t = cfg.task
    return longest_prompt_tokens(build_task(t.name, t.min_len, t.max_len, t.length_skew), CharTokenizer())


def longest_sequence_tokens(cfg: RunConfig, max_context: int) -> int:
    """The longest prompt + response a run's trainer is handed: the task's longest prompt (the
    data's prompt limit) plus ``max_new_tokens``, never more than the context. An engine with
    static shapes (the pipeline's buffers) is built for this length, not for the whole context."""
    new = cfg.algorithm.max_new_tokens
    if cfg.agent is not None:  # an episode's prompt is its environment's to write: the whole context
        return max_context
    if cfg.task is not None:
        prompt = task_prompt_tokens(cfg)
    else:
        from .data import prompt_token_limit

        prompt = prompt_token_limit(cfg.data, new, max_context)
    return min(max_context, prompt + new)
