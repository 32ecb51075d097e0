"""Micro-batch partitions and token layouts (padded / packed) by hand."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_megatron.workers.batching import (
    balanced_token_partition,
    build_micro_batches,
    fixed_size_partition,
    mini_batch_rows,
)
from verl_megatron.workers.model_runner import dp_share


def test_fixed_partition_keeps_order_and_a_short_tail():
    assert fixed_size_partition(5, 2) == [[0, 1], [2, 3], [4]]
    with pytest.raises(ValueError, match="micro batch size"):
        fixed_size_partition(4, 0)


def test_balanced_partition_by_hand():
    # 30 tokens, budget 12 -> 3 micro-batches; longest-first greedy fills each to 10.
    assert balanced_token_partition([9, 1, 8, 2, 7, 3], max_tokens=12) == [[0, 1], [2, 3], [4, 5]]
    # Budget 30 fits everything into one micro-batch.
    assert balanced_token_partition([9, 1, 8, 2, 7, 3], max_tokens=30) == [[0, 1, 2, 3, 4, 5]]
    with pytest.raises(ValueError, match="exceeds the micro-batch token budget 8"):
        balanced_token_partition([9, 1], max_tokens=8)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 50), min_size=1, max_size=24), st.integers(50, 120))
def test_balanced_partition_covers_every_row_once_within_budget(lengths, budget):
    groups = balanced_token_partition(lengths, max_tokens=budget)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert all(g and g == sorted(g) for g in groups)
    assert all(sum(lengths[i] for i in g) <= budget for g in groups)
    # Never more micro-batches than one per row, never fewer than the token count needs.
    assert -(-sum(lengths) // budget) <= len(groups) <= len(lengths)


def partition_job(lengths_per_rank: list[list[int]], budget: int) -> list[list[int]]:
    from verl_megatron.distributed.parallel import ParallelLayout, init_runtime

    runtime = init_runtime(ParallelLayout(), seed=0)
    return balanced_token_partition(lengths_per_rank[runtime.rank], budget, runtime.dp_group())


def test_dp_ranks_agree_on_the_number_of_micro_batches(pool2):
    # Rank 0 alone would need 1 micro-batch, rank 1 needs 3: both run 3.
    groups = pool2.run(f"{__name__}:partition_job", lengths_per_rank=[[2, 3, 1, 2], [9, 9, 9, 1]], budget=10)
    assert [len(g) for g in groups] == [3, 3]
    assert groups[1] == [[0, 3], [1], [2]]
    assert sorted(i for g in groups[0] for i in g) == [0, 1, 2, 3]


def test_mini_batches_are_the_same_for_every_dp_size():
    one = mini_batch_rows(8, 4, dp_size=1, dp_rank=0, shuffle=True, seed=3, epoch=1)
    two = [mini_batch_rows(8, 4, dp_size=2, dp_rank=r, shuffle=True, seed=3, epoch=1) for r in range(2)]
    for j, (rows, local) in enumerate(one):
        assert torch.equal(rows, local)
        assert torch.equal(torch.cat([two[0][j][1], two[1][j][1]]), rows)
    assert sorted(torch.cat([r for r, _ in one]).tolist()) == list(range(8))
    other_epoch = mini_batch_rows(8, 4, dp_size=1, dp_rank=0, shuffle=True, seed=3, epoch=2)
    assert not torch.equal(other_epoch[0][0], one[0][0])
    plain = mini_batch_rows(8, 4, dp_size=1, dp_rank=0, shuffle=False, seed=3, epoch=0)
    assert [r.tolist() for r, _ in plain] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(ValueError, match="does not split into mini-batches of 3"):
        mini_batch_rows(8, 3, dp_size=1, dp_rank=0, shuffle=False, seed=0, epoch=0)
    with pytest.raises(ValueError, match="over dp=4"):
        mini_batch_rows(8, 2, dp_size=4, dp_rank=0, shuffle=False, seed=0, epoch=0)


def test_dp_share_wraps_around_to_equal_shares():
    assert [dp_share(5, 2, r).tolist() for r in range(2)] == [[0, 1, 2], [3, 4, 0]]


def _batch() -> dict[str, torch.Tensor]:
    # Row 0: prompt [5, 6] after one left pad, response [7, 8] + pad.
    # Row 1: prompt [9, 10, 11], response [12] + 2 pads.
    return {
        "input_ids": torch.tensor([[0, 5, 6, 7, 8, 0], [9, 10, 11, 12, 0, 0]]),
        "attention_mask": torch.tensor([[0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]]),
        "responses": torch.tensor([[7, 8, 0], [12, 0, 0]]),
        "response_mask": torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]]),
    }


def test_padded_layout_moves_valid_tokens_to_the_front():
    (mb,) = build_micro_batches(_batch(), [[0, 1]], pack=False, tensor_keys=["response_mask"])
    inputs = mb.inputs
    assert inputs.input_ids.tolist() == [[5, 6, 7, 8], [9, 10, 11, 12]]
    assert inputs.attention_mask is None and inputs.packed_seq_params is None
    # Response token 7 (row 0) is predicted at column 1 (token 6), 8 at column 2, ...
    assert inputs.gather_index.tolist() == [[1, 2, 0], [6, 0, 0]]
    assert inputs.response_valid.tolist() == [[True, True, False], [True, False, False]]
    # Gathering the inputs themselves returns the token before each response token.
    previous = inputs.gather(inputs.input_ids.unsqueeze(-1))[..., 0]
    assert previous[inputs.response_valid].tolist() == [6, 7, 11]
    assert torch.equal(mb.tensors["response_mask"], _batch()["response_mask"])


def test_packed_layout_without_thd_uses_a_block_causal_mask():
    (mb,) = build_micro_batches(_batch(), [[0, 1]], pack=True, align=3)
    inputs = mb.inputs
    # 4 + 4 valid tokens, padded to a multiple of 3 -> 9 columns.
    assert inputs.input_ids.tolist() == [[5, 6, 7, 8, 9, 10, 11, 12, 0]]
    assert inputs.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3, 0]]
    assert inputs.gather_index.tolist() == [[1, 2, 0], [6, 0, 0]]
    allowed = ~inputs.attention_mask[0, 0]
    assert allowed[3].tolist() == [True] * 4 + [False] * 5  # last token of sequence 1
    assert allowed[5].tolist() == [False] * 4 + [True, True] + [False] * 3  # 2nd token of sequence 2
    assert allowed[8].tolist() == [False] * 8 + [True]  # the padding only sees itself


def test_packed_layout_with_thd_gives_cumulative_lengths():
    (mb,) = build_micro_batches(_batch(), [[0, 1]], pack=True, thd=True, align=4)
    packed = mb.inputs.packed_seq_params
    assert mb.inputs.attention_mask is None
    assert packed.qkv_format == "thd"
    assert packed.cu_seqlens_q.tolist() == [0, 4, 8] and packed.max_seqlen_q == 4


def test_uniform_shapes_for_pipeline_parallelism():
    mbs = build_micro_batches(_batch(), [[0], [1]], pack=False, uniform=True, align=1)
    assert [tuple(m.inputs.input_ids.shape) for m in mbs] == [(1, 4), (1, 4)]
    mbs = build_micro_batches(_batch(), [[0, 1], [1]], pack=False, uniform=True)
    assert [tuple(m.inputs.input_ids.shape) for m in mbs] == [(2, 4), (2, 4)]
    assert mbs[1].inputs.gather_index.tolist() == [[2, 0, 0]]


def test_response_without_any_prompt_token_is_rejected():
    batch = _batch()
    batch["attention_mask"][0] = torch.tensor([0, 0, 0, 1, 1, 0])
    with pytest.raises(ValueError, match="row 0: a response token has no valid token before it"):
        build_micro_batches(batch, [[0, 1]], pack=False)
    del batch["responses"]
    with pytest.raises(KeyError, match="responses"):
        build_micro_batches(batch, [[0, 1]], pack=True)
