"""Save and load a megatron model with its optimizer, scheduler, RNG and trainer state.

Tensors go through megatron dist-checkpointing: each rank contributes its
shards (``sharded_state_dict()`` of the model chunks and of the optimizer)
under layout-independent keys, so a checkpoint written with one tp/pp/vpp/dp
layout loads into another. Next to the shards the checkpoint holds:

- the LR scheduler's ``state_dict()`` and the caller's ``extra_state`` (trainer
  step, dataloader position, KL controller value...: any picklable dict, taken
  from rank 0), pickled into the common part that rank 0 writes;
- each rank's RNG states (Python, NumPy, torch, CUDA and megatron's
  tensor-parallel tracker), restored only under the same layout, where
  "rank r" still means the same piece of the model.

Checkpoints are trusted input: loading unpickles their contents.

How files become a checkpoint (staging, markers, atomic renames, pruning) is
:mod:`verl_megatron.checkpoint.storage`; this module is the collective part
that every rank calls (with :mod:`.collectives`, :mod:`.state_dicts`, :mod:`.checks`
and :mod:`.optimizer_state`).
"""

from __future__ import annotations

import logging
import os
import re
import time
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException

from verl_megatron.checkpoint import storage
from verl_megatron.checkpoint.checks import (
    check_common_readable,
    check_fits,
    check_loaded_keys,
    check_nothing_left_over,
    checkpoint_shapes,
    model_shapes,
)
from verl_megatron.checkpoint.collectives import (
    agree,
    all_ranks,
    describe_failure,
    from_rank0,
    gather_to_rank0,
    on_rank0,
    world,
)
from verl_megatron.checkpoint.optimizer_state import (
    back_up,
    has_state,
    init_distributed_optimizer_state,
    is_distributed,
    load_scheduler,
    restore,
    step_set_apart,
    torch_optimizers,
)
from verl_megatron.checkpoint.rng import capture_rng_state, restore_rng_state
from verl_megatron.checkpoint.state_dicts import (
    OPTIM_METADATA,
    layout_record,
    model_sharded_state_dict,
    pack,
    rng_object,
    stage_on_cpu,
    unpack,
)
from verl_megatron.checkpoint.storage import CheckpointCorruptError, CheckpointError, CheckpointMismatchError
from verl_megatron.distributed.parallel import Runtime
from verl_megatron.models.lora import checkpoint_module, lora_mismatch, lora_signature

__all__ = ["commit_checkpoint", "load_checkpoint", "save_checkpoint"]

logger = logging.getLogger(__name__)

# torch.distributed.checkpoint reports failures as CheckpointException, a
# BaseException: caught explicitly, so KeyboardInterrupt still goes through.
_READ_WRITE_ERRORS = (Exception, CheckpointException)
_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_\-]*$")


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(f"checkpoint part name must be letters, digits, '_' or '-', got {name!r}")


# ---------------------------------------------------------------------- save


def save_checkpoint(
    root: str | os.PathLike,
    step: int,
    *,
    chunks: list[torch.nn.Module],
    optimizer=None,
    scheduler=None,
    extra_state: dict | None = None,
    runtime: Runtime,
    name: str = "model",
    max_ckpt_to_keep: int | None = None,
    commit: bool = True,
) -> Path:
    """Save one model (``name``) of training step ``step`` under ``root``; collective over all ranks.

    Args:
        chunks: this rank's model chunks (one per virtual stage), DDP-wrapped or not.
        optimizer: the megatron optimizer over ``chunks`` (None: weights only).
        scheduler: anything with ``state_dict()``/``load_state_dict()`` (megatron's
            OptimizerParamScheduler, a torch LR scheduler).
        extra_state: picklable dict of trainer state; rank 0's value is saved.
        name: subdirectory of the step, so several models (actor, critic) share a step.
        max_ckpt_to_keep: after the commit, keep this many newest complete steps
            (None or <= 0: keep all). Only steps older than ``step`` are deleted.
        commit: publish the step now. To save several models in one step, pass
            ``commit=False`` for all but the last (or call :func:`commit_checkpoint`).

    Returns ``root/global_step_{step}``. Until the commit the step lives in a
    hidden staging directory that readers ignore, so an interrupted save
    never hides or damages the previous checkpoint.
    """
    _check_name(name)
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"checkpoint step must be a non-negative int, got {step!r}")
    if extra_state is not None and not isinstance(extra_state, dict):
        raise TypeError(f"extra_state must be a dict, got {type(extra_state).__name__}")
    start = time.perf_counter()
    tmp = storage.staging_dir(root, step) / f".{name}.tmp"
    on_rank0(lambda: storage.start_part(root, step, name), f"preparing {tmp}")
    extra_state = from_rank0(extra_state)
    state, optimizer_kind = _state_to_save(chunks, optimizer, scheduler, extra_state, runtime)

    written = _write(state, tmp, runtime, f"saving step {step} to {root}")
    meta = {
        "step": step,
        "name": name,
        "layout": layout_record(runtime),
        "world_size": runtime.world_size,
        "optimizer": optimizer_kind,
        "distributed_optimizer": is_distributed(optimizer),
        "scheduler": scheduler is not None,
        "lora": lora_signature(chunks),
    }
    on_rank0(lambda: storage.publish_part(root, step, name, meta, written), f"finishing {tmp}")
    if commit:
        commit_checkpoint(root, step, max_ckpt_to_keep=max_ckpt_to_keep)
    logger.info("saved %s of step %d to %s in %.2fs", name, step, root, time.perf_counter() - start)
    return storage.step_dir(root, step)


