"""The actors of one run on Ray (``Cluster``, the facade) and what the run machinery asks of it:
``placement`` (bundles, slots, rank -> bundle), ``session`` (the Ray session and the job's
runtime_env), ``calls`` (many actor calls at once, the run's failures), ``replicas`` (the rollout
replicas' lifecycle and generation), ``channel`` (the weight channel's lifecycle)."""
from recipes.cluster.calls import RolloutEngineFailed, SyncFailed, engine_error, phase, stop_actors, wait_all
from recipes.cluster.cluster import Cluster
from recipes.cluster.placement import (LENT_SLOT, TRANSITION_SLOT, PlacementError, Resources, Slot, lent_replicas,
                                       rank_bundles, resources, resources_for)
from recipes.cluster.replicas import Generation, IncomingReplicas
from recipes.cluster.session import quiet_default_token_auth_notice, run_runtime_env, session_env, start_ray

__all__ = ["Cluster", "Generation", "IncomingReplicas", "LENT_SLOT", "PlacementError", "Resources", "RolloutEngineFailed",
           "Slot", "SyncFailed", "TRANSITION_SLOT", "engine_error", "lent_replicas", "phase", "quiet_default_token_auth_notice",
           "rank_bundles", "resources", "resources_for", "run_runtime_env", "session_env", "start_ray", "stop_actors",
           "wait_all"]
