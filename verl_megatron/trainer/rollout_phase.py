"""Handing the accelerator to a colocated rollout engine for one generation, then taking it back.

Order matters on a GPU: the training state the ``<role>.megatron`` offload switches name is
parked first; the engine then takes back its weights' memory and, if the actor changed since
the last sync, loads them (the actor's own parameters are still on the GPU for that); only then
are the actor's parameters parked and the KV cache allocated. On CPU the offload functions move
nothing. The native engine reads the actor in place.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from verl_megatron.trainer.config import PPOConfig

if TYPE_CHECKING:
    from verl_megatron.models.offload import Offloader
    from verl_megatron.rollout.base import RolloutEngine
    from verl_megatron.workers.actor import MegatronActor, MegatronRef
    from verl_megatron.workers.critic import MegatronCritic

__all__ = ["rollout_phase"]


@contextlib.contextmanager
def rollout_phase(
    config: PPOConfig,
    rollout: RolloutEngine,
    actor: MegatronActor,
    ref: MegatronRef | None,
    critic: MegatronCritic | None,
    sync_weights: Callable[[], None],
    offloader: Offloader,
) -> Iterator[None]:
    """The engine awake with the training state parked (see the module docstring) inside the
    block; ``sync_weights`` loads the actor's weights into the engine when they changed;
    ``offloader`` (the caller's, kept for the run) parks and restores."""
    from verl_megatron.models import offload

    restore: list[tuple[Callable[[Any], None], Any]] = []

    def park(move: Callable[..., None], load: Callable[[Any], None], target: Any, **kwargs: Any) -> None:
        move(target, **kwargs)
        restore.append((load, target))

    actor_off = config.actor.megatron
    if actor_off.optimizer_offload:
        park(offloader.offload_optimizer, offloader.load_optimizer, actor.optimizer)
    if ref is not None and config.ref.megatron.param_offload:
        park(offloader.offload_model, offloader.load_model, ref.chunks, grads=False)
    if critic is not None:
        critic_off = config.critic.megatron
        if critic_off.param_offload:
            park(offloader.offload_model, offloader.load_model, critic.chunks, grads=critic_off.grad_offload)
        if critic_off.optimizer_offload:
            park(offloader.offload_optimizer, offloader.load_optimizer, critic.optimizer)
    rollout.wake_up_weights()
    sync_weights()
    # The native engine generates with the actor's own parameters: they stay.
    if actor_off.param_offload and config.rollout.name != "native":
        park(offloader.offload_model, offloader.load_model, actor.chunks, grads=actor_off.grad_offload)
    if restore:
        offload.empty_device_cache()
    rollout.wake_up()
    try:
        yield
    finally:
        rollout.sleep()
        for load, target in reversed(restore):
            load(target)
