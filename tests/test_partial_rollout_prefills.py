"""Partial rollout with the native engine re-prefills only where the weights change.

Cut in segments of 3 tokens, a 24-token response had one engine call per segment, each
re-prefilling every running row's prompt + response so far, even with no newer weights waiting.
Told whether weights are waiting (``pending``), one engine call now runs on through such
boundaries; the tokens, rollout versions and seeds are those of the call-per-segment path,
which other engines still take (here a wrapper that hides the native engine).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.test_rollout_native import (
    EOS,
    PAD,
    PROMPT_LENGTHS,
    _assert_within_float32_error,
    _recomputed_log_probs,
    _setup,
    prompt_batch,
    save_peaked_llama,
)

RESPONSE, SEGMENT = 24, 3
SAMPLING = {"temperature": 0.7, "top_k": 20, "top_p": 0.9, "n": 2, "seed": 5}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("partial_llama")
    save_peaked_llama(path)
    return str(path)


class _Updates:
    """Weights version 0, then version 1 (every parameter nudged) from segment boundary ``at`` on."""

    def __init__(self, chunks: list[torch.nn.Module], at: int | None) -> None:
        self.chunks, self.at, self.version, self.boundaries = chunks, at, 0, 0

    def _due(self) -> bool:
        return self.at is not None and self.boundaries >= self.at and self.version == 0

    def load(self) -> None:
        if self._due():
            g = torch.Generator().manual_seed(3)
            with torch.no_grad():
                for chunk in self.chunks:
                    for p in chunk.parameters():
                        p.add_(0.1 * torch.randn(p.shape, generator=g))
            self.version = 1

    def refresh_each_boundary(self) -> None:  # the call-per-segment path refreshes at each boundary
        self.boundaries += 1
        self.load()

    def pending(self) -> bool:  # the continuing path asks at each boundary, refreshes when told so
        self.boundaries += 1
        return self._due()


def _counting_engine(config, runtime, chunks, hf_config, prefills: list[int]):
    """A native engine recording the prompt tokens each of its calls prefills."""
    from verl_megatron.rollout.native import NativeRollout

    class Counting(NativeRollout):
        def generate_sequences(self, prompts):
            prefills.append(int(prompts.batch["attention_mask"].sum()))
            return super().generate_sequences(prompts)

        def generate_segments(self, prompts, segments):
            prefills.append(int(prompts.batch["attention_mask"].sum()))
            return super().generate_segments(prompts, segments)

    return Counting(config, runtime, chunks, SimpleNamespace(pad_token_id=PAD, eos_token_id=EOS), hf_config)


def _per_call(engine):
    """The engine behind a plain RolloutEngine: partial rollout calls it once a segment."""
    from verl_megatron.rollout.base import RolloutEngine

    class PerCall(RolloutEngine):
        config = engine.config

        def generate_sequences(self, prompts):
            return engine.generate_sequences(prompts)

    return PerCall()


def _set(chunks: list[torch.nn.Module], weights: list[list[torch.Tensor]]) -> None:
    with torch.no_grad():
        for chunk, saved in zip(chunks, weights):
            for p, w in zip(chunk.parameters(), saved):
                p.copy_(w)


def _exact_log_probs(chunks, weights, out: dict) -> torch.Tensor:
    """Float64 recomputation [rows, Tr] of ``out``'s log-probs under float32 ``weights`` upcast."""
    _set(chunks, weights)
    chunk = chunks[0].eval().double()
    with torch.no_grad():
        exact = _recomputed_log_probs(chunk, out, SAMPLING["temperature"])
    chunk.float()
    return exact


