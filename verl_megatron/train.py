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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

__all__ = ["Checked", "main", "parse_args", "run", "run_mode", "startup_checks"]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="verl-megatron train",
        description="Train with PPO/GRPO/DAPO on megatron-core. Without --config: the CPU quickstart.",
    )
    parser.add_argument("--config", default=None, help="YAML config (default: configs/quickstart.yaml)")
    parser.add_argument(
        "overrides", nargs="*", help="config overrides, e.g. actor.optim.lr=1e-6 parallel.tp=2"
    )
    # Set by ``verl-megatron train`` when it launches torchrun: the launcher prints the error line.
    parser.add_argument("--errors-to-launcher", action="store_true", help=argparse.SUPPRESS)
    # Intermixed: "--config x a=1" and "a=1 --config x b=2" both work.
    return parser.parse_intermixed_args(list(sys.argv[1:] if argv is None else argv))


def _rank() -> int:
    """This process's rank: torch.distributed's when a caller (a test's worker pool) started it."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def _set_threads() -> None:
    """One intra-op thread per process on CPU unless OMP_NUM_THREADS says otherwise: several
    processes (or other jobs) share the cores, and spinning OpenMP threads starve each other."""
    import torch

    if not torch.cuda.is_available():
        torch.set_num_threads(_omp_threads(os.environ.get("OMP_NUM_THREADS", "")))


def _omp_threads(raw: str) -> int:
    """OMP_NUM_THREADS as torch takes it: unset or empty means 1; OpenMP's nested form "4,2"
    names the outer level first. Anything else is a user's typo, stopped here in one line
    instead of a bare int() traceback from every rank."""
    from verl_megatron.errors import UserInputError

    first = raw.split(",")[0].strip()
    if not first:
        return 1
    if first.isdigit() and int(first) > 0:
        return int(first)
    raise UserInputError(
        f"OMP_NUM_THREADS={raw!r} in the environment is not a positive number of threads "
        "(unset it for one thread per process)"
    )


def quiet_warnings() -> None:
    """Megatron warns about absent Apex / Transformer Engine at every import, torch.distributed
    about deprecated names: noise on the console (cheap; call before importing them)."""
    import warnings

    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed\.")


def _quiet_libraries() -> None:
    """Also keep transformers from drawing progress bars while it loads a checkpoint."""
    from transformers.utils import logging as hf_logging

    quiet_warnings()
    hf_logging.disable_progress_bar()


def _derived_note(config_path: str | None, overrides: Sequence[str], dp: int) -> str:
    """`` | derived actor.ppo_micro_batch_size_per_gpu=128`` for each size the config left unset."""
    from verl_megatron.trainer.config import default_config_path, load_config
    from verl_megatron.trainer.validate import derived_micro_batches

    derived = derived_micro_batches(load_config(config_path or default_config_path(), list(overrides)), dp)
    return f" | derived {', '.join(derived)} (unset: a rank's share of a mini-batch)" if derived else ""


def run_mode(config_path: str | None, overrides: Sequence[str]) -> str:
    """``trainer.mode``: "rl" or "sft" (ConfigError for anything else), from the last override
    that sets it, else the YAML file (read alone: the whole config is loaded once, by the mode)."""
    import yaml

    from verl_megatron.errors import ConfigError

    given = [item.split("=", 1)[1].strip() for item in overrides if item.startswith("trainer.mode=")]
    mode = given[-1] if given else "rl"
    if not given and config_path and os.path.isfile(config_path):
        try:
            with open(config_path, encoding="utf-8") as f:
                values = yaml.safe_load(f)
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            values = None  # the whole config's loader names what is wrong with the file
        section = values.get("trainer") if isinstance(values, dict) else None
        mode = str(section.get("mode", "rl")) if isinstance(section, dict) else "rl"
    if mode not in ("rl", "sft"):
        raise ConfigError(f"trainer.mode={mode!r}; expected 'rl' (PPO-family training) or 'sft'")
    return mode


@dataclass(frozen=True)
class Checked:
    """What the start-up checks passed: the config to build (derived sizes filled in), its layout,
    the data's row counts (None: the quickstart writes its data), and the memory plan's warning
    line (``trainer.memory_check=warn`` on a job that does not fit; else None)."""

    config: Any
    layout: Any
    data_sizes: Any
    memory_line: str | None = None


def startup_checks(
    config_path: str | None,
    overrides: Sequence[str],
    world_size: int,
    announce: Callable[[Checked], None] | None = None,
) -> Checked:
    """Every check of a run of ``world_size`` processes before a process group or a model exists,
    in this order: config and data (the rows' reward columns gathered on the way, so the files are
    read once), reward setup, distillation, memory plan; each failure is one ``UserInputError``.
    ``run`` (on every rank) and ``verl-megatron check`` (before a launcher starts torchrun) both run
    this function, so the launcher's verdict is the ranks'. ``announce`` sees the checked config
    before the memory plan, which builds every role's model on the meta device (``run`` prints its
    start-up line there). An SFT run: its own checks (``prepare_sft``, as ``run_sft`` runs them)."""
    from verl_megatron.reward.loading import RewardColumns, check_reward_config
    from verl_megatron.trainer.distill_checks import check_distill
    from verl_megatron.trainer.preflight import prepare_run

    if run_mode(config_path, overrides) == "sft":
        from verl_megatron.trainer.sft_trainer import prepare_sft

        return Checked(*prepare_sft(config_path, overrides, world_size))
    reward_columns = RewardColumns()  # gathered by the data check, so the files are read once
    config, layout, data_sizes = prepare_run(config_path, overrides, world_size, reward_columns.add)
    check_reward_config(config, reward_columns)  # imports the scorer in a child process, before any model
    check_distill(config)
    checked = Checked(config, layout, data_sizes)
    if announce is not None:
        announce(checked)
    from verl_megatron.planner.memory_check import check_memory, device_memory_bytes

    # Before any weights; over the ranks that train (rollout.placement=separate keeps some apart).
    trainer_ranks = layout.tp * layout.pp * layout.cp * layout.dp
    return replace(checked, memory_line=check_memory(config, trainer_ranks, device_memory_bytes()))


def _print_startup(
    config_path: str | None, overrides: Sequence[str], world_size: int, checked: Checked
) -> None:
    """Rank 0's start-up line (and the note on kept weights), once the config and data pass."""
    from verl_megatron.trainer.progress import kept_weights_note, startup_line

    if _rank() != 0:
        return
    line = startup_line(checked.config, checked.layout, world_size, checked.data_sizes)
    print(line + _derived_note(config_path, overrides, checked.layout.dp), flush=True)
    note = kept_weights_note(checked.config)
    if note:
        print(note, flush=True)


