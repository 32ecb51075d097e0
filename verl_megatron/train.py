"""Training entry point: ``python -m verl_megatron.train`` or under torchrun.

    torchrun --nproc_per_node=2 -m verl_megatron.train --config configs/grpo.yaml parallel.tp=2

Reads the YAML config (default: ``configs/quickstart.yaml``) with ``key=value``
overrides, checks it for this world size before any model is built, starts the
distributed runtime, builds the workers and runs ``PPOTrainer.fit``. Every
process runs this same code; rank 0 logs.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

__all__ = ["main", "parse_args", "run"]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="verl-megatron train",
        description="Train with PPO/GRPO/DAPO on megatron-core. Without --config: the CPU quickstart.",
    )
    parser.add_argument("--config", default=None, help="YAML config (default: configs/quickstart.yaml)")
    parser.add_argument(
        "overrides", nargs="*", help="config overrides, e.g. actor.optim.lr=1e-6 parallel.tp=2"
    )
    # Intermixed: "--config x a=1" and "a=1 --config x b=2" both work.
    return parser.parse_intermixed_args(list(sys.argv[1:] if argv is None else argv))


def _set_threads() -> None:
    """One intra-op thread per process on CPU unless OMP_NUM_THREADS says otherwise: several
    processes (or other jobs) share the cores, and spinning OpenMP threads starve each other."""
    import torch

    if not torch.cuda.is_available():
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))


def _quiet_libraries() -> None:
    """Keep the console readable: megatron warns about absent Apex / Transformer Engine at
    every import, torch.distributed about deprecated names, transformers draws progress bars."""
    import warnings

    from transformers.utils import logging as hf_logging

    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed\.")
    hf_logging.disable_progress_bar()


def run(config_path: str | None, overrides: Sequence[str]) -> dict[str, float]:
    """Load, check, build and train; returns the trainer's summary (first/last validation score)."""
    from verl_megatron.distributed.parallel import init_runtime, shutdown
    from verl_megatron.trainer.components import build_components
    from verl_megatron.trainer.config import (
        check_model_fits,
        default_config_path,
        load_config,
        validate_config,
    )
    from verl_megatron.trainer.ppo.reward import check_reward_config
    from verl_megatron.trainer.ppo_trainer import PPOTrainer
    from verl_megatron.trainer.quickstart import prepare_quickstart_assets
    from verl_megatron.trainer.run_dir import claim_output_dir

    config = load_config(config_path or default_config_path(), list(overrides))
    validate_config(config, int(os.environ.get("WORLD_SIZE", "1")))
    check_reward_config(config)  # imports the scorer file in a child process, before any model
    _set_threads()
    runtime = init_runtime(config.parallel, seed=config.trainer.seed)
    try:
        # Held until the run ends: one run per output dir, and no silent overwrite of an earlier one.
        with claim_output_dir(config, runtime.rank):
            config = prepare_quickstart_assets(config, runtime.rank)
            check_model_fits(runtime.layout, config.model.path)
            config, components = build_components(config, runtime)
            return PPOTrainer(config, runtime, components).fit()
    finally:
        # A caller that started torch.distributed itself (a test's worker pool) keeps it.
        if runtime._owns_process_group:
            shutdown(runtime)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry; a config error prints its message (naming the key) and exits with 2."""
    from verl_megatron.trainer.config import ConfigError
    from verl_megatron.trainer.guard import TrainingDivergedError

    args = parse_args(argv)
    _quiet_libraries()
    try:
        run(args.config, args.overrides)
    except (ConfigError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except TrainingDivergedError as err:
        print(f"error: {err}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
