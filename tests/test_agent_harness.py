"""Agent harnesses (reward/agents/), the agent reward manager, and the agent quickstart recipe.

The built-in tool loop runs each tool call in the code sandbox (a hanging tool answers
``tool error: timeout`` within its wall limit); the ``agent`` reward manager puts per-turn
rewards at each turn's last token and the trajectory's at the last one, and counts the
multi-turn statistics. configs/quickstart_agent.yaml's step runs in tests/test_recipes.py.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest
import torch

from verl_megatron.errors import ConfigError
from verl_megatron.protocol import DataProto
from verl_megatron.rollout.config import AgentConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOOKUP = {
    "function": "verl_megatron.data.lookup_task:lookup_value",
    "parameters": ["key"],
    "kwargs": {"seed": 0},
}


def test_tools_run_in_the_sandbox_with_per_call_limits(tmp_path):
    from verl_megatron.data.lookup_task import lookup_value
    from verl_megatron.reward.agents import build_harness
    from verl_megatron.reward.agents.tools import ToolCallLog, lookup_score

    hang = tmp_path / "hang.py"
    hang.write_text("def spin(x):\n    while True:\n        pass\n")
    agent = AgentConfig(enable=True, harness="tools", tool_wall_s=30.0, tool_cpu_s=1.0,
                        kwargs={"tools": {"lookup": LOOKUP, "spin": {"function": f"{hang}:spin", "parameters": ["x"]}},
                                "score": "verl_megatron.reward.agents.tools:lookup_score"})  # fmt: skip
    harness = build_harness(agent).harness  # the tool loop inside its ContainedHarness
    calls: list[ToolCallLog] = []
    call = {"function": {"name": "lookup", "arguments": json.dumps({"key": "37"})}}
    assert harness._run(call, 0, calls) == lookup_value("37", 0) == calls[0].result
    start = time.monotonic()
    spun = harness._run({"function": {"name": "spin", "arguments": '{"x": "1"}'}}, 1, calls)
    assert spun == "tool error: timeout" or spun == "tool error: cpu_limit", spun  # killed: it never ends
    assert time.monotonic() - start < 120
    assert harness._run({"function": {"name": "nope", "arguments": "{}"}}, 1, calls).startswith(
        "tool error: no tool"
    )
    assert [c.ok for c in calls] == [True, False, False]
    row = {"extra_info": {"key": "37"}, "reward_model": {"ground_truth": lookup_value("37", 0)}}
    assert lookup_score(lookup_value("37", 0), row, calls) == (0.75, [0.25])
    assert lookup_score(None, row, calls[1:]) == (0.0, [0.0])
    half = (
        str((int(lookup_value("37", 0)[0]) + 1) % 10) + lookup_value("37", 0)[1]
    )  # one digit of two in place
    assert lookup_score(half, row, [ToolCallLog(0, "lookup", {"key": "3"}, "", True)]) == (
        0.375,
        [0.1 + 0.075],
    )
    with pytest.raises(ConfigError, match=r"rollout\.agent\.kwargs\.tools\.bad\.function"):
        build_harness(
            AgentConfig(
                enable=True,
                harness="tools",
                kwargs={"tools": {"bad": {"function": "nowhere:f"}}, "score": "x:y"},
            )
        )


def test_agent_reward_manager_places_turn_and_trajectory_rewards():
    from verl_megatron.reward.loading import load_reward_manager

    manager = load_reward_manager({"reward_model": {"reward_manager": "agent"}}, tokenizer=None)
    columns = {
        "agent_reward": [0.75, -1.0],
        "agent_turn_rewards": [[0.25, 0.1], []],
        "agent_turn_ends": [[2, 6], []],
        "agent_failure": ["", "timeout"],
        "agent_truncated": ["", ""],
        "agent_turns": [2, 0],
        "agent_tool_calls": [1, 0],
        "agent_env_seconds": [0.5, 0.0],
        "agent_context_resets": [0, 0],
    }
    non_tensors = {k: np.array([*v, None], dtype=object)[:2] for k, v in columns.items()}
    attention = torch.tensor([[1, 1, 1, 1] + [1] * 6 + [0, 0], [1, 1, 1, 1] + [0] * 8])
    batch = DataProto.from_dict(
        {"responses": torch.zeros(2, 8, dtype=torch.long), "attention_mask": attention},
        non_tensors=non_tensors,
    )
    out = manager(batch, return_dict=True)
    expected = torch.zeros(2, 8)
    expected[0, 2], expected[0, 5], expected[0, 6], expected[1, 0] = 0.25, 0.75, 0.1, -1.0
    assert torch.equal(out["reward_tensor"], expected), out["reward_tensor"]
    extra = out["reward_extra_info"]
    expected_extra = {
        "turns": [2.0, 0.0], "tool_calls": [1.0, 0.0], "env_seconds": [0.5, 0.0], "truncated": [0.0, 0.0],
        "context_resets": [0.0, 0.0], "trajectories": [1.0, 1.0], "failure_timeout": [0.0, 1.0],
        **{f"failure_{c}": [0.0, 0.0] for c in ("error", "invalid", "max_turns", "token_budget", "prompt_too_long")},
    }  # fmt: skip
    assert extra == {f"reward/agent/{k}_count": v for k, v in expected_extra.items()}, extra
    with pytest.raises(ValueError, match=r"rollout\.agent\.enable=true"):
        manager(DataProto.from_dict({"responses": torch.zeros(1, 2), "attention_mask": torch.ones(1, 4)}))


def test_agent_config_errors_name_the_key():
    from verl_megatron.errors import RolloutConfigError
    from verl_megatron.rollout.config import MultiTurnConfig, RolloutConfig

    tools = AgentConfig(enable=True, harness="tools")
    cases = [
        ({"agent": AgentConfig(enable=True)}, r"needs rollout\.agent\.harness"),
        ({"agent": tools, "name": "vllm"}, r"rollout\.tensor_model_parallel_size=1, got 2"),
        ({"agent": tools, "multi_turn": MultiTurnConfig(enable=True, environment="m:f")}, r"multi_turn"),
        ({"agent": AgentConfig(enable=True, harness="x", tool_call_format="xml")}, r"tool_call_format"),
        (
            {"agent": AgentConfig(enable=True, harness="x", max_turns=0)},
            r"rollout\.agent\.max_turns must be > 0",
        ),
    ]
    for fields, message in cases:
        with pytest.raises(RolloutConfigError, match=message):
            RolloutConfig(**fields)
    # the separate rollout rank and the vLLM / SGLang engines serve the endpoint too
    RolloutConfig(agent=tools, placement="separate", world_size=1)
    RolloutConfig(agent=tools, name="sglang", tensor_model_parallel_size=1)
