"""Context parallelism: the token split, the merge, and the loss/gradient contract on CPU.

Real cp needs Transformer Engine attention (CUDA). What does not is tested here:

- the split by hand and by its properties (every position on exactly one rank, the same
  number of tokens and the same causal attention work on every rank), and against
  megatron's own ``get_batch_on_this_cp_rank`` in a real 2-process cp group;
- the merge's gradient contract with hand-made per-token values: each rank's gradient
  reaches only its own positions and the ranks' gradients add up to the one-process one;
- the whole engine path at cp=2 (packed THD split, schedule, DDP over dp x cp, optimizer)
  with a GPTModel whose layers have no attention, so its forward needs no other token:
  forward log-probs, metrics and updated weights must equal one process running padded
  rows. ``init_runtime`` and the engine refuse cp without CUDA; the jobs step around
  exactly those two checks.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from tests.closeness import assert_adam_weights_close, assert_close_report
from tests.test_actor_update import KL_SHIFT, TEMPERATURE, VOCAB, make_batch

HIDDEN, FFN, LAYERS = 16, 32, 2
MINI_BATCH, MICRO_BATCH = 4, 3


# ------------------------------------------------------------------ split, by hand
def test_pad_lengths_and_held_positions_by_hand():
    from verl_megatron.workers.context_parallel import held_positions, pad_lengths

    assert pad_lengths([5, 0, 8, 1], cp_size=2) == [8, 0, 8, 4]
    # Two sequences of 8 and 4 tokens, cp=2: chunks of 2 and 1 tokens; rank 0 holds the
    # first and last chunk of each, rank 1 the middle two.
    assert held_positions([8, 4], 2, 0).tolist() == [0, 1, 6, 7, 8, 11]
    assert held_positions([8, 4], 2, 1).tolist() == [2, 3, 4, 5, 9, 10]
    with pytest.raises(ValueError, match="sequence length 6 is not a multiple of 2\\*cp = 4"):
        held_positions([6], 2, 0)


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_split_is_a_partition_with_equal_causal_work(cp):
    from verl_megatron.workers.context_parallel import held_positions, pad_lengths

    lengths = pad_lengths([37, 5, 1, 64, 12], cp)
    total = sum(lengths)
    starts = torch.tensor(lengths).cumsum(0) - torch.tensor(lengths)
    # Position within its own sequence; a causal query there attends to (position + 1) keys.
    within = torch.cat([torch.arange(n) for n in lengths])
    held = [held_positions(lengths, cp, rank) for rank in range(cp)]
    assert torch.equal(torch.cat(held).sort().values, torch.arange(total))
    assert all(h.numel() == total // cp for h in held)
    work = [int((within[h] + 1).sum()) for h in held]
    assert work == [work[0]] * cp
    # Each rank's positions of one sequence are two runs of equal length, mirror images.
    first = held[0][(held[0] >= starts[3]) & (held[0] < starts[3] + lengths[3])] - starts[3]
    chunk = lengths[3] // (2 * cp)
    assert first.tolist() == list(range(chunk)) + list(range(lengths[3] - chunk, lengths[3]))


def _two_rows() -> dict[str, torch.Tensor]:
    """Row 0: 1 prompt + 2 response tokens (3 tokens); row 1: 3 prompt + 2 response (5)."""
    input_ids = torch.tensor([[0, 0, 11, 21, 22], [12, 13, 14, 23, 24]])
    attention = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    return {"input_ids": input_ids, "attention_mask": attention, "responses": input_ids[:, 3:]}


def test_packed_layout_and_rank_slices_by_hand():
    from verl_megatron.workers.batching import build_micro_batches
    from verl_megatron.workers.context_parallel import slice_inputs

    (mb,) = build_micro_batches(_two_rows(), [[0, 1]], pack=True, thd=True, cp_size=2)
    inputs = mb.inputs
    # Slots of 4 and 8 tokens (multiples of 2*cp), sequences at the front of their slot.
    assert inputs.input_ids.tolist() == [[11, 21, 22, 0, 12, 13, 14, 23, 24, 0, 0, 0]]
    assert inputs.position_ids.tolist() == [[0, 1, 2, 0, 0, 1, 2, 3, 4, 0, 0, 0]]
    params = inputs.packed_seq_params
    assert params.cu_seqlens_q.tolist() == params.cu_seqlens_q_padded.tolist() == [0, 4, 12]
    assert params.max_seqlen_q == 8
    # Response token t is predicted by the position before it.
    assert inputs.gather_index.tolist() == [[0, 1], [6, 7]]

    # Rank 0 holds positions [0, 3, 4, 5, 10, 11]; rank 1 holds [1, 2, 6, 7, 8, 9].
    rank0 = slice_inputs(inputs, 2, 0, cp_group=None)
    rank1 = slice_inputs(inputs, 2, 1, cp_group=None)
    assert rank0.input_ids.tolist() == [[11, 0, 12, 13, 0, 0]]
    assert rank1.input_ids.tolist() == [[21, 22, 14, 23, 24, 0]]
    assert rank0.position_ids.tolist() == [[0, 0, 0, 1, 0, 0]]
    # Predicting positions of the 4 response tokens (flat over [2, 2]): 0 is rank 0's
    # local 0; 1, 6 and 7 are rank 1's local 0, 2 and 3.
    assert rank0.held_index.tolist() == [0] and rank0.gather_index.tolist() == [0]
    assert rank1.held_index.tolist() == [1, 2, 3] and rank1.gather_index.tolist() == [0, 2, 3]
    assert rank0.labels.tolist() == [21] and rank1.labels.tolist() == [22, 23, 24]
    assert rank0.packed_seq_params is params


def test_cp_needs_packed_thd_rows():
    from verl_megatron.workers.batching import build_micro_batches

    with pytest.raises(ValueError, match=r"context parallelism \(cp=2\) needs packed THD micro-batches"):
        build_micro_batches(_two_rows(), [[0, 1]], pack=False, cp_size=2)


def test_engine_on_cpu_says_what_cp_needs():
    from verl_megatron.distributed.parallel import ParallelLayout, Runtime
    from verl_megatron.errors import ParallelConfigError
    from verl_megatron.workers.model_runner import ModelRunner

    runtime = Runtime(
        layout=ParallelLayout(cp=2, dp=1), rank=0, world_size=2, local_rank=0,
        device=torch.device("cpu"), backend="gloo", seed=0,
    )  # fmt: skip
    expected = (
        "context parallelism (parallel.cp=2) needs Transformer Engine attention on CUDA (megatron's local "
        "attention cannot attend across cp ranks), but this machine has no GPU; set parallel.cp=1 or run "
        "on GPUs with transformer_engine"
    )
    with pytest.raises(ParallelConfigError) as err:
        ModelRunner(runtime, [torch.nn.Linear(1, 1)], use_remove_padding=True, merges_cp=True)
    assert str(err.value) == expected


# ------------------------------------------------------------------ 2-process jobs
def _runtime(cp: int):
    """A runtime whose megatron state has cp ranks (init_runtime refuses cp > 1 without CUDA)."""
    from verl_megatron.distributed.parallel import (
        ParallelLayout,
        build_megatron_groups,
        init_runtime,
        seed_everything,
    )

    runtime = init_runtime(ParallelLayout(), seed=3)
    if cp == 1:
        return runtime
    layout = ParallelLayout(cp=cp).resolve(runtime.world_size)
    build_megatron_groups(layout)
    seed_everything(3)
    return dataclasses.replace(runtime, layout=layout)


def _tokenwise_gpt(pre: bool, post: bool, vp_stage):
    """A GPTModel whose layers are MLP blocks only: each output depends on its own token."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp

    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    spec.submodules.input_layernorm = IdentityOp
    spec.submodules.self_attention = IdentityOp
    spec.submodules.self_attn_bda = IdentityFuncOp
    config = TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=2, ffn_hidden_size=FFN,
        context_parallel_size=ps.get_context_parallel_world_size(), use_cpu_initialization=True,
        params_dtype=torch.float32, pipeline_dtype=torch.float32, hidden_dropout=0.0,
        attention_dropout=0.0, normalization="RMSNorm", add_bias_linear=False,
    )  # fmt: skip
    return GPTModel(
        config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=64,
        pre_process=pre, post_process=post, share_embeddings_and_output_weights=False,
        position_embedding_type="rope", vp_stage=vp_stage,
    )  # fmt: skip


