"""vLLM / SGLang engines without the engines: factory errors, argument mapping, output parsing,
the shared ExternalRollout contract (with a scripted backend) and weight streaming in buckets.

The weight-sync test runs the real converter on a tiny model under tp=1, tp=2 and pp=2 and checks
that the engine receives exactly the Hugging Face checkpoint, bucket by bucket.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from verl_megatron.protocol import DataProto
from verl_megatron.rollout import RolloutConfig, RolloutEngineUnavailable, build_rollout
from verl_megatron.rollout.external import Completion, EngineBackend, GenerationRequest
from verl_megatron.rollout.sampling import SamplingParams
from verl_megatron.rollout.sglang_engine import (
    SGLangRollout,
    completions_from_sglang,
    sglang_engine_kwargs,
    sglang_sampling_params,
)
from verl_megatron.rollout.vllm_engine import (
    VLLMRollout,
    completions_from_vllm,
    vllm_engine_kwargs,
    vllm_sampling_kwargs,
)
from verl_megatron.rollout.weight_sync import iter_buckets, map_weights, megabytes, rename, stream_weights

PAD, EOS = 0, 1


@pytest.mark.parametrize(("name", "extra"), [("vllm", "gpu"), ("sglang", "sglang")])
def test_missing_engine_package_names_package_and_extra(monkeypatch, name, extra):
    monkeypatch.setitem(sys.modules, name, None)  # makes `import <name>` raise ImportError
    with pytest.raises(RolloutEngineUnavailable) as err:
        build_rollout(RolloutConfig(name=name, tensor_model_parallel_size=1), None, [], None, None)
    message = str(err.value)
    assert f"'{name}' package" in message and f"pip install 'verl-megatron[{extra}]'" in message
    assert "rollout.name='native'" in message


def _request(**params) -> GenerationRequest:
    return GenerationRequest(
        params=SamplingParams(**params),
        max_tokens=7,
        stop_token_ids=(1, 5),
        ignore_eos=False,
        seed=3,
        logprobs=True,
    )


def test_sampling_arguments_for_each_engine():
    sampled = _request(temperature=0.7, top_k=0, top_p=0.9, n=4)
    assert vllm_sampling_kwargs(sampled) == {
        "n": 4, "temperature": 0.7, "top_p": 0.9, "top_k": -1, "max_tokens": 7, "stop_token_ids": [1, 5],
        "ignore_eos": False, "logprobs": 0, "seed": 3, "detokenize": False,
    }  # fmt: skip
    greedy = _request(greedy=True, top_k=5)
    assert vllm_sampling_kwargs(greedy)["temperature"] == 0.0 and vllm_sampling_kwargs(greedy)["top_k"] == 5
    assert sglang_sampling_params(sampled) == {
        "temperature": 0.7, "top_p": 0.9, "top_k": -1, "max_new_tokens": 7, "stop_token_ids": [1, 5],
        "ignore_eos": False,
    }  # fmt: skip
    assert sglang_sampling_params(greedy)["temperature"] == 0.0


def test_engine_arguments_and_their_errors():
    runtime = SimpleNamespace(world_size=4, seed=9, dp_rank=1, local_rank=2)
    hf_config = SimpleNamespace(_name_or_path="/models/tiny")
    config = RolloutConfig(
        name="vllm", prompt_length=16, response_length=8, engine_kwargs={"max_num_seqs": 3}
    )
    kwargs = vllm_engine_kwargs(config, hf_config, runtime)
    assert kwargs["model"] == "/models/tiny" and kwargs["tensor_parallel_size"] == 2
    assert kwargs["max_model_len"] == 24 and kwargs["max_num_seqs"] == 3  # engine_kwargs win
    assert kwargs["distributed_executor_backend"] == "external_launcher" and kwargs["enable_sleep_mode"]
    with pytest.raises(ValueError, match="does not divide the world size 4"):
        vllm_engine_kwargs(RolloutConfig(tensor_model_parallel_size=3), hf_config, runtime)
    with pytest.raises(ValueError, match="needs the model folder"):
        vllm_engine_kwargs(config, SimpleNamespace(), runtime)
    with pytest.raises(ValueError, match="tensor_model_parallel_size=1"):
        sglang_engine_kwargs(RolloutConfig(name="sglang"), hf_config, runtime)
    sg = sglang_engine_kwargs(
        RolloutConfig(name="sglang", tensor_model_parallel_size=1, seed=5), hf_config, runtime
    )
    assert sg["base_gpu_id"] == 2 and sg["random_seed"] == 6 and sg["context_length"] == 1024


def test_engine_outputs_become_completions():
    def step(token, logprob):
        return {token: SimpleNamespace(logprob=logprob), token + 1: SimpleNamespace(logprob=-9.0)}

    vllm_outputs = [
        SimpleNamespace(
            outputs=[SimpleNamespace(token_ids=(4, 1), logprobs=[step(4, -0.5), step(1, -0.25)])]
        ),
        SimpleNamespace(outputs=[SimpleNamespace(token_ids=[7], logprobs=[step(7, -1.5)])]),
    ]
    parsed = completions_from_vllm(vllm_outputs, logprobs=True)
    assert parsed == [[Completion([4, 1], [-0.5, -0.25])], [Completion([7], [-1.5])]]
    assert completions_from_vllm(vllm_outputs, logprobs=False)[0][0].log_probs is None

    sglang_outputs = [
        {"output_ids": [3, 1], "meta_info": {"output_token_logprobs": [(-0.1, 3, None), (-0.2, 1, None)]}},
        {"output_ids": [4], "meta_info": {"output_token_logprobs": [(-0.3, 4, None)]}},
        {"output_ids": [5], "meta_info": {"output_token_logprobs": [(-0.4, 5, None)]}},
        {"output_ids": [6, 6], "meta_info": {"output_token_logprobs": [(-0.5, 6, None), (-0.6, 6, None)]}},
    ]
    grouped = completions_from_sglang(sglang_outputs, n=2, logprobs=True)
    assert [[c.token_ids for c in g] for g in grouped] == [[[3, 1], [4]], [[5], [6, 6]]]
    assert grouped[1][1].log_probs == [-0.5, -0.6]
    with pytest.raises(RuntimeError, match="not a multiple of n=3"):
        completions_from_sglang(sglang_outputs, n=3, logprobs=False)


class ScriptedBackend(EngineBackend):
    """Answers prompt i's sample j with [10*i + j + 2] * (i + j + 1) followed by EOS; records calls."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.loaded: dict[str, torch.Tensor] = {}
        self.bucket_bytes: list[int] = []

    def generate(self, prompts, request):
        self.calls.append(("generate", prompts, request))
        return [
            [
                Completion(
                    [10 * i + j + 2] * (i + j + 1) + [EOS],
                    [-0.1 * (k + 1) for k in range(i + j + 2)] if request.logprobs else None,
                )
                for j in range(request.params.n)
            ]
            for i in range(len(prompts))
        ]

    def load_weights(self, bucket):
        self.calls.append(("load", len(bucket)))
        self.bucket_bytes.append(sum(t.numel() * t.element_size() for _, t in bucket))
        for name, tensor in bucket:
            self.loaded[name] = tensor.clone()

    def reset_cache(self):
        self.calls.append(("reset_cache",))

    def sleep(self):
        self.calls.append(("sleep",))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up",))


