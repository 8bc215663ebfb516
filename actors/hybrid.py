"""The colocated hybrid worker: one per logical device, its training engines and (placement
``worker``) its rollout engine — all built through the engine interfaces (``engines/base.py``).

``HybridWorker`` is a plain class; the recipe makes it a Ray actor with ``ray.remote`` (see
``remote_class``), one actor per placement-group bundle. The workers form their own gloo world
(rank 0 opens a TCPStore on a free port of its own node and hands out its address), and on it:

- the trainer: the training engine ``train.engine`` names (``fsdp2``, ``torch_tp``, ``torch_pp``,
  ``deepspeed`` or a user's ``module:Class``) over all ranks. Its starting state comes from a
  checkpoint directory (the warm start, or a run being resumed) through the VPS: rank 0 holds the
  checkpoint whole (``FullState``) and ``switch_training`` moves it into the engine's layout, the
  same path that saves it (engine -> ``FullState`` on rank 0 -> disk);
- the reference: a training engine of its own (``reference``), the warm-start weights moved in
  through the VPS, frozen;
- PPO's critic: a training engine whose model has a value head (``actors/critic.py``);
- a reward model (``reward.model_path``): a value-head training engine of its own layout, its
  weights moved in from that directory, frozen like the reference; ``reward_scores`` reads it at
  the last token of every rollout (``actors/reward_model.py``, docs/reward-models.md);
- a rollout engine of placement ``worker`` (the torch engine): one TP worker per rank, each
  replica's ranks a TP group of this world. Engines of placement ``replica`` (vLLM) live in their
  own actors (``actors/rollout_replica.py``); this worker only sends to them.

The weights reach the rollout engine through the run's weight channel (``engines/channel.py``),
opened once (``channel_open``): every sync is ``sync_send`` — one VPS move from the trainer's
compute weights (``adapter.weights()``; a LoRA run's adapters or merged weights,
``engines.lora.WeightSync``) into the rollout buffers (``rollout.handoff: ipc``: into
shared buckets that this rank hands its colocated vLLM worker by handle). The trainer keeps its optimizer
state in place unless ``train.offload`` says otherwise (below). ``logprobs`` recomputes the
log-probs of the generated tokens with the trainer (the *old* log-probs) and compares them with
what the rollout engine reported — the stale-weights check, which the driver reads before it
asks for the ``update``. The RL maths of both is the run's ``rl.algorithm.Algorithm``: this worker
only slices the batch, calls its engines and keeps what passes between the two calls.

Memory at the phase boundary (``train.offload``, ``engines/offload.py``): after the sync,
``offload`` parks the trainer's optimizer state (``all``: its weights too) in host buffers and
hands the engine's memory back; ``reload`` puts it back before the update. ``memory_mark`` closes
a phase: its peak device memory (``torch.cuda.max_memory_allocated`` where the trainer is on a
GPU; on CPU the largest number of bytes the trainer's state buffers held in the phase).
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Sequence

import torch
import torch.distributed as dist

from rlhf_switch.device import CPU, DeviceSpec
from rlhf_switch.engines.base import DEFAULT_TIMEOUT as TIMEOUT  # the world's deadline
from rlhf_switch.engines.base import stop_set
from rlhf_switch.families import context_length
from rlhf_switch.rl.algorithm import Algorithm
from rlhf_switch.rl.config import RunConfig, load_config, longest_sequence_tokens
from rlhf_switch.timeouts import MOVE_S


class ChannelStale(RuntimeError):
    """The trainer's weights are no longer where the channel's plan says (an engine was rebuilt
    without re-planning): nothing was moved."""


class HybridWorker:
    """One rank of the colocated world (call every method on every worker, concurrently)."""

    def __init__(self):
        self._store = self._channel_store = None
        self.rank = self.world = None
        self.channel = None
        self._offload = None
        self._cpu_peak = 0  # CPU: the most bytes the trainer's state buffers held since the last mark
        self._prepared = None  # what ``logprobs`` computed for the ``update`` after it
        self.reward_model = None
        self.device = CPU

    def devices_seen(self) -> dict:
        """What this actor sees on its bundle: a GPU or not (``device: auto`` is resolved from
        it, once, by the driver) and the GPU ids Ray assigned it."""
        import ray

        from rlhf_switch.device import cuda_available

        return {"cuda": cuda_available(), "gpu_ids": [str(g) for g in ray.get_gpu_ids()]}

    # --- the world ---------------------------------------------------------------------------------
    def open_store(self) -> tuple[str, int]:
        """Rank 0 only: the TCPStore of the workers' world on a free port of this node; returns
        (address, port) for the others."""
        from rlhf_switch.engines.channel import open_store

        self._store, host, port = open_store(TIMEOUT.total_seconds())
        return host, port

    def node(self) -> dict:
        """The Ray node this rank runs on (``engines.channel.node_of_this_process``)."""
        from rlhf_switch.engines.channel import node_of_this_process

        return node_of_this_process()

    def init_world(self, host: str, port: int, rank: int, world: int, device: DeviceSpec = CPU) -> dict:
        """Join the workers' world; ``device``: the run's (``rlhf_switch.device``), whose backend
        the world's groups use (nccl: every tensor a collective carries is on this actor's GPU)."""
        torch.set_num_threads(1)
        store = self._store or dist.TCPStore(host, port, is_master=False, timeout=TIMEOUT)
        self._store = store
        self.device = device
        dist.init_process_group(device.backend, store=store, rank=rank, world_size=world, timeout=TIMEOUT)
        self.rank, self.world = rank, world
        return {"rank": rank, "pid": os.getpid(), "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}

    def init_world_at(self, address: tuple[str, int], rank: int, world: int, device: DeviceSpec = CPU) -> dict:
        """``init_world`` with rank 0's ``open_store`` answer as one argument: the driver can pass
        that call's object ref on without waiting for it (the elastic background build)."""
        return self.init_world(address[0], address[1], rank, world, device)

    # --- engines -----------------------------------------------------------------------------------
    def _training_context(self, cfg: RunConfig):
        from rlhf_switch.engines.base import TrainingContext
        from rlhf_switch.engines.optim import AdamWConfig

        alg = cfg.algorithm
        optim = AdamWConfig(lr=alg.lr, weight_decay=alg.weight_decay, max_grad_norm=alg.max_grad_norm or 0.0)
        hf = hf_config_of(cfg)
        # the pipeline engine pads every batch to this length: the run's longest sequence, not the context
        seq_len = longest_sequence_tokens(cfg, context_length(hf))
        return TrainingContext(hf, cfg.seed, tuple(range(self.world)), optim, micro_batch=alg.micro_batch_size,
                               outputs_batch=alg.logprob_micro_batch_size, seq_len=seq_len, timeout=TIMEOUT,
                               device=self.device)

    def _trainer_context(self, cfg: RunConfig):
        """The policy's context: the run's, with ``model.lora``'s adapters where it has them (the
        reference and the critic train no adapters)."""
        from dataclasses import replace

        ctx = self._training_context(cfg)
        lora = cfg.model.lora
        return ctx if lora is None else replace(ctx, lora=lora.spec(), lora_dropout=lora.dropout)

    def _weight_sync(self):
        """What each weight sync moves (``engines.lora.WeightSync``): every weight, or with LoRA
        the adapters or the merged weights of their targets, chosen once for the run."""
        from rlhf_switch.engines.base import rollout_engine
        from rlhf_switch.engines.lora import WeightSync

        if getattr(self, "_sync", None) is None or self._sync[0] is not self.trainer:
            option = self.cfg.model.lora.sync if self.cfg.model.lora is not None else "auto"
            sync = WeightSync.choose(self.spec, option, rollout_engine(self.cfg.rollout.engine).takes_adapters,
                                     self.device.compute_dtype)
            self._sync = (self.trainer, sync)
        return self._sync[1]

    def build_empty(self, config: dict | RunConfig, init_dir: str | None = None) -> dict:
        """The trainer of ``config`` on this rank with no state of its own worth keeping (its seeded
        weights, Adam state created at zero): the destination of an elastic resize, which
        overwrites all of it. ``init_dir`` (the run's warm start): the reference and a rollout
        engine of placement ``worker`` are built from it too (the reference is the warm start; the
        rollout engine gets the trainer's weights at the next sync). PPO's critic is built empty
        too (seeded, value head): the move overwrites its state like the trainer's. The device
        is the one the world was joined with."""
        from rlhf_switch.engines.base import training_engine

        cfg = config if isinstance(config, RunConfig) else load_config(config)
        self.cfg, self.algorithm = cfg, Algorithm.build(cfg.algorithm)
        t0 = time.perf_counter()
        self.trainer = training_engine(cfg.train.engine).build(cfg.train, self._trainer_context(cfg))
        self.trainer.adapter.prepare_state()  # done here, in the background, not in the stop-the-world
        self.spec = self.trainer.spec
        self.reference = self.rollout = None
        self._build_critic(cfg, self._training_context(cfg), None)
        if self.critic is not None:
            self.critic.adapter.prepare_state()
        if init_dir is not None:
            self._build_reference(cfg, self._training_context(cfg), init_dir)
            self._build_rollout(cfg, init_dir)
        hf = hf_config_of(cfg)
        self.pad_id, self.eos_id = int(hf.get("pad_token_id") or 0), hf.get("eos_token_id")
        self.train_steps = 0
        return {"rank": self.rank, "trainer": self.trainer.name, "seconds": time.perf_counter() - t0}

    def build(self, config: dict | RunConfig, init_dir: str, resume_dir: str | None = None,
              device: DeviceSpec | None = None) -> dict:
        """Build the engines of ``config`` on this rank. The trainer starts from the weights in
        ``init_dir`` (fresh optimizer, step 0) or, when ``resume_dir`` is given, from that
        checkpoint's weights, Adam moments, step and LR schedule; the reference is ``init_dir``.
        ``device``: the run's (default: the one the world was joined with)."""
        from rlhf_switch.engines.base import training_engine

        cfg = config if isinstance(config, RunConfig) else load_config(config)
        self.cfg, self.algorithm = cfg, Algorithm.build(cfg.algorithm)
        self.device = device or self.device  # what the engines run on (the recipe checked them)
        hf = hf_config_of(cfg)
        ctx = self._training_context(cfg)
        self.trainer = training_engine(cfg.train.engine).build(cfg.train, self._trainer_context(cfg))
        self.spec = self.trainer.spec
        # the starting state, through the VPS from rank 0's copy of the checkpoint
        t0 = time.perf_counter()
        start = self._load_state(resume_dir or init_dir, weights_only=resume_dir is None)
        load_s = time.perf_counter() - t0
        self._build_reference(cfg, ctx, init_dir)
        self._build_reward_model(cfg, ctx)
        # PPO: the critic, its trunk from the warm start, its own engine and layout
        self._build_critic(cfg, ctx, init_dir)
        if self.critic is not None and resume_dir is not None:  # its weights, moments, step and LR schedule
            self._load_state(str(Path(resume_dir) / "critic"), weights_only=False, adapter=self.critic.adapter)
        self._build_rollout(cfg, init_dir)
        tp = self.tp
        self.pad_id = int(hf.get("pad_token_id") or 0)
        self.eos_id = hf.get("eos_token_id")
        self.train_steps = int(start.get("step", 0))
        rollout = (f"{self.rollout.name}×{self.replicas}" if self.rollout is not None
                   else f"{cfg.rollout.engine} TP{tp}×{self.replicas} (separate actors)")
        return {"rank": self.rank, "trainer": self.trainer.name, "rollout": rollout, "params": self.spec.numel,
                "reference": self.reference.name if self.reference is not None else None,
                "critic": self.critic.name if self.critic is not None else None,
                "start": start, "load_seconds": load_s}

    def _build_reference(self, cfg: RunConfig, ctx, init_dir: str) -> None:
        """The reference: the warm-start weights, frozen, in its own engine and layout."""
        from rlhf_switch.engines.base import training_engine

        self.reference = None
        if cfg.reference:
            self.reference = training_engine(cfg.reference.engine).build(cfg.reference, ctx)
            self._load_weights(init_dir, self.reference)
            self.reference.freeze()

    def _build_reward_model(self, cfg: RunConfig, ctx) -> None:
        """The reward model (None without a ``reward`` block): the value model of its own
        ``config.json`` in its own engine and layout, the weights of ``reward.model_path`` moved
        in (``actors.reward_model.reward_model_weights``), frozen."""
        from dataclasses import replace

        from actors.reward_model import reward_model_weights
        from rlhf_switch.engines.base import training_engine
        from rlhf_switch.rl.config import ModelConfig

        self.reward_model = None
        r = cfg.reward
        if r is not None:
            hf = ModelConfig(path=r.model_path).hf_dict()
            rows = r.micro_batch_size or ctx.outputs_batch or ctx.micro_batch
            self.reward_model = training_engine(r.engine).build(
                r, replace(ctx, hf_config=hf, head="value", micro_batch=rows, outputs_batch=rows))
            self._load_weights(r.model_path, self.reward_model, read=reward_model_weights)
            self.reward_model.freeze()

    def _build_critic(self, cfg: RunConfig, ctx, init_from: str | None) -> None:
        """PPO's critic (None without a ``critic`` block): a value-head engine of its own layout,
        its optimizer at ``algorithm.critic_lr``, its trunk from ``init_from`` (None: seeded)."""
        from dataclasses import replace

        from actors.critic import Critic
        from rlhf_switch.engines.base import training_engine

        self.critic = None
        if cfg.critic is not None:
            optim = replace(ctx.optim, lr=cfg.algorithm.critic_lr)
            engine = training_engine(cfg.critic.engine).build(
                cfg.critic, replace(ctx, optim=optim, head="value", init_from=init_from))
            self.critic = Critic(engine, micro_batch=cfg.algorithm.micro_batch_size)

    def _build_rollout(self, cfg: RunConfig, init_dir: str) -> None:
        """The rollout engine of placement ``worker`` on this rank (placement ``replica``: separate
        actors, nothing here), starting from ``init_dir``; the weight channel brings it up to date."""
        from rlhf_switch.engines.base import RolloutContext, rollout_engine

        hf, tp = hf_config_of(cfg), cfg.rollout.tp
        self.tp, self.replicas = tp, self.world // tp
        self.replica, self.tp_rank = self.rank // tp, self.rank % tp
        self.rollout_cls = rollout_engine(cfg.rollout.engine)
        self.rollout = None
        if self.rollout_cls.placement == "worker":
            groups = [dist.new_group(list(range(r, r + tp)), timeout=TIMEOUT) for r in range(0, self.world, tp)] \
                if tp > 1 else [None] * self.replicas
            self.rollout = self.rollout_cls.build(RolloutContext(
                hf, self.spec, init_dir, tp, self.replicas, self.replica, cfg.seed,
                context_length(hf), tp_rank=self.tp_rank, group=groups[self.replica],
                device=self.device, options=dict(cfg.rollout.options)))
            self.rollout.weight_sync(self._weight_sync().mode)

    def _load_weights(self, path: str, engine, read=None) -> None:
        """The weights of the checkpoint at ``path`` into ``engine`` (a VPS move from rank 0's
        whole copy): the reference's starting point. Its forward reads exactly these buffers
        (ZeRO-1/2 bit16 flat groups, ZeRO-3 partitions, FSDP2/DTensor local shards, stages); it
        never steps, so its fp32 master copy is left alone. ``read(path, spec)``: rank 0's whole
        copy (default: ``FullState.load_dir`` of the weights)."""
        from rlhf_switch.engines.full_state import FullState
        from rlhf_switch.engines.train_state import gather_layouts
        from rlhf_switch.routing import move

        spec = engine.spec
        read = read or (lambda p, s: FullState.load_dir(p, s, weights_only=True))
        holder = read(path, spec).to(self.device.torch_device()).weights() if self.rank == 0 else None
        mine = engine.adapter.weights()
        (src, dst), _ = gather_layouts([(spec, holder) if holder else None, (spec, mine)],
                                       ["warm start", f"reference:{engine.name}"])
        with torch.no_grad():
            move(src, dst, holder.tensors if holder else {}, mine.tensors, timeout=TIMEOUT)
        written = getattr(engine.adapter, "weights_written", None)
        if written is not None:  # ZeRO-3: its whole persistent parameters, gathered again from the partitions
            written()

    # --- state in and out: checkpoints through the VPS ---------------------------------------------
    def _load_state(self, path: str, weights_only: bool, adapter=None) -> dict:
        """Rank 0 reads the checkpoint at ``path`` whole; the VPS moves it into ``adapter``'s
        layout (default: the trainer's). ``weights_only``: a warm start — the engine keeps its
        own fresh step, LR schedule and RNG, and zero moments."""
        from rlhf_switch.engines.full_state import FullState
        from rlhf_switch.engines.train_switch import switch_training

        adapter = adapter or self.trainer.adapter
        holder = None
        if self.rank == 0:
            # on the run's device: the world's group (nccl on CUDA) carries it to the other ranks
            holder = FullState.load_dir(path, adapter.spec, weights_only=weights_only,
                                        seed=self.cfg.seed).to(self.device.torch_device())
            if weights_only:
                holder.load_scalars(adapter.scalars())
        report = switch_training(holder, adapter, timeout=TIMEOUT)
        extra = getattr(holder, "extra", {}) if holder is not None else {}
        (extra,) = _broadcast_objects([extra])
        return {"step": int(report.scalars.get("step", 0)), **extra}

    def save_checkpoint(self, path: str, extra: dict | None = None) -> dict:
        """Write the trainer's whole state (weights as a HF checkpoint, Adam moments, step, LR
        schedule) to ``path`` — and the critic's to ``path/critic`` — : every rank moves its part
        to rank 0, which writes."""
        from rlhf_switch.engines.full_state import FullState
        from rlhf_switch.engines.train_switch import switch_training

        t0 = time.perf_counter()
        sent = 0
        # the actor's directory first: the critic's goes inside it
        parts = [(self.trainer.adapter, Path(path), hf_config_of(self.cfg), self.device.compute_dtype)]
        if self.critic is not None:
            parts.append((self.critic.adapter, Path(path) / "critic", None, "float32"))
        for adapter, where, hf, dtype in parts:
            holder = (FullState(adapter.spec, name=f"checkpoint {where}").to(self.device.torch_device())
                      if self.rank == 0 else None)
            report = switch_training(adapter, holder, timeout=TIMEOUT)
            sent += report.move.bytes_sent
            if holder is not None:
                # the actor's directory is a model.path of its own: weights, config and tokenizer
                holder.save_dir(where, hf, dtype, extra, tokenizer_from=tokenizer_dir_of(self.cfg) if hf else None,
                                lora_dropout=self.cfg.model.lora.dropout if self.cfg.model.lora else 0.0)
        dist.barrier()
        return {"rank": self.rank, "seconds": time.perf_counter() - t0, "bytes_sent": sent}

    def gathered_state(self, part: str = "trainer") -> dict | None:
        """The whole state of the trainer (``part="critic"``: PPO's critic) gathered on rank 0
        (fp32 master, Adam moments, step, LR schedule, RNG) through the VPS; rank 0 returns it,
        the others None (collective)."""
        from rlhf_switch.engines.full_state import FullState
        from rlhf_switch.engines.train_switch import switch_training

        adapter = {"trainer": self.trainer, "critic": self.critic}[part].adapter
        holder = FullState(adapter.spec, name=f"gathered {part} state") if self.rank == 0 else None
        switch_training(adapter, holder, timeout=TIMEOUT)
        if holder is None:
            return None
        return {"master": holder.master, "moments": holder.moments, "scalars": holder.scalars()}

    # --- elastic resize: this rank's part of the move between the old and the new world ------------
    def resize_store(self) -> tuple[str, int]:
        """Old rank 0 only: the union group's TCPStore on a free port of this node."""
        from rlhf_switch.engines.channel import open_store

        self._resize_store, host, port = open_store(MOVE_S)
        return host, port

    def _state_adapters(self) -> list:
        """The engines whose training state a resize moves and a host copy keeps, in that order:
        the trainer's, then PPO's critic's."""
        return [self.trainer.adapter] + ([self.critic.adapter] if self.critic is not None else [])

    def resize_move(self, endpoint, source: str = "engine") -> dict:
        """Join the union of the old and new trainer ranks and move the training state across
        (``rlhf_switch.elastic.member``): the trainer's, then PPO's critic's over the same group;
        an old rank sends, a new rank receives; on the new side the step counters follow the
        moved state. ``source`` (old side): ``engine``, the engines' own state, or ``host_copy``,
        the copies of the last ``redundancy_refresh`` (a surviving rank after a trainer was lost:
        its own engines are mid-step)."""
        from rlhf_switch.elastic.member import move_over_union

        host_store = getattr(self, "_resize_store", None) if endpoint.rank == 0 else None
        if source == "host_copy" and endpoint.side == "old":
            adapters = [c.source() for c in self._host_copies]
        else:
            adapters = self._state_adapters()
        out = move_over_union(adapters, endpoint, store=host_store)
        self._resize_store = None
        if endpoint.side == "new":
            self.train_steps = out["steps"][0]
            if self.critic is not None:
                self.critic.steps = out["steps"][1]
        return out

    # --- elastic.redundancy: host — the state kept by a buddy, for a lost trainer -------------------
    # ``pid``, ``host_copy_torn``, ``host_copy_extra``, ``resize_store`` and ``resize_move(source="host_copy")`` are what
    # a recovery calls on a survivor, in the actor's control concurrency group (``remote_class``):
    # a thread of their own, while the main thread may still sit in the interrupted call's
    # collective until the gloo timeout. Reading the host copy there races nothing: a refresh runs
    # only in the main thread, called by the driver between steps and never during a recovery, so
    # the only one that can be running then is one the loss interrupted — and it left the copy
    # ``torn`` (refused, ``HostCopy.source``). The usual stuck calls are ``logprobs`` and ``update``,
    # which read and write the engines' buffers only, never ``_host_copies``.
    def pid(self) -> int:
        """This actor's process id (a liveness probe; the test that kills one finds it here)."""
        return os.getpid()

    def host_copy_torn(self) -> list[str]:
        """The host copies whose last refresh was cut short (their buffers mix two states)."""
        return [c.adapter.name for c in getattr(self, "_host_copies", []) if c.torn]

    def host_copy_extra(self) -> list[dict]:
        """What each host copy's last complete refresh was given (the loop: its iteration)."""
        return [dict(c.extra) for c in getattr(self, "_host_copies", [])]

    def redundancy_refresh(self, shift: int = 1, extra: dict | None = None) -> dict:
        """The trainer's state as of now into the host copy (``rlhf_switch.elastic.redundancy``) —
        and PPO's critic's into one of its own: this rank's share and its buddy's, step, LR
        schedule and RNG, and ``extra`` (the data position); collective over the trainer's world.
        Call it before ``offload``. Returns the bytes summed over the copies."""
        from rlhf_switch.elastic.redundancy import HostCopy

        adapters = self._state_adapters()
        copies = getattr(self, "_host_copies", [])
        if len(copies) != len(adapters) or any(c.adapter is not a or c.shift != shift
                                               for c, a in zip(copies, adapters)):
            for a in adapters:  # before an engine's first step (the critic's, ZeRO-1/2): the zeros it would create
                a.prepare_state()
            self._host_copies = [HostCopy(a, shift, timeout=TIMEOUT) for a in adapters]
        reports = [c.refresh(extra) for c in self._host_copies]
        return {k: sum(r[k] for r in reports) for k in ("bytes_local", "bytes_received", "bytes_held", "seconds")}

    # --- the weight channel ------------------------------------------------------------------------
    def channel_source(self):
        """The trainer's compute weights as one global Layout (collective; rank 0 returns it,
        the others None) — the source of the channel into rollout engines in other processes."""
        src = self._gather_weights_layout()
        return src if self.rank == 0 else None

    def channel_destination(self, tp: int, replicas: int):
        """The rollout replicas' layout (``tp`` × ``replicas``, the run's rollout engine) of what each
        sync moves (``_weight_sync``): the destination of the channel into engines in other processes."""
        from rlhf_switch.engines.base import rollout_engine

        layout = rollout_engine(self.cfg.rollout.engine).rollout_layout(self.spec, tp, replicas, self.device.compute_dtype)
        return self._weight_sync().destination(layout)

    def channel_store(self) -> tuple[str, int]:
        """Rank 0 only: a TCPStore for the weight channel on a free port of this node."""
        from rlhf_switch.engines.channel import open_store

        self._channel_store, host, port = open_store(MOVE_S)
        return host, port

    def channel_open(self, endpoint=None) -> dict:
        """Join the run's weight channel, once. ``endpoint`` (``engines.channel.Endpoint``): the
        channel into replica engines in other processes, this rank ``endpoint.first_rank``; None:
        the rollout engine lives on these ranks (placement ``worker``) — the channel is a group of
        this world and both layouts are worked out here (collective)."""
        from rlhf_switch.engines.channel import ChannelEnd

        if self.channel is not None:
            self.channel.close()
        if endpoint is None:
            cfg = getattr(self, "cfg", None)  # the run's verify setting (RunConfig.verify)
            self.channel = ChannelEnd.over(timeout_s=MOVE_S, verify=cfg.verify if cfg else "off",
                                           verify_fraction=cfg.verify_fraction if cfg else 0.1,
                                           share_sources=True)  # a weight sync: the same buffers every time
            src = self._gather_weights_layout()
            self.channel.set_layouts(src, self._weight_sync().destination(
                self.rollout_cls.rollout_layout(self.spec, self.tp, self.replicas, self.device.compute_dtype)))
        else:
            self._weights = self._weight_sync().source(self.trainer.adapter)
            self.channel = ChannelEnd.join(endpoint.host, endpoint.port, endpoint.first_rank, endpoint.world_size,
                                           store=self._channel_store if self.rank == 0 else None,
                                           timeout_s=endpoint.timeout_s, budget_bytes=endpoint.budget_bytes,
                                           standby_s=endpoint.standby_s, verify=endpoint.verify,
                                           verify_fraction=endpoint.verify_fraction, handoff=endpoint.handoff,
                                           colocated=endpoint.colocated, backend=endpoint.backend,
                                           share_sources=True)  # a weight sync: the same buffers every time
            self.channel.set_layouts(endpoint.src, endpoint.dst)
        self._planned = (tuple(self._weights.fragments), dict(self._weights.buffers))
        return self.channel.stats()

    def channel_release(self) -> dict:
        """Take part in one move with no buffers: every member refuses it at the move's agreement
        (or finds the lost peer there) before a byte moves — the rollout workers standing by in
        their receive are let go with their weights as they were (``Cluster.drop_replicas``)."""
        try:
            self.channel.move({}, {})
        except Exception as e:  # noqa: BLE001 - the refusal is the point
            return {"rank": self.rank, "refused": type(e).__name__}
        raise RuntimeError(f"rank {self.rank}: a weight-channel move with no buffers was not refused")

    def sync_send(self, verify: str | None = None) -> dict:
        """One sync through the channel: this rank's part of the move of the trainer's compute
        weights (and, placement ``worker``, its receive into the rollout engine's buffers).
        ``verify``: this sync's checking (``off``/``sample``/``full``, the same on every member)
        instead of the channel's (the run config's ``verify``)."""
        t0 = time.perf_counter()
        weights = self._weight_sync().source(self.trainer.adapter)
        dst = self.rollout.buffers() if self.rollout is not None else {}
        if (tuple(weights.fragments), dict(weights.buffers)) != self._planned:
            # still take part, without buffers: every member then refuses the move at once (the
            # executor's agreement) instead of waiting for this rank until its timeout
            try:
                self.channel.move({}, dst)
            finally:
                raise ChannelStale(f"rank {self.rank}: the weights of {self.trainer.name} are not where the "
                                   f"weight channel's plan has them; re-open the channel after rebuilding an "
                                   f"engine; nothing was moved")
        report = self.channel.move(weights.tensors, dst, verify=verify)
        if self.rollout is not None:
            self.rollout.weights_updated()
        out = dict(vars(report))
        out["weights"] = self._weight_sync().mode
        out["wall_seconds"] = time.perf_counter() - t0
        return out

    def channel_stats(self) -> dict:
        return self.channel.stats() if self.channel is not None else {}

    def _gather_weights_layout(self):
        """This rank's compute weights (kept in ``self._weights`` for the move) and everyone's, as
        one global Layout (collective)."""
        from rlhf_switch.engines.train_state import gather_layouts

        self._weights = self._weight_sync().source(self.trainer.adapter)
        spec = self._weight_sync().spec_of(self.spec)  # the model, or the part of it a LoRA sync moves
        (src,), _ = gather_layouts([(spec, self._weights)], [f"train:{self.trainer.name}"])
        return src

    # --- memory at the phase boundary --------------------------------------------------------------
    def offload(self) -> dict:
        """After the weight sync: what ``train.offload`` names leaves the trainer's buffers for host
        memory (collective over the trainer's ranks). Returns this rank's bytes and seconds."""
        from rlhf_switch.engines.offload import HostOffload

        mode = self.cfg.train.offload
        if mode == "none":
            return {"bytes_moved": 0, "bytes_released": 0, "seconds": 0.0}
        self._note_memory()  # the phase that ends here held the whole state
        if self._offload is None or self._offload.adapter is not self.trainer.adapter:
            self._offload = HostOffload(self.trainer.adapter, mode, timeout=TIMEOUT)
        return self._offload.offload().as_dict()

    def reload(self) -> dict:
        """Before the update: the parked state back into the trainer's own buffers, bit for bit."""
        if self._offload is None or not self._offload.parked:
            return {"bytes_moved": 0, "bytes_released": 0, "seconds": 0.0}
        out = self._offload.reload().as_dict()
        self._note_memory()
        return out

    def _on_gpu(self) -> bool:
        return torch.cuda.is_available() and torch.cuda.is_initialized()

    def _note_memory(self) -> None:
        if not self._on_gpu():
            from rlhf_switch.engines.offload import live_state_bytes

            self._cpu_peak = max(self._cpu_peak, live_state_bytes(self.trainer.adapter))

    def memory_mark(self) -> dict:
        """The peak memory of the phase that ends now, and a new phase begins."""
        if self._on_gpu():
            peak = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            return {"bytes": peak, "measure": "torch.cuda.max_memory_allocated"}
        from rlhf_switch.engines.offload import live_state_bytes

        # one walk of the state (it describes every tensor: ~5 ms a call under load, on the
        # worker's path between two phases): the phase's peak and the next phase's start are the same now
        now = live_state_bytes(self.trainer.adapter)
        peak, self._cpu_peak = max(self._cpu_peak, now), now
        return {"bytes": peak, "measure": "bytes of the trainer's live state buffers (CPU)"}

    # --- phases ------------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float,
                 seeds: Sequence[int], stop_ids: Sequence[int] = ()) -> dict:
        """This rank's replica generates its contiguous share of ``prompts`` (all TP ranks of a
        replica return the same); only TP rank 0 of each replica returns its tokens. The shares
        differ by one prompt at most where the replicas do not divide the count (a multi-turn
        rollout's turns; a replica may get none). ``seeds``: one per prompt, so a sample does not
        depend on the rollout layout. A response ends after the model's eos or any of
        ``stop_ids`` (an agent turn's own)."""
        n, R = len(prompts), self.replicas
        cut = [r * (n // R) + min(r, n % R) for r in (self.replica, self.replica + 1)]
        lo, hi = cut
        t0 = time.perf_counter()
        tokens, logprobs = (self.rollout.generate(prompts[lo:hi], max_new_tokens, temperature, list(seeds[lo:hi]),
                                                  stop_set(self.eos_id, stop_ids)) if hi > lo else ([], []))
        return {"replica": self.replica, "lead": self.tp_rank == 0, "tokens": tokens, "logprobs": logprobs,
                "seconds": time.perf_counter() - t0}

    def logprobs(self, batch: dict) -> dict:
        """The log-probs phase on this rank's DP share of the global ``batch`` (every rank gets all
        of it): the trainer's log-probs of the generated tokens with the weights that generated
        them (the old policy), the reference's, and the critic's values where the algorithm uses a
        critic — kept for ``update``. Returns the stale-weights check's number: the largest
        difference between the trainer's and the rollout engine's log-probs.

        ``batch``: ``prompts``, ``responses`` (token ids), ``rollout_logprobs`` (per token) and what
        the algorithm makes of the rewards (``Algorithm.batch_fields``: ``advantages`` per sequence,
        or the ``scores`` a per-token estimator turns into advantages with the critic)."""
        from rlhf_switch.rl.algorithm import OldPolicy, RankBatch

        t0 = time.perf_counter()
        trainer = self.trainer
        if self.algorithm.needs_critic and self.critic is None:
            raise ValueError(f"{self.algorithm.name} needs a critic; this worker has none")
        rows = RankBatch.of(batch, trainer.dp, trainer.dp_rank, self.pad_id, self.cfg.algorithm,
                            self.device.torch_device())  # the batch goes where the engines compute
        mask, checked = rows.response_mask, rows.checked_mask
        old = trainer.outputs(rows.ids) * mask
        ref = self.reference.outputs(rows.ids) * mask if self.reference is not None else None
        values = self.critic.values(rows.ids) * mask if self.algorithm.needs_critic else None
        stale = float(((old - rows.rollout_logprobs).abs() * checked).max()) if checked.any() else 0.0
        self._prepared = (rows, OldPolicy(old, ref, values))
        return {"stale_logprob_diff": stale, "logprob_seconds": time.perf_counter() - t0,
                "mismatch": mismatch_share(old, rows.rollout_logprobs, checked, trainer.dp_rank)}

    def reward_scores(self, batch: dict) -> dict:
        """The reward phase's learned part: the reward model's score — its value at the last
        token — of this rank's DP share of the sequences ``prompts[i] + responses[i]`` (every rank
        gets them all; ``dp_rank`` says which share came back)."""
        from actors.reward_model import score_share

        if self.reward_model is None:
            raise ValueError("reward_scores: this run has no reward model (reward.model_path)")
        t0 = time.perf_counter()
        seqs = [list(p) + list(r) for p, r in zip(batch["prompts"], batch["responses"])]
        scores = score_share(self.reward_model, seqs, self.pad_id, self.device.torch_device())
        return {"dp_rank": self.reward_model.dp_rank, "scores": scores, "seconds": time.perf_counter() - t0}

    def update(self) -> dict:
        """The update phase: the algorithm's optimizer steps on what ``logprobs`` prepared
        (``Algorithm.update``: ``epochs`` passes in mini-batches of ``mini_batch_size`` sequences,
        micro-batches of ``micro_batch_size``; the critic after the policy where there is one)."""
        if self._prepared is None:
            raise RuntimeError("update without a logprobs call before it: nothing to train on")
        rows, old = self._prepared
        self._prepared = None
        t0 = time.perf_counter()
        out = self.algorithm.update(self.trainer, self.critic, rows, old)
        self.train_steps += self.cfg.algorithm.epochs * len(rows.totals)
        out.update(update_seconds=time.perf_counter() - t0, steps=self.train_steps)
        return out

    def train_on(self, batch: dict) -> dict:
        """``logprobs`` then ``update`` in one call (what the elastic tests and benches drive)."""
        checked = self.logprobs(batch)
        return {**checked, **self.update()}

    def shutdown(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        if dist.is_initialized():
            dist.destroy_process_group()


def mismatch_share(trainer_lp: torch.Tensor, rollout_lp: torch.Tensor, checked: torch.Tensor, dp_rank: int) -> dict:
    """This DP rank's part of the train–inference mismatch (``rl.algorithms.mismatch_stats``
    in the driver, over every rank's): ``log π_train - log π_rollout`` of each checked token
    (those generated with the trainer's own weights), and its sum per sequence with any."""
    keep = checked.bool()
    log_ratio = (trainer_lp.float() - rollout_lp.float()).detach()
    rows = keep.any(-1)
    seq = torch.where(keep, log_ratio, torch.zeros_like(log_ratio)).sum(-1)[rows]
    return {"dp_rank": int(dp_rank), "log_ratio": log_ratio[keep].cpu(), "seq_log_ratio": seq.cpu()}


def hf_config_of(cfg: RunConfig) -> dict:
    """The model's HF config fields (``ModelConfig.hf_dict``)."""
    return cfg.model.hf_dict()


def tokenizer_dir_of(cfg: RunConfig) -> str | None:
    """Where the run's Hugging Face tokenizer lives (``model.tokenizer``, else ``model.path``), or
    None for a generated-task run (the character tokenizer has no files)."""
    from rlhf_switch.rl.tokenizer import has_tokenizer, tokenizer_path

    where = tokenizer_path(cfg)
    return where if where is not None and has_tokenizer(where) else None


def _broadcast_objects(objs: list) -> list:
    dist.broadcast_object_list(objs, src=0)
    return objs


def remote_class(num_cpus: float, num_gpus: float = 1):
    """``HybridWorker`` as a Ray actor class with explicit resources (Ray's default 1 CPU would
    not fit a fractional bundle; ``num_gpus`` are logical devices on CPU machines). Calls run in
    Ray's default group — one at a time, in the order they were sent — except those sent with
    ``.options(concurrency_group=CONTROL)`` (a recovery's, see ``pid``): one thread of their own."""
    import ray

    from rlhf_switch.elastic.manager import CONTROL

    # the default group's order is what the collectives rely on (Ray's default at max_concurrency 1,
    # said here: a concurrency group must not make it out-of-order)
    return ray.remote(num_cpus=num_cpus, num_gpus=num_gpus, concurrency_groups={CONTROL: 1},
                      allow_out_of_order_execution=False)(HybridWorker)
