"""SDPA core attention gives megatron's local DotProductAttention numbers (and falls back where it would not)."""

from __future__ import annotations

import torch


def attention_job() -> dict:
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from verl_megatron.distributed.parallel import ParallelLayout, init_runtime
    from verl_megatron.models.sdpa_attention import SDPADotProductAttention

    init_runtime(ParallelLayout(), seed=3)
    config = TransformerConfig(
        num_layers=1,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        use_cpu_initialization=True,
        attention_dropout=0.0,
    )
    g = torch.Generator().manual_seed(0)
    sq, b = 6, 3
    q = torch.randn(sq, b, 4, 8, generator=g, requires_grad=True)
    k = torch.randn(sq, b, 2, 8, generator=g, requires_grad=True)
    v = torch.randn(sq, b, 2, 8, generator=g, requires_grad=True)
    # Padding-aware causal mask (True = hidden): row 1 is right-padded, row 2 left-padded, so
    # row 2's first query has no visible key at all.
    causal = torch.triu(torch.ones(sq, sq, dtype=torch.bool), 1)
    keep = torch.ones(b, sq, dtype=torch.bool)
    keep[1, 4:] = False
    keep[2, 0] = False
    mask = causal[None, None] | ~keep[:, None, None, :]
    out: dict = {}
    for name, m in (("no_mask", None), ("mask", mask)):
        results = []
        for cls in (DotProductAttention, SDPADotProductAttention):
            attn = cls(config, 1, AttnMaskType.causal, "self")
            ctx = attn(q, k, v, m)
            # Gradients through every position but the one with no visible key (padding).
            weight = torch.arange(ctx.numel()).view_as(ctx).sin()
            weight[0, 2] = 0.0
            grads = torch.autograd.grad((ctx * weight).sum(), (q, k, v))
            results.append((ctx.detach(), [x.detach() for x in grads]))
        out[name] = results
    # Dropout while training: SDPA would draw different random numbers, so megatron's path runs.
    dropped = SDPADotProductAttention(config, 1, AttnMaskType.causal, "self", attention_dropout=0.5)
    out["dropout_uses_megatron"] = not dropped._sdpa_applies(None, None)
    dropped.eval()
    out["eval_uses_sdpa"] = dropped._sdpa_applies(None, None)
    return out


def test_sdpa_core_attention_matches_megatron(pool1):
    (out,) = pool1.run(f"{__name__}:attention_job")
    for name in ("no_mask", "mask"):
        (ref, ref_grads), (ours, our_grads) = out[name]
        visible = torch.ones(ours.shape[:2], dtype=torch.bool)
        visible[0, 2] = name == "no_mask"  # query 0 of left-padded row 2 sees no key: padding
        torch.testing.assert_close(ours[visible], ref[visible], rtol=1e-5, atol=1e-6, msg=f"{name}: context")
        assert torch.isfinite(ours).all()
        for a, e in zip(our_grads, ref_grads):
            torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6, msg=f"{name}: gradient")
    assert out["dropout_uses_megatron"] and out["eval_uses_sdpa"]
