"""Jobs that run on every rank of a ``LocalWorld`` (module level, so they pickle by reference)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from rlhf_switch.routing import move
from rlhf_switch.vps import Layout, StateKey
from rlhf_switch.vps.materialize import allocate, bits, coverage_masks, materialize, synthetic_tensor


def tensor_source(layout: Layout, seed: int):
    cache: dict[StateKey, torch.Tensor] = {}
    spec = layout.spec

    def tensor_of(key: StateKey) -> torch.Tensor:
        if key not in cache:
            dtype = None if key.field == "param" else "float32"
            cache[key] = synthetic_tensor(spec[key.tensor], key, seed, dtype)
        return cache[key]
    return tensor_of


def garbage_like(buffers: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for n, t in buffers.items():
        raw = torch.randint(0, 256, (t.numel() * t.element_size(),), generator=g, dtype=torch.uint8)
        out[n] = raw.view(t.dtype).clone()
    return out


def bare_gloo_group():
    """A gloo group formed the way a trainer and an engine's workers form one: its own TCPStore
    (rank 0 binds port 0 and shares the real port), not registered with torch.distributed."""
    from datetime import timedelta

    from rlhf_switch.routing.comm import gloo_group

    rank, world = dist.get_rank(), dist.get_world_size()
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False) if rank == 0 else None
    port = [store.port if store else None]
    dist.broadcast_object_list(port, src=0)
    if rank:
        store = dist.TCPStore("127.0.0.1", port[0], world, is_master=False)
    return gloo_group(store, rank, world, timedelta(seconds=60)), store


def move_and_check(src: Layout, dst: Layout, seed: int = 0, budget_bytes: int = 1 << 20,
                   ranks_per_node: int | None = None, bare_group: bool = False, shared: bool | tuple = False,
                   hooks=None, rank: int | None = None, group=None) -> dict:
    """Fill ``src`` from seeded global tensors, move into garbage-filled ``dst`` buffers, and
    compare bit for bit with a direct construction of ``dst``. Padding must stay untouched,
    and the source must be unchanged. ``shared``: the source buffers in shared memory
    (``same_host.share``), so same-host peers read them through mappings — on every rank, or on
    the ranks a tuple names. ``hooks``: the move's (``executor.MoveHooks``). ``rank`` and
    ``group``: where the rank is not a process of the default world (``thread_world``)."""
    rank = dist.get_rank() if rank is None else rank
    tensor_of = tensor_source(src, seed)
    src_bufs = materialize(src, rank, tensor_of)
    if shared is True or (shared and rank in shared):
        from rlhf_switch.routing import same_host
        same_host.share(src_bufs.values())
    src_copy = {n: t.clone() for n, t in src_bufs.items()}
    dst_bufs = garbage_like(allocate(dst, rank, fill=None), seed + 1000 + rank)
    before = {n: t.clone() for n, t in dst_bufs.items()}
    group, _store = bare_gloo_group() if bare_group else (group, None)
    move_and_check.last_group = group  # a test looks at the group's same-host state afterwards
    report = move(src, dst, src_bufs, dst_bufs, budget_bytes=budget_bytes, ranks_per_node=ranks_per_node,
                  group=group, hooks=hooks)
    expected = materialize(dst, rank, tensor_of)
    masks = coverage_masks(dst, rank)
    wrong = []
    for n, t in dst_bufs.items():
        m = masks[n]
        if not torch.equal(bits(t)[m], bits(expected[n])[m]):
            wrong.append(f"{n}: {(bits(t)[m] != bits(expected[n])[m]).sum().item()} elements differ")
        if not torch.equal(bits(t)[~m], bits(before[n])[~m]):
            wrong.append(f"{n}: padding was written")
    for n, t in src_bufs.items():
        if not torch.equal(bits(t), bits(src_copy[n])):
            wrong.append(f"source {n} changed")
    return {"wrong": wrong, "report": report}


def rank_of_world() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def _attempt(src: Layout, dst: Layout, src_bufs, dst_bufs, **kw) -> dict:
    before = {n: t.clone() for n, t in dst_bufs.items()}
    try:
        move(src, dst, src_bufs, dst_bufs, **kw)
        error = None
    except Exception as e:  # noqa: BLE001 - the test inspects it
        error = f"{type(e).__name__}: {e}"
    untouched = all(torch.equal(bits(before[n]), bits(t)) for n, t in dst_bufs.items())
    return {"error": error, "untouched": untouched}


def move_with_bad_buffer_on(bad_rank: int, src: Layout, dst: Layout) -> dict:
    rank = dist.get_rank()
    src_bufs = materialize(src, rank, tensor_source(src, 0))
    dst_bufs = garbage_like(allocate(dst, rank, fill=None), rank)
    if rank == bad_rank:
        dst_bufs.pop("param/lm_head.weight")
    return _attempt(src, dst, src_bufs, dst_bufs)


def move_into_source_memory_on(bad_rank: int, src: Layout, dst: Layout) -> dict:
    """On ``bad_rank`` one destination buffer is a view into a source buffer's memory."""
    rank = dist.get_rank()
    src_bufs = materialize(src, rank, tensor_source(src, 0))
    dst_bufs = garbage_like(allocate(dst, rank, fill=None), rank)
    if rank == bad_rank:
        name, want = min(((n, t) for n, t in dst_bufs.items() if n.startswith("param/")), key=lambda x: x[1].numel())
        host = max((t for t in src_bufs.values() if t.dtype == want.dtype), key=lambda t: t.numel())
        assert host.numel() >= want.numel() + 3, "the test needs a source buffer larger than the destination one"
        dst_bufs[name] = host.view(-1)[3:3 + want.numel()]
    return _attempt(src, dst, src_bufs, dst_bufs)


