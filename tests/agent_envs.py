"""Environments that misbehave, for tests/test_agent.py and tests/test_agent_pool.py: imported by
name ("agent_envs:Raises") in the test process and in the pool's Ray workers (this directory is on
their PYTHONPATH)."""
from __future__ import annotations

import os
import time

from rlhf_switch.agent.env import Environment, StepResult


class Raises(Environment):
    def reset(self, sample):
        return ""

    def step(self, action):
        raise RuntimeError("the environment broke")


class NonString(Environment):
    def reset(self, sample):
        return ""

    def step(self, action):
        return StepResult(["not", "text"])


class BadReset(Environment):
    def reset(self, sample):
        return 42


class Chatty(Environment):
    """Answers every turn with ``n`` characters (``n``: the sample's answer)."""

    def reset(self, sample):
        self.n = int(sample.answer)
        return ""

    def step(self, action):
        return StepResult("a" * self.n)


class OutOfVocabulary(Environment):
    def reset(self, sample):
        return ""

    def step(self, action):
        return StepResult("Ünicode")


class Sleeps(Environment):
    """Each step sleeps the sample's answer in seconds."""

    def reset(self, sample):
        self.seconds = float(sample.answer)
        return ""

    def step(self, action):
        time.sleep(self.seconds)
        return StepResult("late")


class Timed(Environment):
    """Greets on reset, answers every step with ``reward`` (an argument of the environment); reset and
    each step sleep 0.02 s; done after two steps."""

    def __init__(self, reward):
        self.reward = reward

    def reset(self, sample):
        time.sleep(0.02)
        self.steps = 0
        return "hi "

    def step(self, action):
        time.sleep(0.02)
        self.steps += 1
        return StepResult("ok ", self.reward, self.steps >= 2)


class Pid(Environment):
    """Answers with the process it runs in; done after the sample's answer turns."""

    def reset(self, sample):
        self.turns, self.left = 0, int(sample.answer)
        return ""

    def step(self, action):
        self.left -= 1
        return StepResult(f"{os.getpid()} ", 0.0, self.left <= 0)


class GuessFailsOnOdd:
    """The guessing game, whose step raises when the secret is odd: half the samples of a run fail
    (``env_error``), the others play on."""

    def __init__(self, **kwargs):
        from rlhf_switch.agent.guess import GuessEnvironment

        self.game = GuessEnvironment(**kwargs)

    @classmethod
    def episode_request(cls, sample, session, tokenizer, **kwargs):
        from rlhf_switch.agent.guess import request

        return _with_env(request(sample, session, tokenizer, **kwargs))

    def reset(self, sample):
        return self.game.reset(sample)

    def step(self, action):
        if self.game.secret % 2:
            raise RuntimeError(f"the secret {self.game.secret} is odd")
        return self.game.step(action)

    def close(self):
        pass


def _with_env(request):
    import dataclasses

    return dataclasses.replace(request, env="agent_envs:GuessFailsOnOdd")


class ChatCalc(Environment):
    """The calculator as a chat model's tool: Hermes/Qwen JSON calls, the tool declared to the
    chat template (``chat_tools``), exact match of the final answer (tests/test_agent_chat.py)."""

    def __init__(self):
        from rlhf_switch.agent.calc import Calculator
        from rlhf_switch.agent.tools import ToolEnvironment

        self.inner = ToolEnvironment([Calculator()], "json")

    @classmethod
    def chat_tools(cls):
        from rlhf_switch.agent.calc import Calculator

        return [Calculator().schema()]

    def reset(self, sample):
        return self.inner.reset(sample)

    def step(self, action):
        return self.inner.step(action)


class Greets(Environment):
    """Speaks first: its reset returns an observation."""

    def reset(self, sample):
        return "hello"

    def step(self, action):
        return StepResult("", 1.0, True)


class Numbers(Environment):
    """Asks for a number ``turns`` times: reward 1/turns for each turn that is one (the chat loop's
    test, tests/test_agent_loop.py); no warm-start transcripts, so a data run's SFT (prompt ->
    answer) warms it up."""

    def __init__(self, turns: int = 3):
        self.turns, self.seen = turns, 0

    def reset(self, sample):
        return ""

    def step(self, action):
        self.seen += 1
        reward = 1.0 / self.turns if action.strip().isdigit() else 0.0
        return StepResult("again", reward, self.seen >= self.turns, {"number": action.strip().isdigit()})


class BadChatTools(ChatCalc):
    """Its tool declaration raises (tests/test_problems.py: the pre-start check renders the first turn)."""

    @classmethod
    def chat_tools(cls):
        raise RuntimeError("no schema today")


class PaysThenRaises(Environment):
    """Rewards its first step, raises at its second: a failed episode with a reward so far
    (tests/test_sources.py: a failed episode's reward is 0). A model turn ends at "4" or "6"."""

    @classmethod
    def episode_request(cls, sample, session, tokenizer):
        from rlhf_switch.agent.episode import EpisodeRequest

        return EpisodeRequest(session=session, env="agent_envs:PaysThenRaises", sample=sample,
                              prompt_ids=tuple(tokenizer.encode(sample.prompt, add_bos=True)),
                              stop_ids=frozenset(tokenizer.encode("46")))

    def reset(self, sample):
        self.steps = 0
        return ""

    def step(self, action):
        self.steps += 1
        if self.steps > 1:
            raise RuntimeError("the environment broke at its second step")
        return StepResult("", 1.0, False)
