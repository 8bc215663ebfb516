"""Verification of the bytes themselves (``move(..., verify=...)``, ``routing/verify.py``):
4 real gloo ranks; one staged chunk corrupted in flight by a test-only hook
(``MoveHooks.staged_receive``, set by ``verify_jobs.move_verified`` on one rank)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import verify_jobs
from rlhf_switch.routing import build_schedule, prepare
from rlhf_switch.routing.verify import checked, checksum, sampled
from rlhf_switch.vps import plan_rank, plan_transition
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


# ------------------------------------------------------------------ verify_move in this process
# Every rank a thread of the pytest process over one gloo group (a ``HashStore``): the check runs
# where a mutation test sees it, in a second. The destination buffers are what a correct move
# leaves (built directly from the global tensors, not moved), then corrupted by the test; each
# buffer sits at a non-zero offset of a larger tensor with garbage before it, as engines' do.

M64 = (1 << 64) - 1


def _engine_like(buffers: dict, seed: int) -> dict:
    """``buffers`` copied into views at odd element offsets of one larger tensor per buffer."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i, (n, t) in enumerate(buffers.items()):
        big = torch.randint(-100, 100, (t.numel() + 3 + i,), generator=g).to(t.dtype)
        out[n] = big[3 + i:]
        out[n].copy_(t)
    return out


def _exact_buffers(src, dst):
    """Per rank: the source buffers, and the destination buffers a correct move leaves."""
    from rank_jobs import tensor_source
    from rlhf_switch.vps.materialize import materialize

    tensor_of = tensor_source(src, 0)
    return ([_engine_like(materialize(src, r, tensor_of), r) for r in range(src.world_size)],
            [_engine_like(materialize(dst, r, tensor_of), 10 + r) for r in range(dst.world_size)])


def _verify_on_threads(src, dst, src_bufs, dst_bufs, verify="full", fraction=1.0, seeds=0, fractions=None):
    """``verify_move`` of ``src -> dst`` on every rank at once (``thread_world``); per rank what it
    returned or ``"<Exception>: <message>"``. ``seeds`` / ``fractions``: one for all, or one per rank."""
    from datetime import timedelta

    from rlhf_switch.routing.verify import verify_move
    from thread_world import run_on_threads

    n = src.world_size
    seeds = seeds if isinstance(seeds, (list, tuple)) else [seeds] * n
    fractions = fractions or [fraction] * n
    return run_on_threads(n, lambda r, comm: verify_move(
        build_schedule(plan_rank(src, dst, r), 1 << 20), src_bufs[r], dst_bufs[r], comm, verify, fractions[r],
        seeds[r], timedelta(seconds=60)))


def _dst_view(t, bufs):
    b = bufs[t.dst_buffer]
    return torch.as_strided(b, t.box.shape, t.dst_strides, b.storage_offset() + t.dst_offset)


def _src_view(t, bufs):
    b = bufs[t.src_buffer]
    return torch.as_strided(b, t.box.shape, t.src_strides, b.storage_offset() + t.src_offset)


def _hex(words) -> str:
    return "/".join(f"{w & M64:016x}" for w in words)


def _report(t, sent, arrived) -> str:
    """How the module docstring says a corrupted piece is named: its destination rank, state key,
    box, buffer and source rank, and both checksums (the definition's, computed in Python)."""
    return (f"rank {t.dst} received {t.key}{t.box} (buffer {t.dst_buffer!r}) from rank {t.src}: "
            f"checksum {_hex(sent)} was sent, {_hex(arrived)} arrived")


def _swap_words(v):
    """Swap the piece's first two 8-byte words (fp32: elements 0,1 <-> 2,3): every word's value
    survives, so the plain sum of the words does too."""
    f = v.reshape(-1).clone()
    f = torch.cat([f[2:4], f[0:2], f[4:]])
    v.copy_(f.view(v.shape))


def _shift_run(v):
    """Shift the piece's first 16 elements (8 words) by one word: a run landed one word late, its
    last word wrapped to the front — the same words, each at another position."""
    f = v.reshape(-1).clone()
    f = torch.cat([f[14:16], f[0:14], f[16:]])
    v.copy_(f.view(v.shape))


def _flip_bit(v):
    f = v.reshape(-1).clone()
    raw = f.view(torch.uint8)
    raw[5] ^= 0x08
    v.copy_(f.view(v.shape))