def move_with_different_dst_on(odd_rank: int, src: Layout, dst: Layout, other: Layout) -> dict:
    rank = dist.get_rank()
    mine = other if rank == odd_rank else dst
    src_bufs = materialize(src, rank, tensor_source(src, 0))
    dst_bufs = garbage_like(allocate(mine, rank, fill=None), rank)
    return _attempt(src, mine, src_bufs, dst_bufs)


def attempt_move(src: Layout, dst: Layout) -> dict:
    rank = dist.get_rank()
    src_bufs = materialize(src, rank, tensor_source(src, 0))
    dst_bufs = garbage_like(allocate(dst, rank, fill=None), rank)
    return _attempt(src, dst, src_bufs, dst_bufs)


def move_twice_with_merge(merge_bytes: int, src: Layout, dst: Layout, **kw) -> dict:
    """``move_and_check`` twice with ``schedule.MERGE_BYTES`` set on this rank (0: every
    contiguous piece travels zero-copy), the second move reusing the cached schedule."""
    from rlhf_switch.routing import executor, schedule
    old = schedule.MERGE_BYTES
    schedule.MERGE_BYTES = merge_bytes
    executor._SCHEDULES.clear()
    try:
        first = move_and_check(src, dst, **kw)
        key = next(reversed(executor._SCHEDULES))
        cached = executor._SCHEDULES[key]
        second = move_and_check(src, dst, seed=kw.get("seed", 0) + 7,
                                **{k: v for k, v in kw.items() if k != "seed"})
        return {"wrong": first["wrong"] + second["wrong"], "reports": [first["report"], second["report"]],
                "reused": executor._SCHEDULES[key] is cached and len(executor._SCHEDULES) == 1}
    finally:
        schedule.MERGE_BYTES = old
        executor._SCHEDULES.clear()


def move_with_tampered_pair_digest_on(odd_rank: int, src: Layout, dst: Layout) -> dict:
    """On ``odd_rank`` the digest of its transfers with one peer is changed (the plan digest, and
    so the whole-plan agreement, stays the same): every rank must refuse."""
    import dataclasses

    from rlhf_switch.routing import executor

    rank = dist.get_rank()
    real = executor.prepare

    def tampered(*args, **kw):
        schedule = real(*args, **kw)
        plan = schedule.plan
        peer = min(plan.pair_digests)
        digests = {**plan.pair_digests, peer: plan.pair_digests[peer] ^ 1}
        return dataclasses.replace(schedule, plan=dataclasses.replace(plan, pair_digests=digests))

    if rank == odd_rank:
        executor.prepare = tampered
    try:
        return attempt_move(src, dst)
    finally:
        executor.prepare = real


