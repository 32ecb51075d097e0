"""Incremental decoding over megatron GPT chunks, in place, with a static KV cache.

``ChunkDecoder`` runs this rank's model chunks (same tp/pp layout and weights as the actor) on
the new tokens of a step and returns next-token logits on the last pipeline stage. It calls
the chunks' own modules (embedding, qkv / output projections, norms, MLP, output layer), so
tensor parallelism and the layer spec (local or Transformer Engine) work as in training, but
it replaces two parts of megatron's inference path:

- attention reads a per-layer cache of shape [B, groups, T_max, head_dim] written once per
  token, with a padding-aware mask, grouped-query heads without copying the cache per head,
  and rotary embeddings applied once to each new key. megatron's ``StaticInferenceContext``
  re-applies the rotary embedding to the whole cached prefix and repeats it per query head at
  every step, and masks padding only with the local layer spec;
- rotary positions are per row (verl's ``position_ids``: the token's index in its own
  sequence), so left-padded prompts need no re-alignment.

On CPU, dense layers step through ``lean_layer.py`` instead of their modules. In a prefill of
left-padded prompts those layers' token-wise work (norms, linears) runs on the real tokens only;
attention alone sees the padded layout. Outside parity mode the rotary embedding uses a fused
form (:func:`_rotate_fused`) that differs from megatron's by float32 rounding.

Bitwise parity mode (``batch_invariance``: the ``models.batch_invariant.BatchInvariance`` the
chunks were switched to, passed at construction): the cache holds
each row's keys in canonical columns (column j = the row's j-th token: its 1-D rotary position;
not its 3-D multimodal ids, which jump after an image)
over the fixed key length L, and attention and the linear layers run through the batch-invariant
kernels, so each token's logits are bit for bit those of the training forward.

Pipeline parallelism: each step runs stage after stage; a stage sends its hidden states
[s, B, H] to the next pipeline rank (with virtual stages the last rank sends back to the first).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F

from verl_megatron.distributed.modules import unwrap
from verl_megatron.distributed.parallel import Runtime
from verl_megatron.models import batch_invariant
from verl_megatron.rollout import vl_prefill
from verl_megatron.rollout.cpu.kernels import decode_kernels
from verl_megatron.rollout.cpu.lean_layer import LeanLayer, lean_layer
from verl_megatron.rollout.cpu.packed_linear import PackedWeights, packed_linears
from verl_megatron.rollout.gpt_oss_decode import SinkWindows
from verl_megatron.rollout.mla_decode import MLARotary, mla_cache_shapes, mla_store_and_attend
from verl_megatron.rollout.qwen3_next_decode import (
    apply_output_gate,
    gdn_empty_states,
    gdn_layer_step,
    is_gdn_layer,
)

__all__ = ["ChunkDecoder", "inference_mode_for"]


@contextlib.contextmanager
def inference_mode_for(
    chunks: list[torch.nn.Module], packed: PackedWeights | None = None
) -> Iterator[list[torch.nn.Module]]:
    """Eval mode, no autograd and no sequence parallelism for the duration; yields the bare chunks.
    On CPU the linears multiply with weights packed into ``packed`` (None: packed for this
    context only; see packed_linear.py).

    Sequence parallelism splits activations along the sequence, which a one-token decoding step
    cannot be; without it the same weights compute the same function.
    """
    bare = [unwrap(c) for c in chunks]
    was_training = [m.training for m in bare]
    switched: list[tuple[torch.nn.Module, str]] = []
    for module in (m for chunk in bare for m in chunk.modules()):
        for attr in ("sequence_parallel", "reduce_scatter_embeddings"):
            if getattr(module, attr, None) is True:
                setattr(module, attr, False)
                switched.append((module, attr))
    try:
        for m in bare:
            m.eval()
        # On CPU the linears multiply with pre-packed weights (packed_linear.py).
        with torch.no_grad(), packed_linears(bare, packed):
            yield bare
    finally:
        for module, attr in switched:
            setattr(module, attr, True)
        for m, training in zip(bare, was_training):
            m.train(training)


def _check_supported(chunk: torch.nn.Module) -> None:
    config = chunk.config
    where = f"{type(chunk).__name__} (native rollout)"
    if getattr(chunk, "position_embedding_type", "rope") not in ("rope", "mrope"):
        raise NotImplementedError(f"{where}: only rotary position embeddings are supported")
    if config.rotary_interleaved:
        raise NotImplementedError(f"{where}: interleaved rotary embeddings are not supported")
    if config.context_parallel_size > 1:
        raise NotImplementedError(f"{where}: context parallelism is not supported for generation")


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [s, B, heads, D] with cos/sin [s, B, 1, R] (R <= D rotated dims),
    in megatron's arithmetic (x * cos + rotate_half(x) * sin): bitwise the training forward's."""
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    x1, x2 = x_rot.chunk(2, dim=-1)
    out = x_rot * cos + torch.cat((-x2, x1), dim=-1) * sin
    return torch.cat((out, x_pass), dim=-1) if x_pass.shape[-1] else out