CORRUPTIONS = {"swapped words": _swap_words, "shifted run": _shift_run, "one flipped bit": _flip_bit}


def _received(plan, r, local=False):
    """Rank ``r``'s received (or local) transfers of at least 16 elements, from the global plan."""
    return [t for t in plan.transfers if t.dst == r and (t.src == r) == local and t.box.numel >= 16]


def test_full_passes_an_exact_move_and_checks_every_piece_it_received(layouts4):
    src, dst = layouts4[SRC], layouts4[DST]
    plan = plan_transition(src, dst)
    src_bufs, dst_bufs = _exact_buffers(src, dst)
    got = _verify_on_threads(src, dst, src_bufs, dst_bufs, "full", 0.1, seeds=[3, 3, 3, 3])
    assert got == [len([t for t in plan.transfers if t.dst == r]) for r in range(4)]


@pytest.mark.parametrize("kind", CORRUPTIONS)
@pytest.mark.parametrize("local", [False, True], ids=["received", "local"])
def test_full_catches_corruption_that_keeps_the_sum_of_the_words(layouts4, kind, local):
    """A misplaced word keeps ``s1`` (the sum) and changes only ``s2`` (the positions): ``full``
    must flag a piece where either check word differs, received from a peer or copied locally."""
    src, dst = layouts4[SRC], layouts4[DST]
    plan = plan_transition(src, dst)
    src_bufs, dst_bufs = _exact_buffers(src, dst)
    rank = 2
    t = _received(plan, rank, local)[1]
    view = _dst_view(t, dst_bufs[rank])
    sent = _reference_checksum(_src_view(t, src_bufs[t.src]))
    CORRUPTIONS[kind](view)
    arrived = _reference_checksum(view)
    if kind != "one flipped bit":
        assert arrived[0] == sent[0] and arrived[1] != sent[1], "the corruption must keep the sum of the words"
    got = _verify_on_threads(src, dst, src_bufs, dst_bufs, "full")
    total = len(plan.transfers)
    expected = (f"VerifyError: verify=full: the move {src.name} -> {dst.name} delivered 1 corrupted piece(s) "
                f"of {total} checked: " + _report(t, sent, arrived))
    assert got == [expected] * 4


def test_every_corrupted_piece_counts_and_each_rank_names_at_most_eight(layouts4):
    """Ten corrupted pieces on one rank, one on another: all eleven counted, the first eight of
    the first rank's (in the order it checks them: local pieces, then per peer) and the other's
    named, the rest as 'and 2 more'."""
    src, dst = layouts4[SRC], layouts4[DST]
    plan = plan_transition(src, dst)
    src_bufs, dst_bufs = _exact_buffers(src, dst)
    mine = [t for t in plan.transfers if t.dst == 1 and t.src == 1][:4] + \
           [t for t in plan.transfers if t.dst == 1 and t.src == 0][:3] + \
           [t for t in plan.transfers if t.dst == 1 and t.src == 3][:3]
    other = [t for t in plan.transfers if t.dst == 3 and t.src == 2][0]
    reports = []
    for t, r in [(t, 1) for t in mine] + [(other, 3)]:
        sent = _reference_checksum(_src_view(t, src_bufs[t.src]))
        view = _dst_view(t, dst_bufs[r])
        _flip_bit(view)
        reports.append(_report(t, sent, _reference_checksum(view)))
    got = _verify_on_threads(src, dst, src_bufs, dst_bufs, "full")
    expected = (f"VerifyError: verify=full: the move {src.name} -> {dst.name} delivered 11 corrupted piece(s) "
                f"of {len(plan.transfers)} checked: " + "; ".join(reports[:8] + reports[10:]) + "; and 2 more")
    assert got == [expected] * 4


def test_one_piece_past_the_eight_named_is_said(layouts4):
    """Nine corrupted local copies on one rank: the first eight named, then 'and 1 more'."""
    src, dst = layouts4[SRC], layouts4[DST]
    plan = plan_transition(src, dst)
    src_bufs, dst_bufs = _exact_buffers(src, dst)
    local = [t for t in plan.transfers if t.dst == 0 and t.src == 0][:9]
    assert len(local) == 9
    reports = []
    for t in local:
        sent = _reference_checksum(_src_view(t, src_bufs[0]))
        _flip_bit(_dst_view(t, dst_bufs[0]))
        reports.append(_report(t, sent, _reference_checksum(_dst_view(t, dst_bufs[0]))))
    got = _verify_on_threads(src, dst, src_bufs, dst_bufs, "full")
    assert got == [f"VerifyError: verify=full: the move {src.name} -> {dst.name} delivered 9 corrupted piece(s) "
                   f"of {len(plan.transfers)} checked: " + "; ".join(reports[:8]) + "; and 1 more"] * 4


