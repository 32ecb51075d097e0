"""Rollout through an inference engine colocated with the trainer: the part vLLM and SGLang share.

Each rank drives its own engine on its own GPU, next to the trainer. One training step uses
the engine as::

    engine.wake_up_weights()  # take back the weights' GPU memory only
    engine.sync_weights()     # actor weights -> engine, in buckets (see weight_sync.py);
                              # then the prefix cache is reset (it holds old-weight keys/values)
    # (the trainer parks the actor's parameters here, before the KV cache is allocated)
    engine.wake_up()          # the KV cache
    out = engine.generate_sequences(prompts)
    engine.sleep()            # give the memory to training (when rollout.free_cache_engine)

``ExternalRollout`` does everything that does not need the engine itself: unpadding prompts to
token-id lists, choosing sampling settings, stop tokens and seeds, turning completions into
verl's batch keys, and streaming weights. An ``EngineBackend`` (``vllm_engine.py``,
``sglang_engine.py``) talks to the engine. In those two modules, what does not need the engine's
package (engine and sampling arguments, reading its outputs) is plain functions, unit-tested on
CPU; the backend class is the thin part that calls the engine.

Image + text prompts (vision-language checkpoints): the prompt batch carries verl's
``multi_modal_data`` column (per row ``{"image": [encoded bytes]}``, ``data/multimodal.py``) beside
the expanded prompt ids (each image's ``<|image_pad|>`` repeated once per image token). Both engines
take the images raw and expand the placeholders themselves: vLLM's multimodal processor, given
``prompt_token_ids``, treats them as not yet expanded and replaces each ``<|image_pad|>`` with the
image's run; SGLang decodes ``input_ids`` to text and runs the HF processor, which does the same. So
each image's run is cut to ONE placeholder token (:func:`engine_prompt_ids`) and the decoded images
go with the prompt (:func:`engine_inputs`). The engine's answers are mapped back onto the batch's
own expanded prompt rows, whose [B, 3, Tp] rotary ids continue over the response
(``assemble_output``), so the actor sees exactly the ids the engine expanded.
"""

from __future__ import annotations

import abc
import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from verl_megatron.distributed.parallel import Runtime
from verl_megatron.protocol import DataProto
from verl_megatron.rollout.base import (
    RolloutEngine,
    assemble_output,
    pad_token_id,
    prompt_tensors,
    responses_from_lists,
    stop_token_ids,
)
from verl_megatron.rollout.config import RolloutConfig, RolloutConfigError
from verl_megatron.rollout.sampling import (
    SamplingParams,
    call_seed,
    prompt_indices,
    prompt_seed,
    resolve_sampling,
)
from verl_megatron.rollout.weight_sync import NamedTensor, SyncStats, stream_weights

__all__ = [
    "Completion",
    "EngineBackend",
    "ExternalRollout",
    "GenerationRequest",
    "engine_dtype",
    "engine_inputs",
    "engine_prompt_ids",
    "engine_sampling",
    "model_path_of",
]

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def engine_dtype(config: RolloutConfig) -> torch.dtype:
    """The torch dtype of ``rollout.dtype``."""
    if config.dtype not in _DTYPES:
        raise RolloutConfigError(f"rollout.dtype must be one of {list(_DTYPES)}, got {config.dtype!r}")
    return _DTYPES[config.dtype]


def model_path_of(hf_config: Any) -> str:
    """The checkpoint folder an engine reads its config / tokenizer from (``hf_config._name_or_path``)."""
    path = getattr(hf_config, "_name_or_path", None) or getattr(hf_config, "name_or_path", None)
    if not path:
        raise RolloutConfigError(
            "vllm/sglang rollout needs the model folder: load hf_config with AutoConfig.from_pretrained(path)"
        )
    return str(path)


def engine_sampling(request: GenerationRequest) -> dict[str, Any]:
    """The sampling fields vLLM and SGLang name alike (in both, temperature 0 is greedy and top_k
    -1 is off); each engine adds its own names for the length, log-probs and seed."""
    params = request.params
    return {
        "temperature": 0.0 if params.greedy else params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else -1,
        "stop_token_ids": list(request.stop_token_ids),
        "ignore_eos": request.ignore_eos,
    }


