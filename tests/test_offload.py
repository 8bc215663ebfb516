"""Memory at the phase boundary (``engines/offload.py``): a real engine's optimizer state (and,
``all``, its weights) moved into host buffers by a VPS move, the engine's storage handed back,
then moved back — on 2 ranks, DeepSpeed ZeRO-1/2/3 and FSDP2.

- After the round trip every storage the offload touched holds the same bytes as before (padding
  no fragment describes included), and training continues bit-identically to a twin engine that
  never offloaded (losses and the whole final state).
- While parked, those storages are 0 bytes (the memory really was handed back).
- Bytes moved each way = the rank's optimizer state counted from the torch optimizer the engine
  steps (fp32 master where apart from the weights + two Adam moments; ``all``: + the weights).
"""
from __future__ import annotations

import importlib.util

import pytest

assert importlib.util.find_spec("deepspeed"), "deepspeed is not installed; `make test` installs it"

import offload_jobs as jobs  # noqa: E402

CASES = [("zero", 1, "optimizer"), ("zero", 2, "optimizer"), ("zero", 3, "optimizer"), ("zero", 3, "all"),
         ("fsdp2", 0, "optimizer"), ("fsdp2", 0, "all")]


@pytest.mark.parametrize("kind,stage,mode", CASES, ids=[f"{k}{s or ''}-{m}" for k, s, m in CASES])
def test_offload_round_trip_is_bit_exact(world2, kind, stage, mode):
    results = world2.run(jobs.round_trip, kind, stage, mode, timeout=300)
    for r in results:
        assert r["changed"] == [], r["changed"]
        assert r["released_now"]
        assert r["losses_a"] == r["losses_b"]  # exactly
        assert r["final_differs"] == [], r["final_differs"]
        assert r["moved"] == [r["optimizer_bytes"]] * 4, (r["moved"], r["optimizer_bytes"])
        assert r["taken"] == r["released"] >= r["optimizer_bytes"]
        live_before, live_parked = r["live"]
        assert live_parked == live_before - r["released"]


def test_offload_mode_is_checked():
    from rlhf_switch.engines.offload import HostOffload

    with pytest.raises(ValueError, match="offload mode 'gpu'"):
        HostOffload(None, "gpu")
