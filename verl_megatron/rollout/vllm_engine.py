"""vLLM behind the rollout interface, colocated with the trainer (GPU; ``pip install 'verl-megatron[gpu]'``).

Every rank runs vLLM in-process as part of the trainer's torch.distributed job
(``distributed_executor_backend="external_launcher"``), with ``rollout.tensor_model_parallel_size``
ranks per engine. The engine starts from dummy weights; ``sync_weights`` streams the actor's
weights into it in buckets (``weight_sync.py``) through the model's own ``load_weights``, which
takes Hugging Face names and shards them for vLLM's tensor parallelism. ``sleep`` / ``wake_up``
use vLLM's sleep mode (level 1: weights offloaded to CPU, KV cache freed).

Log-probs: vLLM is asked for ``processed_logprobs`` (after temperature, so they match
``rollout_log_probs`` of the native engine; with top-k / top-p vLLM renormalises over the kept
tokens, the native engine does not).

Images (vision-language checkpoints): each prompt goes as ``TokensPrompt(prompt_token_ids=ids,
multi_modal_data={"image": [PIL images]})`` with one ``<|image_pad|>`` per image (``external.py``:
vLLM's multimodal processor expands token prompts itself, ``is_update_applied=False`` for token
input in ``vllm/multimodal/processing``). The engine then keeps its tokenizer
(``skip_tokenizer_init=False``): its multimodal processor (the HF image processor, the placeholder's
token id) is built from it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from verl_megatron.distributed.parallel import Runtime
from verl_megatron.rollout.config import RolloutConfig, RolloutConfigError
from verl_megatron.rollout.external import (
    Completion,
    EngineBackend,
    ExternalRollout,
    GenerationRequest,
    engine_sampling,
    model_path_of,
)
from verl_megatron.rollout.weight_sync import NamedTensor

__all__ = [
    "VLLMBackend",
    "VLLMRollout",
    "completions_from_vllm",
    "disable_engine_multiprocessing",
    "vllm_engine_kwargs",
    "vllm_prompts",
    "vllm_sampling_kwargs",
]

_SLEEP_LEVEL = 1
# vLLM's engine core runs in a child process unless this is "0"; with
# distributed_executor_backend="external_launcher" it must run in this process (vLLM asserts it).
_MULTIPROCESSING_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"


def disable_engine_multiprocessing(environ: dict[str, str] | None = None) -> None:
    """Keep vLLM's engine core in the trainer's process (call before ``vllm.LLM`` is built).

    Raises RolloutConfigError when the user explicitly asked for multiprocessing, which the
    external launcher cannot run with.
    """
    environ = os.environ if environ is None else environ
    value = environ.get(_MULTIPROCESSING_ENV)
    if value is not None and value.strip() not in ("0", "false", "False"):
        raise RolloutConfigError(
            f"{_MULTIPROCESSING_ENV}={value!r} is set, but the colocated vLLM engine "
            "(distributed_executor_backend='external_launcher') runs in the trainer's process: "
            f"unset it or set it to 0"
        )
    environ[_MULTIPROCESSING_ENV] = "0"


def vllm_engine_kwargs(config: RolloutConfig, hf_config: Any, runtime: Runtime) -> dict[str, Any]:
    """Keyword arguments for ``vllm.LLM`` from the rollout config (``engine_kwargs`` override them)."""
    tp = config.tensor_model_parallel_size
    if runtime.world_size % tp != 0:
        raise RolloutConfigError(
            f"rollout.tensor_model_parallel_size={tp} does not divide the world size {runtime.world_size}"
        )
    kwargs: dict[str, Any] = {
        "model": model_path_of(hf_config),
        # A vision-language engine builds its multimodal processor from the tokenizer (docstring).
        "skip_tokenizer_init": getattr(hf_config, "vision_config", None) is None,
        "tensor_parallel_size": tp,
        "distributed_executor_backend": "external_launcher",
        "dtype": config.dtype,
        "enforce_eager": config.enforce_eager,
        "gpu_memory_utilization": config.gpu_memory_utilization,
        "enable_sleep_mode": True,
        "load_format": config.load_format,
        "max_model_len": config.max_model_len or config.prompt_length + config.response_length,
        "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "enable_chunked_prefill": config.enable_chunked_prefill,
        "enable_prefix_caching": config.enable_prefix_caching,
        "disable_log_stats": config.disable_log_stats,
        "logprobs_mode": "processed_logprobs",
        # The engine's own RNG only seeds its start-up; each request carries its seed.
        "seed": config.seed if config.seed is not None else runtime.seed,
    }
    kwargs.update(config.engine_kwargs)
    return kwargs


def vllm_sampling_kwargs(request: GenerationRequest, seed: int | None = None) -> dict[str, Any]:
    """Keyword arguments for ``vllm.SamplingParams`` (vLLM: temperature 0 is greedy, top_k -1 is off);
    ``seed`` (a prompt's) replaces the call's."""
    return {
        "n": request.params.n,
        **engine_sampling(request),
        "max_tokens": request.max_tokens,
        "logprobs": 0 if request.logprobs else None,
        "seed": request.seed if seed is None else seed,
        "detokenize": False,
    }


def vllm_prompts(prompts: list[list[int]], images: Sequence[list[Any] | None] = ()) -> list[dict[str, Any]]:
    """``TokensPrompt`` fields of each prompt: its ids, and ``multi_modal_data`` where it has images."""
    images = images or [None] * len(prompts)
    return [
        {"prompt_token_ids": ids, **({"multi_modal_data": {"image": list(imgs)}} if imgs else {})}
        for ids, imgs in zip(prompts, images)
    ]


def completions_from_vllm(outputs: list[Any], logprobs: bool) -> list[list[Completion]]:
    """vLLM ``RequestOutput`` list -> per prompt, its completions (token ids and sampled log-probs).

    With ``logprobs=0`` vLLM returns, per generated token, a dict {token id: Logprob} holding
    the sampled token.
    """
    result = []
    for output in outputs:
        per_prompt = []
        for completion in output.outputs:
            tokens = list(completion.token_ids)
            log_probs = None
            if logprobs:
                log_probs = [float(step[token].logprob) for token, step in zip(tokens, completion.logprobs)]
            per_prompt.append(Completion(tokens, log_probs))
        result.append(per_prompt)
    return result


class VLLMBackend(EngineBackend):
    """Calls an in-process ``vllm.LLM`` (built from :func:`vllm_engine_kwargs`)."""

    def __init__(self, config: RolloutConfig, hf_config: Any, runtime: Runtime) -> None:
        disable_engine_multiprocessing()
        from vllm import LLM

        self.llm = LLM(**vllm_engine_kwargs(config, hf_config, runtime))
        self.lora_request = None  # rollout.lora_sync=adapter: the actor's current adapter

    def generate(self, prompts: list[list[int]], request: GenerationRequest) -> list[list[Completion]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        # One SamplingParams per prompt (vLLM takes a list as long as the prompts): each prompt
        # draws from its own seed, whichever replica generates it.
        seeds = request.prompt_seeds or (request.seed,) * len(prompts)
        # lora_request only when an adapter is loaded (rollout.lora_sync=adapter); None is vLLM's default.
        extra = {"lora_request": self.lora_request} if self.lora_request is not None else {}
        outputs = self.llm.generate(
            [TokensPrompt(**fields) for fields in vllm_prompts(prompts, request.prompt_images)],
            sampling_params=[SamplingParams(**vllm_sampling_kwargs(request, seed)) for seed in seeds],
            use_tqdm=False,
            **extra,
        )
        return completions_from_vllm(outputs, request.logprobs)

    def generate_each(
        self, prompts: list[list[int]], requests: list[GenerationRequest]
    ) -> list[list[Completion]]:
        """One ``LLM.generate`` for prompts with settings of their own: one SamplingParams per
        prompt (its n, length, sampling and seed), token ids in, token ids and log-probs out."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        extra = {"lora_request": self.lora_request} if self.lora_request is not None else {}
        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts],
            sampling_params=[SamplingParams(**vllm_sampling_kwargs(r)) for r in requests],
            use_tqdm=False,
            **extra,
        )
        return [completions_from_vllm([out], r.logprobs)[0] for out, r in zip(outputs, requests)]

    def load_weights(self, bucket: list[NamedTensor]) -> None:
        # Runs in this process (external_launcher): the bucket is not copied between processes.
        self.llm.apply_model(lambda model: model.load_weights(weights=bucket))

    def set_lora_adapter(self, folder) -> None:
        """Load the PEFT folder as a new LoRA (a new id: vLLM caches adapters by id), drop the old one."""
        from vllm.lora.request import LoRARequest

        previous = self.lora_request
        self.lora_request = LoRARequest(
            lora_name=folder.name, lora_int_id=folder.int_id, lora_path=folder.path
        )
        # Loaded now rather than at the first request, so a bad folder fails at the sync (vLLM's
        # worker refuses it unless built with enable_lora: lora_sync.lora_rollout_config sets it).
        self.llm.llm_engine.add_lora(self.lora_request)
        if previous is not None:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)

    def reset_cache(self) -> None:
        # Prefix-cache blocks hold keys/values computed with the previous weights.
        self.llm.reset_prefix_cache()

    def sleep(self) -> None:
        self.llm.sleep(level=_SLEEP_LEVEL)

    def wake_up(self, tags: tuple[str, ...] | None = None) -> None:
        self.llm.wake_up(tags=None if tags is None else list(tags))


class VLLMRollout(ExternalRollout):
    """The rollout interface over vLLM (see the module docstring); ``backend`` replaces vLLM in tests."""

    backend_cls = VLLMBackend
