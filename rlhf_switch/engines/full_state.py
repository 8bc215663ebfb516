"""The whole training state as full tensors on one process — what a checkpoint holds — and the
VPS moves that save a running engine into it and load it back into any engine.

``FullState`` implements the ``TrainAdapter`` contract for one *holder* rank: every tensor of the
model whole, as fp32 ``master`` (also described as ``param``: the weights), ``exp_avg`` and
``exp_avg_sq``, plus the scalars (step, LR scheduler, RNG). So a checkpoint is just another
layout: ``save`` is ``switch_training(engine, FullState)`` and ``load`` is
``switch_training(FullState, engine)`` — from any engine layout into any other, without a
checkpoint format per engine. Only the holder ever has the full state in memory (tiny-model RL and
tests; a sharded checkpoint for large models would give each rank its own holder of a part).

On disk (``save_dir``/``load_dir``), a Hugging Face directory that ``transformers`` and vLLM load
as it is, with the optimizer beside it:

- ``config.json`` + ``model.safetensors``: the weights under the model's own parameter names, in
  the model's dtype;
- ``optimizer/moments.safetensors``: ``exp_avg/<name>``, ``exp_avg_sq/<name>`` and the fp32
  ``master/<name>`` where the model dtype is not fp32 (in a subdirectory: vLLM loads every
  ``*.safetensors`` file at the top as weights);
- ``optimizer/trainer_state.pt``: the scalars (``torch.save`` of plain values and the RNG tensor).

With LoRA (a spec ``with_adapters``) ``model.safetensors`` holds the frozen base — the model
transformers and vLLM load — and ``lora_adapter/`` the adapters in peft's format
(``adapter_config.json`` + ``adapter_model.safetensors``: ``peft.PeftModel.from_pretrained(base,
"<dir>/lora_adapter")``); moments exist for the adapters only, the tensors that train.

Files are written under a temporary name and renamed, the directory last (``COMPLETE`` marker): a
crash mid-save leaves the previous checkpoint intact and the half-written one recognisably
incomplete.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Mapping

import torch

from ..vps import EXP_AVG, EXP_AVG_SQ, MASTER, PARAM, Box, ModelSpec, StateKey
from ..vps.materialize import TORCH_DTYPES
from ..rl.tokenizer import copy_tokenizer_files
from .train_state import LocalState

MOMENTS = (EXP_AVG, EXP_AVG_SQ)
COMPLETE = "COMPLETE"
OPTIMIZER = "optimizer/moments.safetensors"
TRAINER_STATE = "optimizer/trainer_state.pt"


class FullState:
    """The holder rank's adapter over whole tensors (create one on the holder only; other ranks
    pass ``None`` to ``switch_training``)."""

    def __init__(self, spec: ModelSpec, master: Mapping[str, torch.Tensor] | None = None,
                 moments: Mapping[str, Mapping[str, torch.Tensor]] | None = None,
                 scalars: Mapping[str, Any] | None = None, name: str = "full state"):
        self.spec, self.name = spec, name
        self.master = {t.name: _fp32_whole(master, t, zero=master is None) for t in spec.tensors}
        self.moments = {f: {t.name: _fp32_whole((moments or {}).get(f), t, zero=True) for t in spec.tensors
                            if spec.trainable(t.name)} for f in MOMENTS}
        self._scalars = dict(scalars) if scalars is not None else None

    def to(self, device: torch.device | str) -> "FullState":
        """Its tensors on ``device`` (in place; returns self): where the group that moves them
        carries tensors — the run's device under NCCL (a no-op on CPU). Saving writes from host
        copies either way."""
        self.master = {n: t.to(device) for n, t in self.master.items()}
        self.moments = {f: {n: t.to(device) for n, t in ts.items()} for f, ts in self.moments.items()}
        return self

    # --- TrainAdapter -----------------------------------------------------------------------------
    def _describe(self, field: str, tensors: Mapping[str, torch.Tensor]) -> LocalState:
        out = LocalState()
        for t in self.spec.tensors:
            if t.name not in tensors:  # a moment of a frozen tensor: there is none
                continue
            buf = out.add_buffer(f"{field}/{t.name}", tensors[t.name].view(-1))
            out.add_box(StateKey(t.name, field), Box.full(t.shape), buf)
        return out

    def weights(self) -> LocalState:
        return self._describe(PARAM, self.master)

    def state(self) -> LocalState:
        out = self._describe(MASTER, self.master)
        for f in MOMENTS:
            out.merge(self._describe(f, self.moments[f]))
        return out

    def prepare_state(self) -> None:
        pass

    def state_written(self) -> None:
        pass

    def scalars(self) -> dict[str, Any]:
        if self._scalars is None:
            raise ValueError(f"{self.name} has no scalars (step, LR schedule) to give")
        return dict(self._scalars)

    def load_scalars(self, scalars: Mapping[str, Any]) -> None:
        self._scalars = dict(scalars)

    # --- disk ---------------------------------------------------------------------------------------
    def save_dir(self, path: str | os.PathLike, hf_config: Mapping[str, Any] | None = None,
                 dtype: str = "float32", extra: Mapping[str, Any] | None = None,
                 tokenizer_from: str | os.PathLike | None = None, head: str = "lm",
                 files: Mapping[str, str] | None = None, lora_dropout: float = 0.0) -> Path:
        """Write the checkpoint directory (see the module doc); ``extra`` goes into
        ``trainer_state.pt`` beside the scalars (e.g. the iteration); ``tokenizer_from``: a
        directory whose tokenizer files are copied beside the weights, so the checkpoint loads
        as a ``model.path`` (weights, config and tokenizer) in transformers and vLLM. ``head``:
        the model ``config.json`` names (``write_hf_config``); ``files``: more text files to write
        beside the weights, by name (inside the same all-or-nothing rename). With LoRA: the base
        there, the adapters in ``lora_adapter/`` (``lora_dropout`` goes into its config)."""
        from safetensors.torch import save_file

        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        model_dtype = TORCH_DTYPES[dtype]
        base = self.spec.base()
        save_file({t.name: self.master[t.name].to("cpu", model_dtype).contiguous() for t in base.tensors},
                  str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if self.spec.lora is not None:
            from .lora import ADAPTER_DIR, save_adapter

            save_adapter(tmp / ADAPTER_DIR, self.spec, self.master, model_dtype, lora_dropout, base_model=str(path))
        opt = {f"{f}/{n}": t.cpu() for f in MOMENTS for n, t in self.moments[f].items()}
        if model_dtype != torch.float32:
            opt.update({f"master/{n}": t.cpu() for n, t in self.master.items()})
        (tmp / "optimizer").mkdir()
        save_file(opt, str(tmp / OPTIMIZER))
        torch.save({"scalars": self._scalars, "extra": dict(extra or {}), "spec_digest": self.spec.digest},
                   tmp / TRAINER_STATE)
        if hf_config is not None:
            write_hf_config(tmp, hf_config, dtype, head)
        for name, text in (files or {}).items():
            (tmp / name).write_text(text)
        if tokenizer_from is not None:
            copy_tokenizer_files(tokenizer_from, tmp)
        (tmp / COMPLETE).write_text("")
        if path.exists():
            shutil.rmtree(path)
        tmp.rename(path)
        return path

    @classmethod
    def load_dir(cls, path: str | os.PathLike, spec: ModelSpec, weights_only: bool = False,
                 seed: int = 0) -> "FullState":
        """Read a checkpoint directory written by ``save_dir`` (``weights_only``: any HF directory
        with ``model.safetensors``; moments zero, no scalars). With LoRA the adapters come from
        its ``lora_adapter/``; a ``weights_only`` directory without one (the warm start: the base)
        starts them as ``engines.lora.initial_adapters(spec, seed)``."""
        from safetensors.torch import load_file

        path = Path(path)
        if not (path / "model.safetensors").is_file():
            raise FileNotFoundError(f"{path} has no model.safetensors")
        if not weights_only and not (path / COMPLETE).is_file():
            raise FileNotFoundError(f"{path} is an incomplete checkpoint (no {COMPLETE} marker)")
        if not weights_only:  # a checkpoint names its model: refuse another one by name first
            meta = torch.load(path / TRAINER_STATE, weights_only=False)
            if meta.get("spec_digest") not in (None, spec.digest):
                raise ValueError(f"{path} holds another model (spec digest {meta['spec_digest']}, "
                                 f"this model {spec.digest})")
        master = load_file(str(path / "model.safetensors"))
        _check_weights(path, spec.base(), master)
        if spec.lora is not None:
            from .lora import ADAPTER_DIR, initial_adapters, load_adapter

            if (path / ADAPTER_DIR).is_dir():
                master.update(load_adapter(path / ADAPTER_DIR, spec))
            elif weights_only:
                master.update(initial_adapters(spec, seed))
            else:
                raise FileNotFoundError(f"{path} has no {ADAPTER_DIR}/: a checkpoint of a LoRA run holds its adapters there")
        if weights_only:
            return cls(spec, master, name=f"weights {path}")
        opt = load_file(str(path / OPTIMIZER))
        master.update({k[len("master/"):]: v for k, v in opt.items() if k.startswith("master/")})
        moments = {f: {k[len(f) + 1:]: v for k, v in opt.items() if k.startswith(f + "/")} for f in MOMENTS}
        state = cls(spec, master, moments, meta["scalars"], name=f"checkpoint {path}")
        state.extra = meta.get("extra", {})
        return state


# buffers some transformers versions save beside the weights; they are recomputed, never trained
IGNORED_WEIGHTS = ("rotary_emb.inv_freq",)


def _check_weights(path: Path, spec: ModelSpec, tensors: Mapping[str, torch.Tensor]) -> None:
    """The weights file must hold exactly the model's tensors, each of the model's shape: one
    ``ValueError`` naming every missing, unexpected or misshapen tensor (a ``model.path`` whose
    ``config.json`` says another model than its weights is refused here, before any move)."""
    problems = []
    for t in spec.tensors:
        x = tensors.get(t.name)
        if x is None:
            problems.append(f"{t.name} {list(t.shape)} is missing")
        elif tuple(x.shape) != tuple(t.shape):
            problems.append(f"{t.name} has shape {list(x.shape)}, the model's is {list(t.shape)}")
    extra = sorted(n for n in tensors if n not in spec and not n.endswith(IGNORED_WEIGHTS))
    if extra:
        more = f" (and {len(extra) - 5} more)" if len(extra) > 5 else ""
        problems.append(f"unexpected tensors not in the model: {', '.join(extra[:5])}{more}")
    if problems:
        more = f" (and {len(problems) - 10} more)" if len(problems) > 10 else ""
        raise ValueError(f"{path / 'model.safetensors'} does not hold model {spec.name!r}: "
                         + "; ".join(problems[:10]) + more)


def _fp32_whole(tensors: Mapping[str, torch.Tensor] | None, t, zero: bool = False) -> torch.Tensor:
    if tensors is None or t.name not in tensors:
        if zero:
            return torch.zeros(t.shape, dtype=torch.float32)
        raise KeyError(f"no tensor {t.name!r} {list(t.shape)} for the full state")
    x = tensors[t.name]
    if tuple(x.shape) != tuple(t.shape):
        raise ValueError(f"{t.name}: shape {list(x.shape)}, the model's is {list(t.shape)}")
    return x.detach().to(torch.float32).contiguous().clone()


def write_hf_config(path: str | os.PathLike, hf_config: Mapping[str, Any], dtype: str = "float32",
                    head: str = "lm") -> None:
    """``config.json`` of the family's causal LM (``families.py``; a dict without ``model_type`` is
    Llama) — with ``head="value"``, of its value model, ``…ForTokenClassification`` with one label
    (a reward model, docs/reward-models.md) — that transformers and vLLM load without a tokenizer
    (``architectures`` names the class and ``model_type`` the family; ``dtype`` the saved weights'
    dtype, also as ``torch_dtype`` for readers older than transformers 5). The attribute set is ``dtype``:
    transformers 5 warns "`torch_dtype` is deprecated!" on every write or read of
    ``config.torch_dtype`` (reading the key from a file does not warn)."""
    import json

    from ..families import family, hf_config_object

    cfg = hf_config_object({k: v for k, v in dict(hf_config).items() if k != "torch_dtype"})
    fam = family(hf_config)
    cfg.architectures = [fam.causal_lm_class if head == "lm" else fam.value_class]
    if head != "lm":
        cfg.num_labels = 1
    cfg.dtype = dtype
    cfg.save_pretrained(str(path))
    written = Path(path) / "config.json"
    data = json.loads(written.read_text())
    data["dtype"] = data["torch_dtype"] = dtype
    written.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def is_checkpoint(path: str | os.PathLike) -> bool:
    return (Path(path) / COMPLETE).is_file()


def checkpoint_extra(path: str | os.PathLike) -> dict:
    """What the writer put beside the scalars (``save_dir(extra=...)``, e.g. the loop's
    ``iteration``), read without loading any tensor of the model."""
    meta = torch.load(Path(path) / TRAINER_STATE, weights_only=False)
    return dict(meta.get("extra") or {})


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The newest complete ``step_<N>`` directory under ``root`` (incomplete ones are skipped)."""
    root = Path(root)
    if not root.is_dir():
        return None
    done = [p for p in root.glob("step_*") if p.is_dir() and is_checkpoint(p) and p.name[5:].isdigit()]
    return max(done, key=lambda p: int(p.name[5:]), default=None)

