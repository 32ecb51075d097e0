"""The native rollout engine: generation with the actor's own megatron chunks (CPU and GPU).

No weights are copied: the engine decodes with the chunks the actor trains, in their tp/pp
layout, so ``sync_weights`` / ``sleep`` / ``wake_up`` have nothing to do. One call:

1. prefill the B unique prompts once (keys / values cached per layer, see ``decode.py``);
2. copy each prompt's cache rows n times (a prompt's n samples are adjacent rows);
3. decode one token per row per step until every row has stopped (EOS / stop id) or the
   response length is reached; the last pipeline stage samples, and the tokens and their
   log-probs are broadcast to every rank of the model-parallel group, so all ranks agree.
   Once a quarter of the rows still decoded have stopped, they are dropped from the cache.
   With expert parallelism, ranks of different replicas meet in the MoE all-to-alls of every
   step, so the replicas of one expert group agree on "all done" each step (one tiny all-reduce)
   and a replica that finished first keeps stepping on one discarded row until all have.

The log-prob of each sampled token is computed by the trainer's own function
(``models.logprobs.vocab_parallel_log_probs`` on this tp rank's slice of the logits), so with
``rollout.bitwise_parity`` (batch-invariant kernels in decoding and training) it equals the
actor's ``old_log_probs`` bit for bit.

Each prompt samples from its own seed (``sampling.prompt_seed``: seed, call number, and the
prompt's row in the global batch, ``meta_info['prompt_offset']`` + its local row, or
``meta_info['prompt_indices']``, see ``sampling.prompt_indices``): the same seed and the same
sequence of calls give the same tokens whatever the tp/pp/dp layout.

Partial rollout (``rollout/partial.py``) decodes a response in segments through
:meth:`NativeRollout.generate_segments`: one call runs on through every segment boundary where no
newer weights are waiting, each segment drawing as its own call would, so it costs one prefill
where a call per segment re-prefilled each row's prompt + response so far at every boundary.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from verl_megatron.distributed.parallel import Runtime
from verl_megatron.distributed.wire import check_wire
from verl_megatron.models.batch_invariant import BatchInvariance
from verl_megatron.models.logprobs import vocab_parallel_log_probs
from verl_megatron.models.routing import NO_RECORDER, RouteRecorder
from verl_megatron.protocol import DataProto
from verl_megatron.rollout import vl_prefill
from verl_megatron.rollout.base import (
    RolloutEngine,
    assemble_output,
    pad_token_id,
    prompt_tensors,
    stop_token_ids,
)
from verl_megatron.rollout.config import RolloutConfig
from verl_megatron.rollout.cpu.packed_linear import PackedWeights
from verl_megatron.rollout.decode import ChunkDecoder, inference_mode_for
from verl_megatron.rollout.sampling import (
    SamplingParams,
    prompt_indices,
    prompt_seed,
    prompt_uniforms,
    resolve_sampling,
    sample_next,
    sample_rows,
)

__all__ = ["Lockstep", "NativeRollout", "Segments"]

# Finished rows are dropped from the batch once at most this fraction of its rows is still live.
_COMPACT_FRACTION = 0.75


@dataclass(frozen=True)
class Lockstep:
    """The process groups whose ranks decode each step together with this rank: a replica's
    tp x pp ranks (model-parallel group), then, where the MoE layers meet other replicas (ep > 1
    or an expert tp group wider than tp), the expert group. Empty: this rank decodes alone."""

    groups: tuple[dist.ProcessGroup, ...]
    device: torch.device
    """Where the agreement's tensor lives (the runtime's: NCCL reduces only on the GPU)."""

    @classmethod
    def of(cls, runtime: Runtime) -> Lockstep:
        layout, groups = runtime.layout, []
        if layout.tp * layout.pp > 1:
            groups.append(runtime.mp_group())
        if layout.ep > 1 or layout.expert_tp > layout.tp:
            groups.append(runtime.expert_group())
        return cls(tuple(groups), runtime.device)

    def max(self, values: list[int]) -> list[int]:
        """Collective over ``groups``: the elementwise largest ``values`` of all ranks here.

        The replica's ranks first agree, then the expert group over replicas: each expert group
        then holds one value whenever it is a union of replicas' stages or lies within one (the
        layouts where ``NativeRollout._all_done`` agrees on finishing too)."""
        flags = torch.tensor(values, dtype=torch.int64, device=self.device)
        check_wire("Lockstep.max", flags, reduction=True)
        for group in self.groups:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        return [int(v) for v in flags.tolist()]


@dataclass(frozen=True)
class Segments:
    """How partial rollout cuts one :meth:`NativeRollout.generate_segments` call's response."""

    width: int
    """Tokens a segment (the last may be shorter); each draws as a separate call would."""
    stop: Callable[[], bool]
    """Asked at each segment boundary where rows are still running: True (newer weights are
    waiting) ends the call there. Each rank asks its own, so ranks may answer differently."""
    lockstep: Lockstep | None = None
    """The ranks that decode with this one (``Lockstep.of`` the engine's runtime): the call ends
    at a boundary when any of them says stop, one all-reduce a boundary, for a rank that went on
    alone would wait forever in the next step's collectives. None: this rank decodes alone."""


