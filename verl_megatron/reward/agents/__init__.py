"""Agent harnesses and environment adapters for ``rollout.agent`` (they run tools in the code
sandbox, so they live at the reward layer; the rollout layer only knows the ``Harness``
protocol of ``verl_megatron.rollout.agent``).

``rollout.agent.harness``: ``tools`` (the built-in tool loop, ``tools.py``) or
``pkg.module:name`` / ``/path/file.py:name`` of a factory called with ``rollout.agent.kwargs``
that returns a harness (``run(task, client) -> AgentOutcome``). ``verifiers`` and ``openenv``
adapters are not built in yet (a named error says so).
"""

from __future__ import annotations

from typing import Any

from verl_megatron.errors import ConfigError
from verl_megatron.rollout.config import AgentConfig
from verl_megatron.utils.import_utils import load_object

__all__ = ["build_harness"]


def build_harness(agent: AgentConfig) -> Any:
    """The harness ``rollout.agent`` names, built before any model (a bad name fails fast)."""
    kwargs = dict(agent.kwargs)
    if agent.harness == "tools":
        from verl_megatron.reward.agents.tools import ToolHarness

        return ToolHarness(agent, **kwargs)
    if agent.harness in ("verifiers", "openenv"):
        raise ConfigError(
            f"rollout.agent.harness={agent.harness}: no built-in adapter yet; write a harness factory "
            "('pkg.module:name') whose harness points the environment's OpenAI client at task.base_url"
        )
    factory = load_object(agent.harness, "rollout.agent.harness")
    try:
        return factory(**kwargs)
    except TypeError as err:
        raise ConfigError(
            f"rollout.agent.harness={agent.harness!r} with rollout.agent.kwargs: {err}"
        ) from None
