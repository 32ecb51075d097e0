"""Build what the trainer drives from a checked config: tokenizer, workers, rollout, rewards, data.

Every process of the job calls :func:`build_components` with the same config;
each builds its own shards of the actor (and of the reference and critic when
the algorithm needs them). The trainer receives the result and never builds
anything itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from verl_megatron.data import PromptLoader, RLHFDataset
from verl_megatron.data.multimodal import image_processor_for
from verl_megatron.distributed.parallel import Runtime
from verl_megatron.errors import ConfigError
from verl_megatron.rollout.config import old_log_prob_micro_batch_size
from verl_megatron.trainer.config import PPOConfig, use_critic, use_reference

if TYPE_CHECKING:  # the workers and engines import megatron: only for the annotations here
    from megatron.core.optimizer import MegatronOptimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

    from verl_megatron.models.matmul_route import MatmulRoute
    from verl_megatron.reward.model_rewards import ModelRewards
    from verl_megatron.rollout.async_worker import RolloutModel
    from verl_megatron.rollout.base import RolloutEngine
    from verl_megatron.workers.actor import MegatronActor, MegatronRef
    from verl_megatron.workers.config import OptimConfig
    from verl_megatron.workers.critic import MegatronCritic
    from verl_megatron.workers.routes import RunRoutes

__all__ = [
    "Components",
    "RewardFn",
    "build_colocated",
    "build_components",
    "build_loaders",
    "build_rollout_model",
    "policy_chunks",
    "resolve_worker_configs",
    "reward_fns",
    "total_training_steps",
    "train_reward_fn",
]

RewardFn = Callable[..., Any]
"""A reward manager: ``reward_fn(batch, return_dict=...)`` (``reward/loading.compute_reward`` calls it)."""
Training = tuple["MegatronActor", "MegatronRef | None", "MegatronCritic | None"]


@dataclass
class Components:
    """The trainer's collaborators, built for this rank."""

    tokenizer: PreTrainedTokenizerBase
    hf_config: PretrainedConfig
    actor: MegatronActor
    ref: MegatronRef | None
    critic: MegatronCritic | None
    rollout: RolloutEngine
    reward_fn: RewardFn
    val_reward_fn: RewardFn
    train_loader: PromptLoader
    val_loader: PromptLoader | None
    model_rewards: ModelRewards | None = None  # reward model / judge (reward/model_rewards.py)
    routes: RunRoutes | None = None  # MoE routing replay (workers/routes.py), or None


def total_training_steps(config: PPOConfig, batches_per_epoch: int) -> int:
    """``trainer.total_training_steps``, else ``total_epochs`` passes over the training set."""
    if config.trainer.total_training_steps is not None:
        return config.trainer.total_training_steps
    return config.trainer.total_epochs * batches_per_epoch


def resolve_worker_configs(config: PPOConfig, total_steps: int) -> PPOConfig:
    """Copy the values the workers take from other sections: samples per prompt, run length and
    the micro-batch for recomputing log-probs (``rollout.log_prob_micro_batch_size_per_gpu``)."""
    n = config.rollout.n
    actor = dataclasses.replace(
        config.actor,
        rollout_n=n,
        ppo_infer_micro_batch_size_per_gpu=old_log_prob_micro_batch_size(config.rollout, config.actor),
        optim=dataclasses.replace(config.actor.optim, total_training_steps=total_steps),
    )
    critic = dataclasses.replace(
        config.critic,
        rollout_n=n,
        optim=dataclasses.replace(config.critic.optim, total_training_steps=total_steps),
    )
    return dataclasses.replace(config, actor=actor, critic=critic)


