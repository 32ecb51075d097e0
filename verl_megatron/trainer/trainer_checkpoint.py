"""The trainer's checkpoints: the actor's (and critic's) parts of a step, staged then published.

A step's parts are written inside the step (``save_step``) and published only once its metrics
are logged (``publish_step``), so a run killed in between resumes from the previous checkpoint
and no published step is ever missing from the log. ``load_resume_state`` loads the checkpoint
``trainer.resume_mode`` points at into the workers and returns the trainer's saved state.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from verl_megatron.distributed.parallel import Runtime
from verl_megatron.trainer.config import PPOConfig, to_dict

if TYPE_CHECKING:
    from verl_megatron.workers.actor import MegatronActor
    from verl_megatron.workers.critic import MegatronCritic

__all__ = ["load_resume_state", "publish_step", "save_step"]


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
