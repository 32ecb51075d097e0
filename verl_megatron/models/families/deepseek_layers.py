"""Multi-latent attention layers for megatron's local (non-Transformer-Engine) spec.

Three fixes to megatron-core 0.16.1's MLA without Transformer Engine (what the layers are: see
``deepseek.py``): the YaRN rotary table is built where ``use_cpu_initialization`` says, the
rotary key's gradient is summed over tp, and the core attention accepts MLA's key / value widths. Imported by the builder only (it needs megatron).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.models.common.embeddings import YarnRotaryEmbedding
from megatron.core.transformer import multi_latent_attention
from megatron.core.transformer.multi_latent_attention import MLASelfAttention

from verl_megatron.models.families.deepseek import YARN_ROTARY_ARGS
from verl_megatron.models.sdpa_attention import SDPADotProductAttention

_YARN_ARGS = ("scaling_factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")  # fmt: skip


def use_local_mla(attention_spec: Any) -> None:
    """Point a local-spec MLA ``self_attention`` ModuleSpec at the classes below."""
    # Without Transformer Engine, megatron-core 0.16.1 leaves a MagicMock (not a class) as MLA's
    # ``TELinear`` while ``HAVE_TE`` stays true, and its fp8 check ``isinstance(linear_proj,
    # TELinear)`` raises TypeError. That check only matters with Transformer Engine's fp8.
    if not isinstance(multi_latent_attention.TELinear, type):
        multi_latent_attention.HAVE_TE = False
    attention_spec.module = LocalMLASelfAttention
    attention_spec.submodules.core_attention = MLACoreAttention


class _GatherKVLatent(torch.autograd.Function):
    """[..., (kv_lora_rank + rope) / tp] shards -> the whole [..., kv_lora_rank + rope] latent.

    Every tp rank uses the whole latent: its kv part through the column-parallel up projection
    (whose backward already sums the input gradient over tp) and its rotary key part, shared by
    all heads, through its own heads only. The whole gradient is therefore complete in the kv
    part and a per-rank share in the rotary part: backward sums the rotary part over tp and
    returns this rank's slice. (megatron-core 0.16.1 gathers with a plain split backward, which
    leaves out the other ranks' heads from the rotary key's gradient at tp > 1.)
    """

    @staticmethod
    def forward(ctx: Any, shard: torch.Tensor, group: Any, rope_dim: int) -> torch.Tensor:
        ctx.group, ctx.rope_dim = group, rope_dim
        parts = [torch.empty_like(shard) for _ in range(group.size())]
        dist.all_gather(parts, shard.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        rope = grad[..., -ctx.rope_dim :].contiguous()
        dist.all_reduce(rope, group=ctx.group)
        whole = torch.cat([grad[..., : -ctx.rope_dim], rope], dim=-1)
        return whole.chunk(ctx.group.size(), dim=-1)[ctx.group.rank()].contiguous(), None, None


class LocalMLASelfAttention(MLASelfAttention):
    """megatron's ``MLASelfAttention`` whose YaRN rotary table honours ``use_cpu_initialization``,
    and whose rotary key gets its whole gradient at tp > 1 (:class:`_GatherKVLatent`).

    megatron-core 0.16.1 builds MLA's ``YarnRotaryEmbedding`` without passing
    ``use_cpu_initialization``, so it allocates on ``torch.cuda.current_device()``, which fails
    without a GPU. The layer is built with plain-rope settings, then given the YaRN table built
    with the config's own flag; the softmax scale (from ``rotary_scaling_factor`` and
    ``mscale_all_dim``) does not depend on the rope type.
    """

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        self._build(config, *args, **kwargs)
        if self.pg_collection.tp.size() > 1:
            self.linear_kv_down_proj.register_forward_hook(self._gather_kv_latent)

    def _gather_kv_latent(self, module: Any, args: Any, output: tuple) -> tuple:
        """The kv down projection's output whole on every tp rank, with the gradient of its rotary
        key part summed over tp (megatron's own gather keeps each rank's share only)."""
        latent, bias = output
        return _GatherKVLatent.apply(latent, self.pg_collection.tp, self.config.qk_pos_emb_head_dim), bias

    def _build(self, config: Any, *args: Any, **kwargs: Any) -> None:
        if config.rope_type != "yarn":
            super().__init__(config, *args, **kwargs)
            return
        plain = copy.copy(config)
        plain.rope_type = "rope"
        super().__init__(plain, *args, **kwargs)
        self.config = config
        yarn = {arg: getattr(config, YARN_ROTARY_ARGS.get(arg, arg)) for arg in _YARN_ARGS}
        self.rotary_pos_emb = YarnRotaryEmbedding(
            config.qk_pos_emb_head_dim,
            rotary_base=config.rotary_base,
            use_cpu_initialization=config.use_cpu_initialization,
            cp_group=self.pg_collection.cp,
            **yarn,
        )


class MLACoreAttention(SDPADotProductAttention):
    """The local spec's core attention for MLA: megatron's MLA passes the key and value widths
    (``k_channels``, ``v_channels``), which megatron's ``DotProductAttention`` does not take in
    0.16.1; the widths come from the tensors (and ``kv_channels`` = the value width)."""

    def __init__(
        self, *args: Any, k_channels: int | None = None, v_channels: int | None = None, **kwargs: Any
    ):
        super().__init__(*args, **kwargs)
