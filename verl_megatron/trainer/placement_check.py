"""Start-up check of ``rollout.placement`` / ``rollout.world_size`` / ``async_training`` against the
rest of the config (the algorithm's features that a separate rollout cannot serve yet)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from verl_megatron.errors import PlacementError

if TYPE_CHECKING:
    from verl_megatron.trainer.config_schema import PPOConfig

__all__ = ["check_placement"]


def check_placement(config: PPOConfig, world_size: int) -> int:
    """Check ``rollout.placement`` / ``rollout.world_size`` / ``async_training`` for a job of
    ``world_size`` processes; return how many of them train."""
    rollout, asyn = config.rollout, config.async_training
    if rollout.placement == "colocated":
        if rollout.world_size != 0:
            raise PlacementError(
                f"rollout.world_size={rollout.world_size} applies only with rollout.placement=separate"
            )
        if asyn.max_staleness > 0 or asyn.partial_rollout or asyn.old_log_probs_on_rollout:
            raise PlacementError(
                "async_training (max_staleness > 0, partial_rollout or old_log_probs_on_rollout) needs "
                "rollout.placement=separate: a colocated rollout generates in turn with training"
            )
        return world_size
    if rollout.name != "native":
        raise PlacementError(
            f"rollout.placement=separate sends the weights to the rollout ranks over the process group, "
            f"which rollout.name={rollout.name!r} cannot receive; use rollout.name=native"
        )
    if rollout.world_size < 1:
        raise PlacementError(
            f"rollout.placement=separate needs rollout.world_size >= 1 (ranks that generate), got {rollout.world_size}"
        )
    if rollout.world_size >= world_size:
        raise PlacementError(
            f"rollout.placement=separate with rollout.world_size={rollout.world_size} leaves no trainer rank "
            f"among the {world_size} processes: start more (torchrun --nproc_per_node) or lower rollout.world_size"
        )
    algo = config.algorithm
    if asyn.max_staleness > 0 and not algo.rollout_correction.enabled:
        raise PlacementError(
            f"async_training.max_staleness={asyn.max_staleness} trains on stale samples: set "
            "algorithm.rollout_correction.rollout_is (e.g. token) or rollout_rs to correct them"
        )
    if asyn.partial_rollout:
        _check_partial_rollout(config)
    unsupported = {
        "algorithm.filter_groups.enable=true": algo.filter_groups.enable,
        "algorithm.adv_estimator=remax": algo.adv_estimator == "remax",
        "rollout.multi_turn.enable=true": rollout.multi_turn.enable,
        # Its model copy is built without the matmul route that carries the tiled kernels.
        "rollout.bitwise_parity=true": rollout.bitwise_parity,
    }
    # The rollout's model copy has no routes to replay, no adapters and no parity kernels.
    if asyn.old_log_probs_on_rollout:
        unsupported.update({
            "async_training.old_log_probs_on_rollout with actor.megatron.router_replay.mode=R3":
                config.actor.megatron.router_replay.mode != "disabled",
            "async_training.old_log_probs_on_rollout with model.lora_rank > 0": config.model.lora_rank > 0,
            "async_training.old_log_probs_on_rollout with actor.recompute_old_log_prob=false (none to compute)":
                not config.actor.recompute_old_log_prob,
        })  # fmt: skip
    for key, on in unsupported.items():
        if on:
            raise PlacementError(f"rollout.placement=separate does not support {key} yet")
    return world_size - rollout.world_size


def _check_partial_rollout(config: PPOConfig) -> None:
    """``async_training.partial_rollout`` only where newer weights can reach a batch in generation,
    and with its segments inside one step's budget of sampling calls (their seeds)."""
    import torch

    from verl_megatron.rollout.async_worker import CALLS_PER_STEP

    rollout, asyn = config.rollout, config.async_training
    if asyn.max_staleness == 0:
        raise PlacementError(
            "async_training.partial_rollout needs async_training.max_staleness >= 1: at 0 the weights of "
            "step s arrive only after batch s+1 is generated, so no segment could take newer ones"
        )
    if rollout.world_size > 1 and torch.cuda.is_available():
        raise PlacementError(
            f"async_training.partial_rollout with rollout.world_size={rollout.world_size} on GPUs: the weights "
            "reach several rollout ranks by one NCCL broadcast that every rank joins at a step's start, never "
            "between segments; use rollout.world_size=1 or turn partial_rollout off"
        )
    segments = -(-rollout.response_length // asyn.partial_rollout_segment)
    if segments > CALLS_PER_STEP:
        raise PlacementError(
            f"async_training.partial_rollout_segment={asyn.partial_rollout_segment} cuts responses of "
            f"{rollout.response_length} tokens into {segments} segments, more than the {CALLS_PER_STEP} sampling "
            "calls a step has (their seeds would repeat the next step's): raise the segment"
        )
