"""Plan a transition between two layouts: which bytes go from which rank to which.

For every destination fragment the planner intersects it with the source's disjoint regions and,
for every piece, picks one source replica:

1. the destination rank itself, if it already holds the piece (a local copy, no communication);
2. otherwise a holder on the same node (when ``ranks_per_node`` is given), else any holder,
   spreading the ranks that want the same piece round-robin over its holders (rotated per piece
   by a stable hash, so single requesters do not all land on the lowest rank).

The choice depends only on the two layouts, so every rank computes its *own* part — its sends,
receives and local copies — without building anyone else's (``plan_rank``), and both ends of a
pair agree on it. ``plan_transition`` builds everyone's, for inspection and for tests.
Plans are cached per ``(src, dst, rank)``.
"""
from __future__ import annotations

import functools
import hashlib
import zlib
from zlib import crc32
from bisect import bisect_left, bisect_right
from itertools import accumulate, chain, groupby
from operator import itemgetter
from dataclasses import dataclass, field
from typing import Iterable, NamedTuple

from .layout import Fragment, Layout, LayoutError, expand, without_gc
from .space import Box, StateKey, tuple_new
from .spec import itemsize

PLANNER_VERSION = "1"


class Transfer(NamedTuple):
    """Box ``box`` of ``key`` from ``src``'s buffer view to ``dst``'s buffer view. ``dtype`` is the
    destination buffer's dtype, which is also what travels (a sender casts before sending)."""

    src: int
    dst: int
    key: StateKey
    box: Box
    src_buffer: str
    src_offset: int
    src_strides: tuple[int, ...]
    dst_buffer: str
    dst_offset: int
    dst_strides: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        return self.box.numel

    @property
    def nbytes(self) -> int:
        return self.box.numel * itemsize(self.dtype)

    def __str__(self) -> str:
        return f"{self.src}->{self.dst} {self.key}{self.box} ({self.nbytes} B)"


@dataclass(frozen=True)
class RankPlan:
    """One rank's part of a transition: what it copies locally, sends and receives."""

    rank: int
    world_size: int
    transition: str  # "src -> dst", for messages
    digest: str  # digest of the planner's inputs: equal digests mean equal plans everywhere
    local: tuple[Transfer, ...]
    sends: tuple[Transfer, ...]  # grouped by dst, canonical order within a peer
    recvs: tuple[Transfer, ...]  # grouped by src, canonical order within a peer
    min_bytes_received: int  # what any correct transition must bring to this rank
    pair_digests: dict[int, int] = field(default_factory=dict, compare=False)

    @property
    def bytes_sent(self) -> int:
        return sum(t.nbytes for t in self.sends)

    @property
    def bytes_received(self) -> int:
        return sum(t.nbytes for t in self.recvs)

    @property
    def bytes_local(self) -> int:
        return sum(t.nbytes for t in self.local)

    def peers(self) -> list[int]:
        return sorted({t.dst for t in self.sends} | {t.src for t in self.recvs})

    def __str__(self) -> str:
        return (f"rank {self.rank} of {self.transition}: {len(self.local)} local copies "
                f"({self.bytes_local} B), {len(self.sends)} sends ({self.bytes_sent} B) to "
                f"{len({t.dst for t in self.sends})} peers, {len(self.recvs)} receives "
                f"({self.bytes_received} B, minimum {self.min_bytes_received} B)")


@dataclass(frozen=True)
class Plan:
    """Everyone's part of a transition (built from the same per-key planning as ``RankPlan``)."""

    transition: str
    digest: str
    world_size: int
    transfers: tuple[Transfer, ...]
    min_bytes: int

    @property
    def bytes_moved(self) -> int:
        return sum(t.nbytes for t in self.transfers if t.src != t.dst)

    @property
    def bytes_local(self) -> int:
        return sum(t.nbytes for t in self.transfers if t.src == t.dst)

    def link_bytes(self) -> dict[tuple[int, int], int]:
        out: dict[tuple[int, int], int] = {}
        for t in self.transfers:
            if t.src != t.dst:
                out[(t.src, t.dst)] = out.get((t.src, t.dst), 0) + t.nbytes
        return out

    def __str__(self) -> str:
        return (f"{self.transition}: {len(self.transfers)} pieces, {self.bytes_moved} B across ranks "
                f"(minimum {self.min_bytes} B), {self.bytes_local} B local")


