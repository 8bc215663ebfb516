"""Memory at the phase boundary (``engines/offload.py``): a real engine's optimizer state (and,
``all``, its weights) moved into host buffers by a VPS move, the engine's storage handed back,
then moved back — on 2 ranks, DeepSpeed ZeRO-1/2/3 and FSDP2.

- After the round trip every storage the offload touched holds the same bytes as before (padding
  no fragment describes included), and training continues bit-identically to a twin engine that
  never offloaded (losses and the whole final state).
- While parked, those storages are 0 bytes (the memory really was handed back).
- Bytes moved each way = the rank's optimizer state counted from the torch optimizer the engine
  steps (fp32 master where apart from the weights + two Adam moments; ``all``: + the weights).

Then the loop (slow, over Ray, the module's ``ray_session``): GRPO with real DeepSpeed ZeRO-3 DP2
and ``train.offload: optimizer`` / ``all`` gives the same rollouts, losses and final state, bit for
bit, as ``none``, and each rank's offload/reload bytes are its own state, counted from the model's
shapes. An engine without offload is refused before Ray starts (exit 2 from the CLI).
"""
from __future__ import annotations

import importlib.util

import pytest
import torch

assert importlib.util.find_spec("deepspeed"), "deepspeed is not installed; `make test` installs it"

import offload_jobs as jobs  # noqa: E402

CASES = [("zero", 1, "optimizer"), ("zero", 2, "optimizer"), ("zero", 3, "optimizer"), ("zero", 3, "all"),
         ("fsdp2", 0, "optimizer"), ("fsdp2", 0, "all")]


@pytest.mark.parametrize("kind,stage,mode", [
    pytest.param(*c, id=f"{c[0]}{c[1] or ''}-{c[2]}", marks=() if c == ("fsdp2", 0, "all") else pytest.mark.heavy)
    for c in CASES])
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


# --- the loop: GRPO over Ray with real DeepSpeed, offload: optimizer / all against none -----------

def _loop_config(out, offload: str) -> dict:
    from helpers import small

    cfg = small("grpo_tiny.yaml", out, train={"engine": "deepspeed", "zero_stage": 3, "dp": 2, "offload": offload},
                rollout={"engine": "torch", "tp": 1, "dp": 2}, checkpoint={"save_every": 0})
    cfg["algorithm"]["iterations"] = 2
    return cfg


def _zero3_partition_elements(hf_config: dict, dp: int) -> list[int]:
    """The elements of each rank's ZeRO-3 partition, from the model's shapes and ZeRO-3's rule
    (each parameter split on its own: rank r owns flat [r·P, (r+1)·P), P = ceil(n/dp))."""
    from rlhf_switch.vps import llama_spec

    per_rank = [0] * dp
    for t in llama_spec(hf_config).tensors:
        P = -(-t.numel // dp)
        for r in range(dp):
            per_rank[r] += max(0, min((r + 1) * P, t.numel) - r * P)
    return per_rank


@pytest.mark.slow
def test_grpo_with_offload_is_bit_identical_to_none(ray_session, tmp_path):
    from safetensors.torch import load_file

    from recipes.grpo import run
    from helpers import TINY, records

    outs = {mode: tmp_path / mode for mode in ("none", "optimizer", "all")}
    for mode, out in outs.items():
        run(_loop_config(out, mode), quiet=True)
    recs = {m: [r for r in records(o) if "reward_mean" in r] for m, o in outs.items()}
    keys = ("reward_mean", "policy_loss", "kl", "clipfrac", "grad_norm", "stale_logprob_diff", "optimizer_steps")
    for mode in ("optimizer", "all"):
        assert [r["iteration"] for r in recs[mode]] == [0, 1]
        for a, b in zip(recs["none"], recs[mode]):
            assert [a[k] for k in keys] == [b[k] for k in keys], (mode, a["iteration"])
        ra, rb = records(outs["none"], "rollouts.jsonl"), records(outs[mode], "rollouts.jsonl")
        assert [r["responses"] for r in ra] == [r["responses"] for r in rb]
        assert [r["logprobs"] for r in ra] == [r["logprobs"] for r in rb]
        for f in ("model.safetensors", "optimizer/moments.safetensors"):
            wa, wb = (load_file(str(outs[m] / "final" / f)) for m in ("none", mode))
            assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa), (mode, f)
    # the moves: each rank's own optimizer state (fp32 master + 2 moments; all: + its fp32
    # "bit16" partition) out and back, every iteration
    elements = _zero3_partition_elements(TINY, 2)
    for mode, copies in (("optimizer", 3), ("all", 4)):
        want = [copies * 4 * n for n in elements]
        for r in recs[mode]:
            assert r["offload_bytes_per_rank"] == r["reload_bytes_per_rank"] == want, (mode, r["offload_bytes_per_rank"])
            assert r["offload_seconds"] > 0 and r["reload_seconds"] > 0 and r["switch_rollout_to_train_s"] > 0
            # CPU: the trainer's live state buffers; generation ran with the optimizer state gone
            assert r["peak_device_bytes_generate"] <= r["peak_device_bytes_train"] - max(want)
            assert r["peak_device_bytes_sync"] == r["peak_device_bytes_train"]
    assert all(r["peak_device_bytes_generate"] == 0 for r in recs["all"])  # gradient buffers too
    for r in recs["none"]:
        assert r["offload_bytes"] == r["reload_bytes"] == 0
        assert r["peak_device_bytes_generate"] == r["peak_device_bytes_train"]


