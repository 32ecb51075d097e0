"""Optimizer settings and learning-rate schedule from an ``OptimConfig``.

The schedule is megatron's ``OptimizerParamScheduler`` (warmup from ``lr_warmup_init``
to ``lr``, then constant / linear / cosine / inverse-square-root decay to ``min_lr``),
stepped once per training step by the workers. Its state_dict is what checkpoints save.
Like megatron (and verl), step k of a warmup of W steps trains with
``lr_warmup_init + (lr - lr_warmup_init) * k / W``: the first step uses ``lr_warmup_init``.
"""

from __future__ import annotations

from verl_megatron.errors import WorkerConfigError
from verl_megatron.models.megatron_model import OptimSettings
from verl_megatron.workers.config import OptimConfig

__all__ = ["build_lr_scheduler", "optim_settings", "warmup_steps"]


def optim_settings(optim: OptimConfig, *, bf16: bool = False) -> OptimSettings:
    """The megatron optimizer settings for ``build_optimizer`` (``bf16``: the model's params are bf16)."""
    return OptimSettings(
        lr=optim.lr,
        min_lr=optim.min_lr,
        weight_decay=optim.weight_decay,
        betas=tuple(optim.betas),
        clip_grad=optim.clip_grad,
        optimizer=optim.optimizer,
        bf16=bf16,
        use_distributed_optimizer=optim.use_distributed_optimizer,
        overlap_grad_reduce=optim.overlap_grad_reduce,
        overlap_param_gather=optim.overlap_param_gather,
        optimizer_cpu_offload=optim.optimizer_cpu_offload,
        optimizer_offload_fraction=optim.optimizer_offload_fraction,
        use_precision_aware_optimizer=optim.use_precision_aware_optimizer,
    )


def warmup_steps(optim: OptimConfig) -> int:
    """lr_warmup_steps if positive, else int(lr_warmup_steps_ratio * total_training_steps)."""
    if optim.lr_warmup_steps is not None and optim.lr_warmup_steps > 0:
        return int(optim.lr_warmup_steps)
    if optim.lr_warmup_steps_ratio > 0:
        if optim.total_training_steps <= 0:
            raise WorkerConfigError(
                "optim.lr_warmup_steps_ratio > 0 needs optim.total_training_steps (set by the trainer); "
                f"got total_training_steps={optim.total_training_steps}"
            )
        return int(optim.lr_warmup_steps_ratio * optim.total_training_steps)
    return 0


def build_lr_scheduler(optimizer, optim: OptimConfig):
    """Megatron's OptimizerParamScheduler for ``optimizer``; sets the step-0 rate right away."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    warmup = warmup_steps(optim)
    decay = optim.lr_decay_steps
    if decay is None:
        decay = optim.total_training_steps
    if optim.lr_decay_style != "constant" and (decay is None or decay <= warmup):
        raise WorkerConfigError(
            f"optim.lr_decay_style={optim.lr_decay_style!r} needs lr_decay_steps (or total_training_steps) "
            f"greater than the {warmup} warmup steps; got {decay}"
        )
    if optim.lr_decay_style == "constant":
        # A constant schedule never reads the decay length; megatron only requires it to exceed warmup.
        decay = max(decay or 0, warmup + 1)
    return OptimizerParamScheduler(
        optimizer,
        init_lr=optim.lr_warmup_init,
        max_lr=optim.lr,
        min_lr=optim.min_lr,
        lr_warmup_steps=warmup,
        lr_decay_steps=decay,
        lr_decay_style=optim.lr_decay_style,
        start_wd=optim.weight_decay,
        end_wd=optim.weight_decay,
        wd_incr_steps=max(decay, 1),
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=True,
    )