def build_loaders(
    config: PPOConfig, tokenizer: PreTrainedTokenizerBase
) -> tuple[PromptLoader, PromptLoader | None]:
    """The training prompt loader and the validation one (None without ``data.val_files``)."""
    data = config.data
    seed = data.seed if data.seed is not None else config.trainer.seed
    # Rows with images need the checkpoint's image processor (vision-language model.path), else refused.
    processor = image_processor_for(config.model.path)
    train_set = RLHFDataset(data.train_files, tokenizer, data, processor)
    filtering = config.algorithm.filter_groups.enable
    batch_size = (data.gen_batch_size or data.train_batch_size) if filtering else data.train_batch_size
    train = PromptLoader(
        train_set, batch_size, shuffle=data.shuffle, seed=seed, pad_token_id=tokenizer.pad_token_id
    )
    if not data.val_files:
        return train, None
    val_set = RLHFDataset(data.val_files, tokenizer, data, processor)
    val = PromptLoader(
        val_set,
        data.val_batch_size or len(val_set),
        shuffle=data.validation_shuffle,
        seed=seed,
        pad_token_id=tokenizer.pad_token_id,
        drop_last=False,
    )
    return train, val


def policy_chunks(
    config: PPOConfig,
    runtime: Runtime,
    hf_config: PretrainedConfig,
    value_head: bool = False,
    route: MatmulRoute | None = None,
) -> list[torch.nn.Module]:
    """This rank's model chunks of ``model.path`` (a value head instead of the LM head for critics);
    ``route``: the update's ``MatmulRoute`` for a model to be trained (``build_gpt_chunks``)."""
    from verl_megatron.models.builder import build_gpt_chunks
    from verl_megatron.models.convert import load_hf_weights

    chunks = build_gpt_chunks(hf_config, runtime, config.model, value_head=value_head, route=route)
    # Weights go in before the optimizer exists: its fp32 master copies are taken from them.
    load_hf_weights(chunks, config.model.path, runtime, config.model)
    return chunks


def _trained(
    chunks: list[torch.nn.Module], optim: OptimConfig, bf16: bool
) -> tuple[list[torch.nn.Module], MegatronOptimizer, OptimizerParamScheduler]:
    """The chunks wrapped for data-parallel training, their optimizer and learning-rate schedule."""
    from verl_megatron.models.megatron_model import build_optimizer, wrap_ddp
    from verl_megatron.workers.lr_schedule import build_lr_scheduler, optim_settings

    settings = optim_settings(optim, bf16=bf16)
    chunks = wrap_ddp(chunks, settings)
    optimizer = build_optimizer(chunks, settings)
    return chunks, optimizer, build_lr_scheduler(optimizer, optim)


def build_colocated(
    engine: str,
    build_training: Callable[[], Training],
    make_rollout: Callable[[list[torch.nn.Module]], RolloutEngine],
) -> tuple[Training, RolloutEngine]:
    """((actor, ref, critic), rollout) built in the order a shared GPU needs.

    vLLM and SGLang size their KV cache from the GPU memory free when they start, so an external
    engine is built before any training state exists, put to sleep, and given the actor's chunks
    (for weight syncs) once they exist. The native engine is built on the actor's chunks.
    """
    if engine == "native":
        training = build_training()
        return training, make_rollout(training[0].chunks)
    rollout = make_rollout([])
    rollout.sleep()
    training = build_training()
    rollout.bind_actor(training[0].chunks)
    return training, rollout


def _reward_extra(config: PPOConfig) -> dict[str, Any]:
    """The training reward manager's arguments beyond ``reward_model.reward_kwargs``."""
    from verl_megatron.reward.loading import dapo_extra_kwargs

    return dapo_extra_kwargs(config)


def train_reward_fn(config: PPOConfig, tokenizer: PreTrainedTokenizerBase) -> RewardFn:
    """The training reward manager; the rollout ranks of an async run build it too."""
    from verl_megatron.reward.loading import load_reward_manager

    return load_reward_manager(
        config, tokenizer, num_examine=config.reward_model.num_examine, **_reward_extra(config)
    )


