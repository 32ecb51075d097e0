"""A separate judge model for the native judge (``reward_model.judge.model_path``).

A causal LM built beside the actor under the actor's layout (its own megatron chunks, no
optimizer) and generated from by its own :class:`~verl_megatron.rollout.native.NativeRollout`.
The prompts are split over the rollout replicas and the answers gathered back, as the trainer
does for the actor's engine, so every rank returns the whole batch's answers.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from verl_megatron.distributed.parallel import Runtime
from verl_megatron.protocol import DataProto, pad_dataproto_to_divisor, unpad_dataproto

__all__ = ["build_judge_model", "check_judge_model_path"]


def check_judge_model_path(path: str) -> None:
    """Raise ValueError naming the key when the judge checkpoint folder is not there."""
    where = f"reward_model.judge.model_path='{path}'"
    if not os.path.isdir(os.path.expanduser(path)):
        raise ValueError(f"{where} does not exist")
    if not os.path.isfile(os.path.join(os.path.expanduser(path), "config.json")):
        raise ValueError(f"{where} has no config.json")


def build_judge_model(config: Any, runtime: Runtime) -> tuple[Callable[[DataProto], DataProto], Any]:
    """(generate function, tokenizer) of the judge checkpoint; collective (every rank builds its shards)."""
    import dataclasses

    from verl_megatron.models.builder import build_gpt_chunks
    from verl_megatron.models.config import load_hf_config
    from verl_megatron.models.convert import load_hf_weights
    from verl_megatron.rollout.base import generation_meta
    from verl_megatron.rollout.layout import gather_replicas, shard_for
    from verl_megatron.rollout.native import NativeRollout
    from verl_megatron.utils.tokenizer import hf_tokenizer

    path = config.reward_model.judge.model_path
    hf_config = load_hf_config(path)
    model_cfg = dataclasses.replace(config.model, path=path, tokenizer_path=None)
    chunks = build_gpt_chunks(hf_config, runtime, model_cfg)
    load_hf_weights(chunks, path, runtime, model_cfg)
    for chunk in chunks:
        chunk.requires_grad_(False)
    tokenizer = hf_tokenizer(path)
    engine = NativeRollout(config.rollout, runtime, chunks, tokenizer, hf_config)

    def generate(prompts: DataProto) -> DataProto:
        prompts.meta_info.update(generation_meta(tokenizer), validate=True)
        shard = shard_for("native", 1, runtime)
        padded, pad = pad_dataproto_to_divisor(prompts, shard.replicas)
        local = padded.chunk(shard.replicas)[shard.replica]
        local.meta_info["prompt_offset"] = shard.replica * len(local)
        output = engine.generate_sequences(local).to("cpu")
        output.meta_info.pop("prompt_offset", None)  # differs per replica
        output = DataProto.concat(gather_replicas(output, shard, runtime.world_size))
        return unpad_dataproto(output, pad)  # one answer per prompt (greedy)

    return generate, tokenizer
