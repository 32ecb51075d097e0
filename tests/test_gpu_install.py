"""The GPU install: ``.[gpu]`` holds binary wheels only, and the README's Transformer Engine step
pins the range megatron-core itself declares.

Transformer Engine's PyTorch part (``transformer_engine_torch``) is published as source only, so a
``.[gpu]`` that required it would compile on install (CUDA toolkit needed) or fail; it is a
separate, documented step instead.
"""

from __future__ import annotations

import os
import re
from importlib import metadata

import tomllib
from packaging.requirements import Requirement

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TE_NAMES = {"transformer-engine", "transformer-engine-torch"}


def _name(req: Requirement) -> str:
    return re.sub(r"[-_.]+", "-", req.name).lower()


def test_gpu_extra_needs_no_source_build():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    gpu = [Requirement(r) for r in extras["gpu"]]
    assert not {_name(r) for r in gpu} & _TE_NAMES, extras["gpu"]
    assert "vllm" in {_name(r) for r in gpu}


def test_readme_te_step_pins_megatron_cores_own_range():
    declared = [Requirement(r) for r in metadata.requires("megatron-core") or []]
    (megatron_te,) = [r for r in declared if _name(r) == "transformer-engine"]
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    (command,) = re.findall(r'pip install --no-build-isolation "(transformer-engine\[[^"]+)"', readme)
    readme_te = Requirement(command)
    assert readme_te.specifier == megatron_te.specifier, (str(readme_te), str(megatron_te))
    assert "pytorch" in readme_te.extras
    # Versions megatron-core 0.16 accepts pass, others do not.
    assert readme_te.specifier.contains("2.10.0") and not readme_te.specifier.contains("2.12.0")
