"""Model settings, and the translation of a Hugging Face config into megatron's TransformerConfig.

``ModelConfig`` is the user's choice (checkpoint path, dtype, recomputation, GPU-only switches).
``read_hf_architecture`` reads the facts of a Llama-family checkpoint (dense, or mixture-of-experts:
see ``verl_megatron.models.moe``) from its HF config
into one typed object that the builder and the weight converter share, and
``hf_to_transformer_config`` turns it, with the parallel layout and the ``ModelConfig``, into the
``TransformerConfig`` megatron builds from. Unsupported models and settings raise
``ModelConfigError`` naming the field at fault before anything is built.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from verl_megatron.distributed.parallel import ParallelLayout
from verl_megatron.errors import ModelConfigError, ParallelConfigError
from verl_megatron.models.families.deepseek import (
    MLAArchitecture,
    check_mla_split,
    mla_transformer_config,
    read_mla_architecture,
)
from verl_megatron.models.families.gpt_oss import (
    GPT_OSS_MODEL_TYPES,
    GptOssArchitecture,
    gpt_oss_transformer_config,
    read_gpt_oss_architecture,
    read_gpt_oss_moe,
)
from verl_megatron.models.families.qwen2_vl import (
    VLArchitecture,
    check_vl_settings,
    read_vl_architecture,
    vl_transformer_config,
)
from verl_megatron.models.families.qwen3_next import (
    LinearAttentionArchitecture,
    check_linear_split,
    linear_transformer_config,
    read_linear_attention,
)
from verl_megatron.models.families.qwen3_vl import read_qwen3_vl_architecture
from verl_megatron.models.moe import (
    MOE_MODEL_TYPES,
    SIGMOID_MOE_MODEL_TYPES,
    MoEArchitecture,
    check_dispatcher,
    moe_transformer_config,
    read_moe_architecture,
)

logger = logging.getLogger(__name__)

# Sigmoid-routed families: deepseek_v3 (multi-latent attention) and glm4_moe (grouped-query).
SUPPORTED_MODEL_TYPES = (
    "llama", "qwen2", "qwen3", "mistral", *MOE_MODEL_TYPES, *SIGMOID_MOE_MODEL_TYPES, *GPT_OSS_MODEL_TYPES,
    "qwen3_5_text",
)  # fmt: skip
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")
# Families whose transformers rotary embedding rotates only ``partial_rotary_factor`` of each head.
_PARTIAL_ROTARY_MODEL_TYPES = ("glm4_moe", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_RECOMPUTE_KEYS = ("recompute_granularity", "recompute_method", "recompute_num_layers", "recompute_modules")


def transformer_engine_available() -> bool:
    """True when Transformer Engine's PyTorch part imports and a GPU is present (its kernels need CUDA).

    The ``transformer_engine`` package alone is not enough: an install without its PyTorch part
    (``transformer_engine_torch``) imports, and megatron's spec builder fails on it later. Its
    ``transformer_engine.pytorch`` raises ImportError, or FileNotFoundError when the extension's
    shared object is missing; both read as unavailable.
    """
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except (ImportError, OSError):
        return False
    return True


@dataclass
class ModelConfig:
    """Which checkpoint to build and how (verl's ``actor_rollout_ref.model`` + megatron settings).

    ``tie_word_embeddings`` is not a setting: it is read from the checkpoint's config.json.
    """

    path: str = ""
    """Local folder of a Hugging Face checkpoint (config.json + safetensors)."""
    tokenizer_path: str | None = None
    """Tokenizer folder; ``None`` means ``path``."""
    dtype: str = "bfloat16"
    """Parameter dtype: ``float32`` or ``bfloat16`` (verl's megatron default; slow on CPU)."""
    use_te: bool | None = None
    """Transformer Engine layer spec: ``None`` uses it on a GPU (an error there without transformer_engine)
    and the local spec on CPU; ``True`` requires it; ``false`` picks the local spec (logged on a GPU)."""
    make_vocab_size_divisible_by: int = 128
    """Embedding rows are padded to a multiple of this (and of tp): the padded size, and so the
    checkpoint's, stays the same for every tp that divides it."""
    sequence_parallel: bool = False
    """Split activations outside attention/MLP over tp ranks; needs tp > 1 and Transformer Engine."""
    enable_gradient_checkpointing: bool = False
    """Recompute activations in backward; without explicit recompute_* fields: full, uniform, 1 layer."""
    recompute_granularity: str | None = None
    """``full`` (whole layers) or ``selective`` (only ``recompute_modules``, e.g. core attention)."""
    recompute_method: str | None = None
    """For ``full``: ``uniform`` (every ``recompute_num_layers`` layers) or ``block`` (first N per stage)."""
    recompute_num_layers: int | None = None
    """Layers per recomputed group (uniform) or recomputed layers per pipeline stage (block)."""
    recompute_modules: list[str] | None = None
    """For ``selective``: megatron module names, e.g. ``["core_attn"]`` (megatron's default)."""
    override_transformer_config: dict[str, Any] = field(default_factory=dict)
    """Any other ``TransformerConfig`` field (verl's ``megatron.override_transformer_config``)."""
    lora_rank: int = 0
    """LoRA adapter rank (verl's ``model.lora_rank``): > 0 freezes the base weights and trains
    adapters only (see models/lora.py); 0 trains every weight."""
    lora_alpha: float = 16
    """LoRA scaling: the adapters' output is multiplied by lora_alpha / lora_rank (PEFT's)."""
    target_modules: Any = "all-linear"
    """Projections given adapters: "all-linear" or a list of Hugging Face names (q_proj, k_proj,
    v_proj, o_proj, gate_proj, up_proj, down_proj) or megatron's (linear_qkv, linear_fc1, ...)."""
    exclude_modules: list[str] | None = None
    """Projections taken out of target_modules."""
    lora_dropout: float = 0.0
    """Dropout on the adapters' input while training (PEFT's lora_dropout)."""
    freeze_vision_tower: bool = False
    """Vision-language models: the vision tower (patch embedding, blocks, merger) gets no gradient
    and no optimizer state; only the language model trains."""

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    def resolve_use_te(self) -> bool:
        """Whether the Transformer Engine spec is used; raises when ``use_te=True`` cannot be honoured.

        On a GPU without Transformer Engine, auto (``use_te=None``) is an error: the local spec
        builds a dense [T, T] mask per packed micro-batch (256 MiB at 16k tokens) and runs
        unfused attention, so it is taken only when asked for (``use_te=false``), and logged.
        """
        available = transformer_engine_available()
        if torch.cuda.is_available() and not self.use_te:
            if self.use_te is None and not available:
                raise ModelConfigError(
                    "model.use_te is auto and this GPU machine has no transformer_engine.pytorch (Transformer "
                    "Engine's PyTorch part): install it (README, 'GPU install'), or set model.use_te=false to run "
                    "megatron's local spec on the GPU (dense attention mask per packed micro-batch, unfused "
                    "attention; configs/gpu_quickstart.yaml does)"
                )
            if self.use_te is False:
                logger.warning(
                    "model.use_te=false on a GPU: megatron's local layer spec (dense attention mask per "
                    "packed micro-batch, unfused attention), as configured"
                )
        if self.use_te and not available:
            why = (
                "no GPU is present"
                if not torch.cuda.is_available()
                else "transformer_engine.pytorch does not import"
            )
            raise ModelConfigError(
                f"model.use_te=True needs Transformer Engine on CUDA, but {why}; set use_te to null (auto) or false"
            )
        return available if self.use_te is None else bool(self.use_te)

    def validate(self, layout: ParallelLayout) -> None:
        """Raise ModelConfigError for settings that cannot work with this layout on this machine."""
        if self.dtype not in _DTYPES:
            raise ModelConfigError(f"model.dtype must be one of {list(_DTYPES)}, got {self.dtype!r}")
        if self.dtype == "bfloat16" and not torch.cuda.is_available():
            warnings.warn(
                "model.dtype=bfloat16 on a machine without a GPU: matmuls run slowly and logits differ "
                "from float32 by ~1e-2; use dtype=float32 on CPU",
                stacklevel=2,
            )
        if self.make_vocab_size_divisible_by < 1:
            raise ModelConfigError(
                f"model.make_vocab_size_divisible_by must be >= 1, got {self.make_vocab_size_divisible_by}"
            )
        use_te = self.resolve_use_te()
        from verl_megatron.models.lora import check_lora_config

        # An MoE model's experts take no adapters: MLP targets named for one are refused here.
        check_lora_config(self, use_te, moe=self.lora_rank > 0 and _is_moe_checkpoint(self.path))
        if self.sequence_parallel and layout.tp == 1:
            raise ModelConfigError(
                "model.sequence_parallel=True needs tp > 1 (it splits activations over tp)"
            )
        if self.sequence_parallel and not use_te:
            raise ModelConfigError(
                "model.sequence_parallel=True needs the Transformer Engine layer spec (megatron's local "
                "spec uses torch norms, which do not support it); that needs CUDA and transformer_engine"
            )
        # megatron (seconds to import) only when there are keys to check against its TransformerConfig.
        overrides = set(self.override_transformer_config)
        unknown = sorted(overrides - _transformer_config_fields()) if overrides else []
        if unknown:
            raise ModelConfigError(
                f"model.override_transformer_config has keys that are not TransformerConfig fields: {unknown}"
            )

    def recompute_settings(self) -> dict[str, Any]:
        """The recompute_* TransformerConfig fields implied by this config (empty: no recomputation)."""
        explicit = {k: getattr(self, k) for k in _RECOMPUTE_KEYS if getattr(self, k) is not None}
        for key, value in explicit.items():
            other = self.override_transformer_config.get(key, value)
            if other != value:
                raise ModelConfigError(
                    f"model.{key}={value!r} conflicts with model.override_transformer_config.{key}={other!r}"
                )
        if self.enable_gradient_checkpointing and not explicit:
            explicit = {
                "recompute_granularity": "full",
                "recompute_method": "uniform",
                "recompute_num_layers": 1,
            }
        granularity = explicit.get("recompute_granularity")
        if granularity not in (None, "full", "selective"):
            raise ModelConfigError(
                f"model.recompute_granularity must be full or selective, got {granularity!r}"
            )
        method = explicit.get("recompute_method")
        if method not in (None, "uniform", "block"):
            raise ModelConfigError(f"model.recompute_method must be uniform or block, got {method!r}")
        if granularity == "full" and (method is None or explicit.get("recompute_num_layers") is None):
            raise ModelConfigError(
                "model.recompute_granularity=full needs recompute_method (uniform|block) and recompute_num_layers"
            )
        if granularity != "full" and (method is not None or explicit.get("recompute_num_layers") is not None):
            raise ModelConfigError(
                "model.recompute_method and recompute_num_layers only apply to recompute_granularity=full"
            )
        if granularity is None and explicit:
            raise ModelConfigError(f"model.{next(iter(explicit))} is set but recompute_granularity is not")
        return explicit


def _transformer_config_fields() -> set[str]:
    from megatron.core.transformer import TransformerConfig

    return {f.name for f in dataclasses.fields(TransformerConfig)}


def _is_moe_checkpoint(path: str) -> bool:
    """Whether ``path`` holds a dense-layout mixture-of-experts model (False where it holds no config)."""
    folder = os.path.expanduser(path)
    if not os.path.isfile(os.path.join(folder, "config.json")):
        return False
    return load_hf_config(folder).model_type in MOE_MODEL_TYPES


def load_hf_config(path: str | os.PathLike) -> Any:
    """The ``PretrainedConfig`` of a local checkpoint folder; raises naming the path when absent."""
    from transformers import AutoConfig

    path = os.path.expanduser(os.fspath(path))
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"model path '{path}' is not a directory (expected a Hugging Face checkpoint)"
        )
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"model path '{path}' has no config.json: {sorted(os.listdir(path))[:10]}")
    return AutoConfig.from_pretrained(path, local_files_only=True)


