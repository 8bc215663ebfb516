"""Mutation testing of named modules against their fast tests: what ``make mutate FILES=...`` runs.

    python tools/mutate.py rlhf_switch/routing/verify.py [more modules] [--tests tests/test_x.py ...]

mutmut (configured in pyproject.toml's ``[tool.mutmut]``) copies the packages into ``mutants/``,
rewrites every function of the named modules into its mutants (one small change each: an operator,
a constant, a comparison, an argument dropped...), runs the selected tests once to learn which test
reaches which function, and then runs, for each mutant, only the tests that reach its function
(``-x``: the first failure kills it), two mutants at a time by default. This script sets the two
things that change from run to run without editing pyproject.toml: which modules are mutated
(mutmut's ``only_mutate``) and which tests run (``pytest_add_cli_args_test_selection``; by default
the test file named after each module and every test file that imports the module, directly or
through a helper module of tests/; always only the fast tier, pyproject's ``pytest_add_cli_args``).

It ends with a score per module: killed / total, the survivors with a one-line diff each, and the
mutants no selected test reached. mutmut learns which tests reach a function in the pytest process
only: a function reached only in a process a test spawns (a ``LocalWorld`` rank, a Ray actor) has
no test for mutmut, and its mutants count as "no tests" unless ``--unreached all`` runs every
selected test on them (slow: a rank world per mutant).

``--functions`` mutates only some functions of the modules (``Class.method``, ``Class.*``, a
top-level ``function``; ``*`` matches any run of characters): the part of a large module a change
touched, such as the ``algorithm`` block's classes of ``rl/config.py``. The score then counts those
functions' mutants only. (mutmut mutates functions only, and not those with decorators other than
``@staticmethod`` and ``@classmethod``: pydantic's validators and properties have no mutants.)

``mutants/`` is made anew by every run; ``--again`` keeps it and reruns only the last run's
survivors (and mutants without tests), after a new test was written, for example. Read one
mutant in full with ``mutmut show <name>`` (from the repository root).
"""
from __future__ import annotations

import argparse
import ast
import os
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("rlhf_switch", "actors", "recipes")  # pyproject's [tool.mutmut] source_paths
DETECTED = ("killed", "timeout", "crashed")  # a test run that did not pass: the mutant was noticed
TIMEOUT_CODES = (-24, 24, 152, 255, 36)  # mutmut's: SIGXCPU (its time limit), or its own timeout code


def status_of(exit_code: int | None) -> str:
    """A mutant's verdict from its test run's exit code: mutmut's words, except that a run killed
    by a signal other than the time limit (SIGABRT from gloo, SIGSEGV, ...) is "crashed": the
    tests did not pass, so the mutant was noticed (mutmut calls SIGABRT "suspicious")."""
    from mutmut.stats import status_by_exit_code

    if exit_code is not None and exit_code < 0 and exit_code not in TIMEOUT_CODES:
        return "crashed"
    return status_by_exit_code[exit_code]


