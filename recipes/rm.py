"""``rlhf-switch rm``: train a reward model from preference pairs (the Bradley–Terry loss).

    rlhf-switch rm configs/rm_tiny.yaml [--steps N] [--output-dir DIR] [--quiet]
    # or: python -m recipes.rm CONFIG ...

The config (``rl.reward_model.RewardModelRunConfig``, docs/reward-models.md) is checked before
anything starts (``rlhf_switch.problems.check_reward_training``: one error listing every
problem). Then, in order:

    pairs       the preference files read and tokenized as the loop will score rollouts
                (``<bos> prompt response <eos>``; pairs longer than the context dropped, counted)
    trunk       ``sft:`` — a causal LM taught the chosen responses in this process (cached in
                ``<output_dir>/init``), or ``model.path``'s weights, or the seeded model
    world       one Ray actor per device (``actors.reward_model.RewardModelTrainer``) on a
                placement group, as the loop places its workers; they form a gloo (nccl) world
                and build the ``train`` engine (fsdp2, deepspeed) with a value head
    steps       ``training.steps`` optimizer steps of ``training.batch_size`` pairs, each rank its
                DP share; held-out loss and pairwise accuracy before the first step, every
                ``training.eval_every`` steps and after the last
    save        ``<output_dir>/final``: the reward model the loop's ``reward.model_path`` takes

Why Ray actors and not ``rlhf_switch.launch.LocalWorld``: that is the tests' and benches'
world on one host; a training run of this project is Ray actors on placement-group bundles (the
loop's), which is what lets the same command run on a GPU node or a Ray cluster.

Output in ``output_dir``: ``final/`` (``config.json`` of the family's ``…ForTokenClassification``
with one label, ``model.safetensors``, the optimizer state, ``reward_model.json``, the tokenizer
files of an HF tokenizer), ``metrics.jsonl`` (one record per step: ``loss``, ``accuracy``,
``grad_norm``; per evaluation: ``heldout_loss``, ``heldout_accuracy``, ``heldout_margin``),
``config.yaml``.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from contextlib import ExitStack
from pathlib import Path

from rlhf_switch.timeouts import CONTROL_S, START_S

RM_DESCRIPTION = """\
Train a reward model from preference pairs (prompt, chosen, rejected) with the Bradley-Terry loss
on the project's training engines; the result (<output_dir>/final) is what a run's
reward.model_path takes.

  rlhf-switch rm configs/rm_tiny.yaml                 # 300 steps (training.steps)
  rlhf-switch rm configs/rm_tiny.yaml --steps 50 --output-dir runs/rm_quick"""


def prepare(config_source, steps: int | None = None, output_dir: str | None = None):
    """Load and check the config; everything that can be refused is refused here, before Ray."""
    from rlhf_switch.problems import check_reward_training
    from rlhf_switch.rl.reward_model import load_rm_config

    overrides = {"training.steps": int(steps)} if steps is not None else {}
    if output_dir:
        overrides["output_dir"] = str(output_dir)
    cfg = load_rm_config(config_source, overrides)
    check_reward_training(cfg)
    return cfg


# ---------------------------------------------------------------- the trunk


def _stamp(path: Path) -> list:
    return [str(path.resolve()), path.stat().st_size, path.stat().st_mtime_ns] if path.is_file() else [str(path)]


def trunk_start(cfg, tokenizer, train, out: Path, quiet: bool) -> str | None:
    """Where the reward model's trunk comes from: with ``sft:``, a causal LM (``model.path``'s
    weights or the seeded model) taught ``prompt → chosen`` on the train pairs in this process,
    saved to ``out/init`` and reused while its inputs are unchanged; else ``model.path`` when it
    holds weights; else None (the seeded trunk)."""
    import torch

    from rlhf_switch.rl.sft import initial_model, save_hf_checkpoint, sft
    from rlhf_switch.rl.tasks import Sample

    has_weights = cfg.model.path is not None and any(Path(cfg.model.path).glob("*.safetensors"))
    if cfg.sft is None or cfg.sft.steps == 0:
        return cfg.model.path if has_weights else None
    init = out / "init"
    files = [_stamp(Path(f)) for f in cfg.data.train_files]
    if has_weights:
        files += [_stamp(f) for f in sorted(Path(cfg.model.path).glob("*.safetensors"))]
    fp = {"hf_config": cfg.model.hf_dict(), "sft": cfg.sft.model_dump(), "seed": cfg.seed,
          "data": cfg.data.model_dump(), "files": files}
    digest = hashlib.sha256(json.dumps(fp, sort_keys=True, default=str).encode()).hexdigest()
    stamp = init / "rm_sft.json"
    if stamp.is_file() and json.loads(stamp.read_text()).get("digest") == digest:
        if not quiet:
            print(f"[rm] trunk: reusing {init}")
        return str(init)
    d = cfg.data
    samples = [Sample(tokenizer.render_prompt(p.prompt, True) if d.chat_template else p.prompt, p.chosen)
               for p in train.pairs]
    budget = max(len(tokenizer.encode(p.chosen, add_eos=True)) for p in train.pairs)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the loop's warm start: a tiny model gains nothing from more
    try:
        model = initial_model(cfg)
        stats = sft(model, None, cfg.sft, cfg.seed, progress=not quiet, max_new_tokens=budget, samples=samples,
                    tokenizer=tokenizer)
    finally:
        torch.set_num_threads(threads)
    stamp.unlink(missing_ok=True)
    save_hf_checkpoint(model, init)
    stamp.write_text(json.dumps({"digest": digest, "sft_stats": stats}, indent=2, sort_keys=True, default=str) + "\n")
    if not quiet:
        print(f"[rm] trunk: SFT on the chosen responses, {stats['steps']} steps, answer loss "
              f"{stats['loss_first']:.3f} -> {stats['loss_final']:.3f} ({stats['seconds']:.1f} s)")
    return str(init)


# ---------------------------------------------------------------- the world


def start_ray(cfg, verbose: bool = False):
    """Ray for this run, as the loop starts it (``recipes.cluster.start_ray``): the session already
    running in this process, the cluster at ``ray_address``, or an embedded one with
    ``world_size`` CPUs (and as many logical GPUs where the run resolves to cpu); the project's code
    reaches the actors in the job's ``runtime_env`` (``rlhf_switch.runtime_env``)."""
    import ray

    from recipes.cluster import quiet_default_token_auth_notice, session_env
    from rlhf_switch.device import cuda_available, resolve_device
    from rlhf_switch.runtime_env import job_runtime_env

    env = job_runtime_env(ship_code=bool(cfg.ray_address))
    if ray.is_initialized():
        session_env(ray, env)
        return ray, False
    if cfg.ray_address:
        ray.init(address=cfg.ray_address, runtime_env=env, log_to_driver=True)
    else:
        logical = resolve_device(cfg.device, cuda_available(), cfg.model.dtype).kind == "cpu"
        with quiet_default_token_auth_notice():
            ray.init(address="local", num_cpus=cfg.world_size, num_gpus=cfg.world_size if logical else None,
                     log_to_driver=verbose, include_dashboard=False, runtime_env=env)
    return ray, True


