"""The colocated hybrid worker: one per logical device, a training engine and a rollout engine.

``HybridWorker`` is a plain class; the recipe makes it a Ray actor with ``ray.remote`` (see
``remote_class``), one actor per placement-group bundle. The workers form their own gloo world
(rank 0 opens a TCPStore on port 0 and the driver hands its real port to everyone), and on it:

- the training engine over all ranks: torch-native FSDP2 (``train.engine: fsdp2``) or DeepSpeed
  ZeRO-1/2/3 (``deepspeed``; one forward per optimizer step) — the actor
  whose weights are trained;
- the reference: a frozen, unsharded copy of the initial weights on every rank (tiny models only);
- the rollout engine: ``TorchRollout`` in vLLM's per-rank TP layout (``rollout.tp``), replicas =
  world / tp, each replica's ranks a TP group.

``sync_weights_to_rollout`` moves the trainer's compute weights (``adapter.weights()``, field
``param``) into the rollout engine's own buffers with the VPS (``routing.move``); the trainer
keeps its optimizer state in place (nothing to switch back on CPU). ``train_on`` first recomputes
the log-probs of the generated tokens with the trainer's model (the *old* log-probs) and compares
them with what the rollout engine reported — the stale-weights check — then runs the GRPO update.
"""
from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any, Sequence

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
    def build(self, config: dict | RunConfig) -> dict:
        from rlhf_switch.engines.optim import AdamWConfig
        from rlhf_switch.engines.torch_rollout import TorchRollout
        from rlhf_switch.engines.torch_train import build_fsdp2, hf_model

        cfg = config if isinstance(config, RunConfig) else load_config(config)
        self.cfg, alg = cfg, cfg.algorithm
        if cfg.model.hf_config is None:
            raise NotImplementedError("the hybrid worker builds models from model.hf_config only (no path yet)")
        if cfg.train.engine not in ("fsdp2", "deepspeed"):
            raise NotImplementedError(f"train.engine={cfg.train.engine!r}: this worker trains with fsdp2 or "
                                      f"deepspeed so far (torch_tp / torch_pp land later)")
        if cfg.rollout.engine != "torch":
            raise NotImplementedError(f"rollout.engine={cfg.rollout.engine!r}: this worker runs the torch "
                                      f"rollout engine only so far")
        if cfg.model.dtype != "float32":
            raise NotImplementedError("float32 only on CPU")
        hf = cfg.model.hf_config
        optim = AdamWConfig(lr=alg.lr, weight_decay=alg.weight_decay, max_grad_norm=alg.max_grad_norm or 0.0)
        ranks = list(range(self.world))
        self.micro_override = None
        if cfg.train.engine == "fsdp2":
            t = build_fsdp2(hf, cfg.seed, ranks, optim=optim, timeout=TIMEOUT)
            self.model, self.spec, self.adapter, self.engine_name = t.module, t.spec, t.adapter, t.name
            self.dp, self.dp_rank = t.dp, t.dp_rank
            self._backward = lambda loss: loss.backward()

            def step() -> float:
                gn = float("nan")
                if t._max_grad_norm > 0:  # DTensor gradients: the norm is the global one
                    gn = torch.nn.utils.clip_grad_norm_(t.module.parameters(), t._max_grad_norm, foreach=False)
                    gn = float(gn.full_tensor() if hasattr(gn, "full_tensor") else gn)
                t.optimizer.step()
                t.scheduler.step()
                t.optimizer.zero_grad(set_to_none=True)
                return gn
            self._step = step
        else:
            from rlhf_switch.engines.deepspeed_zero import build_zero_trainer
            from rlhf_switch.vps import llama_spec

            if cfg.train.zero_stage not in (1, 2, 3):
                raise ValueError(f"train.engine deepspeed needs zero_stage 1, 2 or 3, got {cfg.train.zero_stage}")
            # one forward per optimizer step: the engine is built with gradient_accumulation_steps=1,
            # so its micro batch is the whole per-rank mini-batch
            local_mini = alg.train_batch_size // self.world
            self.micro_override = local_mini
            module = hf_model(hf, cfg.seed)
            spec = llama_spec(module.config)
            z = build_zero_trainer(module, spec, cfg.train.zero_stage, local_mini, ranks, optim=optim)
            eng = z.engine
            self.model, self.spec, self.adapter, self.engine_name = eng, spec, z.adapter, z.adapter.name
            self.dp, self.dp_rank = z.dp, dist.get_rank(z.dp_group)
            self._backward = eng.backward

            def step() -> float:
                eng.step()
                gn = eng.get_global_grad_norm() if hasattr(eng, "get_global_grad_norm") else None
                return float(gn) if gn is not None else float("nan")
            self._step = step
        self.max_grad_norm = optim.max_grad_norm
        # the reference: the initial weights, frozen (same seed: identical to the trainer at step 0)
        self.reference = hf_model(hf, cfg.seed).eval().requires_grad_(False) if cfg.reference else None
        # rollout: replicas of TP=tp over consecutive ranks
        tp = cfg.rollout.tp
        self.tp, self.replicas = tp, self.world // tp
        groups = [dist.new_group(list(range(r, r + tp)), timeout=TIMEOUT) for r in range(0, self.world, tp)] \
            if tp > 1 else [None] * self.replicas
        self.replica, self.tp_rank = self.rank // tp, self.rank % tp
        from transformers import LlamaConfig

        self.rollout = TorchRollout.from_hf_config(self.spec, LlamaConfig(**hf), tp=tp,
                                                   tp_rank=self.tp_rank, group=groups[self.replica])
        self.pad_id = int(hf.get("pad_token_id") or 0)
        self.eos_id = hf.get("eos_token_id")
        self.train_steps = 0
        return {"rank": self.rank, "trainer": self.engine_name, "rollout": f"TorchRollout TP{tp}×{self.replicas}",
                "params": self.spec.numel}

    # --- phases ------------------------------------------------------------------------------------
    def sync_weights_to_rollout(self) -> dict:
        """VPS move: trainer compute weights -> this rank's rollout buffers. Returns the MoveReport."""
        from rlhf_switch.engines.train_state import gather_layouts
        from rlhf_switch.routing import move

        t0 = time.perf_counter()
        local = self.adapter.weights()
        (src,), _ = gather_layouts([(self.spec, local)], [f"train:{self.engine_name}"])
        dst = self.rollout.layout(self.replicas)
        report = move(src, dst, local.tensors, self.rollout.buffers, timeout=TIMEOUT)
        out = dict(vars(report))
        out["wall_seconds"] = time.perf_counter() - t0
        return out

    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float, seed: int) -> dict:
        """This rank's replica generates its contiguous share of ``prompts`` (all TP ranks of a
        replica return the same); only TP rank 0 of each replica returns its tokens."""
        n = len(prompts)
        if n % self.replicas:
            raise ValueError(f"{n} sequences do not split over {self.replicas} rollout replicas")
        per = n // self.replicas
        mine = prompts[self.replica * per:(self.replica + 1) * per]
        t0 = time.perf_counter()
        tokens, logprobs = self.rollout.generate(mine, max_new_tokens, temperature=temperature,
                                                 seed=seed + 7919 * self.replica, eos_token_id=self.eos_id)
        return {"replica": self.replica, "lead": self.tp_rank == 0, "tokens": tokens, "logprobs": logprobs,
                "seconds": time.perf_counter() - t0}

    def train_on(self, batch: dict) -> dict:
        """One GRPO update on the global ``batch`` (every rank gets all of it and takes its DP
        slice): stale-weights check, old and reference log-probs, then ``epochs`` passes in
        mini-batches of ``mini_batch_size`` sequences, micro-batches of ``micro_batch_size``.

        ``batch``: ``prompts``, ``responses`` (token ids), ``rollout_logprobs`` (per token) and
        ``advantages`` (one per sequence)."""
        alg, model = self.cfg.algorithm, self.model
        B = len(batch["prompts"])
        mini = alg.train_batch_size
        if B % mini or mini % self.dp:
            raise ValueError(f"batch {B}, mini-batch {mini} and DP {self.dp} do not divide")
        per = B // self.dp
        lo, hi = self.dp_rank * per, (self.dp_rank + 1) * per
        prompts, responses = batch["prompts"][lo:hi], batch["responses"][lo:hi]
        ids, targets, mask = _pad_batch(prompts, responses, self.pad_id)
        adv = torch.tensor(batch["advantages"][lo:hi], dtype=torch.float32)[:, None] * mask
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
        logprob_seconds = time.perf_counter() - t0

        # the update
        t0 = time.perf_counter()
        stats: dict[str, list[float]] = {"policy_loss": [], "kl": [], "clipfrac": [], "grad_norm": []}
        for _ in range(alg.epochs):
            for m in chunks(local_mini):
                n_micro = local_mini // micro
                for s in range(m.start, m.stop, micro):
                    s = slice(s, s + micro)
                    lp = _token_logprobs(model, ids[s], targets[s])
                    pl, st = policy_loss(lp, old_lp[s], adv[s], mask[s], clip_eps=alg.clip_eps,
                                         clip_eps_high=alg.clip_eps_high, aggregation=alg.loss_aggregation)
                    loss = pl
                    kl = kl_penalty(lp, ref_lp[s], getattr(alg, "kl_estimator", "k3"))
                    kl_mean = aggregate(kl, mask[s], alg.loss_aggregation)
                    if alg.kl_coef > 0 and self.reference is not None:
                        loss = loss + alg.kl_coef * kl_mean
                    self._backward(loss / n_micro)
                    stats["policy_loss"].append(float(pl.detach()))
                    stats["kl"].append(float(kl_mean.detach()))
                    stats["clipfrac"].append(float(st["clipfrac"]))
                gn = self._step()
                if gn == gn:
                    stats["grad_norm"].append(gn)
                self.train_steps += 1
        out = {k: (sum(v) / len(v) if v else float("nan")) for k, v in stats.items()}
        out.update(stale_logprob_diff=stale_diff, logprob_seconds=logprob_seconds,
                   update_seconds=time.perf_counter() - t0, tokens=int(mask.sum()),
                   old_vs_ref_kl=float(masked_mean(kl_penalty(old_lp, ref_lp, "k3"), mask)) if mask.any() else 0.0,
                   steps=self.train_steps)
        return out

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def remote_class(num_cpus: float, num_gpus: float = 1):
    """``HybridWorker`` as a Ray actor class with explicit resources (Ray's default 1 CPU would
    not fit a fractional bundle; ``num_gpus`` are logical devices on CPU machines)."""
    import ray

    return ray.remote(num_cpus=num_cpus, num_gpus=num_gpus)(HybridWorker)
