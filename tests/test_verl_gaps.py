"""verl 0.9 paths this project fills in (trainer.ppo.metric_utils batch/MoE metrics,
trainer.ppo.v1.utils, the rollout-correction presets, the rate-limited reward manager,
utils.tokenizer.chat_template, utils.reward_score.sandbox_fusion): hand-computed values."""

from __future__ import annotations

import asyncio
import math
import re
import time
from unittest.mock import patch

import numpy as np
import pytest
import torch

from verl_megatron.protocol import DataProto
from verl_megatron.trainer.ppo import metric_utils as mu
from verl_megatron.trainer.ppo.rollout_correction_config import (
    RolloutCorrectionConfig,
    RolloutCorrectionConfigError,
    VerlRolloutCorrectionConfig,
)

# ---------------------------------------------------------------- metric_utils


def _step_batch() -> DataProto:
    """Row 0: prompt 2 of 2, response 2 of 3; row 1: prompt 1, no response (aborted)."""
    return DataProto.from_dict(
        {
            "prompts": torch.zeros(2, 2, dtype=torch.long),
            "responses": torch.zeros(2, 3, dtype=torch.long),
            "attention_mask": torch.tensor([[1, 1, 1, 1, 0], [0, 1, 0, 0, 0]]),
            "response_mask": torch.tensor([[1, 1, 0], [0, 0, 0]]),
            "token_level_scores": torch.tensor([[0.0, 3.0, 0.0], [5.0, 0.0, 0.0]]),
            "token_level_rewards": torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]),
            "advantages": torch.tensor([[1.0, 3.0, 9.0], [9.0, 9.0, 9.0]]),
            "returns": torch.tensor([[2.0, 4.0, 9.0], [9.0, 9.0, 9.0]]),
            "values": torch.tensor([[1.0, 3.0, 9.0], [9.0, 9.0, 9.0]]),
        }
    )


def test_compute_data_metrics_hand_computed() -> None:
    m = mu.compute_data_metrics(_step_batch(), use_critic=True)
    assert m["critic/score/mean"] == 3.0  # the aborted row's 5.0 is left out
    assert m["critic/rewards/mean"] == 2.0
    assert (m["critic/advantages/mean"], m["critic/advantages/max"], m["critic/advantages/min"]) == (
        2.0,
        3.0,
        1.0,
    )
    assert m["critic/returns/mean"] == 3.0
    # returns - values = [1, 1]: no residual variance -> 1 - 0 / (Var[2, 4] + 1e-5)
    assert m["critic/vf_explained_var"] == pytest.approx(1.0)
    assert m["response_length/mean"] == 1.0 and m["response_length_non_aborted/mean"] == 2.0
    assert m["response/aborted_ratio"] == 0.5 and m["response_length/clip_ratio"] == 0.0
    assert m["prompt_length/mean"] == 1.5 and m["prompt_length/clip_ratio"] == 0.5
    assert "critic/values/mean" not in mu.compute_data_metrics(_step_batch(), use_critic=False)


def test_timing_and_throughput_metrics() -> None:
    batch = _step_batch()  # 3 prompt tokens, 2 response tokens
    m = mu.compute_timing_metrics(batch, {"gen": 0.2, "ref": 0.5, "other": 1.0})
    assert m["timing_s/other"] == 1.0 and "timing_per_token_ms/other" not in m
    assert m["timing_per_token_ms/gen"] == pytest.approx(100.0)  # 200 ms / 2 response tokens
    assert m["timing_per_token_ms/ref"] == pytest.approx(100.0)  # 500 ms / 5 tokens
    batch.meta_info["global_token_num"] = [10, 30]
    m = mu.compute_throughout_metrics(batch, {"step": 2.0}, n_gpus=4)
    assert m == {"perf/total_num_tokens": 40, "perf/time_per_step": 2.0, "perf/throughput": 5.0}


