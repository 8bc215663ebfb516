"""Driver side of the vLLM rollout engine: real vLLM, weights written straight into its workers.

::

    rollout = VLLMRollout("/path/to/hf-model", spec, tp=2)         # starts vllm.LLM, checks its layout
    rollout.load_from(world, train_layout, trainer_buffers, *args)  # VPS move trainer ranks -> workers
    tokens, logprobs = rollout.generate([[1, 2, 3]], max_tokens=8)

``rollout.layout`` is ``vllm_layout(spec, tp)`` — with the layers vLLM keeps in a processed form
in that form (``processed_layout``). Before anything moves it is checked against what the
engine's workers really hold (``vps_describe``: names, shapes, dtypes) and what each layer's
kernel really reads (``vps_probe``, ``plan_processing``: ``engines/vllm_processed.py``); an engine
built for another model or vocabulary, or a layer no write reaches, is refused with the mismatch
named, and so is a destination that would write a processed layer in another form
(``check_destination``). A TP vLLM cannot run is refused (``LayoutError``) before the engine
starts.

The move goes through a weight channel (``engines/channel.py``): trainer ranks ``0..n-1`` and
vLLM workers ``n..n+tp-1`` form one gloo group over a TCPStore, both layouts placed on it
(``place``); every worker keeps its end (``channel_open``, once) and each sync is one
``channel_receive`` — the workers' part of the move, straight into their parameters — while the
trainer ranks send (``handoff="ipc"``: the trainer rank on a worker's device gathers the worker's
fragments into shared buckets and hands it one handle per bucket; the worker copies them into its
parameters — ``engines/channel.py``). Then the prefix cache is reset: KV computed with old weights must not be
reused. ``load_from`` does the same for the ranks of a ``LocalWorld``, with a one-shot channel. Where the platform has sleep mode (GPU), the engine sleeps (level 2: weights and KV
freed), wakes its weights, receives, then wakes its KV cache; on CPU sleep mode is refused by vLLM
and these steps are skipped.
"""
from __future__ import annotations

import pickle
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Mapping, Sequence

from .. import compat
from ..routing.executor import DEFAULT_BUDGET
from ..rl.tokenizer import has_tokenizer
from ..vps.layout import Layout, LayoutError
from ..vps.layouts.vllm import (BlockedExperts, expert_forms, param_shape, processed_layout, vllm_layout,
                                vllm_lora_layout, vllm_lora_rank, worker_tensors)
from ..vps.placement import place
from ..vps.spec import ModelSpec
from .base import RolloutContext, RolloutEngine, stop_set
from ..timeouts import MOVE_S

WORKER_EXTENSION = "rlhf_switch.engines.vllm_worker.VpsWorkerExtension"
PREFIX = "param/"


class EngineMismatch(LayoutError):
    """The running engine's workers do not hold what the layout says (other model, vocab, TP...)."""


PROCESSED_WEIGHTS = ("auto", "loader", "refuse")


@dataclass(frozen=True)
class Processing:
    """How the channel writes each layer of the engine (``engines/vllm_processed.py``): ``plain``
    (the checkpoint form in place), ``form`` (its processed form's layout, in place) or
    ``loader`` (the checkpoint form, then vLLM's processing of the layer), and what the probe
    found for every layer that is not plain."""

    paths: Mapping[str, str] = field(default_factory=dict)            # layer -> path
    forms: Mapping[str, BlockedExperts] = field(default_factory=dict)  # buffer -> form (path form)
    loader: tuple[str, ...] = ()                                       # layers of path loader
    found: Mapping[str, str] = field(default_factory=dict)            # layer -> the probe's findings
    buffers: Mapping[str, str] = field(default_factory=dict)          # buffer -> its (processed) layer

    def processed(self) -> dict[str, str]:
        """Layers not written plain -> path."""
        return {n: p for n, p in self.paths.items() if p != "plain"}


def candidate_forms(layers: Mapping[str, dict]) -> dict[str, list[dict]]:
    """Per expert layer of a worker's ``vps_describe`` ``layers``, the processed forms to probe:
    one ``{buffer: form}`` per block size that fits every buffer of the layer."""
    out = {}
    for name, layer in layers.items():
        if "experts" not in layer["kinds"]:
            continue
        per = {}
        for p in layer["params"].values():
            per[p["buffer"]] = {f.block: f for f in expert_forms(p["buffer"], tuple(p["created"][0]),
                                                                  tuple(p["live"][0]))}
        blocks = sorted(set.intersection(*(set(v) for v in per.values()))) if per else []
        out[name] = [{b: per[b][block] for b in per} for block in blocks]
    return out