def packed(buffers: dict[str, torch.Tensor], seed: int, lead: int = 5, gap: int = 3):
    """``buffers`` copied into views of one flat tensor per dtype, as an engine hands out its
    parameters: every view starts at a non-zero storage offset (``lead``, then ``gap`` garbage
    elements between neighbours). Returns (views, {dtype: (flat, {name: start})})."""
    g = torch.Generator().manual_seed(seed)
    by_dtype: dict = {}
    for n, t in buffers.items():
        by_dtype.setdefault(t.dtype, []).append(n)
    views, flats = {}, {}
    for dtype, names in by_dtype.items():
        total = lead + sum(buffers[n].numel() + gap for n in names)
        size = torch.tensor([], dtype=dtype).element_size()
        raw = torch.randint(0, 256, (total * size,), generator=g, dtype=torch.uint8)
        flat = raw.view(dtype)
        starts, at = {}, lead
        for n in names:
            k = buffers[n].numel()
            flat[at:at + k].copy_(buffers[n].view(-1))
            views[n] = flat[at:at + k]
            starts[n] = at
            at += k + gap
        flats[dtype] = (flat, starts)
    return views, flats


def move_engine_like(src: Layout, dst: Layout, seed: int = 0, budget_bytes: int = 1 << 20,
                     merge_bytes: int | None = None) -> dict:
    """``move_and_check`` with both sides' buffers as views into one flat tensor per dtype at
    non-zero storage offsets; the garbage between the views must survive, the source must not
    change, and every covered element must equal a direct construction of ``dst``."""
    from rlhf_switch.routing import executor, prepare, schedule

    rank = dist.get_rank()
    old = schedule.MERGE_BYTES
    if merge_bytes is not None:
        schedule.MERGE_BYTES = merge_bytes
    executor._SCHEDULES.clear()
    try:
        tensor_of = tensor_source(src, seed)
        src_bufs, src_flats = packed(materialize(src, rank, tensor_of), seed + 1)
        src_before = {d: f.clone() for d, (f, _) in src_flats.items()}
        dst_bufs, dst_flats = packed(garbage_like(allocate(dst, rank, fill=None), seed + 1000 + rank), seed + 2)
        dst_before = {d: f.clone() for d, (f, _) in dst_flats.items()}
        report = move(src, dst, src_bufs, dst_bufs, budget_bytes=budget_bytes)
        sched = prepare(src, dst, rank, src_bufs, dst_bufs, budget_bytes)
    finally:
        schedule.MERGE_BYTES = old
        executor._SCHEDULES.clear()
    expected = materialize(dst, rank, tensor_of)
    masks = coverage_masks(dst, rank)
    wrong = []
    for dtype, (flat, starts) in dst_flats.items():
        covered = torch.zeros(flat.numel(), dtype=torch.bool)
        for n, at in starts.items():
            m = masks[n]
            covered[at:at + m.numel()] = m
            if not torch.equal(bits(dst_bufs[n])[m], bits(expected[n])[m]):
                wrong.append(f"{n}: {(bits(dst_bufs[n])[m] != bits(expected[n])[m]).sum().item()} elements differ")
        if not torch.equal(bits(flat)[~covered], bits(dst_before[dtype])[~covered]):
            wrong.append(f"{dtype}: bytes outside the destination views were written")
    for dtype, (flat, _) in src_flats.items():
        if not torch.equal(bits(flat), bits(src_before[dtype])):
            wrong.append(f"source {dtype} storage changed")
    # this rank's side of each message: a send is packed or not, a receive unpacked or not
    sides = [s.stage_send for ex in sched.exchanges for s, _ in ex.steps if s is not None]
    sides += [r.stage_recv for ex in sched.exchanges for _, r in ex.steps if r is not None]
    return {"wrong": wrong, "report": report, "direct": sides.count(False), "staged": sides.count(True),
            "local": len(sched.local_runs)}


def move_recording_posts(src: Layout, dst: Layout, budget_bytes: int = 1 << 20, seed: int = 0) -> dict:
    """``move_and_check``, recording every message this rank posts, in posting order, as
    (peer, send?, bytes) (``MoveHooks.post``)."""
    from rlhf_switch.routing import MoveHooks

    posts: list[tuple[int, bool, int]] = []
    hooks = MoveHooks(post=lambda peer, send, nbytes: posts.append((peer, send, nbytes)))
    out = move_and_check(src, dst, seed=seed, budget_bytes=budget_bytes, hooks=hooks)
    return {**out, "posts": posts}


