"""Forward-only log-probs with the LM head deferred (workers/output_rows.py ``DeferredHead``):
the output layer runs on chunks of the selected rows after the model call, so no [K, V]
float32 logits exist at once. Values equal the whole-head path within float32 noise measured
against a float64 reference; the actor-level comparison (deferred vs the head over every
position, padded and packed) is tests/test_output_rows.py.
"""

from __future__ import annotations

import torch

from verl_megatron.models.logprobs import vocab_parallel_log_probs
from verl_megatron.workers.output_rows import DeferredHead, head_log_probs


class _Head(torch.nn.Module):
    """An output layer's call convention: ``(x @ weight.T, None)``, the weight as a keyword."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[int] = []

    def forward(self, x: torch.Tensor, weight: torch.Tensor):
        self.calls.append(x.shape[0])
        return x @ weight.t(), None


def _case(dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(10, 1, 16, generator=g).to(dtype)
    weight = (torch.randn(50, 16, generator=g) * 2).to(dtype)
    labels = torch.randint(0, 47, (2, 5), generator=g)  # real vocabulary: 47 of 50 columns
    return hidden, weight, labels


def test_deferred_head_chunks_equal_the_whole_head_within_float32_noise():
    settings = {"temperature": 0.7, "vocab_size": 47, "calculate_entropy": True}
    hidden, weight, labels = _case(torch.float32)
    layer = _Head()
    head = DeferredHead(layer=layer, hidden=hidden, kwargs={"weight": weight})
    assert head.local_vocab == 50
    chunked = head_log_probs(head, labels, settings, rows=3)
    assert layer.calls == [3, 3, 3, 1]  # never more than one chunk's logits at once
    whole = vocab_parallel_log_probs((hidden @ weight.t()).view(2, 5, 50), labels, **settings)
    h64, w64, _ = _case(torch.float64)
    ref = vocab_parallel_log_probs((h64 @ w64.t()).view(2, 5, 50), labels, **settings)
    for i, name in enumerate(("log_probs", "entropy")):
        err_chunked = (chunked[i].double() - ref[i]).abs().max().item()
        err_whole = (whole[i].double() - ref[i]).abs().max().item()
        # Same per-row kernels: the chunked error is the whole path's float32 error, not larger
        # (2x its error plus one float32 ulp of the values' size, for a GEMM blocked by M).
        bound = 2 * err_whole + 4 * torch.finfo(torch.float32).eps * ref[i].abs().max().item()
        assert err_chunked <= bound, (
            f"{name}: chunked vs float64 {err_chunked:.3e} > {bound:.3e} (whole: {err_whole:.3e})"
        )
        assert chunked[i].shape == labels.shape


def test_deferred_head_refuses_a_mismatch_and_an_unrun_layer():
    hidden, weight, labels = _case(torch.float32)
    head = DeferredHead(layer=_Head(), hidden=hidden[:7], kwargs={"weight": weight})
    try:
        head_log_probs(head, labels, {"calculate_entropy": False})
    except ValueError as exc:
        assert "10 labels for 7 selected rows" in str(exc)
    else:
        raise AssertionError("10 labels for 7 rows were accepted")
    try:
        DeferredHead().logits(0, 1)
    except RuntimeError as exc:
        assert "has not run" in str(exc)
    else:
        raise AssertionError("an unrun head returned logits")
