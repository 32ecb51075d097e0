"""SGLang behind the rollout interface, colocated with the trainer (GPU; ``pip install 'verl-megatron[sglang]'``).

Every rank drives one offline ``sglang.Engine`` on its own GPU (SGLang's engine starts its own
worker processes, so it cannot share the trainer's ranks for tensor parallelism the way vLLM's
external launcher does: ``rollout.tensor_model_parallel_size`` must be 1). Weights start as
dummies and stream in through ``update_weights_from_tensor`` in buckets; ``sleep`` / ``wake_up``
release and resume the engine's GPU memory (``enable_memory_saver``) by SGLang's memory tags:
sleep releases the weights, the KV cache and the CUDA graphs, and the wake-ups resume exactly
those (the weights first, for the weight sync; then the KV cache and the CUDA graphs, which
generation needs). A tag released and never resumed would leave its memory unmapped (CUDA graphs
are on by default: their replay would read unmapped memory); a tag resumed that was not released
is an error in SGLang (its set of offloaded tags has no such entry).

Sampling: a prompt's n samples are requested as n copies of the prompt; the engine's draws are
seeded by its ``random_seed`` (SGLang takes no per-request seed), so only the native and vLLM
engines repeat a call's tokens from the rollout seed.

Images (vision-language checkpoints): ``Engine.generate(input_ids=..., image_data=...)`` with
``image_data`` one list of PIL images per request (None for a text prompt; SGLang's
``GenerateReqInput`` takes a list of lists as long as the batch). SGLang decodes ``input_ids`` to
text and its processor expands each ``<|image_pad|>``, so the ids hold one per image
(``external.py``). The engine keeps its tokenizer for that (``skip_tokenizer_init=False``).
"""

from __future__ import annotations

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
    "SLEEP_TAGS",
    "SGLangBackend",
    "SGLangRollout",
    "completions_from_sglang",
    "sglang_engine_kwargs",
    "sglang_generate_kwargs",
    "sglang_sampling_params",
]


# SGLang's memory tags (``sglang.srt.constants.GPU_MEMORY_TYPE_*``). Without tags SGLang releases
# every type it knows, so the tags are always named: what sleep releases is what the wake-ups resume.
SLEEP_TAGS = ("weights", "kv_cache", "cuda_graph")
# The rollout's two wake-ups (ExternalRollout: "weights" for the sync, then "kv_cache" for
# generation) -> SGLang's tags; generation needs its CUDA graphs with the KV cache.
_WAKE_TAGS = {"weights": ("weights",), "kv_cache": ("kv_cache", "cuda_graph")}


def sglang_engine_kwargs(config: RolloutConfig, hf_config: Any, runtime: Runtime) -> dict[str, Any]:
    """Keyword arguments for ``sglang.Engine`` from the rollout config (``engine_kwargs`` override them)."""
    if config.tensor_model_parallel_size != 1:
        raise RolloutConfigError(
            "rollout.name='sglang' runs one engine per rank: set rollout.tensor_model_parallel_size=1 "
            f"(got {config.tensor_model_parallel_size}), or use rollout.name='vllm' for tensor-parallel engines"
        )
    kwargs: dict[str, Any] = {
        "model_path": model_path_of(hf_config),
        # A vision-language engine decodes the ids to text for its processor (docstring).
        "skip_tokenizer_init": getattr(hf_config, "vision_config", None) is None,
        "tp_size": 1,
        "base_gpu_id": runtime.local_rank,
        "dtype": config.dtype,
        "mem_fraction_static": config.gpu_memory_utilization,
        "enable_memory_saver": True,
        "load_format": config.load_format,
        "context_length": config.max_model_len or config.prompt_length + config.response_length,
        "max_running_requests": config.max_num_seqs,
        "chunked_prefill_size": config.max_num_batched_tokens if config.enable_chunked_prefill else -1,
        "disable_radix_cache": not config.enable_prefix_caching,
        "random_seed": (config.seed if config.seed is not None else runtime.seed) + runtime.dp_rank,
        "log_level": "error",
    }
    kwargs.update(config.engine_kwargs)
    return kwargs


def sglang_sampling_params(request: GenerationRequest) -> dict[str, Any]:
    """SGLang's per-request sampling dict (temperature 0 is greedy, top_k -1 is off)."""
    return {**engine_sampling(request), "max_new_tokens": request.max_tokens}


