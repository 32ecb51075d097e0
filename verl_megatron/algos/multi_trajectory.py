"""Advantages of a DataProto batch (verl's ``compute_advantage``) and of multi-trajectory
sessions (verl's ``trainer.ppo.v1.utils.compute_advantage_for_multi_trajectories``).

An agent session (one rollout of a prompt) may produce several outputs, e.g. one per turn
that the agent loop trains on separately. Batch key ``f"{uid}_{session}_{index}"`` names
output ``index`` of session ``session`` of prompt ``uid``. With GRPO only each session's
final output (highest index) takes part in the group statistics, so a session counts once
however many outputs it has; its advantage is then given to every output of the session.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from verl_megatron.algos.advantages import (
    AdvantageEstimator,
    compute_gae_advantage_return,
    compute_grpo_outcome_advantage,
    get_adv_estimator_fn,
)
from verl_megatron.algos.pf_ppo import compute_pf_ppo_reweight_data
from verl_megatron.protocol import DataProto

__all__ = ["compute_advantage", "compute_advantage_for_multi_trajectories"]

# Batch columns an estimator receives when the batch has them (gae: values; remax:
# reward_baselines; the optimal-token baselines: the last three).
_OPTIONAL_INPUTS = ("values", "reward_baselines", "sum_pi_squared", "old_log_probs", "rollout_is_weights")


def _option(config: Any, name: str, default: Any) -> Any:
    if config is None:
        return default
    return config.get(name, default) if hasattr(config, "get") else getattr(config, name, default)


def compute_advantage(
    data: DataProto,
    adv_estimator: AdvantageEstimator | str,
    gamma: float = 1.0,
    lam: float = 1.0,
    num_repeat: int = 1,
    norm_adv_by_std_in_grpo: bool = True,
    config: Any = None,
) -> DataProto:
    """Write ``advantages`` and ``returns`` [B, Tr] into `data` (and return it) with the named
    estimator, from ``token_level_rewards`` [B, Tr], ``response_mask`` [B, Tr] (derived from
    ``attention_mask``'s last Tr columns when absent), ``values`` (gae), the ``uid`` groups
    and optional ``reward_baselines``. `num_repeat` is accepted for verl's signature. With
    gae and ``config.use_pf_ppo`` the batch is then resampled (PF-PPO) and the new one returned.
    """
    del num_repeat
    tensors = data.batch
    if "response_mask" not in tensors.keys():  # noqa: SIM118 (TensorDict)
        width = tensors["responses"].shape[-1]
        tensors["response_mask"] = tensors["attention_mask"][:, -width:]
    name = adv_estimator.value if isinstance(adv_estimator, AdvantageEstimator) else str(adv_estimator)
    inputs = {
        "token_level_rewards": tensors["token_level_rewards"],
        "response_mask": tensors["response_mask"],
        "index": data.non_tensor_batch.get("uid"),
        "gamma": gamma,
        "lam": lam,
        "norm_adv_by_std_in_grpo": norm_adv_by_std_in_grpo,
        "config": config,
        "non_tensor_batch": data.non_tensor_batch,
        "batch": tensors,
    }
    inputs.update({key: tensors[key] for key in _OPTIONAL_INPUTS if key in tensors.keys()})  # noqa: SIM118
    # gae and grpo are called directly, as verl does: they work whatever the registry holds.
    direct = {
        AdvantageEstimator.GAE.value: compute_gae_advantage_return,
        AdvantageEstimator.GRPO.value: compute_grpo_outcome_advantage,
    }
    estimator = direct.get(name) or get_adv_estimator_fn(name)
    wanted = inspect.signature(estimator).parameters
    tensors["advantages"], tensors["returns"] = estimator(
        **{key: value for key, value in inputs.items() if key in wanted and value is not None}
    )
    if name == AdvantageEstimator.GAE.value and _option(config, "use_pf_ppo", False):
        pf_ppo = _option(config, "pf_ppo", {}) or {}
        data = compute_pf_ppo_reweight_data(
            data, _option(pf_ppo, "reweight_method", "pow"), _option(pf_ppo, "weight_pow", 2.0)
        )
    return data


def _final_outputs(batch_keys: Sequence[str]) -> tuple[list[int], list[int]]:
    """(row of each session's final output, for every row the position of its session's final
    output in that list). Keys are ``f"{uid}_{session}_{index}"``; uid may contain ``_``."""
    finals: dict[str, tuple[int, int]] = {}  # session -> (index, row)
    sessions = []
    for row, key in enumerate(batch_keys):
        session, _, index = key.rpartition("_")
        if not session or not index.isdigit():
            raise ValueError(f"batch key {key!r} is not '<uid>_<session>_<index>'")
        sessions.append(session)
        if session not in finals or finals[session][0] < int(index):
            finals[session] = (int(index), row)
    order = {session: position for position, session in enumerate(finals)}
    return [row for _, row in finals.values()], [order[session] for session in sessions]


def compute_advantage_for_multi_trajectories(
    data: DataProto, batch_keys: list[str], adv_estimator: AdvantageEstimator | str, *args: Any, **kwargs: Any
) -> DataProto:
    """GRPO over each session's final output, broadcast to all outputs of the session:
    every row gets the scalar advantage of its session's final output (read at that output's
    first response token) times its own ``response_mask``; returns equal advantages. Other
    estimators: `compute_advantage` of the whole batch, unchanged. The remaining arguments
    (gamma, lam, num_repeat, norm_adv_by_std_in_grpo, config) are `compute_advantage`'s."""
    name = adv_estimator.value if isinstance(adv_estimator, AdvantageEstimator) else str(adv_estimator)
    if name != AdvantageEstimator.GRPO.value:
        return compute_advantage(data, adv_estimator, *args, **kwargs)
    if len(batch_keys) != len(data):
        raise ValueError(f"batch_keys has {len(batch_keys)} keys for {len(data)} rows")
    final_rows, session_of_row = _final_outputs(batch_keys)
    finals = compute_advantage(data.select_idxs(np.asarray(final_rows)), adv_estimator, *args, **kwargs)
    first_token = finals.batch["response_mask"].argmax(dim=1)  # 0 for an empty response
    per_session = finals.batch["advantages"][torch.arange(len(final_rows)), first_token]  # [sessions]
    advantages = per_session[torch.as_tensor(session_of_row)].unsqueeze(-1) * data.batch["response_mask"]
    data.batch["advantages"], data.batch["returns"] = advantages, advantages.clone()
    return data
