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


@pytest.mark.heavy  # left out of `make test-fast`
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
    assert w.rollout_batch == 512  # the shipped config's 64 prompts x 8: 13 waves of at most 40
    assert tight.concurrent_sequences == 40 and tight.rollout_waves == 13 and tight.kv_cache == 40 * per_seq
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


# --- every cost term against a hand computation --------------------------------------------------------
# A model small enough to count by hand: H 32, I 64, 4 layers, 4 heads of 8 (2 KV heads), vocab 64,
# untied. Per layer the matmuls hold q 32·32 + k 32·16 + v 32·16 + o 32·32 + gate, up, down 3·64·32
# = 9216 parameters, and 2 norms of 32; plus embeddings 64·32, lm_head 64·32, final norm 32.
HAND_HF = dict(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
               tie_word_embeddings=False, torch_dtype="float32")
HAND_MATMUL = 4 * 9216 + 64 * 32                   # what a token multiplies through (no embedding lookup)
HAND_PARAMS = 4 * (9216 + 2 * 32) + 2 * 64 * 32 + 32
HAND_TENSORS = 1 + 4 * 9 + 1 + 1
INF = float("inf")


@pytest.fixture(scope="module")
def hand():
    """The workload: 16 sequences of 10 + 6 tokens per iteration, optimizer steps of 8, forwards of 2,
    2 epochs (4 steps), float32 (4 bytes)."""
    from rlhf_switch.tune import Workload

    w = Workload(hf_config=HAND_HF, dtype="float32", rollout_batch=16, mini_batch=8, micro_batch=2, epochs=2,
                 prompt_tokens=10, new_tokens=6, has_reference=False, has_critic=False)
    assert (w.matmul_params, w.params(), len(w.spec.tensors), w.seq, w.head_dim) == \
        (HAND_MATMUL, HAND_PARAMS, HAND_TENSORS, 16, 8)
    return w


def free_machine(**rates):
    """A profile on which everything is free (rates infinite, fixed costs 0) except ``rates``: a
    term of the model then stands alone and can be compared with its formula."""
    from rlhf_switch.tune.profile import Link, MachineProfile

    free = Link(INF, 0.0)
    base = dict(name="hand", origin="test", matmul_flops={"float32": INF}, memory_bandwidth=INF, device_memory=1e12,
                devices_per_node=8, p2p_intra=free, p2p_inter=free, collective_intra=free, collective_inter=free,
                same_device=free)
    return MachineProfile(**{**base, **rates})


def _layout(**kw):
    from rlhf_switch.rl.config import TrainLayout

    return TrainLayout(**kw)


def test_cost_compute_term_is_the_flops_by_hand(hand):
    """2 FLOPs per multiplied parameter per token plus attention (4·layers·heads·head_dim·seq per
    token), ×3 with the backward, over the devices' share, at the profile's rate (×2 slower when
    4 devices share 2 compute slots)."""
    from rlhf_switch.tune.cost import engine_pass

    R = 2.0 ** 30
    per_token = 2 * HAND_MATMUL + 4 * 4 * 4 * 8 * 16
    z1 = _layout(engine="deepspeed", zero_stage=1, dp=2)
    # forward: 16 sequences over DP2 = 8 per rank
    assert engine_pass(hand, free_machine(matmul_flops={"float32": R}), z1, 2, 16, train=False).compute == \
        pytest.approx(per_token * 16 * 8 / R, rel=1e-12)
    # train: 32 sequences (2 epochs) = 16 per rank, ×3
    assert engine_pass(hand, free_machine(matmul_flops={"float32": R}), z1, 2, 32, train=True, steps=4).compute == \
        pytest.approx(3 * per_token * 16 * 16 / R, rel=1e-12)
    # PP2: each stage multiplies half the model (and waits out GPipe's bubble: 8 micro-batches, 9/8)
    pp2 = _layout(engine="torch_pp", pp=2)
    assert engine_pass(hand, free_machine(matmul_flops={"float32": R}), pp2, 2, 16, train=False).compute == \
        pytest.approx(per_token * 16 * 16 / 2 / R * 9 / 8, rel=1e-12)
    # TP2: half the FLOPs per device; 2 compute slots for a world of 4: each device at half speed
    tp2 = _layout(engine="torch_tp", tp=2)
    assert engine_pass(hand, free_machine(matmul_flops={"float32": R}, compute_slots=2), tp2, 4, 16,
                       train=False).compute == pytest.approx(2 * per_token * 16 * 16 / 2 / R, rel=1e-12)


