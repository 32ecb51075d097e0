"""utils/cpu_heap.py: with ``keep_freed_memory`` a step that allocates and frees the same tensors
stops page-faulting them in again; a user's own malloc settings are left alone (each case in a
fresh interpreter, since the setting is for the whole process). ``empty_on_huge_pages`` gives a
2 MiB-aligned buffer whose mapping carries the huge-page advice."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.helpers import advised_huge_pages
from verl_megatron.utils.cpu_heap import empty_on_huge_pages

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


@pytest.mark.parametrize("shape", [(3, 1 << 20), (56, 896, 16)])
def test_a_large_buffer_is_aligned_to_huge_pages_and_advised(shape):
    buffer = empty_on_huge_pages(shape, torch.float32)
    assert buffer.shape == shape and buffer.dtype == torch.float32 and buffer.is_contiguous()
    assert buffer.data_ptr() % (2 << 20) == 0, f"data at {buffer.data_ptr():#x}, not 2 MiB-aligned"
    assert advised_huge_pages(buffer.data_ptr())
    # All of it is usable memory of its own: written and read back whole.
    values = torch.arange(buffer.numel(), dtype=torch.float32).view(shape)
    buffer.copy_(values)
    assert torch.equal(buffer, values)


def test_a_small_buffer_is_a_plain_empty_tensor():
    buffer = empty_on_huge_pages((4, 16), torch.float64)
    assert buffer.shape == (4, 16) and buffer.dtype == torch.float64
    assert buffer.untyped_storage().nbytes() == 4 * 16 * 8  # no slack: under one huge page
