"""Rank-side jobs of ``test_families_vllm.py``: vLLM's own model classes and loaders, no engine;
and ``trainer_buffers``, the trainer ranks' buffers every real-vLLM test moves from.

Spawned ranks import this module, so its top level stays light (no vllm, no transformers).
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def worker_differences(where: str, got, want, masks) -> list[str]:
    """What a vLLM worker's parameters (``got``: name -> tensor, as its loader left them) hold that
    the layout's buffers for that worker (``want``/``masks``: ``param/<name>`` -> flat tensor and
    the mask of elements some fragment covers) do not: bit for bit, covered elements only."""
    from rlhf_switch.vps.materialize import bits

    problems = []
    for name, t in got.items():
        w, mk = want.get("param/" + name), masks.get("param/" + name)
        if w is None:
            continue
        flat = t.reshape(-1)
        if flat.numel() != w.numel():
            problems.append(f"{where}: {name} has {flat.numel()} elements in vLLM, layout {w.numel()}")
        elif not torch.equal(bits(flat)[mk], bits(w)[mk]):
            problems.append(f"{where}: {name}: {(bits(flat)[mk] != bits(w)[mk]).sum().item()} elements differ")
    return problems


def _vllm_model(model_dir: str, tp: int):
    """vLLM's model class of ``model_dir``'s checkpoint, built for this rank's TP rank (the
    caller has initialised vLLM's model parallel groups)."""
    from vllm.config import ModelConfig, ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.model_loader.utils import get_model_architecture

    model_config = ModelConfig(model=model_dir, dtype="float32", enforce_eager=True, skip_tokenizer_init=True)
    vllm_config = VllmConfig(model_config=model_config, parallel_config=ParallelConfig(tensor_parallel_size=tp))
    cls, _ = get_model_architecture(model_config)
    with set_current_vllm_config(vllm_config):
        return cls(vllm_config=vllm_config)


