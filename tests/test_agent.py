"""The agent foundation without Ray (rlhf_switch.agent): the call formats' parser, the tools, both
tasks' environments turn by turn, the checks of what an environment returns, the episode driver's
token list, loss mask, limits and finish reasons (through the in-process pool), token exactness
(ids never decoded and encoded again — with the character tokenizer and a BPE one), the batched
greedy evaluator against one-row decoding, the experts' transcripts, the multi-turn SFT batch and
the config block. Seconds: a random tiny Llama at most, no process group."""
from __future__ import annotations

import asyncio
import math

import pytest
import torch

from rlhf_switch.agent import calc, guess
from rlhf_switch.agent.config import AgentConfig, build_pool, episode_limits
from rlhf_switch.agent.env import (EnvError, StepResult, build_environment, check_step_result,
                                   environment_class)
from rlhf_switch.agent.episode import EpisodeRequest, Generated, HFCodec, episode_metrics, run_episode, run_episodes
from rlhf_switch.agent.evaluate import BatchedGreedy, play
from rlhf_switch.agent.experts import Transcript, calc_transcripts, guess_transcripts
from rlhf_switch.agent.limits import FINISH_REASONS, Limits
from rlhf_switch.agent.pool import LocalEnvPool
from rlhf_switch.agent.sft import sft_transcripts, transcript_batch
from rlhf_switch.agent.tools import (CallError, CompactCallFormat, JsonCallFormat, Tool, ToolCall, ToolEnvironment,
                                     build_tool)
from rlhf_switch.rl.tasks import CharTokenizer, Sample, make_splits

TOK = CharTokenizer()
HF_CONFIG = dict(model_type="llama", vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                 tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def ids(text: str) -> list[int]:
    return TOK.encode(text)


class Echo(Tool):
    name = "echo"
    description = "returns its text"
    parameters = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"],
                  "additionalProperties": False}

    def call(self, text: str) -> str:
        return text


class Boom(Tool):
    name = "boom"
    parameters = {"type": "object", "properties": {}}

    def call(self) -> str:
        raise ZeroDivisionError("kaput")


class NotText(Tool):
    name = "num"
    parameters = {"type": "object", "properties": {}}

    def call(self) -> int:
        return 7


TOOLSET = {t.name: t for t in (Echo(), Boom(), NotText(), calc.Calculator())}


# ---------------------------------------------------------------- the parser


@pytest.mark.parametrize("text, expect", [
    ("1234", None),                                             # no call: the final answer
    ("12>3", None),                                             # a '>' alone opens nothing
    ("<calc 12+34>", ToolCall("calc", {"expression": "12+34"}, "<calc 12+34>")),
    ("let me see <calc 9*9>", ToolCall("calc", {"expression": "9*9"}, "<calc 9*9>")),
    ("<boom>", ToolCall("boom", {}, "<boom>")),
    ("<calc 12+34", "syntax"),                                  # not closed
    ("<calc 12+34> and more", "syntax"),                        # the call must end the turn
    ("<calc <calc 1+2>>", "syntax"),                            # nested
    ("<<>>", "syntax"),
    ("<>", "syntax"),
    ("<Calc 1+2>", "syntax"),                                   # names are lower case
    ("<sqrt 16>", "unknown_tool"),
    ("<calc>", "arguments"),                                    # the calculator needs its expression
])
def test_compact_format_parses_calls_and_refuses_malformed_ones(text, expect):
    got = CompactCallFormat().parse(text, TOOLSET)
    if isinstance(expect, str):
        assert isinstance(got, CallError) and got.kind == expect, got
    else:
        assert got == expect


@pytest.mark.parametrize("text, expect", [
    ("the answer is 3", None),
    ('<tool_call>{"name": "echo", "arguments": {"text": "hi"}}</tool_call>', ("echo", {"text": "hi"})),
    ('think <tool_call>{"name": "echo", "arguments": "{\\"text\\": \\"hi\\"}"}</tool_call>\n',
     ("echo", {"text": "hi"})),                                 # OpenAI's arguments-as-a-string
    ('<tool_call>{"name": "echo", "arguments": {"text": "hi"}}', "syntax"),        # not closed
    ('<tool_call>{"name": "echo", "arguments": {"text": }}</tool_call>', "syntax"),  # not JSON
    ('<tool_call>["echo"]</tool_call>', "syntax"),              # not an object
    ('<tool_call>{"arguments": {}}</tool_call>', "syntax"),     # no name
    ('<tool_call>{"name": "echo", "arguments": [1]}</tool_call>', "syntax"),
    ('<tool_call>{"name": "echo", "arguments": {}}</tool_call> more', "syntax"),
    ('<tool_call><tool_call>{}</tool_call></tool_call>', "syntax"),  # nested
    ('<tool_call>{"name": "search", "arguments": {}}</tool_call>', "unknown_tool"),
])
def test_json_format_parses_calls_and_refuses_malformed_ones(text, expect):
    got = JsonCallFormat().parse(text, TOOLSET)
    if isinstance(expect, str):
        assert isinstance(got, CallError) and got.kind == expect, got
    elif expect is None:
        assert got is None
    else:
        assert isinstance(got, ToolCall) and (got.name, got.arguments) == expect


