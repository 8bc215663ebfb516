"""``data:`` runs without Ray: the shipped GSM8K-format data regenerates byte for byte, the BPE
tokenizer round-trips through ``AutoTokenizer``, files become ``Splits`` (rendered, too-long
prompts dropped and counted), prompts are drawn once per epoch by (seed, iteration), the warm
start begins from ``model.path``, and every bad input is one message naming the file and key,
exit 2, before Ray starts."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import yaml

from test_loop_inputs import cli, config

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "data" / "gsm8k_tiny"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny Llama (vocab 384) with the BPE tokenizer beside it: a data run's ``model.path``."""
    from rlhf_switch.testing.tiny_models import build_model_dir

    return build_model_dir(tmp_path_factory.mktemp("tiny") / "model")


def data_config(model_dir: Path, **data) -> dict:
    """The shipped FSDP2 + torch-rollout config on ``model_dir`` and the shipped GSM8K-format data."""
    cfg = config()
    cfg["model"] = {"path": str(model_dir)}
    del cfg["task"]
    cfg["data"] = {"train_files": [str(DATA / "train.jsonl")], "heldout_files": [str(DATA / "test.jsonl")],
                   "chat_template": True, **data}
    cfg["algorithm"]["max_new_tokens"] = 24
    cfg["eval"]["num_prompts"] = 16
    cfg["sft"] = None
    return cfg


# ---------------------------------------------------------------- shipped data and tokenizer


def test_shipped_data_regenerates_byte_identically(tmp_path):
    from rlhf_switch.testing.gsm8k_tiny import write_splits

    train, test = write_splits(tmp_path)
    assert train.read_bytes() == (DATA / "train.jsonl").read_bytes()
    assert test.read_bytes() == (DATA / "test.jsonl").read_bytes()
    records = [json.loads(x) for x in train.read_text().splitlines()]
    assert len(records) == 2000 and sum(p.stat().st_size for p in DATA.iterdir()) < 1_000_000
    assert all(" #### " in r["answer"] for r in records)
    held = {json.loads(x)["question"] for x in test.read_text().splitlines()}
    assert len(held) == 200 and not held & {r["question"] for r in records}