def plan_processing(descriptions: Sequence[dict], probes: Sequence[dict], candidates: Mapping[str, list],
                    mode: str = "auto", engine: str = "the vLLM engine") -> Processing:
    """Each layer's path from every worker's probe (``vps_probe``): ``plain`` where its kernel
    reads the checkpoint form in place; else (``mode`` ``auto``) the first candidate form every
    worker's kernel reads, else (``auto``, ``loader``) vLLM's processing re-run on the moved
    weights where that computes them; else — and for any processed layer with ``mode``
    ``refuse`` — ``EngineMismatch`` naming every such layer and what was tried."""
    if mode not in PROCESSED_WEIGHTS:
        raise ValueError(f"processed_weights {mode!r}: expected one of {', '.join(PROCESSED_WEIGHTS)}")
    paths, forms, loader, found, problems = {}, {}, [], {}, []
    layers = descriptions[0]["layers"]
    for name in probes[0]:
        results = [p[name] for p in probes]
        kinds = "/".join(layers[name]["kinds"])
        plain = all(r["plain"][0] for r in results)
        if plain:
            paths[name] = "plain"
            continue
        tried = [f"the checkpoint form in place: {results[0]['plain'][1]}"]
        form = next((i for i in range(len(candidates.get(name, ()))) if all(r["forms"][i][0] for r in results)), None)
        names = [next(iter(c.values())).name for c in candidates.get(name, ())]
        if form is not None:
            tried.append(f"its processed form: {names[form]}")
        elif names:
            tried.append(f"none of its {len(names)} candidate processed forms ({', '.join(names)}): "
                         f"{results[0]['forms'][0][1]}, …")
        else:
            tried.append("no processed form known for it")
        loaded = all(r["loader"][0] for r in results)
        tried.append(f"vLLM's processing re-run on moved weights: "
                     f"{'ok' if loaded else next(r['loader'][1] for r in results if not r['loader'][0])}")
        found[name] = "; ".join(tried)
        if mode == "auto" and form is not None:
            paths[name] = "form"
            forms.update(candidates[name][form])
        elif mode != "refuse" and loaded:
            paths[name] = "loader"
            loader.append(name)
        else:
            why = ("processed_weights refuse" if mode == "refuse" else
                   "processed_weights loader, which does not use its processed form" if form is not None else
                   "no write its kernel reads")
            problems.append(f"{name} ({kinds}): {why} — {found[name]}")
    if problems:
        raise EngineMismatch(f"{engine} keeps {len(problems)} layer(s) in a form the weight channel cannot write "
                             f"(nothing was moved): " + " | ".join(problems[:6])
                             + (f" | … ({len(problems)} in all)" if len(problems) > 6 else ""))
    owner: dict[str, str] = {}  # a buffer two layers share (a tied LM head's) belongs to the processed one
    for name, layer in layers.items():
        for p in layer["params"].values():
            if paths.get(owner.get(p["buffer"]), "plain") == "plain":
                owner[p["buffer"]] = name
    return Processing(paths, forms, tuple(loader), found, owner)


