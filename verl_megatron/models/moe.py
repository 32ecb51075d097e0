"""Mixture-of-experts checkpoints: what a Hugging Face MoE config says, in megatron's terms.

Supported families (``model_type``) and how their routers map onto megatron's MoE layer:

- ``qwen3_moe``: softmax router, top-k, renormalised when ``norm_topk_prob``; QK-norm.
- ``qwen2_moe``: as qwen3_moe plus one shared expert whose output is scaled by
  ``sigmoid(shared_expert_gate(x))`` (megatron's ``moe_shared_expert_gate``); q/k/v biases.
- ``qwen3_next``, ``qwen3_5_moe_text``: qwen2_moe's block (no q/k/v biases; its layers: ``models/families/qwen3_next.py``).
- ``mixtral``: softmax router, top-k always renormalised; experts named ``w1`` (gate),
  ``w3`` (up), ``w2`` (down) under ``block_sparse_moe``.
- ``deepseek_v3``, ``glm4_moe`` (GLM-4.5): sigmoid router with an expert bias, group-limited top-k,
  scaled weights, shared experts, first layers dense (:func:`read_sigmoid_moe`;
  ``models/families/deepseek.py``). GLM-4.5 has grouped-query attention with q/k/v biases, optional
  QK-norm and a partial rotary embedding (``partial_rotary_factor``, megatron's ``rotary_percent``).

Softmax-then-top-k without renormalisation is megatron's ``moe_router_pre_softmax=True``;
with renormalisation it is top-k-then-softmax (``pre_softmax=False``), the same numbers.

Load balancing: ``router_aux_loss_coef`` becomes ``moe_aux_loss_coeff``. Transformers adds
that loss only when ``output_router_logits`` is true, so the megatron aux loss is on
(``moe_router_load_balancing_type="aux_loss"``) exactly then; released Qwen/Mixtral configs
say false (verl also trains RL with it off). ``model.override_transformer_config`` can switch it.

Token dispatcher: megatron's ``alltoall`` on every machine. Its expert-parallel exchange is
``all_to_all_single`` with uneven splits, which gloo implements; the ``allgather`` dispatcher
refuses the variable sequence lengths RL micro-batches have, and ``flex`` needs DeepEP (GPU).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

MOE_MODEL_TYPES = ("qwen3_moe", "qwen2_moe", "mixtral", "qwen3_next", "qwen3_5_moe_text")
# Sigmoid routing with expert bias and groups (DeepSeek-V3): read by :func:`read_sigmoid_moe`.
SIGMOID_MOE_MODEL_TYPES = ("deepseek_v3", "glm4_moe")
# Qwen3-Next's MoE block is Qwen2-MoE's (one shared expert with a sigmoid gate).
_GATED_SHARED_EXPERT = ("qwen2_moe", "qwen3_next", "qwen3_5_moe_text")
EXPERT_BIAS_UPDATE_RATE = 1e-3
"""megatron's ``moe_router_bias_update_rate`` for sigmoid routers with an expert bias (DeepSeek-V3's
bias update speed; ``model.override_transformer_config.moe_router_bias_update_rate=0`` freezes it)."""
# Dispatchers that run without a GPU (see the module docstring).
CPU_TOKEN_DISPATCHERS = ("alltoall",)
# Routed-expert weights (global expert index): the local spec's and Transformer Engine's names.
_LOCAL_EXPERT_RE = re.compile(r"^mlp\.experts\.local_experts\.(?P<index>\d+)\.linear_fc(?P<fc>[12])\.weight$")
_GROUPED_EXPERT_RE = re.compile(r"^mlp\.experts\.linear_fc(?P<fc>[12])\.weight(?P<index>\d+)$")


@dataclass(frozen=True)
class MoEArchitecture:
    """Router and expert shapes of a mixture-of-experts checkpoint."""

    num_experts: int
    """Routed experts per MoE layer."""
    topk: int
    """Experts each token is sent to."""
    ffn_hidden_size: int
    """Intermediate size of one routed expert."""
    norm_topk_prob: bool
    """Whether the top-k routing weights are renormalised to sum to 1."""
    layer_pattern: tuple[int, ...]
    """Per layer: 1 for an MoE layer, 0 for a dense MLP (``mlp_only_layers``, ``decoder_sparse_step``)."""
    aux_loss_coeff: float
    """``router_aux_loss_coef`` of the checkpoint."""
    aux_loss_enabled: bool
    """Whether transformers trains with the aux loss (``output_router_logits``)."""
    shared_expert_size: int = 0
    """Intermediate size of the shared expert (0: none)."""
    shared_expert_gate: bool = False
    """Whether the shared expert's output is scaled by a sigmoid gate."""
    hf_block: str = "mlp"
    """HF module holding the router and experts (``mlp``, or ``block_sparse_moe`` for mixtral)."""
    hf_expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    """HF names of each expert's gate, up and down projections."""
    hf_shared_name: str = "shared_expert"
    """HF module of the shared expert (``shared_experts`` in DeepSeek-V3)."""
    score_function: str = "softmax"
    """Router scores: ``softmax`` or ``sigmoid`` (DeepSeek-V3, see ``models/families/deepseek.py``)."""
    expert_bias: bool = False
    """Whether a per-expert bias (HF ``e_score_correction_bias``) is added for the choice of experts."""
    num_groups: int = 0
    """Group-limited routing: expert groups (0: off)."""
    group_topk: int = 0
    """Group-limited routing: groups kept per token."""
    scaling_factor: float | None = None
    """Factor on the routing weights (HF ``routed_scaling_factor``); None: 1."""


