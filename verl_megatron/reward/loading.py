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

import difflib
import functools
import importlib
import inspect
import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import torch

from verl_megatron.reward.combine import FormulaError, compile_formula, default_formula
from verl_megatron.reward.managers import (
    REWARD_MANAGER_REGISTRY,
    BatchRewardManager,
    RewardManagerBase,
    get_reward_manager_cls,
)
from verl_megatron.reward.scorers import (
    batch_default_compute_score,
    check_file,
    default_compute_score,
    is_known_data_source,
    known_data_sources,
)
from verl_megatron.reward.scorers.custom import load_custom_compute_score

_MISSING = object()
# Importing a scorer file may import heavy libraries (torch, sympy): seconds, not minutes.
_CHECK_TIMEOUT_S = 120.0
# The keyword arguments a per-sample reward manager calls compute_score with (base.py's
# ScoreTask), and those of BatchRewardManager (plus its extra reward_kwargs).
SAMPLE_CALL_ARGS = ("data_source", "solution_str", "ground_truth", "extra_info")
BATCH_CALL_ARGS = ("data_sources", "solution_strs", "ground_truths", "extra_infos")


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


def check_scorer_file(
    path: str, name: str, timeout: float = _CHECK_TIMEOUT_S, call_args: list[str] | None = None
) -> str | None:
    """Import the scorer file ``path`` in a child interpreter and look up ``name``.

    Returns None when it loads (and, given ``call_args``, its signature takes those keyword
    arguments), else a one-line message naming the file (and line) and the function. The
    child contains whatever the file's top level does: an exception, ``sys.exit``,
    ``os._exit``, a crash or a hang (cut off after ``timeout`` seconds).
    """
    full_path = os.path.abspath(os.path.expanduser(str(path)))
    where = f"custom_reward_function.path='{path}'"
    if not os.path.isfile(full_path):
        return f"{where}: file not found (resolved to '{full_path}')"
    with open(check_file.__file__) as f:
        source = f.read()
    try:
        child = subprocess.run(
            [sys.executable, "-c", source, full_path, str(name), json.dumps(list(call_args or []))],
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        return f"{where}: importing it did not finish within {timeout:g} s; cannot load function '{name}'"
    results = [line for line in child.stdout.splitlines() if line.startswith(check_file.MARKER)]
    if not results:
        return (
            f"{where}: importing it ended the interpreter (exit code {child.returncode}); "
            f"cannot load function '{name}'"
        )
    return json.loads(results[-1][len(check_file.MARKER) :]).get("error")


def _check_manager_kwargs(manager_cls: type, kwargs: dict[str, Any]) -> str | None:
    """A message naming the first key of ``reward_model.reward_kwargs`` the manager does not take."""
    params = inspect.signature(manager_cls.__init__).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return None
    accepted = [n for n in params if n not in ("self", "tokenizer", "num_examine", "compute_score")]
    for key in kwargs:
        if key not in params:
            close = difflib.get_close_matches(key, accepted, n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            return (
                f"reward_model.reward_kwargs.{key}: {manager_cls.__name__} takes no such argument; {hint}"
                f"(it takes: {', '.join(accepted)})"
            )
    return None


def _check_manager_values(manager_cls: type, kwargs: dict[str, Any]) -> str | None:
    """A message when a registered manager refuses the values of ``reward_model.reward_kwargs``
    (a manager is cheap to make: its worker processes start on the first call)."""
    if not manager_cls.__module__.startswith("verl_megatron."):
        return None  # a user's class: made once, when the trainer builds it
    try:
        manager = manager_cls(tokenizer=None, num_examine=0, **kwargs)
    except (TypeError, ValueError) as err:
        return f"reward_model.reward_kwargs: {' '.join(str(err).split())}"
    close = getattr(manager, "close", None)
    if close is not None:
        close()
    return None


def dapo_extra_kwargs(config: Any) -> dict[str, Any]:
    """The arguments the trainer gives the "dapo" manager beyond ``reward_model.reward_kwargs``
    (they override those): ``data.max_response_length`` and ``reward_model.overlong_buffer``."""
    reward_model = _get(config, "reward_model")
    if str(_get(reward_model, "reward_manager", "naive")) != "dapo":
        return {}
    return {
        "max_resp_len": _get(_get(config, "data"), "max_response_length"),
        "overlong_buffer_cfg": _get(reward_model, "overlong_buffer"),
    }


def _scorer_call_args(manager_cls: type, kwargs: dict[str, Any], custom: Any) -> list[str]:
    """The keyword arguments the manager's calls give the custom scorer (bound ones included)."""
    if issubclass(manager_cls, BatchRewardManager):
        own = inspect.signature(manager_cls.__init__).parameters
        args = [*BATCH_CALL_ARGS, *(key for key in kwargs if key not in own)]
    else:
        args = list(SAMPLE_CALL_ARGS)
    bound = _as_dict(_get(custom, "reward_kwargs"), "custom_reward_function.reward_kwargs")
    return list(dict.fromkeys([*args, *bound]))


def _uses_rule(reward_model: Any) -> bool:
    """Whether the final reward reads the rule reward (``reward_model.combine``)."""
    judge_on = bool(_get(_get(reward_model, "judge"), "enable", False))
    text = _get(reward_model, "combine") or default_formula(
        bool(_get(reward_model, "enable", False)), judge_on
    )
    try:
        return "rule" in compile_formula(str(text)).names
    except FormulaError:  # reported by the model-reward check
        return True


def _files(value: Any) -> list[str]:
    if not value:
        return []
    return [str(value)] if isinstance(value, (str, os.PathLike)) else [str(v) for v in value]


def _reward_rows(path: str, key: str) -> list[Any]:
    """The rows of ``path``; of a parquet file only the two reward columns (cheaper)."""
    from verl_megatron.data.dataset import read_rows

    if path.endswith(".parquet") and os.path.isfile(path):
        try:
            import pyarrow.parquet as pq

            return pq.read_table(path, columns=[key, "reward_model"]).to_pylist()
        except Exception:  # read_rows below names what is wrong with the file
            pass
    return read_rows(path)


class _FileRewardFacts:
    """Of one data file, what the default-scorer check refuses: the first row whose data
    source has no rule (its number and source) and the first row whose ground truth is null."""

    def __init__(self) -> None:
        self.unknown_source: tuple[int, Any] | None = None
        self.null_truth: int | None = None

    def add(self, row_no: int, source: Any, reward_model: Any) -> None:
        if self.unknown_source is None and not is_known_data_source(source):
            self.unknown_source = (row_no, source)
        if (
            self.null_truth is None
            and isinstance(reward_model, dict)
            and reward_model.get("ground_truth") is None
        ):
            self.null_truth = row_no


class RewardColumns:
    """The reward columns of the data files, gathered while the start-up data check reads them
    (``check_data_files(..., on_row=columns.add)``), so that :func:`check_default_scorer_data`
    does not read the files a second time. Keeps two facts a file, not its rows."""

    def __init__(self) -> None:
        self._files: dict[str, _FileRewardFacts] = {}

    def add(self, path: str, row_no: int, fields: dict[str, Any]) -> None:
        """One checked row: ``fields`` as the data check returns them (``data_source`` is the
        ``data.reward_fn_key`` column's value)."""
        facts = self._files.setdefault(path, _FileRewardFacts())
        facts.add(row_no, fields.get("data_source"), fields.get("reward_model"))

    def get(self, path: str) -> _FileRewardFacts | None:
        return self._files.get(path)


def _read_facts(path: str, key: str) -> _FileRewardFacts:
    facts = _FileRewardFacts()
    for row_no, row in enumerate(_reward_rows(path, key)):
        if isinstance(row, dict):  # check_data_files names a row that is not
            facts.add(row_no, row.get(key), row.get("reward_model"))
    return facts


def _refuse_first(path: str, key: str, facts: _FileRewardFacts) -> None:
    """Raise for the file's first refused row (its source before its ground truth)."""
    from verl_megatron.data.dataset import DataFormatError
    from verl_megatron.errors import ConfigError

    unknown, null = facts.unknown_source, facts.null_truth
    if unknown is not None and (null is None or unknown[0] <= null):
        raise ConfigError(
            f"{path}: row {unknown[0]}: {key}={unknown[1]!r} has no rule in the default scorer "
            f"(known: {', '.join(known_data_sources())}); set custom_reward_function.path "
            "to a scorer for it"
        )
    if null is not None:
        raise DataFormatError(
            f"{path}: row {null}: reward_model.ground_truth is null; the default scorer "
            "compares each response with it (every reward would be 0)"
        )


def check_default_scorer_data(config: Any, columns: RewardColumns | None = None) -> None:
    """Every data row can be scored by the default scorer: its data source has a rule and
    its ``reward_model.ground_truth`` is not null (every rule compares the response with it).
    Raises ConfigError / DataFormatError naming the file and row. A file that `columns` (what
    the start-up data check gathered) covers is not read again."""
    data = _get(config, "data")
    key = str(_get(data, "reward_fn_key", "data_source"))
    for path in [*_files(_get(data, "train_files")), *_files(_get(data, "val_files"))]:
        facts = columns.get(path) if columns is not None else None
        _refuse_first(path, key, facts if facts is not None else _read_facts(path, key))


def check_reward_config(config: Any, columns: RewardColumns | None = None) -> None:
    """Start-up check of the reward setup, before any model is built.

    Raises ``ConfigError`` (one line) when ``reward_model.reward_kwargs`` names an argument
    the manager does not take or a value it refuses, when the ``custom_reward_function``
    file does not import (syntax error with its line, failing import, top-level exit or
    hang), lacks the function or has one that cannot take the manager's arguments; without
    a custom function, when a data row's source has no rule or its ground truth is null
    (:func:`check_default_scorer_data`; only when the final reward reads the rule reward).
    `columns`: the data files' reward columns, as the start-up data check read them.
    """
    from verl_megatron.errors import ConfigError

    reward_model = _get(config, "reward_model")
    name = str(_get(reward_model, "reward_manager", "naive"))
    try:
        manager_cls = resolve_reward_manager_cls(name)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    kwargs = _as_dict(_get(reward_model, "reward_kwargs"), "reward_model.reward_kwargs")
    problem = _check_manager_kwargs(manager_cls, kwargs) or _check_manager_values(
        manager_cls, {**kwargs, **dapo_extra_kwargs(config)}
    )
    custom = _get(config, "custom_reward_function")
    scores_rows = issubclass(manager_cls, RewardManagerBase)
    if problem is None and _get(custom, "path"):
        call_args = _scorer_call_args(manager_cls, kwargs, custom) if scores_rows else None
        problem = check_scorer_file(
            _get(custom, "path"), _get(custom, "name", "compute_score"), call_args=call_args
        )
    if problem is not None:
        raise ConfigError(problem)
    if scores_rows and not _get(custom, "path") and _uses_rule(reward_model):
        check_default_scorer_data(config, columns)


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
        sandbox = _get(reward_model, "sandbox")
        if sandbox is not None:  # limits for code data sources (reward_model.sandbox)
            compute_score = functools.partial(
                compute_score, code_sandbox=_as_dict(sandbox, "reward_model.sandbox")
            )
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
