"""Row-chunked log-probs and entropy are bitwise the unchunked computation (issue 19).

The rollout/train parity of the bypass mode compares log-probs computed over different
numbers of rows, so chunking must not change a single bit of any row: forward values
(log-probs, entropy) and the gradient with respect to the logits, with and without an
entropy term in the loss, a temperature and padded vocabulary columns. "Unchunked" is
both one chunk of all rows and the plain autograd formulation a user writes
(``log_softmax(logits / T).gather(labels)``).
"""

from __future__ import annotations

import pytest
import torch

from tests.closeness import assert_close_report
from verl_megatron.models.logprobs import vocab_parallel_log_probs

N, V = 37, 300


def _plain(logits, labels, temperature, vocab_size, with_entropy):
    """The reference: one [N, V] log_softmax and its autograd graph."""
    z = logits[..., :vocab_size] if vocab_size is not None else logits
    log_p = torch.log_softmax(z.float() / temperature if temperature != 1.0 else z.float(), dim=-1)
    log_probs = log_p.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_p.exp() * log_p).sum(-1) if with_entropy else None
    return log_probs, entropy


def _run(fn, logits, weights):
    """(log-probs, entropy, grad of sum(w1 * lp) + sum(w2 * entropy) w.r.t. the logits)."""
    x = logits.clone().requires_grad_()
    log_probs, entropy = fn(x)
    loss = (weights[0] * log_probs).sum()
    if entropy is not None and entropy.requires_grad:
        loss = loss + (weights[1] * entropy).sum()
    loss.backward()
    out = {"log_probs": log_probs.detach(), "grad": x.grad}
    if entropy is not None:
        out["entropy"] = entropy.detach()
    return out


@pytest.mark.parametrize(
    "temperature, vocab_size, entropy_grad",
    [(1.0, None, False), (0.7, None, True), (1.0, 290, True)],
    ids=["plain", "temperature+entropy-bonus", "padded-vocab"],
)
def test_chunked_equals_unchunked_bitwise(temperature, vocab_size, entropy_grad):
    gen = torch.Generator().manual_seed(0)
    logits = 4 * torch.randn(N, V, generator=gen)
    labels = torch.randint(0, vocab_size or V, (N,), generator=gen)
    weights = torch.randn(2, N, generator=gen)

    def ours(chunk_rows):
        return lambda x: vocab_parallel_log_probs(
            x,
            labels,
            temperature=temperature,
            vocab_size=vocab_size,
            calculate_entropy=True,
            entropy_requires_grad=entropy_grad,
            chunk_rows=chunk_rows,
        )

    def plain(x):
        log_probs, entropy = _plain(x, labels, temperature, vocab_size, with_entropy=True)
        return log_probs, entropy if entropy_grad else entropy.detach()

    expected = _run(plain, logits, weights)
    whole = _run(ours(N), logits, weights)
    assert_close_report(whole, expected, rtol=0.0, atol=0.0, what="one chunk vs plain log_softmax")
    for rows in (1, 5, 16):
        chunked = _run(ours(rows), logits, weights)
        assert_close_report(chunked, whole, rtol=0.0, atol=0.0, what=f"chunks of {rows} rows vs one chunk")
    if vocab_size is not None:
        assert torch.all(whole["grad"][:, vocab_size:] == 0), "padded columns must get a zero gradient"


def test_chunked_batched_shape_and_no_grad():
    """[b, T, V] logits under no_grad (the log-prob stage): chunked == whole, shape [b, T]."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 11, V, generator=gen)
    labels = torch.randint(0, V, (3, 11), generator=gen)
    with torch.no_grad():
        whole = vocab_parallel_log_probs(logits, labels, calculate_entropy=True, chunk_rows=33)
        chunked = vocab_parallel_log_probs(logits, labels, calculate_entropy=True, chunk_rows=4)
    assert whole[0].shape == (3, 11) and whole[1].shape == (3, 11)
    assert_close_report(
        {"log_probs": chunked[0], "entropy": chunked[1]},
        {"log_probs": whole[0], "entropy": whole[1]},
        rtol=0.0,
        atol=0.0,
        what="no-grad chunked vs whole",
    )
    with pytest.raises(ValueError, match="chunk_rows must be >= 1"):
        vocab_parallel_log_probs(logits, labels, chunk_rows=0)
