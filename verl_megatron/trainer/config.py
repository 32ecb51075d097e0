"""The trainer's typed config: one dataclass schema, YAML values, command-line overrides, checks.

``load_config(yaml_path, overrides)`` merges, once, at the entry point::

    OmegaConf.structured(PPOConfig) <- YAML file <- dotlist overrides ("actor.optim.lr=1e-6")

and returns a plain ``PPOConfig`` object (``OmegaConf.to_object``); nothing after
the entry point sees a DictConfig. Unknown keys fail with the closest known key
("did you mean ...") and where the key came from; wrong types fail naming the key.
``validate_config`` then checks what no single section can check alone (batch
arithmetic against the data-parallel size, parallel sizes against the world
size and the model) before any model is built.

Sections and their owners: ``model`` (models/config.py), ``parallel``
(distributed/parallel.py's ParallelLayout), ``data`` (data/config.py),
``actor``/``ref``/``critic`` (workers/config.py), ``rollout`` (rollout/config.py);
``algorithm``, ``reward_model``, ``custom_reward_function``, ``trainer`` and
``quickstart`` are defined here.
"""

from __future__ import annotations

import difflib
import importlib.util
import math
import os
import sys
import typing
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

from omegaconf import MISSING

from verl_megatron.data.config import DataConfig
from verl_megatron.distributed.parallel import ParallelLayout
from verl_megatron.errors import ConfigError, ConfigFileNotFoundError
from verl_megatron.models.config import ModelConfig
from verl_megatron.reward.model_config import ModelRewardSettings
from verl_megatron.reward.scorers.code_exec import CodeSandboxConfig
from verl_megatron.rollout.config import RolloutConfig
from verl_megatron.trainer.async_config import AsyncTrainingConfig
from verl_megatron.trainer.guard import DivergenceGuardConfig
from verl_megatron.trainer.ppo.rollout_correction_config import RolloutCorrectionConfig
from verl_megatron.workers.config import ActorConfig, CriticConfig, RefConfig

__all__ = [
    "AlgoConfig",
    "AlgorithmConfig",
    "ConfigError",
    "ConfigFileNotFoundError",
    "CustomRewardFunctionConfig",
    "FilterGroupsConfig",
    "KLControlConfig",
    "OverlongBufferConfig",
    "PPOConfig",
    "QuickstartConfig",
    "RewardModelConfig",
    "TrainerConfig",
    "default_config_path",
    "load_config",
    "to_dict",
]


@dataclass
class KLControlConfig:
    """KL coefficient for KL-in-reward (``algorithm.use_kl_in_reward``).

    Attributes:
        type: "fixed" or "adaptive" (Ziegler et al.'s proportional controller).
        kl_coef: the (initial) coefficient beta.
        horizon: adaptive only: steps over which beta moves toward the target.
        target_kl: adaptive only: the KL the controller aims for.
    """

    type: str = "fixed"
    kl_coef: float = 0.001
    horizon: int = 10000
    target_kl: float = 0.1


@dataclass
class FilterGroupsConfig:
    """DAPO dynamic sampling: keep only groups whose samples disagree.

    Attributes:
        enable: drop groups where every sample got the same ``metric`` and
            generate more batches until ``data.train_batch_size`` groups remain.
        metric: the per-sample value compared within a group: "score"
            (sum of token-level scores), "seq_reward" (sum of token-level
            rewards) or a key of the reward manager's extra info (e.g. "acc").
        max_num_gen_batches: generation rounds allowed per step; <= 0 means no limit.
    """

    enable: bool = False
    metric: str | None = None
    max_num_gen_batches: int = 0


