"""One rollout replica as a Ray actor: any rollout engine of placement ``replica`` (vLLM), built by
name through the registry, its workers joined to the run's weight channel once.

vLLM's own Ray executor is refused on CPU (PLATFORM.md), so each replica actor runs the engine's
own workers (vLLM's ``mp`` workers at TP > 1, its in-process ``uni`` worker at TP 1) inside
itself. The actor is colocated: it takes a fraction of its first device's bundle, beside the
hybrid workers' training engines. (On a GPU cluster a TP > 1 replica needs its workers pinned to
the bundle's devices — the actor would have to hand the engine those devices; on CPU there is
nothing to pin.)

The weight channel (``engines/channel.py``): the driver hands every member an ``Endpoint`` once —
trainer ranks ``0..n-1``, then replica ``r``'s workers ``n + r·tp ..`` — and each sync is
``channel_receive`` here (the workers write straight into the parameters their kernels read,
then the engine drops its prefix cache) while the trainer ranks send.
"""
from __future__ import annotations

import os
import time
from typing import Sequence


class RolloutReplica:
    def start(self, engine: str, ctx, gpu_ids: Sequence[str] | None = None) -> dict:
        """Build the rollout engine ``engine`` (a registered name or ``module:Class``) for ``ctx``
        (an ``engines.base.RolloutContext``). ``gpu_ids``: on CUDA, the devices its workers use
        (colocated: the whole devices of the trainer ranks it shares, ``cluster.resources``) —
        a Ray actor holds a share of one bundle's GPU only, so they are handed to it here, before
        the engine starts its worker processes."""
        from rlhf_switch.engines.base import rollout_engine

        if ctx.device.is_cuda and gpu_ids:  # not run here: no GPU in CI
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpu_ids))

        t0 = time.perf_counter()
        cls = rollout_engine(engine)
        if cls.placement != "replica":
            raise ValueError(f"rollout engine {engine!r} has placement {cls.placement!r}; a replica actor "
                             f"runs engines of placement 'replica'")
        self.replica, self.tp = ctx.replica, ctx.tp
        self.engine = cls.build(ctx)
        return {"replica": ctx.replica, "pid": os.getpid(), "seconds": time.perf_counter() - t0,
                "name": self.engine.name}

    def node(self) -> dict:
        """The Ray node this replica runs on — and so do its engine's workers: vLLM's ``mp``/``uni``
        workers are this actor's own processes (``engines.channel.node_of_this_process``)."""
        from rlhf_switch.engines.channel import node_of_this_process

        return node_of_this_process()

    def channel_destination(self, layout):
        """The engine's own form of the rollout layout ``layout`` (``RolloutEngine.channel_destination``);
        None where that is ``layout`` itself (nothing to send back)."""
        own = self.engine.channel_destination(layout)
        return None if own is layout else own

    def channel_open(self, endpoint) -> dict:
        t0 = time.perf_counter()
        self.engine.channel_open(endpoint)
        return {"replica": self.replica, "seconds": time.perf_counter() - t0}

    def channel_receive(self, version: int | None = None) -> dict:
        """One sync into this replica's engine; ``version``: the weights' version it now holds
        (what every sample it generates next records)."""
        t0 = time.perf_counter()
        answers = self.engine.channel_receive()
        self.version = version
        return {"replica": self.replica, "workers": answers, "wall_seconds": time.perf_counter() - t0}

    def channel_stats(self) -> dict:
        return {"replica": self.replica, "workers": self.engine.channel_stats(),
                "actor": {"open_fds": len(os.listdir("/proc/self/fd")), "os_threads": len(os.listdir("/proc/self/task"))}}

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float,
                 seeds: Sequence[int], stop_ids: Sequence[int]) -> dict:
        """``stop_ids``: every id that ends a response (the model's eos among them)."""
        t0 = time.perf_counter()
        tokens, logprobs = self.engine.generate(prompts, max_new_tokens, temperature, list(seeds), list(stop_ids))
        return {"replica": self.replica, "lead": True, "tokens": tokens, "logprobs": logprobs,
                "version": getattr(self, "version", None), "seconds": time.perf_counter() - t0}

    def shutdown(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            try:
                engine.channel_close()
            except Exception:  # noqa: BLE001 - best effort: the engine is shut down next
                pass
            engine.shutdown()
            self.engine = None


def remote_class(num_cpus: float, num_gpus: float):
    """``RolloutReplica`` as a Ray actor class with explicit resources."""
    import ray

    return ray.remote(num_cpus=num_cpus, num_gpus=num_gpus)(RolloutReplica)