def test_cost_fixed_terms_are_per_layer_call_per_micro_batch_and_per_step(hand):
    """layer_overhead_s per decoder-layer call (×3 with the backward), the engine's forward cost per
    micro-batch call (×3 with the backward) and its step cost per optimizer step."""
    from rlhf_switch.tune.cost import engine_pass

    z1 = _layout(engine="deepspeed", zero_stage=1, dp=2)
    layer = free_machine(layer_overhead_s=2.0 ** -10)
    # forward: 8 sequences per rank in micro-batches of 2 = 4 calls of 4 layers
    assert engine_pass(hand, layer, z1, 2, 16, train=False).compute == pytest.approx(4 * 4 * 2.0 ** -10)
    # train: 16 per rank = 8 micro-batches, forward + backward (×3)
    assert engine_pass(hand, layer, z1, 2, 32, train=True, steps=4).compute == pytest.approx(8 * 4 * 3 * 2.0 ** -10)
    fixed = free_machine(engine_forward_s={"deepspeed-z1": 0.5}, engine_step_s={"deepspeed-z1": 7.0})
    assert engine_pass(hand, fixed, z1, 2, 16, train=False).compute == pytest.approx(4 * 0.5)
    assert engine_pass(hand, fixed, z1, 2, 32, train=True, steps=4).compute == pytest.approx(8 * 0.5 * 3 + 4 * 7.0)
    # the log-prob passes' own micro-batch: 8 per rank in forwards of 8 = 1 call
    wide = dataclasses.replace(hand, logprob_micro_batch=8)
    assert engine_pass(wide, layer, z1, 2, 16, train=False).compute == pytest.approx(1 * 4 * 2.0 ** -10)


def test_cost_pipeline_bubble_is_gpipes(hand):
    """PP2 over 4 layers: 2 layers per stage; 16 sequences in micro-batches of 2 = 8 per step, and
    GPipe's bubble (m + pp - 1) / m = 9/8 on the compute."""
    from rlhf_switch.tune.cost import engine_pass

    pp2 = _layout(engine="torch_pp", pp=2)
    layer = free_machine(layer_overhead_s=1.0)
    assert engine_pass(hand, layer, pp2, 2, 16, train=False).compute == pytest.approx(8 * 2 * 9 / 8)
    # train, 2 steps of 8 micro-batches (32 sequences): (8 + 1) / 8 again
    assert engine_pass(hand, layer, pp2, 2, 32, train=True, steps=2).compute == pytest.approx(16 * 2 * 3 * 9 / 8)


def test_cost_optimizer_step_is_28_bytes_per_parameter_of_the_shard_and_a_cost_per_tensor(hand):
    """AdamW reads param, grad and two moments and writes three fp32 values: 28 bytes per parameter of
    the rank's optimizer shard per step at the memory bandwidth; plus the per-tensor cost (DeepSpeed:
    one flat group; the torch engines: every tensor of the stage)."""
    from rlhf_switch.tune.cost import engine_pass

    M = 2.0 ** 20
    for layout, shards in ((_layout(engine="deepspeed", zero_stage=1, dp=2), 2),
                           (_layout(engine="deepspeed", zero_stage=3, dp=2), 2),
                           (_layout(engine="fsdp2", dp=2), 2), (_layout(engine="torch_tp", tp=2), 2),
                           (_layout(engine="torch_pp", pp=2), 2)):
        got = engine_pass(hand, free_machine(memory_bandwidth=M), layout, 2, 32, train=True, steps=4).compute
        # (a pipeline's bubble is idle micro-batch slots: it does not stretch the optimizer step)
        assert got == pytest.approx(4 * HAND_PARAMS / shards * 28 / M, rel=1e-12), layout
    per_tensor = free_machine(optimizer_tensor_s=1.0)
    assert engine_pass(hand, per_tensor, _layout(engine="deepspeed", zero_stage=3, dp=2), 2, 32, train=True,
                       steps=4).compute == pytest.approx(4 * 1)
    assert engine_pass(hand, per_tensor, _layout(engine="fsdp2", dp=2), 2, 32, train=True,
                       steps=4).compute == pytest.approx(4 * HAND_TENSORS)


