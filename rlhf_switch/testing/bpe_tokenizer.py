"""A byte-level BPE tokenizer of exactly ``VOCAB_SIZE`` ids, trained on the shipped GSM8K-format
train file, saved as a Hugging Face ``PreTrainedTokenizerFast`` directory (what
``AutoTokenizer.from_pretrained`` loads) with a ChatML-style chat template. Deterministic and fast
(well under a second): tests build it instead of downloading one.

Ids 0–3 are the specials ``<|pad|>`` (pad), ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``
(eos: a chat turn ends with it, so an answer learned with its eos ends the turn); then the 256
byte symbols, then merges up to ``VOCAB_SIZE``.
"""
from __future__ import annotations

import json
from pathlib import Path

VOCAB_SIZE = 384
PAD, EOT, IM_START, IM_END = "<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIALS = [PAD, EOT, IM_START, IM_END]
TRAIN_FILE = Path(__file__).resolve().parents[2] / "data" / "gsm8k_tiny" / "train.jsonl"
# ChatML: every message is "<|im_start|>role\ncontent<|im_end|>\n"; the generation prompt opens
# the assistant's turn
CHAT_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
                 "+ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
                 "{% endif %}")


def _texts(train_file: Path):
    for line in train_file.read_text().splitlines():
        record = json.loads(line)
        yield record["question"]
        yield record["answer"]


def build_bpe_tokenizer(out_dir: str | Path, train_file: str | Path = TRAIN_FILE):
    """Train the tokenizer on ``train_file``'s questions and answers and save it in ``out_dir``;
    returns the ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_texts(Path(train_file)), trainer=trainer)
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"BPE training made {tok.get_vocab_size()} ids, not {VOCAB_SIZE}")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=IM_END,
                                   additional_special_tokens=[EOT, IM_START])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))
    return fast
