"""Build megatron GPT model chunks for a Hugging Face dense checkpoint (policy or critic).

``build_gpt_chunks`` returns one ``GPTModel`` per virtual pipeline stage held by this rank,
with random weights; ``verl_megatron.models.convert.load_hf_weights`` fills them.

How to call a chunk (``megatron.core.models.gpt.GPTModel.forward``)::

    out = chunk(input_ids, position_ids, attention_mask=None,
                packed_seq_params=None, runtime_gather_output=None)

- ``input_ids`` and ``position_ids`` are [B, T] token ids and positions. Only the first pipeline
  stage reads ``input_ids``; later stages receive hidden states through ``set_input_tensor``,
  which megatron's ``get_forward_backward_func`` schedule calls: run multi-stage models through it.
- Rotary positions are the column index 0..T-1 of each row: megatron's ``RotaryEmbedding``
  ignores ``position_ids``. Every sequence must therefore start at column 0. Right padding is
  harmless under the causal mask; LEFT-padded batches (verl's prompts) must be re-aligned or
  unpadded first.
- ``attention_mask=None`` selects the causal mask of the layer spec (no padding mask is needed
  for right-padded rows, whose pad positions only attend to earlier tokens and are ignored).
- Packed sequences (verl's ``use_remove_padding``): ``input_ids`` [1, total_tokens] and
  ``PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=m,
  max_seqlen_kv=m)`` with ``cu`` the int32 cumulative lengths [0, l1, l1+l2, ...]; rotary
  positions then restart at each sequence. This needs Transformer Engine attention (GPU): the
  local spec's attention rejects ``packed_seq_params``.
- Output on the last stage, policy: logits [B, T, V_pad / tp], vocabulary-parallel (each tp rank
  holds a contiguous slice of columns); ``runtime_gather_output=True`` gathers [B, T, V_pad].
  Critic (``value_head=True``): values [B, T, 1], identical on every tp rank.

Vocabulary padding: the vocabulary is padded to ``padded_vocab_size`` (a multiple of
``model.make_vocab_size_divisible_by`` and of tp, the same size for every tp dividing it) so it
splits evenly and checkpoints reload at another tp. The converter fills padded embedding / output rows with zeros, so padded logits
start at exactly 0 — but 0 is not "impossible", and training updates those rows through the
softmax normaliser. Callers must never let padded columns take part: slice logits to
``[..., :info.vocab_size]`` when gathered, and with vocabulary-parallel logits set the columns
at global index >= ``vocab_size`` to -inf (on the tp ranks whose slice contains them) before
any softmax, log-prob, entropy or sampling. Export drops the padded rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from verl_megatron.distributed.modules import unwrap
from verl_megatron.distributed.parallel import Runtime
from verl_megatron.models.config import (
    HFArchitecture,
    ModelConfig,
    RopeSettings,
    hf_to_transformer_config,
    read_hf_architecture,
)
from verl_megatron.models.megatron_model import build_chunks

if TYPE_CHECKING:
    from verl_megatron.models.matmul_route import MatmulRoute


@dataclass(frozen=True)
class ModelInfo:
    """What a built model is, attached to every chunk as ``chunk.verl_model_info``."""

    arch: HFArchitecture
    padded_vocab_size: int
    value_head: bool

    @property
    def vocab_size(self) -> int:
        """The checkpoint's true vocabulary size: logit columns from here on are padding."""
        return self.arch.vocab_size

    @property
    def tied_embeddings(self) -> bool:
        """Whether the output layer reuses the input embedding (never for a critic)."""
        return self.arch.tie_word_embeddings and not self.value_head


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """Smallest multiple of lcm(``divisible_by``, ``tp``) that holds ``vocab_size`` rows.

    The size does not depend on tp as long as tp divides ``divisible_by`` (every power of two
    up to 128 by default), so a checkpoint saved at one tp reloads at another. (megatron's
    ``make_vocab_size_divisible_by * tp`` rule changes the size with tp.)
    """
    multiple = math.lcm(divisible_by, tp)
    return math.ceil(vocab_size / multiple) * multiple


def model_info(chunks: list[torch.nn.Module]) -> ModelInfo:
    """The ModelInfo of chunks made by :func:`build_gpt_chunks` (DDP-wrapped or not)."""
    inner = unwrap(chunks[0])
    info = getattr(inner, "verl_model_info", None)
    if info is None:
        raise ValueError(f"{type(inner).__name__} was not built by build_gpt_chunks (no verl_model_info)")
    return info


