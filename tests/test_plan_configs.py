"""The shipped config.json files of real models (planner/configs/) build into megatron models of
their published parameter counts (model cards: 7.62B, 32.8B, ...), checked within 1%."""

from __future__ import annotations

import os

import pytest

from verl_megatron.distributed.parallel import ParallelLayout
from verl_megatron.models.config import ModelConfig, load_hf_config
from verl_megatron.planner.shards import RoleSpec, build_role_state

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "verl_megatron", "planner", "configs")
PUBLISHED_BILLIONS = {
    "Qwen2.5-7B": 7.62,
    "Qwen2.5-32B": 32.8,
    "Qwen2.5-72B": 72.7,
    "Qwen3-8B": 8.19,
    "Llama-3.1-70B": 70.6,
    "Qwen3-30B-A3B": 30.5,
    "Qwen3-235B-A22B": 235.1,
    "Mixtral-8x7B": 46.7,
}


def test_every_shipped_config_is_listed():
    assert sorted(os.listdir(CONFIGS)) == sorted(PUBLISHED_BILLIONS)


@pytest.mark.parametrize("name", list(PUBLISHED_BILLIONS))
def test_shipped_config_builds_to_the_published_size(name):
    hf = load_hf_config(os.path.join(CONFIGS, name))
    experts = getattr(hf, "num_experts", None) or getattr(hf, "num_local_experts", None)
    ep = 8 if experts else 1  # rank 0 of ep=8 holds 1/8 of the experts (a full MoE build is slow)
    spec = RoleSpec("reference", hf, ModelConfig(dtype="bfloat16", use_te=False), ParallelLayout(ep=ep))
    _, states = build_role_state(spec, ep, 0)
    params = states[None].params / 2  # bf16
    if experts:
        expert_size = getattr(hf, "moe_intermediate_size", None) or hf.intermediate_size
        per_rank = hf.num_hidden_layers * (experts // ep) * 3 * hf.hidden_size * expert_size
        params += (ep - 1) * per_rank
    assert abs(params / 1e9 / PUBLISHED_BILLIONS[name] - 1) < 0.01, f"{name}: {params / 1e9:.3f}B"


def test_sft_is_planned_as_the_actor_alone(tmp_path):
    """configs/sft_quickstart.yaml: no rollout engine, reference or critic; rows of sft.max_length
    (16) tokens, not the rollout's prompt + response (8 + 4). The actor's state and activations
    equal those of an RL job's actor with 16-token rows and the same micro-batch."""
    from verl_megatron.planner.command import _checked, plan_config
    from verl_megatron.trainer.config import load_config
    from verl_megatron.utils.local_assets import build_tiny_hf_model

    build_tiny_hf_model(
        tmp_path, "llama", vocab_size=32, hidden_size=64, num_heads=4, num_kv_heads=4, num_layers=2
    )
    sft_yaml = os.path.join(os.path.dirname(__file__), "..", "configs", "sft_quickstart.yaml")

    def actor_plan(*overrides: str):
        config = _checked(load_config(sft_yaml, [f"model.path={tmp_path}", *overrides]), 1)
        return plan_config(config, 1, 2**40, savings=False).positions[0]

    sft = actor_plan()
    rl = actor_plan(
        "trainer.mode=rl", "data.max_prompt_length=8", "data.max_response_length=8",
        "algorithm.adv_estimator=reinforce_plus_plus",
    )  # fmt: skip
    assert set(sft.roles) == {"actor"} and sft.engine == {} and rl.engine["kv_cache"] > 0
    actor = sft.roles["actor"]
    assert actor == rl.roles["actor"] and actor.train_activations > 0
    state = actor.state.params + actor.state.grads + actor.state.optimizer
    assert sft.phases == {
        "validation": state + actor.infer_activations,
        "update": state + actor.train_activations,
    }
