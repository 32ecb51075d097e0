"""LoRA adapters on megatron's tensor-parallel linear layers, named and laid out like PEFT's.

A frozen linear ``W`` gains ``(alpha / r) * B @ A`` with ``A`` [r, in] and ``B`` [out, r]. Each
Hugging Face projection gets its own pair, so the adapters map one to one onto PEFT's
``q_proj``/``k_proj``/``v_proj``/``o_proj``/``gate_proj``/``up_proj``/``down_proj`` adapters
even where megatron fuses the projections:

- column-parallel linears (``linear_qkv``, ``linear_fc1``): ``A`` is replicated over tp and
  ``B`` is sharded along its output rows like the base weight. ``h = x A^T`` is the same on
  every tp rank; its gradient is the sum over ranks of ``dY_i B_i``, so ``h`` enters the
  tensor-parallel region through megatron's copy (identity forward, all-reduce backward): one
  all-reduce of [S, B, r] numbers, and ``A``'s gradient is then complete on every rank.
  ``linear_qkv`` holds, per key/value group, its query heads, then its key head, then its
  value head (see convert.py): each component's output is computed on its own and interleaved
  group by group; ``linear_fc1`` holds [gate shard; up shard] on each rank.
- row-parallel linears (``linear_proj``, ``linear_fc2``): ``A`` is sharded along its input
  columns like the base weight, ``x_i A_i^T`` is all-reduced (megatron's reduce region) before
  the replicated ``B``.

The whole tensors (concatenated tp shards) of every ``A`` and ``B`` are exactly PEFT's
``lora_A.weight`` / ``lora_B.weight`` of the same projection, so export and import are copies.

The adapters of a chunk live in one module, ``chunk.lora_adapters``, keyed by GLOBAL layer
number (``layers.<n>.<site>.<hf name>.lora_A``), so checkpoints load under any layout. Each base
linear calls its adapter through a forward hook: every caller of the chunk's modules (training
forward, the native rollout's KV-cached decoder) computes base + adapter, never a merged copy.
Base weights are frozen (``requires_grad=False``): megatron's DDP and optimizer skip such
parameters, so gradient buffers and optimizer state exist for the adapters only.
"""

from __future__ import annotations

import difflib
import logging
import math
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from verl_megatron.distributed import state
from verl_megatron.distributed.modules import unwrap
from verl_megatron.errors import ModelConfigError, UserInputError

__all__ = [
    "HF_TARGETS",
    "LoraConfigError",
    "LoraSettings",
    "adapter_container",
    "apply_lora",
    "checkpoint_module",
    "has_lora",
    "lora_signature",
    "named_adapter_parameters",
    "resolve_targets",
]

# Hugging Face projection -> (megatron site in a TransformerLayer, component of a fused site).
_SITES: dict[str, tuple[str, str]] = {
    "q_proj": ("self_attention.linear_qkv", "q"),
    "k_proj": ("self_attention.linear_qkv", "k"),
    "v_proj": ("self_attention.linear_qkv", "v"),
    "o_proj": ("self_attention.linear_proj", "o"),
    "gate_proj": ("mlp.linear_fc1", "gate"),
    "up_proj": ("mlp.linear_fc1", "up"),
    "down_proj": ("mlp.linear_fc2", "down"),
}
HF_TARGETS = tuple(_SITES)
# The MLP's projections: an MoE layer's MLP is its experts (megatron's MoELayer), which take no adapters.
_MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
# megatron's names, accepted as shorthands for the projections they fuse.
_MEGATRON_ALIASES = {
    "linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "linear_proj": ("o_proj",),
    "linear_fc1": ("gate_proj", "up_proj"),
    "linear_fc2": ("down_proj",),
}
_HF_PREFIX = {"self_attention": "self_attn", "mlp": "mlp"}
_CONTAINER = "lora_adapters"
logger = logging.getLogger(__name__)


class LoraConfigError(ModelConfigError, UserInputError):
    """LoRA settings that cannot apply to this model; the message names the key."""


