"""``recipes/common.py`` without Ray or engines: the checkpoints a run keeps and the one a resumed
run continues from — with more than ten of them, where the order of the directories' names
(``step_10`` < ``step_2``) is not the order of their steps —, what a finished run says, the
prompts and seeds of an iteration, the stale-weights check's bound, fault injection.

Every checkpoint here is a real one (``FullState.save_dir`` of a two-tensor model, as the loop's
save writes it: complete, its iteration recorded beside the scalars).
"""
from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import pytest

from recipes.common import (SEEDS_PER_ITERATION, RunFinished, StaleTolerance, checkpoint_iteration, draw_extra_prompts,
                            draw_prompts, epoch_order, fault, prune_checkpoints, resolve_resume, sample_seeds)


def _save(path: Path, iteration: int, critic: bool = False) -> Path:
    """A checkpoint of the loop holding ``iteration`` (``critic``: PPO's ``critic/`` inside it)."""
    from rlhf_switch.engines.full_state import FullState
    from rlhf_switch.vps import synthetic_spec

    spec = synthetic_spec([("w", (2, 3), "float32", "replicate"), ("b", (3,), "float32", "replicate")])
    FullState(spec, scalars={"step": iteration + 1}).save_dir(path, extra={"iteration": iteration})
    if critic:
        FullState(spec, scalars={"step": iteration + 1}).save_dir(path / "critic")
    return path


def _steps(root: Path) -> list[str]:
    return sorted((p.name for p in root.iterdir()), key=lambda n: (len(n), n))


# --------------------------------------------------------------------------- keeping and resuming


def test_pruning_keeps_the_newest_steps_by_number_past_step_10_and_resume_takes_the_newest(tmp_path):
    """``save_every: 1``, ``keep: 3``, twelve iterations, pruned after every save as the loop does:
    the three newest by step number stay (from ``step_10`` on, name order would delete the newest
    and keep ``step_7..9``), and ``--resume`` continues from the newest, ``step_12`` (iteration 11)."""
    from rlhf_switch.engines.full_state import latest_checkpoint

    out = tmp_path / "run"
    root = out / "checkpoints"
    for it in range(12):
        _save(root / f"step_{it + 1}", it)
        prune_checkpoints(root, 3)
        assert _steps(root) == [f"step_{s}" for s in range(max(1, it - 1), it + 2)], it
    assert _steps(root) == ["step_10", "step_11", "step_12"]
    assert resolve_resume(True, out, 20) == (root / "step_12", 11)
    assert resolve_resume("auto", out, 20) == (root / "step_12", 11)
    assert latest_checkpoint(root) == root / "step_12"


def test_pruning_keeps_what_is_not_a_numbered_step_and_keep_1(tmp_path):
    """Only ``step_<N>`` directories are pruned: a save in progress (``step_13.tmp``) and other
    names stay; ``keep`` at least the number there prunes nothing; ``keep: 1`` keeps the newest."""
    root = tmp_path / "checkpoints"
    for step in (9, 10, 2, 11):
        (root / f"step_{step}").mkdir(parents=True)
    (root / "step_13.tmp").mkdir()
    (root / "step_x").mkdir()
    prune_checkpoints(root, 4)
    assert _steps(root) == ["step_2", "step_9", "step_x", "step_10", "step_11", "step_13.tmp"]
    prune_checkpoints(root, 2)
    assert _steps(root) == ["step_x", "step_10", "step_11", "step_13.tmp"]
    prune_checkpoints(root, 1)
    assert _steps(root) == ["step_x", "step_11", "step_13.tmp"]


def test_pruning_never_fails_the_run_on_what_it_cannot_remove(tmp_path):
    """Pruning after a save is best effort: a ``step_<N>`` it cannot remove (here a file, not a
    directory) is left where it is and the run goes on; the directories beside it are pruned."""
    root = tmp_path / "checkpoints"
    for step in (1, 3):
        (root / f"step_{step}").mkdir(parents=True)
    (root / "step_2").write_text("not a checkpoint")
    prune_checkpoints(root, 1)
    assert _steps(root) == ["step_2", "step_3"]
    assert (root / "step_2").read_text() == "not a checkpoint"


