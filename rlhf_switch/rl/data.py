"""Prompts and answers from files (the ``data:`` block), as the ``Splits`` of ``Sample(prompt,
answer)`` the loop consumes for generated tasks too.

``read_records(path, prompt_key, answer_key)`` reads one ``.jsonl``/``.json``/``.parquet`` file
with ``datasets`` (``load_dataset("json"|"parquet", data_files=..., split="train")``, cached in a
temporary directory, offline) and returns its ``(prompt, answer)`` string pairs, or raises one
``DataError`` naming the file and the key (``read_columns``: any string keys, e.g. a preference
file's ``prompt``/``chosen``/``rejected``). ``load_data_splits(data_cfg, tokenizer, max_tokens)``
renders every prompt (the chat template when ``chat_template``), drops those longer than
``max_tokens`` after tokenizing (counted in the returned ``DataSummary``) and keeps the file order:
the loop's ``draw_prompts`` shuffles, by (seed, iteration).
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from .tasks import Sample, Splits

EXTENSIONS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


class DataError(ValueError):
    """A data file that cannot be used; the message names the file (and the key)."""


@dataclass(frozen=True)
class DataSummary:
    """What ``load_data_splits`` read and dropped, for the start-up line."""

    train_read: int
    train_dropped: int
    heldout_read: int
    heldout_dropped: int
    max_tokens: int

    def line(self) -> str:
        return (f"data: {self.train_read} train prompts read, {self.train_dropped} dropped; "
                f"{self.heldout_read} held-out read, {self.heldout_dropped} dropped "
                f"(longer than {self.max_tokens} tokens)")


# (path, size, mtime, keys) -> rows: the config check and the loop read each file once
_READ: dict[tuple, tuple[tuple[str, ...], ...]] = {}


def _load(path: Path, builder: str):
    # offline before datasets is imported: a local file must never cost a network call
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import datasets

    datasets.disable_progress_bars()
    # a bad file is reported once, by DataError; datasets would also log it at ERROR
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    with tempfile.TemporaryDirectory(prefix="rlhf_switch_data_") as cache:
        ds = datasets.load_dataset(builder, data_files=[str(path)], split="train", cache_dir=cache,
                                   keep_in_memory=True)
        return ds.features, ds.num_rows, ds


def read_records(path: str | os.PathLike, prompt_key: str, answer_key: str) -> tuple[tuple[str, str], ...]:
    """The file's ``(prompt, answer)`` pairs, in file order."""
    return read_columns(path, (prompt_key, answer_key))  # type: ignore[return-value]


def read_columns(path: str | os.PathLike, keys: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
    """The file's string values of ``keys``, one tuple per record, in file order; one
    ``DataError`` naming the file and the key when a key is missing, not strings, or empty."""
    path = Path(path)
    builder = EXTENSIONS.get(path.suffix.lower())
    if builder is None:
        raise DataError(f"{path}: unsupported extension {path.suffix or '(none)'!r} "
                        f"(use {', '.join(EXTENSIONS)})")
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns, *keys)
    if key in _READ:
        return _READ[key]
    if stat.st_size == 0:
        raise DataError(f"{path}: the file is empty")
    try:
        features, rows, ds = _load(path, builder)
        columns = {k: ds[k] for k in keys if k in features}
    except Exception as e:  # datasets wraps parse errors in several types; the cause is what helps
        cause = e.__cause__ or e
        raise DataError(f"{path}: not readable as {builder} ({type(cause).__name__}: "
                        f"{str(cause).splitlines()[0][:200] if str(cause) else ''})") from None
    if rows == 0:
        raise DataError(f"{path}: no records")
    for k in keys:
        if k not in features:
            raise DataError(f"{path}: no key {k!r} (keys: {', '.join(features) or 'none'})")
        dtype = getattr(features[k], "dtype", None)
        if dtype not in ("string", "large_string"):
            raise DataError(f"{path}: key {k!r} holds {dtype or type(features[k]).__name__}, not strings")
    records = []
    for i, values in enumerate(zip(*(columns[k] for k in keys))):
        for k, v in zip(keys, values):
            if v is None:
                raise DataError(f"{path}: record {i} has no value for key {k!r}")
        records.append(tuple(values))
    _READ[key] = tuple(records)
    return _READ[key]