def test_cost_data_parallel_communication_is_the_ring_formula(hand):
    """Ring collectives over n ranks: (n - 1)/n of the bytes per rank and n - 1 latency steps per
    message (all-reduce: twice that). ZeRO-3 gathers the weights per micro-batch forward, again for
    its backward, and reduce-scatters the gradients, one message per tensor; ZeRO-1 all-reduces the
    gradients and all-gathers the weights once per step, ZeRO-2 reduce-scatters instead."""
    from rlhf_switch.tune.cost import engine_pass
    from rlhf_switch.tune.profile import Link

    bw, lat = 2.0 ** 20, 2.0 ** -12
    net = free_machine(collective_intra=Link(bw, lat))
    weights = HAND_PARAMS * 4
    half = weights / 2 / bw  # (n - 1)/n of the weights over DP2
    z3 = _layout(engine="deepspeed", zero_stage=3, dp=2)
    assert engine_pass(hand, net, z3, 2, 16, train=False).comm == \
        pytest.approx(4 * (half + HAND_TENSORS * lat), rel=1e-12)            # 4 micro-batch forwards
    assert engine_pass(hand, net, z3, 2, 32, train=True, steps=4).comm == \
        pytest.approx(3 * 8 * (half + HAND_TENSORS * lat), rel=1e-12)        # 8 × (2 gathers + 1 reduce-scatter)
    z1, z2 = (_layout(engine="deepspeed", zero_stage=s, dp=2) for s in (1, 2))
    assert engine_pass(hand, net, z1, 2, 16, train=False).comm == 0
    assert engine_pass(hand, net, z1, 2, 32, train=True, steps=4).comm == \
        pytest.approx(4 * (2 * (half + lat) + (half + lat)), rel=1e-12)
    assert engine_pass(hand, net, z2, 2, 32, train=True, steps=4).comm == \
        pytest.approx(4 * ((half + lat) + (half + lat)), rel=1e-12)
    # FSDP2 on a model this small gathers once per call, in one unit (one message)
    fsdp = _layout(engine="fsdp2", dp=2)
    assert engine_pass(hand, net, fsdp, 2, 16, train=False).comm == pytest.approx(half + lat, rel=1e-12)
    assert engine_pass(hand, net, fsdp, 2, 32, train=True, steps=4).comm == \
        pytest.approx(4 * (half + lat) + 8 * (half + lat), rel=1e-12)
    # replicas of a pipeline all-reduce their stage's gradients (half the weights) once per step
    pp2dp2 = _layout(engine="torch_pp", pp=2, dp=2)
    assert engine_pass(hand, net, pp2dp2, 4, 32, train=True, steps=4).comm == \
        pytest.approx(4 * 2 * (half / 2 + lat), rel=1e-12)
    # the group spans nodes when DP × TP devices do not fit in one: the inter-node link
    far = free_machine(collective_inter=Link(bw, lat), devices_per_node=1)
    assert engine_pass(hand, far, z1, 2, 32, train=True, steps=4).comm == \
        engine_pass(hand, net, z1, 2, 32, train=True, steps=4).comm


def test_cost_tensor_and_pipeline_parallel_communication_by_hand(hand):
    """TP all-reduces a micro-batch's activations (micro · seq · H · 4 bytes) twice per layer
    forward and twice more per backward; PP sends them across each stage boundary, once per
    micro-batch forward and once back per backward."""
    from rlhf_switch.tune.cost import engine_pass
    from rlhf_switch.tune.profile import Link

    bw, lat = 2.0 ** 20, 2.0 ** -12
    act = 2 * 16 * 32 * 4
    tp2 = _layout(engine="torch_tp", tp=2)
    ring = free_machine(collective_intra=Link(bw, lat))
    one = 2 * (act / 2 / bw + lat)  # one all-reduce over 2 ranks
    assert engine_pass(hand, ring, tp2, 2, 16, train=False).comm == pytest.approx(8 * 4 * 2 * one, rel=1e-12)
    assert engine_pass(hand, ring, tp2, 2, 32, train=True, steps=4).comm == \
        pytest.approx(16 * 4 * 2 * 2 * one, rel=1e-12)
    pp2 = _layout(engine="torch_pp", pp=2)
    p2p = free_machine(p2p_intra=Link(bw, lat))
    assert engine_pass(hand, p2p, pp2, 2, 16, train=False).comm == pytest.approx(8 * 1 * (act / bw + lat), rel=1e-12)
    assert engine_pass(hand, p2p, pp2, 2, 32, train=True, steps=2).comm == \
        pytest.approx(16 * 1 * 2 * (act / bw + lat), rel=1e-12)


