"""Error type for checks where verl raises AssertionError.

verl validates many arguments with ``assert``; code written for verl catches
AssertionError there. Raising an error that is both a ValueError (what this
project raises for bad input) and an AssertionError keeps such code working while
the message stays a proper one-line explanation. Temporary home: the shared
``verl_megatron.utils.errors`` type replaces it once merged.
"""

from __future__ import annotations

__all__ = ["VerlCheckError"]


class VerlCheckError(ValueError, AssertionError):
    """Bad input at a place where verl raises AssertionError."""
