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
that every rank calls.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import os
import pickle
import re
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from verl_megatron.checkpoint import storage
from verl_megatron.checkpoint.rng import capture_rng_state, restore_rng_state
from verl_megatron.checkpoint.storage import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
)
from verl_megatron.distributed.parallel import Runtime
from verl_megatron.models.lora import checkpoint_module, lora_mismatch, lora_signature

logger = logging.getLogger(__name__)

# A ChainedOptimizer otherwise prefixes its state keys with the index of the
# sub-optimizer holding each parameter; that index depends on how parameters
# are grouped, and the keys of the non-distributed optimizer are unique anyway.
# The distributed optimizer saves in "fully_reshardable" form: its dp shards are gathered and
# written per model tensor under the same keys as the plain optimizer's state ("optimizer.state.
# exp_avg.<model key>"), so the checkpoint loads under any layout, with or without it. Megatron's
# default ("fully_sharded_model_space") needs flattened tensors, which dist-checkpointing no longer takes.
_OPTIM_METADATA = {"chained_optim_avoid_prefix": True, "distrib_optim_sharding_type": "fully_reshardable"}
# torch.distributed.checkpoint reports failures as CheckpointException, a
# BaseException: caught explicitly, so KeyboardInterrupt still goes through.
_READ_WRITE_ERRORS = (Exception, CheckpointException)
_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_\-]*$")
_ERRORS = {
    cls.__name__: cls
    for cls in (CheckpointError, CheckpointNotFoundError, CheckpointCorruptError, CheckpointMismatchError)
}


# ---------------------------------------------------------------- collectives


def _describe(exc: BaseException) -> str:
    """One line per failure: exception type and the first sentence of its message."""
    if isinstance(exc, CheckpointException):
        failures = []
        for rank, failure in exc.failures.items():
            inner = failure[0] if isinstance(failure, tuple) else failure
            failures.append(f"rank {rank}: {_describe(inner)}")
        return "; ".join(failures)
    text = str(exc).strip()
    first = text.splitlines()[0].split(". ")[0] if text else ""
    return f"{type(exc).__name__}: {first[:300]}"


def _world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _agree(error: BaseException | None, what: str) -> None:
    """Raise on every rank when any rank failed, so no rank is left waiting in a collective."""
    world = _world()[1]
    if world == 1:
        if error is not None:
            raise error
        return
    reports: list[Any] = [None] * world
    dist.all_gather_object(reports, None if error is None else (type(error).__name__, str(error)))
    if error is not None:
        raise error
    for failed_rank, report in enumerate(reports):
        if report is not None:
            kind, message = report
            raise _ERRORS.get(kind, CheckpointError)(f"{what} failed on rank {failed_rank}: {message}")


def _on_rank0(fn, what: str) -> Any:
    """Run ``fn`` on rank 0 only (file operations on the shared filesystem); all ranks see its failure."""
    result, error = None, None
    if _world()[0] == 0:
        try:
            result = fn()
        except Exception as exc:
            error = exc
    _agree(error, what)
    return result


def _from_rank0(obj: Any) -> Any:
    rank, world = _world()
    if world == 1:
        return obj
    box = [obj if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _all_ranks(flag: bool) -> bool:
    if _world()[1] == 1:
        return flag
    t = torch.tensor([0 if flag else 1], dtype=torch.int64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t)
    return int(t.item()) == 0


# ------------------------------------------------------------------- helpers


def _model_sharded_state_dict(chunks: list[torch.nn.Module]) -> dict[str, Any]:
    # A LoRA model checkpoints its adapters only: the frozen base is the Hugging Face model.
    return {f"chunk{i}": checkpoint_module(c).sharded_state_dict() for i, c in enumerate(chunks)}


def _torch_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    subs = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return [s.optimizer for s in subs if getattr(s, "optimizer", None) is not None]


def _is_distributed(optimizer) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    subs = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return optimizer is not None and any(isinstance(s, DistributedOptimizer) for s in subs)


def _has_state(optimizer) -> bool:
    return any(len(s) > 0 for opt in _torch_optimizers(optimizer) for s in opt.state.values())


def _pack(obj: Any) -> torch.Tensor:
    # Pickled into a uint8 tensor: megatron reads the common part with
    # torch.load(weights_only=True), which refuses arbitrary Python objects.
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)


def _unpack(tensor: torch.Tensor) -> Any:
    return pickle.loads(tensor.numpy().tobytes())


