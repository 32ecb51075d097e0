"""What one micro-batch feeds the model, and the small pieces every layout shares.

:class:`ModelInputs` is built by the layouts (``batching``: padded and packed rows,
``shared_prefix``: shared-prompt rows, ``context_parallel``: a cp rank's share) and read by the
model runner, the output-row selector and the step functions. :func:`merge_held` brings a cp
rank's per-token results back to the whole [r, Tr] (see ``context_parallel``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from verl_megatron.models.shared_prefix_attention import SharedPrefix

__all__ = ["PAD_ID", "ModelInputs", "compact_columns", "merge_held", "response_columns"]

# Token id written into padding slots; any id works because those outputs are never read.
PAD_ID = 0


@dataclass
class ModelInputs:
    """What one micro-batch feeds a megatron GPTModel chunk.

    Attributes:
        input_ids: [b, S] padded rows or [1, N] one packed row.
        position_ids: same shape; 0-based positions within each sequence.
        attention_mask: None (the layer's causal mask) or [1, 1, N, N] bool, True = masked
            (block-diagonal causal, for packed rows without THD support).
        packed_seq_params: megatron PackedSeqParams (qkv_format="thd") or None.
        gather_index: [r, Tr] flat index into the output's b*S (or N) positions of the
            position that predicts each response token (0 where the token is padding).
            With context parallelism: [K], the response positions this cp rank holds.
        response_valid: [r, Tr] bool, response positions holding a real token.
        labels: [r, Tr] the response token ids ([K] with context parallelism).
        held_index: None, or with context parallelism [K] flat indices into the r * Tr
            response positions of those this cp rank holds (``context_parallel.slice_inputs``).
        cp_group: the context-parallel group when ``held_index`` is set.
        padding: same shape as ``input_ids``, True at filler positions (no token of the
            batch); mixture-of-experts routers leave them out of the load-balancing loss
            and expert counts (under context parallelism: this rank's positions).

    Per-token results are computed on what :meth:`gather` returns and brought to
    [r, Tr] by :meth:`merge_cp`, the same code with or without context parallelism::

        log_probs, _ = vocab_parallel_log_probs(inputs.gather(logits), inputs.labels, ...)
        log_probs = inputs.merge_cp(log_probs)  # [r, Tr] on every cp rank
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    packed_seq_params: object | None
    gather_index: torch.Tensor
    response_valid: torch.Tensor
    labels: torch.Tensor
    held_index: torch.Tensor | None = None
    cp_group: object | None = None
    output_rows_selected: bool = False
    """The model's output holds only the gather_index positions, in order ([1, K, ...]):
    ``workers.output_rows`` ran the LM head on those rows alone."""
    padding: torch.Tensor | None = None
    shared_prefix: SharedPrefix | None = None
    """The layout where rows sharing a prompt share one model row (``workers.shared_prefix``)."""
    pixel_values: torch.Tensor | None = None
    """Image rows (``workers.vl_inputs``): the micro-batch's image patches, its rows' images in row order;
    ``position_ids`` are then [3, b, S] (3-D rotary ids)."""
    image_grid_thw: torch.Tensor | None = None
    """[n, 3] (t, h, w) patches of each image of ``pixel_values``."""
    prompt_mask: torch.Tensor | None = None
    """[b, S] True at prompt tokens, laid out like ``input_ids``: only they take image features (a
    sampled response token equal to the image token id is text, as the rollout embedded it)."""

    @classmethod
    def laid_out(
        cls,
        ids: torch.Tensor,
        positions: torch.Tensor,
        padding: torch.Tensor,
        gather: torch.Tensor,
        resp_valid: torch.Tensor,
        responses: torch.Tensor,
        **layout,
    ) -> ModelInputs:
        """The inputs of a layout (``layout``: its attention_mask, packed_seq_params or
        shared_prefix); ``gather`` [r, Tr] is zeroed at padding response positions."""
        return cls(
            input_ids=ids,
            position_ids=positions,
            attention_mask=layout.pop("attention_mask", None),
            packed_seq_params=layout.pop("packed_seq_params", None),
            gather_index=torch.where(resp_valid, gather, torch.zeros_like(gather)),
            response_valid=resp_valid,
            labels=responses,
            padding=padding,
            **layout,
        )

    def gather(self, output: torch.Tensor) -> torch.Tensor:
        """Model output [b, S, ...] (or [1, N, ...]) at the response positions: [r, Tr, ...] ([K, ...] under cp)."""
        if self.output_rows_selected:
            return output.reshape(*self.gather_index.shape, *output.shape[2:])
        flat = output.reshape(-1, *output.shape[2:])
        picked = flat.index_select(0, self.gather_index.reshape(-1).to(output.device))
        return picked.view(*self.gather_index.shape, *output.shape[2:])

    def merge_cp(self, values: torch.Tensor) -> torch.Tensor:
        """Per-position results of :meth:`gather`'s positions -> [r, Tr, ...] on every cp rank.

        Without context parallelism ``values`` already are [r, Tr, ...] and come back
        unchanged. Under cp the gradient reaches only this rank's positions (see
        ``verl_megatron.workers.context_parallel``).
        """
        if self.held_index is None:
            return values
        return merge_held(values, self.held_index, tuple(self.response_valid.shape), self.cp_group)


def compact_columns(attention_mask: torch.Tensor) -> torch.Tensor:
    """[b, T] column of each valid token once the row's valid tokens are moved to the front."""
    mask = attention_mask.long()
    return mask.cumsum(dim=-1) - 1


def response_columns(
    attention_mask: torch.Tensor, response_length: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(compact columns [b, T], response columns [b, Tr], response valid [b, Tr])."""
    columns = compact_columns(attention_mask)
    resp_cols = columns[:, -response_length:]
    resp_valid = attention_mask[:, -response_length:].bool()
    bad = resp_valid & (resp_cols < 1)
    if bad.any():
        row = int(bad.any(dim=-1).nonzero()[0])
        raise ValueError(
            f"row {row}: a response token has no valid token before it (empty prompt in attention_mask); "
            "the model needs at least one prompt token to predict the first response token"
        )
    return columns, resp_cols, resp_valid


class _SumOverRanks(torch.autograd.Function):
    """All-reduce SUM forward; identity backward.

    Each cp rank contributes zeros except at the positions it holds, and every rank then
    computes the same loss from the sum. Passing the gradient through unchanged sends each
    rank's (identical) loss gradient to the positions it holds and nowhere else.
    """

    @staticmethod
    def forward(ctx, tensor, group):
        out = tensor.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def merge_held(
    values: torch.Tensor, held_index: torch.Tensor, shape: tuple[int, int], cp_group
) -> torch.Tensor:
    """Per-position values of the held response positions [K, ...] -> [r, Tr, ...] on every cp rank.

    ``held_index`` [K] are flat indices into the r * Tr response positions; every position
    is held by at most one cp rank. Positions no rank holds (padding) are 0. Differentiable:
    the gradient reaches ``values`` for the positions this rank holds.
    """
    if values.shape[0] != held_index.numel():
        raise ValueError(
            f"merge_held: {values.shape[0]} values for {held_index.numel()} held positions; pass the "
            "per-position results of ModelInputs.gather"
        )
    flat = values.new_zeros((shape[0] * shape[1], *values.shape[1:]))
    flat = flat.index_put((held_index.to(values.device),), values)
    merged = _SumOverRanks.apply(flat, cp_group)
    return merged.view(*shape, *values.shape[1:])
