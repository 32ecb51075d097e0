"""How the ranks of a checkpoint save or load agree: every rank fails together or none does.

Works without torch.distributed too (one process).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from verl_megatron.checkpoint.storage import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
)

# Error classes a failure on another rank is raised as here (by name: only text crosses ranks).
_ERRORS = {
    cls.__name__: cls
    for cls in (CheckpointError, CheckpointNotFoundError, CheckpointCorruptError, CheckpointMismatchError)
}


class DescribedWriteError(RuntimeError):
    """A failed write whose message already holds its OS cause (see ``describe_failure``): the
    exception chain does not survive the pickling that carries a failure between ranks."""


def describe_failure(exc: BaseException) -> str:
    """One line per failure: exception type and the first sentence of its message, and the
    OSError (disk full, file too large) found in its chain."""
    if isinstance(exc, DescribedWriteError):
        return str(exc)
    if isinstance(exc, CheckpointException):
        failures = []
        for rank, failure in exc.failures.items():
            inner = failure[0] if isinstance(failure, tuple) else failure
            failures.append(f"rank {rank}: {describe_failure(inner)}")
        return "; ".join(failures)
    text = str(exc).strip()
    first = text.splitlines()[0].split(". ")[0] if text else ""
    line = f"{type(exc).__name__}: {first[:300]}"
    cause = None if isinstance(exc, OSError) else _os_cause(exc)
    # torch.save's C++ writer replaces a failed write (disk full, file too large) with its own
    # RuntimeError; the OSError that says why survives only in the exception chain.
    return line if cause is None else f"{line} (caused by {type(cause).__name__}: {cause})"


def _os_cause(exc: BaseException) -> OSError | None:
    """The first OSError in ``exc``'s chain of causes and contexts, if any."""
    seen: set[int] = set()
    link = exc.__cause__ or exc.__context__
    while link is not None and id(link) not in seen:
        if isinstance(link, OSError):
            return link
        seen.add(id(link))
        link = link.__cause__ or link.__context__
    return None


def world() -> tuple[int, int]:
    """(rank, world size) of this process; (0, 1) without torch.distributed."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def agree(error: BaseException | None, what: str) -> None:
    """Raise on every rank when any rank failed, so no rank is left waiting in a collective."""
    size = world()[1]
    if size == 1:
        if error is not None:
            raise error
        return
    reports: list[Any] = [None] * size
    dist.all_gather_object(reports, None if error is None else (type(error).__name__, str(error)))
    if error is not None:
        raise error
    for failed_rank, report in enumerate(reports):
        if report is not None:
            kind, message = report
            raise _ERRORS.get(kind, CheckpointError)(f"{what} failed on rank {failed_rank}: {message}")


def on_rank0(fn: Callable[[], Any], what: str) -> Any:
    """Run ``fn`` on rank 0 only (file operations on the shared filesystem); all ranks see its failure."""
    result, error = None, None
    if world()[0] == 0:
        try:
            result = fn()
        except Exception as exc:
            error = exc
    agree(error, what)
    return result


def from_rank0(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank."""
    rank, size = world()
    if size == 1:
        return obj
    box = [obj if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_to_rank0(obj: Any) -> list[Any] | None:
    """Every rank's ``obj`` in rank order on rank 0, None on the others."""
    rank, size = world()
    if size == 1:
        return [obj]
    gathered: list[Any] | None = [None] * size if rank == 0 else None
    dist.gather_object(obj, gathered, dst=0)
    return gathered


def all_ranks(flag: bool) -> bool:
    """Whether ``flag`` holds on every rank."""
    if world()[1] == 1:
        return flag
    t = torch.tensor([0 if flag else 1], dtype=torch.int64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t)
    return int(t.item()) == 0
