"""Tools, the call formats the model writes them in, and ``ToolEnvironment``: a set of tools as an
environment.

A tool (``Tool``) has a ``name``, a ``description``, JSON-schema ``parameters`` (an object schema,
as in OpenAI/Hermes function calling) and ``call(**arguments) -> str``. ``TOOLS`` registers them by
name (``register_tool``); ``build_tool(spec)`` builds a registered one or a user's ``module:Class``.

A call format (``CallFormat``) is declared per environment: ``parse(text, tools)`` reads one model
turn and returns a ``ToolCall``, a ``CallError`` (the turn tried to call and failed), or None (no
call: the turn is the final answer); ``stop`` is the text that closes a call, where generation
stops so the environment can answer; ``result_text`` / ``error_text`` write the observation.

- ``JsonCallFormat`` (``"json"``), for models with a chat vocabulary, the Hermes/Qwen spelling::

      <tool_call>{"name": "calc", "arguments": {"expression": "12+34"}}</tool_call>
      -> <tool_response>46</tool_response>            error: <tool_response>error: ...</tool_response>

- ``CompactCallFormat`` (``"compact"``), for a character-level model: ``<name argument>``, the
  argument passed as the tool's one parameter::

      <calc 12345*678>  ->  =8369910␠               error: =err syntax␠ | tool | args | failed

  Its error texts are fixed words (never the model's text echoed back), so every observation is
  in the character tokenizer's vocabulary.

Everything a turn can get wrong becomes an error observation and the episode goes on (the model may
try again, within ``max_turns``): text that opens a call and is not one (``syntax``), a name that
is no tool (``unknown_tool``), arguments the schema refuses (``arguments``), a tool that raises or
returns something that is not a string (``tool_error``). Generation stops at ``stop``, so a turn
holds at most one call, and the call must end the turn.
"""
from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from typing import Any, Callable, Literal, Mapping, Sequence

from ..rl.imports import import_named
from .env import Environment, StepResult


