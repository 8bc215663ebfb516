"""The field's methods the switch bench (``bench/switch.py``) measures the VPS move against, on
one rank of its gloo world: the full gather (verl / TRL / OpenRLHF), torch.distributed.checkpoint
save + load, and a raw point-to-point exchange of the plan's bytes (the transport's limit).

Each method is ``*_prepare(S)`` (untimed: the metadata a framework has anyway), ``*_run(ctx)``
(timed) and, for DCP, ``dcp_cleanup(ctx)``. ``S`` is the rank's state: ``spec``, ``src``,
``dst`` (layouts) and ``src_bufs`` / ``dst_bufs`` (live buffers). What each method does, and why
it is a faithful version of what the field runs, is in ``bench/switch.py``'s docstring.
"""
from __future__ import annotations

import math
import os
import shutil
import time

import torch
import torch.distributed as dist

from rlhf_switch.routing import pair_round, same_host
from rlhf_switch.routing.comm import P2P, as_comm
from rlhf_switch.vps import plan_rank
from rlhf_switch.vps.materialize import torch_dtype
from rlhf_switch.vps.space import row_major_strides


def view(buf: torch.Tensor, offset: int, shape, strides) -> torch.Tensor:
    return torch.as_strided(buf, tuple(shape), tuple(strides), buf.storage_offset() + offset)


# --- method 2: full gather -------------------------------------------------------------------------

def full_gather_prepare(S: dict) -> dict:
    """Per (tensor, field) the dst wants, in model order (identical on every rank): what this rank
    contributes, how the gathered buffer maps back to the tensor, and which boxes it cuts out.
    This is metadata a framework has anyway, so it is built outside the timed region."""
    rank, world = dist.get_rank(), dist.get_world_size()
    spec, src, dst = S["spec"], S["src"], S["dst"]
    src_bufs, dst_bufs = S["src_bufs"], S["dst_bufs"]
    order = {t.name: i for i, t in enumerate(spec.tensors)}
    keys = sorted(dst.all_keys(), key=lambda k: (order[k.tensor], k.field))
    dst_frags: dict = {}
    for f in dst.fragments(rank):
        dst_frags.setdefault(f.key, []).append(f)
    entries = []
    for key in keys:
        t = spec[key.tensor]
        regions = src.regions(key)
        mine_any = [(reg, f) for reg in regions for h, f in reg.holders if h == rank]
        dt = torch_dtype(src.buffers(rank)[mine_any[0][1].buffer].dtype) if mine_any else None
        e = {"key": key, "shape": t.shape, "numel": t.numel, "cuts": []}
        for f in dst_frags.get(key, ()):
            e["cuts"].append((view(dst_bufs[f.buffer], f.offset, f.box.shape, f.strides), f.box.slices))
        everyone_whole = all(len(reg.holders) == world and {h for h, _ in reg.holders} == set(range(world))
                             for reg in regions)
        if everyone_whole:  # e.g. ZeRO-1/2 params: already whole on every rank, nothing to gather
            views = [(reg.box, view(src_bufs[f.buffer], f.view(reg.box)[0], reg.box.shape, f.strides))
                     for reg, f in mine_any]
            e.update(mode="local", views=views, dtype=views[0][1].dtype)
            entries.append(e)
            continue
        # owner of each disjoint region = its lowest-rank holder (holders come sorted by rank)
        owned = {r: [] for r in range(world)}
        for reg in regions:
            owned[reg.holders[0][0]].append(reg)
        counts = {r: sum(reg.box.numel for reg in owned[r]) for r in range(world)}
        maxc = max(counts.values())
        my_views = []
        for reg in owned[rank]:
            f = next(f for h, f in reg.holders if h == rank)
            my_views.append((src_bufs[f.buffer], f.view(reg.box)[0], reg.box.shape, f.strides))
        # send straight from the source buffer when this rank's contribution is one contiguous
        # run there and the buffer has room for the padded length (FSDP2 / ZeRO-3 shard buffers)
        direct = None
        if my_views and all(v[0] is my_views[0][0] for v in my_views):
            buf = my_views[0][0]
            start, pos, ok = my_views[0][1], my_views[0][1], True
            for b, off, shape, strides in my_views:
                n = math.prod(shape)
                if off != pos or not _row_major(shape, strides):
                    ok = False
                    break
                pos += n
            if ok and start + maxc <= buf.numel():
                direct = buf[start:start + maxc]
        my_views = [view(b, off, shape, strides) for b, off, shape, strides in my_views]
        # the gathered buffer is the tensor itself when rank r owns exactly flat [r·maxc, (r+1)·maxc)
        flat_ok = True
        pieces = []
        for r in range(world):
            pos = 0
            expect = r * maxc
            for reg in owned[r]:
                fr = _flat_range(reg.box, t.shape)
                if fr is None or fr[0] != expect:
                    flat_ok = False
                if fr is not None:
                    expect = fr[1]
                pieces.append((r * maxc + pos, reg.box))
                pos += reg.box.numel
            if expect != min((r + 1) * maxc, t.numel) and counts[r]:
                flat_ok = False
            if not counts[r] and r * maxc < t.numel:
                flat_ok = False
        if dt is None:  # this rank holds nothing of the key: use the dtype another rank declares
            holder = regions[0].holders[0]
            dt = torch_dtype(src.buffers(holder[0])[holder[1].buffer].dtype)
        e.update(mode="gather", maxc=maxc, my_views=my_views, direct=direct, flat=flat_ok,
                 pieces=pieces, dtype=dt, received=(world - 1) * maxc * torch.empty((), dtype=dt).element_size())
        entries.append(e)
    return {"entries": entries}