def check_pair(src: Layout, dst: Layout) -> None:
    """Errors a transition can be refused for before any planning: different models or worlds."""
    if src.spec.digest != dst.spec.digest:
        raise LayoutError(f"cannot move {src.name} (model {src.spec.name!r}) into {dst.name} "
                          f"(model {dst.spec.name!r}): the layouts describe different models")
    if src.world_size != dst.world_size:
        raise LayoutError(f"cannot move {src.name} ({src.world_size} ranks) into {dst.name} "
                          f"({dst.world_size} ranks): world sizes differ")
    missing = set(dst.fields()) - set(src.fields())
    if missing:
        raise LayoutError(f"{dst.name} wants fields {sorted(missing)} that {src.name} does not hold")


def input_digest(src: Layout, dst: Layout, ranks_per_node: int | None) -> str:
    h = hashlib.sha256(f"{PLANNER_VERSION}|{src.digest}|{dst.digest}|{ranks_per_node}".encode())
    return h.hexdigest()[:24]


@functools.lru_cache(maxsize=256)
@without_gc
def plan_rank(src: Layout, dst: Layout, rank: int, ranks_per_node: int | None = None) -> RankPlan:
    """Rank ``rank``'s part of ``src -> dst``, computed from metadata only."""
    check_pair(src, dst)
    if not 0 <= rank < src.world_size:
        raise LayoutError(f"rank {rank} is outside a world of {src.world_size}")
    keys = sorted(src.keys(rank) | dst.keys(rank), key=_order(src))
    wanted: dict[StateKey, list[Fragment]] = {}  # key -> the destination fragments `rank` holds
    for f in dst.fragments(rank):
        wanted.setdefault(f.key, []).append(f)
    held: dict[StateKey, list[Fragment]] = {}  # key -> its source fragments
    for f in src.fragments(rank):
        held.setdefault(f.key, []).append(f)
    transfers: list[Transfer] = []
    dtypes = {n: b.dtype for n, b in dst.buffers(rank).items()}
    partition = src._is_partition
    every_key_partitioned = src._partition  # (then no need to ask per key)
    # (src geometry, dst geometry, box) -> _receipt's steps (receipts) and _shipment's (shipments),
    # when both layouts name geometries
    geometries = src._geometry_fn is not None and dst._geometry_fn is not None
    receipts = {} if geometries else None
    shipments = {} if geometries else None
    sgeometry, dgeometry = src._geometry_fn, dst._geometry_fn
    walked = False  # whether some key took the general walk
    for k in keys:
        dfrags, sfrags = wanted.get(k, ()), held.get(k, ())
        if len(dfrags) <= 1 and (every_key_partitioned or partition(k)) and \
                (len(sfrags) <= 1 or len({f.box for f in sfrags}) == len(sfrags)):
            # the fast path: only the holders of the boxes `rank` meets, found per key
            pair = None
            if geometries:
                sg = sgeometry(k)
                if sg is not None:
                    dg = dgeometry(k)
                    if dg is not None:
                        pair = (sg, dg)
            if dfrags:
                d = dfrags[0]
                dtype = dtypes.get(d.buffer) or dst.buffers(rank)[d.buffer].dtype
                _receive(k, src, dst, rank, ranks_per_node, d, dtype, transfers, receipts, pair)
            if sfrags:
                if pair is not None and len(sfrags) == 1:
                    sf = sfrags[0]
                    steps = shipments.get((pair, sf.box))
                    if steps is None:
                        steps = shipments[(pair, sf.box)] = _shipment(k, src, dst, rank, ranks_per_node, sf)
                    if steps is not False:
                        _ship(k, dst, rank, ranks_per_node, sf, steps, transfers)
                        continue
                _send(k, src, dst, rank, ranks_per_node, sfrags, transfers)
        else:  # overlapping source boxes, or several boxes of one key here: the general walk
            walked = True
            transfers.extend(_plan_key(k, src, dst, rank, ranks_per_node, {f.box for f in dfrags}))
    local = tuple(t for t in transfers if t.src == t.dst == rank)
    # canonical order within a peer: the keys' order (their position in `keys`), then the box
    position = {k: i for i, k in enumerate(keys)}
    sends = tuple(sorted((t for t in transfers if t.src == rank and t.dst != rank),
                         key=lambda t: (t.dst, position[t.key], t.box.lo)))
    recvs = [t for t in transfers if t.dst == rank and t.src != rank]
    if walked:
        recvs.sort(key=lambda t: (t.src, position[t.key], t.box.lo))
    else:  # already in key order, and a key's receives in box order (_receive's region order)
        recvs.sort(key=_src_of)
    return RankPlan(rank, src.world_size, f"{src.name} -> {dst.name}",
                    input_digest(src, dst, ranks_per_node), local, sends, tuple(recvs),
                    _minimum_bytes(wanted, held, dst.buffers(rank)), _pair_digests(rank, sends, recvs))


