"""A stand-in for the cluster's rollout replicas (``recipes.cluster.replicas.ReplicasMixin``), for
the fast tests of the loop's rollout sources and partial rollout (``tests/test_sources.py``,
``tests/test_partial.py``).

It keeps the real interface: ``submit_generation(prompts, seeds, max_new_tokens, temperature,
stop_ids=(), pull=True)`` shares the prompts out in contiguous shares over the replicas (as
``_share_out``) and returns at once a ``Generation`` whose ``refs`` are one per share;
``collect_generation(gen)`` returns ``(responses, logprobs, versions)`` in prompt order, each sample's
version the one its replica held (None for a replica that received no sync, as the real actor's
``getattr(self, "version", None)``); ``sync(version)`` is every replica's receive; ``ray.wait``
answers which refs are ready.

Its engine is deterministic and easy to compute by hand: a response counts on in digits from the
last digit of the sequence it continues (prompt "3+6=" -> "7", "8", "9"), then ends with the eos
id, within the budget. So a continuation of a prompt and part of its response (partial rollout)
goes on exactly where the whole generation would. A token's log-prob says which weights made it:
``-(version + 1)`` (``-0.5`` for a replica with no version). A generation runs with the version
its replica holds when it is submitted (the real actor runs a call before any receive posted
after it). ``ray.wait`` is a clock: each call is one tick, and a ref is ready ``ticks`` ticks after
it was made (a test decides how many rounds of partial rollout fit in an update)."""
from __future__ import annotations

from dataclasses import dataclass, field

EOS = 2            # rlhf_switch.rl.tasks.CharTokenizer's eos id
DIGIT_0 = 3        # the id of "0"; "9" is 12


def tok(text: str) -> list[int]:
    """Ids of a text of digits and ``+=`` (the CharTokenizer's), no bos."""
    from rlhf_switch.rl.tasks import CharTokenizer

    return CharTokenizer().encode(text)


def engine(seq: list[int], max_new_tokens: int, stops: tuple) -> list[int]:
    """The next ``max_new_tokens`` tokens after ``seq`` (module docstring), ending at a stop id."""
    digits = [t for t in seq if DIGIT_0 <= t <= DIGIT_0 + 9]
    last, out = digits[-1] if digits else DIGIT_0 - 1, []
    while len(out) < max_new_tokens:
        last = last + 1 if last < DIGIT_0 + 9 else EOS
        out.append(last)
        if last in stops:
            break
    return out


class Ref:
    def __init__(self, ray, ticks: int):
        self.ready_at = ray.now + ticks


class FakeRay:
    """``ray.wait`` over ``Ref``s: each call one tick of a clock (module docstring)."""

    def __init__(self):
        self.now = 0

    def wait(self, refs: list, num_returns: int = 1, timeout=None):
        if not 0 < num_returns <= len(refs):  # Ray's own refusal
            raise ValueError(f"num_returns {num_returns} of {len(refs)} refs")
        # a timeout: one tick; none: it blocks until num_returns are ready
        self.now = self.now + 1 if timeout is not None else max(self.now, sorted(r.ready_at for r in refs)[num_returns - 1])
        ready = [r for r in refs if r.ready_at <= self.now][:num_returns]
        return ready, [r for r in refs if not any(r is x for x in ready)]


@dataclass
class Generation:
    shares: list           # per share: (replica, first prompt index, results)
    refs: list
    collected: bool = False


@dataclass
class Replicas:
    """Rollout replicas (module docstring); ``calls``: every ``submit_generation``'s arguments."""

    n_replicas: int = 2
    ticks: int = 1                       # how long a generation takes, in ``ray.wait`` calls
    versions: list = field(default_factory=list)
    calls: list = field(default_factory=list)

    def __post_init__(self):
        self.ray = FakeRay()
        self.versions = self.versions or [None] * self.n_replicas

    def sync(self, version: int, skip: tuple = ()) -> None:
        """Every replica receives the weights of ``version`` (but those in ``skip``: a sync that
        did not reach them)."""
        for r in range(self.n_replicas):
            if r not in skip:
                self.versions[r] = version

    def submit_generation(self, prompts, seeds, max_new_tokens, temperature, stop_ids=(), pull=True):
        if max_new_tokens < 1:  # vLLM's SamplingParams refuses max_tokens < 1
            raise ValueError(f"max_tokens must be at least 1, got {max_new_tokens}")
        self.calls.append({"prompts": [list(p) for p in prompts], "seeds": list(seeds), "max_new_tokens": max_new_tokens,
                           "temperature": temperature, "stop_ids": tuple(stop_ids), "pull": pull})
        stops = tuple(sorted({EOS, *stop_ids}))
        n, R = len(prompts), self.n_replicas
        cuts = [i * (n // R) + min(i, n % R) for i in range(R + 1)]
        shares = []
        for r, a, b in zip(range(R), cuts, cuts[1:]):
            if b > a:
                v = self.versions[r]
                tokens = [engine(list(p), max_new_tokens, stops) for p in prompts[a:b]]
                lp = -0.5 if v is None else -(v + 1.0)
                shares.append((tokens, [[lp] * len(t) for t in tokens], [v] * len(tokens)))
        return Generation(shares, [Ref(self.ray, self.ticks) for _ in shares])

    def collect_generation(self, gen: Generation):
        assert not gen.collected, "a generation collected twice"
        gen.collected = True
        return tuple([x for share in gen.shares for x in share[k]] for k in range(3))
