"""The dist-checkpointing save strategy: megatron's torch_dist format, written in-process.

megatron's own torch_dist writer starts a multiprocessing manager and forks
one writer process per file. Daemonic workers (our test pool, Ray actors)
may not have children, and starting the manager costs seconds. The format
itself is torch.distributed.checkpoint's, so this strategy keeps megatron's
key translation and planner and lets torch's FileSystemWriter write the same
files with threads; megatron's torch_dist loader reads them unchanged.

With dp > 1 megatron's fully-parallel wrapper spreads the shards of the
replicated model over the data-parallel ranks instead of one replica
writing all of them. It only re-assigns replica ids (object collectives),
which works on gloo. Its load-side twin exchanges tensors through CUDA
buffers, so loading keeps megatron's default: every rank reads its own shards.
"""

from __future__ import annotations

from megatron.core.dist_checkpointing.strategies import torch as mcore_torch
from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint import save as dcp_save

from verl_megatron.checkpoint.collectives import DescribedWriteError, describe_failure
from verl_megatron.checkpoint.hashing import HashingFileSystem, WrittenFiles
from verl_megatron.distributed.parallel import Runtime


class _CauseKeepingWriter(FileSystemWriter):
    """torch's file writer, whose failures keep their OS cause in the message.

    torch.save reports a failed write (disk full, file too large) as a RuntimeError of its C++
    writer; the OSError that says why is only its ``__context__``, which torch.distributed.checkpoint
    drops when it gathers the failures of the ranks.
    """

    def __init__(self, *args, written: WrittenFiles | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if written is not None:
            self.fs = HashingFileSystem(written)  # the sha256 of each file, taken as it is written

    def write_data(self, plan, planner):
        try:
            return super().write_data(plan, planner)
        except Exception as exc:
            raise DescribedWriteError(describe_failure(exc)) from exc


class InProcessTorchDistSave(mcore_torch.TorchDistSaveShardedStrategy):
    """Synchronous torch_dist save from the calling process (no helper processes)."""

    def __init__(self, thread_count: int = 2, written: WrittenFiles | None = None) -> None:
        super().__init__("torch_dist", 1, keep_only_main_replica=True, thread_count=thread_count)
        self.written = written

    def save(self, sharded_state_dict, checkpoint_dir) -> None:
        # The translation megatron's TorchDistSaveShardedStrategy.async_save does
        # (megatron-core 0.16): main replicas only, ShardedObjects as bytes.
        flat, _, _ = mcore_torch._replace_state_dict_keys_with_sharded_keys(
            sharded_state_dict, self.keep_only_main_replica
        )
        dcp_save(
            mcore_torch.mcore_to_pyt_state_dict(flat, False),
            storage_writer=_CauseKeepingWriter(
                str(checkpoint_dir), sync_files=True, thread_count=self.thread_count, written=self.written
            ),
            planner=mcore_torch.MCoreSavePlanner(
                dedup_replicated_tensors=not self.keep_only_main_replica, flatten_state_dict=False
            ),
        )


def save_strategy(runtime: Runtime, written: WrittenFiles | None = None):
    """The strategy for this layout: in-process torch_dist, split over dp replicas when dp > 1.
    ``written`` records the sha256 of each file this rank writes."""
    base = InProcessTorchDistSave(written=written)
    if (runtime.layout.dp or 1) > 1:
        return FullyParallelSaveStrategyWrapper(base, runtime.dp_group(with_cp=True))
    return base
