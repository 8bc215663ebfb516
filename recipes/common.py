"""What the GRPO and PPO recipes share besides the actors (``recipes/cluster.py``) and the user's
view (``recipes/run_log.py``): the warm start, held-out evaluation, the prompts and seeds of an
iteration, the run's config as it follows it, checkpoints to keep and to resume from, fault
injection. (What a config is checked for before anything starts: ``rlhf_switch.problems``.)
"""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Sequence

class StaleWeightsError(RuntimeError):
    """The rollout engine generated with weights other than the trainer's."""


class StaleTolerance:
    """The stale-weights check's bound on ``max |log π_train - log π_rollout|`` over the tokens
    generated with the trainer's weights. Given (``--stale-tol T``): that. Else by the compute
    dtype: float32 — ``FLOOR`` (1e-4: rounding is ~1e-6 there); bfloat16/float16 — calibrated on
    the run's first iteration, where the trainer and the rollout engine hold the same weights
    (both loaded from one warm start or checkpoint, then synced): ``FACTOR`` × that iteration's
    largest gap, at least ``FLOOR``. A first gap above ``CEILING`` (far more than the dtype's
    rounding) is not calibrated on: the check fails it with the ceiling as its bound."""

    FLOOR = 1e-4
    FACTOR = 4.0
    CEILING = {"bfloat16": 0.5, "float16": 0.1}

    def __init__(self, given: float | None, compute_dtype: str):
        self.dtype = compute_dtype
        self.value = given if given is not None else (self.FLOOR if compute_dtype not in self.CEILING else None)
        self.source = "given" if given is not None else ("float32" if self.value is not None else "")

    def bound(self, first_gap: float) -> float:
        """The bound for this iteration's check; ``first_gap``: its largest gap, which calibrates
        the bound when none is set yet (the run's first iteration)."""
        if self.value is None:
            ceiling = self.CEILING[self.dtype]
            if first_gap > ceiling:
                self.value, self.source = ceiling, f"{self.dtype} ceiling (first gap {first_gap:.3g} not calibrated on)"
            else:
                self.value = max(self.FLOOR, self.FACTOR * first_gap)
                self.source = f"{self.dtype}: {self.FACTOR:g} x the first iteration's {first_gap:.3g}"
        return self.value


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
        return Path(sft_warm_start(cfg, out_dir, progress=not quiet, log=None if quiet else print,
                                   train=agent_warm_start(cfg)))
    finally:
        torch.set_num_threads(threads)


def agent_warm_start(cfg):
    """An agent run's SFT (``warm_start``'s ``train``): on the transcripts its environment class
    writes for the task's train samples (``warm_start_transcripts``, a function or its
    ``module:function``: ``(samples, tokenizer, max_context, seed, max_turns, **env_kwargs)``: ``calc`` and ``guess`` play scripted experts through the
    episode driver), the loss on the player's tokens only. None — the task's prompt → answer SFT —
    for a run without an agent block or an environment without transcripts."""
    if cfg.agent is None or cfg.sft is None or not cfg.sft.steps:
        return None
    from rlhf_switch.agent.config import prompt_renderer
    from rlhf_switch.agent.env import environment_class

    write = getattr(environment_class(cfg.agent.env), "warm_start_transcripts", None)
    if write is None:
        return chat_prompts_sft(cfg)
    if isinstance(write, str):  # "module:function": the environment's module need not import its experts
        from rlhf_switch.rl.imports import import_named

        write = import_named(write, "warm_start_transcripts")

    def train(model):
        from rlhf_switch.agent.sft import sft_transcripts
        from rlhf_switch.rl.data import load_splits
        from rlhf_switch.rl.tokenizer import load_tokenizer

        tok = load_tokenizer(cfg)
        splits, _ = load_splits(cfg, tok, prompt_renderer(cfg, tok))
        transcripts = write(splits.train, tok, int(model.config.max_position_embeddings), cfg.seed,
                            cfg.agent.max_turns, **cfg.agent.env_kwargs)
        return sft_transcripts(model, transcripts, cfg.sft.steps, cfg.sft.lr, cfg.sft.batch_size, cfg.seed)
    name = json.dumps({"env": cfg.agent.env, "env_kwargs": cfg.agent.env_kwargs, "max_turns": cfg.agent.max_turns},
                      sort_keys=True)
    return f"agent transcripts {name}", train


