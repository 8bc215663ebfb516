"""Shared fixtures: tiny model specs, the catalogue of named layouts, one 4-rank world per module."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # rank_jobs, catalogue: importable in spawned ranks

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


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def prepare_ray_env() -> None:
    """Before a Ray instance starts (its processes inherit the driver's environment): the loop's
    actors find the repository on ``PYTHONPATH``, vLLM's processes its CPU defaults."""
    from rlhf_switch.compat import set_vllm_env_defaults

    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join([REPO] + [p for p in paths if p != REPO])
    set_vllm_env_defaults()


@pytest.fixture(scope="module")
def ray_session():
    """One local Ray session per test module (``prepare_ray_env``; 4 logical CPUs and GPUs)."""
    import ray

    prepare_ray_env()
    ray.init(address="local", num_cpus=4, num_gpus=4, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()