def check_engine(layout: Layout, descriptions: Sequence[dict], engine: str = "the vLLM engine",
                 processing: Processing | None = None) -> None:
    """Compare ``layout`` (a ``vllm_layout``, or its ``processed_layout``) with the workers'
    ``vps_describe`` answers, in worker order; raise ``EngineMismatch`` naming every difference:
    parameter names, and each parameter's shape and dtype as vLLM created it (the checkpoint form
    the layout writes — another model, vocabulary or TP shows here). With ``processing`` (the
    engine's ``plan_processing``), also what each layer keeps: a plain layer's live parameter is
    the created one (contiguous), a processed form's has the form's shape."""
    spec, tp = layout.spec, layout.world_size
    problems: list[str] = []
    if len(descriptions) != tp:
        problems.append(f"the engine has {len(descriptions)} workers, the layout {tp}")
    for rank, d in enumerate(descriptions[:tp]):
        where = f"worker {rank}"
        if d.get("tp_size") != tp or d.get("tp_rank") != rank or d.get("pp_size", 1) != 1:
            problems.append(f"{where} is TP rank {d.get('tp_rank')} of {d.get('tp_size')} "
                            f"(PP {d.get('pp_size', 1)}); the layout is TP{tp} without PP")
            continue
        have = d["params"]
        made = {p["buffer"]: p["created"] for layer in d.get("layers", {}).values() for p in layer["params"].values()}
        want = {PREFIX + lt.buffer: param_shape(spec, lt) for lt in worker_tensors(spec, tp, rank)}
        bufs = layout.buffers(rank)
        for name in sorted(set(want) - set(have)):
            problems.append(f"{where} has no parameter {name[len(PREFIX):]!r} (layout shape {list(want[name])})")
        for name in sorted(set(have) - set(want)):
            problems.append(f"{where} has parameter {name[len(PREFIX):]!r} {have[name][0]} that the layout "
                            f"of {spec.name!r} does not know (it would never be written)")
        for name in sorted(set(have) & set(want)):
            live_shape, live_dtype, contiguous = have[name]
            shape, dtype = made.get(name, (live_shape, live_dtype))
            short = name[len(PREFIX):]
            if tuple(shape) != tuple(want[name]):
                problems.append(f"{where} {short} is {list(shape)}, the layout says {list(want[name])}")
            if dtype != bufs[name].dtype:
                problems.append(f"{where} {short} is {dtype}, the layout says {bufs[name].dtype}")
            if processing is None:
                continue
            path = processing.paths.get(processing.buffers.get(name), "plain")
            form = processing.forms.get(name)
            if path == "plain" and (tuple(live_shape) != tuple(shape) or live_dtype != dtype or not contiguous):
                problems.append(f"{where} {short} is kept as {live_shape} {live_dtype}"
                                f"{'' if contiguous else ' (not contiguous)'}, written in place as {list(shape)} {dtype}")
            if form is not None and tuple(live_shape) != tuple(form.live):
                problems.append(f"{where} {short} is {live_shape}; its processed form is {list(form.live)}")
    if problems:
        shown = "; ".join(problems[:12]) + (f"; … ({len(problems)} in all)" if len(problems) > 12 else "")
        raise EngineMismatch(f"{engine} does not hold {layout.name} of model {spec.name!r}: {shown}")


omp_binding = compat.vllm_cpu_omp_binding  # the old name, still importable from here


@dataclass
class LoadReport:
    seconds: float
    bytes_received: int  # by the workers, in all
    slept: bool
    trainer: list[Any]  # each trainer rank's MoveReport
    workers: list[dict]  # each worker's MoveReport, as a dict


class WorkerError(RuntimeError):
    """One or more vLLM workers failed a ``vps_*`` call (each worker's error is in the message)."""

    def __init__(self, method: str, errors: dict[int, str], tracebacks: dict[int, str]):
        self.errors = errors
        self.tracebacks = tracebacks
        detail = "; ".join(f"worker {w}: {e}" for w, e in sorted(errors.items()))
        super().__init__(f"vLLM workers failed {method}: {detail}")


def unwrap(method: str, answers: Sequence[dict]) -> list:
    """The workers' ``{"value"}``/``{"error"}`` answers (see ``vllm_worker._answer``) -> values."""
    errors = {w: a["error"] for w, a in enumerate(answers) if "error" in a}
    if errors:
        raise WorkerError(method, errors, {w: answers[w].get("traceback", "") for w in errors})
    return [a["value"] for a in answers]


