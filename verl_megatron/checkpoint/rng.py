"""Capture and restore every random generator a training process draws from.

Resuming must continue the same random streams: Python's ``random``, NumPy's
global generator, torch's CPU generator, the CUDA generator on a GPU, and
megatron's tensor-parallel RNG tracker (the dropout streams that differ or
agree across tensor-parallel ranks on purpose).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def _tracker():
    from megatron.core import tensor_parallel

    return tensor_parallel.get_cuda_rng_tracker()


def _real_cuda() -> bool:
    from verl_megatron.distributed import cpu_compat

    # Under the CPU compatibility layer torch.cuda's RNG functions are
    # stand-ins for the CPU generator: saving them again would be redundant.
    return torch.cuda.is_available() and not cpu_compat.is_installed()


def capture_rng_state() -> dict[str, Any]:
    """This process's generator states (a picklable dict of tensors and tuples)."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": {name: s.clone() for name, s in _tracker().get_states().items()},
    }
    if _real_cuda():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Put back the generator states returned by :func:`capture_rng_state`."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and _real_cuda():
        torch.cuda.set_rng_state(state["cuda"])
    _tracker().set_states({name: s.clone() for name, s in state["tracker"].items()})
