"""Generation in segments, so that a weight update can land in the middle of a batch (partial rollout).

A batch's responses are decoded ``segment`` tokens at a time: after each segment ``refresh()``
may load newer weights, and the rows still running continue from prompt + response so far
(re-prefilled with the weights now loaded). Each token records the weight version that
generated it (``rollout_versions`` [B*n, Tr], -1 on padding); ``weight_version`` [B*n] is the
version a row started with. With one segment covering the whole response this is exactly one
``generate_sequences`` call.

Given ``pending`` (whether newer weights are waiting) and the native engine, a boundary where none
are does not end the engine call: its rows decode on in the cache, each segment drawing as its own
call would (``NativeRollout.generate_segments``), so the tokens are the same and only a boundary
where weights change re-prefills. Ranks that decode together (tp / pp / expert peers, given as
``lockstep``) end the call at the same boundary, the first where any of them sees newer weights,
and then load the same version. Without ``pending``, or with another engine, every boundary is
an engine call and a re-prefill of every row still running (e.g. 64 prefills of a 512-token
response cut in segments of 8, where one suffices when no update arrives).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from verl_megatron.protocol import DataProto
from verl_megatron.rollout.base import RolloutEngine, assemble_output, prompt_tensors
from verl_megatron.rollout.config import RolloutConfig
from verl_megatron.rollout.native import Lockstep, NativeRollout, Segments
from verl_megatron.rollout.sampling import resolve_sampling, sample_rows

__all__ = ["generate_with_versions"]


def _continuation(
    prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, responses: torch.Tensor, rows: torch.Tensor, pad: int
) -> DataProto:
    """Left-padded prompts made of each row's prompt tokens followed by its response so far."""
    sequences = [torch.cat([prompt_ids[r][prompt_mask[r].bool()], responses[r]]) for r in rows.tolist()]
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad, dtype=torch.long)
    mask = torch.zeros(len(sequences), width, dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, width - len(s) :], mask[i, width - len(s) :] = s, 1
    return DataProto.from_dict({"input_ids": ids, "attention_mask": mask})


def _generate(
    engine: RolloutEngine,
    batch: DataProto,
    remaining: int,
    segment: int,
    pending: Callable[[], bool] | None,
    lockstep: Lockstep | None,
) -> tuple[DataProto, int]:
    """(output, response columns it decoded) of one engine call from here: to the first boundary
    where newer weights are waiting when the engine can continue past boundaries, else one segment."""
    if pending is not None and isinstance(engine, NativeRollout):
        batch.meta_info["response_length"] = remaining
        out, decoded = engine.generate_segments(batch, Segments(segment, pending, lockstep))
        return out.to("cpu"), decoded
    batch.meta_info["response_length"] = min(segment, remaining)
    return engine.generate_sequences(batch).to("cpu"), min(segment, remaining)


def _refresh_alike(
    refresh: Callable[[], None], version: Callable[[], int], lockstep: Lockstep | None
) -> None:
    """``refresh()``, then, with ranks decoding together, again on those behind until all hold the
    newest version any of them loaded: a peer may have seen a version arrive that this rank's
    refresh() had not yet (whatever told the peer was there before the agreement, so a rank behind
    finds it). Raises on every rank, naming the versions, where a refresh() behind loads nothing."""
    refresh()
    if lockstep is None or not lockstep.groups:
        return
    stuck = 0
    while True:
        newest, negated_oldest, any_stuck = lockstep.max([version(), -version(), stuck])
        if any_stuck:
            raise RuntimeError(
                f"partial rollout: ranks decoding together hold weight versions {-negated_oldest} to "
                f"{newest} at one segment boundary, and refresh() loads no newer one on a rank behind"
            )
        if newest == -negated_oldest:
            return
        if version() < newest:
            before = version()
            refresh()
            stuck = int(version() == before)


