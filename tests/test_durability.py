"""Nothing a user trained or logged is lost: metrics history, checkpoint integrity, the output-dir
lock, resuming with a changed config, and the guard that stops a run whose weights blow up."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from verl_megatron.trainer.tracking import Tracking, read_jsonl_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}


# ------------------------------------------------------------------ metrics.jsonl


def _history(path, steps) -> None:
    with open(path, "w") as f:
        for step in steps:
            f.write(json.dumps({"step": step, "actor/pg_loss": 0.1 * step}) + "\n")


# Kills the process at a moment of the resume's rewrite of metrics.jsonl: when the first kept line
# is serialised (the file is open for writing), or just before the finished file is swapped in.
_KILL_DURING_REWRITE = """
import json, os, sys
from verl_megatron.trainer import tracking

where = sys.argv[2]
if where == "serialise":
    real = json.dumps
    def dying_dumps(obj, *a, **k):
        if isinstance(obj, dict) and obj.get("step") == 1:
            os._exit(9)
        return real(obj, *a, **k)
    tracking.json.dumps = dying_dumps
else:
    os.replace = lambda *a, **k: os._exit(9)
tracking.Tracking("p", "e", [], sys.argv[1], resume_step=2)
"""


@pytest.mark.parametrize("where", ["serialise", "replace"])
def test_a_kill_while_the_resume_rewrites_metrics_keeps_the_history(tmp_path, where):
    _history(tmp_path / "metrics.jsonl", [0, 1, 2, 3, 4])
    before = (tmp_path / "metrics.jsonl").read_text()
    proc = subprocess.run(
        [sys.executable, "-c", _KILL_DURING_REWRITE, str(tmp_path), where],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 9, proc.stderr[-2000:]
    assert (tmp_path / "metrics.jsonl").read_text() == before


def test_resume_drops_only_the_steps_after_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    _history(path, [0, 1, 2, 3, 4])
    tracker = Tracking("p", "e", [], str(tmp_path), resume_step=2)
    assert [r["step"] for r in read_jsonl_metrics(path)] == [0, 1, 2]
    tracker.log({"actor/pg_loss": 7.0}, step=3)
    assert read_jsonl_metrics(path)[-1] == {"step": 3, "actor/pg_loss": 7.0}
    # Nothing to drop: the file is not rewritten at all (same inode, appended to).
    inode = os.stat(path).st_ino
    Tracking("p", "e", [], str(tmp_path), resume_step=3)
    assert os.stat(path).st_ino == inode and len(read_jsonl_metrics(path)) == 4
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")], "temporary files left behind"


def test_a_line_cut_short_by_a_kill_is_skipped(tmp_path):
    path = tmp_path / "metrics.jsonl"
    _history(path, [0, 1])
    with open(path, "a") as f:
        f.write('{"step": 2, "actor/pg_')
    assert [r["step"] for r in read_jsonl_metrics(path)] == [0, 1]
    Tracking("p", "e", [], str(tmp_path), resume_step=1).log({"x": 1.0}, step=2)
    assert [r["step"] for r in read_jsonl_metrics(path)] == [0, 1, 2]
    path.write_text('{"step": 0}\nnot json\n{"step": 1}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl, line 2: not a JSON object"):
        read_jsonl_metrics(path)