def test_resume_takes_the_newest_complete_checkpoint_by_iteration_not_by_name(tmp_path):
    """Among ``step_2``, ``step_10`` and ``step_11`` the newest is ``step_11``; a ``final/`` of the
    same iteration as the newest step wins the tie; an incomplete newest is skipped; the total
    decides whether anything is left to run."""
    out = tmp_path / "run"
    root = out / "checkpoints"
    for step in (2, 11, 10):
        _save(root / f"step_{step}", step - 1)
    (root / "step_12.tmp").mkdir()  # a save that died before its rename
    (root / "notes").mkdir()
    assert resolve_resume(True, out, 12) == (root / "step_11", 10)
    assert resolve_resume(True, out, 12, parts=()) == (root / "step_11", 10)
    # the continued run's last iteration is 11 of 12: a checkpoint of iteration 10 leaves one to run
    with pytest.raises(RunFinished) as e:
        resolve_resume(True, out, 11)
    assert str(e.value) == (f"the run is finished: {root / 'step_11'} holds iteration 10 (11 iterations); nothing "
                            f"to resume. Raise --iterations (the run's total) to continue it.")
    with pytest.raises(RunFinished) as e:
        resolve_resume(True, out, 10)
    assert str(e.value) == (f"the run is finished: {root / 'step_11'} holds iteration 10 (11 iterations, beyond the "
                            f"10 asked for); nothing to resume. Raise --iterations (the run's total) to continue it.")
    final = _save(out / "final", 10)
    assert resolve_resume(True, out, 13) == (final, 10)  # final/ and step_11 both hold iteration 10
    (final / "COMPLETE").unlink()
    (root / "step_11" / "COMPLETE").unlink()
    assert resolve_resume(True, out, 13) == (root / "step_10", 9)
    assert resolve_resume(False, out, 13) is None and resolve_resume(None, out, 13) is None


def test_resume_with_parts_skips_checkpoints_without_them(tmp_path):
    """PPO: a checkpoint whose ``critic/`` is missing (a save that died between the two) is skipped
    by ``--resume`` and refused by ``--resume DIR``, naming what is missing."""
    out = tmp_path / "run"
    root = out / "checkpoints"
    with_critic = _save(root / "step_9", 8, critic=True)
    _save(root / "step_10", 9)
    assert resolve_resume(True, out, 20, parts=("critic",)) == (with_critic, 8)
    assert resolve_resume(True, out, 20) == (root / "step_10", 9)
    _save(out / "final", 9)  # no critic either: skipped
    assert resolve_resume(True, out, 20, parts=("critic",)) == (with_critic, 8)
    with pytest.raises(FileNotFoundError) as e:
        resolve_resume(str(root / "step_10"), out, 20, parts=("critic", "reward"))
    assert str(e.value) == (f"--resume {root / 'step_10'}: no complete critic/, reward/ checkpoint in it "
                            f"(this run needs one)")
    assert resolve_resume(str(with_critic), out, 20, parts=("critic",)) == (with_critic, 8)
    assert resolve_resume(str(root / "step_10"), out, 20) == (root / "step_10", 9)


