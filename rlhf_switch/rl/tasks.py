"""Tasks with verifiable rewards, generated from a seed, and the character tokenizer a tiny model
learns them with. Nothing is downloaded: every prompt and answer is made here.

====================  =================  ==========  ============================================
task                  prompt             answer      ``min_len``/``max_len`` bound
====================  =================  ==========  ============================================
``addition``          ``12+345=``        ``357``     digits of each operand
``sorting``           ``sort 3,1,2=``    ``1,2,3``   number of digits in the list
``reversal``          ``rev abc=``       ``cba``     letters in the word
====================  =================  ==========  ============================================

``make_splits(task, num_train, num_heldout, seed)`` draws distinct prompts: the held-out ones
first, so the held-out set depends only on ``(task, seed, num_heldout)`` and never on how much
training data is asked for; train and held-out never share a prompt. Small spaces (at most
``ENUMERATE_BELOW`` prompts) are listed and shuffled, so they can be used up completely.

``length_skew`` makes short samples common and long ones rare: a sampled length ``n`` (of
``min_len..max_len``) has probability proportional to
``exp(-length_skew * (n - min_len) / (max_len - min_len))`` — 0 (the default) is uniform, 3.5
puts the median about a fifth of the way up the range, with a tail to ``max_len``. It changes only
how ``draw`` picks a length, so it applies to sampled spaces; a small space that is listed
(above) holds every length as often as it has prompts of that length, whatever the skew.

The tokenizer is fixed (no training, no file): ids 0–2 are ``<pad>``, ``<bos>``, ``<eos>``, then
digits, lowercase letters and the symbols ``+-*=,<>`` and space — 47 ids, so a Llama with a
64-entry vocabulary (already a multiple of vLLM's padding of 64) holds it.
"""
from __future__ import annotations

import itertools
import math
import random
import string
from dataclasses import dataclass
from typing import Iterator, Sequence

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
SPECIAL_TOKENS = (PAD, BOS, EOS)
CHARACTERS = string.digits + string.ascii_lowercase + "+-*=,<> "


class CharTokenizer:
    """One id per character; ``decode`` stops at ``<eos>`` and drops ``<pad>``/``<bos>``, so a
    generated response decodes to exactly the text a reward function should judge."""

    def __init__(self):
        self.tokens: tuple[str, ...] = SPECIAL_TOKENS + tuple(CHARACTERS)
        self._ids = {t: i for i, t in enumerate(self.tokens)}
        self.pad_id, self.bos_id, self.eos_id = (self._ids[t] for t in SPECIAL_TOKENS)

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        ids = [self.bos_id] if add_bos else []
        for pos, ch in enumerate(text):
            try:
                ids.append(self._ids[ch])
            except KeyError:
                raise ValueError(f"character {ch!r} at position {pos} of {text!r} is not in the "
                                 f"tokenizer's vocabulary ({CHARACTERS!r})") from None
        if add_eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        chars = []
        for pos, i in enumerate(ids):
            i = int(i)
            if i == self.eos_id:
                break
            if i in (self.pad_id, self.bos_id):
                continue
            if not 0 <= i < self.vocab_size:
                # a model whose vocab is larger than the tokenizer's can sample these ids: they mean
                # nothing, and an answer containing one is wrong, so they decode to a visible marker
                chars.append("?")
                continue
            chars.append(self.tokens[i])
        return "".join(chars)


@dataclass(frozen=True)
class Sample:
    prompt: str
    answer: str


@dataclass(frozen=True)
class Splits:
    train: tuple[Sample, ...]
    heldout: tuple[Sample, ...]


