"""What the GRPO and PPO recipes share: Ray and the colocated actors, the warm start, the weight
sync train -> rollout, generation, held-out evaluation, checkpoints, and the user's view
(per-phase progress bars, one line per iteration, JSONL + TensorBoard metrics, a PNG at the end).

The driver is Ray's single controller. ``Cluster`` owns the actors: one ``HybridWorker`` per
logical device (training engine, reference, and for ``rollout.engine: torch`` the rollout engine)
and, for ``rollout.engine: vllm``, one ``VLLMReplica`` per rollout replica, colocated on the same
placement-group bundles.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Sequence

REPO = str(Path(__file__).resolve().parents[1])


class StaleWeightsError(RuntimeError):
    """The rollout engine generated with weights other than the trainer's."""


def loop_problems(cfg) -> list[str]:
    """What the config asks for that this loop does not run (checked before anything starts)."""
    problems = []
    if cfg.train.engine not in ("fsdp2", "torch_tp", "deepspeed"):
        problems.append(f"train.engine: {cfg.train.engine!r} is not run by the loop yet (fsdp2, torch_tp, deepspeed)")
    if cfg.train.engine == "torch_tp" and cfg.train.pp > 1:
        problems.append("train: pipeline stages (pp > 1) are not run by the loop yet")
    if cfg.critic is not None:
        if cfg.critic.engine not in ("fsdp2", "deepspeed") or cfg.critic.tp > 1 or cfg.critic.pp > 1:
            problems.append(f"critic: the critic runs data parallel with fsdp2 or deepspeed (got {cfg.critic.engine}, "
                            f"tp={cfg.critic.tp}, pp={cfg.critic.pp})")
        elif cfg.critic.dp != cfg.train.dp:
            problems.append(f"critic: dp={cfg.critic.dp} must equal train.dp={cfg.train.dp} (the critic and the "
                            f"actor take the same share of each batch)")
    if cfg.model.dtype != "float32":
        problems.append(f"model.dtype: {cfg.model.dtype} — the CPU loop trains in float32")
    return problems


# --- Ray ------------------------------------------------------------------------------------------

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


# --- the warm start and held-out evaluation --------------------------------------------------------

def warm_start(cfg, out_dir: Path, quiet: bool = False) -> Path:
    """The checkpoint every engine starts from: the SFT warm start (``cfg.sft``) or the model's
    seeded initial weights, as a HF directory (cached by ``rlhf_switch.rl.sft``)."""
    import torch

    from rlhf_switch.rl.sft import warm_start as sft_warm_start

    # one thread: a tiny model gains nothing from more, and a 2-thread pool on a machine where
    # another process holds a core waits at every barrier (measured 20x slower SFT on 2 cores)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return Path(sft_warm_start(cfg, out_dir, progress=not quiet, log=None if quiet else print))
    finally:
        torch.set_num_threads(threads)


class Evaluator:
    """Greedy decoding of the first ``eval.num_prompts`` held-out prompts on the rollout engine
    (whatever weights it holds now), scored with the task's reward."""

    def __init__(self, cfg, splits, tokenizer, reward_fn, max_ctx: int):
        from rlhf_switch.rl.tasks import encode_prompt

        self.samples = list(splits.heldout[: cfg.eval.num_prompts])
        self.prompts = [encode_prompt(tokenizer, s.prompt, cfg.algorithm.max_new_tokens, max_ctx) for s in self.samples]
        self.cfg, self.tok, self.reward_fn = cfg, tokenizer, reward_fn

    def __call__(self, cluster: Cluster) -> float:
        from rlhf_switch.rl.rewards import score_samples

        tokens, _ = cluster.generate(self.prompts, [0] * len(self.prompts), self.cfg.algorithm.max_new_tokens, 0.0)
        texts = [self.tok.decode(t) for t in tokens]
        scores = score_samples(self.reward_fn, [s.prompt for s in self.samples], texts, [s.answer for s in self.samples])
        return sum(scores) / len(scores)


