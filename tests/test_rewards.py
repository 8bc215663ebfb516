"""``rlhf_switch.rl.rewards`` beyond the maths rewards (``test_math_rewards``) and the runner
(``test_reward_workers``): the shipped string rewards by hand, ``final_number``'s order of
preference, the plug-in point's messages, and ``score_samples``' checks of what a reward returns,
each message whole (pure, fast)."""
from __future__ import annotations

import math
from decimal import Decimal
from types import SimpleNamespace

import pytest
import torch

from rlhf_switch.rl.rewards import (RewardError, Watch, _as_decimal, _shorten, as_score, batched, describe_exception,
                                    describe_fn, describe_sample, exact_match, final_number, is_batched,
                                    load_reward_fn, parse_reward_spec, partial_credit, score_samples)

HERE = "test_rewards"


def test_batched_marks_the_function_and_only_true_counts():
    def f(p, r, a):
        return 0.0

    assert batched(f) is f and f.batched is True and is_batched(f)

    def g(p, r, a):
        return 0.0

    assert not is_batched(g)
    g.batched = 1  # truthy, but not the declaration
    assert not is_batched(g)

    class Scorer:
        @batched
        def score(self, prompts, responses, answers):
            return [1.0] * len(prompts)

    assert is_batched(Scorer().score)  # a bound method follows its function


def test_exact_match_and_partial_credit_by_hand():
    assert exact_match("p", "12", "12") == 1.0 and exact_match("p", "12", "012") == 0.0
    assert partial_credit("p", "12", "312") == 2 / 3  # digits right-aligned: 2 and 1 match
    assert partial_credit("p", "1357", "357") == 3 / 4  # one extra digit costs a quarter
    assert partial_credit("p", "abd", "abc") == 2 / 3  # not a number: left-aligned
    assert partial_credit("p", "xabc", "abc") == 0.0  # left-aligned: nothing lines up
    assert partial_credit("p", "5-", "-5") == 0.0  # "-5" is not all digits: left-aligned
    assert partial_credit("p", "", "") == 1.0


def test_final_number_prefers_hashes_then_the_last_boxed_with_a_number_then_the_last_number():
    assert final_number("1 #### 2 then 3") == 2
    assert final_number("\\boxed{7} and \\boxed{no number} and 9") == 7  # the last boxed that holds one
    assert final_number("\\boxed{1, 2} later 5") == 2
    assert final_number("\\boxed{x} 4 and 6") == 6
    assert final_number("-1,234.50 is it") == Decimal("-1234.50")
    assert final_number("#### $ 18") == 18
    assert _as_decimal("1,234.0") == Decimal("1234.0") and _as_decimal("72.") == 72
    assert _as_decimal("x") is None and _as_decimal("1.2.3") is None


def test_parse_reward_spec():
    assert parse_reward_spec(" my.mod : Scorer.score ") == ("my.mod", "Scorer.score")
    for bad in ("no_colon", ":f", "m:", "m: ", " :f", "a:b:c"):
        with pytest.raises(ValueError) as e:
            parse_reward_spec(bad)
        assert str(e.value) == (f"reward function {bad!r} must be written 'module:function' "
                                f"(e.g. 'rlhf_switch.rl.rewards:exact_match')")
    with pytest.raises(RewardError) as e:  # load_reward_fn: the same message, as a RewardError
        load_reward_fn("a:b:c")
    assert str(e.value).startswith("reward function 'a:b:c' must be written 'module:function'")
    assert e.value.__cause__ is None


def _module(tmp_path, monkeypatch, name, source):
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))


