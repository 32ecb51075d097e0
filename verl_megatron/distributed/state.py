"""The one door to megatron's process-global parallel state.

Megatron keeps the ranks and process groups of the layout built by
:func:`verl_megatron.distributed.parallel.build_megatron_groups` in module globals.
Code outside ``distributed/`` reads them here (or through :class:`Runtime`, whose
accessors call these functions), never from ``megatron.core.parallel_state``.
"""

from __future__ import annotations

from typing import Any, Literal

import torch.distributed as dist

Axis = Literal["tp", "pp", "dp", "cp", "ep", "etp"]
"""tp: tensor, pp: pipeline, dp: data, cp: context, ep: expert,
etp: expert tensor (the split of each routed expert's weights)."""

# axis -> the name megatron's rank / world-size / group getters share: get_<name>_rank, ...
_MEGATRON_NAME: dict[str, str] = {
    "tp": "tensor_model_parallel",
    "pp": "pipeline_model_parallel",
    "dp": "data_parallel",
    "cp": "context_parallel",
    "ep": "expert_model_parallel",
    "etp": "expert_tensor_parallel",
}


def _ps() -> Any:
    # Imported on use: megatron is heavy, and the CPU compatibility layer must be
    # installed before it is first imported.
    from megatron.core import parallel_state

    return parallel_state


def is_initialized() -> bool:
    """Whether megatron's parallel groups have been built in this process."""
    return _ps().model_parallel_is_initialized()


def rank(axis: Axis) -> int:
    """This process's rank within its ``axis`` group."""
    return getattr(_ps(), f"get_{_MEGATRON_NAME[axis]}_rank")()


def size(axis: Axis) -> int:
    """The size of this process's ``axis`` group."""
    return getattr(_ps(), f"get_{_MEGATRON_NAME[axis]}_world_size")()


def group(axis: Axis, with_cp: bool = False) -> dist.ProcessGroup:
    """This process's ``axis`` group; ``with_cp`` (dp only): the data x context-parallel group."""
    if axis == "dp":
        return _ps().get_data_parallel_group(with_context_parallel=with_cp)
    return getattr(_ps(), f"get_{_MEGATRON_NAME[axis]}_group")()


def model_parallel_group() -> dist.ProcessGroup:
    """The model-parallel group (tp x pp) of one model replica."""
    return _ps().get_model_parallel_group()


def expert_group() -> dist.ProcessGroup:
    """The ranks that meet in the MoE layers: expert tensor x expert parallel."""
    return _ps().get_expert_tensor_and_model_parallel_group()


def tp_src_rank() -> int:
    """Global rank of tp rank 0 of this rank's tensor-parallel group."""
    return _ps().get_tensor_model_parallel_src_rank()


def pp_peer_rank(which: Literal["last", "next", "prev"]) -> int:
    """Global rank of this pipeline's last stage, or of the next / previous stage (wrapping around)."""
    return getattr(_ps(), f"get_pipeline_model_parallel_{which}_rank")()


def is_pp_first_stage(vp_stage: int | None = None) -> bool:
    """Whether virtual stage ``vp_stage`` of this rank (None: no vpp) is the model's first."""
    return _ps().is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)


def is_pp_last_stage(vp_stage: int | None = None) -> bool:
    """Whether virtual stage ``vp_stage`` of this rank (None: no vpp) is the model's last."""
    return _ps().is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)


def is_pp_last_rank() -> bool:
    """Whether this rank is the last pipeline rank (whatever its virtual stages)."""
    return _ps().is_pipeline_last_stage(ignore_virtual=True)
