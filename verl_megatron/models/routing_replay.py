"""Routing replay (verl's "R3") config: the ``router_replay`` section and its start-up checks.

The native rollout records the experts each MoE router chose for every token it fed; training
routes those tokens to the same experts again (``models/routing.py`` holds the router hook and
the recorder, ``workers/routes.py`` the per-rank route store and the training-side replay).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from verl_megatron.errors import ConfigError, WorkerConfigError

__all__ = ["ROUTER_REPLAY_MODES", "RouterReplayConfig", "check_config"]

ROUTER_REPLAY_MODES = ("disabled", "R3")


@dataclass
class RouterReplayConfig:
    """Routing replay for MoE models (verl's ``actor.megatron.router_replay``)."""

    mode: str = "disabled"
    """``disabled``, or ``R3``: the actor's old-log-prob and update forwards route every token the
    rollout fed to the experts the rollout chose (needs ``rollout.enable_rollout_routing_replay``
    and the native rollout engine). verl's ``R2`` (replaying the old-log-prob routes) is not
    implemented here."""

    def __post_init__(self) -> None:
        if self.mode not in ROUTER_REPLAY_MODES:
            hint = " (R2 is verl's old-log-prob replay, not implemented here)" if self.mode == "R2" else ""
            raise WorkerConfigError(
                f"router_replay.mode must be one of {list(ROUTER_REPLAY_MODES)}, got {self.mode!r}{hint}"
            )


def check_config(
    actor: RouterReplayConfig,
    ref: RouterReplayConfig,
    critic: RouterReplayConfig,
    rollout: Any,
    *,
    cp: int,
    model_path: str | None,
    quickstart: bool,
) -> None:
    """Start-up checks of the routing-replay keys (raises ConfigError naming the key).

    Args:
        actor, ref, critic: each role's ``megatron.router_replay`` section.
        rollout: the rollout section (reads ``enable_rollout_routing_replay``, ``name`` and
            ``multi_turn.enable``).
        cp: ``parallel.cp``.
        model_path: ``model.path`` (its config.json tells whether the model is MoE).
        quickstart: ``quickstart.enable`` (the quickstart model is dense).
    """
    record = rollout.enable_rollout_routing_replay
    for role, section in (("ref", ref), ("critic", critic)):
        if section.mode != "disabled":
            raise ConfigError(
                f"{role}.megatron.router_replay.mode: only the actor replays routes; set it to disabled"
            )
    if actor.mode == "disabled" and not record:
        return
    if actor.mode == "R3" and not record:
        raise ConfigError(
            "actor.megatron.router_replay.mode=R3 replays the rollout's routes: set "
            "rollout.enable_rollout_routing_replay=true"
        )
    if rollout.name != "native":
        raise ConfigError(
            f"rollout.enable_rollout_routing_replay=true: rollout.name={rollout.name!r} cannot record "
            "MoE routes here (only the native engine does); use rollout.name=native or turn routing replay off"
        )
    if rollout.multi_turn.enable:
        raise ConfigError(
            "rollout.enable_rollout_routing_replay=true does not support rollout.multi_turn yet"
        )
    if cp > 1:
        raise ConfigError(
            "rollout.enable_rollout_routing_replay=true does not support context parallelism (parallel.cp > 1)"
        )
    if model_path:
        _check_moe_checkpoint(model_path)
    elif quickstart:
        raise ConfigError(
            "rollout.enable_rollout_routing_replay=true needs a mixture-of-experts model; the quickstart model is dense"
        )


def _check_moe_checkpoint(model_path: str) -> None:
    """Refuse a dense checkpoint (reads its config.json only; an unreadable one passes here)."""
    from verl_megatron.models.config import load_hf_config
    from verl_megatron.models.moe import MOE_MODEL_TYPES, read_moe_architecture

    try:
        hf_config = load_hf_config(model_path)
    except (ValueError, OSError):
        return  # check_model_fits names an unreadable checkpoint
    if hf_config.model_type == "gpt_oss":
        raise ConfigError(
            "rollout.enable_rollout_routing_replay=true is not supported with gpt_oss yet (not verified); "
            "set it to false"
        )
    if read_moe_architecture(hf_config, hf_config.num_hidden_layers) is None:
        raise ConfigError(
            f"rollout.enable_rollout_routing_replay=true needs a mixture-of-experts model; model.path="
            f"'{model_path}' is dense (model_type {hf_config.model_type!r}, MoE types: "
            f"{list(MOE_MODEL_TYPES)})"
        )
