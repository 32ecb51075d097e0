"""Supervised fine-tuning: ``verl-megatron sft --config configs/sft.yaml`` (``trainer.mode: sft``).

The same config schema, start-up checks, output directory, checkpoints, resume, divergence
guard, metrics and Hugging Face export as the RL trainer, with one stage per step::

    loader.next_batch (SFT rows, data/sft_dataset.py) -> actor.sft_update (workers/sft.py)
        -> validation loss (every test_freq) -> checkpoint (every save_freq) -> metrics

Rows per step: ``data.train_batch_size``; one optimizer step per ``actor.ppo_mini_batch_size``
rows; micro-batches, packing, dynamic batch size, ``actor.loss_agg_mode``, LoRA and the parallel
layout are the actor's settings. Metrics: ``train/loss`` (the step's mean aggregated loss),
``train/num_tokens`` (trained tokens), ``actor/grad_norm``, ``actor/lr``, ``val/loss`` (the token
mean over the validation set), ``timing_s/*``.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from verl_megatron.distributed.parallel import Runtime
from verl_megatron.trainer import metrics as M
from verl_megatron.trainer.config import PPOConfig, load_config, to_dict, validate_config
from verl_megatron.trainer.final_export import export_final_model
from verl_megatron.trainer.guard import DivergenceGuard
from verl_megatron.trainer.progress import DataSizes
from verl_megatron.trainer.tracking import Tracking
from verl_megatron.trainer.trainer_checkpoint import load_resume_state, publish_step, save_step

if TYPE_CHECKING:
    from verl_megatron.data.sft_dataset import SFTLoader
    from verl_megatron.workers.sft import SFTActor

__all__ = ["SFTParts", "SFTTrainer", "build_sft", "prepare_sft", "sft_startup_line"]


def _check_sft_data(config: PPOConfig) -> DataSizes | None:
    """Every SFT row checked (no tokenizer); None when the quickstart writes the data itself."""
    from verl_megatron.data.dataset import DataFormatError
    from verl_megatron.data.sft_dataset import check_sft_files

    data = config.data
    if not data.train_files:
        return None
    train_rows = check_sft_files(data.train_files, config.sft, data.image_key)
    val_rows = check_sft_files(data.val_files, config.sft, data.image_key) if data.val_files else 0
    if train_rows < data.train_batch_size:
        raise DataFormatError(
            f"data.train_batch_size={data.train_batch_size} is larger than the {train_rows} rows of "
            f"data.train_files {list(data.train_files)}; lower it or add data"
        )
    return DataSizes(train_rows=train_rows, val_rows=val_rows)


def prepare_sft(config_path: str | None, overrides: Sequence[str], world_size: int) -> tuple[Any, Any, Any]:
    """(config, layout, data sizes) of an SFT run of ``world_size`` processes, everything checked."""
    config, layout = check_sft_config(load_config(config_path, list(overrides)), world_size)
    return config, layout, _check_sft_data(config)


def check_sft_config(config: PPOConfig, world_size: int, this_machine: bool = True) -> tuple[PPOConfig, Any]:
    """(config with its derived micro-batch size, layout): the config checks of an SFT run
    (``this_machine``: see ``validate_config``)."""
    from verl_megatron.errors import ConfigError

    if config.rollout.n != 1:
        raise ConfigError(f"rollout.n={config.rollout.n}: SFT trains each row once; set rollout.n=1")
    # SFT builds the actor alone: checked as a run without critic (the default estimator has one).
    actor_only = dataclasses.replace(
        config, algorithm=dataclasses.replace(config.algorithm, adv_estimator="reinforce_plus_plus")
    )
    layout = validate_config(actor_only, world_size, this_machine)
    return dataclasses.replace(config, actor=actor_only.actor), layout  # with a derived micro-batch size


def sft_startup_line(config: PPOConfig, layout: Any, world_size: int, data: DataSizes | None) -> str:
    model = config.model.path or f"quickstart tiny {config.quickstart.family}"
    rows = "synthetic SFT rows" if data is None else f"{data.train_rows} train / {data.val_rows} val rows"
    steps = config.trainer.total_training_steps or f"{config.trainer.total_epochs} epochs of"
    parallel = f"tp={layout.tp} pp={layout.pp} dp={layout.dp} ({world_size} process(es))"
    return (
        f"verl-megatron sft: model {model} | {config.model.dtype} | {parallel} | "
        f"{rows}, batch {config.data.train_batch_size} rows | {steps} steps | "
        f"output {config.trainer.default_local_dir}"
    )


@dataclass
class SFTParts:
    """What the SFT loop drives, built for this rank."""

    tokenizer: Any
    hf_config: Any
    actor: SFTActor
    train_loader: SFTLoader
    val_loader: SFTLoader | None


def _loaders(config: PPOConfig, tokenizer: Any) -> tuple[SFTLoader, SFTLoader | None]:
    from verl_megatron.data.sft_dataset import SFTDataset, SFTLoader

    data = config.data
    seed = data.seed if data.seed is not None else config.trainer.seed
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    train_set = SFTDataset(data.train_files, tokenizer, config.sft, data)
    train = SFTLoader(train_set, data.train_batch_size, shuffle=data.shuffle, seed=seed, pad_token_id=pad)
    if not data.val_files:
        return train, None
    val_set = SFTDataset(data.val_files, tokenizer, config.sft, data)
    size = data.val_batch_size or len(val_set)
    return train, SFTLoader(val_set, size, shuffle=False, seed=seed, pad_token_id=pad, drop_last=False)


def build_sft(config: PPOConfig, runtime: Runtime) -> tuple[PPOConfig, SFTParts]:
    """Tokenizer, SFT loaders and the actor; the config with the actor's run length filled in."""
    from verl_megatron.models.config import load_hf_config
    from verl_megatron.models.lora import apply_configured_lora
    from verl_megatron.models.matmul_route import MatmulRoute
    from verl_megatron.models.megatron_model import build_optimizer, wrap_ddp
    from verl_megatron.trainer.components import policy_chunks, total_training_steps
    from verl_megatron.utils.tokenizer import hf_tokenizer
    from verl_megatron.workers.lr_schedule import build_lr_scheduler, optim_settings
    from verl_megatron.workers.sft import SFTActor

    tokenizer = hf_tokenizer(config.model.tokenizer_path or config.model.path)
    hf_config = load_hf_config(config.model.path)
    train_loader, val_loader = _loaders(config, tokenizer)
    steps = total_training_steps(config, len(train_loader))
    # One row per sample and no prompt to share: the actor's RL-only settings are fixed here.
    actor_config = dataclasses.replace(
        config.actor,
        rollout_n=1,
        share_prompt_prefix=False,
        optim=dataclasses.replace(config.actor.optim, total_training_steps=steps),
    )
    config = dataclasses.replace(config, actor=actor_config)
    route = MatmulRoute()  # the update's matmul route (models/matmul_route.py)
    policy = apply_configured_lora(
        policy_chunks(config, runtime, hf_config, route=route), config.model, runtime.seed
    )
    settings = optim_settings(actor_config.optim, bf16=config.model.dtype == "bfloat16")
    chunks = wrap_ddp(policy, settings)
    optimizer = build_optimizer(chunks, settings)
    actor = SFTActor(
        runtime,
        actor_config,
        chunks,
        optimizer,
        build_lr_scheduler(optimizer, actor_config.optim),
        route=route,
    )
    return config, SFTParts(tokenizer, hf_config, actor, train_loader, val_loader)


