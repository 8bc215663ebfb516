"""Weight sync p2p vs the colocated handoff (ipc), side by side in one cluster.

    python -m bench.handoff [--config configs/grpo_tiny.yaml] [--syncs 40] [--rounds 2] [--json FILE]

Builds the config's engines once (Ray, the trainer, vLLM; the model's seeded initial weights: no
SFT), then alternates the run's weight channel between ``rollout.handoff: p2p`` and ``ipc``
(``Cluster.open_channel`` again: a new channel, the same engines), ``--rounds`` times each; per
round 3 warm-up syncs, then ``--syncs`` timed ``Cluster.sync`` calls (driver's view: the
replicas' receive posted and every trainer rank's send, as in the loop without the post-ahead).
Prints the median and quartiles of each, the trainer ranks' move (gather + handoff for ipc) and
the handles per sync. After the last round the trainer's log-probs are checked against vLLM's
on a generated batch (the weights really arrived).
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(xs, n=4)
    return q[0], statistics.median(xs), q[2]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/grpo_tiny.yaml")
    ap.add_argument("--syncs", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)

    from recipes.cluster import Cluster, start_ray
    from recipes.common import warm_start
    from rlhf_switch.rl.config import load_config

    cfg = load_config(a.config)
    cfg.sft = None  # the seeded initial weights: the bench moves bytes, it does not learn
    out = Path(tempfile.mkdtemp(prefix="bench-handoff-"))
    init = warm_start(cfg, out / "init", quiet=True)
    ray, owned = start_ray(cfg, cfg.world_size)
    cluster = Cluster(cfg, ray, quiet=True)
    rows: dict[str, dict[str, list]] = {m: {"sync_s": [], "trainer_move_s": [], "handles": []} for m in ("p2p", "ipc")}
    try:
        t0 = time.perf_counter()
        cluster.build(init, None)
        print(f"engines built in {time.perf_counter() - t0:.0f} s", flush=True)
        for _ in range(a.rounds):
            for mode in ("p2p", "ipc"):
                cluster.cfg.rollout.handoff = mode
                cluster.open_channel()
                for _ in range(3):
                    cluster.sync()
                for _ in range(a.syncs):
                    s = cluster.sync()
                    assert s["handoff"] == mode, s
                    rows[mode]["sync_s"].append(s["seconds"])
                    rows[mode]["trainer_move_s"].append(s["breakdown"]["trainer_move_s"])
                    rows[mode]["handles"].append(s["handles"])
                    bytes_moved = s["bytes_moved"]
        prompts = [[1, 5 + i, 7, 9] for i in range(8)]
        tokens, lps = cluster.generate(prompts, list(range(8)), 4, 1.0)
        stats = cluster.all("train_on", {"prompts": prompts, "responses": tokens, "rollout_logprobs": lps,
                                         "advantages": [0.0] * 8})
        stale = max(s["stale_logprob_diff"] for s in stats)
    finally:
        cluster.shutdown()
        if owned:
            ray.shutdown()
    result = {"config": a.config, "syncs_per_round": a.syncs, "rounds": a.rounds, "bytes_moved": bytes_moved,
              "stale_logprob_diff_after": stale}
    print(f"{a.config}: {a.rounds} rounds x {a.syncs} syncs per handoff, {bytes_moved / 2**20:.2f} MiB per sync; "
          f"trainer vs vLLM log-probs after the last ipc sync: max |diff| {stale:.1e}")
    print(f"{'handoff':8} {'sync median (q1-q3)':>26} {'trainer move median':>20} {'handles/sync':>13}")
    for mode, r in rows.items():
        q1, med, q3 = quartiles(r["sync_s"])
        tm = statistics.median(r["trainer_move_s"])
        result[mode] = {"sync_s": [q1, med, q3], "trainer_move_s": tm, "handles": r["handles"][0]}
        print(f"{mode:8} {med * 1e3:>12.2f} ms ({q1 * 1e3:.2f}-{q3 * 1e3:.2f}) {tm * 1e3:>17.2f} ms "
              f"{r['handles'][0]:>13}")
    ratio = result["ipc"]["sync_s"][1] / result["p2p"]["sync_s"][1]
    result["ipc_over_p2p"] = ratio
    print(f"ipc / p2p (median sync): {ratio:.2f}")
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
