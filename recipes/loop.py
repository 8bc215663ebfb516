"""The RLHF loop (GRPO and PPO), driven by one Ray controller over colocated hybrid workers.

    rlhf-switch train configs/grpo_tiny.yaml            # or: python -m recipes.grpo CONFIG
    rlhf-switch train configs/ppo_tiny.yaml             # or: python -m recipes.ppo CONFIG
        [--iterations N] [--output-dir DIR] [--resume [DIR]] [--stale-tol T] [--quiet] [--verbose]

Before iteration 0: the config is checked against the world (one error listing every problem,
before Ray starts), the warm start is made (SFT on the task, cached) and every engine is built
from it. Per iteration: switch train -> rollout (VPS move of the weights; ``train.offload``: the
trainer's optimizer state into host memory) -> generate ``group_size`` samples per prompt (then
the parked state comes back) -> rewards -> group-normalised advantages -> train (the
stale-weights check first: the trainer's log-probs of the generated tokens must equal the
rollout engine's within ``--stale-tol``, else ``StaleWeightsError``; PPO: the critic's values,
per-token rewards with the KL penalty, GAE, then policy and critic updates) -> one line and one JSONL /
TensorBoard record. Held-out greedy reward before the first iteration, every ``eval.every``
iterations and at the end. Checkpoints every ``checkpoint.save_every`` iterations and at the end
(``<output_dir>/final``: a HF checkpoint transformers and vLLM load, plus the optimizer state).
A PNG of reward and time per phase is written at the end.

``--iterations N`` (default: the config's ``algorithm.iterations``) is the run's TOTAL: iterations
0 .. N-1, also on ``--resume``. ``--resume`` finishes an interrupted run: it continues from the
newest complete checkpoint (``checkpoints/step_<K>`` or ``final/``) at the iteration after it,
with the same prompts and seeds, and stops at N-1 — the same ``final/`` as the uninterrupted run;
the records the interrupted run wrote after that checkpoint are dropped from ``metrics.jsonl`` and
``rollouts.jsonl`` first. ``--resume`` of a finished run (``final/`` holds iteration N-1) says so
and exits 0 without starting anything; with a larger N it continues from ``final/``.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from recipes.cluster import Cluster, start_ray
from recipes.common import (Evaluator, RunFinished, StaleWeightsError, draw_prompts, fault, loop_problems,
                            prune_checkpoints, resolve_resume, sample_seeds, warm_start)
from recipes.resize import rollout_layout, trainer_layout
from recipes.run_log import MetricsLog, is_iteration_record, plot_run

__all__ = ["run", "main", "StaleWeightsError"]


def reward_problems(cfg) -> list[str]:
    """Call the run's reward function (``task.reward_fn`` or ``data.reward_fn``) once on a
    held-out sample (the right answer and an empty response) so a function that cannot run is
    refused before any actor starts."""
    from rlhf_switch.rl.data import load_splits
    from rlhf_switch.rl.rewards import RewardError, load_reward_fn, score_samples

    s = load_splits(cfg)[0].heldout[0]
    try:
        score_samples(load_reward_fn(cfg.reward_fn), [s.prompt] * 2, [s.answer, ""], [s.answer] * 2)
    except RewardError as e:
        return [f"{cfg.prompt_source}.reward_fn: {e}"]
    return []


def prepare(config_source, iterations=None, output_dir=None):
    """Load and check the config; everything that can be refused is refused here, before Ray.
    Returns (config, the run's total number of iterations)."""
    from rlhf_switch.rl.config import ConfigError, check_fits, load_config

    cfg = load_config(config_source)
    if output_dir:
        cfg.output_dir = str(output_dir)
    if iterations is not None:
        if int(iterations) < 1:
            raise ConfigError("--iterations", [f"--iterations: {iterations} — the run's total must be at least 1"])
        cfg.algorithm.iterations = int(iterations)  # the total: recorded in <output_dir>/config.yaml
    check_fits(cfg)
    problems = loop_problems(cfg) + reward_problems(cfg)
    if problems:
        raise ConfigError(f"the loop cannot run this config: {len(problems)} problem{'s' * (len(problems) != 1)}",
                          problems)
    return cfg, cfg.algorithm.iterations


def run(config_source, iterations: int | None = None, output_dir: str | None = None,
        stale_tol: float = 1e-4, quiet: bool = False, resume: str | bool | None = None,
        skip_sync_at: tuple[int, ...] = (), crash_at: tuple[int, ...] = (), algorithm: str | None = None,
        verbose: bool = False, phase_hook=None) -> list[dict]:
    """Run the loop; returns this call's per-iteration records (also in
    ``<output_dir>/metrics.jsonl``). ``iterations`` is the run's total (default: the config's),
    also when resuming: ``resume`` (True: the newest checkpoint of this run, or a directory)
    continues after the checkpoint's iteration up to ``iterations - 1``; a finished run returns
    ``[]`` at once (module docstring). ``verbose``: vLLM's INFO logs too. Fault injection for
    tests: ``skip_sync_at`` — iterations that generate WITHOUT syncing the weights first (the
    stale-weights check must catch it); ``crash_at`` — iterations that crash after generating (the
    last checkpoint must survive); ``phase_hook(iteration, phase, cluster)`` — called as the train
    phase starts (a test kills a trainer there)."""
    import torch

    from rlhf_switch.rl.algorithms import grpo_advantages
    from rlhf_switch.rl.rewards import load_reward_fn, score_samples
    from rlhf_switch.rl.data import load_splits
    from rlhf_switch.rl.tasks import encode_prompt
    from rlhf_switch.rl.tokenizer import load_tokenizer

    cfg, iterations = prepare(config_source, iterations, output_dir)
    alg = cfg.algorithm
    name = alg.name
    if algorithm is not None and name != algorithm:
        from rlhf_switch.rl.config import ConfigError

        raise ConfigError(f"recipes.{algorithm}", [f"algorithm.name: this recipe runs {algorithm}, the config "
                                                   f"names {name!r} (use recipes.{name} or rlhf-switch train)"])
    out_dir = Path(cfg.output_dir)

    def say(msg: str) -> None:
        if not quiet:
            from tqdm import tqdm
            tqdm.write(msg)

    # where a resumed run continues (a PPO checkpoint must hold the critic's state too)
    try:
        point = resolve_resume(resume, out_dir, iterations, parts=("critic",) if cfg.critic is not None else ())
    except RunFinished as e:
        say(f"[{name}] {e}")
        return []
    resume_dir, first = (point[0], point[1] + 1) if point else (None, 0)
    last = iterations - 1
    out_dir.mkdir(parents=True, exist_ok=True)

    tok = load_tokenizer(cfg)
    splits, read_line = load_splits(cfg, tok)  # data: prompts rendered (chat template), too-long dropped
    say(f"[{name}] {read_line}")
    reward_fn = load_reward_fn(cfg.reward_fn)
    from actors.hybrid import hf_config_of

    max_ctx = int(hf_config_of(cfg).get("max_position_embeddings", 2048))
    write_run_config(out_dir, cfg)

    t_start = time.perf_counter()
    init_dir = warm_start(cfg, out_dir / "init", quiet)
    say(f"[{name}] warm start: {init_dir} ({time.perf_counter() - t_start:.1f} s)")
    log = MetricsLog(out_dir, cfg.tensorboard, resume_from=first if resume_dir is not None else None)
    # elastic.schedule: the world in force at the first iteration, the resizes after it
    schedule = [e for e in (cfg.elastic.schedule if cfg.elastic else []) if first < e.iteration <= last]
    redundancy = cfg.elastic.redundancy if cfg.elastic else "none"
    now = cfg.at_iteration(first)
    most = max([now.world_size] + [e.world_size for e in schedule])
    ray, owns_ray = start_ray(cfg, most, verbose=verbose)
    cluster, ok, devices, pending = None, False, None, None
    records: list[dict] = []
    try:
        # the device manager: for a schedule, for resize requests (any elastic block, torch rollout
        # or vLLM replicas colocated) and for a lost trainer's replacement (redundancy)
        if cfg.elastic is not None and (cfg.elastic.schedule or cfg.rollout.engine == "torch"
                                        or (cfg.rollout.engine == "vllm" and cfg.rollout.colocate)
                                        or redundancy == "host"):
            from rlhf_switch.elastic.manager import Devices

            devices = Devices(ray)
            devices.acquire(range(now.world_size))
        cluster = Cluster(now, ray, quiet, devices=devices.slots(range(now.world_size)) if devices else None)
        built = cluster.build(init_dir, resume_dir)
        if resume_dir is not None and int(built["start"].get("iteration", -1)) != first - 1:
            raise RuntimeError(f"{resume_dir}: the engines loaded iteration {built['start'].get('iteration')}, "
                               f"the driver read {first - 1}")
        say(f"[{name}] {cfg.world_size} workers: train {built['trainer']}, rollout {built['rollout']}, "
            f"{built['params']:,} params; " + (f"resumed from {resume_dir} at iteration {first} of {iterations}; "
                                               if resume_dir else "")
            + f"ready in {time.perf_counter() - t_start:.1f} s")
        evaluate = Evaluator(cfg, splits, tok, reward_fn, max_ctx)
        ckpt_root = out_dir / "checkpoints"
        every_eval = cfg.eval.every

        def eval_now(it: int, when: str) -> None:
            t0 = time.perf_counter()
            r = evaluate(cluster)
            rec = {"iteration": it, "heldout_reward": r, "eval": when, "eval_seconds": time.perf_counter() - t0}
            log.write(rec, it)
            records.append(rec)
            say(f"[{name}] held-out greedy reward {when} iteration {it}: {r:.3f} ({len(evaluate.prompts)} prompts)")

        requested: dict[int, dict] = {}  # iteration -> the resize request that scheduled it
        # Ray's nodes as last seen (elastic: a node added or lost is an event, maybe a resize request)
        nodes_seen = _node_snapshot(ray) if cfg.elastic is not None else None
        it, refreshed_at = first, None  # refreshed_at: the iteration of the last host copy (redundancy)
        recovered: list[dict] = []  # recovery events since the last node watch (a node lost: what was done)
        while it <= last:
            try:
                if schedule and schedule[0].iteration == it:  # the resize due now: stop-the-world
                    if phase_hook is not None:  # tests: the state right before the resize
                        phase_hook(it, "before_resize", cluster)
                    if pending is None:  # its build abandoned for a recovery that restored this iteration
                        pending = _start_resize(ray, cluster, cfg, schedule[0], devices, init_dir, it)
                    rec = _commit_resize(cluster, pending, schedule.pop(0), cfg, devices, it, say, name,
                                         request=requested.pop(it, None), out_dir=out_dir)
                    if phase_hook is not None:  # ... and right after it
                        phase_hook(it, "after_resize", cluster)
                    pending = None
                    records.append(rec)
                    log.write(rec, it)
                    if "abandoned" not in rec["resize"]:
                        # the new world's actors hold no host copies until its first refresh (this
                        # iteration's, after the sync): a loss before it falls back to the checkpoint
                        # (``_recover_trainer``), never restores the old world's copies into this one
                        refreshed_at = None
                if cfg.elastic is not None:  # Ray's nodes: every change recorded, maybe a resize request
                    nodes_seen, notes = _watch_nodes(out_dir, cfg, nodes_seen, ray, it, say, name, recovered)
                    recovered = []
                    for note in notes:
                        records.append(note)
                        log.write(note, it)
                if cfg.elastic is not None:  # a resize request from outside the config (elastic.requests)
                    cfg, note = _take_request(out_dir, cfg, schedule, requested, ray, devices, it, last, say, name)
                    if note is not None:
                        records.append(note)
                        log.write(note, it)
                if schedule and pending is None and schedule[0].iteration - 1 <= it:
                    pending = _start_resize(ray, cluster, cfg, schedule[0], devices, init_dir, it)
                t_it = time.perf_counter()
                # 1. switch train -> rollout
                sync = ({"seconds": 0.0, "bytes_moved": 0, "bytes_sent": 0} if it in skip_sync_at else cluster.sync())
                # elastic.redundancy: host — the state as of now kept by a buddy (before offload parks it)
                copied = {"bytes": 0, "seconds": 0.0}
                if redundancy == "host":
                    copied = cluster.refresh_host_copy({"iteration": it})
                    refreshed_at = it
                # the trainer's optimizer state (train.offload) leaves its buffers while the rollout runs
                off = cluster.offload()
                peak = {"sync": cluster.memory_mark(wait=False)}  # read with the record (no round trip here)
                # before iteration 0, and where the uninterrupted run evaluated before this iteration
                # (a resumed run's records are the uninterrupted run's)
                if it == first and (it == 0 or (every_eval and it % every_eval == 0)):
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
                peak["generate"] = cluster.memory_mark(wait=False)
                back = cluster.reload()
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
                if phase_hook is not None:  # tests: a fault during the train phase
                    phase_hook(it, "train", cluster)
                t0 = time.perf_counter()
                calls = cluster.submit("train_on", batch)
                # the train phase's mark, queued behind train_on: it is there when train_on returns
                # (no round trip of its own after it)
                peak["train"] = cluster.memory_mark(wait=False)
                stats = cluster.collect(calls, "train")
                train_s = time.perf_counter() - t0
                peak = {p: read() for p, read in peak.items()}
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
                    # the weights stay where they are in the trainer; the parked state (train.offload)
                    # comes back (0 with offload: none)
                    "switch_rollout_to_train_s": back["seconds"],
                    # train.offload: bytes and seconds of each move (per rank: the rank's own state)
                    "offload_bytes": off["bytes"], "offload_bytes_per_rank": off["bytes_per_rank"],
                    "offload_released_bytes": off["released_bytes"], "offload_seconds": off["seconds"],
                    "reload_bytes": back["bytes"], "reload_bytes_per_rank": back["bytes_per_rank"],
                    "reload_seconds": back["seconds"],
                    # elastic.redundancy: host — the refresh of the buddies' host copies
                    "redundancy_bytes": copied["bytes"], "redundancy_seconds": copied["seconds"],
                    # per phase, the largest over the trainer ranks (peak_device_measure says of what)
                    **{f"peak_device_bytes_{p}": m["bytes"] for p, m in peak.items()},
                    "peak_device_measure": peak["train"]["measure"],
                    "bytes_moved": sync["bytes_moved"],
                    "bytes_sent": sync["bytes_sent"],
                    # rollout.handoff ipc: bucket handles handed to the workers (one per bucket)
                    "handoff": sync.get("handoff", "p2p"),
                    "handles": sync.get("handles", 0),
                    "switch_breakdown": sync.get("breakdown", {}),
                    "train_seconds": train_s,
                    # inside train: old/reference log-probs (and PPO values) vs the update, slowest worker
                    "logprob_seconds": max(s["logprob_seconds"] for s in stats),
                    "update_seconds": max(s["update_seconds"] for s in stats),
                    "optimizer_steps": stats[0]["steps"],
                    **({k: stats[0][k] for k in ("vf_loss", "vf_clipfrac", "value_mean", "return_mean") if k in stats[0]}),
                    "iteration_seconds": time.perf_counter() - t_it,
                    "example": {"prompt": samples[0].prompt, "response": texts[0], "answer": samples[0].answer},
                }
                records.append(rec)
                log.write(rec, it)
                log.write_rollouts(it, prompts, responses, rollout_lps, scores,
                                   texts={"prompt_texts": [s.prompt for s in samples for _ in range(G)],
                                          "response_texts": texts})
                say(f"[{name}] it {it}: reward {rec['reward_mean']:.3f}  kl {rec['kl']:.2e}  loss {rec['policy_loss']:+.4f}  "
                    f"gen {rec['gen_tokens_per_s']:.0f} tok/s  switch {sync['seconds'] * 1e3:.0f} ms "
                    f"({sync['bytes_moved'] / 1024:.0f} KiB) / back {back['seconds'] * 1e3:.0f} ms  stale Δlogp {stale:.1e}  "
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
                if every_eval and (it + 1) % every_eval == 0 and it != last:
                    cluster.sync()
                    eval_now(it + 1, "before")
            except Exception as e:  # noqa: BLE001 - a lost trainer is recovered; anything else is raised
                if redundancy != "host":
                    raise
                failed_at, world = time.perf_counter(), cluster.world
                if pending is not None:  # the next resize's new world, being built: it goes first
                    note = _abandon_build(pending, schedule[0], e, it, say, name, out_dir)
                    pending = None
                    records.append(note)
                    log.write(note, it)
                cluster, it, rec = _recover_trainer(e, ray, cluster, devices, init_dir, refreshed_at, out_dir,
                                                    iterations, quiet, say, name, failed_at)
                refreshed_at = None  # the recovered world's actors hold no host copies until its first refresh
                if cluster.world < world:  # shrunk to the devices left: the resizes that need more are dropped
                    for note in _drop_entries(schedule, requested, cluster.world, it, say, name, out_dir):
                        records.append(note)
                        log.write(note, it)
                # the iterations from the restored one on are run again: their records go
                records[:] = [r for r in records if r.get("iteration", -1) < it or not is_iteration_record(r)]
                log.drop_rerun(it)
                records.append(rec)
                log.write(rec, it)
                recovered.append(rec["recovery"])
                continue
            it += 1
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
        if pending is not None:
            pending.abandon()
        if cluster is not None:
            cluster.shutdown(graceful=ok)
        if devices is not None:
            devices.release_all()
        if owns_ray:
            ray.shutdown()
    png = plot_run(log.records(), out_dir / f"{name}.png", f"{name.upper()} {cfg.task.name if cfg.task else 'data'}: {cfg.train.engine} → {cfg.rollout.engine}")
    say(f"[{name}] {len([r for r in records if 'reward_mean' in r])} iterations in {time.perf_counter() - t_start:.1f} s; "
        f"metrics: {log.path}" + (f"; plot: {png}" if png else ""))
    return records


def _start_resize(ray, cluster, cfg, entry, devices, init_dir: Path, it: int):
    """Start building the world of ``entry`` in the background (its actors on devices
    ``0..world_size-1``) while iteration ``it`` runs on the current world."""
    from actors.hybrid import remote_class
    from rlhf_switch.elastic import ResizePlan
    from rlhf_switch.elastic.manager import start_world

    new = cfg.at_iteration(entry.iteration)
    if not cluster.in_world:  # vLLM replicas: their layout, or the trainer world with them
        if (new.world_size, new.train, new.reference) == (cluster.world, cluster.cfg.train, cluster.cfg.reference):
            return _start_rollout_resize(cluster, new, init_dir, it)
        from recipes.resize import start_combined_resize

        return start_combined_resize(ray, cluster, new, devices, init_dir, it)
    plan = ResizePlan(tuple(range(cluster.world)), tuple(range(new.world_size)))
    pending = start_world(ray, remote_class(num_cpus=0.5, num_gpus=0.5), new.model_dump(), devices, plan,
                          init_dir=str(init_dir), device=cluster.device)
    pending.started_at, pending.config = it, new
    return pending


def _abandon_build(pending, entry, error: Exception, it: int, say, name: str, out_dir: Path) -> dict:
    """An iteration failed (``elastic.redundancy: host``: maybe a lost trainer) while the new world
    of ``entry`` was being built: the build is abandoned before the recovery — its actors killed
    (each holds half of a kept device, which a lost rank's replacement may need), the devices it
    added released. The entry stays in the schedule: the recovery runs an iteration at or before
    the one the build started in again, and the build starts again there (re-planned), so the
    run resizes where it planned to. Returns the record (``resize.abandoned``, ``replanned``)."""
    pending.abandon()
    why = (f"iteration {it} failed ({type(error).__name__}) while the new world was being built; its actors "
           f"killed, its added devices released; built again when iteration {entry.iteration - 1} runs again")
    return _resize_abandoned(entry.iteration, why, say, name, None, out_dir, event={"replanned": True})


def _drop_entries(schedule: list, requested: dict, world: int, it: int, say, name: str, out_dir: Path) -> list[dict]:
    """A recovery shrank the run to ``world`` devices (a node lost): the schedule entries that
    need more devices are dropped — their build would wait for devices that are gone —, each
    recorded (its request, if any, answered ``abandoned``); the run trains on in the recovered world."""
    notes = []
    for entry in [e for e in schedule if e.world_size > world]:
        schedule.remove(entry)
        why = (f"the recovery before iteration {it} left the run {world} devices, the resize needs "
               f"{entry.world_size}; dropped, the run trains on in the recovered world")
        notes.append(_resize_abandoned(entry.iteration, why, say, name, requested.pop(entry.iteration, None), out_dir))
    return notes


def _node_snapshot(ray) -> dict:
    from rlhf_switch.elastic.nodes import snapshot

    return snapshot(ray.nodes())


def _watch_nodes(out_dir: Path, cfg, seen: dict, ray, it: int, say, name: str,
                 recovered: list[dict] = ()) -> tuple[dict, list[dict]]:
    """At the boundary before iteration ``it``: Ray's nodes compared with ``seen``; every node
    added or lost is an ``event`` record. With ``elastic.on_node_change: resize`` a node added is
    also a resize request to every device now available (layouts scaled along DP), written to the
    run's mailbox as ``requests.request_resize`` writes one: ``_take_request`` checks it right
    after, as any request (refused with the config's messages, or a schedule entry at ``it + 1``).
    A node lost took its trainers with it: its record says what the recovery since the last
    watch (``recovered``, ``_recover_trainer``'s events naming the node) did with them, e.g.
    recovered to 2 devices. Returns the new snapshot and the records."""
    from rlhf_switch.elastic import ResizeError, nodes, requests

    now = nodes.snapshot(ray.nodes())
    changes = nodes.node_changes(seen, now)
    if not changes:
        return now, []
    before, total = nodes.cluster_devices(seen), nodes.cluster_devices(now)
    notes = []
    for c in changes:
        ev = {"kind": c.kind, "node_id": c.node_id, "devices": c.devices, "gpus": c.gpus, "cpus": c.cpus,
              "cluster_devices": total, "old": f"{before} devices", "new": f"{total} devices"}
        if c.kind == "node_lost":
            done = [r for r in recovered if any(c.node_id[:8] in n.split()[-1] for n in r.get("lost_nodes", ()))]
            if done:  # rank_nodes names a node "address id[:8]"
                ev["action"] = f"trainer rank(s) {done[-1]['lost_ranks']} lost with it: {done[-1]['action']}"
            else:
                ev["action"] = "recorded (a lost trainer is elastic.redundancy: host's job)"
        notes.append({"iteration": it, "event": ev})
        say(f"[{name}] {c.kind.replace('_', ' ')} before iteration {it}: {c.node_id[:12]} ({c.devices} devices); "
            f"the cluster has {total} devices")
    added = [n for n in notes if n["event"]["kind"] == "node_added"]
    if added:
        target = cfg.at_iteration(it + 1)  # the world in force after this boundary (a due entry included)
        ev = added[-1]["event"]
        if cfg.elastic.on_node_change != "resize":
            ev["action"] = "recorded (elastic.on_node_change: record)"
        elif total <= target.world_size:
            ev["action"] = f"no resize: the run already uses {target.world_size} devices"
        else:
            dumped = {k: (getattr(target, k).model_dump() if getattr(target, k) is not None else None)
                      for k in ("train", "rollout", "reference")}
            try:
                rid = requests.request_resize(out_dir, reason="node_added", **nodes.grown_request(dumped, total))
                ev["action"] = f"resize requested: {total} devices (request {rid})"
                ev["request"] = rid
            except ResizeError as e:  # another request waits in the mailbox: that one goes first
                ev["action"] = f"no resize: {e}"
    return now, notes


def write_run_config(out_dir: Path, cfg) -> None:
    """``<output_dir>/config.yaml``: the config the run follows, accepted resize requests
    included as ``elastic.schedule`` entries (``--resume`` with it takes the same resizes)."""
    import yaml

    (out_dir / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(), sort_keys=False))


