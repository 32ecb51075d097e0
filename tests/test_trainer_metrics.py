"""Trainer metrics (verl's names, hand-computed values) and tracking (JSONL, resume, PNG)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from verl_megatron.protocol import DataProto
from verl_megatron.trainer import metrics as M
from verl_megatron.trainer.tracking import Tracking, read_jsonl_metrics


def _batch() -> DataProto:
    """2 samples: prompt widths 3 (lengths 2 and 3), responses of width 4 (lengths 4 and 1)."""
    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    response_mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]])
    scores = torch.tensor([[0.0, 0.0, 0.0, 1.0], [0.5, 0.0, 0.0, 0.0]])
    return DataProto.from_dict(
        tensors={
            "prompts": torch.zeros(2, 3, dtype=torch.long),
            "attention_mask": torch.cat([prompt_mask, response_mask], dim=-1),
            "response_mask": response_mask,
            "token_level_scores": scores,
            "token_level_rewards": scores - 0.25 * response_mask,
            "advantages": torch.tensor([[1.0, 2.0, 3.0, 4.0], [-5.0, 9.0, 9.0, 9.0]]),
            "returns": torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.0, 7.0, 7.0, 7.0]]),
            "values": torch.tensor([[0.5, 1.0, 1.0, 1.5], [0.0, 3.0, 3.0, 3.0]]),
        }
    )


def test_data_metrics_by_hand():
    m = M.compute_data_metrics(_batch(), use_critic=True, max_response_length=4)
    assert (m["critic/score/mean"], m["critic/score/max"], m["critic/score/min"]) == (0.75, 1.0, 0.5)
    # rewards: 1 - 4*0.25 = 0 and 0.5 - 0.25 = 0.25
    assert m["critic/rewards/mean"] == pytest.approx(0.125)
    # advantages over response tokens only: 1, 2, 3, 4, -5
    assert m["critic/advantages/mean"] == pytest.approx(1.0)
    assert (m["critic/advantages/max"], m["critic/advantages/min"]) == (4.0, -5.0)
    assert m["critic/returns/mean"] == pytest.approx(0.8)
    assert m["critic/values/mean"] == pytest.approx(0.8)
    # returns [1,1,1,1,0] vs values [.5,1,1,1.5,0]: residual var 0.1, returns var 0.16
    assert m["critic/vf_explained_var"] == pytest.approx(1 - 0.1 / (0.16 + 1e-5), rel=1e-5)
    assert (m["response_length/mean"], m["response_length/max"], m["response_length/min"]) == (2.5, 4.0, 1.0)
    assert m["response_length/clip_ratio"] == 0.5
    assert (m["prompt_length/mean"], m["prompt_length/clip_ratio"]) == (2.5, 0.5)
    assert "critic/values/mean" not in M.compute_data_metrics(
        _batch(), use_critic=False, max_response_length=4
    )
    # A rollout.multi_turn batch's per-sample columns are summed into multi_turn/*_count.
    turns = {
        "turns": [3, 1],
        "env_turns": [2, 0],
        "env_seconds": [0.5, 0.25],
        "truncated": ["token_budget", ""],
    }
    batch = _batch()
    batch.non_tensor_batch.update({f"multi_turn_{k}": np.array(v, dtype=object) for k, v in turns.items()})
    m = M.compute_data_metrics(batch, use_critic=False, max_response_length=4)
    expected = {"turns": 4.0, "env_turns": 2.0, "env_seconds": 0.75, "truncated": 1.0}
    expected.update({"env_error": 0.0, "env_timeout": 0.0, "env_invalid": 0.0})  # no environment failed
    assert {k: v for k, v in m.items() if k.startswith("multi_turn/")} == {
        f"multi_turn/{k}_count": v for k, v in expected.items()
    }


def test_timing_throughput_and_probs_diff():
    batch = _batch()
    timing = {"gen": 0.5, "update_actor": 1.1, "step": 2.0}
    m = M.compute_timing_metrics(batch, timing)
    assert m["timing_s/gen"] == 0.5 and m["timing_s/step"] == 2.0
    # 5 response tokens, 10 tokens overall (prompt 5 + response 5)
    assert m["timing_per_token_ms/gen"] == pytest.approx(100.0)
    assert m["timing_per_token_ms/update_actor"] == pytest.approx(110.0)
    t = M.compute_throughput_metrics(batch, step_seconds=2.0, num_devices=2)
    assert t == {"perf/total_num_tokens": 10.0, "perf/time_per_step": 2.0, "perf/throughput": 2.5}
    rollout = torch.log(torch.tensor([[0.5, 0.5, 0.5, 0.5], [0.2, 0.9, 0.9, 0.9]]))
    old = torch.log(torch.tensor([[0.5, 0.4, 0.5, 0.5], [0.1, 0.1, 0.1, 0.1]]))
    d = M.rollout_probs_diff_metrics(rollout, old, batch.batch["response_mask"])
    # diffs over the 5 response tokens: 0, 0.1, 0, 0, 0.1
    assert d["training/rollout_probs_diff_max"] == pytest.approx(0.1)
    assert d["training/rollout_probs_diff_mean"] == pytest.approx(0.04)
    assert d["training/rollout_probs_diff_std"] == pytest.approx(math.sqrt(0.0024))


def test_flops_and_mfu():
    # h=4, 1 layer, ffn 8, 2 heads / 1 kv group (kv width 2), vocab 10; one sequence of 3 tokens.
    # weights per layer: q,o 2*16 + k,v 2*4*2 + gated MLP 3*4*8 = 144; per token 2*(144 + 40) = 368
    # attention: 4 * 3^2 * 4 = 144; total 3 * (368*3 + 144) = 3744
    flops = M.training_flops(
        [3],
        hidden_size=4,
        num_layers=1,
        ffn_hidden_size=8,
        num_attention_heads=2,
        num_query_groups=1,
        vocab_size=10,
    )
    assert flops == 3744.0
    assert M.compute_mfu(3744.0, seconds=2.0, num_devices=2, peak_flops=936.0) == 1.0
    assert M.compute_mfu(3744.0, seconds=2.0, num_devices=2, peak_flops=None) is None
    assert M.device_peak_flops(override_tflops=1.5) == 1.5e12


def test_validation_and_reduced_metrics():
    v = M.validation_metrics(["a", "b", "a"], [1.0, 0.5, 0.0])
    assert v == {"val/test_score/a": 0.5, "val/test_score/b": 0.5}
    assert M.reduce_metrics({"actor/pg_loss": [1.0, 2.0, 6.0], "actor/lr": 0.1}) == {
        "actor/pg_loss": 3.0,
        "actor/lr": 0.1,
    }
    timing: dict[str, float] = {}
    with M.timed("gen", timing):
        pass
    with M.timed("gen", timing):
        pass
    assert set(timing) == {"gen"} and timing["gen"] >= 0


def test_tracking_writes_jsonl_truncates_on_resume_and_plots(tmp_path):
    log_dir = str(tmp_path / "run")
    tracker = Tracking("p", "e", ["console", "tensorboard"], log_dir, config={"a": 1}, total_steps=3)
    for step in (1, 2, 3):
        tracker.log({"critic/score/mean": step / 10, "response_length/mean": torch.tensor(2.0)}, step)
    tracker.log({"val/test_score/x": 0.5}, step=3)
    png = tracker.finish()
    rows = read_jsonl_metrics(f"{log_dir}/metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 3]
    assert rows[1] == {"step": 2, "critic/score/mean": 0.2, "response_length/mean": 2.0}
    with open(f"{log_dir}/config.json") as f:
        assert json.load(f) == {"a": 1}
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert any((tmp_path / "run" / "tensorboard" / "p" / "e").iterdir())
    # Resuming from step 1 drops what the interrupted run logged after its checkpoint.
    resumed = Tracking("p", "e", [], log_dir, resume_step=1)
    resumed.log({"critic/score/mean": 0.9}, step=2)
    assert [(r["step"], r["critic/score/mean"]) for r in read_jsonl_metrics(resumed.jsonl_path)] == [
        (1, 0.1),
        (2, 0.9),
    ]
    silent = Tracking("p", "e", ["console"], str(tmp_path / "other"), enabled=False)
    silent.log({"x": 1.0}, step=1)
    assert not (tmp_path / "other").exists()
    with pytest.raises(ValueError, match="unknown backend"):
        Tracking("p", "e", ["mlflow"], log_dir)


def test_verl_validation_metric_names_and_values():
    """verl's val-core / val-aux names: per prompt (uid) statistics averaged over prompts."""
    import numpy as np

    collector = M.VerlValidationMetrics()
    prompts = DataProto.from_dict(
        tensors={"x": torch.zeros(2, 1)}, non_tensors={"data_source": np.array(["s", "s"])}
    )
    collector.tag_prompts(prompts, 0)
    assert list(prompts.non_tensor_batch["uid"]) == ["val-0-0", "val-0-1"]
    # prompt p0: rewards 1, 0 (acc 1, 0; pred A, B); prompt p1: rewards 1, 1 (acc 1, 1; pred A, A)
    output = DataProto.from_dict(
        tensors={"responses": torch.zeros(4, 2)},
        non_tensors={
            "data_source": np.array(["s"] * 4, dtype=object),
            "uid": np.array(["p0", "p0", "p1", "p1"]),
        },
    )
    reward = torch.tensor([[0.0, 1.0], [0.0, 0.0], [1.0, 0.0], [0.5, 0.5]])
    extra = {"acc": [1.0, 0.0, 1.0, 1.0], "pred": ["A", "B", "A", "A"], "reward/error_count": [0, 0, 0, 0]}
    collector.add(output, reward, extra, "data_source")
    got = collector.metrics()

    # bootstrap: 1000 draws of 2 out of 2 with replacement, numpy seed 42 (as verl)
    picks = np.random.RandomState(42).choice(2, size=(1000, 2), replace=True)
    best_p0 = (picks.min(axis=1) == 0).astype(float)  # a draw holding sample 0 (value 1) has max 1
    worst_p0 = (picks.max(axis=1) == 0).astype(float)  # only draws of sample 0 twice have min 1
    assert got["val-core/s/acc/mean@2"] == pytest.approx(0.75)
    assert got["val-aux/s/acc/std@2"] == pytest.approx(0.25)
    assert got["val-core/s/acc/best@2/mean"] == pytest.approx((best_p0.mean() + 1.0) / 2)
    assert got["val-core/s/acc/best@2/std"] == pytest.approx(best_p0.std() / 2)
    assert got["val-aux/s/acc/worst@2/mean"] == pytest.approx((worst_p0.mean() + 1.0) / 2)
    # majority vote of p0's draws: (0, 1) / (1, 0) tie -> the first drawn; a draw of one sample twice -> it
    maj_p0 = (picks[:, 0] == 0).astype(float)
    assert got["val-core/s/acc/maj@2/mean"] == pytest.approx((maj_p0.mean() + 1.0) / 2)
    # acc is the headline variable, so reward goes to val-aux; counters and strings are left out
    assert got["val-aux/s/reward/mean@2"] == pytest.approx(0.75)
    assert not any("/pred/" in k or "error_count" in k for k in got)
    assert {k.split("/")[0] for k in got} == {"val-core", "val-aux"}