def test_tool_environment_turns_every_failure_into_an_observation_and_goes_on():
    env = ToolEnvironment([Echo(), Boom(), NotText()], "json")
    assert env.reset(Sample("say hi", "hi")) == ""
    call = '<tool_call>{{"name": "{}", "arguments": {}}}</tool_call>'
    r = env.step(call.format("echo", '{"text": "hi"}'))
    assert (r.observation, r.reward, r.done, r.info) == ("<tool_response>hi</tool_response>", 0.0, False,
                                                        {"tool_call": "echo", "tool_ok": True})
    for action, kind, words in [(call.format("echo", '{"txt": "hi"}'), "arguments", "'txt' was unexpected"),
                                (call.format("echo", '{}'), "arguments", "'text' is a required property"),
                                (call.format("echo", '{"text": 3}'), "arguments", "not of type"),
                                (call.format("boom", "{}"), "tool_error", "ZeroDivisionError: kaput"),
                                (call.format("num", "{}"), "tool_error", "returned a int"),
                                (call.format("nope", "{}"), "unknown_tool", "no tool named 'nope'"),
                                ("<tool_call>{oops</tool_call>", "syntax", "not JSON")]:
        r = env.step(action)
        assert not r.done and r.reward == 0.0 and r.info["tool_error"] == kind, (action, r)
        assert r.observation.startswith("<tool_response>error: ") and words in r.observation, r.observation
    r = env.step("hi")  # no call: the final answer, scored
    assert (r.reward, r.done, r.info["final"]) == (1.0, True, True)


def test_build_tool_by_name_and_by_module_path():
    assert isinstance(build_tool("calc"), calc.Calculator)
    assert isinstance(build_tool("rlhf_switch.agent.calc:Calculator"), calc.Calculator)
    with pytest.raises(ValueError, match="unknown tool 'abacus'"):
        build_tool("abacus")
    with pytest.raises(ValueError, match="cannot be imported"):
        build_tool("rlhf_switch.agent.calc:Abacus")


# ---------------------------------------------------------------- the tasks' environments


def test_calculator_computes_and_refuses_anything_else():
    c = calc.Calculator()
    assert (c.call("12345*67"), c.call("99999+1"), c.call("3-10")) == ("827115", "100000", "-7")
    for bad in ("12+", "1+2+3", "2**3", "1/2", " 1+2", "1234567890123+1"):
        with pytest.raises(ValueError):
            c.call(bad)


def test_calc_environment_turn_by_turn():
    env = build_environment("calc")
    assert env.reset(Sample("12345*67=", "827115")) == ""
    assert env.step("<calc 12345*67>") == StepResult("=827115 ", 0.0, False, {"tool_call": "calc", "tool_ok": True})
    for bad, word in [("<calc 12345*67", "syntax"), ("<calc 12a45*67>", "failed"), ("<abc 1+1>", "tool"),
                      ("<calc>", "args"), ("<calc <calc 1+1>>", "syntax")]:
        r = env.step(bad)
        assert (r.observation, r.done) == (f"=err {word} ", False), bad
        assert all(ch in TOK.tokens for ch in r.observation)  # the character model can read it
    assert env.step("827115") == StepResult("", 1.0, True, {"tool_call": None, "final": True})
    env.reset(Sample("12345*67=", "827115"))
    assert env.step("827116").reward == 0.0
    no_tool = build_environment("calc", tools=False)
    no_tool.reset(Sample("1+2=", "3"))
    assert no_tool.step("<calc 1+2>").observation == "=err tool "


def test_guess_environment_turn_by_turn():
    env = build_environment("guess")
    env.reset(Sample("guess=", "41"))
    assert [env.step(a).observation for a in ("32,", "48,", "40,", "44,", "0,", "64,", "abc,")] == \
        [">", "<", ">", "<", "x", "x", "x"]
    r = env.step("41,")
    assert (r.observation, r.reward, r.done, r.info["won"]) == ("", 1.0, True, True)
    costly = build_environment("guess", turn_cost=0.1)
    costly.reset(Sample("guess=", "7"))
    costly.step("32,")
    assert costly.step("7,").reward == pytest.approx(0.9)
    with pytest.raises(ValueError):
        build_environment("guess").reset(Sample("guess=", "64"))


