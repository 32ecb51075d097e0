"""``verl-megatron check-hf DIR --tp N --pp M``: does megatron reproduce transformers' logits?

Loads a Hugging Face checkpoint into megatron under the given layout, runs a few prompts
through it and through ``transformers`` (float32 reference), prints the largest absolute logit
difference and exits 1 when it is above the tolerance. Run it under ``torchrun`` with a
multiple of tp*pp processes, or as a plain command: it then launches tp*pp processes itself
(or more when mixture-of-experts ``--ep``/``--etp`` need them: ep*etp*pp ranks at least).
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
from collections.abc import Sequence

import torch
import torch.distributed as dist

from verl_megatron.distributed import state
from verl_megatron.distributed.collective import max_over_ranks
from verl_megatron.distributed.parallel import ParallelLayout, Runtime, init_runtime
from verl_megatron.errors import UserInputError, report_user_error
from verl_megatron.models.builder import build_gpt_chunks, model_info
from verl_megatron.models.config import ModelConfig, load_hf_config
from verl_megatron.models.convert import load_hf_weights
from verl_megatron.models.families.qwen2_vl import VL_MODEL_TYPES
from verl_megatron.tools.check_common import check_prompts, max_abs_diff, verdict

DEFAULT_TOLERANCE = {"float32": 1e-3, "bfloat16": 0.25}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="verl-megatron check-hf",
        description="Compare megatron's logits with transformers' for a checkpoint.",
    )
    parser.add_argument("path", help="local Hugging Face checkpoint folder")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    parser.add_argument("--vpp", type=int, default=None, help="virtual stages per pipeline rank")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size (MoE models)")
    parser.add_argument("--etp", type=int, default=None, help="expert tensor-parallel size (default: tp)")
    parser.add_argument("--dtype", choices=sorted(DEFAULT_TOLERANCE), default="float32")
    parser.add_argument("--tolerance", type=float, default=None, help="max |logit diff| allowed")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompts (no tokenizer)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (0: within tolerance, 1: above it)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    _quiet_libraries()
    try:
        # Checked before torchrun starts: a bad path or layout is one line, not a traceback per rank.
        check_args(args)
    except UserInputError as err:
        return report_user_error(err, show=int(os.environ.get("RANK", "0")) == 0)
    if "WORLD_SIZE" not in os.environ and world_size(args) > 1:
        return _launch(argv, world_size(args))
    return run_check(args)


def world_size(args: argparse.Namespace) -> int:
    """Processes the layout needs: tp*pp, times dp when the experts need more ranks (ep*etp)."""
    import math

    per_stage = math.lcm(args.tp, args.ep * (args.etp or args.tp))
    return per_stage * args.pp


class CheckHfArgumentError(UserInputError):
    """A check-hf argument that cannot work: no checkpoint at the path, or a layout the model cannot take."""


def check_args(args: argparse.Namespace) -> None:
    """The checkpoint folder exists and its model can be split over ``--tp``/``--pp``/``--vpp``."""
    from verl_megatron.errors import ModelConfigError, ParallelConfigError
    from verl_megatron.models.config import check_layout, read_hf_architecture

    if min(args.tp, args.pp, args.ep, args.etp or 1) < 1:
        raise CheckHfArgumentError(
            f"check-hf: --tp, --pp, --ep and --etp must be positive, got tp={args.tp} pp={args.pp} "
            f"ep={args.ep} etp={args.etp}"
        )
    if not os.path.exists(os.path.expanduser(args.path)):
        raise CheckHfArgumentError(f"check-hf: checkpoint folder '{args.path}' does not exist")
    try:
        hf_config = load_hf_config(args.path)
    except (OSError, ValueError) as err:
        raise CheckHfArgumentError(f"check-hf: {' '.join(str(err).split())}") from None
    try:
        arch = read_hf_architecture(hf_config)
        layout = _layout(args).resolve(int(os.environ.get("WORLD_SIZE", world_size(args))))
        check_layout(layout, arch)
    except (ParallelConfigError, ModelConfigError) as err:
        flags = f"--tp {args.tp} --pp {args.pp}" + (f" --vpp {args.vpp}" if args.vpp else "")
        flags += (f" --ep {args.ep}" if args.ep > 1 else "") + (f" --etp {args.etp}" if args.etp else "")
        raise CheckHfArgumentError(f"check-hf {args.path} {flags}: {err}") from None


def _layout(args: argparse.Namespace) -> ParallelLayout:
    return ParallelLayout(tp=args.tp, pp=args.pp, vpp=args.vpp, ep=args.ep, etp=args.etp)


def _quiet_libraries() -> None:
    """Keep the report readable: megatron and torch.distributed warn at every import and call."""
    import warnings

    from transformers.utils import logging as hf_logging

    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed\.")
    hf_logging.disable_progress_bar()


def _launch(argv: list[str], nproc: int) -> int:
    """Re-run this command under torchrun with ``nproc`` local processes."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
        f"--master-port={port}", "-m", "verl_megatron.tools.check_hf", *argv,
    ]  # fmt: skip
    return subprocess.call(cmd)


