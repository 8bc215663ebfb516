"""The environment pool on Ray (rlhf_switch.agent.pool.RayEnvPool): bad environments in one batch
with a good sample — one that raises, one that hangs past its timeout, one that returns a
non-string, one whose observation overflows the token budget, a malformed tool call — each ends
its own sample with its reason while the good one finishes; a killed worker is replaced and later
samples run (a reset that meets a dead worker is retried on its successor); a session's calls stay
on one worker. One Ray session for the module (tests/agent_envs.py is imported by the workers);
about a minute on 2 cores."""
from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from rlhf_switch.agent import calc, guess
from rlhf_switch.agent.episode import EpisodeRequest, run_episodes
from rlhf_switch.agent.limits import Limits
from rlhf_switch.agent.pool import RayEnvPool
from rlhf_switch.rl.tasks import CharTokenizer, Sample

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
TOK = CharTokenizer()
TIMEOUT_S = 10.0  # generous: a loaded 2-core box must not time out a healthy call


@pytest.fixture(scope="module")
def ray_session():
    import ray

    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in (str(REPO), str(HERE))]
    os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO), str(HERE)] + paths)
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def pool(ray_session):
    p = RayEnvPool(num_workers=2, num_cpus=0.25, timeout_s=TIMEOUT_S, start_timeout_s=180)
    yield p
    p.shutdown()


def ids(text: str) -> list[int]:
    return TOK.encode(text)


def planned(plans: dict[str, list[list[int]]]):
    """A ``generate`` that plays each prompt's planned turns in order (the prompt tells the
    requests apart)."""
    played: dict[str, int] = {}

    async def generate(token_ids, max_new_tokens, stop_ids):
        prompt = next(p for p in plans if TOK.decode(token_ids).startswith(p))
        k = played.get(prompt, 0)
        played[prompt] = k + 1
        return plans[prompt][k][:max_new_tokens]
    return generate


def req(session: str, env: str, prompt: str, answer: str, stops: str = ",", **kwargs) -> EpisodeRequest:
    return EpisodeRequest(session, env, Sample(prompt, answer), tuple(TOK.encode(prompt, add_bos=True)), kwargs,
                          frozenset(ids(stops)) | {TOK.eos_id})


def test_bad_environments_end_their_own_sample_and_the_good_one_finishes(pool):
    requests = [req("good", "guess", "a=", "32"),
                req("raises", "agent_envs:Raises", "b=", "1"),
                req("hangs", "agent_envs:Sleeps", "c=", "600"),
                req("nonstring", "agent_envs:NonString", "d=", "1"),
                req("overflow", "agent_envs:Chatty", "e=", "60"),
                req("malformed", "calc", "<calc>1+2=", "3", stops=">")]
    plans = {"a=": [ids("32,")], "b=": [ids("1,")], "c=": [ids("1,")], "d=": [ids("1,")], "e=": [ids("1,")],
             "<calc>1+2=": [ids("<calc 1+2") + [TOK.eos_id], ids("<calc 1+>"), ids("3") + [TOK.eos_id]]}
    eps = asyncio.run(run_episodes(planned(plans), pool, requests, TOK, Limits(4, 50, 64)))
    by = {e.session: e for e in eps}
    assert (by["good"].finish_reason, by["good"].reward) == ("stop", 1.0)
    assert by["raises"].finish_reason == "env_error" and "RuntimeError: the environment broke" in by["raises"].error
    assert by["hangs"].finish_reason == "timeout" and f"ran past {TIMEOUT_S} s" in by["hangs"].error
    assert by["nonstring"].finish_reason == "env_error" and "of type list" in by["nonstring"].error
    assert (by["overflow"].finish_reason, by["overflow"].dropped_tokens) == ("length", 60)
    m = by["malformed"]  # two bad calls answered as errors, then the final answer
    assert m.observations == ["=err syntax ", "=err failed "] and (m.finish_reason, m.reward) == ("stop", 1.0), m
    assert pool.replaced["timeout"] == 1 and len(pool.workers) == 2
    # the hung worker, retired, is killed once it holds no session
    assert pool._retired == []
    # and the pool still serves
    again = asyncio.run(run_episodes(planned({"a=": [ids("32,")]}), pool, [req("good2", "guess", "a=", "32")], TOK,
                                     Limits(4, 50, 64)))
    assert again[0].finish_reason == "stop"


def test_a_session_stays_on_one_worker_and_sessions_spread(pool):
    requests = [req(f"p{i}", "agent_envs:Pid", f"{'fgh'[i]}=", "3") for i in range(3)]
    plans = {f"{'fgh'[i]}=": [ids("1,")] * 3 for i in range(3)}
    eps = asyncio.run(run_episodes(planned(plans), pool, requests, TOK, Limits(4, 50, 64)))
    pids = []
    for e in eps:
        assert e.finish_reason == "stop" and len(e.observations) == 2
        seen = {o.strip() for o in e.observations}
        assert len(seen) == 1, e.observations  # every call of the session in the same process
        pids.append(seen.pop())
    assert len(set(pids)) == 2  # three sessions on two workers: both used


def test_a_killed_worker_is_replaced_and_later_samples_run(pool):
    async def go():
        a, b = guess.request(Sample("guess=", "40"), "A", TOK), guess.request(Sample("guess=", "40"), "B", TOK)
        assert not (await pool.reset("A", a.env, a.sample, a.env_kwargs)).failed
        assert not (await pool.reset("B", b.env, b.sample, b.env_kwargs)).failed
        wa, wb = pool.worker_of("A"), pool.worker_of("B")
        assert wa is not wb
        os.kill(wa.pid, signal.SIGKILL)
        lost = await pool.step("A", "32,")
        assert lost.finish_reason == "env_error" and "died" in lost.error
        assert (await pool.step("B", "32,")).observation == ">"  # the other worker's session goes on
        await pool.close("A")
        await pool.close("B")
        assert pool.replaced["died"] == 1 and wa not in pool.workers and len(pool.workers) == 2
        # a worker dead before a reset reaches it: the reset goes to its successor
        doomed = pool._pick()
        await pool.pids()
        os.kill(doomed.pid, signal.SIGKILL)
        c = guess.request(Sample("guess=", "32"), "C", TOK)
        reply = await pool.reset("C", c.env, c.sample, c.env_kwargs)
        assert not reply.failed and pool.worker_of("C") is not doomed and pool.replaced["died"] == 2
        await pool.close("C")
        # later samples run
        reqs = [calc.request(Sample(f"{n}+1=", str(n + 1)), f"later{n}", TOK) for n in range(4)]

        async def gen(token_ids, max_new, stops):
            text = TOK.decode(token_ids)
            return ids(calc.expert_policy(text)) + ([] if text.endswith("=") else [TOK.eos_id])
        eps = await run_episodes(gen, pool, reqs, TOK, calc.limits(64))
        assert [(e.finish_reason, e.reward) for e in eps] == [("stop", 1.0)] * 4
        new = await pool.pids()
        assert wa.pid not in new and doomed.pid not in new and None not in new
    asyncio.run(go())


def test_caller_mistakes_raise(pool):
    async def go():
        r = guess.request(Sample("guess=", "5"), "M", TOK)
        await pool.reset("M", r.env, r.sample)
        with pytest.raises(ValueError, match="already open"):
            await pool.reset("M", r.env, r.sample)
        await pool.close("M")
        with pytest.raises(ValueError, match="not open"):
            await pool.step("M", "1,")
    asyncio.run(go())
