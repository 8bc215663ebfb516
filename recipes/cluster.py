"""The actors of one run and the phases that involve all of them, on Ray.

The driver is Ray's single controller. ``Cluster`` owns the actors: one ``HybridWorker`` per
logical device (training engine, reference, and for ``rollout.engine: torch`` the rollout engine)
and, for ``rollout.engine: vllm``, one ``VLLMReplica`` per rollout replica, colocated on the same
placement-group bundles. ``Cluster.sync`` is the weight switch train -> rollout through the VPS.
"""
from __future__ import annotations

import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Sequence

REPO = str(Path(__file__).resolve().parents[1])


def start_ray(cfg, world: int):
    """Ray for this run: the session already running in this process (tests share one per
    module), the cluster at ``ray_address``, or an embedded one. Returns (ray, owned)."""
    import ray

    # the actors must import this checkout's packages; vLLM's environment is read when it starts
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if REPO not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([REPO] + paths)
    if cfg.rollout.engine == "vllm":
        from actors.vllm_replica import VLLM_ENV

        for k, v in VLLM_ENV.items():
            os.environ.setdefault(k, v)
    if ray.is_initialized():
        return ray, False
    if cfg.ray_address:
        ray.init(address=cfg.ray_address, log_to_driver=True)
    else:  # never join a stale cluster on the machine
        ray.init(address="local", num_cpus=world, num_gpus=world, log_to_driver=True, include_dashboard=False)
    return ray, True


@contextmanager
def phase(desc: str, total: int, quiet: bool):
    """A progress bar for one phase of an iteration (``update`` per finished actor call)."""
    from tqdm import tqdm

    bar = tqdm(total=total, desc=desc, leave=False, disable=quiet, dynamic_ncols=True)
    try:
        yield bar
    finally:
        bar.close()


def wait_all(ray, refs: list, desc: str, quiet: bool, timeout: float = 900) -> list:
    """``ray.get`` of ``refs`` in order, with a progress bar that advances as each finishes; the
    first failure is raised at once (the others are not waited for)."""
    pending = list(refs)
    deadline = time.monotonic() + timeout
    with phase(desc, len(refs), quiet) as bar:
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not done:
                raise TimeoutError(f"{desc}: {len(pending)} of {len(refs)} actor calls unfinished after {timeout} s")
            ray.get(done)  # raises the actor's error here
            bar.update(len(done))
    return ray.get(refs)