def token_mean_nll(log_probs: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    """(sum of -log p over masked tokens, their count), in float64."""
    kept = mask.bool()
    return float(-log_probs.double()[kept].sum()), float(kept.sum())


class SFTTrainer:
    """The SFT loop (see the module docstring); every rank runs it on the same batches."""

    def __init__(self, config: PPOConfig, runtime: Runtime, parts: SFTParts) -> None:
        from verl_megatron.trainer.components import total_training_steps

        self.config, self.runtime, self.parts = config, runtime, parts
        self.actor = parts.actor
        self.total_steps = total_training_steps(config, len(parts.train_loader))
        self.guard = DivergenceGuard(config.trainer.divergence_guard, config.actor.optim.lr)
        self.tracker = Tracking("", "", [], "", enabled=False)  # replaced in fit()
        self.val_history: list[tuple[int, float]] = []
        self._staged: int | None = None

    def fit(self) -> dict[str, float]:
        """Train until ``total_steps``; returns the first and last validation loss."""
        start = self._resume()
        trainer = self.config.trainer
        self.tracker = Tracking(
            trainer.project_name, trainer.experiment_name, list(trainer.logger), trainer.default_local_dir,
            config=to_dict(self.config), total_steps=self.total_steps,
            resume_step=start if start > 0 else None, enabled=self.runtime.is_main,
        )  # fmt: skip
        try:
            return self._fit(start)
        finally:
            self.tracker.close()  # on an error too: the terminal's cursor, the writers' threads

    def _fit(self, start: int) -> dict[str, float]:
        trainer = self.config.trainer
        if start > 0:
            self.tracker.print(f"resumed from step {start} in {trainer.default_local_dir}")
        if trainer.val_before_train and start == 0 and self.parts.val_loader is not None:
            self.tracker.log(self.validate(0), step=0)
        self.guard.start(self.actor.chunks)
        for step in range(start + 1, self.total_steps + 1):
            metrics = self.train_step(step)
            self.tracker.log(metrics, step=step)
            self.guard.check(step, metrics, self.actor.chunks)
            if self._staged is not None:  # published after its metrics are logged
                publish_step(self.config, self._staged)
                self._staged = None
        return self._finish()

    def train_step(self, step: int) -> dict[str, float]:
        timing: dict[str, float] = {}
        metrics: dict[str, float] = {}
        with M.timed("step", timing):
            batch = self.parts.train_loader.next_batch()
            with M.timed("update_actor", timing):
                metrics.update(M.reduce_metrics(self.actor.sft_update(batch)))
            metrics["train/loss"] = metrics["actor/sft_loss"]
            metrics.update(self._test_and_save(step, timing))
        tokens = float(batch.batch["attention_mask"].sum())
        metrics["train/num_tokens"] = float(batch.batch["response_mask"].sum())
        metrics.update({f"timing_s/{k}": v for k, v in timing.items()})
        metrics["perf/throughput"] = tokens / timing["step"] / self.runtime.world_size
        metrics["training/global_step"] = float(step)
        metrics["training/epoch"] = float(self.parts.train_loader.epoch)
        return metrics

    def _test_and_save(self, step: int, timing: dict[str, float]) -> dict[str, float]:
        trainer, last = self.config.trainer, step == self.total_steps
        metrics: dict[str, float] = {}
        if (
            self.parts.val_loader is not None
            and trainer.test_freq > 0
            and (step % trainer.test_freq == 0 or last)
        ):
            with M.timed("testing", timing):
                metrics.update(self.validate(step))
        if trainer.save_freq > 0 and (step % trainer.save_freq == 0 or last):
            with M.timed("save_checkpoint", timing):
                save_step(self.config, step, self._state(step), self.runtime, self.actor, None)
                self._staged = step
        return metrics

    def validate(self, step: int) -> dict[str, float]:
        """``val/loss``: the token mean of -log p over the validation set's assistant tokens."""
        total, count = 0.0, 0.0
        for batch in self.parts.val_loader.epoch_batches():
            log_probs, _ = self.actor.compute_log_prob(batch)
            nll, tokens = token_mean_nll(log_probs, batch.batch["response_mask"])
            total, count = total + nll, count + tokens
        loss = total / max(count, 1.0)
        self.val_history.append((step, loss))
        return {"val/loss": loss}

    def _state(self, step: int) -> dict[str, Any]:
        return {
            "global_step": step,
            "train_loader": self.parts.train_loader.state_dict(),
            "actor_update_calls": self.actor.update_calls,
            "val_history": list(self.val_history),
        }

    def _resume(self) -> int:
        def warn(line: str) -> None:
            if self.runtime.is_main:
                print(line, file=sys.stderr, flush=True)

        state = load_resume_state(self.config, self.runtime, self.actor, None, warn)
        if state is None:
            return 0
        self.parts.train_loader.load_state_dict(state["train_loader"])
        self.actor.update_calls = state["actor_update_calls"]
        self.val_history = [tuple(v) for v in state["val_history"]]
        return int(state["global_step"])

    def _finish(self) -> dict[str, float]:
        trainer = self.config.trainer
        if trainer.export_hf:
            out_dir = export_final_model(
                self.actor.chunks, self.runtime, trainer.default_local_dir, self.parts.hf_config,
                self.parts.tokenizer, self.config.model,
            )  # fmt: skip
            self.tracker.print(f"exported the final model as a Hugging Face model to {out_dir}")
        png = self.tracker.finish()
        if png:
            self.tracker.print(f"metrics: {self.tracker.jsonl_path}; curves: {png}")
        if not self.val_history:
            return {}
        (first_step, first), (last_step, last) = self.val_history[0], self.val_history[-1]
        self.tracker.print(
            f"validation loss: {first:.4f} at step {first_step} -> {last:.4f} at step {last_step}"
        )
        if not (math.isfinite(first) and math.isfinite(last)):
            self.tracker.print("warning: non-finite validation loss")
        return {
            "val/first": first,
            "val/last": last,
            "val/first_step": first_step,
            "val/last_step": last_step,
        }
