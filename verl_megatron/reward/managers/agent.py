"""The ``agent`` reward manager: the rewards an agent harness returned, placed on its tokens.

An agentic rollout (``rollout.agent``, ``verl_megatron.rollout.agent``) leaves per sample the
trajectory's reward, its per-turn rewards and each policy turn's last response index. Each turn's
reward goes on that turn's last token, the trajectory's on the last response token (GRPO sums
them; GAE sees them where they were earned). The multi-turn statistics come back as
``reward/agent/*_count`` extra info, summed over the batch into the step's metrics: turns, tool
calls, environment seconds, truncations and failures by cause.
"""

from __future__ import annotations

from typing import Any

import torch

from verl_megatron.reward.managers.registry import register

__all__ = ["FAILURE_CAUSES", "AgentRewardManager"]

# Why a trajectory scored rollout.agent.failure_score (first three: the environment's fault).
FAILURE_CAUSES = ("error", "timeout", "invalid", "max_turns", "token_budget", "prompt_too_long")


@register("agent")
class AgentRewardManager:
    """Token-level rewards from the agent columns of a rollout batch (module docstring). The
    usual manager arguments are accepted and unused: the harness scored the samples."""

    def __init__(self, tokenizer: Any = None, num_examine: int = 0, **unused: Any) -> None:
        self.tokenizer = tokenizer

    def __call__(self, data: Any, return_dict: bool = False) -> Any:
        columns = data.non_tensor_batch
        if "agent_reward" not in columns:
            raise ValueError(
                "reward_model.reward_manager=agent scores agentic rollouts: set rollout.agent.enable=true"
            )
        responses = data.batch["responses"]
        length = responses.shape[1]
        present = data.batch["attention_mask"][:, -length:].sum(-1).tolist()
        reward = torch.zeros(responses.shape, dtype=torch.float32)
        for i in range(len(responses)):
            for end, value in zip(columns["agent_turn_ends"][i], columns["agent_turn_rewards"][i]):
                reward[i, min(int(end), length - 1)] += float(value)
            reward[i, max(int(present[i]) - 1, 0)] += float(columns["agent_reward"][i])
        if not return_dict:
            return reward
        return {"reward_tensor": reward, "reward_extra_info": agent_metrics(columns)}


def agent_metrics(columns: dict[str, Any]) -> dict[str, list[float]]:
    """Per-sample ``reward/agent/*_count`` values (their batch sums are the step's metrics)."""
    failures = list(columns["agent_failure"])
    extra = {
        "reward/agent/turns_count": [float(v) for v in columns["agent_turns"]],
        "reward/agent/tool_calls_count": [float(v) for v in columns["agent_tool_calls"]],
        "reward/agent/env_seconds_count": [float(v) for v in columns["agent_env_seconds"]],
        "reward/agent/truncated_count": [float(bool(v)) for v in columns["agent_truncated"]],
        "reward/agent/context_resets_count": [float(v) for v in columns["agent_context_resets"]],
        "reward/agent/trajectories_count": [1.0] * len(failures),
    }
    for cause in FAILURE_CAUSES:
        extra[f"reward/agent/failure_{cause}_count"] = [float(f == cause) for f in failures]
    return extra