def move_watching_gc(src: Layout, dst: Layout, budget_bytes: int = 1 << 20) -> dict:
    """``move_and_check`` with the cyclic GC on, then with it off beforehand: whether it was on at
    each message this rank posted (``MoveHooks.post``), and after each move."""
    import gc

    from rlhf_switch.routing import MoveHooks

    out = {}
    for before in (True, False):
        seen: list[bool] = []
        hooks = MoveHooks(post=lambda peer, send, nbytes: seen.append(gc.isenabled()))
        (gc.enable if before else gc.disable)()
        try:
            res = move_and_check(src, dst, budget_bytes=budget_bytes, hooks=hooks)
        finally:
            after = gc.isenabled()
            gc.enable()
        out[before] = {"wrong": res["wrong"], "during": seen, "after": after}
    return out


def swap_two_sends(schedule):
    """The schedule's posting program with the first two sends of one batch swapped: a rank
    that would post two messages to a peer in the other order than the peer receives them."""
    batches = list(schedule.batches)
    for i, b in enumerate(batches):
        sends = [j for j, m in enumerate(b.messages) if m.send]
        if len(sends) >= 2:
            msgs = list(b.messages)
            j, k = sends[:2]
            msgs[j], msgs[k] = msgs[k], msgs[j]
            batches[i] = b._replace(messages=tuple(msgs))
            return tuple(batches)
    raise AssertionError("no batch with two sends to swap")


def move_misordered_on(odd_rank: int, src: Layout, dst: Layout, budget_bytes: int) -> dict:
    """On ``odd_rank`` the posting program has two sends swapped (``swap_two_sends`` through
    ``MoveHooks.posting_order``): every rank must refuse before a byte moves."""
    from rlhf_switch.routing import MoveHooks

    rank = dist.get_rank()
    hooks = MoveHooks(posting_order=swap_two_sends) if rank == odd_rank else None
    src_bufs = materialize(src, rank, tensor_source(src, 0))
    dst_bufs = garbage_like(allocate(dst, rank, fill=None), 7 + rank)
    return _attempt(src, dst, src_bufs, dst_bufs, budget_bytes=budget_bytes, hooks=hooks)


def move_with_budget_on(odd_rank: int, odd_budget: int, src: Layout, dst: Layout, budget_bytes: int) -> dict:
    """``odd_rank`` moves under another staging budget than the others (so it cuts other
    messages): every rank must refuse before a byte moves."""
    rank = dist.get_rank()
    src_bufs = materialize(src, rank, tensor_source(src, 0))
    dst_bufs = garbage_like(allocate(dst, rank, fill=None), 7 + rank)
    return _attempt(src, dst, src_bufs, dst_bufs, budget_bytes=odd_budget if rank == odd_rank else budget_bytes)


