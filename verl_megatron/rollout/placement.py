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
tensors cross on the CPU, whatever the roles compute on.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from verl_megatron.errors import PlacementError

__all__ = ["Placement", "PlacementError", "check_placement", "init_placement"]

TRAINER, ROLLOUT = "trainer", "rollout"
# Each init_placement of a process gets fresh store keys: every rank calls it equally often, so
# the n-th call of every rank agrees on the prefix (a second run under the same torchrun store).
_sessions = 0


def check_placement(config: Any, world_size: int) -> int:
    """Check ``rollout.placement`` / ``rollout.world_size`` / ``async_training`` for a job of
    ``world_size`` processes; return how many of them train."""
    rollout, asyn = config.rollout, config.async_training
    if rollout.placement == "colocated":
        if rollout.world_size != 0:
            raise PlacementError(
                f"rollout.world_size={rollout.world_size} applies only with rollout.placement=separate"
            )
        if asyn.max_staleness > 0 or asyn.partial_rollout:
            raise PlacementError(
                "async_training (max_staleness > 0 or partial_rollout) needs rollout.placement=separate: "
                "a colocated rollout generates in turn with training"
            )
        return world_size
    if rollout.name != "native":
        raise PlacementError(
            f"rollout.placement=separate sends the weights to the rollout ranks over the process group, "
            f"which rollout.name={rollout.name!r} cannot receive; use rollout.name=native"
        )
    if rollout.world_size < 1:
        raise PlacementError(
            f"rollout.placement=separate needs rollout.world_size >= 1 (ranks that generate), got {rollout.world_size}"
        )
    if rollout.world_size >= world_size:
        raise PlacementError(
            f"rollout.placement=separate with rollout.world_size={rollout.world_size} leaves no trainer rank "
            f"among the {world_size} processes: start more (torchrun --nproc_per_node) or lower rollout.world_size"
        )
    algo = config.algorithm
    if asyn.max_staleness > 0 and not algo.rollout_correction.enabled:
        raise PlacementError(
            f"async_training.max_staleness={asyn.max_staleness} trains on stale samples: set "
            "algorithm.rollout_correction.rollout_is (e.g. token) or rollout_rs to correct them"
        )
    unsupported = {
        "algorithm.filter_groups.enable=true": algo.filter_groups.enable,
        "algorithm.adv_estimator=remax": algo.adv_estimator == "remax",
        "rollout.multi_turn.enable=true": rollout.multi_turn.enable,
    }
    for key, on in unsupported.items():
        if on:
            raise PlacementError(f"rollout.placement=separate does not support {key} yet")
    return world_size - rollout.world_size


@dataclass
class Placement:
    """This process's role in a ``separate`` job and the group that joins the roles."""

    role: str
    rank: int
    """Global rank (trainer ranks come first)."""
    world_size: int
    trainer_world_size: int
    store: Any
    """Key-value store shared by all ranks (the rendezvous store, under this session's prefix)."""
    transfer: Any
    """gloo ProcessGroup over all ranks, global rank numbering."""

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
        if self.transfer is not None:
            self.transfer.shutdown()
            self.transfer = None
        if dist.is_initialized():
            dist.destroy_process_group()


def init_placement(config: Any, timeout_minutes: int = 30) -> Placement | None:
    """Start torch.distributed for ``rollout.placement=separate`` (None when colocated): this
    role's default group plus the transfer group. Call before ``init_runtime``."""
    global _sessions
    if config.rollout.placement != "separate":
        return None
    if dist.is_initialized():
        raise RuntimeError(
            "rollout.placement=separate starts torch.distributed itself: run it under torchrun"
        )
    timeout = datetime.timedelta(minutes=timeout_minutes)
    store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
    session = dist.PrefixStore(f"verl_megatron/placement{_sessions}", store)
    _sessions += 1
    trainers = world - config.rollout.world_size
    role = TRAINER if rank < trainers else ROLLOUT
    role_rank, role_world = (rank, trainers) if role == TRAINER else (rank - trainers, world - trainers)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(
        backend, store=dist.PrefixStore(role, session), rank=role_rank, world_size=role_world, timeout=timeout
    )
    transfer = dist.ProcessGroupGloo(dist.PrefixStore("transfer", session), rank, world, timeout)
    return Placement(
        role=role,
        rank=rank,
        world_size=world,
        trainer_world_size=trainers,
        store=dist.PrefixStore("keys", session),
        transfer=transfer,
    )
