"""Fragments and layouts: which rank holds which box of which state key, and where in memory.

A ``Fragment`` says "this rank holds box B of key K in local buffer X": element ``x`` of B lives
at ``X.view(-1)[offset + sum((x[d] - B.lo[d]) * strides[d])]``. Fused buffers are several
fragments in one buffer; a ZeRO flat partition is many fragments at many offsets of one buffer.

A ``Layout`` is the full map ``rank -> fragments`` plus the buffers each rank must have (numel and
dtype, padding included). It is an immutable value: hashable by digest, cheap to pickle, printable
in a compact form (``TP2·DP2[zero3]``), and it never touches a process group.
"""
from __future__ import annotations

import functools
import gc
import hashlib
from bisect import bisect_right
from itertools import accumulate
from typing import Iterable, Mapping, NamedTuple, Sequence

from .space import MASTER, PARAM, Box, StateKey, tuple_new
from .spec import ModelSpec


class LayoutError(ValueError):
    """A layout (or a pair of layouts) that no correct move can use."""


def without_gc(func):
    """Run ``func`` with Python's cyclic garbage collector paused (and restored after).

    Building a 70B layout, its holder index or a plan allocates ~10^5 small tuples that stay
    alive and form no reference cycles. The collector wakes up every 700 allocations and, as the
    heap grows, rescans all of it: at 70B scale a third of the run, for nothing it can free.
    Reference counting still frees garbage as usual; only the search for cycles waits until
    ``func`` returns. (Mercurial's ``util.nogc`` does the same for the same reason.)
    """
    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        if not gc.isenabled():  # nested, or paused by the caller: leave it as it is
            return func(*args, **kwargs)
        gc.disable()
        try:
            return func(*args, **kwargs)
        finally:
            gc.enable()
    return wrapper


class Fragment(NamedTuple):
    key: StateKey
    box: Box
    buffer: str
    offset: int
    strides: tuple[int, ...]

    def view(self, sub: Box) -> tuple[int, tuple[int, ...]]:
        """(offset, strides) of ``sub`` (a box inside ``self.box``) in this fragment's buffer."""
        off = self.offset
        for lo, base, st in zip(sub.lo, self.box.lo, self.strides):
            off += (lo - base) * st
        return off, self.strides

    @property
    def span(self) -> int:
        """One past the last buffer element this fragment touches."""
        return self.offset + sum((n - 1) * s for n, s in zip(self.box.shape, self.strides)) + 1


class BufferSpec(NamedTuple):
    numel: int
    dtype: str


class Region(NamedTuple):
    """A box of one key and every (rank, fragment) that holds all of it."""

    box: Box
    holders: tuple[tuple[int, Fragment], ...]


class Holders(NamedTuple):
    """Ranks that hold one box of a key through equal fragments: a class's share of a holder list."""

    fragment: Fragment
    ranks: Sequence[int]  # ascending: a tuple, or a range for a regular stride
    dtype: str | None  # of the fragment's buffer on these ranks (None: an undeclared buffer)


class RankClasses:
    """Ranks grouped into classes that hold the same fragments in the same buffers, each class's
    ``(fragments, buffers)`` built on first use. Layout families give one class per distinct
    rank (e.g. one per vLLM worker, replicas share it); class ids count from 0 in order of their
    first rank, so walking classes in id order meets keys and boxes as a rank-by-rank walk does."""

    __slots__ = ("of", "members", "build", "built")

    def __init__(self, of: Sequence[int], members: Sequence[Sequence[int]], build=None, built=None):
        self.of = of  # rank -> class id
        self.members = members  # class id -> its ranks, ascending
        self.build = build  # class id -> (fragments tuple, buffers mapping)
        self.built = built if built is not None else {}

    def get(self, c: int) -> tuple[tuple[Fragment, ...], Mapping[str, BufferSpec]]:
        v = self.built.get(c)
        if v is None:
            v = self.built[c] = self.build(c)
        return v

    @classmethod
    def of_ranks(cls, rank_class: Sequence, build) -> "RankClasses":
        """Classes from any hashable per rank (``rank_class[r]``), numbered by first rank."""
        ids: dict = {}
        of, members, keys = [], [], []
        for r, k in enumerate(rank_class):
            c = ids.get(k)
            if c is None:
                c = ids[k] = len(members)
                members.append([])
                keys.append(k)
            members[c].append(r)
            of.append(c)
        return cls(of, [_ascending(m) for m in members], lambda c: build(keys[c]))


