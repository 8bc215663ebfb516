"""Verification of the bytes themselves (``move(..., verify=...)``, ``routing/verify.py``):
4 real gloo ranks; one staged chunk corrupted in flight by a test-only hook
(``MoveHooks.staged_receive``, set by ``verify_jobs.move_verified`` on one rank)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import verify_jobs
from rlhf_switch.routing import prepare
from rlhf_switch.routing.verify import checked, checksum, sampled
from rlhf_switch.vps import plan_transition
from rlhf_switch.vps.materialize import allocate

SRC, DST, RANK = "zero3", "tp4", 0  # rank 0 of zero3 -> tp4 unpacks staged receives
FRACTION = 0.1


def _first_staged_transfer(src, dst, rank, budget=1 << 20):
    """The transfer whose piece the hook corrupts: the first staged receive of ``rank``'s program."""
    s = prepare(src, dst, rank, allocate(src, rank), allocate(dst, rank), budget)
    program, _ = s.staged
    st = next(x for x in program if x.recv_bytes)
    ex = s.exchanges[st.exchange]
    return s.plan, ex.peer, ex.steps[st.step][1].pieces[0].transfer


def _seeds(plan, peer, t):
    """A seed whose sample checks ``t``, and one whose sample does not."""
    hit = [seed for seed in range(100) if t in checked(plan, FRACTION, seed)[1][peer]]
    miss = [seed for seed in range(100) if t not in checked(plan, FRACTION, seed)[1][peer]]
    return hit[0], miss[0]


def _expected_error_parts(c):
    return [f"rank {c['dst']} received {c['key']}{c['box']}", f"from rank {c['src']}", repr(c["buffer"])]


def test_without_corruption_every_mode_is_bit_exact(world4, layouts4):
    src, dst = layouts4[SRC], layouts4[DST]
    plan = plan_transition(src, dst)
    for verify in ("off", "sample", "full"):
        results = world4.run(verify_jobs.move_verified, src, dst, verify, FRACTION, 3)
        for r, res in enumerate(results):
            assert res["error"] is None and res["differ"] == {}, (verify, r, res)
            rep = res["report"]
            assert rep.verify == verify
            mine = [t for t in plan.transfers if t.dst == r]
            if verify == "full":
                assert rep.pieces_verified == len(mine)
            elif verify == "sample":
                assert 0 < rep.pieces_verified < len(mine)
            else:
                assert rep.pieces_verified == 0 and "verify" not in rep.phases


def test_full_catches_a_corrupted_chunk_on_every_rank(world4, layouts4):
    src, dst = layouts4[SRC], layouts4[DST]
    results = world4.run(verify_jobs.move_verified, src, dst, "full", FRACTION, 0, RANK)
    c = results[RANK]["corrupted"]
    assert c is not None and c["dst"] == RANK
    errors = {res["error"] for res in results}
    assert len(errors) == 1, errors  # the same error on every rank
    error = errors.pop()
    assert error.startswith(f"VerifyError: verify=full: the move {src.name} -> {dst.name} delivered 1 corrupted piece(s)")
    for part in _expected_error_parts(c):
        assert part in error, (part, error)
    # the corruption did land (verification reports, it does not repair)
    assert results[RANK]["differ"] == {c["buffer"]: 1}


def test_sample_catches_it_when_drawn_and_can_miss_it(world4, layouts4):
    src, dst = layouts4[SRC], layouts4[DST]
    plan, peer, t = _first_staged_transfer(src, dst, RANK)
    hit, miss = _seeds(plan, peer, t)
    # drawn: caught, on every rank, naming the piece
    results = world4.run(verify_jobs.move_verified, src, dst, "sample", FRACTION, hit, RANK)
    c = results[RANK]["corrupted"]
    assert (c["key"], c["box"], c["src"]) == (str(t.key), str(t.box), peer)
    for res in results:
        assert res["error"].startswith("VerifyError: verify=sample:"), res["error"]
        for part in _expected_error_parts(c):
            assert part in res["error"]
    # not drawn: sampling misses it — the move "succeeds" with one corrupted element landed
    results = world4.run(verify_jobs.move_verified, src, dst, "sample", FRACTION, miss, RANK)
    assert results[RANK]["corrupted"] == c
    for r, res in enumerate(results):
        assert res["error"] is None, res["error"]
        assert res["differ"] == ({c["buffer"]: 1} if r == RANK else {})


def test_off_does_not_notice(world4, layouts4):
    src, dst = layouts4[SRC], layouts4[DST]
    results = world4.run(verify_jobs.move_verified, src, dst, "off", FRACTION, 0, RANK)
    c = results[RANK]["corrupted"]
    for r, res in enumerate(results):
        assert res["error"] is None  # documented: without verification the corruption arrives unnoticed
        assert res["differ"] == ({c["buffer"]: 1} if r == RANK else {})


def test_ranks_that_disagree_on_what_to_check_fail_together(world4, layouts4):
    results = world4.run(verify_jobs.move_with_seed_of_rank, layouts4["fsdp"], layouts4["tp2xpp2"])
    for res in results:
        assert res["error"].startswith("VerifyError: verification of DP4[fsdp] -> TP2·PP2: the ranks disagree")


