"""Start-up checks of the whole config: what no single section can check alone.

``validate_config(config, world_size)`` runs before any model is built: batch arithmetic
against the data-parallel size, parallel sizes against the world size and the model,
the algorithm against the rollout, and the checks owned by other rooms (placement,
routing replay, rollout LoRA sync, the reward manager, model rewards). Every error is a
``ConfigError`` (or a subclass raised by the room that owns the key) naming the key.
"""

from __future__ import annotations

import difflib
import importlib.util
import math
import os
from dataclasses import fields, is_dataclass
from typing import Any

import torch

from verl_megatron.algos import core_algos
from verl_megatron.data.config import TRUNCATION_MODES
from verl_megatron.distributed.parallel import ParallelLayout
from verl_megatron.errors import ConfigError, ModelConfigError, ParallelConfigError, RolloutConfigError
from verl_megatron.models import routing_replay
from verl_megatron.models.checkpoint_check import check_hf_weights
from verl_megatron.models.config import check_layout, load_hf_config, read_hf_architecture
from verl_megatron.models.families.deepseek import check_family_features
from verl_megatron.models.families.gpt_oss import check_gpt_oss_features
from verl_megatron.models.families.qwen2_vl import check_vl_attention, check_vl_features, check_vl_rollout
from verl_megatron.models.families.qwen3_next import check_linear_features
from verl_megatron.models.moe import MOE_MODEL_TYPES, check_trainable
from verl_megatron.reward.loading import resolve_reward_manager_cls
from verl_megatron.reward.model_rewards_check import check_model_rewards
from verl_megatron.rollout.config import (
    check_agent_port,
    check_engine_installed,
    old_log_prob_micro_batch_size,
)
from verl_megatron.rollout.lora_sync import check_rollout_lora
from verl_megatron.trainer.config_schema import RESUME_MODES, PPOConfig
from verl_megatron.trainer.distill_checks import check_teacher_layout
from verl_megatron.trainer.placement_check import check_placement
from verl_megatron.trainer.ppo.rollout_correction_config import check_rollout_correction
from verl_megatron.trainer.stall_checks import check_stall_timeouts
from verl_megatron.trainer.tracking import TRACKING_BACKENDS

__all__ = [
    "check_model_fits",
    "derived_micro_batches",
    "suggest_key",
    "use_critic",
    "use_reference",
    "validate_config",
]

# Estimators that compare the samples of one prompt (need rollout.n >= 2).
_GROUP_ESTIMATORS = (
    "grpo",
    "rloo",
    "grpo_passk",
    "opo",
    "reinforce_plus_plus_baseline",
    "gpg",
    "grpo_vectorized",
    "rloo_vectorized",
    "gdpo",
)


def suggest_key(key: str, known: list[str], prefix: str = "") -> str:
    """``"; did you mean 'x'?"`` for the closest known names, else the list of known names."""
    close = difflib.get_close_matches(key, known, n=2, cutoff=0.6)
    if close:
        return "; did you mean " + " or ".join(f"'{prefix}{c}'" for c in close) + "?"
    return f"; known: {', '.join(prefix + k for k in sorted(known))}"


def use_critic(config: PPOConfig) -> bool:
    """The critic runs for GAE (verl's rule); other estimators need no value function."""
    return config.algorithm.adv_estimator == "gae"


def use_reference(config: PPOConfig) -> bool:
    """The reference policy runs when a KL term (in the loss or in the reward) needs it."""
    return bool(config.actor.use_kl_loss or config.algorithm.use_kl_in_reward)


def _check_mini_batches(section: str, mini_batch: int, config: PPOConfig, dp: int) -> int:
    """Mini-batches (in prompts) split the step's batch, their samples split over dp; returns the
    samples each dp rank gets per mini-batch."""
    n = config.rollout.n
    train_batch = config.data.train_batch_size
    split = (
        f"(train_batch_size*rollout.n = {train_batch * n} samples split into mini-batches of "
        f"ppo_mini_batch_size*rollout.n = {mini_batch * n})"
    )
    if mini_batch > train_batch:
        raise ConfigError(
            f"{section}.ppo_mini_batch_size={mini_batch} is larger than data.train_batch_size={train_batch}: "
            f"a mini-batch is a part of the step's batch; lower it to a divisor of {train_batch} {split}"
        )
    if mini_batch < 1 or train_batch % mini_batch != 0:
        raise ConfigError(
            f"{section}.ppo_mini_batch_size={mini_batch} must divide data.train_batch_size={train_batch} {split}"
        )
    samples = mini_batch * n
    if samples % dp != 0:
        raise ConfigError(
            f"{section}.ppo_mini_batch_size*rollout.n = {mini_batch}*{n} = {samples} samples per mini-batch "
            f"are not divisible by the data-parallel size dp={dp}"
        )
    return samples // dp