def engine_prompt_ids(ids: list[int], image_token_id: int, num_images: int, where: str) -> list[int]:
    """``ids`` with each run of ``image_token_id`` (one image's tokens) cut to one token, the form
    vLLM and SGLang expand themselves (module docstring); ValueError when the runs are not one per image."""
    out = [t for i, t in enumerate(ids) if t != image_token_id or i == 0 or ids[i - 1] != image_token_id]
    runs = out.count(image_token_id)
    if runs != num_images:
        raise ValueError(f"{where}: {runs} runs of image token {image_token_id} for {num_images} images")
    return out


def engine_inputs(
    prompts: DataProto, token_lists: list[list[int]], hf_config: Any
) -> tuple[list[list[int]], list[list[Any] | None] | None]:
    """(prompt ids, per-prompt decoded images) as the engines take them; (token_lists, None) for a
    batch without images. The images come from verl's ``multi_modal_data`` column (``{"image": [...]}``
    of encoded bytes, paths or PIL images); a batch with ``multi_modal_inputs`` but no such column
    cannot be generated from (ValueError: the engine would see the placeholders without the images)."""
    column = prompts.non_tensor_batch.get("multi_modal_data")
    if column is None or all(not entry for entry in column):
        if any(entry for entry in prompts.non_tensor_batch.get("multi_modal_inputs", ())):
            raise ValueError(
                "prompts carry multi_modal_inputs but no multi_modal_data column ({'image': [...]} per "
                "row): vllm/sglang take the raw images (data/dataset.collate_prompts writes both)"
            )
        return token_lists, None
    from verl_megatron.data.multimodal import load_image

    image_token_id = getattr(hf_config, "image_token_id", None)
    if image_token_id is None:
        raise ValueError("prompts with images need hf_config.image_token_id (a vision-language checkpoint)")
    ids, images = [], []
    for row, (tokens, entry) in enumerate(zip(token_lists, column)):
        raw = list((entry or {}).get("image") or [])
        where = f"prompt {row}"
        images.append([load_image(image, f"{where}: image {i}") for i, image in enumerate(raw)] or None)
        ids.append(engine_prompt_ids(tokens, int(image_token_id), len(raw), where) if raw else tokens)
    return ids, images


@dataclass(frozen=True)
class GenerationRequest:
    """Everything an engine needs to generate for a batch of prompts.

    Attributes:
        params: temperature / top-k / top-p / greedy / n.
        max_tokens: most new tokens per response.
        stop_token_ids: tokens that end a response (kept in it).
        ignore_eos: generate to ``max_tokens`` whatever is produced.
        seed: the call's sampling seed.
        logprobs: also return the sampled tokens' log-probs.
        prompt_seeds: one seed per prompt, from its row in the global batch (layout-invariant).
        prompt_images: with image rows, per prompt its decoded images (None for a text prompt);
            its ids then hold one placeholder per image (:func:`engine_prompt_ids`). Empty otherwise.
    """

    params: SamplingParams
    max_tokens: int
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    seed: int
    logprobs: bool
    prompt_seeds: tuple[int, ...] = ()
    prompt_images: tuple[list[Any] | None, ...] = ()


@dataclass
class Completion:
    """One generated response: its token ids (stop token included) and their log-probs."""

    token_ids: list[int]
    log_probs: list[float] | None = None


class EngineBackend(abc.ABC):
    """The engine-specific half of :class:`ExternalRollout`."""

    @abc.abstractmethod
    def generate(self, prompts: list[list[int]], request: GenerationRequest) -> list[list[Completion]]:
        """For each prompt (token ids, no padding), its ``request.params.n`` completions (with
        ``request.prompt_images``, the images whose placeholders the ids hold once each)."""

    @abc.abstractmethod
    def load_weights(self, bucket: list[NamedTensor]) -> None:
        """Load a bucket of (Hugging Face name, full tensor) into the engine's model."""

    @abc.abstractmethod
    def reset_cache(self) -> None:
        """Forget cached prompt prefixes (their keys/values were computed with the old weights)."""

    @abc.abstractmethod
    def sleep(self) -> None:
        """Release the engine's GPU memory (KV cache; weights offloaded or dropped)."""

    @abc.abstractmethod
    def wake_up(self, tags: tuple[str, ...] | None = None) -> None:
        """Re-allocate what :meth:`sleep` released: ``("weights",)`` or ``("kv_cache",)`` alone, or all."""

    def generate_each(
        self, prompts: list[list[int]], requests: list[GenerationRequest]
    ) -> list[list[Completion]]:
        """Prompt i with ``requests[i]``'s own settings (n, length, sampling, seed): the agent
        endpoint's requests. vLLM and SGLang take per-prompt settings in one engine call; this
        default makes one :meth:`generate` call per prompt."""
        return [self.generate([prompt], request)[0] for prompt, request in zip(prompts, requests)]

    def set_lora_adapter(self, folder: Any) -> None:
        """Generate with the PEFT adapter at ``folder.path`` from now on (``rollout.lora_sync=adapter``)."""
        raise NotImplementedError(
            f"{type(self).__name__} takes merged LoRA weights only (rollout.lora_sync=merged)"
        )


