"""The vLLM / SGLang adapters against fakes of the engines' Python APIs.

vLLM and SGLang need a GPU; the fakes stand in for them and check the calls each real API
requires (names and arguments checked against vLLM's ``vllm/entrypoints/llm.py`` and
SGLang's ``python/sglang/srt/entrypoints/engine.py``):

- vLLM's external launcher runs the engine core in the calling process: vLLM asserts
  ``VLLM_ENABLE_V1_MULTIPROCESSING`` is off when ``distributed_executor_backend ==
  "external_launcher"``;
- ``LLM.wake_up(tags)`` takes ``"weights"`` / ``"kv_cache"``; ``LLM.reset_prefix_cache()``;
- SGLang's ``Engine.update_weights_from_tensor(named_tensors, load_format=None, flush_cache=True)``,
  ``Engine.flush_cache()``, ``Engine.release_memory_occupation(tags=None)`` and
  ``Engine.resume_memory_occupation(tags=None)``: the scheduler
  (``python/sglang/srt/managers/scheduler_update_weights_mixin.py``) reads ``tags=None`` as every
  memory type (``GPU_MEMORY_ALL_TYPES`` in ``python/sglang/srt/constants.py``), adds released tags
  to a set and removes resumed ones from it (``set.remove``: resuming a tag not released raises).
"""

from __future__ import annotations

import os
import sys
import types
from types import SimpleNamespace

import pytest
import torch

from verl_megatron.rollout import RolloutConfig, RolloutConfigError
from verl_megatron.rollout.sglang_engine import SGLangBackend, SGLangRollout
from verl_megatron.rollout.vllm_engine import VLLMBackend, VLLMRollout, disable_engine_multiprocessing

_TAGS = {"weights", "kv_cache"}
# SGLang's GPU_MEMORY_ALL_TYPES: what release/resume_memory_occupation(tags=None) act on.
_SGLANG_ALL_TYPES = ["kv_cache", "weights", "weights_drafter", "cuda_graph"]


class FakeLLM:
    """``vllm.LLM`` with the checks the real one makes; ``log`` records the calls in order."""

    def __init__(self, model: str, **kwargs) -> None:
        if kwargs.get("distributed_executor_backend") == "external_launcher":
            # vLLM: the external launcher cannot hand its engine core to a child process.
            assert os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0", "V1 multiprocessing is on"
        self.kwargs = kwargs
        self.log: list[tuple] = []
        self.model = SimpleNamespace(load_weights=lambda weights: self.log.append(("load", len(weights))))

    def apply_model(self, func):
        return func(self.model)

    def reset_prefix_cache(self, device=None) -> bool:
        self.log.append(("reset_prefix_cache",))
        return True

    def sleep(self, level: int = 1) -> None:
        self.log.append(("sleep", level))

    def wake_up(self, tags: list[str] | None = None) -> None:
        assert tags is None or (isinstance(tags, list) and set(tags) <= _TAGS), tags
        self.log.append(("wake_up", tags))


class FakeEngine:
    """``sglang.Engine`` (offline) recording the calls, with the scheduler's memory-tag bookkeeping."""

    def __init__(self, **kwargs) -> None:
        self.kwargs = kwargs
        self.log: list[tuple] = []
        self.offloaded: set[str] = set()  # the scheduler's offload_tags

    def generate(self, input_ids, sampling_params=None, return_logprob=False):
        # Decoding replays the CUDA graphs over the weights and the KV cache: all must be mapped.
        assert not self.offloaded & {"weights", "kv_cache", "cuda_graph"}, sorted(self.offloaded)
        self.log.append(("generate", len(input_ids)))
        return [
            {"output_ids": [1], "meta_info": {"output_token_logprobs": [(-0.5, 1, None)]}} for _ in input_ids
        ]

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        self.log.append(("update_weights_from_tensor", len(named_tensors), flush_cache))

    def flush_cache(self):
        self.log.append(("flush_cache",))

    def release_memory_occupation(self, tags=None):
        assert tags is None or (isinstance(tags, list) and set(tags) <= set(_SGLANG_ALL_TYPES)), tags
        self.offloaded.update(tags or _SGLANG_ALL_TYPES)
        self.log.append(("release_memory_occupation", tags))

    def resume_memory_occupation(self, tags=None):
        assert tags is None or (isinstance(tags, list) and set(tags) <= set(_SGLANG_ALL_TYPES)), tags
        for tag in tags or _SGLANG_ALL_TYPES:
            self.offloaded.remove(tag)  # KeyError, as in SGLang, for a tag that was not released
        self.log.append(("resume_memory_occupation", tags))