def _check_micro_batch(section: str, worker: Any, per_rank: int, dp: int) -> None:
    """Micro-batches split the samples a rank gets per mini-batch. An unset size is derived here
    (``derived_micro_batches``): one micro-batch a mini-batch, whatever the number of processes."""
    if worker.use_dynamic_bsz:
        return
    micro = worker.ppo_micro_batch_size_per_gpu
    if micro is None:
        worker.ppo_micro_batch_size_per_gpu = per_rank
        return
    if micro < 1:
        raise ConfigError(
            f"{section}.ppo_micro_batch_size_per_gpu must be a positive integer (or set {section}.use_dynamic_bsz)"
        )
    if per_rank % micro != 0:
        raise ConfigError(
            f"{section}.ppo_micro_batch_size_per_gpu={micro} does not divide the {per_rank} samples "
            f"each dp rank gets per mini-batch ({section}.ppo_mini_batch_size*rollout.n/dp = "
            f"{per_rank * dp}/{dp})"
        )


def _trained_roles(config: PPOConfig) -> list[tuple[str, Any]]:
    """(section, worker config) of the roles that train: the actor, and the critic when GAE runs it."""
    return [("actor", config.actor)] + ([("critic", config.critic)] if use_critic(config) else [])


def derived_micro_batches(config: PPOConfig, dp: int) -> list[str]:
    """``key=value`` of each micro-batch size ``validate_config`` derives for a config as loaded
    (unset, no dynamic batch size): the samples a dp rank gets per mini-batch. Call it before
    ``validate_config`` fills them in; the start-up line names them."""
    derived = []
    for section, worker in _trained_roles(config):
        if worker.ppo_micro_batch_size_per_gpu is None and not worker.use_dynamic_bsz:
            per_rank = worker.ppo_mini_batch_size * config.rollout.n // dp
            derived.append(f"{section}.ppo_micro_batch_size_per_gpu={per_rank}")
    return derived


def _check_old_log_prob(config: PPOConfig) -> None:
    """actor.recompute_old_log_prob=false is exact only for an on-policy update whose old log-probs
    nothing else reads before it."""
    actor, algo = config.actor, config.algorithm
    if actor.recompute_old_log_prob:
        return
    why = None
    if actor.ppo_epochs != 1:
        why = f"actor.ppo_epochs={actor.ppo_epochs} (needs 1)"
    elif actor.ppo_mini_batch_size != config.data.train_batch_size:
        why = (
            f"actor.ppo_mini_batch_size={actor.ppo_mini_batch_size} is not data.train_batch_size="
            f"{config.data.train_batch_size} (needs one mini-batch)"
        )
    elif algo.use_kl_in_reward:
        why = "algorithm.use_kl_in_reward=true reads old_log_probs before the update"
    elif algo.rollout_correction.enabled or algo.rollout_correction.bypass_mode:
        why = "algorithm.rollout_correction reads old_log_probs before the update"
    if why is not None:
        raise ConfigError(
            f"actor.recompute_old_log_prob=false needs an on-policy update that nothing else reads old "
            f"log-probs for: {why}"
        )


