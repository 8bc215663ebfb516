"""Helpers the loop tests share, each defined once: the tiny vLLM-shaped Llama their runs train,
a run config built on it (``small``), the run log's records, bitwise equality of two saved
training states. Test modules import these from here, not from one another (a cluster of nodes
started as an operator starts them: ``ray_nodes.py``).

Kept light at the top level (no torch, ray or vllm): modules import it at collection, and the
loop's driver imports ``digit_reward`` by name (``helpers:digit_reward``) from the configs."""
from __future__ import annotations

import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# vLLM-compatible tiny Llama (head_dim 32), 4 heads / 2 KV heads so TP 1, 2, 4 all split it
TINY = {"model_type": "llama", "vocab_size": 64, "hidden_size": 128, "intermediate_size": 256,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 64, "tie_word_embeddings": False,
        "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


def digit_reward(prompt: str, response: str, answer: str) -> float:
    """A reward a randomly initialised model already earns some of (its samples vary in it), so
    the advantages are non-zero and every update really changes the weights."""
    return sum(c.isdigit() for c in response) / max(len(response), 1)


def small(config: str, out: Path, world: int = 2, **blocks) -> dict:
    """The shipped ``configs/<config>`` on ``TINY``, small and quick: 3 iterations of 2 prompts × 4
    samples, ``digit_reward``, a checkpoint each iteration; ``blocks`` replace whole blocks."""
    import yaml

    cfg = yaml.safe_load((REPO / "configs" / config).read_text())
    cfg.update(world_size=world, output_dir=str(out), logging=["tensorboard"])
    cfg["model"] = {"dtype": "float32", "hf_config": dict(TINY)}
    cfg.pop("sft", None)  # the seeded initial weights: the learning test covers the warm start
    cfg["algorithm"].update(iterations=3, prompts_per_iteration=2, group_size=4, mini_batch_size=8,
                            micro_batch_size=4, max_new_tokens=4, lr=1e-3)
    cfg["task"].update(num_train=50, num_heldout=10, reward_fn="helpers:digit_reward")
    cfg["eval"] = {"num_prompts": 4}
    cfg["checkpoint"] = {"save_every": 1, "keep": 2}
    for k, v in blocks.items():
        cfg[k] = v
    return cfg


def records(out: Path, name: str = "metrics.jsonl") -> list[dict]:
    """The JSONL records of a run's ``name`` (``metrics.jsonl``, ``rollouts.jsonl``)."""
    return [json.loads(line) for line in (out / name).read_text().splitlines() if line.strip()]


def same_full_state(a, b) -> bool:
    """Two ``FullState`` s (a run's saved weights and Adam moments) equal bit for bit, tensor by
    tensor of ``b``."""
    import torch

    return (all(torch.equal(a.master[n], b.master[n]) for n in b.master) and
            all(torch.equal(a.moments[f][n], b.moments[f][n]) for f in b.moments for n in b.moments[f]))
