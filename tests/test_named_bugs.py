"""Tests aimed at bugs an outside mutation test found the suite blind to; each test names the
rule it guards, and docs/tests.md lists the mutations of that rule it was checked to kill.

- engine-like buffers: views at non-zero storage offsets inside one flat tensor per dtype (as
  vLLM and DeepSpeed hand them out), strided pieces, staged and direct messages mixed, casts;
- the schedule's message-size cap (``budget // 4`` rounded down to an element, ``budget // 2``
  when a quarter holds none) at budgets where the two differ, and pieces split down to one
  element when the budget is smaller than any piece;
- vLLM's vocabulary padding (to 64) on a vocabulary where padding to 64 and to 128 differ;
- the config's batch-divisibility rules at their boundaries (one side refused, the other not).
(The per-peer digest tampered on one rank is a row of ``test_bad_inputs``.)
"""
from __future__ import annotations


import pytest

import rank_jobs
from catalogue import TINY_LLAMA, named_layouts
from rlhf_switch.routing import build_schedule
from rlhf_switch.vps import ParallelConfig, build_layout, llama_spec, plan_rank, plan_transition, synthetic_spec, \
    vllm_layout
from test_loop_inputs import config

SPEC = llama_spec(TINY_LLAMA, name="tiny-llama")
L = named_layouts(SPEC)


# --------------------------------------------------------------------------- engine-like buffers

ENGINE_CASES = [  # (source, destination, budget, MERGE_BYTES)
    ("fsdp", "vllm4", 1000, None),
    ("fsdp", "vllm4", 1 << 20, 0),
    ("zero3", "vllm4-bf16", 1000, None),  # the sender casts: staged sends, direct receives
    ("vllm2x2", "tp2xdp2", 1000, 0),
    ("zero1-flat", "tp2xpp2", 1000, None),
    ("tp2xpp2", "vllm2x2", 64, 0),
]


def _layout(name):
    return {"vllm4": lambda: vllm_layout(SPEC, 4), "vllm4-bf16": lambda: vllm_layout(SPEC, 4, dtype="bfloat16"),
            "vllm2x2": lambda: vllm_layout(SPEC, 2, replicas=2)}.get(name, lambda: L[name])()


@pytest.mark.heavy  # left out of `make test-fast`
def test_moves_between_engine_like_buffers_are_bit_exact(world4):
    """Both sides' buffers are views into one flat tensor per dtype, each at a non-zero storage
    offset with garbage between them: every covered element equals a direct construction of the
    destination, the garbage and the source are untouched. Over the cases, messages go both
    straight from/into the views and through staging, and local copies run."""
    totals = dict(direct=0, staged=0, local=0)
    for a, b, budget, merge in ENGINE_CASES:
        src, dst = _layout(a), _layout(b)
        results = world4.run(rank_jobs.move_engine_like, src, dst, seed=3, budget_bytes=budget, merge_bytes=merge)
        for r, res in enumerate(results):
            assert res["wrong"] == [], f"{a} -> {b} (budget {budget}) rank {r}: {res['wrong']}"
            assert res["report"].bytes_received == res["report"].min_bytes_received
            for k in totals:
                totals[k] += res[k]
        assert sum(res["report"].bytes_sent for res in results) == plan_transition(src, dst).min_bytes
    assert all(totals.values()), totals


# --------------------------------------------------------------------------- the message-size cap


def messages(schedule):
    """Every message of a schedule, sent or received, staged or direct."""
    return [m for ex in schedule.exchanges for step in ex.steps for m in step if m is not None]


def expected_cap(budget: int, item: int) -> int:
    """The rule: a quarter of the budget, rounded down to whole elements; half when a quarter
    cannot hold one element (which is then always exactly one element: budget < 4·item gives
    budget // 2 < 2·item)."""
    quarter = budget // 4 // item * item
    return quarter if quarter >= item else budget // 2 // item * item


@pytest.mark.parametrize("budget,cap", [
    # budgets of a few bytes: ~10^4 messages to schedule each (left out of `make test-fast`)
    *(pytest.param(b, c, marks=pytest.mark.heavy) for b, c in [(8, 4), (12, 4), (15, 4), (16, 4), (20, 4), (24, 4),
                                                               (31, 4), (32, 8)]),
    (100, 24), (1000, 248), (2048, 512), (4096, 1024)])
