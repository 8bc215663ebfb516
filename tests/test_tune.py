"""``rlhf-switch tune``: the legal layouts are exactly what ``rlhf-switch train`` accepts, the
memory and cost models are the stated formulas (the switch: the planner's own bytes), the ranking
is the exhaustive one, and bad input is one message, exit 2. Pure functions and two CLI
subprocesses; no training runs (bench/tune_validate.py compares with real runs)."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from test_loop_inputs import config as shipped

REPO = Path(__file__).resolve().parents[1]


def config(name: str = "grpo_tiny.yaml", **changes) -> dict:
    """A shipped config (the DeepSpeed + vLLM one by default) with ``changes`` applied."""
    return shipped(name, **changes)


@pytest.fixture(scope="module")
def grpo():
    from rlhf_switch.rl.config import load_config
    from rlhf_switch.tune import Workload

    cfg = load_config(config())
    return cfg, Workload.from_config(cfg)


@pytest.fixture(scope="module")
def cpu():
    from rlhf_switch.tune import load_profile

    return load_profile("cpu_local")


# --- enumeration: the config's checks and the engine registry decide --------------------------------

@pytest.mark.parametrize("world", [2, 4])
def test_every_enumerated_combination_passes_trains_own_checks(grpo, world):
    from rlhf_switch.problems import run_problems
    from rlhf_switch.tune import Combination, enumerate_combinations
    from rlhf_switch.tune.enumerate import combination_problems

    cfg, _ = grpo
    phases = enumerate_combinations(cfg, world)
    assert phases["critic"] == []
    legal = []
    for t in phases["train"]:
        for r in phases["rollout"]:
            combo = Combination(t, r, phases["reference"][0])
            if not combination_problems(cfg, combo):
                legal.append(combo)
    assert len(legal) >= 8
    for combo in legal:
        run = combo.apply(cfg)
        assert run_problems(run, skip=("reward",)) == [], combo


def test_the_shipped_layouts_are_enumerated_and_illegal_ones_are_not(grpo):
    from rlhf_switch.tune import describe, enumerate_combinations

    cfg, _ = grpo
    phases = enumerate_combinations(cfg, 4)
    train = {describe(t) for t in phases["train"]}
    assert "deepspeed ZeRO3·DP4" in train and "torch_tp TP2·DP2" in train and "torch_pp TP2·PP2" in train
    assert not any(t.engine == "deepspeed" and (t.tp > 1 or t.pp > 1) for t in phases["train"])
    assert not any(t.engine == "torch_pp" and t.dp > 1 for t in phases["train"])
    assert all(t.tp <= 2 for t in phases["train"])  # 2 KV heads: training TP must divide them
    # vLLM replicates KV heads: TP4 over 2 KV heads is a legal rollout
    assert {describe(r) for r in phases["rollout"]} >= {"vllm TP4×1", "vllm TP2×2", "vllm TP1×4", "torch TP2×2"}


def test_the_critic_is_enumerated_only_on_engines_with_a_value_head():
    from rlhf_switch.rl.config import load_config
    from rlhf_switch.tune import enumerate_combinations

    phases = enumerate_combinations(load_config(config("ppo_tiny.yaml")), 2)
    assert phases["critic"] and {c.engine for c in phases["critic"]} <= {"deepspeed", "fsdp2"}


# --- memory -------------------------------------------------------------------------------------------

def test_training_state_is_the_stated_formula(grpo):
    from rlhf_switch.rl.config import TrainLayout
    from rlhf_switch.tune.memory import train_state_bytes

    _, w = grpo
    P = w.params()

    def ds(stage, dp):
        return train_state_bytes(w, TrainLayout(engine="deepspeed", zero_stage=stage, dp=dp))

    # fp32: the weights are the master; ZeRO-1: weights + grads whole, Adam moments /dp
    assert ds(1, 2) == pytest.approx(P * 4 + P * 4 + P * 8 / 2)
    assert ds(2, 2) == pytest.approx(P * 4 + P * 4 / 2 + P * 8 / 2)
    gathered = w.layer_params() * 4 * 2
    assert ds(3, 4) == pytest.approx(P * 16 / 4 + gathered)
    # (a 2-layer model: ZeRO-3's gathered layer is not small beside the rest, so no ZeRO-3 < ZeRO-2 here)
    assert ds(3, 4) < ds(3, 2) and ds(2, 4) < ds(2, 2) < ds(1, 2)
    assert train_state_bytes(w, TrainLayout(engine="deepspeed", zero_stage=1, dp=2), trains=False) == P * 4


def test_kv_cache_follows_replicas_and_tp(grpo):
    from rlhf_switch.rl.config import RolloutLayout
    from rlhf_switch.tune.memory import rollout_bytes

    _, w = grpo
    one = rollout_bytes(w, RolloutLayout(engine="vllm", tp=1, dp=1))
    assert one["kv_cache"] == w.rollout_batch * w.seq * 2 * 2 * 2 * 32 * 4  # layers·(K,V)·KV heads·head_dim·fp32
    assert rollout_bytes(w, RolloutLayout(engine="vllm", tp=1, dp=2))["kv_cache"] == one["kv_cache"] / 2
    assert rollout_bytes(w, RolloutLayout(engine="vllm", tp=2, dp=1))["kv_cache"] == one["kv_cache"] / 2
    # TP4 over 2 KV heads: each worker keeps one (replicated) KV head, no further saving
    assert rollout_bytes(w, RolloutLayout(engine="vllm", tp=4, dp=1))["kv_cache"] == one["kv_cache"] / 2


# --- cost ---------------------------------------------------------------------------------------------

def test_the_switch_is_the_planners_bytes(grpo, cpu):
    from rlhf_switch.engines.base import rollout_engine
    from rlhf_switch.rl.config import RolloutLayout, TrainLayout
    from rlhf_switch.tune.cost import switch_cost, train_layout
    from rlhf_switch.vps import plan_rank
    from rlhf_switch.vps.placement import place

    _, w = grpo
    z1 = TrainLayout(engine="deepspeed", zero_stage=1, dp=2)
    # the small torch engine lives in the trainer's processes: ZeRO-1 holds whole weights, so
    # every byte is a local copy and nothing crosses a process
    local = switch_cost(w, cpu, z1, RolloutLayout(engine="torch", tp=1, dp=2))
    assert local.rank_bytes == 0 and local.messages == 0
    # vLLM runs its own workers: the whole model crosses to each TP1 replica
    vllm = RolloutLayout(engine="vllm", tp=1, dp=2)
    moved = switch_cost(w, cpu, z1, vllm)
    src = place(train_layout(w, z1), range(2), 4)
    dst = place(rollout_engine("vllm").rollout_layout(w.spec, 1, 2, "float32"), range(2, 4), 4)
    plans = [plan_rank(src, dst, r) for r in range(4)]
    assert moved.rank_bytes == max(max(p.bytes_sent, p.bytes_received) for p in plans)
    assert moved.rank_bytes == w.params() * 4 and moved.seconds > local.seconds
    faster = dataclasses.replace(cpu, same_device=dataclasses.replace(cpu.same_device, bandwidth=cpu.same_device.bandwidth * 10))
    assert switch_cost(w, faster, z1, vllm).seconds < moved.seconds


def test_phase_times_respond_to_what_they_model(grpo, cpu):
    from rlhf_switch.rl.config import RolloutLayout, TrainLayout
    from rlhf_switch.tune.cost import decode_seconds, engine_pass

    _, w = grpo
    longer = dataclasses.replace(w, new_tokens=2 * w.new_tokens)
    r = RolloutLayout(engine="vllm", tp=1, dp=2)
    assert decode_seconds(longer, cpu, r, 2) > decode_seconds(w, cpu, r, 2)
    z1, z3 = (TrainLayout(engine="deepspeed", zero_stage=s, dp=2) for s in (1, 3))
    # ZeRO-3 gathers the weights for every forward; ZeRO-1 forwards need no communication
    assert engine_pass(w, cpu, z1, 2, w.rollout_batch, train=False).comm == 0
    assert engine_pass(w, cpu, z3, 2, w.rollout_batch, train=False).comm > 0
    slow_links = dataclasses.replace(cpu, collective_intra=dataclasses.replace(cpu.collective_intra, latency=1.0))
    assert engine_pass(w, slow_links, z3, 2, w.rollout_batch, train=True, steps=4).total > \
        engine_pass(w, cpu, z3, 2, w.rollout_batch, train=True, steps=4).total + 1


def test_ranking_is_the_exhaustive_one_and_refusals_are_one_message(grpo, cpu):
    from rlhf_switch.tune import TuneError, rank

    cfg, w = grpo
    everything = rank(cfg, cpu, top=10_000, workload=w)
    top = rank(cfg, cpu, top=3, workload=w)
    assert [r.seconds["total"] for r in top.rows] == [r.seconds["total"] for r in everything.rows[:3]]
    assert top.planned_pairs <= everything.planned_pairs
    totals = [r.seconds["total"] for r in everything.rows]
    assert totals == sorted(totals) and len(everything.rows) == everything.fitting
    assert all(r.headroom >= 0 and 0 <= r.switch_share < 1 for r in everything.rows)
    with pytest.raises(TuneError, match="does not fit world_size=2 in any training layout"):
        rank(cfg, cpu.with_memory(0.001), workload=w)


def test_profiles_round_trip_and_the_gpu_one_says_where_its_figures_come_from(tmp_path, cpu):
    from rlhf_switch.tune import load_profile, save_profile
    from rlhf_switch.tune.profile import ProfileError

    gpu = load_profile("h100_ib")
    assert "published figures" in gpu.origin and "989" in gpu.sources["matmul_flops"]
    assert cpu.origin.startswith("measured")
    assert load_profile(save_profile(gpu, tmp_path / "p.json")) == gpu
    with pytest.raises(ProfileError, match="no such file"):
        load_profile(tmp_path / "missing.json")


# --- the command line ---------------------------------------------------------------------------------

def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "recipes.cli", "tune", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


def test_cli_out_is_a_config_train_accepts(tmp_path):
    from rlhf_switch.problems import check_run, run_problems
    from rlhf_switch.rl.config import load_config

    out = tmp_path / "best.yaml"
    p = run_cli("configs/grpo_tiny.yaml", "--world-size", "4", "--top", "3", "--out", str(out))
    assert p.returncode == 0, p.stderr
    assert "total s" in p.stdout and len([line for line in p.stdout.splitlines() if line[:2] in ("1 ", "2 ", "3 ")]) == 3
    best = load_config(out)
    check_run(best)
    assert best.world_size == 4 and run_problems(best) == []


def test_cli_a_world_that_cannot_hold_the_model(tmp_path):
    p = run_cli("configs/grpo_tiny.yaml", "--device-memory", "0.001")
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.count("error:") == 1 and "does not fit world_size=2 in any training layout" in p.stderr


def test_vllm_decodes_a_batch_larger_than_its_kv_cache_in_waves(grpo, cpu):
    from rlhf_switch.rl.config import RolloutLayout
    from rlhf_switch.tune import Combination
    from rlhf_switch.tune.cost import decode_seconds
    from rlhf_switch.tune.memory import estimate_memory, rollout_bytes

    cfg, w = grpo
    vllm = RolloutLayout(engine="vllm", tp=2, dp=1)
    combo = Combination(cfg.train, vllm, cfg.reference)
    roomy = estimate_memory(w, combo)
    assert roomy.concurrent_sequences == w.rollout_batch and roomy.rollout_waves == 1
    per_seq = rollout_bytes(w, vllm)["kv_per_sequence"]
    tight = estimate_memory(w, combo, roomy.resident + roomy.rollout_weights + roomy.staging + 40 * per_seq)
    assert tight.concurrent_sequences == 40 and tight.rollout_waves == 4 and tight.kv_cache == 40 * per_seq
    assert decode_seconds(w, cpu, vllm, 2, 40) > decode_seconds(w, cpu, vllm, 2)
    # the small torch engine batches everything at once: its KV cache is the whole batch
    torch_engine = Combination(cfg.train, RolloutLayout(engine="torch", tp=2, dp=1), cfg.reference)
    assert estimate_memory(w, torch_engine, 1.0).kv_cache == w.rollout_batch * per_seq


def test_cli_a_rollout_batch_too_large_for_the_device(tmp_path, capsys):
    from recipes.cli import main

    # 100k-token responses: one sequence's KV cache (~49 MiB per TP2 worker) exceeds a 32 MiB
    # device that holds the training state (~3 MiB)
    path = tmp_path / "long.yaml"
    path.write_text(yaml.safe_dump(config(**{"algorithm.max_new_tokens": 100_000,
                                             "model.hf_config.max_position_embeddings": 131072})))
    assert main(["tune", str(path), "--device-memory", str(32 / 1024)]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "the rollout batch does not fit: even one sequence of" in err
    assert main(["tune", str(tmp_path / "missing.yaml")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main(["tune"]) == 2 and "give a config file" in capsys.readouterr().err


@pytest.mark.parametrize("tp,replicas,cfg", [(1, 2, dict(dp=2, dp_shard="zero3")), (2, 2, dict(tp=2, dp=2)),
                                             (4, 1, dict(pp=2, dp=2, dp_shard="fsdp"))])
def test_lazily_placed_layouts_are_the_placed_ones(grpo, tp, replicas, cfg):
    """``place_lazy`` (what tune plans with, so a 235B move on 1024 ranks stays lazy) is ``place``:
    the same digest, the same fragments and buffers on every rank, the same plan of every rank."""
    from rlhf_switch.vps import ParallelConfig, build_layout, plan_rank
    from rlhf_switch.vps.layouts.vllm import vllm_layout
    from rlhf_switch.vps.placement import place, place_lazy

    spec = grpo[1].spec
    train, gen = build_layout(spec, ParallelConfig(**cfg)), vllm_layout(spec, tp, replicas)
    n, m = train.world_size, gen.world_size
    pairs = [(place(train, range(n), n + m), place_lazy(train, range(n), n + m)),
             (place(gen, range(n, n + m), n + m), place_lazy(gen, range(n, n + m), n + m))]
    for eager, lazy in pairs:
        assert lazy.digest == eager.digest
        for r in range(n + m):
            assert lazy.fragments(r) == eager.fragments(r) and dict(lazy.buffers(r)) == dict(eager.buffers(r))
    (src, lsrc), (dst, ldst) = pairs
    for r in range(n + m):
        a, b = plan_rank(src, dst, r), plan_rank(lsrc, ldst, r)
        assert (a.local, a.sends, a.recvs) == (b.local, b.sends, b.recvs)


def test_the_switch_adds_the_profiles_fixed_cost_per_channel_member(grpo, cpu):
    """A sync calls every member of the weight channel: the trainer's ranks, plus vLLM's workers
    (processes of their own); the torch engine's workers are the trainer's own processes."""
    from rlhf_switch.rl.config import RolloutLayout, TrainLayout
    from rlhf_switch.tune.cost import channel_members, switch_cost

    _, w = grpo
    z1, vllm = TrainLayout(engine="deepspeed", zero_stage=1, dp=2), RolloutLayout(engine="vllm", tp=1, dp=2)
    torch_tp2 = RolloutLayout(engine="torch", tp=2, dp=1)
    assert channel_members(z1, vllm) == 4 and channel_members(z1, torch_tp2) == 2
    bare = dataclasses.replace(cpu, switch_member_s={})
    fixed = dataclasses.replace(cpu, switch_member_s={"vllm": 0.25, "torch": 0.5})
    for rollout, per_sync in ((vllm, 4 * 0.25), (torch_tp2, 2 * 0.5)):
        assert switch_cost(w, fixed, z1, rollout).seconds == pytest.approx(
            switch_cost(w, bare, z1, rollout).seconds + per_sync)


def test_engine_fixed_costs_are_what_the_model_leaves_of_a_loop_shaped_micro_run(grpo, cpu):
    """The calibration charges what the model does not explain of a forward over the log-prob
    pass's micro-batches per micro-batch, and of one step over a mini-batch per step: fed back,
    the model reproduces both measurements."""
    import math

    from recipes.tune_calibrate import engine_fixed_costs
    from rlhf_switch.rl.config import TrainLayout
    from rlhf_switch.tune.cost import engine_key, engine_pass

    _, w = grpo
    for layout in (TrainLayout(engine="fsdp2", dp=2), TrainLayout(engine="torch_pp", pp=2),
                   TrainLayout(engine="deepspeed", zero_stage=3, dp=2)):
        bare = dataclasses.replace(cpu, compute_slots=None, engine_forward_s={}, engine_step_s={})
        fwd_model = engine_pass(w, bare, layout, 2, w.rollout_batch, train=False).total
        forward_s, step_s = fwd_model + 0.4, 3.0
        fwd, step = engine_fixed_costs(w, bare, layout, forward_s, step_s)
        per_rank = w.rollout_batch / layout.dp  # the log-prob pass: logprob_micro_batch_size rows per forward
        micro = max(1, min(w.logprob_micro_batch or w.micro_batch, math.ceil(per_rank)))
        n_micro = math.ceil(per_rank / micro)
        if layout.pp == 1:  # spread over the micro-batches (a pipeline's bubble scales it too)
            assert fwd == pytest.approx(0.4 / n_micro)
        fitted = dataclasses.replace(bare, engine_forward_s={engine_key(layout): fwd},
                                     engine_step_s={engine_key(layout): step})
        assert engine_pass(w, fitted, layout, 2, w.rollout_batch, train=False).total == pytest.approx(forward_s)
        assert engine_pass(w, fitted, layout, 2, w.mini_batch, train=True, steps=1).total == pytest.approx(step_s)


@pytest.mark.parametrize("train,tp,replicas", [(dict(engine="fsdp2", dp=4), 2, 2),
                                               (dict(engine="deepspeed", zero_stage=3, dp=4), 1, 4),
                                               (dict(engine="fsdp2", dp=8), 4, 2)])
def test_a_sharded_trainers_switch_in_closed_form_is_the_planned_one(grpo, train, tp, replicas):
    """Above ``PLANNED_SHARD_FRAGMENTS`` a ZeRO-3 / FSDP2 trainer's switch is a closed form (a 235B
    MoE on 1024 ranks would build every rank's slice of every tensor); on worlds small enough to
    plan, it is the planner's time within 3 % (shards of uneven rows differ by a row)."""
    from rlhf_switch.rl.config import RolloutLayout, TrainLayout
    from rlhf_switch.tune import cost, load_profile

    _, w = grpo
    p = dataclasses.replace(load_profile("h100_ib"), devices_per_node=2)  # intra- and inter-node peers
    t, r = TrainLayout(**train), RolloutLayout(engine="vllm", tp=tp, dp=replicas)
    planned, closed = cost.switch_cost(w, p, t, r), cost._sharded_switch(w, p, t, r)
    assert closed.seconds == pytest.approx(planned.seconds, rel=0.03)
    assert closed.messages == planned.messages