def _prompts() -> DataProto:
    ids = torch.tensor([[PAD, PAD, 5, 6], [7, 8, 9, 3]])
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    return DataProto.from_dict(
        {"input_ids": ids, "attention_mask": mask},
        non_tensors={"uid": np.array(["a", "b"], dtype=object)},
        meta_info={"eos_token_id": EOS},
    )


@pytest.mark.parametrize("engine_cls", [VLLMRollout, SGLangRollout])
def test_external_rollout_contract_with_scripted_engine(engine_cls):
    backend = ScriptedBackend()
    config = RolloutConfig(
        n=2, response_length=3, calculate_log_probs=True, seed=4, tensor_model_parallel_size=1
    )
    tokenizer = SimpleNamespace(pad_token_id=PAD, eos_token_id=EOS)
    engine = engine_cls(config, SimpleNamespace(seed=0, dp_rank=0), [], tokenizer, None, backend=backend)
    out = engine.generate_sequences(_prompts())

    _, prompts, request = backend.calls[0]
    assert prompts == [[5, 6], [7, 8, 9, 3]]  # padding removed
    assert request.params.n == 2 and request.max_tokens == 3 and request.stop_token_ids == (EOS,)
    # Prompt 0: [2, 1], [3, 3, 1]; prompt 1: [12, 12, 1], [13, 13, 13, 1] (cut to 3 tokens).
    assert out.batch["responses"].tolist() == [[2, EOS, PAD], [3, 3, EOS], [12, 12, EOS], [13, 13, 13]]
    assert out.batch["response_mask"].tolist() == [[1, 1, 0], [1, 1, 1], [1, 1, 1], [1, 1, 1]]
    torch.testing.assert_close(
        out.batch["rollout_log_probs"],
        torch.tensor([[-0.1, -0.2, 0], [-0.1, -0.2, -0.3], [-0.1, -0.2, -0.3], [-0.1, -0.2, -0.3]]),
    )
    assert list(out.non_tensor_batch["uid"]) == ["a", "a", "b", "b"]
    assert out.batch["position_ids"][0].tolist() == [0, 0, 0, 1, 2, 3, 4]
    assert out.batch["attention_mask"][1].tolist() == [0, 0, 1, 1, 1, 1, 1]
    assert out.batch["input_ids"][3].tolist() == [7, 8, 9, 3, 13, 13, 13]

    engine.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate_sequences(_prompts())
    engine.wake_up()
    engine.wake_up()  # already awake: no second call into the engine
    validation = _prompts()
    validation.meta_info["validate"] = True
    greedy = engine.generate_sequences(validation)
    assert greedy.batch["responses"].shape == (2, 3)  # val_kwargs: n=1
    assert backend.calls[-1][2].params.greedy
    assert [c[0] for c in backend.calls] == ["generate", "sleep", "wake_up", "generate"]
    assert backend.calls[0][2].seed != backend.calls[3][2].seed  # each call draws anew