@dataclass(frozen=True)
class LoraSettings:
    """Resolved LoRA settings: which projections get adapters, how large, how scaled."""

    rank: int
    """r: columns of B / rows of A."""
    alpha: float
    """PEFT's lora_alpha: the adapter's output is scaled by alpha / rank."""
    targets: tuple[str, ...]
    """Hugging Face projection names (a subset of HF_TARGETS, in that order)."""
    dropout: float = 0.0
    """Dropout on the adapter's input while training (PEFT's lora_dropout)."""

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def resolve_targets(target_modules: Any, exclude_modules: Sequence[str] | None = None) -> tuple[str, ...]:
    """HF projection names selected by ``model.target_modules`` (minus ``model.exclude_modules``).

    Accepts "all-linear" (every projection of the decoder layers, as PEFT: not the output head),
    Hugging Face names (``q_proj``) and megatron's (``linear_qkv``). A name that matches no linear
    layer is an error listing what exists.
    """
    if isinstance(target_modules, str):
        names = list(_SITES) if target_modules == "all-linear" else [target_modules]
    elif isinstance(target_modules, Sequence) and target_modules:
        names = [str(n) for n in target_modules]
    else:
        raise LoraConfigError(
            f"model.target_modules must be 'all-linear' or a non-empty list of projection names, "
            f"got {target_modules!r}"
        )
    chosen: set[str] = set()
    for key, group in (("target_modules", names), ("exclude_modules", list(exclude_modules or []))):
        for name in group:
            matched = _match(name)
            if matched is None:
                known = [*_SITES, *_MEGATRON_ALIASES]
                close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
                hint = f"; did you mean '{close[0]}'?" if close else ""
                raise LoraConfigError(
                    f"model.{key} entry '{name}' matches no linear layer of this model (its layers have "
                    f"{', '.join(_SITES)}; megatron names {', '.join(_MEGATRON_ALIASES)}; or 'all-linear'){hint}"
                )
            if key == "target_modules":
                chosen.update(matched)
            else:
                chosen.difference_update(matched)
    if not chosen:
        raise LoraConfigError(
            f"model.exclude_modules {list(exclude_modules or [])} removes every target of model.target_modules "
            f"{names}: no adapter would be trained"
        )
    return tuple(n for n in _SITES if n in chosen)


def _match(name: str) -> tuple[str, ...] | None:
    # PEFT matches a name against the end of module paths: "self_attn.q_proj" selects q_proj.
    last = name.rsplit(".", 1)[-1]
    if last in _SITES:
        return (last,)
    return _MEGATRON_ALIASES.get(last)


def check_lora_config(model_cfg: Any, use_te: bool, moe: bool = False) -> LoraSettings | None:
    """The LoRA settings of a ModelConfig (None: LoRA off); LoraConfigError naming the key at fault.

    ``moe``: the model's MLPs are mixtures of experts (:data:`MOE_MODEL_TYPES`), see :func:`_moe_targets`.
    """
    rank = model_cfg.lora_rank
    if rank < 0:
        raise LoraConfigError(f"model.lora_rank must be > 0 to train LoRA adapters (0: off), got {rank}")
    if rank == 0:
        if model_cfg.target_modules != "all-linear" or model_cfg.exclude_modules or model_cfg.lora_dropout:
            raise LoraConfigError(
                "model.target_modules / exclude_modules / lora_dropout are set but model.lora_rank=0 "
                "(LoRA off, every weight trains): set model.lora_rank > 0, e.g. 16"
            )
        return None
    if not model_cfg.lora_alpha > 0:
        raise LoraConfigError(f"model.lora_alpha must be > 0, got {model_cfg.lora_alpha}")
    if not 0.0 <= model_cfg.lora_dropout < 1.0:
        raise LoraConfigError(f"model.lora_dropout must be in [0, 1), got {model_cfg.lora_dropout}")
    if use_te:
        raise LoraConfigError(
            "model.lora_rank > 0 needs megatron's local layer spec (model.use_te=false): Transformer "
            "Engine fuses the input norm into linear_qkv / linear_fc1, so an adapter cannot see their input"
        )
    targets = resolve_targets(model_cfg.target_modules, model_cfg.exclude_modules)
    if moe:
        targets = _moe_targets(model_cfg.target_modules, targets)
    return LoraSettings(rank, float(model_cfg.lora_alpha), targets, float(model_cfg.lora_dropout))


