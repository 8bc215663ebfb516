"""Imports point downwards: the package never imports the layers above it (``recipes``, ``actors``),
and ``rlhf_switch.compat`` imports neither DeepSpeed nor vLLM until a patch is applied."""
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


# inside the package, each layer may import only the layers below it
LAYERS = {"device": set(), "vps": set(), "routing": {"vps"}, "families": {"vps"}, "models": {"vps", "families"},
          "testing": {"vps", "families", "models", "rl"}, "rl": {"vps", "families", "models"},
          "engines": {"vps", "routing", "families", "models", "rl", "compat", "launch", "device"},
          "elastic": {"vps", "routing", "families", "models", "rl", "compat", "launch", "engines", "device"},
          # the cost model asks the engine registry which layouts each engine runs (no process group)
          "tune": {"vps", "families", "models", "rl", "engines", "device"}}


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