def _check_old_log_probs_from_first_update(config: PPOConfig) -> None:
    """actor.old_log_probs_from_first_update leaves the first mini-batch's old log-probs unset (NaN)
    until its update: nothing may read them before (the actor's own conditions: workers/config.py)."""
    algo = config.algorithm
    if not config.actor.old_log_probs_from_first_update:
        return
    why = None
    if algo.use_kl_in_reward:
        why = "algorithm.use_kl_in_reward=true reads them for the KL penalty"
    elif algo.rollout_correction.bypass_mode:
        why = "algorithm.rollout_correction.bypass_mode replaces them by the rollout's"
    elif algo.rollout_correction.rollout_rs is not None:
        why = "algorithm.rollout_correction.rollout_rs rejects tokens by them before the update"
    elif algo.rollout_correction.rollout_is_batch_normalize:
        why = "algorithm.rollout_correction.rollout_is_batch_normalize needs every row's weight first"
    elif algo.distill.enable:
        why = "algorithm.distill.enable=true reads them for its advantages"
    if why is not None:
        raise ConfigError(
            "actor.old_log_probs_from_first_update=true: the first mini-batch's old log-probs exist only "
            f"in its update, but {why}"
        )


def _check_algorithm(config: PPOConfig) -> None:
    algo = config.algorithm
    if algo.adv_estimator not in core_algos.ADV_ESTIMATOR_REGISTRY:
        raise ConfigError(
            f"algorithm.adv_estimator={algo.adv_estimator!r} is not registered"
            + suggest_key(algo.adv_estimator, sorted(core_algos.ADV_ESTIMATOR_REGISTRY))
        )
    if algo.adv_estimator in ("optimal_token_baseline", "tir_optimal_token_baseline"):
        raise ConfigError(
            f"algorithm.adv_estimator={algo.adv_estimator} needs the actor's sum of squared token "
            "probabilities (sum_pi_squared), which this trainer does not compute; call it from core_algos"
        )
    if config.actor.policy_loss.loss_mode == "bypass_mode":
        raise ConfigError(
            "actor.policy_loss.loss_mode=bypass_mode trains on the rollout's log-probs, which this trainer "
            "does not use as old_log_probs; call rollout_corr_helper.apply_bypass_mode in your own loop"
        )
    if algo.rollout_correction.bypass_mode and not (
        config.rollout.name == "native" and config.rollout.bitwise_parity
    ):
        raise ConfigError(
            "algorithm.rollout_correction.bypass_mode=true trains on the rollout's log-probs as old_log_probs, "
            "which is exact only with rollout.name=native and rollout.bitwise_parity=true "
            f"(got rollout.name={config.rollout.name}, bitwise_parity={config.rollout.bitwise_parity})"
        )
    corr = algo.rollout_correction
    ignored = {
        "loss_type": corr.loss_type != "ppo_clip",
        "rollout_is": corr.rollout_is,
        "rollout_rs": corr.rollout_rs,
    }
    if corr.bypass_mode and any(ignored.values()):
        named = ", ".join(
            f"algorithm.rollout_correction.{k}={getattr(corr, k)!r}" for k, on in ignored.items() if on
        )
        raise ConfigError(
            f"algorithm.rollout_correction.bypass_mode=true trains the actor's policy loss on the rollout's "
            f"log-probs (equal to the old ones under bitwise parity) and would ignore {named}: unset them "
            "(verl's bypass loss with IS/rejection against the current policy: rollout_corr_helper.apply_bypass_mode)"
        )
    if config.rollout.bitwise_parity and config.model.resolve_use_te():
        raise ConfigError(
            "rollout.bitwise_parity=true needs megatron's local layer spec (model.use_te=false): "
            "Transformer Engine's kernels cannot be switched to the batch-invariant ones"
        )
    if config.rollout.bitwise_parity and torch.cuda.is_available():
        raise ConfigError(
            "rollout.bitwise_parity=true runs the batch-invariant kernels of CPU builds only "
            "(models/matmul_route.py); on a GPU machine leave it false"
        )
    check_rollout_correction(config)
    _check_old_log_prob(config)
    _check_old_log_probs_from_first_update(config)
    _check_estimator_inputs(config)


