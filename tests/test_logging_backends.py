"""The run log's backends (``logging: [tensorboard, wandb, mlflow]``, recipes/run_log.py): every
record's numbers arrive in each, read back from what the backend stored (TensorBoard's event
files, W&B's offline run file, MLflow's SQLite store); a backend that is not installed is refused
before anything starts. wandb and mlflow are the optional extras `make test` installs: a test of
one that is missing fails, naming the extra (it does not skip)."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from test_loop_inputs import config

RECORDS = [  # what the loop writes: an evaluation, then iterations (nested dicts of numbers too)
    ({"iteration": 0, "heldout_reward": 0.25, "eval": "before", "eval_seconds": 1.5}, 0),
    ({"iteration": 0, "reward_mean": 0.5, "handoff": "p2p", "stale_check_passed": True,
      "phase_seconds": {"reward": 0.01, "update": 0.4}, "example": {"prompt": "1+1=", "response": "2"}}, 0),
    ({"iteration": 1, "reward_mean": 0.75, "phase_seconds": {"reward": 0.02, "update": 0.3}}, 1),
]
EXPECTED = {  # name -> {step: value}
    "heldout_reward": {0: 0.25}, "eval_seconds": {0: 1.5}, "reward_mean": {0: 0.5, 1: 0.75},
    "phase_seconds/reward": {0: 0.01, 1: 0.02}, "phase_seconds/update": {0: 0.4, 1: 0.3},
}


def need(module: str, extra: str):
    try:
        return __import__(module)
    except ImportError:
        pytest.fail(f"{module} is not installed: pip install -e '.[{extra}]' (make test installs it)")


def write_run(out: Path, backends: list[str]) -> None:
    from recipes.run_log import MetricsLog

    out.mkdir(parents=True, exist_ok=True)
    log = MetricsLog(out, backends, config={"seed": 7, "algorithm": {"name": "grpo", "lr": 1e-4}})
    for rec, step in RECORDS:
        log.write(rec, step)
    log.close()
    assert [r for r in log.records()] == [rec for rec, _ in RECORDS]  # metrics.jsonl as before


def test_scalars_are_the_numbers_of_a_record():
    from recipes.run_log import scalars

    values = {}
    for rec, step in RECORDS:
        for k, v in scalars(rec).items():
            values.setdefault(k, {})[step] = v
    assert values == EXPECTED  # not the iteration, the strings, the bools


def test_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    write_run(tmp_path, ["tensorboard"])
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    got = {k: {e.step: pytest.approx(e.value) for e in events.Scalars(k)} for k in events.Tags()["scalars"]}
    assert got == EXPECTED


def _wandb_records(path: Path):
    """The records of a W&B run file: a LevelDB-style log (32 KiB blocks; each chunk a 7-byte
    header: CRC, length, type full/first/middle/last) after W&B's 7-byte file header."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's trailer
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0:  # zero padding
            pos += block - pos % block if pos % block else 0
        elif kind == 1:
            yield chunk
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            yield pending + chunk


def test_wandb_offline(tmp_path, monkeypatch):
    need("wandb", "wandb")
    from google.protobuf.message import DecodeError
    from wandb.proto import wandb_internal_pb2

    for var, value in {"WANDB_MODE": "offline", "WANDB_CONFIG_DIR": tmp_path / "config",
                       "WANDB_CACHE_DIR": tmp_path / "cache", "WANDB_DATA_DIR": tmp_path / "data",
                       "WANDB_SILENT": "true"}.items():
        monkeypatch.setenv(var, str(value))
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    monkeypatch.delenv("WANDB_NAME", raising=False)
    write_run(tmp_path / "run", ["wandb"])
    (run_file,) = (tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb")
    records = []
    deadline = time.monotonic() + 60
    while not any(r.WhichOneof("record_type") == "exit" for r in records):
        # finish() can return before W&B's service has flushed the file: it is complete at its exit record
        assert time.monotonic() < deadline, f"{run_file}: no exit record after 60 s"
        time.sleep(0.2)
        try:
            records = [wandb_internal_pb2.Record.FromString(raw) for raw in _wandb_records(run_file)]
        except DecodeError:  # a record half written
            records = []
    got, config, project = {}, {}, None
    for rec in records:
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item}
            step = items.pop("_step")
            for k, v in items.items():
                if not k.startswith("_"):
                    got.setdefault(k, {})[step] = pytest.approx(v)
        elif kind in ("run", "config"):  # the run's first record holds its config
            if kind == "run":
                project = rec.run.project
            update = rec.run.config.update if kind == "run" else rec.config.update
            config.update({i.key: json.loads(i.value_json) for i in update})
    assert got == EXPECTED
    assert config["seed"] == 7 and config["algorithm"] == {"name": "grpo", "lr": 1e-4}
    assert project == "rlhf-switch"