def test_offload_is_refused_before_ray_for_engines_without_it(tmp_path):
    import yaml

    from recipes.train import main, prepare
    from rlhf_switch.rl.config import ConfigError

    cfg = _loop_config(tmp_path, "optimizer")
    cfg["train"] = {"engine": "torch_tp", "tp": 2, "offload": "optimizer"}
    with pytest.raises(ConfigError, match="train.offload: optimizer — engine torch_tp cannot park"):
        prepare(cfg)
    path = tmp_path / "tp.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main([str(path), "--quiet"]) == 2  # the CLI: exit 2, nothing started
    cfg["train"] = {"engine": "deepspeed", "zero_stage": 3, "dp": 2, "offload": "gpu"}
    with pytest.raises(ConfigError, match="train.offload"):
        prepare(cfg)
    cfg["reference"] = {**cfg["reference"], "offload": "optimizer"}  # the train block's key only
    cfg["train"]["offload"] = "optimizer"
    with pytest.raises(ConfigError, match="reference.offload: unknown field"):
        prepare(cfg)


# --- the host layout itself (pure metadata) ---------------------------------------------------------

def test_host_layout_keeps_every_rank_its_own_boxes_packed():
    """For every named 4-rank layout (with Adam state: weights + master + moments): the host layout
    is valid, holds on each rank exactly the boxes the rank holds, densely (each host buffer is
    the sum of its fragments, no gaps), and the move into it is local copies of every byte."""
    from catalogue import CONFIGS, TINY_LLAMA
    from rlhf_switch.vps import ADAM_FIELDS, PARAM, build_layout, llama_spec, plan_rank
    from rlhf_switch.vps.layouts.host import host_layout

    spec = llama_spec(TINY_LLAMA, name="tiny-llama")
    for name, config in CONFIGS.items():
        src = build_layout(spec, config, (PARAM, *ADAM_FIELDS))
        host = host_layout(src).validate()
        for rank in range(src.world_size):
            assert sorted((f.key, f.box) for f in host.fragments(rank)) == \
                sorted((f.key, f.box) for f in src.fragments(rank)), (name, rank)
            used = {}
            for f in host.fragments(rank):
                used[f.buffer] = used.get(f.buffer, 0) + f.box.numel
            assert {b: s.numel for b, s in host.buffers(rank).items()} == used, (name, rank)
            there, back = plan_rank(src, host, rank), plan_rank(host, src, rank)
            assert there.bytes_sent == back.bytes_sent == 0, (name, rank)
            held = sum(f.box.numel * 4 for f in src.fragments(rank))  # fp32 spec
            assert there.bytes_local == back.bytes_local == held, (name, rank)


# --- one rank, in this process: what reload puts back, byte for byte --------------------------------

