"""The reward managers decode each response's valid ids only: the padding is never converted
to Python lists (converting the whole padded [B, Tr] cost 0.3 s of a 1024 x 8192 batch)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from verl_megatron.reward.managers import NaiveRewardManager


class _Counting(torch.Tensor):
    """Counts the elements its ``tolist`` calls turn into Python numbers."""

    converted = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.tolist:
            _Counting.converted += args[0].numel()
        return super().__torch_function__(func, types, args, kwargs or {})


class _Tok:
    def batch_decode(self, ids, skip_special_tokens=True):
        return [" ".join(map(str, row)) for row in ids]


def test_decode_converts_only_the_valid_response_ids():
    responses = torch.arange(40).view(4, 10).as_subclass(_Counting)
    mask = torch.zeros(4, 12, dtype=torch.long)
    mask[:, :2] = 1
    for row, length in enumerate([3, 0, 10, 1]):
        mask[row, 2 : 2 + length] = 1
    data = SimpleNamespace(
        batch={"prompts": torch.ones(4, 2, dtype=torch.long), "responses": responses, "attention_mask": mask},
        non_tensor_batch={
            "data_source": np.array(["s"] * 4, dtype=object),
            "reward_model": np.array([{"ground_truth": "x"}] * 4, dtype=object),
        },
    )
    _Counting.converted = 0
    samples = NaiveRewardManager(_Tok(), 0)._decode(data)
    assert [s.response_str for s in samples] == ["0 1 2", "", " ".join(map(str, range(20, 30))), "30"]
    assert [s.valid_response_length for s in samples] == [3, 0, 10, 1]
    assert _Counting.converted == 14, f"{_Counting.converted} ids converted for 14 valid ones"