def test_bpe_tokenizer_round_trips_through_autotokenizer(tmp_path):
    from transformers import AutoTokenizer

    from rlhf_switch.testing.bpe_tokenizer import VOCAB_SIZE, build_bpe_tokenizer

    build_bpe_tokenizer(tmp_path / "a")
    build_bpe_tokenizer(tmp_path / "b")
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "b" / "tokenizer.json").read_bytes()
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "a"))
    assert len(tok) == VOCAB_SIZE
    text = "Ann has 12 apples; she gets 7 more. 12 + 7 = 19. #### 19 (ünïcode too)"
    ids = tok.encode(text, add_special_tokens=False)
    assert max(ids) < VOCAB_SIZE and tok.decode(ids) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.convert_ids_to_tokens([0, 1, 2, 3]) == ["<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert (tok.pad_token_id, tok.eos_token_id) == (0, 3)


def test_hf_tokenizer_interface(model_dir, tmp_path):
    from rlhf_switch.rl.config import load_config
    from rlhf_switch.rl.tasks import CharTokenizer
    from rlhf_switch.rl.tokenizer import HFTokenizer, load_tokenizer

    assert isinstance(load_tokenizer(load_config(config())), CharTokenizer)  # task: runs
    assert load_tokenizer(load_config(data_config(model_dir))).path == str(model_dir)

    tok = HFTokenizer.from_pretrained(model_dir)
    assert (tok.pad_id, tok.eos_id, tok.bos_id, tok.vocab_size) == (0, 3, None, 384)
    rendered = tok.render_prompt("What is 2 + 3?", chat_template=True)
    assert rendered.startswith("<|im_start|>user\nWhat is 2 + 3?") and rendered.endswith("assistant\n")
    assert tok.render_prompt("What is 2 + 3?", chat_template=False) == "What is 2 + 3?"
    ids = tok.encode(rendered, add_bos=True)
    assert ids[0] == 2 and ids.count(2) == 2  # <|im_start|> matched as one token; no bos to add
    answer = tok.encode("2 + 3 = 5. #### 5", add_eos=True)
    assert answer[-1] == tok.eos_id
    # decode: stops at the eos, drops pad, ids beyond the tokenizer become "?"
    assert tok.decode([0] + answer + tok.encode("junk")) == "2 + 3 = 5. #### 5"
    assert tok.decode(tok.encode("#### ") + [400] + tok.encode("5")) == "#### ?5"
    again = HFTokenizer.from_pretrained(tok.save(tmp_path / "saved"))
    assert again.encode(rendered) == tok.encode(rendered) and again.eos_id == tok.eos_id


def test_decode_when_pad_or_bos_is_the_eos(model_dir):
    """Tokenizers without a pad token pad with the eos (HFTokenizer's own default), and some have
    one token for bos and eos (GPT-2's ``<|endoftext|>``): that id still ends the response — it is
    not dropped as padding or as a bos, which would run the text on into what follows it."""
    from transformers import AutoTokenizer

    from rlhf_switch.rl.tokenizer import HFTokenizer

    def variant(**special) -> HFTokenizer:
        hf = AutoTokenizer.from_pretrained(str(model_dir))
        for name, value in special.items():
            setattr(hf, name, value)
        return HFTokenizer(hf, str(model_dir))

    base = HFTokenizer.from_pretrained(model_dir)
    eos = base.hf.eos_token
    no_pad, pad_is_eos, bos_is_eos = variant(pad_token=None), variant(pad_token=eos), variant(bos_token=eos)
    assert no_pad.pad_id == pad_is_eos.pad_id == pad_is_eos.eos_id
    assert bos_is_eos.bos_id == bos_is_eos.eos_id and bos_is_eos.pad_id != bos_is_eos.eos_id
    for tok in (no_pad, pad_is_eos, bos_is_eos):
        answer = tok.encode("2 + 3 = 5. #### 5")
        after = tok.encode(" #### 9 and more")
        assert tok.decode(answer + [tok.eos_id] + after) == "2 + 3 = 5. #### 5"
        assert tok.decode(answer + [tok.eos_id] * 3) == "2 + 3 = 5. #### 5"  # padded with the eos
        assert tok.decode([tok.eos_id] + answer) == ""
        assert tok.decode(answer) == "2 + 3 = 5. #### 5"  # cut at max_new_tokens: no eos at all
    # the pad that is not the eos is still dropped wherever it is
    assert bos_is_eos.decode([bos_is_eos.pad_id] + bos_is_eos.encode("#### 5") + [bos_is_eos.pad_id]) == "#### 5"


# ---------------------------------------------------------------- files -> splits


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


PREFS = [{"prompt": "1+1=", "chosen": "2", "rejected": "3", "answer": "#### 2"},
         {"prompt": "2+5=", "chosen": "7", "rejected": "8", "answer": "#### 7"}]


def test_the_file_cache_keys_on_the_columns_asked_for(tmp_path, monkeypatch):
    """``read_columns`` reads a file once per set of columns: the same file asked for other
    columns (or the same ones in another order) gives those, not the first call's; asked again,
    the cached rows without a new read; another file, or the file rewritten (its size, or only
    its mtime, changed), is read."""
    from rlhf_switch.rl import data

    monkeypatch.setattr(data, "_READ", {})
    loads = []
    load = data._load
    monkeypatch.setattr(data, "_load", lambda path, builder: loads.append((path.name, builder)) or load(path, builder))
    path = _jsonl(tmp_path / "prefs.jsonl", PREFS)
    chosen = data.read_columns(path, ("prompt", "chosen"))
    assert chosen == (("1+1=", "2"), ("2+5=", "7"))
    assert data.read_columns(path, ("prompt", "rejected")) == (("1+1=", "3"), ("2+5=", "8"))
    assert data.read_columns(path, ("chosen", "prompt")) == (("2", "1+1="), ("7", "2+5="))
    assert data.read_records(path, "prompt", "answer") == (("1+1=", "#### 2"), ("2+5=", "#### 7"))
    assert data.read_columns(path, ("prompt",)) == (("1+1=",), ("2+5=",))
    assert len(loads) == 5
    assert data.read_columns(str(path), ("prompt", "chosen")) is chosen  # cached: no new read
    assert data.read_records(path, "prompt", "answer") == (("1+1=", "#### 2"), ("2+5=", "#### 7"))
    assert loads == [("prefs.jsonl", "json")] * 5
    first = path.stat()
    twin = _jsonl(tmp_path / "twin.jsonl", [{**r, "prompt": r["prompt"].replace("+", "-")} for r in PREFS])
    os.utime(twin, ns=(first.st_atime_ns, first.st_mtime_ns))  # another file of the same size and mtime
    assert data.read_columns(twin, ("prompt", "chosen")) == (("1-1=", "2"), ("2-5=", "7"))
    _jsonl(path, [{**r, "chosen": r["chosen"] + "0"} for r in PREFS])  # another size, the same mtime
    os.utime(path, ns=(first.st_atime_ns, first.st_mtime_ns))
    assert data.read_columns(path, ("prompt", "chosen")) == (("1+1=", "20"), ("2+5=", "70"))
    longer = path.stat()
    _jsonl(path, [{**r, "chosen": r["rejected"] + "0"} for r in PREFS])  # the same size, another mtime
    os.utime(path, ns=(longer.st_atime_ns, longer.st_mtime_ns + 1_000_000_000))
    assert path.stat().st_size == longer.st_size
    assert data.read_columns(path, ("prompt", "chosen")) == (("1+1=", "30"), ("2+5=", "80"))
    assert len(loads) == 8


def test_read_columns_refuses_each_bad_file_naming_it(tmp_path):
    """One ``DataError`` naming the file (and the key) for each way a file cannot be used;
    parquet and an upper-case extension read as well as JSON lines."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from rlhf_switch.rl.data import DataError, read_columns

    def refused(name: str, keys=("a",)) -> str:
        with pytest.raises(DataError) as e:
            read_columns(tmp_path / name, keys)
        return str(e.value)

    (tmp_path / "a.csv").write_text("a\nx\n")
    (tmp_path / "noext").write_text("{}")
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "bad.jsonl").write_text("not json\n")
    _jsonl(tmp_path / "ints.jsonl", [{"a": 1}])
    _jsonl(tmp_path / "nested.jsonl", [{"a": {"b": "c"}}])
    _jsonl(tmp_path / "nulls.jsonl", [{"a": "x", "b": "y"}, {"a": "x", "b": None}])
    _jsonl(tmp_path / "NAMES.JSONL", [{"a": "x", "b": "y"}])
    pq.write_table(pa.table({"a": ["p", "q"], "b": ["r", "s"]}), tmp_path / "t.parquet")
    # pyarrow's 64-bit-offset strings (what a parquet writer may choose for long texts) are strings too
    pq.write_table(pa.table({"a": pa.array(["p"], pa.large_string())}), tmp_path / "large.parquet")
    d = tmp_path
    assert refused("a.csv") == f"{d / 'a.csv'}: unsupported extension '.csv' (use .jsonl, .json, .parquet)"
    assert refused("noext") == f"{d / 'noext'}: unsupported extension '(none)' (use .jsonl, .json, .parquet)"
    assert refused("gone.json") == f"{d / 'gone.json'}: no such file"
    assert refused("empty.jsonl") == f"{d / 'empty.jsonl'}: the file is empty"
    assert refused("bad.jsonl") == f"{d / 'bad.jsonl'}: not readable as json (ArrowInvalid: JSON parse error: " \
                                   f"Invalid value. in row 0)"
    assert refused("ints.jsonl") == f"{d / 'ints.jsonl'}: key 'a' holds int64, not strings"
    assert refused("nested.jsonl") == f"{d / 'nested.jsonl'}: key 'a' holds dict, not strings"
    assert refused("nulls.jsonl", ("a", "b")) == f"{d / 'nulls.jsonl'}: record 1 has no value for key 'b'"
    assert refused("nulls.jsonl", ("a", "c", "b")) == f"{d / 'nulls.jsonl'}: no key 'c' (keys: a, b)"
    assert read_columns(d / "NAMES.JSONL", ("b", "a")) == (("y", "x"),)
    assert read_columns(d / "t.parquet", ("a", "b")) == (("p", "r"), ("q", "s"))
    assert read_columns(d / "large.parquet", ("a",)) == (("p",),)


def test_a_loader_failure_is_reported_by_its_cause_first_line_only(tmp_path, monkeypatch):
    """What ``datasets`` raises is reported by its cause (the exception it wraps), its type and
    the first line of its message cut at 200 characters; a cause without a message still gives one
    line. The loader is replaced by one raising what ``datasets`` may raise: a real file does not
    choose its error message."""
    from rlhf_switch.rl import data

    monkeypatch.setattr(data, "_READ", {})
    path = _jsonl(tmp_path / "rows.jsonl", [{"a": "x"}])

    def refused(error: Exception) -> str:
        def load(path, builder):
            raise error
        monkeypatch.setattr(data, "_load", load)
        with pytest.raises(data.DataError) as e:
            data.read_columns(path, ("a",))
        return str(e.value)

    def wrapped(cause: Exception) -> Exception:
        try:
            raise RuntimeError("datasets' wrapper") from cause
        except RuntimeError as e:
            return e

    long = "x" * 250
    assert refused(wrapped(OSError(long + "\nsecond line"))) == f"{path}: not readable as json (OSError: {'x' * 200})"
    assert refused(wrapped(OSError(""))) == f"{path}: not readable as json (OSError: )"
    assert refused(ValueError("no cause\nmore")) == f"{path}: not readable as json (ValueError: no cause)"


def test_a_loader_handing_back_no_records_is_refused_naming_the_file(tmp_path, monkeypatch):
    """``datasets`` 5.2 itself refuses every file without records (``[]``, ``{}`` lines, a
    zero-row parquet: "not readable", above); a loader that hands back an empty table instead is
    still one ``DataError`` naming the file, never an empty split."""
    import datasets

    from rlhf_switch.rl import data

    monkeypatch.setattr(data, "_READ", {})
    empty = datasets.Dataset.from_dict({"a": []}, features=datasets.Features({"a": datasets.Value("string")}))
    monkeypatch.setattr(data, "_load", lambda path, builder: (empty.features, empty.num_rows, empty))
    path = _jsonl(tmp_path / "rows.jsonl", [{"a": "x"}])
    with pytest.raises(data.DataError) as e:
        data.read_columns(path, ("a",))
    assert str(e.value) == f"{path}: no records"


def test_reading_a_file_stays_offline_and_keeps_the_rows_in_memory(tmp_path, monkeypatch):
    """A local file never costs a network call: reading one sets ``HF_DATASETS_OFFLINE=1`` for
    ``datasets`` unless the user set it; the rows ``_load`` hands back live in memory, not in the
    temporary cache directory it removes before returning."""
    from rlhf_switch.rl import data

    monkeypatch.setattr(data, "_READ", {})
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    path = _jsonl(tmp_path / "rows.jsonl", [{"a": "x"}, {"a": "y"}])
    assert data.read_columns(path, ("a",)) == (("x",), ("y",))
    assert os.environ["HF_DATASETS_OFFLINE"] == "1"
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "0")  # the user's own setting is kept
    features, rows, ds = data._load(path, "json")
    assert os.environ["HF_DATASETS_OFFLINE"] == "0"
    assert rows == 2 and ds.cache_files == [] and ds["a"] == ["x", "y"]


class WordTokenizer:
    """Stands in for the run's tokenizer (not what is tested here): a token per word, ``<bos>``
    first; the chat template wraps the prompt in ``<user> … <assistant>``."""

    def render_prompt(self, text: str, chat_template: bool) -> str:
        return f"<user> {text} <assistant>" if chat_template else text

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        return [0] * add_bos + [len(w) for w in text.split()]


def _data_cfg(tmp_path: Path, **fields):
    from rlhf_switch.rl.config import DataConfig

    train = _jsonl(tmp_path / "train.jsonl", [{"q": " ".join(["w"] * k), "a": f"#### {k}"} for k in (1, 4, 2, 6, 3)])
    heldout = _jsonl(tmp_path / "heldout.jsonl", [{"q": " ".join(["h"] * k), "a": str(k)} for k in (2, 5, 1)])
    return DataConfig(**{"train_files": [str(train)], "heldout_files": [str(heldout)], "prompt_key": "q",
                         "answer_key": "a", **fields})


def test_load_data_splits_keeps_file_order_drops_too_long_prompts_and_counts(tmp_path):
    """A prompt of exactly ``max_tokens`` tokens (``<bos>`` counted) is kept, longer ones dropped
    and counted; file order kept; the chat template counted in the length; ``num_heldout`` stops
    reading the held-out files once that many are kept (several files in a split are read in
    order)."""
    from rlhf_switch.rl.data import DataError, DataSummary, load_data_splits
    from rlhf_switch.rl.tasks import Sample

    tok = WordTokenizer()
    cfg = _data_cfg(tmp_path)
    splits, summary = load_data_splits(cfg, tok, 4)  # prompts of up to 3 words (+ <bos>)
    assert splits.train == (Sample("w", "#### 1"), Sample("w w", "#### 2"), Sample("w w w", "#### 3"))
    assert splits.heldout == (Sample("h h", "2"), Sample("h", "1"))
    assert summary == DataSummary(5, 2, 3, 1, 4)
    assert summary.line() == ("data: 5 train prompts read, 2 dropped; 3 held-out read, 1 dropped (longer than 4 "
                              "tokens)")
    # the chat template's two words count; two held-out files, num_heldout=3 stops in the second
    cfg = _data_cfg(tmp_path, chat_template=True, num_heldout=3)
    cfg.heldout_files = cfg.heldout_files * 2
    splits, summary = load_data_splits(cfg, tok, 5)
    assert [s.prompt for s in splits.train] == ["<user> w <assistant>", "<user> w w <assistant>"]
    assert [s.prompt for s in splits.heldout] == ["<user> h h <assistant>", "<user> h <assistant>",
                                                  "<user> h h <assistant>"]
    assert summary == DataSummary(5, 3, 4, 1, 5)  # the second file: 1 read and kept, then full
    with pytest.raises(DataError) as e:
        load_data_splits(_data_cfg(tmp_path), tok, 1)
    assert str(e.value) == ("data.train_files: all 5 prompts are longer than 1 tokens after rendering and tokenizing "
                            "(data.max_prompt_tokens, or the context minus algorithm.max_new_tokens)")
    heldout_only = _data_cfg(tmp_path)
    _jsonl(Path(heldout_only.heldout_files[0]), [{"q": "h h h h h h", "a": "6"}])
    with pytest.raises(DataError, match=r"^data\.heldout_files: all 1 prompts are longer than 4 tokens"):
        load_data_splits(heldout_only, tok, 4)


def test_prompt_token_limit_by_hand(tmp_path):
    from rlhf_switch.rl.data import prompt_token_limit

    cfg = _data_cfg(tmp_path)
    assert prompt_token_limit(cfg, 24, 128) == 104  # the context minus the response
    cfg.max_prompt_tokens = 50
    assert prompt_token_limit(cfg, 24, 128) == 50
    cfg.max_prompt_tokens = 104
    assert prompt_token_limit(cfg, 24, 128) == 104
    cfg.max_prompt_tokens = 105  # more than the context leaves
    assert prompt_token_limit(cfg, 24, 128) == 104


def test_load_splits_of_a_task_and_of_files(tmp_path):
    """``load_splits``: a generated task's splits (``make_splits`` of the task's settings), or the
    files' with the limit the context leaves (``max_position_embeddings`` minus ``max_new_tokens``)."""
    from types import SimpleNamespace

    from rlhf_switch.rl.data import load_splits
    from rlhf_switch.rl.tasks import build_task, make_splits

    task = SimpleNamespace(name="addition", min_len=1, max_len=3, length_skew=0.8, num_train=6, num_heldout=3, seed=4)
    splits, line = load_splits(SimpleNamespace(task=task), WordTokenizer())
    assert splits == make_splits(build_task("addition", 1, 3, 0.8), 6, 3, 4)
    assert splits != make_splits(build_task("addition", 1, 3, 0.0), 6, 3, 4)  # the skew is the task's
    assert line == "task addition: 6 train prompts, 3 held-out"
    files = SimpleNamespace(task=None, data=_data_cfg(tmp_path), algorithm=SimpleNamespace(max_new_tokens=6),
                            model=SimpleNamespace(hf_dict=lambda: {"max_position_embeddings": 10}))
    splits, line = load_splits(files, WordTokenizer())
    assert [s.prompt for s in splits.train] == ["w", "w w", "w w w"]  # 10 - 6 = 4 tokens, <bos> counted
    assert line == "data: 5 train prompts read, 2 dropped; 3 held-out read, 1 dropped (longer than 4 tokens)"
    # without a tokenizer: the run's own, here the BPE tokenizer at model.tokenizer
    from rlhf_switch.rl.tokenizer import HFTokenizer
    from rlhf_switch.testing.bpe_tokenizer import build_bpe_tokenizer

    build_bpe_tokenizer(tmp_path / "tok")
    files.model = SimpleNamespace(tokenizer=str(tmp_path / "tok"), path=None,
                                  hf_dict=lambda: {"max_position_embeddings": 40})
    splits, line = load_splits(files)
    assert (splits, line) == load_splits(files, HFTokenizer.from_pretrained(tmp_path / "tok"))
    assert splits.train[0].prompt == "w" and line.startswith("data: 5 train prompts read, 0 dropped")



