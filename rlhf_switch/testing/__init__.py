"""Small, deterministic stand-ins for downloads: a GSM8K-format word-problem generator and a
byte-level BPE tokenizer trained on its output (tests and the shipped example run use them)."""