def chat_prompts_sft(cfg):
    """A chat agent run's prompt → answer SFT (``warm_start``'s ``train``; an environment without
    transcripts): on the prompts as its episodes start, the system message and the environment's
    tools in the template's first turn (``agent.config.prompt_renderer``) — named by what writes
    them, so the warm start's fingerprint changes with them. None for any other run."""
    if cfg.data is None or not cfg.data.chat_template:
        return None

    def train(model):
        from rlhf_switch.agent.config import prompt_renderer
        from rlhf_switch.rl.sft import data_sft_samples, sft
        from rlhf_switch.rl.tokenizer import load_tokenizer

        tok = load_tokenizer(cfg)
        tok, samples = data_sft_samples(cfg, tok, prompt_renderer(cfg, tok))
        return sft(model, None, cfg.sft, cfg.seed, progress=False, max_new_tokens=cfg.algorithm.max_new_tokens,
                   samples=samples, tokenizer=tok)
    name = json.dumps({"env": cfg.agent.env, "env_kwargs": cfg.agent.env_kwargs, "system": cfg.agent.system},
                      sort_keys=True)
    return f"chat prompts {name}", train


class Evaluator:
    """Greedy decoding of the first ``eval.num_prompts`` held-out prompts on the rollout engine
    (whatever weights it holds now), scored with the run's reward (``task`` or ``data``); the
    last call's responses stay in ``responses`` (a reward model scores them too)."""

    def __init__(self, cfg, splits, tokenizer, reward, max_ctx: int):
        from rlhf_switch.rl.tasks import encode_prompt

        self.samples = cfg.eval.samples(splits)
        self.prompts = [encode_prompt(tokenizer, s.prompt, cfg.algorithm.max_new_tokens, max_ctx) for s in self.samples]
        # reward(prompts, responses, answers) -> scores: the run's RewardRunner
        self.cfg, self.tok, self.reward = cfg, tokenizer, reward

    def __call__(self, cluster) -> float:
        tokens, _ = cluster.generate(self.prompts, [0] * len(self.prompts), self.cfg.algorithm.max_new_tokens, 0.0)
        self.responses = tokens
        texts = [self.tok.decode(t) for t in tokens]
        scores = self.reward([s.prompt for s in self.samples], texts, [s.answer for s in self.samples])
        return sum(scores) / len(scores)


def epoch_order(cfg, n: int, epoch: int) -> list[int]:
    """The order of the ``n`` train prompts in ``epoch``: a permutation seeded by (seed, epoch)."""
    order = list(range(n))
    random.Random(f"{cfg.algorithm.name}:{cfg.seed}:epoch{epoch}").shuffle(order)
    return order


def draw_prompts(cfg, splits, iteration: int):
    """The iteration's prompts: a function of (seed, iteration) only, so a resumed run draws
    exactly what the uninterrupted one would have. The train split is walked epoch by epoch, each
    epoch in its own seeded order, so every prompt is drawn once per epoch (an iteration that
    straddles two epochs may hold a prompt twice)."""
    k, n = cfg.algorithm.prompts_per_iteration, len(splits.train)
    picked, orders = [], {}
    for pos in range(iteration * k, (iteration + 1) * k):
        epoch, index = divmod(pos, n)
        if epoch not in orders:
            orders[epoch] = epoch_order(cfg, n, epoch)
        picked.append(splits.train[orders[epoch][index]])
    return picked


def draw_extra_prompts(cfg, splits, iteration: int, draw: int):
    """Dynamic sampling's ``draw``-th extra round of an iteration (``draw`` >= 1):
    ``prompts_per_iteration`` train prompts from a stream seeded by (seed, iteration, draw) alone,
    apart from the epoch walk ``draw_prompts`` makes, so a resumed run draws the same."""
    k = cfg.algorithm.prompts_per_iteration
    rng = random.Random(f"{cfg.algorithm.name}:{cfg.seed}:iteration{iteration}:draw{draw}")
    return [splits.train[i] for i in rng.sample(range(len(splits.train)), min(k, len(splits.train)))]


SEEDS_PER_ITERATION = 65_536


