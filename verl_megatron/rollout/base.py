"""The rollout interface, the engine factory, and the batch plumbing every engine shares.

An engine turns a batch of left-padded prompts into responses (verl's batch keys)::

    in : input_ids [B, Tp] (left-padded), attention_mask [B, Tp], position_ids [B, Tp]
    out: prompts [B*n, Tp], responses [B*n, Tr] (right-padded with the pad id),
         input_ids / attention_mask / position_ids [B*n, Tp+Tr], response_mask [B*n, Tr],
         rollout_log_probs [B*n, Tr]

where Tr = the response length and a prompt's n samples are adjacent rows (verl's
``repeat(n, interleave=True)``); ``non_tensor_batch`` entries are repeated the same way. The
response mask is 1 on generated tokens up to and including the stop token (EOS or a stop id) and
0 on padding. Every rank of a model-parallel group calls ``generate_sequences`` with the same
prompts (its data-parallel shard) and gets the same result.

A training step drives any engine the same way: ``wake_up_weights()``, ``sync_weights()``,
``wake_up()``, ``generate_sequences(prompts)``, ``sleep()``; the native engine, which reads the
actor's weights in place, makes the hooks no-ops. Multi-turn rollouts wrap an engine in
``verl_megatron.rollout.multiturn.MultiTurnRollout`` with an environment.
"""

from __future__ import annotations

import abc
import functools
import importlib
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from verl_megatron.distributed.parallel import Runtime
from verl_megatron.models.routing import RouteRecorder
from verl_megatron.protocol import DataProto
from verl_megatron.rollout.config import RolloutConfig
from verl_megatron.workers.vl_inputs import with_response_positions

__all__ = [
    "RolloutEngine",
    "RolloutEngineUnavailable",
    "assemble_output",
    "build_rollout",
    "pad_token_id",
    "prompt_tensors",
    "responses_from_lists",
    "stop_token_ids",
]


class RolloutEngineUnavailable(ImportError):
    """The configured engine's package is not installed."""


class RolloutEngine(abc.ABC):
    """Generates responses for prompts; colocated with the actor whose weights it uses."""

    # Sampling seeds derive from (seed, call number, prompt row): a resumed run continues the count.
    _calls: int = 0

    def state_dict(self) -> dict[str, int]:
        """What a checkpoint must keep so that a resumed run samples what the original would have."""
        return {"calls": self._calls}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._calls = int(state["calls"])

    @abc.abstractmethod
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Responses for a batch of left-padded prompts; see the module docstring for the keys."""

    # The three hooks below are no-ops by default: an engine that reads the actor's weights in
    # place (native) has nothing to load, free or take back.
    def sync_weights(self) -> None:  # noqa: B027
        """Load the actor's current weights into the engine (no-op when it reads them in place)."""

    def sleep(self) -> None:  # noqa: B027
        """Free the engine's memory (weights / KV cache) while the trainer runs."""

    def wake_up(self) -> None:  # noqa: B027
        """Take the memory back before generating."""

    def wake_up_weights(self) -> None:  # noqa: B027
        """Take back only the weights' memory, so that ``sync_weights`` can run before the KV cache
        is allocated (the trainer parks the actor's parameters in between)."""


# engine name -> (module, class); the package each needs is rollout.config's table.
_ENGINES = {
    "native": ("verl_megatron.rollout.native", "NativeRollout"),
    "vllm": ("verl_megatron.rollout.vllm_engine", "VLLMRollout"),
    "sglang": ("verl_megatron.rollout.sglang_engine", "SGLangRollout"),
}


def require_package(engine: str) -> None:
    """Raise RolloutEngineUnavailable naming the package and extra when ``engine``'s package
    cannot be imported (config.check_engine_installed only looks it up; this also catches a
    broken install)."""
    from verl_megatron.rollout.config import ENGINE_PACKAGES

    if engine not in ENGINE_PACKAGES:
        return
    package, extra = ENGINE_PACKAGES[engine]
    try:
        importlib.import_module(package)
    except ImportError as err:
        raise RolloutEngineUnavailable(
            f"rollout.name={engine!r} needs the '{package}' package, which is not installed "
            f"({err}); install it with: pip install 'verl-megatron[{extra}]' "
            "(GPU only), or use rollout.name='native'"
        ) from err


