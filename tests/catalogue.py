"""The layouts the core must move between (world 4), and strategies for random ones."""
from __future__ import annotations

from hypothesis import strategies as st

from rlhf_switch.vps import ParallelConfig, build_layout, synthetic_spec

# head_dim 8, GQA (8 heads, 4 KV heads: TP4 still divides them), vocab 250 (padded under TP),
# 3 layers (PP2 splits them 2+1): small enough that 81 moves take seconds.
TINY_LLAMA = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=4,
                  intermediate_size=96, vocab_size=250, tie_word_embeddings=False)

PAD = dict(vocab_divisible_by=8)

CONFIGS = {
    "replicated": ParallelConfig(dp=4),
    "zero1-flat": ParallelConfig(dp=4, dp_shard="zero"),
    "zero3": ParallelConfig(dp=4, dp_shard="zero3"),
    "fsdp": ParallelConfig(dp=4, dp_shard="fsdp"),
    "tp2": ParallelConfig(tp=2, dp=2, **PAD),
    "tp4": ParallelConfig(tp=4, fuse_qkv=True, fuse_gate_up=True, **PAD),
    "pp2": ParallelConfig(pp=2, dp=2),
    "tp2xdp2": ParallelConfig(tp=2, dp=2, dp_shard="fsdp", fuse_qkv=True, fuse_gate_up=True, **PAD),
    "tp2xpp2": ParallelConfig(tp=2, pp=2, **PAD),
}


def named_layouts(spec, fields=("param",)):
    return {name: build_layout(spec, cfg, fields) for name, cfg in CONFIGS.items()}


DTYPES = ("float32", "bfloat16", "float16", "int32")


@st.composite
def synthetic_specs(draw, max_tensors: int = 6):
    """Random tensor sets: dims that TP may split are multiples of 4 so any TP of a 4-rank world
    divides them; the rest are small and odd, so DP shards come out uneven."""
    dtype = draw(st.sampled_from(DTYPES))
    n = draw(st.integers(1, max_tensors))
    rows = []
    for i in range(n):
        role = draw(st.sampled_from(("column", "row", "vocab", "replicate")))
        ndim = draw(st.integers(2 if role == "row" else 1, 3))
        shape = [draw(st.integers(1, 9)) for _ in range(ndim)]
        if role == "column":
            shape[0] = 4 * draw(st.integers(1, 3))
        if role == "row":
            shape[1] = 4 * draw(st.integers(1, 3))
        rows.append((f"t{i}.{role}", tuple(shape), dtype, role))
    layers = draw(st.integers(1, 3))
    return synthetic_spec(rows, num_layers=layers, name=f"synthetic-{n}")


@st.composite
def configs4(draw, spec):
    """A random valid ParallelConfig for 4 ranks on ``spec``."""
    pps = [p for p in (1, 2, 4) if p <= spec.num_layers]
    pp = draw(st.sampled_from(pps))
    tp = draw(st.sampled_from([t for t in (1, 2, 4) if t * pp <= 4]))
    dp = 4 // (tp * pp)
    return ParallelConfig(tp=tp, pp=pp, dp=dp,
                          dp_shard=draw(st.sampled_from(("replicate", "fsdp", "zero3", "zero"))),
                          vocab_divisible_by=draw(st.sampled_from((1, 3))),
                          zero_alignment=draw(st.sampled_from((1, 2))))
