"""Small, deterministic stand-ins for downloads: tiny random models of every family, a GSM8K-format
word-problem generator and a byte-level BPE tokenizer trained on its output (tests and the shipped
examples use them)."""
