"""The trainer's config: load the typed schema from YAML and command-line overrides.

``load_config(yaml_path, overrides)`` merges, once, at the entry point::

    OmegaConf.structured(PPOConfig) <- YAML file <- dotlist overrides ("actor.optim.lr=1e-6")

and returns a plain ``PPOConfig`` object (``OmegaConf.to_object``); nothing after
the entry point sees a DictConfig. Unknown keys fail with the closest known key
("did you mean ...") and where the key came from; wrong types fail naming the key.
``validate_config`` (trainer/validate.py) then checks what no single section can
check alone before any model is built.

The schema's dataclasses live in trainer/config_schema.py and the checks in
trainer/validate.py; both are re-exported here, the one import path callers use.
"""

from __future__ import annotations

import copy
import functools
import os
import sys
import typing
from dataclasses import fields, is_dataclass
from typing import Any

from verl_megatron.errors import ConfigError, ConfigFileNotFoundError
from verl_megatron.trainer.config_schema import (
    RESUME_MODES,
    AlgoConfig,
    AlgorithmConfig,
    CustomRewardFunctionConfig,
    FilterGroupsConfig,
    KLControlConfig,
    OverlongBufferConfig,
    PPOConfig,
    QuickstartConfig,
    RewardModelConfig,
    TrainerConfig,
)
from verl_megatron.trainer.ppo.rollout_correction_config import (
    VerlRolloutCorrectionConfig as RolloutCorrectionConfig,  # verl's (trainer.config.algorithm below)
)
from verl_megatron.trainer.validate import _check_algorithm as _check_algorithm  # tests reach it here
from verl_megatron.trainer.validate import (
    check_model_fits,
    suggest_key,
    use_critic,
    use_reference,
    validate_config,
)

__all__ = [
    "RESUME_MODES",
    "AlgoConfig",
    "AlgorithmConfig",
    "ConfigError",
    "ConfigFileNotFoundError",
    "CustomRewardFunctionConfig",
    "FilterGroupsConfig",
    "KLControlConfig",
    "OverlongBufferConfig",
    "PPOConfig",
    "QuickstartConfig",
    "RewardModelConfig",
    "RolloutCorrectionConfig",
    "TrainerConfig",
    "check_model_fits",
    "default_config_path",
    "load_config",
    "to_dict",
    "use_critic",
    "use_reference",
    "validate_config",
]


def default_config_path() -> str:
    """``configs/quickstart.yaml`` of the source tree (the config ``verl-megatron train`` uses
    without ``--config``)."""
    here = os.path.dirname(os.path.abspath(__file__))
    return os.path.normpath(os.path.join(here, "..", "..", "configs", "quickstart.yaml"))


# ---------------------------------------------------------------- loading


@functools.cache
def _schema() -> Any:
    """The structured DictConfig of PPOConfig with every section at its class's field defaults.
    Built once per process (about half of a ``load_config`` call): nothing writes to it, since
    ``load_config`` merges into its own deep copy and ``to_object`` only reads."""
    from omegaconf import OmegaConf

    schema = OmegaConf.structured(PPOConfig)
    for name, section_cls in typing.get_type_hints(PPOConfig).items():
        # Built from the class, so field defaults are read without running __post_init__.
        schema[name] = OmegaConf.structured(section_cls)
    return schema


