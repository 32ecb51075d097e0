"""verl's import path verl_megatron.trainer.ppo.core_algos: the same module as :mod:`verl_megatron.algos.core_algos` (one object, so patches and
registries are shared)."""

import sys

from verl_megatron.algos import core_algos as _impl

sys.modules[__name__] = _impl
