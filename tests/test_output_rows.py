"""The actor's LM head runs at the response positions only (workers/output_rows.py, issue 19).

The same log-probs, entropies and first update as with the LM head over every position, in
padded and packed micro-batches; and the model really returned only the selected rows.
Tolerance: float32 GEMM blocking may differ with the number of rows (M) of the head's matmul
and its weight gradient sums over fewer (zero) rows; the bounds are float32 summation noise
(closeness.py's Adam bounds for the weights after one step).
"""

from __future__ import annotations

import torch

from tests.closeness import assert_adam_weights_close, assert_close_report
from tests.test_actor_update import TEMPERATURE, build_actor, build_hf_model, make_batch


def rows_job(path: str) -> dict:
    from verl_megatron.distributed.parallel import ParallelLayout, init_runtime
    from verl_megatron.protocol import DataProto
    from verl_megatron.workers.config import ActorConfig, OptimConfig

    runtime = init_runtime(ParallelLayout(), seed=3)
    out = {}
    for packed in (False, True):
        for select in (True, False):
            cfg = ActorConfig(
                ppo_mini_batch_size=8,
                ppo_micro_batch_size_per_gpu=4,
                use_remove_padding=packed,
                entropy_coeff=0.01,
                optim=OptimConfig(lr=1e-2, weight_decay=0.0, clip_grad=1.0),
            )
            chunks, actor = build_actor(runtime, path, cfg)
            shapes = []
            if select:
                assert actor.runner.row_selector is not None
                chunks[0].module.output_layer.register_forward_hook(
                    lambda m, a, o, s=shapes: s.append(o[0].shape)
                )
            else:
                actor.runner.row_selector = None  # the LM head over every position
            data = DataProto.from_dict(make_batch(), meta_info={"temperature": TEMPERATURE})
            log_probs, entropy = actor.compute_log_prob(data, calculate_entropy=True)
            data.batch["old_log_probs"] = log_probs + 0.05 * data.batch["response_mask"]
            metrics = actor.update_policy(data)
            weights = {n: p.detach().clone() for n, p in chunks[0].module.named_parameters()}
            out[(packed, select)] = {
                "log_probs": log_probs,
                "entropy": entropy,
                "pg_loss": metrics["actor/pg_loss"][0],
                "grad_norm": metrics["actor/grad_norm"][0],
                "entropy_metric": metrics["actor/entropy"][0],
                "weights": weights,
                "head_rows": [tuple(s) for s in shapes],
            }
    return out


def test_selected_rows_match_the_full_head(pool1, tmp_path):
    build_hf_model(str(tmp_path))
    runs = pool1.run(f"{__name__}:rows_job", path=str(tmp_path))[0]
    valid_tokens = int(make_batch()["attention_mask"][:, 6:].sum())
    for packed in (False, True):
        selected, full = runs[(packed, True)], runs[(packed, False)]
        # Forward (log-probs) and forward + backward (update): 2 micro-batches each, every call
        # returned [K, 1, V] logits with K = the micro-batch's response positions (padding included).
        # Forward only the head is deferred: the model's call runs it on no rows, then the step on
        # the selected rows (one chunk at this vocabulary).
        assert selected["head_rows"] and all(s[1] == 1 for s in selected["head_rows"]), selected["head_rows"]
        rows = [s[0] for s in selected["head_rows"]]
        assert rows[0] == rows[2] == 0 and rows[1] + rows[3] >= valid_tokens, rows
        assert not full["head_rows"]
        what = f"{'packed' if packed else 'padded'}: LM head at response rows vs at every position"
        scalars = ("pg_loss", "grad_norm", "entropy_metric")
        assert_close_report(
            {k: selected[k] for k in ("log_probs", "entropy", *scalars)},
            {k: full[k] for k in ("log_probs", "entropy", *scalars)},
            rtol=2e-6,
            atol=2e-6,
            what=what,
        )
        assert_adam_weights_close(selected["weights"], full["weights"], lr=1e-2, steps=1, what=what)


def _frozen_head_backward_ops(foldable: bool) -> tuple[set[str], torch.Tensor]:
    """megatron's frozen-weight linear on [K, 1, h] rows, its logits transposed to [1, K, V] as
    GPTModel does; the aten ops of the backward and the input gradient."""
    from megatron.core.tensor_parallel.layers import LinearWithFrozenWeight
    from torch.profiler import ProfilerActivity, profile

    from verl_megatron.workers.output_rows import _FoldableGrad

    g = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 8, generator=g)  # [V, h], frozen (LoRA's base)
    hidden = torch.randn(12, 1, 8, generator=g, requires_grad=True)
    logits = LinearWithFrozenWeight.apply(hidden, weight, None, False, None)
    if foldable:
        logits = _FoldableGrad.apply(logits)
    loss = (logits.transpose(0, 1).contiguous() * torch.randn(1, 12, 64, generator=g)).sum()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        loss.backward()
    return {event.key for event in prof.key_averages()}, hidden.grad


def test_a_frozen_head_gets_a_gradient_it_can_multiply_in_one_matmul():
    """Without re-striding, the [K, 1, V] gradient makes torch.matmul run K batched products over
    the whole head (seen: LoRA updates 2.5x slower than full training at V=32000)."""
    plain_ops, plain_grad = _frozen_head_backward_ops(foldable=False)
    ops, grad = _frozen_head_backward_ops(foldable=True)
    assert "aten::bmm" in plain_ops  # the slow path exists, so this test can fail
    assert "aten::bmm" not in ops and "aten::mm" in ops, sorted(ops)
    torch.testing.assert_close(grad, plain_grad, rtol=0, atol=1e-6)
