"""Error types shared by the verl-compatible API surface."""


class VerlCompatError(ValueError, AssertionError):
    """Bad input to a verl-compatible function.

    verl signals these cases with ``assert`` (so callers ported from verl catch
    ``AssertionError``) while this project raises ``ValueError`` with a message that
    names the problem. Deriving from both keeps either ``except`` clause working.
    """
