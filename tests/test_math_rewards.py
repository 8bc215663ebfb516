"""``math_answer`` and ``math_format`` on GSM8K-style strings (pure, fast)."""
from __future__ import annotations

import pytest

from rlhf_switch.rl.rewards import final_number, load_reward_fn, math_answer, math_format

GSM8K = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
         "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72")


@pytest.mark.parametrize("response, answer, reward", [
    ("She sold 24 in May, so 48 + 24 = 72.\n#### 72", GSM8K, 1.0),
    ("#### 72", GSM8K, 1.0),
    ("#### 71", GSM8K, 0.0),
    ("The answer is 72", GSM8K, 1.0),                                 # no ####: the last number
    ("72 is close, but 48 + 24 = 73", GSM8K, 0.0),                    # the last number counts
    ("#### 72 and then 5 more words 9", GSM8K, 1.0),                  # #### wins over later numbers
    ("so the answer is \\boxed{72}.", GSM8K, 1.0),
    ("\\boxed{71} hmm 72", GSM8K, 0.0),                               # \boxed wins over the last number
    ("#### 1,234", "#### 1234", 1.0),                                 # thousands commas
    ("#### 1234", "total 1,234 apples #### 1,234", 1.0),
    ("#### 72.0", GSM8K, 1.0),                                        # trailing .0
    ("#### 72.", GSM8K, 1.0),                                         # a sentence's full stop
    ("#### -5", "the loss is 5 #### -5", 1.0),                        # negatives
    ("#### 5", "#### -5", 0.0),
    ("#### 2.50", "#### 2.5", 1.0),                                   # decimals, compared as numbers
    ("#### 2.5", "#### 25", 0.0),
    ("I do not know", GSM8K, 0.0),                                    # no number in the response
    ("#### 3", "no number here", 0.0),                                # no number in the answer
    ("", GSM8K, 0.0),
    ("#### $18", "Janet makes 9 * 2 = $<<9*2=18>>18 every day.\n#### 18", 1.0),
])
def test_math_answer(response, answer, reward):
    assert math_answer("a prompt", response, answer) == reward


@pytest.mark.parametrize("response, reward", [
    ("48 + 24 = 72\n#### 72", 1.0),
    ("#### 1,234  \n", 1.0),
    ("#### -3.5", 1.0),
    ("the answer is 72", 0.0),
    ("#### 72 because", 0.0),        # the #### line must end the response
    ("#### ", 0.0),
    ("\\boxed{72}", 0.0),
])
def test_math_format(response, reward):
    assert math_format("p", response, "#### 72") == reward


def test_final_number_and_plugin_names():
    assert final_number(GSM8K) == 72
    assert final_number("nothing") is None
    assert load_reward_fn("rlhf_switch.rl.rewards:math_answer") is math_answer
    assert load_reward_fn("rlhf_switch.rl.rewards:math_format") is math_format


@pytest.mark.parametrize("response, answer, reward", [
    ("#### 5, no wait: 48 + 24 = 72\n#### 72", GSM8K, 1.0),   # the response corrects itself: the last counts
    ("#### 72, no wait\n#### 5", GSM8K, 0.0),
    ("#### 72", "first 5 #### 5 then #### 72", 1.0),          # the answer's last #### too
    ("#### 5", "first 5 #### 5 then #### 72", 0.0),
])
def test_math_answer_with_two_hashes_counts_the_last(response, answer, reward):
    assert math_answer("a prompt", response, answer) == reward
    assert final_number(response + "\n#### 9") == 9  # whatever came before