def read_moe_architecture(hf_config: Any, num_layers: int) -> MoEArchitecture | None:
    """The MoE facts of ``hf_config`` (None for a dense model type)."""
    model_type = hf_config.model_type
    if model_type in SIGMOID_MOE_MODEL_TYPES:
        return read_sigmoid_moe(hf_config, num_layers)
    if model_type not in MOE_MODEL_TYPES:
        return None
    from verl_megatron.errors import ModelConfigError

    num_experts = getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", None)
    if model_type == "qwen3_next" and not num_experts:
        return None  # every layer a dense MLP
    topk = hf_config.num_experts_per_tok
    if not num_experts or not 0 < topk <= num_experts:
        raise ModelConfigError(
            f"{model_type}: num_experts={num_experts} with num_experts_per_tok={topk}: need 0 < top-k <= experts"
        )
    coeff = float(getattr(hf_config, "router_aux_loss_coef", 0.0) or 0.0)
    common = dict(
        num_experts=int(num_experts),
        topk=int(topk),
        aux_loss_coeff=coeff,
        aux_loss_enabled=bool(getattr(hf_config, "output_router_logits", False)) and coeff > 0,
    )
    if model_type == "mixtral":
        if float(getattr(hf_config, "router_jitter_noise", 0.0) or 0.0) != 0.0:
            raise ModelConfigError(
                f"mixtral: router_jitter_noise={hf_config.router_jitter_noise} is not supported; set it to 0"
            )
        return MoEArchitecture(
            ffn_hidden_size=hf_config.intermediate_size,
            norm_topk_prob=True,
            layer_pattern=(1,) * num_layers,
            hf_block="block_sparse_moe",
            hf_expert_names=("w1", "w3", "w2"),
            **common,
        )
    step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
    dense = set(getattr(hf_config, "mlp_only_layers", None) or [])
    pattern = tuple(0 if (i in dense or (i + 1) % step != 0) else 1 for i in range(num_layers))
    shared = int(getattr(hf_config, "shared_expert_intermediate_size", 0) or 0)
    return MoEArchitecture(
        ffn_hidden_size=hf_config.moe_intermediate_size,
        # Qwen3.5-MoE's router always renormalises (its config has no norm_topk_prob).
        norm_topk_prob=bool(getattr(hf_config, "norm_topk_prob", False)) or model_type == "qwen3_5_moe_text",
        layer_pattern=pattern,
        shared_expert_size=shared if model_type in _GATED_SHARED_EXPERT else 0,
        shared_expert_gate=model_type in _GATED_SHARED_EXPERT and shared > 0,
        **common,
    )