class RewardWorld:
    """The run's actors: one ``RewardModelTrainer`` per device, on a placement group of
    ``world_size`` bundles ``{CPU: 1, GPU: 1}`` (logical GPUs on CPU machines), in one world."""

    def __init__(self, cfg, ray, quiet: bool):
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from actors.reward_model import remote_class
        from rlhf_switch.problems import world_device

        self.ray, self.quiet, self.workers = ray, quiet, []
        n = cfg.world_size
        self.pg = placement_group([{"CPU": 1, "GPU": 1}] * n, strategy="PACK")
        try:
            ray.get(self.pg.ready(), timeout=CONTROL_S)  # pg.ready() can pend forever
            self.workers = [remote_class(1, 1).options(scheduling_strategy=PlacementGroupSchedulingStrategy(
                self.pg, placement_group_bundle_index=r)).remote() for r in range(n)]
            seen = ray.get([w.devices_seen.remote() for w in self.workers], timeout=START_S)
            self.device = world_device(cfg, all(s["cuda"] for s in seen))
            host, port = ray.get(self.workers[0].open_store.remote(), timeout=START_S)
            ray.get([w.init_world.remote(host, port, r, n, self.device) for r, w in enumerate(self.workers)],
                    timeout=START_S)
        except BaseException:
            self.shutdown(graceful=False)
            raise

    def all(self, method: str, *args, desc: str | None = None) -> list:
        """Every rank's call of ``method`` (the same arguments), waited for; the first failure raises."""
        from recipes.cluster import wait_all

        return wait_all(self.ray, [getattr(w, method).remote(*args) for w in self.workers], desc or method, True)

    def shutdown(self, graceful: bool = True) -> None:
        from ray.util.placement_group import remove_placement_group

        from recipes.cluster import stop_actors

        if graceful:
            stop_actors(self.ray, self.workers)
        else:
            for w in self.workers:
                self.ray.kill(w)
        self.workers = []
        remove_placement_group(self.pg)


