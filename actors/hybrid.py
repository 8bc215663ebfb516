"""The colocated hybrid worker: one per logical device, a training engine and a rollout engine.

``HybridWorker`` is a plain class; the recipe makes it a Ray actor with ``ray.remote`` (see
``remote_class``), one actor per placement-group bundle. The workers form their own gloo world
(rank 0 opens a TCPStore on port 0 and the driver hands its real port to everyone), and on it:

- the training engine over all ranks: torch-native FSDP2 (``train.engine: fsdp2``), DTensor TP or
  TP×FSDP2 (``torch_tp``, ``tp``) or DeepSpeed ZeRO-1/2/3 (``deepspeed``; one forward per
  optimizer step) — the actor whose weights are trained. Its initial state comes from a
  checkpoint directory (the warm start, or a run being resumed) through the VPS: rank 0 holds the
  checkpoint whole (``FullState``) and ``switch_training`` moves it into the engine's layout, the
  same path that saves it (engine -> ``FullState`` on rank 0 -> disk);
- the reference: a frozen, unsharded copy of the warm-start weights on every rank (tiny models);
- the rollout engine: ``TorchRollout`` in vLLM's per-rank TP layout (``rollout.engine: torch``,
  replicas = world / tp, each replica's ranks a TP group); for ``rollout.engine: vllm`` the
  rollout engines are separate actors (``actors/vllm_replica.py``) and this worker only sends
  (``weights_layout`` + ``send_weights``).

``sync_weights_to_rollout`` moves the trainer's compute weights (``adapter.weights()``, field
``param``) into the rollout engine's own buffers with the VPS (``routing.move``); the trainer
keeps its optimizer state in place (on CPU there is no device memory to free for generation).
``train_on`` first recomputes the log-probs of the generated tokens with the trainer's model (the
*old* log-probs) and compares them with what the rollout engine reported — the stale-weights
check — then runs the GRPO update.
"""
from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Sequence

import torch
import torch.distributed as dist

from rlhf_switch.rl.algorithms import aggregate, kl_penalty, logprobs_from_logits, masked_mean, policy_loss
from rlhf_switch.rl.config import RunConfig, load_config

TIMEOUT = timedelta(seconds=120)


def _pad_batch(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], pad_id: int):
    """Right-padded ``prompt + response`` ids ``[B, T]``, the shifted targets ``ids[:, 1:]`` and the
    mask ``[B, T-1]`` of the positions whose logits predict a response token."""
    seqs = [list(p) + list(r) for p, r in zip(prompts, responses)]
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), T - 1), dtype=torch.float32)
    for b, (p, r) in enumerate(zip(prompts, responses)):
        ids[b, : len(p) + len(r)] = torch.tensor(list(p) + list(r), dtype=torch.long)
        mask[b, len(p) - 1: len(p) - 1 + len(r)] = 1.0
    return ids, ids[:, 1:], mask


