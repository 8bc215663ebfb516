"""Reward models: preference pairs, the Bradley–Terry loss, where a reward model reads its score,
and the config of ``rlhf-switch rm`` (``recipes/rm.py``). Pure: no process group, no engine.

A reward model here is the family's value model — ``models.value_model``, the family's
``…ForTokenClassification`` with one label, the PPO critic's model — read at ONE position: the
last token of ``<bos> prompt response`` (the response ending in ``<eos>`` when it was finished).
The loop scores a rollout on exactly the ids the policy saw and generated (``prompt_ids +
response_ids``), and ``sequence_ids`` builds a training pair's sequences the same way, so the
trained and the scored sequences agree token for token.

- ``PreferenceData`` / ``RewardTraining`` / ``RewardModelRunConfig``: the ``rlhf-switch rm`` config
  (strict, as ``rl/config.py``); ``load_rm_config`` raises one ``ConfigError`` listing every bad
  field;
- ``read_preferences`` / ``load_preferences``: ``(prompt, chosen, rejected)`` records from
  ``.jsonl``/``.json``/``.parquet`` files (key names configurable), tokenized;
- ``last_token_batch``: right-padded ids with one pad column more than the longest sequence, so
  every sequence's last token has an output (the engines' ``outputs`` drop the last position),
  and the index of each last token; ``scores_at_last`` reads them;
- ``bradley_terry``: ``-log σ(r(chosen) - r(rejected))`` per pair, and whether the pair is ranked
  right (``r(chosen) > r(rejected)``: pairwise accuracy);
- ``tokenizer_identity`` / ``REWARD_MODEL_FILE``: what a reward model directory says about its
  vocabulary, which must be the policy's (checked before Ray, ``rlhf_switch.problems``).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence

import torch
import torch.nn.functional as F
from pydantic import Field

from .config import ModelConfig, SftConfig, Strict, TrainLayout, load_config
from .tasks import CharTokenizer

# beside the weights of a reward model ``rlhf-switch rm`` wrote: its tokenizer (kind and, for the
# character tokenizer, its tokens), how it reads its score, its held-out accuracy
REWARD_MODEL_FILE = "reward_model.json"


# ---------------------------------------------------------------- the rlhf-switch rm config


class PreferenceData(Strict):
    """Preference pairs from files: one record per pair with a string ``prompt_key``,
    ``chosen_key`` (the better response) and ``rejected_key``. ``chat_template``: render the
    prompt with the tokenizer's chat template (as a ``data:`` run renders its prompts).
    ``num_heldout`` caps the held-out pairs (the first ones, in file order)."""

    train_files: list[str] = Field(min_length=1)
    heldout_files: list[str] = Field(min_length=1)
    prompt_key: str = Field("prompt", min_length=1)
    chosen_key: str = Field("chosen", min_length=1)
    rejected_key: str = Field("rejected", min_length=1)
    chat_template: bool = False
    num_heldout: int | None = Field(None, ge=1)

    @property
    def keys(self) -> tuple[str, str, str]:
        return (self.prompt_key, self.chosen_key, self.rejected_key)


class RewardTraining(Strict):
    """``steps`` optimizer steps of ``batch_size`` pairs (drawn epoch by epoch in an order fixed
    by the seed), split over the DP ranks and run ``micro_batch_size`` pairs per forward (a pair's
    two sequences always in the same forward); AdamW at ``lr`` after ``warmup_steps`` of linear
    warmup. Held-out loss and pairwise accuracy every ``eval_every`` steps (0: at the end only)
    and at the end. ``keep``: which state ``final/`` holds — ``best``, that of the evaluation with
    the highest held-out accuracy (ties: the lower held-out loss; the later of equals), or ``last``."""

    steps: int = Field(300, ge=1)
    batch_size: int = Field(32, ge=1)
    micro_batch_size: int = Field(8, ge=1)
    lr: float = Field(3e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float | None = Field(1.0, gt=0)
    warmup_steps: int = Field(0, ge=0)
    eval_every: int = Field(50, ge=0)
    keep: Literal["best", "last"] = "best"


class RewardModelRunConfig(Strict):
    """One ``rlhf-switch rm`` run. ``model``: the architecture (``hf_config``) or ``path`` — a
    directory whose trunk (``model.*`` tensors: a causal LM such as an SFT warm start, or a value
    model) the reward model starts from; without weights the trunk is seeded. ``sft``: first
    teach a causal LM the chosen responses (prompt → chosen, as the loop's warm start) and start
    the reward model's trunk from it. ``train``: the training engine and its layout (engines with
    value heads: fsdp2, deepspeed), over all ``world_size`` devices. The tokenizer:
    ``model.tokenizer``, else ``model.path``'s when it holds one, else the character tokenizer of
    the generated tasks."""

    world_size: int = Field(ge=1)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    seed: int = 0
    output_dir: str = "runs/rm"
    ray_address: str | None = None
    model: ModelConfig
    train: TrainLayout
    data: PreferenceData
    training: RewardTraining = RewardTraining()
    sft: SftConfig | None = None

    def phases(self) -> dict:
        """The layouts this run uses, by phase name: its trainer's."""
        return {"train": self.train}