def read_sigmoid_moe(hf_config: Any, num_layers: int) -> MoEArchitecture | None:
    """DeepSeek-V3-style routing of ``hf_config`` (see ``models/families/deepseek.py``); None when no
    layer is a mixture of experts."""
    from verl_megatron.errors import ModelConfigError

    model_type = hf_config.model_type
    num_experts = int(getattr(hf_config, "n_routed_experts", None) or 0)
    first_dense = int(getattr(hf_config, "first_k_dense_replace", 0) or 0)
    pattern = tuple(0 if i < first_dense else 1 for i in range(num_layers))
    if not num_experts or not any(pattern):
        return None
    topk, groups = int(hf_config.num_experts_per_tok), int(getattr(hf_config, "n_group", 1) or 1)
    group_topk = int(getattr(hf_config, "topk_group", 1) or 1)
    if not 0 < topk <= num_experts or num_experts % groups or not 0 < group_topk <= groups:
        raise ModelConfigError(
            f"{model_type}: n_routed_experts={num_experts}, num_experts_per_tok={topk}, n_group={groups}, "
            f"topk_group={group_topk}: need top-k <= experts, experts divisible by n_group, topk_group <= n_group"
        )
    if groups > 1 and topk // group_topk != 2:
        raise ModelConfigError(
            f"{model_type}: num_experts_per_tok / topk_group = {topk}/{group_topk} must be 2 with n_group > 1 "
            "(transformers ranks a group by its top-2 scores, megatron by its top topk/topk_group)"
        )
    if topk > 1 and not bool(getattr(hf_config, "norm_topk_prob", True)):
        raise ModelConfigError(
            f"{model_type}: norm_topk_prob=false is not supported (megatron renormalises sigmoid top-k scores)"
        )
    shared = int(getattr(hf_config, "n_shared_experts", 0) or 0) * int(hf_config.moe_intermediate_size)
    return MoEArchitecture(
        num_experts=num_experts,
        topk=topk,
        ffn_hidden_size=int(hf_config.moe_intermediate_size),
        norm_topk_prob=True,
        layer_pattern=pattern,
        aux_loss_coeff=0.0,
        aux_loss_enabled=False,
        shared_expert_size=shared,
        score_function="sigmoid",
        expert_bias=True,
        num_groups=groups if groups > 1 else 0,
        group_topk=group_topk if groups > 1 else 0,
        scaling_factor=float(getattr(hf_config, "routed_scaling_factor", 1.0) or 1.0),
        hf_shared_name="shared_experts",
    )


def moe_transformer_config(moe: MoEArchitecture, *, use_te: bool, on_gpu: bool) -> dict[str, Any]:
    """The TransformerConfig fields of the MoE layers (merged into the dense ones)."""
    kwargs: dict[str, Any] = dict(
        num_moe_experts=moe.num_experts,
        moe_router_topk=moe.topk,
        moe_ffn_hidden_size=moe.ffn_hidden_size,
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not moe.norm_topk_prob,
        moe_aux_loss_coeff=moe.aux_loss_coeff,
        moe_router_load_balancing_type="aux_loss" if moe.aux_loss_enabled else "none",
        moe_layer_freq=list(moe.layer_pattern),
        moe_token_dispatcher_type="alltoall",
        # Grouped GEMM runs the local experts as one kernel: Transformer Engine on CUDA only.
        moe_grouped_gemm=use_te and on_gpu,
        # Per-layer aux losses go to megatron's tracker, read back as metrics after each step.
        moe_per_layer_logging=True,
    )
    if moe.shared_expert_size:
        kwargs["moe_shared_expert_intermediate_size"] = moe.shared_expert_size
        kwargs["moe_shared_expert_gate"] = moe.shared_expert_gate
    if moe.score_function == "sigmoid":
        kwargs.update(
            moe_router_score_function="sigmoid",
            moe_router_pre_softmax=False,
            moe_router_enable_expert_bias=moe.expert_bias,
            moe_router_bias_update_rate=EXPERT_BIAS_UPDATE_RATE,
            moe_router_num_groups=moe.num_groups or None,
            moe_router_group_topk=moe.group_topk or None,
            moe_router_topk_scaling_factor=moe.scaling_factor,
            # transformers scores the router in float32 whatever the model's dtype.
            moe_router_dtype="fp32",
        )
    return kwargs


def check_dispatcher(config_kwargs: dict[str, Any], on_gpu: bool) -> None:
    """Raise when the chosen token dispatcher cannot run on this machine."""
    from verl_megatron.errors import ModelConfigError

    dispatcher = config_kwargs.get("moe_token_dispatcher_type")
    if config_kwargs.get("num_moe_experts") and not on_gpu and dispatcher not in CPU_TOKEN_DISPATCHERS:
        raise ModelConfigError(
            f"model.override_transformer_config.moe_token_dispatcher_type={dispatcher!r} cannot run "
            f"without a GPU; CPU (gloo) supports {list(CPU_TOKEN_DISPATCHERS)}"
        )