def paths_job(model_dir: str, update_at: int | None, ignore_eos: bool) -> dict:
    """Each path's output and prefilled prompt tokens, from the same starting weights and schedule,
    and the float64 log-probs of the continuing path's tokens under the version of each."""
    from verl_megatron.rollout import RolloutConfig
    from verl_megatron.rollout.partial import generate_with_versions

    runtime, chunks, hf_config = _setup(model_dir)
    start = [[p.detach().clone() for p in chunk.parameters()] for chunk in chunks]
    config = RolloutConfig(prompt_length=8, response_length=RESPONSE, ignore_eos=ignore_eos, **SAMPLING)
    results = {}
    for path in ("per_segment", "continuing"):
        _set(chunks, start)
        prefills: list[int] = []
        engine = _counting_engine(config, runtime, chunks, hf_config, prefills)
        updates = _Updates(chunks, update_at)
        # stops holds the eos even with ignore_eos, as the call-per-segment path's caller may.
        common = dict(
            response_length=RESPONSE,
            segment=SEGMENT,
            stops=[EOS],
            pad=PAD,
            version=lambda u=updates: u.version,
        )
        if path == "per_segment":
            out = generate_with_versions(
                _per_call(engine), prompt_batch(), refresh=updates.refresh_each_boundary, **common
            )
        else:
            out = generate_with_versions(
                engine, prompt_batch(), refresh=updates.load, pending=updates.pending, **common
            )
        results[path] = {k: out.batch[k].clone() for k in out.batch.keys()}  # noqa: SIM118
        results[path].update(prefills=prefills, calls=engine.state_dict()["calls"])
    last = [[p.detach().clone() for p in chunk.parameters()] for chunk in chunks]
    new = results["continuing"]
    exact = [_exact_log_probs(chunks, weights, new) for weights in (start, last)]
    results["exact"] = torch.where(new["rollout_versions"] == 1, exact[1], exact[0])
    return results


def _prefill_tokens(versions: torch.Tensor, boundary: int) -> int:
    """Prompt + response tokens so far of the rows that decode on from ``boundary`` (a column)."""
    running = (versions[:, boundary] != -1).nonzero().flatten().tolist()
    return sum(PROMPT_LENGTHS[row // 2] + boundary for row in running)  # n = 2: rows 2p, 2p + 1


@pytest.mark.parametrize("ignore_eos", [True, False], ids=["ignore-eos", "eos"])
@pytest.mark.parametrize("update_at", [None, 2], ids=["no-update", "update-at-boundary-2"])
def test_continuing_path_prefills_once_per_weights_version(pool1, model_dir, update_at, ignore_eos):
    """Tokens, masks and versions equal; log-probs each within float32 rounding of the float64
    ones (the continuing path's error at most 3x the per-segment path's, the bound and its
    reason as in test_rollout_native's sampled log-probs: both decode from cached keys, the
    continuing path over more steps); the prefilled tokens and sampling calls counted."""
    out = pool1.run(f"{__name__}:paths_job", model_dir=model_dir, update_at=update_at, ignore_eos=ignore_eos)[
        0
    ]
    old, new = out["per_segment"], out["continuing"]
    for key in ("responses", "response_mask", "rollout_versions", "weight_version"):
        differ = (old[key] != new[key]).nonzero().tolist()
        assert not differ, f"{key} differ at {differ[:5]}"
    _assert_within_float32_error(
        new["rollout_log_probs"],
        old["rollout_log_probs"],
        out["exact"],
        "continuing vs per-segment",
        factor=3.0,
    )
    # Each segment begun takes one sampling call number in both paths (the next call's seeds).
    assert new["calls"] == old["calls"] == RESPONSE // SEGMENT
    versions = new["rollout_versions"]
    # Per segment: every running row's prompt + response so far (e.g. 864 tokens in 8 prefills).
    boundaries = range(SEGMENT, RESPONSE, SEGMENT)
    assert old["prefills"] == [sum(PROMPT_LENGTHS)] + [_prefill_tokens(versions, b) for b in boundaries]
    if update_at is None:
        assert versions[new["response_mask"].bool()].unique().tolist() == [0]
        assert new["prefills"] == [sum(PROMPT_LENGTHS)]  # the 5 prompts, once
        return
    cut = update_at * SEGMENT
    mask = new["response_mask"].bool()
    assert bool((versions[:, :cut][mask[:, :cut]] == 0).all()) and bool(
        (versions[:, cut:][mask[:, cut:]] == 1).all()
    )
    assert int((versions[:, cut] == 1).sum()) == 9  # all rows but one, ended by its eos, run on
    # The prompts, then the running rows once more under version 1 (115 tokens where 1059 were).
    assert new["prefills"] == [sum(PROMPT_LENGTHS), _prefill_tokens(versions, cut)]