def _check_keys(schema_node: Any, values: Any, prefix: str, source: str) -> Any:
    """Raise ConfigError for keys the schema lacks; return ``values`` with a lone string given
    for a list field wrapped in a list (``data.train_files=x.parquet``)."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    if not isinstance(values, dict) or not isinstance(schema_node, DictConfig):
        return values
    if OmegaConf.get_type(schema_node) is dict:  # a free-form mapping such as reward_kwargs
        return values
    known = [str(k) for k in schema_node]
    checked = {}
    for key, value in values.items():
        full = f"{prefix}{key}"
        if key not in schema_node:
            raise ConfigError(
                f"unknown config key '{full}' ({source})" + suggest_key(str(key), known, prefix)
            )
        child = schema_node._get_node(key)
        # OmegaConf's own error for a scalar merged onto a section names no key ("'?': None").
        if isinstance(child, DictConfig) and value is not None and not isinstance(value, dict):
            raise ConfigError(f"'{full}' is a section; expected a mapping, got {value!r} ({source})")
        if isinstance(child, ListConfig) and isinstance(value, str):
            value = [value]
        checked[key] = _check_keys(child, value, f"{full}.", source)
    return checked


def _merge(base: Any, values: dict[str, Any], source: str) -> Any:
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    checked = _check_keys(base, values, "", source)
    try:
        # In place (base is load_config's own copy): OmegaConf.merge copies the whole config
        # first, ~20 ms for each override.
        return OmegaConf.unsafe_merge(base, OmegaConf.create(checked))
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or "?"
        message = str(getattr(err, "msg", err)).splitlines()[0]
        raise ConfigError(f"config key '{key}' ({source}): {message}") from None


def _parse_overrides(overrides: list[str]) -> list[tuple[str, dict[str, Any]]]:
    import yaml
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    parsed = []
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"override '{item}' must look like key=value (e.g. actor.optim.lr=1e-6)")
        try:
            values = OmegaConf.to_container(OmegaConf.from_dotlist([item]))
        except (OmegaConfBaseException, yaml.YAMLError) as err:
            reason = getattr(err, "problem", None) or str(getattr(err, "msg", err)).strip().splitlines()[0]
            raise ConfigError(
                f"override '{item}' is not valid YAML ({reason}); a list override looks like "
                "'trainer.logger=[console,jsonl]'"
            ) from None
        parsed.append((item, values))
    return parsed


def _read_yaml(path: str) -> dict[str, Any]:
    """The file's top-level mapping; ConfigError naming the file (and line) for anything unreadable."""
    import yaml
    from omegaconf import OmegaConf

    if not os.path.exists(path):
        raise ConfigFileNotFoundError(f"config file '{path}' does not exist")
    if not os.path.isfile(path):
        raise ConfigError(f"config file '{path}' is not a file")
    try:
        # OmegaConf's YAML loader reads 1e-6 as a float (plain YAML 1.1 reads a string).
        values = OmegaConf.to_container(OmegaConf.load(path), resolve=False) or {}
    except OSError as err:
        raise ConfigError(f"config file '{path}' cannot be read: {err.strerror or err}") from None
    except UnicodeDecodeError as err:
        raise ConfigError(
            f"config file '{path}' is not UTF-8 text ({err.reason} at byte {err.start})"
        ) from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"config file '{path}' is not valid YAML{where}: {problem}") from None
    if not isinstance(values, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    return values


def load_config(path: str | None = None, overrides: list[str] | None = None) -> PPOConfig:
    """Schema defaults <- YAML file at ``path`` <- ``overrides`` ("a.b=value"), as a PPOConfig.

    Raises ConfigError naming the key (and the file or override it came from)
    for unknown keys, values of the wrong type and unresolvable interpolations.
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    merged = copy.deepcopy(_schema())  # the one copy; every source merges into it in place
    if path is not None:
        merged = _merge(merged, _read_yaml(path), f"in {path}")
    for item, values in _parse_overrides(list(overrides or [])):
        merged = _merge(merged, values, f"from override '{item}'")
    try:
        config = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or "?"
        message = str(getattr(err, "msg", err)).splitlines()[0]
        raise ConfigError(f"config key '{key}': {message}") from None
    except ConfigError:  # a section's own __post_init__ check; its message names the key
        raise
    except ValueError as err:  # a section check that raised a plain ValueError naming its key
        raise ConfigError(str(err)) from None
    return config


def to_dict(config: Any) -> dict[str, Any]:
    """A dataclass config as nested plain dicts (for logging and checkpoints)."""
    if is_dataclass(config):
        return {f.name: to_dict(getattr(config, f.name)) for f in fields(config)}
    if isinstance(config, dict):
        return {k: to_dict(v) for k, v in config.items()}
    if isinstance(config, (list, tuple)):
        return [to_dict(v) for v in config]
    return config


# verl's module path ``verl.trainer.config.algorithm`` (AlgoConfig lives there in verl);
# the import system returns a module registered under a child name once the parent is in.
sys.modules[f"{__name__}.algorithm"] = sys.modules[__name__]