def _take_request(out_dir: Path, cfg, schedule: list, requested: dict, ray, devices, it: int, last: int,
                  say, name: str):
    """At the boundary before iteration ``it``: a pending resize request (``elastic.requests``)
    is checked as an ``elastic.schedule`` entry at ``it + 1`` and, if it passes, becomes one (its
    world is built during ``it`` and committed before ``it + 1``, as a planned resize). Returns
    the config in force (with the entry) and, for a refused request, the record saying why — the
    run trains on."""
    from rlhf_switch.elastic import requests
    from rlhf_switch.rl.config import ConfigError

    req = requests.take_request(out_dir)
    if req is None:
        return cfg, None
    held = None
    if devices is not None:
        res = ray.cluster_resources()
        held = int(min(res.get("GPU", 0), res.get("CPU", 0)))
    try:
        new, entry = requests.checked_request(cfg, req, it + 1, last, held)
    except ConfigError as e:
        requests.answer(out_dir, req, "refused", str(e), problems=e.problems, iteration=it)
        say(f"[{name}] {e}")
        return cfg, {"iteration": it, "event": {"kind": "request_refused", "request": req, "problems": e.problems}}
    schedule.append(entry)
    schedule.sort(key=lambda e: e.iteration)
    requested[entry.iteration] = req
    write_run_config(out_dir, new)  # the accepted entry in the run's config.yaml: a resume of it resizes too
    requests.answer(out_dir, req, "accepted", f"resize to {entry.world_size} devices before iteration "
                    f"{entry.iteration}; the new world is built during iteration {it}", iteration=entry.iteration)
    say(f"[{name}] resize request {req.get('id')} accepted: {entry.world_size} devices before iteration {entry.iteration}")
    return new, None