def test_tasks_split_held_out_first_and_fit_the_context():
    t = calc.CalcTask()
    small, big = make_splits(t, 100, 50, 0), make_splits(t, 1000, 50, 0)
    assert small.heldout == big.heldout
    assert not {s.prompt for s in big.heldout} & {s.prompt for s in big.train}
    for s in big.train[:200]:
        a, op, b = s.prompt[:-1].partition("+") if "+" in s.prompt else s.prompt[:-1].partition("*")
        assert 5 <= len(a) <= 6 and (5 <= len(b) <= 6 if op == "+" else len(b) == 2), s
        assert s.answer == str(int(a) + int(b) if op == "+" else int(a) * int(b))
    assert any("+" in s.prompt for s in big.train) and any("*" in s.prompt for s in big.train)
    assert t.longest_episode(tools=True) <= 64 and t.longest_episode(tools=False) <= 64
    g = guess.GuessTask()
    sp = make_splits(g, 47, 16, 0)
    assert sorted(int(s.answer) for s in sp.train + sp.heldout) == list(range(1, 64))
    assert make_splits(g, 10, 16, 0).heldout == sp.heldout


# ---------------------------------------------------------------- what environments return


@pytest.mark.parametrize("result, message", [
    (StepResult(3), "observation of type int"),
    (("ok", float("nan"), False, {}), "not a finite number"),
    (("ok", True, False, {}), "not a finite number"),
    (("ok", "1", False, {}), "not a finite number"),
    (("ok", 1.0, "yes", {}), "not a bool"),
    (("ok", 1.0, False, []), "info of type list"),
    ("ok", "not a StepResult"),
    (None, "not a StepResult"),
])
def test_check_step_result_names_what_is_wrong(result, message):
    with pytest.raises(EnvError, match=message):
        check_step_result(result)


def test_check_step_result_takes_a_gym_tuple():
    assert check_step_result(("o", 1, 1, {"a": 1})) == StepResult("o", 1.0, True, {"a": 1})


def test_environment_class_by_name_or_module_path_and_clear_errors():
    assert environment_class("calc") is calc.CalcEnvironment
    assert environment_class("rlhf_switch.agent.guess:GuessEnvironment") is guess.GuessEnvironment
    with pytest.raises(EnvError, match="unknown environment 'chess'"):
        environment_class("chess")
    with pytest.raises(EnvError, match="cannot be imported"):
        environment_class("rlhf_switch.agent.guess:Chess")
    with pytest.raises(EnvError, match="no reset, step, close"):
        environment_class("rlhf_switch.rl.tasks:Sample")


# ---------------------------------------------------------------- episodes


HERE = "agent_envs"  # tests/agent_envs.py: environments that misbehave


def scripted(turns: list[list[int]]):
    """A ``generate`` that returns the given turns in order (each clipped to the budget) and
    records what it was shown."""
    seen = []

    async def generate(token_ids, max_new_tokens, stop_ids):
        seen.append(list(token_ids))
        turn = turns[len(seen) - 1]
        return turn if isinstance(turn, Generated) else turn[:max_new_tokens]
    generate.seen = seen
    return generate


def run(coro):
    return asyncio.run(coro)


def test_episode_appends_model_and_observation_ids_and_masks_the_observations():
    sample = Sample("12345*67=", "827115")
    req = calc.request(sample, "s", TOK)
    turns = [ids("<calc 12345*67>"), ids("827115") + [TOK.eos_id]]
    gen = scripted(turns)
    ep = run(run_episode(gen, LocalEnvPool(), req, TOK, calc.limits(64)))
    obs = ids("=827115 ")
    assert ep.finish_reason == "stop" and ep.reward == 1.0 and ep.turns == 2 and ep.error is None
    assert ep.response_ids == turns[0] + obs + turns[1]
    assert ep.loss_mask == [1] * len(turns[0]) + [0] * len(obs) + [1] * len(turns[1])
    assert ep.segments == [("model", len(turns[0])), ("env", len(obs)), ("model", len(turns[1]))]
    assert ep.actions == ["<calc 12345*67>", "827115"] and ep.observations == ["=827115 "]
    # the model saw exactly the list so far, each turn
    assert gen.seen == [list(req.prompt_ids), list(req.prompt_ids) + turns[0] + obs]
    # as text: each segment decoded alone, a model turn up to its eos
    assert ep.text(TOK) == "<calc 12345*67>=827115 827115"


