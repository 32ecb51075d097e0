"""One copy of a shared prompt per micro-batch row: GRPO groups without the repeated prefix.

A GRPO batch holds ``rollout.n`` responses to each prompt, and the padded and packed layouts
run the prompt's tokens once per response. Here the rows of one micro-batch that share a
prompt become one model row::

    [ prompt (right-aligned in P columns) | response 1 (Rw columns) | ... | response n ]

Linears, norms and the MLP see the prompt once (at prompt 64 / response 128 / n=8 that is
8704 instead of 12288 positions). Attention keeps every response apart: a prompt query sees
the prompt causally; a query of response k sees the whole prompt and response k causally.
Rotary positions are those of the unshared sequence: prompt column c keeps position c and
response column j of every slot gets P + j, so each query-key distance is the unshared one
(left padding of P - p columns shifts both sides equally). The prompt's keys and values get
the gradients of all n responses summed, which is the sum the unshared layout computes over
n copies, in another order.

The model row also carries the full [G, 1, S, S] boolean mask (True = hidden), so megatron's
own attention computes the same thing; ``SDPADotProductAttention`` recognises the layout
attached to that mask and attends prompt and responses separately instead of scoring all
S x S pairs.

Rows whose response tokens are not a contiguous prefix of the response columns, or a micro-batch
where sharing would not save positions, keep the ordinary layout.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from verl_megatron.distributed.modules import unwrap

__all__ = ["SharedPrefix", "attend", "shared_prefix_inputs"]

# A micro-batch is laid out shared only when that needs at most this fraction of the
# positions of the padded layout (the extra attention calls cost a little).
_MIN_SAVING = 0.9
# Upper bound on the [G, 1, S, S] mask's elements (bytes); past it the ordinary layouts are used.
_MAX_MASK_ELEMENTS = 1 << 26


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
    _masks: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def width(self) -> int:
        return self.prompt_width + self.slots * self.slot_width

    def masks(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``_slot_masks`` on ``device``, built once per micro-batch (every layer reads them)."""
        if device not in self._masks:
            self._masks[device] = _slot_masks(self, device)
        return self._masks[device]