class _Steps:
    """A call's uniforms per decoding step and, with segments, the boundaries where it may end.

    Without segments the call draws one table from its prompts' seeds (``sampling.prompt_seed``
    at the call number). With them, step t lies in segment k = t // width, which draws as the
    k-th of consecutive one-segment calls does: segment 0 from the prompts' seeds, segment k > 0
    from each row's global row (``sampling.sample_rows``, as ``rollout/partial.py`` continues
    rows) at call number + k, its columns counted from the segment's start. A row's tokens are
    then the same whether a boundary ends the call or not.
    """

    def __init__(self, seed: int, call: int, meta: dict, prompts: int, params: SamplingParams,
                 length: int, segments: Segments | None, device: torch.device) -> None:  # fmt: skip
        self.seed, self.call, self.device = seed, call, device
        self.indices, self.params, self.length = prompt_indices(meta, prompts), params, length
        self.rows = sample_rows(meta, prompts, params.n)  # global row of each output row
        self.width = length if segments is None else segments.width
        self.stop = None if segments is None else segments.stop
        lockstep = None if segments is None else segments.lockstep
        self.lockstep = lockstep if lockstep is not None and lockstep.groups else None  # alone: none
        self.table: torch.Tensor | None = None
        self.segment = -1  # the segment ``table`` holds

    def uniform(self, t: int, active: torch.Tensor) -> torch.Tensor | None:
        """[active rows] uniforms of step t (None when greedy)."""
        if self.params.greedy:
            return None
        segment = t // self.width
        if segment != self.segment:  # drawn when reached: rows that stopped before draw nothing
            self.table, self.segment = self._table(segment, active), segment
        return self.table[active, t - segment * self.width]

    def _table(self, segment: int, active: torch.Tensor) -> torch.Tensor:
        width = min(self.width, self.length - segment * self.width)
        if segment == 0:
            seeds = [prompt_seed(self.seed, self.call, i) for i in self.indices]
            return prompt_uniforms(seeds, self.params.n, width, self.device)
        seeds = [prompt_seed(self.seed, self.call + segment, self.rows[r]) for r in active.tolist()]
        table = torch.zeros(len(self.rows), width, device=self.device)
        table[active] = prompt_uniforms(seeds, 1, width, self.device)
        return table

    def stop_after(self, t: int) -> bool:
        """Whether the call ends after step t: a segment boundary, and ``Segments.stop`` says so
        on this rank or, with a lockstep, on any rank decoding with it."""
        if self.stop is None or (t + 1) % self.width != 0:
            return False
        local = bool(self.stop())
        return local if self.lockstep is None else bool(self.lockstep.max([int(local)])[0])

    def calls(self, decoded: int) -> int:
        """Sampling calls used by ``decoded`` tokens: one a segment begun (their call numbers)."""
        return -(-decoded // self.width)


class NativeRollout(RolloutEngine):
    """Generates with the actor's megatron chunks in place (see the module docstring).

    Args:
        config: rollout settings (sampling, lengths, stop tokens, seed).
        runtime: the distributed runtime the chunks were built under.
        actor_chunks: this rank's actor model chunks (DDP-wrapped or bare).
        tokenizer: supplies pad / eos ids when the batch's meta_info does not.
        hf_config: the checkpoint's config (its ``eos_token_id`` also stops generation).
        route_recorder: MoE routing replay: records each fed token's experts into the output's
            ``routed_experts`` (``models/routing.py``; built on ``actor_chunks``). None: no routes.
    """

    def __init__(
        self,
        config: RolloutConfig,
        runtime: Runtime,
        actor_chunks: list[torch.nn.Module],
        tokenizer: Any,
        hf_config: Any,
        route_recorder: RouteRecorder | None = None,
    ) -> None:
        if not actor_chunks:
            raise ValueError("NativeRollout: actor_chunks is empty")
        self.config = config
        self.runtime = runtime
        self.chunks = actor_chunks
        self.tokenizer = tokenizer
        self.hf_config = hf_config
        self.seed = config.seed if config.seed is not None else runtime.seed
        self._calls = 0
        # rollout.bitwise_parity: the same mode (a value: the fixed key length) the trainer
        # switched the actor's chunks to from the same config (models/batch_invariant.py).
        self.batch_invariance = (
            BatchInvariance.for_sequences(config.prompt_length + config.response_length)
            if config.bitwise_parity
            else None
        )
        self._routes = route_recorder if route_recorder is not None else NO_RECORDER
        # CPU: the linears' packed weights (panels / oneDNN), kept between calls of one weights version
        # (``packed.packs`` counts the weights packed so far).
        self.packed = PackedWeights(keep=config.keep_packed_weights)
        # Of the last call: decode_steps (forward steps after the prefill), final_cache_rows (rows
        # still decoded at the end), response_tokens, seconds.
        self.stats: dict[str, float] = {}

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Responses for left-padded prompts [B, Tp] -> [B*n, ...] (keys: ``verl_megatron.rollout.base``).

        ``meta_info`` may set ``validate``, ``do_sample``, ``temperature``, ``top_k``, ``top_p``,
        ``n``, ``eos_token_id``, ``pad_token_id`` and ``response_length`` for this batch, and
        ``weights_version``: an int that changes whenever the actor's weights change (the
        trainer's count of updates). Calls naming the same version reuse the weights packed for
        CPU decoding (``rollout.keep_packed_weights``); without one every call packs afresh.
        """
        return self._generate(prompts, None)[0]

    def generate_segments(self, prompts: DataProto, segments: Segments) -> tuple[DataProto, int]:
        """:meth:`generate_sequences` as consecutive calls of ``segments.width`` tokens each would
        sample it (their call numbers and seeds, see ``_Steps``), in one call that ends early at
        the first boundary where ``segments.stop()`` is true. Returns (output, tokens decoded):
        response columns from that one on are padding in every row (masked).

        Refuses a ``segments.lockstep`` that leaves out the ranks this one decodes with."""
        needed = Lockstep.of(self.runtime).groups
        given = () if segments.lockstep is None else segments.lockstep.groups
        if given != needed:
            raise ValueError(
                f"generate_segments: this rank decodes with {len(needed)} process group(s) "
                f"(tp={self.runtime.layout.tp}, pp={self.runtime.layout.pp}, ep={self.runtime.layout.ep}) "
                f"and segments.lockstep names {len(given)}: pass Lockstep.of(runtime)"
            )
        return self._generate(prompts, segments)

    def _generate(self, prompts: DataProto, segments: Segments | None) -> tuple[DataProto, int]:
        input_ids, mask, positions = prompt_tensors(prompts)
        meta = prompts.meta_info
        params = resolve_sampling(self.config, meta)
        response_length = int(meta.get("response_length", self.config.response_length))
        if response_length < 1:
            raise ValueError(f"generate_sequences: response_length must be >= 1, got {response_length}")
        stops = stop_token_ids(self.config, meta, self.tokenizer, self.hf_config)
        pad = pad_token_id(meta, self.tokenizer)
        device = self.runtime.device
        steps = _Steps(
            self.seed, self._calls, meta, input_ids.shape[0], params, response_length, segments, device
        )
        start = time.perf_counter()
        rows, width = input_ids.shape[0] * params.n, input_ids.shape[1] + response_length
        with (
            self.packed.for_call(meta.get("weights_version")) as packed,
            inference_mode_for(self.chunks, packed) as bare,
            self._routes.recording(rows, width),
        ):
            responses, response_mask, log_probs = self._decode(
                bare,
                packed,
                input_ids.to(device),
                mask.to(device).bool(),
                positions.to(device),
                params,
                stops,
                pad,
                response_length,
                steps,
                vl_prefill.prompt_images(prompts),
            )
        decoded = int(self.stats["decode_steps"]) + 1
        self._calls += steps.calls(decoded)
        self.stats["seconds"] = time.perf_counter() - start
        self.stats["response_tokens"] = float(response_mask.sum())
        output = assemble_output(prompts, responses, response_mask, log_probs, params.n)
        return self._routes.attach(output), decoded

    def _decode(
        self,
        bare: list[torch.nn.Module],
        packed: PackedWeights,
        input_ids: torch.Tensor,
        prompt_valid: torch.Tensor,
        positions: torch.Tensor,
        params: SamplingParams,
        stops: list[int],
        pad: int,
        response_length: int,
        steps: _Steps,
        images: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(responses, response_mask, log_probs), each [B*n, Tr]; see the module docstring.

        ``images``: the prompts' (pixel values, grids), embedded in the prefill (``vl_prefill.py``);
        ``packed``: the call's packed weights (``cpu/packed_linear.py``).
        """
        batch, prompt_len = input_ids.shape
        n, rows, device = params.n, input_ids.shape[0] * params.n, input_ids.device
        info = getattr(bare[0], "verl_model_info", None)
        vocab = info.vocab_size if info is not None else bare[0].vocab_size
        decoder = ChunkDecoder(
            bare, self.runtime, batch, prompt_len + response_length, vocab, self.batch_invariance, packed
        )

        key_valid = torch.ones(batch, prompt_len + response_length, dtype=torch.bool, device=device)
        key_valid[:, :prompt_len] = prompt_valid
        self._routes.begin(torch.arange(rows), 0, expand=n)
        logits = decoder.step(input_ids, positions, key_valid, start=0, images=images)
        if n > 1:
            decoder.reorder(torch.arange(batch, device=device).repeat_interleave(n), filled=prompt_len)
            key_valid = key_valid.repeat_interleave(n, dim=0)
            logits = None if logits is None else logits.repeat_interleave(n, dim=0)

        stop_ids = torch.tensor(stops, dtype=torch.long, device=device)
        next_position = vl_prefill.last_positions(positions).repeat_interleave(n) + 1
        responses = torch.full((rows, response_length), pad, dtype=torch.long, device=device)
        response_mask = torch.zeros(rows, response_length, dtype=torch.long, device=device)
        log_probs = torch.zeros(rows, response_length, dtype=torch.float32, device=device)
        finished = torch.zeros(rows, dtype=torch.bool, device=device)
        active = torch.arange(rows, device=device)  # output row of each cache row
        parity = decoder.parity_length is not None
        for t in range(response_length):
            uniform = steps.uniform(t, active)
            tokens, token_log_probs = self._next_tokens(
                logits, params, uniform, active.numel(), vocab, parity
            )
            live = ~finished[active]
            responses[active, t] = torch.where(live, tokens, pad)
            log_probs[active, t] = torch.where(live, token_log_probs, 0.0)
            response_mask[active, t] = live.long()
            finished[active] |= torch.isin(tokens, stop_ids)
            # Every rank of a replica holds the same tokens; replicas sharing experts agree below.
            if t == response_length - 1 or self._all_done(bool(finished.all())) or steps.stop_after(t):
                self.stats["decode_steps"], self.stats["final_cache_rows"] = t, active.numel()
                break
            keep = ~finished[active]
            if int(keep.sum()) <= _COMPACT_FRACTION * active.numel():
                # Finished rows would keep costing a full step each: drop them from the cache.
                kept = torch.nonzero(keep).flatten()
                if kept.numel() == 0:
                    # Done, but an expert-group peer is not: one row (its outputs are already
                    # masked, as a finished row's are) keeps this rank in the peers' all-to-alls.
                    kept = kept.new_zeros(1)
                decoder.reorder(kept, filled=prompt_len + t)
                key_valid, active = key_valid[kept], active[kept]
            # A replica already done only steps for its expert-group peers: record nothing.
            self._routes.begin(active if bool(keep.any()) else active[:0], prompt_len + t)
            logits = decoder.step(
                responses[active, t : t + 1],
                (next_position[active] + t)[:, None],
                key_valid,
                start=prompt_len + t,
            )
        return responses, response_mask, log_probs

    def _all_done(self, local: bool) -> bool:
        """Whether every replica sharing this rank's expert collectives has finished (else False).

        Ranks of one replica (tp x pp) hold the same tokens already; other replicas only meet
        this one in the MoE layers, when ep > 1 or the expert tp group is wider than tp.
        """
        layout = self.runtime.layout
        if layout.ep == 1 and layout.expert_tp <= layout.tp:
            return local
        flag = torch.tensor([int(local)], dtype=torch.int32, device=self.runtime.device)
        group = self.runtime.expert_group()
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
        return bool(flag.item())

    def _next_tokens(
        self,
        logits: torch.Tensor | None,
        params: SamplingParams,
        uniform: torch.Tensor | None,
        rows: int,
        vocab: int,
        parity: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample on the last pipeline stage; broadcast (tokens [rows], log_probs [rows]) to all ranks.

        ``logits`` [rows, V_pad] are the gathered padded logits. tp ranks of the last stage hold
        identical logits and uniforms; tp rank 0's draw is broadcast anyway so that no rounding
        difference between ranks can split them. The log-probs are then computed as the trainer
        computes them, each tp rank on its own vocabulary slice, when ``parity`` asks for them bit
        for bit or tp > 1 (the broadcast draw may differ from this rank's); otherwise the sampler's
        own log-probabilities serve (equal up to rounding; one pass over the vocabulary, not two).
        """
        device = self.runtime.device
        tp = self.runtime.layout.tp
        # float64 holds token ids exactly and float32 log-probs without rounding: one message.
        packed = torch.empty(2, rows, dtype=torch.float64, device=device)
        if logits is not None:
            tokens, token_log_probs = sample_next(logits[:, :vocab], params, uniform=uniform)
            if tp > 1:
                dist.broadcast(tokens, self.runtime.tp_src_rank(), group=self.runtime.tp_group())
            if parity or tp > 1:
                width = logits.shape[-1] // tp
                start = self.runtime.tp_rank * width
                token_log_probs, _ = vocab_parallel_log_probs(
                    logits[:, start : start + width].contiguous(),
                    tokens,
                    temperature=params.logprob_temperature,
                    vocab_size=vocab,
                    tp_group=self.runtime.tp_group(),
                    vocab_start=start,
                )
            packed[0], packed[1] = tokens, token_log_probs
        if self.runtime.layout.pp > 1:
            dist.broadcast(packed, self.runtime.pp_peer_rank("last"), group=self.runtime.pp_group())
        return packed[0].long(), packed[1].float()
