"""verl's import path verl_megatron.workers.reward_manager: the same package as :mod:`verl_megatron.reward.managers`, submodules included (one object
each, so patches and registries are shared)."""

import importlib
import sys

from verl_megatron.reward import managers as _impl

_SUBMODULES = ("base", "batch", "dapo", "naive", "parallel", "registry", "scoring")

for _name in _SUBMODULES:
    sys.modules[f"{__name__}.{_name}"] = importlib.import_module(f"{_impl.__name__}.{_name}")
sys.modules[__name__] = _impl