def _ascending(ranks: list[int]) -> Sequence[int]:
    """``ranks`` as a range when they are evenly spaced (cheap membership tests), else a tuple."""
    if len(ranks) > 2:
        step = ranks[1] - ranks[0]
        if step > 0 and all(b - a == step for a, b in zip(ranks, ranks[1:])):
            return range(ranks[0], ranks[-1] + 1, step)
    return tuple(ranks)


class _PerRank:
    """``rank -> fragments`` (``item`` 0) or ``rank -> buffers`` (1) of lazily built classes."""

    __slots__ = ("classes", "item")

    def __init__(self, classes: RankClasses, item: int):
        self.classes, self.item = classes, item

    def __len__(self) -> int:
        return len(self.classes.of)

    def __getitem__(self, rank: int):
        return self.classes.get(self.classes.of[rank])[self.item]

    def __iter__(self):
        get, item = self.classes.get, self.item
        return (get(c)[item] for c in self.classes.of)


def expand(groups: Sequence[Holders]) -> list[tuple[int, Fragment]]:
    """Holder groups as one ``(rank, fragment)`` list in rank order (stable: within a rank, in
    the groups' order)."""
    if len(groups) == 1:
        f = groups[0].fragment
        return [(r, f) for r in groups[0].ranks]
    out = [(r, g.fragment) for g in groups for r in g.ranks]
    out.sort(key=_rank_of)
    return out


