"""``elastic.rebalance: update`` — the rollout replicas' devices join the trainer world for the update.

In the synchronous loop with rollout replicas on devices of their own (``rollout.mode:
disaggregated``), those devices are idle from the end of the rollout to the next sync, and the
trainer's are idle while the replicas generate. With rebalance, a second trainer world spans both:
the trainer's N devices and the replicas' M, its layouts the run's scaled along DP
(``rlhf_switch.problems.scaled_run``). It is built once, in the background, while the first
iterations run (its actors take no share of Ray's: the bundles are the trainer's and the replicas'
own, like a combined resize's new trainers). Each iteration then:

    rollout     on the replicas, the small world idle
    grow        the training state (weights, fp32 master, Adam moments, step, LR schedule, RNG)
                moves from the N-rank world into the (N+M)-rank one: one VPS move over the union
                of both worlds' ranks (the elastic resize's ``resize_move``), nothing released
    logprobs,   on N+M ranks
    update
    shrink      the state moves back into the N-rank world, which syncs the replicas as always

Both worlds keep their engines: a move overwrites the receiving world's state whole, so the state
is where it would be without the round trip, bit for bit (``tests/test_rebalance.py``). The
weight channel stays between the N-rank world and the replicas.

``auto`` grows only where it pays (``choose``): it trains in the trainer's own world until the
grown one is built, measures each way warm (a way's first run is its warm-up and is not compared),
then takes whichever of the two last took less (log-probs + update, plus the two moves when grown),
measuring the other again every ``PROBE_EVERY`` iterations.

``elastic.lend`` (``Lending``) moves devices the other way: while the synchronous loop waits for
samples the trainer's devices are idle, so replicas on them (started with the others, fed by the
same weight channel at every sync) take a share of the rollout's prompts — every iteration
(``rollout``) or where that last made the rollout shorter (``auto``). Neither is run on CUDA (the
grown world's actors would need the replicas' devices handed to them, as a colocated replica's
are; a lent replica would need the trainer's memory freed while it generates).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from recipes.cluster import stop_actors, wait_all

# (CPU, GPU) the grown world's actors take of Ray's: none — their bundles are held whole by the
# trainer ranks and the replicas already there (``resize.COMBINED_TRAINER_SLOT``)
REBALANCE_SLOT = (0.0, 0.0)
# rebalance: auto — how many iterations the way not taken goes unmeasured before it is tried again
PROBE_EVERY = 8


def choose(built: bool, last: dict, measured_at: dict, it: int, probe_every: int = PROBE_EVERY,
           ways: tuple[str, str] = ("grown", "static")) -> tuple[bool, str]:
    """``auto``'s choice for iteration ``it``: (take the first of ``ways``, why). ``rebalance:
    auto``: ``("grown", "static")``, ``last`` the seconds the train phase last took each way, warm
    (``"static"``: log-probs + update in the trainer's world; ``"grown"``: the same in the grown
    world plus both moves); ``lend: auto``: ``("lent", "own")``, the rollout phase with the
    replicas lent the trainer's devices or without. ``measured_at``: the iteration each was last
    measured. A way without a warm measurement is taken (``Ways``: a way's first run warms it up
    and is not compared). Pure."""
    tried, default = ways
    if not built:
        return False, "the grown world is still building"
    for way in ways:
        if way not in last:
            return way == tried, f"no warm measurement of {way} yet"
    for way in ways:
        if it - measured_at[way] > probe_every:
            return way == tried, f"{way} last measured at iteration {measured_at[way]}: measured again"
    take = last[tried] < last[default]
    return take, f"{tried} {last[tried]:.3f} s {'<' if take else '>='} {default} {last[default]:.3f} s"


@dataclass
class Ways:
    """``auto``'s measurements of a phase run two ways (``ways``: the one tried first, the default):
    the seconds each last took, warm, and the iteration it was measured at — ``choose``'s input.
    A way's first run is its warm-up (an engine's first call, a world's first move: seconds where
    a warm one takes milliseconds) and is not compared: only runs after it are."""

    ways: tuple[str, str]
    last: dict[str, float] = field(default_factory=dict)
    measured_at: dict[str, int] = field(default_factory=dict)
    runs: dict[str, int] = field(default_factory=dict)

    def choose(self, it: int, built: bool = True) -> tuple[bool, str]:
        """(take the first way at iteration ``it``, why): ``choose``."""
        return choose(built, self.last, self.measured_at, it, ways=self.ways)

    def measured(self, it: int, seconds: float, first: bool) -> None:
        """Iteration ``it``'s phase took ``seconds``, the first way or the other (kept from the
        way's second run on)."""
        way = self.ways[0 if first else 1]
        self.runs[way] = self.runs.get(way, 0) + 1
        if self.runs[way] > 1:
            self.last[way], self.measured_at[way] = seconds, it


