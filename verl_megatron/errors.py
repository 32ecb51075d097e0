"""The one base class of errors a user can fix, and how the command line reports them.

Bad config values, data files, checkpoints chosen for another model and missing optional
packages are the user's to fix: the command line prints their message as one
``error: ...`` line on stderr and exits with status 2, with no traceback. Anything else
is a bug and keeps its traceback.

This module imports nothing heavy: the command line uses it before torch is loaded.
"""

from __future__ import annotations

import sys

__all__ = ["EXIT_USER_ERROR", "UserInputError", "is_user_error", "report_user_error"]

EXIT_USER_ERROR = 2


class UserInputError(ValueError):
    """Input that cannot work (config, data, checkpoint, environment); the message names what and where."""


def is_user_error(err: BaseException) -> bool:
    """Whether ``err`` is the user's to fix: a UserInputError, or a checkpoint that cannot be
    loaded (checkpoint errors name the path and the problem; see verl_megatron.checkpoint)."""
    if isinstance(err, UserInputError):
        return True
    storage = sys.modules.get("verl_megatron.checkpoint.storage")
    # Not imported means no checkpoint was touched, so err cannot be one.
    return storage is not None and isinstance(err, storage.CheckpointError)


def report_user_error(err: BaseException, *, show: bool = True) -> int:
    """Print ``error: <first line of the message>`` to stderr (when ``show``); return the exit status."""
    if show:
        message = str(err).strip() or type(err).__name__
        print(f"error: {' '.join(message.split())}", file=sys.stderr, flush=True)
    return EXIT_USER_ERROR
