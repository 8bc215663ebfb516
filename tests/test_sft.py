"""The SFT warm start (rlhf_switch.rl.sft): the answer-only loss goes down, greedy evaluation is
deterministic and scores a hand-computed case, checkpoints round-trip through transformers
bit-exactly, and warm_start reuses its cache until an input changes."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rlhf_switch.rl import sft as S
from rlhf_switch.rl.config import load_config
from rlhf_switch.rl.rewards import exact_match, partial_credit
from rlhf_switch.rl.tasks import CharTokenizer, Sample, build_task, encode_prompt, make_splits

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
TOK = CharTokenizer()


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _cfg(**sft):
    data = load_config(CONFIGS / "grpo_tiny.yaml").model_dump()
    data["task"].update(num_train=64, num_heldout=32)
    data["sft"] = {"steps": 4, "lr": 1e-3, "batch_size": 8, **sft}
    return load_config(data)


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_sft_batch_masks_the_answer_and_eos_only():
    ids, targets, mask = S.sft_batch(TOK, [Sample("1+2=", "3"), Sample("10+5=", "15")], 4, 64)
    first = encode_prompt(TOK, "1+2=", 4, 64) + TOK.encode("3", add_eos=True)
    assert first[0] == TOK.bos_id  # the GRPO loop's prompt encoding: <bos> first
    assert ids[0].tolist() == first + [TOK.pad_id] * 2
    assert ids[1].tolist() == TOK.encode("10+5=", add_bos=True) + TOK.encode("15", add_eos=True)
    assert torch.equal(targets, ids[:, 1:])
    # the positions whose logits predict "3", <eos> / "1", "5", <eos>
    assert mask[0].tolist() == [0, 0, 0, 0, 1, 1, 0, 0]
    assert mask[1].tolist() == [0, 0, 0, 0, 0, 1, 1, 1]
    assert [int(t) for t, m in zip(targets[1], mask[1]) if m] == TOK.encode("15", add_eos=True)


def test_sft_lowers_the_answer_loss_and_is_deterministic():
    cfg = _cfg(steps=30, lr=2e-3, batch_size=16)
    task = build_task(cfg.task.name, cfg.task.min_len, cfg.task.max_len)
    train = make_splits(task, cfg.task.num_train, cfg.task.num_heldout, cfg.task.seed).train
    batch = S.sft_batch(TOK, train, cfg.algorithm.max_new_tokens, 64)
    model = S.build_initial_model(cfg.model.hf_config, 0)
    with torch.no_grad():
        before = float(S.answer_loss(model, *batch))
    seen = []
    stats = S.sft(model, cfg.task, cfg.sft, seed=0, progress=False, callback=lambda step, loss: seen.append(step))
    with torch.no_grad():
        after = float(S.answer_loss(model, *batch))
    assert seen == list(range(1, 31)) and stats["steps"] == 30 and stats["seconds"] > 0
    assert after < 0.6 * before, (before, after)
    assert stats["loss_final"] < stats["loss_first"]
    again = S.build_initial_model(cfg.model.hf_config, 0)
    S.sft(again, cfg.task, cfg.sft, seed=0, progress=False)
    assert _same(_state(model), _state(again))
    other = S.build_initial_model(cfg.model.hf_config, 0)
    S.sft(other, cfg.task, cfg.sft, seed=1, progress=False)  # another order of the same data
    assert not _same(_state(model), _state(other))


class CopySecondOperand(torch.nn.Module):
    """A stand-in LM: after ``=`` it answers the first digit of the second operand, then ``<eos>``.
    Its logits at a position depend only on the tokens up to there, as a causal LM's do."""

    def __init__(self):
        super().__init__()
        self.config = SimpleNamespace(max_position_embeddings=64)
        self.calls = []

    def forward(self, input_ids, use_cache=False):
        self.calls.append(tuple(input_ids.shape))
        B, T = input_ids.shape
        logits = torch.zeros(B, T, 64)
        plus, equals = TOK.encode("+")[0], TOK.encode("=")[0]
        for b in range(B):
            row = input_ids[b].tolist()
            nxt = row[row.index(plus) + 1] if row[-1] == equals else TOK.eos_id
            logits[b, -1, nxt] = 1.0
        return SimpleNamespace(logits=logits)


def test_evaluate_scores_a_hand_computed_case():
    samples = [Sample("1+2=", "3"), Sample("10+1=", "11"), Sample("0+5=", "5"), Sample("3+14=", "17")]
    model = CopySecondOperand()
    out = S.evaluate(model, samples, TOK, partial_credit, max_new_tokens=4, max_ctx=64, batch_size=64)
    assert out["responses"] == ["2", "1", "5", "1"]
    # partial credit compares numbers right-aligned: "1" vs "11" is half right, "1" vs "17" none
    assert out["rewards"] == [0.0, 0.5, 1.0, 0.0]
    assert out["reward_mean"] == pytest.approx(0.375) and out["accuracy"] == pytest.approx(0.25) and out["n"] == 4
    # two prompt lengths (5 and 6 tokens with <bos>): two batches, no padding; both stop after <eos>
    assert sorted(model.calls) == [(2, 5), (2, 6), (2, 6), (2, 7)]
    exact = S.evaluate(model, samples, TOK, exact_match, max_new_tokens=4, max_ctx=64)
    assert exact["reward_mean"] == exact["accuracy"] == 0.25


