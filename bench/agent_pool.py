"""Multi-turn rollout throughput: environments in a pool of Ray workers with turns batched, against
the same episodes played one after another.

    python -m bench.agent_pool [--samples 64] [--latency 0.05] [--slow-p 0] [--slow-s 0.5] [--workers 4]
        [--sft-steps 300] [--json FILE]

The game of configs/agent_guess_tiny.yaml, on its tiny Llama warm-started on the expert's games
(``--sft-steps``), decoded greedily in this process (``agent.evaluate.BatchedGreedy``, one thread).
Each environment step takes ``--latency`` seconds more (a tool or a game server that answers after
a while: ``SlowGuess``), or ``--slow-s`` for a share ``--slow-p`` of the steps (a tool that now and
then answers late). Four ways, side by side in one run, the same episodes each way (checked: the
same token lists):

- ``sequential``: one episode after another, each turn its own model call, the environment in
  this process — the environments called one after another;
- ``batched``: every episode at once, turns batched (``agent.workflow``), the environments still
  in this process (each call blocks the others);
- ``pool``: every episode at once, turns batched, the environments in ``--workers`` Ray actors
  (``RayEnvPool``): the loop's way, turns batched in rounds (``agent.turn_batching: rounds``);
- ``continuous``: the same with turns batched continuously (``agent.turn_batching: continuous``):
  a batch goes out whenever none is generating, so no episode waits for another's slow step.

Reports rollout samples/s per way, the ratios to ``sequential`` and each way's engine calls.
"""
from __future__ import annotations

import argparse
import json
import time

from rlhf_switch.agent.guess import GuessEnvironment, GuessTask
from rlhf_switch.agent.limits import Limits
from rlhf_switch.agent.pool import LocalEnvPool
from rlhf_switch.agent.workflow import episode_request, run_workflow
from rlhf_switch.rl.tasks import CharTokenizer


class SlowGuess(GuessEnvironment):
    """The game, each step ``latency_s`` seconds slower — or, with probability ``slow_p``, ``slow_s``
    (a tool whose answer now and then takes long: drawn from the secret and the step's number, so
    every way of playing sleeps the same)."""

    def __init__(self, latency_s: float = 0.05, slow_p: float = 0.0, slow_s: float = 0.0, **kwargs):
        super().__init__(**kwargs)
        self.latency_s, self.slow_p, self.slow_s = latency_s, slow_p, slow_s

    @classmethod
    def episode_request(cls, sample, session, tokenizer, latency_s: float = 0.05, slow_p: float = 0.0,
                        slow_s: float = 0.0, **kwargs):
        import dataclasses

        req = super().episode_request(sample, session, tokenizer, **kwargs)
        return dataclasses.replace(req, env="bench.agent_pool:SlowGuess", env_kwargs={
            **req.env_kwargs, "latency_s": latency_s, "slow_p": slow_p, "slow_s": slow_s})

    def step(self, action):
        import random

        slow = random.Random(f"{self.secret}:{self.guesses}").random() < self.slow_p
        time.sleep(self.slow_s if slow else self.latency_s)
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
    ap.add_argument("--slow-p", type=float, default=0.0, help="the share of steps that take --slow-s instead")
    ap.add_argument("--slow-s", type=float, default=0.5)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--sft-steps", type=int, default=300)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import torch

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
    kwargs = {"latency_s": args.latency, "slow_p": args.slow_p, "slow_s": args.slow_s}

    def requests(tag):
        return [episode_request(env, kwargs, s, f"{tag}{i}", tok) for i, s in enumerate(secrets)]

    results, episodes, batches = {}, {}, {}
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
            # nor is their import of this module: one quick game per worker first (untimed)
            warm = [episode_request(env, {"latency_s": 0.0}, s, f"w{i}", tok) for i, s in enumerate(secrets[:args.workers])]
            run_workflow(greedy_batches(model), pool, warm, tok, limits, [0] * len(warm), 0.0)
            for way, batching in (("pool", "rounds"), ("continuous", "continuous")):
                t0 = time.perf_counter()
                played = run_workflow(greedy_batches(model), pool, requests(way[0]), tok, limits,
                                      [0] * len(secrets), 0.0, batching=batching)
                results[way], episodes[way] = time.perf_counter() - t0, played.episodes
                batches[way] = played.batches
    finally:
        ray.shutdown()
    same = all([e.ids for e in episodes[w]] == [e.ids for e in episodes["sequential"]] for w in episodes)
    turns = sum(e.turns for e in episodes["pool"])
    out = {"samples": args.samples, "latency_s": args.latency, "slow_p": args.slow_p, "slow_s": args.slow_s,
           "workers": args.workers, "turns": turns, "same_tokens": same,
           "engine_calls": {w: len(b) for w, b in batches.items()},
           "samples_per_s": {w: args.samples / s for w, s in results.items()},
           "vs_sequential": {w: results["sequential"] / s for w, s in results.items()}}
    slow = f" ({args.slow_p:.0%} of them {args.slow_s} s)" if args.slow_p else ""
    print(f"{args.samples} games ({turns} turns), each environment step +{args.latency} s{slow}, same tokens every "
          f"way: {same}; engine calls: " + ", ".join(f"{w} {len(b)}" for w, b in batches.items()))
    for w, s in results.items():
        print(f"  {w:<10} {s:7.2f} s  {args.samples / s:7.1f} samples/s  x{results['sequential'] / s:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    main()
