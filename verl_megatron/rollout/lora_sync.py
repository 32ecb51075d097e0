"""LoRA weights for an external engine: merged weights, or the base once and adapters per sync.

``rollout.lora_sync=merged`` needs nothing engine-specific: ``iter_hf_weights`` yields base +
adapter for every adapted projection and the usual bucketed stream loads them. ``adapter``
(vLLM only) loads the frozen base once (the first sync) and, on every sync, writes the adapters
as a PEFT folder in a private temporary directory of this process (each rank feeds its own
engine) and hands vLLM a new ``LoRARequest`` for it; the previous adapter is removed from the
engine and its folder deleted. vLLM must be built with ``enable_lora`` (``engine_kwargs`` below).
The native engine needs neither: it runs the actor's own modules, adapters included.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from verl_megatron.rollout.config import RolloutConfigError

__all__ = [
    "AdapterFolder",
    "AdapterPublisher",
    "AdapterSync",
    "check_rollout_lora",
    "lora_rollout_config",
    "uses_adapter_sync",
    "vllm_max_lora_rank",
]

LORA_SYNC_MODES = ("merged", "adapter")
_ADAPTER_ENGINES = ("vllm",)
# The max_lora_rank values vLLM's LoRAConfig accepts (vLLM >= 0.10; later versions add 1, which
# this list leaves out so that one value works on every version the gpu extra allows). Its
# kernels are built for these sizes; an adapter of a smaller rank runs in the next one up.
VLLM_MAX_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)


def vllm_max_lora_rank(lora_rank: int) -> int:
    """The smallest rank vLLM accepts as ``max_lora_rank`` that holds adapters of ``lora_rank``."""
    for accepted in VLLM_MAX_LORA_RANKS:
        if lora_rank <= accepted:
            return accepted
    raise RolloutConfigError(
        f"model.lora_rank={lora_rank} is above vLLM's largest max_lora_rank ({VLLM_MAX_LORA_RANKS[-1]}): "
        "use a smaller rank or rollout.lora_sync=merged"
    )


def check_rollout_lora(rollout_cfg: Any, model_cfg: Any) -> None:
    """RolloutConfigError naming the key when ``rollout.lora_sync`` cannot work with this run."""
    mode = rollout_cfg.lora_sync
    if mode not in LORA_SYNC_MODES:
        raise RolloutConfigError(f"rollout.lora_sync must be one of {list(LORA_SYNC_MODES)}, got {mode!r}")
    if mode == "adapter" and model_cfg.lora_rank <= 0:
        raise RolloutConfigError("rollout.lora_sync=adapter needs LoRA adapters (model.lora_rank > 0)")
    if mode == "adapter" and rollout_cfg.name not in _ADAPTER_ENGINES:
        raise RolloutConfigError(
            f"rollout.lora_sync=adapter loads adapters through vLLM's LoRARequest; rollout.name="
            f"{rollout_cfg.name!r} takes merged weights (rollout.lora_sync=merged)"
        )
    if uses_adapter_sync(rollout_cfg, model_cfg) and "max_lora_rank" not in rollout_cfg.engine_kwargs:
        vllm_max_lora_rank(model_cfg.lora_rank)  # a rank vLLM cannot hold fails here, before any build


def uses_adapter_sync(rollout_cfg: Any, model_cfg: Any) -> bool:
    return (
        model_cfg.lora_rank > 0
        and rollout_cfg.lora_sync == "adapter"
        and rollout_cfg.name in _ADAPTER_ENGINES
    )


def lora_rollout_config(rollout_cfg: Any, model_cfg: Any) -> Any:
    """The rollout config an engine is built from: with adapter sync, vLLM's LoRA switches added
    (``enable_lora``, ``max_lora_rank`` = the adapters' rank rounded up to a size vLLM accepts,
    one adapter at a time) unless the user's ``engine_kwargs`` set them."""
    if not uses_adapter_sync(rollout_cfg, model_cfg):
        return rollout_cfg
    lora = {"enable_lora": True, "max_loras": 1}
    if "max_lora_rank" not in rollout_cfg.engine_kwargs:
        lora["max_lora_rank"] = vllm_max_lora_rank(int(model_cfg.lora_rank))
    return dataclasses.replace(rollout_cfg, engine_kwargs={**lora, **rollout_cfg.engine_kwargs})


@dataclass(frozen=True)
class AdapterFolder:
    """One published adapter: vLLM's ``LoRARequest(name, int_id, path)`` arguments."""

    name: str
    int_id: int
    path: str


class AdapterPublisher:
    """Writes this process's copy of the actor's adapters, one folder per sync (the last one kept)."""

    def __init__(self) -> None:
        self.root = tempfile.mkdtemp(prefix="verl_megatron_lora_")
        self.version = 0
        self.current: AdapterFolder | None = None
        # The folders go with the publisher (or the process), whoever forgets to close it.
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.root, True)

    def publish(self, chunks: list[torch.nn.Module], runtime: Any, base_model: str | None) -> AdapterFolder:
        """Gather the adapters (collective over tp/pp) and write them; returns the new folder."""
        from verl_megatron.models.lora_export import gather_peft_adapters, write_peft_folder

        tensors = gather_peft_adapters(chunks, runtime)
        self.version += 1  # vLLM ids are > 0 and name one adapter's weights for good
        folder = AdapterFolder(
            f"actor_v{self.version}", self.version, os.path.join(self.root, f"v{self.version}")
        )
        write_peft_folder(folder.path, tensors, chunks, base_model)
        previous, self.current = self.current, folder
        if previous is not None:
            shutil.rmtree(previous.path, ignore_errors=True)
        return folder

    def close(self) -> None:
        self._cleanup()


class AdapterSync:
    """``rollout.lora_sync=adapter`` state of one external engine: base loaded yet, adapter folders."""

    def __init__(self) -> None:
        self.base_loaded = False
        self.publisher = AdapterPublisher()

    @classmethod
    def for_engine(cls, rollout_cfg: Any, chunks: list[torch.nn.Module]) -> AdapterSync | None:
        """An AdapterSync when this engine takes adapters, None when it takes (merged) weights."""
        from verl_megatron.models.lora import has_lora

        return cls() if rollout_cfg.lora_sync == "adapter" and has_lora(chunks) else None

    def load_adapters(
        self, backend: Any, chunks: list[torch.nn.Module], runtime: Any, base_model: str | None
    ) -> None:
        """After the (first) stream of base weights: publish this step's adapters to the engine."""
        self.base_loaded = True
        backend.set_lora_adapter(self.publisher.publish(chunks, runtime, base_model))