def _mlflow_values(uri: str) -> tuple[dict, dict, str]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("rlhf-switch").experiment_id])
    got = {k: {m.step: pytest.approx(m.value) for m in client.get_metric_history(run.info.run_id, k)}
           for k in run.data.metrics}
    return got, run.data.params, run.info.status


def test_mlflow_in_the_output_directory(tmp_path, monkeypatch):
    need("mlflow", "mlflow")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    write_run(tmp_path / "run", ["mlflow"])
    got, params, status = _mlflow_values(f"sqlite:///{tmp_path / 'run' / 'mlflow.db'}")
    assert got == EXPECTED
    assert params == {"seed": "7", "algorithm.name": "grpo", "algorithm.lr": "0.0001"} and status == "FINISHED"


def test_mlflow_at_its_tracking_uri(tmp_path, monkeypatch):
    need("mlflow", "mlflow")
    uri = f"sqlite:///{tmp_path / 'elsewhere.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.chdir(tmp_path)  # MLflow's own default for that store's artifacts: ./mlruns
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    write_run(tmp_path / "run", ["tensorboard", "mlflow"])  # several backends: each gets every record
    assert not (tmp_path / "run" / "mlflow.db").exists()
    assert _mlflow_values(uri)[0] == EXPECTED


def test_a_backend_that_does_not_start_is_one_error(tmp_path, monkeypatch):
    need("mlflow", "mlflow")
    from recipes.run_log import BackendFailed, MetricsLog

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "nosuchscheme://nowhere")
    with pytest.raises(BackendFailed, match=r"^logging: mlflow did not start: \w+") as info:
        MetricsLog(tmp_path, ["tensorboard", "mlflow"])
    assert len(str(info.value).splitlines()) == 1  # one line


def test_a_backend_not_installed_is_refused_before_anything_starts(monkeypatch):
    from rlhf_switch.problems import run_problems
    from rlhf_switch.rl.config import load_config

    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed: find_spec and import see none
    problems = run_problems(load_config(config(logging=["tensorboard", "wandb"])))
    assert problems == ["logging: wandb needs the wandb extra (wandb not installed): pip install "
                        "'rlhf-switch[wandb]', or leave wandb out of logging"]


def test_the_old_tensorboard_switch():
    from rlhf_switch.rl.config import ConfigError, load_config

    assert load_config(config()).logging == ["tensorboard"]
    assert load_config(config(tensorboard=False)).logging == []
    assert load_config(config(tensorboard=True)).logging == ["tensorboard"]
    assert "tensorboard" not in load_config(config(tensorboard=False)).model_dump()  # written as logging
    with pytest.raises(ConfigError, match="tensorboard: the old switch, beside logging — give logging only"):
        load_config(config(tensorboard=True, logging=["wandb"]))
    with pytest.raises(ConfigError, match=r"logging\[0\]: Input should be 'tensorboard', 'wandb' or 'mlflow'"):
        load_config(config(logging=["neptune"]))
    with pytest.raises(ConfigError, match="logging: mlflow named more than once"):
        load_config(config(logging=["mlflow", "mlflow"]))
