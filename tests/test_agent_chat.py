"""A chat model's multi-turn episodes (rlhf_switch.agent.chat): the model's own chat template
applied once, to the first turn; every observation appended as the tokens the template writes for
that message alone; the model's turns kept as generated. Shown on a Qwen-style template (a default
system message, tools declared in it, ``tool`` messages rendered as a user turn of
``<tool_response>``s) over the shipped BPE tokenizer, with a scripted engine and with a tiny
Qwen2 model built here. The whole conversation's tokens decode to exactly the template's rendering
of it. Seconds, one process."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from rlhf_switch.agent import guess
from rlhf_switch.agent.chat import ChatCodec, ChatTemplateError, chat_request
from rlhf_switch.agent.episode import Episode, run_episodes
from rlhf_switch.agent.evaluate import BatchedGreedy
from rlhf_switch.agent.limits import Limits
from rlhf_switch.agent.pool import LocalEnvPool
from rlhf_switch.agent.workflow import episode_request, run_workflow
from rlhf_switch.rl.tasks import Sample

REPO = Path(__file__).resolve().parents[1]

# Qwen2.5's shape, written for these tests: a default system message, tools listed in it, tool
# results as <tool_response> blocks of one user turn
QWEN_STYLE = (
    "{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] %}"
    "{%- else %}{%- set system = 'You are a helpful assistant.' %}{%- endif %}"
    "{{- '<|im_start|>system\\n' + system }}"
    "{%- if tools %}{{- '\\n\\n# Tools\\n<tools>' }}{%- for t in tools %}{{- '\\n' + (t | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>' }}{%- endif %}{{- '<|im_end|>\\n' }}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + m['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif m['role'] not in ['system', 'user', 'assistant'] %}{{- raise_exception('unknown role ' + m['role']) }}"
    "{%- elif m['role'] != 'system' or not loop.first %}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """The shipped BPE tokenizer (eos 3 ``<|im_end|>``) with the Qwen-style template."""
    from transformers import AutoTokenizer

    from rlhf_switch.testing.bpe_tokenizer import build_bpe_tokenizer

    out = tmp_path_factory.mktemp("bpe")
    build_bpe_tokenizer(out)
    tok = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    tok.chat_template = QWEN_STYLE
    return tok


def rendered(hf, messages, tools=None, generation_prompt=False) -> str:
    return hf.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt)


def conversation(hf, prompt: str, ep: Episode, role: str) -> list[dict]:
    """The episode as chat messages: the prompt, then each model turn's text (up to its eos) and
    each observation as a ``role`` message."""
    msgs = [{"role": "user", "content": prompt}]
    at = 0
    obs = iter(ep.observations)
    for kind, n in ep.segments:
        ids = ep.response_ids[at:at + n]
        at += n
        if kind == "model":
            msgs.append({"role": "assistant", "content": hf.decode([i for i in ids if i != hf.eos_token_id])})
        else:
            msgs.append({"role": role, "content": next(obs)})
    return msgs


class ScriptedChat:
    """A batch "engine" over token ids: each answer is ``policy(conversation text)`` encoded, the
    eos, then garbage the batcher must cut."""

    def __init__(self, hf, policy):
        self.hf, self.policy, self.contexts = hf, policy, []

    def __call__(self, prompts, seeds, budgets, temperature, stops):
        self.contexts += [list(p) for p in prompts]
        garbage = self.hf.encode("999", add_special_tokens=False)
        out = [(self.hf.encode(self.policy(self.hf.decode(p)), add_special_tokens=False) + [self.hf.eos_token_id]
                + garbage)[:b] for p, b in zip(prompts, budgets)]
        return out, [[-0.5] * len(t) for t in out], [0] * len(out)


def binary_search(text: str) -> str:
    """Guesses from the conversation's user turns after the first (the game's answers)."""
    turns = text.split("<|im_start|>")
    lo, hi = 1, 63
    for a, u in zip(turns[3::2], turns[4::2]):  # system, user prompt, then assistant / user pairs
        g = int(a.removeprefix("assistant\n").split(",")[0])
        fb = u.removeprefix("user\n").split("<|im_end|>")[0]
        lo, hi = (g + 1, hi) if fb == guess.HIGHER else (lo, g - 1) if fb == guess.LOWER else (lo, hi)
    return f"{(lo + hi + 1) // 2 if lo < hi else lo},"


def test_the_first_turn_is_the_models_own_template_applied_once(hf):
    codec = ChatCodec(hf)
    msgs = [{"role": "user", "content": "guess="}]
    assert codec.prompt_ids("guess=") == hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                                                return_dict=False)
    assert hf.decode(codec.prompt_ids("guess=")).startswith("<|im_start|>system\nYou are a helpful assistant.")
    with_system = ChatCodec(hf, system="Be brief.")
    assert hf.decode(with_system.prompt_ids("guess=")) == rendered(
        hf, [{"role": "system", "content": "Be brief."}] + msgs, generation_prompt=True)
    # a request for a chat model: the template's first turn, no stop id but the eos, the
    # environment's arguments passed on
    r = episode_request("guess", {"low": 1, "high": 40}, Sample("guess=", "5"), "s", codec)
    assert list(r.prompt_ids) == codec.prompt_ids("guess=") and r.stop_ids == frozenset()
    assert (r.env, r.env_kwargs, r.session) == ("guess", {"low": 1, "high": 40}, "s")
    # a data run's loader applied the template already: its prompt is encoded as it is
    pre = rendered(hf, msgs, generation_prompt=True)
    assert list(episode_request("guess", {}, Sample(pre, "5"), "s", codec, rendered=True).prompt_ids) == \
        codec.prompt_ids("guess=")


@pytest.mark.parametrize("role", ["user", "tool"])
def test_a_game_decodes_to_the_templates_rendering_of_the_whole_conversation(hf, role):
    codec = ChatCodec(hf, observation_role=role)
    secrets = ["1", "40", "63"]
    requests = [chat_request(codec, "guess", {}, Sample("guess=", s), f"g{i}") for i, s in enumerate(secrets)]
    policy = binary_search if role == "user" else lambda text: binary_search(
        text.replace("user\n<tool_response>\n", "user\n").replace("\n</tool_response>", ""))
    engine = ScriptedChat(hf, policy)
    result = run_workflow(engine, LocalEnvPool(), requests, codec, Limits(max_turns=8, max_total_tokens=400,
                                                                          max_context=512), [0, 1, 2], 1.0)
    assert [e.turns for e in result.episodes] == [6, 3, 6]  # binary search: 32, 16, ..., 1; 32, 48, 40; 32, ..., 63
    for ep in result.episodes:
        assert ep.finish_reason == "stop" and ep.reward == 1.0
        # the token list is the template's text of the conversation, its last "\n" not generated
        whole = rendered(hf, conversation(hf, "guess=", ep, role))
        assert hf.decode(ep.ids) + "\n" == whole
        # model tokens are the engine's, cut after the eos; every model turn ends with the eos
        at = 0
        for kind, n in ep.segments:
            ids, mask = ep.response_ids[at:at + n], ep.loss_mask[at:at + n]
            at += n
            assert mask == [1 if kind == "model" else 0] * n
            if kind == "model":
                assert ids[-1] == hf.eos_token_id and hf.eos_token_id not in ids[:-1]
            else:  # the template's next turn: newline, the observation's message, the assistant opened
                assert ids[0] != hf.eos_token_id
                assert hf.decode(ids).endswith("<|im_end|>\n<|im_start|>assistant\n")
    # every turn was generated from the episode's own list so far (run_workflow's token check), the
    # garbage past the eos was never appended
    assert len(engine.contexts) == sum(e.turns for e in result.episodes)


def test_a_tool_call_turn_declares_the_tools_and_answers_as_a_tool_message(hf):
    codec = ChatCodec(hf, observation_role="tool")
    req = chat_request(codec, "agent_envs:ChatCalc", {}, Sample("12345*67=", "827115"), "c")
    from rlhf_switch.agent.calc import Calculator

    tools = [Calculator().schema()]
    assert hf.decode(req.prompt_ids) == rendered(hf, [{"role": "user", "content": "12345*67="}], tools, True)
    assert json.dumps(tools[0]) in hf.decode(req.prompt_ids)

    def policy(text: str) -> str:
        if "<tool_response>" not in text:
            return '<tool_call>{"name": "calc", "arguments": {"expression": "12345*67"}}</tool_call>'
        return re.findall(r"<tool_response>(\d+)</tool_response>", text)[0]

    result = run_workflow(ScriptedChat(hf, policy), LocalEnvPool(), [req], codec,
                          Limits(max_turns=3, max_total_tokens=300, max_context=2048), [0], 1.0)
    ep = result.episodes[0]
    assert (ep.finish_reason, ep.reward, ep.turns, ep.observations) == ("stop", 1.0, 2, ["<tool_response>827115</tool_response>"])
    assert ep.infos[0]["tool_ok"] is True
    # the environment's text is the tool message's content as the template writes it
    msgs = [{"role": "user", "content": "12345*67="},
            {"role": "assistant", "content": policy("")},
            {"role": "tool", "content": "<tool_response>827115</tool_response>"},
            {"role": "assistant", "content": "827115"}]
    assert hf.decode(ep.ids) + "\n" == rendered(hf, msgs, tools)


def test_the_codec_takes_the_projects_tokenizer_and_decodes_a_turn_as_its_text(hf, tmp_path):
    from rlhf_switch.rl.tokenizer import HFTokenizer

    hf.save_pretrained(str(tmp_path))
    wrapped = HFTokenizer.from_pretrained(tmp_path)
    codec = ChatCodec(wrapped)
    assert codec.tokenizer is wrapped.hf and codec.name == str(tmp_path)
    assert codec.prompt_ids("guess=") == ChatCodec(hf).prompt_ids("guess=")
    # a turn's text: up to its eos, special tokens skipped
    im_start = hf.convert_tokens_to_ids("<|im_start|>")
    twelve = hf.encode("12", add_special_tokens=False)
    assert codec.decode(twelve + [im_start] + twelve + [hf.eos_token_id] + twelve) == "1212"
    # text is encoded as it is: no special token added (a tokenizer that adds a bos)
    from tokenizers.processors import TemplateProcessing

    backend = wrapped.hf.backend_tokenizer
    backend.post_processor = TemplateProcessing(single="<|im_start|> $A", special_tokens=[("<|im_start|>", im_start)])
    assert wrapped.hf.encode("12")[0] == im_start  # what add_special_tokens would do
    assert codec.encode("12") == twelve


def test_an_observation_after_a_turn_without_its_eos_closes_the_assistant_message(hf):
    codec = ChatCodec(hf)
    eos = hf.eos_token_id
    after_eos = codec.observation_ids("higher", [70, eos])
    after_stop = codec.observation_ids("higher", [70, 71])
    assert after_stop == [eos] + after_eos
    assert hf.decode(after_eos) == "\n<|im_start|>user\nhigher<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ChatTemplateError) as e:
        codec.observation_ids("hello", None)
    assert str(e.value) == ("a chat episode's first message is its prompt: the environment's reset returned an "
                            "observation (5 characters) it cannot be put in")
    # an environment that speaks first ends its sample (env_error), not the run
    req = chat_request(codec, "agent_envs:Greets", {}, Sample("hi", "x"), "g")
    result = run_workflow(ScriptedChat(hf, lambda t: "x"), LocalEnvPool(), [req], codec,
                          Limits(max_turns=2, max_total_tokens=50, max_context=512), [0], 1.0)
    ep = result.episodes[0]
    assert ep.finish_reason == "env_error" and "first message is its prompt" in ep.error and ep.turns == 0


def test_a_tiny_qwen2_plays_turns_that_are_its_own_tokens(hf):
    """A real Qwen2 model (random weights) through ``BatchedGreedy``: every id but the eos stops a
    turn, so each turn is one token and the environment's text closes it with the eos — the
    sequence the trainer gets is the model's greedy choice at every model position."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(hf), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                         eos_token_id=hf.eos_token_id, pad_token_id=hf.pad_token_id,
                                         tie_word_embeddings=True))
    codec = ChatCodec(hf)
    stops = frozenset(range(len(hf))) - {hf.eos_token_id}
    prompts = ["hi", "12+3="]
    reqs = [chat_request(codec, "agent_envs:Chatty", {}, Sample(p, "2"), f"q{i}") for i, p in enumerate(prompts)]
    reqs = [type(r)(r.session, r.env, r.sample, r.prompt_ids, r.env_kwargs, stops) for r in reqs]
    eps = torch_run(run_episodes(BatchedGreedy(model), LocalEnvPool(), reqs, codec,
                                 Limits(max_turns=3, max_total_tokens=64, max_context=512)))
    for prompt, ep in zip(prompts, eps):
        assert ep.finish_reason == "max_turns" and ep.turns == 3
        # the template's text of the conversation, the last turn left open (no observation after it)
        assert hf.decode(ep.ids) + "<|im_end|>\n" == rendered(hf, conversation(hf, prompt, ep, "user"))
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ep.ids])).logits[0].float()
        p = len(ep.prompt_ids)
        model_positions = [p + k for k, m in enumerate(ep.loss_mask) if m]
        assert len(model_positions) == 3
        for pos in model_positions:
            row = logits[pos - 1]
            assert float(row.max() - row[ep.ids[pos]]) < 1e-4  # the greedy choice given exactly these tokens
        # each observation closes the one-token turn before it with the eos (an environment token)
        starts = [p + k for k in range(1, len(ep.loss_mask)) if ep.loss_mask[k - 1] and not ep.loss_mask[k]]
        assert len(starts) == 2 and all(ep.ids[s] == hf.eos_token_id for s in starts)