class ExternalRollout(RolloutEngine):
    """A colocated engine behind the rollout interface (see the module docstring).

    Args:
        config, runtime, actor_chunks, tokenizer, hf_config: as for every engine
            (``verl_megatron.rollout.build_rollout``).
        backend: the engine adapter; None builds ``backend_cls(config, hf_config, runtime)``
            (tests pass a fake one).
    """

    # The adapter an engine subclass talks to (VLLMBackend, SGLangBackend).
    backend_cls: ClassVar[type[EngineBackend] | None] = None

    def __init__(
        self,
        config: RolloutConfig,
        runtime: Runtime,
        actor_chunks: list[torch.nn.Module],
        tokenizer: Any,
        hf_config: Any,
        backend: EngineBackend | None = None,
    ) -> None:
        if backend is None:
            if self.backend_cls is None:
                raise TypeError(f"{type(self).__name__}: no backend given and no backend_cls to build one")
            backend = self.backend_cls(config, hf_config, runtime)
        self.config = config
        self.runtime = runtime
        self.chunks = actor_chunks
        self.tokenizer = tokenizer
        self.hf_config = hf_config
        self.backend = backend
        self.seed = config.seed if config.seed is not None else runtime.seed
        self.awake = self.weights_awake = True
        self.last_sync: SyncStats | None = None
        self._calls = 0
        self._lora = None  # rollout.lora_sync=adapter: rollout/lora_sync.py's AdapterSync

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Responses for left-padded prompts [B, Tp] -> [B*n, ...] (keys: ``verl_megatron.rollout.base``)."""
        if not self.awake:
            raise RuntimeError(
                "generate_sequences: the engine is asleep; call wake_up() (and sync_weights()) first"
            )
        input_ids, mask, _ = prompt_tensors(prompts)
        meta = prompts.meta_info
        request = GenerationRequest(
            params=resolve_sampling(self.config, meta),
            max_tokens=int(meta.get("response_length", self.config.response_length)),
            stop_token_ids=tuple(stop_token_ids(self.config, meta, self.tokenizer, self.hf_config)),
            ignore_eos=self.config.ignore_eos,
            # The same on every rank of an engine's tp group (ranks r*t .. r*t+t-1, rollout/layout.py).
            seed=call_seed(
                self.seed,
                getattr(self.runtime, "rank", 0) // self.config.tensor_model_parallel_size,
                self._calls,
            ),
            logprobs=self.config.calculate_log_probs,
            # The trainer passes where this share starts in the global batch (rollout/layout.py).
            prompt_seeds=tuple(
                prompt_seed(self.seed, self._calls, i) for i in prompt_indices(meta, input_ids.shape[0])
            ),
        )
        self._calls += 1
        token_lists = [row[keep].tolist() for row, keep in zip(input_ids.cpu(), mask.cpu().bool())]
        token_lists, images = engine_inputs(prompts, token_lists, self.hf_config)
        if images is not None:
            request = dataclasses.replace(request, prompt_images=tuple(images))
        completions = self.backend.generate(token_lists, request)
        flat = _flatten(completions, len(token_lists), request.params.n)
        log_probs = None
        if request.logprobs:
            if any(c.log_probs is None or len(c.log_probs) != len(c.token_ids) for c in flat):
                raise RuntimeError("engine returned completions without one log-prob per token")
            log_probs = [c.log_probs for c in flat]
        responses, response_mask, rollout_log_probs = responses_from_lists(
            [c.token_ids for c in flat], log_probs, request.max_tokens, pad_token_id(meta, self.tokenizer)
        )
        return assemble_output(prompts, responses, response_mask, rollout_log_probs, request.params.n)

    def generate_requests(
        self, prompts: list[list[int]], params: list[SamplingParams], max_tokens: list[int]
    ) -> list[list[Completion]]:
        """Token-id prompts, each with its own sampling settings and length (the agent endpoint's
        requests, ``rollout/endpoint.py``), in one backend call (:meth:`EngineBackend.generate_each`):
        per prompt its ``params[i].n`` completions, the engine's ids and their log-probs (always
        asked for: the trainer trains on exactly these ids). Stop tokens are the rollout's (EOS,
        ``rollout.stop_token_ids``); stop strings are the endpoint's to apply on the ids (the
        engine runs without a tokenizer). Each prompt's seed is its place in this replica's call."""
        if not self.awake:
            raise RuntimeError("generate_requests: the engine is asleep; call wake_up() first")
        stops = tuple(stop_token_ids(self.config, {}, self.tokenizer, self.hf_config))
        replica = getattr(self.runtime, "rank", 0) // self.config.tensor_model_parallel_size
        base = call_seed(self.seed, replica, self._calls)
        self._calls += 1
        requests = [
            GenerationRequest(p, m, stops, self.config.ignore_eos, prompt_seed(base, 0, i), logprobs=True)
            for i, (p, m) in enumerate(zip(params, max_tokens))
        ]
        completions = self.backend.generate_each(prompts, requests)
        if len(completions) != len(prompts):
            raise RuntimeError(f"engine answered {len(completions)} of {len(prompts)} requests")
        for i, (per_prompt, request) in enumerate(zip(completions, requests)):
            if len(per_prompt) != request.params.n or any(
                c.log_probs is None or len(c.log_probs) != len(c.token_ids) for c in per_prompt
            ):
                raise RuntimeError(
                    f"engine answered request {i} without {request.params.n} completions with log-probs"
                )
        return completions

    def bind_actor(self, actor_chunks: list[torch.nn.Module]) -> None:
        """The actor chunks to sync weights from (an engine built before the actor gets them here)."""
        self.chunks = actor_chunks

    def sync_weights(self) -> None:
        """Stream the actor's weights (gathered over tp/pp; collective) into the engine."""
        if not self.weights_awake:
            raise RuntimeError("sync_weights: the engine's weights are asleep; call wake_up_weights() first")
        from verl_megatron.models.convert import iter_hf_weights
        from verl_megatron.models.megatron_model import gather_updated_params

        # Distributed optimizer with overlap_param_gather: the last update is not all-gathered yet.
        gather_updated_params(self.chunks)
        from verl_megatron.rollout.lora_sync import AdapterSync

        # With LoRA: merged weights every sync, or (lora_sync=adapter) the frozen base once + adapters.
        self._lora = self._lora or AdapterSync.for_engine(self.config, self.chunks)
        if self._lora is None or not self._lora.base_loaded:
            self.last_sync = stream_weights(
                # merge_lora=False only for the adapter sync's one-time base (merged is the default).
                iter_hf_weights(
                    self.chunks,
                    self.runtime,
                    self.hf_config,
                    **({} if self._lora is None else {"merge_lora": False}),
                ),
                self.backend.load_weights,
                bucket_megabytes=self.config.update_weights_bucket_megabytes,
                name_map=self.config.layer_name_map,
                dtype=engine_dtype(self.config),
            )
        if self._lora is not None:
            self._lora.load_adapters(self.backend, self.chunks, self.runtime, model_path_of(self.hf_config))
        self.backend.reset_cache()

    def sleep(self) -> None:
        if self.config.free_cache_engine and self.awake:
            self.backend.sleep()
            self.awake = self.weights_awake = False

    def wake_up_weights(self) -> None:
        if not self.weights_awake:
            self.backend.wake_up(("weights",))
            self.weights_awake = True

    def wake_up(self) -> None:
        if not self.awake:
            self.backend.wake_up(("kv_cache",) if self.weights_awake else None)
            self.awake = self.weights_awake = True


def _flatten(completions: list[list[Completion]], num_prompts: int, n: int) -> list[Completion]:
    """Prompt-major list of completions (a prompt's n samples adjacent), checked for shape."""
    if len(completions) != num_prompts:
        raise RuntimeError(
            f"engine returned completions for {len(completions)} prompts, expected {num_prompts}"
        )
    for i, per_prompt in enumerate(completions):
        if len(per_prompt) != n:
            raise RuntimeError(
                f"engine returned {len(per_prompt)} completions for prompt {i}, expected n={n}"
            )
    return [c for per_prompt in completions for c in per_prompt]