def test_moe_load_balance_violation_and_filler() -> None:
    # [B=1, T=4, layers=2, top_k=1]; the response is the last 3 positions, its last token filler.
    routed = torch.tensor([[[[1], [1]], [[0], [0]], [[1], [0]], [[0], [1]]]])
    counts = mu._compute_rollout_moe_load_counts(routed, torch.ones(1, 3, dtype=torch.bool), num_experts=2)
    assert counts.tolist() == [[1, 1], [2, 0]]
    m = mu.compute_rollout_moe_load_balance_metrics(routed, torch.ones(1, 3, dtype=torch.bool), num_experts=2)
    # layer 1: shares [1, 0] -> violations [1, -1]
    assert (m["rollout/moe/max_vio/layer_1"], m["rollout/moe/min_vio/layer_1"]) == (1.0, -1.0)
    assert m["rollout/moe/avg_vio/layer_0"] == 0.0 and m["rollout/moe/avg_vio/avg"] == 0.5


def test_moe_accumulator_interval() -> None:
    acc = mu.RolloutMoELoadBalanceMetricsAccumulator(model_config={"num_experts": 2})
    mask = torch.ones(1, 2, dtype=torch.bool)
    step = [torch.tensor([[[[0]], [[0]]]]), torch.tensor([[[[1]], [[0]]]])]
    assert mu.compute_moe_lb_metrics(_Batch(step[0], mask), 2, 1, acc) == {}
    m = mu.compute_moe_lb_metrics(_Batch(step[1], mask), 2, 2, acc)
    assert m["rollout/moe/routed_expert_assignments"] == 2 and m["rollout/moe/max_vio/layer_0"] == 0.0
    assert acc.total_assignments() == 0


class _Batch:
    def __init__(self, routed: torch.Tensor, mask: torch.Tensor) -> None:
        self.batch = {"routed_experts": routed, "response_mask": mask}


def test_infer_moe_num_experts() -> None:
    assert mu.infer_moe_num_experts({"model_type": "mixtral", "num_local_experts": 8}) == 8
    assert mu.infer_moe_num_experts({"model_type": "qwen3_moe", "num_local_experts": 8}) is None
    assert mu.infer_moe_num_experts({"override_config": {"model_config": {"n_routed_experts": 64}}}) == 64


# ---------------------------------------------------------------- trainer.ppo.v1.utils


def test_multi_trajectory_grpo_uses_each_sessions_final_output() -> None:
    from verl_megatron.trainer.ppo.v1.utils import compute_advantage_for_multi_trajectories

    # Session p_a_0 has outputs 9 and 10 (10 is final: compared as numbers, not text).
    keys = ["p_a_0_9", "p_a_0_10", "p_a_1_0", "p_a_2_0"]
    rewards = torch.tensor([[0.0, 7.0], [0.0, 1.0], [0.0, 0.0], [2.0, 0.0]])
    mask = torch.tensor([[1, 1], [1, 1], [1, 0], [1, 1]])
    data = DataProto.from_dict(
        {"token_level_rewards": rewards, "response_mask": mask},
        non_tensors={"uid": np.array(["p_a"] * 4, dtype=object)},
    )
    out = compute_advantage_for_multi_trajectories(data, keys, "grpo")
    # final scores [1, 0, 2]: mean 1, unbiased std 1 -> per session [0, -1, 1] (std + 1e-6)
    per_session = torch.tensor([0.0, 0.0, -1.0, 1.0]) / (1 + 1e-6)
    expected = per_session.unsqueeze(-1) * mask
    torch.testing.assert_close(out.batch["advantages"], expected)
    torch.testing.assert_close(out.batch["returns"], expected)


# ---------------------------------------------------------------- rollout correction presets