def torch_run(coro):
    import asyncio

    return asyncio.run(coro)


def test_templates_that_cannot_extend_a_conversation_as_tokens_are_refused(hf, tmp_path):
    template, name = hf.chat_template, hf.name_or_path
    try:
        hf.chat_template = None
        with pytest.raises(ChatTemplateError) as e:
            ChatCodec(hf)
        assert str(e.value) == f"{name} has no chat template"
        hf.name_or_path = ""  # a tokenizer built in memory
        with pytest.raises(ChatTemplateError) as e:
            ChatCodec(hf)
        assert str(e.value) == "the tokenizer has no chat template"
        hf.name_or_path = name
        hf.chat_template = template
        eos = hf.eos_token
        hf.eos_token = None
        with pytest.raises(ChatTemplateError) as e:
            ChatCodec(hf)
        assert str(e.value) == f"{name} has no eos token: a chat turn must end with one"
        hf.eos_token = eos
        # assistant messages not ended by the eos: a generated turn cannot be closed as the template would
        hf.chat_template = ("{% for m in messages %}{{ '### ' + m['role'] + ' says:\\n' + m['content'] + '\\n' }}"
                            "{% endfor %}")
        with pytest.raises(ChatTemplateError) as e:
            ChatCodec(hf)
        assert str(e.value) == (f"{name}: the chat template does not end an assistant message with the eos "
                                "'<|im_end|>', so a generated turn cannot be extended as tokens (it writes "
                                "'\\n### user says:\\nrlhfswitchprobeobservati' after one)")
        # earlier messages rewritten when one is added (the last assistant message shown differently)
        hf.chat_template = ("{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}"
                            "{{ '<|im_start|>assistant\\n(earlier)<|im_end|>\\n' }}{% else %}"
                            "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}"
                            "{% endfor %}")
        with pytest.raises(ChatTemplateError, match="does not keep an assistant message's text"):
            ChatCodec(hf)
        # an observation's content dropped (a role the template does not write)
        hf.chat_template = ("{% for m in messages %}{% if m['role'] != 'tool' %}"
                            "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}"
                            "{% endfor %}")
        with pytest.raises(ChatTemplateError, match="does not write a tool message's content once"):
            ChatCodec(hf, observation_role="tool")
        ChatCodec(hf, observation_role="user")
    finally:
        hf.chat_template, hf.name_or_path = template, name


