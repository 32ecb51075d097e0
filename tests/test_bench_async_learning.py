"""benchmarks/bench_async.py's learning part on its own (``--learning-only``, ``--seeds``): the
seed-to-seed noise of steps-to-target is measured with it, so the flags must give exactly the
learning runs asked for and leave the default full run as it is."""

from __future__ import annotations

import pytest

from tests.bench_modules import bench_module


def _config(*argv: str):
    bench = bench_module("bench_async")
    return bench, bench.config_from_args(bench.parser().parse_args(list(argv)))


def test_default_full_run_keeps_both_parts():
    bench, config = _config()
    assert config == bench.FULL
    assert config.learning and config.workloads == ("quickstart", "long", "long-tail")


def test_learning_only_runs_no_workload_and_the_given_seeds():
    bench, config = _config("--learning-only", "--seeds", "1,2,3,4,5,6")
    assert config.learning and config.workloads == ()
    assert config.seeds == (1, 2, 3, 4, 5, 6)
    assert (config.learning_steps, config.test_freq, config.target) == (150, 5, 0.8)
    assert config.options == bench.FULL.options
    _, quick = _config("--quick", "--learning-only")  # --quick alone skips learning
    assert quick.learning and quick.workloads == ()


def test_no_learning_and_learning_only_exclude_each_other():
    bench = bench_module("bench_async")
    with pytest.raises(SystemExit):
        bench.parser().parse_args(["--no-learning", "--learning-only"])
    with pytest.raises(ValueError, match="unknown workloads"):
        bench.config_from_args(bench.parser().parse_args(["--workloads", "nope"]))