def test_load_splits_renders_drops_and_counts(model_dir):
    from rlhf_switch.problems import check_run
    from rlhf_switch.rl.config import load_config
    from rlhf_switch.rl.data import load_splits

    cfg = load_config(data_config(model_dir, num_heldout=50))
    check_run(cfg)
    splits, line = load_splits(cfg)
    assert len(splits.train) == 2000 and len(splits.heldout) == 50
    first = json.loads((DATA / "train.jsonl").read_text().splitlines()[0])
    assert splits.train[0].prompt == f"<|im_start|>user\n{first['question']}<|im_end|>\n<|im_start|>assistant\n"
    assert splits.train[0].answer == first["answer"]
    assert "2000 train prompts read, 0 dropped" in line
    # a limit between the shortest and the longest rendered prompt drops some, counted
    cfg = load_config(data_config(model_dir, max_prompt_tokens=20, chat_template=False))
    splits, line = load_splits(cfg)
    assert 0 < len(splits.train) < 2000
    assert f"2000 train prompts read, {2000 - len(splits.train)} dropped" in line


def test_a_prompt_exactly_at_max_prompt_tokens_is_kept(model_dir, tmp_path):
    """The limit is the longest prompt *kept*: a prompt of exactly ``max_prompt_tokens`` tokens stays,
    one token more is dropped (and counted); without ``max_prompt_tokens`` the limit is the whole
    context minus ``max_new_tokens`` — a kept prompt plus its response fills the context exactly."""
    from rlhf_switch.rl.config import load_config, longest_sequence_tokens, model_dims
    from rlhf_switch.rl.data import load_data_splits, load_splits, prompt_token_limit
    from rlhf_switch.rl.tokenizer import HFTokenizer

    tok = HFTokenizer.from_pretrained(model_dir)
    words = ["apples", "pears", "plums", "figs", "limes", "dates", "kiwis", "grapes"]
    prompts = [" ".join(words[:k]) for k in range(1, len(words) + 1)]
    lengths = [len(tok.encode(p, add_bos=True)) for p in prompts]
    assert lengths == sorted(lengths) and len(set(lengths)) == len(lengths), lengths
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"question": p, "answer": "#### 1"}) + "\n" for p in prompts))
    cfg = load_config(data_config(model_dir, train_files=[str(path)], heldout_files=[str(path)],
                                  chat_template=False, max_prompt_tokens=lengths[3]))
    splits, line = load_splits(cfg, tok)
    assert [s.prompt for s in splits.train] == prompts[:4]  # the one of exactly max_prompt_tokens included
    assert f"{len(prompts)} train prompts read, {len(prompts) - 4} dropped" in line
    _, summary = load_data_splits(cfg.data, tok, lengths[3] - 1)
    assert summary.train_dropped == len(prompts) - 3
    # the context's bound: exactly max_context - max_new_tokens, and the longest sequence the context
    dims, new = model_dims(cfg.model), cfg.algorithm.max_new_tokens
    cfg.data.max_prompt_tokens = None
    assert prompt_token_limit(cfg.data, new, dims.max_context) == dims.max_context - new
    assert longest_sequence_tokens(cfg, dims.max_context) == dims.max_context
    cfg.data.max_prompt_tokens = dims.max_context  # more than the context leaves: the context's bound
    assert prompt_token_limit(cfg.data, new, dims.max_context) == dims.max_context - new
    cfg.data.max_prompt_tokens = lengths[3]
    assert prompt_token_limit(cfg.data, new, dims.max_context) == lengths[3]


