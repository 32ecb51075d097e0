"""Hugging Face <-> megatron weights for dense Llama-family models, under any tp/pp/vpp layout.

Each megatron parameter (by its global name, see ``sharding.named_global_parameters``) maps to
one or more Hugging Face tensors. "Whole" below means the concatenation of a parameter's
tensor-parallel shards, which is what ``sharding.gather_tp``/``shard_tp`` move in and out:

- ``linear_qkv`` fuses q/k/v in megatron's grouped-query order: for each key/value group,
  its query heads, then its key head, then its value head. Groups split evenly over tp.
- ``linear_fc1`` holds, on each tp rank, [gate shard; up shard]; the whole tensor is therefore
  [gate_0; up_0; gate_1; up_1; ...] and depends on tp.
- Embedding and output rows are padded to ``padded_vocab_size`` with zeros (see builder.py
  for how padded logit columns must be handled); export drops them.
- Tied embeddings: the last pipeline stage's copy of the output weight is loaded from
  ``model.embed_tokens.weight`` and skipped on export.
- The critic's value head is Hugging Face's token-classification ``score`` (weight and bias).
- Mixture-of-experts layers (see ``models/moe.py``): the router is HF's ``gate``; each routed
  expert's ``linear_fc1`` is its [gate; up] split over the *expert* tensor-parallel group
  (``sharding.tp_placement``), ``linear_fc2`` its down projection; transformers saves experts
  one tensor per projection and expert (``experts.<e>.gate_proj.weight``), which is what is
  read and written. Expert ``e`` lives on expert-parallel rank ``e // (experts / ep)``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from verl_megatron.distributed import state
from verl_megatron.distributed.collective import raise_on_any_rank
from verl_megatron.distributed.parallel import Runtime
from verl_megatron.models.builder import ModelInfo, model_info
from verl_megatron.models.config import ModelConfig, read_hf_architecture
from verl_megatron.models.export_io import publish_folder
from verl_megatron.models.families import gpt_oss, qwen3_next
from verl_megatron.models.families.deepseek import hf_mla_names
from verl_megatron.models.families.qwen2_vl import VISION_PREFIX, hf_language_names, hf_vision_name
from verl_megatron.models.moe import expert_index, hf_moe_names
from verl_megatron.models.sharding import (
    gather_tp,
    is_expert_parameter,
    named_expert_biases,
    named_global_parameters,
    shard_tp,
    tp_placement,
    whole_shape,
)

_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
_GATE_UP = ("mlp.gate_proj", "mlp.up_proj")
_CLASS_PREFIX = {
    "llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral", "gpt_oss": "GptOss",
    "qwen3_moe": "Qwen3Moe", "qwen2_moe": "Qwen2Moe", "mixtral": "Mixtral",
    "deepseek_v3": "DeepseekV3", "glm4_moe": "Glm4Moe", "qwen3_next": "Qwen3Next",
}  # fmt: skip

# Suffix of a megatron layer parameter -> (kind, HF suffixes). Both the local spec's names and
# Transformer Engine's (norms fused into the following linear as ``layer_norm_weight``) appear.
_LAYER_RULES: dict[str, tuple[str, tuple[str, ...]]] = {
    "input_layernorm.weight": ("copy", ("input_layernorm.weight",)),
    "self_attention.linear_qkv.layer_norm_weight": ("copy", ("input_layernorm.weight",)),
    "self_attention.linear_qkv.weight": ("qkv", tuple(f"{n}.weight" for n in _QKV)),
    "self_attention.linear_qkv.bias": ("qkv", tuple(f"{n}.bias" for n in _QKV)),
    "self_attention.linear_proj.weight": ("copy", ("self_attn.o_proj.weight",)),
    "self_attention.linear_proj.bias": ("copy", ("self_attn.o_proj.bias",)),
    "self_attention.q_layernorm.weight": ("copy", ("self_attn.q_norm.weight",)),
    "self_attention.k_layernorm.weight": ("copy", ("self_attn.k_norm.weight",)),
    "pre_mlp_layernorm.weight": ("copy", ("post_attention_layernorm.weight",)),
    "mlp.linear_fc1.layer_norm_weight": ("copy", ("post_attention_layernorm.weight",)),
    "mlp.linear_fc1.weight": ("gate_up", tuple(f"{n}.weight" for n in _GATE_UP)),
    "mlp.linear_fc1.bias": ("gate_up", tuple(f"{n}.bias" for n in _GATE_UP)),
    "mlp.linear_fc2.weight": ("copy", ("mlp.down_proj.weight",)),
    "mlp.linear_fc2.bias": ("copy", ("mlp.down_proj.bias",)),
}


@dataclass(frozen=True)
class HFMapping:
    """How one megatron parameter relates to Hugging Face tensors."""

    kind: str  # copy | vocab | qkv | gate_up
    hf_names: tuple[str, ...]
    export: bool = True  # False: a duplicate (tied output weight) that export skips
    optional: bool = False  # may be absent from a checkpoint (a critic's new value head)
    expert: int | None = None  # GPT-OSS: this expert's slice of a stacked HF tensor


def hf_mapping(name: str, info: ModelInfo) -> HFMapping:
    """The Hugging Face tensors behind megatron parameter ``name`` (global layer numbering)."""
    vl = info.arch.vl
    if vl is not None and name.startswith(VISION_PREFIX):  # the replicated vision tower
        return HFMapping("copy", (hf_vision_name(name, vl),))
    mapping = _text_mapping(name, info)
    if vl is None:
        return mapping
    return dataclasses.replace(mapping, hf_names=hf_language_names(mapping.hf_names, vl))


def _text_mapping(name: str, info: ModelInfo) -> HFMapping:
    match = _LAYER_RE.match(name)
    moe = info.arch.moe
    if match and info.arch.gpt_oss is not None:
        found = gpt_oss.hf_gpt_oss_names(int(match.group(1)), match.group(2))
        if found is not None:
            return HFMapping(*found)
    if match and moe is not None:
        found = hf_moe_names(moe, int(match.group(1)), match.group(2))
        if found is not None:
            return HFMapping(*found)
    if match and info.arch.linear is not None:
        found = qwen3_next.hf_linear_names(info.arch.linear, int(match.group(1)), match.group(2))
        if found is not None:
            return HFMapping(*found)
    if match and info.arch.mla is not None:
        found = hf_mla_names(match.group(2))
        if found is not None:
            return HFMapping(found[0], tuple(f"model.layers.{match.group(1)}.{s}" for s in found[1]))
    if match and match.group(2) in _LAYER_RULES:
        kind, suffixes = _LAYER_RULES[match.group(2)]
        return HFMapping(kind, tuple(f"model.layers.{match.group(1)}.{s}" for s in suffixes))
    if name == "embedding.word_embeddings.weight":
        return HFMapping("vocab", ("model.embed_tokens.weight",))
    if name == "decoder.final_layernorm.weight":
        return HFMapping("copy", ("model.norm.weight",))
    if name in ("output_layer.weight", "output_layer.bias") and info.value_head:
        return HFMapping("copy", ("score." + name.rsplit(".", 1)[1],), optional=True)
    if name == "output_layer.weight" and info.tied_embeddings:
        return HFMapping("vocab", ("model.embed_tokens.weight",), export=False)
    if name == "output_layer.weight":
        return HFMapping("vocab", ("lm_head.weight",))
    raise ValueError(f"no Hugging Face tensor is known for megatron parameter {name!r}")


def to_megatron(mapping: HFMapping, tensors: list[torch.Tensor], info: ModelInfo, tp: int) -> torch.Tensor:
    """The whole megatron tensor from its Hugging Face tensors (in ``mapping.hf_names`` order)."""
    arch = info.arch
    if mapping.expert is not None:
        return gpt_oss.expert_to_megatron(mapping.kind, tensors[0], mapping.expert)
    if mapping.kind in qwen3_next.KINDS:
        return qwen3_next.to_megatron(mapping.kind, tensors, arch, tp)
    if mapping.kind == "copy":
        return tensors[0]
    if mapping.kind == "vocab":
        (table,) = tensors
        padding = table.new_zeros((info.padded_vocab_size - table.shape[0], *table.shape[1:]))
        return torch.cat([table, padding])
    if mapping.kind == "qkv":
        groups, heads_per_group = (
            arch.num_key_value_heads,
            arch.num_attention_heads // arch.num_key_value_heads,
        )
        q, k, v = tensors
        rest = q.shape[1:]
        q = q.reshape(groups, heads_per_group * arch.head_dim, *rest)
        k = k.reshape(groups, arch.head_dim, *rest)
        v = v.reshape(groups, arch.head_dim, *rest)
        return torch.cat([q, k, v], dim=1).reshape(-1, *rest)
    if mapping.kind == "gate_up":
        gate, up = tensors
        return torch.cat([torch.cat(pair) for pair in zip(gate.chunk(tp), up.chunk(tp))])
    raise ValueError(f"unknown mapping kind {mapping.kind!r}")


def to_hf(mapping: HFMapping, whole: torch.Tensor, info: ModelInfo, tp: int) -> list[torch.Tensor]:
    """Inverse of :func:`to_megatron`: the Hugging Face tensors of one whole megatron tensor."""
    arch = info.arch
    if mapping.expert is not None:
        return [gpt_oss.expert_to_hf(mapping.kind, whole)]
    if mapping.kind in qwen3_next.KINDS:
        return qwen3_next.to_hf(mapping.kind, whole, arch, tp)
    if mapping.kind == "copy":
        return [whole]
    if mapping.kind == "vocab":
        return [whole[: info.vocab_size]]
    if mapping.kind == "qkv":
        groups, heads_per_group = (
            arch.num_key_value_heads,
            arch.num_attention_heads // arch.num_key_value_heads,
        )
        rest = whole.shape[1:]
        grouped = whole.reshape(groups, (heads_per_group + 2) * arch.head_dim, *rest)
        q, k, v = grouped.split([heads_per_group * arch.head_dim, arch.head_dim, arch.head_dim], dim=1)
        return [t.reshape(-1, *rest) for t in (q, k, v)]
    if mapping.kind == "gate_up":
        halves = [shard.chunk(2) for shard in whole.chunk(tp)]
        return [torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])]
    raise ValueError(f"unknown mapping kind {mapping.kind!r}")


class SafetensorsCheckpoint(contextlib.AbstractContextManager):
    """Lazy, by-name access to a checkpoint's safetensors files (single file or sharded index)."""

    def __init__(self, hf_dir: str | os.PathLike) -> None:
        self.hf_dir = os.fspath(hf_dir)
        self._files: dict[str, str] = {}
        self._handles: dict[str, Any] = {}
        self._stack = contextlib.ExitStack()
        index_path = os.path.join(self.hf_dir, "model.safetensors.index.json")
        single_path = os.path.join(self.hf_dir, "model.safetensors")
        if os.path.isfile(index_path):
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
            self._files = {name: os.path.join(self.hf_dir, file) for name, file in weight_map.items()}
        elif os.path.isfile(single_path):
            self._files = {name: single_path for name in self._open(single_path).keys()}  # noqa: SIM118
        else:
            listing = sorted(os.listdir(self.hf_dir)) if os.path.isdir(self.hf_dir) else "directory missing"
            raise FileNotFoundError(
                f"no safetensors weights in '{self.hf_dir}': expected model.safetensors or "
                f"model.safetensors.index.json (found: {listing})"
            )
        for path in sorted(set(self._files.values())):
            if not os.path.isfile(path):
                raise FileNotFoundError(f"'{index_path}' lists weight file '{path}', which does not exist")

    def _open(self, path: str) -> Any:
        from safetensors import safe_open

        if path not in self._handles:
            self._handles[path] = self._stack.enter_context(safe_open(path, framework="pt"))
        return self._handles[path]

    def __contains__(self, name: str) -> bool:
        return name in self._files

    def get(self, name: str, rows: slice | None = None) -> torch.Tensor:
        """Tensor ``name``, or only its ``rows`` (first axis) when given."""
        handle = self._open(self._files[name])
        return handle.get_tensor(name) if rows is None else handle.get_slice(name)[rows]

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()