def test_a_chat_runs_prompts_carry_the_system_message_and_the_environments_tools(hf, tmp_path):
    """A ``data:`` agent run with ``chat_template``: the loader writes each prompt as the episode's
    first turn — ``agent.system`` and the tools the environment declares (``chat_tools``) in the
    template — so the episode starts from exactly that and the length check counts all of it (a
    prompt that fits as a lone user message but not with the tools is dropped)."""
    from types import SimpleNamespace

    from rlhf_switch.agent.calc import Calculator
    from rlhf_switch.agent.config import prompt_renderer
    from rlhf_switch.rl.config import AgentConfig, DataConfig
    from rlhf_switch.rl.data import load_splits
    from rlhf_switch.rl.tokenizer import HFTokenizer

    tok = HFTokenizer(hf, "bpe")
    short, long_ = "12+34=", "what is " * 12 + "12+34="
    for split in ("train", "test"):
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps({"q": q, "a": "46"}) + "\n" for q in (short, long_)))
    data = DataConfig(train_files=[str(tmp_path / "train.jsonl")], heldout_files=[str(tmp_path / "test.jsonl")],
                      prompt_key="q", answer_key="a", chat_template=True)
    tools = [Calculator().schema()]
    first = {q: rendered(hf, [{"role": "system", "content": "You add."}, {"role": "user", "content": q}], tools, True)
             for q in (short, long_)}
    alone = len(tok.encode(rendered(hf, [{"role": "user", "content": long_}], None, True), add_bos=True))
    # room for the long prompt as a user message alone, and for the short one with the tool, not
    # for the long one with the tool
    room = len(tok.encode(first[long_], add_bos=True)) - 1
    assert alone <= room and len(tok.encode(first[short], add_bos=True)) <= room
    agent = AgentConfig(env="agent_envs:ChatCalc", max_turns=2, system="You add.")
    cfg = SimpleNamespace(task=None, agent=agent, data=data, algorithm=SimpleNamespace(max_new_tokens=8),
                          model=SimpleNamespace(hf_dict=lambda: {"max_position_embeddings": room + 8}))
    splits, _ = load_splits(cfg, tok, prompt_renderer(cfg, tok))
    assert [s.prompt for s in splits.train] == [first[short]]  # the long one is one token too long with the tools
    codec = ChatCodec(tok, system="You add.")
    req = episode_request("agent_envs:ChatCalc", {}, splits.train[0], "s0", codec, rendered=True)
    assert list(req.prompt_ids) == codec.prompt_ids(short, tools) == tok.encode(first[short])
    assert "You add." in hf.decode(req.prompt_ids) and '"name": "calc"' in hf.decode(req.prompt_ids)
    # without agent.system, the template's own default; without an agent, one user message
    cfg.agent = AgentConfig(env="agent_envs:ChatCalc", max_turns=2)
    cfg.model = SimpleNamespace(hf_dict=lambda: {"max_position_embeddings": 4096})
    default = load_splits(cfg, tok, prompt_renderer(cfg, tok))[0].train
    assert [s.prompt for s in default] == [rendered(hf, [{"role": "user", "content": q}], tools, True)
                                           for q in (short, long_)]
    assert "You are a helpful assistant." in default[0].prompt
    cfg.agent = None
    assert prompt_renderer(cfg, tok) is None
    assert [s.prompt for s in load_splits(cfg, tok)[0].train] == [rendered(hf, [{"role": "user", "content": q}],
                                                                           None, True) for q in (short, long_)]


