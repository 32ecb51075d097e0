"""The math of distillation: GKD's generalized JSD (chunked) equals TRL's GKDTrainer formula on the
same inputs, values and gradients, to float32 rounding; the reverse-KL advantages by hand."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


def _trl_jsd():
    try:  # TRL >= 0.24 keeps it under trl.experimental
        from trl.experimental.gkd import GKDTrainer
    except ImportError:
        from trl import GKDTrainer
    return GKDTrainer.generalized_jsd_loss


def _inputs(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    student = (torch.randn(3, 7, 29, generator=g) * 4).to(dtype)
    teacher = (torch.randn(3, 7, 29, generator=g) * 4).to(dtype)
    labels = torch.randint(0, 29, (3, 7), generator=g)
    labels[0, :3] = -100
    labels[2, 5:] = -100
    return student, teacher, labels


def _bound(fn, student, teacher, labels) -> float:
    """3x the float32 error of TRL's formula against itself in float64 (the rounding we may differ by)."""
    exact = fn(student.double(), teacher.double(), labels)
    return 3 * float((fn(student, teacher, labels).double() - exact).abs().max()) + 1e-7 * float(
        exact.abs().max()
    )


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("reduction", ["batchmean", "sum", "mean"])
def test_generalized_jsd_equals_trl(beta, reduction):
    from verl_megatron.algos.gkd import generalized_jsd_loss

    trl_jsd = _trl_jsd()
    student, teacher, labels = _inputs()
    for temperature, use_labels in ((1.0, True), (0.7, False)):
        lab = labels if use_labels else None

        def reference(s, t, lb, temperature=temperature):
            return trl_jsd(s, t, labels=lb, beta=beta, temperature=temperature, reduction=reduction)

        s1, s2 = student.clone().requires_grad_(), student.clone().requires_grad_()
        ours = generalized_jsd_loss(
            s1, teacher, lab, beta=beta, temperature=temperature, reduction=reduction, chunk_tokens=4
        )
        theirs = reference(s2, teacher, lab)
        bound = _bound(reference, student, teacher, lab)
        diff = abs(float(ours.detach()) - float(theirs.detach()))
        assert diff <= bound, (
            f"beta={beta} {reduction} T={temperature}: loss differs by {diff:.3g} > {bound:.3g}"
        )
        ours.backward(), theirs.backward()
        grad_diff = float((s1.grad - s2.grad).abs().max())
        assert grad_diff <= 1e-5 * float(s2.grad.abs().max()) + 1e-8, f"gradient differs by {grad_diff:.3g}"


def test_jsd_is_computed_in_chunks_of_float32(monkeypatch):
    """Never more than ``chunk_tokens`` positions of float32 [., V] at once, bf16 logits included."""
    from verl_megatron.algos import gkd

    seen = []
    rows = gkd._jsd_rows

    def spy(student, teacher, beta, temperature):
        seen.append((student.shape[0], student.dtype))
        return rows(student, teacher, beta, temperature)

    monkeypatch.setattr(gkd, "_jsd_rows", spy)
    student, teacher, labels = _inputs(torch.bfloat16)
    student.requires_grad_()
    loss = gkd.generalized_jsd_loss(student, teacher, labels, beta=0.5, chunk_tokens=5)
    loss.backward()
    kept = int((labels != -100).sum())
    forward = seen[: -(-kept // 5)]
    assert [n for n, _ in forward] == [5] * (kept // 5) + ([kept % 5] if kept % 5 else [])
    assert max(n for n, _ in seen) <= 5 and student.grad is not None and student.grad.dtype == torch.bfloat16
    # The float32 math on bf16 inputs equals the float32 math on the upcast inputs.
    exact = gkd.generalized_jsd_loss(student.detach().float(), teacher.float(), labels, beta=0.5)
    assert float(loss.detach()) == pytest.approx(float(exact), rel=1e-6)


def test_reverse_kl_advantages_by_hand():
    from verl_megatron.algos.distill import reverse_kl_advantages, reverse_kl_metrics

    student = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, float("nan"), 0.0]])
    teacher = torch.tensor([[-0.5, -4.0, -0.5], [-1.0, -1.0, float("inf")]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    rule = torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]])
    pure = reverse_kl_advantages(student, teacher, mask)
    assert pure.tolist() == [[0.5, -2.0, 0.0], [2.0, 0.0, 0.0]]  # padding stays 0, never NaN
    mixed = reverse_kl_advantages(student, teacher, mask, rule, coef=0.5)
    assert mixed.tolist() == [[1.0, -1.5, 0.5], [1.0, 0.0, 0.0]]
    metrics = reverse_kl_metrics(student, teacher, mask)
    assert metrics["distill/reverse_kl"] == pytest.approx((-0.5 + 2.0 + 0.0 - 2.0) / 4)
    assert metrics["distill/teacher_log_prob"] == pytest.approx((-0.5 - 4.0 - 0.5 - 1.0) / 4)
    with pytest.raises(ValueError, match="one shape"):
        reverse_kl_advantages(student, teacher[:, :2], mask)


def test_whitened_reverse_kl_is_a_constant_baseline_and_scale():
    from verl_megatron.algos.distill import reverse_kl_advantages

    g = torch.Generator().manual_seed(3)
    student, teacher = -torch.rand(4, 6, generator=g) * 5, -torch.rand(4, 6, generator=g) * 9
    mask = (torch.rand(4, 6, generator=g) > 0.3).long()
    rule = torch.randn(4, 6, generator=g)
    raw = reverse_kl_advantages(student, teacher, mask)
    white = reverse_kl_advantages(student, teacher, mask, whiten=True)
    kept = mask.bool()
    values = raw[kept].double()
    expected = (values - values.mean()) / values.std()
    torch.testing.assert_close(white[kept].double(), expected, rtol=1e-5, atol=1e-6)
    assert torch.all(white[~kept] == 0)
    mixed = reverse_kl_advantages(student, teacher, mask, rule, coef=2.0, whiten=True)
    torch.testing.assert_close(mixed[kept], white[kept] + 2.0 * rule[kept])


@pytest.mark.parametrize(
    ("setting", "key"),
    [
        ({"jsd_beta": 1.5}, "jsd_beta"),
        ({"jsd_temperature": 0.0}, "jsd_temperature"),
        ({"loss": "gkd"}, "loss"),
    ],
)
def test_distill_config_names_a_bad_setting(setting, key):
    from verl_megatron.workers.teacher_config import DistillConfig, TeacherConfigError

    with pytest.raises(TeacherConfigError, match=rf"^algorithm\.distill\.{key}"):
        DistillConfig(**setting)
    assert DistillConfig(loss="gkd_jsd", jsd_beta=0.0, jsd_temperature=0.5).loss == "gkd_jsd"
