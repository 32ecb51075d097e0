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
own attention computes the same thing; the model runner passes the layout itself as the call's
``packed_seq_params`` (``models.shared_prefix_attention.SharedPrefixParams``), from which
``SDPADotProductAttention`` attends prompt and responses separately instead of scoring all
S x S pairs, and re-indexes the rotary table by the layout's ``rotary_index``
(``models.rotary_positions``).

Rows whose response tokens are not a contiguous prefix of the response columns, or a micro-batch
where sharing would not save positions over the layout that would run instead, keep the ordinary
layout. That comparison is against the caller's layout: rows x padded width for padded rows, the
sum of real tokens for a packed row (``use_remove_padding``). Against the padded count a
long-tailed packed micro-batch (most responses short, one long) would take n slots of the longest
response's width and run more positions than packing does.
"""

from __future__ import annotations

import torch

from verl_megatron.distributed.modules import unwrap
from verl_megatron.models.shared_prefix_attention import SharedPrefix, attend, full_mask
from verl_megatron.workers.model_inputs import PAD_ID, ModelInputs, response_columns

__all__ = ["SharedPrefix", "attend", "full_mask", "shared_prefix_inputs", "unsupported_reason"]

# A micro-batch is laid out shared only when that needs at most this fraction of the
# positions of the layout that would run otherwise (the extra attention calls cost a little).
_MIN_SAVING = 0.9
# Upper bound on the [G, 1, S, S] mask's elements (bytes); past it the ordinary layouts are used.
_MAX_MASK_ELEMENTS = 1 << 26


def _prompt_groups(prompts: list[tuple[int, ...]]) -> list[list[int]]:
    """Row positions grouped by identical prompt, in order of first appearance."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, key in enumerate(prompts):
        groups.setdefault(key, []).append(i)
    return list(groups.values())


def shared_prefix_inputs(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    responses: torch.Tensor,
    *,
    alternative_positions: int,
):
    """Shared-prompt ModelInputs for one micro-batch's rows, or None where the layout does not apply
    or would not save positions.

    ``alternative_positions`` is what the micro-batch's other layout runs: rows x padded width
    for padded rows, the packed row's length (its real tokens) with packing. The shared layout,
    groups x (P + n x W) positions, is taken only when that is at most ``_MIN_SAVING`` of it and
    its [G, 1, S, S] mask has at most ``_MAX_MASK_ELEMENTS`` elements.
    """
    response_columns(attention_mask, responses.shape[1])  # its one-line errors first
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
    if num * s > _MIN_SAVING * alternative_positions or num * s * s > _MAX_MASK_ELEMENTS:
        return None

    ids = torch.full((num, s), PAD_ID, dtype=input_ids.dtype)
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
    shared = {"attention_mask": full_mask(layout), "shared_prefix": layout}
    return ModelInputs.laid_out(ids, positions, padding, gather, resp_valid, responses, **shared)


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
    """A model runner's shared-prompt mode: what each micro-batch's model call takes explicitly.

    megatron's GPTModel computes rotary embeddings for columns 0..S-1; a shared-prompt row's
    columns have the unshared positions ``rotary_index`` instead, which the runner applies for
    that call (``models.rotary_positions``). Holds no per-call state.
    """

    def rotary_index(self, inputs: ModelInputs) -> torch.Tensor | None:
        """[S] rotary position of each column of a shared-prompt micro-batch, else None."""
        layout = inputs.shared_prefix
        return None if layout is None else layout.rotary_index
