"""HF -> megatron -> HF round trips are bit-exact under tp=2, pp=2 and pp=2 with virtual stages.

Each job loads a tiny checkpoint into megatron, streams it back with ``iter_hf_weights`` (every
rank must see the same tensors) and exports it with ``export_hf_weights``; transformers then
reloads the export and its state dict must equal the original exactly. The export is also read
back into fresh megatron chunks (sharded-index files included). The critic's value head exports
as ``*ForTokenClassification`` whose outputs equal megatron's values.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForTokenClassification,
    AutoTokenizer,
    GenerationConfig,
)

from tests.test_models_parity import CASES, make_tiny_model


@pytest.fixture(scope="module")
def originals(tmp_path_factory) -> dict[str, tuple[str, torch.nn.Module]]:
    from verl_megatron.utils.local_assets import build_char_tokenizer

    root = tmp_path_factory.mktemp("export_src")
    out = {}
    for name in ("llama_gqa_llama3rope", "qwen2_tied", "qwen3_headdim32", "llama_mha_tied_biases"):
        path = str(root / name)
        out[name] = (path, make_tiny_model(path, CASES[name], seed=5))
        # Sampling defaults of the source checkpoint must survive the export.
        GenerationConfig(do_sample=True, temperature=0.7, top_p=0.9, eos_token_id=[1, 2]).save_pretrained(
            path
        )
    build_char_tokenizer(root / "tokenizer")
    return out


def _layout_runtime(tp: int, pp: int, vpp: int | None):
    from verl_megatron.distributed.parallel import ParallelLayout, init_runtime

    return init_runtime(ParallelLayout(tp=tp, pp=pp, vpp=vpp))


def export_job(
    path: str,
    out_dir: str,
    tp: int,
    pp: int,
    vpp: int | None,
    tokenizer_dir: str | None,
    max_shard_bytes: int,
) -> dict:
    from verl_megatron.models.builder import build_gpt_chunks
    from verl_megatron.models.config import ModelConfig, load_hf_config
    from verl_megatron.models.convert import export_hf_weights, iter_hf_weights, load_hf_weights
    from verl_megatron.models.sharding import named_global_parameters

    runtime = _layout_runtime(tp, pp, vpp)
    hf_config, model_cfg = load_hf_config(path), ModelConfig(path=path, dtype="float32")
    chunks = build_gpt_chunks(hf_config, runtime, model_cfg)
    load_hf_weights(chunks, path, runtime)
    streamed = {name: tensor.clone() for name, tensor in iter_hf_weights(chunks, runtime, hf_config)}
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir) if tokenizer_dir else None
    export_hf_weights(chunks, runtime, out_dir, hf_config, tokenizer, max_shard_bytes=max_shard_bytes)
    # Read the export back into fresh chunks: every local shard must come back unchanged.
    fresh = build_gpt_chunks(hf_config, runtime, model_cfg)
    load_hf_weights(fresh, out_dir, runtime)
    pairs = zip(named_global_parameters(chunks), named_global_parameters(fresh), strict=True)
    reload_exact = all(n1 == n2 and torch.equal(p1, p2) for (n1, p1), (n2, p2) in pairs)
    return {"streamed": streamed, "reload_exact": reload_exact}


def _config_fields(config) -> dict:
    return {k: v for k, v in config.to_dict().items() if k != "_name_or_path"}


def _assert_round_trip(original: torch.nn.Module, out_dir: str, results: list[dict]) -> None:
    expected = original.state_dict()
    if original.config.tie_word_embeddings:
        expected.pop("lm_head.weight")
    for r in results:
        assert r["reload_exact"]
        assert list(r["streamed"]) == list(results[0]["streamed"])  # same order on every rank
        assert r["streamed"].keys() == expected.keys()
        for name, tensor in expected.items():
            assert torch.equal(r["streamed"][name], tensor), name
    reloaded = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
    got = reloaded.state_dict()
    assert got.keys() == original.state_dict().keys()
    for name, tensor in original.state_dict().items():
        assert torch.equal(got[name], tensor), name
    assert _config_fields(AutoConfig.from_pretrained(out_dir)) == _config_fields(original.config)
    generation = GenerationConfig.from_pretrained(out_dir)
    assert (generation.temperature, generation.top_p, generation.eos_token_id) == (0.7, 0.9, [1, 2])
    assert not [f for f in os.listdir(os.path.dirname(out_dir)) if ".tmp-" in f or ".old-" in f]


@pytest.mark.parametrize(
    ("name", "tp", "pp", "vpp"),
    [("llama_gqa_llama3rope", 2, 1, None), ("qwen2_tied", 1, 2, None), ("qwen3_headdim32", 1, 2, 2)],
    ids=["llama-tp2-padded-vocab", "qwen2-tied-pp2", "qwen3-pp2-vpp2-sharded"],
)
def test_export_round_trips_exactly(pool2, originals, tmp_path, name, tp, pp, vpp):
    path, original = originals[name]
    out_dir = str(tmp_path / "export")
    sharded = vpp is not None
    tokenizer_dir = os.path.join(os.path.dirname(path), "tokenizer") if tp == 2 else None
    results = pool2.run(
        f"{__name__}:export_job", path=path, out_dir=out_dir, tp=tp, pp=pp, vpp=vpp,
        tokenizer_dir=tokenizer_dir, max_shard_bytes=60_000 if sharded else 5 * 2**30,
    )  # fmt: skip
    _assert_round_trip(original, out_dir, results)
    files = sorted(os.listdir(out_dir))
    if sharded:
        with open(os.path.join(out_dir, "model.safetensors.index.json")) as f:
            index = json.load(f)
        shards = sorted(set(index["weight_map"].values()))
        assert len(shards) > 2 and set(shards) <= set(files)
        assert index["weight_map"].keys() == original.state_dict().keys()
    else:
        assert "model.safetensors" in files
    if tokenizer_dir:
        text = "12 + 35 = 47"
        assert (
            AutoTokenizer.from_pretrained(out_dir)(text)["input_ids"]
            == AutoTokenizer.from_pretrained(tokenizer_dir)(text)["input_ids"]
        )


def test_export_replaces_an_existing_folder(pool2, originals, tmp_path):
    path, original = originals["llama_mha_tied_biases"]
    out_dir = tmp_path / "export"
    out_dir.mkdir()
    (out_dir / "stale.txt").write_text("from an earlier save")
    results = pool2.run(
        f"{__name__}:export_job", path=path, out_dir=str(out_dir), tp=2, pp=1, vpp=None,
        tokenizer_dir=None, max_shard_bytes=5 * 2**30,
    )  # fmt: skip
    _assert_round_trip(original, str(out_dir), results)
    assert not (out_dir / "stale.txt").exists()


def critic_job(path: str, out_dir: str, sequence: torch.Tensor) -> dict:
    from verl_megatron.models.builder import build_gpt_chunks
    from verl_megatron.models.config import ModelConfig, load_hf_config
    from verl_megatron.models.convert import export_hf_weights, load_hf_weights

    runtime = _layout_runtime(2, 1, None)
    hf_config, model_cfg = load_hf_config(path), ModelConfig(path=path, dtype="float32")
    critic = build_gpt_chunks(hf_config, runtime, model_cfg, value_head=True)
    load_hf_weights(critic, path, runtime)  # no score.* in a causal-LM checkpoint: head keeps its init
    head = critic[0].output_layer
    with torch.no_grad():
        head.bias.fill_(0.5)  # differs from the init, so reloading it below is visible
        values = critic[0](sequence[None], torch.arange(len(sequence))[None], None)
    export_hf_weights(critic, runtime, out_dir, hf_config)
    fresh = build_gpt_chunks(hf_config, runtime, model_cfg, value_head=True)
    load_hf_weights(fresh, out_dir, runtime)
    return {
        "values": values,
        "head_type": type(head).__name__,
        "reloaded_head_equal": torch.equal(fresh[0].output_layer.weight, head.weight)
        and float(fresh[0].output_layer.bias) == 0.5,
    }


def test_critic_value_head_exports_as_token_classification(pool2, originals, tmp_path):
    path, _ = originals["llama_gqa_llama3rope"]
    out_dir = str(tmp_path / "critic")
    sequence = torch.arange(3, 14)
    rank0, rank1 = pool2.run(f"{__name__}:critic_job", path=path, out_dir=out_dir, sequence=sequence)
    assert rank0["head_type"] == "ValueHead" and rank0["reloaded_head_equal"] and rank1["reloaded_head_equal"]
    assert rank0["values"].shape == (1, 11, 1)
    assert torch.equal(rank0["values"], rank1["values"])  # replicated over tp, not vocab-parallel
    config = AutoConfig.from_pretrained(out_dir)
    assert config.architectures == ["LlamaForTokenClassification"] and config.num_labels == 1
    hf_critic = AutoModelForTokenClassification.from_pretrained(out_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf_critic(sequence[None]).logits
    torch.testing.assert_close(rank0["values"], expected, rtol=0, atol=1e-5)


def load_errors_job(path: str, broken_dir: str, other_path: str) -> dict:
    from verl_megatron.models.builder import build_gpt_chunks
    from verl_megatron.models.config import ModelConfig, load_hf_config
    from verl_megatron.models.convert import iter_hf_weights, load_hf_weights

    runtime = _layout_runtime(1, 1, None)
    hf_config = load_hf_config(path)
    chunks = build_gpt_chunks(hf_config, runtime, ModelConfig(path=path, dtype="float32"))
    errors = {}
    for key, call in {
        "missing_tensor": lambda: load_hf_weights(chunks, broken_dir, runtime),
        "wrong_model": lambda: load_hf_weights(chunks, other_path, runtime),
        "wrong_config": lambda: list(iter_hf_weights(chunks, runtime, load_hf_config(other_path))),
    }.items():
        try:
            call()
            errors[key] = None
        except (KeyError, ValueError) as err:
            errors[key] = f"{type(err).__name__}: {err}"
    return errors


def test_loading_the_wrong_checkpoint_names_the_problem(pool1, originals, tmp_path):
    from safetensors.torch import load_file, save_file

    path, _ = originals["llama_gqa_llama3rope"]
    other_path, _ = originals["qwen3_headdim32"]
    broken = tmp_path / "broken"
    broken.mkdir()
    tensors = load_file(os.path.join(path, "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(broken / "model.safetensors"))
    (errors,) = pool1.run(
        f"{__name__}:load_errors_job", path=path, broken_dir=str(broken), other_path=other_path
    )
    assert errors["missing_tensor"].startswith("KeyError")
    assert f"'{broken}' has no tensor ['model.layers.1.mlp.up_proj.weight']" in errors["missing_tensor"]
    assert "decoder.layers.1.mlp.linear_fc1.weight" in errors["missing_tensor"]
    assert (
        errors["wrong_model"].startswith("ValueError")
        and "do not fit megatron parameter" in errors["wrong_model"]
    )
    assert (
        "'head_dim': (16, 32)" in errors["wrong_config"] and "'num_layers': (2, 4)" in errors["wrong_config"]
    )


def failed_export_job(path: str, out_dir: str) -> dict:
    """Export with a late write failure (the generation config's save, after the weights)."""
    from transformers import GenerationConfig

    from verl_megatron.models.builder import build_gpt_chunks
    from verl_megatron.models.config import ModelConfig, load_hf_config
    from verl_megatron.models.convert import export_hf_weights, load_hf_weights

    def no_space(*args, **kwargs):
        raise OSError(28, "No space left on device")

    runtime = _layout_runtime(1, 1, None)
    hf_config = load_hf_config(path)
    chunks = build_gpt_chunks(hf_config, runtime, ModelConfig(path=path, dtype="float32"))
    load_hf_weights(chunks, path, runtime)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(GenerationConfig, "save_pretrained", no_space)
        try:
            export_hf_weights(chunks, runtime, out_dir, hf_config)
            return {"error": None}
        except OSError as err:
            return {"error": f"{type(err).__name__}: {err}"}


def test_a_failed_export_leaves_no_temporary_folder(pool1, originals, tmp_path):
    """The temporary folder holds a full copy of the weights and its name carries the pid, so a
    failed export must remove it itself; the error still reaches the caller."""
    path, _ = originals["llama_gqa_llama3rope"]
    (result,) = pool1.run(f"{__name__}:failed_export_job", path=path, out_dir=str(tmp_path / "out" / "hf"))
    assert result["error"] == "OSError: [Errno 28] No space left on device"
    assert os.listdir(tmp_path / "out") == []


def test_a_failed_adapter_write_leaves_no_temporary_folder(monkeypatch, tmp_path):
    from verl_megatron.models import lora_export

    def no_space(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(json, "dump", no_space)  # after adapter_model.safetensors is written
    with pytest.raises(OSError, match="No space left on device"):
        lora_export._write(str(tmp_path / "lora_adapter"), {"a.lora_A.weight": torch.ones(2, 3)}, {"r": 2})
    assert os.listdir(tmp_path) == []
