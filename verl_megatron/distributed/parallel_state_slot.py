"""A second megatron parallel state in the same processes, for a model with its own tp/pp.

megatron-core keeps its parallel state (the tp/pp/dp groups, ranks and sizes) in module
globals of ``megatron.core.parallel_state``: one layout per process. A model that runs beside
the actor with another layout (the reward model: ``reward_model.parallel``) gets a
:class:`ParallelStateSlot`: its own groups, created once by the same
``initialize_model_parallel`` call megatron uses, and a context manager that swaps its globals
in for the duration of a build or a forward and puts the actor's back afterwards.

Models built inside the slot keep their own groups (megatron's layers take them at
construction) and every collective inside the slot (the pipeline schedule, tp reductions)
reads the slot's groups, so the two layouts never mix. Not thread-safe: one slot is active at
a time, on the thread that runs the training loop.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from verl_megatron.distributed.parallel import ParallelLayout, Runtime

__all__ = ["ParallelStateSlot"]


def _state_names() -> list[str]:
    """The module globals that make up megatron's parallel state (``_TENSOR_MODEL_PARALLEL_GROUP``, ...)."""
    from megatron.core import parallel_state as ps

    return [n for n in vars(ps) if n.startswith("_") and n[1:2].isupper() and not n.startswith("__")]


def _snapshot() -> dict[str, Any]:
    from megatron.core import parallel_state as ps

    return {name: getattr(ps, name) for name in _state_names()}


def _restore(state: dict[str, Any]) -> None:
    from megatron.core import parallel_state as ps

    # megatron's parallel state is these module globals and nothing else: swapping a layout in
    # means writing them (kept here in distributed/, the one reader of parallel_state; on the
    # allowlist of tests/test_no_foreign_attributes.py).
    for name, value in state.items():
        setattr(ps, name, value)


def _blank(state: dict[str, Any]) -> dict[str, Any]:
    """The state of a process where megatron was never initialised (what the module starts with).

    Not ``destroy_model_parallel``: that destroys the current gloo data-parallel groups, which
    belong to the actor.
    """
    return {name: ({} if isinstance(value, dict) else None) for name, value in state.items()}


class ParallelStateSlot:
    """megatron parallel groups for ``layout`` (resolved against the world size), held aside.

    Creating one is a collective of every rank (as ``initialize_model_parallel`` is). Use
    ``with slot.active(): ...`` around everything that builds or runs the slot's model, and
    :meth:`close` at the end (it destroys the slot's process groups).
    """

    def __init__(self, layout: ParallelLayout, runtime: Runtime, timeout_minutes: int = 30) -> None:
        from megatron.core import parallel_state as ps

        self.layout = layout.resolve(runtime.world_size)
        # The process group stays the outer runtime's to tear down.
        self.runtime = dataclasses.replace(runtime, layout=self.layout, _owns_process_group=False)
        outer = _snapshot()
        before = set(dist.distributed_c10d._world.pg_map)
        _restore(_blank(outer))
        try:
            ps.initialize_model_parallel(
                **self.layout.megatron_sizes(), distributed_timeout_minutes=timeout_minutes
            )
            self._state = _snapshot()
        finally:
            _restore(outer)
        self._groups = [g for g in dist.distributed_c10d._world.pg_map if g not in before]
        self._active = False

    @contextlib.contextmanager
    def active(self) -> Iterator[Runtime]:
        """Swap the slot's parallel state in; yields a Runtime whose layout and ranks are the slot's."""
        if self._state is None:
            raise RuntimeError("ParallelStateSlot is closed")
        if self._active:  # nested use: already in place
            yield self.runtime
            return
        outer = _snapshot()
        _restore(self._state)
        self._active = True
        try:
            yield self.runtime
        finally:
            self._state = _snapshot()  # megatron may have moved e.g. the virtual pipeline rank
            self._active = False
            _restore(outer)

    def close(self) -> None:
        """Destroy the slot's process groups (idempotent)."""
        if self._state is None:
            return
        live = set(dist.distributed_c10d._world.pg_map) if dist.is_initialized() else set()
        for group in self._groups:
            if group in live:
                dist.destroy_process_group(group)
        self._groups.clear()
        self._state = None