def sglang_generate_kwargs(prompts: list[list[int]], request: GenerationRequest) -> dict[str, Any]:
    """``Engine.generate`` arguments: each prompt n times (prompt-major), with its images when any
    (``request.prompt_images``)."""
    n = request.params.n
    kwargs: dict[str, Any] = {
        "input_ids": [p for p in prompts for _ in range(n)],
        "sampling_params": sglang_sampling_params(request),
        "return_logprob": request.logprobs,
    }
    if request.prompt_images:
        kwargs["image_data"] = [
            list(imgs) if imgs else None for imgs in request.prompt_images for _ in range(n)
        ]
    return kwargs


def completions_from_sglang(outputs: list[dict[str, Any]], n: int, logprobs: bool) -> list[list[Completion]]:
    """SGLang outputs for n copies of each prompt (prompt-major) -> per prompt, its n completions.

    With ``return_logprob`` each output's ``meta_info['output_token_logprobs']`` holds one
    (log-prob, token id, text) triple per generated token.
    """
    if len(outputs) % n != 0:
        raise RuntimeError(f"sglang returned {len(outputs)} outputs, not a multiple of n={n}")
    completions = []
    for out in outputs:
        tokens = list(out["output_ids"])
        log_probs = None
        if logprobs:
            log_probs = [float(entry[0]) for entry in out["meta_info"]["output_token_logprobs"]]
        completions.append(Completion(tokens, log_probs))
    return [completions[i : i + n] for i in range(0, len(completions), n)]


class SGLangBackend(EngineBackend):
    """Calls an offline ``sglang.Engine`` (built from :func:`sglang_engine_kwargs`)."""

    def __init__(self, config: RolloutConfig, hf_config: Any, runtime: Runtime) -> None:
        import sglang

        self.engine = sglang.Engine(**sglang_engine_kwargs(config, hf_config, runtime))
        self.released: set[str] = set()  # the tags released by sleep and not resumed yet

    def generate(self, prompts: list[list[int]], request: GenerationRequest) -> list[list[Completion]]:
        outputs = self.engine.generate(**sglang_generate_kwargs(prompts, request))
        return completions_from_sglang(outputs, request.params.n, request.logprobs)

    def generate_each(
        self, prompts: list[list[int]], requests: list[GenerationRequest]
    ) -> list[list[Completion]]:
        """One ``Engine.generate`` for prompts with settings of their own: each prompt repeated its
        request's n times, each copy with that request's sampling dict (SGLang takes a list)."""
        copies = [r for r in requests for _ in range(r.params.n)]
        outputs = self.engine.generate(
            input_ids=[p for p, r in zip(prompts, requests) for _ in range(r.params.n)],
            sampling_params=[sglang_sampling_params(r) for r in copies],
            return_logprob=[r.logprobs for r in copies],
        )
        flat = [group[0] for group in completions_from_sglang(outputs, 1, any(r.logprobs for r in copies))]
        starts = [sum(r.params.n for r in requests[:i]) for i in range(len(requests) + 1)]
        return [flat[starts[i] : starts[i + 1]] for i in range(len(requests))]

    def load_weights(self, bucket: list[NamedTensor]) -> None:
        # One cache flush after the last bucket (reset_cache), not one per bucket.
        self.engine.update_weights_from_tensor(named_tensors=bucket, flush_cache=False)

    def reset_cache(self) -> None:
        # The radix cache holds keys/values computed with the previous weights.
        self.engine.flush_cache()

    def sleep(self) -> None:
        self.engine.release_memory_occupation(tags=list(SLEEP_TAGS))
        self.released = set(SLEEP_TAGS)

    def wake_up(self, tags: tuple[str, ...] | None = None) -> None:
        """Resume the SGLang tags behind the rollout's ``tags`` (all released ones for None)."""
        wanted = SLEEP_TAGS if tags is None else tuple(t for tag in tags for t in _WAKE_TAGS[tag])
        resume = [tag for tag in SLEEP_TAGS if tag in wanted and tag in self.released]
        if resume:
            self.engine.resume_memory_occupation(tags=resume)
            self.released.difference_update(resume)


class SGLangRollout(ExternalRollout):
    """The rollout interface over SGLang (see the module docstring); ``backend`` replaces SGLang in tests."""

    backend_cls = SGLangBackend