# ---------------------------------------------------------------- the run


def batches(n: int, size: int, seed: int):
    """Index batches of ``size`` over ``n`` items, epoch by epoch, each epoch in an order fixed by
    ``seed`` (a batch may straddle two epochs)."""
    import torch

    gen = torch.Generator().manual_seed(int(seed))
    order: list[int] = []
    while True:
        picked = []
        while len(picked) < size:
            if not order:
                order.extend(torch.randperm(n, generator=gen).tolist())
            picked.append(order.pop())
        yield picked


def run(config_source, steps: int | None = None, output_dir: str | None = None, quiet: bool = False,
        verbose: bool = False) -> dict:
    """Train the reward model; returns ``{"final", "steps", "heldout_accuracy_before",
    "heldout_accuracy", "heldout_loss", "records"}`` (the records also in ``metrics.jsonl``)."""
    import yaml
    from tqdm import tqdm

    from rlhf_switch.families import context_length
    from rlhf_switch.rl.reward_model import load_preferences, rm_tokenizer, tokenizer_identity
    from rlhf_switch.rl.tasks import CharTokenizer

    t_start = time.perf_counter()
    cfg = prepare(config_source, steps, output_dir)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(), sort_keys=False))

    def say(msg: str) -> None:
        if not quiet:
            tqdm.write(f"[rm] {msg}")

    tok = rm_tokenizer(cfg)
    hf = cfg.model.hf_dict()
    max_ctx = context_length(hf)
    train, heldout = load_preferences(cfg, tok, max_ctx - 1)  # the scored position needs one more
    say(f"{len(train)} train pairs ({train.dropped} longer than the context dropped), {len(heldout)} held-out")
    init_from = trunk_start(cfg, tok, train, out, quiet)
    seq_len = 1 + max(len(s) for s in train.chosen + train.rejected + heldout.chosen + heldout.rejected)
    ray, owned = start_ray(cfg, verbose)
    world = None
    records: list[dict] = []
    stack = ExitStack()  # the metrics file and the progress bar, closed however the run ends
    try:
        world = RewardWorld(cfg, ray, quiet)
        built = world.all("build", cfg.model_dump(), init_from, tok.pad_id, seq_len)
        engine = built[0]['engine'].removeprefix('critic ')  # the engines call any value-head model a critic
        say(f"{cfg.world_size} ranks: {engine} with a value head ({built[0]['params']:,} params), trunk from "
            f"{init_from or 'the seeded model'}; ready in {time.perf_counter() - t_start:.1f} s")
        metrics = stack.enter_context((out / "metrics.jsonl").open("w"))

        def emit(rec: dict) -> None:
            records.append(rec)
            metrics.write(json.dumps(rec) + "\n")
            metrics.flush()

        def evaluate(step: int) -> dict:
            ev = world.all("evaluate", list(heldout.chosen), list(heldout.rejected), desc="held-out")[0]
            emit({"step": step, "heldout_loss": ev["loss"], "heldout_accuracy": ev["accuracy"],
                  "heldout_margin": ev["margin"], "heldout_pairs": ev["pairs"]})
            return ev

        t = cfg.training
        first = last_eval = evaluate(0)
        say(f"held-out before training: loss {first['loss']:.4f}, pairwise accuracy {first['accuracy']:.3f}")
        # the character tokenizer has no files: its tokens are written down; a HF one's files are copied
        identity = {"tokenizer": tokenizer_identity(tok) if isinstance(tok, CharTokenizer) else {"kind": "hf"},
                    "score": "the value at the last token of <bos> prompt response <eos>", "train_pairs": len(train)}
        kept = Kept(out, t.keep, world, identity, getattr(tok, "path", None))
        draw = batches(len(train), t.batch_size, cfg.seed)
        bar = stack.enter_context(tqdm(total=t.steps, desc="rm", unit="step", disable=quiet, dynamic_ncols=True))
        for step in range(1, t.steps + 1):
            idx = next(draw)
            st = world.all("train_step", [train.chosen[i] for i in idx], [train.rejected[i] for i in idx])[0]
            emit({"step": step, "loss": st["loss"], "accuracy": st["accuracy"], "grad_norm": st["grad_norm"],
                  "seconds": st["seconds"]})
            if step == t.steps or (t.eval_every and step % t.eval_every == 0):
                last_eval = evaluate(step)
                kept.evaluated(step, last_eval, last=step == t.steps)
            bar.update(1)
            bar.set_postfix(loss=f"{st['loss']:.4f}", acc=f"{st['accuracy']:.2f}",
                            heldout_acc=f"{last_eval['accuracy']:.3f}")
        bar.close()
        final, best = kept.finish(), kept.best
        say(f"held-out after {t.steps} steps: loss {last_eval['loss']:.4f}, pairwise accuracy "
            f"{last_eval['accuracy']:.3f} ({last_eval['pairs']} pairs)")
        say(f"reward model: {final}, the {t.keep} held-out evaluation's (step {best['step']}: pairwise accuracy "
            f"{best['accuracy']:.3f}) ({time.perf_counter() - t_start:.1f} s); metrics: {out / 'metrics.jsonl'}")
    finally:
        stack.close()
        if world is not None:
            world.shutdown()
        if owned:
            ray.shutdown()
    return {"final": str(final), "steps": t.steps, "heldout_accuracy_before": first["accuracy"],
            "heldout_accuracy": last_eval["accuracy"], "heldout_loss": last_eval["loss"], "kept_step": best["step"],
            "kept_heldout_accuracy": best["accuracy"], "kept_heldout_loss": best["loss"], "records": records}