def run(config_path: str | None, overrides: Sequence[str]) -> dict[str, float]:
    """Load, check, build and train; returns the trainer's summary (first/last validation score)."""
    if run_mode(config_path, overrides) == "sft":  # supervised fine-tuning: trainer/sft_run.py
        from verl_megatron.trainer.sft_run import run_sft

        return run_sft(config_path, overrides, _rank)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    announce = partial(_print_startup, config_path, overrides, world_size)
    checked = startup_checks(config_path, overrides, world_size, announce)
    config = checked.config
    if checked.memory_line and _rank() == 0:
        print(checked.memory_line, flush=True)
    from verl_megatron.trainer.trainer_checkpoint import restarted

    config, restart_line = restarted(config, _rank())  # torchrun --max-restarts: from the newest checkpoint
    if restart_line and _rank() == 0:
        print(restart_line, flush=True)

    from verl_megatron.distributed.parallel import init_runtime, shutdown
    from verl_megatron.rollout.placement import init_placement
    from verl_megatron.trainer.async_trainer import run_rollout_ranks, train_async
    from verl_megatron.trainer.components import build_components
    from verl_megatron.trainer.config import check_model_fits
    from verl_megatron.trainer.distill_stage import build_teacher
    from verl_megatron.trainer.ppo_trainer import PPOTrainer
    from verl_megatron.trainer.quickstart import prepare_quickstart_assets
    from verl_megatron.trainer.run_dir import claim_output_dir
    from verl_megatron.trainer.stall import process_group_minutes, watched

    _quiet_libraries()
    _set_threads()
    minutes = process_group_minutes(config.trainer)
    placement = init_placement(config.rollout, minutes)  # None unless rollout.placement=separate
    if placement is not None and not placement.is_trainer:
        with watched(config, placement.transfer):
            return run_rollout_ranks(config, placement)
    runtime = None
    try:
        runtime = init_runtime(config.parallel, seed=config.trainer.seed, timeout_minutes=minutes)
        group = None if placement is None else placement.transfer  # the watchdog's ranks: all of them
        # Held until the run ends: one run per output dir, and no silent overwrite of an earlier one.
        # The watchdog ends every rank when one dies or all stop progressing (trainer/stall.py).
        with claim_output_dir(config, runtime.rank), watched(config, group) as watchdog:
            config = prepare_quickstart_assets(config, runtime.rank)
            check_model_fits(runtime.layout, config.model.path, config.model.sequence_parallel)
            if placement is not None:
                placement.barrier()  # the rollout ranks may read the quickstart's assets now
            alive = None if watchdog is None else watchdog.alive  # an agent rollout's bounded waits
            config, components = build_components(config, runtime, alive)
            if placement is not None:
                return train_async(config, runtime, components, placement, stages=watchdog)
            teacher = build_teacher(config, runtime)  # algorithm.distill's teacher, or None
            return PPOTrainer(config, runtime, components, stages=watchdog, teacher=teacher).fit()
    finally:
        # An error before train_async (which closes it) leaves the rollout ranks waiting on the
        # transfer group until it is destroyed; closing twice is harmless.
        if placement is not None:
            placement.close()
        # A caller that started torch.distributed itself (a test's worker pool) keeps it.
        if runtime is not None and runtime._owns_process_group:
            shutdown(runtime)


