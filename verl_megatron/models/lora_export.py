"""LoRA adapters out of megatron: as PEFT tensors, merged into Hugging Face weights, or on disk.

The whole tensors of the adapters (see models/lora.py) are PEFT's ``lora_A.weight`` /
``lora_B.weight`` of each projection, so every function here gathers them over tp (and pp)
and renames them. They are small (rank x hidden per projection), so they are gathered onto
every rank of a model replica at once rather than streamed.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from verl_megatron.distributed.collective import raise_on_any_rank
from verl_megatron.distributed.parallel import Runtime
from verl_megatron.models.export_io import publish_folder
from verl_megatron.models.lora import adapter_container, has_lora, named_adapter_parameters
from verl_megatron.models.sharding import gather_tp

__all__ = ["export_peft_adapter", "gather_peft_adapters", "lora_merger", "peft_config"]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."


def _settings(chunks: Sequence[torch.nn.Module]):
    return next(adapter_container(c) for c in chunks if adapter_container(c) is not None).settings


@torch.no_grad()
def gather_peft_adapters(chunks: Sequence[torch.nn.Module], runtime: Runtime) -> dict[str, torch.Tensor]:
    """PEFT state-dict name -> whole float tensor (CPU), the same dict on every rank of the replica.

    Collective over the tensor- and pipeline-parallel groups. Names look like
    ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``.
    """
    tp = runtime.layout.tp
    local: dict[str, torch.Tensor] = {}
    for layer, prefix, proj, pair in named_adapter_parameters(chunks):
        module = f"{_PEFT_PREFIX}model.layers.{layer}.{prefix}.{proj}"
        for kind, param in (("lora_A", pair.lora_A), ("lora_B", pair.lora_B)):
            whole = gather_tp(param.detach(), param, runtime.tp_group(), tp)
            local[f"{module}.{kind}.weight"] = whole.cpu()
    if runtime.layout.pp > 1:
        stages: list[Any] = [None] * runtime.layout.pp
        dist.all_gather_object(stages, local, group=runtime.pp_group())
        local = {k: v for stage in stages for k, v in stage.items()}
    return local


def lora_merger(
    chunks: Sequence[torch.nn.Module], runtime: Runtime
) -> Callable[[str, torch.Tensor], torch.Tensor]:
    """``merge(hf_name, tensor)``: the tensor plus its adapter's ``scaling * B @ A`` (collective to build).

    Without adapters it returns tensors unchanged. The product and the sum are taken in float32
    (at least), then cast to the base weight's dtype.
    """
    if not has_lora(chunks):
        return lambda name, tensor: tensor
    settings = _settings(chunks)
    adapters = gather_peft_adapters(chunks, runtime)

    def merge(name: str, tensor: torch.Tensor) -> torch.Tensor:
        stem = f"{_PEFT_PREFIX}{name.removesuffix('.weight')}"
        a = adapters.get(f"{stem}.lora_A.weight")
        if a is None or not name.endswith(".weight"):
            return tensor
        b = adapters[f"{stem}.lora_B.weight"]
        work = torch.promote_types(tensor.dtype, torch.float32)
        delta = (b.to(work) @ a.to(work)) * settings.scaling
        return (tensor.to(work) + delta.to(tensor.device)).to(tensor.dtype)

    return merge


def peft_config(chunks: Sequence[torch.nn.Module], base_model: str | None) -> dict[str, Any]:
    """PEFT's adapter_config.json for these adapters (``LoraConfig`` fields, causal LM)."""
    s = _settings(chunks)
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": s.rank,
        "lora_alpha": s.alpha,
        "lora_dropout": s.dropout,
        "target_modules": list(s.targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
    }


def write_peft_folder(
    out_dir: str, tensors: dict[str, torch.Tensor], chunks: Sequence[torch.nn.Module], base_model: str | None
) -> None:
    """Write ``gather_peft_adapters``' tensors as a PEFT folder at ``out_dir`` (this process only)."""
    _write(out_dir, tensors, peft_config(chunks, base_model))


def _write(out_dir: str, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    from safetensors.torch import save_file

    tmp = f"{out_dir}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        weights = {k: v.contiguous() for k, v in tensors.items()}
        save_file(weights, os.path.join(tmp, ADAPTER_WEIGHTS), {"format": "pt"})
        with open(os.path.join(tmp, ADAPTER_CONFIG), "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
        publish_folder(tmp, out_dir)  # the same replace-never-half-written move as the merged HF export
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # its name holds the pid: no later write would remove it
        raise


def export_peft_adapter(
    chunks: Sequence[torch.nn.Module],
    runtime: Runtime,
    out_dir: str | os.PathLike,
    base_model: str | None = None,
) -> None:
    """Write the adapters as a PEFT adapter folder (``PeftModel.from_pretrained`` loads it).

    Collective over all ranks; global rank 0 writes ``adapter_config.json`` and
    ``adapter_model.safetensors`` (the parameters' dtype) into a temporary folder renamed to
    ``out_dir``. ``base_model``: recorded as ``base_model_name_or_path``.
    """
    if not has_lora(chunks):
        raise ValueError("export_peft_adapter: these chunks have no LoRA adapters (model.lora_rank=0)")
    out_dir = os.path.abspath(os.fspath(out_dir))
    tensors = gather_peft_adapters(chunks, runtime)
    error: BaseException | None = None
    if runtime.rank == 0:
        try:
            _write(out_dir, tensors, peft_config(chunks, base_model))
        except Exception as err:  # every rank must reach the status exchange below
            error = err
    message = f"writing the LoRA adapter to '{out_dir}' failed on rank 0 (see its log)"
    raise_on_any_rank(error, runtime.device, message)


def export_final_adapter(
    chunks: Sequence[torch.nn.Module], runtime: Runtime, out_root: str, model_cfg: Any
) -> str | None:
    """The trainer's end-of-run export: ``<out_root>/lora_adapter`` when the actor has adapters
    (``hf_export`` beside it holds the merged weights). Returns the folder, None without LoRA."""
    if not has_lora(chunks):
        return None
    out_dir = os.path.join(out_root, "lora_adapter")
    export_peft_adapter(chunks, runtime, out_dir, base_model=model_cfg.path or None)
    if runtime.rank == 0:
        print(f"exported the LoRA adapters as a PEFT adapter to {out_dir}", flush=True)
    return out_dir