@functools.lru_cache(maxsize=32)
@without_gc
def plan_transition(src: Layout, dst: Layout, ranks_per_node: int | None = None) -> Plan:
    """Every rank's transfers, in canonical order."""
    check_pair(src, dst)
    order = _order(src)
    keys = set(dst.all_keys())
    transfers: list[Transfer] = []
    for k in sorted(keys, key=order):
        _plan_key_all(k, src, dst, ranks_per_node, transfers)
    transfers = tuple(transfers)
    return Plan(f"{src.name} -> {dst.name}", input_digest(src, dst, ranks_per_node), src.world_size,
                transfers, sum(minimum_bytes_received(src, dst, r) for r in range(src.world_size)))


def minimum_bytes_received(src: Layout, dst: Layout, rank: int) -> int:
    """Bytes ``rank`` needs that it does not already hold: every destination element it must
    have, less what its own source fragments of the same key cover. No plan can move less."""
    wanted: dict[StateKey, list[Fragment]] = {}
    for f in dst.fragments(rank):
        wanted.setdefault(f.key, []).append(f)
    held: dict[StateKey, list[Fragment]] = {}
    for f in src.fragments(rank):
        held.setdefault(f.key, []).append(f)
    return _minimum_bytes(wanted, held, dst.buffers(rank))


def _minimum_bytes(wanted: dict[StateKey, list[Fragment]], held: dict[StateKey, list[Fragment]], buffers) -> int:
    """``minimum_bytes_received`` from a rank's destination (``wanted``) and source (``held``)
    fragments by key and its destination buffers."""
    sizes = {n: itemsize(b.dtype) for n, b in buffers.items()}
    total = 0
    numels: dict[Box, int] = {}  # replicas and like tensors share boxes
    for k, dfrags in wanted.items():
        mine = held.get(k, ())
        for f in dfrags:
            need = numels.get(f.box)
            if need is None:
                need = numels[f.box] = f.box.numel
            for s in mine:
                inter = f.box.intersect(s.box)
                if inter is not None:
                    need -= inter.numel
            total += need * sizes[f.buffer]
    return total


def _order(layout: Layout):
    """Sort key of the state keys of ``layout``: model order, then field (an int: cheaper to
    compare than a tuple, for tens of thousands of keys)."""
    order = layout.spec._order()
    fields = {f: i for i, f in enumerate(sorted(layout.fields()))}
    n = len(fields)
    return lambda k: order[k.tensor] * n + fields[k.field]


