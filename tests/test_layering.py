"""Imports point downwards: the package never imports the layers above it (``recipes``, ``actors``),
each layer of the package only the layers below it, no two modules import each other (directly or
round a longer cycle, at module level or inside a function), and ``rlhf_switch.compat`` imports
neither DeepSpeed nor vLLM until a patch is applied."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ABOVE_THE_PACKAGE = ("recipes", "actors")


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every absolute import in ``path``, at any depth (function-level too)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def test_package_does_not_import_recipes_or_actors():
    upward = [f"{path.relative_to(REPO)}:{line} imports {module}"
              for path in sorted((REPO / "rlhf_switch").rglob("*.py"))
              for line, module in imported_modules(path)
              if module.split(".")[0] in ABOVE_THE_PACKAGE]
    assert upward == []


def test_compat_imports_no_third_party_engine_at_module_level():
    probe = "import sys, rlhf_switch.compat; print(sorted({m.split('.')[0] for m in sys.modules} & {'deepspeed', 'vllm'}))"
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(REPO), "PATH": ""}).stdout
    assert out.strip() == "[]"


def test_a_transport_is_imported_only_where_a_group_may_take_it():
    """Transports are plug-ins (``routing.transport.GLOO_TRANSPORTS``): the move's machinery — the
    comm, the schedule, the executor, the weight channel — imports none of them; a one-rank group
    asks none; a gloo group asks each in order, imported then, and takes the first that takes it."""
    probe = ("import sys, rlhf_switch.routing.comm as c, rlhf_switch.routing.executor, rlhf_switch.routing.schedule, "
             "rlhf_switch.engines.channel\n"
             "loaded = lambda: 'rlhf_switch.routing.same_host' in sys.modules\n"
             "before = loaded()\n"
             "class One(c.Comm):\n"
             "    rank, size = 0, 1\n"
             "    def _group_key(self): return object()\n"
             "t = One().choose_transport()\n"
             "print(before, loaded(), type(t).__name__)")
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(REPO), "PATH": ""}).stdout
    assert out.split() == ["False", "False", "PointToPoint"]
    from rlhf_switch.routing.transport import GLOO_TRANSPORTS, POINT_TO_POINT, Transport, find_transport

    assert GLOO_TRANSPORTS == ("rlhf_switch.routing.same_host:for_group",)
    asked, taken = [], Transport()
    sys.modules["transport_plugins"] = type(sys)("transport_plugins")
    sys.modules["transport_plugins"].none = lambda comm, key, timeout: asked.append(("none", key)) or None
    sys.modules["transport_plugins"].this = lambda comm, key, timeout: asked.append(("this", key)) or taken
    try:
        assert find_transport(("transport_plugins:none", "transport_plugins:this", "transport_plugins:missing"),
                              None, "g") is taken
        assert asked == [("none", "g"), ("this", "g")]  # in order, and none asked after the one taken
        assert find_transport(("transport_plugins:none",), None, "h") is POINT_TO_POINT
    finally:
        del sys.modules["transport_plugins"]


# inside the package, each layer may import only the layers below it
LAYERS = {"device": set(), "runtime_env": set(), "timeouts": set(), "vps": set(), "routing": {"vps"}, "families": {"vps"}, "models": {"vps", "families"},
          "testing": {"vps", "families", "models", "rl"}, "rl": {"vps", "families", "models"},
          "engines": {"vps", "routing", "families", "models", "rl", "compat", "launch", "device", "timeouts"},
          # the reward function's worker processes run rl's rewards
          "reward_workers": {"rl"},
          # environments, tools and episodes: rl's tasks, rewards and SFT pieces
          "agent": {"rl"},
          # the pre-start checks ask the config, the engines' registry and the device, and call the reward
          "problems": {"vps", "families", "models", "rl", "engines", "device", "reward_workers", "agent"},
          "elastic": {"vps", "routing", "families", "models", "rl", "compat", "launch", "engines", "device",
                      "problems", "timeouts"},
          # the cost model asks the engine registry which layouts each engine runs (no process group)
          "tune": {"vps", "families", "models", "rl", "engines", "device", "problems"}}


def package_imports(path: Path) -> list[tuple[int, str]]:
    """(line, rlhf_switch subpackage) of every import of the package in ``path``, relative ones
    resolved against the file's own package."""
    package = path.relative_to(REPO).with_suffix("").parts[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1] + tuple((node.module or "").split(".") if node.module else ())
                names = [base + (a.name,) for a in node.names] if not node.module else [base]
            else:
                names = [tuple(node.module.split("."))] if node.module else []
        elif isinstance(node, ast.Import):
            names = [tuple(a.name.split(".")) for a in node.names]
        else:
            continue
        found += [(node.lineno, n[1]) for n in names if len(n) > 1 and n[0] == "rlhf_switch"]
    return found


