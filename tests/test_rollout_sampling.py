"""Sampling rules and the batch plumbing shared by every engine, with hand-computed numbers."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from verl_megatron.protocol import DataProto
from verl_megatron.rollout import RolloutConfig, RolloutConfigError
from verl_megatron.rollout.base import (
    assemble_output,
    pad_token_id,
    prompt_tensors,
    responses_from_lists,
    stop_token_ids,
)
from verl_megatron.rollout.sampling import SamplingParams, resolve_sampling, sample_next

# Probabilities 0.5, 0.3, 0.15, 0.05 at temperature 1.
PROBS = torch.tensor([0.05, 0.5, 0.15, 0.3])
LOGITS = PROBS.log()


def _draw(params: SamplingParams, rows: int = 4000, seed: int = 0, logits: torch.Tensor = LOGITS):
    generator = torch.Generator().manual_seed(seed)
    return sample_next(logits.expand(rows, -1).clone(), params, generator)


def test_greedy_takes_argmax_with_temperature_one_log_prob():
    tokens, log_probs = _draw(SamplingParams(greedy=True, temperature=0.3), rows=2)
    assert tokens.tolist() == [1, 1]
    torch.testing.assert_close(log_probs, torch.full((2,), math.log(0.5)))


@pytest.mark.parametrize(
    ("top_k", "top_p", "allowed"),
    [
        (-1, 1.0, {0, 1, 2, 3}),
        (2, 1.0, {1, 3}),
        (-1, 0.75, {1, 3}),  # 0.5 + 0.3 passes 0.75: the nucleus stops there
        (-1, 0.85, {1, 3, 2}),
        (3, 0.5, {1}),  # 0.5 alone reaches 0.5
    ],
)
def test_top_k_and_top_p_support_and_frequencies(top_k, top_p, allowed):
    tokens, log_probs = _draw(SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p))
    assert set(tokens.tolist()) == allowed
    # Draws follow the renormalised distribution over the allowed set (4000 rows: ~0.02 noise).
    kept = torch.tensor(sorted(allowed))
    expected = PROBS[kept] / PROBS[kept].sum()
    counts = torch.bincount(tokens, minlength=4)[kept].float() / tokens.numel()
    torch.testing.assert_close(counts, expected, atol=0.03, rtol=0)
    # Log-probs are of the full (unfiltered) softmax at the sampling temperature.
    torch.testing.assert_close(log_probs, PROBS.log()[tokens])


def test_temperature_scales_log_probs_and_sharpens():
    tokens, log_probs = _draw(SamplingParams(temperature=0.5))
    sharpened = torch.softmax(LOGITS / 0.5, dim=-1)
    torch.testing.assert_close(log_probs, sharpened.log()[tokens])
    counts = torch.bincount(tokens, minlength=4).float() / tokens.numel()
    torch.testing.assert_close(counts, sharpened, atol=0.03, rtol=0)


def test_large_vocabulary_two_level_draw_matches_the_distribution():
    # 3000 entries (blocks of 256 and a partial last block); mass on a few known ids.
    logits = torch.full((3000,), -30.0)
    weights = {5: 0.4, 300: 0.3, 2999: 0.2, 1024: 0.1}
    for index, p in weights.items():
        logits[index] = math.log(p)
    tokens, _ = _draw(SamplingParams(temperature=1.0), rows=6000, logits=logits)
    assert set(tokens.tolist()) <= set(weights)
    for index, p in weights.items():
        assert abs(float((tokens == index).float().mean()) - p) < 0.03, index
    # top_p over a large vocabulary uses the candidate shortlist: same support rule.
    tokens, _ = _draw(SamplingParams(temperature=1.0, top_p=0.65), rows=500, logits=logits)
    assert set(tokens.tolist()) == {5, 300}


def test_same_generator_state_gives_same_tokens():
    a, _ = _draw(SamplingParams(temperature=1.0), rows=50, seed=4)
    b, _ = _draw(SamplingParams(temperature=1.0), rows=50, seed=4)
    c, _ = _draw(SamplingParams(temperature=1.0), rows=50, seed=5)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_resolve_sampling_training_validation_and_overrides():
    config = RolloutConfig(temperature=0.9, top_k=5, top_p=0.8, n=4)
    assert resolve_sampling(config, {}) == SamplingParams(temperature=0.9, top_k=5, top_p=0.8, n=4)
    # do_sample=False: greedy, one sample (verl), whatever the training settings.
    assert resolve_sampling(config, {"do_sample": False}) == SamplingParams(greedy=True)
    assert resolve_sampling(config, {"validate": True}) == SamplingParams(greedy=True)
    config.val_kwargs.temperature, config.val_kwargs.do_sample, config.val_kwargs.n = 0.6, True, 2
    assert resolve_sampling(config, {"validate": True}) == SamplingParams(temperature=0.6, n=2)
    assert resolve_sampling(config, {"temperature": 0}).greedy
    assert resolve_sampling(config, {"n": 2, "top_p": 0.5}).n == 2
    with pytest.raises(RolloutConfigError, match="invalid sampling"):
        resolve_sampling(config, {"top_p": 0.0})


def test_config_rejects_bad_values_naming_the_field():
    with pytest.raises(RolloutConfigError, match=r"rollout\.name must be one of"):
        RolloutConfig(name="hf")
    with pytest.raises(RolloutConfigError, match=r"rollout\.top_p"):
        RolloutConfig(top_p=1.5)
    with pytest.raises(RolloutConfigError, match=r"rollout\.val_kwargs\.n"):
        RolloutConfig(val_kwargs=type(RolloutConfig().val_kwargs)(n=0))
    with pytest.raises(RolloutConfigError, match="response_length"):
        RolloutConfig(response_length=0)


def _prompt_batch(mask: list[list[int]]) -> DataProto:
    mask_t = torch.tensor(mask)
    return DataProto.from_dict(
        {"input_ids": torch.arange(mask_t.numel()).view(mask_t.shape) + 10, "attention_mask": mask_t},
        non_tensors={"uid": np.array([f"u{i}" for i in range(len(mask))], dtype=object)},
        meta_info={"temperature": 1.0},
    )


def test_prompt_tensors_checks_left_padding_and_derives_positions():
    *_, positions = prompt_tensors(_prompt_batch([[0, 1, 1], [1, 1, 1]]))
    assert positions.tolist() == [[0, 0, 1], [0, 1, 2]]
    with pytest.raises(ValueError, match=r"LEFT-padded.*rows \[1\]"):
        prompt_tensors(_prompt_batch([[0, 1, 1], [1, 1, 0]]))
    with pytest.raises(ValueError, match=r"rows \[0\]"):
        prompt_tensors(_prompt_batch([[0, 0, 0], [1, 1, 1]]))
    with pytest.raises(KeyError, match="input_ids"):
        prompt_tensors(DataProto.from_dict({"attention_mask": torch.ones(1, 2)}))


def test_assemble_output_hand_checked():
    prompts = _prompt_batch([[0, 1, 1], [1, 1, 1]])
    responses, response_mask, log_probs = responses_from_lists(
        [[7, 1], [8], [9, 9, 9], [5, 1]],
        [[-0.5, -0.25], [-1.0], [-0.1, -0.2, -0.3], [-2.0, -3.0]],
        3,
        pad_id=0,
    )
    out = assemble_output(prompts, responses, response_mask, log_probs, n=2)
    assert out.batch["responses"].tolist() == [[7, 1, 0], [8, 0, 0], [9, 9, 9], [5, 1, 0]]
    assert out.batch["response_mask"].tolist() == [[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]]
    assert out.batch["prompts"].tolist() == [[10, 11, 12], [10, 11, 12], [13, 14, 15], [13, 14, 15]]
    assert out.batch["input_ids"][2].tolist() == [13, 14, 15, 9, 9, 9]
    assert out.batch["attention_mask"][1].tolist() == [0, 1, 1, 1, 0, 0]
    assert out.batch["position_ids"][0].tolist() == [0, 0, 1, 2, 3, 4]
    assert out.batch["position_ids"][3].tolist() == [0, 1, 2, 3, 4, 5]
    assert out.batch["rollout_log_probs"][0].tolist() == [-0.5, -0.25, 0.0]
    assert list(out.non_tensor_batch["uid"]) == ["u0", "u0", "u1", "u1"]
    assert out.meta_info == {"temperature": 1.0}
    with pytest.raises(ValueError, match="3 responses for 4 prompt rows"):
        assemble_output(prompts, responses[:3], response_mask[:3], None, n=2)


def test_stop_and_pad_ids_come_from_meta_then_tokenizer_then_model():
    tokenizer = SimpleNamespace(eos_token_id=2, pad_token_id=None)
    hf_config = SimpleNamespace(eos_token_id=[2, 7])
    config = RolloutConfig(stop_token_ids=[9])
    assert stop_token_ids(config, {}, tokenizer, hf_config) == [2, 7, 9]
    assert stop_token_ids(config, {"eos_token_id": [4, 5]}, tokenizer, hf_config) == [4, 5, 9]
    # ignore_eos drops EOS only; explicit stop tokens still end a response (as in vLLM).
    assert stop_token_ids(RolloutConfig(ignore_eos=True, stop_token_ids=[9]), {}, tokenizer, hf_config) == [9]
    assert pad_token_id({}, tokenizer) == 2  # no pad token: eos
    assert pad_token_id({"pad_token_id": 0}, tokenizer) == 0
