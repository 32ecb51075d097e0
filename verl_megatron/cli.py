"""The ``verl-megatron`` console script.

    verl-megatron train [--config FILE] [key=value ...]   # default config: the CPU quickstart
    verl-megatron check-hf PATH [--tp N --pp N]           # HF <-> megatron logit check

``train`` outside torchrun with ``trainer.n_gpus_per_node > 1`` re-launches itself as
``torchrun --nproc_per_node=N -m verl_megatron.train ...`` on this node (several nodes:
see launch/multi_node.sh and launch/slurm.sbatch).
"""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Sequence

__all__ = ["main"]

_USAGE = "usage: verl-megatron {train,check-hf} [args...]"


def _torchrun(argv: list[str], nproc: int) -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
        f"--master-port={port}", "-m", "verl_megatron.train", *argv,
    ]  # fmt: skip
    return subprocess.call(cmd)


def train(argv: list[str]) -> int:
    """Run training here, or under torchrun when the config asks for several processes."""
    import os

    from verl_megatron import train as train_module
    from verl_megatron.trainer.config import ConfigError, default_config_path, load_config

    if "WORLD_SIZE" not in os.environ:
        args = train_module.parse_args(argv)
        try:
            config = load_config(args.config or default_config_path(), args.overrides)
        except (ConfigError, FileNotFoundError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        if config.trainer.nnodes > 1:
            print(
                f"error: trainer.nnodes={config.trainer.nnodes}: start multi-node jobs with torchrun on every "
                "node (launch/multi_node.sh or launch/slurm.sbatch)",
                file=sys.stderr,
            )
            return 2
        if config.trainer.n_gpus_per_node > 1:
            return _torchrun(argv, config.trainer.n_gpus_per_node)
    return train_module.main(argv)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_USAGE)
        print(__doc__)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "train":
        return train(rest)
    if command == "check-hf":
        from verl_megatron.models.check_hf import main as check_hf_main

        return check_hf_main(rest)
    print(f"error: unknown command {command!r}\n{_USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