def _check_estimator_inputs(config: PPOConfig) -> None:
    """What the chosen estimator, KL-in-reward and dynamic sampling need from the other sections."""
    algo = config.algorithm
    if algo.adv_estimator == "gdpo" and not algo.gdpo_reward_keys:
        raise ConfigError(
            "algorithm.adv_estimator=gdpo needs algorithm.gdpo_reward_keys (reward_extra_info keys)"
        )
    if algo.adv_estimator in _GROUP_ESTIMATORS and config.rollout.n < 2:
        raise ConfigError(
            f"algorithm.adv_estimator={algo.adv_estimator} compares samples of the same prompt: "
            f"rollout.n must be >= 2, got {config.rollout.n}"
        )
    if algo.use_kl_in_reward:
        base = algo.kl_penalty.removesuffix("+")  # one '+' (straight-through), as the loss reads it
        if base not in core_algos.KL_PENALTY_NAMES:
            raise ConfigError(
                f"algorithm.kl_penalty={algo.kl_penalty!r}; expected one of {list(core_algos.KL_PENALTY_NAMES)}"
            )
        if algo.kl_ctrl.type not in ("fixed", "adaptive"):
            raise ConfigError(f"algorithm.kl_ctrl.type={algo.kl_ctrl.type!r}; expected 'fixed' or 'adaptive'")
    groups = algo.filter_groups
    if groups.enable:
        if not groups.metric:
            raise ConfigError(
                "algorithm.filter_groups.enable needs algorithm.filter_groups.metric (e.g. 'acc' or 'score')"
            )
        if config.rollout.n < 2:
            raise ConfigError(
                "algorithm.filter_groups.enable needs rollout.n >= 2 (it keeps groups whose samples differ)"
            )
    gen_batch = config.data.gen_batch_size
    if gen_batch is not None and gen_batch < 1:
        raise ConfigError(f"data.gen_batch_size must be >= 1 or null, got {gen_batch}")


def _check_trainer(config: PPOConfig) -> None:
    trainer = config.trainer
    unknown = [name for name in trainer.logger if name not in TRACKING_BACKENDS]
    if unknown:
        raise ConfigError(
            f"trainer.logger has unknown backend {unknown[0]!r}"
            + suggest_key(unknown[0], list(TRACKING_BACKENDS))
        )
    for backend, package in (("wandb", "wandb"), ("tensorboard", "tensorboard")):
        if backend in trainer.logger and importlib.util.find_spec(package) is None:
            raise ConfigError(
                f"trainer.logger includes '{backend}' but the '{package}' package is not installed: "
                f"pip install {package} (or drop '{backend}' from trainer.logger)"
            )
    if trainer.resume_mode not in RESUME_MODES:
        raise ConfigError(
            f"trainer.resume_mode={trainer.resume_mode!r}; expected one of {list(RESUME_MODES)}"
        )
    if trainer.resume_mode == "resume_path" and not trainer.resume_from_path:
        raise ConfigError("trainer.resume_mode=resume_path needs trainer.resume_from_path")
    if trainer.total_training_steps is not None and trainer.total_training_steps < 1:
        raise ConfigError(
            f"trainer.total_training_steps must be >= 1 or null, got {trainer.total_training_steps}"
        )
    if trainer.total_training_steps is None and trainer.total_epochs < 1:
        raise ConfigError(f"trainer.total_epochs must be >= 1, got {trainer.total_epochs}")
    if trainer.critic_warmup < 0:
        raise ConfigError(f"trainer.critic_warmup must be >= 0, got {trainer.critic_warmup}")
    if trainer.nnodes < 1 or trainer.n_gpus_per_node < 1:
        raise ConfigError(
            f"trainer.nnodes={trainer.nnodes} and trainer.n_gpus_per_node={trainer.n_gpus_per_node} must be >= 1"
        )
    # The watchdog looks once a second: fewer than 5 looks cannot tell a stall from a slow second.
    if trainer.stall_timeout_s != 0 and not trainer.stall_timeout_s >= 5:
        raise ConfigError(f"trainer.stall_timeout_s must be >= 5 (or 0: off), got {trainer.stall_timeout_s}")
    if not trainer.process_group_timeout_s > 0:
        raise ConfigError(
            f"trainer.process_group_timeout_s must be > 0, got {trainer.process_group_timeout_s}"
        )


