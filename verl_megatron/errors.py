"""The project's error types: the one base class of errors a user can fix (and how the
command line reports them), and the verl-compatible API's input error.

Bad config values, data files, checkpoints chosen for another model and missing optional
packages are the user's to fix: the command line prints their message as one
``error: ...`` line on stderr and exits with status 2, with no traceback. Anything else
is a bug and keeps its traceback.

The tree::

    UserInputError (ValueError)
        ConfigError: a config key; ConfigFileNotFoundError, and one subclass per room that
            owns settings: ModelConfigError, WorkerConfigError, ParallelConfigError,
            RolloutConfigError, PlacementError, AsyncTrainingConfigError, OutputDirError
        (data, checkpoint and tool errors derive from UserInputError in their own modules)
    VerlCompatError (ValueError, AssertionError): bad input to a verl-compatible function

This module imports nothing heavy: the command line uses it before torch is loaded.
"""

from __future__ import annotations

import sys

__all__ = [
    "EXIT_USER_ERROR",
    "AsyncTrainingConfigError",
    "ConfigError",
    "ConfigFileNotFoundError",
    "ModelConfigError",
    "OutputDirError",
    "ParallelConfigError",
    "PlacementError",
    "RolloutConfigError",
    "UserInputError",
    "VerlCompatError",
    "WorkerConfigError",
    "is_user_error",
    "report_user_error",
]

EXIT_USER_ERROR = 2


class UserInputError(ValueError):
    """Input that cannot work (config, data, checkpoint, environment); the message names what and where."""


class VerlCompatError(ValueError, AssertionError):
    """Bad input to a verl-compatible function (``core_algos``, ``DataProto``, reward managers).

    verl signals these cases with ``assert`` (so callers ported from verl catch
    ``AssertionError``) while this project raises ``ValueError`` with a message that
    names the problem. Deriving from both keeps either ``except`` clause working. Not a
    UserInputError: raised inside a run it is a bug of the caller and keeps its traceback.
    """


class ConfigError(UserInputError):
    """A config value that cannot work; the message names the key."""


class ConfigFileNotFoundError(ConfigError, FileNotFoundError):
    """The ``--config`` file does not exist."""


# Config errors raised by the room that owns the setting (models/, workers/, distributed/,
# rollout/, trainer/): each message names its key, so the loader and validate_config let
# them through as they are (every one is a ConfigError, hence a user error).
class ModelConfigError(ConfigError):
    """A model or model setting that verl-megatron cannot build."""


class WorkerConfigError(ConfigError):
    """An actor/critic/ref setting that cannot work."""


class ParallelConfigError(ConfigError):
    """A parallel layout that cannot work for this world size or model."""


class RolloutConfigError(ConfigError):
    """A rollout setting that cannot work; the message names the field."""


class PlacementError(ConfigError):
    """A placement or async-training setting that cannot work; the message names the key."""


class AsyncTrainingConfigError(ConfigError):
    """An async-training setting that cannot work; the message names the key."""


class OutputDirError(ConfigError):
    """The output directory cannot take this run: another run holds it, or it holds results
    that this run would overwrite, or the config changed in a way a resume cannot honour."""


def is_user_error(err: BaseException) -> bool:
    """Whether ``err`` is the user's to fix (config, data, checkpoint, environment)."""
    return isinstance(err, UserInputError)


def report_user_error(err: BaseException, *, show: bool = True) -> int:
    """Print ``error: <first line of the message>`` to stderr (when ``show``); return the exit status."""
    if show:
        message = str(err).strip() or type(err).__name__
        print(f"error: {' '.join(message.split())}", file=sys.stderr, flush=True)
    return EXIT_USER_ERROR