def test_episode_keeps_generated_ids_that_decoding_and_encoding_again_would_change():
    # id 0 (<pad>) and 60 (beyond the tokenizer's 47 ids, decoded "?") inside model turns: the
    # action text differs from the ids, and encoding it again would drop or refuse them
    weird = [ids("3")[0], TOK.pad_id, 60, ids("2")[0], ids(",")[0]]
    req = guess.request(Sample("guess=", "32"), "s", TOK)
    gen = scripted([weird, ids("32,")])
    ep = run(run_episode(gen, LocalEnvPool(), req, TOK, guess.limits(64)))
    assert ep.actions[0] == "3?2,"  # what the environment was given (not a valid guess)
    assert ep.observations == ["x"] and ep.finish_reason == "stop" and ep.reward == 1.0
    assert ep.response_ids == weird + ids("x") + ids("32,")
    assert ep.ids == list(req.prompt_ids) + weird + ids("x") + ids("32,")


def test_episode_with_a_bpe_tokenizer_keeps_the_split_the_model_generated(tmp_path):
    from rlhf_switch.testing.bpe_tokenizer import build_bpe_tokenizer

    hf = build_bpe_tokenizer(tmp_path / "tok")
    codec = HFCodec(hf)
    # find a text the tokenizer merges: the model generates it one piece at a time instead
    text = next(t for t in ("123", "the", " answer", "ing", "48") if len(codec.encode(t)) < len(t))
    pieces = [i for ch in text for i in codec.encode(ch)]
    assert pieces != codec.encode(text)  # re-tokenizing the history would change these ids
    req = EpisodeRequest("s", "tools", Sample("q", text), tuple(codec.encode("q")),
                         {"tools": ["rlhf_switch.agent.calc:Calculator"], "call_format": "json"})
    turn = pieces + [codec.eos_id]
    ep = run(run_episode(scripted([turn]), LocalEnvPool(), req, codec, Limits(3, 40, 100)))
    assert ep.actions == [text] and ep.reward == 1.0 and ep.finish_reason == "stop"
    assert ep.response_ids == turn



def test_hf_codec_encodes_without_special_tokens_and_decodes_up_to_the_eos(tmp_path):
    from tokenizers.processors import TemplateProcessing

    from rlhf_switch.testing.bpe_tokenizer import build_bpe_tokenizer

    hf = build_bpe_tokenizer(tmp_path / "tok")
    start = hf.convert_tokens_to_ids("<|im_start|>")
    # a tokenizer that adds a start token to every text it encodes with its special tokens
    hf._tokenizer.post_processor = TemplateProcessing(single="<|im_start|> $A", special_tokens=[("<|im_start|>", start)])
    codec = HFCodec(hf)
    assert hf.encode("ab")[0] == start and codec.encode("ab") == hf.encode("ab")[1:]
    ab = codec.encode("ab")
    assert codec.decode(ab) == "ab"  # no eos: the whole turn
    assert codec.decode([start] + ab + [codec.eos_id] + codec.encode("cd")) == "ab"  # special tokens skipped, cut at eos


def test_episode_log_probs_and_versions_line_up_with_the_mask():
    req = calc.request(Sample("1+2=", "3"), "s", TOK)
    t1, t2 = ids("<calc 1+2>"), ids("3") + [TOK.eos_id]
    turns = [Generated(t1, [-0.5] * len(t1), [4] * len(t1)), Generated(t2, [-0.25] * len(t2), [5] * len(t2))]
    ep = run(run_episode(scripted(turns), LocalEnvPool(), req, TOK, calc.limits(64)))
    n_obs = len(ids("=3 "))
    assert ep.logprobs == [-0.5] * len(t1) + [0.0] * n_obs + [-0.25] * len(t2)
    assert ep.versions == [4] * len(t1) + [-1] * n_obs + [5] * len(t2)
    assert len(ep.logprobs) == len(ep.versions) == len(ep.loss_mask) == len(ep.response_ids)


def test_an_episode_that_starts_with_an_observation_adds_its_steps_and_their_seconds():
    """The reset's observation comes before the first model turn (log-prob 0.0, version -1 on it);
    the environment's arguments reach it; rewards and environment seconds add up over reset and steps."""
    req = EpisodeRequest("s", f"{HERE}:Timed", Sample("p", "-"), tuple(ids("p")), {"reward": 0.25}, frozenset(ids(",")))
    t1, t2 = ids("a,"), ids("b,")
    turns = [Generated(t1, [-0.5] * 2, [4] * 2), Generated(t2, [-0.25] * 2, [5] * 2)]
    ep = run(run_episode(scripted(turns), LocalEnvPool(), req, TOK, Limits(5, 40, 64)))
    assert (ep.finish_reason, ep.error, ep.turns) == ("stop", None, 2)
    assert ep.observations == ["hi ", "ok "] and ep.response_ids == ids("hi ") + t1 + ids("ok ") + t2
    assert ep.logprobs == [0.0] * 3 + [-0.5] * 2 + [0.0] * 3 + [-0.25] * 2
    assert ep.versions == [-1] * 3 + [4] * 2 + [-1] * 3 + [5] * 2
    assert ep.step_rewards == [0.25, 0.25] and ep.reward == 0.5
    assert ep.env_seconds >= 3 * 0.02  # the reset's and both steps' (each sleeps 0.02 s)


