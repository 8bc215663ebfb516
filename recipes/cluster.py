"""The actors of one run and the phases that involve all of them, on Ray.

The driver is Ray's single controller. ``Cluster`` owns the actors: one ``HybridWorker`` per
logical device (training engine, reference, and for ``rollout.engine: torch`` the rollout engine)
and, for a rollout engine of placement ``replica`` (vLLM), one ``RolloutReplica`` per replica, colocated on the same
placement-group bundles (packed on few nodes or spread over many by the config's ``placement``;
rank -> bundle by ``rank_bundles``, which keeps a replica's TP ranks on one node). ``Cluster.open_channel`` forms the run's weight channel once; ``Cluster.sync``
is the weight switch train -> rollout through it. ``Cluster.start_replicas`` / ``swap_replicas``
change the replicas' layout (TP × replicas) of a running world: the new ones start in the
background, then the channel is formed again over them and one sync fills them (elastic).
"""
from __future__ import annotations

import time
from contextlib import contextmanager
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence


@dataclass(frozen=True)
class Slot:
    """Where one actor goes: a placement-group bundle and what it takes of it."""

    bundle: int
    num_cpus: float
    num_gpus: float


@dataclass(frozen=True)
class Resources:
    """The placement group of a run and every actor's slot in it (``resources``)."""

    bundles: tuple[dict, ...]
    workers: tuple[Slot, ...]                    # one hybrid worker per trainer rank
    replicas: tuple[Slot, ...]                   # one actor per rollout replica (placement "replica")
    replica_devices: tuple[tuple[int, ...], ...]  # colocated: the bundles whose devices replica r's workers use

    @property
    def devices(self) -> int:
        return int(sum(b.get("GPU", 0) for b in self.bundles))

    @property
    def cpus(self) -> float:
        return float(sum(b.get("CPU", 0) for b in self.bundles))


# what a rollout replica started while the old replicas still run takes of its first device's bundle
# (CPU, GPU): that bundle's trainer rank (0.5, 0.5) and old replica (0.4, 0.5) leave (0.1, 0) free
TRANSITION_SLOT = (0.1, 0.0)
# what a replica lent the trainer's devices (elastic.lend) takes of its first device's bundle (CPU,
# GPU): the trainer rank there holds (0.5, 1.0) when the replicas have devices of their own; the
# GPUs are handed to it by id, as a colocated replica's are
LENT_SLOT = (0.4, 0.0)


@dataclass
class Generation:
    """A generation in flight on the rollout replicas: each call's (replica actor, prompts, seeds)
    and its ref — what a lost replica's prompts are generated again from."""

    shares: list
    refs: list
    max_new_tokens: int
    temperature: float


@dataclass
class IncomingReplicas:
    """Rollout replicas of a new layout, starting in the background (``Cluster.start_replicas``)."""

    cfg: object            # the run config whose rollout layout they make
    actors: list
    starts: list           # their engines' start refs
    devices: list          # per replica, the GPU ids handed to it
    t0: float              # perf_counter at the start
    owner: object = None   # the Cluster that started them

    def ready(self, ray) -> bool:
        return not ray.wait(self.starts, num_returns=len(self.starts), timeout=0)[1]

    def abandon(self) -> None:
        self.owner.abandon_replicas()


def resources(world: int, tp: int, replica_placement: bool, colocate: bool = True, lend: bool = False) -> Resources:
    """The bundles and actor slots of a run of ``world`` trainer devices whose rollout engine runs
    replicas of TP ``tp`` (``replica_placement``: in actors of their own, vLLM; else inside the
    hybrid workers). Pure.

    Colocated (the default): one bundle per device; its hybrid worker and (placement replica) the
    replica that starts on it take half each, and replica ``r``'s TP workers use the ``tp`` whole
    devices of bundles ``r·tp .. r·tp+tp-1`` (a Ray actor holds a share of ONE bundle, so those
    devices are handed to it, ``replica_devices``). Not colocated: the trainer's devices, then one
    bundle of ``tp`` devices per replica, all its own; ``lend`` (``elastic.lend``): after those
    replicas, as many again on the trainer's devices — each beside the trainer rank of its first
    device (``LENT_SLOT``), its TP workers handed that rank's and the next ones' devices as a
    colocated replica's are."""
    device = {"CPU": 1, "GPU": 1}
    workers = tuple(Slot(i, 0.5, 0.5 if colocate else 1.0) for i in range(world))
    if not replica_placement:
        return Resources((device,) * world, workers, (), ())
    n = world // tp
    if colocate:
        replicas = tuple(Slot(r * tp, 0.4, 0.5) for r in range(n))
        return Resources((device,) * world, workers, replicas,
                         tuple(tuple(range(r * tp, (r + 1) * tp)) for r in range(n)))
    replicas = tuple(Slot(world + r, 1, tp) for r in range(n))
    bundles = (device,) * world + ({"CPU": 1, "GPU": tp},) * n
    if not lend:
        return Resources(bundles, workers, replicas, ())
    lent = tuple(Slot(r * tp, *LENT_SLOT) for r in range(n))
    return Resources(bundles, workers, replicas + lent,
                     ((),) * n + tuple(tuple(range(r * tp, (r + 1) * tp)) for r in range(n)))


def lent_replicas(res: Resources, world: int, colocate: bool) -> list[int]:
    """The replicas of ``res`` on the trainer's devices of a run whose replicas have devices of
    their own (``elastic.lend``): they generate only in the iterations that lend them. Pure."""
    return [] if colocate else [i for i, s in enumerate(res.replicas) if s.bundle < world]


def resources_for(cfg, lend: bool = False) -> Resources:
    """``resources`` of a run config (of one world: ``lend`` is the run's ``elastic.lend``)."""
    from rlhf_switch.engines.base import rollout_engine

    return resources(cfg.world_size, cfg.rollout.tp, rollout_engine(cfg.rollout.engine).placement == "replica",
                     cfg.rollout.colocate, lend)