def _samples(files, data_cfg: Any, render: Callable[[str], str], tokenizer, max_tokens: int,
             limit: int | None) -> tuple[list[Sample], int, int]:
    read, kept, dropped = 0, [], 0
    for f in files:
        for prompt, answer in read_records(f, data_cfg.prompt_key, data_cfg.answer_key):
            if limit is not None and len(kept) >= limit:
                break
            read += 1
            rendered = render(prompt)
            if len(tokenizer.encode(rendered, add_bos=True)) > max_tokens:
                dropped += 1
                continue
            kept.append(Sample(rendered, answer))
    return kept, read, dropped


def prompt_token_limit(data_cfg: Any, max_new_tokens: int, max_context: int) -> int:
    """The longest prompt kept: ``max_prompt_tokens``, and never more than the context leaves
    for the response."""
    room = max_context - max_new_tokens
    return room if data_cfg.max_prompt_tokens is None else min(data_cfg.max_prompt_tokens, room)


def load_data_splits(data_cfg: Any, tokenizer, max_tokens: int,
                     render: Callable[[str], str] | None = None) -> tuple[Splits, DataSummary]:
    """Train and held-out samples (prompts rendered, too-long ones dropped; held-out capped at
    ``num_heldout``). ``DataError`` when a file is bad or every prompt of a split is too long.
    ``render``: a prompt's text as the model sees it (``prompt_renderer``; default: the chat
    template's user message when ``data_cfg.chat_template``, else the text)."""
    if render is None:
        render = lambda text: tokenizer.render_prompt(text, data_cfg.chat_template)  # noqa: E731
    train, tr_read, tr_drop = _samples(data_cfg.train_files, data_cfg, render, tokenizer, max_tokens, None)
    heldout, ho_read, ho_drop = _samples(data_cfg.heldout_files, data_cfg, render, tokenizer, max_tokens,
                                         data_cfg.num_heldout)
    for split, kept, read in (("train_files", train, tr_read), ("heldout_files", heldout, ho_read)):
        if not kept:
            raise DataError(f"data.{split}: all {read} prompts are longer than {max_tokens} tokens after "
                            f"rendering and tokenizing (data.max_prompt_tokens, or the context minus "
                            f"algorithm.max_new_tokens)")
    return (Splits(train=tuple(train), heldout=tuple(heldout)),
            DataSummary(tr_read, tr_drop, ho_read, ho_drop, max_tokens))


def load_splits(cfg: Any, tokenizer=None, render: Callable[[str], str] | None = None) -> tuple[Splits, str]:
    """The run's samples, from ``cfg.task`` (generated) or ``cfg.data`` (files), and a one-line
    summary for the start-up output. ``tokenizer``: the run's (``load_tokenizer(cfg)`` when None);
    ``render``: a data prompt's text as the model sees it (default ``load_data_splits``'s; an agent
    run's chat prompts: ``agent.config.prompt_renderer``)."""
    from ..families import context_length
    from .tasks import build_task, make_splits

    if cfg.task is not None:
        t = cfg.task
        splits = make_splits(build_task(t.name, t.min_len, t.max_len, t.length_skew), t.num_train, t.num_heldout, t.seed)
        return splits, f"task {t.name}: {len(splits.train)} train prompts, {len(splits.heldout)} held-out"
    if tokenizer is None:
        from .tokenizer import load_tokenizer

        tokenizer = load_tokenizer(cfg)
    limit = prompt_token_limit(cfg.data, cfg.algorithm.max_new_tokens, context_length(cfg.model.hf_dict()))
    splits, summary = load_data_splits(cfg.data, tokenizer, limit, render)
    return splits, summary.line()
