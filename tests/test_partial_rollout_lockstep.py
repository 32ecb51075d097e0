"""Partial rollout's continuing path on a replica of two ranks (tp=2) whose ranks see new weights
at different boundaries.

Each rank asked its own ``pending()`` at a segment boundary: a rank that saw new weights ended its
engine call there while its tp peer decoded on into the next step's collectives, so the two
waited on each other (or met in mismatched collectives). The ranks now agree, one all-reduce a
boundary, and load the same version before going on.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.test_partial_rollout_prefills import (  # model_dir: the same tiny Llama fixture
    RESPONSE,
    SAMPLING,
    SEGMENT,
    _per_call,
    _Updates,
    model_dir,  # noqa: F401
)
from tests.test_rollout_native import EOS, PAD, _setup, prompt_batch

UPDATE_AT = 2  # the boundary (counted from 1) where version 1 arrives


class _Store:
    """Version 1 (this rank's shards nudged) arrives at boundary ``UPDATE_AT``. ``sees`` says
    whether this rank's pending() notices it; ``lag``: refresh() calls that still find nothing."""

    def __init__(self, chunks: list[torch.nn.Module], sees: bool, lag: int) -> None:
        self.chunks, self.sees, self.lag, self.version, self.boundaries = chunks, sees, lag, 0, 0

    def _arrived(self) -> bool:
        return self.boundaries >= UPDATE_AT and self.version == 0

    def refresh(self) -> None:
        if not self._arrived():
            return
        if self.lag > 0:
            self.lag -= 1
            return
        _Updates(self.chunks, at=0).load()  # the nudge of the single-process test
        self.version = 1

    def refresh_each_boundary(self) -> None:  # the call-per-segment path refreshes at each boundary
        self.boundaries += 1
        self.refresh()

    def pending(self) -> bool:
        self.boundaries += 1
        return self.sees and self._arrived()


def _engine(config, runtime, chunks, hf_config, decoded: list[int]):
    """A native engine recording the tokens each continuing call decoded before it ended."""
    from verl_megatron.rollout.native import NativeRollout

    class Recording(NativeRollout):
        def generate_segments(self, prompts, segments):
            out, width = super().generate_segments(prompts, segments)
            decoded.append(width)
            return out, width

    return Recording(config, runtime, chunks, SimpleNamespace(pad_token_id=PAD, eos_token_id=EOS), hf_config)


def lockstep_job(model_dir: str, lag: int) -> dict:  # noqa: F811 (a path here, not the fixture)
    """Per rank: the call-per-segment path (both ranks load version 1 at boundary 2) and the
    continuing one where only rank 0's pending() sees it (rank 1's refresh() finds it ``lag``
    calls late); the continuing path's segment widths; the error of a call without a lockstep."""
    import torch.distributed as dist

    from verl_megatron.rollout import RolloutConfig
    from verl_megatron.rollout.native import Lockstep, Segments
    from verl_megatron.rollout.partial import generate_with_versions

    runtime, chunks, hf_config = _setup(model_dir, tp=2)
    start = [[p.detach().clone() for p in chunk.parameters()] for chunk in chunks]
    config = RolloutConfig(prompt_length=8, response_length=RESPONSE, ignore_eos=True, **SAMPLING)
    rank, results = dist.get_rank(), {}
    for path in ("per_segment", "continuing"):
        with torch.no_grad():
            for chunk, saved in zip(chunks, start):
                for p, w in zip(chunk.parameters(), saved):
                    p.copy_(w)
        decoded: list[int] = []
        engine = _engine(config, runtime, chunks, hf_config, decoded)
        store = _Store(chunks, sees=rank == 0, lag=lag if rank == 1 and path == "continuing" else 0)
        common = dict(
            response_length=RESPONSE, segment=SEGMENT, stops=[EOS], pad=PAD, version=lambda s=store: s.version
        )
        if path == "per_segment":
            out = generate_with_versions(
                _per_call(engine), prompt_batch(), refresh=store.refresh_each_boundary, **common
            )
        else:
            out = generate_with_versions(
                engine, prompt_batch(), refresh=store.refresh, pending=store.pending,
                lockstep=Lockstep.of(runtime), **common,
            )  # fmt: skip
        results[path] = {k: out.batch[k].clone() for k in ("responses", "response_mask", "rollout_versions")}
        results[path]["decoded"] = decoded
    try:  # a tp=2 rank without its lockstep would decide alone: refused before decoding
        engine.generate_segments(prompt_batch(), Segments(SEGMENT, lambda: False))
    except ValueError as error:
        results["refused"] = str(error)
    return results


@pytest.mark.parametrize("lag", [0, 1], ids=["refresh-finds-it", "refresh-finds-it-late"])
def test_tp_ranks_end_the_call_at_the_same_boundary(pool2, model_dir, lag):  # noqa: F811
    """Only rank 0's pending() turns true at boundary 2: both ranks end their first call after 6
    tokens, load version 1 (rank 1 after ``lag`` empty refreshes) and decode the other 18 in one
    call, and each rank's tokens and versions equal the call-per-segment path's. The old code
    ended rank 0's call at 6 tokens and rank 1's at 24: the pool's time limit ended it."""
    ranks = pool2.run(f"{__name__}:lockstep_job", timeout_s=300, model_dir=model_dir, lag=lag)
    for rank, out in enumerate(ranks):
        old, new = out["per_segment"], out["continuing"]
        assert new["decoded"] == [UPDATE_AT * SEGMENT, RESPONSE - UPDATE_AT * SEGMENT], f"rank {rank}"
        for key in ("responses", "response_mask", "rollout_versions"):
            differ = (old[key] != new[key]).nonzero().tolist()
            assert not differ, f"rank {rank}: {key} differ at {differ[:5]}"
        versions, mask, cut = new["rollout_versions"], new["response_mask"].bool(), UPDATE_AT * SEGMENT
        assert versions[:, :cut][mask[:, :cut]].unique().tolist() == [0]
        assert versions[:, cut:][mask[:, cut:]].unique().tolist() == [1]
        assert "pass Lockstep.of(runtime)" in out["refused"] and "tp=2" in out["refused"]
    differ = (ranks[0]["continuing"]["responses"] != ranks[1]["continuing"]["responses"]).nonzero().tolist()
    assert not differ, f"the two tp ranks hold other tokens at {differ[:5]}"
