"""The ``verl-megatron`` console script: ``train``, ``sft``, ``check-hf``, ``--version``, ``--help``.

``train`` outside torchrun with ``trainer.n_gpus_per_node > 1`` checks the config and the data
here, then re-launches itself as ``torchrun --nproc_per_node=N -m verl_megatron.train ...``
on this node (several nodes: launch/multi_node.sh and launch/slurm.sbatch).

Heavy libraries (torch, megatron, transformers) are imported only once a command runs,
so ``--help`` and ``--version`` answer at once.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
from collections.abc import Sequence

from verl_megatron.errors import EXIT_USER_ERROR, is_user_error, report_user_error

__all__ = ["main"]

_USAGE = "usage: verl-megatron {train,check,check-hf,plan} [args...] | sft [args...] | --version | --help"
_HELP = f"""{_USAGE}

Reinforcement-learning post-training (PPO, GRPO, DAPO) on megatron-core.

commands:
  train [--config FILE] [key=value ...]   train; without --config: the CPU quickstart
                                          (verl-megatron train --help for more)
  sft [--config FILE] [key=value ...]     supervised fine-tuning on the same actor (train with
                                          trainer.mode=sft); without --config: configs/sft_quickstart.yaml
  check [--config FILE] [--world-size N] [key=value ...]
                                          train's start-up checks (config, data, resume, reward,
                                          distillation, memory) for N processes, nothing started
                                          (exit 0 passes, 2 bad input)
  check-hf PATH [--tp N] [--pp N] [--vpp N] [--ep N] [--etp N] [--dtype D] [--tolerance X] [--seed N]
                                          compare megatron's logits with transformers'
                                          for a Hugging Face checkpoint (MoE: --ep/--etp)
  plan [--config FILE] model.path=DIR --gpus N [--gpu-memory 80GiB] [--json]
                                          will the job fit? memory per GPU, per rank and phase
                                          (exit 0 fits, 3 does not, 2 bad input)

With trainer.n_gpus_per_node > 1, train starts torchrun on this node itself.
Several nodes: launch/multi_node.sh or launch/slurm.sbatch.
"""

# ``verl-megatron sft`` without --config: SFT of the quickstart's tiny model on the synthetic task.
_SFT_QUICKSTART = os.path.normpath(
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs", "sft_quickstart.yaml")
)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("verl-megatron")
    except PackageNotFoundError:  # a source tree on PYTHONPATH without pip install
        from verl_megatron import __version__

        return __version__


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(argv: list[str], nproc: int) -> int:
    """Run ``verl_megatron.train`` under torchrun on this node; return the job's exit status.

    Workers that stop on a user error exit with 2 and leave the message in torchrun's
    per-worker error file; it is printed here once, instead of torchrun's failure report.
    """
    import logging

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser
    from torch.distributed.run import run as torchrun

    args = get_args_parser().parse_args(
        [f"--nproc-per-node={nproc}", f"--master-port={_free_port()}", "-m", "verl_megatron.train",
         "--errors-to-launcher", *argv]
    )  # fmt: skip
    # The agent logs every worker's exit at ERROR; the workers' own output says what happened.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        torchrun(args)
    except ChildFailedError as err:
        return _report_failures(err)
    return 0


def _report_failures(err) -> int:
    """One line for the job: a worker's user error (exit 2), else which rank failed and how."""
    failures = sorted(err.failures.items())
    for _, failure in failures:
        if failure.exitcode == EXIT_USER_ERROR and isinstance(failure.message, dict):
            message = str(failure.message.get("message", ""))
            # The error file holds "TypeName: message".
            _, _, text = message.partition(": ")
            print(f"error: {' '.join((text or message).split())}", file=sys.stderr, flush=True)
            return EXIT_USER_ERROR
    if any(f.exitcode == EXIT_USER_ERROR for _, f in failures):
        return EXIT_USER_ERROR
    rank, failure = next(((r, f) for r, f in failures if f.exitcode > 0), None) or _first_failure(failures)
    print(
        f"error: training failed: rank {rank} exited with code {failure.exitcode} (its output is above)",
        file=sys.stderr,
        flush=True,
    )
    return 1


