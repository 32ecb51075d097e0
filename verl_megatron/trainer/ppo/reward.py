"""verl's import path verl_megatron.trainer.ppo.reward: the same module as :mod:`verl_megatron.reward.loading` (one object, so patches and
registries are shared)."""

import sys

from verl_megatron.reward import loading as _impl

sys.modules[__name__] = _impl