def test_draw_prompts_is_a_permutation_per_epoch_and_a_function_of_seed_and_iteration(model_dir):
    from recipes.common import draw_prompts
    from rlhf_switch.rl.config import load_config
    from rlhf_switch.rl.tasks import Sample, Splits

    cfg = load_config(data_config(model_dir))
    cfg.algorithm.prompts_per_iteration = 4
    splits = Splits(train=tuple(Sample(str(i), "") for i in range(12)), heldout=())
    epoch0 = [s.prompt for it in range(3) for s in draw_prompts(cfg, splits, it)]
    epoch1 = [s.prompt for it in range(3, 6) for s in draw_prompts(cfg, splits, it)]
    assert sorted(epoch0, key=int) == sorted(epoch1, key=int) == [str(i) for i in range(12)]
    assert epoch0 != epoch1
    assert draw_prompts(cfg, splits, 4) == draw_prompts(cfg, splits, 4)  # what --resume relies on
    cfg.seed = 1
    assert [s.prompt for it in range(3) for s in draw_prompts(cfg, splits, it)] != epoch0


# ---------------------------------------------------------------- the warm start from model.path


def test_warm_start_from_model_path(model_dir, tmp_path):
    from rlhf_switch.rl import sft as S
    from rlhf_switch.rl.config import load_config

    cfg = load_config(data_config(model_dir))
    assert S.warm_start(cfg, tmp_path / "init", progress=False, log=None) == model_dir  # sft: null
    raw = data_config(model_dir)
    raw["sft"] = {"steps": 12, "lr": 1e-3, "batch_size": 4}
    cfg = load_config(raw)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = S.warm_start(cfg, tmp_path / "init", progress=False, log=None)
    finally:
        torch.set_num_threads(threads)
    stats = json.loads((out / S.FINGERPRINT_FILE).read_text())
    assert stats["sft_stats"]["steps"] == 12 and stats["fingerprint"]["model_path"] == str(model_dir.resolve())
    assert stats["sft_stats"]["loss_final"] < stats["sft_stats"]["loss_first"]  # it learns the answers
    assert S.cached_checkpoint(cfg, out) == out
    # a changed model (another file size / mtime) invalidates the cache
    config_json = model_dir / "config.json"
    text = config_json.read_text()
    config_json.write_text(text + "\n")
    try:
        assert S.cached_checkpoint(cfg, out) is None
    finally:
        config_json.write_text(text)