def _commit_resize(cluster, pending, entry, cfg, devices, it: int, say, name: str, request=None,
                   out_dir: Path | None = None) -> dict:
    """The stop-the-world before iteration ``it``: wait for the background build if it is not
    done, move the state over the union of old and new ranks, adopt the new world. A build that
    failed is abandoned with one message and the run goes on in the current world. ``request``:
    the resize request (``_take_request``) this entry came from, answered here."""
    from rlhf_switch.elastic import ResizeError

    if not cluster.in_world:
        from recipes.resize import PendingCombined

        if isinstance(pending, PendingCombined):
            return _commit_combined_resize(cluster, pending, devices, it, say, name, request, out_dir)
        return _commit_rollout_resize(cluster, pending, it, say, name, request, out_dir)
    old = trainer_layout(cluster.cfg)
    t0 = time.perf_counter()
    try:
        pending.wait()
        waited = time.perf_counter() - t0
        result = pending.commit(cluster.workers)
    except ResizeError as e:
        return _resize_abandoned(it, str(e), say, name, request, out_dir)
    cluster.adopt(pending.config, result.workers, devices.slots(result.plan.new_devices))
    new = trainer_layout(cluster.cfg)
    event = {"kind": "requested" if request else "planned", "old": old, "new": new, "iterations_during_build": it - pending.started_at,
             **({"reason": request["reason"]} if request and request.get("reason") else {}),
             "background_s": result.background_s, "waited_for_build_s": waited,
             "stop_the_world_s": result.stop_the_world_s, "release_s": result.release_s,
             "bytes_moved": result.bytes_moved, "bytes_moved_by_engine": result.bytes_moved_by_engine}
    return _resized(it, event, f"built in the background in {result.background_s:.1f} s", say, name, request, out_dir)


