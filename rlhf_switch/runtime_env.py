"""What a run's Ray workers need from their environment, and how it reaches them: in the job's Ray
``runtime_env`` (``job_runtime_env``), never by inheritance from the driver.

A Ray worker inherits its raylet's environment. Only an embedded Ray (``ray.init(address="local")``)
or ``ray.cluster_utils.Cluster`` makes raylets that are children of the driver; the nodes an
operator starts with ``ray start`` have the environment of that shell. So everything an actor
needs travels with the job, built by the one function here and given to ``ray.init`` by the
recipes (``recipes.cluster.start_ray``):

- ``env_vars``: the defaults the run's engines need (``RolloutEngine.process_env``: vLLM's
  ``compat.VLLM_ENV``), each replaced by the driver's own value where the user set one; the
  variables in ``FORWARDED`` and every ``RLHF_SWITCH_*`` variable the driver has; ``PYTHONPATH``.
- the project's code: embedded, ``PYTHONPATH`` = this checkout + the driver's ``PYTHONPATH``.
  Joining a cluster (``ship_code``), the packages ``PACKAGES`` travel as Ray ``py_modules`` (Ray
  zips them at ``ray.init``, every node unpacks them and puts them first on the workers'
  ``PYTHONPATH``, which vLLM's worker processes inherit); the nodes need the same Python packages
  installed, not the checkout. The driver's own ``PYTHONPATH`` still travels: modules of the user's
  named there (a ``module:Class`` engine) must be at the same path on the nodes, or installed.
- ``worker_process_setup_hook``: ``on_worker_start``, run in every worker process as it starts, on
  its own node: points torch inductor's and vLLM's compiled-kernel caches at directories keyed by
  what compiled code depends on there (``kernel_cache_key``) — another node may have another CPU.

Imports neither torch nor Ray: the hook runs in every worker process before anything else.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import tempfile
from pathlib import Path
from typing import Iterable, Mapping, MutableMapping

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("rlhf_switch", "recipes", "actors")  # what the actors import of the project
SETUP_HOOK = "rlhf_switch.runtime_env.on_worker_start"

# the driver's value of these travels with the job when set: the ISA emulation (docs/devices.md)
# applies to the whole run, vLLM's CPU thread binding is the user's choice (compat.vllm_cpu_omp_threads_bind)
FORWARDED = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "VLLM_CPU_OMP_THREADS_BIND")
OWN_PREFIX = "RLHF_SWITCH_"  # the project's own knobs (e.g. routing.same_host's): all travel
# the caches keyed per machine: set in each worker (on_worker_start), never forwarded
KERNEL_CACHES = ("TORCHINDUCTOR_CACHE_DIR", "VLLM_CACHE_ROOT")


def actor_env_vars(defaults: Mapping[str, str], environ: Mapping[str, str], ship_code: bool = False) -> dict[str, str]:
    """The ``env_vars`` of a run's job (pure): ``defaults`` with the driver's (``environ``) value
    where it has one, the forwarded variables it has, and ``PYTHONPATH`` — this checkout first
    unless the code is shipped (``ship_code``), then the driver's entries."""
    env = {k: environ.get(k, v) for k, v in defaults.items()}
    env.update({k: v for k, v in environ.items() if k in FORWARDED or k.startswith(OWN_PREFIX)})
    for k in KERNEL_CACHES:  # a driver value is of the driver's machine
        env.pop(k, None)
    paths = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if not ship_code:
        paths = [str(REPO)] + [p for p in paths if p != str(REPO)]
    if paths:
        env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def job_runtime_env(defaults: Mapping[str, str] = {}, ship_code: bool = False,
                    environ: Mapping[str, str] = os.environ) -> dict:
    """The ``runtime_env`` for ``ray.init`` of a run's job (module docstring). ``defaults``: the
    environment the run's engines need (``RolloutEngine.process_env``); ``ship_code``: the project's
    packages as ``py_modules`` (a cluster the driver joins) instead of this checkout's path."""
    env: dict = {"env_vars": actor_env_vars(defaults, environ, ship_code), "worker_process_setup_hook": SETUP_HOOK}
    if ship_code:
        env["py_modules"] = [str(REPO / p) for p in PACKAGES]
    return env


def missing_from_job(needed: Mapping, have: Mapping | None) -> list[str]:
    """What of the runtime_env ``needed`` a job started with ``have`` lacks (pure): env_vars by
    name, the setup hook, the code (``PYTHONPATH`` or ``py_modules``). Values may differ: a user's own."""
    have = dict(have or {})
    have_vars = have.get("env_vars") or {}
    missing = [k for k in needed.get("env_vars", {}) if k != "PYTHONPATH" and k not in have_vars]
    if have.get("worker_process_setup_hook") is None:
        missing.append("worker_process_setup_hook")
    if "PYTHONPATH" not in have_vars and not have.get("py_modules"):
        missing.append("PYTHONPATH or py_modules")
    return missing


# --- compiled-kernel caches that follow the machine ---------------------------------------------------

