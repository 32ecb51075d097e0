"""``rollout.lora_sync=adapter``: vLLM's ``max_lora_rank`` is one of the sizes vLLM accepts.

vLLM's ``LoRAConfig`` takes only 8, 16, 32, 64, 128, 256, 320 or 512 as ``max_lora_rank``
(``vllm/config/lora.py``; later versions add 1) and refuses any other value when the engine is
built; an adapter of rank r runs in any ``max_lora_rank >= r``. So the rank is rounded up, and a
rank above 512 is a named error at start-up.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from verl_megatron.rollout import RolloutConfig, RolloutConfigError
from verl_megatron.rollout.lora_sync import check_rollout_lora, lora_rollout_config, vllm_max_lora_rank

# The list read from vLLM's LoRAConfig; it is restated here so that a change to the module's
# copy is a test failure, not a silent new value.
VLLM_ACCEPTS = (8, 16, 32, 64, 128, 256, 320, 512)


@pytest.mark.parametrize(
    ("rank", "expected"),
    [
        (1, 8),
        (4, 8),
        (8, 8),
        (9, 16),
        (16, 16),
        (24, 32),
        (100, 128),
        (257, 320),
        (320, 320),
        (321, 512),
        (512, 512),
    ],
)
def test_rank_rounds_up_to_the_next_size_vllm_accepts(rank, expected):
    assert vllm_max_lora_rank(rank) == expected
    assert expected in VLLM_ACCEPTS and expected >= rank
    assert all(size < rank for size in VLLM_ACCEPTS if size < expected)  # the smallest that holds it


def _configs(rank: int, **engine_kwargs):
    rollout = RolloutConfig(name="vllm", lora_sync="adapter", engine_kwargs=engine_kwargs)
    return rollout, SimpleNamespace(lora_rank=rank)


def test_engine_kwargs_get_the_rounded_rank():
    built = lora_rollout_config(*_configs(4))
    assert built.engine_kwargs == {"enable_lora": True, "max_lora_rank": 8, "max_loras": 1}
    assert lora_rollout_config(*_configs(16)).engine_kwargs["max_lora_rank"] == 16
    assert lora_rollout_config(*_configs(48)).engine_kwargs["max_lora_rank"] == 64
    # A user's own max_lora_rank is passed as written (vLLM judges it).
    assert lora_rollout_config(*_configs(48, max_lora_rank=256)).engine_kwargs["max_lora_rank"] == 256


def test_a_rank_vllm_cannot_hold_is_a_named_error_at_start_up():
    with pytest.raises(
        RolloutConfigError, match=r"model.lora_rank=600 is above vLLM's largest max_lora_rank \(512\)"
    ):
        check_rollout_lora(*_configs(600))
    check_rollout_lora(*_configs(512))
    check_rollout_lora(*_configs(600, max_lora_rank=512))  # the user's choice: vLLM decides
    # Merged sync passes full weights: the rank does not reach vLLM.
    check_rollout_lora(RolloutConfig(name="vllm", lora_sync="merged"), SimpleNamespace(lora_rank=600))
