"""The PPO-family training loop (verl's ``RayPPOTrainer.fit`` without Ray), SPMD under torchrun.

Every process runs this same loop on the same global batch; the workers split
rows over data-parallel ranks themselves and return whole results, and the
rollout engine receives each rollout replica's share of the prompts
(``rollout/layout.py``; the trainer gathers the responses back). Rank 0 alone computes rewards (then
broadcasts them, so a slow or random scorer cannot split the ranks) and logs.

One step, top to bottom (``train_step``)::

    rollout_source.next_batch: prompts -> gen -> reward [-> DAPO: repeat until enough groups
                               with reward variance] (async: received from the rollout ranks)
            -> old_log_prob -> ref -> values -> adv -> update_critic -> update_actor
            -> rollout_source.after_update (async: send the weights to the rollout ranks)
            -> testing (every test_freq) -> save_checkpoint (every save_freq) -> metrics
            -> publish the checkpoint (after the metrics are logged)

The rollout source (``trainer/rollout_source.py``) is this trainer's own generation
(``LocalRollout``) unless the caller passes another (``async_trainer.train_async``).
"""

from __future__ import annotations

import contextlib
import inspect
import math
import sys
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from verl_megatron.algos import core_algos
from verl_megatron.distributed.parallel import Runtime
from verl_megatron.models.offload import Offloader
from verl_megatron.protocol import DataProto, pad_dataproto_to_divisor, unpad_dataproto
from verl_megatron.rollout.base import generation_meta
from verl_megatron.rollout.layout import gather_replicas, shard_for
from verl_megatron.trainer import metrics as M
from verl_megatron.trainer.components import Components, RewardFn, total_training_steps
from verl_megatron.trainer.config import PPOConfig, to_dict
from verl_megatron.trainer.distill_stage import DistillTeacher, distill_advantages, teacher_log_probs
from verl_megatron.trainer.dynamic_sampling import keep_varied_groups
from verl_megatron.trainer.final_export import export_final_model
from verl_megatron.trainer.first_mini_batch import (
    LateOldLogProbs,
    first_rows_skipped,
    first_update_rows,
    pass_diff_metrics,
    rollout_correction,
)
from verl_megatron.trainer.guard import DivergenceGuard, divergence_marker
from verl_megatron.trainer.parity_probe import parity_probe
from verl_megatron.trainer.rollout_phase import rollout_phase
from verl_megatron.trainer.rollout_source import ArrivingOldLogProbs, LogProbFn, RolloutSource
from verl_megatron.trainer.scoring import Reward, combined_reward, store_scores
from verl_megatron.trainer.stall import StageMarks, timed_stage
from verl_megatron.trainer.tracking import Tracking
from verl_megatron.trainer.trainer_checkpoint import load_resume_state, publish_step, save_step

__all__ = ["LocalRollout", "PPOTrainer"]


class LocalRollout:
    """The rollout source of a colocated run: the trainer generates and scores each batch itself
    (``PPOTrainer._collect_batch``); the engine picks up new weights before its next generation."""

    def __init__(self, trainer: PPOTrainer) -> None:
        # Weak: the trainer owns its source, and a reference back would keep the trainer (its
        # models and engine) alive after its last use, until a garbage collection.
        self._trainer = weakref.ref(trainer)

    def start(self, step: int) -> None:
        pass

    def next_batch(self, step: int, timing: dict[str, float]) -> tuple[DataProto, dict[str, float]]:
        trainer = self._trainer()
        assert trainer is not None, "the trainer of this rollout source is gone"
        return trainer._collect_batch(step, timing)

    def old_log_probs(
        self, step: int, batch: DataProto, compute: LogProbFn
    ) -> tuple[torch.Tensor, ArrivingOldLogProbs | None]:
        return compute(batch), None

    def after_update(self, step: int, timing: dict[str, float]) -> None:
        pass

    def finish(self) -> None:
        pass


