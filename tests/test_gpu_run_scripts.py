"""benchmarks/gpu/prepare_wheels.sh and run_on_gpu.sh on CPU: the wheel list is exactly what the
short-loan GPU image lacks, the arguments are checked, the dry run prints the commands, and a
real call installs wheels offline and writes its summary."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
PREPARE, RUN = ROOT / "benchmarks/gpu/prepare_wheels.sh", ROOT / "benchmarks/gpu/run_on_gpu.sh"
# What the GPU machine has (issue 31), each with its own dependencies.
GPU_IMAGE = [
    "torch",
    "transformers",
    "triton",
    "numpy",
    "pyarrow",
    "safetensors",
    "tokenizers",
    "peft",
    "pytest",
]
# Runtime dependencies the GPU check and the GPU quickstart do not import, and why.
NOT_ON_THE_GPU_PATH = {
    "math-verify": "imported only by the math scorer, which the quickstart task does not use",
    "matplotlib": "curves.png is skipped when it is absent (trainer/tracking.py)",
    "tensorboard": "only for trainer.logger=[tensorboard]",
    "ninja": "builds the CPU decoding kernels only",
}


def _name(text: str) -> str:
    return re.sub(r"[-_.]+", "-", text).lower()


def _closure(roots: list[str]) -> set[str]:
    """The roots and everything they require (installed metadata of this environment)."""
    seen: set[str] = set()
    stack = [_name(r) for r in roots]
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.distribution(name).requires or []
        except metadata.PackageNotFoundError:
            continue  # triton: not on a CPU machine (it requires nothing the project needs)
        for text in requires:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                stack.append(_name(req.name))
    return seen


def _script_wheels() -> dict[str, str]:
    body = PREPARE.read_text().split("WHEELS=(", 1)[1].split(")", 1)[0]
    pins = [line.split("#")[0].strip() for line in body.splitlines()]
    return dict(_name_version(pin) for pin in pins if pin)


def _name_version(pin: str) -> tuple[str, str]:
    name, version = pin.split("==")
    return _name(name), version


def test_wheel_list_is_exactly_what_the_gpu_image_lacks():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    roots = [Requirement(r).name for r in project if _name(Requirement(r).name) not in NOT_ON_THE_GPU_PATH]
    assert set(NOT_ON_THE_GPU_PATH) <= {_name(Requirement(r).name) for r in project}
    missing = _closure(roots) - _closure(GPU_IMAGE)
    wheels = _script_wheels()
    assert set(wheels) == missing, (sorted(wheels), sorted(missing))
    # Pinned to what this checkout is tested with.
    assert wheels == {name: metadata.version(name) for name in wheels}
    assert wheels["megatron-core"] == "0.16.1"


def _run(script: Path, *args: str, env: dict | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(script), *args], capture_output=True, text=True, cwd=cwd,
                          env={**os.environ, **(env or {})}, timeout=300)  # fmt: skip


@pytest.mark.parametrize(("script", "args", "message"), [
    (PREPARE, ["--bogus"], "unknown option --bogus"),
    (PREPARE, ["a", "b"], "one DIR only, got a and b"),
    (RUN, ["--bogus", "out"], "unknown option --bogus"),
    (RUN, ["a", "b"], "one OUT only, got a and b"),
    (RUN, ["--wheels"], "--wheels needs a folder"),
    (RUN, [], "no output folder: pass OUT or set $OUT"),
])  # fmt: skip
def test_bad_arguments_are_usage_errors(script, args, message):
    result = _run(script, *args, env={"OUT": ""})
    assert result.returncode == 2 and message in result.stderr and "usage:" in result.stderr


def test_prepare_dry_run_downloads_cp312_manylinux_wheels_only(tmp_path):
    result = _run(PREPARE, "--dry-run", str(tmp_path / "w"))
    assert result.returncode == 0, result.stderr
    command = result.stdout.split()
    for flag in ("--no-deps", "--only-binary=:all:", "--python-version", "3.12", "manylinux2014_x86_64"):
        assert flag in command
    assert dict(_name_version(word) for word in command if "==" in word) == _script_wheels()
    assert not (tmp_path / "w").exists()


def test_run_dry_run_prints_every_command_within_the_time_budget(tmp_path):
    result = _run(RUN, "--dry-run", "--wheels", str(tmp_path / "whl"), env={"OUT": str(tmp_path / "out")})
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[
        0
    ] == f"export PYTHONPATH={ROOT}:{os.environ.get('TMPDIR', '/tmp')}/verl_megatron_gpu_site" + (
        f":{os.environ['PYTHONPATH']}" if os.environ.get("PYTHONPATH") else ""
    )
    install, check, grpo = lines[1:]
    assert install.startswith("timeout 60 python -m pip install --no-deps --no-index --target ")
    assert f"{tmp_path}/whl/*.whl" in install
    # no GPU here: one process (torchrun at dp = the GPU count on 2+ GPUs)
    assert check.startswith("timeout 300 python benchmarks/gpu/gpu_check.py --size 0.5b")
    assert f"--out {tmp_path}/out/gpu_check.json" in check
    assert "configs/gpu_quickstart.yaml" in grpo and f"trainer.default_local_dir={tmp_path}/out/grpo" in grpo
    limits = [int(line.split()[1]) for line in (install, check, grpo)]
    assert limits == [60, 300, 170]  # GRPO gets what a full-length gpu_check leaves of the 8 minutes
    assert not (tmp_path / "out").exists()


def _wheel(folder: Path) -> Path:
    """A minimal pure-Python wheel (one module): what pip installs offline from a folder."""
    folder.mkdir()
    path = folder / "probe_pkg-1.0-py3-none-any.whl"
    info = "probe_pkg-1.0.dist-info"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("probe_pkg.py", "VALUE = 42\n")
        zf.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: probe_pkg\nVersion: 1.0\n")
        zf.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        zf.writestr(f"{info}/RECORD", "")
    return folder


def test_a_real_call_installs_offline_and_records_each_stage(tmp_path):
    """On CPU the 0.5B check refuses at once (exit 2), and with a 30 s budget the GRPO run is skipped."""
    env = {
        "TMPDIR": str(tmp_path),
        "RUN_ON_GPU_TOTAL_S": "30",
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    }
    result = _run(
        RUN, "--wheels", str(_wheel(tmp_path / "whl")), str(tmp_path / "out"), env=env, cwd=tmp_path
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert (tmp_path / "verl_megatron_gpu_site" / "probe_pkg.py").read_text() == "VALUE = 42\n"
    summary = json.loads((tmp_path / "out" / "run_on_gpu.json").read_text())
    assert summary["gpus"] == 0 and summary["install"]["exit"] == 0 and summary["gpu_check"]["exit"] == 2
    assert "grpo" not in summary and "grpo: skipped" in result.stdout
    assert "--size 0.5b on CPU would take hours" in (tmp_path / "out" / "gpu_check.log").read_text()


def test_run_refuses_without_wheels(tmp_path):
    result = _run(RUN, "--wheels", str(tmp_path), str(tmp_path / "out"))
    assert result.returncode == 2 and "no wheels in" in result.stderr and "prepare_wheels.sh" in result.stderr


def _image_site(folder: Path) -> Path:
    """A folder of links to the installed files of the GPU image's closure and the wheels' packages
    only (plus ninja, for the CPU decoding kernels this CPU run uses): ``python -S`` with it on
    PYTHONPATH sees what the GPU machine would after run_on_gpu.sh's install."""
    allowed = _closure(GPU_IMAGE) | set(_script_wheels()) | {"ninja"}
    folder.mkdir()
    for dist in metadata.distributions():
        if _name(dist.metadata["Name"]) not in allowed:
            continue
        for top in {str(f).split("/")[0] for f in dist.files or []} - {"..", "__pycache__"}:
            source, link = Path(dist.locate_file(top)), folder / top
            if source.exists() and not top.endswith(".pth") and not link.exists():
                link.symlink_to(source)
    return folder


