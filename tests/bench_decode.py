"""Time one TorchRollout.generate call, batched vs the one-at-a-time reference (not a test).

The tiny GRPO model of configs/grpo_tiny_fsdp.yaml (hidden 128, 2 layers, vocab 64), random
weights, TP2 on 2 gloo ranks, 128 prompts of 4-12 tokens x 8 new tokens, sampled with per-sample
seeds; median of 3. Run: PYTHONPATH=. python tests/bench_decode.py
"""
from __future__ import annotations

import os
import statistics
import sys
import tempfile

import torch
import yaml

sys.path.insert(0, os.path.dirname(__file__))
import rollout_jobs  # noqa: E402
from rlhf_switch.launch import LocalWorld  # noqa: E402
from rlhf_switch.vps import fsdp, llama_spec  # noqa: E402


def main(n: int = 128, new: int = 8) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    hf_cfg = yaml.safe_load(open(os.path.join(here, "configs/grpo_tiny_fsdp.yaml")))["model"]["hf_config"]
    cfg = LlamaConfig(**{k: v for k, v in hf_cfg.items() if k != "model_type"})
    torch.manual_seed(0)
    path = tempfile.mkdtemp()
    LlamaForCausalLM(cfg).save_pretrained(path)
    spec = llama_spec(cfg)
    g = torch.Generator().manual_seed(0)
    prompts = [[1] + torch.randint(3, 47, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n)]
    seeds = list(range(1000, 1000 + n))
    with LocalWorld(2, timeout=600) as world:
        res = world.run(rollout_jobs.time_generate, path, fsdp(spec, 2), 2, prompts, new, seeds)
    r = res[0]
    same = r["batched_result"][0] == r["reference_result"][0]
    lp = rollout_jobs._max_lp_diff(r["batched_result"][1], r["reference_result"][1])
    for name in ("reference", "batched"):
        print(f"{name}: median {statistics.median(r[name]):.3f} s  (runs {[round(t, 3) for t in r[name]]})")
    print(f"speed-up {statistics.median(r['reference']) / statistics.median(r['batched']):.1f}x; "
          f"tokens identical: {same}; max |logprob diff| {lp:.2e}; "
          f"rows stopped at EOS: {sum(len(t) < new for t in r['batched_result'][0])}/{n}")


if __name__ == "__main__":
    main()
