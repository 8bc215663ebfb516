"""``make run``'s trainer step by step: DeepSpeed ZeRO-3 with and without persistent parameters
(``persistence_threshold``), against FSDP2, on grpo_tiny's model and the loop's shapes.

Both ranks run directly on gloo (a LocalWorld, no Ray): per rank 4 optimizer steps of 16 rows ×
16 tokens (one iteration's update) and one no-grad log-prob forward of 64 rows (the old or the
reference log-probs). Variants run interleaved, ``--rounds`` times, so load from other processes
falls on all of them; reported: the median over rounds of each round's median iteration (the
slower rank's), and whether losses' gradient norms, log-probs and weights after the last round's
iterations are bit-identical to plain ZeRO-3.

    python -m bench.zero3_persistence [--rounds 3] [--iterations 7]
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import yaml

ROOT = Path(__file__).resolve().parents[1]
ALL = 100_000  # above every parameter of grpo_tiny's model (the largest has 32768 elements)
# (label, engine, persistence threshold, DeepSpeed's own per-parameter re-gather after each step,
# DeepSpeed's per-submodule fetch/release kept)
VARIANTS = (("ZeRO-3, threshold 0 (every parameter fetched per submodule)", "deepspeed", 0, False, True),
            ("ZeRO-3, all persistent, DeepSpeed's per-parameter re-gather", "deepspeed", ALL, True, True),
            ("ZeRO-3, all persistent, one coalesced re-gather", "deepspeed", ALL, False, True),
            ("ZeRO-3, all persistent, coalesced re-gather, no submodule fetches", "deepspeed", ALL, False, False),
            ("FSDP2 DP2, gathered once", "fsdp2", 0, False, False))


def _loss(lp: torch.Tensor, s: slice):
    loss = -lp.mean()
    return loss, {"loss": float(loss.detach())}


def measure(engine: str, threshold: int, deepspeed_regather: bool, hooks: bool, iterations: int) -> dict:
    """One rank: build the engine, time ``iterations`` (after one warm-up) of one log-prob forward
    and 4 optimizer steps."""
    from rlhf_switch.engines import deepspeed_zero
    from rlhf_switch.engines.base import TrainingContext, training_engine
    from rlhf_switch.engines.optim import AdamWConfig
    from rlhf_switch.rl.config import TrainerLayout

    torch.set_num_threads(1)
    hf = yaml.safe_load((ROOT / "configs/grpo_tiny.yaml").read_text())["model"]["hf_config"]
    ctx = TrainingContext(hf, 0, (0, 1), AdamWConfig(lr=1e-4, max_grad_norm=1.0), micro_batch=16,
                          outputs_batch=64, seq_len=16)
    layout = TrainerLayout(engine=engine, zero_stage=3 if engine == "deepspeed" else 0, dp=2,
                           persistence_threshold=threshold)
    deepspeed_zero.DROP_FETCHES_WHEN_WHOLE = not hooks  # this rank's process: the next build reads it
    eng = training_engine(engine).build(layout, ctx)
    if deepspeed_regather:
        del eng.engine.optimizer._post_step  # build_zero_trainer's coalesced re-gather: back to DeepSpeed's
    ids = torch.randint(3, 47, (64, 16), generator=torch.Generator().manual_seed(dist.get_rank()))

    def one():
        t0 = time.perf_counter()
        lp = eng.outputs(ids)
        t1 = time.perf_counter()
        norms = [eng.train_step(ids[k * 16:(k + 1) * 16], 16, _loss)["grad_norm"] for k in range(4)]
        return t1 - t0, time.perf_counter() - t1, norms, lp

    one()
    runs = [one() for _ in range(iterations)]
    return {"outputs_s": statistics.median(r[0] for r in runs), "update_s": statistics.median(r[1] for r in runs),
            "norms": [r[2] for r in runs], "logprobs": runs[-1][3],
            "weights": {k: v.clone() for k, v in eng.adapter.weights().tensors.items()}
            if engine == "deepspeed" else None}


def main(argv=None) -> None:
    from rlhf_switch.launch import LocalWorld

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iterations", type=int, default=7)
    a = ap.parse_args(argv)
    times = {v[0]: [] for v in VARIANTS}
    last = {}
    with LocalWorld(2, timeout=600) as world:
        for _ in range(a.rounds):
            for label, engine, threshold, regather, hooks in VARIANTS:
                ranks = world.run(measure, engine, threshold, regather, hooks, a.iterations)
                times[label].append((max(r["update_s"] for r in ranks), max(r["outputs_s"] for r in ranks)))
                last[label] = ranks
    plain = last[VARIANTS[0][0]]
    print("| trainer | 4 optimizer steps | one log-prob forward of 64 rows | rounds (steps) | bit-identical to threshold 0 |")
    print("|---|---|---|---|---|")
    for label, engine, *_ in VARIANTS:
        same = "—" if engine != "deepspeed" else all(
            r["norms"] == p["norms"] and torch.equal(r["logprobs"], p["logprobs"])
            and all(torch.equal(r["weights"][k], p["weights"][k]) for k in p["weights"])
            for r, p in zip(last[label], plain))
        ts = times[label]
        print(f"| {label} | {statistics.median(t[0] for t in ts):.3f} s | {statistics.median(t[1] for t in ts):.3f} s | "
              f"{', '.join(f'{t[0]:.3f}' for t in ts)} | {same} |")


if __name__ == "__main__":
    main()
