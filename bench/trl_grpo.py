"""TRL's ``GRPOTrainer`` on the loop's job: the peer the loop's own overhead is measured against.

    python -m bench.trl_grpo [--config configs/grpo_tiny.yaml] [--init DIR] [--iterations 20] [--json FILE]

One process, HF ``generate``, no Ray, no engines. The same job as ``rlhf-switch train CONFIG``:
the weights of ``--init`` (a run's warm start, ``<output_dir>/init``: what every engine of the
loop starts from), the iterations' prompts in the loop's order (``recipes.common.draw_prompts``:
iteration ``i``'s 16 prompts are TRL's generation batch ``i``, no shuffling), the run's reward
(``task.reward_fn`` through ``score_samples``, on the response up to its eos), and the config's
hyper-parameters — ``group_size`` samples per prompt, ``max_new_tokens``, temperature, optimizer
steps of ``mini_batch_size`` sequences (TRL: ``steps_per_generation`` steps per generation batch,
so it computes the old log-probs in a forward of their own, as the loop does), AdamW with the
loop's betas, eps, lr and clipping, constant LR, clip ``clip_eps``, KL k3 at ``kl_coef`` to the
frozen warm start in the loss (``beta``), token-mean over the step (``loss_type dapo``),
group-normalised advantages (``scale_rewards group``). The character tokenizer is given to TRL as
a ``PreTrainedTokenizerFast`` with the same ids (``<bos>`` before the prompt, one token per
character), so TRL's prompt ids are the loop's.

Iteration time: between the ends of consecutive iterations (each = one generation + its optimizer
steps), as the loop's ``iteration_seconds``. Held-out exact match: greedy on the config's
``eval.num_prompts`` held-out prompts after the last iteration (``rlhf_switch.rl.sft.evaluate``,
the loop's encoding). TRL is an optional dependency (``make bench-trl`` installs it beside the
venv, in ``.trl/``, torch untouched); without it this prints one line and exits 0.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

TRL_DIR = Path(__file__).resolve().parents[1] / ".trl"  # where `make bench-trl` installs trl + accelerate


def import_trl():
    """TRL's trainer classes, or None when TRL is not importable (the venv, or ``.trl/``)."""
    if TRL_DIR.is_dir() and str(TRL_DIR) not in sys.path:
        sys.path.append(str(TRL_DIR))  # after the venv: .trl holds trl and accelerate only
    try:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "TRL supports vLLM 0.22-0.31": TRL's vLLM path is not used
            from trl import GRPOConfig, GRPOTrainer
    except ImportError:
        return None
    return GRPOConfig, GRPOTrainer