def test_layers_inside_the_package_point_down():
    upward = []
    for layer, below in LAYERS.items():
        files = [REPO / "rlhf_switch" / f"{layer}.py"] if (REPO / "rlhf_switch" / f"{layer}.py").exists() \
            else sorted((REPO / "rlhf_switch" / layer).rglob("*.py"))
        for path in files:
            upward += [f"{path.relative_to(REPO)}:{line} imports rlhf_switch.{sub}"
                       for line, sub in package_imports(path) if sub != layer and sub not in below]
    assert upward == []


def module_graph() -> dict[str, set[str]]:
    """Every module of the package, ``recipes`` and ``actors`` -> the modules of those it imports
    (at any depth; ``from pkg import name`` resolved to the submodule ``pkg.name`` where there is
    one; a package's own ``__init__`` is not counted as an import of its parent)."""
    modules = {}
    for root in ("rlhf_switch",) + ABOVE_THE_PACKAGE:
        for path in (REPO / root).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in modules.items():
        package = path.relative_to(REPO).with_suffix("").parts[:-1]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = (".".join(package[:len(package) - node.level + 1] + ((node.module,) if node.module else ()))
                        if node.level else node.module)
                found = [f"{base}.{a.name}" for a in node.names] + [base]
            else:
                continue
            deps |= {m for m in map(known, found) if m}
        graph[name] = {d for d in deps if d != name and not name.startswith(d + ".")}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    assert cycles(module_graph()) == []


def test_the_cycle_check_sees_a_cycle():
    """The check itself: a two-module cycle and a function-level import are found."""
    graph = module_graph()
    assert graph["rlhf_switch.rl.algorithm"] >= {"rlhf_switch.rl.algorithms"}
    graph["rlhf_switch.rl.algorithms"] = graph["rlhf_switch.rl.algorithms"] | {"rlhf_switch.rl.algorithm"}
    assert any({"rlhf_switch.rl.algorithm", "rlhf_switch.rl.algorithms"} <= set(c) for c in cycles(graph))


# the run machinery beneath the recipes, layer by layer: each may import only the layers before it
# (and the package); the recipes (train, rm, tune, cli, ...) sit on top of them all
RUN_LAYERS = ("recipes.common", "recipes.run_log", "recipes.cluster", "recipes.elastic", "recipes.loop")
RUN_MACHINERY = ("recipes/loop", "recipes/cluster", "recipes/elastic", "recipes/train.py")


def _recipes_layer(module: str) -> int | None:
    for i, layer in enumerate(RUN_LAYERS):
        if module == layer or module.startswith(layer + "."):
            return i
    return None


def test_the_run_machinery_imports_downwards():
    """``recipes.cluster`` (the actors) below ``recipes.elastic`` (what moves them between
    iterations) below ``recipes.loop`` (the iteration and its strategies); none imports a recipe."""
    graph, upward = module_graph(), []
    for module, deps in graph.items():
        mine = _recipes_layer(module)
        if mine is None:
            continue
        for dep in sorted(deps):
            theirs = _recipes_layer(dep)
            if dep.startswith("recipes.") and (theirs is None or theirs > mine):
                upward.append(f"{module} imports {dep}")
    assert upward == []


def _run_machinery_files():
    for part in RUN_MACHINERY:
        path = REPO / part
        yield from ([path] if path.suffix == ".py" else sorted(path.rglob("*.py")))


def test_the_loop_and_its_strategies_read_as_their_phases():
    """No function of the loop, its strategies or the recipe over 60 lines; no file of the run
    machinery (loop, cluster, elastic orchestration, the recipe) over 600."""
    long = [f"{path.relative_to(REPO)}:{node.name}: {node.end_lineno - node.lineno + 1} lines"
            for path in [*sorted((REPO / "recipes" / "loop").glob("*.py")), REPO / "recipes" / "train.py"]
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 60]
    big = [f"{path.relative_to(REPO)}: {len(path.read_text().splitlines())} lines" for path in _run_machinery_files()
           if len(path.read_text().splitlines()) > 600]
    assert long == [] and big == []


# --- engine names: compared only inside the engines' own adapters ----------------------------------