def _check_lengths(config: PPOConfig) -> None:
    data, rollout = config.data, config.rollout
    if data.truncation not in TRUNCATION_MODES:
        raise ConfigError(
            f"data.truncation={data.truncation!r} is not a truncation mode"
            + suggest_key(data.truncation, list(TRUNCATION_MODES))
        )
    if data.train_batch_size < 1:
        raise ConfigError(f"data.train_batch_size must be >= 1, got {data.train_batch_size}")
    if data.max_prompt_length < 1 or data.max_response_length < 1:
        raise ConfigError(
            f"data.max_prompt_length={data.max_prompt_length} and data.max_response_length="
            f"{data.max_response_length} must be >= 1"
        )
    if rollout.response_length != data.max_response_length:
        raise ConfigError(
            f"rollout.response_length={rollout.response_length} differs from data.max_response_length="
            f"{data.max_response_length}; set one to the other (e.g. response_length: ${{data.max_response_length}})"
        )
    if rollout.prompt_length != data.max_prompt_length:
        raise ConfigError(
            f"rollout.prompt_length={rollout.prompt_length} differs from data.max_prompt_length="
            f"{data.max_prompt_length}; set one to the other (e.g. prompt_length: ${{data.max_prompt_length}})"
        )
    if rollout.n < 1:
        raise ConfigError(f"rollout.n must be >= 1, got {rollout.n}")
    if rollout.n > 1 and (not rollout.do_sample or rollout.temperature == 0):
        raise ConfigError(
            f"rollout.n={rollout.n} with greedy training rollouts (rollout.do_sample={rollout.do_sample}, "
            f"rollout.temperature={rollout.temperature:g}) gives one response a prompt, not {rollout.n}: "
            "set rollout.n=1, or sample (do_sample=true and a temperature > 0)"
        )


def _check_reward(config: PPOConfig) -> None:
    try:
        resolve_reward_manager_cls(config.reward_model.reward_manager)
    except ValueError as err:
        raise ConfigError(f"reward_model.reward_manager: {err}") from None
    overlong = config.reward_model.overlong_buffer
    if overlong.enable:
        if config.reward_model.reward_manager != "dapo":
            raise ConfigError(
                "reward_model.overlong_buffer.enable needs reward_model.reward_manager=dapo, "
                f"got {config.reward_model.reward_manager!r}"
            )
        if not 0 < overlong.len <= config.data.max_response_length:
            raise ConfigError(
                f"reward_model.overlong_buffer.len={overlong.len} must be in 1..data.max_response_length="
                f"{config.data.max_response_length}"
            )
    path = config.custom_reward_function.path
    if path and not os.path.isfile(os.path.expanduser(path)):
        raise ConfigError(f"custom_reward_function.path='{path}' does not exist")
    check_stall_timeouts(config)


def _check_finite(node: Any, prefix: str) -> None:
    """A NaN or infinite float anywhere in the config (``actor.optim.lr=nan``) is a typo, never a setting."""
    for f in fields(node):
        value = getattr(node, f.name)
        if is_dataclass(value):
            _check_finite(value, f"{prefix}{f.name}.")
        elif isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{prefix}{f.name} must be a finite number, got {value}")


def check_model_fits(
    layout: ParallelLayout, model_path: str, sequence_parallel: bool = False, weights: bool = True
) -> None:
    """Parallel sizes against the checkpoint's heads, kv heads, layers and experts (config.json), and
    its weights against config.json (safetensors headers only) with ``weights``."""
    if not os.path.exists(os.path.expanduser(model_path)):
        raise ConfigError(f"model.path='{model_path}' does not exist")
    try:
        hf_config = load_hf_config(model_path)
    except (OSError, ValueError) as err:  # absent, or a config.json transformers cannot read
        reason = " ".join(str(err).split())
        raise ConfigError(f"model.path: {reason}") from None
    try:
        arch = read_hf_architecture(hf_config)
        check_layout(layout, arch)
        check_trainable(arch.moe, layout.tp, sequence_parallel)
    except (ParallelConfigError, ModelConfigError) as err:
        raise ConfigError(f"parallel: {err} (model.path='{model_path}')") from None
    if weights:
        check_hf_weights(model_path, arch)  # headers only: missing, truncated or misfit weights named


