"""Multi-latent attention (DeepSeek-V3) in the native decoder: queries, keys and values of new tokens.

The decoder's cache for an MLA layer holds the *decompressed* keys [B, heads, T, nope + rope] and
values [B, heads, T, v] of this tp rank's heads, and attention runs over them as over any
multi-head cache (one key/value group per head). This is the simplest correct option: the cache
is ``heads * (q_head_dim + v_head_dim) / (kv_lora_rank + rope)`` times the size of a cache of the
compressed latent (e.g. 4 heads x (24 + 16) / 40 = 4x in the tests' tiny model; 128 x 320 / 576 =
71x for DeepSeek-V3), and each new token is decompressed once, when it is written. Caching the
latent and absorbing the up projections into the query (megatron's ``cache_mla_latents``, which
needs its dynamic inference engine and FlashMLA) is not done.

Rotary embeddings use each row's own positions (the decoder's ``positions``) and megatron's own
``apply_rotary_pos_emb`` with the layer's rotary table and YaRN ``mscale``, as in training.
"""

from __future__ import annotations

import torch

__all__ = ["MLARotary", "mla_cache_shapes", "mla_query_key_value"]


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
    """Key and value cache shapes of one MLA layer on this tp rank."""
    config, heads = attention.config, attention.num_attention_heads_per_partition
    key_dim = config.qk_head_dim + config.qk_pos_emb_head_dim
    return (batch, heads, max_len, key_dim), (batch, heads, max_len, config.v_head_dim)


def _whole(latent: torch.Tensor, width: int) -> torch.Tensor:
    """A column-parallel down projection's output gathered over tp where it is a shard."""
    if latent.shape[-1] == width:
        return latent
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    return gather_from_tensor_model_parallel_region(latent)


def mla_query_key_value(
    attention: torch.nn.Module, hidden: torch.Tensor, freqs: torch.Tensor, mscale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden [s, B, H] (normed) -> query, key [s, B, heads, nope + rope] and value [s, B, heads, v]."""
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

    config, heads = attention.config, attention.num_attention_heads_per_partition
    nope, rope = config.qk_head_dim, config.qk_pos_emb_head_dim
    if config.q_lora_rank is not None:
        q_latent, _ = attention.linear_q_down_proj(hidden)
        query, _ = attention.linear_q_up_proj(attention.q_layernorm(_whole(q_latent, config.q_lora_rank)))
    else:
        query, _ = attention.linear_q_proj(hidden)
    kv_latent, _ = attention.linear_kv_down_proj(hidden)
    kv_latent, k_rope = _whole(kv_latent, config.kv_lora_rank + rope).split(
        [config.kv_lora_rank, rope], dim=-1
    )
    kv, _ = attention.linear_kv_up_proj(attention.kv_layernorm(kv_latent))
    s, batch = hidden.shape[:2]
    query = query.view(s, batch, heads, nope + rope)
    k_nope, value = kv.view(s, batch, heads, nope + config.v_head_dim).split(
        [nope, config.v_head_dim], dim=-1
    )
    cp = attention.pg_collection.cp
    q_rope = apply_rotary_pos_emb(query[..., nope:], freqs, config=config, mscale=mscale, cp_group=cp)
    k_rope = apply_rotary_pos_emb(k_rope.unsqueeze(2), freqs, config=config, mscale=mscale, cp_group=cp)
    query = torch.cat([query[..., :nope], q_rope], dim=-1)
    key = torch.cat([k_nope, k_rope.expand(-1, -1, heads, -1)], dim=-1)
    return query, key, value.contiguous()
