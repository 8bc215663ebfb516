"""Train a policy with RL: the recipe behind ``rlhf-switch train`` — the config in, the run's parts
built, the loop run.

    rlhf-switch train configs/grpo_tiny.yaml            # or: python -m recipes.grpo CONFIG
    rlhf-switch train configs/ppo_tiny.yaml             # or: python -m recipes.ppo CONFIG
        [--iterations N] [--output-dir DIR] [--resume [DIR]] [--stale-tol T] [--quiet] [--verbose]

In order: the config is checked (``rlhf_switch.problems``: one error listing every problem, before
Ray starts); the tokenizer, the prompts, the reward function and the run log are made and the warm
start (SFT on the task, cached) is trained; Ray starts and every actor and engine is built from
the warm start (or the checkpoint being resumed); then each iteration runs (``recipes.loop``:
``Loop.iteration``, its phases), elastic control acting between them (``recipes.elastic.control``).
At the end the final policy is evaluated and saved to ``<output_dir>/final`` (a HF checkpoint
transformers and vLLM load, plus the optimizer state) and a PNG of reward and time per phase is
written.

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

from recipes.cluster import Cluster, RolloutEngineFailed, SyncFailed, start_ray
from recipes.common import RunFinished, StaleWeightsError, resolve_resume, warm_start, write_run_config
from recipes.loop import Faults, Loop, RunState
from recipes.run_log import MetricsLog, plot_run

__all__ = ["run", "main", "prepare", "StaleWeightsError"]


def prepare(config_source, iterations=None, output_dir=None, algorithm: str | None = None):
    """Load and check the config, the command line's ``--iterations`` (the run's total, recorded in
    ``<output_dir>/config.yaml``) and ``--output-dir`` applied; everything that can be refused is
    refused here, before Ray (``rlhf_switch.problems``; ``algorithm``: the one a recipe like
    ``recipes.grpo`` runs). Returns (config, the run's total number of iterations)."""
    from rlhf_switch.problems import check_run
    from rlhf_switch.rl.config import load_config

    overrides = {"algorithm.iterations": int(iterations)} if iterations is not None else {}
    if output_dir:
        overrides["output_dir"] = str(output_dir)
    cfg = load_config(config_source, overrides=overrides)
    check_run(cfg, recipe=algorithm)
    return cfg, cfg.algorithm.iterations


def run(config_source, iterations: int | None = None, output_dir: str | None = None,
        stale_tol: float | None = None, quiet: bool = False, resume: str | bool | None = None,
        skip_sync_at: tuple[int, ...] = (), crash_at: tuple[int, ...] = (), algorithm: str | None = None,
        verbose: bool = False, phase_hook=None, generate_hook=None) -> list[dict]:
    """Run the loop; returns this call's per-iteration records (also in
    ``<output_dir>/metrics.jsonl``). ``iterations`` is the run's total (default: the config's),
    also when resuming: ``resume`` (True: the newest checkpoint of this run, or a directory)
    continues after the checkpoint's iteration up to ``iterations - 1``; a finished run returns
    ``[]`` at once (module docstring). ``verbose``: vLLM's INFO logs too. ``skip_sync_at``,
    ``crash_at``, ``phase_hook``, ``generate_hook``: fault injection for tests (``Faults``)."""
    from recipes.elastic.control import ElasticControl

    cfg, iterations = prepare(config_source, iterations, output_dir, algorithm)
    try:  # where a resumed run continues (a PPO checkpoint must hold the critic's state too)
        point = resolve_resume(resume, Path(cfg.output_dir), iterations,
                               parts=("critic",) if cfg.critic is not None else ())
    except RunFinished as e:
        if not quiet:
            print(f"[{cfg.algorithm.name}] {e}")
        return []
    resume_dir, first = (point[0], point[1] + 1) if point else (None, 0)
    state = RunState(cfg, Path(cfg.output_dir), first, iterations - 1, iterations, quiet,
                     Faults(skip_sync_at, crash_at, phase_hook, generate_hook))
    t_start = time.perf_counter()
    inputs = start(state, resume_dir is not None, t_start)
    try:
        elastic = ElasticControl(state)
        ray, owns_ray = start_ray(cfg, elastic.most_devices(), verbose=verbose)
    except BaseException:
        close_started(state, inputs)
        raise
    loop, ok = Loop(state, stale_tol), False
    try:
        build(state, loop, inputs, ray, elastic.acquire(ray), resume_dir, t_start)
        elastic.started()
        iterate(state, loop, elastic)
        loop.finish()
        ok = True
    finally:
        if loop.world is not None:  # before the cluster: the trainer's own world gets its actors back
            loop.world.close()
        if loop.source is not None:  # an agent run's environment workers
            loop.source.close()
        close_started(state, inputs, ok)
        elastic.close(graceful=ok)
        if owns_ray:
            ray.shutdown()
    png = plot_run(state.log.records(), state.out_dir / f"{cfg.algorithm.name}.png",
                   f"{cfg.algorithm.name.upper()} {cfg.task.name if cfg.task else 'data'}: "
                   f"{cfg.train.engine} → {cfg.rollout.engine}")
    state.say(f"{len([r for r in state.records if 'reward_mean' in r])} iterations in "
              f"{time.perf_counter() - t_start:.1f} s; metrics: {state.log.path}" + (f"; plot: {png}" if png else ""))
    return state.records


def start(state: RunState, resuming: bool, t_start: float) -> dict:
    """Before Ray: the tokenizer, the prompts, the reward function (its workers started), the run
    log and the warm start (``state.log``, ``state.init_dir``)."""
    from rlhf_switch.families import context_length
    from rlhf_switch.reward_workers import RewardRunner
    from rlhf_switch.rl.data import load_splits
    from rlhf_switch.rl.tokenizer import load_tokenizer

    cfg = state.cfg
    state.out_dir.mkdir(parents=True, exist_ok=True)
    tok = load_tokenizer(cfg)
    from rlhf_switch.agent.config import prompt_renderer

    # prompts rendered (chat template; an agent run's first turn), too-long dropped
    splits, read_line = load_splits(cfg, tok, prompt_renderer(cfg, tok))
    state.say(read_line)
    for note in getattr(cfg.algorithm, "off_paper_notes", lambda: [])():  # algorithm.off_paper's choices
        state.say(f"note: {note}")
    # its workers (if any) start now and import the function while the warm start runs
    inputs = {"tok": tok, "splits": splits,
              "reward_runner": RewardRunner(cfg.reward_fn, cfg.reward_workers, cfg.reward_timeout_s, say=state.say)}
    try:
        state.say(f"reward: the environment's ({cfg.agent.env})" if cfg.agent is not None
                  else f"reward: {inputs['reward_runner']!r}")
        hf = cfg.model.hf_dict()
        inputs.update(max_ctx=context_length(hf), eos_id=hf.get("eos_token_id"))
        write_run_config(state.out_dir, cfg)
        # before the warm start: a logging backend that cannot start (W&B not logged in) is refused first
        state.log = MetricsLog(state.out_dir, cfg.logging, resume_from=state.first if resuming else None,
                               config=cfg.model_dump(mode="json"))
        state.init_dir = warm_start(cfg, state.out_dir / "init", state.quiet)
    except BaseException:
        close_started(state, inputs)
        raise
    state.say(f"warm start: {state.init_dir} ({time.perf_counter() - t_start:.1f} s)")
    return inputs


def build(state: RunState, loop: Loop, inputs: dict, ray, devices, resume_dir, t_start: float) -> None:
    """The actors and engines of the first iteration's world, from the warm start (or the
    checkpoint being resumed), and the loop's parts over them."""
    cfg, world_cfg = state.cfg, state.cfg.at_iteration(state.first)
    state.cluster = Cluster(world_cfg, ray, state.quiet,
                            devices=devices.slots(range(world_cfg.world_size)) if devices else None,
                            lend=cfg.elastic is not None and cfg.elastic.lend != "off")
    built = state.cluster.build(state.init_dir, resume_dir)
    if resume_dir is not None and int(built["start"].get("iteration", -1)) != state.first - 1:
        raise RuntimeError(f"{resume_dir}: the engines loaded iteration {built['start'].get('iteration')}, "
                           f"the driver read {state.first - 1}")
    resumed = (f"resumed from {resume_dir} at iteration {state.first} of {state.iterations}; " if resume_dir else "")
    state.say(f"{cfg.world_size} workers: train {built['trainer']}, rollout {built['rollout']}, "
              f"{built['params']:,} params; {resumed}ready in {time.perf_counter() - t_start:.1f} s")
    loop.ready(inputs["splits"], inputs["tok"], inputs["reward_runner"], inputs["max_ctx"], inputs["eos_id"])


def iterate(state: RunState, loop: Loop, elastic) -> None:
    """Iterations ``state.first .. state.last``, elastic control between them; a failed iteration
    is recovered (a lost trainer: ``ElasticControl.recover``) and run again, or raised."""
    it = state.first
    while it <= state.last:
        try:
            elastic.between_iterations(it)
            loop.iteration(it, elastic)
        except Exception as e:  # noqa: BLE001 - a lost trainer is recovered; anything else is raised
            it = elastic.recover(e, it)
            continue
        it += 1


def close_started(state: RunState, inputs: dict | None, ok: bool = False) -> None:
    """What ``start`` started, closed: the run log and the reward function's workers."""
    if state.log is not None:
        state.log.close(ok)
    if inputs is not None:
        inputs["reward_runner"].close()


# --- the command line ------------------------------------------------------------------------------

def add_arguments(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The loop's options (``rlhf-switch train`` and ``python -m recipes.grpo|ppo``)."""
    ap.add_argument("config", metavar="CONFIG",
                    help="the run's YAML (docs/configuration.md); its algorithm.name picks the algorithm")
    ap.add_argument("--iterations", type=int, metavar="N",
                    help="the run's TOTAL number of iterations (0 .. N-1), also with --resume: a resumed run "
                         "stops where the uninterrupted one stops (default: the config's algorithm.iterations)")
    ap.add_argument("--output-dir", metavar="DIR",
                    help="where checkpoints/, final/, metrics.jsonl, rollouts.jsonl, tensorboard/ (and wandb/, mlflow.db) "
                         "and the plot go (default: the config's output_dir)")
    ap.add_argument("--resume", nargs="?", const=True, default=None, metavar="DIR",
                    help="finish an interrupted run: continue from the newest complete checkpoint of this run "
                         "(checkpoints/step_K or final/), or from DIR, up to the total; the records written after "
                         "that checkpoint are dropped from metrics.jsonl and rollouts.jsonl. A finished run (final/ "
                         "holds iteration N-1) is reported as finished, exit 0; a larger N continues it")
    ap.add_argument("--stale-tol", type=float, default=None, metavar="T",
                    help="the stale-weights check: the largest difference between the trainer's and the rollout "
                         "engine's log-probs of the generated tokens that passes (default: 1e-4 in float32; in "
                         "bfloat16/float16, 4x the first iteration's gap, where both hold the same weights)")
    ap.add_argument("--quiet", action="store_true", help="no progress bars and no per-iteration lines")
    ap.add_argument("--verbose", action="store_true",
                    help="vLLM's INFO logs too (default: its warnings and errors only, so they do not interleave "
                         "with the progress bars; sets VLLM_LOGGING_LEVEL=INFO for the run's vLLM processes)")
    return ap


def run_args(a: argparse.Namespace, algorithm: str | None = None) -> int:
    """Run the loop with parsed options; the exit code (2: bad input, 3: stale weights, 4: a member
    of the run failed — a rollout engine, a weight sync —, said in one line)."""
    from recipes.run_log import BackendFailed
    from rlhf_switch.rl.config import ConfigError
    from rlhf_switch.rl.rewards import RewardError

    try:
        run(a.config, a.iterations, a.output_dir, a.stale_tol, a.quiet, a.resume, algorithm=algorithm,
            verbose=a.verbose)
    except (ConfigError, FileNotFoundError, RewardError, BackendFailed) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except StaleWeightsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    except (RolloutEngineFailed, SyncFailed) as e:
        print(f"error: {e}", file=sys.stderr)
        return 4
    return 0


def main(argv=None, algorithm: str | None = None) -> int:
    ap = argparse.ArgumentParser(prog=f"python -m recipes.{algorithm or 'train'}", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    return run_args(add_arguments(ap).parse_args(argv), algorithm)


if __name__ == "__main__":
    sys.exit(main())