def _moe_targets(target_modules: Any, targets: tuple[str, ...]) -> tuple[str, ...]:
    """The attention targets of an MoE model: its experts have no adapters here.

    "all-linear" then adapts q/k/v/o only (PEFT also adapts the experts' stacked weights and the
    router; training them is not supported here); MLP projections named explicitly are an error.
    """
    mlp = [t for t in targets if t in _MLP_TARGETS]
    if mlp and target_modules != "all-linear":
        raise LoraConfigError(
            f"model.target_modules names MLP projections {mlp}, but this model's MLP layers are mixtures of "
            "experts, which LoRA does not adapt: target attention projections (q_proj, k_proj, v_proj, o_proj)"
        )
    kept = tuple(t for t in targets if t not in _MLP_TARGETS)
    if not kept:
        raise LoraConfigError(
            "model.exclude_modules removes every attention projection of this mixture-of-experts model, whose "
            "experts LoRA does not adapt: no adapter would be trained"
        )
    if mlp:
        logger.info(
            "LoRA all-linear on a mixture-of-experts model: adapting %s; the experts stay frozen", kept
        )
    return kept


# ----------------------------------------------------------------------------- modules


def _tp_attributes(param: torch.nn.Parameter, dim: int | None) -> None:
    from megatron.core.tensor_parallel import (
        set_defaults_if_not_set_tensor_model_parallel_attributes,
        set_tensor_model_parallel_attributes,
    )

    if dim is None:
        set_defaults_if_not_set_tensor_model_parallel_attributes(param)
    else:
        set_tensor_model_parallel_attributes(param, True, dim, 1)


class LoraPair(torch.nn.Module):
    """One projection's adapter: ``lora_A`` [r, in(/tp)] and ``lora_B`` [out(/tp), r] on this rank.

    ``a_dim`` / ``b_dim``: the dimension each is sharded along over tp (None: replicated).
    """

    def __init__(
        self,
        shape_a: tuple[int, int],
        shape_b: tuple[int, int],
        a_dim: int | None,
        b_dim: int | None,
        dtype,
        device,
    ) -> None:
        super().__init__()
        self.lora_A = torch.nn.Parameter(torch.zeros(shape_a, dtype=dtype, device=device))
        self.lora_B = torch.nn.Parameter(torch.zeros(shape_b, dtype=dtype, device=device))
        _tp_attributes(self.lora_A, a_dim)
        _tp_attributes(self.lora_B, b_dim)


