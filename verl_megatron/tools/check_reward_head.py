"""``verl-megatron check-hf`` for a reward model: megatron's scores against transformers'.

A checkpoint whose config.json names a ``*ForSequenceClassification`` is checked here instead of
by logits: the same prompts are scored by the megatron reward model
(:class:`~verl_megatron.reward.model.MegatronRewardModel`, under ``--tp``/``--pp``) and by
``AutoModelForSequenceClassification`` in float32, and the largest absolute score difference
is compared with the tolerance (default 1e-4 in float32).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from verl_megatron.distributed.collective import max_over_ranks
from verl_megatron.distributed.parallel import Runtime
from verl_megatron.tools.check_common import check_prompts, max_abs_diff, verdict

__all__ = ["DEFAULT_SCORE_TOLERANCE", "hf_scores", "is_sequence_classification", "run_reward_check"]

DEFAULT_SCORE_TOLERANCE = {"float32": 1e-4, "bfloat16": 0.25}


def is_sequence_classification(hf_config: Any) -> bool:
    return any(
        str(a).endswith("ForSequenceClassification")
        for a in (getattr(hf_config, "architectures", None) or [])
    )


def hf_scores(path: str, sequences: list[torch.Tensor]) -> torch.Tensor:
    """transformers' float32 scores [N] (one label) of each sequence, scored alone."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(
        path, dtype=torch.float32, local_files_only=True
    )
    model.eval()
    with torch.no_grad():
        return torch.tensor([float(model(input_ids=s.unsqueeze(0)).logits[0, 0]) for s in sequences])


def run_reward_check(args: argparse.Namespace, runtime: Runtime, hf_config: Any) -> int:
    """Inside the check's distributed job: score, compare, report; every rank returns the same status."""
    from verl_megatron.reward.model import MegatronRewardModel
    from verl_megatron.reward.model_config import ModelRewardSettings, RewardModelModelConfig

    settings = ModelRewardSettings(
        enable=True,
        model=RewardModelModelConfig(path=args.path, dtype=args.dtype),
        parallel=runtime.layout,
        micro_batch_size_per_gpu=1,
    )
    reward_model = MegatronRewardModel(runtime, settings)
    try:
        sequences = check_prompts(args.path, hf_config.vocab_size, args.seed)
        scores = reward_model.score_sequences([s.tolist() for s in sequences])
    finally:
        reward_model.close()
    reporter = runtime.rank == 0
    # inf for a non-finite score: a NaN could vanish in the MAX all-reduce against another rank's 0.
    local_diff = max_abs_diff([(scores, hf_scores(args.path, sequences))]) if reporter else 0.0
    max_diff = max_over_ranks(local_diff, runtime.device)
    tolerance = DEFAULT_SCORE_TOLERANCE[args.dtype] if args.tolerance is None else args.tolerance
    head = f"check-hf {args.path} (reward model) tp={args.tp} pp={args.pp} vpp={args.vpp} dtype={args.dtype}"
    return verdict(
        max_diff, tolerance, reporter=reporter, head=head, quantity="score", prompts=len(sequences)
    )
