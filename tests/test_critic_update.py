"""MegatronCritic: values and one clipped value-loss update agree across layouts.

Same tiny Llama and batch as tests/test_actor_update.py, built with a value head. The
single-process padded run is the reference; its values are checked against
transformers' final hidden states times the value head, and its first-step loss by
hand (returns = values + 0.5 on every trained token gives vf_loss = 0.5 * 0.5^2).
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.closeness import assert_adam_weights_close, assert_close_report
from tests.test_actor_update import TP_LEN, build_model, full_weights, make_batch, merge

RETURN_SHIFT, LR = 0.5, 1e-2

VARIANTS = {
    "padded": {"use_remove_padding": False, "shuffle": False},
    "packed": {"use_remove_padding": True, "shuffle": False},
    "dynamic": {
        "use_remove_padding": True,
        "shuffle": False,
        "use_dynamic_bsz": True,
        "ppo_max_token_len_per_gpu": 16,
    },
    "shuffled": {"shuffle": True, "ppo_epochs": 2, "cliprange_value": 0.05},
}


def critic_job(path: str, tp: int, pp: int, variants: list[str]) -> dict:
    from verl_megatron.distributed.parallel import ParallelLayout, init_runtime
    from verl_megatron.models.megatron_model import build_optimizer
    from verl_megatron.protocol import DataProto
    from verl_megatron.workers.config import CriticConfig, OptimConfig
    from verl_megatron.workers.critic import MegatronCritic
    from verl_megatron.workers.lr_schedule import build_lr_scheduler, optim_settings

    runtime = init_runtime(ParallelLayout(tp=tp, pp=pp), seed=5)
    out = {}
    for variant in variants:
        cfg = CriticConfig(
            ppo_mini_batch_size=4,
            ppo_micro_batch_size_per_gpu=2,
            optim=OptimConfig(lr=LR, weight_decay=0.0, clip_grad=1.0),
            **VARIANTS[variant],
        )
        chunks = build_model(runtime, path, value_head=True)
        optimizer = build_optimizer(chunks, optim_settings(cfg.optim))
        critic = MegatronCritic(runtime, cfg, chunks, optimizer, build_lr_scheduler(optimizer, cfg.optim))
        start = full_weights(chunks, runtime)
        data = DataProto.from_dict(make_batch())
        values = critic.compute_values(data)
        data.batch["values"] = values
        data.batch["returns"] = values + RETURN_SHIFT * data.batch["response_mask"]
        metrics = critic.update_critic(data)
        out[variant] = {
            "values": values,
            "metrics": metrics,
            "weights": full_weights(chunks, runtime),
            "start": start,
        }
    return out


@pytest.fixture(scope="module")
def reference(pool1, model_path) -> dict:
    return merge(pool1.run(f"{__name__}:critic_job", path=model_path, tp=1, pp=1, variants=list(VARIANTS)))


def test_values_match_transformers_hidden_states_times_value_head(reference, model_path):
    from transformers import AutoModelForCausalLM

    batch = make_batch()
    model = AutoModelForCausalLM.from_pretrained(
        model_path, dtype=torch.float32, local_files_only=True
    ).eval()
    with torch.no_grad():
        hidden = model.model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
        ).last_hidden_state
    head = reference["padded"]["start"]
    expected = (hidden[:, TP_LEN - 1 : -1] @ head["score.weight"].T + head["score.bias"])[..., 0]
    expected = expected * batch["response_mask"]
    for variant in ("padded", "packed"):
        torch.testing.assert_close(reference[variant]["values"], expected, rtol=1e-5, atol=2e-5)


def test_first_step_value_loss_by_hand(reference):
    metrics = reference["padded"]["metrics"]
    # vpreds == old values on the first step: nothing is clipped and every trained token
    # misses its return by exactly 0.5.
    assert math.isclose(metrics["critic/vf_loss"][0], 0.5 * RETURN_SHIFT**2, rel_tol=1e-5)
    assert metrics["critic/vf_clipfrac"][0] == 0.0
    mask = make_batch()["response_mask"][:4]
    expected_mean = float((reference["padded"]["values"][:4] * mask).sum() / mask.sum())
    assert math.isclose(metrics["critic/vpred_mean"][0], expected_mean, rel_tol=1e-5, abs_tol=1e-7)
    assert metrics["critic/vf_loss"][1] != 0.5 * RETURN_SHIFT**2
    assert metrics["critic/lr"] == LR and metrics["critic/skipped_steps"] == 0.0
    # The small clip range of the shuffled variant makes later steps clip.
    assert max(reference["shuffled"]["metrics"]["critic/vf_clipfrac"]) > 0.0
    moved = reference["padded"]["weights"]["score.weight"] - reference["padded"]["start"]["score.weight"]
    assert moved.abs().max() > 1e-3


def _assert_same_update(run: dict, ref: dict) -> None:
    assert_close_report(run["values"], ref["values"], rtol=1e-5, atol=1e-5, what="values")
    assert_close_report(run["metrics"], ref["metrics"], rtol=1e-4, atol=1e-6, what="metrics")
    steps = len(ref["metrics"]["critic/grad_norm"])
    assert_adam_weights_close(run["weights"], ref["weights"], lr=LR, steps=steps, what="weights")


def test_packed_and_dynamic_match_padded(reference):
    _assert_same_update(reference["packed"], reference["padded"])
    _assert_same_update(reference["dynamic"], reference["padded"])


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1), (1, 2)], ids=["dp2", "tp2", "pp2"])
def test_layouts_match_single_process(pool2, reference, model_path, tp, pp):
    variants = ["packed", "dynamic", "shuffled"]
    run = merge(pool2.run(f"{__name__}:critic_job", path=model_path, tp=tp, pp=pp, variants=variants))
    for variant in variants:
        _assert_same_update(run[variant], reference[variant])
