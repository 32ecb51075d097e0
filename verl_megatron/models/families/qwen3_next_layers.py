"""Qwen3-Next layers for megatron's local spec: zero-centred RMSNorm and the gated DeltaNet.

What the layers compute and how HF weights map onto them: ``qwen3_next.py``. megatron-core
0.16.1's own ``GatedDeltaNet`` cannot be used off a GPU (its constructor requires fla and
allocates on ``torch.cuda.current_device()``); :class:`GatedDeltaNet` here has the same
parameter names and tp layout (``in_proj`` [q; k; v; z; b; a] per rank, ``conv1d`` [q; k; v]
per rank, ``A_log``, ``dt_bias``, ``out_norm``, ``out_proj``) and runs one of two kernel sets:

- the torch forms in ``gated_delta_rule.py`` (CPU, and any GPU without the kernels);
- on CUDA tensors when ``fla`` (flash-linear-attention) and ``causal_conv1d`` import, their
  ``chunk_gated_delta_rule`` and ``causal_conv1d_fn``, called as megatron-core 0.16.1's
  ``GatedDeltaNet.forward`` calls them. :func:`fast_kernels` says which. Runs that start from
  given states (the native rollout's prefill and decode steps) always use the torch forms: the
  token-by-token recurrence for one new token (a few small matmuls), the chunked one for a prefill.

Imported by the builder and the native decoder (they need megatron).
"""

from __future__ import annotations

import copy
import functools
import itertools
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec

from verl_megatron.models.families.gated_delta_rule import (
    causal_conv,
    chunk_gated_delta_rule,
    l2_normalize,
    recurrent_gated_delta_rule,
)
from verl_megatron.models.families.qwen3_next import LinearAttentionArchitecture


