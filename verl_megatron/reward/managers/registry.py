"""The one place reward managers are looked up by name."""

from __future__ import annotations

from collections.abc import Callable

REWARD_MANAGER_REGISTRY: dict[str, type] = {}


def _identity(cls: type) -> str:
    # Compared by import path, not object identity: a module imported twice
    # (e.g. in a worker process or after importlib.reload) re-registers the
    # same class, which must not count as a clash.
    return f"{cls.__module__}.{cls.__qualname__}"


def register(name: str) -> Callable[[type], type]:
    """Class decorator: make a reward manager available as ``name``.

    Raises ValueError when ``name`` is already taken by a different class.
    """

    def decorator(cls: type) -> type:
        existing = REWARD_MANAGER_REGISTRY.get(name)
        if existing is not None and _identity(existing) != _identity(cls):
            raise ValueError(
                f"reward manager name {name!r} is already registered to {_identity(existing)}; "
                f"cannot register {_identity(cls)} under it"
            )
        REWARD_MANAGER_REGISTRY[name] = cls
        return cls

    return decorator


def get_reward_manager_cls(name: str) -> type:
    """The reward manager class registered as ``name``.

    Raises ValueError listing the known names when ``name`` is unknown.
    """
    if name not in REWARD_MANAGER_REGISTRY:
        known = ", ".join(sorted(REWARD_MANAGER_REGISTRY))
        # verl's wording first (code ported from verl matches on it), then what is there.
        raise ValueError(f"Unknown reward manager: {name}; registered reward managers: {known or 'none'}")
    return REWARD_MANAGER_REGISTRY[name]