def _record_for_launcher(err: BaseException) -> None:
    """Leave the one ``error:`` line in torchrun's per-worker error file. ``verl-megatron train``
    prints it from there; plain torchrun shows it as the root cause at the end of its failure report
    (as ``traceback``), whichever rank it saw fail first."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    import json
    import time

    line = " ".join((str(err).strip() or type(err).__name__).split())
    record = {
        "message": {
            "message": f"{type(err).__name__}: {line}",
            "extraInfo": {"py_callstack": f"error: {line}", "timestamp": str(int(time.time()))},
        }
    }
    with open(path, "w") as f:
        json.dump(record, f)


# A non-zero rank that fails a check waits this long for rank 0 to print the line and for torchrun
# to stop it: printed by rank 0 alone, and never lost to a SIGTERM that reached rank 0 first.
PEER_GRACE_S = 30.0


def _report(err: BaseException, to_launcher: bool) -> int:
    """Rank 0 prints the ``error:`` line; another rank waits for rank 0 (every rank fails the same
    start-up checks) and prints the line itself only if it is still running after PEER_GRACE_S."""
    from verl_megatron.errors import report_user_error

    under_torchrun = "TORCHELASTIC_ERROR_FILE" in os.environ
    if under_torchrun:
        _record_for_launcher(err)
    rank = _rank()
    if to_launcher or rank == 0 or not under_torchrun:
        return report_user_error(err, show=rank == 0 and not to_launcher)
    import time

    time.sleep(PEER_GRACE_S)
    return report_user_error(err)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry. Input the user can fix (config, data, checkpoint: a UserInputError)
    prints one ``error:`` line and exits with 2 on every rank; rank 0 alone prints it (``_report``),
    or the launching ``verl-megatron train`` does when it started torchrun. A run stopped by the
    divergence guard prints its one line and exits with 3."""
    from verl_megatron.errors import is_user_error
    from verl_megatron.trainer.guard import TrainingDivergedError

    args = parse_args(argv)
    quiet_warnings()
    try:
        run(args.config, args.overrides)
    except TrainingDivergedError as err:
        print(f"error: {err}", file=sys.stderr)
        return 3
    except Exception as err:
        if not is_user_error(err):
            raise
        return _report(err, args.errors_to_launcher)
    return 0


if __name__ == "__main__":
    sys.exit(main())
