"""utils.torch_functional: verl's helpers with hand-computed numbers, on one and two processes."""

import math

import pytest
import torch

from verl_megatron.utils.torch_functional import (
    calculate_sum_pi_squared_from_logits,
    clip_by_value,
    distributed_masked_mean,
    distributed_mean_max_min_std,
    entropy_from_logits,
    entropy_from_logits_with_chunking,
    expand_as_nested,
    gather_from_labels,
    get_response_mask,
    logprobs_from_logits,
    masked_mean,
    pad_2d_list_to_length,
    pad_sequence_to_length,
)


def test_sum_pi_squared_matches_hand_values_and_survives_huge_logits():
    # softmax([0, ln 2]) = [1/3, 2/3] -> 1/9 + 4/9; two equal logits of 1000 -> 1/4 + 1/4.
    logits = torch.tensor([[0.0, math.log(2.0)], [1000.0, 1000.0]], dtype=torch.float64)
    torch.testing.assert_close(
        calculate_sum_pi_squared_from_logits(logits), torch.tensor([5 / 9, 0.5], dtype=torch.float64)
    )


def test_logprobs_from_logits_fp32_and_bf16():
    # softmax([0, ln 3]) = [1/4, 3/4].
    logits = torch.tensor([[[0.0, math.log(3.0)], [math.log(3.0), 0.0]]])  # [1, 2, 2]
    labels = torch.tensor([[1, 1]])
    expected = torch.tensor([[math.log(0.75), math.log(0.25)]])
    torch.testing.assert_close(logprobs_from_logits(logits, labels), expected)
    bf16 = logprobs_from_logits(logits.bfloat16(), labels)
    assert bf16.dtype == torch.bfloat16
    torch.testing.assert_close(bf16.float(), expected, atol=1e-2, rtol=0)
    torch.testing.assert_close(gather_from_labels(logits, labels), torch.tensor([[math.log(3.0), 0.0]]))


def test_chunked_entropy_equals_plain_entropy():
    # Uniform over 4 -> ln 4; a certain distribution -> ~0.
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [50.0, 0.0, 0.0, 0.0], [1.0, 2.0, 3.0, 4.0]])
    chunked = entropy_from_logits_with_chunking(logits, chunk_size=2)
    torch.testing.assert_close(chunked, entropy_from_logits(logits))
    assert chunked[0].item() == pytest.approx(math.log(4.0), abs=1e-6)
    assert chunked[1].item() == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize(
    ("values", "mask", "expected"),
    [
        ([1.0, 2.0, 3.0, 4.0], [1, 0, 0, 1], 2.5),
        ([1.0, 2.0, float("nan"), 4.0], [1, 0, 0, 1], 2.5),  # NaN under a 0 stays out
        ([1.0, 2.0, float("nan"), 4.0], [1, 0, 1, 0], float("nan")),  # NaN under a 1 propagates
    ],
)
def test_masked_mean_nan_handling_as_verl(values, mask, expected):
    result = masked_mean(torch.tensor(values), torch.tensor(mask)).item()
    assert (math.isnan(result) and math.isnan(expected)) or result == pytest.approx(expected)


def test_response_mask_clip_and_padding():
    responses = torch.tensor([[5, 2, 7, 0], [5, 6, 7, 9], [1, 9, 9, 9]])
    assert get_response_mask(responses, eos_token=2).tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1]]
    assert get_response_mask(responses, eos_token=[1, 2]).tolist() == [
        [1, 1, 0, 0],
        [1, 1, 1, 1],
        [1, 0, 0, 0],
    ]
    x = torch.tensor([-3.0, 0.5, 3.0])
    assert clip_by_value(x, torch.tensor(-1.0), torch.tensor([1.0, 0.0, 2.0])).tolist() == [-1.0, 0.0, 2.0]
    assert pad_sequence_to_length(torch.tensor([[1, 2]]), 4, 0).tolist() == [[1, 2, 0, 0]]
    assert pad_sequence_to_length(torch.tensor([[1, 2]]), 4, 0, left_pad=True).tolist() == [[0, 0, 1, 2]]
    assert pad_sequence_to_length(torch.tensor([[1, 2, 3]]), 2, 0).tolist() == [[1, 2, 3]]
    assert pad_2d_list_to_length([[1], [2, 3]], 0, max_length=3).tolist() == [[1, 0, 0], [2, 3, 0]]


def test_expand_as_nested_repeats_each_row_over_its_length():
    nested = torch.nested.as_nested_tensor(
        [torch.zeros(1), torch.zeros(3), torch.zeros(2)], layout=torch.jagged
    )
    out = expand_as_nested(torch.tensor([10, 20, 30]), nested)
    assert out.values().tolist() == [10, 20, 20, 20, 30, 30]
    assert out.offsets().tolist() == [0, 1, 4, 6]


@pytest.mark.parametrize(
    ("tensor", "nested_ok", "match"),
    [
        (torch.tensor([1, 2, 3]), False, "must be a nested"),
        (torch.tensor([1, 2]), True, "2 rows but nested_tensor has 3"),
        (torch.tensor([[1, 2, 3]]), True, "must be 1-D"),
    ],
)
def test_expand_as_nested_errors_are_assertion_and_value_errors(tensor, nested_ok, match):
    nested = torch.nested.as_nested_tensor(
        [torch.zeros(1), torch.zeros(2), torch.zeros(3)], layout=torch.jagged
    )
    with pytest.raises(AssertionError, match=match):
        expand_as_nested(tensor, nested if nested_ok else tensor)
    with pytest.raises(ValueError, match=match):
        expand_as_nested(tensor, nested if nested_ok else tensor)


def dist_stats_job() -> dict:
    """Rank r holds [2r + 1, 2r + 2] with mask [1, 0] on rank 0 and [0, 1] on rank 1."""
    import torch.distributed as dist

    rank = dist.get_rank()
    local = torch.tensor([2.0 * rank + 1, 2.0 * rank + 2])
    mean, gmax, gmin, std = distributed_mean_max_min_std(local)
    mask = torch.tensor([1.0, 0.0]) if rank == 0 else torch.tensor([0.0, 1.0])
    only_mean = distributed_mean_max_min_std(local, compute_max=False, compute_min=False, compute_std=False)
    return {
        "stats": [mean.item(), gmax.item(), gmin.item(), std.item()],
        "masked_mean": distributed_masked_mean(local, mask).item(),
        "disabled": [x is None for x in only_mean[1:]],
    }


def test_distributed_stats_on_two_ranks(pool2):
    # All values {1, 2, 3, 4}: mean 2.5, max 4, min 1, sample std sqrt(5/3); masked {1, 4} -> 2.5.
    for rank, result in enumerate(pool2.run(f"{__name__}:dist_stats_job")):
        assert result["stats"] == pytest.approx([2.5, 4.0, 1.0, math.sqrt(5 / 3)]), f"rank {rank}"
        assert result["masked_mean"] == pytest.approx(2.5), f"rank {rank}"
        assert result["disabled"] == [True, True, True], f"rank {rank}"