def build_rollout(
    config: RolloutConfig,
    runtime: Runtime,
    actor_chunks: list[torch.nn.Module],
    tokenizer: Any,
    hf_config: Any,
    route_recorder: RouteRecorder | None = None,
) -> RolloutEngine:
    """The engine named by ``config.name``, built on the actor's chunks (vllm/sglang imported only then).

    ``route_recorder``: MoE routing replay's recorder on ``actor_chunks`` (the native engine only).
    """
    if config.name not in _ENGINES:
        raise ValueError(f"rollout.name must be one of {list(_ENGINES)}, got {config.name!r}")
    module_name, class_name = _ENGINES[config.name]
    require_package(config.name)
    generation_eos_ids(_model_dir(hf_config))  # a broken generation_config.json fails here, not mid-run
    engine_cls = getattr(importlib.import_module(module_name), class_name)
    if route_recorder is None:
        return engine_cls(config, runtime, actor_chunks, tokenizer, hf_config)
    if config.name != "native":
        raise ValueError(f"routing replay: the {class_name} rollout engine cannot record routes")
    return engine_cls(config, runtime, actor_chunks, tokenizer, hf_config, route_recorder=route_recorder)


def prompt_tensors(prompts: DataProto) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, position_ids) [B, Tp] of a prompt batch, checked to be left-padded.

    ``position_ids`` defaults to cumsum(attention_mask) - 1 clipped at 0 when absent.
    """
    if prompts.batch is None or "input_ids" not in prompts.batch:
        raise KeyError("generate_sequences: the prompt batch needs 'input_ids' [B, Tp]")
    input_ids = prompts.batch["input_ids"]
    if input_ids.dim() != 2 or input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise ValueError(
            f"generate_sequences: input_ids must be [B, Tp] with B, Tp > 0, got {list(input_ids.shape)}"
        )
    keys = prompts.batch.keys()
    mask = prompts.batch["attention_mask"] if "attention_mask" in keys else torch.ones_like(input_ids)
    if mask.shape != input_ids.shape:
        raise ValueError(
            f"generate_sequences: attention_mask {list(mask.shape)} must match input_ids {list(input_ids.shape)}"
        )
    valid = mask.bool()
    # Left padding: once a row's mask turns 1 it stays 1, and the last column is a real token.
    if bool((valid[:, 1:].long() < valid[:, :-1].long()).any()) or not bool(valid[:, -1].all()):
        rows = torch.nonzero(~valid[:, -1] | (valid[:, 1:].long() < valid[:, :-1].long()).any(-1)).flatten()
        raise ValueError(
            f"generate_sequences: prompts must be LEFT-padded with at least one real token; rows "
            f"{rows[:8].tolist()} have padding after a real token or an empty prompt"
        )
    if "position_ids" in keys:
        positions = prompts.batch["position_ids"]
    else:
        positions = (valid.long().cumsum(dim=-1) - 1).clamp(min=0)
    return input_ids, mask, positions


def pad_token_id(meta_info: dict[str, Any], tokenizer: Any) -> int:
    """``meta_info['pad_token_id']``, else the tokenizer's pad id (else its eos id)."""
    for value in (meta_info.get("pad_token_id"), getattr(tokenizer, "pad_token_id", None)):
        if value is not None:
            return int(value)
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        raise ValueError(
            "generate_sequences: no pad id: set meta_info['pad_token_id'] or the tokenizer's pad token"
        )
    return int(eos)


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int | np.integer):
        return [int(value)]
    return [int(v) for v in value]


@functools.cache
def generation_eos_ids(model_dir: str | None) -> tuple[int, ...]:
    """The eos ids of a checkpoint folder's ``generation_config.json`` (none without one).

    Chat models list every token that ends a turn there, often more than the tokenizer's one
    eos: Qwen2.5-Instruct [151645, 151643], Llama-3.1-Instruct [128001, 128008, 128009]. Read
    once per folder, from disk only.
    """
    if not model_dir or not os.path.isfile(os.path.join(model_dir, "generation_config.json")):
        return ()
    from transformers import GenerationConfig

    try:
        generation = GenerationConfig.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError) as err:
        raise ValueError(
            f"{os.path.join(model_dir, 'generation_config.json')} cannot be read: {err}"
        ) from err
    return tuple(_as_ids(generation.eos_token_id))


def _model_dir(hf_config: Any) -> str | None:
    return getattr(hf_config, "_name_or_path", None) or None


