"""The benchmark results block is generated, never pasted, and --quick never overwrites the
committed results (issue 19).

- the committed benchmarks/results/results.json renders to exactly the block between the
  markers of benchmarks/README.md (and of README.md, once it carries the markers);
- render() puts each ratio beside its target and says met / not met;
- run.py --quick defaults to a fresh temporary folder and refuses benchmarks/results/;
- single_process_env hides (and restores) the torch.distributed variables that turned TRL's
  peer run into a DDP run.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"


def _load(name: str):
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))  # run.py imports its sibling modules by name
    spec = importlib.util.spec_from_file_location(f"bench_{name}_module", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being built
    spec.loader.exec_module(module)
    return module


report = _load("report")


def test_committed_readme_blocks_match_the_committed_results():
    results = json.loads((BENCH / "results" / "results.json").read_text())
    assert results["quick"] is False, "benchmarks/results/ must hold a full run"
    block = report.render(results)
    checked = 0
    for readme in report.READMES:
        text = readme.read_text()
        if report.has_block(text):
            assert report.replace_block(text, block) == text, (
                f"{readme.relative_to(REPO)}: the results block is stale; run python benchmarks/report.py"
            )
            checked += 1
    assert report.has_block((BENCH / "README.md").read_text()) and checked >= 1
    assert report.update_readmes(check=True) == []


def test_render_marks_targets():
    results = {
        "quick": False,
        "threads": 2,
        "total_seconds": 100.0,
        "machine": {"cpu_model": "cpu", "physical_cores": 2, "memory_gib": 8, "versions": {"torch": "2"}},
        "sections": {
            "update": {
                "ratios": {"tokens/s ours / HF (best)": 1.25, "CPU MFU ours (fraction of matmul peak)": 0.5}
            },
            "memory": {"ratios": {"stage peak ours / full [B,T,V] float32 logits": 0.125}},
            "other": {"ratios": {"x / y": None}, "errors": {"peer": "boom"}},
            "real_shape": {"ratios": {"log-prob stage peak ours / full [B,T,V] float32 logits": 0.25}},
        },
    }
    lines = report.render(results).splitlines()
    assert "| update | tokens/s ours / HF (best) | 1.25 | >= 1: met |" in lines
    assert "| update | CPU MFU ours (fraction of matmul peak) | 0.50 | >= 0.6: not met |" in lines
    assert "| memory | stage peak ours / full [B,T,V] float32 logits | 0.12 | <= 0.25: met |" in lines
    assert "| other | x / y | n/a |  |" in lines
    assert "| other | peer could not run (see other.md) | n/a | |" in lines
    assert (
        "| real_shape | log-prob stage peak ours / full [B,T,V] float32 logits | 0.25 | <= 0.2: not met |"
        in lines
    )


def test_replace_block_keeps_the_rest():
    text = "a\n<!-- bench:begin -->\nold\nlines\n<!-- bench:end -->\nb\n"
    assert report.replace_block(text, "new") == "a\n<!-- bench:begin -->\nnew\n<!-- bench:end -->\nb\n"
    with pytest.raises(ValueError, match="exactly one"):
        report.replace_block("no markers\n", "new")


def test_quick_defaults_to_a_temporary_folder_and_refuses_the_committed_one():
    run = _load("run")
    args = run.parse_args(["--quick", "--only", "update"])
    try:
        out = Path(args.out).resolve()
        assert out != run.RESULTS_DIR.resolve() and run.RESULTS_DIR.resolve() not in out.parents
        assert out.is_dir() and not any(out.iterdir())  # a fresh folder
    finally:
        shutil.rmtree(args.out, ignore_errors=True)
    with pytest.raises(SystemExit):
        run.parse_args(["--quick", "--out", str(BENCH / "results")])
    assert Path(run.parse_args(["--only", "update"]).out).resolve() == run.RESULTS_DIR.resolve()


def test_single_process_env_hides_and_restores_dist_variables(monkeypatch):
    common = _load("common")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    with common.single_process_env():
        assert not {"RANK", "WORLD_SIZE", "LOCAL_RANK"} & set(os.environ)
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]) == ("0", "1", "0")