def test_evaluate_is_deterministic_and_independent_of_batching():
    cfg = _cfg(steps=40, lr=2e-3, batch_size=16)
    model = S.build_initial_model(cfg.model.hf_config, 0)
    S.sft(model, cfg.task, cfg.sft, seed=0, progress=False)
    task = build_task(cfg.task.name, cfg.task.min_len, cfg.task.max_len)
    heldout = make_splits(task, cfg.task.num_train, cfg.task.num_heldout, cfg.task.seed).heldout
    assert len({len(s.prompt) for s in heldout}) > 1  # mixed prompt lengths
    args = (heldout, TOK, exact_match, cfg.algorithm.max_new_tokens)
    first, second = S.evaluate(model, *args), S.evaluate(model, *args)
    one_by_one = S.evaluate(model, *args, batch_size=1)
    assert first == second
    assert first["responses"] == one_by_one["responses"]
    model.train()
    S.evaluate(model, *args)
    assert model.training  # evaluate decodes in eval mode and restores the caller's mode


def test_checkpoint_round_trips_through_transformers_bit_exactly(tmp_path):
    from transformers import LlamaForCausalLM

    cfg = _cfg()
    model = S.build_initial_model(cfg.model.hf_config, 3)
    S.sft(model, cfg.task, cfg.sft, seed=3, progress=False)
    S.save_hf_checkpoint(model, tmp_path / "ckpt")
    written = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert written["architectures"] == ["LlamaForCausalLM"]
    assert written["torch_dtype"] == written["dtype"] == "float32"
    assert written["hidden_size"] // written["num_attention_heads"] >= 32  # vLLM refuses head_dim 16
    assert list((tmp_path / "ckpt").glob("*.safetensors"))
    loaded = LlamaForCausalLM.from_pretrained(tmp_path / "ckpt")
    assert next(loaded.parameters()).dtype == torch.float32
    assert _same(_state(model), _state(loaded))
    ids = torch.tensor([encode_prompt(TOK, "12+34=", 8, 64)])
    model.eval(), loaded.eval()
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, loaded(input_ids=ids).logits)
    fresh = S.build_initial_model(cfg.model.hf_config, 4)
    assert not _same(_state(model), _state(fresh))
    params = [id(p) for p in fresh.parameters()]
    S.load_hf_weights(fresh, tmp_path / "ckpt")
    assert _same(_state(model), _state(fresh)) and params == [id(p) for p in fresh.parameters()]


def test_warm_start_reuses_its_cache_and_retrains_when_an_input_changes(tmp_path, monkeypatch):
    calls = []
    real_sft = S.sft

    def counting_sft(*args, **kwargs):
        calls.append(args[2])
        return real_sft(*args, **kwargs)

    monkeypatch.setattr(S, "sft", counting_sft)
    out = tmp_path / "warm"
    cfg = _cfg()
    assert S.warm_start(cfg, out, progress=False, log=None) == out and len(calls) == 1
    weights = sorted(out.glob("*.safetensors"))
    stamp = [w.stat().st_mtime_ns for w in weights]
    first = _state(S.load_hf_weights(S.build_initial_model(cfg.model.hf_config, 9), out))
    record = json.loads((out / S.FINGERPRINT_FILE).read_text())
    assert record["fingerprint"]["sft"] == {"steps": 4, "lr": 1e-3, "batch_size": 8}
    assert record["sft_stats"]["steps"] == 4

    # the same inputs: reused, nothing retrained or rewritten
    assert S.warm_start(_cfg(), out, progress=False, log=None) == out and len(calls) == 1
    assert [w.stat().st_mtime_ns for w in weights] == stamp

    # a different SFT config: retrained, other weights
    S.warm_start(_cfg(lr=2e-3), out, progress=False, log=None)
    assert len(calls) == 2
    second = _state(S.load_hf_weights(S.build_initial_model(cfg.model.hf_config, 9), out))
    assert not _same(first, second)
    assert json.loads((out / S.FINGERPRINT_FILE).read_text())["fingerprint"]["sft"]["lr"] == 2e-3

    # another seed retrains too; steps: 0 saves the initial weights without training
    S.warm_start(_cfg(lr=2e-3).model_copy(update={"seed": 1}), out, progress=False, log=None)
    assert len(calls) == 3
    S.warm_start(_cfg(steps=0), out, progress=False, log=None)
    assert len(calls) == 3
    init = _state(S.build_initial_model(cfg.model.hf_config, cfg.seed))
    assert _same(init, _state(S.load_hf_weights(S.build_initial_model(cfg.model.hf_config, 9), out)))