class Rebalance:
    """The grown trainer world of a run and the moves into it and back."""

    def __init__(self, cluster, cfg, init_dir, quiet: bool = True):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from actors.hybrid import remote_class
        from rlhf_switch.problems import scaled_run

        if cluster.device.is_cuda:  # fail closed: nothing of this ran on a GPU
            raise ValueError("elastic.rebalance on CUDA is not built yet (the grown world's actors take no GPU share "
                             "of Ray's; the replicas' devices are not handed to them)")
        self.cluster, self.ray, self.quiet = cluster, cluster.ray, quiet
        self.small = cluster.world
        # the replicas' own devices (not those lent the trainer's: elastic.lend)
        lent = [s.bundle for i, s in enumerate(cluster.resources.replicas) if i not in cluster.lent
                for _ in range(cluster.tp)]
        self.cfg = scaled_run(cfg.model_copy(update={"elastic": None}), self.small + len(lent))
        self.world = self.cfg.world_size
        slots = [cluster._slot(b) for b in list(range(self.small)) + lent]
        cpus, gpus = REBALANCE_SLOT
        cls = remote_class(num_cpus=cpus, num_gpus=gpus)
        self.t0 = time.perf_counter()
        self.workers = [cls.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            pg, placement_group_bundle_index=index)).remote() for pg, index in slots]
        address = self.workers[0].open_store.remote()
        self._building = [w.init_world_at.remote(address, r, self.world, cluster.device)
                          for r, w in enumerate(self.workers)]
        self._building += [w.build_empty.remote(self.cfg, str(init_dir)) for w in self.workers]
        self.built_s: float | None = None
        self._home = None  # the small world's actors while the grown world trains
        self.auto = Ways(("grown", "static"))  # the train phase (log-probs + update), each way

    def built(self) -> bool:
        """Whether the grown world's build is done (not waited for)."""
        if self.built_s is None and len(self.ray.wait(self._building, num_returns=len(self._building),
                                                      timeout=0)[0]) == len(self._building):
            self.wait()
        return self.built_s is not None

    @property
    def grown(self) -> bool:
        return self._home is not None

    def wait(self) -> float:
        """Wait for the grown world's build (once); returns the seconds waited now."""
        if self.built_s is not None:
            return 0.0
        t0 = time.perf_counter()
        wait_all(self.ray, self._building, f"build the grown trainer world ({self.world} ranks)", self.quiet)
        self.built_s = time.perf_counter() - self.t0
        return time.perf_counter() - t0

    def grow(self) -> dict:
        """The state into the grown world, which the cluster's train calls then reach."""
        if self.grown:
            raise ValueError("rebalance: the trainer world is grown already")
        waited = self.wait()
        out = self._move(self.cluster.workers, self.workers)
        self._home = self.cluster.workers
        self.cluster.workers, self.cluster.world = list(self.workers), self.world
        return {**out, "waited_for_build_s": waited}

    def shrink(self) -> dict:
        """The state back into the trainer's own world."""
        if not self.grown:
            raise ValueError("rebalance: the trainer world is not grown")
        out = self._move(self.workers, self._home)
        self.cluster.workers, self.cluster.world, self._home = self._home, self.small, None
        return out

    def _move(self, senders: list, receivers: list) -> dict:
        """One move of the whole training state from ``senders`` (only read) to ``receivers``
        (overwritten) over the union of their ranks."""
        from rlhf_switch.elastic import ResizePlan
        from rlhf_switch.elastic.manager import bytes_moved, union_move

        big, small = tuple(range(self.world)), tuple(range(self.small))
        plan = ResizePlan(small, big) if len(senders) == self.small else ResizePlan(big, small)
        t0 = time.perf_counter()
        members = union_move(self.ray, senders, receivers, plan)
        return {"seconds": time.perf_counter() - t0, "join_s": max(m["join_s"] for m in members),
                "move_s": max(m["move_s"] for m in members), "bytes_moved": bytes_moved(members),
                "bytes_sent": sum(m["bytes_sent"] for m in members if m["side"] == "old")}

    def close(self) -> None:
        """The grown world's actors shut down (after a shrink: the trainer's own world holds the state)."""
        if self.grown:
            self.cluster.workers, self.cluster.world, self._home = self._home, self.small, None
        stop_actors(self.ray, self.workers)
        self.workers = []