def _token_logprobs(model, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``[B, T-1]`` log-probs of ``targets`` under ``model`` (no attention mask: right padding
    and causal attention leave every real position untouched)."""
    logits = model(input_ids=ids).logits[:, :-1]
    return logprobs_from_logits(logits, targets)


class HybridWorker:
    """One rank of the colocated world (call every method on every worker, concurrently)."""

    def __init__(self):
        self._store = None
        self.rank = self.world = None

    # --- the world ---------------------------------------------------------------------------------
    def open_store(self) -> int:
        """Rank 0 only: the TCPStore of the workers' world on a free port; returns the port."""
        self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
        return self._store.port

    def init_world(self, host: str, port: int, rank: int, world: int) -> dict:
        torch.set_num_threads(1)
        store = self._store or dist.TCPStore(host, port, is_master=False, timeout=TIMEOUT)
        self._store = store
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=TIMEOUT)
        self.rank, self.world = rank, world
        return {"rank": rank, "pid": os.getpid(), "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}

    # --- engines -----------------------------------------------------------------------------------
    def build(self, config: dict | RunConfig, init_dir: str, resume_dir: str | None = None) -> dict:
        """Build the engines of ``config`` on this rank. The trainer starts from the weights in
        ``init_dir`` (fresh optimizer, step 0) or, when ``resume_dir`` is given, from that
        checkpoint's weights, Adam moments, step and LR schedule; the reference is ``init_dir``."""
        from rlhf_switch.engines.optim import AdamWConfig
        from rlhf_switch.engines.torch_rollout import TorchRollout

        cfg = config if isinstance(config, RunConfig) else load_config(config)
        self.cfg, alg = cfg, cfg.algorithm
        if cfg.model.dtype != "float32":
            raise NotImplementedError("float32 only on CPU")
        hf = hf_config_of(cfg)
        optim = AdamWConfig(lr=alg.lr, weight_decay=alg.weight_decay, max_grad_norm=alg.max_grad_norm or 0.0)
        self._build_trainer(cfg, hf, optim)
        self.max_grad_norm = optim.max_grad_norm
        # the starting state, through the VPS from rank 0's copy of the checkpoint
        t0 = time.perf_counter()
        start = self._load_state(resume_dir or init_dir, weights_only=resume_dir is None)
        load_s = time.perf_counter() - t0
        # the reference: the warm-start weights, frozen
        self.reference, self.reference_name = None, None
        if cfg.reference:
            self.reference, self.reference_name = self._build_reference(cfg, hf, init_dir, optim)
        # PPO: the critic, its trunk from the warm start, its own engine and layout
        self.critic = None
        if cfg.critic is not None:
            from actors.critic import Critic

            self.critic = Critic.build(cfg.critic, hf, cfg.seed, list(range(self.world)), lr=alg.critic_lr,
                                       max_grad_norm=optim.max_grad_norm, micro_batch=alg.micro_batch_size,
                                       init_from=init_dir, timeout=TIMEOUT)
            if resume_dir is not None:  # its weights, moments, step and LR schedule
                self._load_state(str(Path(resume_dir) / "critic"), weights_only=False, adapter=self.critic.adapter)
        # rollout
        tp = cfg.rollout.tp
        self.tp, self.replicas = tp, self.world // tp
        self.replica, self.tp_rank = self.rank // tp, self.rank % tp
        self.rollout = None
        if cfg.rollout.engine == "torch":
            groups = [dist.new_group(list(range(r, r + tp)), timeout=TIMEOUT) for r in range(0, self.world, tp)] \
                if tp > 1 else [None] * self.replicas
            from transformers import LlamaConfig

            self.rollout = TorchRollout.from_hf_config(self.spec, LlamaConfig(**hf), tp=tp,
                                                       tp_rank=self.tp_rank, group=groups[self.replica])
        self.pad_id = int(hf.get("pad_token_id") or 0)
        self.eos_id = hf.get("eos_token_id")
        self.train_steps = int(start.get("step", 0))
        rollout = f"TorchRollout TP{tp}×{self.replicas}" if self.rollout else f"vLLM TP{tp}×{self.replicas} (separate actors)"
        return {"rank": self.rank, "trainer": self.engine_name, "rollout": rollout, "params": self.spec.numel,
                "reference": self.reference_name, "critic": self.critic.name if self.critic is not None else None,
                "start": start, "load_seconds": load_s}

    def _build_trainer(self, cfg: RunConfig, hf: dict, optim) -> None:
        eng = self._engine(cfg.train, hf, cfg.seed, optim, cfg.algorithm.train_batch_size // cfg.train.dp)
        self.model, self.spec, self.adapter, self.engine_name = eng["module"], eng["spec"], eng["adapter"], eng["name"]
        self.dp, self.dp_rank, self.dp_group = eng["dp"], eng["dp_rank"], eng["dp_group"]
        self._backward, self._step, self.micro_override = eng["backward"], eng["step"], eng["micro_override"]

    def _engine(self, layout, hf: dict, seed: int, optim, local_mini: int) -> dict:
        """A training engine of ``layout`` (engine + tp/dp/zero_stage) over the whole world: the
        module to call, its VPS adapter, DP size/rank, and how to step it."""
        from rlhf_switch.engines.torch_train import build_fsdp2, build_tp, build_tp_dp, hf_model

        ranks = list(range(self.world))
        engine = layout.engine
        if engine in ("fsdp2", "torch_tp"):
            if engine == "fsdp2":
                t = build_fsdp2(hf, seed, ranks, optim=optim, timeout=TIMEOUT)
            elif layout.dp > 1:
                t = build_tp_dp(hf, seed, ranks, tp=layout.tp, optim=optim, timeout=TIMEOUT)
            else:
                t = build_tp(hf, seed, ranks, optim=optim, timeout=TIMEOUT)
            return {"module": t.module, "spec": t.spec, "adapter": t.adapter, "name": t.name, "dp": t.dp,
                    "dp_rank": t.dp_rank, "dp_group": t.dp_group, "backward": lambda loss: loss.backward(), "step": t.optimizer_step,
                    "micro_override": None}
        if engine == "deepspeed":
            from rlhf_switch.engines.deepspeed_zero import build_zero_trainer
            from rlhf_switch.vps import llama_spec

            if layout.zero_stage not in (1, 2, 3):
                raise ValueError(f"engine deepspeed needs zero_stage 1, 2 or 3, got {layout.zero_stage}")
            # one forward per optimizer step: the engine is built with gradient_accumulation_steps=1,
            # so its micro batch is the whole per-rank mini-batch
            module = hf_model(hf, seed)
            spec = llama_spec(module.config)
            z = build_zero_trainer(module, spec, layout.zero_stage, local_mini, ranks, optim=optim)
            eng = z.engine

            def step() -> float:
                eng.step()
                gn = eng.get_global_grad_norm() if hasattr(eng, "get_global_grad_norm") else None
                return float(gn) if gn is not None else float("nan")
            return {"module": eng, "spec": spec, "adapter": z.adapter, "name": z.adapter.name, "dp": z.dp,
                    "dp_rank": dist.get_rank(z.dp_group), "dp_group": z.dp_group, "backward": eng.backward, "step": step,
                    "micro_override": local_mini}
        raise NotImplementedError(f"engine={engine!r}: the loop trains with fsdp2, torch_tp or deepspeed")

    def _build_reference(self, cfg: RunConfig, hf: dict, init_dir: str, optim):
        """The reference policy in its own engine and layout (``cfg.reference``), holding the
        warm-start weights (a VPS move from rank 0's copy of ``init_dir``), frozen."""
        from rlhf_switch.engines.full_state import FullState
        from rlhf_switch.engines.train_state import gather_layouts
        from rlhf_switch.routing import move

        ref = self._engine(cfg.reference, hf, cfg.seed, optim, cfg.algorithm.rollout_batch_size // cfg.reference.dp)
        holder = FullState.load_dir(init_dir, ref["spec"], weights_only=True).weights() if self.rank == 0 else None
        mine = ref["adapter"].weights()
        (src, dst), _ = gather_layouts([(ref["spec"], holder) if holder else None, (ref["spec"], mine)],
                                       ["warm start", f"reference:{ref['name']}"])
        with torch.no_grad():
            move(src, dst, holder.tensors if holder else {}, mine.tensors, timeout=TIMEOUT)
        # (the forward reads exactly these buffers: ZeRO-1/2 bit16 flat groups, ZeRO-3 partitions
        # gathered at each forward, FSDP2/DTensor local shards; the reference never steps, so its
        # fp32 master copy is left alone)
        ref["module"].eval()
        return ref["module"], ref["name"]

    # --- state in and out: checkpoints through the VPS ---------------------------------------------
    def _load_state(self, path: str, weights_only: bool, adapter=None) -> dict:
        """Rank 0 reads the checkpoint at ``path`` whole; the VPS moves it into ``adapter``'s
        layout (default: the trainer's). ``weights_only``: a warm start — the engine keeps its
        own fresh step, LR schedule and RNG, and zero moments."""
        from rlhf_switch.engines.full_state import FullState
        from rlhf_switch.engines.train_switch import switch_training

        adapter = adapter or self.adapter
        holder = None
        if self.rank == 0:
            holder = FullState.load_dir(path, adapter.spec, weights_only=weights_only)
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
        parts = [(self.adapter, Path(path), hf_config_of(self.cfg), self.cfg.model.dtype)]
        if self.critic is not None:
            parts.append((self.critic.adapter, Path(path) / "critic", None, "float32"))
        for adapter, where, hf, dtype in parts:
            holder = FullState(adapter.spec, name=f"checkpoint {where}") if self.rank == 0 else None
            report = switch_training(adapter, holder, timeout=TIMEOUT)
            sent += report.move.bytes_sent
            if holder is not None:
                holder.save_dir(where, hf, dtype, extra)
        dist.barrier()
        return {"rank": self.rank, "seconds": time.perf_counter() - t0, "bytes_sent": sent}

    # --- phases ------------------------------------------------------------------------------------
    def sync_weights_to_rollout(self) -> dict:
        """VPS move: trainer compute weights -> this rank's rollout buffers. Returns the MoveReport."""
        from rlhf_switch.routing import move

        t0 = time.perf_counter()
        src = self._gather_weights_layout()
        dst = self.rollout.layout(self.replicas)
        report = move(src, dst, self._weights.tensors, self.rollout.buffers, timeout=TIMEOUT)
        out = dict(vars(report))
        out["wall_seconds"] = time.perf_counter() - t0
        return out

    def weights_layout(self):
        """The trainer's compute weights as a global Layout (collective; every rank gets it) —
        the source of a move into rollout engines that live in other processes."""
        src = self._gather_weights_layout()
        return src if self.rank == 0 else None

    def _gather_weights_layout(self):
        """This rank's compute weights (kept in ``self._weights`` for the move) and everyone's, as
        one global Layout (collective)."""
        from rlhf_switch.engines.train_state import gather_layouts

        self._weights = self.adapter.weights()
        (src,), _ = gather_layouts([(self.spec, self._weights)], [f"train:{self.engine_name}"])
        return src

    def send_weights(self, host: str, port: int, world_size: int, src, dst, budget_bytes: int,
                     timeout_s: float = 300.0) -> dict:
        """Join the move's gloo group (trainer ranks first, then the rollout workers) as this
        rank and send this rank's part of ``src`` (placed layouts, from the driver)."""
        from rlhf_switch.engines.vllm_rollout import send_to_workers

        t0 = time.perf_counter()
        report = send_to_workers(host, port, self.rank, world_size, src, dst, self._weights.tensors,
                                 budget_bytes, timeout_s)
        out = dict(vars(report))
        out["wall_seconds"] = time.perf_counter() - t0
        return out

    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float,
                 seeds: Sequence[int]) -> dict:
        """This rank's replica generates its contiguous share of ``prompts`` (all TP ranks of a
        replica return the same); only TP rank 0 of each replica returns its tokens. ``seeds``:
        one per prompt, so a sample does not depend on the rollout layout."""
        n = len(prompts)
        if n % self.replicas:
            raise ValueError(f"{n} sequences do not split over {self.replicas} rollout replicas")
        per = n // self.replicas
        lo, hi = self.replica * per, (self.replica + 1) * per
        t0 = time.perf_counter()
        tokens, logprobs = self.rollout.generate(prompts[lo:hi], max_new_tokens, temperature=temperature,
                                                 seed=list(seeds[lo:hi]), eos_token_id=self.eos_id)
        return {"replica": self.replica, "lead": self.tp_rank == 0, "tokens": tokens, "logprobs": logprobs,
                "seconds": time.perf_counter() - t0}

    def train_on(self, batch: dict) -> dict:
        """One GRPO or PPO update on the global ``batch`` (every rank gets all of it and takes its
        DP slice): stale-weights check, old and reference log-probs, then ``epochs`` passes in
        mini-batches of ``mini_batch_size`` sequences, micro-batches of ``micro_batch_size``.

        ``batch``: ``prompts``, ``responses`` (token ids), ``rollout_logprobs`` (per token) and
        either ``advantages`` (GRPO: one per sequence; the KL to the reference is in the loss) or
        ``scores`` (PPO: one per sequence; the critic's values, per-token rewards with the KL
        penalty and GAE give the advantages here, and the critic is updated on each mini-batch
        after the policy)."""
        alg, model = self.cfg.algorithm, self.model
        B = len(batch["prompts"])
        mini = alg.train_batch_size
        if B % mini or mini % self.dp:
            raise ValueError(f"batch {B}, mini-batch {mini} and DP {self.dp} do not divide")
        per = B // self.dp
        lo, hi = self.dp_rank * per, (self.dp_rank + 1) * per
        prompts, responses = batch["prompts"][lo:hi], batch["responses"][lo:hi]
        ids, targets, mask = _pad_batch(prompts, responses, self.pad_id)
        ppo = "scores" in batch
        if ppo and self.critic is None:
            raise ValueError("a PPO batch (scores) for a worker without a critic")
        rollout_lp = torch.zeros_like(mask)
        for b, lps in enumerate(batch["rollout_logprobs"][lo:hi]):
            p = len(prompts[b])
            rollout_lp[b, p - 1: p - 1 + len(lps)] = torch.tensor(lps, dtype=torch.float32)
        local_mini, micro = mini // self.dp, self.micro_override or alg.micro_batch_size
        micro = min(micro, local_mini)
        if local_mini % micro:
            raise ValueError(f"micro_batch_size {micro} does not divide the per-rank mini-batch {local_mini}")

        def chunks(n: int):
            return [slice(i, i + n) for i in range(0, per, n)]

        # old log-probs (the trainer's current weights = what was just synced) and the check
        t0 = time.perf_counter()
        with torch.no_grad():
            old_lp = torch.cat([_token_logprobs(model, ids[s], targets[s]) for s in chunks(micro)]) * mask
            ref_lp = (torch.cat([_token_logprobs(self.reference, ids[s], targets[s]) for s in chunks(micro)]) * mask
                      if self.reference is not None else old_lp)
        stale_diff = float(((old_lp - rollout_lp).abs() * mask).max()) if mask.any() else 0.0
        ppo_stats = {}
        if ppo:
            from rlhf_switch.rl.algorithms import ppo_batch

            values = self.critic.values(ids, micro_batch=micro) * mask
            scores = torch.tensor(batch["scores"][lo:hi], dtype=torch.float32)
            pb = ppo_batch(old_lp, ref_lp if self.reference is not None else None, values, scores, mask,
                           kl_coef=alg.kl_coef, kl_estimator=alg.kl_estimator, gamma=alg.gamma, lam=alg.lam,
                           whiten=alg.whiten_advantages, group=self.critic.dp_group)
            adv, returns = pb["advantages"], pb["returns"]
            ppo_stats = {"value_mean": float(masked_mean(values, mask)), "return_mean": float(masked_mean(returns, mask))}
        else:
            adv = torch.tensor(batch["advantages"][lo:hi], dtype=torch.float32)[:, None] * mask
        logprob_seconds = time.perf_counter() - t0

        # the update
        t0 = time.perf_counter()
        stats: dict[str, list[float]] = {"policy_loss": [], "kl": [], "clipfrac": [], "grad_norm": [],
                                         "vf_loss": [], "vf_clipfrac": []}
        for _ in range(alg.epochs):
            for m in chunks(local_mini):
                # each micro-batch's loss weighted by its share of the whole mini-batch across the
                # DP ranks (tokens for token-mean, sequences otherwise), times DP because the
                # engines average gradients over DP: the step is the one-process full-batch step
                # even when ranks and micro-batches hold different numbers of tokens
                total = _weight(mask[m], alg.loss_aggregation).double()
                if self.dp > 1:
                    dist.all_reduce(total, group=self.dp_group)
                scale = self.dp / max(float(total), 1.0)
                for s in range(m.start, m.stop, micro):
                    s = slice(s, s + micro)
                    lp = _token_logprobs(model, ids[s], targets[s])
                    pl, st = policy_loss(lp, old_lp[s], adv[s], mask[s], clip_eps=alg.clip_eps,
                                         clip_eps_high=alg.clip_eps_high, aggregation=alg.loss_aggregation)
                    loss = pl
                    kl = kl_penalty(lp, ref_lp[s], getattr(alg, "kl_estimator", "k3"))
                    kl_mean = aggregate(kl, mask[s], alg.loss_aggregation)
                    if alg.kl_coef > 0 and self.reference is not None and not ppo:  # PPO: KL is in the reward
                        loss = loss + alg.kl_coef * kl_mean
                    self._backward(loss * (_weight(mask[s], alg.loss_aggregation) * scale))
                    stats["policy_loss"].append(float(pl.detach()))
                    stats["kl"].append(float(kl_mean.detach()))
                    stats["clipfrac"].append(float(st["clipfrac"]))
                gn = self._step()
                if gn == gn:
                    stats["grad_norm"].append(gn)
                if ppo:
                    vs = self.critic.update(ids[m], mask[m], returns[m], values[m], clip_eps=alg.value_clip_eps,
                                            micro_batch=micro, aggregation=alg.loss_aggregation)
                    stats["vf_loss"].append(vs["vf_loss"])
                    stats["vf_clipfrac"].append(vs["vf_clipfrac"])
                self.train_steps += 1
        out = {k: (sum(v) / len(v) if v else float("nan")) for k, v in stats.items() if v or k not in ("vf_loss", "vf_clipfrac")}
        out.update(ppo_stats)
        out.update(stale_logprob_diff=stale_diff, logprob_seconds=logprob_seconds,
                   update_seconds=time.perf_counter() - t0, tokens=int(mask.sum()),
                   old_vs_ref_kl=float(masked_mean(kl_penalty(old_lp, ref_lp, "k3"), mask)) if mask.any() else 0.0,
                   steps=self.train_steps)
        return out

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def _weight(mask: torch.Tensor, aggregation: str) -> torch.Tensor:
    """How much a (micro-)batch counts in an aggregated loss: its tokens for ``token-mean``, its
    sequences with tokens for the ``seq-mean-*`` aggregations."""
    return mask.sum() if aggregation == "token-mean" else (mask.sum(-1) > 0).sum().float()


def hf_config_of(cfg: RunConfig) -> dict:
    """The model's ``LlamaConfig`` fields: the config's inline dict or ``model.path``'s config.json."""
    if cfg.model.hf_config is not None:
        return dict(cfg.model.hf_config)
    return json.loads((Path(cfg.model.path) / "config.json").read_text())


def _broadcast_objects(objs: list) -> list:
    dist.broadcast_object_list(objs, src=0)
    return objs


def remote_class(num_cpus: float, num_gpus: float = 1):
    """``HybridWorker`` as a Ray actor class with explicit resources (Ray's default 1 CPU would
    not fit a fractional bundle; ``num_gpus`` are logical devices on CPU machines)."""
    import ray

    return ray.remote(num_cpus=num_cpus, num_gpus=num_gpus)(HybridWorker)
