"""Rollout: generating responses for prompts with the actor's weights.

``build_rollout(config, runtime, actor_chunks, tokenizer, hf_config)`` returns the engine named
by ``config.name``: ``native`` (the actor's megatron chunks, CPU and GPU), ``vllm`` or
``sglang`` (GPU; their packages are imported only when chosen). Every engine implements
``RolloutEngine.generate_sequences(prompts: DataProto) -> DataProto`` with verl's batch keys.

The engine names load on first use: ``verl_megatron.rollout.config`` (read by the config loader,
which runs in every front-end process before torchrun starts the ranks) must not pull in
megatron or tensordict.
"""

from typing import Any

from verl_megatron.rollout.config import MultiTurnConfig, RolloutConfig, RolloutConfigError, SamplingConfig

__all__ = [
    "MultiTurnConfig",
    "RolloutConfig",
    "RolloutConfigError",
    "RolloutEngine",
    "RolloutEngineUnavailable",
    "SamplingConfig",
    "build_rollout",
]


def __getattr__(name: str) -> Any:
    if name in ("RolloutEngine", "RolloutEngineUnavailable", "build_rollout"):
        from verl_megatron.rollout import base

        return getattr(base, name)
    raise AttributeError(f"module 'verl_megatron.rollout' has no attribute {name!r}")