@pytest.fixture
def fake_engines(monkeypatch):
    vllm = types.ModuleType("vllm")
    vllm.LLM = FakeLLM
    sglang = types.ModuleType("sglang")
    sglang.Engine = FakeEngine
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "sglang", sglang)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)

    def weights(chunks, runtime, hf_config):
        yield from [("a.weight", torch.ones(4)), ("b.weight", torch.ones(4))]

    import verl_megatron.models.convert as convert

    monkeypatch.setattr(convert, "iter_hf_weights", weights)


RUNTIME = SimpleNamespace(world_size=2, seed=1, dp_rank=0, local_rank=0, rank=0)
HF = SimpleNamespace(_name_or_path="/models/tiny")


def test_vllm_engine_is_built_with_multiprocessing_off(fake_engines):
    backend = VLLMBackend(RolloutConfig(name="vllm", tensor_model_parallel_size=2), HF, RUNTIME)
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert backend.llm.kwargs["distributed_executor_backend"] == "external_launcher"


def test_explicit_vllm_multiprocessing_is_a_clear_error():
    with pytest.raises(RolloutConfigError, match=r"VLLM_ENABLE_V1_MULTIPROCESSING='1'.*set it to 0"):
        disable_engine_multiprocessing({"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    disable_engine_multiprocessing(env)
    assert env == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def _cycle(rollout) -> None:
    """One training step's engine calls, as the trainer makes them."""
    rollout.sleep()
    rollout.wake_up_weights()
    rollout.sync_weights()
    rollout.wake_up()


def test_vllm_weight_sync_resets_the_prefix_cache_and_wakes_weights_first(fake_engines):
    config = RolloutConfig(name="vllm", tensor_model_parallel_size=2, update_weights_bucket_megabytes=1)
    rollout = VLLMRollout(config, RUNTIME, [], None, HF)
    _cycle(rollout)
    assert rollout.backend.llm.log == [
        ("sleep", 1),
        ("wake_up", ["weights"]),
        ("load", 2),
        ("reset_prefix_cache",),
        ("wake_up", ["kv_cache"]),
    ]
    # Without a weights-only wake-up the engine is woken whole.
    rollout.sleep()
    rollout.wake_up()
    assert rollout.backend.llm.log[-1] == ("wake_up", None)
    rollout.sleep()
    with pytest.raises(RuntimeError, match="wake_up_weights"):
        rollout.sync_weights()


def test_sglang_weight_sync_flushes_the_cache_once(fake_engines):
    config = RolloutConfig(name="sglang", tensor_model_parallel_size=1, update_weights_bucket_megabytes=1)
    rollout = SGLangRollout(config, RUNTIME, [], None, HF)
    assert isinstance(rollout.backend, SGLangBackend)
    _cycle(rollout)
    assert rollout.backend.engine.log == [
        ("release_memory_occupation", ["weights", "kv_cache", "cuda_graph"]),
        ("resume_memory_occupation", ["weights"]),
        ("update_weights_from_tensor", 2, False),
        ("flush_cache",),
        ("resume_memory_occupation", ["kv_cache", "cuda_graph"]),
    ]


def _sglang_generate(rollout) -> None:
    from tests.test_rollout_engines import _request

    rollout.backend.generate([[5], [6]], _request())


def test_sglang_wake_up_resumes_every_tag_sleep_released(fake_engines):
    """Tag symmetry: after each sleep/wake-up sequence nothing stays offloaded and decoding runs."""
    config = RolloutConfig(name="sglang", tensor_model_parallel_size=1, update_weights_bucket_megabytes=1)
    rollout = SGLangRollout(config, RUNTIME, [], None, HF)
    engine = rollout.backend.engine
    rollout.sleep()  # the build-time sleep (build_colocated), then one training step's calls
    assert engine.offloaded == {"weights", "kv_cache", "cuda_graph"}
    rollout.wake_up_weights()
    assert engine.offloaded == {"kv_cache", "cuda_graph"}
    rollout.sync_weights()
    rollout.wake_up()
    assert engine.offloaded == set()
    _sglang_generate(rollout)
    # A wake-up without the weights-only one (no weight sync this step) resumes the same tags.
    rollout.sleep()
    rollout.wake_up()
    assert engine.offloaded == set() and engine.log[-1] == (
        "resume_memory_occupation", ["weights", "kv_cache", "cuda_graph"],
    )  # fmt: skip
    _sglang_generate(rollout)
    # And never a tag twice: a second wake-up of an awake engine calls nothing.
    calls = len(engine.log)
    rollout.backend.wake_up(None)
    rollout.backend.wake_up(("kv_cache",))
    assert len(engine.log) == calls


@pytest.mark.parametrize("engine", ["vllm", "sglang", "native"])
def test_external_engine_is_built_and_asleep_before_any_training_state(engine):
    from verl_megatron.trainer.components import build_colocated

    log: list[str] = []

    class Engine:
        def __init__(self, chunks):
            log.append(f"build_engine:{chunks}")

        def sleep(self):
            log.append("engine_sleep")

        def bind_actor(self, chunks):
            log.append(f"bind:{chunks}")

    def build_training():
        log.append("build_training")
        return SimpleNamespace(chunks="actor"), None, None

    (actor, _, _), rollout = build_colocated(engine, build_training, Engine)
    assert isinstance(rollout, Engine) and actor.chunks == "actor"
    if engine == "native":
        assert log == ["build_training", "build_engine:actor"]
    else:
        assert log == ["build_engine:[]", "engine_sleep", "build_training", "bind:actor"]


def test_prompt_seeds_follow_the_global_row_not_the_layout(fake_engines):
    from tests.test_rollout_engines import ScriptedBackend, _prompts

    def seeds(offset: int, rows: slice) -> tuple[int, ...]:
        backend = ScriptedBackend()
        tokenizer = SimpleNamespace(pad_token_id=0, eos_token_id=1)
        config = RolloutConfig(n=2, seed=4, tensor_model_parallel_size=1)
        engine = VLLMRollout(config, RUNTIME, [], tokenizer, HF, backend=backend)
        prompts = _prompts()[rows]
        prompts.meta_info["prompt_offset"] = offset
        engine.generate_sequences(prompts)
        return backend.calls[0][2].prompt_seeds

    whole = seeds(0, slice(0, 2))
    assert seeds(0, slice(0, 1)) + seeds(1, slice(1, 2)) == whole  # two replicas, one prompt each
    assert len(set(whole)) == 2


def test_vllm_gets_one_sampling_params_per_prompt_with_its_seed(fake_engines):
    captured = {}

    class SamplingParams:
        def __init__(self, **kwargs):
            self.seed = kwargs["seed"]

    def generate(prompts, sampling_params=None, use_tqdm=True):
        captured["seeds"] = [p.seed for p in sampling_params]
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[1], logprobs=None)]) for _ in prompts]

    sys.modules["vllm"].SamplingParams = SamplingParams
    sys.modules["vllm.inputs"] = types.SimpleNamespace(TokensPrompt=lambda prompt_token_ids: prompt_token_ids)
    try:
        backend = VLLMBackend(RolloutConfig(name="vllm", tensor_model_parallel_size=2), HF, RUNTIME)
        backend.llm.generate = generate
        from tests.test_rollout_engines import _request

        request = _request()
        request = type(request)(**{**request.__dict__, "prompt_seeds": (11, 12), "logprobs": False})
        backend.generate([[5], [6]], request)
    finally:
        del sys.modules["vllm.inputs"]
    assert captured["seeds"] == [11, 12]
