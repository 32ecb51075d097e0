"""Weight gradients accumulated straight into DDP's buffer (models/grad_accumulation.py) give
the update of megatron's own path: same loss, same gradients and weights up to float32 rounding.

A tiny GPTModel (tied and untied LM head) runs one step of megatron's schedule over four
micro-batches (so the buffer accumulates), DDP and the megatron optimizer with clipping, from
the same weights (one frozen), three ways: float64 (the reference; the fused path is float32-only, so this
is DDP's own path), float32 through DDP's hook, float32 with the fused accumulation. The fused
gradients must be as close to float64 as the hook's are (within FLOAT32_ERROR_FACTOR of the
hook's error, per tensor), the loss is bit-equal (the forward runs the same matmuls), and one
Adam step lands on the hook path's weights up to float32 noise.
"""

from __future__ import annotations

import pytest
import torch

from tests import tiny_gpt
from tests.closeness import assert_adam_weights_close

VOCAB, SEQ, HIDDEN, LAYERS, HEADS, GROUPS, FFN = 64, 8, 32, 2, 4, 2, 64
ROWS, MICRO_BATCH, LR = 8, 2, 1e-2
# Both float32 paths compute each micro-batch's product with the same GEMM and differ only in
# where it is summed into the buffer (inside the GEMM or after it): a few float32 roundings per
# element either way, so their errors against float64 are of one size. 2 leaves room for one
# path's rounding landing on the other side of the other's (measured ratios up to ~1.3).
FLOAT32_ERROR_FACTOR = 2.0


def step_job(dtype_name: str, fused: bool, tied: bool) -> dict:
    """One training step; returns the loss, the gradients before the step, the updated weights,
    whether the route was on and how many layers consult it."""
    dtype = getattr(torch, dtype_name)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # megatron's torch RMSNorm takes no dtype argument
    try:
        return _step(dtype, fused, tied)
    finally:
        torch.set_default_dtype(previous)


def _step(dtype: torch.dtype, fused: bool, tied: bool) -> dict:
    from verl_megatron.distributed.parallel import ParallelLayout
    from verl_megatron.models.matmul_route import MatmulRoute, accumulate_into_main_grad, routed_layers
    from verl_megatron.models.megatron_model import (
        OptimSettings,
        attach_schedule_hooks,
        build_optimizer,
        wrap_ddp,
        zero_grads,
    )
    from verl_megatron.models.sharding import gather_full_state, load_full_state, seeded_tensor

    route = MatmulRoute()

    def make(pre, post, vp_stage):
        return tiny_gpt.make_gpt(
            pre, post, vp_stage, vocab=VOCAB, seq=SEQ, hidden=HIDDEN, layers=LAYERS, heads=HEADS,
            groups=GROUPS, ffn=FFN, dtype=dtype, tied=tied, route=route,
        )  # fmt: skip

    def float32_weights(name, shape):  # the same numbers in both dtypes (randn draws per dtype)
        torch.set_default_dtype(torch.float32)
        try:
            return seeded_tensor(name, shape, seed=3).to(dtype)
        finally:
            torch.set_default_dtype(dtype)

    runtime, chunks = tiny_gpt.seeded_chunks(
        ParallelLayout(), make, layers=LAYERS, heads=HEADS, groups=GROUPS
    )
    load_full_state(chunks, float32_weights)
    # A frozen weight (as LoRA's base) has no buffer: its layer falls through to megatron's matmul.
    chunks[0].decoder.layers[0].mlp.linear_fc2.weight.requires_grad_(False)
    settings = OptimSettings(lr=LR, weight_decay=0.01, clip_grad=0.05, grad_reduce_in_fp32=False)
    chunks = wrap_ddp(chunks, settings)
    attach_schedule_hooks(chunks)
    optimizer = build_optimizer(chunks, settings)
    batch = tiny_gpt.uneven_batch(VOCAB, ROWS, SEQ, seed=1)
    micro_batches, forward_step, num_micro = tiny_gpt.token_mean_schedule(
        batch, micro_batch=MICRO_BATCH, seq=SEQ, dp=1, dp_rank=0
    )
    zero_grads(chunks, optimizer)
    with accumulate_into_main_grad(route if fused else None, chunks) as switched:
        out = tiny_gpt.run_schedule(
            chunks, micro_batches, forward_step, num_micro, seq=SEQ, micro_batch=MICRO_BATCH
        )
    # Nothing is set on the modules; the route is off again after the update.
    leftover = [
        type(m).__name__ for c in chunks for m in c.modules() if {"_forward_impl", "forward"} & set(vars(m))
    ]
    leftover += ["route still on"] if route.accumulate_main_grad else []
    grads = gather_full_state(chunks, grads=True)
    ok, _, _ = optimizer.step()
    assert ok
    return {
        "loss": tiny_gpt.global_token_loss(runtime, out, batch["loss_mask"].sum()),
        "grads": grads,
        "weights": gather_full_state(chunks),
        "switched": switched,
        "routed": sum(len(routed_layers(c.module)) for c in chunks),
        "leftover": leftover,
    }


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_fused_accumulation_matches_ddp_hook_path(pool1, tied):
    def run(dtype: str, fused: bool) -> dict:
        return pool1.run(f"{__name__}:step_job", dtype_name=dtype, fused=fused, tied=tied)[0]

    ref, hook, fused = run("float64", False), run("float32", False), run("float32", True)
    # Per layer qkv, proj, fc1, fc2; the embedding; the LM head (the tied one too: its matmul).
    assert fused["routed"] == hook["routed"] == 4 * LAYERS + 2, (fused["routed"], hook["routed"])
    assert fused["switched"] and not hook["switched"], (fused["switched"], hook["switched"])
    assert fused["leftover"] == [], f"modules still switched after the update: {fused['leftover']}"
    assert fused["loss"] == hook["loss"], (fused["loss"], hook["loss"])
    assert abs(hook["loss"] - ref["loss"]) < 1e-5 * abs(ref["loss"]), (hook["loss"], ref["loss"])
    assert fused["grads"].keys() == ref["grads"].keys() and ("output_layer.weight" in ref["grads"]) != tied
    worse = {}
    for name, expected in ref["grads"].items():
        fused_err = float((fused["grads"][name].double() - expected).abs().max())
        hook_err = float((hook["grads"][name].double() - expected).abs().max())
        floor = 2.0**-24 * float(expected.abs().max())  # one float32 rounding of the largest entry
        if fused_err > FLOAT32_ERROR_FACTOR * max(hook_err, floor):
            worse[name] = (fused_err, hook_err)
    assert not worse, f"fused gradients further from float64 than the hook path's (fused, hook): {worse}"
    assert_adam_weights_close(
        fused["weights"], hook["weights"], lr=LR, steps=1, what="weights after one step"
    )