class ZeroCenteredRMSNorm(torch.nn.Module):
    """RMSNorm scaling by ``1 + weight`` in float32, cast back afterwards (HF's Qwen3NextRMSNorm)."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-6, **kwargs: Any) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = bool(config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)


@functools.cache
def _fla_kernels() -> tuple[Any, Any] | None:
    try:
        from causal_conv1d import causal_conv1d_fn
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
    except ImportError:
        return None
    return fla_chunk, causal_conv1d_fn


def fast_kernels(x: torch.Tensor) -> tuple[Any, Any] | None:
    """fla's chunked rule and causal-conv1d's convolution for CUDA ``x`` when both are installed."""
    return _fla_kernels() if x.is_cuda else None


def _tp_parameter(shape: tuple[int, ...], config: Any, device: torch.device) -> torch.nn.Parameter:
    """A parameter split over tp along dim 0 (megatron's attributes, read by sharding.py)."""
    from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

    param = torch.nn.Parameter(torch.empty(shape, dtype=config.params_dtype, device=device))
    set_tensor_model_parallel_attributes(param, True, 0, 1)
    return param


class GatedDeltaNet(MegatronModule):
    """Gated DeltaNet token mixer of one layer: [s, B, H] -> ([s, B, H], None), this tp rank's heads.

    ``forward`` is the training / log-prob path (states start at zero); :meth:`run` continues
    from a (conv state [B, C/tp, K-1], recurrent state [B, nv/tp, dk, dv]) pair for decoding.
    """

    core_attention = None  # no softmax attention inside (code probing a layer's core attention sees None)

    def __init__(self, config: Any, linear: LinearAttentionArchitecture, layer_number: int = 1,
                 pg_collection: Any = None, **kwargs: Any) -> None:  # fmt: skip
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        super().__init__(config)
        self.layer_number, self.linear, self.tp_group = layer_number, linear, pg_collection.tp
        tp = self.tp_group.size()
        self.nk, self.nv = linear.num_key_heads // tp, linear.num_value_heads // tp
        self.dk, self.dv = linear.key_head_dim, linear.value_head_dim
        device = torch.device("cpu") if config.use_cpu_initialization else torch.cuda.current_device()
        common = dict(config=config, init_method=config.init_method, bias=False, skip_bias_add=False,
                      is_expert=False, tp_group=self.tp_group)  # fmt: skip
        in_width = 2 * linear.key_dim + 2 * linear.value_dim + 2 * linear.num_value_heads
        self.in_proj = ColumnParallelLinear(config.hidden_size, in_width, gather_output=False, **common)
        self.conv1d = torch.nn.Module()
        self.conv1d.weight = _tp_parameter((linear.conv_dim // tp, 1, linear.conv_kernel), config, device)
        self.dt_bias = _tp_parameter((self.nv,), config, device)
        self.A_log = _tp_parameter((self.nv,), config, device)
        self.out_norm = torch.nn.Module()
        self.out_norm.weight = torch.nn.Parameter(
            torch.ones(self.dv, dtype=config.params_dtype, device=device)
        )
        common.update(init_method=config.output_layer_init_method, skip_bias_add=True)
        self.out_proj = RowParallelLinear(
            linear.value_dim, config.hidden_size, input_is_parallel=True, **common
        )
        with torch.no_grad():  # HF's initial values (the checkpoint overwrites them)
            torch.nn.init.normal_(self.conv1d.weight, std=config.init_method_std)
            self.dt_bias.fill_(1.0)
            self.A_log.copy_(torch.empty(self.nv).uniform_(1, 16).log())

    def _project(self, hidden: torch.Tensor, valid: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        """hidden [s, B, H] -> mixed q/k/v [B, C/tp, s] (before the convolution), z [B, s, nv, dv],
        beta and the log decay g [B, s, nv] (float32). Tokens not ``valid`` [B, s] get zero q/k/v,
        beta and g: they leave the recurrent state as it is."""
        mixed, _ = self.in_proj(hidden)
        mixed = mixed.transpose(0, 1)
        conv_width = 2 * self.nk * self.dk + self.nv * self.dv
        qkv, z, b, a = mixed.split([conv_width, self.nv * self.dv, self.nv, self.nv], dim=-1)
        z = z.reshape(*z.shape[:2], self.nv, self.dv)
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        beta = b.sigmoid()
        if valid is not None:
            keep = valid[..., None]
            qkv, beta, g = qkv * keep, beta * keep, g * keep
        return qkv.transpose(1, 2), z, beta, g

    def _heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Convolved [B, C/tp, s] -> q, k [B, s, nv, dk] (l2-normalised, repeated per value head), v."""
        qkv = qkv.transpose(1, 2)
        q, k, v = qkv.split([self.nk * self.dk, self.nk * self.dk, self.nv * self.dv], dim=-1)
        rep = self.nv // self.nk
        q, k = (l2_normalize(x.reshape(*x.shape[:2], self.nk, self.dk)).repeat_interleave(rep, dim=2)
                for x in (q, k))  # fmt: skip
        return q, k, v.reshape(*v.shape[:2], self.nv, self.dv)

    def _output(self, core: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """Gated norm of core [B, s, nv, dv] with gate z, then out_proj -> [s, B, H]."""
        weight = self.out_norm.weight
        if self.tp_group.size() > 1:
            from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

            # Each tp rank normalises its own heads with the shared weight: sum its gradient over tp.
            weight = copy_to_tensor_model_parallel_region(weight, group=self.tp_group)
        dtype = core.dtype
        cf = core.float()
        normed = (cf * torch.rsqrt(cf.pow(2).mean(-1, keepdim=True) + self.linear.norm_eps)).to(dtype)
        out = (weight * normed * F.silu(z.float())).to(dtype)
        out, _ = self.out_proj(out.reshape(*out.shape[:2], -1).transpose(0, 1).contiguous())
        return out

    def forward(self, hidden_states: torch.Tensor, attention_mask: Any = None, packed_seq_params: Any = None,
                **kwargs: Any) -> tuple[torch.Tensor, None]:  # fmt: skip
        """Each row's recurrence starts at zero, and again wherever a token may not attend to the
        one before it (a packed row's next sequence, a left-padded row's first real token)."""
        if kwargs.get("inference_context") is not None:
            raise ValueError(
                "gated DeltaNet layers decode through the native rollout, not megatron's context"
            )
        segments = _segments(hidden_states.shape[:2], attention_mask, packed_seq_params)
        if segments is None:
            return self.run(hidden_states)[0], None
        rows = [
            torch.cat([self.run(hidden_states[lo:hi, b : b + 1])[0] for lo, hi in row], dim=0)
            for b, row in enumerate(segments)
        ]
        return torch.cat(rows, dim=1), None

    def run(self, hidden: torch.Tensor, conv_state: torch.Tensor | None = None,
            state: torch.Tensor | None = None, valid: torch.Tensor | None = None,
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        """hidden [s, B, H] from the given states (None: zero) -> (out [s, B, H], conv state
        [B, C/tp, K-1], recurrent state [B, nv/tp, dk, dv] float32) after the s tokens.
        ``valid`` [B, s]: see :meth:`_project` (None: all)."""
        qkv, z, beta, g = self._project(hidden, valid)
        weight = self.conv1d.weight
        kernels = fast_kernels(qkv) if conv_state is None and state is None else None
        width = self.linear.conv_kernel - 1
        history = qkv.new_zeros(*qkv.shape[:2], width) if conv_state is None else conv_state.to(qkv.dtype)
        new_conv_state = torch.cat([history, qkv], dim=-1)[..., -width:]
        if kernels is not None:
            fla_chunk, conv_fn = kernels
            mixed = conv_fn(x=qkv.contiguous(), weight=weight.squeeze(1), bias=None, activation="silu")
            q, k, v = self._heads(mixed)
            # Contiguous, q/k in the model's dtype: as megatron-core 0.16.1's GatedDeltaNet passes them.
            q, k, v = (t.to(mixed.dtype).contiguous() for t in (q, k, v))
            core, new_state = fla_chunk(q, k, v, g=g, beta=beta.contiguous(), initial_state=None,
                                        output_final_state=True, use_qk_l2norm_in_kernel=False)  # fmt: skip
        else:
            q, k, v = self._heads(causal_conv(qkv, weight, history))
            rule = recurrent_gated_delta_rule if hidden.shape[0] == 1 else chunk_gated_delta_rule
            core, new_state = rule(q, k, v, g, beta, state)
        return self._output(core.to(hidden.dtype), z), new_conv_state, new_state


def _segments(shape: tuple[int, int], mask: Any, packed: Any) -> list[list[tuple[int, int]]] | None:
    """Per row of an [s, B] input, its (start, end) recurrence segments; None: one per row."""
    s, batch = shape
    if packed is not None:  # THD: one row of concatenated sequences
        cu = packed.cu_seqlens_q_padded if packed.cu_seqlens_q_padded is not None else packed.cu_seqlens_q
        bounds = [int(x) for x in cu.tolist()]
        tail = [(bounds[-1], s)] if bounds[-1] < s else []
        return [[(lo, hi) for lo, hi in itertools.pairwise(bounds) if hi > lo] + tail]
    if mask is None or mask.dtype != torch.bool or s < 2:
        return None
    # mask [B or 1, 1, s, s], True = may not attend: token i starts a segment if it cannot see i-1.
    cut = mask[:, 0].diagonal(offset=-1, dim1=-2, dim2=-1).expand(batch, -1)
    if not bool(cut.any()):
        return None
    segments = []
    for row in cut.tolist():
        starts = [0] + [i + 1 for i, c in enumerate(row) if c]
        segments.append(list(zip(starts, [*starts[1:], s])))
    return segments


def use_qwen3_next_layers(block: Any, linear: LinearAttentionArchitecture, config: Any,
                          vp_stage: int | None) -> None:  # fmt: skip
    """Turn the local spec's MoE block of this pipeline stage into Qwen3-Next's: DeltaNet layers
    where ``linear.layer_pattern`` says, zero-centred norms everywhere."""
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    specs = [copy.deepcopy(spec) for spec in block.layer_specs]
    for i, spec in enumerate(specs):
        sub = spec.submodules
        sub.input_layernorm = sub.pre_mlp_layernorm = ZeroCenteredRMSNorm
        if linear.layer_pattern[offset + i]:
            sub.self_attention = ModuleSpec(module=GatedDeltaNet, params={"linear": linear})
        else:
            sub.self_attention.submodules.q_layernorm = ZeroCenteredRMSNorm
            sub.self_attention.submodules.k_layernorm = ZeroCenteredRMSNorm
    block.layer_specs = specs
    block.layer_norm = ZeroCenteredRMSNorm