@dataclass
class AlgorithmConfig:
    """Advantage estimation and KL-in-reward (verl's ``algorithm`` section).

    Attributes:
        gamma: discount factor (GAE).
        lam: GAE's lambda.
        adv_estimator: registered estimator name: gae (needs the critic), grpo,
            rloo, reinforce_plus_plus, reinforce_plus_plus_baseline, remax, opo, grpo_passk, gpg.
        norm_adv_by_std_in_grpo: divide GRPO advantages by the group std (False: Dr.GRPO).
        use_kl_in_reward: subtract beta * KL(policy || reference) from the token rewards.
        kl_penalty: KL estimator for KL-in-reward: kl/k1, abs, mse/k2, low_var_kl/k3.
        kl_ctrl: the coefficient beta and how it adapts.
        filter_groups: DAPO dynamic sampling.
        rollout_correction: what to do about the rollout / training log-prob gap (bypass_mode).
    """

    gamma: float = 1.0
    lam: float = 1.0
    adv_estimator: str = "gae"
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    gdpo_reward_keys: list[str] | None = None
    """gdpo: reward_extra_info keys (from compute_score's dict) normalised one by one."""
    gdpo_reward_weights: list[float] | None = None
    """gdpo: weight of each of those keys (null: 1 each)."""
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """verl's rollout correction (IS weights / rejection of off-policy rollout tokens)."""


# verl's name for the algorithm section's class.
AlgoConfig = AlgorithmConfig


@dataclass
class OverlongBufferConfig:
    """DAPO's soft penalty for responses close to ``data.max_response_length``.

    Attributes:
        enable: apply the penalty (needs ``reward_model.reward_manager: dapo``).
        len: buffer length in tokens before the maximum where the penalty ramps up.
        penalty_factor: penalty at the maximum length.
        log: log ``overlong_reward`` and ``overlong`` per sample.
    """

    enable: bool = False
    len: int = 0
    penalty_factor: float = 1.0
    log: bool = False


@dataclass
class RewardModelConfig(ModelRewardSettings):
    """How responses are scored (verl's ``reward_model`` section): the rule-based manager below,
    a reward model and a judge (``ModelRewardSettings``, workers/reward_model_config.py).

    Attributes:
        reward_manager: "naive", "dapo", "batch", "parallel", "prime" or an import path.
        reward_kwargs: extra keyword arguments for the manager, e.g. ``compute_score_timeout``
            (seconds per scorer call, default 30; null: no limit) and ``isolation`` ("auto":
            a custom_reward_function in a killable worker process, built-in scorers in-process;
            "process"; "none"). Unknown names are rejected at start-up.
        overlong_buffer: DAPO's overlong penalty (used by the "dapo" manager).
        num_examine: decoded samples per data source printed per step (rank 0).
        sandbox: limits of the sandbox that runs programs for code data sources
            (codecontests, apps, codeforces, taco); see ``utils/reward_score/code_exec.py``.
    """

    reward_manager: str = "naive"
    reward_kwargs: dict[str, Any] = field(default_factory=dict)
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    num_examine: int = 0
    sandbox: CodeSandboxConfig = field(default_factory=CodeSandboxConfig)


@dataclass
class CustomRewardFunctionConfig:
    """A scorer from a Python file: ``compute_score(data_source, solution_str, ground_truth, extra_info)``.

    Attributes:
        path: the file; None uses the built-in scorer chosen by ``data_source``.
        name: the function's name in that file.
        reward_kwargs: keyword arguments bound to the function.
    """

    path: str | None = None
    name: str = "compute_score"
    reward_kwargs: dict[str, Any] = field(default_factory=dict)


RESUME_MODES = ("auto", "disable", "resume_path")