def _row_major(shape, strides) -> bool:
    return all(st == rs for n, st, rs in zip(shape, strides, row_major_strides(shape)) if n > 1)


def _flat_range(box, shape):
    """(start, stop) of ``box`` in the row-major flattening of ``shape``, if it is one run."""
    dims = [d for d in range(len(shape)) if box.hi[d] - box.lo[d] != shape[d]]
    if dims and any(box.hi[d] - box.lo[d] != 1 for d in dims[1:]):
        return None
    strides = row_major_strides(shape)
    start = sum(lo * s for lo, s in zip(box.lo, strides))
    return start, start + box.numel


# torch 2.13 deprecates ``all_gather_into_tensor`` (a FutureWarning per call) as an alias of
# ``all_gather_single``: the same collective, called by its new name where it exists.
_all_gather_into_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def full_gather_run(ctx: dict) -> dict:
    world = dist.get_world_size()
    peak = 0
    received = 0
    for e in ctx["entries"]:
        if e["mode"] == "local":
            if len(e["views"]) == 1:
                full = e["views"][0][1]
                staged = 0
            else:
                full = torch.empty(e["shape"], dtype=e["dtype"])
                staged = full.numel() * full.element_size()
                for box, v in e["views"]:
                    full[box.slices].copy_(v)
        else:
            maxc, dt = e["maxc"], e["dtype"]
            isz = torch.empty((), dtype=dt).element_size()
            staged = 0
            if e["direct"] is not None:
                inp = e["direct"]
            else:
                inp = torch.empty(maxc, dtype=dt)
                staged += maxc * isz
                pos = 0
                for v in e["my_views"]:
                    n = v.numel()
                    inp[pos:pos + n].view(v.shape).copy_(v)
                    pos += n
            out = torch.empty(world * maxc, dtype=dt)
            staged += world * maxc * isz
            _all_gather_into_tensor(out, inp)
            received += e["received"]
            if e["flat"]:
                full = out[:e["numel"]].view(e["shape"])
            else:
                full = torch.empty(e["shape"], dtype=dt)
                staged += full.numel() * isz
                for at, box in e["pieces"]:
                    full[box.slices].copy_(out[at:at + box.numel].view(box.shape))
            del inp, out
        for v, sl in e["cuts"]:
            v.copy_(full[sl])
        del full
        peak = max(peak, staged)
    return {"peak_staging_bytes": peak, "bytes_received": received}


# --- method 3: DCP ----------------------------------------------------------------------------------