def test_a_turn_of_one_token_is_still_generated():
    """The context leaves the third turn one token: the model gets it (and the turn, cut there,
    ends the episode with length)."""
    req = guess.request(Sample("guess=", "63"), "s", TOK)  # 7 prompt tokens
    gen = scripted([ids("1,"), ids("33,")])
    ep = run(run_episode(gen, LocalEnvPool(), req, TOK, Limits(6, 64, 11)))
    assert (ep.finish_reason, ep.turns, ep.response_ids) == ("length", 2, ids("1,>3"))
    assert ep.error == "a model turn used its 1 tokens without ending"


def test_finish_reasons_of_the_limits():
    pool = LocalEnvPool()
    req = guess.request(Sample("guess=", "63"), "s", TOK)
    # max_turns: six wrong guesses; the last answer is not appended
    wrong = [ids(f"{n},") for n in (1, 2, 3, 4, 5, 6)]
    ep = run(run_episode(scripted(wrong), pool, req, TOK, guess.limits(64, max_turns=6)))
    assert (ep.finish_reason, ep.turns, ep.reward) == ("max_turns", 6, 0.0)
    assert ep.observations == [">"] * 5 and ep.segments[-1][0] == "model"
    # length: a turn that uses its budget without a stop is not sent to the environment
    ep = run(run_episode(scripted([ids("123456")]), pool, req, TOK, Limits(6, 64, 64, max_turn_tokens=4)))
    assert (ep.finish_reason, ep.turns, ep.actions, ep.response_ids) == ("length", 1, [], ids("1234"))
    assert ep.error == "a model turn used its 4 tokens without ending"
    # length: the context runs out (prompt 7 tokens + 9 of context left): the third answer would
    # leave the model no token, so it is not appended
    ep = run(run_episode(scripted([ids("1,"), ids("2,"), ids("3,"), ids("4,")]), pool, req, TOK, Limits(6, 64, 16)))
    assert (ep.finish_reason, ep.response_ids, ep.dropped_tokens) == ("length", ids("1,>2,>3,"), 1)
    # length: the model's turn meets the context's end
    ep = run(run_episode(scripted([ids("1,"), ids("2,"), ids("345,")]), pool, req, TOK, Limits(6, 64, 16)))
    assert (ep.finish_reason, ep.response_ids, ep.turns) == ("length", ids("1,>2,>345"), 3)
    with pytest.raises(ValueError, match="no room"):
        run(run_episode(scripted([]), pool, req, TOK, Limits(6, 64, 7)))


def test_an_observation_that_overflows_the_budget_is_not_appended():
    req = EpisodeRequest("s", f"{HERE}:Chatty", Sample("p", "20"), tuple(ids("p")), stop_ids=frozenset(ids(",")))
    ep = run(run_episode(scripted([ids("hi,")] * 3), LocalEnvPool(), req, TOK,
                         Limits(5, 20, 64)))
    assert ep.finish_reason == "length" and ep.dropped_tokens == 20
    assert ep.response_ids == ids("hi,") and ep.loss_mask == [1, 1, 1] and ep.observations == []
    assert "20 tokens" in ep.error


def test_a_generator_that_breaks_the_contract_is_refused():
    req = guess.request(Sample("guess=", "5"), "s", TOK)
    with pytest.raises(ValueError, match="after a stop token"):
        run(run_episode(scripted([ids("1,2,")]), LocalEnvPool(), req, TOK, guess.limits(64)))
    with pytest.raises(ValueError, match="0 tokens"):
        run(run_episode(scripted([[]]), LocalEnvPool(), req, TOK, guess.limits(64)))
    with pytest.raises(ValueError, match="position 0 of 2"):  # a stop right before the last token
        run(run_episode(scripted([ids(",2")]), LocalEnvPool(), req, TOK, guess.limits(64)))
    t = ids("1,")
    for turn, words in [(Generated(t, [-0.5]), "1 logprobs for 2 tokens"), (Generated(t, None, [3, 3, 3]), "3 versions for 2")]:
        with pytest.raises(ValueError, match=words):
            run(run_episode(scripted([turn]), LocalEnvPool(), req, TOK, guess.limits(64)))
    # log-probs on one turn and not the next (versions on neither)
    with pytest.raises(ValueError, match="^generate returned log-probs or versions for some turns of an episode, not all$"):
        run(run_episode(scripted([Generated(t, [-0.5] * 2), Generated(ids("2,"))]), LocalEnvPool(), req, TOK,
                        guess.limits(64)))


