"""HF config -> TransformerConfig mapping, ModelConfig validation and clear errors (single process)."""

from __future__ import annotations

import json
import math
import os
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoConfig

from verl_megatron.distributed.parallel import ParallelLayout
from verl_megatron.errors import ModelConfigError, ParallelConfigError
from verl_megatron.models.builder import llama3_inv_freq, padded_vocab_size
from verl_megatron.models.config import (
    ModelConfig,
    RopeSettings,
    hf_to_transformer_config,
    load_hf_config,
    read_hf_architecture,
    read_rope_settings,
)
from verl_megatron.models.convert import SafetensorsCheckpoint

FP32 = ModelConfig(dtype="float32")


def _hf(family: str, **overrides):
    fields = dict(
        vocab_size=131, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=128, rms_norm_eps=1e-5,
    )  # fmt: skip
    if family == "mistral":
        fields["sliding_window"] = None
    fields.update(overrides)
    return AutoConfig.for_model(family, **fields)


@pytest.mark.parametrize(
    ("family", "qkv_bias", "qk_norm"),
    [("llama", False, False), ("qwen2", True, False), ("qwen3", False, True), ("mistral", False, False)],
)
def test_family_maps_to_transformer_config(family, qkv_bias, qk_norm):
    config = hf_to_transformer_config(_hf(family), ParallelLayout(tp=2, pp=2).resolve(4), FP32)
    assert (config.num_layers, config.hidden_size, config.ffn_hidden_size) == (2, 64, 128)
    assert (config.num_attention_heads, config.num_query_groups, config.kv_channels) == (4, 2, 16)
    assert config.layernorm_epsilon == 1e-5 and config.normalization == "RMSNorm"
    assert config.gated_linear_unit and config.activation_func is torch.nn.functional.silu
    assert config.add_qkv_bias is qkv_bias and config.add_bias_linear is False
    assert config.qk_layernorm is qk_norm
    assert (config.tensor_model_parallel_size, config.pipeline_model_parallel_size) == (2, 2)
    assert config.params_dtype == torch.float32 and not config.bf16
    assert config.hidden_dropout == 0.0 and config.attention_dropout == 0.0


def test_head_dim_and_biases_and_tied_embeddings():
    # Qwen3-style head_dim that is not hidden/heads; llama with all linear biases; tied embeddings.
    config = hf_to_transformer_config(_hf("qwen3", head_dim=32), ParallelLayout(), FP32)
    assert config.kv_channels == 32
    config = hf_to_transformer_config(
        _hf("llama", attention_bias=True, mlp_bias=True), ParallelLayout(), FP32
    )
    assert config.add_bias_linear and config.add_qkv_bias
    assert read_hf_architecture(_hf("qwen2", tie_word_embeddings=True)).tie_word_embeddings
    assert not read_hf_architecture(_hf("qwen2", tie_word_embeddings=False)).tie_word_embeddings


def test_rope_settings_from_rope_parameters_and_legacy_fields():
    assert read_rope_settings(_hf("llama", rope_theta=500000.0)) == RopeSettings(theta=500000.0)
    legacy = SimpleNamespace(model_type="llama", rope_theta=1e6, rope_scaling=None)
    assert read_rope_settings(legacy) == RopeSettings(theta=1e6)
    llama3 = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0}
    llama3 |= {"high_freq_factor": 2.0, "original_max_position_embeddings": 1024}
    assert read_rope_settings(_hf("llama", rope_parameters=llama3)) == RopeSettings(
        theta=5e5, rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=2.0,
        original_max_position_embeddings=1024,
    )  # fmt: skip
    linear = SimpleNamespace(
        model_type="llama", rope_theta=1e4, rope_scaling={"type": "linear", "factor": 2.0}
    )
    assert read_rope_settings(linear) == RopeSettings(theta=1e4, rope_type="linear", factor=2.0)
    yarn = SimpleNamespace(model_type="qwen2", rope_parameters={"rope_type": "yarn", "rope_theta": 1e4})
    with pytest.raises(ModelConfigError, match=r"rope type 'yarn'.*\['default', 'llama3', 'linear'\]"):
        read_rope_settings(yarn)


