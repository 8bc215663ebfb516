"""The colocated handoff in the GRPO loop: ``configs/grpo_tiny.yaml`` (DeepSpeed ZeRO-3 DP2 ->
vLLM TP2, worker ``t`` on trainer rank ``t``'s logical device) run twice from the same seeded
start, ``rollout.handoff: p2p`` and ``auto`` (which the cluster resolves to ``ipc`` from where its
actors sit): the same rollouts (tokens, log-probs, rewards) and losses, bit for bit; with ipc
every sync hands the workers one shared-memory handle per bucket (here one bucket per worker at
the default budget, for 15 parameters each) and nothing over the group into them."""
from __future__ import annotations

import json

import pytest

from helpers import records, small

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


def test_grpo_ipc_handoff_same_rollouts_as_p2p(ray_session, tmp_path):
    from recipes.grpo import run
    from rlhf_switch.engines.channel import DEFAULT_BUDGET
    from rlhf_switch.models import model_spec
    from rlhf_switch.vps import vllm_layout
    from rlhf_switch.vps.layouts.buckets import bucket_layout
    from rlhf_switch.vps.placement import place

    got = {}
    for handoff in ("p2p", "auto"):
        out = tmp_path / handoff
        cfg = small("grpo_tiny.yaml", out)
        cfg["rollout"] = dict(cfg["rollout"], handoff=handoff)
        cfg["algorithm"].update(iterations=2)
        cfg["checkpoint"] = {"save_every": 0, "keep": 1}
        assert cfg["train"]["engine"] == "deepspeed" and cfg["rollout"]["engine"] == "vllm"
        run(cfg, quiet=True)
        rollouts = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
        got[handoff] = ([r for r in records(out) if "reward_mean" in r], rollouts, cfg)
    (p2p, p2p_rollouts, cfg), (ipc, ipc_rollouts, _) = got["p2p"], got["auto"]
    assert [r["handoff"] for r in p2p] == ["p2p"] * 2 and [r["handles"] for r in p2p] == [0, 0]
    spec = model_spec(cfg["model"]["hf_config"])
    buckets = bucket_layout(place(vllm_layout(spec, 2), range(2, 4), 4), {2: 0, 3: 1}, DEFAULT_BUDGET)
    n_buckets = len(buckets.buffers(0)) + len(buckets.buffers(1))
    n_tensors = 2 * len(vllm_layout(spec, 2).buffers(0))
    assert [r["handoff"] for r in ipc] == ["ipc"] * 2
    assert all(r["handles"] == n_buckets < n_tensors for r in ipc), (n_buckets, n_tensors, ipc)
    for a, b in zip(p2p_rollouts, ipc_rollouts):
        assert (a["responses"], a["logprobs"], a["rewards"]) == (b["responses"], b["logprobs"], b["rewards"])
    for a, b in zip(p2p, ipc):
        assert a["stale_check_passed"] and b["stale_check_passed"]
        assert (a["policy_loss"], a["kl"], a["grad_norm"]) == (b["policy_loss"], b["kl"], b["grad_norm"])
