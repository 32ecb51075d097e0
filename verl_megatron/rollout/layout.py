"""Which prompts each rank generates: the rollout's data-parallel split, not the trainer's.

Every rank holds the whole global prompt batch. Generation is split over engine *replicas*,
each of which must receive identical requests on all of its ranks:

- an external engine (vLLM, SGLang) with ``rollout.tensor_model_parallel_size = t`` forms its
  tensor-parallel groups from ``t`` consecutive global ranks (vLLM's external launcher), so
  replica ``r`` is ranks ``[r*t, (r+1)*t)``: ``world_size / t`` replicas, whatever the
  training layout. Splitting by the *training* dp rank instead would give one vLLM group two
  different prompt lists (training tp=1, rollout tp=2), or make replicas generate the same
  prompts twice (training tp*cp > rollout tp);
- the native engine runs on the actor's own chunks, so a replica is a training model-parallel
  group (tp x cp x pp ranks) and the replicas are the training dp ranks.

One rank per replica (its *leader*) contributes the replica's output to the gather, so each
prompt comes back exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = [
    "RolloutShard",
    "external_shard",
    "gather_replicas",
    "native_shard",
    "order_replica_outputs",
    "shard_for",
]


@dataclass(frozen=True)
class RolloutShard:
    """This rank's place in the rollout's data-parallel split.

    Attributes:
        replicas: engine replicas generating distinct prompts (the rollout dp size).
        replica: which of them this rank belongs to (its share is chunk ``replica`` of ``replicas``).
        leader: this rank returns its replica's output in the gather (one rank per replica).
    """

    replicas: int
    replica: int
    leader: bool


def external_shard(rank: int, world_size: int, rollout_tp: int) -> RolloutShard:
    """Replica of ``rank`` for an engine whose tp groups are ``rollout_tp`` consecutive ranks."""
    if rollout_tp < 1 or world_size % rollout_tp != 0:
        raise ValueError(
            f"rollout.tensor_model_parallel_size={rollout_tp} must divide the world size {world_size}"
        )
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside the world of {world_size}")
    return RolloutShard(
        replicas=world_size // rollout_tp, replica=rank // rollout_tp, leader=rank % rollout_tp == 0
    )


def native_shard(dp: int, dp_rank: int, tp_rank: int, cp_rank: int, pp_rank: int) -> RolloutShard:
    """Replica of a rank for the native engine: its training dp rank; led by model-parallel rank 0."""
    return RolloutShard(replicas=dp, replica=dp_rank, leader=tp_rank == 0 and cp_rank == 0 and pp_rank == 0)


def order_replica_outputs(parts: list[tuple[int, Any] | None], replicas: int) -> list[Any]:
    """The leaders' (replica, output) pairs from an all-gather over ranks -> outputs in replica order.

    Raises RuntimeError unless every replica appears exactly once (a layout mismatch between ranks).
    """
    found: dict[int, Any] = {}
    for part in parts:
        if part is None:
            continue
        replica, output = part
        if replica in found:
            raise RuntimeError(f"rollout gather: replica {replica} was returned by two ranks")
        found[replica] = output
    if sorted(found) != list(range(replicas)):
        raise RuntimeError(f"rollout gather: expected replicas 0..{replicas - 1}, got {sorted(found)}")
    return [found[r] for r in range(replicas)]


def gather_replicas(output: Any, shard: RolloutShard, world_size: int) -> list[Any]:
    """Every replica's output on every rank, in replica order (collective over the world)."""
    if shard.replicas == 1:
        return [output]  # every rank is in the one replica and holds its output
    import torch.distributed as dist

    parts: list[Any] = [None] * world_size
    dist.all_gather_object(parts, (shard.replica, output) if shard.leader else None)
    return order_replica_outputs(parts, shard.replicas)


def shard_for(engine: str, rollout_tp: int, runtime: Any) -> RolloutShard:
    """This rank's shard for ``rollout.name == engine`` under ``runtime``'s layout."""
    if runtime.world_size == 1:
        return RolloutShard(replicas=1, replica=0, leader=True)
    if engine == "native":
        return native_shard(
            runtime.layout.dp, runtime.dp_rank, runtime.tp_rank, runtime.cp_rank, runtime.pp_rank
        )
    return external_shard(runtime.rank, runtime.world_size, rollout_tp)