def test_cost_decode_by_hand(hand):
    """Each replica's share in waves of what its KV cache holds; a wave: the prefill (the prompts'
    matmuls, one read of the weights, the fixed cost) then one step per new token (reading the
    weights or multiplying them, whichever is slower, plus the KV cache so far, plus the fixed
    cost per step and per sequence), with TP all-reduces of the hidden states twice per layer."""
    from rlhf_switch.rl.config import RolloutLayout
    from rlhf_switch.tune.cost import decode_seconds
    from rlhf_switch.tune.profile import Link

    M, R = 2.0 ** 24, 2.0 ** 26
    weight_bytes = HAND_PARAMS * 4
    r2 = RolloutLayout(engine="vllm", tp=1, dp=2)  # 8 sequences per replica

    def kv(batch, ctx):  # layers · K and V · KV heads · head_dim · 4 bytes per token
        return batch * ctx * 4 * 2 * 2 * 8 * 4

    assert decode_seconds(hand, free_machine(memory_bandwidth=M), r2, 2) == pytest.approx(
        (1 + 6) * weight_bytes / M + sum(kv(8, 10 + s) for s in range(6)) / M, rel=1e-12)
    assert decode_seconds(hand, free_machine(matmul_flops={"float32": R}), r2, 2) == pytest.approx(
        2 * HAND_MATMUL * 8 * 10 / R + 6 * 2 * HAND_MATMUL * 8 / R, rel=1e-12)
    fixed = free_machine(decode_step_overhead_s={"vllm": 0.25}, decode_sequence_s={"vllm": 2.0 ** -6})
    assert decode_seconds(hand, fixed, r2, 2) == pytest.approx(7 * (0.25 + 8 * 2.0 ** -6))
    # waves: 8 sequences, 3 at a time = 3 waves of 3
    assert decode_seconds(hand, fixed, r2, 2, concurrent=3) == pytest.approx(3 * 7 * (0.25 + 3 * 2.0 ** -6))
    # TP2, one replica of 16: the prefill's all-reduce of 16 · 10 hidden states, each step's of 16
    bw, lat = 2.0 ** 20, 2.0 ** -12
    tp2 = RolloutLayout(engine="vllm", tp=2, dp=1)
    ring = free_machine(collective_intra=Link(bw, lat))

    def all_reduce(nbytes):
        return 2 * (nbytes / 2 / bw + lat)

    assert decode_seconds(hand, ring, tp2, 2) == pytest.approx(
        2 * 4 * all_reduce(16 * 10 * 32 * 4) + 6 * 2 * 4 * all_reduce(16 * 32 * 4), rel=1e-12)


def test_cost_sharded_switch_and_iteration_sums_by_hand(hand):
    """The closed-form switch of a DP-sharded trainer (n ranks) into TP workers on the same devices:
    each pair moves bytes / n / tp in chunks of half the staging budget — one peer on the own
    device, the node's others intra-node, the rest across nodes — plus the agreement's all-gather
    of 32 bytes per rank over the 2n members, plus the fixed cost per member. An iteration: the
    log-prob passes over the rollout batch, the update over epochs × batch in epochs × batch /
    mini-batch optimizer steps."""
    from rlhf_switch.rl.config import RolloutLayout
    from rlhf_switch.tune import Combination
    from rlhf_switch.tune.cost import _sharded_switch, iteration_seconds
    from rlhf_switch.tune.memory import STAGING_BYTES
    from rlhf_switch.tune.profile import Link

    same, intra, inter, coll = Link(2.0 ** 30, 1e-6), Link(2.0 ** 28, 2e-6), Link(2.0 ** 26, 3e-6), Link(2.0 ** 27, 4e-6)
    p = free_machine(same_device=same, p2p_intra=intra, p2p_inter=inter, collective_inter=coll, devices_per_node=2,
                     switch_member_s={"vllm": 0.125})
    z3, vllm = _layout(engine="deepspeed", zero_stage=3, dp=4), RolloutLayout(engine="vllm", tp=2, dp=2)
    per_peer = HAND_PARAMS * 4 / 4 / 2
    assert per_peer < STAGING_BYTES // 2  # one chunk per peer
    want = (same.seconds(per_peer) + 1 * intra.seconds(per_peer) + 2 * inter.seconds(per_peer)
            + (7 / 8 * 32 * 8 / coll.bandwidth + 7 * coll.latency) + 0.125 * 8)
    got = _sharded_switch(hand, p, z3, vllm)
    assert got.seconds == pytest.approx(want, rel=1e-12) and got.messages == 4
    # the iteration: only the engines' fixed costs, so each phase counts its calls
    fixed = free_machine(engine_forward_s={"deepspeed-z3": 1.0}, engine_step_s={"deepspeed-z3": 100.0})
    ref = _layout(engine="deepspeed", zero_stage=3, dp=2)
    combo = Combination(_layout(engine="deepspeed", zero_stage=3, dp=2), RolloutLayout(engine="torch", tp=1, dp=2),
                        reference=ref)
    out = iteration_seconds(hand, fixed, combo)
    # log-probs: 16 sequences / DP2 / micro 2 = 4 forwards, policy and reference: 8
    # update: 32 sequences / DP2 / micro 2 = 8 micro-batches × 3, and 2 × 16 / 8 = 4 steps
    assert (out["logprob"], out["update"]) == (pytest.approx(8.0), pytest.approx(8 * 3 + 4 * 100.0))
    assert out["total"] == pytest.approx(sum(out[k] for k in ("switch", "rollout", "logprob", "update")))