def _plan_key(key: StateKey, src: Layout, dst: Layout, rank: int | None,
              ranks_per_node: int | None, wanted: set[Box] | None = None) -> Iterable[Transfer]:
    """Transfers of ``key``: everyone's (``rank`` None), or those ``rank`` sends or receives.
    ``wanted``, when given, is the set of boxes of ``key`` that ``rank`` holds in ``dst``."""
    regions = src.regions(key)
    # a rank planning only its own part looks at every region for the boxes it receives, but
    # only at the regions it holds for the boxes others receive (its sends)
    mine = regions if rank is None else [r for r in regions if _holds(r.holders, rank)]
    rot_seed = None  # crc32 of the key's part of the rotation string, computed on first use
    reach = None  # see _pieces, computed on first use
    for dbox, requesters in dst.groups(key).items():
        # `rank` is among the requesters (a set lookup rather than a scan of all the replicas)
        wants = rank is None or (dbox in wanted if wanted is not None else _holds(requesters, rank))
        if not wants and not mine:
            continue
        if rank is not None and wants:
            where: dict[int, list[int]] = {}  # requester rank -> its positions in `requesters`
            for j, (d, _) in enumerate(requesters):
                where.setdefault(d, []).append(j)
        covered = 0
        if wants and reach is None and len(regions) > 8:
            reach = _reach(regions)
        for _, reg, piece in (_pieces(regions, dbox, reach) if wants else _pieces(mine, dbox, None)):
            covered += piece.numel
            holders = reg.holders
            held_by = dict(holders)
            if rank is not None and rank not in held_by:
                # `rank` only receives this piece: of all the remote requesters' holder choices
                # only its own matter, but its position i among the remote ones picks its holder
                if rot_seed is None:
                    rot_seed = _rotation_seed(key)
                rot = _rotation(rot_seed, piece)
                for j in where[rank]:
                    d, f = requesters[j]
                    i = _remote_position(j, held_by, where) + rot
                    if ranks_per_node:
                        h, hf = _choose(holders, i, d, ranks_per_node)
                    else:
                        h, hf = holders[i % len(holders)]
                    yield _transfer(h, hf, d, f, piece, dst)
                continue
            views: dict[int, tuple] = {}  # for this piece; replicas share Fragment objects
            # local copies: requesters that hold the piece themselves (for `rank`: its own entries)
            if rank is None:
                for d, f in requesters:
                    if d in held_by:
                        yield _transfer(d, held_by[d], d, f, piece, dst, views)
            elif wants:
                for j in where[rank]:
                    yield _transfer(rank, held_by[rank], rank, requesters[j][1], piece, dst, views)
            remote = [(d, f) for d, f in requesters if d not in held_by]
            if remote:
                if rot_seed is None:
                    rot_seed = _rotation_seed(key)
                rot = _rotation(rot_seed, piece)
                n = len(holders)
                for i, (d, f) in enumerate(remote):
                    if ranks_per_node:
                        h, hf = _choose(holders, i + rot, d, ranks_per_node)
                    else:  # _choose without a node preference, inlined: this loop is the hot one
                        h, hf = holders[(i + rot) % n]
                    if rank is None or rank == d or rank == h:
                        yield _transfer(h, hf, d, f, piece, dst, views)
        if wants and covered != dbox.numel:
            raise LayoutError(f"{src.name} holds only {covered} of the {dbox.numel} elements of "
                              f"{key}{dbox} that {dst.name} needs")