# megatron writes these itself on rank 0, past the hashing writer: small files, hashed from disk.
_MEGATRON_COMMON_FILES = ("common.pt", "metadata.json")


def _write(state: dict[str, Any], tmp: Path, runtime: Runtime, what: str) -> list[dict[str, str]] | None:
    """Write ``state``'s shards into ``tmp``; collective. Returns, on rank 0, what every rank wrote
    (relative path -> sha256, one dict per rank): each rank hashes its own files as it writes them,
    so the part marker's checksums cost no rank a read of the whole checkpoint."""
    from megatron.core import dist_checkpointing

    from verl_megatron.checkpoint.hashing import WrittenFiles
    from verl_megatron.checkpoint.strategy import save_strategy

    written, error = WrittenFiles(tmp), None
    try:
        dist_checkpointing.save(state, str(tmp), sharded_strategy=save_strategy(runtime, written))
        if world()[0] == 0:
            for rel in _MEGATRON_COMMON_FILES:
                written.hash_from_disk(rel)
    except _READ_WRITE_ERRORS as exc:
        error = CheckpointError(f"writing {tmp} failed: {describe_failure(exc)} ({storage.write_room(tmp)})")
    agree(error, what)
    return gather_to_rank0(written.digests())


def _state_to_save(
    chunks: list[torch.nn.Module], optimizer, scheduler, extra_state: dict | None, runtime: Runtime
) -> tuple[dict[str, Any], str]:
    """(the sharded state dict to write, what the optimizer contributes: "none", "empty" or "state")."""
    from verl_megatron.models.megatron_model import gather_updated_params

    # With overlap_param_gather the last step's updates would reach the other dp ranks' copies
    # only in the next forward: gathered now, or the saved weights are partly a step old.
    gather_updated_params(chunks)
    model_sd = model_sharded_state_dict(chunks)
    state: dict[str, Any] = {
        "model": model_sd,
        "rng_state": rng_object(runtime, capture_rng_state()),
        "extra_state": pack(extra_state or {}),
    }
    optimizer_kind = "none"
    if optimizer is not None:
        # Adam's moments appear at the first step; before it there is nothing to save.
        optimizer_kind = "state" if all_ranks(has_state(optimizer)) else "empty"
        if optimizer_kind == "state":
            state["optimizer"] = optimizer.sharded_state_dict(model_sd, metadata=OPTIM_METADATA)
    if scheduler is not None:
        state["scheduler"] = pack(scheduler.state_dict())
    return state, optimizer_kind


def commit_checkpoint(
    root: str | os.PathLike,
    step: int,
    *,
    max_ckpt_to_keep: int | None = None,
    files: dict[str, str] | None = None,
) -> Path:
    """Publish the parts saved for ``step`` (rank 0's file work, see :func:`storage.commit_step`); collective.

    ``files``: name -> text of small files (e.g. the run's config) to publish in the step directory.
    """
    on_rank0(
        lambda: storage.commit_step(root, step, max_ckpt_to_keep, files=files),
        f"committing step {step} in {root}",
    )
    return storage.step_dir(root, step)


# ---------------------------------------------------------------------- load