def family_loader_check(cases, move_from=None) -> list[list[str]]:
    """For each ``(model_dir, tp, shift)``: build vLLM's model for this rank's TP rank, let its own
    ``load_weights`` read the checkpoint, and compare every parameter with
    ``materialize(vllm_layout(spec, tp, replicas), (tp_rank + shift) % tp)`` of the same tensors
    (``shift`` != 0 is a control: another worker's layout must differ). Buffers must be exactly
    vLLM's parameters.

    ``move_from`` = ``(case index, ParallelConfig)``: also move that case's tensors from the trainer
    layout ``build_layout(spec, config)`` (filled from the checkpoint) into zeroed buffers of the
    vLLM layout through the executor, and compare them bit for bit with vLLM's loaded parameters.
    Returns, per case, the differences found."""
    import json
    import os

    from safetensors.torch import load_file
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    from rlhf_switch.compat import vllm_dist_ident
    from rlhf_switch.models import model_spec
    from rlhf_switch.routing import move
    from rlhf_switch.vps import build_layout
    from rlhf_switch.vps.layouts.vllm import vllm_layout
    from rlhf_switch.vps.materialize import allocate, bits, coverage_masks, materialize

    rank, world = dist.get_rank(), dist.get_world_size()
    found: list[list[str]] = []
    # the LocalWorld's gloo world is already up: vLLM adopts it as its world group (and its CPU shm
    # communicator, where present, needs one VLLM_DIST_IDENT on every rank)
    with set_current_vllm_config(VllmConfig()), vllm_dist_ident():
        ps.init_distributed_environment(world, rank, backend="gloo")
        for i, (model_dir, tp, shift) in enumerate(cases):
            problems: list[str] = []
            found.append(problems)
            hf_config = json.loads(open(os.path.join(model_dir, "config.json")).read())
            spec = model_spec(hf_config)
            hf = load_file(os.path.join(model_dir, "model.safetensors"))
            ps.initialize_model_parallel(tensor_model_parallel_size=tp, backend="gloo")
            try:
                t_rank = ps.get_tensor_model_parallel_rank()
                model = _vllm_model(model_dir, tp)
                model.load_weights(iter(hf.items()))
                got = {n: p.data for n, p in model.named_parameters()}
                layout = vllm_layout(spec, tp, replicas=world // tp)
                want_rank = rank - t_rank + (t_rank + shift) % tp
                want = materialize(layout, want_rank, lambda key: hf[key.tensor])
                masks = coverage_masks(layout, want_rank)
                where = f"{hf_config['model_type']} TP{tp} rank {t_rank}"
                if set(want) != {"param/" + n for n in got}:
                    problems.append(f"{where}: buffers {sorted(set(want) - {'param/' + n for n in got})} "
                                    f"not in vLLM, vLLM's {sorted({'param/' + n for n in got} - set(want))} "
                                    f"not in the layout")
                problems += worker_differences(where, got, want, masks)
                if move_from is not None and move_from[0] == i and not problems:
                    src = build_layout(spec, move_from[1])
                    src_bufs = materialize(src, rank, lambda key: hf[key.tensor])
                    dst_bufs = allocate(layout, rank, fill=0.0)
                    move(src, layout, src_bufs, dst_bufs)
                    for name, t in got.items():
                        moved = dst_bufs["param/" + name]
                        mk = masks["param/" + name]
                        if not torch.equal(bits(t.reshape(-1))[mk], bits(moved)[mk]):
                            problems.append(f"{where}: moved from {src.name}: {name} differs from vLLM's load")
            finally:
                ps.destroy_model_parallel()
    return found


def trainer_buffers(layout, state):
    """A trainer rank's buffers of ``layout``, built from the driver's global tensors."""
    from rlhf_switch.vps.materialize import materialize

    return materialize(layout, dist.get_rank(), lambda key: state[key.tensor])


_TRAINER = {}  # this rank's FSDP2 trainer, kept between jobs (the LocalWorld's processes stay up)


def train_fsdp2(cfg: dict, steps: int, seed: int = 0):
    """Build an FSDP2 trainer of ``cfg`` over the world, train ``steps`` AdamW steps on seeded
    batches, keep it for ``trainer_weights``; return (on rank 0) the layout of its weights and
    the full trained parameters by HF name (``full_tensor()``, collective)."""
    from rlhf_switch.engines.torch_train import build_fsdp2
    from rlhf_switch.engines.train_state import gather_layouts

    trainer = build_fsdp2(cfg, seed, list(range(dist.get_world_size())))
    g = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        trainer.train_step(torch.randint(3, cfg["vocab_size"], (4, 16), generator=g))
    _TRAINER["fsdp2"] = trainer
    weights = trainer.adapter.weights()
    (layout,), _ = gather_layouts([(trainer.spec, weights)], ["weights"])
    full = {n: p.full_tensor().detach().clone() for n, p in trainer.module.named_parameters()}
    return (layout, full) if dist.get_rank() == 0 else None


def trainer_weights() -> dict:
    """This rank's trainer weight buffers (the live parameters), as its layout names them."""
    return _TRAINER["fsdp2"].adapter.weights().tensors


def processed_forms_check(cases, seed: int = 0) -> list[dict]:
    """For each ``(model_dir, tp)``: vLLM's model for this rank's TP rank, loaded by its own loader
    and processed by its own post-load processing with vLLM's CPU kernels (none of
    ``compat``'s plain-kernel patches), then probed (``vllm_processed.probe``) and planned
    (``vllm_rollout.plan_processing``) as an engine's workers are. Returns per case the layers'
    paths, the forms chosen, and every difference between the parameters vLLM processed and what
    the processed layout (``processed_layout``) places, bit for bit — for each buffer whose live
    parameter holds the layout's elements (plain and processed-form layers)."""
    import json
    import os

    from safetensors.torch import load_file
    from vllm.config import ModelConfig, ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps
    from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading

    from rlhf_switch import compat
    from rlhf_switch.engines import vllm_processed
    from rlhf_switch.engines.vllm_rollout import candidate_forms, plan_processing
    from rlhf_switch.models import model_spec
    from rlhf_switch.vps.layouts.vllm import processed_layout, vllm_layout
    from rlhf_switch.vps.materialize import bits, coverage_masks, materialize

    compat.apply_vllm_cpu_kernels("vllm")  # vLLM's own CPU kernels and post-load processing
    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    with set_current_vllm_config(VllmConfig()), compat.vllm_dist_ident():
        ps.init_distributed_environment(world, rank, backend="gloo")
        for model_dir, tp in cases:
            hf_config = json.loads(open(os.path.join(model_dir, "config.json")).read())
            spec = model_spec(hf_config)
            hf = load_file(os.path.join(model_dir, "model.safetensors"))
            ps.initialize_model_parallel(tensor_model_parallel_size=tp, backend="gloo")
            try:
                t_rank = ps.get_tensor_model_parallel_rank()
                model_config = ModelConfig(model=model_dir, dtype="float32", enforce_eager=True, skip_tokenizer_init=True)
                vllm_config = VllmConfig(model_config=model_config, parallel_config=ParallelConfig(tensor_parallel_size=tp))
                with set_current_vllm_config(vllm_config):  # as vLLM's loader: created forms recorded, loaded, processed
                    model = initialize_model(vllm_config=vllm_config)
                    model.load_weights(iter(hf.items()))
                    process_weights_after_loading(model, model_config, torch.device("cpu"))
                base = vllm_layout(spec, tp, replicas=world // tp)
                layers = vllm_processed.describe(model)
                candidates = candidate_forms(layers)
                probes = vllm_processed.probe(model, base, rank, candidates, seed=seed)
                plan = plan_processing([{"layers": layers}], [probes], candidates, "auto")
                layout = processed_layout(base, dict(plan.forms))
                want, masks = materialize(layout, rank, lambda key: hf[key.tensor]), coverage_masks(layout, rank)
                differences = []
                for name, p in model.named_parameters():
                    b = "param/" + name
                    if plan.paths[plan.buffers[b]] == "loader" and p.numel() != want[b].numel():
                        continue  # kept only as a prepacked copy: not comparable element by element
                    if p.numel() != want[b].numel():
                        differences.append(f"TP{tp} rank {t_rank} {name}: {p.numel()} elements, layout {want[b].numel()}")
                    elif not torch.equal(bits(p.data.reshape(-1))[masks[b]], bits(want[b])[masks[b]]):
                        differences.append(f"TP{tp} rank {t_rank} {name}: elements differ")
                out.append({"paths": dict(plan.paths), "forms": {b: tuple(f) for b, f in plan.forms.items()},
                            "found": dict(plan.found), "differences": differences})
            finally:
                ps.destroy_model_parallel()
    return out