def hf_moe_names(moe: MoEArchitecture, layer: int, rest: str) -> tuple[str, tuple[str, ...]] | None:
    """(kind, HF names) of an MoE-layer parameter ``decoder.layers.<layer>.<rest>``, or None.

    Expert indices in ``rest`` are global (see ``sharding.named_global_parameters``). Local
    spec: ``mlp.experts.local_experts.<e>.linear_fc{1,2}.weight``; Transformer Engine's grouped
    GEMM: ``mlp.experts.linear_fc{1,2}.weight<e>``.
    """
    block = f"model.layers.{layer}.{moe.hf_block}"
    gate, up, down = moe.hf_expert_names
    if rest == "mlp.router.weight":
        return "copy", (f"{block}.gate.weight",)
    expert = expert_index(rest)
    if expert is not None:
        index, fc = expert
        prefix = f"{block}.experts.{index}"
        if fc == 1:
            return "gate_up", (f"{prefix}.{gate}.weight", f"{prefix}.{up}.weight")
        return "copy", (f"{prefix}.{down}.weight",)
    if rest == "mlp.router.expert_bias":
        return "copy", (f"{block}.gate.e_score_correction_bias",)
    shared = f"{block}.{moe.hf_shared_name}"
    if rest == "mlp.shared_experts.linear_fc1.weight":
        return "gate_up", (f"{shared}.gate_proj.weight", f"{shared}.up_proj.weight")
    if rest == "mlp.shared_experts.linear_fc2.weight":
        return "copy", (f"{shared}.down_proj.weight",)
    if rest == "mlp.shared_experts.gate_weight":
        return "copy", (f"{block}.shared_expert_gate.weight",)
    return None


def expert_index(rest: str) -> tuple[int, int] | None:
    """(expert index, 1 or 2) of a routed expert's fc1/fc2 weight name, else None."""
    match = _LOCAL_EXPERT_RE.match(rest) or _GROUPED_EXPERT_RE.match(rest)
    if match is None:
        return None
    return int(match.group("index")), int(match.group("fc"))


def install_router_fallback() -> None:
    """Let megatron's router run without Transformer Engine.

    megatron-core 0.16.1's ``moe_utils`` imports ``te_general_gemm`` inside a ``try`` and, when
    Transformer Engine is absent, never defines the name, so ``RouterGatingLinearFunction``
    raises NameError instead of taking its own ``torch.mm`` branch (``te_general_gemm is None``).
    Defining it as None selects that branch; with Transformer Engine nothing is changed.
    """
    from megatron.core.transformer.moe import moe_utils

    if not getattr(moe_utils, "HAVE_TE", False) and not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def check_trainable(moe: MoEArchitecture | None, tp: int, sequence_parallel: bool) -> None:
    """Raise when megatron cannot train this MoE model under the layout.

    megatron-core's MoE layer refuses training with tp > 1 unless sequence parallelism is on
    (``MoELayer.forward``), and sequence parallelism needs Transformer Engine (GPU). Forward
    passes (check-hf, log-probs) are not affected.
    """
    from verl_megatron.errors import ModelConfigError

    if moe is not None and tp > 1 and not sequence_parallel:
        raise ModelConfigError(
            f"training a mixture-of-experts model with tp={tp} needs model.sequence_parallel=True "
            "(megatron's MoE layer requires it; it needs Transformer Engine on a GPU); on CPU use "
            "tp=1 with parallel.ep for the experts"
        )


def install_expert_bias_count_fix() -> None:
    """Let megatron count expert loads of micro-batches with padding (for the expert-bias update).

    megatron-core 0.16.1's ``TopKRouter._apply_expert_bias`` masks the [tokens, experts] routing
    map with the flattened [tokens] padding mask (True = padding) without a trailing axis, which
    raises whenever tokens != experts (and would mask the wrong cells otherwise). The replacement
    drops padding tokens per row and counts, as the method means to; without a padding mask, or
    without an expert bias, it does what megatron's does.
    """
    import torch
    from megatron.core.transformer.moe.router import TopKRouter

    if getattr(TopKRouter._apply_expert_bias, "__verl_fixed__", False):
        return

    def apply_expert_bias(self, routing_map: torch.Tensor, padding_mask: torch.Tensor | None = None) -> None:
        if self.enable_expert_bias and torch.is_grad_enabled():
            with torch.no_grad():
                if padding_mask is not None:
                    routing_map = routing_map & ~padding_mask.reshape(-1, 1)
                self.local_tokens_per_expert += routing_map.sum(dim=0)

    apply_expert_bias.__verl_fixed__ = True
    TopKRouter._apply_expert_bias = apply_expert_bias