def _pairs(plan, r):
    """Rank ``r``'s received transfers per source rank (its own: the local copies), in plan order."""
    out = {}
    for t in plan.transfers:
        if t.dst == r:
            out.setdefault(t.src, []).append(t)
    return out


def test_sample_checks_the_drawn_pieces_of_every_pair_and_only_those(layouts4):
    """``sample`` at a quarter: each rank checks ceil(n / 4) of the n pieces of each pair (and of
    its local copies), the ones ``sampled`` draws; a corrupted piece that was drawn is caught,
    one that was not passes."""
    src, dst = layouts4[SRC], layouts4[DST]
    plan = plan_transition(src, dst)
    digest = plan_rank(src, dst, 0).digest
    seed = 11
    src_bufs, dst_bufs = _exact_buffers(src, dst)
    got = _verify_on_threads(src, dst, src_bufs, dst_bufs, "sample", 0.25, seed)
    assert got == [sum(-(-len(ts) // 4) for ts in _pairs(plan, r).values()) for r in range(4)]
    ts = _pairs(plan, 1)[2]  # what rank 2 sends rank 1
    drawn = set(_oracle_sample(len(ts), 0.25, digest, seed, 2, 1))
    for i, t in enumerate(ts):  # every piece not drawn corrupted: none of them is checked
        if i not in drawn:
            _flip_bit(_dst_view(t, dst_bufs[1]))
    assert _verify_on_threads(src, dst, src_bufs, dst_bufs, "sample", 0.25, seed) == got
    hit = ts[min(drawn)]
    sent = _reference_checksum(_src_view(hit, src_bufs[2]))
    _flip_bit(_dst_view(hit, dst_bufs[1]))
    arrived = _reference_checksum(_dst_view(hit, dst_bufs[1]))
    expected = (f"VerifyError: verify=sample: the move {src.name} -> {dst.name} delivered 1 corrupted piece(s) "
                f"of {sum(got)} checked: " + _report(hit, sent, arrived))
    assert _verify_on_threads(src, dst, src_bufs, dst_bufs, "sample", 0.25, seed) == [expected] * 4


def test_sample_checks_at_least_one_piece_of_every_pair(layouts4):
    """A fraction too small for any pair still checks one piece of each (and one local copy)."""
    src, dst = layouts4[SRC], layouts4[DST]
    plan = plan_transition(src, dst)
    src_bufs, dst_bufs = _exact_buffers(src, dst)
    got = _verify_on_threads(src, dst, src_bufs, dst_bufs, "sample", 1e-6, 4)
    assert got == [len(_pairs(plan, r)) for r in range(4)] == [4] * 4


@pytest.mark.parametrize("verify, fractions, seeds, shown", [
    ("full", [0.1] * 4, [5, 5, 6, 5], ["full, fraction 1.0, seed 5"] * 2 + ["full, fraction 1.0, seed 6"]
     + ["full, fraction 1.0, seed 5"]),
    ("sample", [0.25, 0.25, 0.25, 0.5], [7] * 4, ["sample, fraction 0.25, seed 7"] * 3
     + ["sample, fraction 0.5, seed 7"]),
])
def test_ranks_that_disagree_name_every_ranks_settings(layouts4, verify, fractions, seeds, shown):
    src, dst = layouts4["fsdp"], layouts4["tp2xpp2"]
    src_bufs, dst_bufs = _exact_buffers(src, dst)
    got = _verify_on_threads(src, dst, src_bufs, dst_bufs, verify, seeds=seeds, fractions=fractions)
    detail = "; ".join(f"rank {r}: verify={s}" for r, s in enumerate(shown))
    assert got == [f"VerifyError: verification of {src.name} -> {dst.name}: the ranks disagree on what to check "
                   f"({detail}); the bytes were moved but not checked"] * 4


def test_seeds_equal_modulo_2_62_check_the_same_pieces(layouts4):
    """The seed travels as an int64 and is compared modulo 2^62; the ranks that pass that
    comparison must also draw the same pieces (rank 3's seed is 2^62 above the others')."""
    src, dst = layouts4[SRC], layouts4[DST]
    plan = plan_transition(src, dst)
    src_bufs, dst_bufs = _exact_buffers(src, dst)
    got = _verify_on_threads(src, dst, src_bufs, dst_bufs, "sample", 0.25, [9, 9, 9, 9 + (1 << 62)])
    assert got == [sum(-(-len(ts) // 4) for ts in _pairs(plan, r).values()) for r in range(4)]


def test_the_source_checksum_is_of_the_wire_dtype():
    """A sender that casts (its buffer fp32, the destination's bf16) checksums what it sends: the
    bf16 bytes, not its own fp32 ones; the destination checksums its view as it is."""
    from rlhf_switch.routing.verify import destination_checksum, source_checksum
    from rlhf_switch.vps import Box, StateKey
    from rlhf_switch.vps.planner import Transfer

    g = torch.Generator().manual_seed(4)
    src = {"flat": torch.randn(7 + 6 * 10, generator=g)[7:]}
    t = Transfer(0, 1, StateKey("w", "param"), Box((2, 1), (5, 4)), "flat", 3, (10, 1), "out", 2, (1, 4), "bfloat16")
    view = torch.as_strided(src["flat"], (3, 3), (10, 1), src["flat"].storage_offset() + 3)
    assert [v & M64 for v in source_checksum(t, src).tolist()] == _reference_checksum(view.to(torch.bfloat16))
    dst = {"out": torch.randn(1 + 16, generator=g).to(torch.bfloat16)[1:]}
    view = torch.as_strided(dst["out"], (3, 3), (1, 4), dst["out"].storage_offset() + 2)
    assert [v & M64 for v in destination_checksum(t, dst).tolist()] == _reference_checksum(view)


def test_check_mode_refuses_unknown_modes_and_fractions_outside_0_1():
    from rlhf_switch.routing.verify import check_mode

    for mode in ("off", "sample", "full"):
        check_mode(mode, 1.0)
        check_mode(mode, 1e-6)
    with pytest.raises(ValueError, match=r"^verify must be one of \('off', 'sample', 'full'\), not 'always'$"):
        check_mode("always", 0.5)
    for bad in (0.0, -0.1, 1.0001):
        with pytest.raises(ValueError, match=rf"^verify_fraction must be in \(0, 1\], not {bad}$"):
            check_mode("sample", bad)


# ----------------------------------------------------------------------- sampling, by definition

def _splitmix64_finaliser(z: int) -> int:
    """SplitMix64's output function (Steele, Lea, Flood 2014; Vigna's splitmix64.c), from the paper's
    constants: state advanced by the golden gamma, then two xor-shift-multiplies and a xor-shift."""
    z = (z + 0x9E3779B97F4A7C15) % 2**64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
    return z ^ (z >> 31)


def _oracle_sample(n, fraction, digest, seed, src, dst):
    """The module docstring's rule: the ceil(fraction * n) positions whose hash of (plan digest,
    seed, source, destination, position) is smallest, ascending."""
    import hashlib
    import math

    k = min(n, math.ceil(fraction * n))
    base = int.from_bytes(hashlib.blake2b(f"{digest}|{seed}|{src}|{dst}".encode(), digest_size=8).digest(), "big")
    return sorted(sorted(range(n), key=lambda i: _splitmix64_finaliser(base ^ _splitmix64_finaliser(i)))[:k])


def test_the_sampling_hash_is_splitmix64():
    """The first outputs of SplitMix64 seeded with 0, as published with the reference code."""
    from rlhf_switch.routing.verify import _mix

    assert _mix(0) == 0xE220A8397B1DCDAF
    assert _mix(0x9E3779B97F4A7C15) == 0x6E789E6AA1B965F4
    assert _mix((1 << 64) - 1) == _splitmix64_finaliser((1 << 64) - 1)


@pytest.mark.parametrize("n, fraction, k", [(40, 0.1, 4), (3, 0.1, 1), (10, 0.25, 3), (7, 0.5, 4), (9, 1.0, 9),
                                            (1, 0.01, 1), (0, 0.5, 0)])
def test_sampled_draws_the_pieces_the_definition_names(n, fraction, k):
    for seed, src, dst in [(0, 0, 1), (12345, 3, 2), (7, 1, 1)]:
        got = sampled(n, fraction, "digest-a", seed, src, dst)
        assert len(got) == k
        assert got == _oracle_sample(n, fraction, "digest-a", seed, src, dst)
    draws = {tuple(sampled(40, 0.1, d, s, a, b)) for d, s, a, b in
             [("x", 0, 0, 1), ("y", 0, 0, 1), ("x", 1, 0, 1), ("x", 0, 1, 0), ("x", 0, 0, 2)]}
    assert len(draws) == 5  # digest, seed, source and destination each change the draw


def test_checked_draws_per_pair_in_the_plans_order(layouts4):
    """This rank's checked pieces: per peer it sends to, per peer it receives from, and its local
    copies, each drawn from that list by ``sampled`` with (this rank, peer) in sending order."""
    src, dst = layouts4[SRC], layouts4[DST]
    for rank in range(4):
        plan = plan_rank(src, dst, rank)
        sends, recvs, local = checked(plan, 0.25, 5)
        for peer in range(4):
            out = [t for t in plan.sends if t.dst == peer]
            inc = [t for t in plan.recvs if t.src == peer]
            if out:
                assert sends[peer] == [out[i] for i in _oracle_sample(len(out), 0.25, plan.digest, 5, rank, peer)]
            else:
                assert peer not in sends
            if inc:
                assert recvs[peer] == [inc[i] for i in _oracle_sample(len(inc), 0.25, plan.digest, 5, peer, rank)]
            else:
                assert peer not in recvs
        assert local == [plan.local[i] for i in _oracle_sample(len(plan.local), 0.25, plan.digest, 5, rank, rank)]
        assert checked(plan, 1.0, 5) == ({p: [t for t in plan.sends if t.dst == p] for p in sends},
                                         {p: [t for t in plan.recvs if t.src == p] for p in recvs}, list(plan.local))


# ------------------------------------------------------------------- the checksum, more cases

def test_checksum_of_foreign_memory_whose_storage_offset_is_not_a_multiple_of_8():
    """Bytes over memory torch did not allocate (``frombuffer``): a view whose address is 8-byte
    aligned while its storage offset is not still reads the right words (an int64 view of it is
    refused, so the checksum copies it first), as does one whose address is not aligned."""
    data = bytearray(range(256)) * 3
    base = torch.frombuffer(memoryview(data)[1:], dtype=torch.uint8)  # an address 1 past alignment
    assert base[7:].data_ptr() % 8 == 0, "the bytearray's buffer is expected 8-byte aligned"
    for view in (base[7:7 + 101], base[7:7 + 96], base[:77]):
        assert [v & M64 for v in checksum(view).tolist()] == _reference_checksum(view), view.storage_offset()


def test_checksum_of_an_aligned_address_at_a_storage_offset_that_9_divides():
    """Storage offset 63 (a multiple of 9, not of 8) at an 8-byte aligned address: torch refuses
    the int64 view of it, so the checksum must copy it by its offset modulo 8 alone."""
    data = bytearray(range(256)) * 3
    base = torch.frombuffer(memoryview(data)[1:], dtype=torch.uint8)
    view = base[63:63 + 88]
    assert view.data_ptr() % 8 == 0 and view.storage_offset() == 63
    assert [v & M64 for v in checksum(view).tolist()] == _reference_checksum(view)


def test_checksum_of_more_rows_than_the_weights_cache_starts_with():
    """More than 4·COLS rows of words (the size the weights cache starts at): the definition,
    computed with numpy's wrapping uint64 arithmetic."""
    import numpy as np

    from rlhf_switch.routing.verify import COLS

    n = (4 * COLS + 3) * COLS + 5
    g = torch.Generator().manual_seed(1)
    t = torch.randint(-(1 << 62), 1 << 62, (n,), generator=g, dtype=torch.int64)
    w = t.numpy().view(np.uint64)
    s1 = int(w.sum(dtype=np.uint64))
    s2 = int((w * np.arange(1, n + 1, dtype=np.uint64)).sum(dtype=np.uint64))
    assert [v & M64 for v in checksum(t).tolist()] == [s1, s2]
