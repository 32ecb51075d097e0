"""Sampling draws only what the distribution allows: the exact top-p set over the whole vocabulary,
and never a zero-probability token from the two-level inverse CDF (Python path and compiled kernel,
native and generic builds), whatever the rounding at a block's boundary."""

from __future__ import annotations

import pytest
import torch

from verl_megatron.rollout import sampling
from verl_megatron.rollout.cpu import kernels as cpu_kernels
from verl_megatron.rollout.sampling import SamplingParams, sample_next

_V = 4096


def _nucleus_case():
    """Logits [V] with distinct values: 10 strong tokens, then a slowly falling tail; the 1024 most
    likely tokens hold about 0.95 of the mass, so the top-0.94 set reaches far into the tail."""
    logits = -torch.arange(_V, dtype=torch.float32) * 1e-5
    logits[:10] += 8.65 - torch.arange(10, dtype=torch.float32) * 0.01
    return logits


def test_top_p_without_top_k_draws_exactly_the_full_vocabulary_nucleus():
    logits, top_p = _nucleus_case(), 0.94
    exact = torch.softmax(logits.double(), dim=-1)  # sorted already: decreasing, distinct
    assert 0.94 < float(exact[:1024].sum()) < 0.96  # the shortlist holds top_p: its shortcut runs
    before = exact.cumsum(0) - exact
    size = int((before < top_p).sum())
    # No token's mass-before lies within float32 rounding of top_p: the exact set is unambiguous.
    assert float((before - top_p).abs().min()) > 1e-6 and size > 400
    # One uniform at the middle of each nucleus token's share of the nucleus mass draws that token,
    # and the uniforms next to 0 and 1 draw the first and the last: nothing past the set is drawn.
    share = exact[:size] / exact[:size].sum()
    middles = (share.cumsum(0) - share / 2).float()
    edges = torch.tensor([0.0, torch.nextafter(torch.tensor(1.0), torch.tensor(0.0)).item()])
    uniforms = torch.cat([middles, edges])
    tokens, log_probs = sample_next(
        logits.expand(len(uniforms), _V).contiguous(), SamplingParams(top_p=top_p), uniform=uniforms
    )
    expected = [*range(size), 0, size - 1]
    wrong = [(i, t, e) for i, (t, e) in enumerate(zip(tokens.tolist(), expected, strict=True)) if t != e]
    assert not wrong, (
        f"exact nucleus of {size} tokens; (uniform #, drawn, expected): {wrong[:5]} ({len(wrong)} wrong)"
    )
    torch.testing.assert_close(log_probs, exact.log().float()[tokens])


def test_top_k_with_top_p_renormalises_within_the_top_k():
    """HF / vLLM order: top-k first, then top-p over the top k renormalised."""
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    # Within the top 2 (0.625, 0.375), top_p=0.6 keeps only the first; over all four it would keep two.
    tokens, _ = sample_next(
        logits.expand(200, 4).contiguous(), SamplingParams(top_k=2, top_p=0.6), uniform=torch.rand(200)
    )
    assert set(tokens.tolist()) == {0}


def _adversarial(block_sums, trials: int, seed: int = 0):
    """Logits [trials, V] whose block 0 ends with a token of probability exactly 0, and per trial 41
    uniforms at block 0's share of the total (from ``block_sums`` of the rows) and the float32 values
    just below it, where the block's sum and the running sum inside it disagree by a few ulps."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(trials, _V, generator=g) * 3
    logits[:, :256] = torch.randn(trials, 256, generator=g) * 3 + 2
    logits[:, 255] = -300.0
    sums = block_sums(logits).double()
    u = (sums[:, 0] / sums.sum(dim=-1)).float()
    steps = [u]
    for _ in range(40):
        steps.append(torch.nextafter(steps[-1], torch.zeros(())))
    return logits, torch.stack(steps, dim=1)  # [trials, 41]


def _count_zero_probability_draws(draw, block_sums, trials: int = 200) -> tuple[int, int]:
    logits, uniforms = _adversarial(block_sums, trials)
    hits = 0
    for row, us in zip(logits, uniforms, strict=True):
        tokens = draw(row.expand(len(us), _V).contiguous(), us)
        assert torch.softmax(row, dim=-1)[255] == 0
        hits += int((tokens == 255).sum())
    return hits, uniforms.numel()


def _softmax_block_sums(logits):
    return torch.softmax(logits, dim=-1).reshape(len(logits), -1, sampling._BLOCK).sum(-1)


def _exp_block_sums(logits):
    return torch.exp(logits - logits.amax(-1, keepdim=True)).reshape(len(logits), -1, sampling._BLOCK).sum(-1)


def test_the_python_two_level_draw_never_returns_a_zero_probability_token():
    hits, tried = _count_zero_probability_draws(
        lambda logits, u: sampling._inverse_cdf_blocked(torch.softmax(logits, dim=-1), None, u),
        _softmax_block_sums,
    )
    assert hits == 0, f"{hits} of {tried} uniforms next to a block boundary drew a zero-probability token"


@pytest.mark.parametrize("arch", cpu_kernels.ARCHES)
def test_the_compiled_draw_never_returns_a_zero_probability_token(arch):
    kernels = cpu_kernels.decode_kernels(arch)
    assert kernels is not None, f"the {arch} CPU kernels did not build on this machine"

    def draw(logits, u):
        tokens, log_probs = kernels.sample_softmax(logits, u, sampling._BLOCK)
        infinite = int((~torch.isfinite(log_probs)).sum())
        assert infinite == 0, f"{arch}: {infinite} drawn tokens have log-probability -inf"
        return tokens

    hits, tried = _count_zero_probability_draws(draw, _exp_block_sums)
    assert hits == 0, (
        f"{arch}: {hits} of {tried} uniforms next to a block boundary drew a zero-probability token"
    )


def test_a_draw_past_every_block_takes_the_last_one_of_positive_weight():
    """A uniform whose product with the total rounds up to the total (or any offset past the end)
    lands on the last positive-weight entry, not on an empty last block."""
    weights = torch.zeros(2, 1100)  # blocks of 256: the partial last block (1024..1099) is empty
    weights[:, 7] = 1.0
    weights[:, 900] = 0.5
    tokens = sampling._inverse_cdf_blocked(weights, None, torch.tensor([0.5, 1.0]))
    assert tokens.tolist() == [7, 900]


def test_meta_overrides_take_each_fields_declared_type_not_the_config_values():
    """A config written with an int temperature (1) must not truncate a meta temperature 0.7 to 0,
    which would silently mean greedy decoding; nor an int top_p 1 a meta top_p 0.9."""
    from verl_megatron.rollout import RolloutConfig
    from verl_megatron.rollout.sampling import resolve_sampling

    config = RolloutConfig(temperature=1, top_p=1, n=2)
    assert resolve_sampling(config, {"temperature": 0.7}) == SamplingParams(temperature=0.7, n=2)
    params = resolve_sampling(config, {"temperature": 0.7, "top_p": 0.9, "n": 3.0, "top_k": 5.0})
    assert params == SamplingParams(temperature=0.7, top_p=0.9, n=3, top_k=5, greedy=False)
    assert type(params.temperature) is float and type(params.n) is int and type(params.top_k) is int
    assert type(resolve_sampling(config, {}).temperature) is float
