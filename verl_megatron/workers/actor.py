"""The PPO policy (actor) and the frozen reference policy on megatron model chunks.

Workers receive already-built chunks, optimizer and LR scheduler (they never build
models), and are called the same way on every rank with the same *global* batch,
like verl's trainer calls its worker group: each data-parallel rank takes its own
share of the rows, and results (log-probs, metrics) come back whole on every rank.

Batch keys (``DataProto.batch``): ``input_ids``/``attention_mask`` [B, Tp+Tr],
``responses``/``response_mask`` [B, Tr]; for ``update_policy`` also ``old_log_probs``,
``advantages`` and, with ``use_kl_loss``, ``ref_log_prob`` (optional
``rollout_is_weights``; with ``meta_info["distill_jsd"]``, GKD distillation's
``teacher_logits`` [B, Tr, V]). ``meta_info["temperature"]`` is required: log-probs are those
of softmax(logits / temperature), the distribution the rollout sampled from.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Callable

import torch
import torch.distributed as dist

from verl_megatron.algos import core_algos
from verl_megatron.algos.gkd import generalized_jsd_per_token
from verl_megatron.algos.policy_losses import metrics_on_device
from verl_megatron.algos.rollout_corr_helper import rollout_is_weights
from verl_megatron.distributed.modules import unwrap
from verl_megatron.distributed.parallel import Runtime
from verl_megatron.models.batch_invariant import BatchInvariance
from verl_megatron.models.logprobs import rows_per_chunk, vocab_parallel_log_probs
from verl_megatron.models.matmul_route import MatmulRoute
from verl_megatron.models.megatron_model import attach_schedule_hooks
from verl_megatron.models.routing import ROW_ID_KEY
from verl_megatron.protocol import DataProto
from verl_megatron.workers import vl_inputs
from verl_megatron.workers.batching import LateRows, MicroBatch
from verl_megatron.workers.config import ActorConfig, PolicyLossSettings, RefConfig
from verl_megatron.workers.model_runner import ModelRunner, StepResult, dp_share
from verl_megatron.workers.output_rows import DeferredHead, head_log_probs
from verl_megatron.workers.ppo_updates import PPOUpdates
from verl_megatron.workers.routes import TrainingRoutes

__all__ = ["FIRST_UPDATE_IS", "ActorLogProbs", "MegatronActor", "MegatronRef"]

_MODEL_KEYS = ("input_ids", "attention_mask", "responses")
_POLICY_METRICS = ("pg_loss", "pg_clipfrac", "ppo_kl", "pg_clipfrac_lower", "entropy", "kl_loss")
# [B] bool: rows whose old log-probs are their update forward's (old_log_probs_from_first_update).
_OWN_OLD_KEY = "_old_log_probs_from_update"
# meta_info key: rollout correction's IS settings (rollout_is, rollout_is_threshold) for those rows,
# whose weights the update computes from its forward and ``rollout_log_probs``.
FIRST_UPDATE_IS = "first_update_rollout_is"


def batch_tensors(data: DataProto, keys: tuple[str, ...], where: str) -> dict[str, torch.Tensor]:
    """The named [B, ...] tensors of ``data`` on the CPU (and ``vl_inputs.ROW_IMAGES`` where rows carry
    images); KeyError naming what is missing."""
    if data.batch is None:
        raise KeyError(f"{where}: the DataProto has no tensor batch; it needs {list(keys)}")
    # TensorDict refuses `in` on itself: membership goes through keys().
    missing = [k for k in keys if k not in data.batch.keys()]  # noqa: SIM118
    if missing:
        raise KeyError(f"{where}: batch is missing {missing}; it has {sorted(data.batch.keys())}")
    out = {k: data.batch[k].cpu() for k in keys}
    width = out["responses"].shape[1] if "responses" in out else None
    for key, value in out.items():
        if key in ("input_ids", "attention_mask", "responses") or value.dim() == 1:
            continue
        if width is not None and value.shape[1] != width:  # [B, Tr] or [B, Tr, ...]
            raise ValueError(
                f"{where}: '{key}' has shape {tuple(value.shape)}, expected [B, {width}] like responses"
            )
    if out["attention_mask"].shape != out["input_ids"].shape:
        raise ValueError(
            f"{where}: attention_mask {tuple(out['attention_mask'].shape)} and input_ids "
            f"{tuple(out['input_ids'].shape)} differ in shape"
        )
    out.update(vl_inputs.row_images(data, where))  # image rows: their images and 3-D positions
    return out


def _row_keys(data: DataProto) -> tuple[str, ...]:
    """Per-row [B] keys the micro-batches carry along: MoE routing replay's row ids, when present."""
    present = data.batch is not None and ROW_ID_KEY in data.batch.keys()  # noqa: SIM118
    return (ROW_ID_KEY,) if present else ()


