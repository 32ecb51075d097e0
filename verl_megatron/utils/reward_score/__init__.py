"""verl's import path verl_megatron.utils.reward_score: the same package as :mod:`verl_megatron.reward.scorers`, submodules included (one object
each, so patches and registries are shared)."""

import importlib
import sys

from verl_megatron.reward import scorers as _impl

_SUBMODULES = (
    "check_file",
    "code_exec",
    "code_harness",
    "custom",
    "gsm8k",
    "math_dapo",
    "math_verify_score",
    "sandbox_fusion",
    "sandbox_fusion.utils",
    "synthetic",
)

for _name in _SUBMODULES:
    sys.modules[f"{__name__}.{_name}"] = importlib.import_module(f"{_impl.__name__}.{_name}")
sys.modules[__name__] = _impl