def _resize_abandoned(it: int, why: str, say, name: str, request, out_dir: Path | None, part: str = "",
                      event: dict | None = None) -> dict:
    """A resize before iteration ``it`` that did not happen: said in one line, the request (if it
    came from one) answered ``abandoned``, and its record (``event``: what is known of it)."""
    from rlhf_switch.elastic import requests

    say(f"[{name}] {part}resize before iteration {it} abandoned: {why}")
    if request is not None:
        requests.answer(out_dir, request, "abandoned", why, iteration=it)
    return {"iteration": it, "resize": {"kind": "requested" if request else "planned", **(event or {}),
                                        "abandoned": why}}


def _resized(it: int, event: dict, built: str, say, name: str, request, out_dir: Path | None,
             part: str = "", moved: str = "") -> dict:
    """A resize done before iteration ``it``: the request (if any) answered ``done`` with its
    event, one line said (``built``: how the new side was started; ``moved``: the stop-the-world's
    parts), and the run-log record."""
    from rlhf_switch.elastic import requests

    old, new = event["old"], event["new"]
    if request is not None:
        requests.answer(out_dir, request, "done", f"{part}resized before iteration {it}: {old} -> {new}",
                        iteration=it, event=event)
    say(f"[{name}] {part}resized before iteration {it}: {old} -> {new}; {built} "
        f"({event['iterations_during_build']} iteration(s) meanwhile, {event['waited_for_build_s']:.1f} s waited), "
        f"stop-the-world {event['stop_the_world_s']:.2f} s{moved}, {event['bytes_moved']} B moved")
    return {"iteration": it, "resize": event, "resize_stop_the_world_s": event["stop_the_world_s"],
            "resize_background_s": event["background_s"]}


