"""Every check a run must pass before anything starts, in one registry.

A check is a function ``(config, facts) -> [problem, ...]`` registered under a name with
``@check(name)``; ``run_problems(config)`` runs them all, in registration order, and
``check_run(config)`` raises one ``ConfigError`` listing every problem they found — before Ray,
any process or any engine starts. ``facts`` (``Facts``) holds what several checks need and is
worked out once: the model's dimensions and whether the actors will see a GPU.

=============  ==================================================================================
``model``      the model's config reads; its family is one the VPS describes; ``model.path``'s
               weights are the model ``config.json`` describes
``layouts``    every phase's layout covers the world and splits the model (heads, KV heads, MLP
               width, layers), in every world of an ``elastic.schedule`` too
``batch``      the batch sizes divide over the replicas and DP ranks, in every world
``algorithm``  the algorithm and its pieces resolve (a user's ``module:Class`` imports), its fields
               fit its estimator and its paper, the run has the critic and reference it needs
``off_policy`` a batch in flight (one-step off-policy) has replicas of their own devices
``rebalance``  ``elastic.rebalance``: replicas of their own devices, a synchronous loop, and a grown
               world (layouts scaled along DP) that passes every check
``lend``       ``elastic.lend``: replicas of their own devices and a synchronous loop (the trainer's
               devices are idle while it waits for samples)
``sampling``   the rollout engines sample as the algorithm block asks
``prompts``    ``task:`` — its prompts and answers fit the model and tokenizer; ``data:`` — the
               tokenizer loads and fits, every file reads with its keys, some prompts fit
``engines``    each phase's engine (a registered name or ``module:Class``) runs that phase's
               layout; offload, handoff and placement options the engines support
``device``     the device and compute dtype resolve where the actors run (``rlhf_switch.device``)
``lora``       ``model.lora``: the train engine trains adapters, the model has every target module,
               the rollout engine takes what ``sync`` moves
``reward``     the reward function loads and runs on a held-out sample, where and within the time
               the run gives it (``reward_workers``, ``reward_timeout_s``)
``logging``    every logging backend named (wandb, mlflow: optional extras) is installed
``reward_model``  ``reward.model_path`` is a reward model directory (a value head on a family's
               trunk) whose vocabulary is the policy's; its engine runs its layout
=============  ==================================================================================

``check_reward_training`` is the same for ``rlhf-switch rm``'s own config (``recipes/rm.py``):
the model and its trunk, the layout and engine, the batch, the tokenizer, every preference file
with its three keys.

The rules themselves live where their subject does: an engine's in its ``layout_problems``, a
family's in ``families.family_problems``, a config field's form in its pydantic type; this module
asks them all and is the one place that says what a run is checked for.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .agent.env import EnvError
from .device import DeviceUnavailable, resolve_device
from .engines.base import EngineError, phase_engine_problems, rollout_engine, training_engine, training_engine_names
from .families import DEFAULT_CONTEXT, derive_spec, family_problems
from .rl.config import (ConfigError, ElasticEntry, ModelConfig, ModelDims, PhaseLayout, RolloutLayout, RunConfig,
                        load_config, model_dims, scaled_along_dp, task_prompt_tokens)
from .rl.algorithm_rules import algorithm_problems
from .rl.data import DataError, load_data_splits, prompt_token_limit, read_columns, read_records
from .rl.tasks import CharTokenizer, build_task, longest_answer_tokens
from .rl.tokenizer import TokenizerError, load_tokenizer

LOCAL = "local"  # cuda_available: ask this machine (an embedded Ray's actors see what it sees)


@dataclass
class Facts:
    """What several checks need, worked out once per run of the checks: the model's dimensions
    (None when its config cannot be read: the ``model`` check says why), whether the actors will
    see a GPU (None: not known before Ray — a cluster joined at ``ray_address``), and the problems
    found so far (a check that needs a sound config, e.g. one that runs the reward, skips itself
    when there are some)."""

    dims: ModelDims | None
    cuda_available: bool | None
    found: list[str] = field(default_factory=list)


Check = Callable[[RunConfig, Facts], "list[str]"]
CHECKS: dict[str, Check] = {}


def check(name: str) -> Callable[[Check], Check]:
    """Register a check under ``name`` (run in registration order)."""
    def register(fn: Check) -> Check:
        if name in CHECKS:
            raise ValueError(f"a check named {name!r} is registered already")
        CHECKS[name] = fn
        return fn
    return register


def run_problems(cfg: RunConfig, *, cuda_available: bool | None | str = LOCAL, skip: tuple[str, ...] = (),
                 recipe: str | None = None) -> list[str]:
    """Every problem the registered checks find in ``cfg`` (empty: it can run). ``skip``: names of
    checks not to run (an elastic request re-checks a config whose reward already ran);
    ``recipe``: the algorithm a recipe runs (``python -m recipes.grpo``: its config must name it)."""
    unknown = sorted(set(skip) - set(CHECKS))
    if unknown:
        raise ValueError(f"no such checks: {', '.join(unknown)}; known: {', '.join(CHECKS)}")
    if cuda_available == LOCAL:
        from .device import cuda_available as local_cuda

        cuda_available = None if cfg.ray_address else local_cuda()
    try:
        dims = model_dims(cfg.model)
        found: list[str] = []
    except ConfigError as e:
        dims, found = None, list(e.problems)
    if recipe is not None and cfg.algorithm.name != recipe:
        found.append(f"algorithm.name: this recipe runs {recipe}, the config names {cfg.algorithm.name!r} (use "
                     f"recipes.{cfg.algorithm.name} or rlhf-switch train)")
    facts = Facts(dims, cuda_available, found)
    for name, fn in CHECKS.items():
        if name not in skip:
            facts.found += fn(cfg, facts)
    return facts.found


def check_run(cfg: RunConfig, **kwargs) -> None:
    """Raise one ``ConfigError`` listing every problem ``run_problems`` finds; call it before any
    process, actor or engine starts."""
    problems = run_problems(cfg, **kwargs)
    if problems:
        raise ConfigError(f"the config cannot run on world_size={cfg.world_size}: "
                          f"{len(problems)} problem{'s' * (len(problems) != 1)}", problems)


# --- the rules, one function each -----------------------------------------------------------------

def safetensors_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from a ``.safetensors`` file's JSON header (the weights are not read)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    return {k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"}


def family_problems_of(model: ModelConfig) -> list[str]:
    """The model family's refusals (``families.family_problems``: an unknown ``model_type``, …)."""
    return [f"model: {p}" for p in family_problems(model.hf_dict())]


