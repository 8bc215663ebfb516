"""The rollout replicas of a run (a rollout engine of placement ``replica``: vLLM): their contexts,
a new layout started in the background and swapped in (elastic), a generation shared out over them
and collected, and a replica that died dropped, its prompts generated again by the others.
``ReplicasMixin`` is the part of ``Cluster`` that does it (``recipes.cluster.cluster``).

A generation is shared out in one of two ways (``rollout.pull_prompts``):

- **fixed shares** (0, the default): each replica one contiguous share of the prompts, all sent at
  once (``Generation``) — a replica whose share has the long responses holds the others idle;
- **pulled** (N > 0, work stealing): the prompts cut in chunks of N, each replica sent one, and
  the next chunk as soon as it returns one (``PulledGeneration``). The driver hands the chunks out
  while it collects, so a pulled generation makes progress only while it is being collected: a
  run that collects a batch later (one step ahead, partial rollout) keeps fixed shares, except an
  agent run's, whose rounds are collected in the episodes' own thread. (An agent run's turns
  batched continuously go into one queue the replicas pull from: ``recipes.cluster.turn_queue``.)

Either way a sample's tokens are the same (its own seed; the engines' results do not depend on
the batch), and ``rollout_time`` adds up each replica's generating seconds against the
generations' wall time: what the loop records as the replicas' idle share."""
from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from recipes.cluster.calls import RolloutEngineFailed, engine_error, stop_actors, wait_all
from recipes.cluster.placement import TRANSITION_SLOT, Resources, lent_replicas, resources_for
from rlhf_switch.timeouts import CONTROL_S, RESIZE_S, SHUTDOWN_S


@dataclass
class Generation:
    """A generation in flight on the rollout replicas: each call's (replica actor, prompts, seeds)
    and its ref — what a lost replica's prompts are generated again from."""

    shares: list
    refs: list
    max_new_tokens: int
    temperature: float
    stop_ids: tuple = ()   # beyond the model's eos
    t0: float = dataclasses.field(default_factory=time.perf_counter)


@dataclass
class PulledGeneration:
    """A generation in flight by work stealing (module docstring): chunk ``c`` is
    ``prompts[chunks[c][0]:chunks[c][1]]``; ``queue``: the chunks not sent yet; ``running``: each
    call in flight's (replica actor, chunk)."""

    prompts: list
    seeds: list
    chunks: list
    queue: list
    running: dict
    max_new_tokens: int
    temperature: float
    stop_ids: tuple
    t0: float


@dataclass
class RolloutTime:
    """The replicas' generating seconds (``busy_s``, per replica number) and the wall seconds of
    the generations they ran in (``wall_s``), added up until ``take`` returns and clears them."""

    wall_s: float = 0.0
    busy_s: dict = dataclasses.field(default_factory=dict)
    # an agent run K steps ahead collects generations in several threads at once
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    def add(self, wall_s: float, results) -> None:
        with self._lock:
            self.wall_s += wall_s
            for g in results:
                if g is not None:
                    self.busy_s[g["replica"]] = self.busy_s.get(g["replica"], 0.0) + g["seconds"]

    def take(self) -> dict:
        """``{"wall_s", "busy_s": {replica: s}, "idle_share": {replica: 1 - busy/wall}}``, then cleared."""
        with self._lock:
            out = {"wall_s": self.wall_s, "busy_s": dict(self.busy_s),
                   "idle_share": {r: max(0.0, 1.0 - b / self.wall_s) if self.wall_s > 0 else 0.0
                                  for r, b in self.busy_s.items()}}
            self.wall_s, self.busy_s = 0.0, {}
        return out


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