def char_tokenizer_hf():
    """The character tokenizer as a ``PreTrainedTokenizerFast``: the same ids, ``<bos>`` added in
    front (what ``encode_prompt`` does), special tokens dropped by ``skip_special_tokens``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from rlhf_switch.rl.tasks import BOS, EOS, PAD, CharTokenizer

    ct = CharTokenizer()
    tk = Tokenizer(models.WordLevel({t: i for i, t in enumerate(ct.tokens)}, unk_token=PAD))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tk.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, ct.bos_id)])
    tk.decoder = decoders.Fuse()  # the characters joined as they are (WordLevel's default puts spaces between)
    hf = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token=PAD, bos_token=BOS, eos_token=EOS)
    ids = ct.encode("12+34=", add_bos=True)
    assert hf("12+34=")["input_ids"] == ids and hf.decode(ids[1:] + [ct.eos_id], skip_special_tokens=True) == "12+34="
    return hf


def run(config: str, init: str, iterations: int | None = None, threads: int = 1, log=print) -> dict:
    """TRL on ``config``'s job from the weights in ``init``; returns per-iteration seconds, the
    median over iterations 2.. (the first two warm up), reward means and held-out exact match.
    ``threads``: torch's intra-op threads (1, as each of the loop's workers: on this 2-core
    machine a 2-thread pool beside any other process waits at every op's barrier — measured
    ~10x slower under load). Raises ImportError when TRL is not importable."""
    got = import_trl()
    if got is None:
        raise ImportError("trl is not importable (make bench-trl installs it into .trl/)")
    GRPOConfig, GRPOTrainer = got
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback

    from recipes.common import draw_prompts
    from rlhf_switch.rl.config import load_config
    from rlhf_switch.rl.data import load_splits
    from rlhf_switch.rl.rewards import load_reward_fn, score_samples
    from rlhf_switch.rl.sft import evaluate
    from rlhf_switch.rl.tasks import CharTokenizer

    torch.set_num_threads(threads)
    cfg = load_config(config)
    alg = cfg.algorithm
    n_it = iterations or alg.iterations
    splits, _ = load_splits(cfg, CharTokenizer())
    reward_fn = load_reward_fn(cfg.reward_fn)
    G, P = alg.group_size, alg.prompts_per_iteration
    mini = alg.train_batch_size
    steps = P * G // mini  # optimizer steps per iteration
    rows = [s for it in range(n_it) for s in draw_prompts(cfg, splits, it)]
    data = Dataset.from_list([{"prompt": s.prompt, "answer": s.answer} for s in rows])
    rewards: list[float] = []

    def reward(prompts, completions, answer, **_):
        r = score_samples(reward_fn, prompts, completions, answer)
        rewards.extend(r)
        return r

    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"trl_grpo_{os.getpid()}"
    args = GRPOConfig(
        output_dir=str(out), use_cpu=True, bf16=False, fp16=False, seed=cfg.seed, data_seed=cfg.seed,
        per_device_train_batch_size=mini, gradient_accumulation_steps=1, steps_per_generation=steps,
        num_generations=G, max_completion_length=alg.max_new_tokens, temperature=alg.temperature,
        top_p=alg.top_p, top_k=0, shuffle_dataset=False, num_train_epochs=1, max_steps=n_it * steps,
        learning_rate=alg.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=alg.weight_decay,
        adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-8, max_grad_norm=alg.max_grad_norm or 0.0,
        beta=alg.kl_coef, epsilon=alg.clip_eps, loss_type="dapo", scale_rewards="group" if alg.norm_adv_by_std else "none",
        num_iterations=alg.epochs, mask_truncated_completions=False, disable_dropout=True,
        logging_steps=10**6, report_to="none", save_strategy="no", disable_tqdm=True, log_completions=False,
        dataloader_num_workers=0, remove_unused_columns=False)
    model = AutoModelForCausalLM.from_pretrained(init, dtype=torch.float32)
    model.generation_config.pad_token_id = model.config.pad_token_id

    ends: list[float] = []

    class IterationClock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step % steps == 0:
                ends.append(time.perf_counter())

    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data,
                          processing_class=char_tokenizer_hf(), callbacks=[IterationClock()])
    t0 = time.perf_counter()
    trainer.train()
    per_it = [b - a for a, b in zip([t0] + ends[:-1], ends)]
    trainer.model.eval()
    ev = evaluate(trainer.model, splits.heldout[:cfg.eval.num_prompts], CharTokenizer(), reward_fn,
                  alg.max_new_tokens)
    res = {"iterations": n_it, "iteration_seconds": per_it,
           "median_iteration_s": statistics.median(per_it[2:] if len(per_it) > 2 else per_it),
           "reward_mean": [sum(rewards[i * P * G:(i + 1) * P * G]) / (P * G) for i in range(n_it)],
           "heldout_exact_match": ev["accuracy"], "heldout_n": ev["n"], "threads": torch.get_num_threads(),
           "trl_version": __import__("trl").__version__}
    log(f"[trl] {n_it} iterations, median {res['median_iteration_s']:.3f} s/iteration "
        f"(iterations 2..), held-out exact match {res['heldout_exact_match']:.3f} ({ev['n']} prompts)")
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/grpo_tiny.yaml")
    ap.add_argument("--init", default=None, help="the warm start (default: the config's <output_dir>/init)")
    ap.add_argument("--iterations", type=int, default=None)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default: %(default)s)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if import_trl() is None:
        print("[trl] skipped: trl is not importable (make bench-trl installs it into .trl/)")
        return 0
    from rlhf_switch.rl.config import load_config

    init = a.init or str(Path(load_config(a.config).output_dir) / "init")
    res = run(a.config, init, a.iterations, a.threads)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