def start_ray(cfg, world: int, verbose: bool = False):
    """Ray for this run: the session already running in this process (tests share one per
    module), the cluster at ``ray_address``, or an embedded one. Returns (ray, owned).

    Everything the run's actors need from their environment travels in the job's
    ``runtime_env`` (``rlhf_switch.runtime_env.job_runtime_env``): the rollout engine's variables
    (``RolloutEngine.process_env``: vLLM's, its log level INFO only when ``verbose``), the project's
    code — this checkout's path on an embedded Ray, the packages shipped (``py_modules``) to a
    cluster joined at ``ray_address`` —, and the hook that keys the compiled-kernel caches on each
    worker's machine. Nothing is set in the driver's environment. A session already running must
    carry the same (``session_env``).

    The embedded instance has the CPUs the run's bundles need (``resources_for``) and, on a run
    that resolves to ``cpu`` here, as many logical GPUs (Ray then only counts them: nothing
    computes on them); on ``cuda`` Ray counts this machine's real GPUs itself. Starting it, Ray's
    notice that it enabled token authentication (its default for a new local cluster) is not
    printed: ``quiet_default_token_auth_notice``."""
    import ray

    env = run_runtime_env(cfg, verbose)
    if ray.is_initialized():
        session_env(ray, env)
        return ray, False
    if cfg.ray_address:
        ray.init(address=cfg.ray_address, runtime_env=env, log_to_driver=True)
    else:  # never join a stale cluster on the machine
        from rlhf_switch.device import cuda_available, resolve_device

        res = resources_for(cfg)
        logical = resolve_device(cfg.device, cuda_available(), cfg.model.dtype).kind == "cpu"
        with quiet_default_token_auth_notice():
            ray.init(address="local", num_cpus=max(world, int(res.cpus)),
                     num_gpus=max(world, res.devices) if logical else None,
                     log_to_driver=True, include_dashboard=False, runtime_env=env)
    return ray, True


def run_runtime_env(cfg, verbose: bool = False) -> dict:
    """The job's ``runtime_env`` of a run of ``cfg`` (``start_ray``)."""
    from rlhf_switch.engines.base import rollout_engine
    from rlhf_switch.runtime_env import job_runtime_env

    return job_runtime_env(rollout_engine(cfg.rollout.engine).process_env(verbose), ship_code=bool(cfg.ray_address))


def session_env(ray, needed: dict) -> None:
    """A Ray session this process joined before the run (``ray.init`` by the caller): its job's
    ``runtime_env`` must carry what the run's actors need (``needed``), or ``RuntimeError`` says
    what is missing and how to start it — before any actor starts."""
    from rlhf_switch.runtime_env import missing_from_job

    missing = missing_from_job(needed, ray.get_runtime_context().runtime_env)
    if missing:
        raise RuntimeError(
            f"the Ray session this process joined does not carry what the run's actors need from their environment "
            f"(missing: {', '.join(missing)}); start it with ray.init(..., runtime_env=rlhf_switch.runtime_env."
            f"job_runtime_env(...)) as recipes.cluster.run_runtime_env(cfg) builds it, or let the run start Ray")


TOKEN_AUTH_NOTICE = "Token authentication is enabled for this Ray cluster"


