"""Length-grouped micro-batches (``group_by_length``): the partition by hand, its dp agreement, and
an actor whose micro-batches are grouped by length computing what the ungrouped actor computes.

The actor part runs tests/test_actor_update.py's batch (rows of 4..11 tokens) through
compute_log_prob and two PPO mini-batches with micro-batches of 2 rows in row order (the
reference), the same 2-row micro-batches cut from the rows sorted by length, and a 16-token
budget of padded positions. Log-probs are held to a float64 transformers forward: the grouped
runs' error may not exceed twice the reference's (both are float32 evaluations of the same sums
in another order, so each is within float32 rounding of the float64 value; 2x allows the two
orders' errors to differ, a wrong row or mask gives errors of order 1). Metrics and updated
weights follow the float32 noise bounds the other layout tests use (tests/closeness.py).
"""

from __future__ import annotations

import pytest
import torch

from tests.closeness import assert_adam_weights_close, assert_close_report
from tests.test_actor_update import (
    LR,
    TP_LEN,
    _hf_log_probs,
    build_actor,
    kl_actor_config,
    kl_update_record,
    make_batch,
)
from verl_megatron.workers.batching import length_grouped_partition

GROUPED = {
    "reference": {"use_remove_padding": False, "ppo_micro_batch_size_per_gpu": 2},
    "by_count": {"use_remove_padding": False, "ppo_micro_batch_size_per_gpu": 2, "group_by_length": True},
    "by_budget": {
        "use_remove_padding": False, "use_dynamic_bsz": True, "group_by_length": True,
        "ppo_max_token_len_per_gpu": 16, "ppo_infer_max_token_len_per_gpu": 16,
    },
}  # fmt: skip


def test_partition_by_hand():
    # by count: rows sorted by length (stable), cut every 2; each micro-batch in row order
    assert length_grouped_partition([5, 1, 4, 1, 3], micro_batch_size=2) == [[1, 3], [2, 4], [0]]
    # by a budget of padded positions (rows x longest): 1,2,3 -> 3 x 3 = 9; 7 alone (2 x 8 > 12)...
    lengths = [9, 1, 8, 2, 7, 3]
    groups = length_grouped_partition(lengths, max_tokens=12)
    assert groups == [[1, 3, 5], [4], [2], [0]]
    assert all(len(g) * max(lengths[i] for i in g) <= 12 for g in groups)
    with pytest.raises(ValueError, match="exceeds the micro-batch token budget 8"):
        length_grouped_partition([9, 1], max_tokens=8)
    with pytest.raises(ValueError, match="not both"):
        length_grouped_partition([1, 2], micro_batch_size=1, max_tokens=4)


def test_grouping_cuts_padded_positions_of_a_long_tail():
    # 60 rows of 10 tokens and 4 of 100, one in each run of 16 rows: every ungrouped micro-batch of
    # 16 pads to 100; grouped, the four long rows share the last one
    lengths = [100 if i % 16 == 5 else 10 for i in range(64)]

    def padded(groups):
        return sum(len(g) * max(lengths[i] for i in g) for g in groups)

    grouped = length_grouped_partition(lengths, micro_batch_size=16)
    assert sorted(i for g in grouped for i in g) == list(range(64))
    assert padded([list(range(s, s + 16)) for s in range(0, 64, 16)]) == 4 * 16 * 100
    assert padded(grouped) == 3 * 16 * 10 + 16 * 100


def partition_job(lengths_per_rank: list[list[int]], budget: int) -> list[list[int]]:
    from verl_megatron.distributed.parallel import ParallelLayout, init_runtime

    runtime = init_runtime(ParallelLayout(), seed=0)
    return length_grouped_partition(
        lengths_per_rank[runtime.rank], max_tokens=budget, dp_group=runtime.dp_group()
    )


def test_dp_ranks_agree_on_the_number_of_grouped_micro_batches(pool2):
    # Rank 0 alone needs 2 micro-batches ([1, 2, 2] and [3]), rank 1 needs 4: rank 0 halves its
    # costliest micro-batch until it has 4 too.
    groups = pool2.run(f"{__name__}:partition_job", lengths_per_rank=[[2, 3, 1, 2], [9, 9, 9, 1]], budget=10)
    assert groups == [[[2], [0], [3], [1]], [[3], [0], [1], [2]]]


def grouped_job(path: str) -> dict:
    from verl_megatron.distributed.parallel import ParallelLayout, init_runtime

    runtime = init_runtime(ParallelLayout(), seed=5)
    out = {}
    for name, settings in GROUPED.items():
        chunks, actor = build_actor(runtime, path, kl_actor_config(**settings))
        mbs = actor.runner.split(
            {k: v[:4] for k, v in make_batch().items()}, micro_batch_size=2,
            use_dynamic_bsz=settings.get("use_dynamic_bsz", False), max_token_len=16,
        )  # fmt: skip
        out[name] = {**kl_update_record(runtime, chunks, actor), "groups": [mb.rows.tolist() for mb in mbs]}
    return out


def test_grouped_micro_batches_compute_what_ungrouped_ones_do(pool1, model_path):
    runs = pool1.run(f"{__name__}:grouped_job", path=model_path)[0]
    ref = runs["reference"]
    # the first mini-batch's rows are 11, 5, 5 and 4 tokens long
    assert ref["groups"] == [[0, 1], [2, 3]]
    assert runs["by_count"]["groups"] == [[1, 3], [0, 2]]
    assert runs["by_budget"]["groups"] == [[1, 2, 3], [0]]
    valid = make_batch()["attention_mask"][:, TP_LEN:].bool()
    exact = _hf_log_probs(model_path, torch.float64)[0][valid]
    floor = float((ref["old_log_probs"][valid].double() - exact).abs().max())
    assert 0 < floor < 1e-5, f"float32 log-probs vs float64: {floor:.3g}"
    for name in ("by_count", "by_budget"):
        run = runs[name]
        err = (run["old_log_probs"][valid].double() - exact).abs()
        assert float(err.max()) <= 2 * floor, (
            f"{name}: log-probs vs float64 max diff {float(err.max()):.3g} at valid token "
            f"{int(err.argmax())}, ungrouped {floor:.3g}"
        )
        assert torch.all(run["old_log_probs"][~valid] == 0)
        assert_close_report(run["metrics"], ref["metrics"], rtol=1e-4, atol=1e-6, what=f"{name} metrics")
        steps = len(ref["metrics"]["actor/grad_norm"])
        assert_adam_weights_close(run["weights"], ref["weights"], lr=LR, steps=steps, what=f"{name} weights")