def reward_fns(config: PPOConfig, tokenizer: PreTrainedTokenizerBase) -> tuple[RewardFn, RewardFn]:
    """(training, validation) reward managers."""
    from verl_megatron.reward.loading import load_reward_manager

    train = train_reward_fn(config, tokenizer)
    # Validation gets the same manager arguments (verl's DAPO recipe gives val_reward_fn the
    # overlong buffer too); one sample printed when the training manager prints any.
    val = load_reward_manager(
        config, tokenizer, num_examine=1 if config.reward_model.num_examine else 0, **_reward_extra(config)
    )
    return train, val


def _route_replay(
    config: PPOConfig, runtime: Runtime, actor_chunks: list[torch.nn.Module]
) -> RunRoutes | None:
    """MoE routing replay's pieces on the actor's chunks, or None when the rollout records no routes."""
    if not config.rollout.enable_rollout_routing_replay:
        return None
    if config.rollout.name != "native":
        raise ValueError(f"routing replay: the {config.rollout.name} rollout engine cannot record routes")
    from verl_megatron.workers.routes import RunRoutes

    return RunRoutes(runtime, actor_chunks, replay=config.actor.megatron.router_replay.mode == "R3")


def _build_training(
    config: PPOConfig, runtime: Runtime, hf_config: PretrainedConfig, routes: list[RunRoutes]
) -> Callable[[], Training]:
    """The builder of (actor, reference or None, critic or None) for ``build_colocated``; it
    appends routing replay's pieces, when on, to ``routes`` (the rollout is built after it)."""

    def build() -> Training:
        from verl_megatron.models.lora import apply_configured_lora
        from verl_megatron.models.matmul_route import MatmulRoute
        from verl_megatron.workers.actor import MegatronActor, MegatronRef

        bf16 = config.model.dtype == "bfloat16"
        # Each trained model's update turns on the route its layers were built with.
        route, critic_route = MatmulRoute(), MatmulRoute()
        # model.lora_rank > 0: frozen base + adapters, before the optimizer sees the parameters.
        policy = apply_configured_lora(
            policy_chunks(config, runtime, hf_config, route=route), config.model, runtime.seed
        )
        actor_chunks, optimizer, scheduler = _trained(policy, config.actor.optim, bf16)
        replay = _route_replay(config, runtime, actor_chunks)
        routes.extend([replay] if replay is not None else [])
        invariance = None
        if config.rollout.bitwise_parity:
            from verl_megatron.models import batch_invariant

            invariance = batch_invariant.enable(
                actor_chunks, config.rollout.prompt_length + config.rollout.response_length
            )
        actor = MegatronActor(
            runtime,
            config.actor,
            actor_chunks,
            optimizer,
            scheduler,
            route_replay=replay.training if replay is not None else None,
            batch_invariance=invariance,
            route=route,
        )
        ref = None
        if use_reference(config):
            ref = MegatronRef(runtime, config.ref, policy_chunks(config, runtime, hf_config))
        critic = None
        if use_critic(config):
            from verl_megatron.workers.critic import MegatronCritic

            critic_parts = _trained(
                policy_chunks(config, runtime, hf_config, value_head=True, route=critic_route),
                config.critic.optim,
                bf16,
            )
            critic = MegatronCritic(runtime, config.critic, *critic_parts, route=critic_route)
        return actor, ref, critic

    return build


def _agent_harness(config: PPOConfig) -> Any:
    """``rollout.agent``'s harness (None when off), built before any model."""
    if not config.rollout.agent.enable:
        return None
    if not config.data.return_raw_chat:
        raise ConfigError(
            "rollout.agent.enable=true needs data.return_raw_chat=true (harnesses get the chat)"
        )
    layout = config.parallel
    if layout.tp * layout.pp * layout.cp > 1:
        # Each rank runs its own endpoint and harnesses: the ranks of one model would diverge.
        raise ConfigError("rollout.agent.enable=true supports data parallelism only (parallel.tp/pp/cp = 1)")
    from verl_megatron.reward.agents import build_harness

    return build_harness(config.rollout.agent)