class Tool:
    """A tool the model may call. Subclass: set ``name``, ``description``, ``parameters`` (a JSON
    schema of type object) and implement ``call``."""

    name: str = ""
    description: str = ""
    parameters: dict = {"type": "object", "properties": {}}

    def call(self, **arguments: Any) -> str:
        raise NotImplementedError

    def schema(self) -> dict:
        """The OpenAI-style function description of the tool."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


# name -> class, or the "module:Class" of a shipped one (imported on first use)
TOOLS: dict[str, Callable[..., Tool] | str] = {"calc": "rlhf_switch.agent.calc:Calculator"}


def register_tool(name: str) -> Callable[[type], type]:
    """Class decorator: ``@register_tool("echo")`` makes ``build_tool("echo")`` build the class."""
    def add(cls: type) -> type:
        TOOLS[name] = cls
        return cls
    return add


def build_tool(spec: str | Tool) -> Tool:
    """A tool: an instance is returned as it is; a registered name or ``module:Class`` is built."""
    if isinstance(spec, Tool):
        return spec
    spec = TOOLS.get(spec, spec)
    if not isinstance(spec, str):
        return spec()
    if ":" not in spec:
        raise ValueError(f"unknown tool {spec!r}; registered: {', '.join(sorted(TOOLS))} (or 'module:Class')")
    tool = import_named(spec, "tool")()
    if not (isinstance(getattr(tool, "name", None), str) and callable(getattr(tool, "call", None))):
        raise ValueError(f"tool {spec!r} has no name or no call method")
    return tool


# ---------------------------------------------------------------- calls


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict
    text: str  # the call as the model wrote it


ErrorKind = Literal["syntax", "unknown_tool", "arguments", "tool_error"]


@dataclass(frozen=True)
class CallError:
    kind: ErrorKind
    message: str
    name: str | None = None  # the tool named, when the text got that far


@functools.lru_cache(maxsize=256)
def _validator(schema_json: str):
    """A compiled validator of a schema (building one per call costs ~10 ms)."""
    import jsonschema

    schema = json.loads(schema_json)
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def check_arguments(tool: Tool, arguments: dict) -> str | None:
    """None when ``arguments`` satisfy the tool's JSON schema, else why not (jsonschema's message)."""
    import jsonschema

    error = jsonschema.exceptions.best_match(_validator(json.dumps(tool.parameters, sort_keys=True)).iter_errors(arguments))
    if error is None:
        return None
    where = "/".join(str(p) for p in error.absolute_path)
    return f"{where + ': ' if where else ''}{error.message}"


def run_call(call: ToolCall, tools: Mapping[str, Tool]) -> str | CallError:
    """The tool's result text, or the ``CallError`` the call ends in (unknown tool, bad arguments,
    the tool raising or returning something that is not a string)."""
    tool = tools.get(call.name)
    if tool is None:
        return CallError("unknown_tool", f"no tool named {call.name!r}; tools: {', '.join(sorted(tools))}", call.name)
    bad = check_arguments(tool, call.arguments)
    if bad is not None:
        return CallError("arguments", bad, call.name)
    try:
        result = tool.call(**call.arguments)
    except Exception as e:  # the tool's failure is the model's observation, never the run's
        return CallError("tool_error", f"{type(e).__name__}: {e}", call.name)
    if not isinstance(result, str):
        return CallError("tool_error", f"the tool returned a {type(result).__name__}, not a str", call.name)
    return result


class CallFormat:
    """How a model writes a tool call and reads its result (see the module docstring)."""

    name: str = ""
    stop: str = ""

    def parse(self, text: str, tools: Mapping[str, Tool]) -> ToolCall | CallError | None:
        raise NotImplementedError

    def result_text(self, result: str) -> str:
        raise NotImplementedError

    def error_text(self, error: CallError) -> str:
        raise NotImplementedError


class JsonCallFormat(CallFormat):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (``arguments`` may also be a
    JSON string of the object, as OpenAI's API sends it)."""

    name, open, stop = "json", "<tool_call>", "</tool_call>"

    def parse(self, text: str, tools: Mapping[str, Tool]) -> ToolCall | CallError | None:
        start = text.find(self.open)
        if start < 0:
            return None
        body_start = start + len(self.open)
        end = text.find(self.stop, body_start)
        if end < 0:
            return CallError("syntax", f"{self.open} without {self.stop}")
        if text[end + len(self.stop):].strip():
            return CallError("syntax", f"text after {self.stop}: the call must end the turn")
        try:
            obj = json.loads(text[body_start:end])
        except ValueError as e:
            return CallError("syntax", f"the call is not JSON: {e}")
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return CallError("syntax", 'the call must be a JSON object with a string "name"')
        args = obj.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError as e:
                return CallError("syntax", f"the arguments are not JSON: {e}", obj["name"])
        if not isinstance(args, dict):
            return CallError("syntax", '"arguments" must be a JSON object', obj["name"])
        if obj["name"] not in tools:
            return CallError("unknown_tool", f"no tool named {obj['name']!r}; tools: {', '.join(sorted(tools))}",
                             obj["name"])
        return ToolCall(obj["name"], args, text[start:end + len(self.stop)])

    def result_text(self, result: str) -> str:
        return f"<tool_response>{result}</tool_response>"

    def error_text(self, error: CallError) -> str:
        return f"<tool_response>error: {error.message}</tool_response>"