class _BoxState:
    """One state key's boxes on this rank, for ``torch.distributed.checkpoint``.

    Our layouts are arbitrary boxes of a global tensor (ZeRO flat ranges are up to 2·ndim-1 boxes
    per tensor; vLLM replicates KV heads and whole engines), which DTensor placements cannot
    express. ShardedTensor (deprecated in torch 2.13: "Please use DTensor instead") can describe
    disjoint boxes but validates at construction, across ranks, that no two shards overlap
    (``validate_non_overlapping_shards_metadata``) — so it cannot describe a destination in which
    two ranks want the same box (vLLM replicas, case a; KV-head replication) — and wants one
    contiguous tensor per shard.
    DCP's own extension protocol (what DTensor itself implements: ``__create_write_items__`` /
    ``__create_chunk_list__`` / ``__get_tensor_shard__``) expresses any set of boxes: save emits
    one WriteItem per disjoint region this rank holds (a region held by several ranks — ZeRO-1
    params — is emitted by each of them and DCP's own ``dedup_save_plans`` keeps one copy,
    balanced over ranks, as it does for replicated plain tensors), and load asks for exactly the
    rank's destination boxes. ``__get_tensor_shard__`` returns *views of the live buffers*, so the
    save reads the source buffers (DCP's writer clones each view before ``torch.save``) and the
    load's ``target.copy_(...)`` lands straight in the destination buffers: there is no separate
    copy into the destination afterwards. Two planner overrides are needed because
    ``find_state_dict_object`` only accepts ``torch.Tensor`` values and ``_init_state_dict`` turns
    unknown objects into ``None``; neither changes what is read or written.
    """

    def __init__(self, shape, views: dict):
        self.shape = torch.Size(shape)
        self.views = views  # tuple(box.lo) -> box-shaped view of a live buffer

    def size(self) -> torch.Size:
        return self.shape

    def __create_write_items__(self, fqn, obj):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
        items = []
        for lo, v in self.views.items():
            off = torch.Size(lo)
            items.append(WriteItem(index=MetadataIndex(fqn, off), type=WriteItemType.SHARD,
                                   tensor_data=TensorWriteData(
                                       chunk=ChunkStorageMetadata(offsets=off, sizes=v.size()),
                                       properties=TensorProperties.create_from_tensor(v), size=self.shape)))
        return items

    def __create_chunk_list__(self):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        return [ChunkStorageMetadata(offsets=torch.Size(lo), sizes=v.size()) for lo, v in self.views.items()]

    def __get_tensor_shard__(self, index):
        return self.views[tuple(index.offset)]


def _planners():
    from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner

    class SavePlanner(DefaultSavePlanner):
        def lookup_object(self, index):
            obj = self.state_dict[index.fqn]
            return obj.__get_tensor_shard__(index) if isinstance(obj, _BoxState) else super().lookup_object(index)

    class LoadPlanner(DefaultLoadPlanner):
        def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
            # the state dict is flat already; skip _init_state_dict (meta-tensor materialisation)
            self.original_state_dict = state_dict
            self.state_dict = state_dict
            self.mappings = {}
            self.metadata = metadata
            self.is_coordinator = is_coordinator

        def lookup_tensor(self, index):
            obj = self.state_dict[index.fqn]
            return obj.__get_tensor_shard__(index) if isinstance(obj, _BoxState) else super().lookup_tensor(index)

    return SavePlanner, LoadPlanner


def _fqn(key) -> str:
    return f"{key.tensor}.{key.field}"


def dcp_prepare(S: dict, root: str) -> dict:
    rank = dist.get_rank()
    spec, src, dst = S["spec"], S["src"], S["dst"]
    save_sd, load_sd = {}, {}
    for key in src.all_keys():
        views = {}
        for reg in src.regions(key):
            for h, f in reg.holders:
                if h == rank:
                    views[tuple(reg.box.lo)] = view(S["src_bufs"][f.buffer], f.view(reg.box)[0],
                                                     reg.box.shape, f.strides)
        if views:
            save_sd[_fqn(key)] = _BoxState(spec[key.tensor].shape, views)
    per_key: dict = {}
    for f in dst.fragments(rank):
        per_key.setdefault(f.key, {})[tuple(f.box.lo)] = view(S["dst_bufs"][f.buffer], f.offset,
                                                               f.box.shape, f.strides)
    for key, views in per_key.items():
        load_sd[_fqn(key)] = _BoxState(spec[key.tensor].shape, views)
    sp, lp = _planners()
    return {"root": root, "save_sd": save_sd, "load_sd": load_sd, "SavePlanner": sp, "LoadPlanner": lp,
            "n": 0}


def dcp_run(ctx: dict) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    path = os.path.join(ctx["root"], f"ckpt{ctx['n']}")
    ctx["n"] += 1
    ctx["last"] = path
    t0 = time.perf_counter()
    dcp.save(ctx["save_sd"], storage_writer=FileSystemWriter(path), planner=ctx["SavePlanner"]())
    t1 = time.perf_counter()
    dcp.load(ctx["load_sd"], storage_reader=FileSystemReader(path), planner=ctx["LoadPlanner"]())
    t2 = time.perf_counter()
    return {"save_s": t1 - t0, "load_s": t2 - t1, "copy_s": 0.0}


