"""What a checkpoint holds, as megatron dist-checkpointing state dicts.

The model chunks (their LoRA adapters only, with LoRA), pickled objects carried in
uint8 tensors (scheduler, trainer state), one RNG shard per rank, and the optimizer's
metadata choices.
"""

from __future__ import annotations

import dataclasses
import pickle
from typing import Any

import torch

from verl_megatron.distributed.parallel import Runtime
from verl_megatron.models.lora import checkpoint_module

# A ChainedOptimizer otherwise prefixes its state keys with the index of the
# sub-optimizer holding each parameter; that index depends on how parameters
# are grouped, and the keys of the non-distributed optimizer are unique anyway.
# The distributed optimizer saves in "fully_reshardable" form: its dp shards are gathered and
# written per model tensor under the same keys as the plain optimizer's state ("optimizer.state.
# exp_avg.<model key>"), so the checkpoint loads under any layout, with or without it. Megatron's
# default ("fully_sharded_model_space") needs flattened tensors, which dist-checkpointing no longer takes.
OPTIM_METADATA = {"chained_optim_avoid_prefix": True, "distrib_optim_sharding_type": "fully_reshardable"}


def model_sharded_state_dict(chunks: list[torch.nn.Module]) -> dict[str, Any]:
    """``chunk<i>`` -> sharded state dict of each chunk."""
    # A LoRA model checkpoints its adapters only: the frozen base is the Hugging Face model.
    return {f"chunk{i}": checkpoint_module(c).sharded_state_dict() for i, c in enumerate(chunks)}


def pack(obj: Any) -> torch.Tensor:
    """``obj`` pickled into a uint8 tensor [N]."""
    # Megatron reads the common part with torch.load(weights_only=True), which refuses
    # arbitrary Python objects.
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)


def unpack(tensor: torch.Tensor) -> Any:
    """The object :func:`pack` put in ``tensor``."""
    return pickle.loads(tensor.numpy().tobytes())


def layout_record(runtime: Runtime) -> dict[str, Any]:
    """The parallel layout as saved in a part's metadata."""
    return dataclasses.asdict(runtime.layout)


def rng_object(runtime: Runtime, data: Any):
    """The sharded entry of this rank's RNG states (``data``: None when loading)."""
    from megatron.core.dist_checkpointing import ShardedObject

    # One shard per global rank: RNG streams belong to a process, not to a tensor.
    return ShardedObject("rng_state", data, (runtime.world_size,), (runtime.rank,), replica_id=0)


def stage_on_cpu(state: dict[str, Any]) -> None:
    """Point every shard at a fresh CPU buffer so the read never writes into live parameters."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    for item in nested_values(state):
        if isinstance(item, (ShardedTensor, ShardedTensorFactory)) and item.data is not None:
            item.data = torch.empty(item.data.shape, dtype=item.data.dtype, device="cpu")