def temperature_of(data: DataProto, where: str) -> float:
    if "temperature" not in data.meta_info:
        raise KeyError(
            f"{where}: meta_info['temperature'] is required (log-probs are taken at the rollout's sampling "
            "temperature); set it to the rollout temperature"
        )
    temperature = float(data.meta_info["temperature"])
    if not temperature > 0:
        raise ValueError(f"{where}: meta_info['temperature'] must be > 0, got {temperature}")
    return temperature


class _PolicyForward:
    """Forward-only log-probs of the response tokens; shared by the actor and the reference."""

    def __init__(
        self,
        runtime: Runtime,
        chunks: list[torch.nn.Module],
        use_remove_padding: bool,
        share_prefix: bool,
        route_replay: TrainingRoutes | None = None,
        batch_invariance: BatchInvariance | None = None,
        group_by_length: bool = False,
    ) -> None:
        self.runtime = runtime
        self.chunks = chunks
        self.runner = ModelRunner(
            runtime,
            chunks,
            use_remove_padding=use_remove_padding,
            merges_cp=True,
            select_output_rows=True,
            share_prefix=share_prefix,
            route_replay=route_replay,
            batch_invariance=batch_invariance,
            group_by_length=group_by_length,
        )

    def _log_probs(
        self,
        mb: MicroBatch,
        logits: torch.Tensor | DeferredHead,
        temperature: float,
        calculate_entropy: bool,
        entropy_requires_grad: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[r, Tr] log-probs (and entropy) of mb's response tokens, zero at padding positions.
        ``logits``: the model's output, or its LM head deferred (forward only, ``defer_head``)."""
        settings = {
            "temperature": temperature,
            "vocab_size": self.runner.vocab_size,
            "tp_group": self.runtime.tp_group(),
            "calculate_entropy": calculate_entropy,
            "entropy_requires_grad": entropy_requires_grad,
        }
        if isinstance(logits, DeferredHead):
            log_probs, entropy = head_log_probs(logits, mb.inputs.labels, settings)
        else:
            log_probs, entropy = vocab_parallel_log_probs(
                mb.inputs.gather(logits), mb.inputs.labels.to(logits.device), **settings
            )
        device = log_probs.device
        valid = mb.inputs.response_valid.to(device)
        log_probs = mb.inputs.merge_cp(log_probs)
        log_probs = torch.where(valid, log_probs, torch.zeros_like(log_probs))
        if entropy is not None:
            entropy = mb.inputs.merge_cp(entropy)
            entropy = torch.where(valid, entropy, torch.zeros_like(entropy))
        return log_probs, entropy

    def _log_prob_batching(self) -> tuple[int | None, bool, int]:
        """(micro_batch_size, use_dynamic_bsz, max_token_len) of log-prob passes, from the config."""
        raise NotImplementedError

    def compute_log_prob(
        self, data: DataProto, calculate_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(log_probs [B, Tr], entropy [B, Tr] or None) of the response tokens; forward only.

        Micro-batching follows ``meta_info`` (``micro_batch_size``, ``use_dynamic_bsz``,
        ``max_token_len``, verl's keys) when given, else the config's (the actor's
        ``ppo_infer_*``, the reference's ``log_prob_*``). Positions where ``attention_mask``
        is 0 hold 0.
        """
        where = f"{type(self).__name__}.compute_log_prob"
        temperature = temperature_of(data, where)

        def step(mb: MicroBatch, logits: torch.Tensor) -> StepResult:
            log_probs, entropy = self._log_probs(mb, logits, temperature, calculate_entropy)
            outputs = {"log_probs": log_probs}
            if entropy is not None:
                outputs["entropy"] = entropy
            return StepResult(outputs=outputs)

        results, mbs, shape, size = self._forward_only(data, where, step, defer_head=True)
        log_probs = self.runner.gather_dp(self.runner.collect_outputs(results, mbs, "log_probs", shape), size)
        entropy = None
        if calculate_entropy:
            entropy = self.runner.gather_dp(self.runner.collect_outputs(results, mbs, "entropy", shape), size)
        return log_probs, entropy

    def compute_response_logits(self, data: DataProto) -> torch.Tensor:
        """The logits [B, Tr, V] (whole real vocabulary, the model's dtype, no temperature) of the
        position that predicts each response token, 0 at padding; forward only. They are whole on
        every rank (B * Tr * V values): on-policy distillation's teacher logits (``algos/gkd.py``)."""

        def step(mb: MicroBatch, logits: torch.Tensor) -> StepResult:
            picked = mb.inputs.merge_cp(self._whole_vocab(mb.inputs.gather(logits)))
            valid = mb.inputs.response_valid.to(picked.device).unsqueeze(-1)
            return StepResult(outputs={"logits": torch.where(valid, picked, torch.zeros_like(picked))})

        where = f"{type(self).__name__}.compute_response_logits"
        if self.runner.vocab_size is None:
            raise ValueError(f"{where}: the model records no vocabulary size (build it with models.builder)")
        results, mbs, shape, size = self._forward_only(data, where, step)
        dtype = unwrap(self.chunks[0]).config.params_dtype
        local = self.runner.collect_outputs(results, mbs, "logits", (*shape, self.runner.vocab_size), dtype)
        return self.runner.gather_dp(local, size)

    def _whole_vocab(self, local: torch.Tensor) -> torch.Tensor:
        """[..., Vl] columns of this tp rank -> [..., V] (padded columns dropped) on every tp rank."""
        tp = self.runtime.layout.tp
        if tp > 1:
            parts = [torch.empty_like(local) for _ in range(tp)]
            dist.all_gather(parts, local.contiguous(), group=self.runtime.tp_group())
            local = torch.cat(parts, dim=-1)
        return local if self.runner.vocab_size is None else local[..., : self.runner.vocab_size]

    def _forward_only(
        self,
        data: DataProto,
        where: str,
        step: Callable[[MicroBatch, torch.Tensor], StepResult],
        defer_head: bool = False,
    ) -> tuple[list[StepResult], list[MicroBatch], tuple[int, int], int]:
        """``step`` over micro-batches of this dp rank's rows of ``data``, forward only: (step
        results, micro-batches, [rows, Tr] of this rank's share, global batch size).
        ``defer_head``: ``step`` may get a :class:`DeferredHead` instead of the logits."""
        row_keys = _row_keys(data)
        batch = batch_tensors(data, _MODEL_KEYS + row_keys, where)
        meta = data.meta_info
        micro_batch_size, use_dynamic_bsz, max_token_len = self._log_prob_batching()
        micro_batch_size = meta.get("micro_batch_size", micro_batch_size)
        use_dynamic_bsz = meta.get("use_dynamic_bsz", use_dynamic_bsz)
        max_token_len = meta.get("max_token_len", max_token_len)

        size, width = batch["responses"].shape
        rows = dp_share(size, self.runtime.layout.dp, self.runtime.dp_rank)
        local = {k: v[rows] for k, v in batch.items()}
        mbs = self.runner.split(
            local,
            micro_batch_size=micro_batch_size,
            use_dynamic_bsz=use_dynamic_bsz,
            max_token_len=max_token_len,
            tensor_keys=row_keys,
        )

        with torch.no_grad():
            results = self.runner.run(mbs, step, forward_only=True, defer_head=defer_head)
        return results, mbs, (len(rows), width), size


class MegatronRef(_PolicyForward):
    """The frozen reference policy: forward-only log-probs, no optimizer.

    ``chunks`` need no DDP wrapping. Its log-probs go into the batch as ``ref_log_prob``.
    """

    def __init__(self, runtime: Runtime, config: RefConfig, chunks: list[torch.nn.Module]) -> None:
        super().__init__(runtime, chunks, config.use_remove_padding, config.share_prompt_prefix)
        config.validate()
        self.config = config
        for chunk in chunks:
            chunk.requires_grad_(False)

    def _log_prob_batching(self) -> tuple[int | None, bool, int]:
        cfg = self.config
        return (
            cfg.log_prob_micro_batch_size_per_gpu,
            cfg.log_prob_use_dynamic_bsz,
            cfg.log_prob_max_token_len_per_gpu,
        )


class ActorLogProbs(_PolicyForward):
    """The actor's forward-only log-probs (``compute_log_prob``: its micro-batching and length
    grouping), ``MegatronActor``'s base; alone, on another copy of its weights without optimizer
    or DDP: an async run's rollout ranks computing their share of ``old_log_probs``
    (``trainer/async_trainer.py``)."""

    def __init__(
        self,
        runtime: Runtime,
        config: ActorConfig,
        chunks: list[torch.nn.Module],
        route_replay: TrainingRoutes | None = None,
        batch_invariance: BatchInvariance | None = None,
    ) -> None:
        super().__init__(
            runtime,
            chunks,
            config.use_remove_padding,
            config.share_prompt_prefix,
            route_replay,
            batch_invariance,
            config.group_by_length,
        )
        self.config = config

    def _log_prob_batching(self) -> tuple[int | None, bool, int]:
        cfg = self.config
        return cfg.infer_micro_batch_size, cfg.use_dynamic_bsz, cfg.ppo_infer_max_token_len_per_gpu


def _trainer_loss_config(config: ActorConfig) -> ActorConfig:
    """The config handed to the policy loss: the trainer's defaults where verl's differ.

    geo_mean_valid_rows unset means the layout-invariant geo_mean mean here (see
    PolicyLossConfig); the user's config object is left as it is.
    """
    if config.policy_loss.geo_mean_valid_rows is not None:
        return config
    loss_config = copy.copy(config)
    loss_config.policy_loss = dataclasses.replace(config.policy_loss, geo_mean_valid_rows=True)
    return loss_config


def _old_and_is_weights(
    t: dict[str, torch.Tensor], log_probs: torch.Tensor, own_is: dict | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A micro-batch's old log-probs and IS weights. On-policy without a recomputation pass (for
    all rows, or for the first mini-batch's rows with old_log_probs_from_first_update) this
    forward's log-probs, detached, are the old ones; those rows' IS weights (``own_is``: rollout
    correction's settings) come from them and the rollout's log-probs, as the trainer's do."""
    old = t["old_log_probs"] if "old_log_probs" in t else log_probs.detach()
    weights = t.get("rollout_is_weights")
    if _OWN_OLD_KEY not in t:
        return old, weights
    own = t[_OWN_OLD_KEY].unsqueeze(-1)
    old = torch.where(own, log_probs.detach(), old)
    if own_is is not None and weights is not None:
        mine = rollout_is_weights(old - t["rollout_log_probs"], t["response_mask"], **own_is)
        weights = torch.where(own, mine, weights)
    return old, weights


class MegatronActor(ActorLogProbs, PPOUpdates):
    """PPO policy: log-probs for the batch and PPO updates with megatron's optimizer.

    ``chunks`` are DDP-wrapped (``wrap_ddp``); ``optimizer`` is a megatron optimizer over
    them and ``scheduler`` megatron's ``OptimizerParamScheduler`` (see ``lr_schedule``),
    stepped once per ``update_policy`` call. All three stay reachable as attributes for
    checkpointing. ``route_replay``: MoE routing replay's training side (``workers/routes.py``),
    built on these chunks, when the rollout records routes. ``batch_invariance``: the bitwise
    parity mode the chunks were switched to (``models.batch_invariant.enable``), if any.
    ``route``: the ``MatmulRoute`` the chunks were built with, on during updates (see ``PPOUpdates``).
    """

    def __init__(
        self,
        runtime: Runtime,
        config: ActorConfig,
        chunks: list[torch.nn.Module],
        optimizer,
        scheduler,
        route_replay: TrainingRoutes | None = None,
        batch_invariance: BatchInvariance | None = None,
        route: MatmulRoute | None = None,
    ) -> None:
        if not all(hasattr(c, "no_sync") for c in chunks):
            raise ValueError(
                "MegatronActor needs DDP-wrapped chunks (verl_megatron.models.megatron_model.wrap_ddp)"
            )
        super().__init__(runtime, config, chunks, route_replay, batch_invariance)
        config.validate()
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.route = route
        self.policy_loss_fn = core_algos.get_policy_loss_fn(config.policy_loss.loss_mode)
        self.loss_config = PolicyLossSettings.of(_trainer_loss_config(config))  # the loss's numbers only
        self.update_calls = 0
        attach_schedule_hooks(chunks)
        self.moe_stats = self.runner.moe_stats

    def _keys(self, data: DataProto) -> tuple[str, ...]:
        keys = (*_MODEL_KEYS, "response_mask", "advantages")
        if self.config.recompute_old_log_prob or "old_log_probs" in data.batch.keys():  # noqa: SIM118
            keys += ("old_log_probs",)
        if self.config.use_kl_loss:
            keys += ("ref_log_prob",)
        if data.batch is not None and "rollout_is_weights" in data.batch.keys():  # noqa: SIM118
            keys += ("rollout_is_weights",)
        if "distill_jsd" in data.meta_info:
            keys += ("teacher_logits",)
        if FIRST_UPDATE_IS in data.meta_info:
            keys += ("rollout_log_probs",)
        return keys + _row_keys(data)

    def update_policy(self, data: DataProto, late: LateRows | None = None) -> dict[str, float | list[float]]:
        """PPO epochs over mini-batches of ``data``; one optimizer step per mini-batch.

        Returns per-step lists for actor/pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower,
        entropy, grad_norm (and kl_loss with use_kl_loss), each the value over the whole
        mini-batch (all dp ranks), plus actor/lr (the rate these steps used) and
        actor/skipped_steps (steps dropped for a non-finite gradient norm); for a
        mixture-of-experts model also actor/moe/* (see ``verl_megatron.workers.moe.MoEStats``).

        ``meta_info["distill_jsd"]`` (``{"beta": b, "temperature": t}``) adds GKD's generalized JSD
        between the student and ``teacher_logits`` at every response token to the loss, aggregated
        like the policy loss (``actor/gkd_jsd``).

        ``late``: rows whose old log-probs (and IS weights) arrive while the first mini-batches
        update (an async run's rollout ranks compute them, ``trainer/async_trainer.py``); their
        values in ``data`` are placeholders until the first mini-batch that holds one.
        """
        cfg = self.config
        temperature = temperature_of(data, "MegatronActor.update_policy")
        keys = self._keys(data)
        batch = batch_tensors(data, keys, "MegatronActor.update_policy")
        jsd = data.meta_info.get("distill_jsd")
        if jsd is not None and batch["teacher_logits"].shape[-1] != self.runner.vocab_size:
            raise ValueError(
                f"MegatronActor.update_policy: teacher_logits cover {batch['teacher_logits'].shape[-1]} "
                f"tokens, the student's vocabulary {self.runner.vocab_size}"
            )
        if self.moe_stats is not None:
            self.moe_stats.begin()
        if cfg.old_log_probs_from_first_update:  # rows 0..M-1: the first mini-batch (no shuffle, 1 epoch)
            size = batch["responses"].shape[0]
            batch[_OWN_OLD_KEY] = torch.arange(size) < cfg.ppo_mini_batch_size * cfg.rollout_n
            keys += (_OWN_OLD_KEY,)
        metrics = self._ppo_update(
            batch,
            prefix="actor",
            tensor_keys=[k for k in keys if k not in _MODEL_KEYS],
            loss_step=functools.partial(
                self._policy_step,
                temperature=temperature,
                jsd=jsd,
                own_is=data.meta_info.get(FIRST_UPDATE_IS),
            ),
            metric_names=_POLICY_METRICS + (("gkd_jsd",) if jsd is not None else ()),
            late=late,
        )
        if not cfg.use_kl_loss:
            metrics.pop("actor/kl_loss")
        else:
            metrics["actor/kl_coef"] = cfg.kl_loss_coef
        if self.moe_stats is not None:  # expert load and aux loss of this update's steps
            metrics.update(self.moe_stats.collect("actor"))
        return metrics

    def _policy_step(
        self,
        mb: MicroBatch,
        logits: torch.Tensor,
        *,
        temperature: float,
        jsd: dict[str, float] | None,
        counts: dict,
        num_micro: int,
        own_is: dict | None = None,
    ) -> StepResult:
        """Loss of one micro-batch with global counts, and its metric partial sums."""
        cfg = self.config
        device = logits.device
        t = {k: v.to(device) for k, v in mb.tensors.items()}
        # The entropy is always reported; it needs a gradient only with an entropy bonus.
        log_probs, entropy = self._log_probs(
            mb, logits, temperature, calculate_entropy=True, entropy_requires_grad=cfg.entropy_coeff != 0
        )
        # A response token the attention mask hides has no prediction: keep it out of the loss.
        mask = t["response_mask"].to(log_probs.dtype) * mb.inputs.response_valid.to(device)
        agg = {
            k: counts[k] for k in ("dp_size", "batch_num_tokens", "global_batch_size", "loss_scale_factor")
        }
        agg["robust"] = True  # empty mini-batch -> 0 (verl: NaN); padding never leaks; float32 sums
        old, is_weights = _old_and_is_weights(t, log_probs, own_is)
        # Metrics as device tensors: summed over micro-batches, moved to the host once per mini-batch.
        with metrics_on_device():
            pg_loss, pg_metrics = self.policy_loss_fn(
                old,
                log_probs,
                t["advantages"],
                mask,
                cfg.loss_agg_mode,
                self.loss_config,
                is_weights,
                global_batch_info=agg,
            )
        entropy_agg = core_algos.agg_loss(entropy, mask, cfg.loss_agg_mode, **agg)
        loss = pg_loss - cfg.entropy_coeff * entropy_agg if cfg.entropy_coeff else pg_loss
        dp = counts["dp_size"]
        # Each micro-batch's share of a mini-batch-wide value: agg values carry a dp factor
        # (summed over dp ranks they count dp times); masked means are weighted by tokens.
        share = mask.sum() / max(counts["batch_num_tokens"], 1)  # stays on the device: no sync
        metrics = {
            "pg_loss": pg_loss.detach() / dp,
            "entropy": entropy_agg.detach() / dp,
            # a loss that reports no such metric counts 0 (a device zero: no host-to-device copy)
            **{
                name: torch.as_tensor(pg_metrics[f"actor/{name}"], device=share.device) * share
                if f"actor/{name}" in pg_metrics
                else torch.zeros_like(share)
                for name in ("pg_clipfrac", "ppo_kl", "pg_clipfrac_lower")
            },
        }
        if cfg.use_kl_loss:
            kld = core_algos.kl_penalty(log_probs, t["ref_log_prob"], cfg.kl_loss_type)
            kl_loss = core_algos.agg_loss(kld, mask, cfg.loss_agg_mode, **agg)
            loss = loss + cfg.kl_loss_coef * kl_loss
            metrics["kl_loss"] = kl_loss.detach() / dp
        if jsd is not None:  # GKD distillation: the whole-vocabulary divergence from the teacher
            per_token = self._distill_jsd(mb, logits, t["teacher_logits"], **jsd)
            jsd_loss = core_algos.agg_loss(per_token, mask, cfg.loss_agg_mode, **agg)
            loss = loss + jsd_loss
            metrics["gkd_jsd"] = jsd_loss.detach() / dp
        return StepResult(loss=core_algos.megatron_microbatch_loss(loss, num_micro), metrics=metrics)

    def _distill_jsd(
        self,
        mb: MicroBatch,
        logits: torch.Tensor,
        teacher_logits: torch.Tensor,
        beta: float,
        temperature: float,
    ) -> torch.Tensor:
        """[r, Tr] generalized JSD (``algos/gkd.py``) of the student's and the teacher's next-token
        distributions at the response positions, on this tp rank's vocabulary columns."""
        student = mb.inputs.gather(logits)  # [r, Tr, Vl] ([K, Vl] under cp)
        width = student.shape[-1]
        start = self.runtime.tp_rank * width
        real = max(0, min(width, self.runner.vocab_size - start))  # padded columns left out
        teacher = teacher_logits.to(student.device)
        if mb.inputs.held_index is not None:  # this cp rank's response positions
            teacher = teacher.reshape(-1, teacher.shape[-1])[mb.inputs.held_index.to(student.device)]
        per_token = generalized_jsd_per_token(
            student[..., :real],
            teacher[..., start : start + real],
            beta=beta,
            temperature=temperature,
            chunk_tokens=rows_per_chunk(real),  # float32 chunks of ~16 MiB
            tp_group=self.runtime.tp_group(),
        )
        return mb.inputs.merge_cp(per_token)