def _start_rollout_resize(cluster, new, init_dir: Path, it: int):
    """Start the rollout replicas of ``new`` (vLLM: its TP × replicas on the same trainer world) in
    the background while iteration ``it`` runs on the current ones (``Cluster.start_replicas``)."""
    pending = cluster.start_replicas(new, init_dir)
    pending.started_at, pending.config = it, new
    return pending


def _commit_rollout_resize(cluster, pending, it: int, say, name: str, request, out_dir: Path | None) -> dict:
    """Before iteration ``it``: the new replicas take over (``Cluster.swap_replicas``: the weight
    channel re-formed over the trainer ranks and them, one sync fills them, the old ones shut
    down). New replicas that cannot be taken: abandoned with one message, the old ones generate on."""
    old = rollout_layout(cluster.cfg)
    try:
        swap = cluster.swap_replicas()
    except ValueError as e:
        return _resize_abandoned(it, str(e), say, name, request, out_dir, part="rollout ")
    event = {"kind": "requested" if request else "planned", "part": "rollout", "old": old,
             "new": rollout_layout(cluster.cfg), "iterations_during_build": it - pending.started_at, **swap}
    return _resized(it, event, f"new replicas started in the background in {swap['background_s']:.1f} s", say, name,
                    request, out_dir, part="rollout ")


