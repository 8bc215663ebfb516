"""Reward models on the training engines: training one (``rlhf-switch rm``) and scoring with one
(the loop's reward phase, ``HybridWorker.reward_scores``).

The model is the family's value model (``rlhf_switch.models.value_model``: ``…ForTokenClassification``,
one label — the PPO critic's model, the engines' ``head="value"``) and its score of a sequence is
its value at the sequence's last token (``rl.reward_model.last_token_batch``). Nothing here is a
new model path: the engines build, shard and step it as they do the critic.

- ``RewardModelTrainer``: one rank of ``rlhf-switch rm``'s world, a Ray actor (``remote_class``)
  like the loop's hybrid workers: it joins the world, builds the training engine of the run's
  ``train`` layout, and per optimizer step takes its DP share of the global batch of pairs and
  minimises the Bradley–Terry loss ``-log σ(r(chosen) - r(rejected))`` (the mean over the global
  batch: each micro-batch's sum weighted by ``dp / pairs``, the engines average over DP);
  ``evaluate`` is the same loss and the pairwise accuracy on held-out pairs, no gradients;
  ``save`` moves the whole state to rank 0 through the VPS, which writes the reward model
  directory (``config.json`` of ``…ForTokenClassification`` with one label, ``model.safetensors``,
  the optimizer beside it, ``reward_model.json``, the tokenizer files when it has some).
- ``score_share``: a frozen value engine's scores of its DP share of a list of sequences.
- ``reward_model_weights``: a reward model directory as a ``FullState`` of the value model's spec —
  a ``…ForSequenceClassification`` directory (no ``score.bias``) reads with a zero bias, the
  same scores.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Sequence

import torch
import torch.distributed as dist

from rlhf_switch.device import CPU, DeviceSpec
from rlhf_switch.engines.base import DEFAULT_TIMEOUT as TIMEOUT
from rlhf_switch.rl.reward_model import (REWARD_MODEL_FILE, bradley_terry, interleave, last_token_batch,
                                         scores_at_last)


def dp_share(n: int, dp: int, dp_rank: int) -> tuple[int, int, int]:
    """``(lo, hi, per)``: DP rank ``dp_rank``'s contiguous share of ``n`` items padded up to a
    multiple of ``dp`` (``per`` items each; indexes ``>= n`` are padding)."""
    per = -(-n // dp)
    return dp_rank * per, (dp_rank + 1) * per, per


def _padded(items: Sequence, lo: int, hi: int) -> list:
    """``items[lo:hi]``, filled up to ``hi - lo`` with copies of ``items[0]`` (padding rows every
    DP rank must still run: the engines' forwards are collective)."""
    mine = list(items[lo:hi])
    return mine + [items[0]] * (hi - lo - len(mine))


def score_share(engine, seqs: Sequence[Sequence[int]], pad_id: int, device=None) -> list[float]:
    """The scores (value at the last token) of this DP rank's share of ``seqs``, padding dropped;
    collective over the engine's ranks (every rank calls it with the same ``seqs``)."""
    # no_grad as a block, not a decorator: mutation testing (mutmut) skips decorated functions
    with torch.no_grad():
        lo, hi, _ = dp_share(len(seqs), engine.dp, engine.dp_rank)
        ids, last = last_token_batch(_padded(seqs, lo, hi), pad_id)
        if device is not None:
            ids = ids.to(device)
        scores = scores_at_last(engine.outputs(ids), last).float().cpu()
        return scores[:max(0, min(hi, len(seqs)) - lo)].tolist()


def reward_model_weights(path: str | os.PathLike, spec):
    """The weights of the reward model directory ``path`` (every top-level ``*.safetensors``) as a
    ``FullState`` of the value model's ``spec``. A ``…ForSequenceClassification`` directory has
    no ``score.bias``: it reads as a zero bias (that class adds none). Anything else missing,
    misshapen or extra is one ``ValueError`` naming it."""
    from safetensors.torch import load_file

    from rlhf_switch.engines.full_state import IGNORED_WEIGHTS, FullState

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors (a reward model directory holds its weights)")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(load_file(str(f)))
    weights = {k: v for k, v in weights.items() if not k.endswith(IGNORED_WEIGHTS)}
    if "score.bias" in spec and "score.bias" not in weights and "score.weight" in weights:
        weights["score.bias"] = torch.zeros(spec["score.bias"].shape)
    problems = [f"{t.name} {list(t.shape)} is missing" for t in spec.tensors if t.name not in weights]
    problems += [f"{t.name} has shape {list(weights[t.name].shape)}, the model's is {list(t.shape)}"
                 for t in spec.tensors if t.name in weights and tuple(weights[t.name].shape) != tuple(t.shape)]
    extra = sorted(k for k in weights if k not in spec)
    if extra:
        problems.append(f"unexpected tensors: {', '.join(extra[:5])}")
    if problems:
        raise ValueError(f"{path} does not hold the reward model its config.json describes: " + "; ".join(problems))
    return FullState(spec, weights, name=f"reward model {path}")


class RewardModelTrainer:
    """One rank of ``rlhf-switch rm`` (call every method on every rank, concurrently)."""

    def __init__(self):
        self._store = None
        self.rank = self.world = None
        self.device = CPU
        self.engine = None

    # --- the world (as the loop's hybrid workers form theirs) -------------------------------------
    def devices_seen(self) -> dict:
        from rlhf_switch.device import cuda_available

        return {"cuda": cuda_available()}

    def open_store(self) -> tuple[str, int]:
        """Rank 0 only: the world's TCPStore on a free port of this node."""
        from rlhf_switch.engines.channel import open_store

        self._store, host, port = open_store(TIMEOUT.total_seconds())
        return host, port

    def init_world(self, host: str, port: int, rank: int, world: int, device: DeviceSpec = CPU) -> dict:
        torch.set_num_threads(1)
        store = self._store or dist.TCPStore(host, port, is_master=False, timeout=TIMEOUT)
        self._store, self.device = store, device
        dist.init_process_group(device.backend, store=store, rank=rank, world_size=world, timeout=TIMEOUT)
        self.rank, self.world = rank, world
        return {"rank": rank, "pid": os.getpid()}

    # --- the engine --------------------------------------------------------------------------------
    def build(self, config: dict, init_from: str | None, pad_id: int, seq_len: int) -> dict:
        """The training engine of ``config``'s ``train`` layout with a value head over the whole
        world; its trunk from ``init_from`` (a checkpoint directory's ``model.*``; None: seeded)."""
        from rlhf_switch.engines.base import TrainingContext, training_engine
        from rlhf_switch.engines.optim import AdamWConfig
        from rlhf_switch.rl.reward_model import RewardModelRunConfig

        cfg = RewardModelRunConfig.model_validate(config)
        t = cfg.training
        self.cfg, self.pad_id, self.hf = cfg, int(pad_id), cfg.model.hf_dict()
        optim = AdamWConfig(lr=t.lr, weight_decay=t.weight_decay, warmup_steps=t.warmup_steps,
                            max_grad_norm=t.max_grad_norm or 0.0)
        # a row is one sequence: micro_batch_size pairs are 2·micro_batch_size rows per forward
        ctx = TrainingContext(self.hf, cfg.seed, tuple(range(self.world)), optim, micro_batch=2 * t.micro_batch_size,
                              seq_len=seq_len, head="value", init_from=init_from, timeout=TIMEOUT, device=self.device)
        t0 = time.perf_counter()
        self.engine = training_engine(cfg.train.engine).build(cfg.train, ctx)
        return {"rank": self.rank, "engine": self.engine.name, "params": self.engine.spec.numel,
                "seconds": time.perf_counter() - t0}

    def _pairs(self, chosen: Sequence, rejected: Sequence) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """This DP rank's share of the global pairs as interleaved rows ``[c, r, c, r, …]``:
        ``ids``, ``last`` and a weight per pair (0 for padding), and the global pair count."""
        n = len(chosen)
        lo, hi, _ = dp_share(n, self.engine.dp, self.engine.dp_rank)
        rows = interleave(_padded(chosen, lo, hi), _padded(rejected, lo, hi))
        ids, last = last_token_batch(rows, self.pad_id)
        weight = torch.tensor([1.0 if lo + i < n else 0.0 for i in range(hi - lo)])
        return ids.to(self.device.torch_device()), last, weight, n

    def _global(self, sums: list[float]) -> list[float]:
        t = torch.tensor(sums, dtype=torch.float64, device=self.device.torch_device())
        if self.engine.dp > 1:
            dist.all_reduce(t, group=self.engine.dp_group)
        return t.cpu().tolist()

    def train_step(self, chosen: list, rejected: list) -> dict:
        """One optimizer step on the global batch of pairs ``(chosen[i], rejected[i])`` (token
        ids), this rank taking its DP share. Returns the batch's mean loss and pairwise accuracy
        (global) and the gradient norm before clipping."""
        t0 = time.perf_counter()
        ids, last, weight, n = self._pairs(chosen, rejected)
        scale = self.engine.dp / n  # the engines average gradients over DP: the global mean

        def loss_fn(values: torch.Tensor, s: slice):
            r = scores_at_last(values, last[s])
            w = weight[s.start // 2:s.stop // 2].to(r.device)  # rows 2k, 2k+1 are pair k
            loss, right = bradley_terry(r[0::2], r[1::2])
            return (loss * w).sum() * scale, {"loss": float((loss.detach() * w).sum()),
                                               "right": float((right * w).sum())}

        micro = 2 * self.cfg.training.micro_batch_size
        step = self.engine.train_step(ids, micro, loss_fn)
        loss, right = self._global([sum(s["loss"] for s in step["stats"]), sum(s["right"] for s in step["stats"])])
        return {"loss": loss / n, "accuracy": right / n, "grad_norm": step["grad_norm"], "pairs": n,
                "seconds": time.perf_counter() - t0}

    def evaluate(self, chosen: list, rejected: list) -> dict:
        """The mean Bradley–Terry loss and the pairwise accuracy (``r(chosen) > r(rejected)``) of
        the pairs, no gradients; every rank gets the global numbers."""
        with torch.no_grad():  # a block, not a decorator: mutmut skips decorated functions
            ids, last, weight, n = self._pairs(chosen, rejected)
            r = scores_at_last(self.engine.outputs(ids), last).float().cpu()
            loss, right = bradley_terry(r[0::2], r[1::2])
            margin = r[0::2] - r[1::2]
        loss, right, margin = self._global([float((loss * weight).sum()), float((right * weight).sum()),
                                            float((margin * weight).sum())])
        return {"loss": loss / n, "accuracy": right / n, "margin": margin / n, "pairs": n}

    @torch.no_grad()
    def scores(self, seqs: list) -> dict:
        """The model's score of every sequence of ``seqs`` (this rank's DP share; ``dp_rank`` says
        which)."""
        return {"dp_rank": self.engine.dp_rank,
                "scores": score_share(self.engine, seqs, self.pad_id, self.device.torch_device())}

    def save(self, path: str, info: dict, tokenizer_from: str | None = None) -> dict:
        """The reward model directory at ``path``: the whole state moved to rank 0 through the VPS
        (weights, Adam moments, step), ``config.json`` of the family's ``…ForTokenClassification``
        with one label, ``reward_model.json`` (``info``: its tokenizer and how it reads its
        score), the tokenizer files from ``tokenizer_from``."""
        from rlhf_switch.engines.full_state import FullState
        from rlhf_switch.engines.train_switch import switch_training

        t0 = time.perf_counter()
        adapter = self.engine.adapter
        holder = FullState(adapter.spec, name=f"reward model {path}").to(self.device.torch_device()) \
            if self.rank == 0 else None
        switch_training(adapter, holder, timeout=TIMEOUT)
        if holder is not None:
            holder.save_dir(path, self.hf, "float32", extra={"reward_model": True}, tokenizer_from=tokenizer_from,
                            head="value", files={REWARD_MODEL_FILE: json.dumps(info, indent=2, sort_keys=True) + "\n"})
        dist.barrier()
        return {"rank": self.rank, "seconds": time.perf_counter() - t0}

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def remote_class(num_cpus: float = 1, num_gpus: float = 1):
    """``RewardModelTrainer`` as a Ray actor class with explicit resources (as the loop's
    ``actors.hybrid.remote_class``: ``num_gpus`` are logical devices on CPU machines)."""
    import ray

    return ray.remote(num_cpus=num_cpus, num_gpus=num_gpus)(RewardModelTrainer)