def _matmul_transposed(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., in] @ weight [out, in].T -> [..., out]."""
    return x @ weight.t()


class _SiteAdapter(torch.nn.Module):
    """The adapters of one megatron linear: one LoraPair per targeted component."""

    def __init__(self, settings: LoraSettings, pairs: dict[str, LoraPair], base: torch.nn.Module) -> None:
        super().__init__()
        self.scaling = settings.scaling
        self.dropout = settings.dropout
        self.pairs = torch.nn.ModuleDict(pairs)
        self.tp_group = base.tp_group
        self.matmul = _matmul_transposed

    def use_matmul(self, matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        """Compute x @ w.T with ``matmul(x, w)`` (bitwise parity's batch-invariant linear)."""
        self.matmul = matmul

    def _drop(self, x: torch.Tensor, training: bool) -> torch.Tensor:
        if self.dropout and training:
            return torch.nn.functional.dropout(x, self.dropout, training=True)
        return x

    def hook(self, module: torch.nn.Module, args: tuple, output: tuple) -> tuple:
        """Forward hook of the base linear: its (output, bias) with the adapter's term added."""
        out, bias = output
        # The base module's mode decides dropout (the container's own flag may lag behind).
        return out + self.delta(args[0], module.training).to(out.dtype), bias


class ColumnAdapter(_SiteAdapter):
    """Adapters of a column-parallel linear whose output is made of components (fused qkv, gate/up).

    ``parts``: (component, local output rows) in the order they are fused. ``groups``: for
    ``linear_qkv``, the key/value groups on this rank (components interleave group by group);
    None: components are concatenated whole ([gate; up]).
    """

    def __init__(self, settings, pairs, base, parts: list[tuple[str, int]], groups: int | None) -> None:
        super().__init__(settings, pairs, base)
        self.parts = parts
        self.groups = groups

    def delta(self, x: torch.Tensor, training: bool) -> torch.Tensor:
        from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

        names = [name for name, _ in self.parts if name in self.pairs]
        a = torch.cat([self.pairs[n].lora_A for n in names])
        # h is the same on every tp rank; its gradient sums each rank's share (all-reduce backward).
        h = copy_to_tensor_model_parallel_region(self.matmul(self._drop(x, training), a), group=self.tp_group)
        hs = dict(zip(names, h.split(a.shape[0] // len(names), dim=-1)))
        outs = []
        for name, rows in self.parts:
            if name in hs:
                outs.append(self.matmul(hs[name], self.pairs[name].lora_B) * self.scaling)
            else:
                outs.append(h.new_zeros((*h.shape[:-1], rows)))
        if self.groups is None:
            return torch.cat(outs, dim=-1)
        lead = h.shape[:-1]
        grouped = [o.reshape(*lead, self.groups, -1) for o in outs]
        return torch.cat(grouped, dim=-1).reshape(*lead, -1)


class RowAdapter(_SiteAdapter):
    """Adapter of a row-parallel linear (input sharded over tp): A sharded, B replicated."""

    def delta(self, x: torch.Tensor, training: bool) -> torch.Tensor:
        from megatron.core.tensor_parallel import (
            get_cuda_rng_tracker,
            reduce_from_tensor_model_parallel_region,
        )

        (pair,) = self.pairs.values()
        if self.dropout and training:
            # The input is this rank's slice: dropout draws from the tensor-parallel RNG stream.
            with get_cuda_rng_tracker().fork():
                x = self._drop(x, training)
        h = reduce_from_tensor_model_parallel_region(self.matmul(x, pair.lora_A), group=self.tp_group)
        return self.matmul(h, pair.lora_B) * self.scaling


def _site_module(layer: torch.nn.Module, site: str) -> torch.nn.Module:
    try:
        return layer.get_submodule(site)
    except AttributeError:  # an MoELayer has no linear_fc1 / linear_fc2
        raise LoraConfigError(
            f"LoRA targets {site}, which layer {layer.layer_number} does not have (a mixture-of-experts MLP?): "
            "target attention projections only"
        ) from None


def _layer_sites(
    layer: torch.nn.Module, settings: LoraSettings, config: Any, tp: int, dtype, device
) -> dict[str, _SiteAdapter]:
    """Adapters for the targeted linears of one TransformerLayer, keyed by site name."""
    hidden, head_dim = config.hidden_size, config.kv_channels
    groups = config.num_query_groups or config.num_attention_heads
    q_rows = config.num_attention_heads * head_dim // tp
    kv_rows = groups * head_dim // tp
    ffn = config.ffn_hidden_size
    r = settings.rank
    sites: dict[str, _SiteAdapter] = {}
    by_site: dict[str, list[str]] = {}
    for hf_name in settings.targets:
        by_site.setdefault(_SITES[hf_name][0], []).append(hf_name)
    for site, hf_names in by_site.items():
        base = _site_module(layer, site)
        pairs: dict[str, LoraPair] = {}
        if site.endswith("linear_qkv"):
            parts = [("q_proj", q_rows), ("k_proj", kv_rows), ("v_proj", kv_rows)]
            for name, rows in parts:
                if name in hf_names:
                    pairs[name] = LoraPair((r, hidden), (rows, r), None, 0, dtype, device)
            sites[site] = ColumnAdapter(settings, pairs, base, parts, groups // tp)
        elif site.endswith("linear_fc1"):
            if not config.gated_linear_unit:
                raise LoraConfigError("model.target_modules gate_proj/up_proj need a gated (SwiGLU) MLP")
            parts = [("gate_proj", ffn // tp), ("up_proj", ffn // tp)]
            for name, rows in parts:
                if name in hf_names:
                    pairs[name] = LoraPair((r, hidden), (rows, r), None, 0, dtype, device)
            sites[site] = ColumnAdapter(settings, pairs, base, parts, None)
        else:
            fan_in = (config.num_attention_heads * head_dim) if site.endswith("linear_proj") else ffn
            (name,) = hf_names
            pairs[name] = LoraPair((r, fan_in // tp), (hidden, r), 1, None, dtype, device)
            sites[site] = RowAdapter(settings, pairs, base)
    return sites


class LoraAdapters(torch.nn.Module):
    """All adapters of one model chunk: ``layers.<global layer>.<site>.pairs.<hf name>.lora_A``."""

    def __init__(self, settings: LoraSettings) -> None:
        super().__init__()
        self.settings = settings
        self.layers = torch.nn.ModuleDict()
        self.handles: list[Any] = []

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        """megatron dist-checkpointing entries: sharded tensors along each parameter's tp dim."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        tensors = self.state_dict(prefix="", keep_vars=True)
        axis = {name: int(p.partition_dim) for name, p in self.named_parameters() if p.tensor_model_parallel}
        return make_sharded_tensors_for_checkpoint(
            tensors,
            prefix,
            axis,
            sharded_offsets,
            tp_group=state.group("tp"),
            dp_cp_group=state.group("dp", with_cp=True),
        )


def adapter_container(chunk: torch.nn.Module) -> LoraAdapters | None:
    """The chunk's adapters (DDP-wrapped or not), or None without LoRA."""
    return dict(unwrap(chunk).named_children()).get(_CONTAINER)


def has_lora(chunks: Sequence[torch.nn.Module]) -> bool:
    return any(adapter_container(c) is not None for c in chunks)


def checkpoint_module(chunk: torch.nn.Module) -> torch.nn.Module:
    """What a checkpoint of this chunk holds: the adapters with LoRA (the base is the HF model), else the chunk."""
    container = adapter_container(chunk)
    return container if container is not None else unwrap(chunk)


def lora_signature(chunks: Sequence[torch.nn.Module]) -> dict[str, Any] | None:
    """What a checkpoint records of the adapters (None: a full-weights model)."""
    container = next((adapter_container(c) for c in chunks if adapter_container(c) is not None), None)
    if container is None:
        return None
    s = container.settings
    return {"rank": s.rank, "alpha": s.alpha, "targets": list(s.targets)}


def named_adapter_parameters(chunks: Sequence[torch.nn.Module]) -> Iterator[tuple[int, str, str, LoraPair]]:
    """(global layer, HF site prefix, HF projection, pair) of every adapter on this rank.

    The HF prefix is ``self_attn`` or ``mlp``: the PEFT module is ``model.layers.<n>.<prefix>.<proj>``.
    """
    for chunk in chunks:
        container = adapter_container(chunk)
        if container is None:
            continue
        for layer_key, sites in container.layers.items():
            for site_key, site in sites.items():
                prefix = _HF_PREFIX[site_key.split("__")[0]]
                for proj, pair in site.pairs.items():
                    yield int(layer_key), prefix, proj, pair


def _init_value(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """PEFT's A init (kaiming-uniform with a=sqrt(5): U(-1/sqrt(in), 1/sqrt(in))), the same whole
    tensor under every layout (a generator per parameter name)."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    bound = 1.0 / math.sqrt(shape[-1])
    return (torch.rand(shape, generator=generator, dtype=torch.float64) * 2 - 1) * bound


def apply_lora(
    chunks: Sequence[torch.nn.Module], settings: LoraSettings, *, seed: int = 0
) -> list[torch.nn.Module]:
    """Freeze every base weight of ``chunks`` and add the targeted adapters (A: PEFT's init, B: 0).

    Call after the base weights are loaded and before DDP wrapping and the optimizer, which then
    see only the adapters as trainable. Returns ``chunks`` (modified in place).
    """
    tp = state.size("tp")
    tp_rank = state.rank("tp")
    for chunk in chunks:
        inner = unwrap(chunk)
        if hasattr(inner, "module") or hasattr(chunk, "ddp_config"):
            raise ValueError("apply_lora: pass the bare chunks, before wrap_ddp")
        if adapter_container(inner) is not None:
            raise ValueError("apply_lora: these chunks already have LoRA adapters")
        inner.requires_grad_(False)
        param = next(inner.parameters())
        container = LoraAdapters(settings)
        for layer in inner.decoder.layers:
            sites = _layer_sites(layer, settings, inner.config, tp, param.dtype, param.device)
            container.layers[str(layer.layer_number - 1)] = torch.nn.ModuleDict(
                {key.replace(".", "__"): site for key, site in sites.items()}
            )
            for key, site in sites.items():
                container.handles.append(layer.get_submodule(key).register_forward_hook(site.hook))
        with torch.no_grad():
            for name, p in container.named_parameters():
                if name.endswith("lora_A"):
                    whole_shape = list(p.shape)
                    if p.tensor_model_parallel:
                        whole_shape[p.partition_dim] *= tp
                    whole = _init_value(name, tuple(whole_shape), seed)
                    if p.tensor_model_parallel:
                        whole = whole.chunk(tp, dim=p.partition_dim)[tp_rank]
                    p.copy_(whole.to(p.dtype))
        # A child module (torch's registration API), not a loose attribute: DDP, the optimizer
        # and checkpoints must see the adapters as the chunk's parameters, ``lora_adapters.*``.
        inner.add_module(_CONTAINER, container)
    return list(chunks)


def apply_configured_lora(chunks: list[torch.nn.Module], model_cfg: Any, seed: int) -> list[torch.nn.Module]:
    """``apply_lora`` with the settings of a ModelConfig (``model.lora_rank`` etc.); a no-op at rank 0."""
    moe = unwrap(chunks[0]).config.num_moe_experts is not None
    settings = check_lora_config(model_cfg, use_te=False, moe=moe) if model_cfg.lora_rank else None
    return chunks if settings is None else apply_lora(chunks, settings, seed=seed)


def _describe(signature: dict[str, Any]) -> str:
    return f"rank {signature['rank']}, alpha {signature['alpha']:g}, on {', '.join(signature['targets'])}"


def lora_mismatch(part: Any, saved: dict | None, current: dict | None, error_cls: type[Exception]) -> None:
    """Raise ``error_cls`` when a checkpoint's LoRA record (``lora_signature``) is not this model's.

    A full-weights checkpoint cannot resume a LoRA run (its base weights are not adapters), nor
    an adapters-only checkpoint a full run (it has no base weights): said in one line.
    """
    if saved == current:
        return
    if saved is None:
        raise error_cls(
            f"checkpoint {part} holds full model weights, but this run trains LoRA adapters "
            f"(model.lora_rank={current['rank']}): resume it with model.lora_rank=0, or start the LoRA "
            "run in another trainer.default_local_dir"
        )
    settings = f"model.lora_rank={saved['rank']} model.lora_alpha={saved['alpha']:g} model.target_modules=[{','.join(saved['targets'])}]"
    if current is None:
        raise error_cls(
            f"checkpoint {part} holds only LoRA adapters ({_describe(saved)}), but this run trains every "
            f"weight (model.lora_rank=0): resume it with {settings}"
        )
    raise error_cls(
        f"checkpoint {part} holds LoRA adapters with {_describe(saved)}, but this run's have "
        f"{_describe(current)}: resume it with {settings}"
    )