class ReplicasMixin:
    """``Cluster``'s rollout replicas (its state: ``replicas``, ``resources``, ``lending``, …)."""

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
        ``recipes/elastic/resize.py``; ``adopt`` finishes it): the replicas go on its devices. Each new
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
        starts += [a.generate.remote([[int(self.hf.get("bos_token_id") or 1)]], 2, 1.0, [0], self._stop_ids(()))
                   for a in actors]
        self._incoming = IncomingReplicas(cfg, actors, starts, devices, time.perf_counter(), self)
        return self._incoming


    def swap_replicas(self, timeout_s: float = RESIZE_S, fall_back: bool = True) -> dict:
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


    def _replica_name(self, replica: int, worker: int | None = None) -> str:
        who = f"rollout replica {replica}" + ("" if worker is None else f" worker {worker}")
        return f"{who} (node {self._node_of_rank(replica * self.tp, self.resources.replicas[replica].bundle)})"


    # --- generation -------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], seeds: Sequence[int], max_new_tokens: int,
                 temperature: float) -> tuple[list[list[int]], list[list[float]]]:
        """Every prompt's response and its per-token log-probs, in prompt order; each replica
        takes a contiguous share, each sample its own seed."""
        tokens, logprobs, _ = self.collect_generation(self.submit_generation(prompts, seeds, max_new_tokens, temperature))
        return tokens, logprobs


    def submit_generation(self, prompts: list[list[int]], seeds: Sequence[int], max_new_tokens: int,
                          temperature: float, stop_ids: Sequence[int] = (), pull: bool = True):
        """Start the generation of ``prompts`` and return at once (rollout replicas: a
        ``Generation``, each replica's contiguous share of the prompts in flight; the torch engine in
        the trainer's actors runs it now and returns its results). A response ends after the
        model's eos or any of ``stop_ids`` (an agent turn's own: the engines stop there rather than
        generate tokens the episode would cut). ``pull``: False for a generation collected later
        than it is submitted (one step ahead), which keeps fixed shares (module docstring)."""
        stop_ids = tuple(sorted({int(t) for t in stop_ids}))
        if self.in_world:
            refs = self.submit("generate", prompts, max_new_tokens, temperature, list(seeds), list(stop_ids))
            return wait_all(self.ray, refs, "generate", self.quiet, failed=lambda rank, e: RolloutEngineFailed(
                f"the rollout engine of {self._trainer_name(rank)} failed while generating: {engine_error(e)}"))
        n = self.cfg.rollout.pull_prompts
        if pull and n and self.replicas:
            return self._pull_out(list(prompts), list(seeds), max_new_tokens, temperature, stop_ids, n)
        return self._share_out(list(prompts), list(seeds), max_new_tokens, temperature, stop_ids)


    def _pull_out(self, prompts: list, seeds: list, max_new_tokens: int, temperature: float, stop_ids: tuple,
                  n: int) -> PulledGeneration:
        """``prompts`` cut in chunks of ``n``, the first ones sent, one to each replica."""
        chunks = [(a, min(a + n, len(prompts))) for a in range(0, len(prompts), n)]
        gen = PulledGeneration(prompts, seeds, chunks, list(range(len(chunks))), {}, max_new_tokens, temperature,
                               stop_ids, time.perf_counter())
        for r in self.generating():
            self._send_chunk(gen, r)
        return gen


    def _send_chunk(self, gen: PulledGeneration, replica) -> None:
        """The next chunk of ``gen`` to ``replica`` (nothing when none is left)."""
        if gen.queue:
            c = gen.queue.pop(0)
            a, b = gen.chunks[c]
            ref = replica.generate.remote(gen.prompts[a:b], gen.max_new_tokens, gen.temperature, gen.seeds[a:b],
                                          self._stop_ids(gen.stop_ids))
            gen.running[ref] = (replica, c)


    def _collect_pulled(self, gen: PulledGeneration, desc: str) -> list[tuple]:
        """Each chunk's (tokens, log-probs, per-sample versions), in chunk order, handing a replica
        the next chunk as soon as it returns one. A replica that died: its chunk goes back to the
        front of the queue for the others, and it leaves the run (``drop_replicas``) once nothing
        is in flight."""
        from ray.exceptions import RayActorError, RayTaskError

        from recipes.cluster.calls import phase
        from rlhf_switch.timeouts import PHASE_S

        results, got, dead, requeued = [None] * len(gen.chunks), [], [], 0
        deadline = time.monotonic() + PHASE_S
        with phase(desc, len(gen.chunks), self.quiet) as bar:
            while gen.running:
                done, _ = self.ray.wait(list(gen.running), num_returns=1,
                                        timeout=max(0.0, deadline - time.monotonic()))
                if not done:
                    raise TimeoutError(f"{desc}: {len(gen.running)} chunks unfinished after {PHASE_S} s")
                replica, c = gen.running.pop(done[0])
                try:
                    g = self.ray.get(done[0])
                except RayActorError:
                    dead.append(replica)
                    gen.queue.insert(0, c)
                    requeued += gen.chunks[c][1] - gen.chunks[c][0]
                    idle = [r for r in self.generating() if not any(r is d for d in dead)
                            and not any(r is x for x, _ in gen.running.values())]
                    if not idle and not gen.running:
                        raise RolloutEngineFailed(f"{self._replica_name(self._index(replica))} died while generating "
                                                  f"(its actor lost) and no rollout replica is left to generate its "
                                                  f"share") from None
                    for r in idle:
                        self._send_chunk(gen, r)
                    continue
                except RayTaskError as e:
                    raise RolloutEngineFailed(f"{self._replica_name(self._index(replica))} failed while generating: "
                                              f"{engine_error(e)}") from e
                results[c] = (g["tokens"], g["logprobs"], [g.get("version")] * len(g["tokens"]))
                got.append(g)
                bar.update(1)
                self._send_chunk(gen, replica)
        self.rollout_time.add(time.perf_counter() - gen.t0, got)
        if dead:
            self.drop_lost(dead, requeued)
        return results


    def _stop_ids(self, stop_ids: Sequence[int]) -> list[int]:
        """The ids a replica's response ends at: the model's eos and ``stop_ids``."""
        from rlhf_switch.engines.base import stop_set

        return stop_set(self.hf.get("eos_token_id"), stop_ids)


    def _share_out(self, prompts: list, seeds: list, max_new_tokens: int, temperature: float,
                   stop_ids: tuple = ()) -> "Generation":
        """``prompts`` split into contiguous shares over the replicas (sizes differ by one at most:
        a replica lost earlier leaves a count that need not divide), each share's call started."""
        if not self.replicas:
            raise RuntimeError("no rollout replica is left to generate with")
        replicas = self.generating()
        stops, R, n = self._stop_ids(stop_ids), len(replicas), len(prompts)
        cuts = [i * (n // R) + min(i, n % R) for i in range(R + 1)]
        shares = [(r, prompts[a:b], seeds[a:b]) for r, a, b in zip(replicas, cuts, cuts[1:]) if b > a]
        refs = [r.generate.remote(p, max_new_tokens, temperature, s, stops) for r, p, s in shares]
        return Generation(shares, refs, max_new_tokens, temperature, stop_ids)


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
        collect = self._collect_pulled if isinstance(submitted, PulledGeneration) else self._collect_shares
        for tokens, logprobs, versions in collect(submitted, f"generate ({self.cfg.rollout.engine})"):
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
        self.rollout_time.add(time.perf_counter() - gen.t0, got)
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
            again = self._collect_shares(self._share_out(prompts, seeds, gen.max_new_tokens, gen.temperature,
                                                         gen.stop_ids),
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
                self.ray.get(ref, timeout=SHUTDOWN_S)
            except (ActorDiedError, RayActorError):
                dead.append(a)
        return dead


    def drop_lost(self, dead: Sequence, requeued: int, **event) -> None:
        """``drop_replicas(dead)``, recorded in ``replica_events`` (how many prompts the others
        generate again, the replicas left, the seconds the drop took; ``event``: more fields)."""
        t0 = time.perf_counter()
        names = self.drop_replicas(dead)
        self.replica_events.append({"lost": names, "requeued_prompts": requeued, "replicas_left": len(self.replicas),
                                    "seconds": time.perf_counter() - t0, **event})


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
                    self.ray.get(ref, timeout=CONTROL_S)
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

