"""The one door to megatron's process-global parallel state.

Megatron keeps the ranks and process groups of the layout built by
:func:`verl_megatron.distributed.parallel.build_megatron_groups` in module globals.
Code outside ``distributed/`` reads them here (or through :class:`Runtime`, whose
accessors call these functions), never from ``megatron.core.parallel_state``.

Group names: tp (tensor), pp (pipeline), dp (data), cp (context), ep (expert),
etp (expert tensor: the split of each routed expert's weights).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


def _ps() -> Any:
    # Imported on use: megatron is heavy, and the CPU compatibility layer must be
    # installed before it is first imported.
    from megatron.core import parallel_state

    return parallel_state


def is_initialized() -> bool:
    """Whether megatron's parallel groups have been built in this process."""
    return _ps().model_parallel_is_initialized()


# ------------------------------------------------------------------ tensor parallel
def tp_rank() -> int:
    return _ps().get_tensor_model_parallel_rank()


def tp_size() -> int:
    return _ps().get_tensor_model_parallel_world_size()


def tp_group() -> dist.ProcessGroup:
    return _ps().get_tensor_model_parallel_group()


def tp_src_rank() -> int:
    """Global rank of tp rank 0 of this rank's tensor-parallel group."""
    return _ps().get_tensor_model_parallel_src_rank()


# ------------------------------------------------------------------ pipeline parallel
def pp_rank() -> int:
    return _ps().get_pipeline_model_parallel_rank()


def pp_group() -> dist.ProcessGroup:
    return _ps().get_pipeline_model_parallel_group()


def pp_last_rank() -> int:
    """Global rank of the last pipeline stage of this rank's pipeline."""
    return _ps().get_pipeline_model_parallel_last_rank()


def pp_next_rank() -> int:
    """Global rank of the next pipeline stage (wrapping around)."""
    return _ps().get_pipeline_model_parallel_next_rank()


def pp_prev_rank() -> int:
    """Global rank of the previous pipeline stage (wrapping around)."""
    return _ps().get_pipeline_model_parallel_prev_rank()


def is_pp_first_stage(vp_stage: int | None = None) -> bool:
    """Whether virtual stage ``vp_stage`` of this rank (None: no vpp) is the model's first."""
    return _ps().is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)


def is_pp_last_stage(vp_stage: int | None = None) -> bool:
    """Whether virtual stage ``vp_stage`` of this rank (None: no vpp) is the model's last."""
    return _ps().is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)


def is_pp_last_rank() -> bool:
    """Whether this rank is the last pipeline rank (whatever its virtual stages)."""
    return _ps().is_pipeline_last_stage(ignore_virtual=True)


# ------------------------------------------------------------------ data / context parallel
def dp_rank() -> int:
    return _ps().get_data_parallel_rank()


def dp_group(with_cp: bool = False) -> dist.ProcessGroup:
    """The data-parallel group; with ``with_cp`` the data x context-parallel group."""
    return _ps().get_data_parallel_group(with_context_parallel=with_cp)


def cp_rank() -> int:
    return _ps().get_context_parallel_rank()


def cp_group() -> dist.ProcessGroup:
    return _ps().get_context_parallel_group()


def mp_group() -> dist.ProcessGroup:
    """The model-parallel group (tp x pp) of one model replica."""
    return _ps().get_model_parallel_group()


# ------------------------------------------------------------------ experts
def ep_rank() -> int:
    return _ps().get_expert_model_parallel_rank()


def ep_size() -> int:
    return _ps().get_expert_model_parallel_world_size()


def ep_group() -> dist.ProcessGroup:
    return _ps().get_expert_model_parallel_group()


def etp_rank() -> int:
    return _ps().get_expert_tensor_parallel_rank()


def etp_size() -> int:
    return _ps().get_expert_tensor_parallel_world_size()


def etp_group() -> dist.ProcessGroup:
    return _ps().get_expert_tensor_parallel_group()


def etp_ep_group() -> dist.ProcessGroup:
    """The ranks that meet in the MoE layers: expert tensor x expert parallel."""
    return _ps().get_expert_tensor_and_model_parallel_group()