def test_load_reward_fn_messages(tmp_path, monkeypatch):
    """Each way a spec fails to load, one message naming the spec: a missing module or package, a
    module that fails to import (whose own message is kept), a missing attribute with the module's
    public callables (the first 20, sorted) or none, something not callable."""
    many = "".join(f"def f{i:02d}(p, r, a):\n    return 0.0\n" for i in range(25))
    _module(tmp_path, monkeypatch, "many_rewards", many + "VALUE = 3\ndef _hidden(p, r, a):\n    return 0.0\n")
    _module(tmp_path, monkeypatch, "plain_rewards", "VALUE = 3\nclass Box:\n    size = 2\n")
    _module(tmp_path, monkeypatch, "needs_missing", "import not_installed_dep_xyz\n")
    _module(tmp_path, monkeypatch, "raises_at_import", "raise KeyError('boom')\n")

    def refused(spec):
        with pytest.raises(RewardError) as e:
            load_reward_fn(spec)
        return str(e.value)

    assert load_reward_fn("many_rewards:f03")("p", "r", "a") == 0.0
    hint = ", ".join(f"f{i:02d}" for i in range(20))
    assert refused("many_rewards:nope") == f"reward function 'many_rewards:nope': 'many_rewards' has no attribute " \
                                           f"'nope'; callables there: {hint}"
    assert refused("plain_rewards:nope") == ("reward function 'plain_rewards:nope': 'plain_rewards' has no "
                                             "attribute 'nope'; callables there: Box")
    assert refused("plain_rewards:Box.size.x").startswith("reward function 'plain_rewards:Box.size.x': "
                                                          "'plain_rewards:Box.size' has no attribute 'x'; callables "
                                                          "there: as_integer_ratio, bit_count")
    assert refused("plain_rewards:Box.nope") == ("reward function 'plain_rewards:Box.nope': 'plain_rewards:Box' has "
                                                 "no attribute 'nope'")  # no public callable there: no hint
    assert refused("plain_rewards:VALUE") == "reward function 'plain_rewards:VALUE' is a int, not callable"
    assert refused("no_such_pkg_xyz.sub:f") == ("reward function 'no_such_pkg_xyz.sub:f': no module named "
                                                "'no_such_pkg_xyz.sub' (is it on PYTHONPATH / installed?)")
    assert refused("needs_missing:f") == ("reward function 'needs_missing:f': importing 'needs_missing' failed: No "
                                          "module named 'not_installed_dep_xyz'")
    assert refused("raises_at_import:f") == ("reward function 'raises_at_import:f': importing 'raises_at_import' "
                                             "raised KeyError: 'boom'")
    assert refused("plain_rewards.sub:f").startswith("reward function 'plain_rewards.sub:f': no module named "
                                                     "'plain_rewards.sub'")


def test_the_descriptions_a_message_is_made_of():
    assert describe_fn(exact_match) == "rlhf_switch.rl.rewards:exact_match"

    assert describe_fn(SimpleNamespace(__module__=None, __qualname__="Q")) == "?:Q"
    assert describe_fn(SimpleNamespace(__module__="m", __qualname__=None, __name__="N")) == "m:N"
    assert describe_fn(SimpleNamespace(__module__="m", __qualname__=None, __name__=None)) == \
        "m:namespace(__module__='m', __qualname__=None, __name__=None)"
    assert _shorten("x" * 80) == repr("x" * 80)
    assert _shorten("y" * 81) == repr("y" * 80) + "... (81 chars)"
    assert _shorten("z" * 90, limit=10) == repr("z" * 10) + "... (90 chars)"
    assert describe_sample(3, "12+5=", "17", "17") == "sample 3 (prompt='12+5=', response='17', answer='17')"
    try:
        {}["k"]
    except KeyError as e:
        assert describe_exception(e) == f"KeyError: 'k' (test_rewards.py:{e.__traceback__.tb_lineno})"
    assert describe_exception(ValueError("v")) == "ValueError: v"  # never raised: no place


def test_as_score_takes_finite_real_numbers_only():
    def where():
        return "reward function f on sample 0"

    assert as_score(True, where) == 1.0 and as_score(3, where) == 3.0 and as_score(torch.tensor(0.5), where) == 0.5
    for value, shown in (("1", "'1' (str)"), (b"1", "b'1' (bytes)"), (None, "None (NoneType)"),
                         ([1.0], "[1.0] (list)")):
        with pytest.raises(RewardError) as e:
            as_score(value, where)
        assert str(e.value) == f"reward function f on sample 0 returned {shown}, not a number"
        assert e.value.__cause__ is None
    with pytest.raises(RewardError, match=r"^reward function f on sample 0 returned tensor\(\[1\., 2\.\]\) \(Tensor\), "
                                          r"not a number$"):
        as_score(torch.tensor([1.0, 2.0]), where)
    for bad in (math.inf, -math.inf, math.nan):
        with pytest.raises(RewardError) as e:
            as_score(bad, where)
        assert str(e.value) == f"reward function f on sample 0 returned {bad}, not a finite number"