def test_bad_environments_fail_their_sample_only_in_process():
    good = guess.request(Sample("guess=", "32"), "good", TOK)
    bad = [EpisodeRequest(name, f"{HERE}:{cls}", Sample("guess=", "3"), good.prompt_ids, stop_ids=good.stop_ids)
           for name, cls in [("raises", "Raises"), ("nonstring", "NonString"), ("badreset", "BadReset"),
                             ("vocab", "OutOfVocabulary"), ("missing", "NoSuchEnv")]]
    pool = LocalEnvPool()

    async def generate(token_ids, max_new_tokens, stop_ids):  # the bad ones fail whatever the turn is
        return ids("32,")
    eps = run(run_episodes(generate, pool, [*bad, good], TOK, guess.limits(64)))
    by = {e.session: e for e in eps}
    assert by["good"].finish_reason == "stop" and by["good"].reward == 1.0
    for name, words in [("raises", "RuntimeError: the environment broke"), ("nonstring", "of type list"),
                        ("badreset", "reset returned an observation of type int"),
                        ("vocab", "cannot be tokenized: ValueError"), ("missing", "cannot be imported")]:
        assert by[name].finish_reason == "env_error" and words in by[name].error, (name, by[name].error)
    assert pool.host.envs == {} and pool._sessions.open == set()  # every session closed


def test_local_pool_with_a_timeout_fails_a_hung_call():
    class_spec = f"{HERE}:Sleeps"
    req = EpisodeRequest("slow", class_spec, Sample("p", "1"), tuple(ids("p")), stop_ids=frozenset(ids(",")))
    # (the abandoned call sleeps on in its thread for the rest of its second)
    ep = run(run_episode(scripted([ids("a,")]), LocalEnvPool(timeout_s=0.2), req, TOK, Limits(2, 10, 64)))
    assert ep.finish_reason == "timeout" and "0.2 s" in ep.error


def test_episode_metrics_count_calls_and_reasons():
    reqs = [calc.request(Sample("1+2=", "3"), f"s{i}", TOK) for i in range(2)]
    plans = {"s0": [ids("<calc 1+2>"), ids("3") + [2]], "s1": [ids("<calc 1+>"), ids("4") + [2]]}

    async def go():
        pool = LocalEnvPool()
        return await asyncio.gather(*(run_episode(scripted(plans[r.session]), pool, r, TOK, calc.limits(64))
                                      for r in reqs))
    m = episode_metrics(run(go()))
    assert m["reward_mean"] == 0.5 and m["tool_calls_per_sample"] == 1.0 and m["tool_call_success"] == 0.5
    assert m["finish/stop"] == 1.0 and set(FINISH_REASONS) <= {k.split("/")[1] for k in m if k.startswith("finish/")}


def test_episode_metrics_every_entry():
    reqs = [guess.request(Sample("guess=", s), f"s{i}", TOK) for i, s in enumerate(["2", "9"])]
    plans = {"s0": [ids("2,")], "s1": [ids("1,"), ids("5,"), ids("9,")]}

    async def go():
        pool = LocalEnvPool()
        return await asyncio.gather(*(run_episode(scripted(plans[r.session]), pool, r, TOK, guess.limits(64))
                                      for r in reqs))
    eps = run(go())
    eps[1].dropped_tokens = 3  # (as a sample whose last observation did not fit would have)
    m = episode_metrics(eps)
    assert math.isnan(m.pop("tool_call_success"))  # no tool call tried
    assert m.pop("env_seconds_mean") == (eps[0].env_seconds + eps[1].env_seconds) / 2 > 0
    assert m == {"n": 2, "reward_mean": 1.0, "turns_mean": 2.0, "tokens_mean": (2 + 3 * 2 + 2 * 1) / 2,
                 "tool_calls_per_sample": 0.0, "dropped_tokens": 3,
                 **{f"finish/{r}": float(r == "stop") for r in FINISH_REASONS}}
    assert episode_metrics([]) == {"n": 0}


def test_run_episodes_runs_at_most_concurrency_at_once_and_keeps_the_order():
    reqs = [calc.request(Sample(p, a), f"s{i}", TOK) for i, (p, a) in enumerate([("1+2=", "3"), ("2+2=", "4")])]
    answers = {"1+2": "3", "2+2": "4"}
    order = []

    async def generate(token_ids, max_new_tokens, stop_ids):
        text = TOK.decode(token_ids)
        expr = next(e for e in answers if e + "=" in text)
        order.append(expr)
        await asyncio.sleep(0)  # a turn takes time: the other episodes may run meanwhile
        return ids(answers[expr]) + [TOK.eos_id] if f"<calc {expr}>" in text else ids(f"<calc {expr}>")

    for concurrency, expect in [(1, ["1+2", "1+2", "2+2", "2+2"]), (None, ["1+2", "2+2", "1+2", "2+2"])]:
        order.clear()
        eps = run(run_episodes(generate, LocalEnvPool(), reqs, TOK, calc.limits(64), concurrency=concurrency))
        assert [(e.session, e.reward, e.turns) for e in eps] == [("s0", 1.0, 2), ("s1", 1.0, 2)]
        assert order == expect, concurrency