def module_name(path: str) -> str:
    """``rlhf_switch/routing/verify.py`` -> ``rlhf_switch.routing.verify``."""
    p = Path(path).with_suffix("")
    parts = p.parts[:-1] if p.name == "__init__" else p.parts
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports (absolute, any depth), with ``from a.b import c`` also as ``a.b.c``
    (``c`` may be a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return found


def default_tests(files: list[str], tests_dir: Path) -> list[str]:
    """The test files of ``files``: ``tests/test_<module's name>.py`` where it exists, and every
    ``tests/test_*.py`` that imports one of the modules itself (not through a helper module: the
    rank jobs of tests/ reach most of the package, and their tests are the slow ones)."""
    targets = {module_name(f) for f in files}
    named = {f"test_{Path(f).stem}.py" for f in files}
    picked = sorted(p for p in tests_dir.glob("test_*.py") if p.name in named or _imports(p) & targets)
    return [str(p.relative_to(REPO)) for p in picked]


def _check_files(files: list[str]) -> list[str]:
    out = []
    for f in files:
        p = (REPO / f).resolve()
        rel = p.relative_to(REPO) if p.is_relative_to(REPO) else None
        if rel is None or not p.is_file() or p.suffix != ".py" or rel.parts[0] not in PACKAGES:
            raise SystemExit(f"mutate: {f} is not a module of {', '.join(PACKAGES)} (a .py file under them)")
        out.append(str(rel))
    return out


def _configure(files: list[str], tests: list[str], time_limit: tuple[float, float] | None = None):
    """mutmut's config of this run: pyproject's [tool.mutmut], with the modules and the tests;
    ``time_limit``: (constant, multiplier) of mutmut's CPU-time limit per mutant,
    ``(tests' time + constant) · multiplier · 2`` (mutmut's defaults otherwise)."""
    from mutmut import configuration

    configuration.reset_config()
    cfg = configuration.config()
    cfg.only_mutate = list(files)
    cfg.pytest_add_cli_args_test_selection = list(tests)
    if time_limit is not None:
        cfg.timeout_constant, cfg.timeout_multiplier = time_limit
    return cfg


def _give_unreached_every_test(files: list[str]) -> None:
    """After mutmut's stats pass: every function of ``files`` that no test reached in the pytest
    process gets every selected test (it may be reached in a process a test spawns)."""
    import mutmut.__main__ as mm
    from mutmut.mutation.data import SourceFileMutationData
    from mutmut.state import state
    from mutmut.utils.format_utils import mangled_name_from_mutant_name

    collect = mm.collect_or_load_stats

    def collect_then_fill(runner, **kwargs):
        collect(runner, **kwargs)
        everything = set(state().duration_by_test)
        for f in files:
            data = SourceFileMutationData(path=f)
            data.load()
            for key in data.exit_code_by_key:
                fn = mangled_name_from_mutant_name(key)
                if not state().tests_by_mangled_function_name.get(fn):
                    state().tests_by_mangled_function_name[fn] = set(everything)

    mm.collect_or_load_stats = collect_then_fill


def _time_fixtures_and_run_fastest_first() -> None:
    """Two changes to how mutmut runs the tests, both in this process before it forks:

    * its stats pass records each test's call only; a test that first asks for a module's rank
      world (``world4``: four spawned gloo processes) spends tens of seconds in the fixture. Setup
      and teardown count too here, so a mutant's time limit and its place in the queue see them;
    * each mutant's tests run shortest first (its run stops at the first failure), so a mutant a
      pure test kills never waits for a rank world."""
    import mutmut.__main__ as mm
    from mutmut.runners.harness import PytestRunner
    from mutmut.state import state

    class FixtureTimes:
        def pytest_runtest_makereport(self, item, call):
            if call.when in ("setup", "teardown"):
                state().duration_by_test[item.nodeid] += call.duration

    execute = PytestRunner.execute_pytest

    def execute_timing_fixtures(self, params, **kwargs):
        if kwargs.get("plugins"):  # the stats pass (and the listing of tests, which runs none)
            kwargs["plugins"] = [*kwargs["plugins"], FixtureTimes()]
        return execute(self, params, **kwargs)

    PytestRunner.execute_pytest = execute_timing_fixtures
    make_runner = mm.get_mutant_runner

    def runner_fastest_first(*args, **kwargs):
        runner = make_runner(*args, **kwargs)
        submit = runner.submit

        def submit_sorted(mutant_name, tests, *rest):
            seconds = state().duration_by_test
            return submit(mutant_name, sorted(tests, key=lambda t: (seconds.get(t, 0.0), t)), *rest)
        runner.submit = submit_sorted
        return runner

    mm.get_mutant_runner = runner_fastest_first


def mutant_patterns(files: list[str], functions: list[str]) -> list[str]:
    """mutmut's names (fnmatch patterns) of the mutants of ``functions`` in every module of
    ``files``: ``Class.method`` -> ``<module>.xǁClassǁmethod__mutmut_*``, ``function`` ->
    ``<module>.x_function__mutmut_*``."""
    out = []
    for f in files:
        for fn in functions:
            cls, dot, name = fn.rpartition(".")
            stem = f"xǁ{cls}ǁ{name}" if dot else f"x_{name}"
            out.append(f"{module_name(f)}.{stem}" + ("" if stem.endswith("*") else "__mutmut_*"))
    return out


def _results(files: list[str], patterns: list[str] | None = None) -> dict[str, dict[str, str]]:
    """Per module: mutant name -> status (mutmut's words: killed, survived, no tests, timeout, ...);
    only the mutants ``patterns`` match where given."""
    from fnmatch import fnmatchcase

    from mutmut.mutation.data import SourceFileMutationData

    out = {}
    for f in files:
        data = SourceFileMutationData(path=f)
        data.load()
        out[f] = {k: status_of(v) for k, v in data.exit_code_by_key.items()
                  if not patterns or any(fnmatchcase(k, p) for p in patterns)}
    return out


def one_line_diff(name: str, path: str) -> str:
    """The mutant's change on one line: ``old -> new`` (the lines the diff removes and adds)."""
    from mutmut.mutation.diff_apply import get_diff_for_mutant

    try:
        diff = get_diff_for_mutant(name, path=path)
    except Exception as e:  # noqa: BLE001 - a summary line, not a failure of the run
        return f"(no diff: {e})"
    lines = diff.splitlines()
    old = [line[1:].strip() for line in lines if line.startswith("-") and not line.startswith("---")]
    new = [line[1:].strip() for line in lines if line.startswith("+") and not line.startswith("+++")]
    return f"{' / '.join(old) or '(nothing)'}  ->  {' / '.join(new) or '(removed)'}"


def summarise(files: list[str], seconds: float, patterns: list[str] | None = None) -> int:
    """Print each module's score, its survivors and timeouts (one line each) and, per function, the
    mutants no selected test reached; returns how many mutants went undetected. ``patterns``: only
    the mutants they match (``--functions``)."""
    undetected = 0
    print()
    print(f"mutation score ({seconds / 60:.1f} min for {len(files)} module(s))")
    for f, statuses in _results(files, patterns).items():
        total = len(statuses)
        counts: dict[str, int] = {}
        for s in statuses.values():
            counts[s] = counts.get(s, 0) + 1
        killed = sum(counts.get(s, 0) for s in DETECTED)
        undetected += total - killed
        pct = 100.0 * killed / total if total else 0.0
        rest = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()) if s != "killed")
        part = " (the functions --functions names)" if patterns else ""
        print(f"\n{f}{part}: {killed}/{total} killed ({pct:.1f} %)" + (f" [{rest}]" if rest else ""))
        unreached: dict[str, int] = {}
        for name, s in sorted(statuses.items(), key=lambda kv: (kv[1], kv[0])):
            if s in ("no tests", "not checked"):
                fn = name.rpartition(".")[2].partition("__mutmut_")[0]
                unreached[f"{fn} ({s})"] = unreached.get(f"{fn} ({s})", 0) + 1
            elif s != "killed":
                print(f"  {s:9} {name}: {one_line_diff(name, f)}")
        if unreached:
            print("  without a run: " + ", ".join(f"{fn}: {n}" for fn, n in unreached.items()))
    print("\n'killed' counts a timeout (listed above: it may be a slow fixture, not a hang) and a test run killed "
          "by a signal (crashed). Read a mutant in full: mutmut show <name> (from the repository root); rerun the undetected "
          "ones after adding tests: the same command with --again (make mutate ... MUTATE_ARGS=--again)")
    return undetected


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", help="modules to mutate (paths, e.g. rlhf_switch/routing/verify.py)")
    ap.add_argument("--tests", nargs="+", default=None,
                    help="test files or node ids to run (default: the modules' test files, see the docstring)")
    ap.add_argument("--max-children", type=int, default=None,
                    help="mutants tested at once (default: the CPU count)")
    ap.add_argument("--again", action="store_true",
                    help="keep mutants/ and rerun only the last run's undetected mutants")
    ap.add_argument("--functions", nargs="+", default=None,
                    help="mutate only these functions of the modules: Class.method, Class.*, function (see the docstring)")
    ap.add_argument("--unreached", choices=("none", "all"), default="none",
                    help="functions no test reaches in the pytest process: no tests (none), or every selected test (all)")
    ap.add_argument("--time-limit", nargs=2, type=float, metavar=("CONSTANT", "MULTIPLIER"), default=None,
                    help="a mutant's CPU-time limit is (its tests' time + CONSTANT) x MULTIPLIER x 2 (mutmut's "
                         "defaults otherwise); lower it for modules whose mutants loop forever (routing/schedule.py: 10 2)")
    args = ap.parse_args(argv)

    os.chdir(REPO)  # mutmut works relative to the current directory (pyproject.toml, mutants/)
    files = _check_files(args.files)
    tests = args.tests or default_tests(files, REPO / "tests")
    if not tests:
        raise SystemExit(f"mutate: no test file for {files}; name some with --tests")
    print(f"mutating {' '.join(files)}\nwith the fast tests of {' '.join(tests)}", flush=True)

    _configure(files, tests, tuple(args.time_limit) if args.time_limit else None)
    import mutmut.__main__ as mm

    patterns = mutant_patterns(files, args.functions) if args.functions else None
    names: list[str] = list(patterns or [])
    if args.again:
        if not Path("mutants").is_dir():
            raise SystemExit("mutate: --again needs a previous run's mutants/")
        names = [n for st in _results(files, patterns).values() for n, s in st.items() if s not in DETECTED]
        if not names:
            print("nothing to rerun: every mutant of the last run was killed")
            return 0
    else:
        shutil.rmtree("mutants", ignore_errors=True)  # stale mutants of other modules or older sources
    # processes the tests start import the mutants too (multiprocessing's spawned ranks get this
    # process's sys.path; a subprocess or a Ray worker reads PYTHONPATH), never the checkout itself
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != REPO]
    os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO / "mutants")] + paths)
    _time_fixtures_and_run_fastest_first()
    if args.unreached == "all":
        _give_unreached_every_test(files)
    max_children = args.max_children or os.cpu_count() or 2
    start = time.monotonic()
    try:
        mm._run(names, max_children)
    except SystemExit as e:  # mutmut's own early exits (no test reaches the code, failing clean run)
        if e.code:
            print(f"mutate: mutmut stopped ({e.code})")
            return int(e.code) if isinstance(e.code, int) else 1
    summarise(files, time.monotonic() - start, patterns)
    return 0


if __name__ == "__main__":
    sys.exit(main())
