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