def test_llama3_frequencies_match_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "low_freq_factor": 1.0}
    params |= {"high_freq_factor": 2.0, "original_max_position_embeddings": 64}
    hf_config = _hf("llama", rope_parameters=params, max_position_embeddings=2048)
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, torch.device("cpu"))
    plain = 1.0 / 10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16)
    got = llama3_inv_freq(plain, read_rope_settings(hf_config))
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)
    # The checkpoint's constants matter: scaled, blended and untouched frequencies all occur here.
    assert (got < plain).sum() >= 2 and torch.equal(got[:2], plain[:2])
    wavelen = 2 * math.pi / plain
    assert ((wavelen > 32) & (wavelen < 64)).any()  # at least one blended frequency


def test_padded_vocab_is_a_multiple_of_tp_and_the_same_for_every_tp_dividing_the_multiple():
    assert [padded_vocab_size(131, tp) for tp in (1, 2, 4, 8)] == [256] * 4
    assert [padded_vocab_size(151_936, tp) for tp in (1, 2, 4, 8)] == [151_936] * 4  # Qwen2
    assert padded_vocab_size(131, 3) == 384  # lcm(128, 3)
    assert [padded_vocab_size(131, tp, divisible_by=1) for tp in (1, 2, 4, 8)] == [131, 132, 132, 136]


def test_unsupported_model_type_lists_the_supported_ones():
    with pytest.raises(
        ModelConfigError,
        match=r"'gpt2' is not supported.*\['llama', 'qwen2', 'qwen3', 'mistral', 'qwen3_moe', 'qwen2_moe', 'mixtral', "
        r"'qwen3_next', 'qwen3_5_moe_text', 'deepseek_v3', 'glm4_moe', 'gpt_oss', 'qwen3_5_text'\]",
    ):
        hf_to_transformer_config(AutoConfig.for_model("gpt2"), ParallelLayout(), FP32)


def test_layout_is_checked_against_the_model():
    with pytest.raises(ParallelConfigError, match="num_attention_heads=4 is not divisible by tp=3"):
        hf_to_transformer_config(_hf("llama"), ParallelLayout(tp=3).resolve(3), FP32)
    with pytest.raises(ParallelConfigError, match="num_key_value_heads=2 is not divisible by tp=4"):
        hf_to_transformer_config(_hf("llama"), ParallelLayout(tp=4).resolve(4), FP32)
    with pytest.raises(ParallelConfigError, match="num_layers=2 is not divisible by pp"):
        hf_to_transformer_config(_hf("llama"), ParallelLayout(pp=4).resolve(4), FP32)


def test_unsupported_architecture_details_raise():
    with pytest.raises(ModelConfigError, match="attention_bias=True with mlp_bias=False"):
        read_hf_architecture(_hf("llama", attention_bias=True))
    with pytest.raises(ModelConfigError, match="sliding_window=4096"):
        read_hf_architecture(_hf("mistral", sliding_window=4096))
    with pytest.raises(ModelConfigError, match="hidden_act='gelu'"):
        read_hf_architecture(_hf("llama", hidden_act="gelu"))


def test_model_config_guards_gpu_only_options():
    tp2 = ParallelLayout(tp=2).resolve(2)
    with pytest.raises(ModelConfigError, match="sequence_parallel=True needs tp > 1"):
        ModelConfig(dtype="float32", sequence_parallel=True).validate(ParallelLayout().resolve(1))
    with pytest.raises(ModelConfigError, match="sequence_parallel=True needs the Transformer Engine"):
        ModelConfig(dtype="float32", sequence_parallel=True).validate(tp2)
    with pytest.raises(ModelConfigError, match="use_te=True needs Transformer Engine on CUDA"):
        ModelConfig(dtype="float32", use_te=True).validate(tp2)
    with pytest.raises(ModelConfigError, match=r"model.dtype must be one of \['float32', 'bfloat16'\]"):
        ModelConfig(dtype="fp16").validate(tp2)
    with pytest.warns(UserWarning, match="bfloat16 on a machine without a GPU"):
        config = hf_to_transformer_config(_hf("llama"), tp2, ModelConfig(dtype="bfloat16"))
    assert config.bf16 and config.params_dtype == torch.bfloat16