def test_data_sft_masks_the_rendered_prompt(model_dir):
    from rlhf_switch.rl import sft as S
    from rlhf_switch.rl.tasks import Sample
    from rlhf_switch.rl.tokenizer import HFTokenizer

    tok = HFTokenizer.from_pretrained(model_dir)
    prompt = tok.render_prompt("What is 2 + 3?", True)
    ids, targets, mask = S.sft_batch(tok, [Sample(prompt, "#### 5")], 8, 128)
    p, a = tok.encode(prompt, add_bos=True), tok.encode("#### 5", add_eos=True)
    assert ids[0].tolist() == p + a
    assert [int(t) for t, m in zip(targets[0], mask[0]) if m] == a


# ---------------------------------------------------------------- bad input: exit 2, before Ray


def _bad_files(tmp: Path) -> dict[str, Path]:
    import pandas as pd

    files = {"empty": tmp / "empty.jsonl", "corrupt": tmp / "corrupt.jsonl", "nokey": tmp / "nokey.jsonl",
             "csv": tmp / "train.csv", "badparquet": tmp / "int.parquet", "junkparquet": tmp / "junk.parquet"}
    files["empty"].write_text("")
    files["corrupt"].write_text('{"question": "a", "answer": "1"}\n{"question": "b"\n')
    files["nokey"].write_text('{"prompt": "a", "answer": "1"}\n')
    files["csv"].write_text("question,answer\na,1\n")
    pd.DataFrame({"question": ["x"], "answer": [3]}).to_parquet(files["badparquet"])
    files["junkparquet"].write_bytes(b"not parquet")
    return files