def _first_failure(failures: list) -> tuple:
    """The (rank, failure) that died first: once one worker fails torchrun SIGTERMs the others,
    so a -15 is a consequence unless every rank has it; the earliest of the rest (torchrun's
    timestamps are whole seconds, so a tie goes to the lowest rank)."""
    own = [(r, f) for r, f in failures if f.exitcode != -signal.SIGTERM] or failures
    return min(own, key=lambda item: (item[1].timestamp, item[0]))


def check(argv: list[str]) -> int:
    """``check``: train's start-up checks (``train.startup_checks``) once, before a launcher starts
    its ranks (launch/*.sh), so a config error is one line and exit status 2 instead of a torchrun
    restart per attempt."""
    import argparse

    from verl_megatron import train as train_module

    parser = argparse.ArgumentParser(
        prog="verl-megatron check", description="The start-up checks of train; nothing is built or run."
    )
    parser.add_argument("--config", default=None, help="YAML config (default: configs/quickstart.yaml)")
    parser.add_argument(
        "--world-size", type=int, default=None, help="processes (default: trainer.nnodes x n_gpus_per_node)"
    )
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. actor.optim.lr=1e-6")
    args = parser.parse_intermixed_args(argv)
    train_module.quiet_warnings()
    try:
        from verl_megatron.trainer.config import default_config_path, load_config

        config = load_config(args.config or default_config_path(), args.overrides)
        world_size = args.world_size or config.trainer.nnodes * config.trainer.n_gpus_per_node
        # The function every rank runs before it builds anything: the ranks' verdict, once.
        checked = train_module.startup_checks(args.config, args.overrides, world_size)
    except Exception as err:
        if not is_user_error(err):
            raise
        return report_user_error(err)
    if checked.memory_line:  # trainer.memory_check=warn on a job that does not fit
        print(checked.memory_line, flush=True)
    print(f"verl-megatron check: the start-up checks pass for {world_size} process(es)", flush=True)
    return 0


def train(argv: list[str]) -> int:
    """Run training here, or under torchrun when the config asks for several processes."""
    from verl_megatron import train as train_module

    if "WORLD_SIZE" in os.environ:  # already a torchrun worker
        return train_module.main(argv)
    args = train_module.parse_args(argv)  # --help answers here, before any heavy import
    config_path = args.config or "configs/quickstart.yaml (default)"
    print(f"verl-megatron train: checking {config_path} with {len(args.overrides)} override(s)", flush=True)
    train_module.quiet_warnings()
    try:
        from verl_megatron.trainer.config import default_config_path, load_config

        config = load_config(args.config or default_config_path(), args.overrides)
        trainer = config.trainer
        if trainer.nnodes > 1:
            print(
                f"error: trainer.nnodes={trainer.nnodes}: start multi-node jobs with torchrun on every "
                "node (launch/multi_node.sh or launch/slurm.sbatch)",
                file=sys.stderr,
            )
            return EXIT_USER_ERROR
        if trainer.n_gpus_per_node > 1:  # the ranks' start-up checks, once (the ranks print the warnings)
            train_module.startup_checks(args.config, args.overrides, trainer.n_gpus_per_node)
    except Exception as err:
        if not is_user_error(err):
            raise
        return report_user_error(err)
    if trainer.n_gpus_per_node > 1:
        return _torchrun(argv, trainer.n_gpus_per_node)
    return train_module.main(argv)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_HELP if argv else _USAGE, file=sys.stdout if argv else sys.stderr)
        return 0 if argv else EXIT_USER_ERROR
    if argv[0] in ("-V", "--version"):
        print(f"verl-megatron {_version()}")
        return 0
    command, rest = argv[0], argv[1:]
    if command == "train":
        return train(rest)
    if command == "sft":  # the last override wins: `sft` always runs the SFT loop
        if not any(a == "--config" or a.startswith("--config=") for a in rest):
            rest = ["--config", _SFT_QUICKSTART, *rest]
        return train([*rest, "trainer.mode=sft"])
    if command == "check":
        return check(rest)
    if command == "check-hf":
        from verl_megatron.tools.check_hf import main as check_hf_main

        return check_hf_main(rest)
    if command == "plan":
        from verl_megatron.planner.command import main as plan_main

        return plan_main(rest)
    print(f"error: unknown command {command!r}\n{_USAGE}", file=sys.stderr)
    return EXIT_USER_ERROR


if __name__ == "__main__":
    sys.exit(main())
