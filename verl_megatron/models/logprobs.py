"""Log-probabilities and entropy of sampled tokens from vocabulary-parallel logits.

With tensor parallelism each rank holds a slice of the vocabulary columns of the
logits. Gathering the whole [N, V] tensor on every rank would cost V/tp times
more memory than the slice, so, like megatron's vocab-parallel cross-entropy,
only per-token scalars cross the tensor-parallel group: the row maximum
(all-reduce MAX), the softmax normaliser and the target logit (all-reduce SUM),
and for the entropy the expectation of the logits (all-reduce SUM). The backward
pass needs no communication: the gradient with respect to a rank's own columns
only depends on those columns and the reduced per-token scalars.

Columns past the real vocabulary (megatron pads the vocabulary to a multiple of
tp) are excluded: they never receive probability and get a zero gradient.

Rows (tokens) are processed in chunks of about ``CHUNK_BYTES`` of float32 logits, so
no [N, V] float32 temporary (log-softmax, probabilities, their gradients) is ever
held whole: the stage's memory stays at the logits themselves, and each chunk's
passes over the vocabulary run while it is in cache. Every row's numbers come from
the same per-row kernels whatever the chunking, so the results are bitwise those of
the unchunked computation (tests/test_logprobs_chunked.py); chunking is never over
the vocabulary, which would change the order of the softmax reductions.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["CHUNK_BYTES", "rows_per_chunk", "vocab_parallel_log_probs"]

# float32 logits per row chunk: 16 MiB is 128 rows at a 32k vocabulary. Measured on a 2-core CPU
# (forward + backward of [768, 32k]): chunks of 16-32 MiB beat no chunking by 1.2-2x, 4-8 MiB
# chunks are slower (per-op thread start-up); the stage's temporaries stay at two chunk-sized
# tensors at any batch size.
CHUNK_BYTES = 16 * 2**20


def rows_per_chunk(vocab: int, chunk_rows: int | None = None) -> int:
    """Rows per chunk of ``vocab`` float32 columns: ``chunk_rows`` (>= 1) or ``CHUNK_BYTES``' worth."""
    if chunk_rows is not None:
        if chunk_rows < 1:
            raise ValueError(f"vocab_parallel_log_probs: chunk_rows must be >= 1, got {chunk_rows}")
        return chunk_rows
    return max(1, CHUNK_BYTES // (4 * max(vocab, 1)))


def _group_size(group) -> int:
    if group is None or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def _all_reduce(tensor: torch.Tensor, op, group) -> torch.Tensor:
    if _group_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def _column_valid(num_columns: int, vocab_start: int, vocab_size: int | None, device) -> torch.Tensor | None:
    """[Vl] bool: which local columns are real vocabulary entries (None when all are)."""
    if vocab_size is None or vocab_start + num_columns <= vocab_size:
        return None
    return torch.arange(vocab_start, vocab_start + num_columns, device=device) < vocab_size


def _shifted_logits(
    logits: torch.Tensor, temperature: float, valid: torch.Tensor | None, group
) -> tuple[torch.Tensor, torch.Tensor]:
    """(z - max_z) in float32 with padded columns at -inf, and the global row max [N]."""
    z = logits.float() / temperature
    if valid is not None:
        z = z.masked_fill(~valid, float("-inf"))
    row_max = z.max(dim=-1).values
    _all_reduce(row_max, dist.ReduceOp.MAX, group)
    return z - row_max.unsqueeze(-1), row_max


class _VocabParallelLogProbs(torch.autograd.Function):
    """log p(label) and optionally the entropy H of softmax(logits / temperature), per row."""

    @staticmethod
    def forward(ctx, logits, labels, temperature, vocab_start, vocab_size, group, with_entropy):
        valid = _column_valid(logits.shape[-1], vocab_start, vocab_size, logits.device)
        z, row_max = _shifted_logits(logits, temperature, valid, group)
        exp_z = z.exp()
        sum_exp = _all_reduce(exp_z.sum(dim=-1), dist.ReduceOp.SUM, group)
        log_sum_exp = sum_exp.log()

        local = labels - vocab_start
        owned = (local >= 0) & (local < logits.shape[-1])
        picked = z.gather(-1, local.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
        target = _all_reduce(torch.where(owned, picked, torch.zeros_like(picked)), dist.ReduceOp.SUM, group)
        log_probs = target - log_sum_exp

        entropy = None
        if with_entropy:
            probs = exp_z / sum_exp.unsqueeze(-1)
            # Padded columns hold z = -inf and p = 0; where() keeps 0 * -inf out of the sum.
            expected_z = torch.where(probs > 0, probs * z, torch.zeros_like(z)).sum(dim=-1)
            entropy = log_sum_exp - _all_reduce(expected_z, dist.ReduceOp.SUM, group)

        ctx.save_for_backward(logits, row_max, log_sum_exp, local, owned, entropy)
        # An output the loss does not use (the entropy, reported as a metric with
        # entropy_coeff=0) then arrives as None in backward, and its [N, V] pass is skipped.
        ctx.set_materialize_grads(False)
        ctx.temperature = temperature
        ctx.vocab_start, ctx.vocab_size = vocab_start, vocab_size
        ctx.with_entropy = with_entropy
        if entropy is None:
            entropy = log_probs.new_zeros(0)
            ctx.mark_non_differentiable(entropy)
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        logits, row_max, log_sum_exp, local, owned, entropy = ctx.saved_tensors
        valid = _column_valid(logits.shape[-1], ctx.vocab_start, ctx.vocab_size, logits.device)
        # Recomputed from the saved input rather than kept from forward: one [N, Vl]
        # float32 tensor less held between forward and backward.
        log_p = logits.float() / ctx.temperature - (row_max + log_sum_exp).unsqueeze(-1)
        if valid is not None:
            log_p = log_p.masked_fill(~valid, float("-inf"))
        probs = log_p.exp()

        if grad_log_probs is not None:
            # d log p_y / d z_j = 1[j = y] - p_j
            grad_z = -probs * grad_log_probs.unsqueeze(-1)
            rows = torch.nonzero(owned, as_tuple=True)
            if rows[0].numel():
                index = (*rows, local[owned])
                grad_z[index] += grad_log_probs[owned]
        else:  # only the entropy reached the loss
            grad_z = torch.zeros_like(probs)
        if ctx.with_entropy and grad_entropy is not None and grad_entropy.numel():
            # dH / d z_j = -p_j (log p_j + H)
            log_p_safe = torch.where(probs > 0, log_p, torch.zeros_like(log_p))
            grad_z -= probs * (log_p_safe + entropy.unsqueeze(-1)) * grad_entropy.unsqueeze(-1)
        grad_logits = (grad_z / ctx.temperature).to(logits.dtype)
        return grad_logits, None, None, None, None, None, None


def vocab_parallel_log_probs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    vocab_size: int | None = None,
    tp_group=None,
    vocab_start: int | None = None,
    calculate_entropy: bool = False,
    entropy_requires_grad: bool = True,
    chunk_rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of `labels` and entropies under softmax(logits / temperature), vocabulary-parallel.

    Args:
        logits: [..., Vl] this rank's vocabulary slice (columns
            [vocab_start, vocab_start + Vl) of the padded vocabulary).
        labels: [...] global token ids.
        temperature: logits are divided by it first (the sampling temperature).
        vocab_size: the real vocabulary size; columns at or past it are padding and
            get no probability. None: every column is real.
        tp_group: the tensor-parallel group holding the other slices (None: no split).
        vocab_start: first global column of this slice; default rank * Vl in tp_group.
        calculate_entropy: also return the entropy of each row's distribution.
        entropy_requires_grad: False when the entropy is only reported (no entropy bonus in
            the loss): it is then computed without building an autograd graph.
        chunk_rows: rows (tokens) per chunk; default: ``CHUNK_BYTES`` of float32 logits.
            Any value gives bitwise the same results.

    Returns:
        (log_probs [...], entropy [...] or None), float32, differentiable w.r.t. logits.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"vocab_parallel_log_probs: logits {tuple(logits.shape)} must be labels {tuple(labels.shape)} + [Vl]"
        )
    if not temperature > 0:
        raise ValueError(f"vocab_parallel_log_probs: temperature must be > 0, got {temperature}")
    if vocab_start is None:
        rank = dist.get_rank(tp_group) if _group_size(tp_group) > 1 else 0
        vocab_start = rank * logits.shape[-1]
    if vocab_size is not None and vocab_size <= 0:
        raise ValueError(f"vocab_parallel_log_probs: vocab_size must be positive, got {vocab_size}")
    shape = labels.shape
    rows = rows_per_chunk(logits.shape[-1], chunk_rows)
    flat, flat_labels = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1).long()
    if _group_size(tp_group) == 1:
        log_probs, entropy = _ChunkedLogProbs.apply(
            flat,
            flat_labels,
            float(temperature),
            vocab_size,
            calculate_entropy,
            calculate_entropy and entropy_requires_grad,
            rows,
        )
    else:
        # Every rank takes the same chunks (same N), so the collectives stay matched.
        parts = [
            _VocabParallelLogProbs.apply(
                flat[s : s + rows],
                flat_labels[s : s + rows],
                float(temperature),
                int(vocab_start),
                vocab_size,
                tp_group,
                calculate_entropy,
            )
            for s in range(0, flat.shape[0], rows)
        ] or [(flat.new_zeros(0, dtype=torch.float32), flat.new_zeros(0, dtype=torch.float32))]
        log_probs = torch.cat([p[0] for p in parts])
        entropy = torch.cat([p[1] for p in parts]) if calculate_entropy else None
    return log_probs.view(shape), (entropy.view(shape) if calculate_entropy else None)


