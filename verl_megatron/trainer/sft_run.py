"""Start an SFT run (``trainer.mode: sft``): check, build, train; the quickstart's SFT data.

``train.run`` hands a config whose ``trainer.mode`` is ``sft`` to :func:`run_sft`. With
``quickstart.enable`` and no data files, the synthetic task's rows are written as prompt /
correct-answer SFT rows (``data/synthetic_sft.py``; the lookup task's as tool-use chats,
``data/agent_sft.py``) next to the quickstart's RL data.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence

import torch.distributed as dist

from verl_megatron.trainer.config import PPOConfig

__all__ = ["quickstart_sft_data", "run_sft"]


def quickstart_sft_data(config: PPOConfig, rank: int) -> PPOConfig:
    """The config with the quickstart's RL data files replaced by SFT rows of the same split."""
    from verl_megatron.data.agent_sft import write_lookup_sft_from_rl
    from verl_megatron.data.synthetic_sft import write_sft_from_rl

    write = write_lookup_sft_from_rl if config.quickstart.task == "lookup" else write_sft_from_rl
    data = config.data
    out_dir = os.path.join(os.path.dirname(data.train_files[0]), "sft")
    names = [os.path.join(out_dir, os.path.basename(p)) for p in [*data.train_files, *data.val_files]]
    if rank == 0:
        write([*data.train_files, *data.val_files], out_dir)
    if dist.is_initialized():
        dist.barrier()
    train, val = names[: len(data.train_files)], names[len(data.train_files) :]
    return dataclasses.replace(config, data=dataclasses.replace(data, train_files=train, val_files=val))


def run_sft(config_path: str | None, overrides: Sequence[str], rank: Callable[[], int]) -> dict[str, float]:
    """Load, check, build and train an SFT run; returns the first and last validation loss."""
    from verl_megatron.distributed.parallel import init_runtime, shutdown
    from verl_megatron.trainer.config import check_model_fits
    from verl_megatron.trainer.quickstart import prepare_quickstart_assets
    from verl_megatron.trainer.run_dir import claim_output_dir
    from verl_megatron.trainer.sft_trainer import SFTTrainer, build_sft, prepare_sft, sft_startup_line

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    config, layout, data_sizes = prepare_sft(config_path, overrides, world_size)
    if rank() == 0:
        print(sft_startup_line(config, layout, world_size, data_sizes), flush=True)
    runtime = init_runtime(config.parallel, seed=config.trainer.seed)
    try:
        with claim_output_dir(config, runtime.rank):
            synthetic = config.quickstart.enable and not config.data.train_files
            config = prepare_quickstart_assets(config, runtime.rank)
            if synthetic:
                config = quickstart_sft_data(config, runtime.rank)
            check_model_fits(runtime.layout, config.model.path, config.model.sequence_parallel)
            config, parts = build_sft(config, runtime)
            return SFTTrainer(config, runtime, parts).fit()
    finally:
        if runtime._owns_process_group:  # a test's worker pool keeps its own process group
            shutdown(runtime)