@contextmanager
def quiet_default_token_auth_notice():
    """Around ``ray.init`` of the embedded instance only: drop Ray's warning "Token authentication
    is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled to opt out…", which Ray 2.60 logs
    whenever it starts a local cluster with ``RAY_AUTH_MODE`` unset
    (``ray._private.authentication.authentication_token_setup._warn_token_auth_enabled``). Token
    authentication itself stays on, as Ray chose; only that one line of that one logger is
    filtered, and only while the embedded instance starts (joining ``ray_address`` is untouched;
    every other warning passes). Setting ``RAY_AUTH_MODE=token`` in the environment instead would
    also silence it, but the driver's cached Ray config would not see it (the driver then fails to
    authenticate to its own GCS)."""
    import logging

    class DropNotice(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return not record.getMessage().startswith(TOKEN_AUTH_NOTICE)

    logger = logging.getLogger("ray._private.authentication.authentication_token_setup")
    drop = DropNotice()
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


@contextmanager
def phase(desc: str, total: int, quiet: bool):
    """A progress bar for one phase of an iteration (``update`` per finished actor call)."""
    from tqdm import tqdm

    bar = tqdm(total=total, desc=desc, leave=False, disable=quiet, dynamic_ncols=True)
    try:
        yield bar
    finally:
        bar.close()


def wait_all(ray, refs: list, desc: str, quiet: bool, timeout: float = 900, died: list | None = None,
             failed=None) -> list:
    """``ray.get`` of ``refs`` in order, with a progress bar that advances as each finishes; the
    first failure is raised at once (the others are not waited for). ``died``: a list that takes
    the index of each call whose actor died (its result None) instead of raising. ``failed(index,
    error)``: the exception raised instead of Ray's ``RayTaskError`` when a call raised (the caller
    names the member; the error is chained)."""
    from ray.exceptions import RayActorError, RayTaskError

    pending, index = list(refs), {ref: i for i, ref in enumerate(refs)}
    deadline = time.monotonic() + timeout
    with phase(desc, len(refs), quiet) as bar:
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not done:
                raise TimeoutError(f"{desc}: {len(pending)} of {len(refs)} actor calls unfinished after {timeout} s")
            try:
                ray.get(done)  # raises the actor's error here
            except RayActorError:
                if died is None:
                    raise
                died.append(index[done[0]])
            except RayTaskError as e:
                if failed is None:
                    raise
                raise failed(index[done[0]], e) from e
            bar.update(len(done))
    return [None if died and i in died else ray.get(ref) for i, ref in enumerate(refs)]


def stop_actors(ray, actors: Sequence) -> None:
    """Shut the engines of ``actors`` down (their worker processes too), then free the actors."""
    try:
        ray.get([a.shutdown.remote() for a in actors], timeout=60)
    except Exception:  # noqa: BLE001 - best effort: the actors are killed next
        pass
    for a in actors:
        ray.kill(a)


# config ``placement`` -> the placement group's strategy (SPREAD is Ray's best-effort spread: on one
# node every bundle still fits)
STRATEGIES = {"pack": "PACK", "spread": "SPREAD"}


class PlacementError(RuntimeError):
    """The placement group's bundles landed where a rollout replica cannot run."""


def rank_bundles(bundle_nodes: Sequence[str], group: int = 1) -> list[int]:
    """Rank -> placement-group bundle: the bundles grouped by node (nodes in the order of their
    first bundle, bundles in index order within a node), so every ``group`` consecutive ranks — a
    rollout replica's TP devices, whose workers run inside one actor — share a node. On one node,
    and whenever Ray packed the bundles in order, this is the identity. ``bundle_nodes[b]``: the
    node of bundle ``b``. Raises ``PlacementError`` when a group would span nodes."""
    nodes = list(dict.fromkeys(bundle_nodes))
    order = sorted(range(len(bundle_nodes)), key=lambda b: (nodes.index(bundle_nodes[b]), b))
    for first in range(0, len(order), group):
        spanned = sorted({bundle_nodes[b] for b in order[first:first + group]}, key=nodes.index)
        if len(spanned) > 1:
            counts = {n[:8]: bundle_nodes.count(n) for n in nodes}
            raise PlacementError(
                f"ranks {first}..{first + group - 1} (one rollout replica of tp {group}) would span nodes "
                f"{[n[:8] for n in spanned]}: its workers run inside one actor on one node. Devices per node "
                f"{counts}: use placement: pack, or nodes whose device counts are multiples of {group}")
    return order


class RolloutEngineFailed(RuntimeError):
    """A rollout engine that failed to start or while generating — its call raised, or its replica
    died and none is left to generate its share: one line naming the member (rollout replica, or
    the trainer rank whose actor runs the engine, with its node) and the engine's own error."""


def engine_error(error: Exception) -> str:
    """``Type: first line of the message`` of the exception a Ray call raised inside the actor (the
    engine's own, ``RayTaskError.cause``), not Ray's wrapper with the remote traceback."""
    cause = getattr(error, "cause", None)
    cause = cause if isinstance(cause, BaseException) else error
    lines = [line.strip() for line in str(cause).splitlines() if line.strip()]
    return f"{type(cause).__name__}: {lines[0] if lines else '(no message)'}"


class SyncFailed(RuntimeError):
    """A weight sync that failed, naming the channel member(s) lost — an actor Ray reports dead
    (``ActorDiedError``), else the ranks the surviving members' ``PeerLost`` errors name — as
    trainer rank / rollout replica and worker, with the node each was placed on."""

    def __init__(self, message: str, lost: list[str]):
        super().__init__(message)
        self.lost = lost


class Cluster:
    """The actors of one run and the phases that involve all of them."""

    def __init__(self, cfg, ray, quiet: bool = False, devices: Sequence | None = None, lend: bool = False):
        """``devices``: one (placement group, bundle index) per rank, owned by the caller (the
        elastic device manager, whose devices outlive a world); by default the cluster makes and
        owns a placement group of ``world_size`` devices. ``lend``: replicas on the trainer's
        devices too (``elastic.lend``; ``resources``)."""
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from actors.hybrid import hf_config_of, remote_class
        from rlhf_switch.problems import world_device
        from rlhf_switch.engines.base import rollout_engine

        self.cfg, self.quiet, self.ray = cfg, quiet, ray
        self.hf = hf_config_of(cfg)
        self.world = world = cfg.world_size
        self.workers, self.replicas = [], []
        self._incoming = None  # new rollout replicas starting in the background (start_replicas)
        self.rollout_cls = rollout_engine(cfg.rollout.engine)
        self.in_world = self.rollout_cls.placement == "worker"
        self.resources = res = resources_for(cfg, lend)
        self.tp, self.n_replicas = cfg.rollout.tp, len(res.replicas) or world // cfg.rollout.tp
        self.lending = False  # elastic.lend: whether the replicas on the trainer's devices generate now
        self.owns_devices = devices is None
        if devices is None:
            self.pg = placement_group(list(res.bundles), strategy=STRATEGIES[cfg.placement])
            ray.get(self.pg.ready(), timeout=120)  # pg.ready() can pend forever
            # rank r sits on bundle self.bundles[r]: a colocated replica's tp ranks on one node
            # (rank_bundles); the bundles after the trainer's (rollout.colocate: false) hold one whole
            # replica each
            bundle_nodes = ray.util.placement_group_table(self.pg)["bundles_to_node_id"]
            try:
                self.bundles = rank_bundles([bundle_nodes[b] for b in range(world)],
                                            1 if self.in_world or not cfg.rollout.colocate else self.tp)
            except PlacementError:
                from ray.util.placement_group import remove_placement_group

                remove_placement_group(self.pg)
                raise
            self.devices = [(self.pg, b) for b in self.bundles]  # rank r: (placement group, bundle)
        else:  # the elastic device manager's: one per trainer rank, nothing else placed
            if len(devices) != world or len(res.bundles) != world:
                raise ValueError(f"{len(devices)} caller-owned devices for a world of {world} whose run needs "
                                 f"{len(res.bundles)} bundles")
            self.pg, self.devices = None, list(devices)
            self.bundles = [index for _, index in self.devices]

        def on(bundle: int):
            pg, index = self._slot(bundle)
            return PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index)

        self.workers = [remote_class(num_cpus=s.num_cpus, num_gpus=s.num_gpus).options(scheduling_strategy=on(s.bundle))
                        .remote() for s in res.workers]
        # the run's device, backend and dtypes: resolved once, from what the actors on their
        # bundles see (cuda only if every one sees a GPU)
        seen = ray.get([w.devices_seen.remote() for w in self.workers], timeout=180)
        try:
            self.device = world_device(cfg, all(s["cuda"] for s in seen))
            if self.lent and self.device.is_cuda:  # fail closed: nothing of this ran on a GPU
                raise ValueError("elastic.lend on CUDA is not built yet (a replica lent the trainer's GPUs would "
                                 "need the trainer's memory freed while it generates)")
        except Exception:  # a ConfigError: nothing of this run may stay behind on a joined cluster
            self.shutdown(graceful=False)
            raise
        self._replica_gpus: list[list[str]] = []
        self._gpus_seen = [s["gpu_ids"] for s in seen]  # per trainer rank: replicas started later use them
        if not self.in_world:
            from actors.rollout_replica import remote_class as replica_class

            self.replicas = [replica_class(num_cpus=s.num_cpus, num_gpus=s.num_gpus)
                             .options(scheduling_strategy=on(s.bundle)).remote() for s in res.replicas]
            # colocated: replica r's workers use the (whole) devices of the trainer ranks it shares
            self._replica_gpus = self._gpus_of(res)
        # rank 0 hosts the world's store on its own node's address: nothing assumes one host
        host, port = ray.get(self.workers[0].open_store.remote(), timeout=180)
        ray.get([w.init_world.remote(host, port, r, world, self.device) for r, w in enumerate(self.workers)],
                timeout=180)
        self.channel_opened = 0
        self.handoff = "p2p"  # the weight channel's, once opened (rollout.handoff resolved)
        self._standing_by = None  # the replicas' receives posted ahead of the next sync
        self.replica_events: list[dict] = []  # replicas lost mid-generation, their prompts re-queued

    def all(self, method: str, *args, desc: str | None = None, **kwargs) -> list:
        return self.collect(self.submit(method, *args, **kwargs), desc or method)

    def submit(self, method: str, *args, **kwargs) -> list:
        """Every trainer rank's call of ``method``, not waited for (``collect``): what the driver
        asks next is queued behind it on each worker (a worker runs its calls in order)."""
        return [getattr(w, method).remote(*args, **kwargs) for w in self.workers]

    def collect(self, refs: list, desc: str) -> list:
        return wait_all(self.ray, refs, desc, self.quiet)

    def build(self, init_dir: Path, resume_dir: Path | None) -> dict:
        """Build every engine (rollout replicas start from ``init_dir`` while the trainers
        build), then open the weight channel between them — once for the whole run."""
        gpus = self._replica_gpus or [None] * len(self.replicas)
        starts = [r.start.remote(self.cfg.rollout.engine, self._replica_context(self.cfg, init_dir, i), gpus[i])
                  for i, r in enumerate(self.replicas)]
        built = self.all("build", self.cfg.model_dump(), str(init_dir), str(resume_dir) if resume_dir else None,
                         self.device, desc="build engines")
        if starts:
            wait_all(self.ray, starts, "start rollout replicas", self.quiet, failed=lambda i, e: RolloutEngineFailed(
                f"{self._replica_name(i)} failed to start its engine: {engine_error(e)}"))
        self.open_channel()
        return built[0]

    def _replica_context(self, cfg, init_dir, replica: int):
        """The ``RolloutContext`` replica ``replica`` of ``cfg``'s rollout layout starts from."""
        from rlhf_switch.engines.base import RolloutContext
        from rlhf_switch.families import context_length

        tp = cfg.rollout.tp
        # this run's replicas (with those lent the trainer's devices), or a new layout's
        replicas = len(self.resources.replicas) if cfg is self.cfg else cfg.world_size // tp
        return RolloutContext(self.hf, self._rollout_spec(cfg), str(init_dir), tp, replicas, replica,
                              cfg.seed, context_length(self.hf), device=self.device,
                              memory_utilization=cfg.rollout.memory_utilization, options=dict(cfg.rollout.options))

    def _rollout_spec(self, cfg):
        """The model a replica holds: the base, or with a LoRA run's adapters where each sync
        moves those (``engines.lora.WeightSync``: the replica then computes with them itself)."""
        from rlhf_switch.engines.lora import WeightSync
        from rlhf_switch.models import model_spec

        spec, lora = model_spec(self.hf), cfg.model.lora
        if lora is None:
            return spec
        full = spec.with_adapters(lora.spec())
        sync = WeightSync.choose(full, lora.sync, self.rollout_cls.takes_adapters, self.device.compute_dtype)
        return full if sync.mode == "adapters" else spec

    def _gpus_of(self, res: Resources) -> list[list[str]]:
        """Colocated: the GPU ids replica r's workers use — the whole devices of the trainer ranks
        it shares (``res.replica_devices``)."""
        seen = self._gpus_seen  # per device of the current world; one it does not use: not known ([])
        return [[g for b in bundles for g in (seen[b] if b < len(seen) else [])] for bundles in res.replica_devices]

    # --- the rollout layout of a running world (elastic, vLLM replicas) -----------------------------
    def start_replicas(self, cfg, init_dir: Path, devices: Sequence | None = None) -> "IncomingReplicas":
        """Start the rollout replicas of ``cfg``'s rollout layout (vLLM: its TP × replicas, on the
        same trainer world) in the background; returns at once — the current replicas keep
        syncing and generating meanwhile. ``devices``: one (placement group, bundle index) per
        rank of ``cfg``'s world when that is a new trainer world (a combined resize,
        ``recipes/resize.py``; ``adopt`` finishes it): the replicas go on its devices. Each new
        replica starts on its first device's bundle beside the trainer rank and the replica
        already there: during the transition it takes a
        CPU share of ``TRANSITION_SLOT`` and no GPU share of Ray's (its devices are handed to it by
        id, as a colocated replica's other devices always are), so nothing waits for the old
        replicas to leave. ``swap_replicas`` finishes it at an iteration boundary."""
        from actors.rollout_replica import remote_class as replica_class

        if self.in_world or self._incoming is not None:
            raise ValueError("start_replicas: " + ("the rollout engine lives in the trainer's actors" if self.in_world
                                                   else "new replicas are already starting"))
        if devices is not None and len(devices) != cfg.world_size:
            raise ValueError(f"start_replicas: {len(devices)} devices for a world of {cfg.world_size}")
        if ((devices is None and cfg.world_size != self.world) or cfg.rollout.engine != self.cfg.rollout.engine
                or not cfg.rollout.colocate):
            raise ValueError("start_replicas: only the rollout layout of a colocated world and the same engine changes "
                             "(a new trainer world: give its devices)")
        res = resources_for(cfg)
        gpu_ids = self._gpus_of(res)
        unknown = [b for bundles in res.replica_devices for b in bundles if b >= len(self._gpus_seen)]
        if self.device.is_cuda and unknown:  # fail closed: not run here
            raise ValueError("start_replicas: the GPU ids of devices the current world does not use are not known "
                             "(a grown trainer world with vLLM replicas on CUDA is not built yet)")
        cpus, gpus = TRANSITION_SLOT
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        on = ((lambda b: PlacementGroupSchedulingStrategy(devices[b][0], placement_group_bundle_index=devices[b][1]))
              if devices is not None else self._on)
        actors = [replica_class(num_cpus=cpus, num_gpus=gpus).options(
            scheduling_strategy=on(s.bundle)).remote() for s in res.replicas]
        devices = gpu_ids
        starts = [a.start.remote(cfg.rollout.engine, self._replica_context(cfg, init_dir, i), devices[i])
                  for i, a in enumerate(actors)]
        # and one short generation each (after the start: Ray runs an actor's calls in order): an
        # engine's first generation is far slower than the next (vLLM's warm-up, ~45 s on the loaded
        # CPU box) — paid here in the background, not in the first iteration after the swap. Its
        # tokens are dropped; the fill's receive resets the prefix cache
        eos = self.hf.get("eos_token_id")
        starts += [a.generate.remote([[int(self.hf.get("bos_token_id") or 1)]], 2, 1.0, [0], eos) for a in actors]
        self._incoming = IncomingReplicas(cfg, actors, starts, devices, time.perf_counter(), self)
        return self._incoming

    def swap_replicas(self, timeout_s: float = 600.0, fall_back: bool = True) -> dict:
        """The stop-the-world of a rollout layout change (``start_replicas``): wait for what is left
        of the new replicas' start, re-form the weight channel over the trainer ranks and the new
        replicas (the channel's own join and plan), fill them with one sync before they take any
        work, then shut down the replicas that leave. A new replica that failed to start, or a
        channel that fails to form or fill: the new replicas are killed, the channel is formed
        again over the old ones (they still hold the trainer's last weights) and ``ValueError``
        says why — the run goes on in the old layout. ``fall_back=False`` (``adopt``: the trainer
        world the old replicas were fed by is gone): no channel is formed again and
        ``RuntimeError`` says why. Returns the resize's figures."""
        if self._incoming is None:
            raise ValueError("swap_replicas: no new replicas are starting")
        if self._standing_by is not None:  # they wait in the old channel for a move that will not come
            raise ValueError("swap_replicas: the old replicas stand by for a sync; sync before the swap")
        incoming, self._incoming = self._incoming, None
        t0 = time.perf_counter()
        old = (self.cfg, self.replicas, self._replica_gpus, self.tp, self.n_replicas, self.resources)
        try:
            wait_all(self.ray, incoming.starts, "start new rollout replicas", self.quiet,
                     timeout=max(1.0, timeout_s - (t0 - incoming.t0)))
            background_s = time.perf_counter() - incoming.t0
            t1 = time.perf_counter()
            self.cfg, self.replicas, self._replica_gpus = incoming.cfg, list(incoming.actors), incoming.devices
            self.tp, self.n_replicas = incoming.cfg.rollout.tp, incoming.cfg.world_size // incoming.cfg.rollout.tp
            self.resources = resources_for(incoming.cfg)
            self.open_channel()
            fill = self.sync()
        except Exception as e:  # noqa: BLE001 - back to the old replicas, then one message
            stop_actors(self.ray, incoming.actors)
            (self.cfg, self.replicas, self._replica_gpus, self.tp, self.n_replicas, self.resources) = old
            if not fall_back:
                raise RuntimeError(f"the new rollout replicas were not taken after the trainer world moved "
                                   f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); the old "
                                   f"trainer world is gone: resume from the newest checkpoint") from e
            self.open_channel()
            raise ValueError(f"the new rollout replicas were not taken ({type(e).__name__}: "
                             f"{str(e).splitlines()[0] if str(e) else ''}); killed, the old replicas generate on") from e
        stop_s = time.perf_counter() - t1
        t2 = time.perf_counter()
        stop_actors(self.ray, old[1])
        return {"background_s": background_s, "waited_for_build_s": t1 - t0, "stop_the_world_s": stop_s,
                "release_s": time.perf_counter() - t2, "bytes_moved": fill["bytes_moved"],
                "fill_sync_s": fill["seconds"], "old_replicas": len(old[1]), "new_replicas": len(self.replicas),
                "old_replicas_gone": self._gone(old[1])}

    def abandon_replicas(self) -> None:
        """Drop new replicas still starting (the run ends, or their resize was abandoned)."""
        incoming, self._incoming = self._incoming, None
        if incoming is not None:
            stop_actors(self.ray, incoming.actors)

    def _gone(self, actors: Sequence, wait_s: float = 90.0) -> int:
        """How many of ``actors`` Ray reports dead (a call to each fails with ``RayActorError``).
        The kill is asynchronous: on a loaded machine a killed actor's call can stay unanswered, or
        be answered, for a while — asked again until ``wait_s`` has passed."""
        from ray.exceptions import GetTimeoutError, RayActorError

        deadline = time.perf_counter() + wait_s
        gone = 0
        for a in actors:
            while True:
                try:
                    self.ray.get(a.node.remote(), timeout=max(1.0, min(30.0, deadline - time.perf_counter())))
                except RayActorError:
                    gone += 1
                    break
                except GetTimeoutError:
                    pass
                except Exception:  # noqa: BLE001 - another error: not known to be gone
                    break
                if time.perf_counter() >= deadline:  # still answering (or silent): not gone
                    break
                time.sleep(0.5)
        return gone

    def _on(self, bundle: int):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        pg, index = self._slot(bundle)
        return PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index)

    def adopt(self, cfg, workers: list, devices: Sequence) -> dict | None:
        """After an elastic resize (``rlhf_switch.elastic.manager``): the new world's actors —
        trainer, reference, critic and in-actor rollout engine built by ``build_empty(config, init_dir)``,
        the training state moved in — become this cluster's; the weight channel is re-formed over
        them and the next ``sync`` brings their rollout engines up to date. With rollout replicas
        (vLLM, a combined resize): ``cfg``'s replicas must be starting on ``devices``
        (``start_replicas(cfg, init_dir, devices)``); they take over here — ``swap_replicas``: the
        channel formed over the new trainer world and them, one sync fills them, the old replicas
        shut down — and its figures are returned."""
        if self.replicas and (self._incoming is None or self._incoming.cfg is not cfg):
            raise ValueError("adopt: a world with rollout replicas needs the new world's replicas started first "
                             "(start_replicas with its devices)")
        seen = self._gpus_seen  # per device (rank r on device r): the ids seen there, kept with the device
        self.cfg, self.workers, self.world, self.devices = cfg, list(workers), cfg.world_size, list(devices)
        self.bundles = [index for _, index in self.devices]
        self._gpus_seen = [seen[d] if d < len(seen) else [] for d in range(self.world)]
        if self.replicas:
            return self.swap_replicas(fall_back=False)
        self.resources = resources_for(cfg)
        self.tp, self.n_replicas = cfg.rollout.tp, cfg.world_size // cfg.rollout.tp
        self.open_channel()

    # --- elastic.redundancy: host ---------------------------------------------------------------------
    @property
    def buddy_shift(self) -> int:
        """Which rank keeps rank r's host copy: ``(r + shift) % world``, another node's where the
        ranks' nodes allow (``vps.layouts.buddy.buddy_shift``); per world."""
        from rlhf_switch.vps.layouts.buddy import buddy_shift

        key = tuple(map(id, self.workers))
        if getattr(self, "_buddy", (None,))[0] != key:
            nodes = [self._node_of_rank(r) for r in range(self.world)]
            self._buddy = (key, buddy_shift(nodes), nodes)
        return self._buddy[1]

    def rank_nodes(self) -> list[str]:
        """Each trainer rank's node (``address id[:8]``) as ``buddy_shift`` last saw it: still
        known after a node is lost (its placement groups then name no node)."""
        buddy = getattr(self, "_buddy", None)
        return list(buddy[2]) if buddy else ["?"] * self.world

    def refresh_host_copy(self, extra: dict) -> dict:
        """Every trainer rank's state as of now into the host copies (one VPS move into the buddy
        layout; ``extra``, the data position, kept beside): bytes copied, from the buddies, held."""
        reports = self.all("redundancy_refresh", self.buddy_shift, extra, desc="host copy")
        return {"bytes": sum(r["bytes_local"] + r["bytes_received"] for r in reports),
                "bytes_received": sum(r["bytes_received"] for r in reports),
                "held_bytes": sum(r["bytes_held"] for r in reports),
                "seconds": max(r["seconds"] for r in reports)}

    # --- the weight channel train -> rollout -------------------------------------------------------
    def open_channel(self, budget_bytes: int | None = None) -> None:
        """Form the weight channel between the trainer's ranks and the rollout workers: one process
        group, both layouts placed on it, handed out once. Called again only when a layout changes
        (it re-plans; the members' groups are made anew only then)."""
        from rlhf_switch.engines.channel import Endpoint, resolve_handoff
        from rlhf_switch.routing.executor import DEFAULT_BUDGET
        from rlhf_switch.vps.placement import place

        if self.in_world:  # the rollout engine lives on the trainer's ranks: a group of their world
            self.all("channel_open", desc="open weight channel")
        else:
            # the handoff first: an impossible ``ipc`` is refused before anything is opened
            self.handoff, colocated = resolve_handoff(self.cfg.rollout.handoff, self.member_devices(), self.world)
            src = next(x for x in self.all("channel_source", desc="describe weights") if x is not None)
            n, total = self.world, self.world + self.n_replicas * self.tp
            # the replicas' layout of what a sync moves (all weights; a LoRA run's adapters or merged weights)
            dst = self.ray.get(self.workers[0].channel_destination.remote(self.tp, self.n_replicas), timeout=120)
            if self.replicas:  # as the engines must be written (vLLM layers kept in a processed form)
                dst = self.ray.get(self.replicas[0].channel_destination.remote(dst), timeout=120) or dst
            host, port = self.ray.get(self.workers[0].channel_store.remote(), timeout=60)
            ep = Endpoint(host, port, total, 0, place(src, range(n), total), place(dst, range(n, total), total),
                          budget_bytes or DEFAULT_BUDGET, verify=self.cfg.verify,
                          verify_fraction=self.cfg.verify_fraction, handoff=self.handoff, colocated=colocated,
                          backend=self.device.backend)
            refs = [r.channel_open.remote(ep.at(n + i * self.tp)) for i, r in enumerate(self.replicas)]
            refs += [w.channel_open.remote(ep.at(rank)) for rank, w in enumerate(self.workers)]
            wait_all(self.ray, refs, "open weight channel", self.quiet)
        self.channel_opened += 1

    def member_devices(self) -> list[tuple[str, int]]:
        """Each channel member's device as ``(node, device)``: trainer rank ``i`` on device ``i``
        (its bundle's); replica ``r``'s worker ``t`` runs in the replica's actor process tree, on
        the node of its bundle, on device ``r·tp + t`` — one the trainer ranks share when
        colocated (``resources``), else one of its own after theirs. The colocated handoff needs
        both the same."""
        devices = [(self._node_of_rank(i), i) for i in range(self.world)]
        for r, slot in enumerate(self.resources.replicas):
            node = self._node_of_rank(r * self.tp, slot.bundle)
            # on the trainer's devices (colocated, or lent: elastic.lend) from its bundle's, else
            # on devices of its own after them
            first = slot.bundle if slot.bundle < self.world else self.world + (slot.bundle - self.world) * self.tp
            devices += [(node, first + t) for t in range(self.tp)]
        return devices

    def stand_by(self, version: int | None = None) -> None:
        """The rollout replicas post their receive now (call it when a rollout phase is over and
        the next use of the rollout engines is after a sync): their workers wait in the channel
        while the trainer trains — they are idle then anyway — so the next ``sync`` starts with
        only the trainer's ranks to reach (a receive posted ahead, as with NCCL). Ray runs a
        replica's calls in order, so nothing else reaches a replica before that sync."""
        if self.replicas and self._standing_by is None and self._incoming is None:
            self._standing_by = [r.channel_receive.remote(version) for r in self.replicas]

    def sync(self, version: int | None = None) -> dict:
        """Move the trainer's weights into the rollout engine(s) through the channel; returns the
        seconds the driver saw, bytes, and where the time went (slowest member's move, the
        replicas' receive including the cache reset). ``version``: the weights' version the replicas
        record (the loop's iteration; a receive posted ahead by ``stand_by`` carries its own)."""
        t0, t_wall = time.perf_counter(), time.time()
        recv, self._standing_by = self._standing_by or [r.channel_receive.remote(version) for r in self.replicas], None
        send = [w.sync_send.remote() for w in self.workers]
        try:
            out = self.ray.get(recv + send, timeout=600)
        except Exception as e:  # noqa: BLE001 - which member is gone, then raise
            failure = self._sync_failure(recv, send, e)
            dead = self._dead(self.replicas)
            if dead and len(dead) < len(self.replicas) and all(n.startswith("rollout replica") for n in failure.lost):
                # only rollout replicas died: the run goes on with the others, and this sync again
                # fills them whole (the failed move may have written a part of their weights)
                t1 = time.perf_counter()
                names = self.drop_replicas(dead)
                self.replica_events.append({"lost": names, "requeued_prompts": 0, "replicas_left": len(self.replicas),
                                            "seconds": time.perf_counter() - t1, "during": "sync"})
                return self.sync(version)
            raise failure from e
        seconds = time.perf_counter() - t0
        senders, receivers = out[len(recv):], out[:len(recv)]
        reports = senders + [w for r in receivers for w in r["workers"]]
        entered = [r["phases"]["entered_at"] for r in reports]
        return {"seconds": seconds,
                "bytes_moved": sum(r["bytes_sent"] + r["bytes_local"] for r in senders),
                "bytes_sent": sum(r["bytes_sent"] for r in senders),
                "weights": senders[0].get("weights", "full"),  # what moved: full, or LoRA's adapters / merged
                # ipc: bucket handles handed to the workers (one per bucket) — 0 with p2p
                "handoff": self.handoff,
                "handles": sum(r.get("handles", 0) for r in senders),
                # where the time went: every member in the move (the replicas may have been
                # standing by since before the call), the trainers' agreement and move, their whole
                # call (describe + check + move), the replicas' RPC to their workers and cache reset
                "breakdown": {"stood_by": bool(receivers) and min(entered) < t_wall,
                              "all_members_in_s": max(entered) - t_wall,
                              "trainer_agree_s": max(r["phases"].get("agree", 0.0) for r in senders),
                              "trainer_move_s": max(r["seconds"] for r in senders),
                              "trainer_call_s": max(r["wall_seconds"] for r in senders),
                              "replica_rpc_s": max((w.get("rpc_s", 0.0) for r in receivers for w in r["workers"]),
                                                   default=0.0),
                              "cache_reset_s": max((w.get("reset_s", 0.0) for r in receivers for w in r["workers"]),
                                                   default=0.0),
                              # the workers' part of the move (ipc: waiting for the handles, the copy)
                              "worker_move_s": max((w["seconds"] for r in receivers for w in r["workers"]),
                                                   default=0.0)}}

    def _slot(self, bundle: int) -> tuple:
        """(placement group, bundle index) of a ``resources`` bundle: the first ``world`` are the
        trainer ranks' devices (rank r on ``self.devices[r]``), any after them a replica's own."""
        return self.devices[bundle] if bundle < self.world else (self.pg, bundle)

    def _node_of_rank(self, rank: int, bundle: int | None = None) -> str:
        """The node of rank ``rank``'s bundle (or of ``resources`` bundle ``bundle``): its address
        and id (nodes may share an address)."""
        try:
            pg, index = self._slot(rank if bundle is None else bundle)
            node_id = self.ray.util.placement_group_table(pg)["bundles_to_node_id"][index]
            address = next(n["NodeManagerAddress"] for n in self.ray.nodes() if n["NodeID"] == node_id)
            return f"{address} {node_id[:8]}"
        except Exception:  # noqa: BLE001 - a name without an address is still a name
            return "?"

    def _trainer_name(self, rank: int) -> str:
        return f"trainer rank {rank} (node {self._node_of_rank(rank)})"

    def _replica_name(self, replica: int, worker: int | None = None) -> str:
        who = f"rollout replica {replica}" + ("" if worker is None else f" worker {worker}")
        return f"{who} (node {self._node_of_rank(replica * self.tp, self.resources.replicas[replica].bundle)})"

    def nodes(self) -> dict:
        """Where the run's actors are, as each actor's process reports it (Ray's node id and
        address, pid): the trainer ranks in rank order, the rollout replicas (their engines'
        workers are the replica actors' own processes) in replica order; each rank's bundle."""
        got = self.ray.get([w.node.remote() for w in self.workers] + [r.node.remote() for r in self.replicas],
                           timeout=120)
        return {"placement": self.cfg.placement, "trainers": got[:self.world], "replicas": got[self.world:],
                "n_nodes": len({g["node_id"] for g in got}), "rank_bundles": list(self.bundles)}

    def channel_member(self, rank: int) -> str:
        """Who channel rank ``rank`` is: trainer ranks first, then each replica's workers."""
        if self.in_world or rank < self.world:
            return self._trainer_name(rank)
        return self._replica_name(*divmod(rank - self.world, self.tp))

    def _sync_failure(self, recv: list, send: list, error: Exception) -> SyncFailed:
        """Ask every member's call how it ended: dead actors are named by Ray; the survivors'
        ``PeerLost`` name the channel ranks they lost (``lost rank N`` / ``lost ranks [..]``)."""
        import re

        from ray.exceptions import ActorDiedError, GetTimeoutError, RayActorError

        calls = [(self._replica_name(i), ref) for i, ref in enumerate(recv)]
        calls += [(self._trainer_name(r), ref) for r, ref in enumerate(send)]
        dead, named, seen = [], set(), []
        for who, ref in calls:
            try:
                self.ray.get(ref, timeout=120)
            except (ActorDiedError, RayActorError) as e:
                dead.append(who)
                seen.append(f"{who}: died ({type(e).__name__})")
            except GetTimeoutError:
                seen.append(f"{who}: no answer within 120 s")
            except Exception as e:  # noqa: BLE001
                text = str(e)
                for one, many in re.findall(r"lost rank (\d+)|lost ranks \[([\d, ]+)\]", text):
                    named.update(int(x) for x in (one or many).split(",") if x.strip())
                line = next((ln for ln in text.splitlines() if "PeerLost" in ln), text.splitlines()[0] if text else "")
                seen.append(f"{who}: {line[:300]}")
        lost = dead or [self.channel_member(r) for r in sorted(named)]
        what = f"lost {', '.join(lost)}" if lost else f"no member named ({type(error).__name__}: {error})"
        return SyncFailed(f"weight sync failed: {what}. Members: " + "; ".join(seen), lost)

    def channel_stats(self) -> dict:
        """Every member's channel counters, open file descriptors and threads."""
        stats = self.ray.get([w.channel_stats.remote() for w in self.workers]
                             + [r.channel_stats.remote() for r in self.replicas], timeout=120)
        return {"trainers": stats[:self.world], "replicas": stats[self.world:]}

    # --- memory at the phase boundary ----------------------------------------------------------------
    def offload(self) -> dict:
        """The trainers' state ``train.offload`` names into host memory (after a sync)."""
        return self._boundary("offload")

    def reload(self) -> dict:
        """The parked state back into the trainers' buffers (before the update)."""
        return self._boundary("reload")

    def _boundary(self, method: str) -> dict:
        if self.cfg.train.offload == "none":  # nothing moves: no call to the workers
            return {"bytes": 0, "bytes_per_rank": [0] * self.world, "released_bytes": 0, "seconds": 0.0}
        reports = self.all(method, desc=f"{method} trainer state")
        return {"bytes": sum(r["bytes_moved"] for r in reports),
                "bytes_per_rank": [r["bytes_moved"] for r in reports],
                "released_bytes": sum(r["bytes_released"] for r in reports),
                "seconds": max(r["seconds"] for r in reports)}

    def memory_mark(self, wait: bool = True):
        """Every trainer rank's peak memory in the phase that ends now (the largest, and per rank).
        ``wait=False``: the marks are requested now and read later — a function that returns the
        same dict. A worker runs its calls in order, so the mark still closes the phase where it
        was asked for; the driver just does not wait a Ray round trip for it (three per iteration)."""
        refs = [w.memory_mark.remote() for w in self.workers]

        def read() -> dict:
            marks = self.ray.get(refs, timeout=900)
            return {"bytes": max(m["bytes"] for m in marks), "per_rank": [m["bytes"] for m in marks],
                    "measure": marks[0]["measure"]}
        return read() if wait else read

    # --- generation -------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], seeds: Sequence[int], max_new_tokens: int,
                 temperature: float) -> tuple[list[list[int]], list[list[float]]]:
        """Every prompt's response and its per-token log-probs, in prompt order; each replica
        takes a contiguous share, each sample its own seed."""
        tokens, logprobs, _ = self.collect_generation(self.submit_generation(prompts, seeds, max_new_tokens, temperature))
        return tokens, logprobs

    def submit_generation(self, prompts: list[list[int]], seeds: Sequence[int], max_new_tokens: int,
                          temperature: float):
        """Start the generation of ``prompts`` and return at once (rollout replicas: a
        ``Generation``, each replica's contiguous share of the prompts in flight; the torch engine in
        the trainer's actors runs it now and returns its results)."""
        if self.in_world:
            refs = self.submit("generate", prompts, max_new_tokens, temperature, list(seeds))
            return wait_all(self.ray, refs, "generate", self.quiet, failed=lambda rank, e: RolloutEngineFailed(
                f"the rollout engine of {self._trainer_name(rank)} failed while generating: {engine_error(e)}"))
        return self._share_out(list(prompts), list(seeds), max_new_tokens, temperature)

    def _share_out(self, prompts: list, seeds: list, max_new_tokens: int, temperature: float) -> "Generation":
        """``prompts`` split into contiguous shares over the replicas (sizes differ by one at most:
        a replica lost earlier leaves a count that need not divide), each share's call started."""
        if not self.replicas:
            raise RuntimeError("no rollout replica is left to generate with")
        replicas = self.generating()
        eos, R, n = self.hf.get("eos_token_id"), len(replicas), len(prompts)
        cuts = [i * (n // R) + min(i, n % R) for i in range(R + 1)]
        shares = [(r, prompts[a:b], seeds[a:b]) for r, a, b in zip(replicas, cuts, cuts[1:]) if b > a]
        refs = [r.generate.remote(p, max_new_tokens, temperature, s, eos) for r, p, s in shares]
        return Generation(shares, refs, max_new_tokens, temperature)

    @property
    def lent(self) -> list[int]:
        """The replicas on the trainer's devices (``elastic.lend``), by index."""
        return lent_replicas(self.resources, self.world, self.cfg.rollout.colocate)

    def generating(self) -> list:
        """The replicas a generation is shared over: all of them — but those lent the trainer's
        devices (``elastic.lend``) only while ``lending`` (or when no other is left)."""
        own = [r for i, r in enumerate(self.replicas) if i not in self.lent]
        return list(self.replicas) if self.lending or not own else own

    def collect_generation(self, submitted) -> tuple[list[list[int]], list[list[float]], list[int | None]]:
        """The responses, per-token log-probs and, per sample, the weight version its replica
        generated with (None where the engine does not count them), in prompt order. A replica
        that died before its share came back: its prompts are generated again by the replicas
        left (``_requeue``), and the run goes on with them."""
        if self.in_world:
            leads = sorted((g for g in submitted if g["lead"]), key=lambda g: g["replica"])
            return ([t for g in leads for t in g["tokens"]], [lp for g in leads for lp in g["logprobs"]],
                    [g.get("version") for g in leads for _ in g["tokens"]])
        out = ([], [], [])
        for tokens, logprobs, versions in self._collect_shares(submitted, f"generate ({self.cfg.rollout.engine})"):
            out[0].extend(tokens), out[1].extend(logprobs), out[2].extend(versions)
        return out

    def _collect_shares(self, gen: "Generation", desc: str) -> list[tuple]:
        """Each share's (tokens, log-probs, per-sample versions), in share order; the shares of
        replicas that died generated again by the others."""
        died: list[int] = []
        got = wait_all(self.ray, gen.refs, desc, self.quiet, died=died,
                       failed=lambda i, e: RolloutEngineFailed(f"{self._replica_name(self._index(gen.shares[i][0]))} "
                                                               f"failed while generating: {engine_error(e)}"))
        results = [None if g is None else (g["tokens"], g["logprobs"], [g.get("version")] * len(g["tokens"]))
                   for g in got]
        if died:
            for i, part in zip(died, self._requeue(gen, died)):
                results[i] = part
        return results

    def _requeue(self, gen: "Generation", lost: list[int]) -> list[tuple]:
        """The shares ``lost`` (their replicas died mid-generation) generated again: the dead
        replicas dropped from the run (``drop_replicas``), each share split over the replicas left,
        with the same seeds."""
        t0 = time.perf_counter()
        dead = [gen.shares[i][0] for i in lost]
        names = self.drop_replicas(dead)
        if not self.replicas:
            raise RolloutEngineFailed(f"{', '.join(names)} died while generating (its actor lost) and no rollout "
                                      f"replica is left to generate its share")
        n = sum(len(gen.shares[i][1]) for i in lost)
        parts = []
        for i in lost:
            _, prompts, seeds = gen.shares[i]
            again = self._collect_shares(self._share_out(prompts, seeds, gen.max_new_tokens, gen.temperature),
                                         f"generate again: {len(prompts)} prompts of a lost replica")
            parts.append(tuple([x for p in again for x in p[k]] for k in range(3)))
        self.replica_events.append({"lost": names, "requeued_prompts": n, "replicas_left": len(self.replicas),
                                    "seconds": time.perf_counter() - t0})
        return parts

    def _index(self, replica) -> int:
        """The index of replica actor ``replica`` in the run's replicas."""
        return next(i for i, r in enumerate(self.replicas) if r is replica)

    def _dead(self, actors: Sequence) -> list:
        """Those of ``actors`` that Ray reports dead."""
        from ray.exceptions import ActorDiedError, RayActorError

        refs, dead = [(a, a.node.remote()) for a in actors], []
        for a, ref in refs:
            try:
                self.ray.get(ref, timeout=60)
            except (ActorDiedError, RayActorError):
                dead.append(a)
        return dead

    def drop_replicas(self, dead: Sequence) -> list[str]:
        """Rollout replicas that died (their actors, ``dead``) leave the run: a receive the others
        posted ahead (``stand_by``) is released — a move that fails at its first exchange, on every
        member, before a byte moves: the receivers' weights stay what they were —, the dead
        replicas' actors are freed, and the weight channel is formed again over the replicas left
        (the next sync fills them). Returns the dead replicas' names."""
        keep = [i for i, r in enumerate(self.replicas) if not any(r is d for d in dead)]
        names = [self._replica_name(i) for i in range(len(self.replicas)) if i not in keep]
        if self._standing_by is not None:
            recv, self._standing_by = self._standing_by, None
            for ref in recv + [w.channel_release.remote() for w in self.workers]:
                try:
                    self.ray.get(ref, timeout=120)
                except Exception:  # noqa: BLE001 - expected: PeerLost on the survivors, ActorDiedError for the dead
                    pass
        for d in dead:
            try:
                self.ray.kill(d)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.replicas = [self.replicas[i] for i in keep]
        self._replica_gpus = [self._replica_gpus[i] for i in keep] if self._replica_gpus else []
        res = self.resources
        self.resources = dataclasses.replace(
            res, replicas=tuple(res.replicas[i] for i in keep),
            replica_devices=tuple(res.replica_devices[i] for i in keep) if res.replica_devices else ())
        self.n_replicas = len(self.replicas)
        if self.replicas:
            self.open_channel()
        return names

    def save(self, path: Path, extra: dict) -> float:
        t0 = time.perf_counter()
        self.all("save_checkpoint", str(path), extra, desc=f"save {path.name}")
        return time.perf_counter() - t0

    def shutdown(self, graceful: bool = True) -> None:
        """Stop the engines and free the actors and their placement group (a shared Ray session
        goes on; an owned one is shut down by the recipe)."""
        from ray.util.placement_group import remove_placement_group

        ray = self.ray
        self.abandon_replicas()
        if graceful:
            try:
                if self.replicas:
                    ray.get([r.shutdown.remote() for r in self.replicas], timeout=60)
                ray.get([w.shutdown.remote() for w in self.workers], timeout=60)
            except Exception:  # noqa: BLE001 - best effort: the actors are killed next
                pass
        for a in self.replicas + self.workers:
            ray.kill(a)
        self.replicas, self.workers = [], []
        if self.owns_devices:
            remove_placement_group(self.pg)
