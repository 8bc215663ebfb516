"""Multi-turn rollout throughput: environments in a pool of Ray workers with turns batched, against
the same episodes played one after another.

    python -m bench.agent_pool [--samples 64] [--latency 0.05] [--workers 4] [--sft-steps 300] [--json FILE]

The game of configs/agent_guess_tiny.yaml, on its tiny Llama warm-started on the expert's games
(``--sft-steps``), decoded greedily in this process (``agent.evaluate.BatchedGreedy``, one thread).
Each environment step takes ``--latency`` seconds more (a tool or a game server that answers after
a while: ``SlowGuess``). Three ways, side by side in one run, the same episodes each way (checked:
the same token lists):

- ``sequential``: one episode after another, each turn its own model call, the environment in
  this process — the environments called one after another;
- ``batched``: every episode at once, turns batched (``agent.workflow``), the environments still
  in this process (each call blocks the others);
- ``pool``: every episode at once, turns batched, the environments in ``--workers`` Ray actors
  (``RayEnvPool``): the loop's way.

Reports rollout samples/s per way and the ratios to ``sequential``.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from rlhf_switch.agent.guess import GuessEnvironment, GuessTask
from rlhf_switch.agent.limits import Limits
from rlhf_switch.agent.pool import LocalEnvPool
from rlhf_switch.agent.workflow import episode_request, run_workflow
from rlhf_switch.rl.tasks import CharTokenizer


class SlowGuess(GuessEnvironment):
    """The game, each step ``latency_s`` seconds slower."""

    def __init__(self, latency_s: float = 0.05, **kwargs):
        super().__init__(**kwargs)
        self.latency_s = latency_s

    @classmethod
    def episode_request(cls, sample, session, tokenizer, latency_s: float = 0.05, **kwargs):
        import dataclasses

        req = super().episode_request(sample, session, tokenizer, **kwargs)
        return dataclasses.replace(req, env="bench.agent_pool:SlowGuess", env_kwargs={**req.env_kwargs,
                                                                                     "latency_s": latency_s})

    def step(self, action):
        time.sleep(self.latency_s)
        return super().step(action)


def greedy_batches(model):
    """``agent.workflow``'s batch generator over a HF model, greedy, each row stopping at its stop ids."""
    from rlhf_switch.agent.evaluate import BatchedGreedy

    greedy = BatchedGreedy(model)

    def generate_batch(prompts, seeds, budgets, temperature, stops):
        tokens = greedy.decode([list(p) for p in prompts], list(budgets), list(stops))
        return tokens, [[0.0] * len(t) for t in tokens], [0] * len(tokens)
    return generate_batch


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--latency", type=float, default=0.05)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--sft-steps", type=int, default=300)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    import ray

    from rlhf_switch.agent.pool import RayEnvPool
    from rlhf_switch.agent.warm_start import tiny_hf_config, warm_start_guess

    tok = CharTokenizer()
    model, _ = warm_start_guess(tiny_hf_config(), args.sft_steps, seed=0)
    model.eval()
    every = list(GuessTask().all_samples())
    secrets = [every[i % len(every)] for i in range(args.samples)]
    limits = Limits(max_turns=6, max_total_tokens=24, max_context=int(model.config.max_position_embeddings),
                    max_turn_tokens=4)
    env = "bench.agent_pool:SlowGuess"
    kwargs = {"latency_s": args.latency}

    def requests(tag):
        return [episode_request(env, kwargs, s, f"{tag}{i}", tok) for i, s in enumerate(secrets)]

    results, episodes = {}, {}
    t0 = time.perf_counter()
    seq = []
    for r in requests("s"):
        seq += run_workflow(greedy_batches(model), LocalEnvPool(), [r], tok, limits, [0], 0.0).episodes
    results["sequential"], episodes["sequential"] = time.perf_counter() - t0, seq
    t0 = time.perf_counter()
    episodes["batched"] = run_workflow(greedy_batches(model), LocalEnvPool(), requests("b"), tok, limits,
                                       [0] * len(secrets), 0.0).episodes
    results["batched"] = time.perf_counter() - t0
    ray.init(address="local", num_cpus=args.workers + 1, include_dashboard=False, log_to_driver=False)
    try:
        with RayEnvPool(num_workers=args.workers, num_cpus=1.0) as pool:
            import asyncio

            asyncio.run(pool.pids())  # the workers up: their start is not the rollout's time
            t0 = time.perf_counter()
            episodes["pool"] = run_workflow(greedy_batches(model), pool, requests("p"), tok, limits,
                                            [0] * len(secrets), 0.0).episodes
            results["pool"] = time.perf_counter() - t0
    finally:
        ray.shutdown()
    same = all([e.ids for e in episodes[w]] == [e.ids for e in episodes["sequential"]] for w in episodes)
    turns = sum(e.turns for e in episodes["pool"])
    out = {"samples": args.samples, "latency_s": args.latency, "workers": args.workers, "turns": turns,
           "same_tokens": same,
           "samples_per_s": {w: args.samples / s for w, s in results.items()},
           "vs_sequential": {w: results["sequential"] / s for w, s in results.items()}}
    print(f"{args.samples} games ({turns} turns), each environment step +{args.latency} s, same tokens every way: {same}")
    for w, s in results.items():
        print(f"  {w:<10} {s:7.2f} s  {args.samples / s:7.1f} samples/s  x{results['sequential'] / s:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    main()
