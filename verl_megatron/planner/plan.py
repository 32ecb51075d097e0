"""The memory plan of a job: per distinct rank position, per role and per phase, against one GPU.

Model state (parameters, gradient buffers, optimizer) is exact, built by ``shards``; activations
come from ``activations``; the rollout engine's memory from the rollout config. Phases of a
colocated step: ``rollout`` (generation), ``log_probs`` (old / reference log-probs, values) and
``update`` (actor and critic forward + backward + step). Offloaded state is off the GPU in the
phases that do not use it (the switches of ``<role>.megatron``; the external engines sleep
outside the rollout).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from verl_megatron.distributed.parallel import ParallelLayout
from verl_megatron.planner.activations import ActivationShape, activation_bytes, forward_bytes
from verl_megatron.planner.shards import RankPosition, RoleSpec, StateBytes, build_role_state

__all__ = ["MemoryPlan", "PositionPlan", "RoleMemory", "plan_memory", "role_specs"]

PHASES = ("rollout", "log_probs", "update")


@dataclass(frozen=True)
class RoleMemory:
    """One role on one rank: its model state (as configured, and with the distributed optimizer
    switched) and the activations of one micro-batch (training, and forward only)."""

    state: StateBytes
    state_other_optimizer: StateBytes | None
    train_activations: int
    infer_activations: int
    train_recompute: int = 0  # training activations with full recomputation
    train_half: int = 0  # training activations at half the micro-batch


@dataclass
class PositionPlan:
    position: RankPosition
    roles: dict[str, RoleMemory]
    engine: dict[str, int]  # weights and kv_cache of the rollout engine (bytes on this GPU)
    phases: dict[str, int] = field(default_factory=dict)

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


def role_specs(config: Any, hf_config: Any, reward_hf_config: Any = None) -> list[RoleSpec]:
    """The models a job with ``config`` (a PPOConfig) builds on every rank, as the trainer does."""
    from verl_megatron.trainer.config import use_critic, use_reference

    lora = config.model.lora_rank > 0
    specs = [RoleSpec("actor", hf_config, config.model, config.parallel, optim=config.actor.optim, lora=lora)]
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
    return specs


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


def micro_batch_tokens(config: Any, role: str) -> tuple[int, int]:
    """(training tokens, inference tokens) of one micro-batch of ``role`` on one GPU."""
    length = config.rollout.prompt_length + config.rollout.response_length
    worker = config.critic if role == "critic" else config.actor
    train = (
        worker.ppo_max_token_len_per_gpu
        if worker.use_dynamic_bsz
        else worker.ppo_micro_batch_size_per_gpu * length
    )
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
    infer_rows = config.rollout.log_prob_micro_batch_size_per_gpu if role == "actor" else None
    return train, (infer_rows or worker.ppo_micro_batch_size_per_gpu) * length


def _role_memory(config: Any, spec: RoleSpec, pp_rank: int, states: dict, flip: tuple) -> RoleMemory:
    """A role's state and activations on a rank of pipeline stage ``pp_rank``."""
    shape = _activation_shape(spec.hf_config, spec.model, spec.layout, pp_rank)
    train_tokens, infer_tokens = micro_batch_tokens(config, spec.name)
    length = config.rollout.prompt_length + config.rollout.response_length
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

    recompute = _recomputes(spec.model)
    return RoleMemory(
        state=states[None],
        state_other_optimizer=states.get(flip[0]) if flip else None,
        train_activations=train(train_tokens, recompute),
        infer_activations=forward_bytes(shape, infer_tokens),
        train_recompute=train(train_tokens, True),
        train_half=train(max(1, train_tokens // 2), recompute),
    )


def _engine_bytes(config: Any, hf_config: Any, layout: ParallelLayout, gpu_bytes: int) -> dict[str, int]:
    """The rollout engine's own weights and KV cache on one GPU."""
    rollout = config.rollout
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


def phase_bytes(config: Any, roles: dict[str, RoleMemory], engine: dict[str, int]) -> dict[str, int]:
    """Bytes on the GPU in each phase: what each role keeps there (offloaded parts only while
    the phase uses them) + the phase's engine or activations."""

    def resident(role: str, memory: RoleMemory, uses_params: bool, trains: bool) -> int:
        off = _offload(config, role)
        s = memory.state
        moved = {
            k: bool(off is not None and getattr(off, k))
            for k in ("param_offload", "grad_offload", "optimizer_offload")
        }
        total = 0 if (moved["param_offload"] and not (uses_params or trains)) else s.params
        total += 0 if (moved["grad_offload"] and not trains) else s.grads
        return total + (0 if (moved["optimizer_offload"] and not trains) else s.optimizer)

    def on_gpu(params_of: str | None, trained: str | None) -> int:
        return sum(resident(r, m, r == params_of, r == trained) for r, m in roles.items())

    native = config.rollout.name == "native"  # decodes with the actor's own weights
    out = {"rollout": on_gpu("actor" if native else None, None) + sum(engine.values())}
    out["log_probs"] = max(on_gpu(name, None) + roles[name].infer_activations for name in roles)
    trained = [name for name in roles if roles[name].train_activations]
    out["update"] = max((on_gpu(name, name) + roles[name].train_activations for name in trained), default=0)
    return out


def plan_memory(config: Any, world_size: int, gpu_bytes: int, specs: list[RoleSpec]) -> MemoryPlan:
    """Build every role at each distinct rank position and add up each phase."""
    layout = config.parallel.resolve(world_size)
    distopt = any(s.optim is not None and s.optim.use_distributed_optimizer for s in specs)
    positions = []
    untrained: dict[tuple[str, int], tuple[RankPosition, dict]] = {}  # no optimizer: same on every dp rank
    for rank in representative_ranks(layout, shards_over_dp=distopt):
        roles: dict[str, RoleMemory] = {}
        position = None
        for spec in specs:
            flip = () if spec.optim is None else (not spec.optim.use_distributed_optimizer,)
            stage = rank // (layout.tp * layout.cp * (layout.dp or 1))
            key = (spec.name, stage if spec.layout == config.parallel else rank)
            if key in untrained:
                where, states = untrained[key]
            else:
                where, states = build_role_state(spec, world_size, rank, flip)
                if spec.optim is None:
                    untrained[key] = (where, states)
            position = position or where
            roles[spec.name] = _role_memory(config, spec, where.pp, states, flip)
        engine = _engine_bytes(config, specs[0].hf_config, layout, gpu_bytes)
        plan = PositionPlan(position, roles, engine)
        plan.phases = phase_bytes(config, roles, engine)
        positions.append(plan)
    result = MemoryPlan(world_size, gpu_bytes, layout, positions)
    result.savings = _savings(config, result)
    return result


def _with_section(config: Any, section: str, **changes: Any) -> Any:
    return dataclasses.replace(config, **{section: dataclasses.replace(getattr(config, section), **changes)})


def _worst_peak(config: Any, plan: MemoryPlan, change: Any = None) -> int:
    """The worst rank's peak with each RoleMemory passed through ``change`` (None: as planned)."""
    worst = 0
    for p in plan.positions:
        roles = {name: (change(m) if change else m) for name, m in p.roles.items()}
        worst = max(worst, max(phase_bytes(config, roles, p.engine).values()))
    return worst


def _savings(config: Any, plan: MemoryPlan) -> list[tuple[str, int]]:
    """The three changes that lower the worst rank's peak the most, with the bytes each saves."""
    peak = plan.peak
    options: list[tuple[str, int]] = []
    if not config.actor.optim.use_distributed_optimizer and (plan.layout.dp or 1) > 1:
        swap = lambda m: dataclasses.replace(m, state=m.state_other_optimizer or m.state)  # noqa: E731
        options.append(("actor.optim.use_distributed_optimizer=true", peak - _worst_peak(config, plan, swap)))
    for section in ("actor", "ref", "critic"):
        off = getattr(getattr(config, section), "megatron", None)
        for switch in ("optimizer_offload", "grad_offload", "param_offload"):
            if off is None or getattr(off, switch) or (section == "actor" and switch == "param_offload"):
                continue
            changed = _with_section(config, section, megatron=dataclasses.replace(off, **{switch: True}))
            options.append((f"{section}.megatron.{switch}=true", peak - _worst_peak(changed, plan)))
    if not _recomputes(config.model):
        rec = lambda m: dataclasses.replace(m, train_activations=m.train_recompute)  # noqa: E731
        options.append(("model.enable_gradient_checkpointing=true", peak - _worst_peak(config, plan, rec)))
    half = lambda m: dataclasses.replace(m, train_activations=m.train_half)  # noqa: E731
    options.append(("half the training micro-batch (tokens)", peak - _worst_peak(config, plan, half)))
    return sorted((o for o in options if o[1] > 0), key=lambda o: -o[1])[:3]