BAD_DATA = [
    # (name, how the config is changed, what the message must say)
    ("missing key", lambda c, f, m: c["data"].update(train_files=[str(f["nokey"])]),
     ["data.train_files[0]:", "nokey.jsonl: no key 'question' (keys: prompt, answer)"]),
    ("empty file", lambda c, f, m: c["data"].update(heldout_files=[str(f["empty"])]),
     ["data.heldout_files[0]:", "empty.jsonl: the file is empty"]),
    ("corrupt file", lambda c, f, m: c["data"].update(train_files=[str(DATA / "train.jsonl"), str(f["corrupt"])]),
     ["data.train_files[1]:", "corrupt.jsonl: not readable as json"]),
    ("missing file", lambda c, f, m: c["data"].update(train_files=["/nonexistent/train.jsonl"]),
     ["/nonexistent/train.jsonl: no such file"]),
    ("unsupported extension", lambda c, f, m: c["data"].update(train_files=[str(f["csv"])]),
     ["train.csv: unsupported extension '.csv' (use .jsonl, .json, .parquet)"]),
    ("parquet, non-string column", lambda c, f, m: c["data"].update(train_files=[str(f["badparquet"])]),
     ["int.parquet: key 'answer' holds int64, not strings"]),
    ("not parquet", lambda c, f, m: c["data"].update(train_files=[str(f["junkparquet"])]),
     ["junk.parquet: not readable as parquet"]),
    ("parquet, key missing", lambda c, f, m: c["data"].update(train_files=[str(f["badparquet"])], answer_key="solution"),
     ["int.parquet: no key 'solution' (keys: question, answer)"]),
    ("all prompts too long", lambda c, f, m: c["data"].update(max_prompt_tokens=5),
     ["data.train_files: all 2000 prompts are longer than 5 tokens"]),
    ("no tokenizer at model.path", lambda c, f, m: c["model"].update(tokenizer=str(f["empty"].parent)),
     ["model.tokenizer: no tokenizer in"]),
    ("data and task", lambda c, f, m: c.update(task=config()["task"]),
     ["task/data: give exactly one of task (generated prompts) or data (prompt files)"]),
    ("neither data nor task", lambda c, f, m: c.pop("data"),
     ["task/data: give exactly one of task"]),
    ("tokenizer larger than the model's vocab", lambda c, f, m: c["model"].update(path=str(m)),
     ["model: vocab_size=256 is smaller than the tokenizer's 384 ids"]),
    ("model's eos is not the tokenizer's", lambda c, f, m: c["model"].update(path=str(m), tokenizer=str(m.parent / "tok")),
     ["model: eos_token_id=1 in the model's config, but the tokenizer's eos is 3 ('<|im_end|>')"]),
    ("eval wants more held-out prompts than there are",
     lambda c, f, m: (c["data"].update(num_heldout=8), c["eval"].update(num_prompts=16)),
     ["eval.num_prompts=16 is more than the 8 held-out prompts"]),
    ("unknown model type", lambda c, f, m: c["model"].update(path=str(m.parent / "gpt2")),
     ["model_type 'gpt2' is not supported (known: llama, mistral, qwen2, qwen3, qwen3_moe)"]),
    ("sliding-window attention", lambda c, f, m: c["model"].update(path=str(m.parent / "mistral_window")),
     ["model_type 'mistral': sliding_window=16 is not supported"]),
    ("a reward that does not load", lambda c, f, m: c["data"].update(reward_fn="rlhf_switch.rl.rewards:nope"),
     ["data.reward_fn: reward function 'rlhf_switch.rl.rewards:nope'"]),
]