def _commit_combined_resize(cluster, pending, devices, it: int, say, name: str, request,
                            out_dir: Path | None) -> dict:
    """Before iteration ``it``: the new trainer world and its new vLLM replicas take over in one
    stop-the-world (``recipes/resize.py``); either side not built: both abandoned, one message."""
    from recipes.resize import commit_combined_resize

    event = commit_combined_resize(cluster.ray, cluster, pending, devices, it)
    if request is not None:
        event["kind"] = "requested"
        if request.get("reason"):
            event["reason"] = request["reason"]
    if "abandoned" in event:
        return _resize_abandoned(it, event.pop("abandoned"), say, name, request, out_dir, event=event)
    return _resized(it, event, f"built in the background in {event['background_s']:.1f} s", say, name, request,
                    out_dir, moved=f" (trainer move {event['trainer_move_s']:.2f} s, replicas filled "
                                   f"{event['fill_sync_s']:.2f} s)")


def _recover_trainer(error: Exception, ray, cluster, devices, init_dir: Path, refreshed_at: int | None,
                     out_dir: Path, iterations: int, quiet: bool, say, name: str, failed_at: float):
    """``elastic.redundancy: host``: an iteration failed. When a trainer actor is lost (dead, or no
    answer within the deadline), restore the state of the last refresh from the survivors' host
    copies (``rlhf_switch.elastic.recovery``) into a new world — the same size with a replacement
    on each lost rank's device, or, where devices went with a lost node, the devices left with the
    layouts scaled along DP (``requests.scaled_config``; the run goes on in it) — and return
    ``(cluster, iteration to run again, run-log record)``; both an owner and its copy's holder
    lost, or no valid smaller world: the newest checkpoint, said in one line. No trainer lost:
    ``error`` is raised."""
    from actors.hybrid import remote_class
    from rlhf_switch.elastic.recovery import StateLost, WorldLost, lost_ranks, recover
    from rlhf_switch.elastic.requests import scaled_config

    probe_s = time.perf_counter()
    lost = lost_ranks(ray, cluster.workers)
    probe_s = time.perf_counter() - probe_s
    if not lost:
        raise error
    say(f"[{name}] trainer rank(s) {lost} lost ({type(error).__name__}: {str(error).splitlines()[0][:200]})")

    old, old_cfg, where = trainer_layout(cluster.cfg), cluster.cfg, cluster.rank_nodes()
    smaller = {}

    def config_for(world: int) -> dict:
        smaller["cfg"] = scaled_config(old_cfg, world)
        return smaller["cfg"].model_dump()

    try:
        if refreshed_at is None:
            raise StateLost("the trainer was lost before its state was first copied to the buddies", lost, lost)
        rec = recover(ray, remote_class(num_cpus=0.5, num_gpus=0.5), old_cfg.model_dump(), devices,
                      range(cluster.world), cluster.workers, lost, shift=cluster.buddy_shift,
                      init_dir=str(init_dir), device=cluster.device, failed_at=failed_at, config_for=config_for)
    except (StateLost, WorldLost) as e:
        return _fall_back_to_checkpoint(e, ray, cluster, devices, init_dir, out_dir, iterations, quiet, say, name,
                                        failed_at)
    # the iteration the copies were refreshed at (a loss at the very end of a refresh: the copies
    # are complete and newer than the last refresh the driver saw return)
    refreshed_at = int(rec.extra.get("iteration", refreshed_at))
    new_cfg = smaller["cfg"] if rec.devices_gone else old_cfg
    devices.renumber(rec.devices)  # the run's world stays on devices 0..n-1
    cluster.adopt(new_cfg, rec.workers, devices.slots(range(new_cfg.world_size)))
    how = (f"devices {rec.devices_gone} gone with their node: shrunk to the {new_cfg.world_size} left, layouts "
           f"scaled along DP" if rec.devices_gone else f"a replacement for rank(s) {rec.lost}")
    event = rec.event(old, f"{trainer_layout(new_cfg)} ({how})")
    # probe_s: of detect_s, the actors asked (lost_ranks); the rest waits on Ray's placement of the devices
    event.update(restored_iteration=refreshed_at, lost_nodes=sorted({where[r] for r in rec.lost}), probe_s=probe_s,
                 action=f"recovered to {new_cfg.world_size} devices from the host copies" +
                        (" (a smaller world)" if rec.devices_gone else ""))
    say(f"[{name}] recovered without a checkpoint in {rec.seconds:.1f} s onto {trainer_layout(new_cfg)} ({how}; build "
        f"{rec.build_s:.1f} s, move {rec.move_s:.2f} s, {rec.bytes_moved} B from the survivors' host copies); "
        f"iteration {refreshed_at} runs again")
    return cluster, refreshed_at, {"iteration": refreshed_at, "recovery": event, "recovery_seconds": rec.seconds}


