"""Everything checked before a process group or a model exists: config, data files, resume target.

``prepare_run`` is the first part of ``train.startup_checks``, which the launching process runs
before it starts torchrun and every rank runs before it builds anything: load and validate the
config, read every data row (no tokenizer), compare the data with the batch size, and look at
the checkpoint a resume names. Each failure is a ``UserInputError`` (one ``error:`` line on the
command line). The reward, distillation and memory checks follow there (the memory plan lives
in the planner, a layer above this one).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

from verl_megatron.errors import ConfigError
from verl_megatron.trainer.config import load_config, validate_config
from verl_megatron.trainer.progress import DataSizes

__all__ = ["check_inputs", "prepare_run"]


def _check_resume(config: Any) -> None:
    trainer = config.trainer
    if trainer.resume_mode == "resume_path" and trainer.resume_from_path:
        path = os.path.expanduser(trainer.resume_from_path)
        if not os.path.exists(path):
            raise ConfigError(f"trainer.resume_from_path='{trainer.resume_from_path}' does not exist")


def check_inputs(
    config: Any, on_row: Callable[[str, int, dict[str, Any]], None] | None = None
) -> DataSizes | None:
    """Read and check every data row (each shown to `on_row`, see ``check_data_files``); None
    when the quickstart will write the data itself."""
    from verl_megatron.data.dataset import DataFormatError, check_data_files

    _check_resume(config)
    data = config.data
    if not data.train_files:
        return None
    train_rows = check_data_files(data.train_files, data, on_row)
    val_rows = check_data_files(data.val_files, data, on_row) if data.val_files else 0
    filtering = config.algorithm.filter_groups.enable
    batch_key = "data.gen_batch_size" if filtering and data.gen_batch_size else "data.train_batch_size"
    batch = data.gen_batch_size if batch_key == "data.gen_batch_size" else data.train_batch_size
    if train_rows < batch:
        raise DataFormatError(
            f"{batch_key}={batch} is larger than the {train_rows} rows of data.train_files {list(data.train_files)}; "
            "lower it or add data"
        )
    return DataSizes(train_rows=train_rows, val_rows=val_rows)


def prepare_run(
    config_path: str | None,
    overrides: Sequence[str],
    world_size: int,
    on_row: Callable[[str, int, dict[str, Any]], None] | None = None,
) -> tuple[Any, Any, DataSizes | None]:
    """(config, layout, data sizes) of a run of ``world_size`` processes, everything checked;
    `on_row` sees each data row as it is checked."""
    from verl_megatron.trainer.config import default_config_path

    config = load_config(config_path or default_config_path(), list(overrides))
    layout = validate_config(config, world_size)
    return config, layout, check_inputs(config, on_row)