# where the code compares a string that is also an engine's name but means something else, and what
NOT_ENGINE_NAMES = {
    ("rlhf_switch/compat.py", "choice"): "the CPU kernels a vLLM worker runs (plain | vllm), not an engine",
}
ADAPTERS = "rlhf_switch/engines/"  # each engine's own adapter module, and the interfaces they implement


def engine_names() -> frozenset[str]:
    from rlhf_switch.engines.base import rollout_engine_names, training_engine_names

    return frozenset(training_engine_names()) | frozenset(rollout_engine_names())


def _named(node: ast.AST, names: frozenset[str], constants: dict[str, set[str]]) -> set[str]:
    """The engine names ``node`` spells: a string, a tuple/list/set of them (or a set()/tuple()/
    frozenset() of one), or a name bound to such a collection (``constants``)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value} & names
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return set().union(*(_named(e, names, {}) for e in node.elts))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args and \
            node.func.id in ("set", "frozenset", "tuple", "list"):
        return _named(node.args[0], names, {})
    if isinstance(node, ast.Name):
        return constants.get(node.id, set())
    return set()


def engine_name_constants(trees: dict[str, ast.AST], names: frozenset[str]) -> dict[str, set[str]]:
    """Every name bound anywhere to a collection of engine names (``ELASTIC = ("torch", "vllm")``)."""
    found: dict[str, set[str]] = {}
    for tree in trees.values():
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, ast.AnnAssign) and node.value is not None else []
            spelled = _named(node.value, names, {}) if targets else set()
            for t in targets:
                if spelled and isinstance(t, ast.Name) and not isinstance(node.value, ast.Constant):
                    found.setdefault(t.id, set()).update(spelled)
    return found


def engine_name_comparisons(trees: dict[str, ast.AST], names: frozenset[str]) -> list[str]:
    """``file:line: code`` of every ``==``/``!=``/``in``/``not in`` (and ``match``/``case``) outside
    the adapters with an engine's name on one side (a string, a collection of them, or a name bound
    to one), less ``NOT_ENGINE_NAMES``. Dispatch through a dict keyed by names is not seen here."""
    constants = engine_name_constants(trees, names)
    found = []
    for path, tree in trees.items():
        if path.startswith(ADAPTERS):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare) and all(
                    isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) for op in node.ops):
                sides = [node.left, *node.comparators]
                if any(_named(s, names, constants) for s in sides) and \
                        (path, ast.unparse(node.left)) not in NOT_ENGINE_NAMES:
                    found.append((path, node.lineno, ast.unparse(node)))
            elif isinstance(node, ast.MatchValue) and _named(node.value, names, {}):
                found.append((path, node.lineno, f"case {ast.unparse(node.value)}"))
    return [f"{path}:{line}: {code}" for path, line, code in sorted(found)]


def _sources() -> dict[str, ast.AST]:
    return {str(p.relative_to(REPO)): ast.parse(p.read_text(), str(p))
            for part in ("rlhf_switch", *ABOVE_THE_PACKAGE) for p in sorted((REPO / part).rglob("*.py"))}


def test_no_engine_name_is_compared_outside_its_adapter():
    """What an engine is (resizable, paged KV, LoRA, ZeRO stages, how it shards and gathers, its
    profile key, ...) is a class attribute of its adapter, asked through the registry
    (``engines.base.training_engine``/``rollout_engine``): nothing outside ``rlhf_switch/engines/``
    compares a config's ``engine`` with a registered name, so a user's ``module:Class`` engine is
    never silently treated as a different one."""
    assert engine_name_comparisons(_sources(), engine_names()) == []


def test_the_engine_name_check_sees_a_comparison():
    """The check itself: comparisons with a name, a tuple of names and a constant bound to them are
    found (and where they are); an adapter's own and an allowed meaning are not."""
    names = engine_names()
    assert {"deepspeed", "fsdp2", "torch_tp", "torch_pp", "torch", "vllm"} <= names
    code = ('PAGED = ("vllm",)\n'
            'if layout.engine == "deepspeed": pass\n'
            'if engine in ("fsdp2", "torch_tp"): pass\n'
            'if cfg.rollout.engine not in PAGED: pass\n'
            'if "torch" != kind: pass\n'
            'if phase == "rollout": pass\n'
            'match engine:\n    case "torch_pp": pass\n')
    found = engine_name_comparisons({"recipes/x.py": ast.parse(code), "rlhf_switch/engines/x.py": ast.parse(code),
                                     "rlhf_switch/compat.py": ast.parse('if choice == "vllm": pass\n')}, names)
    assert [f.split(": ")[0] for f in found] == [f"recipes/x.py:{n}" for n in (2, 3, 4, 5, 8)]
