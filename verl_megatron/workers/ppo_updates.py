"""The update call the actor and the critic share (``update_policy`` / ``update_critic``)."""

from __future__ import annotations

from typing import Any

import torch

from verl_megatron.models.matmul_route import MatmulRoute, accumulate_into_main_grad
from verl_megatron.workers.model_runner import ModelRunner

__all__ = ["PPOUpdates"]


class PPOUpdates:
    """The update call the actor and the critic share: PPO epochs of one optimizer step per
    mini-batch through ``runner``, then one scheduler step. ``update_calls`` counts the calls
    (it seeds the mini-batch order and is checkpointed by the trainer). ``route``: the one the
    chunks were built with (``build_gpt_chunks(..., route=)``), turned on for each update; None
    leaves the update on DDP's own gradient path."""

    runner: ModelRunner
    config: Any
    optimizer: Any
    scheduler: Any
    update_calls: int
    route: MatmulRoute | None

    def _ppo_update(
        self, batch: dict[str, torch.Tensor], *, prefix: str, **epochs
    ) -> dict[str, float | list[float]]:
        """:meth:`ModelRunner.ppo_epochs` (``epochs``: its tensor_keys, loss_step, metric_names, late)
        with ``{prefix}/lr`` (the rate these steps used) and ``{prefix}/skipped_steps`` (steps
        dropped for a non-finite gradient norm) added."""
        cfg = self.config
        seed = cfg.data_loader_seed if cfg.data_loader_seed is not None else self.runner.runtime.seed
        lr = float(self.optimizer.param_groups[0]["lr"])
        # Weight gradients go straight into DDP's buffer while the update runs (CPU, float32).
        with accumulate_into_main_grad(self.route, self.runner.chunks):
            history, skipped = self.runner.ppo_epochs(
                batch, self.optimizer, cfg=cfg, seed=seed + 7919 * self.update_calls, prefix=prefix, **epochs
            )
        self.scheduler.step(1)
        self.update_calls += 1
        metrics: dict[str, float | list[float]] = dict(history)
        metrics[f"{prefix}/lr"] = lr
        metrics[f"{prefix}/skipped_steps"] = float(skipped)
        return metrics
