"""Implementation modules of `verl_megatron.trainer.ppo.core_algos` (import from there)."""