def move_at_storage_offsets(src: Layout, dst: Layout, seed: int = 0, budget_bytes: int = 1 << 20) -> dict:
    """``move_and_check`` with every buffer a view at a storage offset inside a larger tensor
    (as an engine's parameters sit inside its flat buffers): the bytes before and after each
    destination view stay untouched, and every local copy goes view to view (its bytes are
    counted in ``bytes_local``, never through staging)."""
    rank = dist.get_rank()
    tensor_of = tensor_source(src, seed)

    def embedded(buffers, fill_seed):
        out, hosts = {}, {}
        for i, (n, t) in enumerate(sorted(buffers.items())):
            pad = 3 + i % 5  # elements before the view; 2 after
            g = torch.Generator().manual_seed(fill_seed + i)
            raw = torch.randint(0, 256, ((t.numel() + pad + 2) * t.element_size(),), generator=g, dtype=torch.uint8)
            host = raw.view(t.dtype)
            host[pad:pad + t.numel()] = t.view(-1)
            hosts[n] = (host, pad, host.clone())
            out[n] = host[pad:pad + t.numel()].view(t.shape)
        return out, hosts

    src_bufs, _ = embedded(materialize(src, rank, tensor_of), seed + 50)
    src_copy = {n: t.clone() for n, t in src_bufs.items()}
    dst_bufs, hosts = embedded(garbage_like(allocate(dst, rank, fill=None), seed + 1000 + rank), seed + 99)
    before = {n: t.clone() for n, t in dst_bufs.items()}
    report = move(src, dst, src_bufs, dst_bufs, budget_bytes=budget_bytes)
    expected = materialize(dst, rank, tensor_of)
    masks = coverage_masks(dst, rank)
    wrong = []
    for n, t in dst_bufs.items():
        m = masks[n]
        assert t.storage_offset() > 0
        if not torch.equal(bits(t)[m], bits(expected[n])[m]):
            wrong.append(f"{n}: {(bits(t)[m] != bits(expected[n])[m]).sum().item()} elements differ")
        if not torch.equal(bits(t)[~m], bits(before[n])[~m]):
            wrong.append(f"{n}: padding was written")
        host, pad, host_before = hosts[n]
        outside = torch.ones(host.numel(), dtype=torch.bool)
        outside[pad:pad + t.numel()] = False
        if not torch.equal(bits(host)[outside], bits(host_before)[outside]):
            wrong.append(f"{n}: bytes outside the view were written")
    for n, t in src_bufs.items():
        if not torch.equal(bits(t), bits(src_copy[n])):
            wrong.append(f"source {n} changed")
    return {"wrong": wrong, "report": report}


def mappings_held() -> list[int]:
    """Per peer this rank reads from: how many of its storages this rank keeps mapped."""
    from rlhf_switch.routing import same_host
    states = [st for _, st in same_host._GROUPS.values() if st is not None]
    return sorted(r.maps.held() for st in states for r in st._readers.values())


def channel_moves(src: Layout, dst: Layout, moves: int, share_sources: bool) -> dict:
    """``moves`` moves over one weight channel from the same source buffers, each into garbage
    and checked bit for bit; per move its receives copied through mappings, and the channel's stats."""
    from rlhf_switch.engines.channel import ChannelEnd
    rank = dist.get_rank()
    tensor_of = tensor_source(src, 0)
    src_bufs = materialize(src, rank, tensor_of)
    expected, masks = materialize(dst, rank, tensor_of), coverage_masks(dst, rank)
    channel = ChannelEnd.over(share_sources=share_sources)
    channel.set_layouts(src, dst)
    mapped, wrong = [], []
    try:
        for i in range(moves):
            dst_bufs = garbage_like(allocate(dst, rank, fill=None), 1000 + i + rank)
            mapped.append(channel.move(src_bufs, dst_bufs).mapped_messages)
            wrong += [f"move {i}: {n}" for n, t in dst_bufs.items()
                      if not torch.equal(bits(t)[masks[n]], bits(expected[n])[masks[n]])]
        return {"mapped": mapped, "wrong": wrong, "stats": channel.stats(),
                "shared": all(t.untyped_storage().is_shared() for t in src_bufs.values())}
    finally:
        channel.close()


def board_agreements() -> int | None:
    """How many agreements the default group has written on its same-host board (None: it has none)."""
    from torch.distributed.distributed_c10d import _get_default_group

    from rlhf_switch.routing import same_host
    hit = same_host._GROUPS.get(id(_get_default_group()))
    board = hit[1].board if hit is not None and hit[1] is not None else None
    return None if board is None else board.seq


def move_on_a_new_group_with_the_board_off_on(odd_rank: int, src: Layout, dst: Layout) -> dict:
    """``move_and_check`` over a fresh bare group, with ``RLHF_SWITCH_SAME_HOST_BOARD=0`` on
    ``odd_rank`` only (while the group is probed); and whether that group got a board here."""
    import os

    from rlhf_switch.routing import same_host
    was = os.environ.get(same_host.BOARD_ENV)
    if dist.get_rank() == odd_rank:
        os.environ[same_host.BOARD_ENV] = "0"
    try:
        res = move_and_check(src, dst, bare_group=True)
    finally:
        if was is None:
            os.environ.pop(same_host.BOARD_ENV, None)
        else:
            os.environ[same_host.BOARD_ENV] = was
    state = same_host._GROUPS[id(move_and_check.last_group)][1]
    return {**res, "board": state is not None and state.board is not None}
