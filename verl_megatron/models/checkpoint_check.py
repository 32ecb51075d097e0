"""Start-up check of a Hugging Face checkpoint's weights against its config.json, before any model is built.

Reads only the safetensors headers (an 8-byte little-endian length, then a JSON table of
``name -> {dtype, shape, data_offsets}``), never a tensor, so a missing, truncated or random
weights file and a config.json whose sizes do not match the weights are each one named error
(the file and the tensor) instead of a traceback after the model was built.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass

from verl_megatron.errors import UserInputError
from verl_megatron.models.config import HFArchitecture
from verl_megatron.models.families.deepseek import mla_hf_shapes
from verl_megatron.models.families.gpt_oss import gpt_oss_hf_shapes
from verl_megatron.models.families.qwen2_vl import hf_language_names
from verl_megatron.models.families.qwen3_next import linear_layer_shapes

__all__ = [
    "HFWeightsError",
    "TensorEntry",
    "check_hf_weights",
    "expected_hf_shapes",
    "read_safetensors_header",
]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# safetensors refuses headers above 100 MB; a larger length is a file that is not safetensors.
_MAX_HEADER_BYTES = 100_000_000
_ITEM_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip
# Weights are cast to the model's dtype on load (``Tensor.to``): any float type converts.
_FLOAT_DTYPES = ("F8_E5M2", "F8_E4M3", "F16", "BF16", "F32", "F64")


class HFWeightsError(UserInputError):
    """A checkpoint's weights are missing, unreadable, or do not fit its config.json."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor as a safetensors header describes it (no data read)."""

    file: str
    dtype: str
    shape: tuple[int, ...]


