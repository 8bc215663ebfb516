"""The RLHF loop (GRPO and PPO), driven by one Ray controller over colocated hybrid workers.

    rlhf-switch train configs/grpo_tiny.yaml            # or: python -m recipes.grpo CONFIG
    rlhf-switch train configs/ppo_tiny.yaml             # or: python -m recipes.ppo CONFIG
        [--iterations N] [--output-dir DIR] [--resume [DIR]] [--stale-tol T] [--quiet]

Before iteration 0: the config is checked against the world (one error listing every problem,
before Ray starts), the warm start is made (SFT on the task, cached) and every engine is built
from it. Per iteration: switch train -> rollout (VPS move of the weights) -> generate
``group_size`` samples per prompt -> rewards -> group-normalised advantages -> train (the
stale-weights check first: the trainer's log-probs of the generated tokens must equal the
rollout engine's within ``--stale-tol``, else ``StaleWeightsError``; PPO: the critic's values,
per-token rewards with the KL penalty, GAE, then policy and critic updates) -> one line and one JSONL /
TensorBoard record. Held-out greedy reward before the first iteration, every ``eval.every``
iterations and at the end. Checkpoints every ``checkpoint.save_every`` iterations and at the end
(``<output_dir>/final``: a HF checkpoint transformers and vLLM load, plus the optimizer state);
``--resume`` continues from the newest one with the same prompts and seeds the uninterrupted
run would have used. A PNG of reward and time per phase is written at the end.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from recipes.cluster import Cluster, start_ray
from recipes.common import (Evaluator, StaleWeightsError, draw_prompts, fault, loop_problems, prune_checkpoints,
                            resolve_resume, sample_seeds, warm_start)
from recipes.run_log import MetricsLog, plot_run

__all__ = ["run", "main", "StaleWeightsError"]


def reward_problems(cfg) -> list[str]:
    """Call the reward function once on a held-out sample (the right answer and an empty
    response) so a function that cannot run is refused before any actor starts."""
    from rlhf_switch.rl.rewards import RewardError, load_reward_fn, score_samples
    from rlhf_switch.rl.tasks import build_task, make_splits

    task = build_task(cfg.task.name, cfg.task.min_len, cfg.task.max_len)
    s = make_splits(task, cfg.task.num_train, cfg.task.num_heldout, cfg.task.seed).heldout[0]
    try:
        score_samples(load_reward_fn(cfg.task.reward_fn), [s.prompt] * 2, [s.answer, ""], [s.answer] * 2)
    except RewardError as e:
        return [f"task.reward_fn: {e}"]
    return []


def prepare(config_source, iterations=None, output_dir=None):
    """Load and check the config; everything that can be refused is refused here, before Ray."""
    from rlhf_switch.rl.config import ConfigError, check_fits, load_config

    cfg = load_config(config_source)
    if output_dir:
        cfg.output_dir = str(output_dir)
    check_fits(cfg)
    problems = loop_problems(cfg) + reward_problems(cfg)
    if problems:
        raise ConfigError(f"the loop cannot run this config: {len(problems)} problem{'s' * (len(problems) != 1)}",
                          problems)
    return cfg, iterations or cfg.algorithm.iterations


def run(config_source, iterations: int | None = None, output_dir: str | None = None,
        stale_tol: float = 1e-4, quiet: bool = False, resume: str | bool | None = None,
        skip_sync_at: tuple[int, ...] = (), crash_at: tuple[int, ...] = (), algorithm: str | None = None) -> list[dict]:
    """Run the loop; returns this call's per-iteration records (also in
    ``<output_dir>/metrics.jsonl``). Fault injection for tests: ``skip_sync_at`` — iterations
    that generate WITHOUT syncing the weights first (the stale-weights check must catch it);
    ``crash_at`` — iterations that crash after generating (the last checkpoint must survive)."""
    import torch

    from rlhf_switch.engines.full_state import is_checkpoint
    from rlhf_switch.rl.algorithms import grpo_advantages
    from rlhf_switch.rl.rewards import load_reward_fn, score_samples
    from rlhf_switch.rl.tasks import CharTokenizer, build_task, encode_prompt, make_splits

    cfg, iterations = prepare(config_source, iterations, output_dir)
    alg = cfg.algorithm
    name = alg.name
    if algorithm is not None and name != algorithm:
        from rlhf_switch.rl.config import ConfigError

        raise ConfigError(f"recipes.{algorithm}", [f"algorithm.name: this recipe runs {algorithm}, the config "
                                                   f"names {name!r} (use recipes.{name} or rlhf-switch train)"])
    out_dir = Path(cfg.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    resume_dir = resolve_resume(resume, out_dir)
    if resume_dir is not None and cfg.critic is not None and not is_checkpoint(resume_dir / "critic"):
        raise FileNotFoundError(f"--resume: {resume_dir} has no complete critic checkpoint (critic/) for this PPO run")

    def say(msg: str) -> None:
        if not quiet:
            from tqdm import tqdm
            tqdm.write(msg)

    tok = CharTokenizer()
    task = build_task(cfg.task.name, cfg.task.min_len, cfg.task.max_len)
    splits = make_splits(task, cfg.task.num_train, cfg.task.num_heldout, cfg.task.seed)
    reward_fn = load_reward_fn(cfg.task.reward_fn)
    from actors.hybrid import hf_config_of

    max_ctx = int(hf_config_of(cfg).get("max_position_embeddings", 2048))
    (out_dir / "config.yaml").write_text(__import__("yaml").safe_dump(cfg.model_dump(), sort_keys=False))

    t_start = time.perf_counter()
    init_dir = warm_start(cfg, out_dir / "init", quiet)
    say(f"[{name}] warm start: {init_dir} ({time.perf_counter() - t_start:.1f} s)")
    log = MetricsLog(out_dir, cfg.tensorboard, append=resume_dir is not None)
    ray, owns_ray = start_ray(cfg, cfg.world_size)
    cluster, ok = None, False
    records: list[dict] = []
    try:
        cluster = Cluster(cfg, ray, quiet)
        built = cluster.build(init_dir, resume_dir)
        first = int(built["start"].get("iteration", -1)) + 1 if resume_dir else 0
        say(f"[{name}] {cfg.world_size} workers: train {built['trainer']}, rollout {built['rollout']}, "
            f"{built['params']:,} params; " + (f"resumed from {resume_dir} at iteration {first}; " if resume_dir else "")
            + f"ready in {time.perf_counter() - t_start:.1f} s")
        evaluate = Evaluator(cfg, splits, tok, reward_fn, max_ctx)
        ckpt_root = out_dir / "checkpoints"
        last = first + iterations - 1 if resume_dir else iterations - 1

        def eval_now(it: int, when: str) -> None:
            t0 = time.perf_counter()
            r = evaluate(cluster)
            rec = {"iteration": it, "heldout_reward": r, "eval": when, "eval_seconds": time.perf_counter() - t0}
            log.write(rec, it)
            records.append(rec)
            say(f"[{name}] held-out greedy reward {when} iteration {it}: {r:.3f} ({len(evaluate.prompts)} prompts)")

        for it in range(first, last + 1):
            t_it = time.perf_counter()
            # 1. switch train -> rollout
            sync = ({"seconds": 0.0, "bytes_moved": 0, "bytes_sent": 0} if it in skip_sync_at else cluster.sync())
            if it == first:
                eval_now(it, "before")
            # 2. generate G samples per prompt
            samples = draw_prompts(cfg, splits, it)
            G = alg.group_size
            prompts = [encode_prompt(tok, s.prompt, alg.max_new_tokens, max_ctx) for s in samples for _ in range(G)]
            t0 = time.perf_counter()
            responses, rollout_lps = cluster.generate(prompts, sample_seeds(cfg, it, len(prompts)),
                                                      alg.max_new_tokens, alg.temperature)
            gen_s = time.perf_counter() - t0
            n_tokens = sum(len(r) for r in responses)
            fault(crash_at, it, "after generation")
            if it + 1 not in skip_sync_at:  # a sync comes before the rollout engines are used again
                cluster.stand_by()
            # 3. rewards and advantages
            texts = [tok.decode(r) for r in responses]
            scores = score_samples(reward_fn, [s.prompt for s in samples for _ in range(G)], texts,
                                   [s.answer for s in samples for _ in range(G)])
            batch = {"prompts": prompts, "responses": responses, "rollout_logprobs": rollout_lps}
            if name == "grpo":  # group-normalised, one advantage per sequence
                batch["advantages"] = grpo_advantages(torch.tensor(scores), G, alg.norm_adv_by_std, alg.adv_eps).tolist()
            else:  # PPO: the workers turn scores into per-token rewards and advantages with the critic
                batch["scores"] = list(scores)
            # 4. train (stale-weights check inside, before any update)
            t0 = time.perf_counter()
            stats = cluster.all("train_on", batch, desc="train")
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
                "switch_train_to_rollout_s": sync["seconds"],
                # the trainer keeps its state in place while the rollout runs (CPU: no device
                # memory to give back), so nothing moves on the way back
                "switch_rollout_to_train_s": 0.0,
                "bytes_moved": sync["bytes_moved"],
                "bytes_sent": sync["bytes_sent"],
                "switch_breakdown": sync.get("breakdown", {}),
                "train_seconds": train_s,
                "optimizer_steps": stats[0]["steps"],
                **({k: stats[0][k] for k in ("vf_loss", "vf_clipfrac", "value_mean", "return_mean") if k in stats[0]}),
                "iteration_seconds": time.perf_counter() - t_it,
                "example": {"prompt": samples[0].prompt, "response": texts[0], "answer": samples[0].answer},
            }
            records.append(rec)
            log.write(rec, it)
            log.write_rollouts(it, prompts, responses, rollout_lps, scores)
            say(f"[{name}] it {it}: reward {rec['reward_mean']:.3f}  kl {rec['kl']:.2e}  loss {rec['policy_loss']:+.4f}  "
                f"gen {rec['gen_tokens_per_s']:.0f} tok/s  switch {sync['seconds'] * 1e3:.0f} ms "
                f"({sync['bytes_moved'] / 1024:.0f} KiB) / back 0 ms  stale Δlogp {stale:.1e}  "
                f"[{rec['iteration_seconds']:.1f} s]")
            if not rec["stale_check_passed"]:
                raise StaleWeightsError(
                    f"iteration {it}: the trainer's log-probs of the generated tokens differ from the rollout "
                    f"engine's by {stale:.3g} > {stale_tol:g}: the rollout engine ran on stale or wrong weights")
            every = cfg.checkpoint.save_every
            if every and (it + 1) % every == 0 and it != last:
                s = cluster.save(ckpt_root / f"step_{it + 1}", {"iteration": it})
                prune_checkpoints(ckpt_root, cfg.checkpoint.keep)
                say(f"[{name}] checkpoint {ckpt_root / f'step_{it + 1}'} ({s:.1f} s)")
            if cfg.eval.every and (it + 1) % cfg.eval.every == 0 and it != last:
                cluster.sync()
                eval_now(it + 1, "before")
        # the end: the final policy evaluated and saved
        cluster.sync()
        eval_now(last + 1, "after")
        s = cluster.save(out_dir / "final", {"iteration": last})
        say(f"[{name}] final actor: {out_dir / 'final'} (HF safetensors + optimizer state, {s:.1f} s)")
        channel = channel_summary(cluster)
        log.write({"iteration": last + 1, "channel": channel}, last + 1)
        say(f"[{name}] weight channel: opened {channel['opened']}x, {channel['moves']} syncs, process groups "
            f"made per member process: {channel['groups_per_member']}")
        ok = True
    finally:
        log.close()
        if cluster is not None:
            cluster.shutdown(graceful=ok)
        if owns_ray:
            ray.shutdown()
    png = plot_run(log.records(), out_dir / f"{name}.png", f"{name.upper()} {cfg.task.name}: {cfg.train.engine} → {cfg.rollout.engine}")
    say(f"[{name}] {len([r for r in records if 'reward_mean' in r])} iterations in {time.perf_counter() - t_start:.1f} s; "
        f"metrics: {log.path}" + (f"; plot: {png}" if png else ""))
    return records


def channel_summary(cluster) -> dict:
    """How the run's weight channel was used: how often it was opened (once, unless a layout
    changed), the syncs through it, and the process groups each member process made for it."""
    stats = cluster.channel_stats()
    members = stats["trainers"] + [w for r in stats["replicas"] for w in r["workers"]]
    return {"opened": cluster.channel_opened, "moves": max(m.get("moves", 0) for m in members),
            "groups_per_member": sorted({m.get("groups_created", 0) for m in members}),
            "members": len(members), "pieces_verified": sum(m.get("pieces_verified", 0) for m in members)}


def main(argv=None, algorithm: str | None = None) -> int:
    from rlhf_switch.rl.config import ConfigError
    from rlhf_switch.rl.rewards import RewardError

    ap = argparse.ArgumentParser(prog=f"recipes.{algorithm or 'loop'}", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config")
    ap.add_argument("--iterations", type=int)
    ap.add_argument("--output-dir")
    ap.add_argument("--resume", nargs="?", const=True, default=None,
                    help="continue from the newest checkpoint of this run, or from DIR")
    ap.add_argument("--stale-tol", type=float, default=1e-4)
    ap.add_argument("--quiet", action="store_true")
    a = ap.parse_args(argv)
    try:
        run(a.config, a.iterations, a.output_dir, a.stale_tol, a.quiet, a.resume, algorithm=algorithm)
    except (ConfigError, FileNotFoundError, RewardError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except StaleWeightsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