def test_the_gpu_check_imports_nothing_past_the_image_and_the_wheels(tmp_path):
    """The CPU fallback of gpu_check.py (the same imports as the GPU run) with only those packages."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{_image_site(tmp_path / 'site')}", "OMP_NUM_THREADS": "1"}
    argv = ["--prompts", "2", "--group", "2", "--prompt-len", "6", "--response-len", "5", "--micro-batch", "2",
            "--workdir", str(tmp_path / "work"), "--out", str(tmp_path / "summary.json")]  # fmt: skip
    command = [sys.executable, "-S", str(ROOT / "benchmarks/gpu/gpu_check.py"), *argv]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert all(json.loads((tmp_path / "summary.json").read_text())["checks"].values())
    # And the site really lacks the rest of this environment (e.g. matplotlib, math-verify).
    missing = subprocess.run([sys.executable, "-S", "-c", "import matplotlib"], env=env, capture_output=True)
    assert missing.returncode == 1 and b"No module named 'matplotlib'" in missing.stderr


def test_curves_are_skipped_without_matplotlib(tmp_path, monkeypatch, capsys):
    """The GPU image has no matplotlib: the GRPO run's end must not fail on curves.png."""
    from verl_megatron.trainer.tracking import plot_curves

    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "critic/score/mean": 0.5}\n')
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what an absent package imports as
    assert plot_curves(str(tmp_path / "metrics.jsonl"), str(tmp_path / "curves.png")) is None
    assert "matplotlib is not installed: no" in capsys.readouterr().out
    assert not (tmp_path / "curves.png").exists()
