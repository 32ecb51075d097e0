"""The trainer ranks of a ``rollout.placement=separate`` job: PPO steps on batches generated ahead.

``PPOTrainer``'s own loop, with ``AsyncRolloutLink`` as its rollout source
(``trainer/rollout_source.py``); two of the step's stages differ from a colocated run:

- the batch (``next_batch``): received from the rollout ranks (``timing_s/wait_rollout`` is the
  time spent waiting for it) instead of generated here. The trainer draws the same prompts from
  its own loader and checks them against the batch, so its loader position (checkpointed) always
  says which prompts have been *trained on*: a resumed run regenerates every batch that was
  generated but not trained, and none twice. Each sample's staleness (step - 1 - the oldest
  weight version among its tokens) is checked against ``async_training.max_staleness``; the
  rollout correction (``algorithm.rollout_correction``) then weights or rejects stale tokens.
- after the update (``after_update``): the new weights go to the rollout ranks (bucketed,
  ``WeightSender``), except after the last step. They are read only after the actor's runner has
  completed the update's parameter all-gather (``gather_params``: with the distributed optimizer
  and ``overlap_param_gather`` it would otherwise happen in the next forward, and the rollout
  would get shards one update old). On GPU the payloads are broadcast once over the placement's
  NCCL group (``Placement.weights``); on CPU they go over gloo. Validation generates here, with
  the trainer's own weights.

A function reward (``rollout_scores``: no reward model or judge, a built-in rule-based manager
and scorer) is computed on the rollout's main rank before it sends the batch; the trainer stores
the scores, token-level reward and extra info it received as-is (``stored_rollout_scores``),
the same values its own ``BatchScorer`` would compute from the same batch.

With ``async_training.old_log_probs_on_rollout`` the old log-probs of a batch's last rows come from
the rollout ranks (``old_log_probs``): they compute them once the weights of the step have
arrived, while this rank computes the other rows; messages that arrive before they are asked for
wait in an inbox. With ``actor.old_log_probs_from_first_update`` the first mini-batch's rows need no
pass (the update forward gives them) and the share applies to the other rows, by default all of
them (this rank computes none). The rollout's rows are then not waited for before the update: the
update takes them when it cuts its second mini-batch (``LateOldLogProbs``), so they are computed
while the first one trains.

Per-step metrics ``async/*``: staleness mean/max, fraction of samples that span several
weight versions (partial rollout), the rollout's wait for weights and generation time, and the
time it spent on its share of old log-probs before generating the batch, and on scoring it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from verl_megatron.data import PromptLoader
from verl_megatron.distributed.parallel import Runtime
from verl_megatron.protocol import DataProto
from verl_megatron.reward.loading import compute_reward
from verl_megatron.rollout.async_worker import from_wire, old_log_prob_split, weights_key
from verl_megatron.rollout.placement import Placement
from verl_megatron.rollout.weight_sync import WeightSender, isend_object, recv_object
from verl_megatron.trainer.components import (
    Components,
    build_rollout_model,
    total_training_steps,
    train_reward_fn,
)
from verl_megatron.trainer.config import PPOConfig
from verl_megatron.trainer.first_mini_batch import first_update_rows
from verl_megatron.trainer.ppo_trainer import PPOTrainer
from verl_megatron.trainer.rollout_source import ArrivingOldLogProbs, LogProbFn, ScoreFn
from verl_megatron.trainer.scoring import BatchScorer, store_scores
from verl_megatron.trainer.stall import StageMarks, timed_stage
from verl_megatron.trainer.trainer_checkpoint import RecentWeights, resumed_step_dir, save_due

if TYPE_CHECKING:
    from verl_megatron.rollout.async_worker import RolloutModel
    from verl_megatron.trainer.async_config import AsyncTrainingConfig
    from verl_megatron.workers.actor import MegatronActor

__all__ = [
    "ROLLOUT_SCORED_MANAGERS",
    "SAMPLES_FILE",
    "AsyncRolloutLink",
    "StalenessError",
    "rollout_log_prob_share",
    "rollout_scores",
    "run_rollout_ranks",
    "stored_rollout_scores",
    "train_async",
]

SAMPLES_FILE = "samples.jsonl"


# Built-in rule-based managers: a pure function of the batch, no state kept between steps.
ROLLOUT_SCORED_MANAGERS = ("naive", "dapo", "batch")


class StalenessError(RuntimeError):
    """A batch holds samples older than async_training.max_staleness allows."""


def rollout_scores(config: PPOConfig) -> bool:
    """Whether the rollout ranks score their batches (the one place this is decided).

    Only a function reward moves: no reward model or judge (their models live on the trainer),
    one of ``ROLLOUT_SCORED_MANAGERS``, no ``custom_reward_function`` (a user's file may keep
    state between calls; it stays, contained, on the trainer) and no printed samples
    (``num_examine``: the trainer's log shows them). Anything else scores on the trainer.
    """
    reward = config.reward_model
    return (
        not reward.enable
        and not reward.judge.enable
        and reward.reward_manager in ROLLOUT_SCORED_MANAGERS
        and not config.custom_reward_function.path
        and reward.num_examine == 0
    )


def rollout_log_prob_share(asyn: AsyncTrainingConfig, dp: int, rollout_ranks: int, own: float = 0.0) -> float:
    """The fraction of each batch's rows whose old log-probs the rollout ranks compute: 0 without
    ``async_training.old_log_probs_on_rollout``, else ``old_log_probs_rollout_share``.
    ``own``: the fraction (the first rows) whose old log-probs the actor's update gives itself
    (``actor.old_log_probs_from_first_update``); the share is then one of the other rows, by
    default all of them (the trainer computing none): the update takes them when it cuts its
    second mini-batch, so they cost the trainer nothing if they come by then, while any row it
    computed itself would delay its update. Without it, by default one share per replica of the
    pass (each rollout rank counted as one more, next to dp)."""
    if not asyn.old_log_probs_on_rollout:
        return 0.0
    share = asyn.old_log_probs_rollout_share
    if share is None and own == 0:
        return rollout_ranks / (dp + rollout_ranks)
    return float(1.0 if share is None else share) * (1.0 - own)


def stored_rollout_scores(batch: DataProto) -> dict[str, float]:
    """A ``ScoreFn`` for batches the rollout scored: stores the (reward [B, Tr], extra info) sent in
    ``meta_info["reward"]`` as the trainer's own scoring would; the scorer-failure counts."""
    reward = batch.meta_info.pop("reward", None)
    if reward is None:
        raise RuntimeError("async: the rollout sent a batch without its scores (rollout_scores disagrees)")
    return store_scores(batch, *reward)


class AsyncRolloutLink:
    """A trainer rank's rollout source: batches from the rollout ranks, weights back to them.

    Args:
        config: the run's config (``rollout.n``, ``async_training.max_staleness``, the bucket
            size of the weight sends, the output dir of ``samples.jsonl``).
        runtime: this trainer rank's runtime.
        placement: the roles of the job and the group that joins them.
        loader: the trainer's prompt loader (drawn in step with the rollout's).
        actor: the trained actor, whose weights are sent.
        score: scores a received batch in place (``trainer/scoring.py``'s ``BatchScorer``).
        total_steps: the run's last step (no weights are sent after it).
        stages: told each of the link's stages as it starts (``wait_rollout``, ``reward``,
            ``send_weights``: the stall watchdog, ``trainer/stall.py``), or None.
    """

    def __init__(
        self,
        config: PPOConfig,
        runtime: Runtime,
        placement: Placement,
        loader: PromptLoader,
        actor: MegatronActor,
        score: ScoreFn,
        total_steps: int,
        stages: StageMarks | None = None,
    ) -> None:
        self.runtime, self.placement, self.stages = runtime, placement, stages
        self.loader, self.actor, self.score = loader, actor, score
        self.n, self.total_steps = config.rollout.n, total_steps
        self.max_staleness = config.async_training.max_staleness
        self.samples_path = os.path.join(config.trainer.default_local_dir, SAMPLES_FILE)
        self.config = config
        rows = config.data.train_batch_size * config.rollout.n
        self.own_rows = first_update_rows(config)  # the first mini-batch's (0 when off)
        self.log_prob_share = rollout_log_prob_share(
            config.async_training, runtime.layout.dp, len(placement.rollout_ranks), own=self.own_rows / rows
        )
        self._inbox: list[DataProto | dict[str, Any]] = []  # batches and old log-probs received ahead of use
        # Exact resume: the versions the rollout still generates with after a checkpoint.
        keep = self.max_staleness if config.trainer.save_freq > 0 and runtime.is_main else 0
        self.recent = RecentWeights(keep)
        self.sender = WeightSender(
            placement.transfer,
            placement.rollout_ranks,
            config.rollout.update_weights_bucket_megabytes,
            broadcast=placement.weights,
        )

    # ------------------------------------------------------------------ start, weights, end

    def start(self, step: int) -> None:
        """Tell the rollout ranks where to start (step, loader position, first weight version), then
        send the weights: after a resume from step c, first the versions c-k..c-1 kept in the
        checkpoint, which the batches of steps c+1..c+k were generated with in the saved run."""
        if self.stages is not None:
            self.stages.mark("send_weights", step)
        if self.runtime.is_main:
            earlier = self.recent.restore(resumed_step_dir(self.config, step)) if step > 0 else {}
            start_message = {
                "step": step,
                "version": min(earlier, default=step),
                "total_steps": self.total_steps,
                "loader": self.loader.state_dict(),
                "old_log_prob_share": self.log_prob_share,
            }
            for rank in self.placement.rollout_ranks:
                for work, _ in isend_object(self.placement.transfer, start_message, rank):
                    work.wait()
            self._truncate_samples(step)
            for version, weights in earlier.items():
                self.sender.send(((n, t.to(self.runtime.device)) for n, t in weights.items()), version)
                self.placement.store.set(weights_key(version), "1")
        self._send_weights(step)

    def after_update(self, step: int, timing: dict[str, float]) -> None:
        if step < self.total_steps:
            with timed_stage(self.stages, "send_weights", step, timing):
                self._send_weights(step)
        # The last step's checkpoint too: a run continued from it with more steps needs them.
        if self.runtime.is_main and save_due(self.config, step, self.total_steps):
            self.recent.save(self.config.trainer.default_local_dir, step)  # published with the step

    def finish(self) -> None:
        self.sender.wait()  # on an error the transfer group is shut down instead (train_async)

    def _send_weights(self, version: int) -> None:
        from verl_megatron.models.convert import iter_hf_weights

        self.actor.runner.gather_params()  # collective over dp: the update reaches every shard
        weights = iter_hf_weights(self.actor.chunks, self.runtime)  # collective over tp/pp
        if self.runtime.is_main:
            # A host copy only of the versions a coming checkpoint holds (steps version+1..+keep).
            saved = range(version + 1, version + self.recent.keep + 1)
            needed = any(save_due(self.config, c, self.total_steps) for c in saved)
            self.sender.send(self.recent.record(weights, version, needed), version)
            self.placement.store.set(weights_key(version), "1")
        else:
            for _ in weights:
                pass

    # ------------------------------------------------------------------ the batch

    def next_batch(self, step: int, timing: dict[str, float]) -> tuple[DataProto, dict[str, float]]:
        with timed_stage(self.stages, "wait_rollout", step, timing):
            batch = from_wire(self._receive("batch", -1))
        info = batch.meta_info.pop("async")
        prompts = self.loader.next_batch()
        expected = np.repeat(np.asarray(prompts.non_tensor_batch["index"]), self.n)
        got = np.asarray(batch.non_tensor_batch["index"])
        if info["step"] != step or not np.array_equal(expected, got):
            raise RuntimeError(
                f"async step {step}: the rollout sent the batch of step {info['step']} with prompts "
                f"{got[:: self.n][:8].tolist()}, the trainer's loader drew {expected[:: self.n][:8].tolist()}"
            )
        metrics = self._staleness(batch, step)
        # rollout_old_log_prob_s: its share of the previous batch's old log-probs, before this batch
        for key in ("rollout_wait_weights_s", "rollout_gen_s", "rollout_old_log_prob_s", "rollout_reward_s"):
            metrics[f"async/{key}"] = float(info[key])
        with timed_stage(self.stages, "reward", step, timing):
            metrics.update(self.score(batch))
        self._log_samples(step, batch)
        return batch, metrics

    def _receive(self, kind: str, step: int) -> Any:
        """The rollout's next batch (``kind="batch"``, whatever its step: the caller checks it) or
        the old log-probs of ``step`` (``"old_log_probs"``), on every trainer rank."""
        payload: list[Any] = [None]
        if self.runtime.is_main:
            payload[0] = self._take(kind, step)
        if self.runtime.world_size > 1:
            dist.broadcast_object_list(payload, src=0)
        return payload[0]

    def _take(self, kind: str, step: int) -> Any:
        def wanted(message: DataProto | dict[str, Any]) -> bool:
            if isinstance(message, DataProto):
                return kind == "batch"
            return kind == "old_log_probs" and message["old_log_probs_step"] == step

        while True:
            for i, held in enumerate(self._inbox):
                if wanted(held):
                    return self._inbox.pop(i)
            self._inbox.append(recv_object(self.placement.transfer, self.placement.rollout_main))

    # ------------------------------------------------------------------ old log-probs

    def old_log_probs(
        self, step: int, batch: DataProto, compute: LogProbFn
    ) -> tuple[torch.Tensor, ArrivingOldLogProbs | None]:
        """[B, Tr] old log-probs of step ``step``'s batch: ``compute``'s (the actor's pass) for the
        first rows, the rollout ranks' for the last ``log_prob_share`` of them. When the actor's
        update gives the first mini-batch's own (``own_rows``), the rollout's rows are NaN here and
        come as ``ArrivingOldLogProbs``, taken during the update."""
        if self.log_prob_share == 0:
            return compute(batch), None
        first = old_log_prob_split(len(batch), self.log_prob_share)
        parts = [compute(batch.slice(0, first))] if first > 0 else []
        shape = (len(batch) - first, batch.batch["responses"].shape[1])
        take = functools.partial(self._rollout_rows, step, first, shape)
        if self.own_rows == 0:  # on the batch's device, as the actor's pass returns them
            return torch.cat([*parts, take().to(batch.batch["responses"].device)]), None
        # parts holds at least the first mini-batch's (NaN) rows; the update takes the others later
        later = torch.full(shape, float("nan"), device=parts[0].device, dtype=parts[0].dtype)
        return torch.cat([*parts, later]), ArrivingOldLogProbs(first, take)

    def _rollout_rows(self, step: int, first: int, shape: tuple[int, int]) -> torch.Tensor:
        """The rollout ranks' old log-probs of step ``step``'s rows ``first``.. ([B - first, Tr])."""
        message = self._receive("old_log_probs", step)
        theirs = message["log_probs"]
        if message["first_row"] != first or tuple(theirs.shape) != shape:
            raise RuntimeError(
                f"async step {step}: the rollout sent old log-probs of shape {tuple(theirs.shape)} from row "
                f"{message['first_row']}, expected {shape} from row {first}"
            )
        return theirs

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

    def _log_samples(self, step: int, batch: DataProto) -> None:
        """One line per step: the ids (prompt index / sample number) trained on, main rank only."""
        if not self.runtime.is_main:
            return
        index = batch.non_tensor_batch["index"]
        ids = [f"{index[i]}/{i % self.n}" for i in range(len(batch))]
        versions = batch.batch["weight_version"].tolist()
        with open(self.samples_path, "a") as f:
            f.write(json.dumps({"step": step, "samples": ids, "weight_version": versions}) + "\n")

    def _truncate_samples(self, start: int) -> None:
        """A resumed run forgets the lines of steps after its checkpoint (they are trained again)."""
        if not os.path.exists(self.samples_path):
            return
        with open(self.samples_path) as f:
            kept = [line for line in f if line.strip() and json.loads(line)["step"] <= start]
        with open(self.samples_path, "w") as f:
            f.writelines(kept)


def train_async(
    config: PPOConfig,
    runtime: Runtime,
    components: Components,
    placement: Placement,
    stages: StageMarks | None = None,
) -> dict[str, float]:
    """A trainer rank's run (``train.run`` with ``rollout.placement=separate``); ``stages``: the
    stall watchdog's handle (``trainer/stall.py``), told every stage of the trainer's steps."""
    score = (
        stored_rollout_scores
        if rollout_scores(config)
        else BatchScorer(components.reward_fn, runtime, components.model_rewards)
    )
    total_steps = total_training_steps(config, len(components.train_loader))
    try:
        link = AsyncRolloutLink(
            config, runtime, placement, components.train_loader, components.actor, score, total_steps, stages
        )
        summary = PPOTrainer(config, runtime, components, rollout_source=link, stages=stages).fit()
        placement.barrier()  # the rollout ranks have finished too
        return summary
    finally:
        placement.close()


def _actor_log_probs(config: PPOConfig, runtime: Runtime, model: RolloutModel) -> LogProbFn:
    """The actor's old-log-prob pass (its batching, as ``resolve_worker_configs`` sets it) on a
    rollout rank's model copy."""
    from verl_megatron.rollout.config import old_log_prob_micro_batch_size
    from verl_megatron.workers.actor import ActorLogProbs

    micro = old_log_prob_micro_batch_size(config.rollout, config.actor)
    actor = dataclasses.replace(config.actor, ppo_infer_micro_batch_size_per_gpu=micro)
    forward = ActorLogProbs(runtime, actor, model.chunks)
    return lambda data: forward.compute_log_prob(data)[0]


def run_rollout_ranks(config: PPOConfig, placement: Placement) -> dict[str, float]:
    """A rollout rank's run (``train.run`` with ``rollout.placement=separate``)."""
    from verl_megatron.rollout.async_worker import AheadSettings, run_rollout_worker
    from verl_megatron.trainer.quickstart import prepare_quickstart_assets

    asyn = config.async_training
    segment = asyn.partial_rollout_segment if asyn.partial_rollout else config.rollout.response_length
    settings = AheadSettings(rollout=config.rollout, max_staleness=asyn.max_staleness, segment=segment)

    managers: list[Any] = []  # the training reward manager when built here, closed at the end

    def build(runtime: Runtime) -> RolloutModel:
        # The trainer ranks built the quickstart's assets before the worker's first barrier.
        model = build_rollout_model(prepare_quickstart_assets(config, rank=-1), runtime)
        if rollout_scores(config):
            managers.append(train_reward_fn(config, model.tokenizer))
            model = dataclasses.replace(model, score=functools.partial(compute_reward, reward_fn=managers[0]))
        if not asyn.old_log_probs_on_rollout:
            return model
        return dataclasses.replace(model, old_log_probs=_actor_log_probs(config, runtime, model))

    try:
        return run_rollout_worker(placement, config.trainer.seed, settings, build)
    finally:
        for manager in managers:
            getattr(manager, "close", lambda: None)()
        placement.close()