def _fall_back_to_checkpoint(lost, ray, cluster, devices, init_dir: Path, out_dir: Path, iterations: int,
                             quiet: bool, say, name: str, failed_at: float):
    """The state a lost trainer held is gone from every host copy, or no smaller world takes it
    (``WorldLost``): a new world of the same size from the newest checkpoint of the run (none, or
    the run's devices not all placed: a clear error)."""
    from rlhf_switch.elastic.recovery import WorldLost

    try:
        ckpt, at = resolve_resume(True, out_dir, iterations)
    except FileNotFoundError:
        raise RuntimeError(f"trainer lost and not recoverable: {lost}; and the run has no checkpoint to fall "
                           f"back to (checkpoint.save_every)") from lost
    cfg = cluster.cfg
    missing = sorted(set(range(cfg.world_size)) - set(devices.placed(range(cfg.world_size))))
    if missing:  # a lost node's devices: the checkpoint needs the run's whole world back
        raise RuntimeError(f"trainer lost and not recoverable: {lost}; and devices {missing} of the run's "
                           f"{cfg.world_size} are not placed any more, so the checkpoint {ckpt} has no world "
                           f"to load into") from lost
    say(f"[{name}] {lost}: falling back to the newest checkpoint {ckpt} (iteration {at}); iteration {at + 1} "
        f"runs again")
    cluster.shutdown(graceful=False)
    cluster = Cluster(cfg, ray, quiet, devices=devices.slots(range(cfg.world_size)))
    cluster.build(init_dir, ckpt)
    event = {"kind": "trainer_lost", "lost_ranks": lost.lost, "unrecoverable": lost.unrecoverable,
             **({"devices_gone": lost.devices_gone} if isinstance(lost, WorldLost) else {}),
             "fell_back_to": str(ckpt), "restored_iteration": at + 1, "seconds": time.perf_counter() - failed_at}
    return cluster, at + 1, {"iteration": at + 1, "recovery": event, "recovery_seconds": event["seconds"]}


