"""One vLLM rollout replica as a Ray actor: a real ``vllm.LLM`` of TP ``rollout.tp`` whose workers
receive the trainer's weights in place through the VPS.

vLLM's own Ray executor is refused on CPU (PLATFORM.md), so each replica actor runs vLLM's ``mp``
workers (TP > 1) or its in-process ``uni`` worker (TP 1) inside itself. The actor is colocated:
it takes a fraction of its first device's bundle, beside the hybrid workers' training engines.
(On a GPU cluster a TP > 1 replica needs its workers pinned to the bundle's devices — the actor
would have to hand vLLM those devices; on CPU there is nothing to pin.)

A weight sync (the driver orchestrates): every trainer rank and every worker of every replica
join one bare gloo group over a TCPStore the driver hosts — trainer ranks ``0..n-1``, then replica
``r``'s workers ``n + r·tp ..`` — and run one VPS move from the trainer's layout to
``vllm_layout(spec, tp, replicas)``. Each worker writes straight into the parameters its kernels
read (prepacking is disabled by the worker extension); afterwards the replica resets its prefix
cache. No process ever holds the whole model.
"""
from __future__ import annotations

import os
import time
from typing import Sequence

from rlhf_switch.compat import VLLM_ENV  # noqa: F401 - the drivers' vLLM environment, importable from here


class VLLMReplica:
    def start(self, model_dir: str, hf_config: dict, tp: int, seed: int, max_model_len: int,
              replica: int) -> dict:
        from rlhf_switch.engines.vllm_rollout import VLLMRollout
        from rlhf_switch.vps import llama_spec

        t0 = time.perf_counter()
        self.replica, self.tp = replica, tp
        self.engine = VLLMRollout(model_dir, llama_spec(hf_config), tp=tp, seed=seed, max_model_len=max_model_len)
        return {"replica": replica, "pid": os.getpid(), "seconds": time.perf_counter() - t0,
                "workers": len(self.engine.description)}

    def receive(self, host: str, port: int, first_rank: int, world_size: int, src, dst,
                budget_bytes: int, timeout_s: float = 300.0) -> dict:
        t0 = time.perf_counter()
        answers = self.engine.receive(host, port, first_rank, world_size, src, dst,
                                      budget_bytes=budget_bytes, timeout_s=timeout_s)
        return {"replica": self.replica, "workers": answers, "wall_seconds": time.perf_counter() - t0}

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float,
                 seeds: Sequence[int], eos_token_id: int | None) -> dict:
        t0 = time.perf_counter()
        tokens, logprobs = self.engine.generate(prompts, max_new_tokens, greedy=temperature == 0,
                                                seed=list(seeds), temperature=temperature or 1.0,
                                                eos_token_id=eos_token_id)
        return {"replica": self.replica, "lead": True, "tokens": tokens, "logprobs": logprobs,
                "seconds": time.perf_counter() - t0}

    def shutdown(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
            self.engine = None


def remote_class(num_cpus: float, num_gpus: float):
    """``VLLMReplica`` as a Ray actor class with explicit resources."""
    import ray

    return ray.remote(num_cpus=num_cpus, num_gpus=num_gpus)(VLLMReplica)
