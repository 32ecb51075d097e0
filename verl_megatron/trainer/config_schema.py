"""The trainer's typed config schema: one dataclass per section, composed by ``PPOConfig``.

Sections and their owners: ``model`` (models/config.py), ``parallel``
(distributed/parallel.py's ParallelLayout), ``data`` (data/config.py),
``actor``/``ref``/``critic`` (workers/config.py), ``rollout`` (rollout/config.py),
``async_training`` (trainer/async_config.py); ``algorithm``, ``reward_model``,
``custom_reward_function``, ``trainer`` and ``quickstart`` are defined here.
Loading (YAML + overrides) lives in trainer/config.py, cross-section checks in
trainer/validate.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from verl_megatron.data.config import DataConfig
from verl_megatron.data.sft_config import SFTConfig
from verl_megatron.distributed.parallel import ParallelLayout
from verl_megatron.models.config import ModelConfig
from verl_megatron.reward.model_config import ModelRewardSettings
from verl_megatron.reward.scorers.code_exec import CodeSandboxConfig
from verl_megatron.rollout.config import RolloutConfig
from verl_megatron.trainer.async_config import AsyncTrainingConfig
from verl_megatron.trainer.guard import DivergenceGuardConfig
from verl_megatron.trainer.ppo.rollout_correction_config import RolloutCorrectionConfig
from verl_megatron.workers.config import ActorConfig, CriticConfig, RefConfig
from verl_megatron.workers.teacher_config import DistillConfig


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
    distill: DistillConfig = field(default_factory=DistillConfig)
    """On-policy distillation from a frozen teacher (workers/teacher_config.py)."""


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
    a reward model and a judge (``ModelRewardSettings``, reward/model_config.py).

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
        stall_timeout_s: with several processes, seconds after which a job whose rank died or
            stopped, or in which no rank made progress (a stage, CPU work, Python code running),
            ends on every rank with one ``stall:`` line and each rank's stacks in
            ``<default_local_dir>/stall/`` (``distributed/watchdog.py``); 0 turns the watchdog off.
            Keep it above ``reward_model.reward_kwargs.compute_score_timeout``: a scorer call is
            waited for without progress.
        process_group_timeout_s: timeout of every collective (torch.distributed's process groups);
            the watchdog ends a stalled job long before it, on GPU NCCL's own watchdog uses it.
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
    stall_timeout_s: float = 60.0
    process_group_timeout_s: float = 1800.0
    memory_check: str = "error"
    """At start-up, before any weights are loaded, plan every rank's GPU memory as ``verl-megatron plan``
    does (planner/memory_check.py): "error" stops a job that cannot fit with one line, "warn" prints
    that line and starts it, "off" skips the check. Skipped on CPU unless ``memory_check_gpu_memory``
    is set, and while ``model.path`` is empty (the quickstart's model)."""
    memory_check_gpu_memory: str | None = None
    """Memory of one GPU for ``memory_check`` (``80GiB``, ``141GB``); None: this GPU's total memory."""
    mode: str = "rl"
    """"rl": the PPO-family loop; "sft": supervised fine-tuning on the actor (``verl-megatron sft``,
    the ``sft`` section, trainer/sft_trainer.py)."""


@dataclass
class QuickstartConfig:
    """Self-contained run: build a tiny tokenizer, model and synthetic data when none are given.

    Attributes:
        enable: build what ``model.path`` / ``data.train_files`` do not provide.
        task: synthetic task, "reverse" or "copy" (see verl_megatron.data.synthetic), or
            "lookup" (the agent quickstart's tool task, verl_megatron.data.lookup_task), or
            "shapes" (configs/quickstart_vl.yaml: "What colour is the square?" about generated
            images, verl_megatron.data.shapes_task; the model is then a tiny Qwen2.5-VL and
            ``family`` is not used).
        num_digits: digits per prompt.
        hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size: the
            random-init model.
        family: its model family: ``llama``, or a mixture-of-experts one (``qwen3_moe``,
            ``qwen2_moe``, ``mixtral``: 4 experts, top-2, aux loss on; ``deepseek_v3``: multi-latent
            attention, 8 sigmoid-routed experts in 4 groups, top-4, a shared expert, layer 0 dense).
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
    sft: SFTConfig = MISSING
