"""The optimizer and scheduler side of a checkpoint load: back up, load, restore on failure.

Also the two gaps of megatron 0.16's distributed optimizer over torch's Adam (no Transformer
Engine or Apex, as on CPU) that a load must work around.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch


def torch_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside a megatron (possibly chained) optimizer."""
    subs = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return [s.optimizer for s in subs if getattr(s, "optimizer", None) is not None]


def is_distributed(optimizer) -> bool:
    """Whether ``optimizer`` is (or chains) megatron's DistributedOptimizer."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    subs = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return optimizer is not None and any(isinstance(s, DistributedOptimizer) for s in subs)


def has_state(optimizer) -> bool:
    """Whether the optimizer has per-parameter state (Adam's moments appear at the first step)."""
    return any(len(s) > 0 for opt in torch_optimizers(optimizer) for s in opt.state.values())


def init_distributed_optimizer_state(optimizer) -> None:
    """Give a fresh distributed optimizer zero moments and a step count to be overwritten by the load.

    Its ``sharded_state_dict(is_loading=True)`` first calls ``state_dict()``, which with torch's
    Adam reads every parameter's ``step`` and fails on an optimizer that never stepped (megatron
    assumes TE's or Apex's Adam there). Nothing is computed: no dummy step touches the weights.
    With TE or Apex installed megatron takes its own path and this does nothing.
    """
    from megatron.core.optimizer import distrib_optimizer
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if distrib_optimizer.HAVE_APEX_OR_TE:
        return
    for sub in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        if not isinstance(sub, DistributedOptimizer) or len(sub.optimizer.state) > 0:
            continue
        sub.init_state_fn(sub.optimizer, sub.config)
        for group in sub.optimizer.param_groups:
            for param in group["params"]:
                sub.optimizer.state[param].setdefault("step", torch.tensor(0.0))


@contextlib.contextmanager
def step_set_apart(optimizer):
    """Load into a distributed optimizer over torch's Adam (no TE/Apex, as on CPU) correctly.

    Two gaps in megatron 0.16 with torch's Adam: (1) it copies every entry of a parameter's
    state from the checkpoint, ``step`` included, but the fully-reshardable format keeps
    ``step`` in the param groups: a KeyError; the copy here sees the state without ``step``,
    put back unchanged. (2) it gives all parameters ONE shared ``step`` tensor, which Adam then
    increments once per parameter, so the next update's bias correction is wrong: each
    parameter gets its own copy afterwards.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    patched = []
    for sub in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        if not isinstance(sub, DistributedOptimizer):
            continue

        def copy_without_step(model_param, tensors, sub=sub, copy=sub._set_main_param_and_optimizer_states):
            group, order = sub.model_param_group_index_map[model_param]
            state = sub.optimizer.state[sub.optimizer.param_groups[group]["params"][order]]
            step = state.pop("step", None)
            try:
                copy(model_param, tensors)
            finally:
                if step is not None:
                    state["step"] = step

        sub._set_main_param_and_optimizer_states = copy_without_step
        patched.append(sub)
    try:
        yield
    finally:
        for sub in patched:
            del sub._set_main_param_and_optimizer_states
    for sub in patched:
        for state in sub.optimizer.state.values():
            if "step" in state:
                state["step"] = state["step"].clone()


def back_up(optimizer, scheduler) -> dict[str, Any]:
    """What :func:`restore` needs to undo a failed load: the optimizers' state and hyper-parameters, the scheduler's state."""
    backup: dict[str, Any] = {}
    if optimizer is not None:
        backup["optimizer"] = [
            {
                # Per-parameter dicts are copied: loading replaces them, the tensors stay.
                "state": {p: dict(s) for p, s in opt.state.items()},
                "param_groups": copy.deepcopy(
                    [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
                ),
            }
            for opt in torch_optimizers(optimizer)
        ]
    if scheduler is not None:
        backup["scheduler"] = copy.deepcopy(scheduler.state_dict())
    return backup


def restore(optimizer, scheduler, backup: dict[str, Any]) -> None:
    """Put back what :func:`back_up` saved."""
    if optimizer is not None:
        for opt, saved in zip(torch_optimizers(optimizer), backup["optimizer"]):
            opt.state.clear()
            opt.state.update(saved["state"])
            for group, hyper in zip(opt.param_groups, saved["param_groups"]):
                group.update(hyper)
    if scheduler is not None:
        load_scheduler(scheduler, backup["scheduler"])


def load_scheduler(scheduler, state: dict) -> None:
    """Load a scheduler's ``state_dict()``, megatron's included (which adds to its step count)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    if isinstance(scheduler, OptimizerParamScheduler):
        # Its load_state_dict adds the saved step count to the current one
        # (it expects a fresh scheduler); start from zero so loading sets it.
        scheduler.num_steps = 0
    scheduler.load_state_dict(state)
