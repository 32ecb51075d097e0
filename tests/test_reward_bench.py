"""Smoke test of benchmarks/bench_reward.py in --quick mode."""

import json
import runpy
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_reward.py"


def test_quick_benchmark_writes_consistent_json(tmp_path, monkeypatch, capsys):
    out = tmp_path / "reward.json"
    monkeypatch.setattr(sys, "argv", [str(BENCH), "--quick", "--out", str(out)])
    bench = runpy.run_path(str(BENCH), run_name="__main__")
    result = json.loads(out.read_text())
    assert (result["samples"], result["repeats"]) == (100, 1)
    rows = result["results"]
    assert [(r["workload"], r["manager"]) for r in rows][:4] == [
        ("gsm8k", "naive (in-process)"),
        ("gsm8k", "naive, isolated worker (user scorer default)"),
        ("gsm8k", "parallel, 2 workers"),
        ("gsm8k", "parallel, 4 workers"),
    ]
    assert len(rows) == 8
    # Every manager scored the same batch identically (the script also checks the tensors).
    for workload in ("gsm8k", "math (math-verify)"):
        assert len({r["mean_reward"] for r in rows if r["workload"] == workload}) == 1
    assert all(r["samples_per_s"] > 0 for r in rows)
    # The gsm8k mean reward is the share of right answers the generator made (seed 0).
    rng = bench["random"].Random(0)
    samples = [bench["gsm8k_sample"](rng) for _ in range(100)]
    right = sum(response.endswith(f"#### {int(truth):,}") for _, response, truth in samples)
    assert 20 < right < 80
    assert rows[0]["mean_reward"] == right / 100
    printed = capsys.readouterr().out
    assert "| workload | manager | seconds | samples/s |" in printed
