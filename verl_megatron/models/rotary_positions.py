"""Rotary embeddings at given per-column positions, for one model call.

megatron's GPTModel computes its rotary table for columns 0..S-1 of the model row and has no
argument for other positions. Two layouts need others: packed rows under the batch-invariant
kernels (each sequence restarts at 0, bitwise like its own padded row) and shared-prompt rows
(every response slot continues from the prompt). :func:`rotary_positions` re-indexes the
table by the positions its caller passes, for the duration of one call only: nothing stays on
the model afterwards, so another caller (training or the decoder) always gets 0..S-1.

A table row depends only on its position (an outer product of the position with the inverse
frequencies, then elementwise ops), so row p of the S-row table has the bits of row p of any
other table: re-indexing gives exactly the embedding of those positions.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from verl_megatron.distributed.modules import unwrap

__all__ = ["rotary_positions"]


@contextlib.contextmanager
def rotary_positions(chunk: torch.nn.Module, positions: torch.Tensor | None) -> Iterator[None]:
    """Inside the block, ``chunk``'s rotary embedding returns its rows at ``positions`` [S]
    (the model row's column c gets position ``positions[c]``); None, or a chunk without rotary
    embeddings, changes nothing."""
    model = unwrap(chunk)
    if positions is None or getattr(model, "position_embedding_type", None) != "rope":
        yield
        return

    def at_positions(module, args, table: torch.Tensor) -> torch.Tensor:  # table [S, 1, 1, D]
        return table.index_select(0, positions.to(table.device))

    handle = model.rotary_pos_emb.register_forward_hook(at_positions)
    try:
        yield
    finally:
        handle.remove()
