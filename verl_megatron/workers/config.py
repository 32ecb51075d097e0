"""Configs of the actor, reference policy and critic workers (verl's field names and defaults).

The trainer's schema composes these (``actor_rollout_ref.actor``, ``actor_rollout_ref.ref``,
``critic``). Batch sizes follow verl: ``ppo_mini_batch_size`` counts prompts (it is
multiplied by ``rollout_n`` samples per prompt) over the whole data-parallel group;
``*_per_gpu`` sizes count sequences on one data-parallel rank. Validation raises, it
never rewrites a value.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from typing import Any, ClassVar

from verl_megatron.algos.core_algos import KL_PENALTY_NAMES, LOSS_AGG_MODES, POLICY_LOSS_REGISTRY
from verl_megatron.errors import WorkerConfigError
from verl_megatron.models.routing_replay import RouterReplayConfig

__all__ = [
    "ActorConfig",
    "CriticConfig",
    "OptimConfig",
    "PPOWorkerConfig",
    "PolicyLossConfig",
    "PolicyLossSettings",
    "RefConfig",
]

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root")


@dataclass
class OptimConfig:
    """Megatron optimizer and learning-rate schedule (verl's ``optim`` section for megatron)."""

    lr: float = 1e-6
    """Peak learning rate."""
    lr_warmup_steps_ratio: float = 0.0
    """Warmup length as a fraction of ``total_training_steps`` (used when lr_warmup_steps is null or <= 0)."""
    total_training_steps: int = -1
    """Training steps of the run; the trainer sets it. Needed by ratio warmup and decaying schedules."""
    weight_decay: float = 0.01
    """Decoupled weight decay (AdamW) on weights; megatron skips biases and norms."""
    lr_warmup_steps: int | None = None
    """Warmup steps (linear from lr_warmup_init to lr); null, 0 or negative: use lr_warmup_steps_ratio."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam betas."""
    clip_grad: float = 1.0
    """Clip the global gradient norm to this value (0 disables clipping)."""
    optimizer: str = "adam"
    """Megatron optimizer name: ``adam`` or ``sgd``."""
    lr_warmup_init: float = 0.0
    """Learning rate at step 0 of the warmup."""
    lr_decay_steps: int | None = None
    """Steps over which lr decays to min_lr; null means total_training_steps."""
    lr_decay_style: str = "constant"
    """After warmup: ``constant``, ``linear``, ``cosine`` or ``inverse-square-root`` (megatron's names)."""
    min_lr: float = 0.0
    """Floor of decaying schedules."""
    use_distributed_optimizer: bool = False
    """Shard Adam state and fp32 master weights over the dp ranks (megatron's distributed optimizer)."""
    overlap_grad_reduce: bool = False
    """Reduce gradient buckets while the backward pass runs (megatron DDP)."""
    overlap_param_gather: bool = False
    """With the distributed optimizer: all-gather the updated parameters during the next forward."""
    optimizer_cpu_offload: bool = False
    """Run the optimizer step for a fraction of the parameters on the CPU, their Adam moments (and a
    float32 copy of their master weights) kept in host memory (megatron's HybridDeviceOptimizer).
    The fp32 master weights of the mixed-precision optimizer stay on the GPU (not with
    use_precision_aware_optimizer)."""
    optimizer_offload_fraction: float = 1.0
    """With optimizer_cpu_offload: the fraction of the parameters (by element count, in
    megatron's parameter order) whose optimizer step runs on the CPU."""
    use_precision_aware_optimizer: bool = False
    """megatron's precision-aware optimizer, with optimizer_cpu_offload and the distributed
    optimizer only: the CPU step's float32 copy is the offloaded parameters' only master (none
    on the GPU); gradients reach it as megatron's ``decoupled_grad``. Its dtypes stay float32."""

    def __post_init__(self) -> None:
        self._check_precision_aware()
        if not 0.0 <= self.optimizer_offload_fraction <= 1.0:
            raise WorkerConfigError(
                f"optim.optimizer_offload_fraction must be in [0, 1], got {self.optimizer_offload_fraction}"
            )
        if self.lr < 0 or self.min_lr < 0 or self.lr_warmup_init < 0:
            raise WorkerConfigError(
                f"optim: lr, min_lr and lr_warmup_init must be >= 0, got {self.lr}, {self.min_lr}, {self.lr_warmup_init}"
            )
        if self.min_lr > self.lr or self.lr_warmup_init > self.lr:
            raise WorkerConfigError(
                f"optim: min_lr ({self.min_lr}) and lr_warmup_init ({self.lr_warmup_init}) must not exceed lr ({self.lr})"
            )
        if self.lr_decay_style not in LR_DECAY_STYLES:
            raise WorkerConfigError(
                f"optim.lr_decay_style must be one of {LR_DECAY_STYLES}, got {self.lr_decay_style!r}"
            )
        if not 0.0 <= self.lr_warmup_steps_ratio < 1.0:
            raise WorkerConfigError(
                f"optim.lr_warmup_steps_ratio must be in [0, 1), got {self.lr_warmup_steps_ratio}"
            )
        if self.optimizer not in ("adam", "sgd"):
            raise WorkerConfigError(f"optim.optimizer must be 'adam' or 'sgd', got {self.optimizer!r}")
        if self.clip_grad < 0:
            raise WorkerConfigError(f"optim.clip_grad must be >= 0, got {self.clip_grad}")
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise WorkerConfigError(
                "optim.overlap_param_gather=true needs optim.use_distributed_optimizer=true"
            )

    def _check_precision_aware(self) -> None:
        """What megatron-core 0.16.1 needs for ``use_precision_aware_optimizer`` in this project."""
        if not self.use_precision_aware_optimizer:
            return
        if not self.optimizer_cpu_offload:
            raise WorkerConfigError(
                "optim.use_precision_aware_optimizer=true needs optim.optimizer_cpu_offload=true "
                "(without the CPU step megatron runs it in Transformer Engine's FusedAdam, not supported here)"
            )
        if not self.use_distributed_optimizer or self.optimizer != "adam":
            raise WorkerConfigError(
                "optim.use_precision_aware_optimizer=true needs optim.use_distributed_optimizer=true and "
                f"optim.optimizer='adam' (megatron's), got {self.use_distributed_optimizer} and {self.optimizer!r}"
            )


@dataclass
class PolicyLossConfig:
    """Which policy loss and its extra knobs (verl's ``actor.policy_loss``)."""

    loss_mode: str = "vanilla"
    """Registered policy loss: vanilla, gspo, sapo, gpg, clip_cov, kl_cov, geo_mean, cispo."""
    clip_cov_ratio: float = 0.0002
    """clip_cov: fraction of tokens whose gradient is cut."""
    clip_cov_lb: float = 1.0
    """clip_cov: lower bound of the covariance band."""
    clip_cov_ub: float = 5.0
    """clip_cov: upper bound of the covariance band."""
    kl_cov_ratio: float = 0.0002
    """kl_cov: fraction of tokens given the KL penalty."""
    ppo_kl_coef: float = 0.1
    """kl_cov: coefficient of that penalty."""
    dro_beta: float | None = None
    """dro: weight of the quadratic log-ratio penalty (> 0; required by loss_mode dro)."""
    rollout_correction: dict[str, Any] | None = None
    """bypass_mode: the rollout-correction settings (loss_type, rollout_is, rollout_rs, ...)."""
    geo_mean_valid_rows: bool | None = None
    """geo_mean: average the sequence losses over rows that have response tokens only, normalised
    by the global batch counts, so the gradient does not depend on the dp / micro-batch layout
    (true), or verl 0.9.1's plain mean over every row of each micro-batch, global counts ignored
    (false). Unset (null): the trainer's actor uses true (a deliberate difference from verl);
    ``core_algos.compute_policy_loss_geo_mean`` called directly uses verl's false."""

    def __post_init__(self) -> None:
        if self.loss_mode not in POLICY_LOSS_REGISTRY:
            raise WorkerConfigError(
                f"actor.policy_loss.loss_mode {self.loss_mode!r} is not registered; "
                f"known: {sorted(POLICY_LOSS_REGISTRY)}"
            )


def _check_kl_type(where: str, name: str) -> None:
    base = name[:-1] if name.endswith("+") else name
    if base not in KL_PENALTY_NAMES:
        raise WorkerConfigError(
            f"{where} {name!r} is not supported; use one of {KL_PENALTY_NAMES} (optionally with '+')"
        )


def _require_micro_batch(where: str, micro: int | None, dynamic: bool) -> None:
    if not dynamic and micro is None:
        raise WorkerConfigError(
            f"{where}.ppo_micro_batch_size_per_gpu must be set when {where}.use_dynamic_bsz is false"
        )


def _check_batching(
    where: str, mini: int, micro: int | None, dynamic: bool, max_tokens: int, epochs: int
) -> None:
    if mini < 1:
        raise WorkerConfigError(f"{where}.ppo_mini_batch_size must be >= 1, got {mini}")
    if epochs < 1:
        raise WorkerConfigError(f"{where}.ppo_epochs must be >= 1, got {epochs}")
    if micro is not None and micro < 1:
        raise WorkerConfigError(f"{where}.ppo_micro_batch_size_per_gpu must be >= 1, got {micro}")
    if dynamic and max_tokens < 1:
        raise WorkerConfigError(f"{where}.ppo_max_token_len_per_gpu must be >= 1, got {max_tokens}")


@dataclass
class OffloadConfig:
    """What to park in host memory while the rollout runs (verl's ``<role>.megatron`` switches).

    GPU only: on CPU everything already lives in host memory and the switches do nothing.
    With the native rollout engine the actor's parameters are needed to generate, so
    ``actor.megatron.param_offload`` is a config error there (reference and critic apply it).
    """

    param_offload: bool = False
    """Move parameters to host memory between this model's stages."""
    grad_offload: bool = False
    """Release gradient buffers between updates (they come back zeroed)."""
    optimizer_offload: bool = False
    """Move optimizer state (Adam moments, fp32 master weights) to host memory between updates."""
    router_replay: RouterReplayConfig = field(default_factory=RouterReplayConfig)
    """MoE routing replay (verl's engine key; the actor's only: see models/routing_replay.py)."""


@dataclass
class PPOWorkerConfig:
    """What the actor and the critic share: mini/micro batching, epochs, loss aggregation,
    optimizer and offload (verl's field names; defaults are the actor's, the critic overrides some)."""

    role: ClassVar[str] = "actor"
    """The YAML section this class reads (named in error messages)."""

    strategy: str = "megatron"
    """Training backend; only ``megatron`` here."""
    ppo_mini_batch_size: int = 256
    """Prompts per optimizer step over all dp ranks (times rollout_n sequences)."""
    ppo_micro_batch_size: int | None = None
    """Deprecated in verl; must stay null (use ppo_micro_batch_size_per_gpu)."""
    ppo_micro_batch_size_per_gpu: int | None = None
    """Sequences per forward/backward micro-batch on one dp rank (when use_dynamic_bsz is false)."""
    ppo_infer_micro_batch_size_per_gpu: int | None = None
    """Sequences per inference micro-batch (log-probs / values); null means ppo_micro_batch_size_per_gpu."""
    use_dynamic_bsz: bool = False
    """Form micro-batches by a token budget instead of a sequence count."""
    ppo_max_token_len_per_gpu: int = 16384
    """Token budget of one training micro-batch with use_dynamic_bsz."""
    ppo_infer_max_token_len_per_gpu: int = 16384
    """Token budget of one inference micro-batch with use_dynamic_bsz."""
    use_remove_padding: bool = True
    """Pack the valid tokens of a micro-batch into one row (THD) instead of a padded [b, T] batch."""
    share_prompt_prefix: bool = True
    """Rows of a micro-batch that share a prompt (GRPO groups) run it once: one model row of
    prompt + responses with attention kept per response (``workers/shared_prefix.py``). Applies
    with the local (SDPA) attention spec without cp/sp/MoE; elsewhere the layout above is used."""
    group_by_length: bool = False
    """Sort a rank's rows by length before cutting micro-batches (by count, or with use_dynamic_bsz
    by a budget of padded positions: rows x longest row), so short rows are not padded to a long
    one's length; same losses and gradients, fewer padded positions on long-tailed batches."""
    loss_agg_mode: str = "token-mean"
    """How per-token losses become one number (see core_algos.agg_loss)."""
    loss_scale_factor: int | None = None
    """Constant divisor for seq-mean-token-sum-norm; null means the response length."""
    ppo_epochs: int = 1
    """Passes over the batch per update call."""
    shuffle: bool = False
    """Shuffle sequences before splitting into mini-batches, per epoch."""
    data_loader_seed: int | None = None
    """Seed of that shuffle; null means the runtime seed."""
    rollout_n: int = 1
    """Samples per prompt (the trainer copies rollout.n here)."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and learning-rate schedule."""
    megatron: OffloadConfig = field(default_factory=OffloadConfig)
    """Host-memory offload between stages (GPU only)."""

    def __post_init__(self) -> None:
        where = self.role
        if self.ppo_micro_batch_size is not None:
            raise WorkerConfigError(
                f"{where}.ppo_micro_batch_size is deprecated (as in verl); set {where}.ppo_micro_batch_size_per_gpu"
            )
        _check_batching(
            where,
            self.ppo_mini_batch_size,
            self.ppo_micro_batch_size_per_gpu,
            self.use_dynamic_bsz,
            self.ppo_max_token_len_per_gpu,
            self.ppo_epochs,
        )
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            raise WorkerConfigError(
                f"{where}.loss_agg_mode must be one of {LOSS_AGG_MODES}, got {self.loss_agg_mode!r}"
            )
        self._check_role()
        if self.rollout_n < 1:
            raise WorkerConfigError(f"{where}.rollout_n must be >= 1, got {self.rollout_n}")
        if self.optim.optimizer_cpu_offload and self.megatron.optimizer_offload:
            raise WorkerConfigError(
                f"{where}.optim.optimizer_cpu_offload keeps the offloaded optimizer state in host memory "
                f"already: set {where}.megatron.optimizer_offload=false"
            )

    def _check_role(self) -> None:
        """The role's own construction checks (between loss_agg_mode and rollout_n, as before)."""

    def _check_strategy(self) -> None:
        if self.strategy != "megatron":
            raise WorkerConfigError(f"{self.role}.strategy must be 'megatron', got {self.strategy!r}")

    def validate(self) -> None:
        """What a role that will train needs set (checked when the worker is built)."""
        _require_micro_batch(self.role, self.ppo_micro_batch_size_per_gpu, self.use_dynamic_bsz)
        if self.optim.optimizer_cpu_offload:
            from verl_megatron.models.megatron_model import check_cpu_offload_device

            check_cpu_offload_device(f"{self.role}.optim")
        if self.optim.use_precision_aware_optimizer:
            from verl_megatron.models.megatron_model import check_precision_aware_support

            check_precision_aware_support(f"{self.role}.optim")

    @property
    def infer_micro_batch_size(self) -> int | None:
        return self.ppo_infer_micro_batch_size_per_gpu or self.ppo_micro_batch_size_per_gpu


@dataclass
class ActorConfig(PPOWorkerConfig):
    """PPO policy training (verl's ``actor_rollout_ref.actor``)."""

    role: ClassVar[str] = "actor"
    clip_ratio: float = 0.2
    """PPO clip range (default for clip_ratio_low/high)."""
    clip_ratio_low: float = 0.2
    """Lower clip range: ratio >= 1 - clip_ratio_low."""
    clip_ratio_high: float = 0.2
    """Upper clip range: ratio <= 1 + clip_ratio_high (DAPO's clip-higher)."""
    clip_ratio_c: float = 3.0
    """Dual-clip constant for negative advantages (> 1)."""
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    """Policy loss variant and its knobs."""
    tau_pos: float = 1.0
    """SAPO gate temperature for positive advantages."""
    tau_neg: float = 1.05
    """SAPO gate temperature for negative advantages."""
    entropy_coeff: float = 0.0
    """Entropy bonus: loss -= entropy_coeff * agg(entropy)."""
    use_kl_loss: bool = False
    """Add a KL(policy || reference) loss on ``ref_log_prob`` (GRPO)."""
    kl_loss_coef: float = 0.001
    """Weight of the KL loss."""
    kl_loss_type: str = "low_var_kl"
    """KL estimator of the KL loss (core_algos.kl_penalty names)."""
    recompute_old_log_prob: bool = True
    """Compute old_log_probs in a forward pass of their own before the update (verl's way). false,
    for an on-policy update only (one mini-batch, one epoch; checked at start-up): the update's own
    log-probs, detached, are the old ones (the ratio is exactly 1, as in verl's actor on-policy and
    TRL's GRPO with one iteration), and the trainer skips that pass; the gradient is the same."""
    old_log_probs_from_first_update: bool = False
    """The first mini-batch's old log-probs (rows 0..ppo_mini_batch_size * rollout_n - 1, before
    any optimizer step of the call) are its own update forward's, detached (ratio exactly 1): the
    old-log-prob pass computes only the later mini-batches' rows (in async mode with
    old_log_probs_on_rollout the rollout ranks compute them by default, and ``update_policy``'s
    ``late`` rows arrive when it cuts its second mini-batch). The values given
    for the first rows are ignored (the trainer leaves them NaN). Needs recompute_old_log_prob,
    ppo_epochs=1 and shuffle=false (checked here); readers of old log-probs before the update are
    refused at start-up (trainer/validate.py)."""

    def _check_role(self) -> None:
        _check_kl_type("actor.kl_loss_type", self.kl_loss_type)
        if self.old_log_probs_from_first_update:
            for wrong, why in (
                (
                    not self.recompute_old_log_prob,
                    "recompute_old_log_prob=false (all rows' come from the update)",
                ),
                (
                    self.ppo_epochs != 1,
                    f"ppo_epochs={self.ppo_epochs} (a later epoch has no pre-update forward)",
                ),
                (self.shuffle, "shuffle=true (the first mini-batch's rows must be rows 0..M-1)"),
            ):
                if wrong:
                    raise WorkerConfigError(
                        f"actor.old_log_probs_from_first_update=true needs no actor.{why}"
                    )
        if self.clip_ratio_c <= 1.0:
            raise WorkerConfigError(f"actor.clip_ratio_c must be > 1 (dual clip), got {self.clip_ratio_c}")

    def validate(self) -> None:
        """What an actor that will train needs set (checked when the worker is built)."""
        # Checked here, not at construction: verl code builds ActorConfig(strategy="fsdp")
        # just to hand its fields to a policy loss.
        self._check_strategy()
        super().validate()


@dataclass(frozen=True)
class PolicyLossSettings:
    """The numbers a policy loss reads, under verl's actor field names (so a loss written for
    verl's ActorConfig reads this the same way); the trainer's actor passes this, not its config."""

    clip_ratio: float
    clip_ratio_low: float
    clip_ratio_high: float
    clip_ratio_c: float
    tau_pos: float
    tau_neg: float
    loss_agg_mode: str
    policy_loss: PolicyLossConfig

    @classmethod
    def of(cls, config: ActorConfig) -> PolicyLossSettings:
        """The loss numbers of an actor config (its policy_loss sub-config shared, not copied)."""
        return cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(cls)})


