"""The output directory (``trainer.default_local_dir``): one run at a time, never overwritten silently.

``claim_output_dir(config)`` runs at start-up, before any model is built:

- rank 0 takes an exclusive ``flock`` on ``<dir>/.verl_megatron.lock`` and holds it for the
  run; a second run into the same directory stops with ``OutputDirError`` naming the
  process that holds it. The kernel drops the lock when its process dies, however it dies.
- a directory holding an earlier run's results is either resumed or refused:
  ``resume_mode=auto`` resumes its newest complete checkpoint; ``disable`` (or ``auto``
  with no checkpoint but logged steps) would overwrite them and is refused.
- ``resume_mode=resume_path`` at step N is refused when the directory holds complete steps
  after N (a rewind): the newest checkpoint there would stay the abandoned run's.
- resuming compares the config with the one saved in the checkpoint. Keys that decide
  which data a step sees or what the model is (``REFUSED_ON_RESUME``) may not change
  unless ``trainer.resume_allow_changes=true``; every other changed key is applied and
  announced, one ``resume:`` line each.

Every rank calls it; rank 0 decides and the others raise the same error.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from verl_megatron.errors import OutputDirError
from verl_megatron.trainer.config import PPOConfig, to_dict

__all__ = [
    "CONFIG_FILE",
    "LOCK_FILE",
    "REFUSED_ON_RESUME",
    "OutputDirError",
    "claim_output_dir",
    "config_changes",
    "saved_config",
]

LOCK_FILE = ".verl_megatron.lock"
CONFIG_FILE = "config.json"  # in the output dir (Tracking) and in every checkpoint step

# Changing these between a checkpoint and its resume changes which prompts a step sees,
# how many samples form a group, or which model the weights belong to: the resumed run
# would silently not be the run that was checkpointed.
REFUSED_ON_RESUME = (
    "data.train_files",
    "data.train_batch_size",
    "data.gen_batch_size",
    "data.shuffle",
    "data.seed",
    "data.prompt_key",
    "data.max_prompt_length",
    "data.filter_overlong_prompts",
    "data.truncation",
    "data.apply_chat_template_kwargs",
    "rollout.n",
    "trainer.seed",
    "trainer.mode",  # an SFT checkpoint resumed as RL (or back) is another run
    "sft",  # every sft.* key decides which tokens an SFT step trains on
    "model.path",
    "model.tokenizer_path",
    "model.override_transformer_config",
    "quickstart.enable",
    "quickstart.task",
    "quickstart.num_digits",
    "quickstart.hidden_size",
    "quickstart.num_layers",
    "quickstart.num_heads",
    "quickstart.num_kv_heads",
    "quickstart.intermediate_size",
)
# How to resume, not what to train: never reported.
_IGNORED = ("trainer.resume_mode", "trainer.resume_from_path", "trainer.resume_allow_changes")
# Filled in by the trainer from other keys (components.resolve_worker_configs).
_DERIVED = (
    "actor.rollout_n",
    "actor.ppo_infer_micro_batch_size_per_gpu",
    "critic.rollout_n",
    "actor.optim.total_training_steps",
    "critic.optim.total_training_steps",
)


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict) and tree:
        flat: dict[str, Any] = {}
        for key, value in tree.items():
            flat.update(_flatten(value, f"{prefix}{key}."))
        return flat
    return {prefix[:-1]: tree}


def _comparable(config: dict[str, Any]) -> dict[str, Any]:
    flat = _flatten(json.loads(json.dumps(config, default=str)))
    skip = set(_IGNORED) | set(_DERIVED)
    # The quickstart writes its model and data under the output dir and points these keys at
    # them; the quickstart.* keys that decide what it builds are compared instead.
    if flat.get("quickstart.enable"):
        skip |= {"model.path", "data.train_files", "data.val_files"}
    return {k: v for k, v in flat.items() if k not in skip}


def config_changes(saved: dict[str, Any], new: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(key, saved value, new value) for every key whose value differs, sorted by key."""
    old, cur = _comparable(saved), _comparable(new)
    missing = object()
    changes = []
    for key in sorted(set(old) | set(cur)):
        a, b = old.get(key, missing), cur.get(key, missing)
        if a != b:
            changes.append((key, None if a is missing else a, None if b is missing else b))
    return changes


def _refused(key: str) -> bool:
    return any(key == k or key.startswith(k + ".") for k in REFUSED_ON_RESUME)


def saved_config(step_dir: Path) -> dict[str, Any] | None:
    """The config a checkpoint step was trained with: its own ``config.json``, else the output
    dir's (checkpoints written before steps carried one); None when neither is readable."""
    for path in (step_dir / CONFIG_FILE, step_dir.parent / CONFIG_FILE):
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            continue
    return None


def _logged_steps(directory: Path) -> int:
    """Training steps (step >= 1) in the directory's metrics.jsonl."""
    from verl_megatron.trainer.tracking import read_jsonl_metrics

    path = directory / "metrics.jsonl"
    if not path.is_file():
        return 0
    try:
        return len({r.get("step") for r in read_jsonl_metrics(path) if r.get("step", 0) >= 1})
    except (OSError, ValueError):
        return 1  # unreadable history is still history