def test_message_size_cap_is_a_quarter_of_the_budget_in_whole_elements(budget, cap):
    """Every message (staged or direct, sent or received) is at most the cap, and some message
    reaches it exactly (the tiny model's fp32 tensors are larger than every cap here)."""
    assert expected_cap(budget, 4) == cap
    src, dst = L["zero3"], L["tp2xpp2"]
    largest = 0
    for r in range(4):
        sched = build_schedule(plan_rank(src, dst, r), budget)
        for m in messages(sched):
            assert m.nbytes <= cap, (budget, m.nbytes, cap)
            largest = max(largest, m.nbytes)
        assert sched.peak_staging_bytes <= budget
    assert largest == cap, (budget, largest, cap)


@pytest.mark.parametrize("budget,cap", [(13, 4), (108, 24), (116, 28)])
def test_mixed_dtypes_cap_in_whole_elements_of_the_largest_item(budget, cap):
    """bf16 beside fp32: the cap is rounded down to the largest item (4 B), so a bf16 message
    never fills an odd quarter (budget 108: a quarter is 27 B, bf16 runs stop at 24 B, not 26);
    budget 13: a quarter (3 B) holds no fp32 element, half (6 B) holds one: 4 B."""
    assert expected_cap(budget, 4) == cap
    spec = synthetic_spec([("a.column", (8, 6), "float32", "column"), ("b.replicate", (256,), "bfloat16", "replicate")])
    src = build_layout(spec, ParallelConfig(dp=4, dp_shard="fsdp"))
    dst = build_layout(spec, ParallelConfig(dp=4))
    largest = {}
    for r in range(4):
        sched = build_schedule(plan_rank(src, dst, r), budget)
        for m in messages(sched):
            assert m.nbytes <= cap, (budget, m.nbytes)
            dt = m.pieces[0].transfer.dtype
            largest[dt] = max(largest.get(dt, 0), m.nbytes)
    assert largest["bfloat16"] == cap, largest


def test_a_budget_below_every_piece_splits_pieces_down_to_single_elements(world4):
    """What the schedule does when the budget is smaller than the smallest piece: it does not
    refuse — it cuts pieces into row-major sub-boxes down to one element per message (only a
    budget that cannot hold one element each way, < 2 items, is refused: test_bad_inputs). At 8 B
    and fp32 every message is one element, and the move is still bit-exact."""
    spec = synthetic_spec([("a.column", (8, 3), "float32", "column"), ("b.row", (3, 8), "float32", "row"),
                           ("c.replicate", (5,), "float32", "replicate")], num_layers=2)
    src = build_layout(spec, ParallelConfig(dp=4, dp_shard="zero"))
    dst = build_layout(spec, ParallelConfig(tp=2, pp=2))
    smallest = min(t.box.numel * 4 for r in range(4) for t in plan_rank(src, dst, r).sends)
    assert smallest > 4  # every piece of the plan is larger than one message may be
    for r in range(4):
        sched = build_schedule(plan_rank(src, dst, r), 8)
        for ex in sched.exchanges:
            for s, rv in ex.steps:
                for m in (s, rv):
                    if m is not None:
                        assert m.nbytes == 4 and len(m.pieces) == 1 and m.pieces[0].box.numel == 1
    reports = [res["report"] for res in _checked(world4.run(rank_jobs.move_and_check, src, dst, budget_bytes=8))]
    assert all(rep.peak_staging_bytes <= 8 for rep in reports)


def _checked(results):
    for r, res in enumerate(results):
        assert res["wrong"] == [], (r, res["wrong"])
    return results


# --------------------------------------------------------------------------- vLLM vocabulary padding


