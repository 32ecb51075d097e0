"""The changes that lower a plan's peak the most, each measured by planning the changed job.

A candidate is a changed config, planned by ``plan_memory`` exactly as the original job is:
the distributed optimizer, offloading, the optimizer step on the CPU, recomputation and a halved micro-batch (training and
log-probs), and the layout changes (tp doubled within a node, pp doubled, ep doubled for a MoE
model whose expert count allows it; dp shrinks so the world size stays the same). Layout changes
build every rank's shards again on the meta device under the changed layout; the others reuse
the builds (they change no shard). A change's saving is the original peak minus the changed
plan's peak, to the byte; changes that do not lower the peak, or that the config or the model
refuses (a layout that does not divide the heads, layers, experts or world size), are left out.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from verl_megatron.errors import is_user_error
from verl_megatron.planner.plan import MemoryPlan, plan_memory, role_specs
from verl_megatron.planner.shards import RoleSpec

__all__ = ["GPUS_PER_NODE", "candidate_changes", "plan_savings"]

GPUS_PER_NODE = 8  # tensor parallelism is kept within one node's GPUs


def _with(config: Any, section: str, **changes: Any) -> Any:
    """``config`` with keys of one section changed; None when the section's checks refuse them
    (e.g. a micro-batch that no longer divides the mini-batch)."""
    try:
        return dataclasses.replace(
            config, **{section: dataclasses.replace(getattr(config, section), **changes)}
        )
    except ValueError:  # the sections' __post_init__ checks (ConfigError is a ValueError)
        return None


def _halved(config: Any, keys: list[tuple[str, str]]) -> tuple[str, Any] | None:
    """``config`` with each (section, key) halved, as one change (the phases take the largest
    micro-batch of their roles, so halving one role's alone may not lower the peak)."""
    overrides, changed = [], config
    for section, key in keys:
        value = getattr(getattr(config, section), key)
        changed = changed and _with(changed, section, **{key: value // 2})
        overrides.append(f"{section}.{key}={value // 2}")
    return (" ".join(overrides), changed) if overrides else None


def _infer_key(config: Any, role: str) -> tuple[str, str] | None:
    """The (section, key) setting ``role``'s forward-only micro-batch (``plan.micro_batch_tokens``)."""
    if role == "reference":
        dynamic = config.ref.log_prob_use_dynamic_bsz
        return "ref", "log_prob_max_token_len_per_gpu" if dynamic else "log_prob_micro_batch_size_per_gpu"
    section = "critic" if role == "critic" else "actor"
    worker = getattr(config, section)
    if worker.use_dynamic_bsz:
        return section, "ppo_infer_max_token_len_per_gpu"
    if role == "actor" and config.rollout.log_prob_micro_batch_size_per_gpu:
        return "rollout", "log_prob_micro_batch_size_per_gpu"
    # Unset, the training micro-batch is used (halved with the training change above).
    return (
        (section, "ppo_infer_micro_batch_size_per_gpu") if worker.ppo_infer_micro_batch_size_per_gpu else None
    )


def _micro_batch_changes(config: Any, roles: set[str]) -> list[tuple[str, Any]]:
    """Halve the training micro-batches (tokens with dynamic batching) of the trained roles, and
    the log-prob micro-batches of the actor and the reference."""
    train, infer = [], []
    for section in ("actor", "critic"):
        worker = getattr(config, section)
        key = "ppo_max_token_len_per_gpu" if worker.use_dynamic_bsz else "ppo_micro_batch_size_per_gpu"
        if section in roles and (getattr(worker, key) or 0) >= 2:
            train.append((section, key))
    for role in [r for r in ("actor", "reference", "critic") if r in roles]:
        key = _infer_key(config, role)
        if key is not None and (getattr(getattr(config, key[0]), key[1]) or 0) >= 2:
            infer.append(key)
    return [change for change in (_halved(config, train), _halved(config, infer)) if change is not None]


def _cpu_step(config: Any, section: str) -> tuple[str, Any]:
    """The optimizer step of every parameter on the CPU (which replaces the section's
    optimizer_offload: the config refuses both)."""
    worker = getattr(config, section)
    optim = dataclasses.replace(worker.optim, optimizer_cpu_offload=True, optimizer_offload_fraction=1.0)
    change = f"{section}.optim.optimizer_cpu_offload=true"
    if worker.megatron.optimizer_offload:
        change += f" {section}.megatron.optimizer_offload=false"
    return change, _with(
        config, section, optim=optim, megatron=dataclasses.replace(worker.megatron, optimizer_offload=False)
    )


def _layout_changes(config: Any, hf_config: Any, world_size: int) -> list[tuple[str, Any]]:
    """tp x2 (within a node), pp x2, ep x2 (MoE), each a layout the model and world size admit."""
    from verl_megatron.models.config import check_layout, read_hf_architecture

    arch = read_hf_architecture(hf_config)
    parallel = config.parallel
    options = [("tp", parallel.tp * 2), ("pp", parallel.pp * 2)]
    if arch.moe is not None:
        options.append(("ep", parallel.ep * 2))
    out = []
    for axis, value in options:
        if axis == "tp" and value > GPUS_PER_NODE:
            continue
        layout = dataclasses.replace(parallel, **{axis: value, "dp": None})
        try:
            check_layout(layout.resolve(world_size), arch)
        except Exception as err:
            if not is_user_error(err):
                raise
            continue
        out.append((f"parallel.{axis}={value}", dataclasses.replace(config, parallel=layout)))
    return out


def candidate_changes(config: Any, hf_config: Any, world_size: int, roles: set[str]) -> list[tuple[str, Any]]:
    """(override, changed config) for every change worth planning; ``roles``: the job's roles."""
    out = []
    for section in ("actor", "critic"):
        optim = getattr(config, section).optim
        if (
            section in roles
            and not optim.use_distributed_optimizer
            and (config.parallel.resolve(world_size).dp or 1) > 1
        ):
            changed = _with(config, section, optim=dataclasses.replace(optim, use_distributed_optimizer=True))
            out.append((f"{section}.optim.use_distributed_optimizer=true", changed))
        if section in roles and not optim.optimizer_cpu_offload:
            out.append(_cpu_step(config, section))
    # What each role can offload: the actor keeps its parameters (the config refuses
    # actor.megatron.param_offload); the reference has only parameters.
    offloadable = (("actor", "actor", ("optimizer", "grad")), ("ref", "reference", ("param",)))
    for section, role, parts in (*offloadable, ("critic", "critic", ("optimizer", "grad", "param"))):
        off = getattr(getattr(config, section), "megatron", None)
        for part in parts:
            switch = f"{part}_offload"
            if off is None or role not in roles or getattr(off, switch):
                continue
            changed = _with(config, section, megatron=dataclasses.replace(off, **{switch: True}))
            out.append((f"{section}.megatron.{switch}=true", changed))
    if not (config.model.enable_gradient_checkpointing or config.model.recompute_granularity == "full"):
        out.append(
            (
                "model.enable_gradient_checkpointing=true",
                _with(config, "model", enable_gradient_checkpointing=True),
            )
        )
    changes = out + _micro_batch_changes(config, roles) + _layout_changes(config, hf_config, world_size)
    return [(change, changed) for change, changed in changes if changed is not None]


def _respec(config: Any, specs: list[RoleSpec]) -> list[RoleSpec]:
    reward = next((s.hf_config for s in specs if s.name == "reward_model"), None)
    teacher = next((s.hf_config for s in specs if s.name == "teacher"), None)
    return role_specs(config, specs[0].hf_config, reward, teacher)


def plan_savings(
    config: Any, plan: MemoryPlan, specs: list[RoleSpec], built: dict | None = None, top: int = 3
) -> list[tuple[str, int]]:
    """The ``top`` changes that lower ``plan``'s peak the most: (override, bytes saved), each the
    original peak minus the peak of the changed job's own plan. ``built``: the original plan's
    build cache (the changes that keep the layout reuse it)."""
    built = {} if built is None else built
    roles = {name for p in plan.positions for name in p.roles}
    options = []
    for change, changed in candidate_changes(config, specs[0].hf_config, plan.world_size, roles):
        try:
            after = plan_memory(
                changed, plan.world_size, plan.gpu_bytes, _respec(changed, specs), built, False
            )
        except Exception as err:  # a change this job's config or model refuses is no option
            if not is_user_error(err):
                raise
            continue
        options.append((change, plan.peak - after.peak))
    return sorted((o for o in options if o[1] > 0), key=lambda o: -o[1])[:top]