class Layout:
    """``{rank: [Fragment]}`` plus per-rank buffer declarations, for one model spec.

    Built eagerly from per-rank lists, or lazily (``Layout.lazy``) from rank classes that are
    made on first use, optionally with a ``holders(key, box)`` function that names the holders of
    one key without building every rank: one rank plans its part of a 1024-rank move from the
    classes it meets, not from all of them.

    A ``holders`` object may also name each key's *geometry* (``holders.geometry(key)``): keys of
    equal geometry are held as the same boxes by the same ranks with the same strides, their
    fragments differing only in key, buffer and offset (``holders.relocate(key, fragment)`` gives
    ``key``'s buffer and offset for the fragment another key of its geometry has there). The
    planner works out a geometry once and reuses it for every key of it: a MoE layer's 128
    experts are a few geometries."""

    __slots__ = ("spec", "world_size", "name", "_frags", "_buffers", "_recipe", "_digest",
                 "_classes", "_holders_fn", "_partition", "_fields", "_index", "_key_index_cache",
                 "_meet", "_part", "_regions", "_class_keys", "_geometry_fn", "_relocate_fn")

    def __init__(self, spec: ModelSpec, fragments: Sequence[Sequence[Fragment]],
                 buffers: Sequence[Mapping[str, BufferSpec]], name: str = "layout",
                 recipe: str | None = None):
        if len(fragments) != len(buffers):
            raise LayoutError(f"{name}: {len(fragments)} fragment lists but {len(buffers)} buffer maps")
        self._setup(spec, len(fragments), name, recipe)
        self._frags = tuple(f if isinstance(f, tuple) else tuple(f) for f in fragments)
        self._buffers = tuple(buffers)

    @classmethod
    def lazy(cls, spec: ModelSpec, classes: RankClasses, name: str, recipe: str,
             fields: Sequence[str], holders=None, partition: bool = False) -> "Layout":
        """A layout whose rank classes are built on first use. ``holders(key, box)``, when given,
        lists ``(box, Holders)`` for the boxes of ``key`` that meet ``box`` (all of them for
        ``None``) in the order a rank-by-rank walk meets them, exactly as the built classes hold
        them; ``partition`` says that any two boxes of one key are equal or disjoint."""
        self = cls.__new__(cls)
        self._setup(spec, len(classes.of), name, recipe)
        self._classes = classes
        self._frags, self._buffers = _PerRank(classes, 0), _PerRank(classes, 1)
        self._holders_fn = holders
        self._geometry_fn = getattr(holders, "geometry", None)
        self._relocate_fn = getattr(holders, "relocate", None)
        self._partition = partition
        self._fields = tuple(sorted(set(fields)))
        return self

    def _setup(self, spec: ModelSpec, world_size: int, name: str, recipe: str | None) -> None:
        self.spec = spec
        self.world_size = world_size
        self.name = name
        self._recipe = recipe  # a builder's exact arguments: a cheap, equivalent digest source
        self._digest = None
        self._classes = None
        self._holders_fn = None
        self._geometry_fn = None
        self._relocate_fn = None
        self._partition = False
        self._fields = None
        self._index = None
        self._key_index_cache = {}
        self._meet = {}
        self._part = {}
        self._regions = {}
        self._class_keys = {}

    # --- values -------------------------------------------------------------------------------
    def __repr__(self) -> str:
        return f"Layout({self.name}, world={self.world_size}, model={self.spec.name})"

    __str__ = lambda self: self.name  # noqa: E731

    @property
    def digest(self) -> str:
        if self._digest is None:
            h = hashlib.sha256()
            h.update(f"{self.spec.digest}|{self.world_size}|".encode())
            if self._recipe is not None:
                h.update(self._recipe.encode())
            else:
                seen: dict[int, str] = {}  # replicas share tuples: hash each distinct one once
                for frags, bufs in zip(self._frags, self._buffers):
                    k = id(frags)
                    if k not in seen:
                        seen[k] = hashlib.sha256(repr(frags).encode()).hexdigest()
                    h.update(seen[k].encode())
                    h.update(repr(sorted(bufs.items())).encode())
            self._digest = h.hexdigest()[:24]
        return self._digest

    def __hash__(self) -> int:
        return hash(self.digest)

    def __eq__(self, other) -> bool:
        return isinstance(other, Layout) and self.digest == other.digest

    def __reduce__(self):  # a lazy layout pickles as the eager one it equals
        return (_rebuild_layout, (self.spec, tuple(self._frags), tuple(self._buffers), self.name, self._recipe))

    # --- per rank -------------------------------------------------------------------------------
    def fragments(self, rank: int) -> tuple[Fragment, ...]:
        return self._frags[rank]

    def buffers(self, rank: int) -> Mapping[str, BufferSpec]:
        return self._buffers[rank]

    def keys(self, rank: int) -> frozenset[StateKey]:
        c = self._rank_classes().of[rank]
        ks = self._class_keys.get(c)
        if ks is None:
            ks = self._class_keys[c] = frozenset(f.key for f in self._frags[rank])
        return ks

    def fields(self) -> tuple[str, ...]:
        if self._fields is None:
            cl = self._rank_classes()
            self._fields = tuple(sorted({f.key.field for c in range(len(cl.members)) for f in cl.get(c)[0]}))
        return self._fields

    def numel(self, rank: int) -> int:
        return sum(f.box.numel for f in self._frags[rank])

    def _rank_classes(self) -> RankClasses:
        """Ranks that share one fragment tuple and one buffer map (replicas) form a class."""
        if self._classes is None:
            ids: dict[tuple[int, int], int] = {}
            of, members, built = [], [], {}
            for rank, (frags, bufs) in enumerate(zip(self._frags, self._buffers)):
                k = (id(frags), id(bufs))
                c = ids.get(k)
                if c is None:
                    c = ids[k] = len(members)
                    members.append([])
                    built[c] = (frags, bufs)
                members[c].append(rank)
                of.append(c)
            self._classes = RankClasses(of, [_ascending(m) for m in members], None, built)
        return self._classes

    # --- per key ---------------------------------------------------------------------------------
    def _holder_index(self) -> dict[StateKey, dict[Box, list[Holders]]]:
        """key -> box -> [Holders], built once over all classes."""
        if self._index is None:
            self._index = self._build_index()
        return self._index

    @without_gc
    def _build_index(self) -> dict[StateKey, dict[Box, list[Holders]]]:
        # Classes are walked in order of their first rank, so keys and boxes are first met in the
        # same order as in a rank-by-rank walk (a key's first holder is always some class's first
        # rank); ``expand`` puts a box's holders back in rank order.
        cl = self._rank_classes()
        index: dict[StateKey, dict[Box, list[Holders]]] = {}
        for c, ranks in enumerate(cl.members):
            frags, bufs = cl.get(c)
            dtypes = {n: b.dtype for n, b in bufs.items()}
            for f in frags:
                boxes = index.get(f.key)
                if boxes is None:
                    boxes = index[f.key] = {}
                h = tuple_new(Holders, (f, ranks, dtypes.get(f.buffer)))
                held = boxes.get(f.box)
                if held is None:
                    boxes[f.box] = [h]
                else:
                    held.append(h)
        return index

    def _key_index(self, key: StateKey) -> dict[Box, list[Holders]]:
        """box -> [Holders] of one key, from the family's ``holders`` when it has one."""
        if self._holders_fn is None or self._index is not None:
            return self._holder_index().get(key, {})
        boxes = self._key_index_cache.get(key)
        if boxes is None:
            boxes = self._key_index_cache[key] = {}
            for box, h in self._holders_fn(key, None):
                held = boxes.get(box)
                if held is None:
                    boxes[box] = [h]
                else:
                    held.append(h)
        return boxes

    def _holders_of(self, key: StateKey, box: Box) -> list[Holders]:
        """Every holder of exactly ``box`` of ``key``."""
        if self._holders_fn is None or self._index is not None:
            return self._holder_index().get(key, {}).get(box, [])
        return [h for b, h in self._holders_fn(key, box) if b == box]

    def _meeting(self, key: StateKey, box: Box) -> list[tuple[Box, list[Holders]]]:
        """The boxes of ``key`` that meet ``box``, sorted by ``(lo, hi)``, with their holders."""
        if self._holders_fn is not None and self._index is None:
            items = self._holders_fn(key, box)
            if len(items) == 1:
                return [(items[0][0], [items[0][1]])]
            found: dict[Box, list[Holders]] = {}
            for b, h in items:
                held = found.get(b)
                if held is None:
                    found[b] = [h]
                else:
                    held.append(h)
            return sorted(found.items(), key=_first)
        entry = self._meet.get(key)
        if entry is None:
            items = sorted(self._key_index(key).items(), key=_first)
            entry = self._meet[key] = (items, list(accumulate([b.hi[0] for b, _ in items], max)))
        items, reach = entry
        end = box.hi[0]
        out = []
        for i in range(bisect_right(reach, box.lo[0]), len(items)):
            b, held = items[i]
            if b.lo[0] >= end:
                break
            if _overlap(b, box):
                out.append(items[i])
        return out

    def _geometry(self, key: StateKey):
        """A hashable naming ``key``'s geometry (see ``Layout.lazy``), or None (no other key is
        known to share it)."""
        return self._geometry_fn(key) if self._geometry_fn is not None else None

    def _relocate(self, key: StateKey, fragment: Fragment) -> tuple[str, int]:
        """(buffer, offset) of ``key``'s fragment where a key of the same geometry has ``fragment``."""
        if key == fragment.key:
            return fragment.buffer, fragment.offset
        return self._relocate_fn(key, fragment)

    def _is_partition(self, key: StateKey) -> bool:
        """Whether any two boxes of ``key`` are equal or disjoint (its regions are its boxes)."""
        if self._partition:
            return True
        p = self._part.get(key)
        if p is None:
            p = self._part[key] = _pairwise_disjoint(sorted(self._key_index(key)))
        return p

    def all_keys(self) -> Iterable[StateKey]:
        return self._holder_index().keys()

    def groups(self, key: StateKey) -> dict[Box, list[tuple[int, Fragment]]]:
        """Distinct boxes of ``key`` and the (rank, fragment)s holding each (replicas share a box)."""
        return {box: expand(held) for box, held in self._key_index(key).items()}

    def regions(self, key: StateKey) -> tuple[Region, ...]:
        """Disjoint boxes covering everything held of ``key``, each with all of its holders,
        sorted by ``(lo, hi)`` (the planner relies on that order)."""
        r = self._regions.get(key)
        if r is None:
            r = self._regions[key] = disjoint_regions(self.groups(key))
        return r

    # --- checks ----------------------------------------------------------------------------------
    def validate(self, require_cover: bool = True) -> "Layout":
        """Raise one ``LayoutError`` listing every problem: unknown tensors, boxes outside their
        tensor, views outside their buffer, overlapping boxes of one key on one
        rank, and (``require_cover``) elements of the model no rank holds."""
        problems: list[str] = []
        spec = self.spec
        checked: set[tuple[int, int]] = set()
        for rank, (frags, bufs) in enumerate(zip(self._frags, self._buffers)):
            if (id(frags), id(bufs)) in checked:  # replicas share both: check them once
                continue
            checked.add((id(frags), id(bufs)))
            per_key: dict[StateKey, list[Box]] = {}
            for f in frags:
                if f.key.tensor not in spec:
                    problems.append(f"rank {rank}: unknown tensor {f.key.tensor!r} (not in model {spec.name!r})")
                    continue
                shape = spec[f.key.tensor].shape
                full = Box.full(shape)
                if len(f.box.lo) != len(shape) or f.box.empty or not full.contains(f.box):
                    problems.append(f"rank {rank}: box {f.box} of {f.key} is outside shape {shape}")
                    continue
                b = bufs.get(f.buffer)
                if b is None:
                    problems.append(f"rank {rank}: {f.key} points at undeclared buffer {f.buffer!r}")
                elif f.offset < 0 or f.span > b.numel:
                    problems.append(f"rank {rank}: {f.key} {f.box} spans [{f.offset}, {f.span}) "
                                    f"of buffer {f.buffer!r} which has {b.numel} elements")
                per_key.setdefault(f.key, []).append(f.box)
            for key, boxes in per_key.items():
                if len(boxes) > 1 and not _pairwise_disjoint(sorted(boxes)):
                    problems.append(f"rank {rank}: overlapping boxes of {key}")
        if require_cover and not problems:
            for field in self.fields() or (PARAM,):
                for t in spec.tensors:
                    if field not in (PARAM, MASTER) and not spec.trainable(t.name):
                        continue  # a frozen tensor (LoRA's base) has no optimizer state
                    key = StateKey(t.name, field)
                    held = sum(r.box.numel for r in self.regions(key))
                    if held != t.numel:
                        problems.append(f"{key}: ranks hold {held} of its {t.numel} elements "
                                        f"(the layout does not cover the tensor)")
        if problems:
            more = f" (and {len(problems) - 20} more)" if len(problems) > 20 else ""
            raise LayoutError(f"layout {self.name} is invalid: " + "; ".join(problems[:20]) + more)
        return self