def _policy_step(mb, logits, *, counts: dict, num_micro: int, cfg):
    """The actor's PPO step: per-token values merged over cp before any loss."""
    from verl_megatron.models.logprobs import vocab_parallel_log_probs
    from verl_megatron.trainer.ppo import core_algos
    from verl_megatron.workers.model_runner import StepResult

    log_probs, entropy = vocab_parallel_log_probs(
        mb.inputs.gather(logits), mb.inputs.labels, temperature=TEMPERATURE, calculate_entropy=True
    )
    # Merged values are 0 at padding; the plain path reads some real position there.
    valid = mb.inputs.response_valid
    log_probs = torch.where(valid, mb.inputs.merge_cp(log_probs), 0.0)
    entropy = torch.where(valid, mb.inputs.merge_cp(entropy), 0.0)
    outputs = {"log_probs": log_probs.detach(), "entropy": entropy.detach()}
    if counts is None:
        return StepResult(outputs=outputs)
    t = mb.tensors
    mask = t["response_mask"] * valid
    agg = {k: counts[k] for k in ("dp_size", "batch_num_tokens", "global_batch_size")}
    pg_loss, pg_metrics = core_algos.get_policy_loss_fn("vanilla")(
        t["old_log_probs"],
        log_probs,
        t["advantages"],
        mask,
        cfg.loss_agg_mode,
        cfg,
        None,
        global_batch_info=agg,
    )
    entropy_agg = core_algos.agg_loss(entropy, mask, cfg.loss_agg_mode, **agg)
    kl = core_algos.agg_loss(
        core_algos.kl_penalty(log_probs, t["ref_log_prob"], "low_var_kl"), mask, cfg.loss_agg_mode, **agg
    )
    loss = pg_loss - 0.01 * entropy_agg + 0.1 * kl
    share = float(mask.sum()) / counts["batch_num_tokens"]
    metrics = {
        "pg_loss": pg_loss.detach(),
        "kl": kl.detach(),
        "ppo_kl": torch.tensor(pg_metrics["actor/ppo_kl"] * share),
    }
    return StepResult(
        loss=core_algos.megatron_microbatch_loss(loss, num_micro), metrics=metrics, outputs=outputs
    )


