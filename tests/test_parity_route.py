"""Bitwise parity's tiled linear runs through the matmul route (models/matmul_route.py): the
switch turns the routes of a model's linears to the batch-invariant kernel and sets nothing on
megatron's layers; a linear built without a route is refused by name; decoding keeps the tiled
kernel (no packed weights, no lean layer)."""

from __future__ import annotations

import functools

import torch

from tests import tiny_gpt

VOCAB, SEQ, HIDDEN, LAYERS, HEADS, GROUPS, FFN = 64, 8, 32, 2, 4, 2, 64


def parity_route_job() -> dict:
    from verl_megatron.distributed.parallel import ParallelLayout
    from verl_megatron.models import batch_invariant
    from verl_megatron.models.matmul_route import MatmulRoute
    from verl_megatron.rollout.cpu import lean_layer, packed_linear

    route = MatmulRoute()
    shape = dict(vocab=VOCAB, seq=SEQ, hidden=HIDDEN, layers=LAYERS, heads=HEADS, groups=GROUPS, ffn=FFN)
    models = {
        routed: tiny_gpt.seeded_chunks(
            ParallelLayout(),
            functools.partial(tiny_gpt.make_gpt, **shape, dtype=torch.float32, route=route if routed else None),
            layers=LAYERS, heads=HEADS, groups=GROUPS,
        )[1][0]
        for routed in (False, True)
    }  # fmt: skip
    try:
        batch_invariant._linear_routes(models[False])
        refused = ""
    except ValueError as err:
        refused = str(err)
    routes = batch_invariant._linear_routes(models[True])
    before = route.batch_invariant
    for r in routes:
        r.use_batch_invariant_kernels()
    fc1 = models[True].decoder.layers[0].mlp.linear_fc1
    x = torch.randn(5, 3, HIDDEN, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        whole = fc1(x)[0]
        first_row = fc1(x[:1, :1])[0]
        tiled = batch_invariant.linear(x, fc1.weight)
        with packed_linear.packed_linears([models[True]]) as switched:
            decoded = fc1(x)[0]
    return {
        "refused": refused,
        "routes": len(routes),
        "shared": all(r is route for r in routes),
        "before": before,
        "whole": whole,
        "first_row": first_row,
        "tiled": tiled,
        "decoded": decoded,
        "switched": switched,
        "lean": lean_layer._why_not(models[True].decoder.layers[0]),
        "instance_impls": sum("_forward_impl" in vars(m) for m in models[True].modules()),
    }


def test_parity_linears_run_tiled_through_the_route(pool1):
    out = pool1.run(f"{__name__}:parity_route_job")[0]
    assert "linear" in out["refused"] and "consults no matmul route" in out["refused"], out["refused"]
    # 2 layers x (qkv, proj, fc1, fc2) + the LM head, all on the one route, off until switched
    assert (out["routes"], out["shared"], out["before"]) == (4 * LAYERS + 1, True, False)
    diff = float((out["whole"] - out["tiled"]).abs().max())
    assert torch.equal(out["whole"], out["tiled"]), f"routed linear vs tiled kernel: max diff {diff}"
    row_diff = float((out["whole"][:1, :1] - out["first_row"]).abs().max())
    assert torch.equal(out["whole"][:1, :1], out["first_row"]), f"one row alone vs in the batch: {row_diff}"
    assert torch.equal(out["decoded"], out["whole"]) and out["switched"] == 0
    assert out["lean"] == "qkv is RoutedColumnParallelLinear with its own matmul", out["lean"]
    assert out["instance_impls"] == 0