def generation_meta(tokenizer: Any) -> dict[str, Any]:
    """What a trainer's generate call puts in ``meta_info`` for its tokenizer: the pad id, not the
    eos. A batch's ``eos_token_id`` replaces every other eos (``stop_token_ids``), and without it
    the engine stops on the tokenizer's, the model config's and ``generation_config.json``'s alike
    (chat models end a turn on any of several)."""
    return {"pad_token_id": tokenizer.pad_token_id}


def stop_token_ids(
    config: RolloutConfig, meta_info: dict[str, Any], tokenizer: Any, hf_config: Any
) -> list[int]:
    """Token ids that end a response: EOS (``meta_info['eos_token_id']``, else the tokenizer's,
    the model config's and its ``generation_config.json``'s; none with ``ignore_eos``) plus
    ``config.stop_token_ids``."""
    eos: list[int] = []
    if not config.ignore_eos:
        eos = _as_ids(meta_info.get("eos_token_id"))
        if not eos:
            eos = _as_ids(getattr(tokenizer, "eos_token_id", None))
            eos += _as_ids(getattr(hf_config, "eos_token_id", None))
            eos += generation_eos_ids(_model_dir(hf_config))
    return sorted(set(eos) | set(config.stop_token_ids))


def responses_from_lists(
    token_lists: Sequence[Sequence[int]],
    logprob_lists: Sequence[Sequence[float]] | None,
    response_length: int,
    pad_id: int,
    mask_lists: Sequence[Sequence[int]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Right-pad per-row token lists into (responses [B, Tr], response_mask [B, Tr], log_probs [B, Tr]).

    Rows longer than ``response_length`` are cut. ``mask_lists`` (default all ones) marks which
    tokens the policy generated; ``log_probs`` is None when ``logprob_lists`` is.
    """
    batch = len(token_lists)
    responses = torch.full((batch, response_length), pad_id, dtype=torch.long)
    mask = torch.zeros((batch, response_length), dtype=torch.long)
    log_probs = None if logprob_lists is None else torch.zeros((batch, response_length), dtype=torch.float32)
    for i, tokens in enumerate(token_lists):
        n = min(len(tokens), response_length)
        responses[i, :n] = torch.as_tensor(list(tokens[:n]), dtype=torch.long)
        mask[i, :n] = 1 if mask_lists is None else torch.as_tensor(list(mask_lists[i][:n]), dtype=torch.long)
        if log_probs is not None:
            log_probs[i, :n] = torch.as_tensor(list(logprob_lists[i][:n]), dtype=torch.float32)
    return responses, mask, log_probs


def assemble_output(
    prompts: DataProto,
    responses: torch.Tensor,
    response_mask: torch.Tensor,
    log_probs: torch.Tensor | None,
    n: int,
    response_attention_mask: torch.Tensor | None = None,
) -> DataProto:
    """The rollout output batch from [B*n, Tr] responses of a [B, Tp] prompt batch (keys: module docstring).

    ``response_attention_mask`` [B*n, Tr] marks the response tokens that are part of the sequence;
    it defaults to ``response_mask`` and differs only when the environment added tokens (multi-turn).
    Response positions continue from each prompt's last position.
    """
    input_ids, mask, positions = prompt_tensors(prompts)
    if n > 1:
        input_ids, mask, positions = (t.repeat_interleave(n, dim=0) for t in (input_ids, mask, positions))
    if responses.shape[0] != input_ids.shape[0]:
        raise ValueError(
            f"assemble_output: {responses.shape[0]} responses for {input_ids.shape[0]} prompt rows"
        )
    device = input_ids.device
    responses, response_mask = responses.to(device), response_mask.to(device)
    if response_attention_mask is None:
        response_attention_mask = response_mask
    steps = torch.arange(1, responses.shape[1] + 1, device=device, dtype=positions.dtype)
    tensors = {
        "prompts": input_ids,
        "responses": responses,
        "input_ids": torch.cat([input_ids, responses], dim=-1),
        "attention_mask": torch.cat([mask, response_attention_mask.to(device, mask.dtype)], dim=-1),
        "position_ids": torch.cat([positions, positions[:, -1:] + steps], dim=-1)
        if positions.dim() == 2
        else with_response_positions(positions, responses.shape[1]),  # [B, 3, T] multimodal ids
        "response_mask": response_mask,
    }
    if log_probs is not None:
        tensors["rollout_log_probs"] = log_probs.to(device)
    non_tensors = {k: np.repeat(v, n, axis=0) for k, v in prompts.non_tensor_batch.items()}
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info=dict(prompts.meta_info))
