"""benchmarks/gpu/gpu_check.py on CPU: its argument handling, and its CPU fallback end to end on
the tiny size (the GPU run itself has not happened on this machine)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu" / "gpu_check.py"


def _script():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("argv", "message"), [
    (["--device", "cuda"], "--device cuda: no CUDA device is visible"),
    (["--size", "0.5b"], "--size 0.5b on CPU would take hours"),
    (["--prompts", "0"], "--prompts must be >= 1"),
    (["--prompts", "3", "--group", "3", "--micro-batch", "2"], "--micro-batch 2 must divide prompts x group = 9"),
])  # fmt: skip
def test_bad_arguments_are_one_line_errors(argv, message, capsys):
    assert _script().main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_defaults_on_a_cpu_machine():
    args = _script().parse_args([])
    assert (args.device, args.size) == ("cpu", "tiny")


def cpu_fallback_job(out: str, workdir: str) -> int:
    argv = ["--prompts", "2", "--group", "2", "--prompt-len", "6", "--response-len", "5", "--micro-batch", "2",
            "--workdir", workdir, "--out", out]  # fmt: skip
    return _script().main(argv)


def test_cpu_fallback_runs_every_stage(pool1, tmp_path):
    out = tmp_path / "summary.json"
    (status,) = pool1.run(f"{__name__}:cpu_fallback_job", out=str(out), workdir=str(tmp_path / "work"))
    summary = json.loads(out.read_text())
    assert status == 0, summary["checks"]
    assert summary["device"] == "cpu" and summary["spec"] == "local"
    assert summary["optimizer"] == ["DistributedOptimizer"]
    assert summary["generation_tokens_per_s"] > 0 and summary["update_tokens_per_s"] > 0
    assert summary["actor_mfu"] is None  # no peak FLOP/s known for a CPU
    assert 0 < summary["logprob_vs_fp32"]["max_abs"] < 0.5  # bf16 vs float32: close, not equal
    assert summary["offload"]["weights_exact"] and set(summary["checks"]) == {
        "update_finite", "logprobs_close_to_fp32", "distributed_optimizer", "offload_weights_exact",
    }  # fmt: skip