def weights_problems(model: ModelConfig) -> list[str]:
    """``model.path``: the weights beside ``config.json`` must be the model it describes (names
    and shapes from the safetensors header, against the VPS spec of the config)."""
    if model.path is None:
        return []
    root = Path(model.path)
    weights = root / "model.safetensors"
    if not weights.is_file():
        return []  # no weights: the run starts from the config's seeded initial model
    hf_config = json.loads((root / "config.json").read_text())
    if family_problems(hf_config):
        return []  # family_problems_of reports the family's own problems; there is no spec to compare with
    spec = derive_spec(hf_config, name=str(root))
    try:
        held = safetensors_shapes(weights)
    except (OSError, ValueError, KeyError) as e:
        return [f"model.path: {weights} is not a readable safetensors file ({e})"]
    problems = []
    for t in spec.tensors:
        if t.name not in held:
            problems.append(f"model.path: {weights} lacks {t.name} {list(t.shape)} that config.json implies")
        elif held[t.name] != t.shape:
            problems.append(f"model.path: {weights} has {t.name} of shape {list(held[t.name])}, "
                            f"config.json implies {list(t.shape)}")
    extra = sorted(n for n in held if n not in spec and not n.endswith("rotary_emb.inv_freq"))
    if extra:
        problems.append(f"model.path: {weights} holds tensors config.json does not describe: "
                        f"{', '.join(extra[:5])}" + (f" (and {len(extra) - 5} more)" if len(extra) > 5 else ""))
    return problems


def layout_problems(phase: str, layout: PhaseLayout, world_size: int) -> list[str]:
    """Every phase is colocated on the whole world. (What each engine runs — ZeRO stages, TP, PP —
    its own ``layout_problems`` says: ``engine_problems``.)"""
    if layout.size != world_size:
        return [f"{phase}: tp·pp·dp = {layout.tp}·{layout.pp}·{layout.dp} = {layout.size}, but "
                f"world_size = {world_size} (every phase is colocated on all devices)"]
    return []


def model_split_problems(phase: str, layout: PhaseLayout, dims: ModelDims) -> list[str]:
    """TP must split heads and the MLP evenly; PP needs a layer per stage."""
    tp, problems = layout.tp, []
    if dims.num_heads % tp:
        problems.append(f"{phase}: tp={tp} does not divide num_attention_heads={dims.num_heads}")
    kv = dims.num_kv_heads
    if isinstance(layout, RolloutLayout) and tp > kv:
        # vLLM (and the torch rollout, in vLLM's layout) replicate KV heads when TP exceeds them
        if tp % kv:
            problems.append(f"{phase}: tp={tp} is above num_key_value_heads={kv} and must then be a "
                            f"multiple of it")
    elif kv % tp:
        problems.append(f"{phase}: tp={tp} does not divide num_key_value_heads={kv}")
    if dims.intermediate_size % tp:
        problems.append(f"{phase}: tp={tp} does not divide intermediate_size={dims.intermediate_size}")
    if dims.moe_intermediate_size and dims.moe_intermediate_size % tp:
        problems.append(f"{phase}: tp={tp} does not divide moe_intermediate_size={dims.moe_intermediate_size}")
    if layout.pp > dims.num_layers:
        problems.append(f"{phase}: pp={layout.pp} is more stages than num_hidden_layers={dims.num_layers}")
    return problems