def _rank_of(holder: tuple[int, Fragment]) -> int:
    return holder[0]


def _first(item):
    return item[0]


def _rebuild_layout(spec, frags, buffers, name, recipe):
    return Layout(spec, frags, buffers, name, recipe)


def union(*layouts: Layout, name: str | None = None) -> Layout:
    """Merge layouts of the same model and world (e.g. ZeRO-1: params replicated ∪ Adam state
    partitioned). Buffer names must not clash unless declared identically."""
    first = layouts[0]
    for lay in layouts[1:]:
        if lay.spec.digest != first.spec.digest:
            raise LayoutError(f"cannot merge {first.name} and {lay.name}: different models")
        if lay.world_size != first.world_size:
            raise LayoutError(f"cannot merge {first.name} (world {first.world_size}) and "
                              f"{lay.name} (world {lay.world_size})")
    frags, bufs = [], []
    for r in range(first.world_size):
        frags.append(tuple(f for lay in layouts for f in lay.fragments(r)))
        merged: dict[str, BufferSpec] = {}
        for lay in layouts:
            for n, b in lay.buffers(r).items():
                if merged.get(n, b) != b:
                    raise LayoutError(f"buffer {n!r} on rank {r} is declared twice differently")
                merged[n] = b
        bufs.append(merged)
    recipe = None
    if all(lay._recipe for lay in layouts):
        recipe = "union(" + ";".join(lay._recipe for lay in layouts) + ")"
    return Layout(first.spec, frags, bufs, name or "+".join(lay.name for lay in layouts), recipe)


