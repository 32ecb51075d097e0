"""The start-up check of ``reward_model``'s model-based part (config only, plus the reward model's
config.json and weight names), called from ``validate_config``.

Apart from ``reward/model_rewards.py`` because every front-end process validates the config before
torchrun starts the ranks: this check must not import the protocol (tensordict, torch._dynamo).
"""

from __future__ import annotations

from typing import Any

import torch

from verl_megatron.reward.combine import FormulaError, compile_formula, default_formula
from verl_megatron.reward.judge import check_judge_config
from verl_megatron.reward.model_config import TRUNCATION_MODES

__all__ = ["check_model_rewards", "formula_text"]


def formula_text(section: Any) -> str:
    return section.combine or default_formula(section.enable, section.judge.enable)


def check_model_rewards(config: Any, world_size: int) -> None:
    """Start-up check of ``reward_model``'s model-based part; raises ConfigError naming the key."""
    from verl_megatron.errors import ConfigError, ParallelConfigError
    from verl_megatron.models.config import load_hf_config, read_hf_architecture

    section = config.reward_model
    try:
        formula = compile_formula(formula_text(section))
    except FormulaError as err:
        raise ConfigError(str(err)) from None
    for name, on, key in (
        ("rm", section.enable, "reward_model.enable"),
        ("judge", section.judge.enable, "reward_model.judge.enable"),
    ):
        if name in formula.names and not on:
            raise ConfigError(f"reward_model.combine={formula.text!r} uses '{name}' but {key} is false")
    if section.judge.enable:
        try:
            check_judge_config(section.judge)
            if section.judge.backend == "native" and section.judge.model_path:
                from verl_megatron.reward.judge_model import check_judge_model_path

                check_judge_model_path(section.judge.model_path)
        except ValueError as err:
            raise ConfigError(str(err)) from None
    if not section.enable:
        return
    from verl_megatron.reward.model import check_reward_checkpoint  # megatron: only with a reward model

    check_reward_checkpoint(section.model.path)
    if section.truncation not in TRUNCATION_MODES:
        raise ConfigError(
            f"reward_model.truncation={section.truncation!r}; expected one of {list(TRUNCATION_MODES)}"
        )
    if section.max_length is not None and section.max_length < 1:
        raise ConfigError(f"reward_model.max_length must be >= 1 or null, got {section.max_length}")
    if not section.use_dynamic_bsz and section.micro_batch_size_per_gpu < 1:
        raise ConfigError(
            f"reward_model.micro_batch_size_per_gpu must be >= 1, got {section.micro_batch_size_per_gpu}"
        )
    if section.model.input_tokenizer and not config.data.return_raw_chat:
        raise ConfigError(
            "reward_model.model.input_tokenizer re-templates the chat from raw_prompt: set data.return_raw_chat=true"
        )
    if section.parallel.cp > 1 and not torch.cuda.is_available():
        raise ConfigError(
            "reward_model.parallel.cp > 1 needs Transformer Engine attention, which needs CUDA; this machine has no GPU"
        )
    try:
        layout = section.parallel.resolve(world_size)
        arch = read_hf_architecture(load_hf_config(section.model.path))
        layout.check_model(
            num_layers=arch.num_layers,
            num_attention_heads=arch.num_attention_heads,
            num_query_groups=arch.num_key_value_heads,
        )
    except (ParallelConfigError, ValueError) as err:
        raise ConfigError(
            f"reward_model.parallel: {err} (reward_model.model.path='{section.model.path}')"
        ) from None
