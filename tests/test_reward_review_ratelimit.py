"""RateLimitedRewardManager across calls: each ``asyncio.run`` is a new event loop (the shared
semaphore and bucket lock are made per loop), and the timeout cuts off a blocking scorer."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from verl_megatron.protocol import DataProto


class _Tok:
    def decode(self, ids, skip_special_tokens=True) -> str:
        return " ".join(str(int(i)) for i in ids)


def _batch(size: int) -> DataProto:
    data = DataProto.from_dict(
        tensors={
            "responses": torch.ones(size, 3, dtype=torch.long),
            "attention_mask": torch.ones(size, 3, dtype=torch.long),
        }
    )
    data.non_tensor_batch.update(
        data_source=np.array(["s"] * size, dtype=object),
        reward_model=np.array([{"ground_truth": "1 1 1"}] * size, dtype=object),
    )
    return data


@pytest.fixture
def manager_cls():
    from verl_megatron.reward.managers.rate_limited import RateLimitedRewardManager

    RateLimitedRewardManager._class_initialized = False
    yield RateLimitedRewardManager
    RateLimitedRewardManager._class_initialized = False


def test_two_calls_with_fewer_slots_than_samples(manager_cls):
    def scorer(data_source, solution_str, ground_truth, extra_info=None):
        time.sleep(0.01)  # the samples queue on the semaphore (1 slot) and on the rpm bucket's lock
        return float(solution_str == ground_truth)

    manager = manager_cls({"reward": {"max_concurrent": 1, "max_rpm": 60000}}, _Tok(), scorer)
    for call in range(2):
        out = manager(_batch(3), return_dict=True)
        assert out["reward_tensor"][:, -1].tolist() == [1.0, 1.0, 1.0], f"call {call}: {out}"
        assert "error" not in out["reward_extra_info"], f"call {call}: {out['reward_extra_info']}"


def test_timeout_returns_while_a_blocking_scorer_still_runs(manager_cls):
    release, finished = threading.Event(), threading.Event()

    def scorer(data_source, solution_str, ground_truth, extra_info=None):
        release.wait(timeout=1.5)  # held until the test releases it (at most 1.5 s)
        finished.set()
        return 1.0

    manager = manager_cls({"reward": {"timeout": 0.1}}, _Tok(), scorer)
    out = manager(_batch(1), return_dict=True)
    still_running = not finished.is_set()
    release.set()
    finished.wait(timeout=5)
    assert still_running, "the step waited for the blocking scorer past its 0.1 s timeout"
    assert out["reward_extra_info"] == {"acc": [0.0], "timeout": [True]}
    assert out["reward_tensor"].abs().sum().item() == 0.0