class PPOTrainer:
    """Drives rollout, reward, advantage estimation and the actor/critic updates.

    Args:
        config: the checked config (``validate_config``), with worker fields resolved.
        runtime: this process's distributed runtime.
        components: tokenizer, workers, rollout, reward functions and data loaders
            (``verl_megatron.trainer.components.build_components``).
        rollout_source: where the batches come from; None: ``LocalRollout`` (generated here).
        teacher: on-policy distillation's frozen teacher (``trainer/distill_stage.py``), or None.
        stages: told each stage as it starts (the stall watchdog, ``trainer/stall.py``), or None.
    """

    def __init__(
        self,
        config: PPOConfig,
        runtime: Runtime,
        components: Components,
        rollout_source: RolloutSource | None = None,
        teacher: DistillTeacher | None = None,
        stages: StageMarks | None = None,
    ) -> None:
        self.config = config
        self.runtime = runtime
        self.tokenizer = components.tokenizer
        self.actor, self.ref, self.critic = components.actor, components.ref, components.critic
        self.rollout = components.rollout
        self.reward_fn, self.val_reward_fn = components.reward_fn, components.val_reward_fn
        self.model_rewards = components.model_rewards  # reward model / judge, combined in _reward
        if self.model_rewards is not None:
            self.model_rewards.bind_generate(
                lambda prompts: self._generate(prompts, validate=True, greedy=True)
            )
        self.train_loader, self.val_loader = components.train_loader, components.val_loader
        self.hf_config = components.hf_config
        self.total_steps = total_training_steps(config, len(self.train_loader))
        self.kl_ctrl = (
            core_algos.get_kl_controller(config.algorithm.kl_ctrl)
            if config.algorithm.use_kl_in_reward
            else None
        )
        self.peak_flops = M.device_peak_flops(config.trainer.device_peak_tflops)
        self.val_history: list[tuple[int, float]] = []
        self.tracker = Tracking("", "", [], "", enabled=False)  # replaced in fit()
        self.global_step = 0
        # The rollout engine holds a copy of the weights only for external engines; these
        # count actor updates so a copy is refreshed once per update, not once per call.
        self._weights_version, self._synced_version = 0, -1
        self.offloader = Offloader()  # what the rollout phase parks, for the whole run
        self._in_rollout_phase = False
        self._staged_checkpoint: int | None = None  # step saved but not yet published
        self._validation_error: Exception | None = None  # raised once its step's checkpoint is out
        marker = divergence_marker(config.trainer.default_local_dir) if runtime.is_main else None
        self.guard = DivergenceGuard(config.trainer.divergence_guard, config.actor.optim.lr, marker)
        self.routes = components.routes  # MoE routing replay (workers/routes.py), or None
        self.rollout_source: RolloutSource = LocalRollout(self) if rollout_source is None else rollout_source
        self.teacher = teacher
        self.stages = stages

    # ------------------------------------------------------------------ the loop

    def fit(self) -> dict[str, float]:
        """Train until ``total_steps``; returns the first and last mean validation score."""
        try:
            summary = self._fit()
        finally:
            self.tracker.close()  # on an error too: the terminal's cursor, the writers' threads
            self._close_rewards()
        self.rollout_source.finish()
        return summary

    def _close_rewards(self) -> None:
        if self.model_rewards is not None:
            self.model_rewards.close()
        if self.teacher is not None:
            self.teacher.close()
        # Scorer worker processes end with the run, not at garbage collection.
        for reward_fn in {id(f): f for f in (self.reward_fn, self.val_reward_fn) if f is not None}.values():
            close = getattr(reward_fn, "close", None)
            if callable(close):
                close()

    def _fit(self) -> dict[str, float]:
        start = self._resume()
        self.rollout_source.start(start)
        self.tracker = self._start_tracking(start)
        if self.config.trainer.val_before_train and start == 0 and self.val_loader is not None:
            self.tracker.log(self._validate(0), step=0)
        self.guard.start(self.actor.chunks)
        for step in range(start + 1, self.total_steps + 1):
            self.global_step = step
            metrics = self.train_step(step)
            self.tracker.log(metrics, step=step)
            # Raises before a blown-up step's checkpoint is published.
            self.guard.check(step, metrics, self.actor.chunks)
            # A step's checkpoint is written inside train_step but published only now, after its
            # metrics are in the log: a run killed in between resumes from the previous
            # checkpoint, so no published step is ever missing from the log.
            if self._staged_checkpoint is not None:
                publish_step(self.config, self._staged_checkpoint)
                self._staged_checkpoint = None
            if self._validation_error is not None:
                raise self._validation_error
        return self._finish()

    def _start_tracking(self, start: int) -> Tracking:
        trainer = self.config.trainer
        tracker = Tracking(
            trainer.project_name,
            trainer.experiment_name,
            list(trainer.logger),
            trainer.default_local_dir,
            config=to_dict(self.config),
            total_steps=self.total_steps,
            resume_step=start if start > 0 else None,
            enabled=self.runtime.is_main,
        )
        if start > 0:
            tracker.print(f"resumed from step {start} in {trainer.default_local_dir}")
        return tracker

    def train_step(self, step: int) -> dict[str, float]:
        """One PPO step; returns its metrics (verl's names)."""
        timing: dict[str, float] = {}
        metrics: dict[str, float] = {}
        with M.timed("step", timing):
            batch, gen_metrics = self.rollout_source.next_batch(step, timing)
            metrics.update(gen_metrics)
            late = self._old_log_probs(batch, step, timing, metrics)
            if self.config.algorithm.rollout_correction.bypass_mode:  # bypass trusts parity: probe it
                metrics.update(parity_probe(self.actor, batch, step, self.config.rollout, timing))
            if late is None:
                metrics.update(rollout_correction(batch, self.config))
            self._reference_and_values(batch, timing)
            if self.teacher is not None:  # log p_teacher of the sampled tokens
                metrics.update(teacher_log_probs(self.teacher, batch, timing, self.config.algorithm.distill))
            with self._stage("adv", timing):
                metrics.update(self._compute_advantages(batch))
            metrics.update(self._update(batch, step, timing, late))
            if late is not None:  # the pass's diff and rollout correction of the rows that came late
                metrics.update(late.finish())
            self.rollout_source.after_update(step, timing)
            metrics.update(self._test_and_save(step, timing))
        metrics.update(self._batch_metrics(batch, timing))
        metrics["training/global_step"] = float(step)
        metrics["training/epoch"] = float(self.train_loader.epoch)
        return metrics

    # ------------------------------------------------------------------ the step's stages

    def _old_log_probs(
        self, batch: DataProto, step: int, timing: dict[str, float], metrics: dict[str, float]
    ) -> LateOldLogProbs | None:
        """``old_log_probs``: the rollout's (bypass), recomputed by the actor, or (on-policy) none
        here; with both, how far the rollout's log-probs are from the recomputed ones (into
        ``metrics``). Rows the rollout source gives during the update: their ``LateOldLogProbs``."""
        bypass = self.config.algorithm.rollout_correction.bypass_mode
        recompute = self.config.actor.recompute_old_log_prob
        own = first_update_rows(self.config)
        if bypass:
            # Equal bit for bit to a recomputation (bitwise parity, required at start-up).
            batch.batch["old_log_probs"] = batch.batch["rollout_log_probs"]
        elif recompute:
            with self._stage("old_log_prob", timing):
                compute = lambda data: self.actor.compute_log_prob(data)[0]  # noqa: E731
                if own:  # the first mini-batch's rows (NaN here) come from the actor's update forward
                    compute = first_rows_skipped(own, compute)
                old, arriving = self.rollout_source.old_log_probs(step, batch, compute)
                batch.batch["old_log_probs"] = old
            if arriving is not None:
                return LateOldLogProbs(batch, self.config, arriving, timing, self.stages, step)
        # else: an on-policy update takes its own log-probs as the old ones (checked at start-up).
        if recompute and not bypass:
            metrics.update(pass_diff_metrics(batch, own))  # the rows the pass computed
        return None

    def _reference_and_values(self, batch: DataProto, timing: dict[str, float]) -> None:
        if self.ref is not None:
            with self._stage("ref", timing):
                batch.batch["ref_log_prob"], _ = self.ref.compute_log_prob(batch)
        if self.critic is not None:
            with self._stage("values", timing):
                batch.batch["values"] = self.critic.compute_values(batch)

    def _update(
        self, batch: DataProto, step: int, timing: dict[str, float], late: LateOldLogProbs | None
    ) -> dict[str, float]:
        """The critic's update, then the actor's (after ``trainer.critic_warmup`` steps), which
        takes ``late``'s rows when it needs them."""
        metrics: dict[str, float] = {}
        if self.critic is not None:
            with self._stage("update_critic", timing):
                metrics.update(self._report_skips("critic", self.critic.update_critic(batch), step))
        if step > self.config.trainer.critic_warmup:
            with self._stage("update_actor", timing):
                update = self.actor.update_policy(batch, late.rows() if late is not None else None)
                metrics.update(self._report_skips("actor", update, step))
            self._weights_version += 1
        if self.routes is not None:
            metrics.update(self.routes.end_step())
        return metrics

    def _test_and_save(self, step: int, timing: dict[str, float]) -> dict[str, float]:
        """Validation every ``trainer.test_freq`` steps and a checkpoint every ``save_freq`` (and at the end)."""
        trainer = self.config.trainer
        last = step == self.total_steps
        metrics: dict[str, float] = {}
        save = trainer.save_freq > 0 and (step % trainer.save_freq == 0 or last)
        if self.val_loader is not None and trainer.test_freq > 0 and (step % trainer.test_freq == 0 or last):
            with self._stage("testing", timing):
                try:
                    metrics.update(self._validate(step))
                except Exception as err:
                    if not save:
                        raise
                    # What the step trained is kept: its checkpoint is written and published with
                    # its training metrics logged (_fit), then the error is raised.
                    self._validation_error = err
        if save:
            with self._stage("save_checkpoint", timing):
                save_step(self.config, step, self._trainer_state(step), self.runtime, self.actor, self.critic)
                self._staged_checkpoint = step
        return metrics

    def _stage(self, name: str, timing: dict[str, float]) -> contextlib.AbstractContextManager[None]:
        """Time stage ``name`` of the current step, telling ``self.stages`` that it starts."""
        return timed_stage(self.stages, name, self.global_step, timing)

    def _batch_metrics(self, batch: DataProto, timing: dict[str, float]) -> dict[str, float]:
        """The batch's statistics, stage times, throughput and the actor update's MFU."""
        metrics = M.compute_data_metrics(batch, self.critic is not None, self.config.data.max_response_length)
        metrics.update(M.compute_timing_metrics(batch, timing))
        metrics.update(M.compute_throughput_metrics(batch, timing["step"], self.runtime.world_size))
        if "update_actor" in timing:  # less its wait for an async rollout's old log-probs
            seconds = timing["update_actor"] - timing.get("wait_old_log_probs", 0.0)
            epochs, devices = self.config.actor.ppo_epochs, self.runtime.world_size
            metrics.update(M.actor_mfu(batch, self.hf_config, epochs, seconds, devices, self.peak_flops))
        return metrics

    # ------------------------------------------------------------------ rollout and reward

    def _collect_batch(self, step: int, timing: dict[str, float]) -> tuple[DataProto, dict[str, float]]:
        """Generate and score one step's batch; with DAPO dynamic sampling, keep generating until
        ``data.train_batch_size`` prompt groups have reward variance."""
        algo, n = self.config.algorithm, self.config.rollout.n
        groups_cfg, target = algo.filter_groups, self.config.data.train_batch_size
        kept: list[DataProto] = []
        kept_groups, rounds = 0, 0
        reward_counts: dict[str, float] = {}
        while True:
            rounds += 1
            prompts = self.train_loader.next_batch()
            # Deterministic group ids (not uuid4): a resumed run must form the same groups.
            prompts.non_tensor_batch["uid"] = np.array(
                [f"{step}-{rounds}-{i}" for i in range(len(prompts))], dtype=object
            )
            # ReMax's greedy baseline in the same wake of the engine as the samples.
            with self._stage("gen", timing), self._rollout_phase():
                batch = self._generate(prompts, validate=False)
                if algo.adv_estimator == "remax":
                    baseline = self._generate(prompts, validate=False, greedy=True)
            with self._stage("reward", timing):
                for key, count in self._score(batch, self.reward_fn).items():
                    reward_counts[key] = reward_counts.get(key, 0.0) + count
                if algo.adv_estimator == "remax":
                    scores, _ = self._reward(baseline, self.reward_fn)
                    batch.batch["reward_baselines"] = scores.sum(-1).repeat_interleave(n)
            if not groups_cfg.enable:
                return batch, reward_counts
            batch, num_groups = keep_varied_groups(batch, groups_cfg.metric)
            if num_groups:
                kept.append(batch)
                kept_groups += num_groups
            if kept_groups >= target:
                break
            if 0 < groups_cfg.max_num_gen_batches <= rounds:
                raise RuntimeError(
                    f"DAPO dynamic sampling: after {rounds} generation rounds "
                    f"(algorithm.filter_groups.max_num_gen_batches={groups_cfg.max_num_gen_batches}) only "
                    f"{kept_groups} of the {target} prompt groups needed (data.train_batch_size) had samples "
                    f"with different '{groups_cfg.metric}'; raise max_num_gen_batches or data.gen_batch_size, "
                    "or check that the reward can vary within a group"
                )
        # A prompt's samples are adjacent rows, so the first target*n rows are whole groups.
        batch = DataProto.concat(kept).slice(0, target * n)
        return batch, {
            **reward_counts,
            "train/num_gen_batches": float(rounds),
            "train/num_kept_groups": float(kept_groups),
        }

    def _generate(self, prompts: DataProto, validate: bool, greedy: bool = False) -> DataProto:
        """Responses for the global prompt batch: each dp rank generates its share, then all gather."""
        rollout_cfg = self.config.rollout
        # weights_version: the native engine keeps its packed weights while it stays the same.
        prompts.meta_info.update(
            generation_meta(self.tokenizer), validate=validate, weights_version=self._weights_version
        )
        if greedy:
            prompts.meta_info["do_sample"] = False
        # Split by the rollout's replicas (rollout/layout.py), not by the training dp rank.
        shard = shard_for(rollout_cfg.name, rollout_cfg.tensor_model_parallel_size, self.runtime)
        padded, pad = pad_dataproto_to_divisor(prompts, shard.replicas)
        local = padded.chunk(shard.replicas)[shard.replica]
        local.meta_info["prompt_offset"] = shard.replica * len(local)
        with self._rollout_phase():
            output = self.rollout.generate_sequences(local).to("cpu")
        if self.routes is not None:  # MoE routes stay on the ranks that recorded them
            output = self.routes.keep(output, shard.replica, shard.replicas, validate)
        # Per replica, so the parts would disagree in the concat (it refuses conflicting keys).
        output.meta_info.pop("prompt_offset", None)
        output = DataProto.concat(gather_replicas(output, shard, self.runtime.world_size))
        samples_per_prompt = len(output) // len(padded)
        output = unpad_dataproto(output, pad * samples_per_prompt)
        # The actor's log-probs must be those of the distribution the rollout sampled from.
        output.meta_info["temperature"] = rollout_cfg.temperature if rollout_cfg.temperature > 0 else 1.0
        for key in ("validate", "do_sample", "prompt_offset", "weights_version"):
            output.meta_info.pop(key, None)
        return output

    @contextlib.contextmanager
    def _rollout_phase(self) -> Iterator[None]:
        """The engine awake, the training state parked (``trainer/rollout_phase.py``); inside an
        open phase, nothing more (several generate calls share one wake of the engine)."""
        if self._in_rollout_phase:
            yield
            return
        self._in_rollout_phase = True
        try:
            with rollout_phase(
                self.config,
                self.rollout,
                self.actor,
                self.ref,
                self.critic,
                self._sync_rollout_weights,
                self.offloader,
            ):
                yield
        finally:
            self._in_rollout_phase = False

    def _sync_rollout_weights(self) -> None:
        """Load the actor's weights into the engine if they changed since it last took them."""
        if self._synced_version != self._weights_version:
            self.rollout.sync_weights()
            self._synced_version = self._weights_version

    def _reward(self, batch: DataProto, reward_fn: RewardFn) -> Reward:
        """(reward [B, Tr], extra info) of ``reward_fn`` and the model rewards (``trainer/scoring.py``)."""
        return combined_reward(batch, reward_fn, self.runtime, self.model_rewards)

    def _score(self, batch: DataProto, reward_fn: RewardFn) -> dict[str, float]:
        """Score the batch in place (``token_level_scores``, extra info); the scorer-failure counts."""
        return store_scores(batch, *self._reward(batch, reward_fn))

    # ------------------------------------------------------------------ advantages

    def _compute_advantages(self, batch: DataProto) -> dict[str, float]:
        """token_level_rewards (KL penalty optional), then the configured estimator's advantages/returns."""
        algo = self.config.algorithm
        tensors = batch.batch
        metrics: dict[str, float] = {}
        if self.kl_ctrl is not None:
            tensors["token_level_rewards"], kl_metrics = core_algos.apply_kl_penalty_to_rewards(
                tensors["token_level_scores"],
                tensors["old_log_probs"],
                tensors["ref_log_prob"],
                tensors["response_mask"],
                self.kl_ctrl,
                algo.kl_penalty,
            )
            metrics.update(kl_metrics)
        else:
            tensors["token_level_rewards"] = tensors["token_level_scores"]
        present = set(tensors.keys())
        available = {
            "token_level_rewards": tensors["token_level_rewards"],
            "response_mask": tensors["response_mask"],
            "values": tensors["values"] if "values" in present else None,
            "reward_baselines": tensors["reward_baselines"] if "reward_baselines" in present else None,
            "index": batch.non_tensor_batch["uid"],
            "gamma": algo.gamma,
            "lam": algo.lam,
            "zero_masked": True,  # gae: advantages 0 on masked cells (verl leaves leftovers)
            "norm_adv_by_std_in_grpo": algo.norm_adv_by_std_in_grpo,
            "config": algo,
            "non_tensor_batch": batch.non_tensor_batch,  # gdpo's reward components
            "batch": tensors,
        }
        estimator = core_algos.get_adv_estimator_fn(algo.adv_estimator)
        wanted = inspect.signature(estimator).parameters
        advantages, returns = estimator(
            **{k: v for k, v in available.items() if k in wanted and v is not None}
        )
        tensors["advantages"], tensors["returns"] = advantages, returns
        if self.teacher is not None:  # reverse-KL advantages (+ coef x the estimator's)
            metrics.update(distill_advantages(batch, algo.distill))
        return metrics

    def _report_skips(self, role: str, worker_metrics: dict[str, Any], step: int) -> dict[str, float]:
        """Average per-mini-batch metrics; say so when optimizer steps were skipped for non-finite
        gradients (the worker leaves the weights untouched and the run goes on)."""
        reduced = M.reduce_metrics(worker_metrics)
        skipped = int(reduced.get(f"{role}/skipped_steps", 0))
        if skipped:
            self.tracker.print(
                f"step {step}: {skipped} {role} optimizer step(s) skipped: non-finite loss or gradient norm"
            )
        return reduced

    # ------------------------------------------------------------------ validation

    def _validate(self, step: int) -> dict[str, float]:
        """Validation-sampling (greedy by default) rollouts of the whole validation set:
        ``val/test_score/<data_source>`` = mean score."""
        sources: list[str] = []
        scores: list[float] = []
        failures: dict[str, float] = {}  # val/reward/{timeout,error,invalid}_count over the set
        verl_names = M.VerlValidationMetrics()  # val-core/... and val-aux/..., as verl logs them
        for index, prompts in enumerate(self.val_loader.epoch_batches()):
            verl_names.tag_prompts(prompts, index)
            output = self._generate(prompts, validate=True)
            reward, extra = self._reward(output, self.val_reward_fn)
            scores.extend(reward.sum(-1).tolist())
            sources.extend(str(s) for s in output.non_tensor_batch[self.config.data.reward_fn_key])
            for key, values in extra.items():
                if key.startswith("reward/") and key.endswith("_count"):
                    failures[f"val/{key}"] = failures.get(f"val/{key}", 0.0) + float(np.sum(values))
            verl_names.add(output, reward, extra, self.config.data.reward_fn_key)
        result = M.validation_metrics(sources, scores)
        self.val_history.append((step, float(np.mean(list(result.values())))))
        return {**result, **failures, **verl_names.metrics()}

    # ------------------------------------------------------------------ checkpoints

    def _trainer_state(self, step: int) -> dict[str, Any]:
        return {
            "global_step": step,
            "train_loader": self.train_loader.state_dict(),
            "kl_coef": None if self.kl_ctrl is None else self.kl_ctrl.value,
            "rollout": self.rollout.state_dict(),
            "actor_update_calls": self.actor.update_calls,
            "critic_update_calls": getattr(self.critic, "update_calls", None),
            "val_history": list(self.val_history),
        }

    def _resume(self) -> int:
        """Load the checkpoint ``trainer.resume_mode`` points at; return its step (0: fresh start)."""
        state = load_resume_state(self.config, self.runtime, self.actor, self.critic, self._warn)
        if state is None:
            return 0
        self.train_loader.load_state_dict(state["train_loader"])
        # A fixed coefficient is config, not state: a resume with a new kl_coef uses it.
        if (
            self.kl_ctrl is not None
            and state["kl_coef"] is not None
            and self.config.algorithm.kl_ctrl.type != "fixed"
        ):
            self.kl_ctrl.value = state["kl_coef"]
        # The rollout seeds each call from a call counter, the workers their mini-batch
        # shuffles from an update counter: both continue where the saved run stopped.
        self.rollout.load_state_dict(state["rollout"])
        self.actor.update_calls = state["actor_update_calls"]
        if self.critic is not None and state["critic_update_calls"] is not None:
            self.critic.update_calls = state["critic_update_calls"]
        self.val_history = [tuple(v) for v in state["val_history"]]
        return int(state["global_step"])

    def _warn(self, line: str) -> None:
        if self.runtime.is_main:
            print(line, file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ end of run

    def _finish(self) -> dict[str, float]:
        trainer = self.config.trainer
        if trainer.export_hf:  # hf_export/ (and lora_adapter/ with LoRA)
            out_dir = export_final_model(
                self.actor.chunks, self.runtime, trainer.default_local_dir, self.hf_config, self.tokenizer,
                self.config.model,
            )  # fmt: skip
            self.tracker.print(f"exported the final actor as a Hugging Face model to {out_dir}")
        png = self.tracker.finish()
        if png:
            self.tracker.print(f"metrics: {self.tracker.jsonl_path}; curves: {png}")
        summary: dict[str, float] = {}
        if self.val_history:
            (first_step, first), (last_step, last) = self.val_history[0], self.val_history[-1]
            summary = {
                "val/first": first,
                "val/last": last,
                "val/first_step": first_step,
                "val/last_step": last_step,
            }
            self.tracker.print(
                f"validation reward (mean over data sources): {first:.3f} at step {first_step} -> "
                f"{last:.3f} at step {last_step}"
            )
        if not all(math.isfinite(v) for v in summary.values()):
            self.tracker.print("warning: non-finite validation reward")
        return summary