def _layout_record(runtime: Runtime) -> dict[str, Any]:
    return dataclasses.asdict(runtime.layout)


def _rng_object(runtime: Runtime, data: Any):
    from megatron.core.dist_checkpointing import ShardedObject

    # One shard per global rank: RNG streams belong to a process, not to a tensor.
    return ShardedObject("rng_state", data, (runtime.world_size,), (runtime.rank,), replica_id=0)


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
    from megatron.core import dist_checkpointing

    from verl_megatron.checkpoint.strategy import save_strategy

    start = time.perf_counter()
    tmp = storage.staging_dir(root, step) / f".{name}.tmp"
    _on_rank0(lambda: storage.start_part(root, step, name), f"preparing {tmp}")
    extra_state = _from_rank0(extra_state)

    from verl_megatron.models.megatron_model import gather_updated_params

    # With overlap_param_gather the last step's updates would reach the other dp ranks' copies
    # only in the next forward: gathered now, or the saved weights are partly a step old.
    gather_updated_params(chunks)
    model_sd = _model_sharded_state_dict(chunks)
    state: dict[str, Any] = {
        "model": model_sd,
        "rng_state": _rng_object(runtime, capture_rng_state()),
        "extra_state": _pack(extra_state or {}),
    }
    optimizer_kind = "none"
    if optimizer is not None:
        # Adam's moments appear at the first step; before it there is nothing to save.
        optimizer_kind = "state" if _all_ranks(_has_state(optimizer)) else "empty"
        if optimizer_kind == "state":
            state["optimizer"] = optimizer.sharded_state_dict(model_sd, metadata=_OPTIM_METADATA)
    if scheduler is not None:
        state["scheduler"] = _pack(scheduler.state_dict())

    error = None
    try:
        dist_checkpointing.save(state, str(tmp), sharded_strategy=save_strategy(runtime))
    except _READ_WRITE_ERRORS as exc:
        error = CheckpointError(f"writing {tmp} failed: {_describe(exc)}")
    _agree(error, f"saving step {step} to {root}")

    meta = {
        "step": step,
        "name": name,
        "layout": _layout_record(runtime),
        "world_size": runtime.world_size,
        "optimizer": optimizer_kind,
        "distributed_optimizer": _is_distributed(optimizer),
        "scheduler": scheduler is not None,
        "lora": lora_signature(chunks),
    }
    _on_rank0(lambda: storage.publish_part(root, step, name, meta), f"finishing {tmp}")
    if commit:
        commit_checkpoint(root, step, max_ckpt_to_keep=max_ckpt_to_keep)
    logger.info("saved %s of step %d to %s in %.2fs", name, step, root, time.perf_counter() - start)
    return storage.step_dir(root, step)


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
    _on_rank0(
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
    from megatron.core import dist_checkpointing

    start = time.perf_counter()
    part, meta, ckpt, error = None, None, {}, None
    mine = _model_shapes(chunks)
    try:
        part = storage.resolve_part(root_or_step_dir, name)
        # Every rank checks the checksums of its share of the files.
        meta = storage.read_part_meta(part, share=_world())
        ckpt = _checkpoint_shapes(part)
        _check_common_readable(part)
        lora_mismatch(part, meta.get("lora"), lora_signature(chunks), CheckpointMismatchError)
        _check_fits(part, meta, mine, ckpt, optimizer, scheduler)
    except CheckpointError as exc:
        error = exc
    _agree(error, f"checking checkpoint {root_or_step_dir}")
    _check_nothing_left_over(part, mine, ckpt)

    model_sd = _model_sharded_state_dict(chunks)
    state: dict[str, Any] = {"model": model_sd}
    backup = _backup(optimizer, scheduler)
    if optimizer is not None and meta["optimizer"] == "state":
        # is_loading creates empty moments for a fresh optimizer so there are
        # tensors to describe; _restore undoes that if the read fails.
        _init_distributed_optimizer_state(optimizer)
        state["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=True, metadata=_OPTIM_METADATA)
    same_layout = meta["layout"] == _layout_record(runtime) and meta["world_size"] == runtime.world_size
    if load_rng and same_layout:
        state["rng_state"] = _rng_object(runtime, None)
    _stage_on_cpu(state)

    loaded = None
    try:
        loaded = dist_checkpointing.load(state, str(part))
    except _READ_WRITE_ERRORS as exc:
        error = CheckpointCorruptError(f"reading checkpoint {part} failed: {_describe(exc)}")
        _restore(optimizer, None, backup)
    _agree(error, f"loading {part}")

    try:
        _check_loaded_keys(loaded, chunks)
    except CheckpointError as exc:
        error = exc
        _restore(optimizer, None, backup)
    _agree(error, f"checking what was read from {part}")
    try:
        _apply(loaded, meta, chunks, optimizer, scheduler, backup)
    except Exception as exc:
        error = exc
    _agree(error, f"applying {part}")
    if load_rng and not same_layout:
        logger.info("checkpoint %s was saved under %s; RNG states not restored", part, meta["layout"])
    logger.info("loaded %s in %.2fs", part, time.perf_counter() - start)
    return _unpack(loaded["extra_state"])


def _init_distributed_optimizer_state(optimizer) -> None:
    """Give a fresh distributed optimizer zero moments and a step count to be overwritten by the load.

    Its ``sharded_state_dict(is_loading=True)`` first calls ``state_dict()``, which with torch's
    Adam reads every parameter's ``step`` and fails on an optimizer that never stepped (megatron
    assumes TE's or Apex's Adam there). Nothing is computed: no dummy step touches the weights.
    With TE or Apex installed megatron takes its own path and this does nothing.
    """
    from megatron.core.optimizer import distrib_optimizer
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if distrib_optimizer.HAVE_APEX_OR_TE:
        return
    for sub in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        if not isinstance(sub, DistributedOptimizer) or len(sub.optimizer.state) > 0:
            continue
        sub.init_state_fn(sub.optimizer, sub.config)
        for group in sub.optimizer.param_groups:
            for param in group["params"]:
                sub.optimizer.state[param].setdefault("step", torch.tensor(0.0))


@contextlib.contextmanager
def _step_set_apart(optimizer):
    """Load into a distributed optimizer over torch's Adam (no TE/Apex, as on CPU) correctly.

    Two gaps in megatron 0.16 with torch's Adam: (1) it copies every entry of a parameter's
    state from the checkpoint, ``step`` included, but the fully-reshardable format keeps
    ``step`` in the param groups: a KeyError; the copy here sees the state without ``step``,
    put back unchanged. (2) it gives all parameters ONE shared ``step`` tensor, which Adam then
    increments once per parameter, so the next update's bias correction is wrong: each
    parameter gets its own copy afterwards.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    patched = []
    for sub in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        if not isinstance(sub, DistributedOptimizer):
            continue

        def copy_without_step(model_param, tensors, sub=sub, copy=sub._set_main_param_and_optimizer_states):
            group, order = sub.model_param_group_index_map[model_param]
            state = sub.optimizer.state[sub.optimizer.param_groups[group]["params"][order]]
            step = state.pop("step", None)
            try:
                copy(model_param, tensors)
            finally:
                if step is not None:
                    state["step"] = step

        sub._set_main_param_and_optimizer_states = copy_without_step
        patched.append(sub)
    try:
        yield
    finally:
        for sub in patched:
            del sub._set_main_param_and_optimizer_states
    for sub in patched:
        for state in sub.optimizer.state.values():
            if "step" in state:
                state["step"] = state["step"].clone()


def _stage_on_cpu(state: dict[str, Any]) -> None:
    """Point every shard at a fresh CPU buffer so the read never writes into live parameters."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    for item in nested_values(state):
        if isinstance(item, (ShardedTensor, ShardedTensorFactory)) and item.data is not None:
            item.data = torch.empty(item.data.shape, dtype=item.data.dtype, device="cpu")


def _backup(optimizer, scheduler) -> dict[str, Any]:
    backup: dict[str, Any] = {}
    if optimizer is not None:
        backup["optimizer"] = [
            {
                # Per-parameter dicts are copied: loading replaces them, the tensors stay.
                "state": {p: dict(s) for p, s in opt.state.items()},
                "param_groups": copy.deepcopy(
                    [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
                ),
            }
            for opt in _torch_optimizers(optimizer)
        ]
    if scheduler is not None:
        backup["scheduler"] = copy.deepcopy(scheduler.state_dict())
    return backup


def _restore(optimizer, scheduler, backup: dict[str, Any]) -> None:
    if optimizer is not None:
        for opt, saved in zip(_torch_optimizers(optimizer), backup["optimizer"]):
            opt.state.clear()
            opt.state.update(saved["state"])
            for group, hyper in zip(opt.param_groups, saved["param_groups"]):
                group.update(hyper)
    if scheduler is not None:
        _load_scheduler(scheduler, backup["scheduler"])


def _load_scheduler(scheduler, state: dict) -> None:
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    if isinstance(scheduler, OptimizerParamScheduler):
        # Its load_state_dict adds the saved step count to the current one
        # (it expects a fresh scheduler); start from zero so loading sets it.
        scheduler.num_steps = 0
    scheduler.load_state_dict(state)


def _check_loaded_keys(loaded, chunks) -> None:
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


def _apply(loaded, meta, chunks, optimizer, scheduler, backup) -> None:
    model_states = loaded["model"]
    try:
        if scheduler is not None:
            _load_scheduler(scheduler, _unpack(loaded["scheduler"]))
        if optimizer is not None and meta["optimizer"] == "state":
            with _step_set_apart(optimizer):
                optimizer.load_state_dict(loaded["optimizer"])
            # The checkpoint brings the optimizer's state (moments, step counts); its
            # hyper-parameters (max_lr, betas, eps, ...) stay those of the optimizer being
            # loaded into, i.e. of the current config: a resume with a new learning rate uses it.
            for opt, fresh in zip(_torch_optimizers(optimizer), backup["optimizer"]):
                for group, hyper in zip(opt.param_groups, fresh["param_groups"]):
                    group.update(hyper)
        elif optimizer is not None:
            # Saved before the first step: the optimizer starts from scratch too.
            for opt in _torch_optimizers(optimizer):
                opt.state.clear()
        for i, chunk in enumerate(chunks):
            # Keys were compared above; strict=False only tolerates the dropped "_extra_state".
            checkpoint_module(chunk).load_state_dict(model_states[f"chunk{i}"], strict=False)
        if scheduler is not None and hasattr(scheduler, "get_lr") and hasattr(scheduler, "num_steps"):
            scheduler.step(0)  # megatron's: set this step's lr and weight decay from the current schedule
    except Exception:
        _restore(optimizer, scheduler, backup)
        raise
    if "rng_state" in loaded:
        restore_rng_state(loaded["rng_state"])


# ------------------------------------------------------------------ checking


def _model_shapes(chunks: list[torch.nn.Module]) -> dict[str, tuple[int, ...]]:
    """Checkpoint key -> global shape of every tensor this rank's chunks hold."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    probe = _model_sharded_state_dict(chunks)
    # Factories (e.g. the fused SwiGLU fc1 stored as two tensors) expand into
    # the keys actually written; building them only takes views.
    apply_factories(probe)
    return {t.key: tuple(t.global_shape) for t in nested_values(probe) if isinstance(t, ShardedTensor)}


def _check_common_readable(part: Path) -> None:
    """The small common file (scheduler, trainer state, optimizer hyper-parameters) must unpickle."""
    from megatron.core import dist_checkpointing

    try:
        dist_checkpointing.load_common_state_dict(str(part))
    except Exception as exc:
        raise CheckpointCorruptError(
            f"checkpoint {part}: common.pt is unreadable ({_describe(exc)})"
        ) from exc


def _checkpoint_shapes(part: Path) -> dict[str, tuple[int, ...]]:
    from megatron.core import dist_checkpointing

    try:
        metadata = dist_checkpointing.load_tensors_metadata(str(part))
    except Exception as exc:
        raise CheckpointCorruptError(
            f"checkpoint {part}: cannot read its tensor index ({_describe(exc)})"
        ) from exc
    return {key: tuple(t.global_shape) for key, t in metadata.items()}


def _check_fits(
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
        and saved_distributed != _is_distributed(optimizer)
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


def _check_nothing_left_over(
    part: Path, mine: dict[str, tuple[int, ...]], ckpt: dict[str, tuple[int, ...]]
) -> None:
    """Model tensors in the checkpoint that no rank holds mean a different model (collective).

    Each pipeline stage sees only its own layers, so the model's keys are
    gathered from every rank first.
    """
    held = set(mine)
    if _world()[1] > 1:
        gathered: list[Any] = [None] * _world()[1]
        dist.all_gather_object(gathered, held)
        held = set().union(*gathered)
    extra = sorted(k for k in ckpt if not k.startswith("optimizer.") and k not in held)
    error = None
    if extra:
        error = CheckpointMismatchError(
            f"checkpoint {part} does not fit this model: it holds {len(extra)} tensor(s) the model "
            f"does not have ({', '.join(extra[:4])})"
        )
    _agree(error, f"checking checkpoint {part}")