@dataclass(frozen=True)
class Task:
    """A task family with its size bound: ``draw`` one random sample, count (``space_size``) or
    list (``all_samples``) every distinct one, and the ``longest`` prompt and answer — what the
    context check needs, without generating anything."""

    name: str
    min_len: int = 1
    max_len: int = 3
    length_skew: float = 0.0

    def __post_init__(self):
        if not 1 <= self.min_len <= self.max_len:
            raise ValueError(f"task {self.name!r}: need 1 <= min_len <= max_len, "
                             f"got min_len={self.min_len}, max_len={self.max_len}")
        if not (math.isfinite(self.length_skew) and self.length_skew >= 0):
            raise ValueError(f"task {self.name!r}: need length_skew >= 0, got {self.length_skew}")

    def draw(self, rng: random.Random) -> Sample:
        raise NotImplementedError

    def space_size(self) -> int:
        raise NotImplementedError

    def all_samples(self) -> Iterator[Sample]:
        raise NotImplementedError

    def longest(self) -> Sample:
        raise NotImplementedError

    def _lengths(self) -> range:
        return range(self.min_len, self.max_len + 1)

    def length_weights(self) -> list[float]:
        """The relative probability of each of ``_lengths()`` in a draw (``length_skew``)."""
        span = max(self.max_len - self.min_len, 1)
        return [math.exp(-self.length_skew * (n - self.min_len) / span) for n in self._lengths()]

    def _length(self, rng: random.Random) -> int:
        """One length for ``draw``: uniform (``rng.choice``, the stream of every unskewed task)
        or, with ``length_skew``, weighted by ``length_weights``."""
        if self.length_skew == 0:
            return rng.choice(self._lengths())
        return rng.choices(self._lengths(), weights=self.length_weights())[0]


def _numbers_with_digits(n: int) -> range:
    """The non-negative integers written with exactly ``n`` digits (0 counts as one digit)."""
    return range(0, 10) if n == 1 else range(10 ** (n - 1), 10 ** n)


@dataclass(frozen=True)
class AdditionTask(Task):
    name: str = "addition"

    def _operand(self, rng: random.Random) -> int:
        # digit count first, then the value: uniform over values would make almost every operand
        # max_len digits long, and the short cases would never be learned
        return rng.choice(_numbers_with_digits(self._length(rng)))

    def _sample(self, a: int, b: int) -> Sample:
        return Sample(f"{a}+{b}=", str(a + b))

    def draw(self, rng: random.Random) -> Sample:
        return self._sample(self._operand(rng), self._operand(rng))

    def _operands(self) -> Iterator[int]:
        return itertools.chain.from_iterable(_numbers_with_digits(n) for n in self._lengths())

    def space_size(self) -> int:
        return sum(len(_numbers_with_digits(n)) for n in self._lengths()) ** 2

    def all_samples(self) -> Iterator[Sample]:
        return (self._sample(a, b) for a in self._operands() for b in self._operands())

    def longest(self) -> Sample:
        big = 10 ** self.max_len - 1
        return self._sample(big, big)


@dataclass(frozen=True)
class SortingTask(Task):
    name: str = "sorting"

    def _sample(self, digits: Sequence[str]) -> Sample:
        return Sample(f"sort {','.join(digits)}=", ",".join(sorted(digits)))

    def draw(self, rng: random.Random) -> Sample:
        n = self._length(rng)
        return self._sample([rng.choice(string.digits) for _ in range(n)])

    def space_size(self) -> int:
        return sum(10 ** n for n in self._lengths())

    def all_samples(self) -> Iterator[Sample]:
        for n in self._lengths():
            yield from (self._sample(d) for d in itertools.product(string.digits, repeat=n))

    def longest(self) -> Sample:
        return self._sample(["9"] * self.max_len)


@dataclass(frozen=True)
class ReversalTask(Task):
    name: str = "reversal"

    def _sample(self, word: str) -> Sample:
        return Sample(f"rev {word}=", word[::-1])

    def draw(self, rng: random.Random) -> Sample:
        n = self._length(rng)
        return self._sample("".join(rng.choice(string.ascii_lowercase) for _ in range(n)))

    def space_size(self) -> int:
        return sum(26 ** n for n in self._lengths())

    def all_samples(self) -> Iterator[Sample]:
        for n in self._lengths():
            yield from (self._sample("".join(w)) for w in itertools.product(string.ascii_lowercase, repeat=n))

    def longest(self) -> Sample:
        return self._sample("z" * self.max_len)


TASKS: dict[str, type[Task]] = {"addition": AdditionTask, "sorting": SortingTask, "reversal": ReversalTask}