@torch.no_grad()
def load_hf_weights(
    chunks: list[torch.nn.Module],
    hf_dir: str | os.PathLike | None,
    runtime: Runtime,
    model_cfg: ModelConfig | None = None,
) -> None:
    """Fill this rank's chunks from a Hugging Face checkpoint (``hf_dir``, or ``model_cfg.path``).

    Each rank reads only the tensors its own parameters need and keeps its tp slice. Load
    before building the optimizer (its fp32 master copies are taken from the parameters). A
    critic's value head keeps its initial weights unless the checkpoint has ``score.*``.
    """
    if hf_dir is None:
        if model_cfg is None or not model_cfg.path:
            raise ValueError("load_hf_weights: pass hf_dir or a model_cfg with a path")
        hf_dir = model_cfg.path
    info = model_info(chunks)
    with SafetensorsCheckpoint(hf_dir) as ckpt:
        for name, param in _named_parameters(chunks):
            mapping = hf_mapping(name, info)
            missing = [n for n in mapping.hf_names if n not in ckpt]
            if missing and mapping.optional:
                continue
            if missing:
                raise KeyError(
                    f"checkpoint '{hf_dir}' has no tensor {missing} (for megatron parameter {name})"
                )
            _, tp, tp_rank = tp_placement(name)
            rows = None if mapping.expert is None else slice(mapping.expert, mapping.expert + 1)
            if rows is not None:  # GPT-OSS: read this expert's row of the stacked tensor only
                mapping = HFMapping(mapping.kind, mapping.hf_names, expert=0)
            whole = _whole_from_hf(mapping, [ckpt.get(n, rows) for n in mapping.hf_names], info, tp)
            expected = whole_shape(param, tp)
            if whole is None or tuple(whole.shape) != expected:
                shapes = {n: tuple(ckpt.get(n).shape) for n in mapping.hf_names}
                raise ValueError(
                    f"checkpoint '{hf_dir}': tensors {shapes} do not fit megatron parameter {name} "
                    f"(whole shape {expected}); is config.json from the same model?"
                )
            param.copy_(shard_tp(whole, param, tp_rank, tp).to(param.dtype))