class VLLMRollout:
    """One ``vllm.LLM`` of TP ``tp`` for the model at ``model`` (a HF checkpoint directory) whose
    spec is ``spec``; prompts are token ids. The directory's tokenizer, where it has one (a
    ``model.path`` run), is vLLM's tokenizer too — so ids out of its vocabulary are refused by vLLM
    as by the trainer; a generated-task checkpoint has none and vLLM loads none. ``sleep_mode``: use vLLM's
    sleep mode around moves (default: where the platform has it, i.e. not on CPU).
    ``engine_kwargs`` go to ``vllm.LLM`` as they are (e.g. ``block_size``, ``gpu_memory_utilization``).

    A ``spec`` with LoRA adapters (``ModelSpec.with_adapters``) starts vLLM with its LoRA support
    (``enable_lora``, one adapter slot, ``max_lora_rank`` the smallest vLLM has for ``r``), loads
    one adapter — the run's initial one, from a peft directory — pins it into slot 0, and
    generates every request with it (``LoRARequest``); the weight channel then writes the trained
    adapters into that slot (``vllm_lora_layout``) and the workers fold alpha/r into ``B``.

    ``cpu_kernels``: ``plain`` (every CPU layer computes from its parameters as loaded) or ``vllm``
    (vLLM's own prepacked CPU kernels, their post-load processing kept). ``processed_weights``
    (``auto`` | ``loader`` | ``refuse``): how a layer vLLM processed after loading is written
    (``plan_processing``); ``processing`` is what was decided, ``layout`` the engine's destination
    with it (docs/weight-channel.md, "Weights vLLM processes after loading")."""

    def __init__(self, model: str, spec: ModelSpec, tp: int = 1, *, dtype: str = "float32",
                 seed: int = 0, max_model_len: int = 256, enforce_eager: bool = True,
                 backend: str | None = None, sleep_mode: bool | None = None, processed_weights: str = "auto",
                 cpu_kernels: str = "plain", **engine_kwargs):
        self.spec = spec
        self.tp = tp
        self.model = model
        if processed_weights not in PROCESSED_WEIGHTS:
            raise ValueError(f"processed_weights {processed_weights!r}: expected one of {', '.join(PROCESSED_WEIGHTS)}")
        if cpu_kernels not in compat.CPU_KERNEL_CHOICES:
            raise ValueError(f"cpu_kernels {cpu_kernels!r}: expected one of {', '.join(compat.CPU_KERNEL_CHOICES)}")
        if cpu_kernels != "plain" and spec.lora is not None:
            raise ValueError("cpu_kernels 'vllm' with LoRA adapters: vLLM's LoRA layers wrap the processed base "
                             "layers, which the weight channel does not sync yet; use cpu_kernels 'plain'")
        # refuses a TP vLLM cannot run (LayoutError) before anything starts
        base = vllm_layout(spec.base(), tp, dtype=dtype)
        self.layout = base if spec.lora is None else vllm_lora_layout(spec, tp, dtype=dtype)
        self.lora_request = None
        from vllm import LLM
        from vllm.platforms import current_platform

        self.is_cpu = current_platform.is_cpu()
        available = bool(current_platform.is_sleep_mode_available())  # False on CPU
        self.can_sleep = available if sleep_mode is None else bool(sleep_mode) and available
        if backend is None:
            backend = "mp" if tp > 1 else None
        kwargs = dict(model=model, dtype=dtype, tensor_parallel_size=tp, enforce_eager=enforce_eager,
                      worker_extension_cls=WORKER_EXTENSION, skip_tokenizer_init=not has_tokenizer(model),
                      seed=seed,
                      max_model_len=max_model_len, enable_sleep_mode=self.can_sleep)
        if backend is not None:
            kwargs["distributed_executor_backend"] = backend
        if spec.lora is not None:  # one adapter, in slot 0 (vllm_lora_layout)
            kwargs.update(enable_lora=True, max_loras=1, max_lora_rank=vllm_lora_rank(spec.lora.r))
        kwargs.update(engine_kwargs)
        # both read by the processes LLM() starts (and by an engine core in this process)
        with compat.vllm_cpu_omp_threads_bind(tp, self.is_cpu), compat.vllm_cpu_kernels(cpu_kernels), \
                compat.quiet_vllm_chat_template_warmup():
            self.llm = LLM(**kwargs)
        self._asleep = False
        try:
            self.description = self._rpc("vps_describe")
            engine = f"vLLM engine for {model!r}"
            kernels = {d.get("cpu_kernels") for d in self.description}
            if self.is_cpu and kernels != {cpu_kernels}:
                raise EngineMismatch(f"{engine} was asked for cpu_kernels {cpu_kernels!r} but its workers run "
                                     f"{sorted(kernels)}: a worker process keeps the kernels of the first engine "
                                     f"it loaded (start this engine in a process of its own)")
            check_engine(base, self.description, engine)  # the model itself, before probing its layers
            self.processing = self._plan(base, processed_weights, engine)
            if self.processing.forms:
                self.layout = processed_layout(base, dict(self.processing.forms))
            check_engine(self.layout if spec.lora is None else base, self.description, engine, self.processing)
            self.staged_bytes = sum(self._rpc("vps_processing", list(self.processing.loader)))
            if spec.lora is not None:
                self._load_adapter(seed)
        except BaseException:
            self.shutdown()
            raise

    def _plan(self, base: Layout, mode: str, engine: str) -> Processing:
        """Probe every layer's kernel (``vps_probe``, on copies) and decide how each is written."""
        candidates = candidate_forms(self.description[0]["layers"])
        self.probes = self._rpc("vps_probe", pickle.dumps(base), pickle.dumps(candidates))
        return plan_processing(self.description, self.probes, candidates, mode, engine)

    def destination(self, layout: Layout) -> Layout:
        """``layout`` (a ``vllm_layout`` of any number of replicas of this engine, or a selection
        of it) as this engine's workers must be written: its processed layers in their form."""
        forms = {b: f for b, f in self.processing.forms.items()}
        return processed_layout(layout, forms) if forms else layout

    def check_destination(self, dst: Layout, first_rank: int = 0) -> None:
        """Refuse (``EngineMismatch``, naming the layers) a destination whose ranks
        ``first_rank..+tp`` would write a parameter of this engine in another form than its
        kernels read — e.g. the checkpoint form into a processed layer with no loader path —
        before anything is opened or moved."""
        problems = []
        for t in range(self.tp):
            r = first_rank + t
            if r >= dst.world_size:
                problems.append(f"the destination {dst.name} has no rank {r} for worker {t}")
                continue
            mine, theirs = self.layout.buffers(t), dst.buffers(r)
            # a processed form must be written as such, and a layer synced through vLLM's
            # processing whole (its staging holds nothing else): their fragments exactly the engine's
            loader = set(self.processing.loader)
            form_buffers = {b for b in theirs if b in self.processing.forms or self.processing.buffers.get(b) in loader}
            for b, spec in theirs.items():
                if b in mine and spec != mine[b] and b not in form_buffers:
                    problems.append(f"worker {t} {b[len(PREFIX):]}: the destination declares {spec}, "
                                    f"the engine {mine[b]}")
            if form_buffers:
                want = [f for f in self.layout.fragments(t) if f.buffer in form_buffers]
                got = [f for f in dst.fragments(r) if f.buffer in form_buffers]
                if got != want or any(theirs[b] != mine[b] for b in form_buffers):
                    layers = sorted({self.processing.buffers.get(b, b) for b in form_buffers})
                    problems += [f"worker {t} {n}: vLLM keeps it processed, and the destination {dst.name} does "
                                 f"not write it whole in the form the engine syncs it in "
                                 f"({self.processing.paths.get(n)}: {self.processing.found.get(n, '')})" for n in layers]
        if problems:
            raise EngineMismatch(f"vLLM engine for {self.model!r} cannot be written through {dst.name} "
                                 f"(nothing was opened or moved): " + " | ".join(problems[:6])
                                 + (f" | … ({len(problems)} in all)" if len(problems) > 6 else ""))

    def _load_adapter(self, seed: int) -> None:
        """The run's initial adapter (``engines.lora.initial_adapters``) loaded from a peft directory
        and pinned: it holds slot 0 for good, so the channel's writes there are what it computes."""
        import tempfile

        import torch
        from vllm.lora.request import LoRARequest

        from .lora import initial_adapters, save_adapter

        self._adapter_dir = tempfile.TemporaryDirectory(prefix="vps-lora-")
        save_adapter(self._adapter_dir.name, self.spec, initial_adapters(self.spec, seed), torch.float32)
        self.lora_request = LoRARequest("policy", 1, self._adapter_dir.name)
        engine = self.llm.llm_engine
        if not (engine.add_lora(self.lora_request) and engine.pin_lora(self.lora_request.lora_int_id)):
            raise RuntimeError("vLLM did not load and pin the run's LoRA adapter")
        self._rpc("vps_lora_setup", self.spec.lora.scaling)

    def _rpc(self, method: str, *args, timeout: float | None = None) -> list:
        return unwrap(method, self.llm.collective_rpc(method, timeout=timeout, args=args))

    # --- the layout -----------------------------------------------------------------------------------
    def check(self, layout: Layout) -> None:
        """Check another vLLM layout against this engine's workers (what the constructor does)."""
        check_engine(layout, self.description, f"vLLM engine for {self.model!r}", self.processing)

    # --- sleep / wake (a capability: real on GPU, refused by vLLM on CPU) -----------------------------
    def sleep(self, level: int = 1) -> bool:
        if not self.can_sleep:
            return False
        self.llm.sleep(level=level)
        self._asleep = True
        return True

    def wake_up(self, tags: list[str] | None = None) -> bool:
        if not self.can_sleep:
            return False
        self.llm.wake_up(tags)
        if tags is None or "kv_cache" in tags:
            self._asleep = False
        return True

    # --- the move -------------------------------------------------------------------------------------
    def load_from(self, world, src_layout: Layout, make_buffers: Callable[..., dict], *args,
                  budget_bytes: int = DEFAULT_BUDGET, timeout_s: float = MOVE_S, verify: str = "off",
                  handoff: str = "p2p", dst: Layout | None = None, **kwargs) -> LoadReport:
        """Move the weights ``src_layout`` describes, held by ``world``'s ranks (rank ``r``'s buffers
        are ``make_buffers(*args, **kwargs)`` run on rank ``r``), into this engine's workers: a
        one-shot weight channel (``engines/channel.py``) between the world's ranks and the workers —
        a loop keeps one channel open instead (``channel_open`` once, ``channel_receive`` per sync).
        ``verify`` (``off``/``sample``/``full``): check the move's bytes in the workers
        (``routing/verify.py``). ``handoff`` (``p2p``/``ipc``/``auto``, ``engines.channel.resolve_handoff``):
        here the world's rank ``t`` and worker ``t`` count as sharing device ``t`` (one host), so
        ``ipc`` hands worker ``t`` its weights as shared buckets of rank ``t``."""
        import time

        from .channel import Endpoint, open_store, resolve_handoff

        n = world.world_size
        if src_layout.world_size != n:
            raise LayoutError(f"{src_layout.name} is for {src_layout.world_size} ranks; the world has {n}")
        dst = self.layout if dst is None else dst  # or part of it (vps.layout.select: e.g. a LoRA run's adapters)
        if src_layout.spec.digest != dst.spec.digest:
            raise LayoutError(f"cannot load {src_layout.name} of model {src_layout.spec.name!r} "
                              f"({src_layout.spec.digest}) into {dst.name} of model {dst.spec.name!r} "
                              f"({dst.spec.digest}): different models; nothing was moved")
        self.check_destination(dst)  # a processed layer it would write in another form: refused here
        total = n + self.tp
        mode, colocated = resolve_handoff(handoff, list(range(n)) + list(range(self.tp)), n)
        t0 = time.perf_counter()
        store, host, port = open_store(timeout_s)
        endpoint = Endpoint(host, port, total, n, place(src_layout, range(n), total),
                            place(dst, range(n, total), total), budget_bytes, timeout_s,
                            verify=verify, handoff=mode, colocated=colocated)
        box: dict[str, Any] = {}

        def workers():
            try:
                self.channel_open(endpoint)
                box["workers"] = self.channel_receive(timeout_s)
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                box["error"] = e

        thread = threading.Thread(target=workers, name="vps-vllm-receive", daemon=True)
        thread.start()
        trainer_error = None
        try:
            trainer = world.run(_send, endpoint, make_buffers, args, kwargs, timeout=timeout_s + 60)
        except BaseException as e:  # noqa: BLE001 - wait for the workers before raising
            trainer, trainer_error = None, e
        thread.join(timeout_s + 120)
        del store
        if thread.is_alive():
            raise TimeoutError("vLLM workers did not finish the move") from trainer_error
        if trainer_error is not None:
            raise trainer_error
        if "error" in box:
            raise box["error"]
        received = sum(int(r["bytes_received"]) + int(r["bytes_local"]) for r in box["workers"])
        return LoadReport(time.perf_counter() - t0, received, self.can_sleep, trainer, box["workers"])

    # --- the weight channel: joined once, then one move per sync ----------------------------------------
    def channel_open(self, endpoint) -> list[dict]:
        """Every worker joins the run's weight channel (``engines.channel.Endpoint``) as rank
        ``endpoint.first_rank + tp_rank`` and keeps both layouts. Blocks until every member joined."""
        e = endpoint
        self.check_destination(e.dst, e.first_rank)
        return self._rpc("vps_channel_open", e.host, e.port, e.first_rank, e.world_size, pickle.dumps(e.src),
                         pickle.dumps(e.dst), e.timeout_s, e.budget_bytes, e.standby_s, e.verify, e.verify_fraction,
                         e.handoff, [list(p) for p in e.colocated], e.backend, timeout=e.timeout_s + 60)

    def channel_receive(self, timeout_s: float | None = None, verify: str | None = None) -> list[dict]:
        """The workers' part of one sync (the trainer ranks send meanwhile); sleep/wake around it
        where the platform has sleep mode. The prefix cache is reset first: KV computed with the
        old weights must not be reused, and nothing can compute KV between the reset and the new
        weights — this engine generates nothing until the call returns (a replica's calls run in
        order) — so the reset costs the sync nothing once the receive is posted ahead."""
        import time

        t0 = time.perf_counter()
        self.llm.reset_prefix_cache()
        reset_s = time.perf_counter() - t0
        if self.can_sleep:
            if not self._asleep:
                self.llm.sleep(level=2)
                self._asleep = True
            self.llm.wake_up(["weights"])
        t0 = time.perf_counter()
        answers = self._rpc("vps_channel_receive", verify, timeout=timeout_s)
        t1 = time.perf_counter()
        if self.can_sleep:
            self.llm.wake_up(["kv_cache"])
            self._asleep = False
        for a in answers:  # where the replica's time went: the workers' RPC (their move inside), the reset
            a.update(rpc_s=t1 - t0, reset_s=reset_s)
        return answers

    def channel_stats(self) -> list[dict]:
        return self._rpc("vps_channel_stats")

    def channel_close(self) -> None:
        self._rpc("vps_channel_close")

    # --- generation ------------------------------------------------------------------------------------
    def generate(self, prompts_token_ids: Sequence[Sequence[int]], max_tokens: int, greedy: bool = True,
                 seed: int | Sequence[int] | None = None, temperature: float = 1.0,
                 eos_token_id: int | None = None, stop_ids: Collection[int] = ()
                 ) -> tuple[list[list[int]], list[list[float]]]:
        """Generate from token-id prompts: (tokens, log-probabilities of those tokens) per prompt.
        Log-probabilities are of the raw model distribution (vLLM's default ``raw_logprobs``).
        ``seed``: one for every prompt, or one per prompt (a sample then depends only on its own
        seed, not on which replica or batch it ran in). ``eos_token_id`` and each of ``stop_ids``:
        stop after it (the token is returned; vLLM's ``stop_token_ids``); none: always
        ``max_tokens`` tokens."""
        from vllm import SamplingParams

        if self._asleep:
            self.wake_up()
        n = len(prompts_token_ids)
        seeds = list(seed) if isinstance(seed, Sequence) else [seed] * n
        if len(seeds) != n:
            raise ValueError(f"{len(seeds)} seeds for {n} prompts")
        stop = stop_set(eos_token_id, stop_ids)
        params = [SamplingParams(max_tokens=max_tokens, temperature=0.0 if greedy else temperature,
                                 logprobs=0, seed=s, detokenize=False, ignore_eos=True, stop_token_ids=stop)
                  for s in seeds]
        outs = self.llm.generate([{"prompt_token_ids": list(map(int, p))} for p in prompts_token_ids],
                                 params, use_tqdm=False, lora_request=self.lora_request)
        tokens, logprobs = [], []
        for o in outs:
            c = o.outputs[0]
            tokens.append(list(c.token_ids))
            logprobs.append([lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)])
        return tokens, logprobs

    # --- reading back (tests, checks) ------------------------------------------------------------------
    def read_weights(self) -> list[dict]:
        """Each worker's parameters (``param/<name>`` -> tensor), read back through safetensors."""
        from safetensors.torch import load

        return [load(b) for b in self._rpc("vps_read")]

    def shutdown(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        self.llm = None
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception:  # noqa: BLE001 - best effort: older/newer vLLM
            pass
        del llm
        import gc

        gc.collect()

    def __enter__(self) -> "VLLMRollout":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _send(endpoint, make_buffers: Callable[..., dict], args: tuple, kwargs: dict):
    """Trainer-rank job of ``load_from``: build this rank's source buffers, join the channel, send."""
    import torch.distributed as dist

    from .channel import ChannelEnd

    try:
        buffers, error = make_buffers(*args, **kwargs), None
    except Exception as e:  # noqa: BLE001 - still join, so every rank refuses the move at once
        buffers, error = {}, e  # (missing buffers make `move` refuse on every rank, workers included)
    e = endpoint
    channel = ChannelEnd.join(e.host, e.port, dist.get_rank(), e.world_size, timeout_s=e.timeout_s,
                              budget_bytes=e.budget_bytes, verify=e.verify, verify_fraction=e.verify_fraction,
                              handoff=e.handoff, colocated=e.colocated, backend=e.backend)
    channel.set_layouts(e.src, e.dst)
    try:
        return channel.move(buffers, {})
    except Exception:
        if error is not None:
            raise error from None
        raise
    finally:
        channel.close()


class VLLMRolloutEngine(RolloutEngine):
    """vLLM behind the rollout-engine interface: one ``VLLMRollout`` per replica (its own TP
    workers), weights received in place through the weight channel."""

    placement = "replica"
    compute_dtypes = ("float32", "bfloat16", "float16")
    takes_adapters = True  # into vLLM's LoRA slot (vllm_lora_layout); tests/test_lora.py
    resizable = True  # its replicas' layout (TP x replicas) changes in a running world (recipes.elastic)
    paged_kv = True  # paged attention and a scheduler: a batch beyond its KV cache decodes in waves
    profile_name = "vllm"
    # docs/weight-channel.md, "Weights vLLM processes after loading"
    options = {"cpu_kernels": compat.CPU_KERNEL_CHOICES, "processed_weights": PROCESSED_WEIGHTS}

    @classmethod
    def process_env(cls, verbose: bool = False) -> dict[str, str]:
        return compat.vllm_env(verbose)

    @classmethod
    def rollout_layout(cls, spec: ModelSpec, tp: int, replicas: int, dtype: str = "float32") -> Layout:
        """vLLM's layout; with LoRA adapters, theirs in vLLM's adapter slot."""
        if spec.lora is not None:
            return vllm_lora_layout(spec, tp, replicas, dtype)
        return vllm_layout(spec, tp, replicas, dtype)

    @classmethod
    def build(cls, ctx: RolloutContext) -> "VLLMRolloutEngine":
        compat.vllm_engine_core_in_this_process()  # the replica's actor process is this engine's own
        self = cls()
        options = dict(ctx.options)
        # vllm-cpu reads gpu_memory_utilization as a fraction of the HOST's memory to reserve unless
        # VLLM_CPU_KVCACHE_SPACE sizes the KV cache (process_env does): the knob is for devices
        if ctx.device.is_cuda:
            options.setdefault("gpu_memory_utilization", ctx.memory_utilization)
        self.rollout = VLLMRollout(ctx.model_dir, ctx.spec, tp=ctx.tp, seed=ctx.seed, dtype=ctx.device.compute_dtype,
                                   max_model_len=ctx.max_model_len, **options)
        self.name = f"vLLM TP{ctx.tp}"
        return self

    def generate(self, prompts, max_new_tokens, temperature, seeds, stop_ids):
        return self.rollout.generate(prompts, max_new_tokens, greedy=temperature == 0, seed=list(seeds),
                                     temperature=temperature or 1.0, stop_ids=stop_ids)

    def channel_destination(self, layout: Layout) -> Layout:
        return self.rollout.destination(layout)

    def channel_open(self, endpoint) -> None:
        self.rollout.channel_open(endpoint)

    def channel_receive(self) -> list[dict]:
        return self.rollout.channel_receive()

    def channel_stats(self) -> list[dict]:
        return self.rollout.channel_stats()

    def channel_close(self) -> None:
        self.rollout.channel_close()

    def sleep(self) -> bool:
        return self.rollout.sleep()

    def wake_up(self) -> bool:
        return self.rollout.wake_up()

    def shutdown(self) -> None:
        self.rollout.shutdown()