def _run_actor(runner, chunks, optimizer) -> dict:
    """Forward log-probs, then two PPO steps (two mini-batches) like MegatronActor.update_policy."""
    import functools

    from verl_megatron.workers.config import ActorConfig

    cfg = ActorConfig(
        ppo_mini_batch_size=MINI_BATCH,
        ppo_micro_batch_size_per_gpu=MICRO_BATCH,
        loss_agg_mode="seq-mean-token-mean",
    )
    batch = make_batch()
    batch = {k: batch[k] for k in ("input_ids", "attention_mask", "responses", "response_mask", "advantages")}
    size, width = batch["responses"].shape
    mbs = runner.split(batch, micro_batch_size=MICRO_BATCH, use_dynamic_bsz=False, max_token_len=0)
    with torch.no_grad():
        results = runner.run(
            mbs, functools.partial(_policy_step, counts=None, num_micro=0, cfg=cfg), forward_only=True
        )
    out = {key: runner.collect_outputs(results, mbs, key, (size, width)) for key in ("log_probs", "entropy")}
    batch["old_log_probs"] = out["log_probs"]
    batch["ref_log_prob"] = out["log_probs"] - KL_SHIFT * batch["response_mask"]
    out["metrics"], out["grad_norm"] = [], []
    plan = runner.mini_batches(batch, mini_batch_size=MINI_BATCH, epochs=1, shuffle=False, seed=0)
    for local, counts in plan:
        keys = ("response_mask", "advantages", "old_log_probs", "ref_log_prob")
        mbs = runner.split(
            local, micro_batch_size=MICRO_BATCH, use_dynamic_bsz=False, max_token_len=0, tensor_keys=keys
        )
        step = functools.partial(_policy_step, counts=counts, num_micro=len(mbs), cfg=cfg)
        results, grad_norm, stepped = runner.train_step(optimizer, mbs, step)
        assert stepped
        out["metrics"].append(runner.reduce_metrics(results, ("pg_loss", "kl", "ppo_kl")))
        out["grad_norm"].append(grad_norm)
    return out