def load_rm_config(source: str | os.PathLike | Mapping[str, Any],
                   overrides: Mapping[str, Any] | None = None) -> RewardModelRunConfig:
    """A ``RewardModelRunConfig`` from a YAML file or a dict (``rl.config.load_config``);
    ``ConfigError`` lists every bad field."""
    return load_config(source, RewardModelRunConfig, overrides)


def rm_tokenizer(cfg: RewardModelRunConfig):
    """The run's tokenizer: the HF tokenizer at ``model.tokenizer`` (or ``model.path`` when it
    holds one), else the character tokenizer. ``TokenizerError`` when ``model.tokenizer`` has none."""
    from .tokenizer import HFTokenizer, has_tokenizer

    if cfg.model.tokenizer is not None:
        return HFTokenizer.from_pretrained(cfg.model.tokenizer)
    if cfg.model.path is not None and has_tokenizer(cfg.model.path):
        return HFTokenizer.from_pretrained(cfg.model.path)
    return CharTokenizer()


# ---------------------------------------------------------------- preference pairs


@dataclass(frozen=True)
class Preference:
    prompt: str
    chosen: str
    rejected: str


@dataclass(frozen=True)
class TokenizedPairs:
    """Pairs as token ids: ``chosen[i]`` and ``rejected[i]`` are ``sequence_ids`` of pair ``i``."""

    pairs: tuple[Preference, ...]
    chosen: tuple[tuple[int, ...], ...]
    rejected: tuple[tuple[int, ...], ...]
    dropped: int = 0  # pairs left out: a sequence longer than the model's context

    def __len__(self) -> int:
        return len(self.pairs)


def read_preferences(path: str | os.PathLike, data: PreferenceData) -> tuple[Preference, ...]:
    """The pairs of one file, in file order (``DataError`` naming the file and key otherwise)."""
    from .data import read_columns

    return tuple(Preference(*row) for row in read_columns(path, data.keys))


def sequence_ids(tokenizer, prompt: str, response: str, chat_template: bool = False) -> tuple[int, ...]:
    """``<bos> prompt response <eos>`` as the loop scores a finished rollout: the prompt encoded
    as the loop encodes it (rendered with the chat template when asked), the response's ids and
    the eos."""
    if chat_template:
        prompt = tokenizer.render_prompt(prompt, True)
    return tuple(tokenizer.encode(prompt, add_bos=True) + tokenizer.encode(response, add_eos=True))


def tokenize_pairs(pairs: Sequence[Preference], tokenizer, max_tokens: int, chat_template: bool = False,
                   limit: int | None = None) -> TokenizedPairs:
    """``pairs`` as ids, those with a sequence longer than ``max_tokens`` left out (counted);
    at most ``limit`` kept."""
    kept, chosen, rejected, dropped = [], [], [], 0
    for p in pairs:
        if limit is not None and len(kept) >= limit:
            break
        c = sequence_ids(tokenizer, p.prompt, p.chosen, chat_template)
        r = sequence_ids(tokenizer, p.prompt, p.rejected, chat_template)
        if max(len(c), len(r)) > max_tokens:
            dropped += 1
            continue
        kept.append(p)
        chosen.append(c)
        rejected.append(r)
    return TokenizedPairs(tuple(kept), tuple(chosen), tuple(rejected), dropped)


def load_preferences(cfg: RewardModelRunConfig, tokenizer, max_tokens: int) -> tuple[TokenizedPairs, TokenizedPairs]:
    """The run's (train, held-out) pairs, tokenized; pairs longer than ``max_tokens`` (the model's
    context: the scored position needs one more) dropped and counted."""
    d = cfg.data

    def split(files, limit):
        pairs = [p for f in files for p in read_preferences(f, d)]
        return tokenize_pairs(pairs, tokenizer, max_tokens, d.chat_template, limit)

    return split(d.train_files, None), split(d.heldout_files, d.num_heldout)