@torch.no_grad()
def megatron_logits(
    chunks: list[torch.nn.Module], runtime: Runtime, sequences: list[torch.Tensor]
) -> list[torch.Tensor] | None:
    """Logits [T_i, V] (true vocabulary, float32, CPU) of each sequence, one micro-batch each.

    Collective over the model replica; returns the list on the last pipeline stage, else None.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    vocab = model_info(chunks).vocab_size
    for chunk in chunks:
        chunk.eval()

    def forward_step(data_iterator, model):
        ids = next(data_iterator).unsqueeze(0).to(runtime.device)
        positions = torch.arange(ids.shape[1], device=runtime.device).unsqueeze(0)
        output = model(ids, positions, None, runtime_gather_output=True)

        def collect(logits):
            return logits.new_zeros(()), {"logits": logits[0, :, :vocab].float().cpu()}

        return output, collect

    # The interleaved (vpp) schedule runs micro-batches in groups of pp; fill the last group
    # with copies whose outputs are dropped.
    batches = list(sequences)
    if len(chunks) > 1:
        batches += [sequences[0]] * (-len(batches) % runtime.layout.pp)
    iterators = [iter(batches) for _ in chunks]
    results = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iterators if len(chunks) > 1 else iterators[0],
        model=chunks if len(chunks) > 1 else chunks[0],
        num_microbatches=len(batches),
        seq_length=max(len(s) for s in sequences),
        micro_batch_size=1,
        forward_only=True,
    )
    if not state.is_pp_last_rank():
        return None
    return [r["logits"] for r in results[: len(sequences)]]


def hf_logits(path: str, sequences: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """transformers' float32 logits [T_i, V] of each sequence."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).to(device)
    model.eval()
    with torch.no_grad():
        return [model(s.unsqueeze(0).to(device)).logits[0].float().cpu() for s in sequences]


def run_check(args: argparse.Namespace) -> int:
    """Inside a distributed job: build, load, compare. Every rank returns the same status."""
    runtime = init_runtime(_layout(args))
    hf_config = load_hf_config(args.path)
    from verl_megatron.tools.check_reward_head import is_sequence_classification, run_reward_check

    if is_sequence_classification(hf_config):  # a reward model: scores, not logits
        return run_reward_check(args, runtime, hf_config)
    if getattr(hf_config, "model_type", None) in VL_MODEL_TYPES:  # logits on image + text prompts
        from verl_megatron.tools.check_hf_vl import run_vl_check

        tolerance = DEFAULT_TOLERANCE[args.dtype] if args.tolerance is None else args.tolerance
        return run_vl_check(args, runtime, hf_config, tolerance)
    model_cfg = ModelConfig(path=args.path, dtype=args.dtype)
    chunks = build_gpt_chunks(hf_config, runtime, model_cfg)
    load_hf_weights(chunks, args.path, runtime)
    sequences = check_prompts(args.path, hf_config.vocab_size, args.seed)
    logits = megatron_logits(chunks, runtime, sequences)
    # One rank holding megatron's logits runs the reference, so only it loads the HF model.
    reporter = logits is not None and runtime.tp_rank == 0 and runtime.dp_rank == 0
    local_diff = 0.0
    if reporter:
        reference = hf_logits(args.path, sequences, runtime.device)
        local_diff = max_abs_diff(zip(logits, reference))
    max_diff = max_over_ranks(local_diff, runtime.device)
    tolerance = DEFAULT_TOLERANCE[args.dtype] if args.tolerance is None else args.tolerance
    head = (
        f"check-hf {args.path} tp={args.tp} pp={args.pp} vpp={args.vpp}"
        + (f" ep={args.ep} etp={args.etp or args.tp}" if args.ep > 1 or args.etp else "")
        + f" dtype={args.dtype}"
    )
    return verdict(
        max_diff, tolerance, reporter=reporter, head=head, quantity="logit", prompts=len(sequences)
    )


if __name__ == "__main__":
    status = main()
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.exit(status)