def _vllm_padding_rule(vocab: int) -> int:
    return -(-vocab // 64) * 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE = 64 (pad_vocab_size)


@pytest.mark.parametrize("tp,per,last_rows", [(1, 1088, 1030), (2, 544, 486), (4, 272, 214)])
def test_vllm_pads_the_vocabulary_to_64_not_128(tp, per, last_rows):
    """vocab 1030: padded to 64 -> 1088, to 128 it would be 1152. Each worker's embedding and
    LM-head buffer holds padded/TP rows; worker t holds rows [t·per, min((t+1)·per, 1030))."""
    assert _vllm_padding_rule(1030) == 1088 and -(-1030 // 128) * 128 == 1152
    assert per == _vllm_padding_rule(1030) // tp
    spec = llama_spec({**TINY_LLAMA, "vocab_size": 1030}, name="vocab-1030")
    lay = vllm_layout(spec, tp)
    hidden = TINY_LLAMA["hidden_size"]
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        for t in range(tp):
            buf = lay.buffers(t)[f"param/{name}"]
            assert buf.numel == per * hidden, (name, t, buf.numel)
            (frag,) = [f for f in lay.fragments(t) if f.key.tensor == name]
            lo, hi = t * per, min((t + 1) * per, 1030)
            assert (frag.box.lo[0], frag.box.hi[0], frag.offset) == (lo, hi, 0)
        assert frag.box.hi[0] - frag.box.lo[0] == last_rows


# --------------------------------------------------------------------------- batch divisibility


def _fit(name: str = "grpo_tiny_fsdp.yaml", **changes) -> list[str]:
    from rlhf_switch.problems import run_problems
    from rlhf_switch.rl.config import load_config

    if name == "grpo_tiny_fsdp.yaml":  # the rules below are stated for one rollout replica (its TP2 layout then)
        changes.setdefault("rollout", {"engine": "torch", "tp": 2})
    return run_problems(load_config(config(name, **changes)), skip=("reward",))


TP2 = {"engine": "torch_tp", "tp": 2}
PPO = dict(name="ppo_tiny.yaml", train=TP2, reference=TP2, rollout={"engine": "vllm", "tp": 2})

# (changes refused, its one message, changes just inside the rule: accepted)
BATCH_RULES = {
    "micro per DP rank": (
        {"algorithm.micro_batch_size": 32},  # divides the mini batch 32, not the rank's 16
        "algorithm.micro_batch_size=32 does not divide the per-rank mini batch 32/2 = 16",
        {"algorithm.micro_batch_size": 16}),
    "train dp": (
        {"algorithm.prompts_per_iteration": 3, "algorithm.mini_batch_size": 3},  # rollout batch 24: even
        "train: dp=2 does not divide algorithm.mini_batch_size=3",
        {"algorithm.prompts_per_iteration": 3, "algorithm.mini_batch_size": 6, "algorithm.micro_batch_size": 1}),
    "reference dp": (
        {"algorithm.prompts_per_iteration": 3, "algorithm.group_size": 3, "algorithm.mini_batch_size": None,
         "algorithm.micro_batch_size": 1, "train": TP2},
        "reference: dp=2 does not divide the rollout batch 9",
        # the reference sees the whole rollout batch (24), not the mini batch (3)
        {"algorithm.prompts_per_iteration": 3, "algorithm.mini_batch_size": 3, "algorithm.micro_batch_size": 1,
         "train": TP2}),
    "critic dp": (
        {**PPO, "algorithm.prompts_per_iteration": 18, "algorithm.mini_batch_size": 9,
         "algorithm.micro_batch_size": 1},  # the critic's DP 2 beside the actor's TP2 (DP 1)
        "critic: dp=2 must equal train.dp=1 (the critic and the actor take the same share of each batch)",
        {**PPO, "train": {"engine": "fsdp2", "dp": 2}, "algorithm.prompts_per_iteration": 18,
         "algorithm.mini_batch_size": 18, "algorithm.micro_batch_size": 1}),
    "rollout dp": (
        {"algorithm.prompts_per_iteration": 3, "algorithm.mini_batch_size": 24, "algorithm.micro_batch_size": 4,
         "rollout": {"engine": "torch", "dp": 2}},
        "rollout: dp=2 does not divide algorithm.prompts_per_iteration=3 (each replica takes whole groups of prompts)",
        {"algorithm.prompts_per_iteration": 4, "algorithm.mini_batch_size": 32, "rollout": {"engine": "torch", "dp": 2}}),
    "mini batch": (  # a micro-batch that divides both sides' per-rank mini batches (24 and 32)
        {"algorithm.mini_batch_size": 48, "algorithm.micro_batch_size": 8},
        "algorithm.mini_batch_size=48 does not divide the rollout batch prompts_per_iteration·group_size = 128",
        {"algorithm.mini_batch_size": 64, "algorithm.micro_batch_size": 8}),
    "eval": (
        {"eval.num_prompts": 199, "rollout": {"engine": "torch", "dp": 2}, "train": TP2},  # train dp 1
        "eval.num_prompts=199 is not divisible by rollout.dp=2",
        {"eval.num_prompts": 198, "rollout": {"engine": "torch", "dp": 2}, "train": TP2}),
    "sft": ({"sft.batch_size": 31}, "sft: batch_size=31 is not divisible by train.dp=2", {"sft.batch_size": 30}),
}


@pytest.mark.parametrize("rule", list(BATCH_RULES))
def test_each_batch_rule_refuses_exactly_its_side_of_the_boundary(rule):
    bad, message, good = BATCH_RULES[rule]
    bad, good = dict(bad), dict(good)
    assert _fit(bad.pop("name", "grpo_tiny_fsdp.yaml"), **bad) == [message]
    assert _fit(good.pop("name", "grpo_tiny_fsdp.yaml"), **good) == []
