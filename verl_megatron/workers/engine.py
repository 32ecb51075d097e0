"""Run micro-batches through megatron's schedule; shared by the actor, reference and critic.

``ModelRunner`` wraps this rank's model chunks: it builds micro-batches from a batch
(``batching``), runs them through ``get_forward_backward_func`` (no pipelining, 1F1B or
interleaved, chosen by megatron from the layout) with a per-micro-batch step function,
and moves results between ranks. A step function receives the micro-batch and the
model output of the last pipeline stage and returns a :class:`StepResult`:

- ``loss``: the scalar megatron backpropagates (already scaled with
  ``core_algos.megatron_microbatch_loss``), or None in forward-only runs;
- ``metrics``: scalar *partial sums*, chosen so that the sum over every micro-batch of
  every data-parallel rank is the value for the whole mini-batch;
- ``outputs``: per-token tensors [r, Tr] for the micro-batch's rows.

Only the last pipeline stage computes step results. ``collect_outputs`` and
``reduce_metrics`` bring them to every rank (broadcast over the pipeline group,
all-gather / all-reduce over the data-parallel group).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from verl_megatron.distributed.parallel import Runtime
from verl_megatron.models.megatron_model import zero_grads
from verl_megatron.workers.batching import (
    MicroBatch,
    balanced_token_partition,
    build_micro_batches,
    fixed_size_partition,
    mini_batch_rows,
)

__all__ = ["ModelRunner", "StepResult", "dp_share"]


@dataclass
class StepResult:
    """What a step function returns for one micro-batch (see the module docstring)."""

    loss: torch.Tensor | None = None
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    outputs: dict[str, torch.Tensor] = field(default_factory=dict)


StepFn = Callable[[MicroBatch, torch.Tensor], StepResult]


def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def uses_transformer_engine(chunks: Sequence[torch.nn.Module]) -> bool:
    """Whether the chunks' attention is Transformer Engine's (which takes THD packed sequences)."""
    return any(type(m).__name__ == "TEDotProductAttention" for c in chunks for m in c.modules())


def model_vocab_size(chunks: Sequence[torch.nn.Module]) -> int | None:
    """The real vocabulary size recorded by the model builder (None: no padded columns to hide)."""
    info = getattr(_unwrap(chunks[0]), "verl_model_info", None)
    return None if info is None else int(info.vocab_size)


def dp_share(batch_size: int, dp_size: int, dp_rank: int) -> torch.Tensor:
    """Row indices of this dp rank's contiguous share of a batch, padded by wrapping around.

    Every rank gets ceil(B / dp) rows; the padding rows repeat the first rows of the
    batch and are dropped again by :meth:`ModelRunner.gather_dp`.
    """
    share = math.ceil(batch_size / dp_size)
    return torch.arange(dp_rank * share, (dp_rank + 1) * share) % batch_size


class ModelRunner:
    """This rank's model chunks plus the machinery to run micro-batches through them."""

    def __init__(self, runtime: Runtime, chunks: list[torch.nn.Module], *, use_remove_padding: bool) -> None:
        if runtime.layout.cp > 1:
            raise NotImplementedError(
                "context parallelism (cp > 1) is not supported by the actor/critic workers yet"
            )
        self.runtime = runtime
        self.chunks = chunks
        self.pack = use_remove_padding
        self.thd = uses_transformer_engine(chunks)
        config = _unwrap(chunks[0]).config
        if self.thd and not self.pack:
            raise ValueError(
                "Transformer Engine attention applies only the causal mask, so padded rows cannot be "
                "told apart from tokens: set use_remove_padding=True (packed THD sequences)"
            )
        if getattr(config, "calculate_per_token_loss", False):
            raise ValueError("TransformerConfig.calculate_per_token_loss must be False for the PPO losses")
        self.align = runtime.layout.tp if getattr(config, "sequence_parallel", False) else 1
        self.vocab_size = model_vocab_size(chunks)

    # ------------------------------------------------------------------ micro-batches
    def split(
        self,
        batch: dict[str, torch.Tensor],
        *,
        micro_batch_size: int | None,
        use_dynamic_bsz: bool,
        max_token_len: int,
        tensor_keys: Sequence[str] = (),
    ) -> list[MicroBatch]:
        """Micro-batches of ``batch`` (this rank's rows) by count or by token budget."""
        num_rows = batch["input_ids"].shape[0]
        if use_dynamic_bsz:
            lengths = batch["attention_mask"].sum(dim=-1).tolist()
            groups = balanced_token_partition(lengths, max_token_len, self.runtime.dp_group())
        else:
            if not micro_batch_size:
                raise ValueError("a micro-batch size is needed when use_dynamic_bsz is false")
            groups = fixed_size_partition(num_rows, micro_batch_size)
        return build_micro_batches(
            batch,
            groups,
            pack=self.pack,
            thd=self.thd,
            align=self.align,
            uniform=self.runtime.layout.pp > 1,
            tensor_keys=tensor_keys,
        )

    def mini_batches(
        self, batch: dict[str, torch.Tensor], *, mini_batch_size: int, epochs: int, shuffle: bool, seed: int
    ) -> Iterator[tuple[dict[str, torch.Tensor], dict[str, int]]]:
        """For each epoch and global mini-batch: (this dp rank's rows of ``batch``, global counts).

        The counts are agg_loss's global-count arguments for the whole mini-batch over
        all dp ranks: dp_size, batch_num_tokens (response_mask tokens) and
        global_batch_size (sequences with at least one such token).
        """
        dp = self.runtime.layout.dp
        size = batch["response_mask"].shape[0]
        for epoch in range(epochs):
            plan = mini_batch_rows(
                size,
                mini_batch_size,
                dp_size=dp,
                dp_rank=self.runtime.dp_rank,
                shuffle=shuffle,
                seed=seed,
                epoch=epoch,
            )
            for all_rows, local_rows in plan:
                mask = batch["response_mask"][all_rows]
                counts = {
                    "dp_size": dp,
                    "batch_num_tokens": int(mask.sum()),
                    "global_batch_size": int((mask.sum(dim=-1) > 0).sum()),
                }
                yield {k: v[local_rows] for k, v in batch.items()}, counts

    # ------------------------------------------------------------------ schedule
    def run(
        self, micro_batches: list[MicroBatch], step_fn: StepFn, *, forward_only: bool
    ) -> list[StepResult]:
        """Forward (and backward) every micro-batch; step results on the last stage, [] elsewhere."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        results: list[StepResult] = []
        device = self.runtime.device

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            inputs = mb.inputs
            output = model(
                inputs.input_ids.to(device),
                inputs.position_ids.to(device),
                None if inputs.attention_mask is None else inputs.attention_mask.to(device),
                packed_seq_params=_to_device(inputs.packed_seq_params, device),
            )

            def loss_func(output_tensor):
                result = step_fn(mb, output_tensor)
                results.append(result)
                loss = result.loss if result.loss is not None else output_tensor.new_zeros(())
                return loss, {}

            return output, loss_func

        iterators = [iter(micro_batches) for _ in self.chunks]
        shape = micro_batches[0].inputs.input_ids.shape
        for chunk in self.chunks:
            chunk.train(not forward_only)
        with torch.set_grad_enabled(not forward_only):
            get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iterators if len(self.chunks) > 1 else iterators[0],
                model=self.chunks if len(self.chunks) > 1 else self.chunks[0],
                num_microbatches=len(micro_batches),
                seq_length=int(shape[1]),
                micro_batch_size=int(shape[0]),
                forward_only=forward_only,
            )
        return results

    def train_step(
        self, optimizer, micro_batches: list[MicroBatch], step_fn: StepFn
    ) -> tuple[list[StepResult], float, bool]:
        """One optimizer step over the micro-batches: (step results, grad norm, stepped).

        A non-finite gradient norm skips the update (gradients are zeroed) and returns
        stepped=False; every rank sees the same norm, so all ranks skip together.
        """
        zero_grads(self.chunks, optimizer)
        results = self.run(micro_batches, step_fn, forward_only=False)
        found_inf = optimizer.prepare_grads()
        grad_norm = float("nan") if found_inf else float(optimizer.get_grad_norm())
        if not math.isfinite(grad_norm):
            zero_grads(self.chunks, optimizer)
            return results, grad_norm, False
        stepped, _, _ = optimizer.step()
        return results, grad_norm, bool(stepped)

    # ------------------------------------------------------------------ moving results
    def _last_stage_rank(self) -> int:
        from megatron.core import parallel_state as ps

        return ps.get_pipeline_model_parallel_last_rank()

    def _broadcast_pp(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.runtime.layout.pp == 1:
            return tensor
        on_device = tensor.to(self.runtime.device)
        dist.broadcast(on_device, src=self._last_stage_rank(), group=self.runtime.pp_group())
        return on_device.cpu()

    def collect_outputs(
        self, results: list[StepResult], micro_batches: list[MicroBatch], key: str, shape: tuple[int, int]
    ) -> torch.Tensor:
        """Per-token outputs ``key`` of this rank's micro-batches as [rows, Tr], in row order, on every stage."""
        out = torch.zeros(shape, dtype=torch.float32)
        if self.runtime.is_pp_last:
            for mb, result in zip(micro_batches, results):
                out[mb.rows] = result.outputs[key].detach().float().cpu()
        return self._broadcast_pp(out)

    def gather_dp(self, local: torch.Tensor, batch_size: int) -> torch.Tensor:
        """Concatenate the dp ranks' shares (see :func:`dp_share`) and drop the wrap-around padding."""
        dp = self.runtime.layout.dp
        if dp > 1:
            on_device = local.contiguous().to(self.runtime.device)
            parts = [torch.empty_like(on_device) for _ in range(dp)]
            dist.all_gather(parts, on_device, group=self.runtime.dp_group())
            local = torch.cat(parts, dim=0).cpu()
        return local[:batch_size]

    def reduce_metrics(self, results: list[StepResult], names: Sequence[str]) -> dict[str, float]:
        """Sum the named metric partial sums over micro-batches and dp ranks; same on every rank."""
        totals = torch.zeros(len(names), dtype=torch.float64)
        if self.runtime.is_pp_last:
            for result in results:
                for i, name in enumerate(names):
                    if name in result.metrics:
                        totals[i] += float(result.metrics[name])
        if self.runtime.layout.dp > 1:
            totals = totals.to(self.runtime.device)
            dist.all_reduce(totals, group=self.runtime.dp_group())
            totals = totals.cpu()
        totals = self._broadcast_pp(totals)
        return dict(zip(names, totals.tolist()))


def _to_device(packed, device: torch.device):
    if packed is None or device.type == "cpu":
        return packed
    for name in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        value = getattr(packed, name, None)
        if isinstance(value, torch.Tensor):
            setattr(packed, name, value.to(device))
    return packed
