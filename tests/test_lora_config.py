"""LoRA settings a user can get wrong: one named ``error:`` line before anything is built."""

from __future__ import annotations

import pytest

from verl_megatron import cli

CASES = [
    ("negative rank", ["model.lora_rank=-2"], "model.lora_rank must be > 0 to train LoRA adapters (0: off), got -2"),
    ("targets without a rank", ["model.target_modules=[q_proj]"],
     "model.target_modules / exclude_modules / lora_dropout are set but model.lora_rank=0"),
    ("misspelt target", ["model.lora_rank=8", "model.target_modules=[q_porj,v_proj]"],
     "model.target_modules entry 'q_porj' matches no linear layer of this model (its layers have q_proj, k_proj, "
     "v_proj, o_proj, gate_proj, up_proj, down_proj; megatron names linear_qkv, linear_proj, linear_fc1, "
     "linear_fc2; or 'all-linear'); did you mean 'q_proj'?"),
    ("target that is no projection", ["model.lora_rank=8", "model.target_modules=lm_head"],
     "model.target_modules entry 'lm_head' matches no linear layer"),
    ("excluding everything", ["model.lora_rank=8", "model.target_modules=[linear_qkv]",
                              "model.exclude_modules=[q_proj,k_proj,v_proj]"], "removes every target"),
    ("alpha", ["model.lora_rank=8", "model.lora_alpha=0"], "model.lora_alpha must be > 0, got 0"),
    ("dropout", ["model.lora_rank=8", "model.lora_dropout=1.0"], "model.lora_dropout must be in [0, 1), got 1.0"),
    ("adapter sync on the native engine", ["model.lora_rank=8", "rollout.lora_sync=adapter"],
     "rollout.lora_sync=adapter loads adapters through vLLM's LoRARequest; rollout.name='native'"),
    ("adapter sync without LoRA", ["rollout.lora_sync=adapter"], "rollout.lora_sync=adapter needs LoRA adapters"),
    ("unknown sync mode", ["rollout.lora_sync=both"], "rollout.lora_sync must be one of ['merged', 'adapter']"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "overrides", "expected"), CASES, ids=[c[0] for c in CASES])
def test_bad_lora_settings_are_one_named_line(case, overrides, expected, tmp_path, capsys, no_runtime):
    rc = cli.main(["train", f"trainer.default_local_dir={tmp_path}", *overrides])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: "), err
    assert expected in err[0], err[0]


def test_transformer_engine_spec_is_refused_with_lora():
    from verl_megatron.models.config import ModelConfig
    from verl_megatron.models.lora import LoraConfigError, check_lora_config

    cfg = ModelConfig(lora_rank=8)
    with pytest.raises(LoraConfigError, match=r"needs megatron's local layer spec \(model.use_te=false\)"):
        check_lora_config(cfg, use_te=True)
    settings = check_lora_config(cfg, use_te=False)
    assert settings.targets == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert settings.scaling == 16 / 8
    cfg = ModelConfig(
        lora_rank=4, target_modules=["linear_fc1", "self_attn.o_proj"], exclude_modules=["up_proj"]
    )
    assert check_lora_config(cfg, use_te=False).targets == ("o_proj", "gate_proj")


@pytest.fixture(scope="module")
def tiny_mixtral(tmp_path_factory) -> str:
    from tests.test_models_parity import make_tiny_model

    path = str(tmp_path_factory.mktemp("lora_mixtral"))
    make_tiny_model(
        path, dict(family="mixtral", num_kv_heads=2, vocab_size=128, num_layers=2, intermediate_size=64)
    )
    return path


def test_mlp_targets_of_an_moe_model_are_one_line_at_start_up(tiny_mixtral, tmp_path, capsys, no_runtime):
    overrides = [f"model.path={tiny_mixtral}", "model.lora_rank=8", "model.target_modules=[q_proj,gate_proj]"]
    rc = cli.main(["train", f"trainer.default_local_dir={tmp_path}", *overrides])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: "), err
    assert "model.target_modules names MLP projections ['gate_proj']" in err[0], err[0]


def moe_lora_job(model_dir: str) -> dict:
    """Build + load the model, apply LoRA with the default all-linear targets; adapter shapes."""
    from verl_megatron.distributed.parallel import ParallelLayout, init_runtime
    from verl_megatron.models.builder import build_gpt_chunks
    from verl_megatron.models.config import ModelConfig, load_hf_config
    from verl_megatron.models.convert import load_hf_weights
    from verl_megatron.models.lora import adapter_container, apply_configured_lora

    runtime = init_runtime(ParallelLayout(tp=1, pp=1), seed=3)
    cfg = ModelConfig(path=model_dir, dtype="float32", lora_rank=4)
    chunks = build_gpt_chunks(load_hf_config(model_dir), runtime, cfg)
    load_hf_weights(chunks, model_dir, runtime, cfg)
    apply_configured_lora(chunks, cfg, seed=1)
    trainable = {n: tuple(p.shape) for n, p in chunks[0].named_parameters() if p.requires_grad}
    return {"trainable": trainable, "targets": adapter_container(chunks[0]).settings.targets}


def test_all_linear_on_an_moe_model_adapts_attention(pool1, tiny_mixtral):
    # PEFT's all-linear also adapts the experts' stacked weights; the experts stay frozen here.
    (result,) = pool1.run(f"{__name__}:moe_lora_job", model_dir=tiny_mixtral)
    assert result["targets"] == ("q_proj", "k_proj", "v_proj", "o_proj")
    trainable = result["trainable"]
    assert all(".self_attention__" in name for name in trainable), sorted(trainable)
    # Rank 4, two layers, hidden 64, 4 heads of 16, 2 kv groups: A of q/k/v (3 x 64 columns), B of
    # q (64 rows), k and v (32 each), A and B of o (64 each).
    assert sum(a * b for a, b in trainable.values()) == 2 * 4 * (3 * 64 + 64 + 32 + 32 + 64 + 64)