def test_the_switch_fixed_cost_is_a_runs_median_sync_less_its_modelled_bytes_per_member(tmp_path, cpu):
    from recipes.tune_calibrate import switch_member_seconds
    from rlhf_switch.rl.config import load_config
    from rlhf_switch.tune import Workload
    from rlhf_switch.tune.cost import channel_members, switch_cost

    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config()))
    syncs = {0: 5.0, 1: 0.020, 2: 0.012, 3: 0.016}  # iteration 0 (the warm-up) is left out
    (tmp_path / "metrics.jsonl").write_text("".join(
        f'{{"iteration": {i}, "switch_train_to_rollout_s": {s}}}\n' for i, s in syncs.items()) + '{"eval": 1}\n')
    cfg = load_config(config())
    bare = dataclasses.replace(cpu, switch_member_s={})
    engine, member = switch_member_seconds(tmp_path, dataclasses.replace(cpu, switch_member_s={"vllm": 9.0}))
    assert engine == cfg.rollout.engine
    members = channel_members(cfg.train, cfg.rollout)
    assert member * members == pytest.approx(
        0.016 - switch_cost(Workload.from_config(cfg), bare, cfg.train, cfg.rollout).seconds)


def test_a_pipeline_with_tp_stages_pays_the_tp_engines_fixed_costs_too(grpo, cpu):
    """The pipeline engine at TP > 1 runs DTensor TP inside its stages: its fixed costs are the
    pipeline's plus the TP engine's (the validation run: torch_pp TP2 measured 3x its
    prediction without them)."""
    from rlhf_switch.rl.config import TrainLayout
    from rlhf_switch.tune.cost import engine_pass

    _, w = grpo
    bare = dataclasses.replace(cpu, engine_forward_s={}, engine_step_s={})
    tp_only = dataclasses.replace(bare, engine_forward_s={"torch_tp": 0.01}, engine_step_s={"torch_tp": 0.1})
    pp_tp2, pp2 = TrainLayout(engine="torch_pp", tp=2), TrainLayout(engine="torch_pp", pp=2)
    assert engine_pass(w, tp_only, pp_tp2, 2, w.rollout_batch, train=False).total > \
        engine_pass(w, bare, pp_tp2, 2, w.rollout_batch, train=False).total
    assert engine_pass(w, tp_only, pp2, 2, w.rollout_batch, train=False).total == \
        engine_pass(w, bare, pp2, 2, w.rollout_batch, train=False).total