def sample_seeds(cfg, iteration: int, n: int, first: int = 0) -> list[int]:
    """One sampling seed per sequence: independent of the rollout layout (TP, replicas).
    ``first``: where this batch's seeds start among the iteration's (dynamic sampling's extra rounds)."""
    if first + n > SEEDS_PER_ITERATION:
        raise ValueError(f"{first + n} samples in one iteration: more than its {SEEDS_PER_ITERATION} seeds")
    base = (cfg.seed * 1_000_003 + iteration) * SEEDS_PER_ITERATION
    return [base + first + i for i in range(n)]


def write_run_config(out_dir: Path, cfg) -> None:
    """``<output_dir>/config.yaml``: the config the run follows, accepted resize requests
    included as ``elastic.schedule`` entries (``--resume`` with it takes the same resizes)."""
    import yaml

    (out_dir / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(), sort_keys=False))


def prune_checkpoints(root: Path, keep: int) -> None:
    done = sorted((p for p in root.glob("step_*") if p.name[5:].isdigit()), key=lambda p: int(p.name[5:]))
    for p in done[:-keep]:
        shutil.rmtree(p, ignore_errors=True)


class RunFinished(Exception):
    """``--resume`` of a run whose ``final/`` already holds its last iteration: nothing to do."""


def checkpoint_iteration(path: Path) -> int:
    """The last iteration a checkpoint of the loop holds (``extra["iteration"]``)."""
    from rlhf_switch.engines.full_state import checkpoint_extra

    it = checkpoint_extra(path).get("iteration")
    if it is None:
        raise FileNotFoundError(f"--resume {path}: not a checkpoint of the loop (no iteration recorded)")
    return int(it)


def resolve_resume(resume: str | bool | None, out_dir: Path, iterations: int,
                   parts: Sequence[str] = ()) -> tuple[Path, int] | None:
    """Where a resumed run continues from: ``(checkpoint, its last iteration)``, or None without
    ``--resume``. ``iterations`` is the run's TOTAL (iterations ``0 .. iterations-1``), so the run
    continues at the checkpoint's iteration + 1 and stops where the uninterrupted run stops.

    ``--resume`` (``True``/``"auto"``) takes the newest complete checkpoint of this run — the newest
    ``checkpoints/step_<N>`` or ``final/``, by iteration; ``parts`` are subdirectories each must hold
    complete too (PPO: ``critic``), so a save that died between the actor and the critic is skipped.
    ``--resume DIR`` takes DIR. If that checkpoint already holds the last iteration (a finished run,
    or a total lowered since) ``RunFinished`` is raised before anything starts; a ``final/`` of a run
    whose total was raised since is continued from."""
    from rlhf_switch.engines.full_state import is_checkpoint

    if not resume:
        return None

    def whole(p: Path) -> bool:
        return p.is_dir() and is_checkpoint(p) and all(is_checkpoint(p / part) for part in parts)

    if resume is True or resume == "auto":
        root = out_dir / "checkpoints"
        found = [p for p in root.glob("step_*") if p.name[5:].isdigit() and whole(p)] if root.is_dir() else []
        if whole(out_dir / "final"):
            found.append(out_dir / "final")
        if not found:
            raise FileNotFoundError(f"--resume: no complete checkpoint under {root} or {out_dir / 'final'}")
        at = {p: checkpoint_iteration(p) for p in found}
        path = max(found, key=lambda p: (at[p], p.name == "final"))
        iteration = at[path]
    else:
        path = Path(resume)
        if not is_checkpoint(path):
            raise FileNotFoundError(f"--resume {path}: not a complete checkpoint directory")
        missing = [part for part in parts if not is_checkpoint(path / part)]
        if missing:
            raise FileNotFoundError(f"--resume {path}: no complete {', '.join(m + '/' for m in missing)} checkpoint "
                                    f"in it (this run needs one)")
        iteration = checkpoint_iteration(path)
    if iteration >= iterations - 1:
        beyond = f", beyond the {iterations} asked for" if iteration > iterations - 1 else ""
        raise RunFinished(f"the run is finished: {path} holds iteration {iteration} "
                          f"({iteration + 1} iterations{beyond}); nothing to resume. Raise --iterations "
                          f"(the run's total) to continue it.")
    return path, iteration


def fault(at: Sequence[int], iteration: int, what: str) -> None:
    """Fault injection for tests: a crash in the middle of iteration ``iteration``."""
    if iteration in at:
        raise RuntimeError(f"injected crash in iteration {iteration} ({what})")

