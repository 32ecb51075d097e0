"""Partial rollout takes a batch's samples per prompt from the engine's own sampling rule: greedy
decoding (temperature 0 or do_sample false) returns one row per prompt whatever ``n`` says."""

from __future__ import annotations

import pytest
import torch

from verl_megatron.protocol import DataProto
from verl_megatron.rollout import RolloutConfig
from verl_megatron.rollout.base import RolloutEngine, assemble_output
from verl_megatron.rollout.partial import generate_with_versions
from verl_megatron.rollout.sampling import resolve_sampling

EOS, PAD = 1, 0


class RuleEngine(RolloutEngine):
    """Returns resolve_sampling's n rows per prompt (as the native engine does); a row's tokens are
    100 * (its prompt's last token) + 10 + (tokens so far), never EOS."""

    def __init__(self, config: RolloutConfig) -> None:
        self.config = config

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        n = resolve_sampling(self.config, prompts.meta_info).n
        ids, mask = prompts.batch["input_ids"], prompts.batch["attention_mask"]
        width = int(prompts.meta_info["response_length"])
        done = mask.repeat_interleave(n, 0).sum(-1, keepdim=True) - 2  # prompts are 2 tokens long
        # No row stops, so every continuation has the same length: column 1 is the prompt's last token.
        tokens = 100 * ids.repeat_interleave(n, 0)[:, 1:2] + 10 + done + torch.arange(width)
        return assemble_output(prompts, tokens, torch.ones_like(tokens), torch.zeros(tokens.shape), n)


@pytest.mark.parametrize(
    ("settings", "meta", "rows"),
    [
        ({"temperature": 0.0, "n": 3}, {}, 2),  # greedy by temperature 0: one row a prompt
        ({"n": 3}, {"do_sample": False}, 2),  # greedy by meta do_sample=False
        ({"n": 3}, {}, 6),
        ({"n": 1}, {"n": 2}, 4),
    ],
)
def test_partial_rollout_rows_follow_the_engines_sampling_rule(settings, meta, rows):
    engine = RuleEngine(RolloutConfig(**settings))
    prompts = DataProto.from_dict(
        {"input_ids": torch.tensor([[3, 5], [3, 6]]), "attention_mask": torch.ones(2, 2, dtype=torch.long)},
        meta_info=meta,
    )
    out = generate_with_versions(
        engine,
        prompts,
        response_length=4,
        segment=2,
        stops=[EOS],
        pad=PAD,
        version=lambda: 7,
        refresh=lambda: None,
    )
    per_prompt = rows // 2
    assert out.batch["responses"].shape == (rows, 4)
    # Each row continues its own prompt across the two segments: 100 * last prompt token + 10 + t.
    expected = torch.tensor([5, 6]).repeat_interleave(per_prompt)[:, None] * 100 + 10 + torch.arange(4)
    assert torch.equal(out.batch["responses"], expected), out.batch["responses"].tolist()
    assert out.batch["weight_version"].tolist() == [7] * rows
