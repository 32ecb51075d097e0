"""The agents' ``isolation`` setting. Their worker process is
:class:`~verl_megatron.utils.call_worker.CallWorker`, below the rollout layer, so that
``rollout/multiturn.py`` runs its environment in one as well.
"""

from __future__ import annotations

from typing import Any

from verl_megatron.errors import ConfigError
from verl_megatron.utils.call_worker import ISOLATION_MODES

__all__ = ["check_isolation"]


def check_isolation(isolation: Any) -> str:
    """``rollout.agent.kwargs.isolation``: ``process`` (the default) or ``none``; else a ConfigError."""
    if isolation not in ISOLATION_MODES:
        raise ConfigError(f"rollout.agent.kwargs.isolation must be one of {ISOLATION_MODES}, got {isolation!r}")  # fmt: skip
    return isolation