def _check_family_features(config: PPOConfig, layout: ParallelLayout) -> None:
    """Trainer features a model family does not have yet (models/families/), named at start-up."""
    model_type = load_hf_config(config.model.path).model_type
    for check in (check_family_features, check_gpt_oss_features, check_vl_features):
        check(
            model_type,
            lora_rank=config.model.lora_rank,
            bitwise_parity=config.rollout.bitwise_parity,
            cp=layout.cp,
        )
    check_vl_rollout(model_type, config.rollout.name)
    check_vl_attention(model_type, config.model.resolve_use_te)
    check_linear_features(  # Qwen3-Next (gated DeltaNet)
        load_hf_config(config.model.path).model_type,
        lora_rank=config.model.lora_rank,
        bitwise_parity=config.rollout.bitwise_parity,
        cp=layout.cp,
        routing_replay=config.rollout.enable_rollout_routing_replay
        or config.actor.megatron.router_replay.mode != "disabled",
    )


def _resolve_layout(config: PPOConfig, world_size: int) -> ParallelLayout:
    """The trainer's layout over the ranks that train (``rollout.placement`` may keep some apart)."""
    world_size = check_placement(config, world_size)  # the trainer's ranks only
    try:
        return config.parallel.resolve(world_size)
    except ParallelConfigError as err:
        raise ConfigError(f"parallel: {err}") from None


def _check_model_and_rollout(config: PPOConfig, layout: ParallelLayout, this_machine: bool = True) -> None:
    """The model's settings on this layout and the rollout engine that serves it."""
    # Before the engine's install check: vllm cannot record routes.
    routing_replay.check_config(
        config.actor.megatron.router_replay,
        config.ref.megatron.router_replay,
        config.critic.megatron.router_replay,
        config.rollout,
        cp=config.parallel.cp,
        model_path=config.model.path,
        # Its routing check refuses the quickstart's dense model; quickstart.family may build an MoE one.
        quickstart=config.quickstart.enable and config.quickstart.family not in MOE_MODEL_TYPES,
    )
    if this_machine:
        config.model.validate(layout)  # Transformer Engine and CUDA among them
        check_engine_installed(config.rollout.name)
    config.model.recompute_settings()
    check_rollout_lora(config.rollout, config.model)
    old_log_prob_micro_batch_size(config.rollout, config.actor)
    _check_expert_rollout(config, layout)


def _check_expert_rollout(config: PPOConfig, layout: ParallelLayout) -> None:
    """Replicas that meet in the MoE layers' collectives (ep > 1, or an expert tp group wider than
    tp) must make the same native generate calls with the same response length: a replica that is
    done keeps stepping for its peers within one call (``NativeRollout._all_done``), not across
    calls. Multi-turn and agent rollouts let every replica choose its own turns and lengths."""
    rollout = config.rollout
    shared = layout.ep > 1 or layout.expert_tp > layout.tp
    if not shared or rollout.name != "native" or rollout.placement != "colocated":
        return
    for key, on in (
        ("rollout.multi_turn.enable", rollout.multi_turn.enable),
        ("rollout.agent.enable", rollout.agent.enable),
    ):
        if on:
            raise RolloutConfigError(
                f"{key}=true with parallel.ep={layout.ep}, expert tp {layout.expert_tp}, tp {layout.tp}: the "
                "native rollout's replicas meet in the MoE layers, and each would choose its own turns and "
                "response lengths, so they would wait on each other for ever; use parallel.ep=1 with "
                "parallel.etp <= parallel.tp, or rollout.name=vllm/sglang"
            )


def _check_workers(config: PPOConfig, dp: int) -> None:
    """Batch arithmetic of the roles that train, then every role this run uses is complete."""
    for section, worker in _trained_roles(config):
        per_rank = _check_mini_batches(section, worker.ppo_mini_batch_size, config, dp)
        _check_micro_batch(section, worker, per_rank, dp)
    # Sections of roles this run uses must be complete; an unused role's section may stay sparse.
    config.actor.validate()
    if use_reference(config):
        config.ref.validate()
    if use_critic(config):
        config.critic.validate()
    if config.actor.megatron.param_offload and config.rollout.name == "native":
        raise ConfigError(
            "actor.megatron.param_offload=true cannot apply with rollout.name='native', which generates "
            "with the actor's parameters on the device; set it to false, or use rollout.name='vllm'/'sglang'"
        )