def routed_build_job() -> dict:
    """The tiny GPT built twice from one seed, once with a route: parameter names, values and
    megatron attributes, and one forward's logits, of both; the routed layers' classes."""
    from verl_megatron.distributed.parallel import ParallelLayout
    from verl_megatron.models.matmul_route import MatmulRoute, routed_layers

    route = MatmulRoute()
    models = {}
    for routed in (False, True):

        def make(pre, post, vp_stage, routed=routed):
            return tiny_gpt.make_gpt(
                pre, post, vp_stage, vocab=VOCAB, seq=SEQ, hidden=HIDDEN, layers=LAYERS, heads=HEADS,
                groups=GROUPS, ffn=FFN, dtype=torch.float32, tied=False, route=route if routed else None,
            )  # fmt: skip

        _, chunks = tiny_gpt.seeded_chunks(ParallelLayout(), make, layers=LAYERS, heads=HEADS, groups=GROUPS)
        models[routed] = chunks[0]
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(SEQ).expand(2, SEQ)

    def described(model):
        attrs = ("tensor_model_parallel", "partition_dim", "is_embedding_or_output_parameter")
        return {
            n: (p.detach().clone(), [getattr(p, a, None) for a in attrs]) for n, p in model.named_parameters()
        }

    return {
        "params": {r: described(m) for r, m in models.items()},
        "logits": {r: m(ids, positions, attention_mask=None).detach() for r, m in models.items()},
        "routed": sorted({type(m).__name__ for m in routed_layers(models[True])}),
        "unrouted": len(routed_layers(models[False])),
    }


def test_routed_layers_build_and_compute_as_megatrons(pool1):
    """The builder's routed linears, embedding and LM head (models/matmul_route.py) hold the same
    parameters (names, random init, megatron's attributes) and, with the route off, give the
    same logits bit for bit as megatron's own layers."""
    out = pool1.run(f"{__name__}:routed_build_job")[0]
    assert out["routed"] == [
        "RoutedColumnParallelLinear",
        "RoutedRowParallelLinear",
        "RoutedVocabParallelEmbedding",
    ]
    assert out["unrouted"] == 0
    plain, routed = out["params"][False], out["params"][True]
    assert plain.keys() == routed.keys() and "output_layer.weight" in plain, sorted(routed)
    differ = [n for n in plain if not torch.equal(plain[n][0], routed[n][0]) or plain[n][1] != routed[n][1]]
    assert not differ, f"parameters or their attributes differ: {differ}"
    diff = (out["logits"][True] - out["logits"][False]).abs()
    assert torch.equal(out["logits"][True], out["logits"][False]), f"max diff {float(diff.max())}"


