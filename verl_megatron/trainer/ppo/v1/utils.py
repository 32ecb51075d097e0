"""verl's ``trainer.ppo.v1.utils``: the multi-trajectory advantage (see
:mod:`verl_megatron.algos.multi_trajectory`)."""

from verl_megatron.algos.multi_trajectory import compute_advantage, compute_advantage_for_multi_trajectories

__all__ = ["compute_advantage", "compute_advantage_for_multi_trajectories"]
