"""The Ray session a run uses: the one this process joined already, the cluster at ``ray_address``,
or an embedded one — with the job's ``runtime_env`` carrying what the run's actors need
(``rlhf_switch.runtime_env``)."""
from __future__ import annotations

from contextlib import contextmanager

from recipes.cluster.placement import resources_for


def start_ray(cfg, world: int, verbose: bool = False):
    """Ray for this run: the session already running in this process (tests share one per
    module), the cluster at ``ray_address``, or an embedded one. Returns (ray, owned).

    Everything the run's actors need from their environment travels in the job's
    ``runtime_env`` (``rlhf_switch.runtime_env.job_runtime_env``): the rollout engine's variables
    (``RolloutEngine.process_env``: vLLM's, its log level INFO only when ``verbose``), the project's
    code — this checkout's path on an embedded Ray, the packages shipped (``py_modules``) to a
    cluster joined at ``ray_address`` —, and the hook that keys the compiled-kernel caches on each
    worker's machine. Nothing is set in the driver's environment. A session already running must
    carry the same (``session_env``).

    The embedded instance has the CPUs the run's bundles need (``resources_for``) and, on a run
    that resolves to ``cpu`` here, as many logical GPUs (Ray then only counts them: nothing
    computes on them); on ``cuda`` Ray counts this machine's real GPUs itself. Starting it, Ray's
    notice that it enabled token authentication (its default for a new local cluster) is not
    printed: ``quiet_default_token_auth_notice``."""
    import ray

    env = run_runtime_env(cfg, verbose)
    if ray.is_initialized():
        session_env(ray, env)
        return ray, False
    if cfg.ray_address:
        ray.init(address=cfg.ray_address, runtime_env=env, log_to_driver=True)
    else:  # never join a stale cluster on the machine
        from rlhf_switch.device import cuda_available, resolve_device

        res = resources_for(cfg)
        logical = resolve_device(cfg.device, cuda_available(), cfg.model.dtype).kind == "cpu"
        with quiet_default_token_auth_notice():
            ray.init(address="local", num_cpus=max(world, int(res.cpus)) + env_pool_cpus(cfg),
                     num_gpus=max(world, res.devices) if logical else None,
                     log_to_driver=True, include_dashboard=False, runtime_env=env)
    return ray, True


def env_pool_cpus(cfg) -> int:
    """The CPUs an agent run's environment workers take (``agent.pool``), beside the bundles': its
    workers and one more, the successor a timed-out worker gets while it finishes its sessions."""
    import math

    pool = cfg.agent.pool if cfg.agent is not None else None
    if pool is None or pool.in_process:
        return 0
    return math.ceil((pool.num_workers + 1) * pool.num_cpus)


def run_runtime_env(cfg, verbose: bool = False) -> dict:
    """The job's ``runtime_env`` of a run of ``cfg`` (``start_ray``)."""
    from rlhf_switch.engines.base import rollout_engine
    from rlhf_switch.runtime_env import job_runtime_env

    return job_runtime_env(rollout_engine(cfg.rollout.engine).process_env(verbose), ship_code=bool(cfg.ray_address))


def session_env(ray, needed: dict) -> None:
    """A Ray session this process joined before the run (``ray.init`` by the caller): its job's
    ``runtime_env`` must carry what the run's actors need (``needed``), or ``RuntimeError`` says
    what is missing and how to start it — before any actor starts."""
    from rlhf_switch.runtime_env import missing_from_job

    missing = missing_from_job(needed, ray.get_runtime_context().runtime_env)
    if missing:
        raise RuntimeError(
            f"the Ray session this process joined does not carry what the run's actors need from their environment "
            f"(missing: {', '.join(missing)}); start it with ray.init(..., runtime_env=rlhf_switch.runtime_env."
            f"job_runtime_env(...)) as recipes.cluster.run_runtime_env(cfg) builds it, or let the run start Ray")


TOKEN_AUTH_NOTICE = "Token authentication is enabled for this Ray cluster"


@contextmanager
def quiet_default_token_auth_notice():
    """Around ``ray.init`` of the embedded instance only: drop Ray's warning "Token authentication
    is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled to opt out…", which Ray 2.60 logs
    whenever it starts a local cluster with ``RAY_AUTH_MODE`` unset
    (``ray._private.authentication.authentication_token_setup._warn_token_auth_enabled``). Token
    authentication itself stays on, as Ray chose; only that one line of that one logger is
    filtered, and only while the embedded instance starts (joining ``ray_address`` is untouched;
    every other warning passes). Setting ``RAY_AUTH_MODE=token`` in the environment instead would
    also silence it, but the driver's cached Ray config would not see it (the driver then fails to
    authenticate to its own GCS)."""
    import logging

    class DropNotice(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return not record.getMessage().startswith(TOKEN_AUTH_NOTICE)

    logger = logging.getLogger("ray._private.authentication.authentication_token_setup")
    drop = DropNotice()
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)