def llama3_inv_freq(inv_freq: torch.Tensor, rope: RopeSettings) -> torch.Tensor:
    """Llama 3.x long-context rotary frequencies [D/2] from the plain ones [D/2].

    Long wavelengths (beyond ``original_max_position_embeddings / low_freq_factor``) are slowed
    by ``factor``, short ones (below ``... / high_freq_factor``) kept, and the band in between
    blended linearly in 1/wavelength. megatron's own switch fixes the three constants to Llama
    3.1's values, so the frequencies are recomputed here from the checkpoint's.
    """
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
    high_freq_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
    smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    blended = (1 - smooth) * inv_freq / rope.factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, blended, scaled)


class ValueHead(torch.nn.Linear):
    """Critic output layer: hidden -> 1 value, replicated on every tp rank (not vocab-parallel).

    Called like megatron's output layer: ``(values [S, B, 1], None)``. With sequence
    parallelism each tp rank sees S/tp positions: values are gathered along S, and the
    weight is marked ``sequence_parallel`` so megatron all-reduces its gradient over tp.
    Named ``score`` in Hugging Face's ``*ForTokenClassification`` layout (with bias).
    """

    def __init__(self, hidden_size: int, config: Any, seed: int, device: torch.device) -> None:
        super().__init__(hidden_size, 1, bias=True, dtype=config.params_dtype)
        # Same seed on every rank, so the replicated copies start identical.
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            self.weight.copy_(torch.randn(self.weight.shape, generator=generator) * config.init_method_std)
            self.bias.zero_()
        self.to(device)
        self.sequence_parallel = bool(config.sequence_parallel)
        from megatron.core.tensor_parallel import set_defaults_if_not_set_tensor_model_parallel_attributes

        for param in self.parameters():
            # Not tensor-parallel: megatron counts it once in the grad norm, like a layer norm.
            set_defaults_if_not_set_tensor_model_parallel_attributes(param)
            param.sequence_parallel = self.sequence_parallel

    def forward(self, hidden_states: torch.Tensor, weight=None, runtime_gather_output=None):
        values = super().forward(hidden_states)
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            # Downstream the loss is computed identically on every tp rank, so the backward
            # only splits the gradient (no sum over ranks).
            values = gather_from_sequence_parallel_region(values, tensor_parallel_output_grad=False)
        return values, None