@pytest.fixture(scope="module")
def small_vocab_model(tmp_path_factory) -> Path:
    """A model with 256 ids and eos 1; its directory's tokenizer is the 384-id BPE, and ``../tok``
    holds a copy of the BPE too (for a model.tokenizer kept elsewhere). Beside it: ``../gpt2`` and
    ``../mistral_window`` — a model whose config.json names a family this package does not run, and a
    Mistral with sliding-window attention."""
    import json
    import shutil

    from rlhf_switch.testing.tiny_models import build_model_dir

    model = build_model_dir(tmp_path_factory.mktemp("small") / "model", vocab_size=256, eos_token_id=1)
    tok = model.parent / "tok"
    tok.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(model / f, tok / f)
    for name, model_type, change in (("mistral_window", "mistral", {"sliding_window": 16}),
                                     ("gpt2", "qwen2", {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})):
        other = build_model_dir(model.parent / name, model_type=model_type)
        config = json.loads((other / "config.json").read_text())
        (other / "config.json").write_text(json.dumps({**config, **change}))
    return model


@pytest.mark.parametrize("name, change, expected", BAD_DATA, ids=[r[0] for r in BAD_DATA])
def test_bad_data_input_exits_2_before_ray(name, change, expected, model_dir, small_vocab_model, tmp_path,
                                           capsys, monkeypatch):
    import recipes.train as loop

    def no_ray(*a, **k):
        raise AssertionError("Ray was started for a bad input")

    monkeypatch.setattr(loop, "start_ray", no_ray)
    cfg = data_config(model_dir)
    change(cfg, _bad_files(tmp_path), small_vocab_model)
    rc, err = cli(tmp_path, cfg, capsys)
    assert rc == 2, err
    for text in expected:
        assert text in err, err
    assert "Traceback" not in err