def test_a_chat_agent_runs_warm_start_learns_the_prompts_its_episodes_start_from(tmp_path):
    """Without transcripts, a chat agent run's SFT is prompt → answer on the prompts as its
    episodes start (the system message in the template's first turn), named by what writes them
    so the warm start's fingerprint follows ``agent.system``: the same stats as SFT on exactly
    those rendered samples, other stats than on the bare user message."""
    import yaml

    from recipes.common import agent_warm_start
    from rlhf_switch.agent.config import chat_prompt
    from rlhf_switch.rl.config import load_config
    from rlhf_switch.rl.sft import data_sft_samples, initial_model, sft
    from rlhf_switch.rl.tokenizer import load_tokenizer
    from rlhf_switch.testing.tiny_models import build_model_dir

    model_dir = build_model_dir(tmp_path / "model")
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"q": f"{a}+1=", "a": str(a + 1)}) + "\n" for a in range(8)))
    cfg = yaml.safe_load((REPO / "configs" / "agent_guess_tiny.yaml").read_text())
    del cfg["task"]
    cfg.update(model={"dtype": "float32", "path": str(model_dir)}, sft={"steps": 2, "lr": 1.0e-3, "batch_size": 4},
               data={"train_files": [str(tmp_path / "d.jsonl")], "heldout_files": [str(tmp_path / "d.jsonl")],
                     "prompt_key": "q", "answer_key": "a", "chat_template": True})
    cfg["agent"].update(env="agent_envs:Numbers", env_kwargs={}, system="You add.")
    cfg = load_config(cfg)
    name, train = agent_warm_start(cfg)
    assert name.startswith("chat prompts ") and '"system": "You add."' in name
    got = train(initial_model(cfg))
    tok = load_tokenizer(cfg)
    _, rendered = data_sft_samples(cfg, tok, chat_prompt(tok, cfg.agent))
    assert all(s.prompt.startswith("<|im_start|>system\nYou add.") for s in rendered)
    want = sft(initial_model(cfg), None, cfg.sft, cfg.seed, progress=False, max_new_tokens=cfg.algorithm.max_new_tokens,
               samples=rendered, tokenizer=tok)
    _, bare = data_sft_samples(cfg, tok)
    other = sft(initial_model(cfg), None, cfg.sft, cfg.seed, progress=False, max_new_tokens=cfg.algorithm.max_new_tokens,
                samples=bare, tokenizer=tok)
    assert (got["loss_first"], got["loss_final"]) == (want["loss_first"], want["loss_final"])
    assert got["loss_first"] != other["loss_first"]


def test_the_agent_blocks_codec_writes_observations_in_its_role_after_its_system_message(hf):
    """``agent.config.chat_codec`` builds the codec the run uses from the ``agent`` block: its
    ``observation_role`` (a ``tool`` message is the Qwen-style template's ``<tool_response>``) and
    its ``system`` message."""
    from rlhf_switch.agent.config import chat_codec
    from rlhf_switch.rl.config import AgentConfig

    codec = chat_codec(hf, AgentConfig(env="guess", max_turns=2, observation_role="tool", system="S."))
    assert "<tool_response>\n42\n</tool_response>" in hf.decode(codec.observation_ids("42", [hf.eos_token_id]))
    assert codec.prompt_text("q").startswith("<|im_start|>system\nS.<|im_end|>")