def channel_summary(cluster) -> dict:
    """How the run's weight channel was used: how often it was opened (once, unless a layout
    changed), the syncs through it, the process groups each member process made for it, and the
    Ray nodes its members ran on (``Cluster.nodes``)."""
    stats = cluster.channel_stats()
    members = stats["trainers"] + [w for r in stats["replicas"] for w in r["workers"]]
    return {"opened": cluster.channel_opened, "moves": max(m.get("moves", 0) for m in members),
            "groups_per_member": sorted({m.get("groups_created", 0) for m in members}),
            "members": len(members), "pieces_verified": sum(m.get("pieces_verified", 0) for m in members),
            "nodes": cluster.nodes()}


def add_arguments(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The loop's options (``rlhf-switch train`` and ``python -m recipes.grpo|ppo``)."""
    ap.add_argument("config", metavar="CONFIG",
                    help="the run's YAML (configs/README.md); its algorithm.name picks GRPO or PPO")
    ap.add_argument("--iterations", type=int, metavar="N",
                    help="the run's TOTAL number of iterations (0 .. N-1), also with --resume: a resumed run "
                         "stops where the uninterrupted one stops (default: the config's algorithm.iterations)")
    ap.add_argument("--output-dir", metavar="DIR",
                    help="where checkpoints/, final/, metrics.jsonl, rollouts.jsonl, tensorboard/ and the plot go "
                         "(default: the config's output_dir)")
    ap.add_argument("--resume", nargs="?", const=True, default=None, metavar="DIR",
                    help="finish an interrupted run: continue from the newest complete checkpoint of this run "
                         "(checkpoints/step_K or final/), or from DIR, up to the total; the records written after "
                         "that checkpoint are dropped from metrics.jsonl and rollouts.jsonl. A finished run (final/ "
                         "holds iteration N-1) is reported as finished, exit 0; a larger N continues it")
    ap.add_argument("--stale-tol", type=float, default=1e-4, metavar="T",
                    help="the stale-weights check: the largest difference between the trainer's and the rollout "
                         "engine's log-probs of the generated tokens that passes (default: %(default)g)")
    ap.add_argument("--quiet", action="store_true", help="no progress bars and no per-iteration lines")
    ap.add_argument("--verbose", action="store_true",
                    help="vLLM's INFO logs too (default: its warnings and errors only, so they do not interleave "
                         "with the progress bars; sets VLLM_LOGGING_LEVEL=INFO for the run's vLLM processes)")
    return ap


def run_args(a: argparse.Namespace, algorithm: str | None = None) -> int:
    """Run the loop with parsed options; the exit code (2: bad input, 3: stale weights)."""
    from rlhf_switch.rl.config import ConfigError
    from rlhf_switch.rl.rewards import RewardError

    try:
        run(a.config, a.iterations, a.output_dir, a.stale_tol, a.quiet, a.resume, algorithm=algorithm,
            verbose=a.verbose)
    except (ConfigError, FileNotFoundError, RewardError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except StaleWeightsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    return 0


def main(argv=None, algorithm: str | None = None) -> int:
    ap = argparse.ArgumentParser(prog=f"python -m recipes.{algorithm or 'loop'}", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    return run_args(add_arguments(ap).parse_args(argv), algorithm)


if __name__ == "__main__":
    sys.exit(main())
