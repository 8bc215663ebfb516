"""Shared fixtures: tiny model specs, the catalogue of named layouts, one 4-rank world per module."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # rank_jobs, catalogue: importable in spawned ranks

# One token-auth mode for every Ray session of the test process, local or operator-started
# (tests/ray_nodes.py): Ray caches the mode per process at its first session, and a local
# ray.init with RAY_AUTH_MODE unset sets it to "token" — a later session under another mode in
# the same process is refused (InvalidAuthToken) when it starts its own GCS.
os.environ["RAY_AUTH_MODE"] = "disabled"

from catalogue import TINY_LLAMA, named_layouts  # noqa: E402
from rlhf_switch.vps import llama_spec  # noqa: E402


@pytest.fixture(scope="session")
def tiny_spec():
    return llama_spec(TINY_LLAMA, name="tiny-llama")


@pytest.fixture(scope="session")
def tiny_tied_spec():
    return llama_spec({**TINY_LLAMA, "tie_word_embeddings": True}, name="tiny-llama-tied")


@pytest.fixture(scope="session")
def layouts4(tiny_spec):
    return named_layouts(tiny_spec)


@pytest.fixture(scope="module")
def world4():
    from rlhf_switch.launch import LocalWorld

    with LocalWorld(4, timeout=120) as world:
        yield world


@pytest.fixture(scope="module")
def world2():
    from rlhf_switch.launch import LocalWorld

    with LocalWorld(2, timeout=180) as world:
        yield world


def pytest_configure(config):
    # the fast tier's marker, beside pyproject.toml's (slow, vllm, soak); kept here because `make`
    # reinstalls the venv whenever pyproject.toml changes
    config.addinivalue_line("markers", "heavy: not slow, but too long for the fast tier (`make test-fast` "
                                       "leaves it out; `make test` runs it)")


def pytest_addoption(parser):
    parser.addoption("--soak-moves", type=int, default=None,
                     help="moves of the soak test (tests/test_soak.py; default sized for a few minutes)")


HERE = os.path.dirname(os.path.abspath(__file__))


def test_runtime_env(**env_vars: str) -> dict:
    """The ``runtime_env`` of the tests' own Ray sessions: a run's (``rlhf_switch.runtime_env``,
    with vLLM's variables), ``tests/`` on ``PYTHONPATH`` too (engines the tests name
    ``module:Class``), and ``env_vars``."""
    from rlhf_switch.compat import vllm_env
    from rlhf_switch.runtime_env import job_runtime_env

    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != HERE]
    env = job_runtime_env(vllm_env(), environ={**os.environ, "PYTHONPATH": os.pathsep.join([HERE] + paths)})
    env["env_vars"].update(env_vars)
    return env


test_runtime_env.__test__ = False  # a helper, not a test


def start_local_ray(num_cpus: int = 4, **env_vars: str):
    """A local Ray session (4 logical GPUs, ``num_cpus`` logical CPUs) whose job carries
    ``test_runtime_env``."""
    import ray

    ray.init(address="local", num_cpus=num_cpus, num_gpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env=test_runtime_env(**env_vars))
    return ray


@pytest.fixture(scope="module")
def ray_session():
    """One local Ray session per test module (``start_local_ray``)."""
    ray = start_local_ray()
    yield ray
    ray.shutdown()
