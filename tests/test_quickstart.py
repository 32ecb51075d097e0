"""The README's main job: the default quickstart run learns its task.

Runs `verl-megatron train` with no config (the shipped quickstart) exactly as a
user would, in a fresh process, and reads the metrics it writes. The claim under
test is the quickstart's promise: mean validation reward from <= 0.2 before
training to >= 0.8 at the end, and the run saying so. Gated on rewards and
steps, never on seconds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys


def test_default_quickstart_learns_reversal(tmp_path):
    out = tmp_path / "quickstart"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    result = subprocess.run(
        [sys.executable, "-m", "verl_megatron.cli", "train", f"trainer.default_local_dir={out}"],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        cwd=tmp_path,  # the default config must be found without relying on the working directory
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    val = [
        (r["step"], r["val/test_score/synthetic/reverse"])
        for r in rows
        if "val/test_score/synthetic/reverse" in r
    ]
    assert val[0][0] == 0 and val[0][1] <= 0.2, val
    assert val[-1][1] >= 0.8, val
    assert max(r["step"] for r in rows) == 150
    assert "validation reward (mean over data sources)" in result.stdout
    assert (out / "curves.png").stat().st_size > 10_000
    assert (out / "hf_export" / "config.json").exists()
