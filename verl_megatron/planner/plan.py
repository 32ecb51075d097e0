"""The memory plan of a job: per distinct rank position, per role and per phase, against one GPU.

Model state (parameters, gradient buffers, optimizer) is exact, built by ``shards``; activations
come from ``activations``; the rollout engine's memory from the rollout config. Phases of a
colocated step: ``rollout`` (generation), ``log_probs`` (old / reference log-probs, values) and
``update`` (actor and critic forward + backward + step). Offloaded state is off the GPU in the
phases that do not use it (the switches of ``<role>.megatron``; the external engines sleep
outside the rollout). An SFT run (``trainer.mode: sft``) builds the actor alone, generates
nothing, and has two phases: ``validation`` (the loss's forward) and ``update``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from verl_megatron.distributed.parallel import ParallelLayout
from verl_megatron.planner.activations import ActivationShape, activation_bytes, forward_bytes, logits_bytes
from verl_megatron.planner.shards import RankPosition, RoleSpec, StateBytes, build_role_state

__all__ = [
    "MemoryPlan",
    "PositionPlan",
    "RoleMemory",
    "offload_schedule",
    "phase_bytes",
    "plan_memory",
    "role_specs",
    "sequence_length",
    "teacher_logits_bytes",
]

PHASES = ("rollout", "log_probs", "update")


@dataclass(frozen=True)
class RoleMemory:
    """One role on one rank: its model state (as configured, and with the distributed optimizer
    switched) and the activations of one micro-batch (training, and forward only)."""

    state: StateBytes
    state_other_optimizer: StateBytes | None
    train_activations: int
    infer_activations: int
    train_logits: int = 0  # of train_activations: the logits (and their gradient) + the log-prob chunk
    infer_logits: int = 0  # of infer_activations: the logits + the log-prob chunk


@dataclass
class PositionPlan:
    position: RankPosition
    roles: dict[str, RoleMemory]
    engine: dict[str, int]  # weights and kv_cache of the rollout engine (bytes on this GPU)
    phases: dict[str, int] = field(default_factory=dict)
    offload: list[dict[str, Any]] = field(default_factory=list)  # see offload_schedule

    @property
    def peak(self) -> int:
        return max(self.phases.values())


@dataclass
class MemoryPlan:
    world_size: int
    gpu_bytes: int
    layout: ParallelLayout
    positions: list[PositionPlan]
    savings: list[tuple[str, int]] = field(default_factory=list)  # (change, bytes saved at the peak)

    @property
    def peak(self) -> int:
        return max(p.peak for p in self.positions)

    @property
    def fits(self) -> bool:
        return self.peak <= self.gpu_bytes

    @property
    def worst(self) -> PositionPlan:
        """The rank position with the highest peak."""
        return max(self.positions, key=lambda p: p.peak)

    @property
    def peak_phase(self) -> str:
        """The phase in which the worst rank peaks."""
        phases = self.worst.phases
        return max(phases, key=phases.get)


def role_specs(
    config: Any, hf_config: Any, reward_hf_config: Any = None, teacher_hf_config: Any = None
) -> list[RoleSpec]:
    """The models a job with ``config`` (a PPOConfig) builds on every rank, as the trainer does."""
    from verl_megatron.trainer.config import use_critic, use_reference

    lora = config.model.lora_rank > 0
    specs = [RoleSpec("actor", hf_config, config.model, config.parallel, optim=config.actor.optim, lora=lora)]
    if config.trainer.mode == "sft":  # the SFT loop builds the actor alone
        return specs
    if use_reference(config):
        specs.append(RoleSpec("reference", hf_config, config.model, config.parallel))
    if use_critic(config):
        specs.append(
            RoleSpec(
                "critic", hf_config, config.model, config.parallel, value_head=True, optim=config.critic.optim
            )
        )
    if config.reward_model.enable and reward_hf_config is not None:
        rm = config.reward_model
        specs.append(RoleSpec("reward_model", reward_hf_config, rm.model, rm.parallel, value_head=True))
    if config.algorithm.distill.enable and teacher_hf_config is not None:  # frozen, only run
        teacher = config.algorithm.distill.teacher
        specs.append(RoleSpec("teacher", teacher_hf_config, teacher.model, teacher.parallel))
    return specs


def teacher_logits_bytes(config: Any, specs: list[RoleSpec]) -> int:
    """``algorithm.distill.loss: gkd_jsd``: the teacher's logits [B, Tr, V] of the whole batch,
    gathered on every rank in its dtype and held from its forward through the update."""
    teacher = next((s for s in specs if s.name == "teacher"), None)
    if teacher is None or config.algorithm.distill.loss != "gkd_jsd":
        return 0
    from verl_megatron.models.config import read_hf_architecture

    rows = config.data.train_batch_size * config.rollout.n
    vocab = read_hf_architecture(teacher.hf_config).vocab_size
    return rows * config.rollout.response_length * vocab * teacher.model.torch_dtype.itemsize


def representative_ranks(layout: ParallelLayout, shards_over_dp: bool) -> list[int]:
    """The global ranks built: tp rank 0 of each pipeline stage at dp rank 0 (megatron's rank
    order is tp, cp, dp, pp), and at the last dp rank too when the distributed optimizer shards
    state over dp. tp, ep and middle dp ranks hold shards of the same shapes (megatron splits
    evenly; middle dp ranks differ from dp rank 0 only by where the buffers' 64-element alignment
    padding falls)."""
    dp = layout.dp or 1
    inner = layout.tp * layout.cp
    dp_ranks = sorted({0, dp - 1}) if shards_over_dp else [0]
    return [inner * (d + dp * p) for p in range(layout.pp) for d in dp_ranks]


def _activation_shape(hf_config: Any, model: Any, layout: ParallelLayout, pp_rank: int) -> ActivationShape:
    from verl_megatron.models.builder import padded_vocab_size
    from verl_megatron.models.config import read_hf_architecture

    arch = read_hf_architecture(hf_config)
    ffn = arch.intermediate_size
    if arch.moe is not None:
        ffn = arch.moe.topk * arch.moe.ffn_hidden_size + arch.moe.shared_expert_size
    return ActivationShape(
        hidden=arch.hidden_size,
        query=arch.num_attention_heads * arch.head_dim,
        kv=arch.num_key_value_heads * arch.head_dim,
        ffn=ffn,
        layers=arch.num_layers // layout.pp,
        padded_vocab=padded_vocab_size(arch.vocab_size, layout.tp, model.make_vocab_size_divisible_by),
        head_dim=arch.head_dim,
        tp=layout.tp,
        cp=layout.cp,
        sequence_parallel=model.sequence_parallel,
        dtype_bytes=2 if model.dtype == "bfloat16" else 4,
        first_stage=pp_rank == 0,
        last_stage=pp_rank == layout.pp - 1,
    )


def _recomputes(model: Any) -> bool:
    return bool(model.enable_gradient_checkpointing or model.recompute_granularity == "full")


def sequence_length(config: Any) -> int:
    """A row's longest length: prompt + response, or an SFT run's sft.max_length."""
    if config.trainer.mode == "sft":
        return config.sft.max_length
    return config.rollout.prompt_length + config.rollout.response_length


def micro_batch_tokens(config: Any, role: str) -> tuple[int, int]:
    """(training tokens, inference tokens) of one micro-batch of ``role`` on one GPU."""
    length = sequence_length(config)
    worker = config.critic if role == "critic" else config.actor
    train = (
        worker.ppo_max_token_len_per_gpu
        if worker.use_dynamic_bsz
        else worker.ppo_micro_batch_size_per_gpu * length
    )
    if role == "teacher":  # its own forward micro-batch (algorithm.distill.teacher)
        t = config.algorithm.distill.teacher
        return 0, t.max_token_len_per_gpu if t.use_dynamic_bsz else t.micro_batch_size_per_gpu * length
    if role == "reference":
        ref = config.ref
        infer = (
            ref.log_prob_max_token_len_per_gpu
            if ref.log_prob_use_dynamic_bsz
            else ref.log_prob_micro_batch_size_per_gpu * length
        )
        return 0, infer
    if worker.use_dynamic_bsz:
        return train, worker.ppo_infer_max_token_len_per_gpu
    rows = worker.infer_micro_batch_size  # ppo_infer_micro_batch_size_per_gpu, else the training one
    if role == "actor":
        rows = config.rollout.log_prob_micro_batch_size_per_gpu or rows
    return train, rows * length


def _role_memory(config: Any, spec: RoleSpec, pp_rank: int, states: dict) -> RoleMemory:
    """A role's state and activations on a rank of pipeline stage ``pp_rank``. ``states``: the
    built state bytes, under None (a role that is only run) or under each value of
    ``use_distributed_optimizer`` (a trained role)."""
    shape = _activation_shape(spec.hf_config, spec.model, spec.layout, pp_rank)
    train_tokens, infer_tokens = micro_batch_tokens(config, spec.name)
    length = sequence_length(config)
    packed = config.actor.use_remove_padding
    dense_mask = packed and spec.model.use_te is False

    def train(tokens: int, recompute: bool) -> int:
        if spec.optim is None:
            return 0
        return activation_bytes(
            shape,
            tokens,
            recompute,
            positions=tokens if packed else length,
            dense_mask=dense_mask,
            in_flight=spec.layout.pp - pp_rank,  # 1F1B: the first stage holds pp micro-batches
        )

    distopt = None if spec.optim is None else spec.optim.use_distributed_optimizer
    return RoleMemory(
        state=states[distopt],
        state_other_optimizer=None if distopt is None else states.get(not distopt),
        train_activations=train(train_tokens, _recomputes(spec.model)),
        infer_activations=forward_bytes(shape, infer_tokens),
        train_logits=0 if spec.optim is None else logits_bytes(shape, train_tokens),
        infer_logits=logits_bytes(shape, infer_tokens, backward=False),
    )


def _engine_bytes(config: Any, hf_config: Any, layout: ParallelLayout, gpu_bytes: int) -> dict[str, int]:
    """The rollout engine's own weights and KV cache on one GPU (none in an SFT run)."""
    rollout = config.rollout
    if config.trainer.mode == "sft":
        return {}
    if rollout.name != "native":  # vLLM / SGLang claim a fraction of the GPU for weights + cache
        return {"weights_and_kv_cache": int(rollout.gpu_memory_utilization * gpu_bytes)}
    from verl_megatron.models.config import read_hf_architecture

    arch = read_hf_architecture(hf_config)
    rows = -(-config.data.train_batch_size * rollout.n // (layout.dp or 1))
    columns = rollout.prompt_length + rollout.response_length
    d = 2 if config.model.dtype == "bfloat16" else 4
    groups = max(1, arch.num_key_value_heads // layout.tp)
    layers = arch.num_layers // layout.pp
    return {"kv_cache": 2 * layers * rows * groups * columns * arch.head_dim * d}


def _offload(config: Any, role: str) -> Any:
    section = {"actor": config.actor, "reference": config.ref, "critic": config.critic}.get(role)
    return getattr(section, "megatron", None)


def _moved(config: Any, role: str) -> dict[str, bool]:
    """Which parts of ``role``'s state its offload switches move to host memory between uses."""
    if role == "teacher":  # algorithm.distill.teacher.offload parks its weights between its forwards
        return {"param": config.algorithm.distill.teacher.offload, "grad": False, "optimizer": False}
    off = _offload(config, role)
    return {
        part: bool(off is not None and getattr(off, f"{part}_offload"))
        for part in ("param", "grad", "optimizer")
    }


def _part_bytes(state: StateBytes) -> dict[str, int]:
    return {"param": state.params, "grad": state.grads, "optimizer": state.optimizer}


def offload_schedule(config: Any, roles: dict[str, RoleMemory]) -> list[dict[str, Any]]:
    """What offload moves off the GPU and when it is back: one entry per offloaded part of a
    role (its bytes on this rank and the phases in which it is on the GPU; off in the others).
    Parameters come back for the role's own forward (its log-probs / values, its update, and the
    native engine's decoding for the actor); gradients and optimizer state for its update."""
    native = config.rollout.name == "native"
    schedule = []
    for role, memory in roles.items():
        trains = memory.train_activations > 0
        for part, moved in _moved(config, role).items():
            size = _part_bytes(memory.state)[part]
            if not moved or not size:
                continue
            if part == "param":
                back = (
                    ["rollout"] * (role == "actor" and native)
                    + ["log_probs (own)"]
                    + ["update (own)"] * trains
                )
            else:
                back = ["update (own)"] if trains else []
            schedule.append({"role": role, "part": part, "bytes": size, "on_gpu_in": back})
    return schedule


def phase_bytes(config: Any, roles: dict[str, RoleMemory], engine: dict[str, int]) -> dict[str, int]:
    """Bytes on the GPU in each phase: what each role keeps there (offloaded parts only while
    the phase uses them) + the phase's engine or activations."""

    def resident(role: str, memory: RoleMemory, uses_params: bool, trains: bool) -> int:
        moved, parts = _moved(config, role), _part_bytes(memory.state)
        needed = {"param": uses_params or trains, "grad": trains, "optimizer": trains}
        return sum(size for part, size in parts.items() if needed[part] or not moved[part])

    def on_gpu(params_of: str | None, trained: str | None) -> int:
        return sum(resident(r, m, r == params_of, r == trained) for r, m in roles.items())

    native = config.rollout.name == "native"  # decodes with the actor's own weights
    out = {"rollout": on_gpu("actor" if native else None, None) + sum(engine.values())}
    out["log_probs"] = max(on_gpu(name, None) + roles[name].infer_activations for name in roles)
    trained = [name for name in roles if roles[name].train_activations]
    out["update"] = max((on_gpu(name, name) + roles[name].train_activations for name in trained), default=0)
    if config.trainer.mode == "sft":  # no generation; the validation loss is the actor's forward
        return {"validation": out["log_probs"], "update": out["update"]}
    return out


def _built_state(
    spec: RoleSpec, world_size: int, rank: int, built: dict, other_optimizer: bool
) -> tuple[RankPosition, dict]:
    """``spec`` built at ``rank`` (cached in ``built``): its position and state bytes, under None
    for a role that is only run, else under its ``use_distributed_optimizer`` (and the other
    value with ``other_optimizer``). A role that is only run holds the same state on every dp
    rank of a stage: built once a stage."""
    layout = spec.layout.resolve(world_size)
    shape = dataclasses.astuple(spec.layout)
    if spec.optim is None:
        key = (spec.name, shape, "stage", rank // (layout.tp * layout.cp * (layout.dp or 1)))
        if key not in built:
            built[key] = build_role_state(spec, world_size, rank)
        return built[key]
    optim = spec.optim
    key = (
        spec.name,
        shape,
        rank,
        optim.optimizer_cpu_offload and optim.optimizer_offload_fraction,
        optim.use_precision_aware_optimizer,
    )
    where, states = built.get(key, (None, {}))
    distopt = spec.optim.use_distributed_optimizer
    missing = tuple(v for v in (distopt, not distopt)[: 1 + other_optimizer] if v not in states)
    if missing:
        where, new = build_role_state(spec, world_size, rank, missing, configured=False)
        states = {**states, **new}
        built[key] = where, states
    return where, states


def plan_memory(
    config: Any,
    world_size: int,
    gpu_bytes: int,
    specs: list[RoleSpec],
    built: dict | None = None,
    other_optimizer: bool = True,
) -> MemoryPlan:
    """Build every role at each distinct rank position and add up each phase. ``built`` caches
    the builds (keyed by role, layout and rank) for plans of changed configs of the same job;
    ``other_optimizer``: also build the trained roles with the distributed optimizer switched."""
    layout = config.parallel.resolve(world_size)
    distopt = any(s.optim is not None and s.optim.use_distributed_optimizer for s in specs)
    built = {} if built is None else built
    held = teacher_logits_bytes(config, specs)  # on the GPU outside the rollout
    positions = []
    for rank in representative_ranks(layout, shards_over_dp=distopt):
        roles: dict[str, RoleMemory] = {}
        position = None
        for spec in specs:
            where, states = _built_state(spec, world_size, rank, built, other_optimizer)
            position = position or where
            roles[spec.name] = _role_memory(config, spec, where.pp, states)
        engine = _engine_bytes(config, specs[0].hf_config, layout, gpu_bytes)
        plan = PositionPlan(position, roles, engine)
        plan.phases = {p: b + held * (p != "rollout") for p, b in phase_bytes(config, roles, engine).items()}
        plan.offload = offload_schedule(config, roles)
        positions.append(plan)
    return MemoryPlan(world_size, gpu_bytes, layout, positions)