def _named_parameters(chunks: list[torch.nn.Module]) -> Iterator[tuple[str, torch.Tensor]]:
    """Global names and parameters, without the empty placeholders some Transformer Engine
    versions register for disabled biases, then the routers' expert biases (buffers)."""
    yield from (
        (name, p)
        for name, p in named_global_parameters(chunks)
        if p.numel() > 0 and not name.startswith("lora_adapters.")  # LoRA: models/lora_export.py
    )
    yield from named_expert_biases(chunks)


def _whole_from_hf(
    mapping: HFMapping, tensors: list[torch.Tensor], info: ModelInfo, tp: int
) -> torch.Tensor | None:
    """to_megatron, or None when the tensors cannot be fused (wrong shapes for this model)."""
    try:
        return to_megatron(mapping, tensors, info, tp)
    except RuntimeError:
        return None


def _check_same_model(info: ModelInfo, hf_config: Any) -> None:
    other = read_hf_architecture(hf_config)
    fields = (
        "num_layers",
        "hidden_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
    )
    diffs = {
        f: (getattr(info.arch, f), getattr(other, f))
        for f in fields
        if getattr(info.arch, f) != getattr(other, f)
    }
    if diffs:
        raise ValueError(f"hf_config does not describe the built model (built, given): {diffs}")


