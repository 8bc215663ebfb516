"""The run's tokenizer: the character tokenizer for generated ``task:`` runs, a Hugging Face
tokenizer (``model.tokenizer``, default ``model.path``) for ``data:`` runs.

``HFTokenizer`` gives an ``AutoTokenizer`` the interface the loop uses from ``CharTokenizer``
(``encode(text, add_bos, add_eos)``, ``decode(ids)`` up to the eos, ``pad_id``/``bos_id``/
``eos_id``/``vocab_size``) plus ``render_prompt`` (the chat template, or the plain text) and
``save``. The engines are fed token ids only; the tokenizer never leaves the driver.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Sequence

from .tasks import CharTokenizer


# what AutoTokenizer.from_pretrained reads from a directory (whichever of them the tokenizer wrote)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json")


def has_tokenizer(path: str | os.PathLike) -> bool:
    """Whether ``path`` holds a Hugging Face tokenizer (what ``AutoTokenizer`` needs first)."""
    p = Path(path)
    return (p / "tokenizer_config.json").is_file() and ((p / "tokenizer.json").is_file()
                                                       or (p / "tokenizer.model").is_file()
                                                       or (p / "vocab.json").is_file())


def copy_tokenizer_files(src: str | os.PathLike, dst: str | os.PathLike) -> list[str]:
    """Copy ``src``'s tokenizer files (``TOKENIZER_FILES`` that exist) into ``dst``; returns their
    names. A ``src`` without a tokenizer copies nothing (a generated-task run has none)."""
    copied = []
    for name in TOKENIZER_FILES:
        f = Path(src) / name
        if f.is_file():
            shutil.copyfile(f, Path(dst) / name)
            copied.append(name)
    return copied


class TokenizerError(ValueError):
    """No usable tokenizer where the config says one is."""


class HFTokenizer:
    """A Hugging Face tokenizer behind ``CharTokenizer``'s interface. The eos is the tokenizer's
    (a chat model's end of turn); pad is the tokenizer's pad, else its eos; bos may be None (then
    ``add_bos`` adds nothing)."""

    def __init__(self, tokenizer: Any, path: str | None = None):
        if tokenizer.eos_token_id is None:
            raise TokenizerError(f"tokenizer at {path}: it has no eos token (a response could never end)")
        self.hf, self.path = tokenizer, path
        self.eos_id = int(tokenizer.eos_token_id)
        self.pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_id)
        self.bos_id = None if tokenizer.bos_token_id is None else int(tokenizer.bos_token_id)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "HFTokenizer":
        """Load from a local directory only (never the network); ``TokenizerError`` naming the
        path when there is no tokenizer there."""
        root = Path(path)
        if not root.is_dir():
            raise TokenizerError(f"no directory {root} to load a tokenizer from")
        if not any((root / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model",
                                                  "vocab.json")):
            raise TokenizerError(f"no tokenizer in {root} (no tokenizer.json / tokenizer_config.json)")
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(str(root), local_files_only=True)
        except Exception as e:  # transformers raises OSError, ValueError, KeyError... by file
            raise TokenizerError(f"the tokenizer in {root} does not load: {type(e).__name__}: {e}") from None
        return cls(tok, str(root))

    @property
    def vocab_size(self) -> int:
        """Every id the tokenizer can produce, added tokens included (``len``, not ``.vocab_size``)."""
        return len(self.hf)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def render_prompt(self, text: str, chat_template: bool) -> str:
        """The prompt as the model sees it: one user message in the chat template, the
        assistant's turn opened (``add_generation_prompt``), or ``text`` itself."""
        if not chat_template:
            return text
        if not self.has_chat_template:
            raise TokenizerError(f"tokenizer at {self.path} has no chat template (set data.chat_template: false)")
        return self.hf.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                           add_generation_prompt=True)

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        # special tokens written in the text (a rendered chat template's) are matched as tokens
        ids = list(self.hf.encode(text, add_special_tokens=False))
        if add_bos and self.bos_id is not None and ids[:1] != [self.bos_id]:  # a template may hold it
            ids.insert(0, self.bos_id)
        if add_eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text up to the eos, pad and bos dropped; ids outside the tokenizer (a model's padded
        vocab) decode to ``?``, as with ``CharTokenizer``."""
        parts, run = [], []
        for i in (int(i) for i in ids):
            if i == self.eos_id:
                break
            if i == self.pad_id or i == self.bos_id:
                continue
            if not 0 <= i < self.vocab_size:
                parts.append(self.hf.decode(run))
                parts.append("?")
                run = []
                continue
            run.append(i)
        parts.append(self.hf.decode(run))
        return "".join(parts)

    def save(self, out_dir: str | os.PathLike) -> Path:
        self.hf.save_pretrained(str(out_dir))
        return Path(out_dir)


def tokenizer_path(cfg: Any) -> str | None:
    """Where a ``data:`` run's tokenizer is: ``model.tokenizer``, else ``model.path``."""
    return cfg.model.tokenizer or cfg.model.path


def load_tokenizer(cfg: Any) -> CharTokenizer | HFTokenizer:
    """The run's tokenizer: ``CharTokenizer`` for ``task:`` runs, the HF tokenizer at
    ``tokenizer_path(cfg)`` for ``data:`` runs."""
    if cfg.data is None:
        return CharTokenizer()
    path = tokenizer_path(cfg)
    if path is None:
        raise TokenizerError("a data: run needs a tokenizer: set model.path or model.tokenizer")
    return HFTokenizer.from_pretrained(path)
