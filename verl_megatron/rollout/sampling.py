"""Choosing the next token from logits: greedy, temperature, top-k, top-p; seeded.

``sample_next`` draws one token per row by inverting the cumulative distribution with one
uniform number per row. ``torch.multinomial`` draws an exponential variate for every vocabulary
entry instead (a [B, V] random tensor per step), which on a CPU costs more than the rest of a
small model's decoding step. The same generator state (or the same given uniforms) and the same
logits give the same tokens on every rank.

``rollout_log_probs`` are the log-softmax of the temperature-scaled logits at the chosen token,
over the whole vocabulary (top-k / top-p only restrict which tokens can be drawn), as the actor
recomputes them; here taken as the log of the token's softmax probability, which differs from
the actor's value by float32 rounding only. For greedy decoding the temperature is 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from verl_megatron.rollout.config import RolloutConfig, RolloutConfigError
from verl_megatron.rollout.cpu.kernels import decode_kernels

__all__ = [
    "SamplingParams",
    "call_seed",
    "last_positive",
    "prompt_indices",
    "prompt_seed",
    "prompt_uniforms",
    "resolve_sampling",
    "sample_next",
    "sample_rows",
]

# Candidates examined before falling back to a full sort for top-p: if the K most likely tokens
# already hold top_p of the probability, the nucleus lies within them (exact, not a heuristic).
_TOP_P_CANDIDATES = 1024
# Vocabulary entries per block of the two-level inverse CDF.
_BLOCK = 256


@dataclass(frozen=True)
class SamplingParams:
    """The sampling settings of one generate call.

    Attributes:
        temperature: logits are divided by it before softmax (ignored when greedy).
        top_k: keep the k most likely tokens; <= 0 keeps all.
        top_p: nucleus mass; 1.0 keeps all.
        greedy: take the argmax (rollout log-probs then use temperature 1).
        n: samples per prompt.
    """

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    greedy: bool = False
    n: int = 1

    @property
    def logprob_temperature(self) -> float:
        return 1.0 if self.greedy else self.temperature


_FIELD_TYPES = {"temperature": float, "top_k": int, "top_p": float, "n": int}


def resolve_sampling(config: RolloutConfig, meta_info: dict[str, Any]) -> SamplingParams:
    """The settings for a batch: ``val_kwargs`` when ``meta_info['validate']``, else the training ones.

    ``meta_info`` may override ``temperature``, ``top_k``, ``top_p``, ``n`` and ``do_sample``
    (``do_sample=False`` means greedy with n=1, as in verl). Temperature 0 also means greedy.
    """
    if meta_info.get("validate", False):
        base = config.val_kwargs
        fields = dict(temperature=base.temperature, top_k=base.top_k, top_p=base.top_p, n=base.n)
        do_sample = base.do_sample
    else:
        fields = dict(temperature=config.temperature, top_k=config.top_k, top_p=config.top_p, n=config.n)
        do_sample = config.do_sample
    # Each field's declared type, not its config value's: an int temperature 1 must not make a
    # meta temperature 0.7 an int 0 (greedy).
    fields = {key: _FIELD_TYPES[key](meta_info.get(key, value)) for key, value in fields.items()}
    do_sample = bool(meta_info.get("do_sample", do_sample))
    if fields["temperature"] < 0 or not 0 < fields["top_p"] <= 1 or fields["n"] < 1:
        raise RolloutConfigError(f"invalid sampling settings for this batch: {fields}")
    greedy = not do_sample or fields["temperature"] == 0
    if greedy:
        # Every greedy sample of a prompt would be identical: verl returns one.
        fields.update(n=1, temperature=1.0, top_k=-1, top_p=1.0)
    return SamplingParams(greedy=greedy, **fields)


def call_seed(seed: int, dp_rank: int, call: int) -> int:
    """The sampling seed of one generate call: distinct per data-parallel rank and per call.

    Data-parallel ranks draw differently even for equal prompts; a fresh engine with the same
    seed repeats the same sequence of calls' draws.
    """
    return ((seed * 1_000_003 + dp_rank) * 1_000_033 + call) % (2**63)


def prompt_seed(seed: int, call: int, prompt_index: int) -> int:
    """The sampling seed of one prompt's samples in one generate call.

    ``prompt_index`` is the prompt's row in the global batch, so the seed (and an engine's draws
    for that prompt) does not depend on how prompts are split over replicas.
    """
    return ((seed * 1_000_003 + call) * 1_000_033 + prompt_index) % (2**63)


def prompt_indices(meta: dict, prompts: int) -> list[int]:
    """The rows of a call's ``prompts`` prompts in the global batch, which their seeds come from:
    ``meta["prompt_indices"]`` when the caller names each (rows continued from an earlier call, see
    ``rollout/partial.py``), else ``meta["prompt_offset"]`` (where this share starts) + the local row."""
    given = meta.get("prompt_indices")
    if given is None:
        offset = int(meta.get("prompt_offset", 0))
        return list(range(offset, offset + prompts))
    if len(given) != prompts:
        raise ValueError(f"meta_info['prompt_indices'] names {len(given)} rows for {prompts} prompts")
    return [int(i) for i in given]


def sample_rows(meta: dict, prompts: int, n: int) -> list[int]:
    """The global rows of a call's samples (sample j of prompt p: ``p * n + j``, p from
    ``prompt_indices``), in the call's row order: the seeds of rows continued in a later call
    (partial rollout's segments, multi-turn's turns)."""
    return [p * n + j for p in prompt_indices(meta, prompts) for j in range(n)]


def prompt_uniforms(seeds: list[int], n: int, steps: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The uniform numbers [len(seeds) * n, steps] a call's rows draw with, one per row and step.

    Prompt ``i``'s ``n`` samples (adjacent rows) take rows of a table drawn from ``seeds[i]`` alone,
    so a prompt's tokens depend on its seed, not on which rows share its batch.
    """
    table = torch.empty(len(seeds) * n, steps, dtype=torch.float32)
    for i, seed in enumerate(seeds):
        generator = torch.Generator().manual_seed(seed)
        table[i * n : (i + 1) * n] = torch.rand(n, steps, generator=generator)
    return table.to(device)