def actor_job(cp: int) -> dict:
    """Log-probs and two PPO steps of the token-wise model: padded rows at cp=1, packed THD at cp>1."""
    from verl_megatron.models.megatron_model import (
        OptimSettings,
        attach_schedule_hooks,
        build_chunks,
        build_optimizer,
        wrap_ddp,
    )
    from verl_megatron.models.sharding import gather_full_state, load_full_state, seeded_tensor
    from verl_megatron.workers import model_runner as engine

    runtime = _runtime(cp)
    chunks = build_chunks(runtime, _tokenwise_gpt)
    load_full_state(chunks, lambda name, shape: seeded_tensor(name, shape, seed=4, std=0.3))
    chunks = wrap_ddp(chunks)
    attach_schedule_hooks(chunks)
    optimizer = build_optimizer(chunks, OptimSettings(lr=1e-2, weight_decay=0.0, clip_grad=1.0))
    saved = engine.cp_attention_available, engine.uses_transformer_engine
    if cp > 1:
        # Stand in for TE attention: the model has none, so packed THD rows need nothing else.
        engine.cp_attention_available = engine.uses_transformer_engine = lambda chunks: True
    try:
        runner = engine.ModelRunner(runtime, chunks, use_remove_padding=cp > 1, merges_cp=True)
        out = _run_actor(runner, chunks, optimizer)
    finally:
        engine.cp_attention_available, engine.uses_transformer_engine = saved
    out["weights"] = gather_full_state(chunks)
    out["local_tokens"] = int(
        runner.split(make_batch(), micro_batch_size=8, use_dynamic_bsz=False, max_token_len=0)[
            0
        ].inputs.input_ids.numel()
    )
    return out


def merge_contract_job() -> dict:
    """Hand-made per-token values over a real cp group: the merge and its gradient."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    from verl_megatron.workers.context_parallel import held_positions, merge_held

    runtime = _runtime(cp=2)
    group, rank = runtime.cp_group(), runtime.cp_rank
    # megatron's own split of a [2, 16] batch along the sequence.
    tokens = torch.arange(32).view(2, 16)
    megatron = get_batch_on_this_cp_rank({"tokens": tokens.clone()}, cp_group=group)["tokens"]
    ours = tokens[:, held_positions([16], 2, rank)]

    values = torch.linspace(-1.0, 2.0, 12, dtype=torch.float64).view(3, 4)
    held = torch.arange(rank, 12, 2)  # rank 0 holds even flat positions, rank 1 odd ones
    local = values.reshape(-1)[held].clone().requires_grad_(True)
    merged = merge_held(local, held, (3, 4), group)
    _nonlinear_loss(merged).backward()
    return {
        "split_equal": torch.equal(megatron, ours),
        "merged": merged.detach(),
        "held": held,
        "grad": local.grad,
    }


def _nonlinear_loss(values: torch.Tensor) -> torch.Tensor:
    """A loss that mixes positions: per-row mean of squares, then a product over rows."""
    return (values.pow(2).mean(dim=-1) + 1).prod()


def test_merge_matches_megatron_split_and_gradients_add_up(pool2):
    results = pool2.run(f"{__name__}:merge_contract_job")
    values = torch.linspace(-1.0, 2.0, 12, dtype=torch.float64).view(3, 4).requires_grad_(True)
    _nonlinear_loss(values).backward()
    summed = torch.zeros(12, dtype=torch.float64)
    for r in results:
        assert r["split_equal"]
        assert torch.equal(r["merged"], values.detach())
        summed[r["held"]] += r["grad"]
    # Each rank's gradient covers only its own positions; together they are the whole gradient.
    torch.testing.assert_close(summed.view(3, 4), values.grad, rtol=1e-12, atol=0)


@pytest.fixture(scope="module")
def reference(pool1) -> dict:
    return pool1.run(f"{__name__}:actor_job", cp=1)[0]


def test_reference_is_a_real_update(reference):
    assert reference["grad_norm"][0] > 0 and reference["metrics"][1]["ppo_kl"] != 0.0
    assert math.isclose(reference["metrics"][0]["kl"], math.exp(-KL_SHIFT) + KL_SHIFT - 1, rel_tol=1e-5)


def test_cp2_update_matches_one_process(pool2, reference):
    results = pool2.run(f"{__name__}:actor_job", cp=2)
    for r in results:
        # Sequences of 11, 5, 5, 4, 8, 7, 7, 7 tokens take slots of 12, 8, 8, 4, 8, 8, 8, 8
        # (multiples of 2*cp): 64 tokens, 32 on each cp rank.
        assert r["local_tokens"] == 32
        assert_close_report(r["log_probs"], reference["log_probs"], rtol=1e-5, atol=1e-6, what="log_probs")
        assert_close_report(r["entropy"], reference["entropy"], rtol=1e-5, atol=1e-6, what="entropy")
        # The tolerances of tests/test_actor_update.py: the second step's metrics see
        # weights that differ by the first step's float32 noise.
        assert_close_report(r["metrics"], reference["metrics"], rtol=1e-4, atol=1e-6, what="metrics")
        assert_close_report(r["grad_norm"], reference["grad_norm"], rtol=1e-5, atol=0, what="grad_norm")
        assert_adam_weights_close(r["weights"], reference["weights"], lr=1e-2, steps=2, what="weights")
