"""verl's import path verl_megatron.trainer.ppo.rollout_corr_helper: the same module as :mod:`verl_megatron.algos.rollout_corr_helper` (one object, so patches and
registries are shared)."""

import sys

from verl_megatron.algos import rollout_corr_helper as _impl

sys.modules[__name__] = _impl
