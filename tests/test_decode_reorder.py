"""ChunkDecoder.reorder copies only the cache columns written so far while they are at most half
the cache (rollout/decode.py ``_rows``): those columns equal a whole copy's, for a column axis of 2
([B, groups, L, D]) or 1 (MLA's [B, L, C]); past half, and for a state without a column axis
(DeltaNet), the copy is whole. Generation through it is held to transformers and to recomputed
log-probs in tests/test_rollout_native.py (a column too few there fails them)."""

from __future__ import annotations

import torch

from verl_megatron.rollout.decode import _rows


def test_reorder_copies_the_written_columns_while_they_are_few():
    g = torch.Generator().manual_seed(0)
    rows = torch.tensor([2, 0, 0, 1, 2])
    for shape, axis, filled in (((3, 2, 9, 4), 2, 4), ((3, 9, 6), 1, 1), ((3, 9, 6), 1, 4)):
        cache = torch.randn(shape, generator=g)
        got = _rows(cache, rows, filled, axis).narrow(axis, 0, filled)
        want = cache.index_select(0, rows).narrow(axis, 0, filled)
        assert torch.equal(got, want), f"max diff {(got - want).abs().max():.3g} for {shape}, axis {axis}"
    for filled, axis in ((5, 2), (9, 2), (3, None), (None, 2)):  # past half, no column axis, not given
        cache = torch.randn(3, 2, 9, 4, generator=g)
        assert torch.equal(_rows(cache, rows, filled, axis), cache.index_select(0, rows)), (filled, axis)