@dataclass
class TrainerConfig:
    """The run: length, evaluation and checkpoint cadence, logging, resuming.

    Attributes:
        project_name: project (wandb project, TensorBoard folder).
        experiment_name: run name.
        logger: backends among "console", "jsonl", "tensorboard", "wandb"
            (metrics.jsonl is always written).
        total_epochs: passes over the training set (used when total_training_steps is None).
        total_training_steps: optimizer steps to run; None means total_epochs passes.
        test_freq: validate every this many steps (and at the end); <= 0 disables.
        save_freq: checkpoint every this many steps (and at the end); <= 0 disables.
        val_before_train: validate once before the first step.
        critic_warmup: steps during which only the critic is updated.
        default_local_dir: checkpoints, metrics.jsonl, curves.png and exports go here.
        resume_mode: "auto" (latest complete checkpoint in default_local_dir, if any),
            "disable" (start fresh) or "resume_path" (``resume_from_path``).
        resume_from_path: checkpoint folder for resume_mode "resume_path".
        resume_allow_changes: resume even when a key that decides the data order or the model
            (``run_dir.REFUSED_ON_RESUME``) differs from the checkpoint's config.
        divergence_guard: stop a run whose loss or weights blow up (``trainer.guard``).
        max_actor_ckpt_to_keep: keep only the newest N checkpoints; None keeps all.
        export_hf: write the final actor as a Hugging Face model to ``<default_local_dir>/hf_export``.
        seed: seed of the data order, sampling and model init.
        nnodes: nodes of the job (``verl-megatron train`` launches torchrun with it).
        n_gpus_per_node: processes per node (``verl-megatron train`` re-launches itself
            through torchrun when this is > 1).
        device_peak_tflops: peak TFLOP/s of one device for ``perf/mfu/actor``; None looks
            the GPU up by name (MFU is not reported on CPU).
    """

    project_name: str = "verl_megatron"
    experiment_name: str = "run"
    logger: list[str] = field(default_factory=lambda: ["console"])
    total_epochs: int = 30
    total_training_steps: int | None = None
    test_freq: int = -1
    save_freq: int = -1
    val_before_train: bool = True
    critic_warmup: int = 0
    default_local_dir: str = "checkpoints/${trainer.project_name}/${trainer.experiment_name}"
    resume_mode: str = "auto"
    resume_from_path: str | None = None
    resume_allow_changes: bool = False
    divergence_guard: DivergenceGuardConfig = field(default_factory=DivergenceGuardConfig)
    max_actor_ckpt_to_keep: int | None = None
    export_hf: bool = False
    seed: int = 1
    nnodes: int = 1
    n_gpus_per_node: int = 1
    device_peak_tflops: float | None = None


@dataclass
class QuickstartConfig:
    """Self-contained run: build a tiny tokenizer, model and synthetic data when none are given.

    Attributes:
        enable: build what ``model.path`` / ``data.train_files`` do not provide.
        task: synthetic task, "reverse" or "copy" (see verl_megatron.data.synthetic).
        num_digits: digits per prompt.
        hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size: the
            random-init model.
        family: its model family: ``llama``, or a mixture-of-experts one (``qwen3_moe``,
            ``qwen2_moe``, ``mixtral``: 4 experts, top-2, aux loss on).
        assets_dir: where the tokenizer, model and data are written
            (default: ``<trainer.default_local_dir>/assets``).
    """

    enable: bool = False
    task: str = "reverse"
    num_digits: int = 3
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 4
    intermediate_size: int = 128
    family: str = "llama"
    assets_dir: str | None = None


@dataclass
class PPOConfig:
    """Everything a run needs; see each section's docstring.

    The sections have no defaults here because some worker configs check
    themselves on construction (e.g. a micro-batch size must be set); the
    loader fills every section with its class's field defaults before the
    YAML values arrive, and constructs (checks) them only after the merge.
    """

    model: ModelConfig = MISSING
    parallel: ParallelLayout = MISSING
    data: DataConfig = MISSING
    actor: ActorConfig = MISSING
    ref: RefConfig = MISSING
    critic: CriticConfig = MISSING
    rollout: RolloutConfig = MISSING
    algorithm: AlgorithmConfig = MISSING
    reward_model: RewardModelConfig = MISSING
    custom_reward_function: CustomRewardFunctionConfig = MISSING
    trainer: TrainerConfig = MISSING
    quickstart: QuickstartConfig = MISSING
    async_training: AsyncTrainingConfig = MISSING