def test_recompute_settings():
    checkpointing = ModelConfig(dtype="float32", enable_gradient_checkpointing=True)
    assert checkpointing.recompute_settings() == {
        "recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1,
    }  # fmt: skip
    selective = ModelConfig(
        dtype="float32", recompute_granularity="selective", recompute_modules=["core_attn"]
    )
    assert selective.recompute_settings() == {
        "recompute_granularity": "selective",
        "recompute_modules": ["core_attn"],
    }
    assert ModelConfig(dtype="float32").recompute_settings() == {}
    with pytest.raises(ModelConfigError, match="needs recompute_method"):
        ModelConfig(dtype="float32", recompute_granularity="full").recompute_settings()
    with pytest.raises(ModelConfigError, match=r"recompute_granularity=.full. conflicts with .*override"):
        ModelConfig(
            dtype="float32", recompute_granularity="full",
            override_transformer_config={"recompute_granularity": "selective"},
        ).recompute_settings()  # fmt: skip
    with pytest.raises(ModelConfigError, match="only apply to recompute_granularity=full"):
        ModelConfig(dtype="float32", recompute_method="uniform").recompute_settings()
    with pytest.raises(ModelConfigError, match="recompute_modules is set but recompute_granularity is not"):
        ModelConfig(dtype="float32", recompute_modules=["core_attn"]).recompute_settings()


def test_recomputation_reaches_the_transformer_config():
    config = hf_to_transformer_config(
        _hf("llama"), ParallelLayout(), ModelConfig(dtype="float32", enable_gradient_checkpointing=True)
    )
    assert (config.recompute_granularity, config.recompute_method, config.recompute_num_layers) == (
        "full",
        "uniform",
        1,
    )


def test_overrides_reach_the_transformer_config_and_unknown_keys_raise():
    cfg = ModelConfig(dtype="float32", override_transformer_config={"attention_softmax_in_fp32": False})
    assert hf_to_transformer_config(_hf("llama"), ParallelLayout(), cfg).attention_softmax_in_fp32 is False
    with pytest.raises(ModelConfigError, match=r"not TransformerConfig fields: \['no_such_field'\]"):
        ModelConfig(dtype="float32", override_transformer_config={"no_such_field": 1}).validate(
            ParallelLayout()
        )


def test_missing_checkpoint_files_name_the_path(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match=f"'{missing}' is not a directory"):
        load_hf_config(missing)
    with pytest.raises(FileNotFoundError, match=f"'{tmp_path}' has no config.json"):
        load_hf_config(tmp_path)
    _hf("llama").save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match=f"no safetensors weights in '{tmp_path}'.*config.json"):
        SafetensorsCheckpoint(tmp_path)
    index = {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}
    with open(os.path.join(tmp_path, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    with pytest.raises(FileNotFoundError, match=r"model-00002-of-00002\.safetensors', which does not exist"):
        SafetensorsCheckpoint(tmp_path)


def test_partial_rotary_factor_only_where_transformers_reads_it():
    from verl_megatron.models.config import _with_partial_rotary

    half = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}
    for family in ("llama", "qwen2", "qwen3", "mistral"):  # their HF rotary ignores the key
        assert read_hf_architecture(_hf(family, rope_parameters=half)).rope.rotary_percent == 1.0, family
    glm = SimpleNamespace(model_type="glm4_moe", rope_parameters=half)
    assert _with_partial_rotary(RopeSettings(theta=1e4), glm).rotary_percent == 0.5
    linear = {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4, "partial_rotary_factor": 0.5}
    with pytest.raises(ModelConfigError, match=r"^llama: partial_rotary_factor=0.5 with rope type 'linear'"):
        read_hf_architecture(_hf("llama", rope_parameters=linear))


def partial_rotary_check_job(path: str) -> int:
    from verl_megatron.tools.check_hf import main

    return main([path])


def test_llama_with_a_partial_rotary_factor_gives_transformers_logits(pool1, tmp_path):
    from tests.test_models_parity import make_tiny_model

    spec = dict(family="llama", num_kv_heads=2, vocab_size=128, num_layers=2, intermediate_size=64)
    make_tiny_model(str(tmp_path), spec | {"partial_rotary_factor": 0.5})
    assert load_hf_config(tmp_path).rope_parameters["partial_rotary_factor"] == 0.5
    (status,) = pool1.run(f"{__name__}:partial_rotary_check_job", path=str(tmp_path))
    assert status == 0  # max |logit diff| <= 1e-3 (7.29 when half of each head rotated)
