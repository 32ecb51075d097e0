"""Damaged or mismatched Hugging Face checkpoints (``model.path``) are one named ``error:`` line
with exit status 2 from the command line, found from the safetensors headers before any
process group or model exists."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from tests.test_user_errors import _base, _one_error_line
from verl_megatron import cli
from verl_megatron.models.checkpoint_check import HFWeightsError, check_hf_weights, read_safetensors_header
from verl_megatron.models.config import load_hf_config, read_hf_architecture


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, str]:
    """A tiny llama with a chat template and the reverse task's data."""
    from verl_megatron.data.synthetic import write_synthetic_dataset
    from verl_megatron.utils.local_assets import build_char_tokenizer, build_tiny_hf_model

    root = tmp_path_factory.mktemp("bad_ckpt")
    tokenizer = build_char_tokenizer(root / "tok", alphabet="0123456789")
    build_tiny_hf_model(root / "model", "llama", hidden_size=16, num_heads=2, num_kv_heads=2,
                        num_layers=2, intermediate_size=32, tokenizer=tokenizer)  # fmt: skip
    write_synthetic_dataset(root / "data", task="reverse", num_digits=2, seed=0)
    return {
        "root": str(root),
        "model": str(root / "model"),
        "train": str(root / "data" / "train.parquet"),
        "val": str(root / "data" / "val.parquet"),
        "out": str(root / "out"),
    }


def _copy(assets: dict[str, str], name: str) -> str:
    dst = os.path.join(assets["root"], name)
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(assets["model"], dst)
    return dst


def _no_weights(path: str) -> str:
    os.remove(os.path.join(path, "model.safetensors"))
    return "has no weights: expected model.safetensors or model.safetensors.index.json"


def _truncated(path: str) -> str:
    weights = os.path.join(path, "model.safetensors")
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) // 2)
    return f"'{weights}' is truncated: tensor '"


def _random_bytes(path: str) -> str:
    weights = os.path.join(path, "model.safetensors")
    with open(weights, "wb") as f:
        f.write(os.urandom(4096))
    return f"'{weights}' is not a safetensors file"


def _cut_in_header(path: str) -> str:
    weights = os.path.join(path, "model.safetensors")
    with open(weights, "r+b") as f:
        f.truncate(20)
    return f"'{weights}' is not a safetensors file or is truncated (20 bytes"


def _config_sizes_differ(path: str) -> str:
    config_path = os.path.join(path, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["intermediate_size"] = 48  # the weights hold 32
    with open(config_path, "w") as f:
        json.dump(config, f)
    weights = os.path.join(path, "model.safetensors")
    return (
        f"'{weights}': tensor 'model.layers.0.mlp.gate_proj.weight' has shape [32, 16] but config.json "
        "(hidden_size=16, intermediate_size=48"
    )


def _more_layers_in_config(path: str) -> str:
    config_path = os.path.join(path, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["num_hidden_layers"] = 3
    with open(config_path, "w") as f:
        json.dump(config, f)
    return "has no tensor 'model.layers.2.input_layernorm.weight', which config.json"


def _shard(path: str, missing_shard: bool) -> str:
    """Split the weights into two shards with an index; optionally delete the second shard."""
    from safetensors.torch import load_file, save_file

    weights = os.path.join(path, "model.safetensors")
    tensors = load_file(weights)
    os.remove(weights)
    names = sorted(tensors)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:])):
        file = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, os.path.join(path, file), {"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    if missing_shard:
        os.remove(os.path.join(path, "model-00002-of-00002.safetensors"))
    return f"lists '{os.path.join(path, 'model-00002-of-00002.safetensors')}', which does not exist"


CASES = [
    ("no weights", _no_weights),
    ("truncated file", _truncated),
    ("random bytes", _random_bytes),
    ("cut inside the header", _cut_in_header),
    ("config sizes differ", _config_sizes_differ),
    ("config has more layers", _more_layers_in_config),
    ("sharded, a shard missing", lambda p: _shard(p, missing_shard=True)),
]


@pytest.mark.parametrize(("case", "damage"), CASES, ids=[c[0] for c in CASES])
def test_bad_weights_are_one_named_line_before_the_runtime(case, damage, assets, capsys, no_runtime):
    path = _copy(assets, case.replace(" ", "_").replace(",", ""))
    expected = damage(path)
    rc = cli.main(["train", *_base({**assets, "model": path})])
    line = _one_error_line(rc, capsys)
    assert expected in line, line


def test_intact_checkpoints_pass_single_and_sharded(assets):
    arch = read_hf_architecture(load_hf_config(assets["model"]))
    check_hf_weights(assets["model"], arch)  # raises on any problem
    header = read_safetensors_header(os.path.join(assets["model"], "model.safetensors"))
    assert header["model.embed_tokens.weight"].shape == (arch.vocab_size, 16)
    assert header["model.layers.1.mlp.down_proj.weight"].shape == (16, 32)
    sharded = _copy(assets, "sharded_ok")
    _shard(sharded, missing_shard=False)
    check_hf_weights(sharded, arch)
    # A tensor the index places in a shard that does not hold it.
    index_path = os.path.join(sharded, "model.safetensors.index.json")
    with open(index_path) as f:
        index = json.load(f)
    name = "model.norm.weight"
    index["weight_map"][name] = next(
        f for f in set(index["weight_map"].values()) if f != index["weight_map"][name]
    )
    with open(index_path, "w") as f:
        json.dump(index, f)
    with pytest.raises(HFWeightsError, match=rf"has no tensor '{name}', which model.safetensors.index.json"):
        check_hf_weights(sharded, arch)
