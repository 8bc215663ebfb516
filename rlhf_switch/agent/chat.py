"""Multi-turn episodes of a Hugging Face chat model: its own chat template applied once, to the
first turn; every later message appended as the tokens the template writes for it alone.

    codec = ChatCodec(tokenizer)                       # an HFTokenizer or a transformers tokenizer
    request = chat_request(codec, "guess", {}, sample, "s0")
    episode = await run_episode(generate, pool, request, codec, limits)

Why not render the whole conversation again each turn: the model's tokens would then be the
tokenizer's reading of their text, not the ids the model generated (a BPE merge across a turn's
edge, a special token the model wrote as text, a template that rewrites earlier messages) — the
field's most reported multi-turn bug. Here nothing already in the token list is rendered or
encoded again:

- the prompt is ``apply_chat_template([system?, user: sample.prompt], add_generation_prompt=True)``
  encoded once (with ``tools`` when the environment class declares some: ``chat_tools``);
- a model turn is the ids the engine returned; a chat model ends its turn with the template's end
  of an assistant message, its eos (``<|im_end|>`` for ChatML/Qwen), so a chat episode has no stop
  id but the eos;
- an observation is a new message of role ``observation_role`` (``user``, or ``tool`` for
  templates that render tool results): its ids are the template's text between the end of an
  assistant message and the next opened assistant turn, worked out by rendering a probe
  conversation with and without that message (``observation_ids``), and encoded alone. The text
  before it ends with the eos (a special token), so encoding it alone reads it as the whole text
  would. A turn that ended at the budget or a stop id without the eos gets the eos from the
  observation (the template's text: the assistant message closed).

So the episode's tokens decode to exactly the template's rendering of the whole conversation
(tests/test_agent_chat.py), and the model's tokens are exactly what it generated.

``ChatTemplateError``: the tokenizer has no chat template, or one that does not write an
assistant message's content as it is followed by the eos, or that changes earlier messages when
one is added — refused when the codec is built (the run's pre-start check builds one), not in the
middle of a run. An environment whose ``reset`` returns an observation cannot be played this way
(the first message is the prompt): that sample ends ``env_error``.
"""
from __future__ import annotations

from typing import Any, Sequence

from .env import environment_class
from .episode import EpisodeRequest, HFCodec

# content no template rewrites (no whitespace to strip, no tags to parse)
PROBE_USER, PROBE_ANSWER = "rlhfswitchprobeuser", "rlhfswitchprobeanswer"


class ChatTemplateError(ValueError):
    """The tokenizer's chat template cannot extend a conversation token by token."""


class ChatCodec(HFCodec):
    """A chat-template tokenizer as an episode's codec (module docstring): ``prompt_ids`` for the
    first turn, ``observation_ids`` for each observation; ``encode`` and ``decode`` (a model turn's
    text) are ``HFCodec``'s."""

    def __init__(self, tokenizer: Any, observation_role: str = "user", system: str | None = None):
        super().__init__(getattr(tokenizer, "hf", tokenizer))  # rl.tokenizer.HFTokenizer wraps one
        self.name = getattr(self.tokenizer, "name_or_path", None) or "the tokenizer"  # its directory, where it has one
        if not getattr(self.tokenizer, "chat_template", None):
            raise ChatTemplateError(f"{self.name} has no chat template")
        if self.eos_id is None:
            raise ChatTemplateError(f"{self.name} has no eos token: a chat turn must end with one")
        self.eos_text = self.tokenizer.convert_ids_to_tokens(self.eos_id)
        self.observation_role, self.system = observation_role, system
        self._tail = self._observation_template()

    def _head(self) -> list[dict]:
        return [{"role": "system", "content": self.system}] if self.system is not None else []

    def _render(self, messages: list[dict], generation_prompt: bool, tools: list | None = None) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                           add_generation_prompt=generation_prompt)

    def _observation_template(self) -> tuple[str, str]:
        """The template's text after an assistant message's content, around an observation's
        content: ``(before, after)``, ``before`` starting with the eos text."""
        probe = self._head() + [{"role": "user", "content": PROBE_USER}, {"role": "assistant", "content": PROBE_ANSWER}]
        closed = self._render(probe, False)
        marker = "rlhfswitchprobeobservation"
        full = self._render(probe + [{"role": self.observation_role, "content": marker}], True)
        end = closed.rfind(PROBE_ANSWER) + len(PROBE_ANSWER)
        if end < len(PROBE_ANSWER) or full[:end] != closed[:end]:
            raise ChatTemplateError(f"{self.name}: the chat template does not keep an assistant message's text "
                                    f"as it is when a {self.observation_role} message follows it")
        tail = full[end:]
        if not tail.startswith(self.eos_text):
            raise ChatTemplateError(f"{self.name}: the chat template does not end an assistant message with the "
                                    f"eos {self.eos_text!r}, so a generated turn cannot be extended as tokens "
                                    f"(it writes {tail[:40]!r} after one)")
        if tail.count(marker) != 1:
            raise ChatTemplateError(f"{self.name}: the chat template does not write a {self.observation_role} "
                                    f"message's content once and as it is")
        before, after = tail.split(marker)
        return before, after

    def prompt_text(self, text: str, tools: list | None = None) -> str:
        """The first turn's text: ``text`` as the user's message (after the system message, if
        any), the assistant's turn opened; ``tools`` (OpenAI-style function schemas) where the
        template declares them."""
        return self._render(self._head() + [{"role": "user", "content": text}], True, tools)

    def prompt_ids(self, text: str, tools: list | None = None) -> list[int]:
        """``prompt_text``'s ids."""
        return self.encode(self.prompt_text(text, tools))

    def observation_ids(self, text: str, turn: Sequence[int] | None) -> list[int]:
        """The ids of observation ``text`` appended after model turn ``turn`` (its ids): the
        assistant message closed (the eos, unless ``turn`` ended with it), ``text`` as a message of
        ``observation_role``, the next assistant turn opened."""
        if turn is None:
            raise ChatTemplateError("a chat episode's first message is its prompt: the environment's reset "
                                    f"returned an observation ({len(text)} characters) it cannot be put in")
        before, after = self._tail
        if turn and int(turn[-1]) == self.eos_id:
            before = before[len(self.eos_text):]
        return self.encode(before + text + after)


def env_tools(env: str, env_kwargs: dict) -> list | None:
    """The tools environment ``env`` declares to a chat template: its class's
    ``chat_tools(**env_kwargs)`` (a classmethod returning function schemas), None without one."""
    declare = getattr(environment_class(env), "chat_tools", None)
    return (declare(**env_kwargs) or None) if declare is not None else None


def chat_request(codec: ChatCodec, env: str, env_kwargs: dict, sample: Any, session: str,
                 rendered: bool = False) -> EpisodeRequest:
    """The episode of ``sample`` for a chat model: its prompt the sample's prompt as the user's
    message, after the codec's system message, with the tools the environment declares
    (``env_tools``); no stop id but the eos. ``rendered``: the sample's prompt is that first
    turn's text already (a ``data:`` run's loader wrote it: ``agent.config.chat_prompt``),
    encoded as it is."""
    if rendered:
        ids = codec.encode(sample.prompt)
    else:
        ids = codec.prompt_ids(sample.prompt, env_tools(env, env_kwargs))
    return EpisodeRequest(session=session, env=env, sample=sample, env_kwargs=dict(env_kwargs), prompt_ids=tuple(ids))
