"""DAPO's dynamic sampling (``algorithm.filter_groups``): which prompt groups a step keeps."""

from __future__ import annotations

import numpy as np

from verl_megatron.protocol import DataProto

__all__ = ["keep_varied_groups"]

# Values of algorithm.filter_groups.metric computed from the reward tensor rather than read
# from the reward manager's extra info.
_SEQUENCE_SCORE_METRICS = ("score", "seq_reward", "seq_final_reward")


def keep_varied_groups(batch: DataProto, metric: str) -> tuple[DataProto, int]:
    """Rows of the groups (same ``uid``) whose ``metric`` differs between samples; and their count."""
    # A float scorer's score is its accuracy ('acc' in verl's DAPO manager): a reward that
    # reports no 'acc' of its own is filtered on its sequence score.
    if metric in _SEQUENCE_SCORE_METRICS or (metric == "acc" and "acc" not in batch.non_tensor_batch):
        values = batch.batch["token_level_scores"].sum(-1).numpy()
    elif metric in batch.non_tensor_batch:
        values = np.asarray(batch.non_tensor_batch[metric], dtype=np.float64)
    else:
        known = [*_SEQUENCE_SCORE_METRICS, *sorted(k for k in batch.non_tensor_batch if k != "uid")]
        raise KeyError(
            f"algorithm.filter_groups.metric={metric!r} is not produced by the reward; known: {known}"
        )
    by_group: dict[str, list[float]] = {}
    for uid, value in zip(batch.non_tensor_batch["uid"], values):
        by_group.setdefault(uid, []).append(float(value))
    keep = {uid for uid, vals in by_group.items() if len(vals) == 1 or np.std(vals) > 0}
    rows = [i for i, uid in enumerate(batch.non_tensor_batch["uid"]) if uid in keep]
    return batch.select_idxs(rows), len(keep)
