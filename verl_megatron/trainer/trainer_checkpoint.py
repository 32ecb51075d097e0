"""The trainer's checkpoints: the actor's (and critic's) parts of a step, staged then published.

A step's parts are written inside the step (``save_step``) and published only once its metrics
are logged (``publish_step``), so a run killed in between resumes from the previous checkpoint
and no published step is ever missing from the log. ``load_resume_state`` loads the checkpoint
``trainer.resume_mode`` points at into the workers and returns the trainer's saved state.

An async run (``rollout.placement=separate``) also keeps in each checkpoint the weight versions
its rollout ranks will still generate with (``RecentWeights``): after a resume from step c the
batches of steps c+1..c+k (k = ``async_training.max_staleness``) are regenerated with the versions
an uninterrupted run used (c-k..c-1), not with the checkpoint's own, so the run continues exactly.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from verl_megatron.distributed.parallel import Runtime
from verl_megatron.trainer.config import PPOConfig, to_dict

if TYPE_CHECKING:
    from verl_megatron.workers.actor import MegatronActor
    from verl_megatron.workers.critic import MegatronCritic

__all__ = ["RecentWeights", "load_resume_state", "publish_step", "restarted", "save_due", "save_step"]

ROLLOUT_WEIGHTS = "rollout_weights"  # the checkpoint part of RecentWeights


def save_due(config: PPOConfig, step: int, total_steps: int) -> bool:
    """Whether step ``step`` writes a checkpoint (every ``trainer.save_freq`` steps and the last)."""
    save_freq = config.trainer.save_freq
    return save_freq > 0 and (step % save_freq == 0 or step == total_steps)


def save_step(
    config: PPOConfig,
    step: int,
    state: dict[str, Any],
    runtime: Runtime,
    actor: MegatronActor,
    critic: MegatronCritic | None,
) -> None:
    """Write step ``step``'s parts (critic first, then actor), not yet published."""
    from verl_megatron.checkpoint import save_checkpoint

    root = config.trainer.default_local_dir
    common = {"extra_state": state, "runtime": runtime}
    if critic is not None:
        save_checkpoint(
            root, step, chunks=critic.chunks, optimizer=critic.optimizer,
            scheduler=critic.scheduler, name="critic", commit=False, **common,
        )  # fmt: skip
    save_checkpoint(
        root, step, chunks=actor.chunks, optimizer=actor.optimizer,
        scheduler=actor.scheduler, name="actor", commit=False, **common,
    )  # fmt: skip


def publish_step(config: PPOConfig, step: int) -> None:
    """Publish the parts saved for ``step``, with the run's config (compared on resume)."""
    from verl_megatron.checkpoint import commit_checkpoint

    trainer = config.trainer
    config_json = json.dumps(to_dict(config), indent=2, default=str)
    commit_checkpoint(
        trainer.default_local_dir, step, max_ckpt_to_keep=trainer.max_actor_ckpt_to_keep,
        files={"config.json": config_json},
    )  # fmt: skip


def load_resume_state(
    config: PPOConfig,
    runtime: Runtime,
    actor: MegatronActor,
    critic: MegatronCritic | None,
    warn: Callable[[str], None],
) -> dict[str, Any] | None:
    """Load the checkpoint ``trainer.resume_mode`` points at into the actor (and critic); return
    the trainer state saved with it (None: a fresh start). ``warn`` names a damaged checkpoint."""
    from verl_megatron.checkpoint import load_checkpoint
    from verl_megatron.checkpoint.resume import load_newest_intact

    trainer = config.trainer

    def load(path: str | Path) -> dict[str, Any]:
        state = load_checkpoint(
            path, chunks=actor.chunks, optimizer=actor.optimizer, scheduler=actor.scheduler,
            runtime=runtime, name="actor",
        )  # fmt: skip
        if critic is not None:
            load_checkpoint(
                path, chunks=critic.chunks, optimizer=critic.optimizer,
                scheduler=critic.scheduler, runtime=runtime, name="critic",
            )  # fmt: skip
        return state

    if trainer.resume_mode == "disable":
        return None
    if trainer.resume_mode == "auto":
        # A damaged newest checkpoint is named and the newest intact one is used.
        found = load_newest_intact(trainer.default_local_dir, load, warn)
        return None if found is None else found[1]
    return load(trainer.resume_from_path)