class Cluster:
    """The actors of one run and the phases that involve all of them."""

    def __init__(self, cfg, ray, quiet: bool = False):
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from actors.hybrid import remote_class

        from actors.hybrid import hf_config_of

        self.cfg, self.quiet, self.ray = cfg, quiet, ray
        self.hf = hf_config_of(cfg)
        self.world = world = cfg.world_size
        self.workers, self.replicas = [], []
        self.pg = placement_group([{"CPU": 1, "GPU": 1}] * world, strategy="PACK")
        ray.get(self.pg.ready(), timeout=120)  # pg.ready() can pend forever

        def on(bundle: int):
            return PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=bundle)

        # colocation: the hybrid worker and (with vLLM) a rollout replica share each device
        cls = remote_class(num_cpus=0.5, num_gpus=0.5)
        self.workers = [cls.options(scheduling_strategy=on(i)).remote() for i in range(world)]
        self.vllm = cfg.rollout.engine == "vllm"
        self.tp, self.n_replicas = cfg.rollout.tp, world // cfg.rollout.tp
        if self.vllm:
            from actors.vllm_replica import remote_class as replica_class

            rcls = replica_class(num_cpus=0.4, num_gpus=0.5)
            self.replicas = [rcls.options(scheduling_strategy=on(r * self.tp)).remote() for r in range(self.n_replicas)]
        port = ray.get(self.workers[0].open_store.remote(), timeout=180)
        ray.get([w.init_world.remote("127.0.0.1", port, r, world) for r, w in enumerate(self.workers)], timeout=180)

    def all(self, method: str, *args, desc: str | None = None, **kwargs) -> list:
        refs = [getattr(w, method).remote(*args, **kwargs) for w in self.workers]
        return wait_all(self.ray, refs, desc or method, self.quiet)

    def build(self, init_dir: Path, resume_dir: Path | None) -> dict:
        """Build every engine; vLLM replicas start (from ``init_dir``) while the trainers build."""
        hf = self.hf
        starts = [r.start.remote(str(init_dir), hf, self.tp, self.cfg.seed, int(hf.get("max_position_embeddings", 2048)), i)
                  for i, r in enumerate(self.replicas)]
        built = self.all("build", self.cfg.model_dump(), str(init_dir), str(resume_dir) if resume_dir else None,
                         desc="build engines")
        if starts:
            wait_all(self.ray, starts, "start vLLM", self.quiet)
        return built[0]

    # --- the switch train -> rollout --------------------------------------------------------------
    def sync(self, budget_bytes: int | None = None) -> dict:
        """Move the trainer's weights into the rollout engine(s); returns seconds and bytes."""
        from rlhf_switch.routing.executor import DEFAULT_BUDGET

        budget = budget_bytes or DEFAULT_BUDGET
        t0 = time.perf_counter()
        if not self.vllm:
            reports = self.all("sync_weights_to_rollout", desc="sync weights")
            moved = sum(r["bytes_sent"] + r["bytes_local"] for r in reports)
            return {"seconds": time.perf_counter() - t0, "bytes_moved": moved,
                    "bytes_sent": sum(r["bytes_sent"] for r in reports)}
        import torch.distributed as dist

        from rlhf_switch.vps.layouts.vllm import vllm_layout
        from rlhf_switch.vps.placement import place

        src = next(x for x in self.all("weights_layout", desc="describe weights") if x is not None)
        n, total = self.world, self.world + self.n_replicas * self.tp
        src_p = place(src, range(n), total)
        dst_p = place(vllm_layout(src.spec, self.tp, self.n_replicas), range(n, total), total)
        store = dist.TCPStore("127.0.0.1", 0, total + 1, is_master=True, wait_for_workers=False)
        refs = [r.receive.remote("127.0.0.1", store.port, n + i * self.tp, total, src_p, dst_p, budget)
                for i, r in enumerate(self.replicas)]
        refs += [w.send_weights.remote("127.0.0.1", store.port, total, src_p, dst_p, budget) for w in self.workers]
        out = wait_all(self.ray, refs, "sync weights -> vLLM", self.quiet)
        del store
        senders = out[len(self.replicas):]
        return {"seconds": time.perf_counter() - t0,
                "bytes_moved": sum(r["bytes_sent"] + r["bytes_local"] for r in senders),
                "bytes_sent": sum(r["bytes_sent"] for r in senders)}

    # --- generation -------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], seeds: Sequence[int], max_new_tokens: int,
                 temperature: float) -> tuple[list[list[int]], list[list[float]]]:
        """Every prompt's response and its per-token log-probs, in prompt order; each replica
        takes a contiguous share, each sample its own seed."""
        if self.vllm:
            R, n = self.n_replicas, len(prompts)
            if n % R:
                raise ValueError(f"{n} prompts do not split over {R} vLLM replicas")
            per = n // R
            eos = self.hf.get("eos_token_id")
            refs = [r.generate.remote(prompts[i * per:(i + 1) * per], max_new_tokens, temperature,
                                      list(seeds[i * per:(i + 1) * per]), eos) for i, r in enumerate(self.replicas)]
            gens = wait_all(self.ray, refs, "generate (vLLM)", self.quiet)
        else:
            gens = self.all("generate", prompts, max_new_tokens, temperature, list(seeds), desc="generate")
        leads = sorted((g for g in gens if g["lead"]), key=lambda g: g["replica"])
        return [t for g in leads for t in g["tokens"]], [lp for g in leads for lp in g["logprobs"]]

    def save(self, path: Path, extra: dict) -> float:
        t0 = time.perf_counter()
        self.all("save_checkpoint", str(path), extra, desc=f"save {path.name}")
        return time.perf_counter() - t0

    def shutdown(self, graceful: bool = True) -> None:
        """Stop the engines and free the actors and their placement group (a shared Ray session
        goes on; an owned one is shut down by the recipe)."""
        from ray.util.placement_group import remove_placement_group

        ray = self.ray
        if graceful:
            try:
                if self.replicas:
                    ray.get([r.shutdown.remote() for r in self.replicas], timeout=60)
                ray.get([w.shutdown.remote() for w in self.workers], timeout=60)
            except Exception:  # noqa: BLE001 - best effort: the actors are killed next
                pass
        for a in self.replicas + self.workers:
            ray.kill(a)
        self.replicas, self.workers = [], []
        remove_placement_group(self.pg)