# what selects the instruction set compiled code is built for, besides the CPU: ATen's dispatch (and
# torch inductor's code generation: torch._inductor.cpu_vec_isa), oneDNN's and MKL's kernels
ISA_ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


def isa_name(cpu_flags: Iterable[str], environ: Mapping[str, str]) -> str:
    """The instruction set compiled CPU code targets (pure): ATen's ``ATEN_CPU_CAPABILITY`` where
    set, else the best of the CPU's flags in ATen's names (``avx512``, ``avx2``, ``sve``, ``neon``,
    ``default``)."""
    if environ.get("ATEN_CPU_CAPABILITY"):
        return environ["ATEN_CPU_CAPABILITY"].strip().lower()
    flags = set(cpu_flags)
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        return "avx512"
    if "avx2" in flags:
        return "avx2"
    if "sve" in flags:
        return "sve"
    return "neon" if "asimd" in flags else "default"


def kernel_cache_key(cpu_flags: Iterable[str], environ: Mapping[str, str], versions: Mapping[str, str]) -> str:
    """The key of a compiled-kernel cache (pure): ``<isa>-<digest>`` of what compiled code depends
    on — the CPU's flags, the ISA overrides in ``environ`` (``ISA_ENV``) and the ``versions`` of
    what compiles (torch, vLLM, Python). Equal inputs, equal key; any of them changed, another key."""
    flags = sorted(set(cpu_flags))
    overrides = {k: environ[k].strip().lower() for k in ISA_ENV if environ.get(k)}
    what = json.dumps({"flags": flags, "overrides": overrides, "versions": dict(versions)}, sort_keys=True)
    return f"{isa_name(flags, environ)}-{hashlib.sha256(what.encode()).hexdigest()[:12]}"


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> list[str]:
    """This machine's CPU flags (x86 ``flags``, Arm ``Features``); else its processor's name."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                name, _, value = line.partition(":")
                if name.strip() in ("flags", "Features"):
                    return value.split()
    except OSError:
        pass
    return [platform.machine(), platform.processor()]


def compiler_versions() -> dict[str, str]:
    """The versions of what compiles kernels here (torch, vLLM — ``vllm-cpu`` or ``vllm`` —, Python)."""
    from importlib.metadata import PackageNotFoundError, version

    found = {"python": "%d.%d" % sys.version_info[:2]}
    for name in ("torch", "vllm", "vllm-cpu"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            pass
    return found


def kernel_cache_dirs(key: str, root: str | None = None) -> dict[str, str]:
    """The cache directories of machine key ``key`` under ``root`` (default: the temp dir, per user)."""
    base = Path(root or tempfile.gettempdir()) / f"rlhf-switch-cache-{os.getuid()}" / key
    return {"TORCHINDUCTOR_CACHE_DIR": str(base / "inductor"), "VLLM_CACHE_ROOT": str(base / "vllm")}


def torch_default_inductor_cache() -> str:
    """torch inductor's own default cache directory (torch 2.13's
    ``torch._inductor.runtime.cache_dir_utils.default_cache_dir``, without importing torch)."""
    import getpass
    import re

    try:
        user = getpass.getuser()
    except (KeyError, ModuleNotFoundError, OSError):
        user = f"uid_{os.getuid()}"
    return os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))


def use_kernel_caches_of_this_machine(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Point torch inductor's and vLLM's caches (``KERNEL_CACHES``) of this process — and of the
    processes it starts — at this machine's keyed directories, where not set already (a user's
    own stays; torch's default, which torch writes into the environment of any process that
    looked its cache up — an embedded Ray's workers inherit the driver's —, is not one). Returns
    the directories in effect.

    Why: torch inductor's default cache (``/tmp/torchinductor_<user>``) is shared by every run of
    the user and its entries are not keyed by the ISA in effect: on an AVX-512 machine, a run that
    emulates AVX2 (``ATEN_CPU_CAPABILITY=avx2 ...``) after an ordinary one crashed at vLLM's first
    generate ("index out of range in self"), served kernels compiled for the other ISA (seen with
    torch 2.13, vllm-cpu 0.32). Nodes of a cluster that share a cache directory but differ in CPU
    would meet the same. Call it in the process that compiles, before anything compiles: the key is
    this machine's."""
    dirs = kernel_cache_dirs(kernel_cache_key(cpu_flags(), environ, compiler_versions()))
    if environ.get("TORCHINDUCTOR_CACHE_DIR") and \
            os.path.abspath(environ["TORCHINDUCTOR_CACHE_DIR"]) == torch_default_inductor_cache():
        del environ["TORCHINDUCTOR_CACHE_DIR"]
    for k, v in dirs.items():
        environ.setdefault(k, v)
    return {k: environ[k] for k in dirs}


def on_worker_start() -> None:
    """Ray's ``worker_process_setup_hook`` of a run's job: runs in each worker process as it starts
    (on the worker's node, before any task or actor of the job)."""
    use_kernel_caches_of_this_machine()