def _rotate_fused(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """:func:`_rotate` with ``signed_sin`` = sin with its first half negated, so that
    rotate_half(x) * sin = [x2, x1] * signed_sin: one roll and one fused multiply-add instead of
    slicing, negating and concatenating halves (35 vs 58 us per layer at B=64; equal up to
    float32 rounding)."""
    rot = cos.shape[-1]
    x_rot = x[..., :rot]
    out = torch.addcmul(x_rot * cos, x_rot.roll(rot // 2, dims=-1), signed_sin)
    return out if rot == x.shape[-1] else torch.cat((out, x[..., rot:]), dim=-1)


class ChunkDecoder:
    """KV-cached forward of this rank's chunks, one step of new tokens at a time.

    Args:
        chunks: this rank's model chunks (bare, in eval mode: see :func:`inference_mode_for`).
        runtime: the distributed runtime (for pipeline neighbours).
        batch_size: rows B of the cache.
        max_len: columns T_max of the cache (prompt + response length).
        vocab_size: real vocabulary size; logits columns past it are tp padding.
        batch_invariance: the bitwise parity mode the chunks were switched to (None: off).
        packed: where lean layers take their packed weights (packed_linear.py; the store the
            caller passed to :func:`inference_mode_for`). None: packed for this decoder only.
    """

    def __init__(
        self,
        chunks: list[torch.nn.Module],
        runtime: Runtime,
        batch_size: int,
        max_len: int,
        vocab_size: int,
        batch_invariance: batch_invariant.BatchInvariance | None = None,
        packed: PackedWeights | None = None,
    ) -> None:
        for chunk in chunks:
            _check_supported(chunk)
        self.chunks = chunks
        self.runtime = runtime
        self.vocab_size = vocab_size
        # Bitwise parity: canonical cache columns over the model's fixed key length.
        self.parity_length = None if batch_invariance is None else batch_invariance.key_length
        if self.parity_length is not None:
            if max_len > self.parity_length:
                raise ValueError(
                    f"rollout.bitwise_parity: prompt + response = {max_len} tokens exceeds the key length "
                    f"{self.parity_length} the model was switched to (rollout.prompt_length + response_length)"
                )
            max_len = self.parity_length
        self.max_len = max_len
        config = chunks[0].config
        # Multi-latent attention: a cache of the compressed latent, own rotary (mla_decode.py).
        self.mla = None
        if config.multi_latent_attention:
            if self.parity_length is not None:
                raise NotImplementedError("rollout.bitwise_parity: multi-latent attention is not supported")
            self.mla = MLARotary(chunks[0].decoder.layers[0].self_attention, max_len)
        # GPT-OSS: attention sinks and per-layer sliding windows (gpt_oss_decode.py).
        self.sinks = SinkWindows.of(chunks)
        if self.sinks is not None and self.parity_length is not None:
            raise NotImplementedError("rollout.bitwise_parity: attention sinks are not supported")
        self.hidden_size = config.hidden_size
        self.dtype = config.params_dtype
        self.device = next(chunks[0].parameters()).device
        self.scale = config.softmax_scale or 1.0 / math.sqrt(config.kv_channels)
        if self.mla is not None:
            self.scale = chunks[0].decoder.layers[0].self_attention.core_attention.softmax_scale
        # Rotary table for positions 0..max_len-1 from the model's own module (keeps its
        # scaling / llama3 frequencies); [T_max, 1, 1, R] -> [T_max, R].
        # Multimodal rotary ids (vision-language models): also per-dim axes into the table.
        table, self.mrope_axes = vl_prefill.rotary_table(chunks[0], max_len, self.mla)
        freqs = table.reshape(max_len, -1).float()
        self.cos, sin = freqs.cos().to(self.dtype), freqs.sin()
        if self.parity_length is None:
            half = sin.shape[-1] // 2
            sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
            self.rotate = _rotate_fused
        else:  # the training forward's own arithmetic
            self.rotate = _rotate
        self.sin = sin.to(self.dtype)
        # One-token attention on CPU through the compiled kernels where they build (cpu/kernels.py).
        self.kernels = (
            decode_kernels()
            if self.parity_length is None
            and self.device.type == "cpu"
            and self.dtype == torch.float32
            and self.mla is None
            and self.sinks is None
            else None
        )
        self.caches, self.column_axes = self._empty_caches(chunks, batch_size)
        # Dense layers on CPU step through plain tensor ops (lean_layer.py); the reason each
        # other layer keeps its modules is in ``lean_skipped``.
        self.lean: list[list[LeanLayer | None]] = [[None] * len(c.decoder.layers) for c in chunks]
        self.lean_skipped: list[str] = []
        if self.parity_length is None and self.device.type == "cpu":
            tp_group = runtime.tp_group() if runtime.layout.tp > 1 else None
            store = PackedWeights(keep=False) if packed is None else packed
            for plans, chunk in zip(self.lean, chunks):
                for i, layer in enumerate(chunk.decoder.layers):
                    plans[i], reason = lean_layer(layer, tp_group, store, self.kernels)
                    if reason is not None:
                        self.lean_skipped.append(reason)

    def _empty_caches(self, chunks: list[torch.nn.Module], batch: int) -> tuple[list, list]:
        """Every layer's zero cache, and its column (token) axis: [B, groups, L, D] 2, MLA's
        [B, L, C] 1; DeltaNet's states have none."""
        layers = [chunk.decoder.layers for chunk in chunks]
        caches = [[self._empty_cache(layer, batch) for layer in chunk] for chunk in layers]
        axis = 1 if self.mla is not None else 2
        return caches, [[None if is_gdn_layer(layer) else axis for layer in chunk] for chunk in layers]

    def _empty_cache(self, layer: torch.nn.Module, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        if is_gdn_layer(layer):  # Qwen3-Next's DeltaNet: conv and recurrent states (qwen3_next_decode.py)
            return gdn_empty_states(layer, batch, self.dtype)
        attn = layer.self_attention
        groups, head_dim = attn.num_query_groups_per_partition, attn.hidden_size_per_attention_head
        shapes = [(batch, groups, self.max_len, head_dim)] * 2
        if self.mla is not None:
            shapes = mla_cache_shapes(attn, batch, self.max_len)
        return tuple(torch.zeros(shape, dtype=self.dtype, device=self.device) for shape in shapes)

    def reorder(self, rows: torch.Tensor, filled: int | None = None) -> None:
        """Keep / repeat cache rows: row i of the new cache is old row ``rows[i]`` (e.g. n samples).

        ``filled``: only cache columns 0..filled-1 hold tokens so far. Then only those are copied
        while they are at most half the cache (a prefill's repeat for n samples: 8 of 136
        columns, 0.17 instead of 2.6 ms a tensor); the others are left unset, since every layout
        writes a column before it reads it (attention reads columns < start + s after writing
        start..start+s-1), except bitwise parity's canonical slots, which attend over the whole
        cache: that copy stays whole. States without a column axis (DeltaNet) are copied whole.
        """
        if self.parity_length is not None:
            filled = None
        self.caches = [
            [tuple(_rows(t, rows, filled, axis) for t in cache) for cache, axis in zip(chunk_cache, axes)]
            for chunk_cache, axes in zip(self.caches, self.column_axes)
        ]

    def step(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        key_valid: torch.Tensor,
        start: int,
        images: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | None:
        """Run new tokens through every chunk; write their keys / values to the cache.

        Args:
            tokens: [B, s] token ids at cache columns start..start+s-1 (read on the first stage).
            positions: [B, s] rotary positions of those tokens ([B, 3, s] multimodal ids).
            key_valid: [B, >= start+s] bool, which cache columns hold real tokens.
            start: first cache column of the new tokens.
            images: (pixel values, grids) of the image tokens in ``tokens`` (read row by row).

        Returns:
            logits [B, V_pad] float32 for the token after the last new one on the last pipeline
            stage (the whole padded vocabulary on every tp rank: tp rank r's slice is columns
            [r * V_pad / tp, (r + 1) * V_pad / tp)), else None. Columns from ``vocab_size`` on
            are padding.
        """
        batch, s = positions.shape[0], positions.shape[-1]
        if positions.dim() == 3:  # [B, 3, s] multimodal rotary ids
            cos = vl_prefill.mrope_angles(self.cos, positions, self.mrope_axes).transpose(0, 1).unsqueeze(2)
            sin = vl_prefill.mrope_angles(self.sin, positions, self.mrope_axes).transpose(0, 1).unsqueeze(2)
        elif self.mla is not None:  # MLA layers rotate with megatron's own function: angles in ``cos``
            cos, sin = self.mla.at(positions), None
        else:
            cos = self.cos[positions].transpose(0, 1).unsqueeze(2)  # [s, B, 1, R]
            sin = self.sin[positions].transpose(0, 1).unsqueeze(2)
        if self.parity_length is None:
            mask = self._mask(key_valid, start, s)
            if self.sinks is not None:  # one visibility mask per window size
                mask = self.sinks.masks(mask, positions, key_valid, start)
        else:
            mask = self._canonical_slots(positions, key_valid[:, : start + s], start)
        # A prefill of left-padded prompts: lean layers run their token-wise work (norms, linears)
        # on the real tokens only, [N, 1, H] instead of [s, B, H]; attention sees the padded layout.
        real, valid = None, key_valid[:, start : start + s]  # [B, s]: the new tokens' columns
        if s > 1 and any(lean is not None for plans in self.lean for lean in plans):
            flat = valid.t().reshape(-1)  # [s * B], [s, B] order
            if not bool(flat.all()):
                real = torch.nonzero(flat).squeeze(1)
        logits = None
        for chunk, cache, plans in zip(self.chunks, self.caches, self.lean):
            deepstack = None  # Qwen3-VL: image features added after the prefill's first layers
            if chunk.pre_process and images is not None:
                hidden, deepstack = vl_prefill.embed_prompt(chunk, tokens, images)
            elif chunk.pre_process:
                hidden = chunk.embedding(input_ids=tokens, position_ids=positions)
            else:
                hidden = self._recv(s, batch)
            packed = False
            for i, (layer, (k_cache, v_cache), lean) in enumerate(zip(chunk.decoder.layers, cache, plans)):
                if lean is None:
                    if packed:
                        hidden, packed = self._unpack(hidden, real, s, batch), False
                    hidden = self._layer(layer, hidden, k_cache, v_cache, cos, sin, mask, start, valid)
                else:
                    attend = functools.partial(self._attend_qkv, k_cache, v_cache, cos, sin, mask, start)
                    if real is not None:
                        if not packed:
                            hidden, packed = hidden.reshape(s * batch, 1, -1).index_select(0, real), True
                        attend = functools.partial(self._attend_packed, attend, real, s, batch)
                    hidden = lean(hidden, attend)
                if deepstack is not None and i < len(deepstack.per_layer):  # at the prompt's image tokens
                    if packed:
                        hidden, packed = self._unpack(hidden, real, s, batch), False
                    hidden = deepstack.add(i, hidden)
            if packed:
                hidden = self._unpack(hidden, real, s, batch)
            if chunk.post_process:
                logits = self._logits(chunk, hidden[-1:])
            else:
                self._send(hidden)
        return logits

    def _mask(self, key_valid: torch.Tensor, start: int, s: int) -> torch.Tensor:
        """[B, 1, s, start+s] additive mask: 0 where attention is allowed, -inf elsewhere.

        Additive rather than boolean: scaled_dot_product_attention on CPU converts a boolean
        mask to this form in every call, i.e. once per layer instead of once per step.
        """
        end = start + s
        query_col = torch.arange(start, end, device=key_valid.device)[:, None]
        key_col = torch.arange(end, device=key_valid.device)[None, :]
        allowed = key_valid[:, None, :end] & (key_col <= query_col)[None]
        # A padding query whose earlier keys are all padding would see no key at all and give
        # NaN; letting every query see itself keeps such rows finite (their output is unused).
        allowed = (allowed | (key_col == query_col)[None]).unsqueeze(1)
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=allowed.device)
        return mask.masked_fill_(~allowed, float("-inf"))

    def _canonical_slots(self, positions: torch.Tensor, key_valid: torch.Tensor, start: int) -> dict:
        """Parity mode: where the new tokens' keys go and what each query may see.

        A token's cache column is its position in its own sequence: its 1-D position, or for
        3-D (multimodal) ids, which jump after an image, the number of real tokens before it.
        Padding tokens of a left-padded prompt are not stored, and a query sees the columns up
        to its own. ``key_valid`` [B, start + s]: the real cache columns up to the new tokens'.
        """
        valid = key_valid[:, start:]
        if self.mrope_axes is not None:
            positions = (key_valid.cumsum(-1)[:, start:] - 1).clamp(min=0)
        rows, cols = torch.nonzero(valid, as_tuple=True)
        key_col = torch.arange(self.max_len, device=positions.device)
        allowed = (key_col[None, None, :] <= positions[:, :, None]).unsqueeze(1)  # [B, 1, s, L]
        return {"rows": rows, "cols": cols, "slots": positions[rows, cols], "allowed": allowed}

    def _layer(self, layer, hidden, k_cache, v_cache, cos, sin, mask, start: int, valid) -> torch.Tensor:
        if is_gdn_layer(layer):
            return gdn_layer_step(layer, hidden, k_cache, v_cache, valid)
        attn, gate = layer.self_attention, []
        if self.mla is not None:  # a cache of the compressed latent, absorbed attention (mla_decode.py)
            rotary, cache = (cos, self.mla.mscale), (k_cache, v_cache)
            context = mla_store_and_attend(attn, layer.input_layernorm(hidden), rotary, cache, mask, start)
            return self._finish_layer(layer, attn, hidden, context, gate)
        query, key, value, *gate = attn.get_query_key_value_tensors(
            layer.input_layernorm(hidden), None, output_gate=attn.config.attention_output_gate
        )
        query, key = self.rotate(query, cos, sin), self.rotate(key, cos, sin)
        if self.parity_length is not None:
            s = query.shape[0]
            rows, cols, slots = mask["rows"], mask["cols"], mask["slots"]
            k_cache[rows, :, slots] = key[cols, rows]
            v_cache[rows, :, slots] = value[cols, rows]
            scale = attn.core_attention.softmax_scale
            out = batch_invariant.attention(
                query.permute(1, 2, 0, 3), k_cache, v_cache, mask["allowed"], scale
            )
            context = out.permute(2, 0, 1, 3).reshape(s, out.shape[0], -1)
        elif self.sinks is not None:
            context = self.sinks.store_and_attend(attn, k_cache, v_cache, query, key, value, mask, start)
        else:
            context = self._store_and_attend(k_cache, v_cache, query, key, value, mask, start)
        return self._finish_layer(layer, attn, hidden, context, gate)

    @staticmethod
    def _finish_layer(layer, attn, hidden, context, gate: list[torch.Tensor]) -> torch.Tensor:
        """Output gate (Qwen3-Next's gated attention), projection, residual, MLP."""
        if gate:
            context = apply_output_gate(context, gate[0])
        out, bias = attn.linear_proj(context)
        hidden = hidden + out if bias is None else hidden + out + bias
        out, bias = layer.mlp(layer.pre_mlp_layernorm(hidden))
        return hidden + out if bias is None else hidden + out + bias

    def _attend_qkv(self, k_cache, v_cache, cos, sin, mask, start: int, qkv: torch.Tensor) -> torch.Tensor:
        """A lean layer's attention: qkv [s, B, groups, per_group + 2, D] -> context [s, B, heads*D].

        Queries and keys are adjacent in each group, so one rotary call turns both. One new token
        on CPU: the compiled kernel turns, stores and attends in one pass over each row and group.
        """
        s, batch, groups, per_group = qkv.shape[0], qkv.shape[1], qkv.shape[2], qkv.shape[3] - 2
        if s == 1 and self.kernels is not None:
            context = self.kernels.decode_step_attention(
                qkv[0], cos.reshape(batch, -1), sin.reshape(batch, -1), k_cache, v_cache, start,
                mask.view(batch, -1), self.scale,
            )  # fmt: skip
            return context.view(1, batch, -1)
        query_key = self.rotate(qkv[:, :, :, : per_group + 1], cos.unsqueeze(2), sin.unsqueeze(2))
        query = query_key[:, :, :, :per_group].reshape(s, batch, groups * per_group, -1)
        key, value = query_key[:, :, :, per_group], qkv[:, :, :, per_group + 1]
        return self._store_and_attend(k_cache, v_cache, query, key, value, mask, start)

    @staticmethod
    def _unpack(hidden: torch.Tensor, real: torch.Tensor, s: int, batch: int) -> torch.Tensor:
        """[N, 1, ...] real tokens -> [s, B, ...] with zeros at the padding."""
        full = hidden.new_zeros(s * batch, *hidden.shape[2:])
        return full.index_copy_(0, real, hidden.squeeze(1)).view(s, batch, *hidden.shape[2:])

    @staticmethod
    def _attend_packed(attend, real: torch.Tensor, s: int, batch: int, qkv: torch.Tensor) -> torch.Tensor:
        """``attend`` for real tokens only: qkv [N, 1, ...] -> context [N, 1, heads * D].

        Padding positions get zero keys and values, which the mask hides from every real query.
        """
        context = attend(ChunkDecoder._unpack(qkv, real, s, batch))
        return context.reshape(s * batch, -1).index_select(0, real).unsqueeze(1)

    def _store_and_attend(self, k_cache, v_cache, query, key, value, mask, start: int) -> torch.Tensor:
        """Write keys / values [s, B, groups, D] at cache column ``start``, then attend with
        query [s, B, heads, D] over columns < start + s -> context [s, B, heads * D]."""
        s = query.shape[0]
        k_cache[:, :, start : start + s] = key.permute(1, 2, 0, 3)
        v_cache[:, :, start : start + s] = value.permute(1, 2, 0, 3)
        return self._attention(query, k_cache[:, :, : start + s], v_cache[:, :, : start + s], mask)

    def _attention(
        self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """query [s, B, heads, D], keys/values [B, groups, L, D], mask [B, 1, s, L] -> [s, B, heads*D].

        The query heads sharing a key/value group are stacked along the query axis, so each group's
        cached keys are used as they are, without repeating them per head.
        """
        s, batch, heads, dim = query.shape
        groups, value_dim = keys.shape[1], values.shape[-1]
        per_group = heads // groups
        if s == 1 and self.kernels is not None:
            q = query.reshape(batch, groups, per_group, dim)
            out = self.kernels.decode_attention(q, keys, values, mask.view(batch, -1), self.scale)
            return out.view(1, batch, heads * dim)
        # [s, B, G*P, D] -> [B, G, P*s, D]; megatron orders heads group-major.
        q = query.reshape(s, batch, groups, per_group, dim).permute(1, 2, 3, 0, 4)
        q = q.reshape(batch, groups, per_group * s, dim)
        if s == 1 and q.device.type == "cpu":
            # One new token without the compiled kernel: two matmuls and a softmax over
            # [B, G, P, L] beat the CPU flash kernel, whose blocking is for long queries
            # (measured 0.4-1.1 vs 0.8-2.0 ms per layer at B=64, G=2, P=4, L=80..190).
            scores = torch.matmul(q * self.scale, keys.transpose(-1, -2)).add_(mask)
            out = torch.matmul(torch.softmax(scores, dim=-1), values)
        else:
            if s > 1:
                mask = mask.repeat(1, 1, per_group, 1)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scale)
        out = out.reshape(batch, groups, per_group, s, value_dim).permute(3, 0, 1, 2, 4)
        return out.reshape(s, batch, heads * value_dim)

    def _logits(self, chunk: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        norm = getattr(chunk.decoder, "final_layernorm", None)
        if norm is not None:
            hidden = norm(hidden)
        weight = (
            chunk.shared_embedding_or_output_weight() if chunk.share_embeddings_and_output_weights else None
        )
        logits, _ = chunk.output_layer(hidden, weight=weight, runtime_gather_output=True)
        return logits[-1].float()

    def _send(self, hidden: torch.Tensor) -> None:
        dist.send(hidden.contiguous(), self.runtime.pp_peer_rank("next"), group=self.runtime.pp_group())

    def _recv(self, s: int, batch: int) -> torch.Tensor:
        hidden = torch.empty(s, batch, self.hidden_size, dtype=self.dtype, device=self.device)
        dist.recv(hidden, self.runtime.pp_peer_rank("prev"), group=self.runtime.pp_group())
        return hidden


def _rows(cache: torch.Tensor, rows: torch.Tensor, filled: int | None, axis: int | None) -> torch.Tensor:
    """``cache``'s rows ``rows``; where ``axis`` is its column axis and ``filled`` at most half of
    it, only columns 0..filled-1 are copied and the others left unset."""
    if filled is None or axis is None or 2 * filled > cache.shape[axis]:
        return cache.index_select(0, rows)
    out = cache.new_empty((rows.numel(), *cache.shape[1:]))
    out.narrow(axis, 0, filled).copy_(cache.narrow(axis, 0, filled).index_select(0, rows))
    return out
