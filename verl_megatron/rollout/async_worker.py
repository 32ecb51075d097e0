"""The rollout ranks of a ``rollout.placement=separate`` job: generate the trainer's batches ahead.

Each rollout rank holds its own whole copy of the model (tp=pp=1, megatron initialised over the
rollout ranks only, see ``rollout/placement.py``) and the native engine on it. The loop, for the
steps the trainer will run (it sends where to start: step, data-loader position, weights):

    for step s: receive weight versions until the loaded one is >= s-1-max_staleness
                draw the prompts of step s (same loader, same order as the trainer's)
                generate (in segments with partial_rollout, picking up newer weights between them)
                (a function reward, ``RolloutModel.score``) score it on the rollout's main rank
                send the batch to the trainer, with each token's weight version (and its scores)
                (async_training.old_log_probs_on_rollout) once the weights of step b-1 are
                loaded, i.e. after the wait of step b+max_staleness: the old log-probs of the
                last rows of batch b (``old_log_prob_split``), sent to the trainer

The sampling call number of step s is fixed (``s * CALLS_PER_STEP`` + segment), so a resumed
run draws the same tokens as an uninterrupted one given the same weights.

With ``rollout.agent`` the batch is the harness's conversations (``rollout/agent.py``) through
this rank's own endpoint over its engine; with partial rollout, newer weights load between two
engine calls (a turn is the segment), and each token carries its version as above.

The trainer layer hands this module what it builds (``RolloutModel``: tokenizer, model config,
prompt loader, the model copy) and the plain settings it reads (``AheadSettings``); nothing here
knows the trainer's config.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from verl_megatron.data import PromptLoader
from verl_megatron.distributed.parallel import Runtime
from verl_megatron.protocol import DataProto, pad_dataproto_to_divisor, unpad_dataproto
from verl_megatron.rollout.base import generation_meta
from verl_megatron.rollout.config import RolloutConfig
from verl_megatron.rollout.placement import Placement
from verl_megatron.rollout.weight_sync import Message, isend_object, receive_weights, recv_object

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

__all__ = [
    "CALLS_PER_STEP",
    "AheadSettings",
    "ChunkWeights",
    "RolloutModel",
    "RolloutWorker",
    "from_wire",
    "last_rows_log_probs",
    "old_log_prob_split",
    "run_rollout_worker",
    "to_wire",
    "weights_key",
]

CALLS_PER_STEP = 1024


def old_log_prob_split(rows: int, share: float) -> int:
    """The first row of a batch of ``rows`` whose old log-probs the rollout ranks compute (they take
    the last ``round(rows * share)``; the trainer the rows before)."""
    return rows - round(rows * share)


def last_rows_log_probs(
    batch: DataProto, share: float, compute: Callable[[DataProto], torch.Tensor]
) -> tuple[int, torch.Tensor]:
    """(first row, [B - first, Tr] log-probs of rows first..B-1 by ``compute``): the rollout ranks'
    part of a batch's old log-probs (``old_log_prob_split``); [0, Tr] when the share rounds to no
    row of this batch (``compute`` is not called)."""
    first = old_log_prob_split(len(batch), share)
    if first == len(batch):
        return first, torch.zeros(0, batch.batch["responses"].shape[1])
    return first, compute(batch.slice(first, None))


def to_wire(batch: DataProto) -> DataProto:
    """``batch`` for the trip to the trainer: each integer tensor in the narrowest integer dtype
    that holds its values, its own dtype named in ``meta_info["wire_dtypes"]`` (``from_wire``
    restores it). Token ids, positions, masks and weight versions are int64 in the batch and most
    of its bytes; the trainer waits for the transfer at the start of its step, so fewer bytes
    shorten its critical path (the quickstart's 512 rows of 8 + 128 tokens: 3.8 MB a message ->
    1.0 MB; token ids of a vocabulary past 32767 stay 4 bytes). The values are unchanged, and
    ``batch`` itself too."""
    tensors, dtypes = {}, {}
    for key, value in batch.batch.items():
        narrow = _narrowest_int(value)
        tensors[key] = value if narrow is None else value.to(narrow)
        if narrow is not None:
            dtypes[key] = str(value.dtype).removeprefix("torch.")
    meta = {**batch.meta_info, "wire_dtypes": dtypes}
    return DataProto.from_dict(tensors, dict(batch.non_tensor_batch), meta)


def from_wire(batch: DataProto) -> DataProto:
    """The batch ``to_wire`` sent, its integer tensors back in their own dtypes (in place)."""
    for key, name in batch.meta_info.pop("wire_dtypes").items():
        batch.batch[key] = batch.batch[key].to(getattr(torch, name))
    return batch


def _narrowest_int(tensor: torch.Tensor) -> torch.dtype | None:
    """The narrowest of int8/16/32 narrower than ``tensor``'s integer dtype that holds its values;
    None for other dtypes, empty tensors and values that need their own width."""
    if tensor.dtype not in (torch.int16, torch.int32, torch.int64) or tensor.numel() == 0:
        return None
    low, high = int(tensor.min()), int(tensor.max())
    for dtype in (torch.int8, torch.int16, torch.int32):
        if dtype.itemsize >= tensor.dtype.itemsize:
            return None
        info = torch.iinfo(dtype)
        if info.min <= low and high <= info.max:
            return dtype
    return None


def weights_key(version: int) -> str:
    """Store key the trainer sets once weight version ``version`` is on its way."""
    return f"weights/{version}"


class ChunkWeights:
    """Loads Hugging Face-named weights (as ``iter_hf_weights`` yields them) into tp=1 chunks."""

    def __init__(self, chunks: list[torch.nn.Module]) -> None:
        from verl_megatron.models.builder import model_info
        from verl_megatron.models.convert import hf_mapping
        from verl_megatron.models.sharding import named_global_parameters

        self.info = model_info(chunks)
        self.params = {n: p for n, p in named_global_parameters(chunks) if p.numel() > 0}
        self.mappings = {n: hf_mapping(n, self.info) for n in self.params}
        self.users: dict[str, list[str]] = {}  # HF name -> megatron parameters built from it
        for name, mapping in self.mappings.items():
            for hf_name in mapping.hf_names:
                self.users.setdefault(hf_name, []).append(name)
        self._pending: dict[str, torch.Tensor] = {}
        self.loaded: set[str] = set()

    @torch.no_grad()
    def load(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        from verl_megatron.models.convert import to_megatron

        for hf_name, tensor in bucket:
            if hf_name not in self.users:
                raise RuntimeError(f"received weight {hf_name!r}, which no rollout parameter uses")
            self._pending[hf_name] = tensor
            for name in self.users[hf_name]:
                mapping = self.mappings[name]
                if all(h in self._pending for h in mapping.hf_names):
                    whole = to_megatron(mapping, [self._pending[h] for h in mapping.hf_names], self.info, 1)
                    param = self.params[name]
                    param.copy_(whole.to(param.device, param.dtype))
                    self.loaded.add(name)

    def finish_version(self) -> None:
        """Check that the version just received covered every parameter; reset for the next."""
        missing = sorted(set(self.params) - self.loaded)
        if missing:
            raise RuntimeError(f"weight update left rollout parameters unset: {missing[:4]}")
        self._pending.clear()
        self.loaded.clear()


@dataclass
class RolloutModel:
    """What a rollout rank generates with, built by the trainer layer for this rank."""

    tokenizer: PreTrainedTokenizerBase
    hf_config: PretrainedConfig
    loader: PromptLoader
    """The training prompt loader, the same data and order as the trainer's."""
    chunks: list[torch.nn.Module]
    """This rank's whole model copy (tp=pp=1), loaded with the starting weights."""
    harness: Any = None
    """``rollout.agent``'s harness (``rollout/agent.py``'s ``Harness``); None without agents."""
    old_log_probs: Callable[[DataProto], torch.Tensor] | None = None
    """[B, Tr] log-probs of a batch's responses computed as the actor's old-log-prob pass, on
    ``chunks`` (``async_training.old_log_probs_on_rollout``); None: the trainer computes them all."""
    score: Callable[[DataProto], tuple[torch.Tensor, dict[str, list[Any]]]] | None = None
    """(reward [B, Tr], per-sample extra info) of a generated batch, sent with it in
    ``meta_info["reward"]`` for the trainer to store as-is; None: the trainer scores it."""