# ---------------------------------------------------------------- scores and the loss


def last_token_batch(seqs: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``ids [B, T]`` (right-padded with ``pad_id``, ``T`` = the longest sequence + 1) and
    ``last [B]``, the index of each sequence's last token. The extra pad column is what makes
    ``outputs(ids)[b, last[b]]`` exist for the longest sequence too (outputs are ``[B, T-1]``:
    the value of the state after ``ids[b, :t+1]``); right padding leaves every real position of
    a causal model untouched, so no attention mask is needed."""
    if not seqs or any(len(s) == 0 for s in seqs):
        raise ValueError("last_token_batch needs non-empty sequences")
    T = max(len(s) for s in seqs) + 1
    ids = torch.full((len(seqs), T), int(pad_id), dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, :len(s)] = torch.as_tensor(list(s), dtype=torch.long)
    return ids, torch.tensor([len(s) - 1 for s in seqs], dtype=torch.long)


def scores_at_last(values: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """``values [B, T-1]`` (a value engine's ``outputs``) at each row's last token: ``[B]``."""
    return values[torch.arange(values.shape[0], device=values.device), last.to(values.device)]


def bradley_terry(chosen: torch.Tensor, rejected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per pair: the Bradley–Terry loss ``-log σ(r_c - r_r)`` (``softplus(r_r - r_c)``, exact for
    large margins too) and whether the pair is ranked right (``r_c > r_r``, as float)."""
    margin = chosen.float() - rejected.float()
    return -F.logsigmoid(margin), (margin > 0).float()


def interleave(chosen: Sequence, rejected: Sequence) -> list:
    """``[c0, r0, c1, r1, …]``: a batch whose every even-sized contiguous slice holds whole pairs
    (the engines cut micro-batches as contiguous row slices)."""
    if len(chosen) != len(rejected):
        raise ValueError(f"{len(chosen)} chosen and {len(rejected)} rejected sequences")
    return [x for pair in zip(chosen, rejected) for x in pair]


# ---------------------------------------------------------------- the vocabulary of a reward model


def tokenizer_identity(tokenizer) -> dict:
    """What a tokenizer's vocabulary is, comparable across processes and files: the character
    tokenizer's tokens, or a HF tokenizer's token -> id map."""
    if isinstance(tokenizer, CharTokenizer):
        return {"kind": "char", "tokens": list(tokenizer.tokens)}
    return {"kind": "hf", "vocab": dict(tokenizer.hf.get_vocab())}


def reward_model_identity(path: str | os.PathLike) -> dict | None:
    """The vocabulary a reward model directory declares: its HF tokenizer files, else the
    character tokenizer ``reward_model.json`` names; None when it says nothing (then whether it
    reads the policy's ids cannot be known). ``TokenizerError`` when its tokenizer files do not load."""
    from .tokenizer import HFTokenizer, has_tokenizer

    root = Path(path)
    if has_tokenizer(root):
        return tokenizer_identity(HFTokenizer.from_pretrained(root))
    info = root / REWARD_MODEL_FILE
    if info.is_file():
        tok = json.loads(info.read_text()).get("tokenizer") or {}
        if tok.get("kind") == "char":
            return {"kind": "char", "tokens": list(tok.get("tokens") or [])}
    return None


def vocabulary_mismatch(reward: dict, policy: dict) -> str | None:
    """Why a reward model of vocabulary ``reward`` cannot score the policy's ids (``policy``), or
    None when they are the same vocabulary (``tokenizer_identity`` forms)."""
    kinds = {"char": "the character tokenizer", "hf": "a Hugging Face tokenizer"}
    if reward["kind"] != policy["kind"]:
        return f"it was made with {kinds[reward['kind']]}, the policy uses {kinds[policy['kind']]}"
    if reward["kind"] == "char":
        if reward["tokens"] != policy["tokens"]:
            return (f"its character tokenizer has {len(reward['tokens'])} tokens "
                    f"{''.join(t if len(t) == 1 else '' for t in reward['tokens'])!r}, the policy's "
                    f"{len(policy['tokens'])}")
        return None
    a, b = reward["vocab"], policy["vocab"]
    if a != b:
        differ = sorted(set(a.items()) ^ set(b.items()), key=lambda kv: kv[1])
        return (f"its tokenizer has {len(a)} tokens, the policy's {len(b)}; they differ at "
                f"{len(differ)} (token, id) entries, e.g. {differ[:3]}")
    return None