def rebuild_job() -> dict:
    """The tiny GPT built without a route, then its embedding and LM head rebuilt as routed layers
    under a dispatch mode recording the device of every tensor an operation makes: the devices, the
    CPU random state before and after, and whether the rebuilt layers hold the built Parameters."""
    from types import SimpleNamespace

    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from verl_megatron.distributed.parallel import ParallelLayout
    from verl_megatron.models.matmul_route import MatmulRoute, route_embedding_and_head

    def make(pre, post, vp_stage):
        return tiny_gpt.make_gpt(
            pre, post, vp_stage, vocab=VOCAB, seq=SEQ, hidden=HIDDEN, layers=LAYERS, heads=HEADS,
            groups=GROUPS, ffn=FFN, dtype=torch.float32, tied=False,
        )  # fmt: skip

    _, chunks = tiny_gpt.seeded_chunks(ParallelLayout(), make, layers=LAYERS, heads=HEADS, groups=GROUPS)
    model = chunks[0]
    built = [model.embedding.word_embeddings.weight, model.output_layer.weight]
    devices: set[str] = set()

    class Devices(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            devices.update(t.device.type for t in tree_leaves(out) if isinstance(t, torch.Tensor))
            return out

    before = torch.get_rng_state()
    with Devices():
        route_embedding_and_head(model, MatmulRoute())
    rebuilt = [model.embedding.word_embeddings, model.output_layer]
    try:  # a GPU build (megatron would allocate and draw on the GPU whatever the device context)
        route_embedding_and_head(SimpleNamespace(config=SimpleNamespace(use_cpu_initialization=False)), None)
        refused = ""
    except ValueError as error:
        refused = str(error)
    return {
        "refused": refused,
        "devices": sorted(devices),
        "rng_unchanged": torch.equal(before, torch.get_rng_state()),
        "classes": [type(m).__name__ for m in rebuilt],
        "same_parameters": [m.weight is w for m, w in zip(rebuilt, built, strict=True)],
    }


def test_embedding_and_head_rebuild_is_free(pool1):
    """The routed embedding and LM head are rebuilt on the meta device: every tensor made during
    the rebuild is a meta tensor (no memory) and the CPU generator has drawn nothing (random init
    after it is unchanged); the built Parameters carry over. A model not built for the CPU is refused."""
    out = pool1.run(f"{__name__}:rebuild_job")[0]
    assert out["devices"] == ["meta"], f"tensors made off the meta device: {out['devices']}"
    assert out["rng_unchanged"], "the rebuild drew from the CPU random generator"
    assert out["classes"] == ["RoutedVocabParallelEmbedding", "RoutedColumnParallelLinear"], out["classes"]
    assert out["same_parameters"] == [True, True], out["same_parameters"]
    assert "use_cpu_initialization=False" in out["refused"], out["refused"]


def _spec_classes(spec) -> list[type]:
    """Every class a layer spec names, depth first (ModuleSpec modules and bare classes)."""
    import dataclasses

    from megatron.core.transformer.spec_utils import ModuleSpec

    if isinstance(spec, ModuleSpec):
        return [spec.module, *_spec_classes(spec.submodules)]
    if isinstance(spec, type):
        return [spec]
    if dataclasses.is_dataclass(spec):
        return [c for f in dataclasses.fields(spec) for c in _spec_classes(getattr(spec, f.name))]
    return []


def route_spec_job() -> dict:
    """Linear class names of the routed local spec; a TE-like spec's classes before and after."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from verl_megatron.models.matmul_route import MatmulRoute, route_spec

    local = route_spec(get_gpt_layer_local_spec(normalization="RMSNorm"), MatmulRoute())

    te_like = {
        n: type(n, (torch.nn.Module,), {}) for n in ("TELayerNormColumnParallelLinear", "TERowParallelLinear")
    }
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    attention, mlp = spec.submodules.self_attention.submodules, spec.submodules.mlp.submodules
    attention.linear_qkv = mlp.linear_fc1 = te_like["TELayerNormColumnParallelLinear"]
    attention.linear_proj = mlp.linear_fc2 = te_like["TERowParallelLinear"]
    before = [c.__name__ for c in _spec_classes(spec)]
    after = _spec_classes(route_spec(spec, MatmulRoute()))
    return {
        "local": [c.__name__ for c in _spec_classes(local) if "Linear" in c.__name__],
        "te_before": before,
        "te_after": [c.__name__ for c in after],
    }


def test_route_spec_routes_megatrons_linears_only(pool1):
    """route_spec turns megatron's column/row linears of the local spec into routed ones and leaves
    Transformer Engine's alone: in a spec naming TE-like linears (TE's classes derive from
    transformer_engine's modules, not megatron's, and TE is not installed here) nothing changes."""
    out = pool1.run(f"{__name__}:route_spec_job")[0]
    assert out["local"] == ["RoutedColumnParallelLinear", "RoutedRowParallelLinear"] * 2, out["local"]
    assert "TERowParallelLinear" in out["te_before"], out["te_before"]
    assert out["te_after"] == out["te_before"], f"a TE-like spec changed: {out['te_after']}"