class FlatGroupAdapter:
    """An engine shaped like DeepSpeed ZeRO on one rank, over plain tensors: each field of the
    state in one flat buffer with zero alignment padding between and after the tensors (no
    fragment describes it), a bf16 compute copy apart from the fp32 master (``separate_weights``)
    and a persistent gradient buffer. Small buffers on purpose (heap chunks, not fresh pages:
    memory taken again after a release holds whatever was there before unless reload zeroes it)."""

    separate_weights = True
    name = "flat-groups"
    PAD = 3  # elements of padding after each tensor

    def __init__(self, seed: int = 0):
        from rlhf_switch.vps import EXP_AVG, EXP_AVG_SQ, MASTER, PARAM, synthetic_spec

        self.spec = synthetic_spec([("a", (5, 3), "float32", "replicate"), ("b", (7,), "float32", "replicate"),
                                    ("c", (2, 4), "float32", "replicate")])
        self.offsets, n = {}, 0
        for t in self.spec.tensors:
            self.offsets[t.name] = n
            n += t.numel + self.PAD
        self.fields = {PARAM: torch.bfloat16, MASTER: torch.float32, EXP_AVG: torch.float32, EXP_AVG_SQ: torch.float32}
        g = torch.Generator().manual_seed(seed)
        self.buffers = {}
        for field, dtype in self.fields.items():
            buf = torch.zeros(n, dtype=dtype)
            for t in self.spec.tensors:  # the described elements: anything but zero; the padding: zero
                o = self.offsets[t.name]
                buf[o:o + t.numel] = (torch.rand(t.numel, generator=g) + 0.5).to(dtype)
            self.buffers[field] = buf
        self.grad = torch.rand(n, generator=g) + 0.5  # last step's gradients: worthless after the step

    def _local(self, fields):
        from rlhf_switch.engines.train_state import LocalState
        from rlhf_switch.vps import StateKey

        out = LocalState()
        for field in fields:
            name = out.add_buffer(f"flat.{field}", self.buffers[field])
            for t in self.spec.tensors:
                out.add_flat(StateKey(t.name, field), t.shape, 0, t.numel, name, self.offsets[t.name])
        return out

    def weights(self):
        from rlhf_switch.vps import PARAM

        return self._local([PARAM])

    def state(self):
        from rlhf_switch.vps import EXP_AVG, EXP_AVG_SQ, MASTER

        return self._local([MASTER, EXP_AVG, EXP_AVG_SQ])

    def gradient_buffers(self):
        return [self.grad]

    def described(self) -> int:
        return sum(t.numel for t in self.spec.tensors)


@pytest.fixture
def one_rank_world():
    """A default process group of one rank in this process (what ``HostOffload``'s move and its
    layout gather run over), gone after the test."""
    from datetime import timedelta

    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=60))
    try:
        yield
    finally:
        dist.destroy_process_group()


def _storage_bytes(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()).clone()


def _dirty_the_heap(sizes, copies: int = 16) -> None:
    """Take memory of the released storages' sizes, fill it with 0xFF and free it again: what a
    rollout phase does with the memory handed back. A reload that does not zero the storage it
    takes again then finds these bytes in the padding and the gradients."""
    junk = [torch.full((n,), 0xFF, dtype=torch.uint8) for n in sizes for _ in range(copies)]
    del junk


@pytest.mark.parametrize("mode", ["optimizer", "all"])
def test_offload_reload_restores_exactly_and_zeroes_padding_and_gradients(one_rank_world, mode):
    """Reload puts every described byte back, the padding no fragment describes back to zero
    (not whatever the memory held meanwhile) and the gradient buffers zeroed, seen through the
    tensor objects the engine holds; a second round trip after the state changed brings back the new state, not the
    first offload's. ``optimizer`` leaves the compute weights where they are."""
    from rlhf_switch.engines.offload import HostOffload
    from rlhf_switch.vps import PARAM

    eng = FlatGroupAdapter()
    parked = dict(eng.buffers) if mode == "all" else {f: b for f, b in eng.buffers.items() if f != PARAM}
    kept = {} if mode == "all" else {PARAM: eng.buffers[PARAM]}
    off = HostOffload(eng, mode)
    for trip in range(2):
        before = {f: _storage_bytes(b) for f, b in eng.buffers.items()}
        out = off.offload()
        assert all(b.untyped_storage().nbytes() == 0 for b in [*parked.values(), eng.grad])
        assert all(b.untyped_storage().nbytes() == before[f].numel() for f, b in kept.items())
        _dirty_the_heap(sorted({b.numel() for b in before.values()} | {eng.grad.untyped_storage().nbytes()}))
        back = off.reload()
        for f, b in eng.buffers.items():
            assert torch.equal(_storage_bytes(b), before[f]), (trip, f)  # padding included
        assert torch.equal(eng.grad, torch.zeros_like(eng.grad)), trip
        described = sum(eng.described() * b.element_size() for b in parked.values())
        assert out.bytes_moved == back.bytes_moved == described
        assert out.bytes_released == back.bytes_released == \
            sum(b.untyped_storage().nbytes() for b in [*parked.values(), eng.grad])
        # a training step between this round trip and the next: new values, new gradients
        for b in eng.buffers.values():
            for t in eng.spec.tensors:
                o = eng.offsets[t.name]
                b[o:o + t.numel] += 1
        eng.grad.fill_(0.25)