def _row_log_probs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    vocab_size: int | None,
    calculate_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The whole vocabulary on one rank, for rows [n, V]: PyTorch's fused log_softmax instead of
    the vocabulary-parallel reductions (several times faster on CPU, same numbers)."""
    if vocab_size is not None and vocab_size < logits.shape[-1]:
        logits = logits[..., :vocab_size]  # padded columns get no probability
    scaled = logits.float() if temperature == 1.0 else logits.float() / temperature
    log_p = torch.log_softmax(scaled, dim=-1)
    log_probs = log_p.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    entropy = None
    if calculate_entropy:
        if torch.is_grad_enabled() and log_p.requires_grad:
            entropy = -(log_p.exp() * log_p).sum(-1)
        else:  # the same numbers with one [n, V] temporary instead of two
            entropy = -log_p.exp().mul_(log_p).sum(-1)
    return log_probs, entropy


class _ChunkedLogProbs(torch.autograd.Function):
    """:func:`_row_log_probs` over chunks of rows of [N, V] logits, forward and backward.

    Forward keeps no [N, V] temporary: only the input is saved. Backward recomputes each
    chunk's graph with autograd and writes its gradient into the chunk's rows, so every
    row's gradient comes from exactly the ops of the unchunked autograd graph.
    """

    @staticmethod
    def forward(ctx, logits, labels, temperature, vocab_size, with_entropy, entropy_grad, rows):
        n = logits.shape[0]
        log_probs = torch.empty(n, dtype=torch.float32, device=logits.device)
        entropy = torch.empty(n, dtype=torch.float32, device=logits.device) if with_entropy else None
        for s in range(0, n, rows):
            lp, ent = _row_log_probs(
                logits[s : s + rows], labels[s : s + rows], temperature, vocab_size, with_entropy
            )
            log_probs[s : s + rows] = lp
            if entropy is not None:
                entropy[s : s + rows] = ent
        ctx.save_for_backward(logits, labels)
        ctx.args = (temperature, vocab_size, rows)
        ctx.entropy_grad = entropy_grad
        # An output the loss does not use (the entropy as a metric) arrives as None in backward.
        ctx.set_materialize_grads(False)
        if entropy is None or not entropy_grad:
            entropy = log_probs.new_zeros(0) if entropy is None else entropy
            ctx.mark_non_differentiable(entropy)
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        logits, labels = ctx.saved_tensors
        temperature, vocab_size, rows = ctx.args
        use_entropy = ctx.entropy_grad and grad_entropy is not None
        if grad_log_probs is None and not use_entropy:
            return (None,) * 7
        grad = torch.empty_like(logits)
        for s in range(0, logits.shape[0], rows):
            with torch.enable_grad():
                chunk = logits[s : s + rows].detach().requires_grad_()
                lp, ent = _row_log_probs(chunk, labels[s : s + rows], temperature, vocab_size, use_entropy)
                outputs, grads = [], []
                if grad_log_probs is not None:
                    outputs.append(lp)
                    grads.append(grad_log_probs[s : s + rows])
                if use_entropy:
                    outputs.append(ent)
                    grads.append(grad_entropy[s : s + rows])
                (grad[s : s + rows],) = torch.autograd.grad(outputs, chunk, grads)
        return grad, None, None, None, None, None, None