def test_rollout_correction_presets_and_verl_face() -> None:
    from verl_megatron.trainer.config.algorithm import RolloutCorrectionConfig as Face

    assert Face is VerlRolloutCorrectionConfig and Face().rollout_is == "sequence"
    assert RolloutCorrectionConfig().rollout_is is None  # the trainer's YAML default: off
    ice = RolloutCorrectionConfig.decoupled_token_icepop()
    assert (ice.rollout_is, ice.rollout_is_threshold, ice.rollout_rs) == ("token", "0.5_5.0", None)
    geo = RolloutCorrectionConfig.decoupled_geo_rs_seq_tis(rs_threshold=1.001)
    assert (geo.rollout_is, geo.rollout_rs, geo.rollout_rs_threshold) == ("sequence", "seq_mean_k1", 1.001)
    pg = RolloutCorrectionConfig.bypass_pg_is(threshold=3.0)
    assert (pg.bypass_mode, pg.loss_type, pg.rollout_is_threshold) == (True, "reinforce", 3.0)
    assert Face(rollout_rs="token_k1").rollout_rs_threshold is None  # verl checks it where used
    with pytest.raises(
        RolloutCorrectionConfigError, match=r"needs algorithm\.rollout_correction\.rollout_rs_threshold"
    ):
        RolloutCorrectionConfig(rollout_rs="token_k1")


# ---------------------------------------------------------------- rate-limited reward loop


def test_token_bucket_waits_for_the_refill_and_borrows_beyond_capacity() -> None:
    from verl_megatron.experimental.reward_loop.reward_manager.limited import AsyncTokenBucket

    async def run() -> tuple[float, float, float]:
        bucket = AsyncTokenBucket(rate_limit=100.0, max_tokens=10.0)
        await bucket.acquire(10.0)
        start = time.monotonic()
        await bucket.acquire(5.0)  # 5 tokens at 100/s
        refill = time.monotonic() - start
        start = time.monotonic()
        await bucket.acquire(30.0)  # more than the bucket holds: 30 - ~0 at 100/s, then in debt
        borrow = time.monotonic() - start
        return refill, borrow, bucket.tokens

    refill, borrow, tokens = asyncio.run(run())
    assert 0.04 <= refill < 1.0 and 0.25 <= borrow < 2.0
    assert tokens == pytest.approx(-30.0, abs=1.0)


class _IdTokenizer:
    def decode(self, ids: torch.Tensor, skip_special_tokens: bool = True) -> str:
        return " ".join(str(int(i)) for i in ids)


@pytest.fixture
def rate_limited():
    from verl_megatron.reward.managers.rate_limited import RateLimitedRewardManager

    RateLimitedRewardManager._class_initialized = False
    yield RateLimitedRewardManager
    RateLimitedRewardManager._class_initialized = False


def _samples() -> DataProto:
    data = DataProto.from_dict(
        {
            "responses": torch.tensor([[5, 6, 0], [7, 0, 0]]),
            "attention_mask": torch.tensor([[1, 1, 0], [1, 0, 0]]),
        }
    )
    data.non_tensor_batch.update(
        data_source=np.array(["s", "s"], dtype=object),
        reward_model=np.array([{"ground_truth": "5 6"}, {"ground_truth": "5 6"}], dtype=object),
    )
    return data


def test_rate_limited_manager_scores_errors_and_timeouts(rate_limited) -> None:
    async def judge(data_source, solution_str, ground_truth, extra_info, **kwargs):
        return {"score": float(solution_str == ground_truth), "seen": solution_str}

    config = {"reward": {"max_concurrent": 2, "timeout": 0.05}}
    manager = rate_limited(config, _IdTokenizer(), judge)
    reward = manager(_samples(), return_dict=True)
    torch.testing.assert_close(reward["reward_tensor"], torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]]))
    assert reward["reward_extra_info"]["seen"] == ["5 6", "7"]

    def broken(**kwargs):
        raise RuntimeError("judge down")

    out = asyncio.run(rate_limited(config, _IdTokenizer(), broken).run_single(_samples()))
    assert out == {"reward_score": 0.0, "reward_extra_info": {"error": "judge down", "acc": 0.0}}

    async def slow(**kwargs):
        await asyncio.sleep(1.0)

    out = asyncio.run(rate_limited(config, _IdTokenizer(), slow).run_single(_samples()))
    assert out["reward_extra_info"] == {"timeout": True, "acc": 0.0}


# ---------------------------------------------------------------- chat template probes

_SPECIAL = {"<s>": 1, "<e>": 2, "\n": 3}


