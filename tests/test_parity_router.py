"""Bitwise parity's MoE router gating runs through the matmul route (models/matmul_route.py):
route_spec builds the spec's router as RoutedTopKRouter with the route; its parameters, state
dict and gating are megatron's until the route is switched, then the gating is the tiled kernel
(a row's logits do not depend on the other rows) and nothing is set on the router."""

from __future__ import annotations

import torch

HIDDEN, EXPERTS, ROWS = 32, 4, 37


def parity_router_job() -> dict:
    from types import SimpleNamespace

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.transformer_config import TransformerConfig

    from verl_megatron.distributed.parallel import ParallelLayout, init_runtime
    from verl_megatron.models import batch_invariant
    from verl_megatron.models.matmul_route import MatmulRoute, RoutedTopKRouter, route_spec
    from verl_megatron.models.moe import install_router_fallback

    init_runtime(ParallelLayout(), seed=0)  # megatron's gating asks for the (CPU-mapped) CUDA device
    install_router_fallback()
    route = MatmulRoute()
    builder = route_spec(
        get_gpt_layer_local_spec(num_experts=EXPERTS), route
    ).submodules.mlp.submodules.router
    config = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, num_moe_experts=EXPERTS,
        moe_router_topk=2, moe_router_dtype="fp32", use_cpu_initialization=True,
    )  # fmt: skip
    groups = SimpleNamespace(tp=None, cp=None, tp_cp=None, tp_dp_cp=None)
    torch.manual_seed(0)
    plain = TopKRouter(config=config, pg_collection=groups)
    torch.manual_seed(0)
    routed = builder(config=config, pg_collection=groups)
    try:
        batch_invariant._linear_routes(torch.nn.ModuleDict({"gate": plain}))
        refused = ""
    except ValueError as err:
        refused = str(err)
    x = torch.randn(ROWS, HIDDEN, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        off = (routed.gating(x), plain.gating(x))
        routes = batch_invariant._linear_routes(routed)
        for r in routes:
            r.use_batch_invariant_kernels()
        on = (routed.gating(x), routed.gating(x[3:4]), batch_invariant.router_gating(plain, x))
    return {
        "builder": (getattr(builder, "func", None) is RoutedTopKRouter, getattr(builder, "keywords", None) == {"route": route}),
        "state": ({k: v.clone() for k, v in plain.state_dict().items()}, {k: v.clone() for k, v in routed.state_dict().items()}),
        "params": ([n for n, _ in plain.named_parameters()], [n for n, _ in routed.named_parameters()]),
        "refused": refused,
        "routes": len(routes) == 1 and routes[0] is route,
        "off": off,
        "on": on,
        "instance_gating": "gating" in vars(routed),
    }  # fmt: skip


def test_router_gating_runs_tiled_through_the_route(pool1):
    out = pool1.run(f"{__name__}:parity_router_job")[0]
    assert out["builder"] == (True, True) and out["routes"], out["builder"]
    plain, routed = out["state"]
    assert plain.keys() == routed.keys() and out["params"][0] == out["params"][1] == ["weight", "bias"]
    assert all(torch.equal(plain[k], routed[k]) for k in plain), (
        "routed router's init differs from megatron's"
    )
    assert "router gate (TopKRouter) consults no matmul route" in out["refused"], out["refused"]
    diff = float((out["off"][0] - out["off"][1]).abs().max())
    assert torch.equal(*out["off"]), f"route off: routed vs megatron's gating, max diff {diff}"
    whole, row, tiled = out["on"]
    diff = float((whole - tiled).abs().max())
    assert torch.equal(whole, tiled), f"route on: routed gating vs the tiled kernel, max diff {diff}"
    row_diff = float((whole[3:4] - row).abs().max())
    assert torch.equal(whole[3:4], row), f"row 3 alone vs in the batch: max diff {row_diff}"
    assert not out["instance_gating"]