def batch_problems(cfg: RunConfig) -> list[str]:
    algo = cfg.algorithm
    rollout_batch, train_batch = algo.rollout_batch_size, algo.train_batch_size
    problems = []
    if algo.prompts_per_iteration % cfg.rollout.dp:
        problems.append(f"rollout: dp={cfg.rollout.dp} does not divide algorithm.prompts_per_iteration="
                        f"{algo.prompts_per_iteration} (each replica takes whole groups of prompts)")
    if rollout_batch % train_batch:
        problems.append(f"algorithm.mini_batch_size={train_batch} does not divide the rollout batch "
                        f"prompts_per_iteration·group_size = {rollout_batch}")
    if train_batch % cfg.train.dp:
        problems.append(f"train: dp={cfg.train.dp} does not divide algorithm.mini_batch_size={train_batch}")
    elif (train_batch // cfg.train.dp) % algo.micro_batch_size:
        problems.append(f"algorithm.micro_batch_size={algo.micro_batch_size} does not divide the per-rank "
                        f"mini batch {train_batch}/{cfg.train.dp} = {train_batch // cfg.train.dp}")
    if cfg.reference is not None and rollout_batch % cfg.reference.dp:
        problems.append(f"reference: dp={cfg.reference.dp} does not divide the rollout batch {rollout_batch}")
    # the critic takes the actor's share of each batch: train.dp dividing the mini batch covers it too
    if cfg.critic is not None and cfg.critic.dp != cfg.train.dp:
        problems.append(f"critic: dp={cfg.critic.dp} must equal train.dp={cfg.train.dp} (the critic and the "
                        f"actor take the same share of each batch)")
    # an agent run's evaluation plays episodes, whose turns go to the replicas in batches of any size
    if cfg.agent is None and cfg.eval.num_prompts % cfg.rollout.dp:
        problems.append(f"eval.num_prompts={cfg.eval.num_prompts} is not divisible by rollout.dp={cfg.rollout.dp}")
    if cfg.task is not None and cfg.eval.split == "all":
        if cfg.eval.num_prompts > cfg.task.num_heldout + cfg.task.num_train:
            problems.append(f"eval.num_prompts={cfg.eval.num_prompts} is more than task.num_heldout + num_train = "
                            f"{cfg.task.num_heldout + cfg.task.num_train} (eval.split: all)")
    elif cfg.task is not None and cfg.eval.num_prompts > cfg.task.num_heldout:
        problems.append(f"eval.num_prompts={cfg.eval.num_prompts} is more than task.num_heldout={cfg.task.num_heldout}")
    if cfg.sft is not None and cfg.sft.batch_size % cfg.train.dp:
        problems.append(f"sft: batch_size={cfg.sft.batch_size} is not divisible by train.dp={cfg.train.dp}")
    return problems


def task_problems(cfg: RunConfig, dims: ModelDims | None) -> list[str]:
    if cfg.task.min_len > cfg.task.max_len:
        return [f"task: min_len={cfg.task.min_len} is above max_len={cfg.task.max_len}"]
    task = build_task(cfg.task.name, cfg.task.min_len, cfg.task.max_len)
    tokenizer = CharTokenizer()
    problems = []
    wanted, space = cfg.task.num_train + cfg.task.num_heldout, task.space_size()
    if wanted > space:
        problems.append(f"task: {cfg.task.name} with max_len={cfg.task.max_len} has {space} distinct prompts; "
                        f"num_train + num_heldout = {wanted}")
    answer = longest_answer_tokens(task, tokenizer)
    if answer > cfg.algorithm.max_new_tokens:
        problems.append(f"algorithm.max_new_tokens={cfg.algorithm.max_new_tokens} cannot hold the task's longest "
                        f"answer ({answer} tokens with <eos>)")
    if dims is None:
        return problems
    try:
        prompt = episode_prompt_tokens(cfg) if cfg.agent is not None else task_prompt_tokens(cfg)
    except EnvError:  # an environment that cannot be imported: the agent check says so
        return problems
    if prompt + cfg.algorithm.max_new_tokens > dims.max_context:
        problems.append(f"model: the task's longest prompt is {prompt} tokens; with max_new_tokens="
                        f"{cfg.algorithm.max_new_tokens} that is {prompt + cfg.algorithm.max_new_tokens} "
                        f"> max_position_embeddings={dims.max_context}")
    if tokenizer.vocab_size > dims.vocab_size:
        problems.append(f"model: vocab_size={dims.vocab_size} is smaller than the tokenizer's "
                        f"{tokenizer.vocab_size} ids")
    expected = {"pad_token_id": tokenizer.pad_id, "bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id}
    for key, value in dims.special_ids.items():
        if value != expected[key]:
            problems.append(f"model: {key}={value}, but the tokenizer's is {expected[key]}")
    return problems


def data_problems(cfg: RunConfig, dims: ModelDims | None) -> list[str]:
    """A ``data:`` run: its tokenizer loads and fits the model's vocabulary (and has a chat
    template when asked to use one), every file reads with its keys, and some prompts of each
    split fit; every bad file is named."""
    data = cfg.data
    field = "model.tokenizer" if cfg.model.tokenizer else "model.path"
    try:
        tokenizer = load_tokenizer(cfg)
    except TokenizerError as e:
        return [f"{field}: {e}"]
    problems = []
    if dims is not None and tokenizer.vocab_size > dims.vocab_size:
        problems.append(f"model: vocab_size={dims.vocab_size} is smaller than the tokenizer's "
                        f"{tokenizer.vocab_size} ids ({tokenizer.path})")
    if dims is not None and dims.special_ids.get("eos_token_id") != tokenizer.eos_id:
        # the engines stop generating at config.json's eos; SFT and decode use the tokenizer's
        problems.append(f"model: eos_token_id={dims.special_ids.get('eos_token_id')} in the model's config, but "
                        f"the tokenizer's eos is {tokenizer.eos_id} ({tokenizer.hf.eos_token!r}): responses "
                        f"would not stop where answers end")
    if data.chat_template and not tokenizer.has_chat_template:
        problems.append(f"data.chat_template: the tokenizer at {tokenizer.path} has no chat template")
    for split in ("train_files", "heldout_files"):
        for i, path in enumerate(getattr(data, split)):
            try:
                read_records(path, data.prompt_key, data.answer_key)
            except DataError as e:
                problems.append(f"data.{split}[{i}]: {e}")
    max_ctx = dims.max_context if dims is not None else DEFAULT_CONTEXT
    limit = prompt_token_limit(data, cfg.algorithm.max_new_tokens, max_ctx)
    if limit < 1:
        problems.append(f"algorithm.max_new_tokens={cfg.algorithm.max_new_tokens} leaves no room for a prompt "
                        f"in the model's context of {max_ctx} tokens")
    if problems:
        return problems
    try:
        from .agent.config import prompt_renderer

        render = prompt_renderer(cfg, tokenizer)
    except Exception:  # noqa: BLE001 - an agent run's first turn that does not render: the agent check names it
        return problems
    try:
        splits, _ = load_data_splits(data, tokenizer, limit, render)
    except (DataError, TokenizerError) as e:
        return [str(e)]
    evaluated = len(cfg.eval.samples(splits))
    if cfg.eval.num_prompts > evaluated:
        given = ("held-out and train prompts data.heldout_files and train_files give" if cfg.eval.split == "all"
                 else "held-out prompts data.heldout_files give")
        problems.append(f"eval.num_prompts={cfg.eval.num_prompts} is more than the {evaluated} {given}")
    return problems


# --- the registered checks ------------------------------------------------------------------------

@check("model")
def _model(cfg: RunConfig, facts: Facts) -> list[str]:
    if facts.dims is None:
        return []  # run_problems reported why the model's config does not read
    return family_problems_of(cfg.model) + weights_problems(cfg.model)


def _worlds(cfg: RunConfig):
    """(prefix, config) of every world the run uses: its own and each ``elastic.schedule`` entry's."""
    yield "", cfg
    for i, e in enumerate(cfg.elastic.schedule if cfg.elastic else []):
        yield f"elastic.schedule[{i}]: ", cfg.at_iteration(e.iteration)


@check("elastic")
def _elastic(cfg: RunConfig, facts: Facts) -> list[str]:
    """``elastic``: the schedule's entries in order, each a world of the run's blocks and engine,
    on devices the resize can share; node events and host redundancy where the rollout engine
    follows the trainer world (its ``placement``) and a rank's copy has another rank to live on."""
    if cfg.elastic is None:
        return []
    problems, schedule = [], cfg.elastic.schedule
    before = cfg  # the world in force before each entry
    for i, e in enumerate(schedule):
        where = f"elastic.schedule[{i}]"
        if i and e.iteration <= schedule[i - 1].iteration:
            problems.append(f"{where}.iteration: {e.iteration} — entries go in increasing iteration order")
        if (e.reference is None) != (cfg.reference is None):
            problems.append(f"{where}.reference: give a reference block exactly when the run has one")
        if (e.critic is None) != (cfg.critic is None):
            problems.append(f"{where}.critic: give a critic block exactly when the run has one (PPO)")
        if not e.rollout.colocate:
            problems.append(f"{where}.rollout.colocate: false — a resize needs colocated devices")
        if not _rollout_fact(e.rollout.engine, "resizable"):
            problems.append(f"{where}.rollout.engine: {e.rollout.engine} — {_resizable_engines()} are resized yet")
        elif e.rollout.engine != before.rollout.engine:
            problems.append(f"{where}.rollout.engine: {e.rollout.engine} — the run's rollout engine is "
                            f"{before.rollout.engine}; a resize does not change the engine")
        before = e
    if schedule and not cfg.rollout.colocate:
        problems.append("rollout.colocate: false — elastic.schedule needs colocated devices (an old and a new "
                        "trainer actor share each kept device during a resize)")
    if schedule and not _rollout_fact(cfg.rollout.engine, "resizable"):
        problems.append(f"rollout.engine: {cfg.rollout.engine} — elastic.schedule resizes {_resizable_engines()} yet")
    follows = _rollout_fact(cfg.rollout.engine, "placement") == "worker" and cfg.rollout.colocate
    if cfg.elastic.on_node_change == "resize" and not follows:
        # a node added becomes a resize request of the trainer world: what a schedule entry that
        # grows it needs, checked here rather than at the first node that joins
        problems.append("elastic.on_node_change: resize: a node added grows the trainer world, which only a rollout "
                        "engine in the trainer's actors, colocated, follows yet (vLLM replicas change only their "
                        "own layout)")
    if cfg.elastic.redundancy == "host":
        why = "elastic.redundancy: host"
        if not follows:
            problems.append(f"{why}: only a rollout engine in the trainer's actors (the torch one), colocated, is "
                            f"rebuilt after a lost trainer yet")
        if cfg.world_size < 2:
            problems.append(f"{why} needs world_size >= 2 (a rank's copy is kept by another rank)")
        problems += [f"elastic.schedule[{i}].world_size: {e.world_size} — {why} needs every world of the run >= 2 "
                     f"(a rank's copy is kept by another rank)" for i, e in enumerate(schedule) if e.world_size < 2]
    return problems


def _rollout_fact(engine: str, fact: str):
    """A fact the rollout engine ``engine`` declares (None: not a known engine; the engines check says so)."""
    try:
        return getattr(rollout_engine(engine), fact)
    except EngineError:
        return None


def _resizable_engines() -> str:
    """The registered rollout engines a resize takes, as a refusal names them."""
    from .engines.base import rollout_engine_names

    names = [n for n in rollout_engine_names() if _rollout_fact(n, "resizable")]
    return "only the rollout engines " + ", ".join(names)


@check("layouts")
def _layouts(cfg: RunConfig, facts: Facts) -> list[str]:
    return [prefix + p for prefix, world in _worlds(cfg) for phase, layout in world.phases().items()
            for p in layout_problems(phase, layout, world.world_size)
            + (model_split_problems(phase, layout, facts.dims) if facts.dims is not None else [])]


@check("batch")
def _batch(cfg: RunConfig, facts: Facts) -> list[str]:
    return [prefix + p for prefix, world in _worlds(cfg) for p in batch_problems(world)]


@check("algorithm")
def _algorithm(cfg: RunConfig, facts: Facts) -> list[str]:
    """The algorithm resolves (a user's ``module:Class`` or pieces import), its fields fit each
    other, its estimator and its paper, and the run has the blocks it needs
    (``rl.algorithm_rules``)."""
    from .rl.algorithm import Algorithm

    problems = algorithm_problems(cfg)
    if problems:
        return problems
    try:
        Algorithm.build(cfg.algorithm)
    except ValueError as e:
        return [str(e)]
    return []


def _replicas_of_their_own(cfg: RunConfig) -> bool:
    """Whether the rollout runs in replica actors (vLLM) on devices of their own (an engine
    that is not known counts as one: the engines check names it)."""
    try:
        replica = rollout_engine(cfg.rollout.engine).placement == "replica"
    except EngineError:
        replica = True
    return replica and not cfg.rollout.colocate


@check("off_policy")
def _off_policy(cfg: RunConfig, facts: Facts) -> list[str]:
    """One-step off-policy needs rollout replicas of their own devices (they generate while the
    trainer trains) and a world that does not change under the batch in flight."""
    op = cfg.algorithm.off_policy
    if not cfg.algorithm.max_staleness:
        return []
    problems = []
    if op.max_staleness > 1 and cfg.agent is None:
        problems.append(f"algorithm.off_policy.max_staleness: {op.max_staleness} — a single-turn run carries one "
                        f"batch in flight (0 or 1); K >= 2 batches in flight are built for agent runs, whose "
                        f"episodes are played in threads of their own")
    if not _replicas_of_their_own(cfg):
        problems.append(f"algorithm.off_policy.max_staleness: {op.max_staleness} — generation overlaps training "
                        f"only on rollout replicas of their own devices: rollout.mode: disaggregated with a "
                        f"replica engine (vllm); this run's rollout is {cfg.rollout.engine}, {cfg.rollout.mode}")
    if cfg.elastic is not None:
        problems.append("algorithm.off_policy: an elastic run does not carry a batch in flight across a resize yet; "
                        "set max_staleness: 0 or remove the elastic block")
    if getattr(cfg.algorithm, "dynamic_sampling", None) is not None:
        problems.append("algorithm.off_policy: dynamic sampling draws its extra rounds synchronously; with a batch "
                        "in flight they would queue behind it — use one of the two")
    return problems


@check("rebalance")
def _rebalance(cfg: RunConfig, facts: Facts) -> list[str]:
    """``elastic.rebalance: update`` lends the replicas' devices to the update: there must be
    replicas on devices of their own, idle while the trainer trains (no batch in flight), and the
    grown world must be a run of its own that passes every check."""
    if cfg.elastic is None or cfg.elastic.rebalance == "off":
        return []
    problems = _idle_to_lend(cfg, "rebalance", "lends the rollout replicas' own devices to the update",
                             "the replicas generate while the trainer trains", "their devices are not idle to lend")
    # a schedule, redundancy: host and on_node_change: resize need colocated devices: refused by the config
    if cfg.train.offload != "none":
        problems.append(f"elastic.rebalance: the state moves between worlds from the engines' buffers; "
                        f"train.offload: {cfg.train.offload} parks it in host memory — use offload: none")
    if cfg.model.lora is not None:
        problems.append("elastic.rebalance: a LoRA run's adapters are not moved between worlds yet")
    if problems:
        return problems
    grown = cfg.world_size + (cfg.world_size // cfg.rollout.tp) * cfg.rollout.tp
    data = cfg.model_dump()
    data.update(scaled_along_dp(data, grown), elastic=None)
    # the checks whose answer does not depend on the world ran on the run's own config already
    same = ("prompts", "reward", "logging", "reward_model")
    try:
        found = run_problems(load_config(data), cuda_available=facts.cuda_available, skip=same)
    except ConfigError as err:
        found = err.problems or [str(err)]
    return [f"elastic.rebalance: the grown world of {grown} devices: {p}" for p in found]


@check("lend")
def _lend(cfg: RunConfig, facts: Facts) -> list[str]:
    """``elastic.lend: rollout`` lends the trainer's devices to the rollout: the rollout must run in
    replicas of their own devices (the lent ones join them), while the trainer waits for samples
    (no batch in flight: with one, the trainer trains while the replicas generate)."""
    if cfg.elastic is None or cfg.elastic.lend == "off":
        return []
    return _idle_to_lend(cfg, "lend", "lends the trainer's devices to rollout replicas of their own devices",
                         "the trainer trains while the replicas generate", "its devices are not idle to lend")


def _idle_to_lend(cfg: RunConfig, field: str, lends: str, busy: str, so: str) -> list[str]:
    """What moving devices between phases (``elastic.<field>``) needs either way: rollout
    replicas on devices of their own, and the synchronous loop — with a batch in flight neither
    side is idle while the other works (``busy``, ``so``)."""
    problems = []
    if not _replicas_of_their_own(cfg):
        problems.append(f"elastic.{field}: {getattr(cfg.elastic, field)} — {lends}: rollout.mode: disaggregated "
                        f"with a replica engine (vllm); this run's rollout is {cfg.rollout.engine}, {cfg.rollout.mode}")
    if cfg.algorithm.max_staleness:
        problems.append(f"elastic.{field}: {busy} (off_policy.max_staleness: {cfg.algorithm.max_staleness}): {so}")
    return problems


@check("sampling")
def _sampling(cfg: RunConfig, facts: Facts) -> list[str]:
    """What the rollout engines' sampling does not do: they sample from the whole distribution at
    ``temperature`` (the stale-weights check compares their log-probs of exactly that), so a
    ``top_p`` below 1 would be accepted and silently ignored."""
    if cfg.algorithm.top_p != 1.0:
        return [f"algorithm.top_p: {cfg.algorithm.top_p} — the rollout engines sample from the whole "
                f"distribution; only top_p 1.0 runs"]
    return []


def episode_prompt_tokens(cfg: RunConfig) -> int:
    """An agent run's longest prompt: the longest sample's episode prompt (the environment's text
    around the sample's: ``agent.workflow.episode_request``), in the character tokenizer's ids."""
    from .agent.workflow import episode_request

    t = cfg.task
    longest = build_task(t.name, t.min_len, t.max_len, t.length_skew).longest()
    return len(episode_request(cfg.agent.env, cfg.agent.env_kwargs, longest, "longest", CharTokenizer()).prompt_ids)


@check("agent")
def _agent(cfg: RunConfig, facts: Facts) -> list[str]:
    """Multi-turn rollouts (``agent``): the environment must import; its episodes fit the trainer's
    room (everything after the prompt is ``algorithm.max_new_tokens`` at most); no partial rollout
    (one step ahead is built; the off-policy check says where it runs); a chat model's template
    can extend a conversation token by token."""
    a = cfg.agent
    if a is None:
        return []
    from .agent.env import environment_class

    problems = []
    try:
        environment_class(a.env)
    except EnvError as e:
        problems.append(f"agent.env: {e}")
    if a.max_total_tokens is not None and a.max_total_tokens > cfg.algorithm.max_new_tokens:
        problems.append(f"agent.max_total_tokens: {a.max_total_tokens} — more than algorithm.max_new_tokens="
                        f"{cfg.algorithm.max_new_tokens}, the trainer's room for everything after the prompt "
                        f"(model turns and observations); leave it null to use that")
    if a.max_turn_tokens is not None and a.max_turn_tokens > cfg.algorithm.max_new_tokens:
        problems.append(f"agent.max_turn_tokens: {a.max_turn_tokens} — more than algorithm.max_new_tokens="
                        f"{cfg.algorithm.max_new_tokens}, the whole episode's room")
    if cfg.data is not None and cfg.data.chat_template and not problems:
        from .agent.chat import ChatTemplateError
        from .agent.config import chat_prompt

        try:  # observations are written as the template's messages (agent.chat), the codec built as the run
            # builds it; the first turn written as the loader writes every prompt (system message, tools)
            chat_prompt(load_tokenizer(cfg), a)("rlhfswitchprobeprompt")
        except TokenizerError:
            pass  # the prompts check names it
        except ChatTemplateError as e:
            problems.append(f"agent: data.chat_template: {e}")
        except Exception as e:  # noqa: BLE001 - the environment's chat_tools or the template raised
            problems.append(f"agent: data.chat_template: the first turn (agent.system, the tools {a.env} "
                            f"declares) does not render: {type(e).__name__}: {e}")
    return problems


@check("prompts")
def _prompts(cfg: RunConfig, facts: Facts) -> list[str]:
    return task_problems(cfg, facts.dims) if cfg.task is not None else data_problems(cfg, facts.dims)


@check("engines")
def engine_problems(cfg: RunConfig, facts: Facts | None = None) -> list[str]:
    """What the config asks of its engines that they cannot do: each phase's engine is resolved
    through the registry and asked whether it runs that phase's layout (``phase_engine_problems``);
    offload, the ipc handoff and a rollout of its own devices need engines that support them."""
    dims = facts.dims if facts is not None else None
    problems = []
    for phase, layout in cfg.phases().items():
        problems += phase_engine_problems(phase, layout, dims)
    try:
        if cfg.train.offload != "none" and not training_engine(cfg.train.engine).can_offload:
            problems.append(f"train.offload: {cfg.train.offload} — engine {cfg.train.engine} cannot park its "
                            f"state in host memory (engines that can: deepspeed, fsdp2); use offload: none")
    except EngineError:
        pass  # reported above
    try:
        placement = rollout_engine(cfg.rollout.engine).placement
    except EngineError:
        placement = None  # reported above
    if placement is not None and cfg.rollout.handoff == "ipc" and placement != "replica":
        problems.append(f"rollout.handoff: ipc hands buckets to rollout workers in processes of their own; "
                        f"engine {cfg.rollout.engine!r} runs inside the trainer's processes (use p2p or auto)")
    if placement is not None and not cfg.rollout.colocate and placement != "replica":
        problems.append(f"rollout.colocate: false needs a rollout engine of its own actors (placement "
                        f"'replica', e.g. vllm); engine {cfg.rollout.engine} runs inside the trainer's "
                        f"processes, on their devices")
    pull = cfg.rollout.pull_prompts
    if pull and placement is not None and placement != "replica":
        problems.append(f"rollout.pull_prompts: {pull} — work stealing hands chunks of a generation to rollout "
                        f"replicas (placement 'replica', e.g. vllm); engine {cfg.rollout.engine} generates in the "
                        f"trainer's processes, each rank its share (use 0)")
    if pull and cfg.algorithm.max_staleness and cfg.agent is None:
        problems.append(f"rollout.pull_prompts: {pull} — a batch generated one step ahead is collected an "
                        f"iteration later, and chunks are handed out only while a generation is collected: it "
                        f"would keep fixed shares (use 0, or max_staleness: 0; an agent run's rounds are pulled)")
    return problems


@check("device")
def _device(cfg: RunConfig, facts: Facts) -> list[str]:
    return device_problems(cfg, facts.cuda_available)


@check("lora")
def lora_problems(cfg: RunConfig, facts: Facts | None = None) -> list[str]:
    """``model.lora`` (docs/lora.md): an engine that trains adapters, target modules the family
    has, a rollout engine that takes what ``sync`` moves."""
    lora = cfg.model.lora
    if lora is None:
        return []
    problems = []
    try:
        if not training_engine(cfg.train.engine).supports_lora:
            problems.append(f"model.lora: engine {cfg.train.engine} does not train LoRA adapters (engines that do: "
                            f"{', '.join(n for n in training_engine_names() if training_engine(n).supports_lora)})")
    except EngineError:
        pass  # the engines check names it
    try:
        takes_adapters = rollout_engine(cfg.rollout.engine).takes_adapters
    except EngineError:
        takes_adapters = True  # the engines check names it
    if lora.sync == "adapters" and not takes_adapters:
        problems.append(f"model.lora.sync: adapters — rollout engine {cfg.rollout.engine} does not take LoRA "
                        f"adapters (it takes merged weights: sync merged or auto)")
    if facts is not None and facts.dims is None:
        return problems  # the model check says why its config does not read
    try:
        spec = derive_spec(cfg.model.hf_dict())
    except (ValueError, ConfigError):
        return problems  # the model check reports it
    missing = [t for t in lora.target_modules if not spec.lora_targets([t])]
    if missing:
        have = sorted({t.name.split(".")[-2] for t in spec.tensors
                       if t.layer is not None and t.expert is None and len(t.shape) == 2})
        problems.append(f"model.lora.target_modules: {', '.join(missing)} — model_type "
                        f"{cfg.model.hf_dict().get('model_type', 'llama')} has no such linear module in its "
                        f"decoder layers (it has {', '.join(have)})")
    kv = {"k_proj", "v_proj"} & set(lora.target_modules)
    if spec.attention is not None and cfg.rollout.tp > spec.attention.num_kv_heads and kv and \
            not {"q_proj", "k_proj", "v_proj"} <= set(lora.target_modules):
        problems.append(f"model.lora.target_modules: at rollout tp={cfg.rollout.tp} above the "
                        f"{spec.attention.num_kv_heads} KV heads, {'/'.join(sorted(kv))} adapters need q_proj, k_proj "
                        f"and v_proj all targeted (their lora_B is then split with qkv_proj's replicated KV heads)")
    return problems


@check("reward")
def _reward(cfg: RunConfig, facts: Facts) -> list[str]:
    """The reward function loads where the run will call it (this process, or its worker
    processes: ``reward_workers``); on a config without other problems it is also called once,
    as the run calls it, on a held-out sample (the right answer and an empty response), with the
    run's time limit — so a function that cannot run, or runs too long, is refused before any
    actor starts."""
    from .reward_workers import RewardRunner
    from .rl.data import load_splits
    from .rl.rewards import RewardError

    try:
        with RewardRunner(cfg.reward_fn, cfg.reward_workers, cfg.reward_timeout_s) as reward:
            if facts.found:
                reward.wait_ready()
            else:
                s = load_splits(cfg)[0].heldout[0]
                reward([s.prompt] * 2, [s.answer, ""], [s.answer] * 2)
    except RewardError as e:
        return [f"{cfg.prompt_source}.reward_fn: {e}"]
    return []


# a logging backend -> (the extra that installs it, the modules it imports); tensorboard is a main dependency
LOGGING_EXTRAS = {"wandb": ("wandb", ("wandb",)),
                  "mlflow": ("mlflow", ("mlflow", "sqlalchemy", "alembic"))}  # SQLite: the local store


@check("logging")
def _logging(cfg: RunConfig, facts: Facts) -> list[str]:
    """Every logging backend named is installed (wandb and mlflow are optional extras), so that a
    run is not refused after its warm start."""
    from importlib.util import find_spec

    problems = []
    for name in cfg.logging:
        extra, modules = LOGGING_EXTRAS.get(name, (None, ()))
        missing = [m for m in modules if find_spec(m) is None]
        if missing:
            problems.append(f"logging: {name} needs the {extra} extra ({', '.join(missing)} not installed): "
                            f"pip install 'rlhf-switch[{extra}]', or leave {name} out of logging")
    return problems


# --- reward models: the loop's reward.model_path, and rlhf-switch rm's own config ------------------

def reward_model_dir_problems(field: str, path: str) -> tuple[list[str], dict | None]:
    """``path`` must be a reward model directory: ``config.json`` of a known family and weights
    (every top-level ``*.safetensors``, read from their headers) of its value model — the
    family's trunk and a one-row head ``score.weight`` (``score.bias`` optional: a
    ``…ForSequenceClassification`` has none). Returns the problems and the directory's config."""
    from .models import value_spec

    root = Path(path)
    if not root.is_dir():
        return [f"{field}: no such directory: {root}"], None
    config_json = root / "config.json"
    if not config_json.is_file():
        return [f"{field}: {root} has no config.json (a reward model directory holds config.json and "
                f"*.safetensors weights)"], None
    try:
        hf = json.loads(config_json.read_text())
    except ValueError as e:
        return [f"{field}: {config_json} is not JSON ({e})"], None
    missing = [k for k in ModelDims.REQUIRED if k not in hf]
    if missing:
        return [f"{field}: {config_json} lacks {', '.join(missing)}"], None
    problems = [f"{field}: {p}" for p in family_problems(hf)]
    files = sorted(root.glob("*.safetensors"))
    if not files:
        problems.append(f"{field}: {root} holds no *.safetensors weights")
    if problems:
        return problems, hf
    held: dict[str, tuple[int, ...]] = {}
    for f in files:
        try:
            held.update(safetensors_shapes(f))
        except (OSError, ValueError, KeyError) as e:
            return [f"{field}: {f} is not a readable safetensors file ({e})"], hf
    if "score.weight" not in held:
        kind = "a causal LM (lm_head.weight)" if "lm_head.weight" in held else "no value head"
        return [f"{field}: {root} is {kind}, not a reward model: it has no score.weight (a reward model is the "
                f"family's …ForTokenClassification or …ForSequenceClassification with num_labels 1)"], hf
    spec = value_spec(hf)
    for t in spec.tensors:
        if t.name not in held:
            if t.name != "score.bias":
                problems.append(f"{field}: {root} lacks {t.name} {list(t.shape)} that its config.json implies")
        elif held[t.name] != t.shape:
            hint = " (a reward model has num_labels 1)" if t.name.startswith("score.") else ""
            problems.append(f"{field}: {root} has {t.name} of shape {list(held[t.name])}, its config.json "
                            f"implies {list(t.shape)}{hint}")
    extra = sorted(n for n in held if n not in spec and not n.endswith("rotary_emb.inv_freq"))
    if extra:
        problems.append(f"{field}: {root} holds tensors its config.json does not describe: {', '.join(extra[:5])}")
    return problems, hf


def reward_vocabulary_problems(cfg: RunConfig, rm_hf: dict, dims: ModelDims | None) -> list[str]:
    """The reward model reads the policy's token ids: its tokenizer (files, or the character
    tokenizer ``reward_model.json`` names) is the policy's, and its embedding holds every id the
    policy's model can generate."""
    from .rl.reward_model import REWARD_MODEL_FILE, reward_model_identity, tokenizer_identity, vocabulary_mismatch

    path = cfg.reward.model_path
    try:
        policy = tokenizer_identity(load_tokenizer(cfg))
    except TokenizerError:
        return []  # the prompts check says why the policy's tokenizer does not load
    problems = []
    try:
        reward = reward_model_identity(path)
    except TokenizerError as e:
        return [f"reward.model_path: {e}"]
    if reward is None:
        problems.append(f"reward.model_path: {path} names no tokenizer (no tokenizer files, no {REWARD_MODEL_FILE}), "
                        f"so its vocabulary cannot be checked against the policy's: copy the tokenizer it was "
                        f"trained with into it")
    else:
        why = vocabulary_mismatch(reward, policy)
        if why:
            problems.append(f"reward.model_path: {path} does not read the policy's token ids: {why}")
    rm_vocab = int(rm_hf["vocab_size"])
    if dims is not None and rm_vocab < dims.vocab_size:
        problems.append(f"reward.model_path: vocab_size={rm_vocab}, but the policy generates ids up to "
                        f"{dims.vocab_size - 1} (its vocab_size={dims.vocab_size}): the reward model's vocabulary "
                        f"must be the policy's")
    return problems


@check("reward_model")
def _reward_model(cfg: RunConfig, facts: Facts) -> list[str]:
    """``reward.model_path``: a reward model directory, of the policy's vocabulary; its engine
    (value heads: fsdp2, deepspeed) runs its layout over the world; no resize (an elastic run
    does not rebuild it in a new world)."""
    r = cfg.reward
    if r is None:
        return []
    problems, rm_hf = reward_model_dir_problems("reward.model_path", r.model_path)
    rm_dims = ModelDims.from_hf_config(rm_hf) if rm_hf is not None and not problems else None
    if rm_dims is not None:
        problems += reward_vocabulary_problems(cfg, rm_hf, facts.dims)
    problems += layout_problems("reward", r, cfg.world_size)
    if rm_dims is not None:
        problems += model_split_problems("reward", r, rm_dims)
    try:
        problems += training_engine(r.engine).layout_problems("reward", r, rm_dims, head="value")
    except EngineError as e:
        problems.append(f"reward.engine: {e}")
    e = cfg.elastic
    if e is not None and (e.schedule or e.on_node_change == "resize" or e.redundancy == "host"):
        problems.append("reward.model_path: an elastic run (elastic.schedule, on_node_change: resize, redundancy: "
                        "host) does not rebuild the reward model's engine in a new world yet")
    return problems


def trunk_problems(model: ModelConfig) -> list[str]:
    """``model.path``'s weights, when it has some, hold the trunk (``model.*``) the config
    describes, each of its shape: the reward model starts from them (a causal LM's or a value
    model's)."""
    if model.path is None:
        return []
    root = Path(model.path)
    files = sorted(root.glob("*.safetensors"))
    if not files:
        return []
    hf = model.hf_dict()
    if family_problems(hf):
        return []  # reported by family_problems_of
    held: dict[str, tuple[int, ...]] = {}
    for f in files:
        try:
            held.update(safetensors_shapes(f))
        except (OSError, ValueError, KeyError) as e:
            return [f"model.path: {f} is not a readable safetensors file ({e})"]
    problems = []
    for t in derive_spec(hf, "value").tensors:
        if not t.name.startswith("model."):
            continue
        if t.name not in held:
            problems.append(f"model.path: {root} lacks {t.name} {list(t.shape)} that config.json implies")
        elif held[t.name] != t.shape:
            problems.append(f"model.path: {root} has {t.name} of shape {list(held[t.name])}, config.json implies "
                            f"{list(t.shape)}")
    return problems[:10]


def reward_training_problems(cfg, cuda_available: bool | None | str = LOCAL) -> list[str]:
    """Every problem of an ``rlhf-switch rm`` config (``rl.reward_model.RewardModelRunConfig``):
    the model reads and its family is known, ``model.path``'s trunk fits it; the ``train`` layout
    covers the world, splits the model and its engine builds value heads; ``batch_size`` divides
    over DP and micro-batches; the tokenizer loads and fits the model; every preference file reads
    with its three keys, and some pairs of each split fit the context."""
    from .device import cuda_available as local_cuda
    from .rl.reward_model import load_preferences, rm_tokenizer

    try:
        dims = model_dims(cfg.model)
    except ConfigError as e:
        return list(e.problems)
    problems = family_problems_of(cfg.model) + trunk_problems(cfg.model)
    problems += layout_problems("train", cfg.train, cfg.world_size) + model_split_problems("train", cfg.train, dims)
    try:
        problems += training_engine(cfg.train.engine).layout_problems("train", cfg.train, dims, head="value")
    except EngineError as e:
        problems.append(f"train.engine: {e}")
    t = cfg.training
    if t.batch_size % cfg.train.dp:
        problems.append(f"train: dp={cfg.train.dp} does not divide training.batch_size={t.batch_size}")
    elif (t.batch_size // cfg.train.dp) % t.micro_batch_size:
        problems.append(f"training.micro_batch_size={t.micro_batch_size} does not divide the per-rank batch "
                        f"{t.batch_size}/{cfg.train.dp} = {t.batch_size // cfg.train.dp} pairs")
    if cuda_available == LOCAL:
        cuda_available = None if cfg.ray_address else local_cuda()
    if cuda_available is not None or cfg.device != "auto":
        try:
            device = resolve_device(cfg.device, bool(cuda_available) if cuda_available is not None
                                    else cfg.device == "cuda", cfg.model.dtype)
            if not device.is_cuda and device.compute_dtype != "float32":
                problems.append(f"model.dtype: {device.compute_dtype} — on CPU a reward model trains in float32")
        except DeviceUnavailable as e:
            problems.append(str(e))
    field = "model.tokenizer" if cfg.model.tokenizer else "model.path"
    try:
        tokenizer = rm_tokenizer(cfg)
    except TokenizerError as e:
        return problems + [f"{field}: {e}"]
    if tokenizer.vocab_size > dims.vocab_size:
        problems.append(f"model: vocab_size={dims.vocab_size} is smaller than the tokenizer's {tokenizer.vocab_size} ids")
    if isinstance(tokenizer, CharTokenizer):
        expected = {"pad_token_id": tokenizer.pad_id, "bos_token_id": tokenizer.bos_id,
                    "eos_token_id": tokenizer.eos_id}
        problems += [f"model: {k}={v}, but the character tokenizer's is {expected[k]}"
                     for k, v in dims.special_ids.items() if v != expected[k]]
        if cfg.data.chat_template:
            problems.append("data.chat_template: the character tokenizer has no chat template")
    elif cfg.data.chat_template and not tokenizer.has_chat_template:
        problems.append(f"data.chat_template: the tokenizer at {tokenizer.path} has no chat template")
    for split in ("train_files", "heldout_files"):
        for i, path in enumerate(getattr(cfg.data, split)):
            try:
                read_columns(path, cfg.data.keys)
            except DataError as e:
                problems.append(f"data.{split}[{i}]: {e}")
    if problems:
        return problems
    try:
        train, heldout = load_preferences(cfg, tokenizer, dims.max_context - 1)
    except (DataError, TokenizerError, ValueError) as e:
        return [f"data: {e}"]
    for split, pairs in (("train_files", train), ("heldout_files", heldout)):
        if not len(pairs):
            problems.append(f"data.{split}: every one of its {pairs.dropped} pairs is longer than the model's "
                            f"context of {dims.max_context} tokens (less the scored position)")
    return problems


def check_reward_training(cfg, **kwargs) -> None:
    """Raise one ``ConfigError`` listing every problem ``reward_training_problems`` finds; call it
    before Ray starts."""
    problems = reward_training_problems(cfg, **kwargs)
    if problems:
        raise ConfigError(f"the reward model config cannot run on world_size={cfg.world_size}: "
                          f"{len(problems)} problem{'s' * (len(problems) != 1)}", problems)


# --- the device: checked before Ray, resolved when the world starts -------------------------------

def device_problems(cfg: RunConfig, cuda_available: bool | None) -> list[str]:
    """What ``cfg.device`` and ``model.dtype`` ask for that cannot run where the actors see
    (``cuda_available``) or do not see a GPU; ``None``: not known before Ray (a cluster joined at
    ``ray_address``) — then ``device: cuda`` is taken at its word and ``auto`` waits for the actors
    (``world_device``)."""
    if cuda_available is None:
        if cfg.device == "auto":
            return []
        cuda_available = cfg.device == "cuda"
    try:
        device = resolve_device(cfg.device, cuda_available, cfg.model.dtype)
    except DeviceUnavailable as e:
        return [str(e)]
    return dtype_problems(cfg, device)


def dtype_problems(cfg: RunConfig, device) -> list[str]:
    """The compute dtype ``device`` resolved to, against each phase's engine: on CPU the loop
    computes in float32 (bf16 is ~26× slower there and not run); on CUDA each engine says which
    compute dtypes it runs beside a float32 master (``compute_dtypes``)."""
    if not device.is_cuda:
        return [] if device.compute_dtype == "float32" else \
            [f"model.dtype: {device.compute_dtype} — the CPU loop trains in float32"]
    problems = []
    why = "model.dtype" if cfg.model.dtype else "model.dtype unset: device cuda's default"
    for phase, layout in cfg.phases().items():
        try:
            cls = rollout_engine(layout.engine) if phase == "rollout" else training_engine(layout.engine)
        except EngineError:
            continue  # the engines check names it
        if device.compute_dtype not in cls.compute_dtypes:
            problems.append(f"{phase}: engine {layout.engine} computes in {'/'.join(cls.compute_dtypes)}, not "
                            f"{device.compute_dtype} ({why}); set model.dtype: float32 or use an engine that "
                            f"does")
    return problems


def world_device(cfg: RunConfig, cuda_available: bool):
    """The run's ``DeviceSpec``, resolved once when the world starts from what its actors see
    (``cuda_available``, asked in an actor on its bundle); ``ConfigError`` where it cannot run."""
    try:
        device = resolve_device(cfg.device, cuda_available, cfg.model.dtype)
    except DeviceUnavailable as e:
        raise ConfigError("device", [str(e)]) from None
    problems = dtype_problems(cfg, device)
    if problems:
        raise ConfigError(f"the config cannot run on {device.kind}", problems)
    return device


# --- the worlds elastic control moves a run into --------------------------------------------------

def check_resize_request(cfg: RunConfig, request: dict, iteration: int, last: int, devices_held: int | None):
    """The run's config with ``request`` (a resize request: ``rlhf_switch.elastic.requests``) as the
    ``elastic.schedule`` entry at ``iteration`` (the one after the boundary it was taken at),
    checked like a schedule entry in the config: the config's types, every pre-start check of the
    world it makes (its reward already ran), and the ``devices_held`` Ray can give (None: the run
    has no elastic device manager). Returns (config, entry); raises one ``ConfigError`` listing
    every problem."""
    where, keys = "resize request", tuple(k for k in ElasticEntry.model_fields if k != "iteration")

    def refuse(problems: list[str]):
        return ConfigError(f"{where} refused: {len(problems)} problem{'s' * (len(problems) != 1)}", problems)

    problems = []
    if "unreadable" in request:
        raise refuse([f"{where}: unreadable ({request['unreadable']})"])
    unknown = sorted(set(request) - set(keys) - {"id", "reason"})
    if unknown:
        problems.append(f"{where}: unknown keys {unknown} (give {', '.join(keys)})")
    if devices_held is None:
        problems.append(f"{where}: this run has no elastic device manager (give the config an elastic block, "
                        f"with the torch rollout engine or vLLM replicas, colocated)")
    if iteration > last:
        problems.append(f"{where}: the run ends at iteration {last}; there is no next iteration to resize before")
    schedule = [e.model_dump() for e in (cfg.elastic.schedule if cfg.elastic else [])]
    if any(e["iteration"] == iteration for e in schedule):
        problems.append(f"{where}: elastic.schedule already resizes before iteration {iteration}")
    if len(problems) > len(unknown[:1]):  # no entry to check
        raise refuse(problems)
    entry = {**{k: request[k] for k in keys if k in request}, "iteration": iteration}
    data = cfg.model_dump()
    data["elastic"] = {**(data.get("elastic") or {}),
                       "schedule": sorted(schedule + [entry], key=lambda e: e["iteration"])}
    try:
        new = load_config(data)
        check_run(new, skip=("reward",))
    except ConfigError as e:
        raise refuse(problems + (e.problems or [str(e)])) from None
    (accepted,) = [e for e in new.elastic.schedule if e.iteration == iteration]
    if accepted.world_size > devices_held:
        problems.append(f"{where}: world_size {accepted.world_size} — Ray holds {devices_held} devices for this run")
    if problems:
        raise refuse(problems)
    return new, accepted


def scaled_run(cfg: RunConfig, world: int) -> RunConfig:
    """The run's config on ``world`` devices, its train, rollout, reference and critic layouts
    scaled along DP (``rl.config.scaled_along_dp``): the world a lost node leaves, the grown world
    of ``elastic.rebalance``. Checked as the config is: its types and the pre-start checks; raises
    one ``ConfigError`` (e.g. a TP that does not divide ``world``, a batch the new DP does not
    divide)."""
    data = cfg.model_dump()
    data.update(scaled_along_dp(data, world))
    try:
        new = load_config(data)
        check_run(new, skip=("reward",))
    except ConfigError as e:
        raise ConfigError(f"no {world}-device world with the run's layouts scaled along DP",
                          e.problems or [str(e)]) from None
    return new
