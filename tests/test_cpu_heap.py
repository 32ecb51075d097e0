"""utils/cpu_heap.py: after ``keep_freed_memory`` a loop that allocates and frees the same tensors
stops page-faulting; a user's own malloc settings are left alone. Each case runs in a fresh
interpreter, since the setting is for the whole process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

_SCRIPT = """
import json, resource, torch
from verl_megatron.utils.cpu_heap import keep_freed_memory

def faults():
    torch.empty(2 << 20).fill_(1.0)  # warm-up: one 8 MiB tensor
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(40):
        torch.empty(2 << 20).fill_(1.0)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

default = faults()
applied = keep_freed_memory()
print(json.dumps({"default": default, "applied": applied, "kept": faults()}))
"""


def _run(env_extra: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", _SCRIPT], env={**env, **env_extra}, capture_output=True,
                         text=True, timeout=120, check=True)  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_freed_tensors_are_reused_without_page_faults():
    out = _run({})
    # 40 x 8 MiB = 80k pages of 4 KiB when each tensor is mapped anew (fewer with huge pages).
    assert out["applied"] and out["default"] >= 1000, out
    assert out["kept"] <= out["default"] // 50, f"page faults for 40 x 8 MiB tensors: {out}"


def test_user_malloc_settings_win():
    out = _run({"MALLOC_TRIM_THRESHOLD_": "131072"})
    assert not out["applied"] and out["kept"] >= 1000, out
