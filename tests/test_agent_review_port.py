"""A fixed rollout.agent.port with several generating ranks on a node is refused at start-up
(each rank binds its own endpoint: the second failed at its first rollout)."""

from __future__ import annotations

import pytest

from verl_megatron.errors import RolloutConfigError
from verl_megatron.rollout.config import AgentConfig, RolloutConfig, check_agent_port
from verl_megatron.trainer.config import load_config
from verl_megatron.trainer.validate import validate_config

AGENT = "configs/quickstart_agent.yaml"


def test_a_fixed_port_with_several_ranks_per_node_is_refused_at_start_up() -> None:
    with pytest.raises(RolloutConfigError) as err:
        validate_config(load_config(AGENT, ["rollout.agent.port=8011"]), 2)
    text = str(err.value)
    assert "rollout.agent.port=8011" in text and "2 ranks" in text and "\n" not in text, text
    validate_config(load_config(AGENT, ["rollout.agent.port=8011"]), 1)  # one rank: its port
    validate_config(load_config(AGENT, []), 2)  # port 0: a free one each


@pytest.mark.parametrize(
    ("placement", "rollout_ranks", "world_size", "nnodes", "refused"),
    [
        ("colocated", 0, 4, 2, True),  # 2 ranks a node
        ("colocated", 0, 2, 2, False),  # 1 rank a node
        ("separate", 1, 4, 1, False),  # one rank generates
        ("separate", 2, 4, 1, True),
        ("separate", 2, 4, 4, False),
    ],
)
def test_agent_port_counts_the_generating_ranks_of_a_node(
    placement, rollout_ranks, world_size, nnodes, refused
):
    agent = AgentConfig(enable=True, harness="tools", port=8011)
    rollout = RolloutConfig(placement=placement, world_size=rollout_ranks, agent=agent)
    if refused:
        with pytest.raises(RolloutConfigError, match=r"set rollout\.agent\.port=0"):
            check_agent_port(rollout, world_size, nnodes)
    else:
        check_agent_port(rollout, world_size, nnodes)
