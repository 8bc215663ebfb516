"""The benchmarks run, end to end, at a size CI affords: every method's destination bit-exact,
bytes moved = the plan's minimum, and the JSON they write holds what docs/benchmarks.md quotes.

Times are never asserted (``make bench`` reports them); these tests only keep the benchmarks
from rotting between the sessions that run them in full. Each bench runs as its own process,
as ``make bench`` runs it."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bench(module: str, *args: str, timeout: int = 600) -> str:
    r = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=timeout, env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 0, f"{module} exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout


@pytest.mark.slow
def test_switch_bench_every_method_exact(tmp_path):
    # case a: ZeRO-3 -> vLLM TP2×2 (weights); case d: ZeRO-1 + Adam -> TP2·DP2 ZeRO-3 + Adam
    _bench("bench.switch", "--sizes", "1M", "--dtypes", "fp32", "--cases", "a,d", "--repeats", "1",
           "--out", str(tmp_path))
    data = json.loads((tmp_path / "switch.json").read_text())
    assert (tmp_path / "switch.png").stat().st_size > 0
    assert [e["case"] for e in data["results"]] == ["a", "d"]
    for entry in data["results"]:
        methods = entry["methods"]
        assert set(methods) == {"vps", "full_gather", "dcp_disk", "dcp_shm", "raw_p2p"}, entry["case"]
        for name, rec in methods.items():
            assert rec["exact"] is True, (entry["case"], name, rec.get("mismatch"))
            assert rec["median_s"] > 0
        vps = methods["vps"]
        assert vps["bytes_moved"] == vps["min_bytes_received"] == entry["plan"]["min_bytes"] > 0
        assert vps["peak_extra_bytes"] <= vps["budget_bytes"]
        assert methods["raw_p2p"]["bytes_moved"] == vps["bytes_moved"]  # the limit moves the same bytes
        # the full gather receives whole tensors, more than the minimum
        assert methods["full_gather"]["bytes_moved"] > vps["bytes_moved"]
    assert "VPS move" in data["table"] and "raw p2p" in data["table"]


@pytest.mark.slow
def test_train_switch_bench_matches_deepspeed_universal_checkpoint(tmp_path):
    _bench("bench.train_switch", "--sizes", "1M", "--repeats", "1", "--out", str(tmp_path))
    data = json.loads((tmp_path / "train_switch.json").read_text())
    (row,) = data["rows"]
    for method in ("vps", "universal:shm", "universal:disk"):
        assert row[method]["exact"] is True, method
        assert row[method]["seconds"] > 0
    assert row["vps"]["bytes_received"] == row["vps"]["min_bytes"] > 0  # summed over the ranks
    assert 0 < row["vps"]["move_s"] <= row["vps"]["seconds"]
    assert {"save", "convert", "load"} <= set(row["universal:shm"])


def test_plan_scale_bench_moves_the_minimum(tmp_path):
    out = tmp_path / "plan_scale.json"
    _bench("bench.plan_scale", "--only", "70B TP8·PP2·DP4 ->", "--ranks", "2", "--out", str(out))
    case, back = json.loads(out.read_text())["cases"]  # train -> vLLM, then vLLM -> train (one-rank plans)
    assert (case["direction"], back["direction"]) == ("train -> vLLM", "vLLM -> train")
    assert case["world"] == back["world"] == 64 and len(case["ranks"]) == len(back["ranks"]) == 2
    assert case["rank_bytes_received"] == case["rank_min_bytes"]
    assert back["rank_bytes_received"] == back["rank_min_bytes"]
    assert case["bytes_moved"] == case["min_bytes"] > 0
    assert case["modelled_s"] > 0


@pytest.mark.heavy  # left out of `make test-fast`
def test_gpu_switch_script_runs_on_cpu(tmp_path):
    # the single-device script (NCCL/CUDA paths need a GPU) runs the same code path on a CPU
    out = tmp_path / "gpu_switch.json"
    _bench("bench.gpu_switch", "--device", "cpu", "--sizes", "0.05B", "--repeats", "1", "--out", str(out))
    data = json.loads(out.read_text())
    cases = data["sizes"]["0.05B"]["cases"]
    assert len(cases) == 2
    for name, rec in cases.items():
        assert rec["exact"] is True and rec["gather_then_load_exact"] is True, name
        assert rec["bytes"] > 0 and rec["floor_s"] > 0 and rec["gather_then_load_s"] > 0


@pytest.mark.slow
def test_handoff_bench_processes_lands_the_same_bits(tmp_path):
    # the plain-process mode (no Ray, no vLLM): p2p and ipc land the same bits, handles = buckets
    _bench("bench.handoff", "--processes", "1M", "--syncs", "2", "--budget-mib", "1",
           "--json", str(tmp_path / "handoff.json"))
    data = json.loads((tmp_path / "handoff.json").read_text())
    assert data["same_bits"] is True
    assert data["p2p"]["handles"] == 0 and data["ipc"]["handles"] >= 2
    assert data["ipc_over_p2p"] > 0


@pytest.mark.slow
def test_elastic_bench_resize_and_restart_both_exact(tmp_path):
    # the 1M model, DP4 -> DP2 only, the modelled cases at 64 ranks: both destinations bit-exact
    _bench("bench.elastic", "--sizes", "1M", "--no-back", "--model-ranks", "64", "--out", str(tmp_path),
           "--ckpt-dir", str(tmp_path))
    data = json.loads((tmp_path / "elastic.json").read_text())
    (row,) = data["rows"]
    assert (row["old_world"], row["new_world"]) == (4, 2)
    assert row["resize_exact"] is True and row["restart_exact"] is True
    assert row["tensors_compared"] > 4 * 9  # master and two moments of every tensor, the scalars
    assert row["bytes_moved"] > 0 and row["checkpoint_bytes"] > 0
    assert row["stop_the_world_s"] > 0 and row["restart_s"] > 0
    modelled = data["modelled"]
    assert {r["model"] for r in modelled} == {"70B", "235B"} and all(r["old_ranks"] == 64 or r["new_ranks"] == 64
                                                                   for r in modelled)
    assert all(r["modelled_s"] > 0 and r["rank_bytes"] > 0 for r in modelled)
    assert "modelled" in (tmp_path / "elastic.md").read_text()


@pytest.mark.heavy  # left out of `make test-fast`
def test_zero3_persistence_bench_is_bit_identical_to_plain_zero3():
    out = _bench("bench.zero3_persistence", "--rounds", "1", "--iterations", "1")
    rows = [line for line in out.splitlines() if line.startswith("| ZeRO-3")]
    assert len(rows) == 4 and all(row.endswith("| True |") for row in rows), out


@pytest.mark.slow
def test_switch_profile_reports_every_rank_against_the_floor():
    out = _bench("bench.switch_profile", "--size", "1M", "--case", "a", "--repeats", "2")
    lines = out.strip().splitlines()
    assert "VPS" in lines[0] and "% of the floor" in lines[0], out
    ranks = [line for line in lines if line.startswith("rank ")]
    assert [line.split(":")[0] for line in ranks] == [f"rank {r}" for r in range(4)], out
    for line in ranks:
        assert "messages" in line and "agree" in line and "CPU user/sys" in line and "floor" in line, line


@pytest.mark.heavy  # left out of `make test-fast`
def test_cma_runs_bench_checks_every_way_it_times():
    out = _bench("bench.cma_runs", "--run-bytes", "768,4096", "--mbytes", "0.5")
    rows = [line.split() for line in out.strip().splitlines()[1:]]
    assert len(rows) == 10 and {r[0] for r in rows} == {"768B", "4096B"}, out
    assert all(float(r[-2]) > 0 for r in rows), out  # CPU ms of each way


# ---------------------------------------------------------------- time to reward (no run)


def _iterations(rewards, seconds=2.0):
    return [{"iteration": i, "reward_mean": r, "iteration_seconds": seconds} for i, r in enumerate(rewards)]


def test_time_to_reward():
    from bench.algorithms import time_to_reward

    recs = _iterations([0.1, 0.3, 0.2, 0.5, 0.4])
    # evaluations (no reward_mean) are not iterations, and the order of the file does not matter
    recs = [{"iteration": 0, "heldout_reward": 0.9, "eval": "before"}] + recs[::-1]
    assert time_to_reward(recs, 0.3) == 4.0        # the end of iteration 1: 2 iterations of 2 s
    assert time_to_reward(recs, 0.1) == 2.0        # the first iteration already reaches it
    assert time_to_reward(recs, 0.5) == 8.0
    assert time_to_reward(recs, 0.51) is None      # never
    assert time_to_reward([], 0.0) is None
    # with a window, the mean of that many iterations: (0.3 + 0.2 + 0.5) / 3 at iteration 3
    assert time_to_reward(recs, 1 / 3, window=3) == 8.0
    uneven = [dict(r, iteration_seconds=s) for r, s in zip(_iterations([0.0, 0.0, 1.0]), (1.5, 0.25, 3.0))]
    assert time_to_reward(uneven, 1.0) == 4.75
    with pytest.raises(ValueError, match="window must be >= 1"):
        time_to_reward(recs, 0.3, window=0)


def test_async_rollout_reports_time_to_reward(tmp_path, monkeypatch, capsys):
    """bench.async_rollout's summary, target, table and JSON on made-up runs of the long config
    (side_by_side stands in for the runs: each writes a metrics.jsonl as the loop does)."""
    from bench import async_rollout

    curves = {"sync": [0.1, 0.2, 0.3, 0.4, 0.5], "one_step": [0.1, 0.3, 0.5, 0.5, 0.6]}
    seconds = {"sync": 3.0, "one_step": 2.0}

    def fake_side_by_side(base, modes, seeds, out, iterations, configure, summarise, report):
        assert base["task"]["length_skew"] > 0 and base["checkpoint"]["save_every"] == 0
        results = []
        for seed in seeds:
            for mode in modes:
                cfg = json.loads(json.dumps(base))
                configure(cfg, mode)
                run = out / f"{mode}_seed{seed}"
                run.mkdir(parents=True)
                recs = [dict(r, samples_per_s=32 / seconds[mode], phase_seconds={"rollout": 0.5},
                             staleness_max=cfg["algorithm"]["off_policy"]["max_staleness"])
                        for r in _iterations(curves[mode], seconds[mode])]
                (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
                res = {"mode": mode, "seed": seed, "heldout_before": 0.1, "heldout_after": 0.2,
                       "heldout_change": 0.1, "stale_check_passed": True}
                results.append(summarise(run, res))
                report(results[-1])
        return results

    monkeypatch.setattr(async_rollout, "side_by_side", fake_side_by_side)
    config = os.path.join(ROOT, "configs", "grpo_20m_long.yaml")
    assert async_rollout.main(["--config", config, "--iterations", "5", "--seeds", "0",
                               "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "async_rollout.json").read_text())
    sync, one_step = data["runs"]
    # the seed's sync run's last 3 iterations: (0.3 + 0.4 + 0.5) / 3
    assert sync["reward_target"] == one_step["reward_target"] == pytest.approx(0.4)
    assert sync["time_to_reward_s"] == 12.0 and one_step["time_to_reward_s"] == 6.0
    assert one_step["reward_final"] == pytest.approx(1.6 / 3) and one_step["staleness"] == [1]
    assert data["samples_per_s_ratios"]["one_step"] == pytest.approx(1.5)
    out = capsys.readouterr().out
    assert "reward target: per seed, sync's" in out and "| time to reward (s) |" in out and "| 0.400 | 12.0 |" in out
    # a given target; one that is never reached
    assert async_rollout.main(["--config", config, "--iterations", "5", "--seeds", "0", "--reward-target", "0.55",
                               "--out", str(tmp_path / "b")]) == 0
    sync, one_step = json.loads((tmp_path / "b" / "async_rollout.json").read_text())["runs"]
    assert sync["time_to_reward_s"] is None and one_step["time_to_reward_s"] == 10.0
    assert "| never |" in capsys.readouterr().out