class _ChatMLTokenizer:
    """ChatML-like: ``<s>{role}\\n{text}<e>\\n`` per turn; optional default system turn."""

    eos_token_id = 2

    def __init__(self, system: bool = False) -> None:
        self.system = system
        self.vocab: dict[str, int] = {}

    def encode(self, text: str) -> list[int]:
        ids = []
        for piece in re.split(r"(<s>|<e>|\n)", text):
            if piece in _SPECIAL:
                ids.append(_SPECIAL[piece])
            elif piece:
                ids.extend(self.vocab.setdefault(w, 10 + len(self.vocab)) for w in piece.split())
        return ids

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=True, **kwargs):
        text = "<s>system\nhelp<e>\n" if self.system else ""
        text += "".join(f"<s>{m['role']}\n{m['content']}<e>\n" for m in messages)
        text += "<s>assistant\n" if add_generation_prompt else ""
        return self.encode(text) if tokenize else text


def test_chat_template_probes() -> None:
    from verl_megatron.utils.tokenizer.chat_template import (
        extract_system_prompt_and_generation,
        initialize_system_prompt,
        initialize_turn_separator,
    )

    tok = _ChatMLTokenizer(system=True)
    assert initialize_turn_separator(tok) == [3]
    system, generation = extract_system_prompt_and_generation(tok)
    assert tok.vocab["system"] in system and system[-2:] == [2, 3] and len(system) == 6
    assert generation == [1, tok.vocab["assistant"], 3]
    assert initialize_system_prompt(_ChatMLTokenizer()) == []


# ---------------------------------------------------------------- sandbox_fusion


def _answer(api: str, run_status: str = "Finished", code: int = 0, stdout: str = "", compile_status=None):
    compile_result = None if compile_status is None else {"status": compile_status, "return_code": 1}
    run = {"status": run_status, "return_code": code, "stdout": stdout}
    return {"status": api, "compile_result": compile_result, "run_result": run}, None


def test_sandbox_fusion_grades() -> None:
    from verl_megatron.utils.reward_score.sandbox_fusion.utils import check_correctness

    answers = {
        "ok": _answer("Success", stdout="1\n"),
        "wrong": _answer("Success", stdout="2\n"),
        "crash": _answer("Failed", code=1),
        "slow": _answer("Failed", run_status="TimeLimitExceeded"),
        "down": (None, "API Call Failed: 503"),
    }
    cases = {"inputs": list(answers), "outputs": ["1"] * 5}
    target = "verl_megatron.utils.reward_score.sandbox_fusion.utils.call_sandbox_api"
    with patch(target, side_effect=lambda **kw: answers[kw["stdin"]]):
        results, meta = check_correctness("mock", cases, "print(1)")
    assert results == [True, False, -2, -3, -1]
    assert [m["status"] for m in meta] == ["success", "wrong_answer", "runtime_error", "timeout", "api_error"]
    with patch(target, return_value=_answer("Failed", compile_status="Error")):
        assert check_correctness("mock", {"inputs": ["a", "b"], "outputs": ["", ""]}, "x", language="cpp")[
            0
        ] == [-4, -4]
    assert check_correctness("mock", {"inputs": ["a"]}, "x") == (
        [-1],
        [{"error": "Invalid input/output data"}],
    )


def test_sandbox_fusion_on_the_local_sandbox() -> None:
    from verl_megatron.utils.reward_score import sandbox_fusion

    completion = "```python\nclass Solution:\n    def add(self, a, b):\n        return a + b\n```"
    cases = {"fn_name": "add", "inputs": ["1\n2", "[1]\n[2]", "1\n1"], "outputs": ["3", "[1, 2]", "3"]}
    score, meta = sandbox_fusion.compute_score("local", None, 1024, completion, cases, timeout=10)
    assert math.isclose(score, 2 / 3) and [m["status"] for m in meta] == [
        "success",
        "success",
        "wrong_answer",
    ]
    assert sandbox_fusion.compute_score("local", None, 1024, "no code", cases) == (
        0.0,
        [{"error": "Invalid completion (missing code block)"}],
    )