def restarted(config: PPOConfig, rank: int) -> tuple[PPOConfig, str | None]:
    """The config of this torchrun attempt, and the line announcing a restart (None: first attempt).

    After a failure ``torchrun --max-restarts=N`` starts the job again with no user action; the
    new attempt continues this run from its newest intact checkpoint (``resume_mode=auto``) once
    the run has one, whatever ``resume_mode`` the first attempt started with (``disable`` would
    refuse to overwrite it, ``resume_path`` would go back to an older one); after the divergence
    guard stopped an attempt it raises the guard's error instead. Before the first
    checkpoint it starts over: rank 0 drops the ``metrics.jsonl`` this job wrote (one written
    before its launcher started is another run's, and the output dir check refuses it as ever).
    """
    import dataclasses
    import os

    from verl_megatron.checkpoint import find_latest_checkpoint

    count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if count == 0:
        return config, None
    trainer = config.trainer
    restart = f"torchrun restart {count} of {os.environ.get('TORCHELASTIC_MAX_RESTARTS', '?')}"
    _refuse_after_divergence(trainer.default_local_dir, restart)
    if find_latest_checkpoint(trainer.default_local_dir) is not None:
        if trainer.resume_mode != "auto":
            config = dataclasses.replace(config, trainer=dataclasses.replace(trainer, resume_mode="auto"))
        return config, f"{restart}: resuming from the newest intact checkpoint"
    metrics = Path(trainer.default_local_dir) / "metrics.jsonl"
    launched = _launcher_started()
    if rank == 0 and launched is not None and metrics.is_file() and metrics.stat().st_mtime >= launched:
        metrics.unlink()
    return config, f"{restart}: no checkpoint yet, starting over"


def _refuse_after_divergence(output_dir: str, restart: str) -> None:
    """Raise the guard's error again when this job's earlier attempt diverged (its marker is newer
    than the launcher): the resume is exact, so the attempt would diverge at the same step."""
    import json

    from verl_megatron.trainer.guard import TrainingDivergedError, divergence_marker

    marker = divergence_marker(output_dir)
    launched = _launcher_started()
    if launched is None or not marker.is_file() or marker.stat().st_mtime < launched:
        return
    record = json.loads(marker.read_text())
    raise TrainingDivergedError(
        f"{record['error']}; {restart} does not resume: it would diverge again at step {record['step']}"
    )


def _launcher_started() -> float | None:
    """When this process's parent (torchrun's agent) started, in seconds since the epoch (Linux)."""
    import os
    import time

    try:
        fields = Path(f"/proc/{os.getppid()}/stat").read_text().rsplit(")", 1)[1].split()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        age = uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: start, in ticks after boot
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - age


def resumed_step_dir(config: PPOConfig, step: int) -> Path:
    """The ``global_step_<step>`` directory a run that resumed at ``step`` loaded."""
    from verl_megatron.checkpoint import storage

    trainer = config.trainer
    if trainer.resume_mode == "resume_path" and trainer.resume_from_path:
        return storage.resolve_part(trainer.resume_from_path, "actor").parent
    return storage.step_dir(trainer.default_local_dir, step)


class RecentWeights:
    """Host copies of the last ``keep`` + 1 weight versions sent to an async run's rollout ranks.

    Version v is generated with by the steps up to v + 1 + keep, so a checkpoint of step c holds
    versions c-keep..c-1 (c itself is the actor's weights): one model copy per version, on the
    sending rank's host memory and disk (``keep`` = 0 or no checkpoints: nothing is kept).
    """

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self.versions: dict[int, dict[str, torch.Tensor]] = {}

    def record(
        self, weights: Iterable[tuple[str, torch.Tensor]], version: int, needed: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Pass ``weights`` (version ``version``) through, keeping a host copy of each tensor when
        a checkpoint will hold the version (``needed``; else nothing is copied)."""
        if self.keep <= 0 or not needed:
            yield from weights
            return
        copy: dict[str, torch.Tensor] = {}
        for name, tensor in weights:
            copy[name] = tensor.detach().to("cpu", copy=True)
            yield name, tensor
        self.versions[version] = copy
        for old in sorted(self.versions)[: -(self.keep + 1)]:
            del self.versions[old]

    def save(self, root: str, step: int) -> None:
        """Stage the versions before ``step`` as a part of checkpoint ``step`` (this rank only)."""
        from verl_megatron.checkpoint.tensor_files import save_tensor_part

        older = {f"v{v}": w for v, w in self.versions.items() if step - self.keep <= v < step}
        if self.keep > 0 and older:
            save_tensor_part(root, step, ROLLOUT_WEIGHTS, older)

    def restore(self, step_dir: Path) -> dict[int, dict[str, torch.Tensor]]:
        """The versions saved in ``step_dir`` (kept again for the next checkpoint), oldest first."""
        from verl_megatron.checkpoint.tensor_files import load_tensor_part

        if self.keep <= 0:
            return {}
        entries = load_tensor_part(step_dir, ROLLOUT_WEIGHTS) or {}
        restored = {
            int(stem[1:]): tensors for stem, tensors in sorted(entries.items(), key=lambda e: int(e[0][1:]))
        }
        self.versions.update(restored)
        return restored