def default_config_path() -> str:
    """``configs/quickstart.yaml`` of the source tree (the config ``verl-megatron train`` uses
    without ``--config``)."""
    here = os.path.dirname(os.path.abspath(__file__))
    return os.path.normpath(os.path.join(here, "..", "..", "configs", "quickstart.yaml"))


# ---------------------------------------------------------------- loading


def _schema() -> Any:
    """The structured DictConfig of PPOConfig with every section at its class's field defaults."""
    from omegaconf import OmegaConf

    schema = OmegaConf.structured(PPOConfig)
    for name, section_cls in typing.get_type_hints(PPOConfig).items():
        # Built from the class, so field defaults are read without running __post_init__.
        schema[name] = OmegaConf.structured(section_cls)
    return schema


def _suggest(key: str, known: list[str], prefix: str = "") -> str:
    close = difflib.get_close_matches(key, known, n=2, cutoff=0.6)
    if close:
        return "; did you mean " + " or ".join(f"'{prefix}{c}'" for c in close) + "?"
    return f"; known: {', '.join(prefix + k for k in sorted(known))}"


def _check_keys(schema_node: Any, values: Any, prefix: str, source: str) -> Any:
    """Raise ConfigError for keys the schema lacks; return ``values`` with a lone string given
    for a list field wrapped in a list (``data.train_files=x.parquet``)."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    if not isinstance(values, dict) or not isinstance(schema_node, DictConfig):
        return values
    if OmegaConf.get_type(schema_node) is dict:  # a free-form mapping such as reward_kwargs
        return values
    known = [str(k) for k in schema_node]
    checked = {}
    for key, value in values.items():
        full = f"{prefix}{key}"
        if key not in schema_node:
            raise ConfigError(f"unknown config key '{full}' ({source})" + _suggest(str(key), known, prefix))
        child = schema_node._get_node(key)
        if isinstance(child, ListConfig) and isinstance(value, str):
            value = [value]
        checked[key] = _check_keys(child, value, f"{full}.", source)
    return checked


def _merge(base: Any, values: dict[str, Any], source: str) -> Any:
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    checked = _check_keys(base, values, "", source)
    try:
        return OmegaConf.merge(base, OmegaConf.create(checked))
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or "?"
        message = str(getattr(err, "msg", err)).splitlines()[0]
        raise ConfigError(f"config key '{key}' ({source}): {message}") from None


def _parse_overrides(overrides: list[str]) -> list[tuple[str, dict[str, Any]]]:
    import yaml
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    parsed = []
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"override '{item}' must look like key=value (e.g. actor.optim.lr=1e-6)")
        try:
            values = OmegaConf.to_container(OmegaConf.from_dotlist([item]))
        except (OmegaConfBaseException, yaml.YAMLError) as err:
            reason = getattr(err, "problem", None) or str(getattr(err, "msg", err)).strip().splitlines()[0]
            raise ConfigError(
                f"override '{item}' is not valid YAML ({reason}); a list override looks like "
                "'trainer.logger=[console,jsonl]'"
            ) from None
        parsed.append((item, values))
    return parsed


def _read_yaml(path: str) -> dict[str, Any]:
    """The file's top-level mapping; ConfigError naming the file (and line) for anything unreadable."""
    import yaml
    from omegaconf import OmegaConf

    if not os.path.exists(path):
        raise ConfigFileNotFoundError(f"config file '{path}' does not exist")
    if not os.path.isfile(path):
        raise ConfigError(f"config file '{path}' is not a file")
    try:
        # OmegaConf's YAML loader reads 1e-6 as a float (plain YAML 1.1 reads a string).
        values = OmegaConf.to_container(OmegaConf.load(path), resolve=False) or {}
    except OSError as err:
        raise ConfigError(f"config file '{path}' cannot be read: {err.strerror or err}") from None
    except UnicodeDecodeError as err:
        raise ConfigError(
            f"config file '{path}' is not UTF-8 text ({err.reason} at byte {err.start})"
        ) from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"config file '{path}' is not valid YAML{where}: {problem}") from None
    if not isinstance(values, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    return values


def load_config(path: str | None = None, overrides: list[str] | None = None) -> PPOConfig:
    """Schema defaults <- YAML file at ``path`` <- ``overrides`` ("a.b=value"), as a PPOConfig.

    Raises ConfigError naming the key (and the file or override it came from)
    for unknown keys, values of the wrong type and unresolvable interpolations.
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    merged = _schema()
    if path is not None:
        merged = _merge(merged, _read_yaml(path), f"in {path}")
    for item, values in _parse_overrides(list(overrides or [])):
        merged = _merge(merged, values, f"from override '{item}'")
    try:
        config = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or "?"
        message = str(getattr(err, "msg", err)).splitlines()[0]
        raise ConfigError(f"config key '{key}': {message}") from None
    except ValueError as err:  # a section's own __post_init__ check; its message names the key
        raise ConfigError(str(err)) from None
    return config


def to_dict(config: Any) -> dict[str, Any]:
    """A dataclass config as nested plain dicts (for logging and checkpoints)."""
    if is_dataclass(config):
        return {f.name: to_dict(getattr(config, f.name)) for f in fields(config)}
    if isinstance(config, dict):
        return {k: to_dict(v) for k, v in config.items()}
    if isinstance(config, (list, tuple)):
        return [to_dict(v) for v in config]
    return config


# ---------------------------------------------------------------- validation


def use_critic(config: PPOConfig) -> bool:
    """The critic runs for GAE (verl's rule); other estimators need no value function."""
    return config.algorithm.adv_estimator == "gae"


def use_reference(config: PPOConfig) -> bool:
    """The reference policy runs when a KL term (in the loss or in the reward) needs it."""
    return bool(config.actor.use_kl_loss or config.algorithm.use_kl_in_reward)


def _check_mini_batches(
    section: str, mini_batch: int, micro_batch: int | None, dynamic: bool, config: PPOConfig, dp: int
) -> None:
    """Mini-batches (in prompts) split the step's batch; samples split over dp; micro-batches split those."""
    n = config.rollout.n
    train_batch = config.data.train_batch_size
    if mini_batch < 1 or mini_batch > train_batch or train_batch % mini_batch != 0:
        raise ConfigError(
            f"{section}.ppo_mini_batch_size={mini_batch} must divide data.train_batch_size={train_batch} "
            f"(train_batch_size*rollout.n = {train_batch * n} samples split into mini-batches of "
            f"ppo_mini_batch_size*rollout.n = {mini_batch * n})"
        )
    samples = mini_batch * n
    if samples % dp != 0:
        raise ConfigError(
            f"{section}.ppo_mini_batch_size*rollout.n = {mini_batch}*{n} = {samples} samples per mini-batch "
            f"are not divisible by the data-parallel size dp={dp}"
        )
    if dynamic:
        return
    if micro_batch is None or micro_batch < 1:
        raise ConfigError(
            f"{section}.ppo_micro_batch_size_per_gpu must be a positive integer (or set {section}.use_dynamic_bsz)"
        )
    per_rank = samples // dp
    if per_rank % micro_batch != 0:
        raise ConfigError(
            f"{section}.ppo_micro_batch_size_per_gpu={micro_batch} does not divide the {per_rank} samples "
            f"each dp rank gets per mini-batch ({section}.ppo_mini_batch_size*rollout.n/dp = {samples}/{dp})"
        )


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


def _check_algorithm(config: PPOConfig) -> None:
    from verl_megatron.algos import core_algos
    from verl_megatron.trainer.ppo.rollout_correction import check_rollout_correction

    algo = config.algorithm
    if algo.adv_estimator not in core_algos.ADV_ESTIMATOR_REGISTRY:
        raise ConfigError(
            f"algorithm.adv_estimator={algo.adv_estimator!r} is not registered"
            + _suggest(algo.adv_estimator, sorted(core_algos.ADV_ESTIMATOR_REGISTRY))
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
    if config.rollout.bitwise_parity and config.model.resolve_use_te():
        raise ConfigError(
            "rollout.bitwise_parity=true needs megatron's local layer spec (model.use_te=false): "
            "Transformer Engine's kernels cannot be switched to the batch-invariant ones"
        )
    check_rollout_correction(config)
    _check_old_log_prob(config)
    if algo.adv_estimator == "gdpo" and not algo.gdpo_reward_keys:
        raise ConfigError(
            "algorithm.adv_estimator=gdpo needs algorithm.gdpo_reward_keys (reward_extra_info keys)"
        )
    group_estimators = ("grpo", "rloo", "grpo_passk", "opo", "reinforce_plus_plus_baseline", "gpg")
    group_estimators += ("grpo_vectorized", "rloo_vectorized", "gdpo")
    if algo.adv_estimator in group_estimators and config.rollout.n < 2:
        raise ConfigError(
            f"algorithm.adv_estimator={algo.adv_estimator} compares samples of the same prompt: "
            f"rollout.n must be >= 2, got {config.rollout.n}"
        )
    if algo.use_kl_in_reward:
        base = algo.kl_penalty.rstrip("+")
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
    from verl_megatron.trainer.tracking import TRACKING_BACKENDS

    trainer = config.trainer
    unknown = [name for name in trainer.logger if name not in TRACKING_BACKENDS]
    if unknown:
        raise ConfigError(
            f"trainer.logger has unknown backend {unknown[0]!r}"
            + _suggest(unknown[0], list(TRACKING_BACKENDS))
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


def _check_lengths(config: PPOConfig) -> None:
    from verl_megatron.data.config import TRUNCATION_MODES

    data, rollout = config.data, config.rollout
    if data.truncation not in TRUNCATION_MODES:
        raise ConfigError(
            f"data.truncation={data.truncation!r} is not a truncation mode"
            + _suggest(data.truncation, list(TRUNCATION_MODES))
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


def _check_reward(config: PPOConfig) -> None:
    from verl_megatron.reward.loading import resolve_reward_manager_cls

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


def _check_finite(node: Any, prefix: str) -> None:
    """A NaN or infinite float anywhere in the config (``actor.optim.lr=nan``) is a typo, never a setting."""
    for f in fields(node):
        value = getattr(node, f.name)
        if is_dataclass(value):
            _check_finite(value, f"{prefix}{f.name}.")
        elif isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{prefix}{f.name} must be a finite number, got {value}")


def check_model_fits(layout: ParallelLayout, model_path: str, sequence_parallel: bool = False) -> None:
    """Parallel sizes against the checkpoint's heads, kv heads, layers and experts (reads config.json only)."""
    from verl_megatron.errors import ModelConfigError, ParallelConfigError
    from verl_megatron.models.config import load_hf_config, read_hf_architecture
    from verl_megatron.models.moe import check_trainable

    if not os.path.exists(os.path.expanduser(model_path)):
        raise ConfigError(f"model.path='{model_path}' does not exist")
    try:
        hf_config = load_hf_config(model_path)
    except (OSError, ValueError) as err:  # absent, or a config.json transformers cannot read
        reason = " ".join(str(err).split())
        raise ConfigError(f"model.path: {reason}") from None
    try:
        arch = read_hf_architecture(hf_config)
        layout.check_model(
            num_layers=arch.num_layers,
            num_attention_heads=arch.num_attention_heads,
            num_query_groups=arch.num_key_value_heads,
            num_experts=arch.moe.num_experts if arch.moe else None,
        )
        check_trainable(arch.moe, layout.tp, sequence_parallel)
    except (ParallelConfigError, ModelConfigError) as err:
        raise ConfigError(f"parallel: {err} (model.path='{model_path}')") from None


def validate_config(config: PPOConfig, world_size: int) -> ParallelLayout:
    """Check the whole config for a job of ``world_size`` processes; return the resolved layout.

    Runs before any model is built. Every error names the key at fault. The
    model's shape is checked against the layout when ``model.path`` is set
    (the quickstart checks its own tiny model once it is built).
    """
    from verl_megatron.errors import ModelConfigError, ParallelConfigError
    from verl_megatron.rollout.config import (
        RolloutConfigError,
        check_engine_installed,
        old_log_prob_micro_batch_size,
    )
    from verl_megatron.rollout.placement import check_placement

    world_size = check_placement(config, world_size)  # the trainer's ranks only
    try:
        layout = config.parallel.resolve(world_size)
    except ParallelConfigError as err:
        raise ConfigError(f"parallel: {err}") from None
    _check_finite(config, "")
    from verl_megatron.models import routing_replay

    routing_replay.check_config(config)  # before the engine's install check: vllm cannot record routes
    try:
        config.model.validate(layout)
        config.model.recompute_settings()
        check_engine_installed(config.rollout.name)
        from verl_megatron.rollout.lora_sync import check_rollout_lora

        check_rollout_lora(config.rollout, config.model)
        old_log_prob_micro_batch_size(config.rollout, config.actor)
    except (ModelConfigError, RolloutConfigError) as err:
        raise ConfigError(str(err)) from None
    _check_lengths(config)
    _check_trainer(config)
    _check_algorithm(config)
    _check_reward(config)
    actor = config.actor
    _check_mini_batches(
        "actor",
        actor.ppo_mini_batch_size,
        actor.ppo_micro_batch_size_per_gpu,
        actor.use_dynamic_bsz,
        config,
        layout.dp,
    )
    if use_critic(config):
        critic = config.critic
        _check_mini_batches(
            "critic",
            critic.ppo_mini_batch_size,
            critic.ppo_micro_batch_size_per_gpu,
            critic.use_dynamic_bsz,
            config,
            layout.dp,
        )
    from verl_megatron.errors import WorkerConfigError

    # Sections of roles this run uses must be complete; an unused role's section may stay sparse.
    roles = [("actor", config.actor)]
    if use_reference(config):
        roles.append(("ref", config.ref))
    if use_critic(config):
        roles.append(("critic", config.critic))
    for _, section in roles:
        try:
            section.validate()
        except WorkerConfigError as err:
            raise ConfigError(str(err)) from None
    if config.actor.megatron.param_offload and config.rollout.name == "native":
        raise ConfigError(
            "actor.megatron.param_offload=true cannot apply with rollout.name='native', which generates "
            "with the actor's parameters on the device; set it to false, or use rollout.name='vllm'/'sglang'"
        )
    if not config.model.path and not config.quickstart.enable:
        raise ConfigError(
            "model.path is not set (a Hugging Face checkpoint folder); or set quickstart.enable=true"
        )
    if not config.data.train_files and not config.quickstart.enable:
        raise ConfigError("data.train_files is empty; give parquet/jsonl files of verl rows")
    if config.model.path:
        check_model_fits(layout, config.model.path, config.model.sequence_parallel)
    from verl_megatron.reward.model_rewards import check_model_rewards

    check_model_rewards(config, world_size)  # reward model checkpoint and layout, combine, judge
    return layout


# verl's module path ``verl.trainer.config.algorithm`` (AlgoConfig lives there in verl);
# the import system returns a module registered under a child name once the parent is in.
sys.modules[f"{__name__}.algorithm"] = sys.modules[__name__]
