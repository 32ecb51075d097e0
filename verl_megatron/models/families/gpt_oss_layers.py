"""GPT-OSS's core attention for megatron's local spec: sinks and per-layer sliding windows.

What the layers compute is described in ``gpt_oss.py``. Imported by the builder only (it needs megatron).
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.tensor_parallel import RowParallelLinear, set_tensor_model_parallel_attributes
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from verl_megatron.models.families.gpt_oss import (
    GptOssArchitecture,
    attend_with_sinks,
    window_allowed,
    yarn_inv_freq,
)
from verl_megatron.models.sdpa_attention import SDPADotProductAttention


def use_gpt_oss_layers(block_spec: Any, gpt: GptOssArchitecture) -> None:
    """Point every layer spec of ``block_spec`` at :class:`SinkWindowAttention` with the windows,
    and its experts' down projection at :class:`ExpertDownLinear`."""
    for layer_spec in block_spec.layer_specs:
        layer_spec.submodules.self_attention.submodules.core_attention = ModuleSpec(
            module=SinkWindowAttention, params={"layer_windows": gpt.layer_windows}
        )
        layer_spec.submodules.mlp.submodules.experts.submodules.linear_fc2 = ExpertDownLinear


class ExpertDownLinear(RowParallelLinear):
    """An expert's down projection whose output megatron may add the weighted bias to in place.

    megatron-core 0.16.1's expert MLP adds ``bias * routing weight`` to the down projection's
    output in place; at expert tp 1 that output is the input of a tp reduction returned as it is,
    which autograd refuses to modify while training. Training gets a copy (forward passes, which
    build no graph, do not need one).
    """

    def forward(self, *args: Any, **kwargs: Any) -> tuple:
        output, bias = super().forward(*args, **kwargs)
        if bias is not None and torch.is_grad_enabled():
            output = output.clone()
        return output, bias


def use_yarn_rotary(rotary: torch.nn.Module, gpt: GptOssArchitecture) -> None:
    """Give megatron's rotary table (built before its first call) YaRN's frequencies, if any."""
    inv_freq = yarn_inv_freq(gpt, rotary.inv_freq.shape[0] * 2)
    if inv_freq is not None:
        rotary.inv_freq = inv_freq.to(rotary.inv_freq.device)


class SinkWindowAttention(SDPADotProductAttention):
    """Core attention with a learnable sink logit per head (``softmax_offset``, this rank's heads)
    and, on sliding-window layers, a window over the keys (``layer_windows[layer_number - 1]``).

    Packed sequences, shared-prompt rows, batch-invariant kernels and attention dropout are
    refused: GPT-OSS runs are refused those features at start-up (``check_gpt_oss_features``).
    """

    def __init__(self, *args: Any, layer_windows: tuple[int | None, ...], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.window = layer_windows[self.layer_number - 1]
        del self.softmax_offset  # megatron's plain attribute (None) for the vanilla softmax
        device = "cpu" if self.config.use_cpu_initialization else torch.cuda.current_device()
        self.softmax_offset = torch.nn.Parameter(
            torch.zeros(self.num_attention_heads_per_partition, dtype=self.config.params_dtype, device=device)
        )
        set_tensor_model_parallel_attributes(self.softmax_offset, True, 0, 1)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """The sinks in distributed checkpoints, split by head over tp (megatron's own method saves
        ``softmax_offset`` only for ``softmax_type='learnable'``)."""
        return make_sharded_tensors_for_checkpoint(
            {"softmax_offset": self.softmax_offset}, prefix, {"softmax_offset": 0}, sharded_offsets,
            tp_group=self.tp_group, dp_cp_group=(metadata or {}).get("dp_cp_group"),
        )  # fmt: skip

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
        attn_mask_type: Any = None, attention_bias: Any = None, packed_seq_params: Any = None,
    ) -> torch.Tensor:  # fmt: skip
        """query [sq, b, heads, d], key/value [sk, b, groups, d], mask [b|1, 1, sq, sk] (True = hidden)
        -> context [sq, b, heads * d]."""
        dropout = self.attention_dropout.p if self.training else 0.0
        if packed_seq_params is not None or attention_bias is not None or self.fixed_length or dropout:
            raise NotImplementedError(
                "gpt_oss attention: packed sequences, shared-prompt rows, attention bias, bitwise parity "
                "and attention dropout are not supported"
            )
        sq, b, sk = query.shape[0], query.shape[1], key.shape[0]
        positions = torch.arange(sk, device=query.device)
        allowed = window_allowed(positions[sk - sq :, None], positions[None, :], self.window)
        if attention_mask is not None:
            allowed = allowed & ~attention_mask.bool()
        context = attend_with_sinks(
            query.permute(1, 2, 0, 3), key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3),
            allowed, self.softmax_scale, self.softmax_offset,
        )  # fmt: skip
        return context.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)