def _cast_parameters(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Store every parameter in ``dtype``, in place (the Parameter objects and their attributes stay).

    megatron's local spec builds its torch norms in float32 whatever ``params_dtype`` says; the
    Transformer Engine spec, and megatron-LM's Float16Module, keep every weight in it. Doing the
    same keeps bf16 layers on one dtype (no mixed-dtype norm kernels) and the checkpoints alike.
    """
    for param in model.parameters():
        if param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)


def _layer_spec(arch: HFArchitecture, use_te: bool, config: Any = None, vp_stage: int | None = None):
    from megatron.core.models.gpt import gpt_layer_specs

    if arch.moe is not None or arch.linear is not None:
        block = _moe_block_spec(config, use_te, vp_stage)
        if arch.linear is not None:  # Qwen3-Next: gated DeltaNet layers, zero-centred norms
            from verl_megatron.models.families.qwen3_next_layers import use_qwen3_next_layers

            use_qwen3_next_layers(block, arch.linear, config, vp_stage)
        return block
    mla = arch.mla is not None
    if use_te:
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            qk_layernorm=arch.qk_norm or mla, multi_latent_attention=mla
        )
    spec = gpt_layer_specs.get_gpt_layer_local_spec(
        qk_layernorm=arch.qk_norm or mla, normalization="RMSNorm", multi_latent_attention=mla
    )
    _use_sdpa(spec, mla)
    return spec


def _use_sdpa(layer_spec: Any, mla: bool) -> None:
    """Same numbers as megatron's local attention, computed by one fused SDPA call (faster on
    CPU); multi-latent attention in its local form (``families/deepseek.py``)."""
    if mla:
        from verl_megatron.models.families.deepseek_layers import use_local_mla

        use_local_mla(layer_spec.submodules.self_attention)
        return
    from verl_megatron.models.sdpa_attention import SDPADotProductAttention

    layer_spec.submodules.self_attention.submodules.core_attention = SDPADotProductAttention


def _moe_block_spec(config: Any, use_te: bool, vp_stage: int | None):
    """One spec per layer of this stage: MoE layers where ``config.moe_layer_freq`` says, dense MLPs
    elsewhere. Transformer Engine (GPU): grouped-GEMM experts when ``config.moe_grouped_gemm``;
    local spec: one megatron MLP per local expert (SequentialMLP) and SDPA attention."""
    from megatron.core.models.gpt import gpt_layer_specs

    from verl_megatron.models.moe import install_expert_bias_count_fix, install_router_fallback

    install_router_fallback()
    install_expert_bias_count_fix()
    block = gpt_layer_specs.get_gpt_decoder_block_spec(
        config, use_transformer_engine=use_te, normalization="RMSNorm", vp_stage=vp_stage
    )
    if not use_te:
        for layer_spec in block.layer_specs:
            _use_sdpa(layer_spec, config.multi_latent_attention)
    return block


def build_gpt_chunks(
    hf_config: Any,
    runtime: Runtime,
    model_cfg: ModelConfig,
    *,
    value_head: bool = False,
    route: MatmulRoute | None = None,
) -> list[torch.nn.Module]:
    """Random-init megatron GPTModel chunks (one per virtual stage) for a Llama-family HF config.

    ``value_head=True`` builds the critic: the last stage ends in a :class:`ValueHead` and the
    embeddings are never tied. The layout and settings are validated before anything is built.
    ``route``: the object the model's linears, input embedding and LM head consult for their
    matmul (``models/matmul_route.py``; the caller hands the same one to the update). A model is
    routed only where the route can act, when built for the CPU; None, or a GPU build, keeps
    megatron's layers as they are.
    """
    from megatron.core.models.gpt import GPTModel

    from verl_megatron.models.families.qwen3_vl_model import vl_model_class
    from verl_megatron.models.matmul_route import route_embedding_and_head, route_spec

    config = hf_to_transformer_config(hf_config, runtime.layout, model_cfg)
    arch = read_hf_architecture(hf_config)
    padded = padded_vocab_size(arch.vocab_size, runtime.layout.tp, model_cfg.make_vocab_size_divisible_by)
    info = ModelInfo(arch, padded, value_head)
    use_te = model_cfg.resolve_use_te()
    rope = arch.rope

    # The route's kernels are CPU code (megatron's CUDA gradient_accumulation_fusion is their
    # counterpart), and only a CPU build lets the embedding and head be rebuilt for free.
    routed = route if config.use_cpu_initialization else None

    def make_chunk(pre_process: bool, post_process: bool, vp_stage: int | None) -> torch.nn.Module:
        spec = _layer_spec(arch, use_te, config, vp_stage)
        if arch.gpt_oss is not None:  # sinks, sliding windows, YaRN (families/gpt_oss_layers.py)
            from verl_megatron.models.families import gpt_oss_layers

            gpt_oss_layers.use_gpt_oss_layers(spec, arch.gpt_oss)
        if routed is not None:
            spec = route_spec(spec, routed)
        model_class, vl_kwargs = (
            (GPTModel, {})
            if arch.vl is None
            else vl_model_class(arch.vl, runtime.seed, model_cfg, value_head)
        )
        model = model_class(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=info.padded_vocab_size,
            max_sequence_length=arch.max_position_embeddings,
            pre_process=pre_process,
            post_process=post_process,
            share_embeddings_and_output_weights=info.tied_embeddings,
            position_embedding_type="rope" if arch.vl is None else "mrope",
            rotary_base=rope.theta,
            rotary_percent=rope.rotary_percent,
            seq_len_interpolation_factor=rope.factor if rope.rope_type == "linear" else None,
            vp_stage=vp_stage,
            **vl_kwargs,
        )
        if routed is not None:
            route_embedding_and_head(model, routed)
        if rope.rope_type == "llama3":
            rotary = model.rotary_pos_emb
            rotary.inv_freq = llama3_inv_freq(rotary.inv_freq, rope)
        if arch.gpt_oss is not None:
            gpt_oss_layers.use_yarn_rotary(model.rotary_pos_emb, arch.gpt_oss)
        if value_head and post_process:
            model.output_layer = ValueHead(config.hidden_size, config, runtime.seed, runtime.device)
        _cast_parameters(model, config.params_dtype)
        model.verl_model_info = info
        return model

    return build_chunks(runtime, make_chunk)