def draw_prompts(cfg, splits, iteration: int):
    """The iteration's prompts: a function of (seed, iteration) only, so a resumed run draws
    exactly what the uninterrupted one would have."""
    rng = random.Random(f"{cfg.algorithm.name}:{cfg.seed}:{iteration}")
    return rng.sample(list(splits.train), cfg.algorithm.prompts_per_iteration)


def sample_seeds(cfg, iteration: int, n: int) -> list[int]:
    """One sampling seed per sequence: independent of the rollout layout (TP, replicas)."""
    base = (cfg.seed * 1_000_003 + iteration) * 65_536
    return [base + i for i in range(n)]


# --- the user's view ---------------------------------------------------------------------------

class MetricsLog:
    """One JSONL record per iteration (and per evaluation), mirrored to TensorBoard."""

    def __init__(self, out_dir: Path, tensorboard: bool, append: bool):
        self.path = out_dir / "metrics.jsonl"
        if not append:
            self.path.write_text("")
            (out_dir / "rollouts.jsonl").write_text("")
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(out_dir / "tensorboard"))

    def write(self, rec: dict, step: int) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        if self.tb is not None:
            for k, v in rec.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "iteration":
                    self.tb.add_scalar(k, v, step)
            self.tb.flush()

    def write_rollouts(self, iteration: int, prompts, responses, logprobs, rewards) -> None:
        """Every generated sample of the iteration (token ids), in ``rollouts.jsonl``."""
        with (self.path.parent / "rollouts.jsonl").open("a") as f:
            f.write(json.dumps({"iteration": iteration, "prompts": prompts, "responses": responses,
                                "logprobs": logprobs, "rewards": list(rewards)}) + "\n")

    def records(self) -> list[dict]:
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def plot_run(records: list[dict], path: Path, title: str) -> Path | None:
    """reward (train samples and held-out) per iteration, and each iteration's time split into
    switch / generate / train."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    its = [r for r in records if "reward_mean" in r]
    evals = [r for r in records if "heldout_reward" in r]
    if not its:
        return None
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.plot([r["iteration"] for r in its], [r["reward_mean"] for r in its], label="rollout reward (train prompts)")
    if evals:
        a.plot([r["iteration"] for r in evals], [r["heldout_reward"] for r in evals], "o-", label="held-out greedy reward")
    a.set_xlabel("iteration")
    a.set_ylabel("reward")
    a.legend()
    a.grid(alpha=0.3)
    x = [r["iteration"] for r in its]
    bottom = [0.0] * len(its)
    for key, label in (("switch_train_to_rollout_s", "switch train→rollout"), ("gen_seconds", "generate"),
                       ("train_seconds", "train (log-probs + update)")):
        vals = [r.get(key, 0.0) for r in its]
        b.bar(x, vals, bottom=bottom, label=label)
        bottom = [p + v for p, v in zip(bottom, vals)]
    b.set_xlabel("iteration")
    b.set_ylabel("seconds")
    b.legend()
    b.set_title("time per iteration")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def prune_checkpoints(root: Path, keep: int) -> None:
    done = sorted((p for p in root.glob("step_*") if p.name[5:].isdigit()), key=lambda p: int(p.name[5:]))
    for p in done[:-keep]:
        shutil.rmtree(p, ignore_errors=True)


def resolve_resume(resume: str | bool | None, out_dir: Path) -> Path | None:
    """``--resume`` (the newest complete checkpoint of this run) or ``--resume DIR``."""
    from rlhf_switch.engines.full_state import is_checkpoint, latest_checkpoint

    if not resume:
        return None
    if resume is True or resume == "auto":
        found = latest_checkpoint(out_dir / "checkpoints")
        if found is None:
            raise FileNotFoundError(f"--resume: no complete checkpoint under {out_dir / 'checkpoints'}")
        return found
    path = Path(resume)
    if not is_checkpoint(path):
        raise FileNotFoundError(f"--resume {path}: not a complete checkpoint directory")
    return path


def fault(at: Sequence[int], iteration: int, what: str) -> None:
    """Fault injection for tests: a crash in the middle of iteration ``iteration``."""
    if iteration in at:
        raise RuntimeError(f"injected crash in iteration {iteration} ({what})")