def test_resume_refuses_what_is_not_a_checkpoint(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(FileNotFoundError) as e:
        resolve_resume(True, out, 5)
    assert str(e.value) == (f"--resume: no complete checkpoint under {out / 'checkpoints'} or {out / 'final'}")
    (out / "checkpoints" / "step_3").mkdir(parents=True)  # not complete
    (out / "checkpoints" / "step_4").write_text("")  # not a directory
    with pytest.raises(FileNotFoundError, match="no complete checkpoint under"):
        resolve_resume(True, out, 5)
    with pytest.raises(FileNotFoundError) as e:
        resolve_resume(str(out / "checkpoints" / "step_3"), out, 5)
    assert str(e.value) == f"--resume {out / 'checkpoints' / 'step_3'}: not a complete checkpoint directory"
    # complete, but not the loop's: no iteration recorded
    from rlhf_switch.engines.full_state import FullState
    from rlhf_switch.vps import synthetic_spec

    other = FullState(synthetic_spec([("w", (2,), "float32", "replicate")])).save_dir(tmp_path / "sft")
    with pytest.raises(FileNotFoundError) as e:
        resolve_resume(str(other), out, 5)
    assert str(e.value) == f"--resume {other}: not a checkpoint of the loop (no iteration recorded)"
    assert checkpoint_iteration(_save(tmp_path / "zero", 0)) == 0  # iteration 0 is recorded, not missing


# --------------------------------------------------------------------------- prompts and seeds


def _cfg(name="grpo", seed=7, k=3):
    return SimpleNamespace(algorithm=SimpleNamespace(name=name, prompts_per_iteration=k), seed=seed)


def test_epoch_order_and_draw_prompts_walk_each_epoch_in_its_own_seeded_order():
    cfg = _cfg()
    want = list(range(5))
    random.Random("grpo:7:epoch1").shuffle(want)  # the order's seed, written out
    assert epoch_order(cfg, 5, 1) == want
    assert sorted(epoch_order(cfg, 5, 0)) == list(range(5)) and epoch_order(cfg, 5, 0) != epoch_order(cfg, 5, 1)
    assert epoch_order(_cfg(seed=8), 5, 1) != want and epoch_order(_cfg(name="ppo"), 5, 1) != want
    splits = SimpleNamespace(train=[f"p{i}" for i in range(5)])
    e0, e1 = epoch_order(cfg, 5, 0), epoch_order(cfg, 5, 1)
    walk = [f"p{i}" for i in e0 + e1]
    # iterations of 3 prompts over 5: the second straddles the epochs, each epoch holds every prompt once
    assert [draw_prompts(cfg, splits, it) for it in range(3)] == [walk[0:3], walk[3:6], walk[6:9]]


def test_draw_extra_prompts_is_a_stream_of_its_own_per_iteration_and_draw():
    cfg = _cfg(k=3)
    splits = SimpleNamespace(train=[f"p{i}" for i in range(5)])
    rng = random.Random("grpo:7:iteration4:draw2")
    assert draw_extra_prompts(cfg, splits, 4, 2) == [f"p{i}" for i in rng.sample(range(5), 3)]
    assert draw_extra_prompts(cfg, splits, 4, 2) == draw_extra_prompts(cfg, splits, 4, 2)
    assert len(set(draw_extra_prompts(cfg, splits, 4, 2))) == 3  # without replacement
    few = SimpleNamespace(train=["a", "b"])  # fewer prompts than an iteration takes: each once
    assert sorted(draw_extra_prompts(cfg, few, 0, 1)) == ["a", "b"]


def test_sample_seeds_are_the_iterations_own_range():
    cfg = _cfg(seed=2)
    base = (2 * 1_000_003 + 5) * SEEDS_PER_ITERATION
    assert SEEDS_PER_ITERATION == 65_536
    assert sample_seeds(cfg, 5, 3) == [base, base + 1, base + 2]
    assert sample_seeds(cfg, 5, 2, first=4) == [base + 4, base + 5]
    assert sample_seeds(cfg, 5, 1, first=SEEDS_PER_ITERATION - 1) == [base + SEEDS_PER_ITERATION - 1]
    with pytest.raises(ValueError) as e:
        sample_seeds(cfg, 5, 2, first=SEEDS_PER_ITERATION - 1)
    assert str(e.value) == "65537 samples in one iteration: more than its 65536 seeds"


# --------------------------------------------------------------------------- the stale-weights bound, faults


def test_stale_tolerance_by_dtype():
    given = StaleTolerance(0.02, "bfloat16")
    assert (given.value, given.source, given.bound(5.0), given.value) == (0.02, "given", 0.02, 0.02)
    f32 = StaleTolerance(None, "float32")
    assert (f32.value, f32.source, f32.bound(1.0)) == (1e-4, "float32", 1e-4)
    bf16 = StaleTolerance(None, "bfloat16")
    assert (bf16.value, bf16.source) == (None, "")
    assert bf16.bound(0.01) == 0.04 and bf16.source == "bfloat16: 4 x the first iteration's 0.01"
    assert bf16.bound(0.3) == 0.04  # calibrated once
    tiny = StaleTolerance(None, "float16")
    assert tiny.bound(1e-6) == 1e-4  # never under the floor
    at = StaleTolerance(None, "float16")
    assert at.bound(0.1) == pytest.approx(0.4)  # the ceiling itself is calibrated on
    over = StaleTolerance(None, "bfloat16")
    assert over.bound(0.7) == 0.5 and over.source == "bfloat16 ceiling (first gap 0.7 not calibrated on)"


def test_fault_crashes_only_in_the_named_iterations():
    fault([2, 5], 3, "after generation")
    with pytest.raises(RuntimeError) as e:
        fault([2, 5], 5, "after generation")
    assert str(e.value) == "injected crash in iteration 5 (after generation)"


# --------------------------------------------------------------------------- evaluation, the run's config


class GreedyCluster:
    """Stands in for the cluster's ``generate`` (not what is tested here): it answers each prompt
    with the ids of the response named for it, and logs what it was asked."""

    def __init__(self, tok, responses):
        self.tok, self.responses, self.asked = tok, responses, []

    def generate(self, prompts, seeds, max_new_tokens, temperature):
        self.asked.append((prompts, seeds, max_new_tokens, temperature))
        return [self.tok.encode(r, add_eos=True) for r in self.responses], None


def test_the_evaluator_decodes_greedy_responses_of_the_first_heldout_prompts_and_scores_them():
    from rlhf_switch.rl.tasks import CharTokenizer, Sample

    tok = CharTokenizer()
    heldout = (Sample("1+1=", "2"), Sample("2+2=", "4"), Sample("3+3=", "6"))
    from rlhf_switch.rl.config import EvalConfig

    cfg = SimpleNamespace(eval=EvalConfig(num_prompts=2), algorithm=SimpleNamespace(max_new_tokens=3))
    seen = []

    def reward(prompts, responses, answers):
        seen.append((prompts, responses, answers))
        return [float(r == a) for r, a in zip(responses, answers)]

    from recipes.common import Evaluator

    ev = Evaluator(cfg, SimpleNamespace(heldout=heldout), tok, reward, max_ctx=16)
    assert ev.samples == list(heldout[:2])
    assert ev.prompts == [tok.encode("1+1=", add_bos=True), tok.encode("2+2=", add_bos=True)]
    cluster = GreedyCluster(tok, ["2", "5"])
    assert ev(cluster) == 0.5
    assert cluster.asked == [(ev.prompts, [0, 0], 3, 0.0)]  # greedy, seed 0, the algorithm's length
    assert seen == [(["1+1=", "2+2="], ["2", "5"], ["2", "4"])]
    assert ev.responses == [tok.encode("2", add_eos=True), tok.encode("5", add_eos=True)]
    with pytest.raises(ValueError, match="with max_new_tokens=3"):  # a prompt the context cannot take
        Evaluator(cfg, SimpleNamespace(heldout=heldout), tok, reward, max_ctx=7)
    # eval.split: all — the held-out prompts, then the train ones
    train = (Sample("4+4=", "8"), Sample("5+5=", "10"))
    splits = SimpleNamespace(heldout=heldout, train=train)
    assert EvalConfig(num_prompts=4, split="all").samples(splits) == list(heldout) + [train[0]]
    assert EvalConfig(num_prompts=4).samples(splits) == list(heldout)


def test_the_run_config_is_written_as_the_run_follows_it(tmp_path):
    import yaml

    from recipes.common import write_run_config

    class Config:
        def model_dump(self):
            return {"seed": 3, "elastic": {"schedule": [{"iteration": 2, "world_size": 4}]}, "algorithm": {"a": 1}}

    write_run_config(tmp_path, Config())
    text = (tmp_path / "config.yaml").read_text()
    assert yaml.safe_load(text) == Config().model_dump()
    assert text.index("seed") < text.index("elastic") < text.index("algorithm")  # the config's order kept