def _uniform(rows: int, like: torch.Tensor, generator, uniform: torch.Tensor | None) -> torch.Tensor:
    """[rows, 1] uniforms in ``like``'s dtype: the given ones, else drawn from ``generator``."""
    if uniform is not None:
        return uniform.to(like.dtype).reshape(rows, 1)
    return torch.rand(rows, 1, generator=generator, device=like.device, dtype=like.dtype)


def _inverse_cdf(
    weights: torch.Tensor, generator: torch.Generator | None, uniform: torch.Tensor | None = None
) -> torch.Tensor:
    """One index per row of ``weights`` [B, K] (non-negative, unnormalised) -> [B].

    searchsorted(right) returns the first index whose cumulative weight exceeds u * total:
    zero-weight entries never increase the cumulative sum, so they are never chosen.
    """
    cdf = weights.cumsum(dim=-1)
    u = _uniform(weights.shape[0], cdf, generator, uniform)
    index = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)
    return index.clamp_(max=weights.shape[-1] - 1).squeeze(-1)


def _inverse_cdf_blocked(
    weights: torch.Tensor, generator: torch.Generator | None, uniform: torch.Tensor | None = None
) -> torch.Tensor:
    """Like :func:`_inverse_cdf` over a large vocabulary [B, V], in two levels.

    A running sum over V is sequential along each row; summing blocks of ``_BLOCK`` entries is
    not. A block is drawn with probability proportional to its sum, then an entry within it,
    which gives each entry probability w_j / sum(w) as one level would, for one uniform per row.
    """
    batch, vocab = weights.shape
    full = vocab // _BLOCK * _BLOCK
    sums = weights[:, :full].reshape(batch, full // _BLOCK, _BLOCK).sum(dim=-1)
    if full < vocab:
        sums = torch.cat([sums, weights[:, full:].sum(dim=-1, keepdim=True)], dim=-1)
    cdf = sums.cumsum(dim=-1)
    u = _uniform(batch, cdf, generator, uniform) * cdf[:, -1:]
    block = torch.minimum(torch.searchsorted(cdf, u, right=True), last_positive(sums))
    # The uniform's offset into its block, and that block's entries (past-the-end columns weigh 0).
    offset = u - (cdf.gather(-1, block) - sums.gather(-1, block))
    columns = block * _BLOCK + torch.arange(_BLOCK, device=weights.device)
    in_block = weights.gather(-1, columns.clamp(max=vocab - 1)) * (columns < vocab)
    running = in_block.cumsum(dim=-1)
    # The block sums and the running sum add in different orders: an offset a few ulps below the
    # block's sum can lie past its running sum. Then take its last entry of positive weight (the
    # entries after it weigh 0 and must never be drawn).
    index = torch.minimum(torch.searchsorted(running, offset, right=True), last_positive(in_block))
    return (block * _BLOCK + index).squeeze(-1)


def last_positive(weights: torch.Tensor) -> torch.Tensor:
    """[B, 1]: the index of each row's last entry of positive weight in ``weights`` [B, K] (0 if none)."""
    columns = torch.arange(weights.shape[-1], device=weights.device)
    return torch.where(weights > 0, columns, 0).amax(dim=-1, keepdim=True)


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The draw weights [B, K] of candidates sorted by decreasing probability ``probs`` [B, K] (of
    the distribution top-p applies to), zero outside the top-p set."""
    if top_p < 1.0:
        # Keep a token while the mass of the tokens before it is below top_p (the first always
        # stays); summed in float64 so that the set is the exact one but for float32 probabilities.
        wide = probs.double()
        before = wide.cumsum(dim=-1) - wide
        probs = probs.masked_fill(before >= top_p, 0.0)
    return probs


def _top_p_weights(
    scaled: torch.Tensor, probs: torch.Tensor, params: SamplingParams
) -> tuple[torch.Tensor, torch.Tensor]:
    """(draw weights [B, K], their token ids [B, K]) of the tokens top-k / top-p keep.

    With top-k, top-p applies to the top k renormalised (as HF and vLLM do); without, to the whole
    vocabulary's ``probs``, whose K most likely tokens are examined first.
    """
    vocab = scaled.shape[-1]
    if 0 < params.top_k < vocab:
        values, index = torch.topk(scaled, params.top_k, dim=-1)
        return _nucleus(torch.softmax(values, dim=-1), params.top_p), index
    k = min(_TOP_P_CANDIDATES, vocab)
    values, index = torch.topk(scaled, k, dim=-1)
    if k < vocab:
        kept = probs.gather(-1, index)
        if bool((kept.double().sum(dim=-1) >= params.top_p).all()):
            return _nucleus(kept, params.top_p), index
        values, index = torch.sort(scaled, dim=-1, descending=True)
    return _nucleus(torch.softmax(values, dim=-1), params.top_p), index


def sample_next(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    uniform: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose one token per row.

    Args:
        logits: [B, V] next-token logits over the real vocabulary (any float dtype).
        params: the batch's sampling settings.
        generator: seeded torch generator on ``logits.device`` (None: the global one).
        uniform: [B] the rows' uniform numbers in [0, 1) (see :func:`prompt_uniforms`);
            when given, ``generator`` is not used.

    Returns:
        (tokens [B] int64, log_probs [B] float32), log-probs of the full-vocabulary
        softmax at temperature ``params.logprob_temperature``.
    """
    scaled = logits.float()
    if params.logprob_temperature != 1.0:
        scaled = scaled / params.logprob_temperature
    plain = not params.greedy and params.top_k <= 0 and params.top_p >= 1.0
    if plain and scaled.device.type == "cpu" and scaled.shape[-1] > 4 * _BLOCK:
        kernels = decode_kernels()
        if kernels is not None:  # the same two-level draw, compiled (cpu/kernels.py)
            u = _uniform(scaled.shape[0], scaled, generator, uniform).reshape(-1)
            return kernels.sample_softmax(scaled, u, _BLOCK)
    # One fused softmax rather than max, subtract, exp and sum: on CPU its exponential is about
    # twice as fast as torch.exp (measured at [64, 32k]: 1.2 vs 2.6 ms for the whole draw).
    probs = torch.softmax(scaled, dim=-1)
    if params.greedy:
        tokens = scaled.argmax(dim=-1)
    elif plain:
        draw = _inverse_cdf_blocked if probs.shape[-1] > 4 * _BLOCK else _inverse_cdf
        tokens = draw(probs, generator, uniform)
    else:
        nucleus, index = _top_p_weights(scaled, probs, params)
        tokens = index.gather(-1, _inverse_cdf(nucleus, generator, uniform).unsqueeze(-1)).squeeze(-1)
    # A drawn token has a positive probability (the inverse CDF never picks a zero weight, and
    # the argmax holds at least 1/V), so its log is finite.
    log_probs = probs.gather(-1, tokens.unsqueeze(-1)).log_().squeeze(-1)
    return tokens, log_probs
