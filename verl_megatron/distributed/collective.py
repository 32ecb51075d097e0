"""Small collectives every rank of the default group must call together."""

from __future__ import annotations

import torch
import torch.distributed as dist

from verl_megatron.distributed.wire import check_wire


def raise_on_any_rank(error: BaseException | None, device: torch.device, message: str) -> None:
    """Collective: re-raise this rank's ``error``, or RuntimeError(message) when another rank had one.

    Lets a step that only some ranks do (writing files on rank 0) fail on every rank alike
    instead of leaving the others waiting in their next collective.
    """
    status = torch.tensor([0 if error is None else 1], dtype=torch.int64, device=device)
    check_wire("raise_on_any_rank", status)
    dist.all_reduce(status, op=dist.ReduceOp.MAX)
    if error is not None:
        raise error
    if int(status.item()) != 0:
        raise RuntimeError(message)


def max_over_ranks(value: float, device: torch.device) -> float:
    """Collective: the largest ``value`` of all ranks (float64)."""
    tensor = torch.tensor(value, dtype=torch.float64, device=device)
    check_wire("max_over_ranks", tensor)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor)
