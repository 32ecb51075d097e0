"""Vocabulary-parallel log-probs and entropy equal the plain full-vocabulary computation.

Reference: torch.log_softmax over the real vocabulary columns of logits / temperature.
The tp=2 job splits a padded vocabulary (11 real columns padded to 12) over two
ranks; values and the gradients of each rank's slice must match the reference.
"""

from __future__ import annotations

import math

import torch

from verl_megatron.models.logprobs import vocab_parallel_log_probs
from verl_megatron.utils.torch_functional import entropy_from_logits

REAL_VOCAB, PADDED_VOCAB, TEMPERATURE = 11, 12, 0.7


def _inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 5, PADDED_VOCAB, generator=g) * 3
    # Padding columns hold large values: they must still get no probability.
    logits[..., REAL_VOCAB:] = 50.0
    labels = torch.randint(0, REAL_VOCAB, (3, 5), generator=g)
    w_lp = torch.randn(3, 5, generator=g)
    w_ent = torch.randn(3, 5, generator=g)
    return logits, labels, w_lp, w_ent


def _reference(logits, labels, w_lp, w_ent):
    logits = logits.clone().requires_grad_(True)
    z = logits[..., :REAL_VOCAB] / TEMPERATURE
    log_probs = torch.log_softmax(z, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    entropy = entropy_from_logits(z)
    ((log_probs * w_lp).sum() + (entropy * w_ent).sum()).backward()
    return log_probs.detach(), entropy.detach(), logits.grad


def test_hand_checked_two_token_vocabulary():
    # logits [0, ln 3] -> p = [1/4, 3/4]; at temperature 2 -> p ∝ [1, sqrt 3].
    logits = torch.tensor([[0.0, math.log(3.0)]])
    lp, ent = vocab_parallel_log_probs(logits, torch.tensor([1]), calculate_entropy=True)
    assert math.isclose(float(lp), math.log(0.75), rel_tol=1e-6)
    assert math.isclose(float(ent), -(0.25 * math.log(0.25) + 0.75 * math.log(0.75)), rel_tol=1e-6)
    lp2, _ = vocab_parallel_log_probs(logits, torch.tensor([0]), temperature=2.0)
    assert math.isclose(float(lp2), math.log(1.0 / (1.0 + math.sqrt(3.0))), rel_tol=1e-6)


def test_single_slice_matches_log_softmax_with_padded_columns():
    logits, labels, w_lp, w_ent = _inputs()
    ref_lp, ref_ent, ref_grad = _reference(logits, labels, w_lp, w_ent)
    x = logits.clone().requires_grad_(True)
    lp, ent = vocab_parallel_log_probs(
        x, labels, temperature=TEMPERATURE, vocab_size=REAL_VOCAB, calculate_entropy=True
    )
    ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
    torch.testing.assert_close(lp, ref_lp, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, ref_grad, rtol=1e-5, atol=1e-6)
    assert torch.all(x.grad[..., REAL_VOCAB:] == 0)


def test_without_entropy_returns_none_and_same_log_probs():
    logits, labels, *_ = _inputs(1)
    lp, ent = vocab_parallel_log_probs(logits, labels, temperature=TEMPERATURE, vocab_size=REAL_VOCAB)
    ref = torch.log_softmax(logits[..., :REAL_VOCAB] / TEMPERATURE, -1).gather(-1, labels[..., None])[..., 0]
    assert ent is None
    torch.testing.assert_close(lp, ref, rtol=1e-6, atol=1e-6)


def test_bad_shapes_and_temperature_raise():
    import pytest

    with pytest.raises(ValueError, match="labels"):
        vocab_parallel_log_probs(torch.zeros(2, 3, 4), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature"):
        vocab_parallel_log_probs(torch.zeros(2, 4), torch.zeros(2, dtype=torch.long), temperature=0.0)


def tp_slices_job() -> dict:
    from verl_megatron.distributed.parallel import ParallelLayout, init_runtime

    runtime = init_runtime(ParallelLayout(tp=2), seed=0)
    logits, labels, w_lp, w_ent = _inputs()
    width = PADDED_VOCAB // 2
    local = logits[..., runtime.tp_rank * width : (runtime.tp_rank + 1) * width].clone().requires_grad_(True)
    lp, ent = vocab_parallel_log_probs(
        local,
        labels,
        temperature=TEMPERATURE,
        vocab_size=REAL_VOCAB,
        tp_group=runtime.tp_group(),
        calculate_entropy=True,
    )
    ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
    return {"log_probs": lp.detach(), "entropy": ent.detach(), "grad": local.grad}


def test_tp2_slices_match_full_vocabulary(pool2):
    results = pool2.run(f"{__name__}:tp_slices_job")
    ref_lp, ref_ent, ref_grad = _reference(*_inputs())
    for r in results:
        torch.testing.assert_close(r["log_probs"], ref_lp, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(r["entropy"], ref_ent, rtol=1e-5, atol=1e-5)
    grad = torch.cat([r["grad"] for r in results], dim=-1)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-6)


def test_gradients_when_only_one_output_reaches_the_loss():
    """An unused output (entropy as a metric only, or log-probs unused) contributes no gradient,
    on the single-slice path and on the vocabulary-parallel function alike."""
    from verl_megatron.models.logprobs import _VocabParallelLogProbs

    def parallel(x, labels):
        return _VocabParallelLogProbs.apply(x, labels, 0.7, 0, None, None, True)

    def single(x, labels):
        return vocab_parallel_log_probs(x, labels, temperature=0.7, calculate_entropy=True)

    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 7, generator=g, dtype=torch.float64)
    labels = torch.tensor([0, 4, 6])
    weights = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)
    for path in (single, parallel):
        for use in ("log_probs", "entropy"):
            ours = logits.clone().requires_grad_()
            lp, ent = path(ours, labels)
            ((lp if use == "log_probs" else ent) * weights).sum().backward()
            ref = logits.clone().requires_grad_()
            log_p = torch.log_softmax(ref / 0.7, dim=-1)
            if use == "log_probs":
                value = log_p.gather(-1, labels[:, None]).squeeze(-1)
            else:
                value = -(log_p.exp() * log_p).sum(-1)
            (value * weights).sum().backward()
            # float32 inside
            torch.testing.assert_close(
                ours.grad, ref.grad, rtol=1e-5, atol=1e-6, msg=f"{path.__name__} {use}"
            )


def test_entropy_as_a_metric_builds_no_graph():
    logits = torch.randn(2, 5, requires_grad=True)
    lp, ent = vocab_parallel_log_probs(
        logits, torch.tensor([1, 2]), calculate_entropy=True, entropy_requires_grad=False
    )
    assert lp.requires_grad and not ent.requires_grad
    torch.testing.assert_close(ent, entropy_from_logits(logits.detach()))