class Log(Watch):
    def __init__(self):
        self.calls = []

    def started(self, index):
        self.calls.append(("started", index))

    def scored(self, count):
        self.calls.append(("scored", count))


def test_score_samples_reports_each_call_to_the_watch():
    watch = Log()
    assert score_samples(exact_match, ["p"] * 3, ["1", "2", "3"], ["1", "0", "3"], first=7, watch=watch) == \
        [1.0, 0.0, 1.0]
    assert watch.calls == [("started", 7), ("scored", 1), ("started", 8), ("scored", 1), ("started", 9), ("scored", 1)]

    @batched
    def lengths(prompts, responses, answers):
        return torch.tensor([float(len(r)) for r in responses])  # a tensor: its numbers as floats

    watch = Log()
    scores = score_samples(lengths, ("p", "p"), ("ab", "abc"), ("a", "a"), first=4, watch=watch)
    assert scores == [2.0, 3.0] and all(type(s) is float for s in scores)
    assert watch.calls == [("started", 4), ("scored", 2)]
    Watch().started(0), Watch().scored(1)  # the base watch: nothing to report to
    with pytest.raises(ValueError) as e:
        score_samples(exact_match, ["p"], ["r", "s"], ["a", "b", "c"])
    assert str(e.value) == "prompts, responses and answers must be equally long, got 1, 2, 3"


def test_a_batched_reward_is_checked_whole_and_per_sample():
    calls = []

    @batched
    def returns(prompts, responses, answers):
        calls.append(len(prompts))
        return {"str": "1.0", "dict": {"a": 1}, "int": 3, "short": [1.0], "none": [1.0, None, 1.0],
                "tuple": (1, 2.5, True), "raise": None}[answers[0]]

    assert score_samples(returns, [], [], []) == [] and calls == []  # no call for no samples
    assert score_samples(returns, ["p"] * 3, ["r"] * 3, ["tuple"] * 3) == [1.0, 2.5, 1.0]
    name = f"{HERE}:test_a_batched_reward_is_checked_whole_and_per_sample.<locals>.returns"
    for answer, what in (("str", """returned "'1.0'" (str), not one number per sample"""),
                         ("dict", """returned "{'a': 1}" (dict), not one number per sample"""),
                         ("int", "returned '3' (int), not one number per sample"),
                         ("short", "returned 1 scores for 3 samples")):
        with pytest.raises(RewardError) as e:
            score_samples(returns, ["p0", "p1", "p2"], ["r"] * 3, [answer] * 3, first=5)
        assert str(e.value) == (f"reward function {name} (batched) on samples 5..7, the first sample 5 (prompt='p0', "
                                f"response='r', answer={answer!r}) {what}")
    with pytest.raises(RewardError) as e:
        score_samples(returns, ["p0", "p1", "p2"], ["r0", "r1", "r2"], ["none"] * 3, first=5)
    assert str(e.value) == (f"reward function {name} (batched) on sample 6 (prompt='p1', response='r1', "
                            f"answer='none') returned None (NoneType), not a number")

    @batched
    def fails(prompts, responses, answers):
        raise KeyError("table")

    with pytest.raises(RewardError) as e:
        score_samples(fails, ["p0", "p1"], ["r"] * 2, ["a"] * 2, first=2)
    assert str(e.value).startswith(f"reward function {HERE}:test_a_batched_reward_is_checked_whole_and_per_sample."
                                   f"<locals>.fails (batched) on samples 2..3, the first sample 2 (prompt='p0', "
                                   f"response='r', answer='a') raised KeyError: 'table' (test_rewards.py:")
    assert isinstance(e.value.__cause__, KeyError)


def test_a_per_sample_reward_that_raises_keeps_the_cause():
    def fails(prompt, response, answer):
        raise ZeroDivisionError("x")

    with pytest.raises(RewardError) as e:
        score_samples(fails, ["p0", "p1"], ["r0", "r1"], ["a", "b"], first=3)
    assert str(e.value).startswith(f"reward function {HERE}:test_a_per_sample_reward_that_raises_keeps_the_cause."
                                   f"<locals>.fails on sample 3 (prompt='p0', response='r0', answer='a') raised "
                                   f"ZeroDivisionError: x (test_rewards.py:")
    assert isinstance(e.value.__cause__, ZeroDivisionError)