def _plan_key_all(key: StateKey, src: Layout, dst: Layout, ranks_per_node: int | None,
                  out: list[Transfer]) -> None:
    """Everyone's transfers of ``key``: ``_plan_key`` with ``rank`` None, in its order, walking
    the destination's holder groups (a group's buffer dtype is looked up once, not per rank)."""
    regions = src.regions(key)
    reach = None
    seed = None
    near: dict[int, dict] = {}  # region index -> its holders by node
    for dbox, groups in dst._key_index(key).items():
        if len(groups) == 1:
            g = groups[0]
            requesters = [(d, g) for d in g.ranks]
        else:
            requesters = sorted(((d, g) for g in groups for d in g.ranks), key=_first)
        covered = 0
        if reach is None and len(regions) > 8:
            reach = _reach(regions)
        for ri, reg, piece in _pieces(regions, dbox, reach):
            covered += piece.numel
            holders = reg.holders
            held_by = dict(holders)
            sviews: dict[int, tuple] = {}
            dviews: dict[int, tuple] = {}
            remote = []
            for d, g in requesters:  # local copies first, in requester order
                hf = held_by.get(d)
                if hf is None:
                    remote.append((d, g))
                    continue
                out.append(_transfer_of(d, hf, d, g, piece, dst, sviews, dviews))
            if not remote:
                continue
            if seed is None:
                seed = _rotation_seed(key)
            rot = _rotation(seed, piece)
            n = len(holders)
            by_node = None
            if ranks_per_node:
                by_node = near.get(ri)
                if by_node is None:
                    by_node = near[ri] = _by_node(holders, ranks_per_node)
            for i, (d, g) in enumerate(remote):
                i += rot
                if by_node is not None:
                    close = by_node.get(d // ranks_per_node)
                    h, hf = close[i % len(close)] if close else holders[i % n]
                else:
                    h, hf = holders[i % n]
                out.append(_transfer_of(h, hf, d, g, piece, dst, sviews, dviews))
        if covered != dbox.numel:
            raise LayoutError(f"{src.name} holds only {covered} of the {dbox.numel} elements of "
                              f"{key}{dbox} that {dst.name} needs")


def _reach(regions) -> list[int]:
    """``reach[i]``: the furthest dim-0 end among ``regions[:i + 1]`` (for ``_pieces``)."""
    return list(accumulate([r.box.hi[0] for r in regions], max))


def _pieces(regions, box: Box, reach: list[int] | None):
    """``(index, region, piece)`` for each of ``regions`` that meets ``box``, ``piece`` being
    their intersection. Regions come sorted by their lower corner, so those that can meet the
    box on dim 0 are one run: stop at the first region that starts at or past the box's end, and
    (given ``reach``, worth it for many regions) skip the head whose regions all end before the
    box begins, found by bisection of ``reach``."""
    if not box.hi:  # a scalar: every region is the whole of it
        for i, reg in enumerate(regions):
            yield i, reg, reg.box
        return
    end = box.hi[0]
    for i in range(bisect_right(reach, box.lo[0]) if reach is not None else 0, len(regions)):
        reg = regions[i]
        if reg.box.lo[0] >= end:
            break
        piece = reg.box.intersect(box)
        if piece is not None:
            yield i, reg, piece


def _transfer_of(s: int, sf: Fragment, d: int, g, piece: Box, dst: Layout, sviews: dict, dviews: dict) -> Transfer:
    """``_transfer`` for a requester ``d`` of holder group ``g``, views memoised per fragment."""
    sv = sviews.get(id(sf))
    if sv is None:
        sv = sviews[id(sf)] = sf.view(piece)
    df = g.fragment
    dv = dviews.get(id(df))
    if dv is None:
        dv = dviews[id(df)] = df.view(piece)
    dtype = g.dtype if g.dtype is not None else dst.buffers(d)[df.buffer].dtype
    return tuple_new(Transfer, (s, d, df.key, piece, sf.buffer, sv[0], sv[1], df.buffer, dv[0], dv[1], dtype))


def _remote_position(j: int, held_by, where: dict[int, list[int]]) -> int:
    """Position among the remote requesters (those not in ``held_by``) of entry ``j`` of the
    requesters: ``j`` less the holders' own entries before it. Holders rarely request the box
    they hold, so this is usually ``j`` after a lookup or two."""
    i = j
    for h in held_by:
        for q in where.get(h, ()):
            if q < j:
                i -= 1
    return i


def _holds(holders, rank: int) -> bool:
    """Whether ``rank`` is among ``(rank, fragment)`` pairs ``holders``."""
    for h, _ in holders:
        if h == rank:
            return True
    return False


def _rotation_seed(key: StateKey) -> int:
    return zlib.crc32(f"{key.tensor}|{key.field}|".encode())


def _rotation(seed: int, piece: Box) -> int:
    """``crc32(f"{tensor}|{field}|{piece.lo}")``, continuing the key's running checksum
    (``seed``) rather than formatting and hashing the key's part again for every piece."""
    return zlib.crc32(str(piece.lo).encode(), seed)


def _choose(holders, i: int, d: int, ranks_per_node: int | None):
    if ranks_per_node:
        near = [h for h in holders if h[0] // ranks_per_node == d // ranks_per_node]
        if near:
            return near[i % len(near)]
    return holders[i % len(holders)]


def _transfer(s: int, sf: Fragment, d: int, df: Fragment, piece: Box, dst: Layout,
              views: dict[int, tuple] | None = None) -> Transfer:
    """The transfer of ``piece`` from ``s``'s fragment ``sf`` to ``d``'s ``df``. ``views`` memoises
    fragment views of this one piece: a piece sent to 16 replicas is one view on each side."""
    if views is None:
        sv, dv = sf.view(piece), df.view(piece)
    else:
        sv = views.get(id(sf))
        if sv is None:
            sv = views[id(sf)] = sf.view(piece)
        dv = views.get(id(df))
        if dv is None:
            dv = views[id(df)] = df.view(piece)
    return tuple_new(Transfer, (s, d, df.key, piece, sf.buffer, sv[0], sv[1], df.buffer, dv[0], dv[1],
                                dst.buffers(d)[df.buffer].dtype))


def _pair_digests(rank: int, sends, recvs) -> dict[int, int]:
    """Per peer, a hash of the pair's transfers in both directions, the same on both ends."""
    pairs: dict[int, list] = {}
    for peer, ts in groupby(sends, _dst_of):  # sends come grouped by peer, and so do receives
        pairs.setdefault(peer, [(), ()])[0 if rank < peer else 1] = tuple(ts)
    for peer, ts in groupby(recvs, _src_of):
        pairs.setdefault(peer, [(), ()])[1 if rank < peer else 0] = tuple(ts)
    return {p: _digest(lower, upper) for p, (lower, upper) in pairs.items()}


_src_of, _dst_of = itemgetter(0), itemgetter(1)
_numbers_of = itemgetter(0, 1, 3, 5, 6, 8, 9)  # ranks, box, offsets and strides: ints only
_key_of, _names_of = itemgetter(2), itemgetter(4, 7, 10)  # key (tensor, field); buffers, dtype


def _digest(*lists) -> int:
    """56 bits of a hash of transfer lists. Their numbers go through ``hash`` (CPython's hash
    of ints and tuples of them is the same in every process; only str hashes are randomised),
    their names through SHA-1 in one string: every step runs in C. (SHA-1 of the transfers'
    ``repr`` ran Python code three times per transfer, a fifth of a 1024-rank MoE rank's plan.)"""
    h = hashlib.sha1()
    numbers = []
    for ts in lists:
        numbers.append(hash(tuple(map(_numbers_of, ts))))
        h.update("\0".join(chain.from_iterable(map(_key_of, ts))).encode())  # tensor, field
        h.update(b"\1")
        h.update("\0".join(chain.from_iterable(map(_names_of, ts))).encode())
        h.update(b"\1")
    h.update(repr(numbers).encode())
    return int.from_bytes(h.digest()[:7], "big")


def _receipt(key: StateKey, src: Layout, dst: Layout, rank: int, ranks_per_node: int | None,
             dfrag: Fragment) -> list[tuple]:
    """How ``rank`` receives its box of ``key`` (``dfrag``), one step per source box meeting it:
    ``(piece, str(piece.lo) encoded, pos, choices, dst offset delta)``. The holder is
    ``choices[0]`` when ``pos`` is None (``rank`` holds the piece: a local copy), else
    ``choices[(pos + rotation) % len(choices)]``, the rotation being the key's checksum continued
    over the piece's lower corner (``_rotation``). A choice is ``(rank, fragment, src offset
    delta)``; offsets are deltas from the fragments' own, so the steps serve every key of the
    same geometry (``Layout.lazy``), each with its own fragments' buffers and offsets."""
    dbox = dfrag.box
    requesters = dst._holders_of(key, dbox)
    # this rank's position among the requesters (in rank order; a rank holds a box once)
    if len(requesters) == 1:
        pos = bisect_left(requesters[0].ranks, rank)
    else:
        pos = 0
        for g in requesters:
            pos += bisect_left(g.ranks, rank)
    steps = []
    covered = 0
    for rbox, held in src._meeting(key, dbox):
        piece = rbox.intersect(dbox)
        whole = piece == dbox  # the common case: one source box holds all of it
        covered += dbox.numel if whole else piece.numel
        if len(held) == 1:
            distinct = held[0].ranks
            holders = [(r, held[0].fragment) for r in distinct]
        else:
            holders = expand(held)
            distinct = dict(holders)
        if rank in distinct:
            i = None
            choices = [(rank, dict(holders)[rank])]
        else:
            # its position among the requesters that do not hold the piece themselves
            i = pos
            for h in distinct:  # ascending
                if h >= rank:
                    break
                for g in requesters:
                    if h in g.ranks:
                        i -= 1
            choices = holders
            if ranks_per_node:
                node = rank // ranks_per_node
                choices = [x for x in holders if x[0] // ranks_per_node == node] or holders
        views = {}  # replicas share fragments: one view each
        for h, hf in choices:
            if id(hf) not in views:
                views[id(hf)] = 0 if piece == hf.box else hf.view(piece)[0] - hf.offset
        choices = [(h, hf, views[id(hf)]) for h, hf in choices]
        steps.append((piece, str(piece.lo).encode(), i, choices, 0 if whole else dfrag.view(piece)[0] - dfrag.offset))
    if covered != dbox.numel:
        raise LayoutError(f"{src.name} holds only {covered} of the {dbox.numel} elements of "
                          f"{key}{dbox} that {dst.name} needs")
    return steps


def _receive(key: StateKey, src: Layout, dst: Layout, rank: int, ranks_per_node: int | None, dfrag: Fragment,
             dtype: str, out: list[Transfer], receipts: dict, pair: tuple | None = None) -> None:
    """``rank``'s local copies and receives of ``key`` (its one destination fragment ``dfrag``,
    of dtype ``dtype``) when the source's boxes of it are a (replicated) partition, in region
    order: the choices of ``_plan_key``, from the holders of the source boxes meeting ``dfrag``.
    ``receipts`` (None when a layout names no geometries) memoises ``_receipt`` per (source
    geometry, destination geometry, box): a MoE layer's experts are received alike, each from
    its own fragments."""
    if pair is None or receipts is None:
        steps = _receipt(key, src, dst, rank, ranks_per_node, dfrag)
    else:
        steps = receipts.get((pair, dfrag.box))
        if steps is None:
            steps = receipts[(pair, dfrag.box)] = _receipt(key, src, dst, rank, ranks_per_node, dfrag)
    seed = None
    dbuf, doff, dstrides = dfrag.buffer, dfrag.offset, dfrag.strides
    for piece, lo, pos, choices, ddelta in steps:
        if pos is None:
            h, hf, sdelta = choices[0]
        else:
            if seed is None:
                seed = _rotation_seed(key)
            h, hf, sdelta = choices[(pos + crc32(lo, seed)) % len(choices)]
        sbuf, soff = (hf.buffer, hf.offset) if hf.key is key else src._relocate(key, hf)
        out.append(tuple_new(Transfer, (h, rank, key, piece, sbuf, soff + sdelta, hf.strides, dbuf,
                                        doff + ddelta, dstrides, dtype)))


def _send(key: StateKey, src: Layout, dst: Layout, rank: int, ranks_per_node: int | None,
          sfrags: list[Fragment], out: list[Transfer]) -> None:
    """``rank``'s sends of ``key`` from its source fragments ``sfrags`` (distinct boxes of a
    (replicated) partition): each against the destination boxes that meet it, the holder chosen
    for each remote requester as ``_plan_key`` chooses it, kept where that is ``rank``."""
    seed = None
    for sfrag in sfrags:
        rbox = sfrag.box
        held = src._holders_of(key, rbox)
        if len(held) == 1:  # one fragment on all its holders (replicas): the common case
            ranks, holders, hf = held[0].ranks, None, held[0].fragment
        else:
            holders = expand(held)
            ranks = tuple(h for h, _ in holders)
        members, mine, near = _places(ranks, rank, ranks_per_node)
        n = len(ranks)
        for dbox, requesters in dst._meeting(key, rbox):
            piece = rbox.intersect(dbox)
            if seed is None:
                seed = _rotation_seed(key)
            rot = _rotation(seed, piece)
            # the requesters that do not hold the piece, in rank order, each with its group
            if len(requesters) == 1:
                g = requesters[0]
                remote = [(d, g) for d in g.ranks if d not in members]
            else:
                remote = sorted(((d, g) for g in requesters for d in g.ranks if d not in members), key=_first)
            # Requester i gets holder (i + rot) % n, or with a node preference the same from
            # the holders on its node when there are some. So `rank` sends to every n-th
            # requester from each of its places, less those on nodes with holders, and to those
            # on its own node that pick it there: found without asking every requester.
            chosen = [i for p in mine for i in range((p - rot) % n, len(remote), n)]
            if near is not None:
                chosen = [i for i in chosen if remote[i][0] // ranks_per_node not in near]
                node = rank // ranks_per_node
                close = near[node]
                for i in range(bisect_left(remote, node * ranks_per_node, key=_first),
                               bisect_left(remote, (node + 1) * ranks_per_node, key=_first)):
                    if ranks[close[(i + rot) % len(close)]] == rank:
                        chosen.append(i)
            sview = None
            dviews = {}  # replicas share their fragment: one view each
            for i in chosen:
                d, g = remote[i]
                if holders is not None:
                    close = near.get(d // ranks_per_node) if near is not None else None
                    hf = holders[close[(i + rot) % len(close)] if close else (i + rot) % n][1]
                if sview is None:
                    sview = hf.view(piece)
                df = g.fragment
                dtype = g.dtype if g.dtype is not None else dst.buffers(d)[df.buffer].dtype
                dv = dviews.get(id(df))
                if dv is None:
                    dv = dviews[id(df)] = df.view(piece)
                out.append(tuple_new(Transfer, (rank, d, key, piece, hf.buffer, sview[0], sview[1], df.buffer,
                                                dv[0], dv[1], dtype)))



def _shipment(key: StateKey, src: Layout, dst: Layout, rank: int, ranks_per_node: int | None,
              sfrag: Fragment):
    """What ``_send`` works out for ``rank``'s one source box of ``key`` (``sfrag``) that does not
    depend on the key itself, so that every key of the same (source geometry, destination
    geometry) pair reuses it: per destination box meeting it, ``(piece, str(piece.lo) encoded,
    remote requesters as (rank, group, dst offset delta), n, mine, near, src offset delta)``.
    Only the rotation (a checksum of the key) and the buffers and offsets are left per key
    (``_ship``). The holder list (replicated norms and KV heads: every worker's) is expanded
    here, once per geometry pair rather than per key; ``rank`` sends from its one fragment of the
    box, ``sfrag``. False where ``rank`` holds the box more than once (``_send`` then)."""
    rbox = sfrag.box
    held = src._holders_of(key, rbox)
    if len(held) == 1:
        ranks = held[0].ranks
    else:  # e.g. a norm or a KV head on every vLLM worker: one group per worker
        ranks = tuple(h for h, _ in expand(held))
    members, mine, near = _places(ranks, rank, ranks_per_node)
    if len(mine) != 1:  # `rank` holds the box more than once: which fragment sends depends on the key
        return False
    n = len(ranks)
    steps = []
    for dbox, requesters in dst._meeting(key, rbox):
        piece = rbox.intersect(dbox)
        deltas = {}  # replicas share their fragment: one view each
        for g in requesters:
            df = g.fragment
            if id(df) not in deltas:
                deltas[id(df)] = df.view(piece)[0] - df.offset
        if len(requesters) == 1:
            g = requesters[0]
            dd = deltas[id(g.fragment)]
            remote = [(d, g, dd) for d in g.ranks if d not in members]
        else:
            remote = sorted(((d, g, deltas[id(g.fragment)]) for g in requesters for d in g.ranks
                             if d not in members), key=_first)
        steps.append((piece, str(piece.lo).encode(), remote, n, mine, near,
                      sfrag.view(piece)[0] - sfrag.offset))
    return steps


def _ship(key: StateKey, dst: Layout, rank: int, ranks_per_node: int | None, sfrag: Fragment,
          steps: list, out: list[Transfer]) -> None:
    """``_send`` of ``key`` from ``rank``'s one source fragment ``sfrag``, from a ``_shipment``
    worked out for a key of the same geometry pair: the same choices, this key's rotation,
    buffers and offsets (``Layout._relocate`` for the destination fragments)."""
    if not steps:
        return
    seed = _rotation_seed(key)
    sbuf, soff, sstrides = sfrag.buffer, sfrag.offset, sfrag.strides
    for piece, lo, remote, n, mine, near, sdelta in steps:
        rot = crc32(lo, seed)
        chosen = [i for p in mine for i in range((p - rot) % n, len(remote), n)]
        if near is not None:
            chosen = [i for i in chosen if remote[i][0] // ranks_per_node not in near]
            node = rank // ranks_per_node
            close = near[node]
            c = len(close)
            # `rank` holds the piece: the holder at close[(i + rot) % c] is `rank` for the
            # requesters of its node at these residues (what _send tests one by one)
            picks = {j for j in range(c) if close[j] in mine}
            for i in range(bisect_left(remote, node * ranks_per_node, key=_first),
                           bisect_left(remote, (node + 1) * ranks_per_node, key=_first)):
                if (i + rot) % c in picks:
                    chosen.append(i)
        spos = soff + sdelta
        at = {}  # destination fragment -> (buffer, offset) of this key there
        for i in chosen:
            d, g, ddelta = remote[i]
            df = g.fragment
            place = at.get(id(df))
            if place is None:
                place = at[id(df)] = (df.buffer, df.offset) if df.key is key else dst._relocate(key, df)
            dbuf = place[0]
            dtype = g.dtype if g.dtype is not None else dst.buffers(d)[dbuf].dtype
            out.append(tuple_new(Transfer, (rank, d, key, piece, sbuf, spos, sstrides, dbuf,
                                            place[1] + ddelta, df.strides, dtype)))

@functools.lru_cache(maxsize=1 << 12)
def _places(ranks, rank: int, ranks_per_node: int | None) -> tuple:
    """For the holders ``ranks`` of a box (ascending, as ``expand`` lists them): a container to
    test who holds it, ``rank``'s positions among them, and (with a node preference, for more
    than one holder) node -> the positions of the holders on it. The keys of a layer share
    holders: this is worked out once for them all."""
    members = ranks if isinstance(ranks, range) else frozenset(ranks)
    mine = tuple(p for p, h in enumerate(ranks) if h == rank)
    near = None
    if ranks_per_node and len(ranks) > 1:
        near = {}
        for p, h in enumerate(ranks):
            near.setdefault(h // ranks_per_node, []).append(p)
    return members, mine, near


def _by_node(holders, ranks_per_node: int) -> dict[int, list]:
    """node -> the holders on it, in holder order (what ``_choose`` filters for each requester)."""
    out: dict[int, list] = {}
    for h in holders:
        out.setdefault(h[0] // ranks_per_node, []).append(h)
    return out


def _first(item):
    return item[0]