@dataclass
class RefConfig:
    """Frozen reference policy (verl's ``actor_rollout_ref.ref``)."""

    strategy: str = "megatron"
    """Backend; only ``megatron`` here."""
    log_prob_micro_batch_size_per_gpu: int | None = None
    """Sequences per micro-batch of compute_log_prob on one dp rank."""
    log_prob_use_dynamic_bsz: bool = False
    """Form micro-batches by a token budget instead."""
    log_prob_max_token_len_per_gpu: int = 16384
    """Token budget of one micro-batch with log_prob_use_dynamic_bsz."""
    use_remove_padding: bool = True
    """Pack valid tokens (see ActorConfig.use_remove_padding)."""
    share_prompt_prefix: bool = True
    """One model row per shared prompt (see ActorConfig.share_prompt_prefix)."""
    megatron: OffloadConfig = field(default_factory=OffloadConfig)
    """Host-memory offload between stages (GPU only; only param_offload applies)."""

    def __post_init__(self) -> None:
        if self.strategy != "megatron":
            raise WorkerConfigError(f"ref.strategy must be 'megatron', got {self.strategy!r}")

    def validate(self) -> None:
        """What a reference that will run needs set (an unused section may leave it unset)."""
        if not self.log_prob_use_dynamic_bsz and not self.log_prob_micro_batch_size_per_gpu:
            raise WorkerConfigError(
                "ref.log_prob_micro_batch_size_per_gpu must be set when ref.log_prob_use_dynamic_bsz is false"
            )


@dataclass
class CriticConfig(PPOWorkerConfig):
    """Value-model training (verl's ``critic``)."""

    role: ClassVar[str] = "critic"
    ppo_max_token_len_per_gpu: int = 32768
    ppo_infer_max_token_len_per_gpu: int = 32768
    shuffle: bool = True
    cliprange_value: float = 0.5
    """Value clipping: new values stay within old values +- cliprange_value in the loss."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    """Optimizer and learning-rate schedule (verl's critic default lr is 1e-5)."""

    def __post_init__(self) -> None:
        self._check_strategy()
        super().__post_init__()

    def _check_role(self) -> None:
        if self.cliprange_value < 0:
            raise WorkerConfigError(f"critic.cliprange_value must be >= 0, got {self.cliprange_value}")


# verl's module path for these classes (``verl.workers.config.actor``); the import system
# returns a module registered under a child name once the parent has been imported.
sys.modules[f"{__name__}.actor"] = sys.modules[__name__]
