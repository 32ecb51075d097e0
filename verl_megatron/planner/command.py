"""``verl-megatron plan``: print the memory plan of a job and whether it fits.

Exit status: 0 when every rank fits, 3 when some rank does not, 2 for bad input (one line).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import warnings
from typing import Any

from verl_megatron.errors import ConfigError, is_user_error, report_user_error

__all__ = ["EXIT_DOES_NOT_FIT", "main", "parse_memory", "plan_config"]

EXIT_DOES_NOT_FIT = 3
GiB = 2**30
_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": GiB,
    "tib": 2**40,
}


def parse_memory(text: str) -> int:
    """Bytes of ``80GiB``, ``141GB``, ``8e10``; ConfigError naming --gpu-memory otherwise."""
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ConfigError(f"--gpu-memory {text!r}: expected a size such as 80GiB or 141GB")
    try:
        value = float(match.group(1)) * _UNITS[unit]
    except ValueError:
        raise ConfigError(f"--gpu-memory {text!r}: expected a size such as 80GiB or 141GB") from None
    if not 0 < value < float("inf"):  # 1e400 reads as inf, which no int holds
        raise ConfigError(f"--gpu-memory {text!r} must be a positive, finite size")
    return int(value)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line and exit status 2, as every user error
        raise ConfigError(f"verl-megatron plan: {message}")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="verl-megatron plan",
        description="Will a job fit? Model state per rank (exact, built on the meta device), "
        "activations, rollout engine, per phase, against one GPU's memory.",
    )
    parser.add_argument(
        "--config", help="YAML recipe (default: configs/quickstart.yaml; model.path=DIR is needed either way)"
    )
    parser.add_argument("--gpus", type=int, required=True, help="world size (GPUs of the job)")
    parser.add_argument("--gpu-memory", default="80GiB", help="memory of one GPU (default 80GiB)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. model.path=DIR")
    return parser


def _hf_config(path: str, key: str) -> Any:
    from verl_megatron.models.config import load_hf_config

    if not path:
        raise ConfigError(f"{key} is required: a folder holding the model's config.json")
    try:
        return load_hf_config(path)
    except (FileNotFoundError, OSError, ValueError) as err:
        if is_user_error(err):
            raise
        raise ConfigError(f"{key}={path}: {' '.join(str(err).split())}") from None


def build_plan(args: argparse.Namespace) -> Any:
    """Load the config and the model's config.json, build and return the MemoryPlan."""
    from verl_megatron.trainer.config import default_config_path, load_config

    if args.gpus < 1:
        raise ConfigError(f"--gpus must be >= 1, got {args.gpus}")
    gpu_bytes = parse_memory(args.gpu_memory)
    config = _checked(load_config(args.config or default_config_path(), args.overrides), args.gpus)
    return plan_config(config, args.gpus, gpu_bytes)


def _checked(config: Any, world_size: int) -> Any:
    """``config`` after the trainer's start-up checks for ``world_size`` GPUs (those that need no
    weights, engine or GPU here): a config the trainer refuses is bad input, and the checks fill
    in the micro-batch sizes left unset."""
    if config.trainer.mode == "sft":
        from verl_megatron.trainer.sft_trainer import check_sft_config

        return check_sft_config(config, world_size, this_machine=False)[0]
    from verl_megatron.trainer.config import validate_config

    validate_config(config, world_size, this_machine=False)
    return config


def plan_config(config: Any, world_size: int, gpu_bytes: int, savings: bool | None = True) -> Any:
    """The MemoryPlan of a loaded config (a PPOConfig) on ``world_size`` GPUs of ``gpu_bytes``,
    with the changes that save the most (``savings``: always, or None: only when it does not fit)."""
    from verl_megatron.planner.plan import plan_memory, role_specs
    from verl_megatron.planner.savings import plan_savings

    hf_config = _hf_config(config.model.path, "model.path")
    reward = None
    if config.reward_model.enable:
        reward = _hf_config(config.reward_model.model.path, "reward_model.model.path")
    teacher = None
    if config.algorithm.distill.enable:
        teacher = _hf_config(
            config.algorithm.distill.teacher.model.path, "algorithm.distill.teacher.model.path"
        )
    config.parallel.resolve(world_size)  # a layout that cannot exist is bad input, not "does not fit"
    specs = role_specs(config, hf_config, reward, teacher)
    built: dict = {}
    plan = plan_memory(config, world_size, gpu_bytes, specs, built, other_optimizer=bool(savings))
    if savings or (savings is None and not plan.fits):
        plan.savings = plan_savings(config, plan, specs, built)
    return plan


def main(argv: list[str]) -> int:
    from verl_megatron.planner.report import plan_dict, render

    try:
        args = _parser().parse_intermixed_args(argv)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # megatron's and the CPU layer's start-up notes
            plan = build_plan(args)
    except Exception as err:
        if not is_user_error(err):
            raise
        return report_user_error(err)
    print(json.dumps(plan_dict(plan), indent=1) if args.json else render(plan))
    return 0 if plan.fits else EXIT_DOES_NOT_FIT


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