def _token_budgets(config: PPOConfig, cp: int) -> list[tuple[str, int, int]]:
    """(key, budget, cp it is multiplied by) of every token budget a role of this run reads."""
    budgets = []
    for section, worker in _trained_roles(config):
        if worker.use_dynamic_bsz:
            for key in ("ppo_max_token_len_per_gpu", "ppo_infer_max_token_len_per_gpu"):
                budgets.append((f"{section}.{key}", getattr(worker, key), cp))
    actor, ref, teacher = config.actor, config.ref, config.algorithm.distill.teacher
    # An async run's rollout ranks (a one-rank layout) may compute the actor's old log-probs.
    rollout_side = config.rollout.placement == "separate" and config.async_training.old_log_probs_on_rollout
    if actor.use_dynamic_bsz and rollout_side:
        budgets.append(("actor.ppo_infer_max_token_len_per_gpu", actor.ppo_infer_max_token_len_per_gpu, 1))
    if use_reference(config) and ref.log_prob_use_dynamic_bsz:
        budgets.append(("ref.log_prob_max_token_len_per_gpu", ref.log_prob_max_token_len_per_gpu, cp))
    if config.algorithm.distill.enable and teacher.use_dynamic_bsz:
        key = "algorithm.distill.teacher.max_token_len_per_gpu"
        budgets.append((key, teacher.max_token_len_per_gpu, teacher.parallel.cp))
    return budgets


def _check_token_budgets(config: PPOConfig, cp: int) -> None:
    """A token budget (``use_dynamic_bsz``) holds whole sequences: budget x cp (a cp rank holds
    1/cp of a micro-batch, ``ModelRunner.split``) must fit the longest row the run can make, as
    ``workers/batching.py`` requires of every row's ``attention_mask`` tokens at run time."""
    data = config.data
    if config.trainer.mode == "sft":
        longest, why = config.sft.max_length, f"sft.max_length={config.sft.max_length}"
    else:
        longest = data.max_prompt_length + data.max_response_length
        why = f"data.max_prompt_length + data.max_response_length = {data.max_prompt_length} + {data.max_response_length}"
    for key, budget, times in _token_budgets(config, cp):
        if budget * times < longest:
            need = -(-longest // times)
            under = f" (x cp={times}: {budget * times} tokens)" if times > 1 else ""
            raise ConfigError(
                f"{key}={budget}{under} is less than the longest row this run can make, {longest} tokens "
                f"({why}): a micro-batch holds whole rows; set {key} >= {need}"
            )


def _check_inputs_named(config: PPOConfig) -> None:
    """A model and training data are named, unless the quickstart builds them."""
    if not config.model.path and not config.quickstart.enable:
        raise ConfigError(
            "model.path is not set (a Hugging Face checkpoint folder); or set quickstart.enable=true"
        )
    if not config.data.train_files and not config.quickstart.enable:
        raise ConfigError("data.train_files is empty; give parquet/jsonl files of verl rows")


def validate_config(config: PPOConfig, world_size: int, this_machine: bool = True) -> ParallelLayout:
    """Check the whole config for a job of ``world_size`` processes; return the resolved layout.

    Runs before any model is built. Every error names the key at fault. The
    model's shape is checked against the layout when ``model.path`` is set
    (the quickstart checks its own tiny model once it is built). ``this_machine=False`` leaves
    out what only the machine that runs the job answers: weight files, the rollout engine's
    package, Transformer Engine and CUDA (``verl-megatron plan`` plans a job for other machines
    from the checkpoints' config.json alone).
    """
    layout = _resolve_layout(config, world_size)
    _check_finite(config, "")
    _check_model_and_rollout(config, layout, this_machine)
    check_agent_port(config.rollout, world_size, config.trainer.nnodes)
    _check_lengths(config)
    _check_trainer(config)
    _check_algorithm(config)
    _check_reward(config)
    _check_workers(config, layout.dp)
    _check_token_budgets(config, layout.cp)
    _check_inputs_named(config)
    if config.model.path:
        check_model_fits(layout, config.model.path, config.model.sequence_parallel, weights=this_machine)
    if config.model.path and this_machine:
        _check_family_features(config, layout)  # some need Transformer Engine's presence
    if this_machine:
        check_model_rewards(config, world_size)  # reward model checkpoint and layout, combine, judge
    check_teacher_layout(config, world_size, this_machine)  # the distillation teacher's tp/pp and settings
    return layout
