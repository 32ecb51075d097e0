"""Context parallelism (cp): split a micro-batch's tokens over the cp ranks, merge results back.

The split is megatron's (``get_batch_on_this_cp_rank``; for packed sequences Transformer
Engine's ``thd_get_partitioned_indices``): each sequence, padded to a multiple of 2*cp
tokens, is cut into 2*cp equal chunks and cp rank r holds chunks r and 2*cp-1-r. Under
the causal mask a chunk's attention work grows with its position, so pairing each early
chunk with its mirror image gives every rank the same work. Packed (THD) rows are split
sequence by sequence, and every rank passes the whole padded ``cu_seqlens``: TE's ring
attention and megatron's rotary embedding find each rank's pieces from them.

Per-token results (log-probs, entropy, values) are computed on the response positions a
rank holds and merged with :func:`merge_held`, so every cp rank sees the whole [r, Tr]
tensor and computes the same loss. The merge's backward keeps only the gradient of the
positions the rank holds. That is the contract of ``core_algos.megatron_microbatch_loss``:
megatron's schedule multiplies each rank's loss by cp and DDP averages gradients over
dp x cp, so the cp ranks' gradients add up to the gradient of the whole micro-batch.

Transformer Engine attention (CUDA) is what makes cp work inside the model; everything in
this module is plain indexing and one all-reduce, and runs anywhere.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from verl_megatron.workers.model_inputs import ModelInputs, merge_held

__all__ = ["held_positions", "merge_held", "pad_lengths", "slice_inputs"]


def pad_lengths(lengths: Sequence[int], cp_size: int) -> list[int]:
    """Sequence lengths rounded up to a multiple of 2 * cp_size (0 stays 0)."""
    multiple = 2 * cp_size
    return [-(-int(n) // multiple) * multiple for n in lengths]


def held_positions(padded_lengths: Sequence[int], cp_size: int, cp_rank: int) -> torch.Tensor:
    """[sum(padded_lengths) / cp] positions of the packed row held by ``cp_rank``, in local order.

    For each sequence (consecutive in the packed row, each length a multiple of
    2 * cp_size): its chunk ``cp_rank`` then its chunk ``2 * cp_size - 1 - cp_rank``.
    """
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"held_positions: cp_rank={cp_rank} is outside [0, {cp_size})")
    pieces = []
    start = 0
    for length in padded_lengths:
        if length % (2 * cp_size) != 0:
            raise ValueError(
                f"held_positions: sequence length {length} is not a multiple of 2*cp = {2 * cp_size} "
                "(pad it with pad_lengths)"
            )
        chunk = length // (2 * cp_size)
        for index in (cp_rank, 2 * cp_size - 1 - cp_rank):
            pieces.append(torch.arange(start + index * chunk, start + (index + 1) * chunk))
        start += length
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)


def slice_inputs(inputs: ModelInputs, cp_size: int, cp_rank: int, cp_group) -> ModelInputs:
    """This cp rank's share of a packed THD micro-batch (see the module docstring).

    ``inputs`` must be laid out with every sequence padded to a multiple of 2 * cp_size
    (``build_micro_batches(..., cp_size=cp_size)``). The result holds [1, N / cp] tokens,
    the same ``packed_seq_params``, and gathers only the K response positions this rank
    holds: ``gather_index``, ``labels`` and ``held_index`` are [K].
    """
    params = inputs.packed_seq_params
    if params is None or getattr(params, "qkv_format", None) != "thd":
        raise ValueError(
            "context parallelism splits packed THD micro-batches only: use_remove_padding=True with "
            "Transformer Engine attention"
        )
    cu = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
    lengths = (cu[1:] - cu[:-1]).tolist()
    total = int(inputs.input_ids.shape[1])
    if sum(lengths) != total:
        raise ValueError(f"cu_seqlens cover {sum(lengths)} tokens but the packed row has {total}")
    held = held_positions(lengths, cp_size, cp_rank)
    local_of = torch.full((total,), -1, dtype=torch.long)
    local_of[held] = torch.arange(held.numel())
    # Response positions (flat over [r, Tr]) whose predicting token is on this rank.
    predictor = local_of[inputs.gather_index.reshape(-1)]
    held_index = torch.nonzero(inputs.response_valid.reshape(-1) & (predictor >= 0)).squeeze(-1)
    return ModelInputs(
        input_ids=inputs.input_ids[:, held],
        position_ids=inputs.position_ids[:, held],
        attention_mask=None,
        packed_seq_params=params,
        gather_index=predictor[held_index],
        response_valid=inputs.response_valid,
        labels=inputs.labels.reshape(-1)[held_index],
        held_index=held_index,
        cp_group=cp_group,
        padding=None if inputs.padding is None else inputs.padding[:, held],
    )
