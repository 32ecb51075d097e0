"""Agent harnesses and environment adapters for ``rollout.agent`` (they run tools in the code
sandbox, so they live at the reward layer; the rollout layer only knows the ``Harness``
protocol of ``verl_megatron.rollout.agent``).

``rollout.agent.harness``: ``tools`` (the built-in tool loop, ``tools.py``), ``verifiers`` (a
verifiers 0.4 taskset, ``verifiers_env.py``), or ``pkg.module:name`` / ``/path/file.py:name`` of
a factory called with ``rollout.agent.kwargs`` that returns a harness (``run(task, client) ->
AgentOutcome``). ``openenv`` steps an OpenEnv ``Environment`` subclass in-process
(``openenv_env.py``, openenv-core 0.3).
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
    if agent.harness == "verifiers":
        from verl_megatron.reward.agents.verifiers_env import VerifiersHarness

        return VerifiersHarness(agent, **kwargs)
    if agent.harness == "openenv":
        from verl_megatron.reward.agents.openenv_env import OpenEnvHarness

        return OpenEnvHarness(agent, **kwargs)
    factory = load_object(agent.harness, "rollout.agent.harness")
    try:
        return factory(**kwargs)
    except TypeError as err:
        raise ConfigError(
            f"rollout.agent.harness={agent.harness!r} with rollout.agent.kwargs: {err}"
        ) from None