class Kept:
    """The reward model a run keeps in ``<out>/final``: with ``keep: best``, the state of the
    evaluation with the highest held-out accuracy (ties: lower held-out loss, then the later step),
    saved to ``<out>/best`` as each such evaluation comes and moved to ``final`` at the end; with
    ``last``, the state after the last step."""

    def __init__(self, out: Path, keep: str, world, identity: dict, tokenizer_path):
        self.out, self.keep, self.world, self.identity, self.tok_path = out, keep, world, identity, tokenizer_path
        self.best: dict | None = None

    def evaluated(self, step: int, ev: dict, last: bool) -> None:
        better = self.best is None or (ev["accuracy"], -ev["loss"]) >= (self.best["accuracy"], -self.best["loss"])
        if self.keep == "last":
            if last:
                self._save(self.out / "final", step, ev)
        elif better:
            self._save(self.out / "best", step, ev)

    def _save(self, path: Path, step: int, ev: dict) -> None:
        self.best = {"step": step, "accuracy": ev["accuracy"], "loss": ev["loss"], "pairs": ev["pairs"]}
        info = {**self.identity, "step": step, "heldout_accuracy": ev["accuracy"], "heldout_loss": ev["loss"],
                "heldout_pairs": ev["pairs"], "steps": step}
        self.world.all("save", str(path), info, self.tok_path, desc="save")

    def finish(self) -> Path:
        final = self.out / "final"
        if self.keep == "best":
            import shutil

            shutil.rmtree(final, ignore_errors=True)
            (self.out / "best").rename(final)
        return final


def add_arguments(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    ap.add_argument("config", metavar="CONFIG", help="the reward model's YAML (docs/reward-models.md)")
    ap.add_argument("--steps", type=int, metavar="N", help="optimizer steps (default: the config's training.steps)")
    ap.add_argument("--output-dir", metavar="DIR",
                    help="where final/, metrics.jsonl and config.yaml go (default: the config's output_dir)")
    ap.add_argument("--quiet", action="store_true", help="no progress bar and no lines")
    ap.add_argument("--verbose", action="store_true", help="the actors' logs too")
    return ap


def run_args(a: argparse.Namespace) -> int:
    """Run with parsed options; the exit code (2: bad input)."""
    from rlhf_switch.rl.config import ConfigError
    from rlhf_switch.rl.data import DataError
    from rlhf_switch.rl.tokenizer import TokenizerError

    try:
        run(a.config, a.steps, a.output_dir, a.quiet, a.verbose)
    except (ConfigError, DataError, TokenizerError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m recipes.rm", description=RM_DESCRIPTION,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    return run_args(add_arguments(ap).parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
