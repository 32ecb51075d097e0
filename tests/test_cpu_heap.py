"""utils/cpu_heap.py: with ``keep_freed_memory`` a step that allocates and frees the same tensors
stops page-faulting them in again; a user's own malloc settings are left alone. Each case runs in
a fresh interpreter, since the setting is for the whole process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

_SCRIPT = """
import json, resource, torch
from verl_megatron.utils.cpu_heap import keep_freed_memory

applied = keep_freed_memory()
counts = []
for _ in range(3):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):  # a step's pattern: a few tensors alive together, then all freed
        step = [torch.empty(2 << 20).fill_(1.0) for _ in range(3)]  # 3 x 8 MiB
        del step
    counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"applied": applied, "faults": counts}))
"""
# 20 steps x 3 x 8 MiB, in 4 KiB pages: what a round costs when every step maps its memory anew.
_PAGES = 20 * 3 * (8 << 20) // 4096


def _run(env_extra: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", _SCRIPT], env={**env, **env_extra}, capture_output=True,
                         text=True, timeout=120, check=True)  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_freed_tensors_are_reused_without_page_faults():
    out = _run({})
    # The first round grows the heap once; the later ones reuse it (the fewest of them: a round
    # can take faults from outside on a loaded machine).
    assert out["applied"] and min(out["faults"][1:]) <= _PAGES // 100, f"page faults per round: {out}"


def test_user_malloc_settings_win():
    # glibc's own static thresholds, set by the user: left alone, and each step faults anew, which
    # is what the test above would see without the setting.
    out = _run({"MALLOC_TRIM_THRESHOLD_": "131072", "MALLOC_MMAP_THRESHOLD_": "131072"})
    assert not out["applied"] and min(out["faults"]) >= _PAGES * 9 // 10, f"page faults per round: {out}"