# the agent tasks (rlhf_switch.agent), imported on first use: they import this module
AGENT_TASKS: dict[str, str] = {"calc": "rlhf_switch.agent.calc:CalcTask", "guess": "rlhf_switch.agent.guess:GuessTask"}


def build_task(name: str, min_len: int = 1, max_len: int = 3, length_skew: float = 0.0) -> Task:
    if name in AGENT_TASKS:
        import importlib

        module, cls_name = AGENT_TASKS[name].split(":")
        cls = getattr(importlib.import_module(module), cls_name)
    elif name in TASKS:
        cls = TASKS[name]
    else:
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join([*TASKS, *AGENT_TASKS])}")
    return cls(min_len=min_len, max_len=max_len, length_skew=length_skew)


# A space this small is listed and shuffled rather than sampled: rejection sampling would need
# ~space·ln(space) draws to collect most of it, and listing 10^5 short strings takes milliseconds.
ENUMERATE_BELOW = 100_000


def _prompt_stream(task: Task, rng: random.Random) -> Iterator[Sample]:
    """Samples with distinct prompts, in an order fixed by ``rng``'s state; ends when the task's
    space is exhausted (small spaces only — a large one is sampled and never ends)."""
    if task.space_size() <= ENUMERATE_BELOW:  # listed: ``length_skew`` does not apply
        everything = list(task.all_samples())
        rng.shuffle(everything)
        yield from everything
        return
    seen: set[str] = set()
    while True:
        s = task.draw(rng)
        if s.prompt not in seen:
            seen.add(s.prompt)
            yield s


def make_splits(task: Task, num_train: int, num_heldout: int, seed: int) -> Splits:
    """Disjoint train and held-out samples, one stream of distinct prompts cut in two. Held-out is
    cut first, so it is the same for every ``num_train``: asking for more training data never
    changes or steals an evaluation prompt."""
    if num_train < 0 or num_heldout < 0:
        raise ValueError(f"num_train and num_heldout must be >= 0, got {num_train}, {num_heldout}")
    space = task.space_size()
    if num_train + num_heldout > space:
        raise ValueError(f"task {task.name!r} with min_len={task.min_len}, max_len={task.max_len} has only "
                         f"{space} distinct prompts; num_train + num_heldout = {num_train} + {num_heldout} "
                         f"= {num_train + num_heldout} were asked for")
    # a string seed: random.Random hashes it with sha512, stable across processes and Python versions
    stream = _prompt_stream(task, random.Random(f"{task.name}:{task.min_len}:{task.max_len}:{seed}"))
    heldout = tuple(itertools.islice(stream, num_heldout))
    train = tuple(itertools.islice(stream, num_train))
    return Splits(train=train, heldout=heldout)


def longest_prompt_tokens(task: Task, tokenizer: CharTokenizer) -> int:
    """Tokens of the task's longest prompt, ``<bos>`` included."""
    return len(tokenizer.encode(task.longest().prompt, add_bos=True))


def longest_answer_tokens(task: Task, tokenizer: CharTokenizer) -> int:
    """Tokens the model must generate for the task's longest answer, ``<eos>`` included."""
    return len(tokenizer.encode(task.longest().answer, add_eos=True))


def check_prompt_fits(prompt_ids: Sequence[int], max_new_tokens: int, max_context: int,
                      prompt: str | None = None) -> None:
    """Refuse a prompt that leaves no room for the response in the model's context: engines
    otherwise truncate silently or fail deep inside attention with a shape error."""
    need = len(prompt_ids) + max_new_tokens
    if need > max_context:
        shown = f" {prompt!r}" if prompt is not None else ""
        raise ValueError(f"prompt{shown} is {len(prompt_ids)} tokens; with max_new_tokens={max_new_tokens} "
                         f"that is {need} > the model's context of {max_context} tokens "
                         f"(max_position_embeddings)")


def encode_prompt(tokenizer: CharTokenizer, prompt: str, max_new_tokens: int, max_context: int) -> list[int]:
    """``<bos>`` + the prompt's ids, checked against the model's context."""
    ids = tokenizer.encode(prompt, add_bos=True)
    check_prompt_fits(ids, max_new_tokens, max_context, prompt)
    return ids