def _entry(path: str, name: str, info: object, data_bytes: int) -> TensorEntry:
    """Check one header entry: known dtype, integer shape, and a byte range inside the file."""
    if not isinstance(info, dict):
        raise HFWeightsError(f"'{path}': tensor '{name}' has a malformed header entry")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in _ITEM_BYTES:
        raise HFWeightsError(f"'{path}': tensor '{name}' has unknown dtype {dtype!r}")
    if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
        raise HFWeightsError(f"'{path}': tensor '{name}' has a malformed shape {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
        raise HFWeightsError(f"'{path}': tensor '{name}' has malformed data_offsets {offsets!r}")
    begin, end = offsets
    if end > data_bytes:
        raise HFWeightsError(
            f"'{path}' is truncated: tensor '{name}' ends at data byte {end} but the file holds "
            f"{data_bytes} bytes of data (an interrupted download or copy?)"
        )
    if end - begin != math.prod(shape) * _ITEM_BYTES[dtype] or begin < 0:
        raise HFWeightsError(
            f"'{path}': tensor '{name}' ({dtype} {shape}) has data_offsets {offsets} of the wrong length"
        )
    return TensorEntry(path, dtype, tuple(shape))


def read_safetensors_header(path: str) -> dict[str, TensorEntry]:
    """Name -> entry of every tensor in the safetensors file ``path``, from its header alone.

    Raises HFWeightsError naming the file when it is absent, not safetensors, or truncated.
    """
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            length = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            if not 0 < length <= min(size - 8, _MAX_HEADER_BYTES):
                raise HFWeightsError(
                    f"'{path}' is not a safetensors file or is truncated ({size} bytes; its header "
                    f"length field says {length})"
                )
            raw = f.read(length)
    except OSError as err:
        raise HFWeightsError(f"cannot read weights file '{path}': {err.strerror or err}") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise HFWeightsError(f"'{path}' is not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise HFWeightsError(f"'{path}' is not a safetensors file (its header is not a JSON object)")
    data_bytes = size - 8 - length
    return {
        name: _entry(path, name, info, data_bytes) for name, info in header.items() if name != "__metadata__"
    }


def _read_index(hf_dir: str) -> dict[str, str]:
    """Tensor name -> shard path of a sharded checkpoint's index file."""
    index_path = os.path.join(hf_dir, INDEX_FILE)
    try:
        with open(index_path) as f:
            weight_map = json.load(f).get("weight_map")
    except (OSError, ValueError, AttributeError) as err:
        raise HFWeightsError(f"'{index_path}' is unreadable: {' '.join(str(err).split())[:200]}") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise HFWeightsError(f"'{index_path}' has no weight_map of tensor name -> file")
    return {name: os.path.join(hf_dir, file) for name, file in weight_map.items()}


def checkpoint_tensors(hf_dir: str) -> dict[str, TensorEntry]:
    """Every tensor of the checkpoint folder (``model.safetensors`` or a sharded index), headers only."""
    if os.path.isfile(os.path.join(hf_dir, INDEX_FILE)):
        files = _read_index(hf_dir)
        headers: dict[str, dict[str, TensorEntry]] = {}
        for path in sorted(set(files.values())):
            if not os.path.isfile(path):
                raise HFWeightsError(
                    f"'{os.path.join(hf_dir, INDEX_FILE)}' lists '{path}', which does not exist"
                )
            headers[path] = read_safetensors_header(path)
        for name, path in files.items():
            if name not in headers[path]:
                raise HFWeightsError(f"'{path}' has no tensor '{name}', which {INDEX_FILE} places there")
        return {name: headers[path][name] for name, path in files.items()}
    single = os.path.join(hf_dir, SINGLE_FILE)
    if os.path.isfile(single):
        return read_safetensors_header(single)
    found = sorted(os.listdir(hf_dir))[:10]
    raise HFWeightsError(
        f"model.path='{hf_dir}' has no weights: expected {SINGLE_FILE} or {INDEX_FILE} (found: {found})"
    )


def _layer_shapes(arch: HFArchitecture, layer: int) -> dict[str, tuple[int, ...]]:
    """HF tensor shapes of decoder layer ``layer`` (attention, norms, dense MLP or MoE block)."""
    h, d = arch.hidden_size, arch.head_dim
    q, kv = arch.num_attention_heads * d, arch.num_key_value_heads * d
    attn = f"model.layers.{layer}.self_attn"
    shapes = {
        f"model.layers.{layer}.input_layernorm.weight": (h,),
        f"model.layers.{layer}.post_attention_layernorm.weight": (h,),
        f"{attn}.q_proj.weight": (q, h), f"{attn}.k_proj.weight": (kv, h),
        f"{attn}.v_proj.weight": (kv, h), f"{attn}.o_proj.weight": (h, q),
    }  # fmt: skip
    if arch.mla is not None:
        shapes = {n: s for n, s in shapes.items() if not n.startswith(attn)}
        shapes.update(mla_hf_shapes(arch.mla, attn, arch.num_attention_heads, h))
    if arch.qkv_bias:
        shapes.update(
            {f"{attn}.q_proj.bias": (q,), f"{attn}.k_proj.bias": (kv,), f"{attn}.v_proj.bias": (kv,)}
        )
    if arch.linear_bias:
        shapes[f"{attn}.o_proj.bias"] = (h,)
    if arch.qk_norm:
        shapes.update({f"{attn}.q_norm.weight": (d,), f"{attn}.k_norm.weight": (d,)})
    if arch.linear is not None:  # Qwen3-Next: DeltaNet layers, gated q_proj
        shapes = linear_layer_shapes(arch.linear, layer, shapes, h)
    if arch.gpt_oss is not None:  # sinks, biased router, stacked experts
        return {**shapes, **gpt_oss_hf_shapes(arch, layer)}
    moe = arch.moe
    if moe is None or not moe.layer_pattern[layer]:
        mlp, i = f"model.layers.{layer}.mlp", arch.intermediate_size
        shapes.update({f"{mlp}.gate_proj.weight": (i, h), f"{mlp}.up_proj.weight": (i, h),
                       f"{mlp}.down_proj.weight": (h, i)})  # fmt: skip
        if arch.linear_bias:
            shapes.update(
                {f"{mlp}.gate_proj.bias": (i,), f"{mlp}.up_proj.bias": (i,), f"{mlp}.down_proj.bias": (h,)}
            )
        return shapes
    block, f = f"model.layers.{layer}.{moe.hf_block}", moe.ffn_hidden_size
    gate, up, down = moe.hf_expert_names
    shapes[f"{block}.gate.weight"] = (moe.num_experts, h)
    for e in range(moe.num_experts):
        shapes.update({f"{block}.experts.{e}.{gate}.weight": (f, h), f"{block}.experts.{e}.{up}.weight": (f, h),
                       f"{block}.experts.{e}.{down}.weight": (h, f)})  # fmt: skip
    if moe.expert_bias:
        shapes[f"{block}.gate.e_score_correction_bias"] = (moe.num_experts,)
    if moe.shared_expert_size:
        s, shared = moe.shared_expert_size, f"{block}.{moe.hf_shared_name}"
        shapes.update({f"{shared}.gate_proj.weight": (s, h), f"{shared}.up_proj.weight": (s, h),
                       f"{shared}.down_proj.weight": (h, s)})  # fmt: skip
    if moe.shared_expert_gate:
        shapes[f"{block}.shared_expert_gate.weight"] = (1, h)
    return shapes


def expected_hf_shapes(arch: HFArchitecture) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor a causal LM of ``arch`` must have (the LM head unless tied)."""
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (arch.vocab_size, arch.hidden_size)}
    for layer in range(arch.num_layers):
        shapes.update(_layer_shapes(arch, layer))
    shapes["model.norm.weight"] = (arch.hidden_size,)
    if not arch.tie_word_embeddings:
        shapes["lm_head.weight"] = (arch.vocab_size, arch.hidden_size)
    if arch.vl is not None:  # Qwen3-VL saves its language model under model.language_model.
        return dict(zip(hf_language_names(tuple(shapes), arch.vl), shapes.values()))
    return shapes


def check_hf_weights(hf_dir: str | os.PathLike, arch: HFArchitecture) -> None:
    """Raise HFWeightsError (file and tensor named) unless every tensor ``arch`` needs is in the
    checkpoint with its shape and a float dtype. Extra tensors (a critic's ``score``) are allowed."""
    hf_dir = os.path.expanduser(os.fspath(hf_dir))
    tensors = checkpoint_tensors(hf_dir)
    sizes = (
        f"hidden_size={arch.hidden_size}, intermediate_size={arch.intermediate_size}, "
        f"vocab_size={arch.vocab_size}, heads={arch.num_attention_heads}/{arch.num_key_value_heads}"
    )
    for name, shape in expected_hf_shapes(arch).items():
        entry = tensors.get(name)
        if entry is None:
            where = os.path.join(
                hf_dir, INDEX_FILE if os.path.isfile(os.path.join(hf_dir, INDEX_FILE)) else SINGLE_FILE
            )
            raise HFWeightsError(
                f"'{where}' has no tensor '{name}', which config.json (model_type={arch.model_type}, "
                f"num_hidden_layers={arch.num_layers}) needs; is config.json from the same model?"
            )
        if entry.shape != shape:
            raise HFWeightsError(
                f"'{entry.file}': tensor '{name}' has shape {list(entry.shape)} but config.json ({sizes}) "
                f"needs {list(shape)}; is config.json from the same model?"
            )
        if entry.dtype not in _FLOAT_DTYPES:
            raise HFWeightsError(f"'{entry.file}': tensor '{name}' has dtype {entry.dtype}, not a float type")