@dataclass(frozen=True)
class AheadSettings:
    """How far generation runs ahead (``async_training``) and how it decodes (``rollout``)."""

    rollout: RolloutConfig
    max_staleness: int
    """Most weight versions a batch may lag behind the step that trains it."""
    segment: int
    """Tokens decoded between two checks for new weights (the whole response: one segment)."""


class RolloutWorker:
    """One rollout rank (see the module docstring)."""

    def __init__(
        self, settings: AheadSettings, runtime: Runtime, placement: Placement, model: RolloutModel
    ) -> None:
        from verl_megatron.rollout.base import stop_token_ids
        from verl_megatron.rollout.native import NativeRollout

        self.settings, self.runtime, self.placement = settings, runtime, placement
        self.tokenizer, self.loader = model.tokenizer, model.loader
        for chunk in model.chunks:
            chunk.requires_grad_(False)
        self.weights = ChunkWeights(model.chunks)
        self.engine = NativeRollout(settings.rollout, runtime, model.chunks, self.tokenizer, model.hf_config)
        self.stops = stop_token_ids(
            settings.rollout, generation_meta(self.tokenizer), self.tokenizer, model.hf_config
        )
        self.version = -1
        self.wait_s = 0.0  # blocked waiting for weights
        self.agent = self._agent(model.harness) if model.harness is not None else None
        self.log_probs = model.old_log_probs
        self.score = model.score

    def _agent(self, harness: Any) -> Any:
        """The agent rollout over this rank's engine; newer weights load between its engine calls
        only with partial rollout (a segment shorter than the response)."""
        from verl_megatron.rollout.agent import AgentRollout
        from verl_megatron.rollout.endpoint import WeightVersions

        partial = self.settings.segment < self.settings.rollout.response_length
        versions = WeightVersions(lambda: self.version, self._refresh if partial else lambda: None)
        return AgentRollout(self.engine, self.settings.rollout, self.tokenizer, harness, self.stops, versions)

    def _receive(self) -> None:
        placement = self.placement
        version = receive_weights(
            placement.transfer, 0, self.weights.load, broadcast=placement.weights, device=self.runtime.device
        )
        self.weights.finish_version()
        if version != self.version + 1 and self.version >= 0:
            raise RuntimeError(f"rollout: weight version {version} arrived after {self.version}")
        self.version = version

    def _refresh(self) -> None:
        """Load every weight version the trainer has already sent (partial rollout).

        Not under an NCCL broadcast with several rollout ranks: every rollout rank must join each
        broadcast, and the ranks' segment loops end at different points (a rank whose rows are all
        done stops refreshing), so a rank waiting in a broadcast could wait on a peer waiting in
        the batch gather. Weights then arrive at step starts, which every rank reaches alike.
        """
        while self._weights_waiting():
            self._receive()

    def _weights_waiting(self) -> bool:
        """Whether :meth:`_refresh` would load a newer version now."""
        if self.placement.weights is not None and len(self.placement.rollout_ranks) > 1:
            return False
        return self.placement.store.check([weights_key(self.version + 1)])

    def _generate(self, prompts: DataProto, step: int) -> DataProto:
        from verl_megatron.rollout.native import Lockstep
        from verl_megatron.rollout.partial import generate_with_versions

        cfg = self.settings.rollout
        ranks, rank = dist.get_world_size(), dist.get_rank()
        padded, pad = pad_dataproto_to_divisor(prompts, ranks)
        local = padded.chunk(ranks)[rank]
        local.meta_info.update(
            **generation_meta(self.tokenizer), validate=False, prompt_offset=rank * len(local),
        )  # fmt: skip
        self.engine.load_state_dict({"calls": step * CALLS_PER_STEP})
        if self.agent is not None:
            output = self.agent.generate_sequences(local)
        else:
            output = generate_with_versions(
                self.engine, local, response_length=cfg.response_length, segment=self.settings.segment,
                stops=self.stops, pad=self.tokenizer.pad_token_id,
                version=lambda: self.version, refresh=self._refresh, pending=self._weights_waiting,
                lockstep=Lockstep.of(self.runtime),  # none to agree with: each rank is a whole replica
            )  # fmt: skip
        output.meta_info = {}
        if ranks > 1:
            parts: list[Any] = [None] * ranks
            dist.all_gather_object(parts, output)
            output = DataProto.concat(parts)
        output = unpad_dataproto(output, pad * cfg.n)
        output.meta_info["temperature"] = cfg.temperature if cfg.temperature > 0 else 1.0
        return output

    def run(self) -> None:
        placement = self.placement
        start = recv_object(placement.transfer, 0)
        self.loader.load_state_dict(start["loader"])
        self._receive()  # the weights of step start
        staleness = self.settings.max_staleness
        share = float(start.get("old_log_prob_share", 0.0))
        if share > 0 and self.log_probs is None:
            raise RuntimeError("the trainer asks for old log-probs, this rollout rank was built without them")
        sends: list[tuple[int, list[Message]]] = []  # (step, its batch's or old log-probs' messages)
        due: dict[int, DataProto] = {}  # batches whose old log-probs are still to compute
        for step in range(start["step"] + 1, start["total_steps"] + 1 + (staleness if share > 0 else 0)):
            began = time.perf_counter()
            # A resumed run starts from the oldest version its next batches were generated with.
            while self.version < max(start.get("version", start["step"]), step - 1 - staleness):
                self._receive()
            waited = time.perf_counter() - began
            # Weights of step s-1-k came after the trainer took batch s-1-k: those buffers can go.
            sends = _complete_sends(sends, up_to=step - 1 - staleness)
            log_prob_s = 0.0
            if staleness > 0 and step - staleness in due:
                began = time.perf_counter()
                sends.extend(self._send_old_log_probs(due.pop(step - staleness), step - staleness, share))
                log_prob_s = time.perf_counter() - began
            if step > start["total_steps"]:
                continue  # only the old log-probs of the last batches were left
            prompts = self.loader.next_batch()
            prompts.non_tensor_batch["uid"] = np.array(
                [f"{step}-1-{i}" for i in range(len(prompts))], dtype=object
            )
            began = time.perf_counter()
            output = self._generate(prompts, step)
            gen_s = time.perf_counter() - began
            main = placement.rank == placement.rollout_main
            if main and self.score is not None:  # the batch as the trainer would score it
                output.meta_info["reward"] = self.score(output)
            output.meta_info["async"] = {
                "step": step, "rollout_wait_weights_s": waited, "rollout_gen_s": gen_s,
                "rollout_old_log_prob_s": log_prob_s, "rollout_reward_s": time.perf_counter() - began - gen_s,
            }  # fmt: skip
            if main:
                sends.append((step, isend_object(placement.transfer, to_wire(output), 0)))
            if share > 0:
                due[step] = output
            if staleness == 0 and share > 0:
                sends.extend(self._send_old_log_probs(due.pop(step), step, share))
        # The trainer sends every version but its last step's: take them so its sends complete.
        while self.version < start["total_steps"] - 1:
            self._receive()
        _complete_sends(sends, up_to=start["total_steps"])

    def _send_old_log_probs(
        self, batch: DataProto, step: int, share: float
    ) -> list[tuple[int, list[Message]]]:
        """Old log-probs of the last rows of ``batch`` (step ``step``) with the weights of step
        ``step - 1`` (loaded now: the next version needs them first), sent to the trainer."""
        assert self.log_probs is not None
        if self.version != step - 1:
            raise RuntimeError(f"rollout: old log-probs of step {step} due with weights {self.version}")
        first, log_probs = last_rows_log_probs(batch, share, self.log_probs)
        if self.placement.rank != self.placement.rollout_main:
            return []
        message = {"old_log_probs_step": step, "first_row": first, "log_probs": log_probs.cpu()}
        return [(step, isend_object(self.placement.transfer, message, 0))]


def _complete_sends(sends: list[tuple[int, list[Message]]], up_to: int) -> list[tuple[int, list[Message]]]:
    """Wait for the sends of the batches of steps <= ``up_to``; return the others (still in flight)."""
    for _, works in [item for item in sends if item[0] <= up_to]:
        for work, _ in works:
            work.wait()
    return [item for item in sends if item[0] > up_to]


def run_rollout_worker(
    placement: Placement, seed: int, settings: AheadSettings, build: Callable[[Runtime], RolloutModel]
) -> dict[str, float]:
    """Main of a rollout rank: wait for the trainer's assets, build the model copy, generate.

    ``build`` makes this rank's ``RolloutModel`` once the runtime exists (it reads the files the
    trainer ranks have written before the first barrier).
    """
    from verl_megatron.distributed.parallel import ParallelLayout, init_runtime

    placement.barrier()  # the trainer ranks have written the quickstart's model and data
    runtime = init_runtime(ParallelLayout(), seed=seed)
    RolloutWorker(settings, runtime, placement, build(runtime)).run()
    placement.barrier()  # the trainer has every batch and its weight sends are complete
    return {}