class CompactCallFormat(CallFormat):
    """``<name argument>`` — the argument is the tool's one parameter; ``<name>`` calls a tool
    without parameters. Any ``<`` in the turn opens a call."""

    name, open, stop = "compact", "<", ">"
    CALL = re.compile(r"<([a-z][a-z0-9_]*)(?: ([^<>]*))?>")
    # the error observation's word for each kind: fixed, in the character vocabulary
    WORDS = {"syntax": "syntax", "unknown_tool": "tool", "arguments": "args", "tool_error": "failed"}

    def parse(self, text: str, tools: Mapping[str, Tool]) -> ToolCall | CallError | None:
        start = text.find(self.open)
        if start < 0:
            return None
        m = self.CALL.fullmatch(text, start)
        if m is None:
            return CallError("syntax", f"not a call <name argument>: {text[start:]!r:.60}")
        name, arg = m.group(1), m.group(2)
        tool = tools.get(name)
        if tool is None:
            return CallError("unknown_tool", f"no tool named {name!r}; tools: {', '.join(sorted(tools))}", name)
        params = list(tool.parameters.get("properties", {}))
        if arg is None:
            if params and tool.parameters.get("required"):
                return CallError("arguments", f"{name} needs an argument", name)
            return ToolCall(name, {}, m.group(0))
        if len(params) != 1:
            return CallError("arguments", f"the compact format passes one argument; {name} takes {len(params)}", name)
        return ToolCall(name, {params[0]: arg}, m.group(0))

    def result_text(self, result: str) -> str:
        return f"={result} "

    def error_text(self, error: CallError) -> str:
        return f"=err {self.WORDS[error.kind]} "


CALL_FORMATS: dict[str, type[CallFormat]] = {"json": JsonCallFormat, "compact": CompactCallFormat}


def build_call_format(spec: str | CallFormat) -> CallFormat:
    if isinstance(spec, CallFormat):
        return spec
    try:
        return CALL_FORMATS[spec]()
    except KeyError:
        raise ValueError(f"unknown call format {spec!r}; known: {', '.join(CALL_FORMATS)}") from None


# ---------------------------------------------------------------- the environment


def sample_field(sample: Any, name: str) -> Any:
    """``sample.name`` or ``sample[name]``: samples are the tasks' dataclasses or plain dicts."""
    if isinstance(sample, Mapping):
        return sample[name]
    return getattr(sample, name)


class ToolEnvironment(Environment):
    """Tools as an environment. Each model turn holding a call gets the tool's result (or the
    call's error) as its observation, reward 0; a turn without a call is the final answer: the
    episode ends, scored by ``reward_fn(prompt, answer_text, sample's answer)``.

    ``tools``: ``Tool`` instances or specs for ``build_tool``; ``call_format``: ``"json"``,
    ``"compact"`` or a ``CallFormat``; ``reward_fn``: a function or a ``module:function`` spec
    (``rlhf_switch.rl.rewards``). ``info`` of each step: ``tool_call`` (the name, or None when the
    text was not a call), ``tool_ok``, and on errors ``tool_error`` (the kind) and
    ``tool_message``; the final step's ``final: True``."""

    def __init__(self, tools: Sequence[Tool | str] = (), call_format: str | CallFormat = "json",
                 reward_fn: Callable[[str, str, str], float] | str = "rlhf_switch.rl.rewards:exact_match"):
        self.tools = {t.name: t for t in map(build_tool, tools)}
        self.format = build_call_format(call_format)
        if isinstance(reward_fn, str):
            from ..rl.rewards import load_reward_fn

            reward_fn = load_reward_fn(reward_fn)
        self.reward_fn = reward_fn
        self.sample: Any = None

    def reset(self, sample: Any) -> str:
        self.sample = sample
        return ""

    def step(self, action: str) -> StepResult:
        parsed = self.format.parse(action, self.tools)
        if parsed is None:
            reward = self.reward_fn(sample_field(self.sample, "prompt"), action, sample_field(self.sample, "answer"))
            return StepResult("", float(reward), True, {"tool_call": None, "final": True})
        if isinstance(parsed, ToolCall):
            result = run_call(parsed, self.tools)
            if isinstance(result, str):
                return StepResult(self.format.result_text(result), 0.0, False, {"tool_call": parsed.name, "tool_ok": True})
            parsed = result
        return StepResult(self.format.error_text(parsed), 0.0, False,
                          {"tool_call": parsed.name, "tool_ok": False, "tool_error": parsed.kind,
                           "tool_message": parsed.message})
