"""Modelled (not measured) best per-phase layouts for 7B, 70B and a 235B MoE on 8–1024 GPUs.

    python -m bench.tune_scale              # table -> bench/results/tune_scale.{json,md}
    python -m bench.tune_scale --quick      # 7B and 70B on 8 and 64 GPUs only

The shipped ``h100_ib`` profile (published figures, H200 141 GB; see rlhf_switch/tune/profile.py),
GRPO with 512 prompts × 8 samples of 1024 prompt + 1024 response tokens per iteration, 4 optimizer
steps of 1024 sequences, micro-batch 1, a reference model; bf16 weights. Rollout engine: vLLM
(the small torch engine is a CPU stand-in). Models: Llama-2-7B's shape, Llama-3-70B and
Qwen3-235B-A22B as in bench/plan_scale.py. Everything here is the cost model's output.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from bench.plan_scale import LLAMA_70B, QWEN3_235B

RESULTS = Path(__file__).resolve().parent / "results"
LLAMA_7B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                intermediate_size=11008, vocab_size=32000, torch_dtype="bfloat16")
MODELS = {
    "7B (Llama-2-7B shape)": dict(model_type="llama", max_position_embeddings=4096, **LLAMA_7B),
    "70B (Llama-3-70B)": dict(model_type="llama", max_position_embeddings=8192, **LLAMA_70B),
    "235B-A22B MoE (Qwen3)": dict(model_type="qwen3_moe", max_position_embeddings=8192, intermediate_size=12288,
                                  num_experts_per_tok=8, norm_topk_prob=True, **QWEN3_235B),
}
WORLDS = {"7B (Llama-2-7B shape)": (8, 64, 256, 1024), "70B (Llama-3-70B)": (8, 64, 256, 1024),
          "235B-A22B MoE (Qwen3)": (8, 64, 256, 1024)}
PROMPT_TOKENS, RESPONSE_TOKENS = 1024, 1024


def run_config(hf: dict, world: int) -> dict:
    layout = {"engine": "deepspeed", "zero_stage": 3, "tp": 1, "pp": 1, "dp": world}
    return {
        "world_size": world, "model": {"dtype": "bfloat16", "hf_config": hf},
        "train": layout, "reference": layout, "rollout": {"engine": "vllm", "tp": 1, "dp": world},
        "task": {"name": "addition", "min_len": 1, "max_len": 5, "num_train": 4000, "num_heldout": 1024},
        "eval": {"every": 0, "num_prompts": 512},
        "algorithm": {"name": "grpo", "prompts_per_iteration": 512, "group_size": 8, "mini_batch_size": 1024,
                      "micro_batch_size": 1, "max_new_tokens": RESPONSE_TOKENS},
    }


def best(name: str, world: int, profile) -> dict:
    from rlhf_switch.rl.config import load_config
    from rlhf_switch.tune import TuneError, Workload, describe, rank
    from rlhf_switch.tune.profile import GIB

    cfg = load_config(run_config(MODELS[name], world))
    w = dataclasses.replace(Workload.from_config(cfg), prompt_tokens=PROMPT_TOKENS)
    t0 = time.perf_counter()
    try:
        ranking = rank(cfg, profile, top=1, rollout_engines=["vllm"], workload=w)
    except TuneError as e:
        return {"model": name, "world": world, "refused": str(e), "tune_s": time.perf_counter() - t0}
    r = ranking.rows[0]
    m = r.memory
    base = baseline(cfg, w, profile, world)
    return {"model": name, "world": world, "train": describe(r.combo.train), "rollout": describe(r.combo.rollout),
            "reference": describe(r.combo.reference), **{f"{k}_s": v for k, v in r.seconds.items()},
            "switch_share": r.switch_share, "switch_rank_gib": r.switch.rank_bytes / GIB,
            "peak_gib": m.peak / GIB, "train_state_gib": m.train_state / GIB, "kv_gib": m.kv_cache / GIB,
            "considered": ranking.considered, "fitting": ranking.fitting, "planned_pairs": ranking.planned_pairs,
            "tune_s": time.perf_counter() - t0, **base}


def baseline(cfg, w, profile, world: int) -> dict:
    """A hand-set layout as a point of comparison: DeepSpeed ZeRO-3 over the whole world for the
    trainer and the reference, vLLM TP8 replicas (one per node), as in verl's default recipes."""
    from rlhf_switch.rl.config import RolloutLayout, TrainLayout
    from rlhf_switch.tune import Combination
    from rlhf_switch.tune.cost import iteration_seconds
    from rlhf_switch.tune.enumerate import combination_problems, phase_problems
    from rlhf_switch.tune.memory import estimate_memory

    z3 = TrainLayout(engine="deepspeed", zero_stage=3, dp=world)
    combo = Combination(z3, RolloutLayout(engine="vllm", tp=8, dp=world // 8), z3)
    problems = combination_problems(cfg, combo) + phase_problems("rollout", combo.rollout, world, w.dims)
    mem = estimate_memory(w, combo, profile.device_memory)
    if problems or mem.peak > profile.device_memory:
        return {"baseline_total_s": None}
    return {"baseline_total_s": iteration_seconds(w, profile, combo, memory=mem)["total"]}


def table(rows: list[dict]) -> str:
    lines = ["| model | GPUs | train | rollout | reference | rollout s | logprob s | update s | switch s | "
             "iteration s | switch share | peak GiB/GPU | ZeRO-3 + vLLM TP8 s (×) | tune s |", "|" + "---|" * 14]
    for r in rows:
        if "refused" in r:
            lines.append(f"| {r['model']} | {r['world']} | refused: {r['refused'].split(';')[0]} |" + " |" * 11)
            continue
        b = r.get("baseline_total_s")
        vs = f"{b:.1f} ({b / r['total_s']:.2f}×)" if b else "does not fit"
        lines.append(f"| {r['model']} | {r['world']} | {r['train']} | {r['rollout']} | {r['reference']} | "
                     f"{r['rollout_s']:.1f} | {r['logprob_s']:.1f} | {r['update_s']:.1f} | {r['switch_s']:.2f} | "
                     f"{r['total_s']:.1f} | {100 * r['switch_share']:.1f} % | {r['peak_gib']:.0f} | {vs} | {r['tune_s']:.0f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default=None, help="models whose name starts with this")
    a = ap.parse_args(argv)
    from rlhf_switch.tune import load_profile

    profile = load_profile("h100_ib")
    rows = []
    for name in MODELS:
        if a.only and not name.startswith(a.only):
            continue
        if a.quick and name.startswith("235B"):
            continue
        for world in WORLDS[name]:
            if a.quick and world > 64:
                continue
            rows.append(best(name, world, profile))
            print(json.dumps(rows[-1]), flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "tune_scale.json").write_text(json.dumps(rows, indent=1))
    (RESULTS / "tune_scale.md").write_text(table(rows) + "\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
