"""Agent harnesses and environment adapters for ``rollout.agent`` (they run tools in the code
sandbox, so they live at the reward layer; the rollout layer only knows the ``Harness``
protocol of ``verl_megatron.rollout.agent``).

``rollout.agent.harness``: ``tools`` (the built-in tool loop, ``tools.py``), ``verifiers`` (a
verifiers 0.4 taskset, ``verifiers_env.py``), or ``pkg.module:name`` / ``/path/file.py:name`` of
a factory called with ``rollout.agent.kwargs`` that returns a harness (``run(task, client) ->
AgentOutcome``). ``openenv`` steps an OpenEnv ``Environment`` subclass, each instance in a
worker process (``openenv_env.py``, openenv-core 0.3).

User code is contained by default (``rollout.agent.kwargs.isolation: process``): a tools (its
score function), verifiers or custom harness runs each trajectory's ``run`` in a worker
process of its own (``contained.py``), an OpenEnv environment each instance; ``isolation:
none`` runs them in the trainer process (trusted code; a custom factory never sees the key).
"""

from __future__ import annotations

from typing import Any

from verl_megatron.errors import ConfigError
from verl_megatron.reward import sandbox
from verl_megatron.reward.agents.contained import ContainedHarness
from verl_megatron.reward.agents.worker import check_isolation
from verl_megatron.rollout.config import AgentConfig
from verl_megatron.utils.import_utils import load_object

__all__ = ["build_harness"]


def build_harness(agent: AgentConfig) -> Any:
    """The harness ``rollout.agent`` names, built before any model (a bad name fails fast)."""
    kwargs = dict(agent.kwargs)
    if agent.harness == "openenv":
        from verl_megatron.reward.agents.openenv_env import OpenEnvHarness

        return OpenEnvHarness(agent, **kwargs)
    isolation = check_isolation(kwargs.pop("isolation", "process"))
    if agent.harness == "tools":  # its score function is user code
        from verl_megatron.reward.agents.tools import ToolHarness

        harness = ToolHarness(agent, **kwargs)
        if agent.tool_isolation == "auto" and isolation == "process":
            sandbox.detect_isolation()  # probed (and cached) once here, not in every worker
    elif agent.harness == "verifiers":
        from verl_megatron.reward.agents.verifiers_env import VerifiersHarness

        harness = VerifiersHarness(agent, **kwargs)
    else:
        harness = _custom(agent.harness, kwargs)
    return harness if isolation == "none" else ContainedHarness(harness)


def _custom(spec: str, kwargs: dict[str, Any]) -> Any:
    factory = load_object(spec, "rollout.agent.harness")
    try:
        return factory(**kwargs)
    except TypeError as err:
        raise ConfigError(f"rollout.agent.harness={spec!r} with rollout.agent.kwargs: {err}") from None
