"""Build the reward function from the trainer config, and call it.

Config keys read (verl's names; a DictConfig, a dict or a plain object):

- ``reward_model.reward_manager``: a registered name ("naive", "dapo",
  "batch", "parallel", "prime") or an import path ``pkg.module:Class`` /
  ``pkg.module.Class``; default "naive".
- ``reward_model.reward_kwargs``: keyword arguments for the manager (e.g.
  ``max_resp_len``, ``overlong_buffer_cfg``, ``compute_score_timeout``).
- ``custom_reward_function.path`` / ``.name`` (default "compute_score") /
  ``.reward_kwargs``: a scorer in a Python file, with bound keyword args.
- ``data.reward_fn_key``: the non-tensor column naming the data source.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

import torch

from verl_megatron.utils.reward_score import batch_default_compute_score, default_compute_score
from verl_megatron.utils.reward_score.custom import load_custom_compute_score
from verl_megatron.workers.reward_manager import (
    REWARD_MANAGER_REGISTRY,
    BatchRewardManager,
    get_reward_manager_cls,
)

_MISSING = object()


def _get(node: Any, key: str, default: Any = None) -> Any:
    """``node[key]`` for dict-like configs, ``node.key`` for objects; ``default``
    when absent or None."""
    if node is None:
        return default
    if hasattr(node, "get") and not isinstance(node, type):
        value = node.get(key, _MISSING)
    else:
        value = getattr(node, key, _MISSING)
    return default if value is _MISSING or value is None else value


def _as_dict(node: Any, where: str) -> dict[str, Any]:
    if node is None:
        return {}
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(node, DictConfig):
            return dict(OmegaConf.to_container(node, resolve=True))
    except ImportError:  # omegaconf is a dependency, but plain dicts need nothing from it
        pass
    if isinstance(node, dict):
        return dict(node)
    if hasattr(node, "__dict__"):
        return {k: v for k, v in vars(node).items() if not k.startswith("_")}
    raise TypeError(f"{where} must be a mapping, got {type(node).__name__}")


def resolve_reward_manager_cls(name: str) -> type:
    """A registered name, or a class given by import path (``pkg.mod:Cls`` or
    ``pkg.mod.Cls``). Raises ValueError listing the registered names."""
    if name in REWARD_MANAGER_REGISTRY:
        return get_reward_manager_cls(name)
    if ":" not in name and "." not in name:
        return get_reward_manager_cls(name)  # raises, listing the registered names
    module_name, _, attr = name.partition(":") if ":" in name else name.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        known = ", ".join(sorted(REWARD_MANAGER_REGISTRY))
        raise ValueError(
            f"reward_model.reward_manager={name!r}: cannot import module {module_name!r} ({err}); "
            f"registered reward managers: {known}"
        ) from err
    cls = getattr(module, attr, None)
    if not isinstance(cls, type):
        raise ValueError(
            f"reward_model.reward_manager={name!r}: module {module_name!r} has no class {attr!r}"
        )
    return cls


def get_custom_reward_fn(config: Any) -> Callable[..., Any] | None:
    """The scorer named by ``custom_reward_function``, loaded now, or None."""
    custom = _get(config, "custom_reward_function")
    path = _get(custom, "path")
    if not path:
        return None
    name = _get(custom, "name", "compute_score")
    kwargs = _as_dict(_get(custom, "reward_kwargs"), "custom_reward_function.reward_kwargs")
    return load_custom_compute_score(path, name, kwargs)


def load_reward_manager(config: Any, tokenizer: Any, num_examine: int = 0, **reward_kwargs: Any) -> Any:
    """Instantiate the configured reward manager.

    The custom scorer (if configured) is imported here, so a missing file, a
    syntax error or a missing function fails at start-up, naming the path
    and function. ``reward_kwargs`` override ``reward_model.reward_kwargs``.
    """
    reward_model = _get(config, "reward_model")
    manager_cls = resolve_reward_manager_cls(str(_get(reward_model, "reward_manager", "naive")))
    compute_score = get_custom_reward_fn(config)
    if compute_score is None:
        batched = issubclass(manager_cls, BatchRewardManager)
        compute_score = batch_default_compute_score if batched else default_compute_score
    manager_kwargs = _as_dict(_get(reward_model, "reward_kwargs"), "reward_model.reward_kwargs")
    manager_kwargs.update(reward_kwargs)
    return manager_cls(
        tokenizer=tokenizer,
        num_examine=num_examine,
        compute_score=compute_score,
        reward_fn_key=_get(_get(config, "data"), "reward_fn_key", "data_source"),
        **manager_kwargs,
    )


def _accepts_return_dict(reward_fn: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(reward_fn).parameters
    except (TypeError, ValueError):
        return True
    return "return_dict" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def compute_reward(data: Any, reward_fn: Callable[..., Any]) -> tuple[torch.Tensor, dict[str, list[Any]]]:
    """``(reward_tensor [B, T_resp], reward_extra_infos_dict)`` for ``data``.

    A reward function without ``return_dict`` (a bare callable returning the
    tensor) gives an empty extra-info dict.
    """
    if not _accepts_return_dict(reward_fn):
        return reward_fn(data), {}
    result = reward_fn(data, return_dict=True)
    if isinstance(result, torch.Tensor):
        return result, {}
    return result["reward_tensor"], dict(result.get("reward_extra_info", {}))