def _ordered_entries(local: dict[str, torch.nn.Parameter], runtime: Runtime) -> list[tuple]:
    """(name, owner pp rank, owner ep rank, whole shape, dtype) of every exported parameter, in HF order."""
    ep_rank = state.rank("ep")
    mine = [
        (name, runtime.pp_rank, ep_rank, whole_shape(p, tp_placement(name)[1]), p.dtype)
        for name, p in local.items()
    ]
    if runtime.layout.ep > 1:
        # Every ep rank holds the same dense parameters and its own experts.
        peers: list[list[tuple]] = [None] * runtime.layout.ep  # type: ignore[list-item]
        dist.all_gather_object(peers, mine, group=state.group("ep"))
        seen: set[str] = set()
        mine = [e for peer in peers for e in peer if not (e[0] in seen or seen.add(e[0]))]
    stages: list[list[tuple]] = [mine]
    if runtime.layout.pp > 1:
        stages = [None] * runtime.layout.pp  # type: ignore[list-item]
        dist.all_gather_object(stages, mine, group=runtime.pp_group())
    entries = [(i, e) for stage in stages for i, e in enumerate(stage)]

    def hf_order(item: tuple[int, tuple]) -> tuple[int, int, int]:
        position, (name, *_rest) = item
        match = _LAYER_RE.match(name)
        if match:
            return (1, int(match.group(1)), _expert_order(match.group(2)))
        return (0 if name.startswith("embedding.") else 2, 0, position)

    return [entry for _, entry in sorted(entries, key=hf_order)]


