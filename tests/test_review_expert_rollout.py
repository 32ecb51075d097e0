"""Colocated native rollouts whose replicas meet in the MoE layers refuse multi-turn and agent
rollouts at start-up: each replica would choose its own generate calls and the others would hang."""

from __future__ import annotations

import os

import pytest

from verl_megatron.errors import RolloutConfigError
from verl_megatron.trainer.config import load_config, validate_config

QUICKSTART = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "quickstart.yaml"
)
FEATURES = {
    "rollout.multi_turn.enable": ["rollout.multi_turn.enable=true", "rollout.multi_turn.environment=x"],
    "rollout.agent.enable": ["rollout.agent.enable=true", "rollout.agent.harness=tools"],
}


@pytest.mark.parametrize("key", list(FEATURES))
@pytest.mark.parametrize(
    ("layout", "where"),
    [
        (["parallel.ep=2"], "parallel.ep=2, expert tp 1, tp 1"),
        (["parallel.etp=2"], "parallel.ep=1, expert tp 2, tp 1"),
    ],
    ids=["ep2", "etp2"],
)
def test_multi_turn_and_agent_rollouts_are_refused_when_replicas_share_experts(key, layout, where):
    with pytest.raises(RolloutConfigError) as err:
        validate_config(load_config(QUICKSTART, [*FEATURES[key], *layout]), 2)
    line = str(err.value)
    assert line.startswith(f"{key}=true with {where}: the native rollout's replicas meet in the MoE layers")
    assert line.endswith("use parallel.ep=1 with parallel.etp <= parallel.tp, or rollout.name=vllm/sglang")
    assert "\n" not in line


@pytest.mark.parametrize("key", list(FEATURES))
def test_they_still_pass_where_each_replica_has_its_own_experts(key):
    for layout in (["parallel.tp=2", "parallel.etp=2"], ["parallel.tp=2", "parallel.etp=1"], []):
        validate_config(load_config(QUICKSTART, [*FEATURES[key], *layout]), 2)
    validate_config(load_config(QUICKSTART, [*FEATURES[key], "parallel.ep=1"]), 1)