# ---------------------------------------------------------------- experts, SFT, evaluation


def test_expert_transcripts_are_episodes_with_their_masks():
    samples = make_splits(calc.CalcTask(), 40, 0, 0).train
    ts = calc_transcripts(samples, TOK, 64, direct_fraction=0.5, seed=0)
    text = lambda t: TOK.decode(t.ids)  # noqa: E731
    tool = [t for t in ts if text(t).startswith("<calc>")]
    direct = [t for t in ts if not text(t).startswith("<calc>")]
    assert tool and direct and len(ts) == 40
    for t, s in zip(ts, samples):
        expr = s.prompt[:-1]
        if t in tool:
            assert text(t) == f"<calc>{s.prompt}<calc {expr}>={s.answer} {s.answer}"
            n_prompt = 1 + len("<calc>" + s.prompt)
            assert t.mask == tuple([0] * n_prompt + [1] * len(f"<calc {expr}>") + [0] * len(f"={s.answer} ")
                                   + [1] * (len(s.answer) + 1))
        else:
            assert text(t) == s.prompt + s.answer and t.mask == tuple([0] * (1 + len(s.prompt)) + [1] * (len(s.answer) + 1))
        assert t.ids[-1] == TOK.eos_id


def test_the_noiseless_guesser_always_wins_within_six_and_the_noisy_one_sometimes_not():
    secrets = list(guess.GuessTask().all_samples())
    sure = guess_transcripts(secrets, TOK, 64, 1, noise=0.0)
    assert all(TOK.decode(t.ids).count(",") <= 6 for t in sure)
    won = lambda t: TOK.decode(t.ids).endswith(",") and not TOK.decode(t.ids)[-2] in "<>x"  # noqa: E731
    assert all(won(t) for t in sure)
    noisy = guess_transcripts(secrets, TOK, 64, 4, noise=1.0, seed=1)
    losses = [t for t in noisy if TOK.decode(t.ids).count(",") == 6]
    assert 0 < len(losses) < len(noisy)


def test_transcript_batch_masks_the_positions_that_predict_player_tokens():
    t1 = Transcript((1, 5, 6, 7, 8), (0, 1, 1, 0, 1))
    t2 = Transcript((1, 9, 10), (0, 0, 1))
    ids_, targets, mask = transcript_batch([t1, t2], pad_id=0)
    assert ids_.tolist() == [[1, 5, 6, 7, 8], [1, 9, 10, 0, 0]]
    assert targets.tolist() == [[5, 6, 7, 8], [9, 10, 0, 0]]
    assert mask.tolist() == [[1, 1, 0, 1], [0, 1, 0, 0]]
    with pytest.raises(ValueError, match="first token"):
        transcript_batch([Transcript((1, 2), (1, 1))], 0)


def test_observation_tokens_carry_no_gradient_in_the_warm_start():
    from rlhf_switch.rl.sft import answer_loss, build_initial_model

    model = build_initial_model(HF_CONFIG, 0)
    t = Transcript(tuple([1] + ids("guess=32,>48,")), tuple([0] * 7 + [1, 1, 1, 0, 1, 1, 1]))
    captured = []

    def keep(module, inputs, out):
        out.retain_grad()
        captured.append(out)
    hook = model.lm_head.register_forward_hook(keep)
    try:
        answer_loss(model, *transcript_batch([t], 0)).backward()
    finally:
        hook.remove()
    grad = captured[0].grad[0].abs().sum(-1)  # per position: the logits' gradient
    # the logits at position p predict token p+1: a gradient exactly where the next token is the player's
    assert [int(g > 0) for g in grad[:-1]] == list(t.mask[1:])
    assert grad[-1] == 0


def test_sft_on_transcripts_learns_the_player_turns():
    from rlhf_switch.rl.sft import build_initial_model

    torch.manual_seed(0)
    model = build_initial_model(HF_CONFIG, 0)
    data = guess_transcripts([Sample("guess=", "41"), Sample("guess=", "7")], TOK, 64, 1, noise=0.0)
    stats = sft_transcripts(model, data, steps=12, lr=3e-3, batch_size=2, seed=0)
    assert stats["loss_final"] < 0.5 * stats["loss_first"], stats


