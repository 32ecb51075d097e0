"""Multi-latent attention (DeepSeek-V3) in the native decoder: a cache of the compressed latent.

The decoder's cache for an MLA layer holds what MLA compresses each token to: the normalized kv
latent ``c_kv`` [B, T, kv_lora_rank] and the shared rotary key ``k_pe`` [B, T, rope] (already
rotated), replicated on every tp rank. Attention runs in the absorbed form, per head h of this tp
rank, with the kv up projection's rows for h split into W_UK [nope, kv_lora_rank] and W_UV
[v, kv_lora_rank]:

    scores  = ((q_nope W_UK) . c_kv + q_pe . k_pe) * softmax_scale     (mscale folded in, as in training)
    context = (softmax(scores) c_kv) W_UV^T

which equals attention over the decompressed keys ``[c_kv W_UK^T, k_pe]`` and values
``c_kv W_UV^T`` (a key bias would add a constant per query, which softmax ignores; a value bias is
added to the context). The prompt goes through the same path. Per token and layer the cache
holds ``kv_lora_rank + rope`` numbers instead of ``heads * (nope + rope + v)``: 4 heads x
(24 + 16) / (32 + 8) = 4x less in the tests' tiny model, 128 x (192 + 128) / (512 + 64) = 71x
less for DeepSeek-V3 (at tp > 1 the decompressed cache would be split over tp, the latent is not).

Rotary embeddings use each row's own positions (the decoder's ``positions``) and megatron's own
``apply_rotary_pos_emb`` with the layer's rotary table and YaRN ``mscale``, as in training.
"""

from __future__ import annotations

import torch

__all__ = ["MLARotary", "mla_cache_shapes", "mla_store_and_attend"]


class MLARotary:
    """The rotary table of an MLA model for positions 0..max_len-1 (from its first layer)."""

    def __init__(self, attention: torch.nn.Module, max_len: int) -> None:
        table = attention.rotary_pos_emb(max_len)
        # megatron's YarnRotaryEmbedding returns (table, mscale); the plain one the table alone.
        self.freqs, self.mscale = table if isinstance(table, tuple) else (table, 1.0)
        self.freqs = self.freqs.reshape(max_len, -1)  # [T_max, R]

    def at(self, positions: torch.Tensor) -> torch.Tensor:
        """positions [B, s] -> freqs [s, B, 1, R]."""
        return self.freqs[positions].transpose(0, 1).unsqueeze(2)


def mla_cache_shapes(attention: torch.nn.Module, batch: int, max_len: int) -> tuple[tuple, tuple]:
    """Shapes of one MLA layer's cache: the kv latent and the rotary key (the same on every tp rank)."""
    config = attention.config
    return (batch, max_len, config.kv_lora_rank), (batch, max_len, config.qk_pos_emb_head_dim)


def _whole(latent: torch.Tensor, width: int) -> torch.Tensor:
    """A column-parallel down projection's output gathered over tp where it is a shard."""
    if latent.shape[-1] == width:
        return latent
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    return gather_from_tensor_model_parallel_region(latent)


def _query_and_latent(
    attention: torch.nn.Module, hidden: torch.Tensor, freqs: torch.Tensor, mscale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden [s, B, H] (normed) -> q_nope [s, B, heads, nope], q_pe [s, B, heads, rope] (rotated),
    the normalized kv latent [s, B, kv_lora_rank] and the rotated key k_pe [s, B, rope]."""
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

    config, heads = attention.config, attention.num_attention_heads_per_partition
    nope, rope = config.qk_head_dim, config.qk_pos_emb_head_dim
    if config.q_lora_rank is not None:
        q_latent, _ = attention.linear_q_down_proj(hidden)
        query, _ = attention.linear_q_up_proj(attention.q_layernorm(_whole(q_latent, config.q_lora_rank)))
    else:
        query, _ = attention.linear_q_proj(hidden)
    kv_latent, _ = attention.linear_kv_down_proj(hidden)
    kv_latent, k_pe = _whole(kv_latent, config.kv_lora_rank + rope).split([config.kv_lora_rank, rope], dim=-1)
    s, batch = hidden.shape[:2]
    query = query.view(s, batch, heads, nope + rope)
    cp = attention.pg_collection.cp
    q_pe = apply_rotary_pos_emb(query[..., nope:], freqs, config=config, mscale=mscale, cp_group=cp)
    k_pe = apply_rotary_pos_emb(k_pe.unsqueeze(2), freqs, config=config, mscale=mscale, cp_group=cp)
    return query[..., :nope], q_pe, attention.kv_layernorm(kv_latent), k_pe.squeeze(2)


def mla_store_and_attend(
    attention: torch.nn.Module,
    hidden: torch.Tensor,
    rotary: tuple[torch.Tensor, float],
    cache: tuple[torch.Tensor, torch.Tensor],
    mask: torch.Tensor,
    start: int,
) -> torch.Tensor:
    """Write the new tokens' latent and rotary key at cache column ``start``, then attend over columns
    < start + s in the absorbed form (module docstring).

    Args:
        attention: the layer's MLA self-attention (this tp rank's heads).
        hidden: [s, B, H] normed hidden states of the new tokens.
        rotary: (freqs [s, B, 1, R] at the new tokens' positions, YaRN mscale).
        cache: (latent [B, T_max, kv_lora_rank], rotary key [B, T_max, rope]), written in place.
        mask: [B, 1, s, start + s] additive mask.

    Returns:
        context [s, B, heads * v] for the layer's output projection.
    """
    config, heads = attention.config, attention.num_attention_heads_per_partition
    nope, v_dim = config.qk_head_dim, config.v_head_dim
    q_nope, q_pe, latent, k_pe = _query_and_latent(attention, hidden, *rotary)
    latent_cache, rope_cache = cache
    s, end = hidden.shape[0], start + hidden.shape[0]
    latent_cache[:, start:end] = latent.transpose(0, 1)
    rope_cache[:, start:end] = k_pe.transpose(0, 1)
    up = attention.linear_kv_up_proj
    w_uk, w_uv = up.weight.view(heads, nope + v_dim, -1).split([nope, v_dim], dim=1)
    q_latent = torch.einsum("sbhn,hnr->bhsr", q_nope, w_uk)
    scores = torch.einsum("bhsr,btr->bhst", q_latent, latent_cache[:, :end])
    scores = scores + torch.einsum("sbhp,btp->bhst", q_pe, rope_cache[:, :end])
    probs = torch.softmax(scores * attention.core_attention.softmax_scale + mask, dim=-1)
    context = torch.einsum("bhst,btr->bhsr", probs, latent_cache[:, :end])
    context = torch.einsum("bhsr,hvr->sbhv", context, w_uv)
    if getattr(up, "bias", None) is not None:  # only the value half matters (module docstring)
        context = context + up.bias.view(heads, nope + v_dim)[:, nope:]
    return context.reshape(s, hidden.shape[1], heads * v_dim)