def dcp_cleanup(ctx: dict) -> dict:
    dist.barrier()
    size = 0
    if dist.get_rank() == 0 and ctx.get("last") and os.path.isdir(ctx["last"]):
        for dp, _, fs in os.walk(ctx["last"]):
            size += sum(os.path.getsize(os.path.join(dp, f)) for f in fs)
        shutil.rmtree(ctx["last"], ignore_errors=True)
    dist.barrier()
    return {"checkpoint_bytes": size}


# --- method 4: raw point-to-point at the plan's byte counts ----------------------------------------

def raw_prepare(S: dict) -> dict:
    """Per peer the byte counts of this rank's VPS plan. One send tensor (the largest message;
    each peer gets a prefix of it — a rank sends to one peer at a time) and one contiguous receive
    slice per peer, carved from the destination buffers' bytes where they fit (they are reset
    before every other method), so the limit costs little extra memory even at 300M + Adam."""
    rank, world = dist.get_rank(), dist.get_world_size()
    plan = plan_rank(S["src"], S["dst"], rank)
    send, recv = {}, {}
    for t in plan.sends:
        send[t.dst] = send.get(t.dst, 0) + t.nbytes
    for t in plan.recvs:
        recv[t.src] = recv.get(t.src, 0) + t.nbytes
    peers = sorted(set(send) | set(recv), key=lambda p: (pair_round(rank, p, world), p))
    sbuf = torch.full((max(send.values(), default=0),), _pattern(rank), dtype=torch.uint8)
    if S.get("shared"):  # in shared memory like the VPS's sources: the same single mapped copy
        same_host.share([sbuf])
    sbufs = {p: sbuf[:n] for p, n in send.items()}
    spaces = [[t.view(-1).view(torch.uint8), 0] for t in S["dst_bufs"].values()]
    rbufs, alloc = {}, sbuf.numel()
    for p in sorted(recv):
        n = recv[p]
        for sp in spaces:
            if sp[0].numel() - sp[1] >= n:
                rbufs[p] = sp[0][sp[1]:sp[1] + n]
                sp[1] += n
                break
        else:
            rbufs[p] = torch.empty(n, dtype=torch.uint8)
            alloc += n
    for b in rbufs.values():
        b.zero_()
    # the local part of the switch at its limit: plan.bytes_local bytes copied as a few big
    # contiguous blocks, source buffers -> the destination bytes the receives did not take
    # (received and locally copied elements are disjoint parts of the destination)
    local, need = [], plan.bytes_local
    srcs = [t.view(-1).view(torch.uint8) for t in S["src_bufs"].values()]
    si, so = 0, 0
    for sp in spaces:
        while need and sp[1] < sp[0].numel() and si < len(srcs):
            n = min(need, sp[0].numel() - sp[1], srcs[si].numel() - so)
            local.append((sp[0][sp[1]:sp[1] + n], srcs[si][so:so + n]))
            sp[1] += n
            so += n
            need -= n
            if so == srcs[si].numel():
                si, so = si + 1, 0
    # the same transport as the VPS: gloo, and same-host copies for the large messages where the
    # VPS uses them (routing/same_host.py; RLHF_SWITCH_SAME_HOST_COPY=0 turns both off)
    comm = as_comm(None)
    comm.choose_transport()
    return {"peers": peers, "sbufs": sbufs, "rbufs": rbufs, "alloc": alloc, "local": local,
            "local_bytes": plan.bytes_local - need, "comm": comm}


def _pattern(a: int) -> int:
    return (a * 37 + 5) % 251


def raw_run(ctx: dict) -> dict:
    """The exchange (what the table times), then the local copies (reported beside it)."""
    comm = ctx["comm"]
    t0 = time.perf_counter()
    for p in ctx["peers"]:
        ops = []
        if p in ctx["rbufs"]:
            ops.append(P2P(False, ctx["rbufs"][p], p))
        if p in ctx["sbufs"]:
            ops.append(P2P(True, ctx["sbufs"][p], p))
        for w in comm.transport.batch(comm, ops):
            w.wait()
    t1 = time.perf_counter()
    if ctx.get("copy_local"):
        for d, s in ctx["local"]:
            d.copy_(s)
    return {"exchange_s": t1 - t0, "with_local_s": time.perf_counter() - t0}


def raw_verify(ctx: dict) -> tuple[bool, list[str]]:
    bad = [f"from {p}" for p, b in ctx["rbufs"].items() if not bool((b == _pattern(p)).all())]
    return not bad, bad
