"""agg_loss numbers per mode, and the Megatron micro-batch contract.

The layout test replays what megatron-core does with a 2-tuple loss: the schedule
multiplies the returned loss by cp and divides it by num_microbatches, backward runs
per micro-batch, and DDP sums the gradients over the dp x cp group and divides by
dp * cp. The result must equal the gradient of agg_loss over the global batch.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_megatron.trainer.ppo.core_algos import (
    LOSS_AGG_MODES,
    agg_loss,
    get_policy_loss_fn,
    megatron_microbatch_loss,
)

L = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
M = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 7 / 3),  # (1 + 2 + 4) / 3 tokens
        ("token-sum", 7.0),
        ("seq-mean-token-sum", 3.5),  # (3 + 4) / 2 valid rows; the empty row does not count
        ("seq-mean-token-mean", 2.75),  # (1.5 + 4) / 2
        ("seq-mean-token-sum-norm", 3.5 / 3),  # seq-mean-token-sum / T
    ],
)
def test_agg_loss_local_counts(mode: str, expected: float) -> None:
    assert agg_loss(L, M, mode).item() == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 7 / 7 * 2),  # N = 7 global tokens, dp = 2
        ("token-sum", 7 * 2),
        ("seq-mean-token-sum", 7 / 4 * 2),  # G = 4 global sequences
        ("seq-mean-token-mean", 5.5 / 4 * 2),
        ("seq-mean-token-sum-norm", 7 / 4 * 2 / 5),  # loss_scale_factor 5
    ],
)
def test_agg_loss_global_counts(mode: str, expected: float) -> None:
    got = agg_loss(L, M, mode, dp_size=2, batch_num_tokens=7, global_batch_size=4, loss_scale_factor=5)
    assert got.item() == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_agg_loss_requires_global_counts_with_dp(mode: str) -> None:
    with pytest.raises(ValueError, match="required when dp_size > 1"):
        agg_loss(L, M, mode, dp_size=2)


def test_agg_loss_unknown_mode_lists_valid_ones() -> None:
    with pytest.raises(ValueError, match="seq-mean-token-sum-norm") as err:
        agg_loss(L, M, "token-median")
    assert "token-median" in str(err.value)


def test_agg_loss_shape_mismatch() -> None:
    with pytest.raises(ValueError, match=r"loss_mat \(3, 3\) and loss_mask \(3, 2\)"):
        agg_loss(L, M[:, :2], "token-mean")


# verl 0.9.1 on an all-masked batch: token-sum has no denominator (0); every other mode is 0/0.
_VERL_ALL_MASKED = {
    "token-mean": math.nan,
    "token-sum": 0.0,
    "seq-mean-token-sum": math.nan,
    "seq-mean-token-mean": math.nan,
    "seq-mean-token-sum-norm": math.nan,
}


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_agg_loss_all_masked_default_is_verls_nan(mode: str) -> None:
    loss_mat = torch.full((2, 3), 5.0)
    for counts in ({}, {"batch_num_tokens": 0, "global_batch_size": 0}):
        got = agg_loss(loss_mat, torch.zeros(2, 3), mode, **counts).item()
        want = _VERL_ALL_MASKED[mode]
        assert (math.isnan(got) and math.isnan(want)) or got == want, (mode, counts, got, want)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_agg_loss_all_masked_robust_is_zero_with_zero_grad(mode: str) -> None:
    loss_mat = torch.full((2, 3), 5.0, requires_grad=True)
    loss = agg_loss(loss_mat, torch.zeros(2, 3), mode, robust=True)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(loss_mat.grad, torch.zeros(2, 3))
    # Global counts of 0 (a whole global batch without tokens) are also finite.
    zero_counts = {"batch_num_tokens": 0, "global_batch_size": 0}
    assert agg_loss(loss_mat, torch.zeros(2, 3), mode, **zero_counts, robust=True).item() == 0.0


def test_agg_loss_robust_keeps_nonzero_counts() -> None:
    """Only a count of exactly 0 is replaced: fractional (weighted-mask) counts stay as verl uses them."""
    mask = torch.tensor([[0.25, 0.0]])
    loss_mat = torch.tensor([[2.0, 7.0]])
    for flag in (False, True):
        assert agg_loss(loss_mat, mask, "token-mean", robust=flag).item() == 2.0  # 0.5 / 0.25


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_agg_loss_robust_ignores_nan_and_inf_under_the_mask(mode: str) -> None:
    poisoned = L.clone()
    poisoned[2] = float("nan")
    poisoned[0, 2] = float("inf")
    want = agg_loss(L, M, mode).item()
    assert agg_loss(poisoned, M, mode, robust=True).item() == pytest.approx(want)
    # verl 0.9.1: token modes shield the padding; seq modes sum L*m per row, so the inf in
    # row 0's padding gives inf*0 = NaN (the all-NaN row 2 has no token and is dropped).
    got = agg_loss(poisoned, M, mode).item()
    assert math.isnan(got) if mode.startswith("seq-") else got == pytest.approx(want), (mode, got)


def test_megatron_microbatch_loss_scales_by_num_microbatches() -> None:
    assert megatron_microbatch_loss(torch.tensor(0.5), 4).item() == 2.0
    with pytest.raises(ValueError, match="num_microbatches must be >= 1"):
        megatron_microbatch_loss(torch.tensor(0.5), 0)


# ---------------------------------------------------------------- layout equivalence

B, T, D = 10, 7, 3


def _global_batch(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[3] = 0  # fully masked rows inside a shard
    lengths[7] = 0
    mask = (torch.arange(T)[None, :] < lengths[:, None]).double()
    mask[1, 0] = 0.0  # a hole: masks need not be prefixes
    return {
        "x": torch.randn(B, T, D, generator=g, dtype=torch.float64),
        "mask": mask,
        "adv": torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, T).contiguous(),
        "noise": 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64),
    }


def _log_probs(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return -torch.nn.functional.softplus(x @ w)


def _token_loss(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    z = x @ w
    return torch.tanh(z) + 0.1 * z**2


def _split(n: int, parts: int, g: torch.Generator, min_size: int = 1) -> list[tuple[int, int]]:
    """`parts` contiguous, randomly uneven slices of range(n), each at least `min_size` long."""
    sizes = [min_size] * parts
    for part in torch.randint(0, parts, (n - parts * min_size,), generator=g).tolist():
        sizes[part] += 1
    bounds = [0, *torch.tensor(sizes).cumsum(0).tolist()]
    return list(itertools.pairwise(bounds))


def _megatron_grad(batch, w0, dp: int, cp: int, microbatches: int, seed: int, loss_of) -> torch.Tensor:
    """Gradient after megatron's schedule + DDP for a dp x cp x micro-batch split of the batch.

    `loss_of(w_live, rows, cols_live, global_info)` returns the micro-batch loss where
    only the tokens in `cols_live` carry gradient (a cp rank's own slice).
    """
    g = torch.Generator().manual_seed(seed)
    mask = batch["mask"]
    info = {
        "dp_size": dp,
        "batch_num_tokens": int(mask.sum()),
        "global_batch_size": int((mask.sum(-1) > 0).sum()),
        "loss_scale_factor": T,
    }
    total = torch.zeros_like(w0)
    for d0, d1 in _split(B, dp, g, min_size=microbatches):
        for m0, m1 in _split(d1 - d0, microbatches, g):
            rows = slice(d0 + m0, d0 + m1)
            for c0, c1 in _split(T, cp, g):
                w = w0.clone().requires_grad_(True)
                loss = loss_of(w, rows, (c0, c1), info)
                returned = megatron_microbatch_loss(loss, microbatches)
                scheduled = returned * cp / microbatches  # what forward_backward_func does
                (grad,) = torch.autograd.grad(scheduled, w)
                total += grad
    return total / (dp * cp)  # DDP: sum over dp x cp, scaled by 1 / (dp * cp)


def _live_on(tensor_fn, w, cols):
    """Values of tensor_fn(w), with gradient only through the columns [c0, c1)."""
    live = tensor_fn(w)
    frozen = tensor_fn(w.detach())
    col = torch.arange(T)
    keep = (col >= cols[0]) & (col < cols[1])
    return torch.where(keep, live, frozen)


def _trim(rows_mask: torch.Tensor) -> int:
    """Micro-batches are padded only to their own longest response (ragged T)."""
    valid_cols = torch.nonzero(rows_mask.sum(0) > 0)
    return int(valid_cols.max()) + 1 if valid_cols.numel() else 1


LAYOUTS = [(1, 1, 1), (1, 1, 3), (2, 1, 2), (2, 2, 2), (3, 1, 3), (1, 2, 1), (2, 3, 1)]


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_megatron_gradient_equals_global_batch_gradient(mode: str) -> None:
    batch = _global_batch(seed=0)
    w0 = torch.tensor([0.4, -0.3, 0.2], dtype=torch.float64)
    w = w0.clone().requires_grad_(True)
    reference = agg_loss(_token_loss(w, batch["x"]), batch["mask"], mode, loss_scale_factor=T)
    (expected,) = torch.autograd.grad(reference, w)

    def loss_of(w_live, rows, cols, info):
        x, mask = batch["x"][rows], batch["mask"][rows]
        t = _trim(mask)
        loss_mat = _live_on(lambda v: _token_loss(v, x), w_live, cols)[:, :t]
        return agg_loss(loss_mat, mask[:, :t], mode, **info)

    for i, (dp, cp, micro) in enumerate(LAYOUTS):
        got = _megatron_grad(batch, w0, dp, cp, micro, seed=i, loss_of=loss_of)
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=0, msg=f"layout dp={dp} cp={cp} mb={micro}")
    assert expected.abs().max() > 1e-3  # the check is not vacuous


class _PolicyLossCfg:
    geo_mean_valid_rows = True  # the trainer's setting: layout-invariant geo_mean


class _ActorCfg:
    policy_loss = _PolicyLossCfg()
    clip_ratio = 0.2
    clip_ratio_low = 0.2
    clip_ratio_high = 0.28
    clip_ratio_c = 3.0
    tau_pos = 1.0
    tau_neg = 1.05


@pytest.mark.parametrize(
    ("loss_mode", "agg_mode"),
    [
        ("vanilla", "token-mean"),
        ("vanilla", "seq-mean-token-sum-norm"),
        ("gspo", "seq-mean-token-mean"),
        ("sapo", "seq-mean-token-mean"),
        ("gpg", "seq-mean-token-sum"),
        ("cispo", "token-mean"),
        ("geo_mean", "token-mean"),
    ],
)
def test_registered_policy_losses_are_layout_invariant(loss_mode: str, agg_mode: str) -> None:
    batch = _global_batch(seed=1)
    w0 = torch.tensor([0.5, 0.1, -0.6], dtype=torch.float64)
    old = (_log_probs(w0, batch["x"]) + batch["noise"]).detach()
    fn = get_policy_loss_fn(loss_mode)
    w = w0.clone().requires_grad_(True)
    reference, _ = fn(old, _log_probs(w, batch["x"]), batch["adv"], batch["mask"], agg_mode, _ActorCfg())
    (expected,) = torch.autograd.grad(reference, w)

    def loss_of(w_live, rows, cols, info):
        x = batch["x"][rows]
        log_prob = _live_on(lambda v: _log_probs(v, x), w_live, cols)
        args = (old[rows], log_prob, batch["adv"][rows], batch["mask"][rows], agg_mode, _ActorCfg())
        return fn(*args, global_batch_info=info)[0]

    for i, (dp, cp, micro) in enumerate(LAYOUTS):
        got = _megatron_grad(batch, w0, dp, cp, micro, seed=10 + i, loss_of=loss_of)
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=0, msg=f"layout dp={dp} cp={cp} mb={micro}")
    assert expected.abs().max() > 1e-4


# ---------------------------------------------------------------- properties

_finite = st.floats(-100, 100, allow_nan=False, width=64)


def _t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 4),
    cols=st.integers(1, 5),
    pad=st.integers(1, 3),
    data=st.data(),
)
def test_padding_columns_do_not_change_agg_loss(rows: int, cols: int, pad: int, data) -> None:
    values = _t(data.draw(st.lists(_finite, min_size=rows * cols, max_size=rows * cols)))
    mask = torch.tensor(
        data.draw(st.lists(st.sampled_from([0.0, 1.0]), min_size=rows * cols, max_size=rows * cols))
    )
    loss_mat, loss_mask = values.view(rows, cols), mask.view(rows, cols)
    junk = _t(data.draw(st.lists(_finite, min_size=rows * pad, max_size=rows * pad))).view(rows, pad)
    padded_mat = torch.cat([loss_mat, junk], dim=1)
    padded_mask = torch.cat([loss_mask, torch.zeros(rows, pad, dtype=torch.float64)], dim=1)
    for mode in LOSS_AGG_MODES:
        # sum-norm divides by T by default, so pin the scale to compare different paddings.
        a = agg_loss(loss_mat, loss_mask, mode, loss_scale_factor=7, robust=True)
        b = agg_loss(padded_mat, padded_mask, mode, loss_scale_factor=7, robust=True)
        assert math.isfinite(b.item())
        assert b.item() == pytest.approx(a.item(), rel=1e-9, abs=1e-9), mode


@settings(max_examples=30, deadline=None)
@given(perm_seed=st.integers(0, 1000), data=st.data())
def test_row_order_does_not_change_agg_loss(perm_seed: int, data) -> None:
    values = _t(data.draw(st.lists(_finite, min_size=12, max_size=12))).view(4, 3)
    mask = _t(data.draw(st.lists(st.sampled_from([0.0, 1.0]), min_size=12, max_size=12))).view(4, 3)
    perm = torch.randperm(4, generator=torch.Generator().manual_seed(perm_seed))
    for mode in LOSS_AGG_MODES:
        assert agg_loss(values[perm], mask[perm], mode, robust=True).item() == pytest.approx(
            agg_loss(values, mask, mode, robust=True).item(), rel=1e-9, abs=1e-9
        )


def test_agg_loss_counts_exactly_in_bfloat16_when_robust() -> None:
    # 1001 is not a bfloat16 number (it rounds to 1000): the reduction must run in float32.
    loss_mat = torch.ones(1, 1001, dtype=torch.bfloat16)
    assert torch.ones(1001, dtype=torch.bfloat16).sum().item() == 1000.0
    loss = agg_loss(loss_mat, torch.ones(1, 1001, dtype=torch.bool), "token-sum", robust=True)
    assert loss.dtype == torch.float32
    assert loss.item() == 1001.0
    assert agg_loss(loss_mat * 3, torch.ones(1, 1001), "seq-mean-token-mean", robust=True).item() == 3.0
    # verl 0.9.1 sums in the inputs' dtype: a bf16 1000
    verl = agg_loss(loss_mat, torch.ones(1, 1001, dtype=torch.bool), "token-sum")
    assert verl.dtype == torch.bfloat16
    assert verl.item() == 1000.0


def test_verls_geo_mean_default_depends_on_the_layout() -> None:
    """Why the trainer sets geo_mean_valid_rows: verl's plain per-micro-batch row mean ignores
    the global counts, so splitting the same batch differently changes the gradient."""

    class _VerlCfg(_ActorCfg):
        policy_loss = None  # geo_mean_valid_rows unset: verl 0.9.1's numbers

    batch = _global_batch(seed=1)
    w0 = torch.tensor([0.5, 0.1, -0.6], dtype=torch.float64)
    old = (_log_probs(w0, batch["x"]) + batch["noise"]).detach()
    fn = get_policy_loss_fn("geo_mean")
    w = w0.clone().requires_grad_(True)
    reference, _ = fn(old, _log_probs(w, batch["x"]), batch["adv"], batch["mask"], "token-mean", _VerlCfg())
    (expected,) = torch.autograd.grad(reference, w)

    def loss_of(w_live, rows, cols, info):
        log_prob = _live_on(lambda v: _log_probs(v, batch["x"][rows]), w_live, cols)
        args = (old[rows], log_prob, batch["adv"][rows], batch["mask"][rows], "token-mean", _VerlCfg())
        return fn(*args, global_batch_info=info)[0]

    worst = max(
        (_megatron_grad(batch, w0, dp, cp, micro, seed=10 + i, loss_of=loss_of) - expected).abs().max().item()
        for i, (dp, cp, micro) in enumerate(LAYOUTS)
    )
    assert worst > 1e-3, f"verl's geo_mean unexpectedly layout-invariant (max grad diff {worst:.2e})"