def test_sampling_is_deterministic_and_exact_in_count():
    a = sampled(40, 0.1, "d", 7, 0, 1)
    assert a == sampled(40, 0.1, "d", 7, 0, 1) and len(a) == 4
    assert a != sampled(40, 0.1, "d", 8, 0, 1)
    assert len(sampled(3, 0.1, "d", 0, 2, 1)) == 1  # at least one piece per pair
    assert sampled(5, 1.0, "d", 0, 0, 1) == list(range(5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64, torch.uint8])
def test_checksum_is_bitwise_and_positional(dtype):
    g = torch.Generator().manual_seed(0)
    t = torch.randint(0, 100, (64, 33), generator=g).to(dtype)
    base = checksum(t)
    assert torch.equal(base, checksum(t.clone()))
    assert torch.equal(base, checksum(t.t().contiguous().t()))  # a strided view of the same values
    swapped = t.clone().view(-1)
    swapped[[3, 4]] = swapped[[4, 3]]
    if swapped[3] != swapped[4]:
        assert not torch.equal(base, checksum(swapped.view(64, 33)))
    flipped = t.clone().view(-1)
    raw = flipped.view(torch.uint8)
    raw[5] ^= 1
    assert not torch.equal(base, checksum(flipped))
    if dtype.is_floating_point:
        z, nz = torch.zeros(4, dtype=dtype), torch.zeros(4, dtype=dtype)
        nz[2] = -0.0
        assert not torch.equal(checksum(z), checksum(nz))  # -0.0 is not 0.0, bitwise


def test_the_weight_channel_carries_verify(world4, layouts4):
    """The channel's setting (what an ``Endpoint`` carries to every member) checks every move;
    a sampled channel draws anew each move (its seed: the channel's count of moves)."""
    src, dst = layouts4[SRC], layouts4[DST]
    results = world4.run(verify_jobs.channel_verified, src, dst, "full", 1.0, 2, RANK)
    for res in results:
        assert res["error"].startswith("VerifyError: verify=full:"), res["error"]
    assert len(results[RANK]["checked"]) == 1  # the first move passed, checked; the second failed
    results = world4.run(verify_jobs.channel_verified, src, dst, "sample", FRACTION, 3)
    plan = plan_transition(src, dst)
    for r, res in enumerate(results):
        assert res["error"] is None
        assert all(0 < c < len([t for t in plan.transfers if t.dst == r]) for c in res["checked"])
        assert res["stats"]["pieces_verified"] == sum(res["checked"])


def test_run_config_verify(tmp_path):
    import yaml

    from rlhf_switch.rl.config import ConfigError, load_config

    cfg = yaml.safe_load((Path(__file__).parent.parent / "configs" / "grpo_tiny_fsdp.yaml").read_text())
    assert load_config(cfg).verify == "off"  # the default
    cfg.update(verify="sample", verify_fraction=0.25)
    loaded = load_config(cfg)
    assert (loaded.verify, loaded.verify_fraction) == ("sample", 0.25)
    for bad in ({"verify": "sometimes"}, {"verify_fraction": 0}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            load_config({**cfg, **bad})


def _reference_checksum(t: torch.Tensor) -> list[int]:
    """The module docstring's definition, in plain Python over the bytes: int64 words (native
    byte order), the last partial one zero-padded; ``s1 = sum w_i``, ``s2 = sum (i + 1) w_i``,
    modulo 2^64."""
    import sys

    raw = bytes(t.contiguous().reshape(-1).view(torch.uint8).tolist())
    raw += bytes(-len(raw) % 8)
    words = [int.from_bytes(raw[i:i + 8], sys.byteorder) for i in range(0, len(raw), 8)]
    m64 = (1 << 64) - 1
    return [sum(words) & m64, sum((i + 1) * w for i, w in enumerate(words)) & m64]


@pytest.mark.parametrize("nbytes", [1, 3, 7, 9, 13, 8 * 5 + 6, 8 * 1024 + 1, 8 * 1024 + 7, 8 * 2048 + 8 * 3 + 5])
def test_checksum_of_a_piece_whose_size_is_not_a_multiple_of_8_bytes(nbytes):
    """A box of bf16/fp16/int8 elements rarely fills whole int64 words: the last partial word
    counts, zero-padded, at its own position — equal to the definition computed by hand (also
    past a whole ``[m, COLS]`` block), and every byte of the tail changes the checksum."""
    from rlhf_switch.routing.verify import COLS

    assert COLS == 1024  # the sizes above straddle one and two whole rows of words
    g = torch.Generator().manual_seed(nbytes)
    t = torch.randint(1, 256, (nbytes,), generator=g, dtype=torch.int64).to(torch.uint8)
    got = [v & ((1 << 64) - 1) for v in checksum(t).tolist()]
    assert got == _reference_checksum(t), nbytes
    for i in range(nbytes - nbytes % 8, nbytes):  # each byte of the partial word
        changed = t.clone()
        changed[i] ^= 0x10
        assert not torch.equal(checksum(changed), checksum(t)), (nbytes, i)
    # the same bytes as fp16 / bf16 elements (an odd count: 2-byte tail) and from an unaligned view
    if nbytes % 2 == 0:
        for dtype in (torch.float16, torch.bfloat16):
            assert torch.equal(checksum(t.view(dtype)), checksum(t)), (nbytes, dtype)
    padded = torch.cat([torch.zeros(1, dtype=torch.uint8), t])[1:]  # storage offset 1
    assert torch.equal(checksum(padded), checksum(t))
