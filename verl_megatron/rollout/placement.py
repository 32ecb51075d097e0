"""Where the rollout runs: on every rank in turn with training (``colocated``, the default) or on
ranks of its own (``separate``: the last ``rollout.world_size`` ranks generate, the others train).

Megatron's parallel state is process-global and is built over torch.distributed's default group
(``initialize_model_parallel`` takes ``get_world_size()`` / ``get_rank()`` of it, megatron-core
0.16.1 ``parallel_state.py``). So under ``separate`` each role gets a default group of its own:
the torchrun rendezvous store is split by prefix, the trainer ranks form one world and the
rollout ranks another, and megatron is initialised in each exactly as in a colocated job (the
trainer's layout resolves against the trainer ranks only). A third group over all ranks, built
directly on the same store, carries what crosses between the roles: the start message, the
weights after each update and the generated batches (``rollout/weight_sync.py``). It is gloo:
what crosses it crosses on the CPU. On GPU (the roles' backend is NCCL) a fourth group, NCCL over
trainer rank 0 and the rollout ranks, carries the weights themselves: device tensors, one
broadcast per bucket instead of a host copy sent to each rollout rank in turn.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from verl_megatron.distributed.parallel import attempt_prefix
from verl_megatron.errors import PlacementError
from verl_megatron.rollout.config import RolloutConfig

__all__ = ["Placement", "PlacementError", "init_placement"]

TRAINER, ROLLOUT = "trainer", "rollout"
# Each init_placement of a process gets fresh store keys: every rank calls it equally often, so
# the n-th call of every rank agrees on the prefix (a second run under the same torchrun store).
_sessions = 0


@dataclass
class Placement:
    """This process's role in a ``separate`` job and the group that joins the roles."""

    role: str
    rank: int
    """Global rank (trainer ranks come first)."""
    world_size: int
    trainer_world_size: int
    store: dist.Store
    """Key-value store shared by all ranks (the rendezvous store, under this session's prefix)."""
    transfer: dist.ProcessGroup | None
    """gloo ProcessGroup over all ranks, global rank numbering (None once closed)."""
    weights: dist.ProcessGroup | None = None
    """NCCL group over trainer rank 0 (its rank 0) and the rollout ranks, for the weight payloads;
    None on CPU (gloo: the weights go over ``transfer``) and on the other trainer ranks."""

    @property
    def is_trainer(self) -> bool:
        return self.role == TRAINER

    @property
    def rollout_ranks(self) -> list[int]:
        return list(range(self.trainer_world_size, self.world_size))

    @property
    def rollout_main(self) -> int:
        return self.trainer_world_size

    def barrier(self) -> None:
        self.transfer.barrier().wait()

    def close(self) -> None:
        """Destroy the transfer group and this role's default group (megatron's first)."""
        from verl_megatron.distributed.parallel import destroy_megatron_groups

        destroy_megatron_groups()
        if self.weights is not None:
            self.weights.shutdown()
            self.weights = None
        if self.transfer is not None:
            self.transfer.shutdown()
            self.transfer = None
        if dist.is_initialized():
            dist.destroy_process_group()


def init_placement(rollout: RolloutConfig, timeout_minutes: float = 30) -> Placement | None:
    """Start torch.distributed for ``rollout.placement=separate`` (None when colocated): this
    role's default group plus the transfer group. Call before ``init_runtime``. The settings
    are checked at start-up (``trainer/placement_check.py``)."""
    global _sessions
    if rollout.placement != "separate":
        return None
    if dist.is_initialized():
        raise RuntimeError(
            "rollout.placement=separate starts torch.distributed itself: run it under torchrun"
        )
    timeout = datetime.timedelta(minutes=timeout_minutes)
    store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
    # Per torchrun attempt: the agent's store outlives a restarted group (parallel.attempt_prefix).
    session = dist.PrefixStore(f"{attempt_prefix()}placement{_sessions}", store)
    _sessions += 1
    trainers = world - rollout.world_size
    role = TRAINER if rank < trainers else ROLLOUT
    role_rank, role_world = (rank, trainers) if role == TRAINER else (rank - trainers, world - trainers)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(
        backend, store=dist.PrefixStore(role, session), rank=role_rank, world_size=role_world, timeout=timeout
    )
    transfer = dist.ProcessGroupGloo(dist.PrefixStore("transfer", session), rank, world, timeout)
    weights = None
    if backend == "nccl" and (rank == 0 or role == ROLLOUT):
        weights = _weights_group(dist.PrefixStore("weights", session), rank, trainers, world, timeout)
    return Placement(
        role=role,
        rank=rank,
        world_size=world,
        trainer_world_size=trainers,
        store=dist.PrefixStore("keys", session),
        transfer=transfer,
        weights=weights,
    )


def _weights_group(
    store: dist.Store, rank: int, trainers: int, world: int, timeout: datetime.timedelta
) -> dist.ProcessGroup:
    """NCCL over global ranks [0, trainers, ..., world-1], numbered in that order (sender first)."""
    members = [0, *range(trainers, world)]
    return dist.ProcessGroupNCCL(store, members.index(rank), len(members), timeout)
