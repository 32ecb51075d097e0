"""Rollout: generating responses for prompts with the actor's weights.

``build_rollout(config, runtime, actor_chunks, tokenizer, hf_config)`` returns the engine named
by ``config.name``: ``native`` (the actor's megatron chunks, CPU and GPU), ``vllm`` or
``sglang`` (GPU; their packages are imported only when chosen). Every engine implements
``RolloutEngine.generate_sequences(prompts: DataProto) -> DataProto`` with verl's batch keys.
"""

from verl_megatron.rollout.base import RolloutEngine, RolloutEngineUnavailable, build_rollout
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
