"""A run's outcome as two digests, to tell whether a change of the code changed what a run does.

    python -m bench.run_digest CONFIG [--iterations N] [--out DIR] [--set algorithm.lr=1e-3 ...]

Runs ``rlhf-switch train CONFIG`` (a process of its own) and prints the sha256 of the final
weights and optimizer state (``<out>/final``: every tensor's bytes, in name order) and of the
metrics every iteration recorded, less what depends on the machine rather than on the maths (wall
times, memory marks, throughput). Two commits that give the same digests for the same config and
seed ran the same run bit for bit. ``--set`` changes one config field (a dotted path, YAML value).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
# record keys that measure the machine, not the run
MACHINE = re.compile(r"seconds|_s$|per_s|peak_device|breakdown|rss|memory|measure|nodes|wall")


def weights_digest(final: Path) -> str:
    """sha256 over every tensor of every ``*.safetensors`` under ``final`` (names sorted)."""
    from safetensors.torch import load_file

    h = hashlib.sha256()
    for f in sorted(final.rglob("*.safetensors")):
        tensors = load_file(str(f))
        for name in sorted(tensors):
            h.update(f"{f.relative_to(final)}:{name}".encode())
            h.update(tensors[name].contiguous().view(-1).view(dtype=__import__("torch").uint8).numpy().tobytes())
    return h.hexdigest()


def _drop_machine(value):
    if isinstance(value, dict):
        return {k: _drop_machine(v) for k, v in sorted(value.items()) if not MACHINE.search(k)}
    if isinstance(value, list):
        return [_drop_machine(v) for v in value]
    return value


def metrics_digest(metrics: Path) -> tuple[str, int]:
    """sha256 of the records (machine-dependent keys dropped), and how many records."""
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    kept = [_drop_machine(r) for r in records]
    return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest(), len(kept)


def set_field(cfg: dict, dotted: str, value: str) -> None:
    *path, last = dotted.split(".")
    node = cfg
    for part in path:
        node = node.setdefault(part, {})
    node[last] = yaml.safe_load(value)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config")
    ap.add_argument("--iterations", type=int)
    ap.add_argument("--out", default=None, help="the run's output directory (default: runs/digest/<config name>)")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE")
    a = ap.parse_args(argv)
    cfg = yaml.safe_load(Path(a.config).read_text())
    for item in a.set:
        field, _, value = item.partition("=")
        set_field(cfg, field, value)
    out = Path(a.out or f"runs/digest/{Path(a.config).stem}")
    init = Path(cfg.get("output_dir", "")) / "init"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    if init.is_dir():  # the config's own warm start, when it has one: the same starting weights
        shutil.copytree(init, out / "init")
    cfg["output_dir"] = str(out)
    path = out.parent / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    cmd = [sys.executable, "-m", "recipes.cli", "train", str(path), "--quiet"]
    if a.iterations:
        cmd += ["--iterations", str(a.iterations)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(
        os.pathsep) if p]))
    p = subprocess.run(cmd, cwd=ROOT, env=env)
    if p.returncode:
        return p.returncode
    metrics, n = metrics_digest(out / "metrics.jsonl")
    print(json.dumps({"config": a.config, "set": a.set, "iterations": a.iterations, "weights": weights_digest(out / "final"),
                      "metrics": metrics, "records": n}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