def _reference_greedy(model, prompt, max_new, stops):
    out, cur = [], list(prompt)
    with torch.no_grad():
        for _ in range(max_new):
            tok = int(model(input_ids=torch.tensor([cur])).logits[0, -1].argmax())
            out.append(tok)
            cur.append(tok)
            if tok in stops:
                break
    return out


def test_batched_greedy_equals_one_row_decoding():
    from rlhf_switch.rl.sft import build_initial_model

    model = build_initial_model(HF_CONFIG, 3).eval()
    gen = BatchedGreedy(model, max_batch=2)
    prompts = [[1] + ids("12+3="), [1] + ids("45+6="), [1] + ids("7*8="), [1] + ids("guess=1,>")]
    max_new = [6, 3, 5, 4]
    stops = [frozenset(range(10, 40)), frozenset(), frozenset(ids(",")), frozenset(range(64))]
    got = gen.decode(prompts, max_new, stops)
    assert got == [_reference_greedy(model, p, m, s) for p, m, s in zip(prompts, max_new, stops)]


def test_evaluator_token_list_is_the_generated_turns_and_the_observations():
    """A random model, every id a stop (one-token turns): many turns of real generated ids, each
    episode's list must be exactly the model's turns and the observations' ids, interleaved."""
    from rlhf_switch.rl.sft import build_initial_model

    model = build_initial_model(HF_CONFIG, 1).eval()
    gen = BatchedGreedy(model)
    calls = []

    async def logged(token_ids, max_new_tokens, stop_ids):
        out = await gen(token_ids, max_new_tokens, stop_ids)
        calls.append((tuple(token_ids), tuple(out)))
        return out
    secrets = [Sample("guess=", str(n)) for n in (5, 17, 40, 63)]
    reqs = [EpisodeRequest(f"e{i}", "guess", s, tuple([1] + ids("guess=")), stop_ids=frozenset(range(64)))
            for i, s in enumerate(secrets)]
    eps = run(run_episodes(logged, LocalEnvPool(), reqs, TOK, guess.limits(64, max_turns=5)))
    answers = dict(calls)  # the same prefix gets the same greedy answer
    for ep in eps:
        pos, k = len(ep.prompt_ids), 0
        for kind, n in ep.segments:
            segment = ep.ids[pos:pos + n]
            if kind == "model":  # exactly what generate returned, shown exactly the list before it
                assert tuple(segment) == answers[tuple(ep.ids[:pos])]
            else:  # the observation's own ids, appended
                assert segment == TOK.encode(ep.observations[k])
                k += 1
            pos += n
        assert pos == len(ep.ids) and k == len(ep.observations)
    assert max(e.turns for e in eps) >= 3
    assert gen.calls == len(calls)
    # play() drives the same way
    assert [e.response_ids for e in play(model, reqs, TOK, guess.limits(64, max_turns=5))] == [e.response_ids for e in eps]


# ---------------------------------------------------------------- the config block


def test_agent_config_is_strict_and_gives_the_limits():
    cfg = AgentConfig(env="calc", max_turns=3, max_total_tokens=48, pool={"num_workers": 3, "num_cpus": 0.5})
    assert episode_limits(cfg, 64) == Limits(3, 48, 64, None) and cfg.pool.timeout_s == 30.0
    # a run's block may leave the total to algorithm.max_new_tokens
    assert episode_limits(AgentConfig(env="calc", max_turns=2), 64, 30) == Limits(2, 30, 64, None)
    with pytest.raises(ValueError, match="max_total_tokens is not set"):
        episode_limits(AgentConfig(env="calc", max_turns=2), 64)
    assert isinstance(build_pool(AgentConfig(env="guess", max_turns=6, max_total_tokens=50,
                                             pool={"in_process": True}).pool), LocalEnvPool)
    for bad in ({"env": ""}, {"env": "calc", "max_turn": 3}, {"env": "calc", "pool": {"num_cpus": 0}},
                {"env": "calc", "failed_samples": "retry"}):
        with pytest.raises(ValueError):
            AgentConfig(**{"max_turns": 3, "max_total_tokens": 10, **bad})
    assert math.isfinite(cfg.pool.start_timeout_s)


def test_a_session_reset_twice_raises_and_leaves_the_first_episode_its_environment():
    pool = LocalEnvPool()
    req = guess.request(Sample("guess=", "32"), "same", TOK)

    async def go():
        assert not (await pool.reset("same", "guess", req.sample)).failed
        with pytest.raises(ValueError, match="already open"):
            await run_episode(scripted([ids("32,")]), pool, req, TOK, guess.limits(64))
        assert "same" in pool.host.envs  # the first owner's environment is still there
        return await pool.step("same", "32,")
    assert run(go()).done