@torch.no_grad()
def iter_hf_weights(
    chunks: list[torch.nn.Module], runtime: Runtime, hf_config: Any = None, *, merge_lora: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (Hugging Face name, full tensor) for the whole model, one tensor at a time.

    Collective over the tensor- and pipeline-parallel groups: every rank of a model replica
    must iterate to the end, and every rank receives every tensor (on ``runtime.device``, in
    the parameters' dtype), in Hugging Face order (embeddings, layers, norm, head). Tensors
    are fresh copies, so consumers may keep them. ``hf_config``, when given, is checked to
    describe the built model. With LoRA adapters the weights are base + adapter (merged in
    float32), unless ``merge_lora=False`` (the frozen base alone).
    """
    from verl_megatron.models.lora_export import lora_merger

    info = model_info(chunks)
    if hf_config is not None:
        _check_same_model(info, hf_config)
    local = {name: p for name, p in _named_parameters(chunks) if hf_mapping(name, info).export}
    merge = lora_merger(chunks, runtime) if merge_lora else (lambda name, tensor: tensor)
    stacker = gpt_oss.ExpertStacker(info.arch.moe.num_experts) if info.arch.gpt_oss else None
    for name, owner, ep_owner, shape, dtype in _ordered_entries(local, runtime):
        group, tp, _ = tp_placement(name)
        if name in local:
            whole = gather_tp(local[name].detach(), local[name], group, tp)
        else:
            whole = torch.empty(shape, dtype=dtype, device=runtime.device)
        if runtime.layout.ep > 1 and is_expert_parameter(name):
            dist.broadcast(whole, group=state.group("ep"), group_src=ep_owner)
        if runtime.layout.pp > 1:
            dist.broadcast(whole, group=runtime.pp_group(), group_src=owner)
        mapping = hf_mapping(name, info)
        pairs = list(zip(mapping.hf_names, to_hf(mapping, whole, info, tp)))
        if mapping.expert is not None:  # GPT-OSS: whole once every expert's slice is in
            pairs = stacker.add(*mapping.hf_names, mapping.expert, pairs[0][1])
        yield from ((n, merge(n, t)) for n, t in pairs)


def _expert_order(layer_rest: str) -> int:
    """Position of a parameter inside its layer: dense ones first, then experts by global index
    (each rank lists only its own experts, so the merged list needs sorting)."""
    found = expert_index(layer_rest)
    return -1 if found is None else found[0] * 2 + found[1]


class _ShardWriter:
    """Writes tensors into safetensors shards of at most ``max_shard_bytes`` (plus an index)."""

    def __init__(self, out_dir: str, max_shard_bytes: int) -> None:
        self.out_dir, self.max_shard_bytes = out_dir, max_shard_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[list[str]] = []
        self.total_bytes = 0
        self.error: Exception | None = None

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Queue a tensor; a write error is kept for ``finish`` so the caller keeps iterating
        (the other ranks are inside the same collectives and would hang otherwise)."""
        if self.error is None:
            try:
                self._add(name, tensor)
            except Exception as err:
                self.error = err

    def _add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        # A private contiguous copy: safetensors refuses tensors that share storage (q/k/v views).
        self.pending[name] = tensor.detach().to("cpu", copy=True).contiguous()
        self.pending_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        from safetensors.torch import save_file

        save_file(self.pending, os.path.join(self.out_dir, f"shard-{len(self.shards)}.tmp"), {"format": "pt"})
        self.shards.append(list(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> None:
        if self.error is not None:
            raise self.error
        if self.pending or not self.shards:
            self._flush()
        count = len(self.shards)
        if count == 1:
            os.rename(
                os.path.join(self.out_dir, "shard-0.tmp"), os.path.join(self.out_dir, "model.safetensors")
            )
            return
        weight_map = {}
        for i, names in enumerate(self.shards):
            file = f"model-{i + 1:05d}-of-{count:05d}.safetensors"
            os.rename(os.path.join(self.out_dir, f"shard-{i}.tmp"), os.path.join(self.out_dir, file))
            weight_map.update(dict.fromkeys(names, file))
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        with open(os.path.join(self.out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)


def _export_config(hf_config: Any, info: ModelInfo, dtype: torch.dtype) -> Any:
    config = copy.deepcopy(hf_config)
    config.dtype = dtype
    if info.value_head:
        config.architectures = [f"{_CLASS_PREFIX[info.arch.model_type]}ForTokenClassification"]
        config.num_labels = 1
        config.tie_word_embeddings = False
    return config


# What AutoProcessor reads besides the tokenizer: a VL checkpoint's image / video processor and
# the processor's own settings and chat template. Without them the export takes no images.
PROCESSOR_FILES = (
    "preprocessor_config.json",
    "video_preprocessor_config.json",
    "processor_config.json",
    "chat_template.json",
    "chat_template.jinja",
)


def _source_dir(hf_config: Any) -> str:
    """The checkpoint folder ``hf_config`` was read from ('' when it was built in memory)."""
    return getattr(hf_config, "_name_or_path", "") or ""


def _copy_processor_files(hf_config: Any, tmp_dir: str) -> None:
    """Copy the source checkpoint's processor files (``PROCESSOR_FILES``) into the export; a file
    the tokenizer already wrote (its chat template) is kept, being the one trained with."""
    source = _source_dir(hf_config)
    for name in PROCESSOR_FILES:
        target = os.path.join(tmp_dir, name)
        if os.path.isfile(os.path.join(source, name)) and not os.path.exists(target):
            shutil.copyfile(os.path.join(source, name), target)


def _generation_config(hf_config: Any) -> Any:
    """The source checkpoint's generation settings (sampling defaults, eos ids) when it has them."""
    from transformers import GenerationConfig

    source = _source_dir(hf_config)
    if os.path.isfile(os.path.join(source, "generation_config.json")):
        return GenerationConfig.from_pretrained(source, local_files_only=True)
    return GenerationConfig.from_model_config(hf_config)


def _write_checkpoint(
    chunks: list[torch.nn.Module],
    runtime: Runtime,
    tmp_dir: str | None,
    hf_config: Any,
    tokenizer: Any,
    max_shard_bytes: int,
) -> None:
    """Stream the weights through every rank of replica 0; rank 0 (``tmp_dir`` set) writes."""
    writer = _ShardWriter(tmp_dir, max_shard_bytes) if tmp_dir else None
    dtype = torch.float32
    for name, tensor in iter_hf_weights(chunks, runtime, hf_config):
        dtype = tensor.dtype
        if writer:
            writer.add(name, tensor)
    if writer is None:
        return
    writer.finish()
    info = model_info(chunks)
    _export_config(hf_config, info, dtype).save_pretrained(tmp_dir)
    if not info.value_head:
        _generation_config(hf_config).save_pretrained(tmp_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp_dir)
    _copy_processor_files(hf_config, tmp_dir)


def export_hf_weights(
    chunks: list[torch.nn.Module],
    runtime: Runtime,
    out_dir: str | os.PathLike,
    hf_config: Any,
    tokenizer: Any = None,
    *,
    max_shard_bytes: int = 5 * 2**30,
) -> None:
    """Write the model as a Hugging Face checkpoint that ``from_pretrained`` loads.

    Collective over all ranks. Replica 0 (dp and cp rank 0) gathers the weights over tp and
    pp; global rank 0 writes safetensors (sharded with an index above ``max_shard_bytes``),
    config.json (``*ForTokenClassification`` with one label for a critic), generation_config.json,
    the tokenizer when given and the source folder's processor files (a VL model's image
    processor, ``PROCESSOR_FILES``), into a temporary folder renamed to ``out_dir`` at the end.
    """
    out_dir = os.path.abspath(os.fspath(out_dir))
    tmp_dir = f"{out_dir}.tmp-{os.getpid()}" if runtime.rank == 0 else None
    error: BaseException | None = None
    try:
        if tmp_dir:
            shutil.rmtree(tmp_dir, ignore_errors=True)
            os.makedirs(tmp_dir)
        # Replica 0 gathers; under ep its experts also live on ranks of other dp replicas.
        if (runtime.dp_rank == 0 and runtime.cp_rank == 0) or runtime.layout.ep > 1:
            _write_checkpoint(chunks, runtime, tmp_dir, hf_config, tokenizer, max_shard_bytes)
        if tmp_dir:
            publish_folder(tmp_dir, out_dir)
    except Exception as err:  # every rank must reach the status broadcast below
        error = err
        if tmp_dir:  # a full copy of the weights, under a name (the pid) no later export reuses
            shutil.rmtree(tmp_dir, ignore_errors=True)
    raise_on_any_rank(error, runtime.device, f"export to '{out_dir}' failed on another rank (see its log)")