def build_components(
    config: PPOConfig, runtime: Runtime, progress: Callable[[], None] | None = None
) -> tuple[PPOConfig, Components]:
    """Tokenizer, data loaders, actor (+ reference, critic), rollout engine and reward functions.

    Returns the config with the worker fields the trainer fills in (rollout_n,
    total_training_steps) and the components. ``progress``: the stall watchdog's ``alive``, which
    an agent rollout calls while its conversations wait within the deadline; None: no watchdog.
    """
    from verl_megatron.models.config import load_hf_config
    from verl_megatron.reward.model_rewards import build_model_rewards
    from verl_megatron.rollout.base import build_rollout
    from verl_megatron.rollout.lora_sync import lora_rollout_config
    from verl_megatron.utils.tokenizer import hf_tokenizer

    tokenizer = hf_tokenizer(config.model.tokenizer_path or config.model.path)
    hf_config = load_hf_config(config.model.path)
    # User code is imported before any model is built, so a bad path fails fast.
    environment = None
    if config.rollout.multi_turn.enable:
        from verl_megatron.utils.import_utils import load_object

        environment = load_object(config.rollout.multi_turn.environment, "rollout.multi_turn.environment")
    harness = _agent_harness(config)
    train_loader, val_loader = build_loaders(config, tokenizer)
    config = resolve_worker_configs(config, total_training_steps(config, len(train_loader)))
    routes: list[RunRoutes] = []  # at most one, made on the actor's chunks before the rollout
    (actor, ref, critic), rollout = build_colocated(
        config.rollout.name,
        _build_training(config, runtime, hf_config, routes),
        lambda chunks: build_rollout(
            lora_rollout_config(config.rollout, config.model),
            runtime,
            chunks,
            tokenizer,
            hf_config,
            route_recorder=routes[0].recorder if routes else None,
        ),
    )
    if environment is not None:
        from verl_megatron.rollout.multiturn import MultiTurnRollout

        rollout = MultiTurnRollout(rollout, config.rollout, tokenizer, environment)
    if harness is not None:
        from verl_megatron.rollout.agent import AgentRollout
        from verl_megatron.rollout.base import stop_token_ids

        stops = stop_token_ids(config.rollout, {}, tokenizer, hf_config)
        rollout = AgentRollout(rollout, config.rollout, tokenizer, harness, stops, progress=progress)
    reward_fn, val_reward_fn = reward_fns(config, tokenizer)
    model_rewards = build_model_rewards(config, runtime, tokenizer)
    return config, Components(
        tokenizer=tokenizer,
        hf_config=hf_config,
        actor=actor,
        ref=ref,
        critic=critic,
        rollout=rollout,
        reward_fn=reward_fn,
        val_reward_fn=val_reward_fn,
        train_loader=train_loader,
        val_loader=val_loader,
        model_rewards=model_rewards,
        routes=routes[0] if routes else None,
    )


def build_rollout_model(config: PPOConfig, runtime: Runtime) -> RolloutModel:
    """A rollout rank's model copy, tokenizer and training prompt loader (``rollout.placement=separate``)."""
    from verl_megatron.models.config import load_hf_config
    from verl_megatron.rollout.async_worker import RolloutModel
    from verl_megatron.utils.tokenizer import hf_tokenizer

    harness = _agent_harness(config)  # user code first: a bad name fails before any model
    tokenizer = hf_tokenizer(config.model.tokenizer_path or config.model.path)
    hf_config = load_hf_config(config.model.path)
    loader, _ = build_loaders(config, tokenizer)
    chunks = policy_chunks(config, runtime, hf_config)
    return RolloutModel(
        tokenizer=tokenizer, hf_config=hf_config, loader=loader, chunks=chunks, harness=harness
    )