def _kept(tokens: torch.Tensor, mask: torch.Tensor, stop_ids: torch.Tensor, segment: int) -> torch.Tensor:
    """[rows, width] bool: the columns of a call from a segment boundary that calls of one segment
    each would have returned, through the end of the segment where a row first holds one of
    ``stops``. Only a call past boundaries drops any, and only where the engine stops on other
    ids than ``stops`` (e.g. ``rollout.ignore_eos`` with the eos among them)."""
    stopped = torch.isin(tokens, stop_ids) & mask.bool()
    first = torch.where(stopped.any(-1), stopped.int().argmax(-1), tokens.shape[1])
    return torch.arange(tokens.shape[1]) < (first // segment + 1)[:, None] * segment


def generate_with_versions(
    engine: RolloutEngine,
    prompts: DataProto,
    *,
    response_length: int,
    segment: int,
    stops: list[int],
    pad: int,
    version: Callable[[], int],
    refresh: Callable[[], None],
    pending: Callable[[], bool] | None = None,
    lockstep: Lockstep | None = None,
) -> DataProto:
    """``engine.generate_sequences(prompts)`` decoded ``segment`` tokens at a time (see the module
    docstring); ``version()`` is the weight version loaded now, ``refresh()`` loads newer weights
    when there are any, ``pending()`` says whether it would now (None: not known, so every segment
    boundary refreshes and re-prefills). ``lockstep``: the ranks that decode with this one
    (``Lockstep.of(runtime)``; None: it decodes alone), which stop and refresh at the same boundary.
    The output carries ``rollout_versions`` and ``weight_version``."""
    config = getattr(engine, "config", None)
    if isinstance(config, RolloutConfig):  # the engine's own rule: greedy returns one row a prompt
        n = resolve_sampling(config, prompts.meta_info).n
    else:
        n = int(prompts.meta_info.get("n", 1))
    input_ids, mask, _ = prompt_tensors(prompts)
    rows = input_ids.shape[0] * n
    row_ids, row_mask = input_ids.repeat_interleave(n, 0).cpu(), mask.repeat_interleave(n, 0).cpu()
    responses = torch.full((rows, response_length), pad, dtype=torch.long)
    response_mask = torch.zeros(rows, response_length, dtype=torch.long)
    log_probs = torch.zeros(rows, response_length, dtype=torch.float32)
    versions = torch.full((rows, response_length), -1, dtype=torch.long)
    stop_ids = torch.tensor(stops, dtype=torch.long)
    live = torch.arange(rows)
    global_rows = torch.tensor(sample_rows(prompts.meta_info, input_ids.shape[0], n))
    start_version = version()
    position = 0
    while position < response_length and live.numel() > 0:
        if position > 0:
            _refresh_alike(refresh, version, lockstep)
        if position == 0:
            batch = DataProto.from_dict(dict(prompts.batch.items()), meta_info=dict(prompts.meta_info))
        else:
            batch = _continuation(row_ids, row_mask, responses[:, :position], live, pad)
            # Each row seeds from its own row in the global batch, as the first segment's prompts
            # do: ranks and splits draw alike.
            batch.meta_info = {**prompts.meta_info, "n": 1, "prompt_indices": global_rows[live].tolist()}
        # Read after refresh(): the engine reuses packed weights only within one version.
        batch.meta_info["weights_version"] = version()
        out, width = _generate(engine, batch, response_length - position, segment, pending, lockstep)
        seg_tokens, seg_mask = out.batch["responses"][:, :width], out.batch["response_mask"][:, :width].long()
        kept = _kept(seg_tokens, seg_mask, stop_ids, segment)
        seg_tokens, seg_mask = torch.where(kept, seg_tokens, pad), seg_mask * kept
        span = slice(position, position + width)
        responses[live, span], response_mask[live, span] = seg_tokens, seg_mask
        if "rollout_log_probs" in out.batch.keys():  # noqa: SIM118 (TensorDict has no __contains__)
            log_probs[live, span] = out.batch["rollout_log_probs"][:, :width].float() * kept
        versions[live, span] = torch.where(seg_mask.bool(), version(), -1)
        ended = (seg_mask == 0).any(-1) | (torch.isin(seg_tokens, stop_ids) & seg_mask.bool()).any(-1)
        live = live[~ended]
        position += width
    output = assemble_output(prompts, responses, response_mask, log_probs, n)
    output.batch["rollout_versions"] = versions
    output.batch["weight_version"] = torch.full((rows,), start_version, dtype=torch.long)
    return output