def test_bucketing_and_name_mapping_hand_checked():
    def t(nbytes):
        return torch.zeros(nbytes // 4, dtype=torch.float32)

    weights = [("a", t(100)), ("b", t(200)), ("c", t(400)), ("d", t(40)), ("e", t(60)), ("f", t(300))]
    sizes = [[n for n, _ in bucket] for bucket in iter_buckets(weights, max_bytes=300)]
    # c (400 B) is bigger than a bucket: it travels alone.
    assert sizes == [["a", "b"], ["c"], ["d", "e"], ["f"]]
    with pytest.raises(ValueError, match="'a' appears twice"):
        list(iter_buckets([("a", t(4)), ("a", t(4))], max_bytes=300))
    assert (
        rename("model.layers.0.mlp.up_proj.weight", {"model.": "m.", "model.layers.": "L."})
        == "L.0.mlp.up_proj.weight"
    )
    assert rename("lm_head.weight", {"model.": "m."}) == "lm_head.weight"
    mapped = list(map_weights([("model.x", torch.ones(2))], {"model.": "m."}, torch.bfloat16))
    assert mapped[0][0] == "m.x" and mapped[0][1].dtype == torch.bfloat16
    loaded = []
    stats = stream_weights(iter(weights), loaded.append, bucket_megabytes=300 / 2**20)
    assert (stats.tensors, stats.bytes, stats.buckets, stats.largest_bucket_bytes) == (6, 1100, 4, 400)
    assert megabytes(512) == 512 * 2**20


def sync_job(model_dir: str, tp: int, pp: int, bucket_mb: float) -> dict:
    """engine.sync_weights() (one 1 MB bucket holds this model), then the same stream in small buckets."""
    from tests.test_rollout_native import _setup
    from verl_megatron.models.convert import iter_hf_weights

    runtime, chunks, hf_config = _setup(model_dir, tp=tp, pp=pp)
    backend = ScriptedBackend()
    config = RolloutConfig(name="vllm", dtype="float32", update_weights_bucket_megabytes=1)
    engine = VLLMRollout(config, runtime, chunks, None, hf_config, backend=backend)
    engine.sync_weights()
    small = ScriptedBackend()
    stats = stream_weights(
        iter_hf_weights(chunks, runtime, hf_config), small.load_weights, bucket_megabytes=bucket_mb
    )
    return {
        "engine": backend.loaded,
        "engine_buckets": backend.bucket_bytes,
        "loaded": small.loaded,
        "bucket_bytes": small.bucket_bytes,
        "stats": stats,
    }


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from tests.test_rollout_native import HEADS, HIDDEN, KV_HEADS, LAYERS, VOCAB
    from verl_megatron.utils.local_assets import build_tiny_hf_model

    path = tmp_path_factory.mktemp("sync_llama")
    build_tiny_hf_model(path, "llama", vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=LAYERS,
                        num_heads=HEADS, num_kv_heads=KV_HEADS, intermediate_size=128, seed=1)  # fmt: skip
    return str(path)


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1), (1, 2)], ids=["single", "tp2", "pp2"])
def test_sync_weights_streams_the_checkpoint_in_buckets(pool1, pool2, model_dir, tp, pp):
    from safetensors.torch import load_file

    expected = load_file(f"{model_dir}/model.safetensors")
    pool = pool1 if tp * pp == 1 else pool2
    bucket_mb = 40_000 / 2**20  # 40 kB: several buckets; the 96x64 embedding (24.6 kB) fits one
    for result in pool.run(f"{__name__}:sync_job", model_dir=model_dir, tp=tp, pp=pp, bucket_mb=bucket_mb):
        assert result["engine"].keys() == result["loaded"].keys() == expected.keys()
        assert len(result["engine_buckets"]) == 1
        for name, tensor in expected.items():
            assert torch.equal(result["engine"][name], tensor), name
            assert torch.equal(result["loaded"][name], tensor), name
        assert max(result["bucket_bytes"]) <= 40_000 and len(result["bucket_bytes"]) >= 8
        assert result["stats"].bytes == sum(t.numel() * 4 for t in expected.values())