# --- the edges of the plug-in point (each a mutant of rl/rewards.py no test told apart) -------------

def test_a_callable_without_names_is_described_by_its_repr():
    """A ``functools.partial`` has no ``__qualname__`` and no ``__name__`` (and a module of its own)."""
    import functools

    fn = functools.partial(exact_match, "p")
    assert describe_fn(fn) == f"functools:{fn!r}"
    namespace = SimpleNamespace()  # no __module__ either
    assert describe_fn(namespace) == "?:namespace()"


def test_an_exception_from_code_without_a_directory_names_its_file():
    code = compile("def f():\n    raise ValueError('bad')\n", "my_rewards.py", "exec")
    scope: dict = {}
    exec(code, scope)
    try:
        scope["f"]()
    except ValueError as e:
        assert describe_exception(e) == "ValueError: bad (my_rewards.py:2)"


def test_a_per_sample_reward_gets_the_prompt():
    assert score_samples(lambda p, r, a: float(p == "12+5="), ["12+5=", "1+1="], ["17", "2"], ["17", "2"]) == [1.0, 0.0]


def _slow(p, r, a):
    import time

    time.sleep(0.05)
    return 1.0


@pytest.mark.parametrize("fn, where", [
    (_slow, f"reward function {HERE}:_slow on sample 4 (prompt='p', response='r', answer='a')"),
    (batched(lambda ps, rs, as_: [_slow(*s) for s in zip(ps, rs, as_)]),
     f"reward function {HERE}:<lambda> (batched) on samples 4..4, the first sample 4 (prompt='p', response='r', "
     f"answer='a')"),
])
def test_a_call_over_reward_timeout_s_is_refused_after_it_returns(fn, where):
    """A call of at least 50 ms against a limit of 1 ms: refused, naming the call and the limit; a
    limit of a minute: scored."""
    with pytest.raises(RewardError) as info:
        score_samples(fn, ["p"], ["r"], ["a"], first=4, timeout_s=0.001)
    text = str(info.value)
    assert text.startswith(f"{where} took ") and text.endswith(
        " s, over the limit of 0.001 s (reward_timeout_s; in the driver's process a call is refused after it returns "
        "— reward_workers >= 1 stops it at the limit)"), text
    assert score_samples(fn, ["p"], ["r"], ["a"], first=4, timeout_s=60) == [1.0]


def test_a_batched_reward_names_its_first_sample_and_returns_one_number_a_sample():
    @batched
    def raises(ps, rs, as_):
        raise KeyError("k")

    with pytest.raises(RewardError) as info:
        score_samples(raises, ["p0", "p1"], ["r0", "r1"], ["a0", "a1"], first=5)
    assert str(info.value).startswith(
        f"reward function {HERE}:test_a_batched_reward_names_its_first_sample_and_returns_one_number_a_sample.<locals>"
        f".raises (batched) on samples 5..6, the first sample 5 (prompt='p0', response='r0', answer='a0') raised "
        f"KeyError: 'k' (")
    # a column of scores ([n, 1]) is not one number per sample: its rows are lists
    column = batched(lambda ps, rs, as_: torch.tensor([[1.0], [0.0]]))
    with pytest.raises(RewardError, match=r"\(batched\) on sample 0 \(prompt='p0', response='r0', answer='a0'\) "
                                          r"returned \[1\.0\] \(list\), not a number$"):
        score_samples(column, ["p0", "p1"], ["r0", "r1"], ["a0", "a1"])
    # what is not a sequence is shown shortened to 60 characters of its repr
    long = batched(lambda ps, rs, as_: "x" * 100)
    with pytest.raises(RewardError) as info:
        score_samples(long, ["p0"], ["r0"], ["a0"])
    text = repr("x" * 100)
    assert str(info.value).endswith(f" returned {repr(text[:60])}... ({len(text)} chars) (str), not one number per "
                                    f"sample")