def _slot_masks(layout: SharedPrefix, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
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


def _prompt_groups(prompts: list[tuple[int, ...]]) -> list[list[int]]:
    """Row positions grouped by identical prompt, in order of first appearance."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, key in enumerate(prompts):
        groups.setdefault(key, []).append(i)
    return list(groups.values())


def shared_prefix_inputs(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, responses: torch.Tensor, padded_width: int
):
    """Shared-prompt ModelInputs for one micro-batch's rows, or None where the layout does not apply
    or would not save positions over ``padded_width`` columns per row."""
    from verl_megatron.workers.batching import _PAD_ID, ModelInputs, _response_columns

    _response_columns(attention_mask, responses.shape[1])  # its one-line errors first
    rows, tr = responses.shape
    tp = input_ids.shape[1] - tr
    valid = attention_mask.bool()
    resp_len = valid[:, tp:].sum(dim=-1)
    # each response's tokens must fill the first columns of its response (no holes)
    if not bool(valid[:, tp:].eq(torch.arange(tr)[None, :] < resp_len[:, None]).all()):
        return None
    prompts = [tuple(input_ids[i, :tp][valid[i, :tp]].tolist()) for i in range(rows)]
    groups = _prompt_groups(prompts)
    p = max(len(prompts[g[0]]) for g in groups)
    n = max(len(g) for g in groups)
    w = max(int(resp_len.max()), 1)
    s = p + n * w
    num = len(groups)
    if num * s > _MIN_SAVING * rows * padded_width or num * s * s > _MAX_MASK_ELEMENTS:
        return None

    ids = torch.full((num, s), _PAD_ID, dtype=input_ids.dtype)
    positions = torch.zeros((num, s), dtype=torch.long)
    padding = torch.ones((num, s), dtype=torch.bool)
    key_valid = torch.zeros((num, p), dtype=torch.bool)
    gather = torch.zeros((rows, tr), dtype=torch.long)
    for gi, members in enumerate(groups):
        prompt = torch.tensor(prompts[members[0]], dtype=input_ids.dtype)
        plen = prompt.numel()
        ids[gi, p - plen : p] = prompt
        positions[gi, p - plen : p] = torch.arange(plen)
        padding[gi, p - plen : p] = False
        key_valid[gi, p - plen : p] = True
        for k, row in enumerate(members):
            length = int(resp_len[row])
            if length == 0:
                continue
            start = p + k * w
            ids[gi, start : start + length] = responses[row, :length]
            positions[gi, start : start + length] = plen + torch.arange(length)
            padding[gi, start : start + length] = False
            # the output before each response token predicts it: the prompt's last column for the first
            flat = gi * s + start + torch.arange(length) - 1
            flat[0] = gi * s + p - 1
            gather[row, :length] = flat
    resp_valid = valid[:, tp:]
    rotary = torch.cat((torch.arange(p), (p + torch.arange(w)).repeat(n)))
    layout = SharedPrefix(prompt_width=p, slots=n, slot_width=w, key_valid=key_valid, rotary_index=rotary)
    mask = full_mask(layout)
    mask.shared_prefix = layout
    return ModelInputs(
        input_ids=ids,
        position_ids=positions,
        attention_mask=mask,
        packed_seq_params=None,
        gather_index=gather,
        response_valid=resp_valid,
        labels=responses,
        padding=padding,
        shared_prefix=layout,
    )


def unsupported_reason(chunks) -> str | None:
    """Why these model chunks cannot take shared-prompt rows (None: they can)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from verl_megatron.models.sdpa_attention import SDPADotProductAttention

    for chunk in chunks:
        model = unwrap(chunk)
        config = model.config
        if getattr(config, "context_parallel_size", 1) > 1 or getattr(config, "sequence_parallel", False):
            return "context or sequence parallelism splits the sequence"
        if getattr(config, "num_moe_experts", None) or getattr(config, "mtp_num_layers", None):
            return "mixture-of-experts routing replay and multi-token prediction read token positions"
        kind = getattr(model, "position_embedding_type", None)
        if kind == "rope" and type(getattr(model, "rotary_pos_emb", None)) is not RotaryEmbedding:
            return "only megatron's plain RotaryEmbedding takes per-column positions"
        if kind not in ("rope", "learned_absolute", "none"):
            return f"position embedding {kind!r}"
        cores = [m for m in model.modules() if hasattr(m, "attn_mask_type") and hasattr(m, "softmax_scale")]
        for core in cores:
            if not isinstance(core, SDPADotProductAttention):
                return f"attention {type(core).__name__} (only the SDPA core attention of the local spec)"
            if core.attention_dropout.p or not core._sdpa_applies(None, None):
                return "attention dropout, query-key layer scaling, softmax offsets or windows"
    return None


class PrefixSharing:
    """Rotary-position hooks for shared-prompt micro-batches (see the module docstring).

    megatron's GPTModel computes rotary embeddings for columns 0..S-1; while installed, a
    forward hook re-indexes them by the current micro-batch's ``rotary_index``.
    """

    def __init__(self, chunks) -> None:
        self.chunks = chunks
        self._rotary = [
            model.rotary_pos_emb
            for model in map(unwrap, chunks)
            if getattr(model, "position_embedding_type", None) == "rope"
        ]
        self._index: torch.Tensor | None = None

    def prepare(self, inputs) -> None:
        """Call before a micro-batch's forward."""
        layout = inputs.shared_prefix
        self._index = None if layout is None else layout.rotary_index

    def _hook(self, module, args, output):
        if self._index is None:
            return output
        return output.index_select(0, self._index.to(output.device))

    @contextlib.contextmanager
    def installed(self):
        handles = [rotary.register_forward_hook(self._hook) for rotary in self._rotary]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            self._index = None

    def batch_invariant(self) -> bool:
        """True while the model runs the rollout's bitwise parity kernels (no sharing then)."""
        from verl_megatron.models import batch_invariant

        return batch_invariant.key_length(self.chunks) is not None