def load_checkpoint(
    root_or_step_dir: str | os.PathLike,
    *,
    chunks: list[torch.nn.Module],
    optimizer=None,
    scheduler=None,
    runtime: Runtime,
    name: str = "model",
    load_rng: bool = True,
) -> dict:
    """Load part ``name`` of a checkpoint into ``chunks`` (and optimizer, scheduler); collective.

    ``root_or_step_dir`` is a checkpoint root (its latest complete step is
    used), a ``global_step_N`` directory, or a part directory. The layout may
    differ from the one that saved; RNG states are restored only under the
    same layout and world size (``load_rng``).

    Returns the saved ``extra_state`` dict ({} when none was given).

    Raises CheckpointNotFoundError, CheckpointCorruptError or
    CheckpointMismatchError (naming the path and the problem) before
    anything is modified: shards are read into host memory first (one copy of
    this rank's part), and the model, optimizer and scheduler change only once
    every rank has read everything.

    The optimizer's hyper-parameters (learning rate, betas, weight decay) and the
    scheduler's schedule are those of the objects loaded into: the checkpoint
    brings their state (moments, step counts), so a changed config takes effect.

    Loading weights without the optimizer into a model trained with a
    mixed-precision (bf16) optimizer leaves its fp32 master copies stale:
    pass the optimizer, or call its ``reload_model_params()``.
    """
    _check_name(name)
    start = time.perf_counter()
    part, meta = _check_part(root_or_step_dir, name, chunks, optimizer, scheduler)

    model_sd = model_sharded_state_dict(chunks)
    state: dict[str, Any] = {"model": model_sd}
    backup = back_up(optimizer, scheduler)
    if optimizer is not None and meta["optimizer"] == "state":
        # is_loading creates empty moments for a fresh optimizer so there are
        # tensors to describe; restore() undoes that if the read fails.
        init_distributed_optimizer_state(optimizer)
        state["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=True, metadata=OPTIM_METADATA)
    same_layout = meta["layout"] == layout_record(runtime) and meta["world_size"] == runtime.world_size
    if load_rng and same_layout:
        state["rng_state"] = rng_object(runtime, None)
    stage_on_cpu(state)

    loaded = _read(state, part, chunks, optimizer, backup)
    error = None
    try:
        _apply(loaded, meta, chunks, optimizer, scheduler, backup)
    except Exception as exc:
        error = exc
    agree(error, f"applying {part}")
    if load_rng and not same_layout:
        logger.info("checkpoint %s was saved under %s; RNG states not restored", part, meta["layout"])
    logger.info("loaded %s in %.2fs", part, time.perf_counter() - start)
    return unpack(loaded["extra_state"])


def _check_part(
    root_or_step_dir: str | os.PathLike, name: str, chunks: list[torch.nn.Module], optimizer, scheduler
) -> tuple[Path, dict]:
    """(the part directory, its metadata) once every rank found it intact and fitting; collective."""
    part, meta, ckpt, error = None, None, {}, None
    mine = model_shapes(chunks)
    try:
        part = storage.resolve_part(root_or_step_dir, name)
        # Every rank checks the checksums of its share of the files.
        meta = storage.read_part_meta(part, share=world())
        ckpt = checkpoint_shapes(part)
        check_common_readable(part)
        lora_mismatch(part, meta.get("lora"), lora_signature(chunks), CheckpointMismatchError)
        check_fits(part, meta, mine, ckpt, optimizer, scheduler)
    except CheckpointError as exc:
        error = exc
    agree(error, f"checking checkpoint {root_or_step_dir}")
    check_nothing_left_over(part, mine, ckpt)
    return part, meta


def _read(state: dict[str, Any], part: Path, chunks: list[torch.nn.Module], optimizer, backup) -> dict:
    """Read ``state``'s shards from ``part`` into host memory; on any rank's failure, undo and raise."""
    from megatron.core import dist_checkpointing

    loaded, error = None, None
    try:
        loaded = dist_checkpointing.load(state, str(part))
    except _READ_WRITE_ERRORS as exc:
        error = CheckpointCorruptError(f"reading checkpoint {part} failed: {describe_failure(exc)}")
        restore(optimizer, None, backup)
    agree(error, f"loading {part}")

    try:
        check_loaded_keys(loaded, chunks)
    except CheckpointError as exc:
        error = exc
        restore(optimizer, None, backup)
    agree(error, f"checking what was read from {part}")
    return loaded


def _apply(loaded, meta, chunks, optimizer, scheduler, backup) -> None:
    model_states = loaded["model"]
    try:
        if scheduler is not None:
            load_scheduler(scheduler, unpack(loaded["scheduler"]))
        if optimizer is not None and meta["optimizer"] == "state":
            with step_set_apart(optimizer):
                optimizer.load_state_dict(loaded["optimizer"])
            # The checkpoint brings the optimizer's state (moments, step counts); its
            # hyper-parameters (max_lr, betas, eps, ...) stay those of the optimizer being
            # loaded into, i.e. of the current config: a resume with a new learning rate uses it.
            for opt, fresh in zip(torch_optimizers(optimizer), backup["optimizer"]):
                for group, hyper in zip(opt.param_groups, fresh["param_groups"]):
                    group.update(hyper)
        elif optimizer is not None:
            # Saved before the first step: the optimizer starts from scratch too.
            for opt in torch_optimizers(optimizer):
                opt.state.clear()
        for i, chunk in enumerate(chunks):
            # Keys were compared above; strict=False only tolerates the dropped "_extra_state".
            checkpoint_module(chunk).load_state_dict(model_states[f"chunk{i}"], strict=False)
        if scheduler is not None and hasattr(scheduler, "get_lr") and hasattr(scheduler, "num_steps"):
            scheduler.step(0)  # megatron's: set this step's lr and weight decay from the current schedule
    except Exception:
        restore(optimizer, scheduler, backup)
        raise
    if "rng_state" in loaded:
        restore_rng_state(loaded["rng_state"])
