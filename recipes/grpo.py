"""GRPO, driven by one Ray controller over colocated hybrid workers.

    python -m recipes.grpo configs/grpo_tiny_fsdp.yaml [--iterations N] [--output-dir DIR]

Per iteration: sync weights train -> rollout (VPS move) -> generate G samples per prompt ->
rewards -> group advantages -> train (the stale-weights check first: the trainer's log-probs of the
generated tokens must equal the rollout engine's within ``--stale-tol``) -> one line and one JSONL
record in ``<output_dir>/metrics.jsonl``.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

REPO = str(Path(__file__).resolve().parents[1])


class StaleWeightsError(RuntimeError):
    pass


def _start_ray(cfg, world: int):
    import ray

    # the actors must import this checkout's packages
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if REPO not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([REPO] + paths)
    if cfg.ray_address:
        ray.init(address=cfg.ray_address, log_to_driver=True)
    else:  # never join a stale cluster on the machine
        ray.init(address="local", num_cpus=world, num_gpus=world, log_to_driver=True,
                 include_dashboard=False)
    return ray


def create_workers(ray, world: int, cpus_per_worker: float = 0.5):
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from actors.hybrid import remote_class

    pg = placement_group([{"CPU": 1, "GPU": 1}] * world, strategy="PACK")
    ray.get(pg.ready(), timeout=120)  # pg.ready() can pend forever
    cls = remote_class(num_cpus=cpus_per_worker, num_gpus=1)
    workers = [cls.options(scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)).remote()
               for i in range(world)]
    port = ray.get(workers[0].open_store.remote(), timeout=180)
    infos = ray.get([w.init_world.remote("127.0.0.1", port, r, world) for r, w in enumerate(workers)], timeout=180)
    return workers, pg, infos


def _all(ray, calls, timeout=600):
    return ray.get(calls, timeout=timeout)


def run(config_source, iterations: int | None = None, output_dir: str | None = None,
        stale_tol: float = 1e-4, quiet: bool = False, skip_sync_at: tuple[int, ...] = ()) -> list[dict]:
    """Run the loop; returns the per-iteration records (also in ``<output_dir>/metrics.jsonl``).
    ``skip_sync_at``: fault injection for tests — iterations that generate WITHOUT syncing the
    weights first, which the stale-weights check must catch."""
    from rlhf_switch.rl.algorithms import grpo_advantages
    from rlhf_switch.rl.config import check_fits, load_config
    from rlhf_switch.rl.rewards import load_reward_fn, score_samples
    from rlhf_switch.rl.tasks import CharTokenizer, build_task, encode_prompt, make_splits

    cfg = load_config(config_source)
    if output_dir:
        cfg.output_dir = output_dir
    check_fits(cfg)
    alg = cfg.algorithm
    if alg.name != "grpo":
        raise SystemExit(f"recipes.grpo runs algorithm grpo, the config names {alg.name!r}")
    iterations = iterations or alg.iterations
    world = cfg.world_size
    out_dir = Path(cfg.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    metrics_path = out_dir / "metrics.jsonl"
    metrics_path.write_text("")

    tok = CharTokenizer()
    task = build_task(cfg.task.name, cfg.task.min_len, cfg.task.max_len)
    splits = make_splits(task, cfg.task.num_train, cfg.task.num_heldout, cfg.task.seed)
    reward_fn = load_reward_fn(cfg.task.reward_fn)
    max_ctx = int(cfg.model.hf_config["max_position_embeddings"])
    rng = random.Random(f"grpo:{cfg.seed}")

    def say(msg: str) -> None:
        if not quiet:
            print(msg, flush=True)

    t_start = time.perf_counter()
    ray = _start_ray(cfg, world)
    records = []
    try:
        workers, _pg, _ = create_workers(ray, world)
        built = _all(ray, [w.build.remote(cfg.model_dump()) for w in workers])
        say(f"[grpo] {world} workers: train {built[0]['trainer']}, rollout {built[0]['rollout']}, "
            f"{built[0]['params']} params; ready in {time.perf_counter() - t_start:.1f} s")
        for it in range(iterations):
            t_it = time.perf_counter()
            # 1. switch train -> rollout
            reports = [] if it in skip_sync_at else _all(ray, [w.sync_weights_to_rollout.remote() for w in workers])
            switch_s = max((r["wall_seconds"] for r in reports), default=0.0)
            moved = sum(r["bytes_sent"] + r["bytes_local"] for r in reports)
            # 2. generate G samples per prompt
            samples = rng.sample(splits.train, alg.prompts_per_iteration)
            G = alg.group_size
            prompt_ids = [encode_prompt(tok, s.prompt, alg.max_new_tokens, max_ctx) for s in samples for _ in range(G)]
            t0 = time.perf_counter()
            gens = _all(ray, [w.generate.remote(prompt_ids, alg.max_new_tokens, alg.temperature, cfg.seed * 100003 + it)
                              for w in workers])
            gen_s = time.perf_counter() - t0
            leads = sorted((g for g in gens if g["lead"]), key=lambda g: g["replica"])
            responses = [t for g in leads for t in g["tokens"]]
            rollout_lps = [lp for g in leads for lp in g["logprobs"]]
            n_tokens = sum(len(r) for r in responses)
            # 3. rewards and advantages
            import torch

            texts = [tok.decode(r) for r in responses]
            scores = score_samples(reward_fn, [s.prompt for s in samples for _ in range(G)], texts,
                                   [s.answer for s in samples for _ in range(G)])
            adv = grpo_advantages(torch.tensor(scores), G, alg.norm_adv_by_std, alg.adv_eps)
            # 4. train (stale-weights check inside, before any update)
            batch = {"prompts": prompt_ids, "responses": responses, "rollout_logprobs": rollout_lps,
                     "advantages": adv.tolist()}
            t0 = time.perf_counter()
            stats = _all(ray, [w.train_on.remote(batch) for w in workers])
            train_s = time.perf_counter() - t0
            stale = max(s["stale_logprob_diff"] for s in stats)
            rec = {
                "iteration": it,
                "reward_mean": sum(scores) / len(scores),
                "policy_loss": sum(s["policy_loss"] for s in stats) / len(stats),
                "kl": sum(s["kl"] for s in stats) / len(stats),
                "clipfrac": sum(s["clipfrac"] for s in stats) / len(stats),
                "grad_norm": stats[0]["grad_norm"],
                "stale_logprob_diff": stale,
                "stale_check_passed": stale <= stale_tol,
                "gen_tokens": n_tokens,
                "gen_seconds": gen_s,
                "gen_tokens_per_s": n_tokens / gen_s if gen_s > 0 else float("nan"),
                "switch_train_to_rollout_s": switch_s,
                "switch_rollout_to_train_s": 0.0,  # trainer state stays in place on CPU: nothing to move back
                "bytes_moved": moved,
                "bytes_sent": sum(r["bytes_sent"] for r in reports),
                "train_seconds": train_s,
                "iteration_seconds": time.perf_counter() - t_it,
                "example": {"prompt": samples[0].prompt, "response": texts[0], "answer": samples[0].answer},
            }
            records.append(rec)
            with metrics_path.open("a") as f:
                f.write(json.dumps(rec) + "\n")
            say(f"[grpo] it {it}: reward {rec['reward_mean']:.3f}  kl {rec['kl']:.2e}  loss {rec['policy_loss']:+.4f}  "
                f"gen {rec['gen_tokens_per_s']:.0f} tok/s  switch {switch_s * 1e3:.0f} ms ({moved / 1024:.0f} KiB)  "
                f"stale Δlogp {stale:.1e}  [{rec['iteration_seconds']:.1f} s]")
            if not rec["stale_check_passed"]:
                raise StaleWeightsError(
                    f"iteration {it}: the trainer's log-probs of the generated tokens differ from the rollout "
                    f"engine's by {stale:.3g} > {stale_tol:g}: the rollout engine ran on stale or wrong weights")
        _all(ray, [w.shutdown.remote() for w in workers], timeout=60)
    finally:
        ray.shutdown()
    say(f"[grpo] {iterations} iterations in {time.perf_counter() - t_start:.1f} s; metrics: {metrics_path}")
    return records


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config")
    ap.add_argument("--iterations", type=int)
    ap.add_argument("--output-dir")
    ap.add_argument("--stale-tol", type=float, default=1e-4)
    a = ap.parse_args(argv)
    try:
        run(a.config, a.iterations, a.output_dir, a.stale_tol)
    except StaleWeightsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
