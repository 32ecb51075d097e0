"""The tiny megatron GPTModel, its batches and token-mean training schedule, shared by the layout tests.

``make_gpt`` builds one model chunk with the local layer spec (RoPE, RMSNorm, no biases, no
dropout unless asked) under whatever tp/pp/vpp the megatron state holds; ``token_mean_schedule``
splits a global batch over dp ranks and micro-batches and makes the loss the global token mean of
a float64 cross-entropy, whatever the layout. Each test module keeps its own sizes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch


def make_gpt(
    pre: bool,
    post: bool,
    vp_stage: int | None,
    *,
    vocab: int,
    seq: int,
    hidden: int,
    layers: int,
    heads: int,
    groups: int,
    ffn: int,
    dtype: torch.dtype = torch.float64,
    tied: bool = False,
    route: Any = None,
    **config: Any,
):
    """One GPTModel chunk; ``config`` overrides TransformerConfig fields (dropout, SwiGLU, ...);
    ``tied``: the LM head shares the embedding's weight; ``route``: a ``models.matmul_route.MatmulRoute``
    for the linears and embedding to consult, as the builder gives them (None: megatron's layers)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    settings = {
        "num_layers": layers,
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_query_groups": groups,
        "ffn_hidden_size": ffn,
        "tensor_model_parallel_size": ps.get_tensor_model_parallel_world_size(),
        "pipeline_model_parallel_size": ps.get_pipeline_model_parallel_world_size(),
        "virtual_pipeline_model_parallel_size": ps.get_virtual_pipeline_model_parallel_world_size(),
        "use_cpu_initialization": True,
        "params_dtype": dtype,
        "pipeline_dtype": dtype,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "normalization": "RMSNorm",
        "add_bias_linear": False,
        **config,
    }
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    if route is not None:
        from verl_megatron.models.matmul_route import route_spec

        spec = route_spec(spec, route)
    model = GPTModel(
        config=TransformerConfig(**settings),
        transformer_layer_spec=spec,
        vocab_size=vocab,
        max_sequence_length=seq,
        pre_process=pre,
        post_process=post,
        share_embeddings_and_output_weights=tied,
        position_embedding_type="rope",
        vp_stage=vp_stage,
    )
    if route is not None:
        from verl_megatron.models.matmul_route import route_embedding_and_head

        route_embedding_and_head(model, route)
    return model


def token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """[B, T] float64 cross-entropy from [B, T, V/tp] logit slices (gathered, differentiably).

    Computed here rather than by megatron's vocab-parallel cross-entropy, which casts to float32.
    """
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    full = gather_from_tensor_model_parallel_region(logits)
    return -torch.log_softmax(full, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def token_mean_schedule(
    batch: dict[str, torch.Tensor], *, micro_batch: int, seq: int, dp: int, dp_rank: int
) -> tuple[Callable[[], Iterator[dict]], Callable, int]:
    """(micro_batches, forward_step, num_micro) for megatron's ``forward_backward_func``.

    ``batch`` is the global batch (input_ids, labels, loss_mask); this dp rank takes its rows, in
    micro-batches of ``micro_batch``. The loss is the global token mean: megatron's schedule
    divides by num_micro and DDP averages over dp, so both are multiplied back in. Each micro-batch
    reports its ``token_sum``.
    """
    total_tokens = batch["loss_mask"].sum()
    rows = len(batch["input_ids"]) // dp
    shard = {k: v[dp_rank * rows : (dp_rank + 1) * rows] for k, v in batch.items()}
    num_micro = rows // micro_batch

    def micro_batches() -> Iterator[dict]:
        for i in range(num_micro):
            yield {k: v[i * micro_batch : (i + 1) * micro_batch] for k, v in shard.items()}

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        positions = torch.arange(seq).unsqueeze(0).expand(micro_batch, -1)

        def loss_func(logits):
            token_sum = (token_losses(logits, mb["labels"]) * mb["loss_mask"]).sum()
            return token_sum / total_tokens * dp * num_micro, {"token_sum": token_sum.detach()}

        return model(mb["input_ids"], positions, None), loss_func

    return micro_batches, forward_step, num_micro


def uneven_batch(
    vocab: int, rows: int, seq: int, seed: int = 0, mask_dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """A global batch of random tokens: ``input_ids`` / ``labels`` [rows, seq] (labels shifted by
    one) and a ``loss_mask`` [rows, seq] of ``mask_dtype`` whose valid lengths run from seq // 2
    to seq, so the token-count normalisation matters."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (rows, seq + 1), generator=g)
    lengths = torch.randint(seq // 2, seq + 1, (rows,), generator=g)
    mask = (torch.arange(seq)[None, :] < lengths[:, None]).to(mask_dtype)
    return {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": mask}


def seeded_chunks(layout: Any, make: Callable, *, layers: int, heads: int, groups: int) -> tuple[Any, list]:
    """(runtime, model chunks) under ``layout`` (a ParallelLayout), every weight set from its
    global name (``seeded_tensor``, seed 3): the same model whatever the sharding."""
    from verl_megatron.distributed.parallel import init_runtime
    from verl_megatron.models.megatron_model import build_chunks
    from verl_megatron.models.sharding import load_full_state, seeded_tensor

    runtime = init_runtime(layout, seed=7)
    runtime.layout.check_model(num_layers=layers, num_attention_heads=heads, num_query_groups=groups)
    chunks = build_chunks(runtime, make)
    load_full_state(chunks, lambda name, shape: seeded_tensor(name, shape, seed=3))
    return runtime, chunks


def run_schedule(
    chunks: list, micro_batches: Callable[[], Iterator], forward_step: Callable, num_micro: int, *, seq: int,
    micro_batch: int,
) -> list[dict]:  # fmt: skip
    """megatron's forward_backward_func over ``chunks`` (one data iterator per virtual stage);
    returns what each micro-batch's loss function reported (on the last pipeline stage)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=[micro_batches() for _ in chunks] if len(chunks) > 1 else micro_batches(),
        model=chunks if len(chunks) > 1 else chunks[0],
        num_microbatches=num_micro,
        seq_length=seq,
        micro_batch_size=micro_batch,
        forward_only=False,
    )


def global_token_loss(runtime: Any, out: list[dict], total_tokens: torch.Tensor) -> float:
    """The step's global token-mean loss from ``token_mean_schedule``'s reports: the token sums
    live on the last pipeline stage of each dp replica (and again on every tp rank, counted once
    here), summed over all ranks and divided by the global token count."""
    local = torch.tensor(sum(float(o["token_sum"]) for o in out) if out else 0.0, dtype=torch.float64)
    if runtime.tp_rank != 0:
        local.zero_()
    torch.distributed.all_reduce(local)
    return float(local) / float(total_tokens)