GPU_RECIPES = [("gsm8k_qwen2.5_0.5b.yaml", "qwen2"), ("gsm8k_qwen3_1.7b.yaml", "qwen3"),
               ("gsm8k_qwen3_30b_a3b.yaml", "qwen3_moe")]


@pytest.mark.parametrize("name, model_type", GPU_RECIPES, ids=[r[0] for r in GPU_RECIPES])
def test_gpu_recipes_pass_every_check_before_ray(name, model_type, tmp_path):
    """The real-model recipes are not run here (no GPU, no download), but each passes every check
    the loop makes before Ray — layouts against its world, engines against its family, batch
    sizes, data keys — with a tiny random model of its family and the shipped GSM8K-format files
    (GSM8K's own keys) in place of the user's copies."""
    from recipes.train import prepare
    from rlhf_switch.testing.tiny_models import build_model_dir

    cfg = yaml.safe_load((REPO / "configs" / name).read_text())
    cfg["model"]["path"] = str(build_model_dir(tmp_path / "model", model_type=model_type,
                                               max_position_embeddings=2048))
    cfg["data"].update(train_files=[str(DATA / "train.jsonl")], heldout_files=[str(DATA / "test.jsonl")])
    cfg["eval"]["num_prompts"] = 200  # the shipped test file's size (GSM8K's has 1319)
    checked, iterations = prepare(cfg)
    assert checked.data.chat_template and checked.sft is None and iterations == cfg["algorithm"]["iterations"]