def _resume_notes(config: PPOConfig, step_dir: Path) -> list[str]:
    """The ``resume:`` lines for a resume from ``step_dir``; raises OutputDirError on a refused change."""
    saved = saved_config(step_dir)
    if saved is None:
        return [f"resume: {step_dir} has no saved config to compare with; resuming with this one"]
    changes = config_changes(saved, to_dict(config))
    allow = config.trainer.resume_allow_changes
    refused = [c for c in changes if _refused(c[0])]
    if refused and not allow:
        key, old, new = refused[0]
        others = (
            f" (and {len(refused) - 1} more: {', '.join(c[0] for c in refused[1:4])})" if refused[1:] else ""
        )
        raise OutputDirError(
            f"resuming {step_dir} with {key}={new!r}, but it was trained with {key}={old!r}{others}: "
            "this key decides the data order or the model, so the resumed run would not continue the "
            f"saved one. Resume with {key}={old!r}, start in another trainer.default_local_dir, or set "
            "trainer.resume_allow_changes=true to resume with the new value anyway"
        )
    return [
        f"resume: {key} {old!r} -> {new!r} (applied{', trainer.resume_allow_changes=true' if _refused(key) else ''})"
        for key, old, new in changes
    ]


def _refuse_newer_steps(directory: Path, resumed: Path) -> None:
    """Refuse a resume from ``resumed`` into a directory holding complete steps after it.

    The resumed run would save its steps among them, and the newest (``resume_mode=auto``, a
    torchrun restart) would then be the abandoned run's. Nothing is moved or deleted here.
    """
    from verl_megatron.checkpoint.storage import complete_steps, step_of

    step = step_of(resumed)
    newer = sorted(s for s in complete_steps(directory) if step is not None and s > step)
    if not newer:
        return
    names = ", ".join(f"global_step_{s}" for s in newer[:3])
    if len(newer) > 3:
        names += f", ... global_step_{newer[-1]} ({len(newer)} steps)"
    raise OutputDirError(
        f"trainer.resume_from_path={resumed} resumes step {step}, but trainer.default_local_dir="
        f"{directory} holds later complete checkpoints {names}: this run would save among them and "
        "a later trainer.resume_mode=auto (or a torchrun restart) would continue the newest of those, "
        "not this run. Choose another trainer.default_local_dir, or move those steps out of "
        f"{directory}; to continue the run that saved them, use trainer.resume_mode=auto"
    )


def inspect_output_dir(config: PPOConfig) -> list[str]:
    """What starting this run in ``trainer.default_local_dir`` means: the lines to print.

    Raises OutputDirError when it would overwrite an earlier run's checkpoints or metrics,
    or resume one with a refused config change.
    """
    from verl_megatron.checkpoint.storage import find_latest_checkpoint, resolve_part

    trainer = config.trainer
    directory = Path(trainer.default_local_dir)
    newest = find_latest_checkpoint(directory)
    if trainer.resume_mode == "resume_path":
        try:
            step = resolve_part(trainer.resume_from_path, "actor").parent
        except (OSError, ValueError):
            return []  # the trainer's load names the problem
        _refuse_newer_steps(directory, step)
        return _resume_notes(config, step)
    if trainer.resume_mode == "auto" and newest is not None:
        return _resume_notes(config, newest)
    where = f"trainer.default_local_dir={directory}"
    if newest is not None:
        raise OutputDirError(
            f"{where} holds checkpoints up to {newest.name} of an earlier run and "
            f"trainer.resume_mode={trainer.resume_mode} would overwrite them: resume it with "
            "trainer.resume_mode=auto, or choose another trainer.default_local_dir (or delete that one)"
        )
    logged = _logged_steps(directory)
    if logged:
        raise OutputDirError(
            f"{where} holds metrics.jsonl with {logged} logged training step(s) and no checkpoint to "
            "resume from; a new run would overwrite them: choose another trainer.default_local_dir, "
            f"or delete {directory / 'metrics.jsonl'} to start over there"
        )
    return []


def _lock(directory: Path) -> int:
    """An open file descriptor holding an exclusive flock on the directory's lock file."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            holder = json.loads(os.pread(fd, 4096, 0) or b"{}")
        except ValueError:
            holder = {}
        os.close(fd)
        who = (
            f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}, started {holder.get('started', '?')}"
        )
        raise OutputDirError(
            f"trainer.default_local_dir={directory} is in use by another run ({who}; lock {path}): "
            "two runs in one directory overwrite each other's checkpoints and metrics. Wait for it to "
            "end or choose another trainer.default_local_dir"
        ) from None
    record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(record).encode(), 0)
    return fd


def _agree(outcome: tuple[str | None, list[str]]) -> tuple[str | None, list[str]]:
    """Rank 0's outcome, on every rank."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return outcome
    box = [outcome]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@contextlib.contextmanager
def claim_output_dir(config: PPOConfig, rank: int) -> Iterator[list[str]]:
    """Hold ``trainer.default_local_dir`` for this run (collective when torch.distributed is up).

    Yields the ``resume:`` lines (already printed by rank 0). Raises OutputDirError on
    every rank when the directory is locked by another run or would be overwritten.
    """
    fd, error, notes = None, None, []
    if rank == 0:
        try:
            fd = _lock(Path(config.trainer.default_local_dir))
            notes = inspect_output_dir(config)
        except OutputDirError as err:
            error = str(err)
        except OSError as err:  # every rank must leave the broadcast below, then fail together
            error = f"cannot use trainer.default_local_dir={config.trainer.default_local_dir}: {err}"
    error, notes = _agree((error, notes))
    try:
        if error is not None:
            raise OutputDirError(error)
        if rank == 0:
            for line in notes:
                print(line, flush=True)
        yield notes
    finally:
        if fd is not None:
            os.close(fd)  # releases the flock