def select(layout: Layout, tensors: Iterable[str], label: str, name: str | None = None) -> Layout:
    """The part of ``layout`` that holds ``tensors``, as a layout of the model of only those
    (``ModelSpec.subset(tensors, label)``): their fragments as they are — buffer names and offsets
    included, so a fused buffer stays the one buffer — and only the buffers those point into,
    each with its whole declaration. A move into it writes those tensors and leaves the rest of
    each rank's buffers alone (e.g. only a model's LoRA adapters, or only the weights they
    change); its source is a layout of the same subset."""
    spec = layout.spec.subset(list(tensors), label)
    wanted = frozenset(t.name for t in spec.tensors)
    frags, bufs = [], []
    for r in range(layout.world_size):
        kept = tuple(f for f in layout.fragments(r) if f.key.tensor in wanted)
        declared = layout.buffers(r)
        frags.append(kept)
        bufs.append({b: declared[b] for b in dict.fromkeys(f.buffer for f in kept)})
    return Layout(spec, frags, bufs, name or f"{layout.name}[{label}]", f"select({layout.digest};{spec.digest})")


def disjoint_regions(groups: Mapping[Box, Sequence[tuple[int, Fragment]]]) -> tuple[Region, ...]:
    """Split possibly overlapping boxes into disjoint regions, each listing every holder.

    The common case — a partition, possibly replicated — is detected by a sweep over dim 0 and
    returned as is; genuinely overlapping boxes are refined by box subtraction.
    """
    boxes = sorted(groups)  # a Box is the tuple (lo, hi): this sorts by (lo, hi)
    if _pairwise_disjoint(boxes):
        return tuple([tuple_new(Region, (b, tuple(groups[b]))) for b in boxes])
    regions: list[Region] = []
    for b in boxes:
        pending = [b]
        holders = tuple(groups[b])
        nxt: list[Region] = []
        for reg in regions:
            inter = reg.box.intersect(b)
            if inter is None:
                nxt.append(reg)
                continue
            nxt.append(Region(inter, reg.holders + holders))
            nxt.extend(Region(piece, reg.holders) for piece in subtract(reg.box, inter))
            pending = [p for q in pending for p in subtract(q, inter)]
        nxt.extend(Region(p, holders) for p in pending)
        regions = nxt
    return tuple(sorted(regions, key=lambda r: (r.box.lo, r.box.hi)))


