"""Checks that a checkpoint part fits the model, optimizer and scheduler it is loaded into.

Run before anything is modified, so a mismatch names the problem and leaves the model as it was.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from verl_megatron.checkpoint.collectives import agree, describe_failure, world
from verl_megatron.checkpoint.optimizer_state import is_distributed
from verl_megatron.checkpoint.state_dicts import model_sharded_state_dict
from verl_megatron.checkpoint.storage import CheckpointCorruptError, CheckpointMismatchError
from verl_megatron.models.lora import checkpoint_module


def check_loaded_keys(loaded: dict[str, Any], chunks: list[torch.nn.Module]) -> None:
    """The model keys read must be exactly the chunks' keys."""
    model_states = loaded["model"]
    for i, chunk in enumerate(chunks):
        # "_extra_state" entries (empty without Transformer Engine) are not all
        # in sharded_state_dict: megatron drops the output layer's on purpose.
        expected = {k for k in checkpoint_module(chunk).state_dict() if not k.endswith("_extra_state")}
        got = {k for k in model_states[f"chunk{i}"] if not k.endswith("_extra_state")}
        if expected != got:
            raise CheckpointMismatchError(
                f"model chunk {i}: keys read {sorted(got - expected)[:5]} not in the model, "
                f"model keys not read {sorted(expected - got)[:5]}"
            )


def model_shapes(chunks: list[torch.nn.Module]) -> dict[str, tuple[int, ...]]:
    """Checkpoint key -> global shape of every tensor this rank's chunks hold."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    probe = model_sharded_state_dict(chunks)
    # Factories (e.g. the fused SwiGLU fc1 stored as two tensors) expand into
    # the keys actually written; building them only takes views.
    apply_factories(probe)
    return {t.key: tuple(t.global_shape) for t in nested_values(probe) if isinstance(t, ShardedTensor)}


def check_common_readable(part: Path) -> None:
    """The small common file (scheduler, trainer state, optimizer hyper-parameters) must unpickle."""
    from megatron.core import dist_checkpointing

    try:
        dist_checkpointing.load_common_state_dict(str(part))
    except Exception as exc:
        raise CheckpointCorruptError(
            f"checkpoint {part}: common.pt is unreadable ({describe_failure(exc)})"
        ) from exc


def checkpoint_shapes(part: Path) -> dict[str, tuple[int, ...]]:
    """Checkpoint key -> global shape of every tensor the part holds (from its index)."""
    from megatron.core import dist_checkpointing

    try:
        metadata = dist_checkpointing.load_tensors_metadata(str(part))
    except Exception as exc:
        raise CheckpointCorruptError(
            f"checkpoint {part}: cannot read its tensor index ({describe_failure(exc)})"
        ) from exc
    return {key: tuple(t.global_shape) for key, t in metadata.items()}


def check_fits(
    part: Path,
    meta: dict,
    mine: dict[str, tuple[int, ...]],
    ckpt: dict[str, tuple[int, ...]],
    optimizer,
    scheduler,
) -> None:
    """Raise CheckpointMismatchError when this rank's model/optimizer/scheduler cannot take the checkpoint."""
    problems = []
    if optimizer is not None and meta["optimizer"] == "none":
        problems.append("it was saved without an optimizer, but an optimizer was given to load into")
    if scheduler is not None and not meta["scheduler"]:
        problems.append("it was saved without a scheduler, but a scheduler was given to load into")
    shapes = [
        f"{key}: checkpoint {list(ckpt[key])}, model {list(shape)}"
        for key, shape in sorted(mine.items())
        if key in ckpt and ckpt[key] != shape
    ]
    if shapes:
        problems.append(f"{len(shapes)} tensor(s) differ in shape ({'; '.join(shapes[:4])})")
    missing = sorted(set(mine) - set(ckpt))
    if missing:
        problems.append(
            f"{len(missing)} model tensor(s) are not in the checkpoint ({', '.join(missing[:4])})"
        )
    saved_distributed = meta.get("distributed_optimizer", False)
    if (
        optimizer is not None
        and meta["optimizer"] == "state"
        and saved_distributed != is_distributed(optimizer)
    ):
        # The common part (param groups, step) is laid out differently by the two optimizers.
        problems.append(
            f"its optimizer state was saved with use_distributed_optimizer={saved_distributed}; "
            f"load it with optim.use_distributed_optimizer={saved_distributed}"
        )
    if optimizer is not None and meta["optimizer"] == "state":
        # Keys look like "optimizer.state.exp_avg.<model key>".
        with_state = {k.split(".", 3)[3] for k in ckpt if k.startswith("optimizer.state.")}
        no_state = sorted(set(mine) - set(missing) - with_state)
        if no_state:
            problems.append(f"no optimizer state for {len(no_state)} tensor(s) ({', '.join(no_state[:4])})")
    if problems:
        raise CheckpointMismatchError(f"checkpoint {part} does not fit this model: " + "; ".join(problems))


def check_nothing_left_over(
    part: Path, mine: dict[str, tuple[int, ...]], ckpt: dict[str, tuple[int, ...]]
) -> None:
    """Model tensors in the checkpoint that no rank holds mean a different model (collective).

    Each pipeline stage sees only its own layers, so the model's keys are
    gathered from every rank first.
    """
    held = set(mine)
    if world()[1] > 1:
        gathered: list[Any] = [None] * world()[1]
        dist.all_gather_object(gathered, held)
        held = set().union(*gathered)
    extra = sorted(k for k in ckpt if not k.startswith("optimizer.") and k not in held)
    error = None
    if extra:
        error = CheckpointMismatchError(
            f"checkpoint {part} does not fit this model: it holds {len(extra)} tensor(s) the model "
            f"does not have ({', '.join(extra[:4])})"
        )
    agree(error, f"checking checkpoint {part}")
