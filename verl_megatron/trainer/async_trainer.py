"""The trainer ranks of a ``rollout.placement=separate`` job: PPO steps on batches generated ahead.

Same step as ``PPOTrainer.train_step``, two stages differ:

- collecting the batch: received from the rollout ranks (``timing_s/wait_rollout`` is the time
  spent waiting for it) instead of generated here. The trainer draws the same prompts from its
  own loader and checks them against the batch, so its loader position (checkpointed) always
  says which prompts have been *trained on*: a resumed run regenerates every batch that was
  generated but not trained, and none twice. Each sample's staleness (step - 1 - the oldest
  weight version among its tokens) is checked against ``async_training.max_staleness``; the
  rollout correction (``algorithm.rollout_correction``) then weights or rejects stale tokens.
- after the update: the new weights go to the rollout ranks (bucketed, ``WeightSender``), except
  after the last step. Validation generates here, with the trainer's own weights.

Per-step metrics ``async/*``: staleness mean/max, fraction of samples that span several
weight versions (partial rollout), the rollout's wait for weights and generation time.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from verl_megatron.protocol import DataProto
from verl_megatron.rollout.async_worker import weights_key
from verl_megatron.rollout.placement import Placement
from verl_megatron.rollout.weight_sync import WeightSender, isend_object, recv_object
from verl_megatron.trainer import metrics as M
from verl_megatron.trainer.ppo_trainer import PPOTrainer

__all__ = ["SAMPLES_FILE", "AsyncPPOTrainer", "StalenessError"]

SAMPLES_FILE = "samples.jsonl"


class StalenessError(RuntimeError):
    """A batch holds samples older than async_training.max_staleness allows."""


class AsyncPPOTrainer(PPOTrainer):
    """PPOTrainer whose batches come from the rollout ranks (see the module docstring)."""

    def __init__(self, config: Any, runtime: Any, components: Any, placement: Placement) -> None:
        super().__init__(config, runtime, components)
        self.placement = placement
        self.max_staleness = config.async_training.max_staleness
        self.sender = WeightSender(
            placement.transfer, placement.rollout_ranks, config.rollout.update_weights_bucket_megabytes
        )

    def fit(self) -> dict[str, float]:
        summary = super().fit()
        self.sender.wait()  # on an error the transfer group is shut down instead (train_async)
        return summary

    # ------------------------------------------------------------------ start and weights

    def _resume(self) -> int:
        start = super()._resume()
        if self.runtime.is_main:
            start_message = {
                "step": start,
                "total_steps": self.total_steps,
                "loader": self.train_loader.state_dict(),
            }
            for rank in self.placement.rollout_ranks:
                for work, _ in isend_object(self.placement.transfer, start_message, rank):
                    work.wait()
            self._truncate_samples(start)
        self._send_weights(start)
        return start

    def _send_weights(self, version: int) -> None:
        from verl_megatron.models.convert import iter_hf_weights

        weights = iter_hf_weights(self.actor.chunks, self.runtime)  # collective over tp/pp
        if self.runtime.is_main:
            self.sender.send(weights, version)
            self.placement.store.set(weights_key(version), "1")
        else:
            for _ in weights:
                pass

    def _after_update(self, step: int, timing: dict[str, float]) -> None:
        if step < self.total_steps:
            with M.timed("send_weights", timing):
                self._send_weights(step)

    # ------------------------------------------------------------------ the batch

    def _receive_batch(self) -> DataProto:
        payload: list[Any] = [None]
        if self.runtime.is_main:
            payload[0] = recv_object(self.placement.transfer, self.placement.rollout_main)
        if self.runtime.world_size > 1:
            dist.broadcast_object_list(payload, src=0)
        return payload[0]

    def _collect_batch(self, step: int, timing: dict[str, float]) -> tuple[DataProto, dict[str, float]]:
        with M.timed("wait_rollout", timing):
            batch = self._receive_batch()
        info = batch.meta_info.pop("async")
        prompts = self.train_loader.next_batch()
        n = self.config.rollout.n
        expected = np.repeat(np.asarray(prompts.non_tensor_batch["index"]), n)
        got = np.asarray(batch.non_tensor_batch["index"])
        if info["step"] != step or not np.array_equal(expected, got):
            raise RuntimeError(
                f"async step {step}: the rollout sent the batch of step {info['step']} with prompts "
                f"{got[::n][:8].tolist()}, the trainer's loader drew {expected[::n][:8].tolist()}"
            )
        metrics = self._staleness(batch, step)
        metrics["async/rollout_wait_weights_s"] = float(info["rollout_wait_weights_s"])
        metrics["async/rollout_gen_s"] = float(info["rollout_gen_s"])
        with M.timed("reward", timing):
            metrics.update(self._score(batch, self.reward_fn))
        self._log_samples(step, batch)
        return batch, metrics

    def _staleness(self, batch: DataProto, step: int) -> dict[str, float]:
        """Per sample: step - 1 - oldest weight version among its tokens; the bound is enforced."""
        versions = batch.batch["rollout_versions"]
        valid = versions >= 0
        oldest = torch.where(valid, versions, versions.new_full((), 2**62)).min(-1).values
        oldest = torch.where(valid.any(-1), oldest, batch.batch["weight_version"])
        newest = versions.max(-1).values
        stale = (step - 1) - oldest
        if int(stale.max()) > self.max_staleness:
            raise StalenessError(
                f"async step {step}: a sample was generated with weights {int(stale.max())} versions old, "
                f"over async_training.max_staleness={self.max_staleness}"
            )
        return {
            "async/staleness_mean": float(stale.float().mean()),
            "async/staleness_max": float(stale.max()),
            "async/partial_fraction": float(((newest > oldest) & valid.any(-1)).float().mean()),
        }

    # ------------------------------------------------------------------ which samples were trained

    def _samples_path(self) -> str:
        return os.path.join(self.config.trainer.default_local_dir, SAMPLES_FILE)

    def _log_samples(self, step: int, batch: DataProto) -> None:
        """One line per step: the ids (prompt index / sample number) trained on, main rank only."""
        if not self.runtime.is_main:
            return
        n = self.config.rollout.n
        index = batch.non_tensor_batch["index"]
        ids = [f"{index[i]}/{i % n}" for i in range(len(batch))]
        versions = batch.batch["weight_version"].tolist()
        with open(self._samples_path(), "a") as f:
            f.write(json.dumps({"step": step, "samples": ids, "weight_version": versions}) + "\n")

    def _truncate_samples(self, start: int) -> None:
        """A resumed run forgets the lines of steps after its checkpoint (they are trained again)."""
        path = self._samples_path()
        if not os.path.exists(path):
            return
        with open(path) as f:
            kept = [line for line in f if line.strip() and json.loads(line)["step"] <= start]
        with open(path, "w") as f:
            f.writelines(kept)


def train_async(config: Any, runtime: Any, components: Any, placement: Placement) -> dict[str, float]:
    """A trainer rank's run (``train.run`` with ``rollout.placement=separate``)."""
    try:
        summary = AsyncPPOTrainer(config, runtime, components, placement).fit()
        placement.barrier()  # the rollout ranks have finished too
        return summary
    finally:
        placement.close()


def run_rollout_ranks(config: Any, placement: Placement) -> dict[str, float]:
    """A rollout rank's run (``train.run`` with ``rollout.placement=separate``)."""
    from verl_megatron.rollout.async_worker import run_rollout_worker

    try:
        return run_rollout_worker(config, placement)
    finally:
        placement.close()