@dataclass(frozen=True)
class RopeSettings:
    """Rotary embedding of a checkpoint: base frequency and (optional) long-context scaling."""

    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    rotary_percent: float = 1.0
    """Share of each head's dimensions that rotate (HF ``partial_rotary_factor``, GLM-4.5's 0.5)."""


@dataclass(frozen=True)
class HFArchitecture:
    """Shape facts of a Llama-family checkpoint, shared by the builder and the converter."""

    model_type: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    qkv_bias: bool
    linear_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    rope: RopeSettings
    initializer_range: float = 0.02
    moe: MoEArchitecture | None = None
    """Router and experts of a mixture-of-experts model; None for a dense one."""
    mla: MLAArchitecture | None = None
    """Multi-latent attention (DeepSeek-V3); None for grouped-query attention."""
    vl: VLArchitecture | None = None
    """Vision tower and 3-D rotary of a vision-language model (Qwen2.5-VL); None for text only."""
    gpt_oss: GptOssArchitecture | None = None
    """GPT-OSS's sinks, sliding windows, clamped SwiGLU and YaRN (``families/gpt_oss.py``)."""
    linear: LinearAttentionArchitecture | None = None
    """Gated DeltaNet layers (Qwen3-Next); None when every layer has full attention."""


def read_rope_settings(hf_config: Any) -> RopeSettings:
    """Rotary settings from transformers 5's ``rope_parameters``, falling back to ``rope_theta``/``rope_scaling``."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    legacy = dict(getattr(hf_config, "rope_scaling", None) or {})
    scaling = {**legacy, **params}
    theta = scaling.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta is None:
        raise ModelConfigError(
            f"{hf_config.model_type} config has neither rope_parameters.rope_theta nor rope_theta"
        )
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelConfigError(
            f"rope type {rope_type!r} of this {hf_config.model_type} checkpoint is not supported; "
            f"supported: {list(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return RopeSettings(theta=float(theta))
    if rope_type == "linear":
        return RopeSettings(theta=float(theta), rope_type=rope_type, factor=float(scaling["factor"]))
    return RopeSettings(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(scaling["factor"]),
        low_freq_factor=float(scaling["low_freq_factor"]),
        high_freq_factor=float(scaling["high_freq_factor"]),
        original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
    )


def _with_partial_rotary(rope: RopeSettings, hf_config: Any) -> RopeSettings:
    """``rope`` rotating only the share ``partial_rotary_factor`` of each head, where transformers does.

    Only the families of _PARTIAL_ROTARY_MODEL_TYPES read the key. The others' default rotary
    embedding ignores it and rotates whole heads, so the converted model does too (rotary_percent
    1.0); their scaled (linear, llama3) frequencies would honour it and then fail to broadcast
    against whole heads in transformers' forward, so that combination is refused.
    """
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    percent = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None))
    model_type = hf_config.model_type
    if percent in (None, 1.0):
        return rope
    if model_type in _PARTIAL_ROTARY_MODEL_TYPES:
        return dataclasses.replace(rope, rotary_percent=float(percent))
    if rope.rope_type != "default":
        raise ModelConfigError(
            f"{model_type}: partial_rotary_factor={percent} with rope type {rope.rope_type!r}, which transformers' "
            f"{model_type} cannot run (its frequencies cover part of each head, its rotation the whole head); "
            "set partial_rotary_factor to 1.0"
        )
    logger.warning(
        "%s: partial_rotary_factor=%s is ignored, as transformers' %s ignores it: whole heads rotate",
        model_type, percent, model_type,
    )  # fmt: skip
    return rope


def read_hf_architecture(hf_config: Any) -> HFArchitecture:
    """Read and check a Llama-family HF config; unsupported models raise ModelConfigError."""
    vl = read_vl_architecture(hf_config) or read_qwen3_vl_architecture(hf_config)
    if vl is not None:  # Qwen2.5-VL / Qwen3-VL: a Qwen2 / Qwen3 decoder behind a vision tower
        arch = read_hf_architecture(vl.language_config)
        return dataclasses.replace(arch, model_type=hf_config.model_type, vl=vl)
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelConfigError(
            f"model_type {model_type!r} is not supported; supported model types: {list(SUPPORTED_MODEL_TYPES)}"
        )
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise ModelConfigError(
            f"{model_type}: hidden_act={hf_config.hidden_act!r}; only silu (SwiGLU) is supported"
        )
    _reject_sliding_window(hf_config)
    heads = hf_config.num_attention_heads
    mla = read_mla_architecture(hf_config)
    qkv_bias, linear_bias = (False, False) if mla else _bias_layout(hf_config)
    num_layers = hf_config.num_hidden_layers
    gpt_oss = read_gpt_oss_architecture(hf_config)
    rope = (
        RopeSettings(theta=mla.rope_theta)
        if mla
        else _with_partial_rotary(read_rope_settings(hf_config), hf_config)
    ) if gpt_oss is None else RopeSettings(theta=gpt_oss.rope_theta)  # fmt: skip
    return HFArchitecture(
        model_type=model_type,
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        num_attention_heads=heads,
        # MLA: every head has its own keys and values (megatron's num_query_groups = heads).
        num_key_value_heads=heads if mla else getattr(hf_config, "num_key_value_heads", None) or heads,
        head_dim=mla.q_head_dim if mla else _head_dim(hf_config),
        intermediate_size=hf_config.intermediate_size,
        vocab_size=hf_config.vocab_size,
        rms_norm_eps=hf_config.rms_norm_eps,
        qkv_bias=qkv_bias,
        linear_bias=linear_bias,
        qk_norm=model_type in ("qwen3", "qwen3_moe", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
        or bool(getattr(hf_config, "use_qk_norm", False)),
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        max_position_embeddings=hf_config.max_position_embeddings,
        rope=rope,
        initializer_range=getattr(hf_config, "initializer_range", 0.02),
        moe=read_gpt_oss_moe(hf_config, num_layers)
        if gpt_oss
        else read_moe_architecture(hf_config, num_layers),
        mla=mla,
        gpt_oss=gpt_oss,
        linear=read_linear_attention(hf_config),
    )


def _head_dim(hf_config: Any) -> int:
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


def _bias_layout(hf_config: Any) -> tuple[bool, bool]:
    """(bias on q/k/v, bias on every linear) as megatron can express it."""
    if hf_config.model_type == "qwen2":
        return True, False  # Qwen2 always has q/k/v biases and nothing else
    if hf_config.model_type == "qwen2_moe":
        return bool(getattr(hf_config, "qkv_bias", True)), False
    if hf_config.model_type == "gpt_oss":  # biases everywhere (attention_bias checked in families/gpt_oss.py)
        return True, True
    if hf_config.model_type == "glm4_moe":  # attention_bias: q/k/v only (o_proj has none)
        return bool(getattr(hf_config, "attention_bias", False)), False
    attention_bias = bool(getattr(hf_config, "attention_bias", False))
    mlp_bias = bool(getattr(hf_config, "mlp_bias", False)) if hf_config.model_type == "llama" else False
    if attention_bias != mlp_bias:
        # megatron has one switch for the biases of o_proj and the MLP together.
        raise ModelConfigError(
            f"{hf_config.model_type}: attention_bias={attention_bias} with mlp_bias={mlp_bias} is not "
            "supported (megatron's add_bias_linear sets both)"
        )
    return attention_bias, attention_bias


def check_layout(layout: ParallelLayout, arch: HFArchitecture) -> None:
    """Raise ParallelConfigError when ``layout`` cannot split this model (heads, kv heads, layers, experts)."""
    layout.check_model(
        num_layers=arch.num_layers,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_key_value_heads,
        num_experts=arch.moe.num_experts if arch.moe else None,
    )
    if arch.moe is not None and arch.linear_bias and layout.expert_tp > 1:  # megatron asserts it later
        raise ParallelConfigError(
            f"{arch.model_type}'s experts have biases, which megatron supports only at expert tensor-parallel "
            f"size 1, got {layout.expert_tp} (etp unset: tp); set etp=1 (parallel.etp=1, check-hf --etp 1)"
        )


def _reject_sliding_window(hf_config: Any) -> None:
    window = getattr(hf_config, "sliding_window", None)
    used = hf_config.model_type in ("mistral", "mixtral") or getattr(hf_config, "use_sliding_window", False)
    if used and window is not None:
        raise ModelConfigError(
            f"{hf_config.model_type}: sliding-window attention (sliding_window={window}) is not supported; "
            "if your sequences never exceed the window, set sliding_window to null in config.json"
        )


def hf_to_transformer_config(hf_config: Any, layout: ParallelLayout, model_cfg: ModelConfig):
    """The megatron ``TransformerConfig`` for a Llama/Qwen2/Qwen3/Mistral checkpoint or their MoE kin.

    The layout is checked against the model (heads, kv heads and layers divisible) and
    ``model_cfg`` against the machine before anything else. Rotary settings are not
    TransformerConfig fields: the builder passes ``read_rope_settings(hf_config)`` to GPTModel.
    """
    from megatron.core.transformer import TransformerConfig

    arch = read_hf_architecture(hf_config)
    check_layout(layout, arch)
    _check_mlp_split(arch, layout)
    if arch.mla is not None:
        check_mla_split(arch.mla, arch.num_attention_heads, layout.tp)
    model_cfg.validate(layout)
    use_te, dtype = model_cfg.resolve_use_te(), model_cfg.torch_dtype
    kwargs: dict[str, Any] = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_key_value_heads,
        kv_channels=arch.head_dim,
        ffn_hidden_size=arch.intermediate_size,
        layernorm_epsilon=arch.rms_norm_eps,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=arch.linear_bias,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=float(getattr(hf_config, "attention_dropout", 0.0) or 0.0),
        init_method_std=arch.initializer_range,
        sequence_parallel=model_cfg.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        # RL micro-batches have different lengths; pipeline stages exchange shapes first.
        variable_seq_lengths=True,
        # megatron refuses variable lengths with its default MoE dispatcher, even for dense models.
        moe_token_dispatcher_type="alltoall",
        use_cpu_initialization=not torch.cuda.is_available(),
        # Fused kernels are CUDA code; the local spec on CPU runs the plain torch versions.
        bias_activation_fusion=use_te,
        bias_dropout_fusion=use_te,
        masked_softmax_fusion=use_te,
        apply_rope_fusion=use_te,
    )
    # The parallel sizes, ep included: megatron marks expert weights as such (not all-reduced
    # over dp) only when the config says ep > 1.
    kwargs.update(layout.megatron_sizes())
    if layout.expert_tp != layout.tp:
        kwargs["expert_tensor_parallel_size"] = layout.expert_tp
    if arch.moe is not None:
        kwargs.update(moe_transformer_config(arch.moe, use_te=use_te, on_gpu=torch.cuda.is_available()))
    config_class = TransformerConfig
    if arch.mla is not None:
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        kwargs.update(mla_transformer_config(arch.mla, use_te))
        config_class = MLATransformerConfig
    if arch.gpt_oss is not None:
        kwargs.update(gpt_oss_transformer_config(arch.gpt_oss, arch.head_dim, use_te))
    if arch.linear is not None:
        check_linear_split(arch.linear, layout.tp, use_te)
        kwargs.update(linear_transformer_config())
    if arch.vl is not None or model_cfg.freeze_vision_tower:
        check_vl_settings(
            arch.vl, sequence_parallel=model_cfg.sequence_parallel, freeze=model_cfg.freeze_vision_tower
        )
        kwargs.update(vl_transformer_config(arch.vl))
    kwargs.update(model_cfg.recompute_settings())
    kwargs.update(model_cfg.override_transformer_config)
    check_dispatcher(kwargs, on_gpu=torch.cuda.is_available())
    try:
        return config_class(**kwargs)
    except (AssertionError, ValueError, TypeError) as err:
        raise ModelConfigError(
            f"megatron rejected the TransformerConfig for this {arch.model_type} model: {err}"
        ) from err


def _check_mlp_split(arch: HFArchitecture, layout: ParallelLayout) -> None:
    """MLP widths must split evenly: dense and shared experts over tp, routed experts over etp."""
    has_dense_layers = arch.moe is None or 0 in arch.moe.layer_pattern
    widths = [("intermediate_size", arch.intermediate_size, layout.tp, "tp")] if has_dense_layers else []
    if arch.moe is not None:
        widths.append(("moe_intermediate_size", arch.moe.ffn_hidden_size, layout.expert_tp, "etp"))
        if arch.moe.shared_expert_size:
            widths.append(("shared_expert_intermediate_size", arch.moe.shared_expert_size, layout.tp, "tp"))
    for field_name, width, split, split_name in widths:
        if width % split != 0:
            raise ModelConfigError(f"{field_name}={width} is not divisible by {split_name}={split}")