def _pairwise_disjoint(boxes: Sequence[Box]) -> bool:
    """Sweep over dim 0 (``boxes`` sorted by ``lo``): only boxes whose dim-0 ranges overlap are
    compared, so a row partition costs O(n) and a column partition O(n²) in its (small) width."""
    active: list[Box] = []
    reach = 0  # the furthest dim-0 end in `active`
    for b in boxes:
        if active:
            start = b.lo[0]
            if start >= reach:  # b is past all of them (a row partition, every time)
                active = []
            elif b.hi[0] > start:  # (a b empty on dim 0 meets nothing: no checks)
                active = [o for o in active if o.hi[0] > start]
                # every box left holds `start` on dim 0, and so does b: only the other dims decide
                if len(b.lo) == 2:  # matrices, the common case: dim 1's test written out
                    lo1, hi1 = b.lo[1], b.hi[1]
                    for other in active:
                        olo1, ohi1 = other.lo[1], other.hi[1]
                        if (ohi1 if ohi1 < hi1 else hi1) > (olo1 if olo1 > lo1 else lo1):
                            return False
                else:
                    for other in active:
                        if _overlap(other, b, 1):
                            return False
        if active:
            active.append(b)
            if b.hi[0] > reach:
                reach = b.hi[0]
        else:
            active = [b]
            reach = b.hi[0] if b.hi else 0
    return True


def _overlap(a: Box, b: Box, first_dim: int = 0) -> bool:
    """``a.intersect(b) is not None`` without building the intersection (dims from
    ``first_dim`` on, when the caller knows the boxes meet on those before it)."""
    alo, ahi, blo, bhi = a.lo, a.hi, b.lo, b.hi
    for i in range(first_dim, len(alo)):
        if (ahi[i] if ahi[i] < bhi[i] else bhi[i]) <= (alo[i] if alo[i] > blo[i] else blo[i]):
            return False
    return True


def subtract(a: Box, b: Box) -> list[Box]:
    """``a - b`` as at most 2·ndim disjoint boxes (``b`` is clipped to ``a``)."""
    inter = a.intersect(b)
    if inter is None:
        return [a]
    out = []
    lo, hi = list(a.lo), list(a.hi)
    for d in range(len(lo)):
        if lo[d] < inter.lo[d]:
            out.append(Box(tuple(lo), tuple(hi[:d] + [inter.lo[d]] + hi[d + 1:])))
            lo[d] = inter.lo[d]
        if inter.hi[d] < hi[d]:
            out.append(Box(tuple(lo[:d] + [inter.hi[d]] + lo[d + 1:]), tuple(hi)))
            hi[d] = inter.hi[d]
    return out
