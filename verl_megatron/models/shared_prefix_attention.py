"""Attention over shared-prompt model rows: the prompt once, each response apart.

A model row ``[ prompt (right-aligned in P columns) | response 1 (Rw columns) | ... | response n ]``
(built by ``workers/shared_prefix.py``) holds the rows of a micro-batch that share a prompt.
A prompt query sees the prompt causally; a query of response k sees the whole prompt and
response k causally. :func:`attend` computes exactly that with two SDPA calls instead of
scoring every pair of the [S, S] mask (:func:`full_mask`, what megatron's own attention would
be given).

The layout reaches the attention as an explicit argument: :class:`SharedPrefixParams`, the
``packed_seq_params`` of the model call (megatron hands that object unchanged to every core
attention), so nothing rides on the mask tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams

__all__ = ["SharedPrefix", "SharedPrefixParams", "attend", "full_mask", "slot_masks"]


@dataclass
class SharedPrefix:
    """Layout of shared-prompt model rows [G, S], S = prompt_width + slots * slot_width.

    Attributes:
        prompt_width: P, columns of the (right-aligned) prompt.
        slots: n, response slots per model row.
        slot_width: Rw, columns per response slot.
        key_valid: [G, P] bool, prompt columns holding a token.
        rotary_index: [S] rotary position of each column (c below P, P + j in a slot).
    """

    prompt_width: int
    slots: int
    slot_width: int
    key_valid: torch.Tensor
    rotary_index: torch.Tensor
    # Per-device cache of slot_masks: every layer of one micro-batch reads the same masks.
    _masks: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def width(self) -> int:
        return self.prompt_width + self.slots * self.slot_width

    def masks(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`slot_masks` on ``device``, built once per micro-batch."""
        if device not in self._masks:
            self._masks[device] = slot_masks(self, device)
        return self._masks[device]


@dataclass
class SharedPrefixParams(PackedSeqParams):
    """``packed_seq_params`` of a shared-prompt model call: megatron's sbhd format (not THD),
    plus the layout the SDPA core attention splits the attention by."""

    layout: SharedPrefix | None = None

    @classmethod
    def of(cls, layout: SharedPrefix) -> SharedPrefixParams:
        # max_seqlen sizes megatron's rotary table: one row per column of the model row.
        return cls(qkv_format="sbhd", max_seqlen_q=layout.width, max_seqlen_kv=layout.width, layout=layout)


def slot_masks(layout: SharedPrefix, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Allowed (True = may attend) masks: prompt [G, 1, P, P] and responses [G*n, 1, Rw, P + Rw]."""
    p, n, w = layout.prompt_width, layout.slots, layout.slot_width
    keys = layout.key_valid.to(device)
    g = keys.shape[0]
    causal_p = torch.ones(p, p, dtype=torch.bool, device=device).tril()
    prompt = causal_p & keys[:, None, None, :]
    # A query at a prompt padding column has no visible key; it may see itself (its output
    # is padding that nothing reads, and SDPA would give NaN for an empty row).
    prompt = prompt | torch.eye(p, dtype=torch.bool, device=device)
    causal_r = torch.ones(w, w, dtype=torch.bool, device=device).tril()
    response = torch.cat((keys[:, None, None, :].expand(g, 1, w, p), causal_r.expand(g, 1, w, w)), dim=-1)
    response = response.repeat_interleave(n, dim=0)
    return prompt, response


def attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layout: SharedPrefix,
    scale: float | None,
    gqa: bool,
) -> torch.Tensor:
    """query [S, G, heads, d], key/value [S, G, groups, d] -> context [S, G, heads, d]."""
    p, n, w = layout.prompt_width, layout.slots, layout.slot_width
    g = query.shape[1]
    allowed_p, allowed_r = layout.masks(query.device)

    def heads_first(t: torch.Tensor) -> torch.Tensor:  # [s, G, h, d] -> [G, h, s, d]
        return t.permute(1, 2, 0, 3)

    def per_slot(t: torch.Tensor) -> torch.Tensor:  # [n*w, G, h, d] -> [G*n, h, w, d]
        return t.reshape(n, w, g, *t.shape[2:]).permute(2, 0, 3, 1, 4).reshape(g * n, t.shape[2], w, -1)

    q_p, k_p, v_p = (heads_first(t[:p]) for t in (query, key, value))
    out_p = F.scaled_dot_product_attention(q_p, k_p, v_p, attn_mask=allowed_p, scale=scale, enable_gqa=gqa)

    def with_prompt(prompt: torch.Tensor, rest: torch.Tensor) -> torch.Tensor:
        shared = prompt.unsqueeze(1).expand(g, n, *prompt.shape[1:]).reshape(g * n, *prompt.shape[1:])
        return torch.cat((shared, per_slot(rest)), dim=2)

    q_r = per_slot(query[p:])
    k_r, v_r = with_prompt(k_p, key[p:]), with_prompt(v_p, value[p:])
    out_r = F.scaled_dot_product_attention(q_r, k_r, v_r, attn_mask=allowed_r, scale=scale, enable_gqa=gqa)
    # back to [S, G, h, d]: prompt columns, then slot by slot
    heads, d = query.shape[2], query.shape[3]
    out_r = out_r.reshape(g, n, heads, w, d).permute(1, 3, 0, 2, 4).reshape(n * w, g, heads, d)
    return torch.cat((out_p.permute(2, 0, 1, 3), out_r), dim=0)


def full_mask(layout: SharedPrefix) -> torch.Tensor:
    """[G, 1, S, S] bool, True where a query may NOT attend to a key (megatron's convention)."""
    p, n, w = layout.prompt_width, layout.slots, layout.slot_width
    allowed_p, allowed_r = layout.masks(layout.key_valid.device)
    g, s = layout.key_valid.shape[0], layout.width
    allowed = torch.zeros(g, 1, s, s, dtype=torch.bool)
    allowed[:, :, :p, :p] = allowed_p
    allowed_r = allowed_r.view(g, n, w, p + w)
    for k in range(n):
        rows = slice(p + k * w, p + (k + 1) * w)
        allowed[:, 0, rows, :p] = allowed_r[:, k, :, :p]
        allowed[:, 0, rows, rows] = allowed_r[:, k, :, p:]
    return ~allowed
