"""``verl-megatron check`` (and every front-end that loads and validates the config before torchrun
starts the ranks) imports neither megatron nor tensordict nor torch._dynamo: together they cost
every such process about 5 CPU seconds. A spy on the import system names the first verl_megatron
frame that pulled each one in, so a regression says where to look.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEAVY = ("megatron", "tensordict", "torch._dynamo")

_SPY = """
import json, sys, traceback
HEAVY = {heavy!r}
pulled = {{}}


class Spy:
    def find_spec(self, name, path=None, target=None):
        if name in HEAVY and name not in pulled:
            frames = [f for f in traceback.extract_stack() if "verl_megatron" in f.filename]
            pulled[name] = " <- ".join(f"{{f.filename}}:{{f.lineno}}" for f in reversed(frames[-3:]))
        return None


sys.meta_path.insert(0, Spy())
from verl_megatron import cli

status = cli.main(["check", "--config", {config!r}])
print("RESULT", json.dumps({{"status": status, "pulled": pulled,
                             "loaded": [m for m in HEAVY if m in sys.modules]}}))
"""


def test_check_of_the_quickstart_config_imports_no_heavy_library():
    config = os.path.join(ROOT, "configs", "quickstart.yaml")
    result = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", _SPY.format(heavy=HEAVY, config=config)],
        env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "the start-up checks pass for 1 process(es)" in result.stdout, result.stdout
    line = next(x for x in result.stdout.splitlines() if x.startswith("RESULT "))
    report = json.loads(line.removeprefix("RESULT "))
    assert report["status"] == 0
    assert report["pulled"] == {}, "imported while checking the config:\n" + "\n".join(
        f"{name}: {where}" for name, where in report["pulled"].items()
    )
    assert report["loaded"] == []
