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

With context parallelism (cp > 1, CUDA and Transformer Engine only) each cp rank runs
its share of every micro-batch's tokens (``context_parallel``); step functions compute
per-token values on ``mb.inputs.gather(output)`` and merge them with
``mb.inputs.merge_cp`` before any loss, so every cp rank computes the same loss,
metrics and outputs. Callers declare that with ``ModelRunner(..., merges_cp=True)``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from verl_megatron.distributed.modules import unwrap
from verl_megatron.distributed.parallel import Runtime
from verl_megatron.errors import ParallelConfigError
from verl_megatron.models.batch_invariant import BatchInvariance
from verl_megatron.models.megatron_model import gather_updated_params, zero_grads
from verl_megatron.models.rotary_positions import rotary_positions
from verl_megatron.models.shared_prefix_attention import SharedPrefixParams
from verl_megatron.workers import context_parallel, moe, shared_prefix, vl_inputs
from verl_megatron.workers.batching import (
    LateRows,
    MicroBatch,
    ModelInputs,
    balanced_token_partition,
    build_micro_batches,
    fixed_size_partition,
    length_grouped_partition,
    mini_batch_rows,
)
from verl_megatron.workers.output_rows import DeferredHead, OutputRowSelector
from verl_megatron.workers.routes import TrainingRoutes

__all__ = ["ModelRunner", "StepResult", "dp_share"]

_LOG = logging.getLogger(__name__)


@dataclass
class StepResult:
    """What a step function returns for one micro-batch (see the module docstring)."""

    loss: torch.Tensor | None = None
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    outputs: dict[str, torch.Tensor] = field(default_factory=dict)


StepFn = Callable[[MicroBatch, torch.Tensor], StepResult]


def uses_transformer_engine(chunks: Sequence[torch.nn.Module]) -> bool:
    """Whether the chunks' attention is Transformer Engine's (which takes THD packed sequences)."""
    return any(type(m).__name__ == "TEDotProductAttention" for c in chunks for m in c.modules())


def cp_attention_available(chunks: Sequence[torch.nn.Module]) -> bool:
    """Whether the chunks can split sequences over cp ranks: Transformer Engine attention on CUDA."""
    return torch.cuda.is_available() and uses_transformer_engine(chunks)


def _check_context_parallel(
    chunks: Sequence[torch.nn.Module], cp: int, *, use_remove_padding: bool, merges_cp: bool
) -> None:
    if not cp_attention_available(chunks):
        why = (
            "this machine has no GPU"
            if not torch.cuda.is_available()
            else "the model chunks use megatron's local attention (install transformer_engine and build "
            "the model with model.use_te null or true)"
        )
        raise ParallelConfigError(
            f"context parallelism (parallel.cp={cp}) needs Transformer Engine attention on CUDA "
            f"(megatron's local attention cannot attend across cp ranks), but {why}; set parallel.cp=1 "
            "or run on GPUs with transformer_engine"
        )
    if not use_remove_padding:
        raise ValueError(
            f"context parallelism (parallel.cp={cp}) splits packed sequences: set use_remove_padding=True"
        )
    if not merges_cp:
        raise ValueError(
            f"context parallelism (parallel.cp={cp}): this worker's step functions do not merge per-token "
            "values across cp ranks (ModelInputs.merge_cp); construct ModelRunner with merges_cp=True "
            "once they do"
        )


def _interleaving_plan(num_micro: int, pp: int) -> tuple[int, int]:
    """(padding micro-batches to add, micro-batch group size) for the interleaved (vpp) schedule.

    megatron's interleaved schedule runs micro-batches in groups of g per virtual stage and
    needs pp <= g <= M with the last group (M mod g) empty or at least pp long. Fewer than
    pp micro-batches are padded up to pp; otherwise g is the smallest size that works
    (g = pp when pp divides M; g = M always works).
    """
    padding = max(pp - num_micro, 0)
    total = num_micro + padding
    group = next(g for g in range(pp, total + 1) if total % g == 0 or total % g >= pp)
    return padding, group


@contextlib.contextmanager
def _schedule_settings(chunks: Sequence[torch.nn.Module], **settings) -> Iterator[None]:
    """Set TransformerConfig fields that megatron's schedule reads, for one schedule call.

    megatron's ``get_forward_backward_func`` takes these options only from the model's config
    (``get_model_config``), so they are set on its declared fields and restored after the call.
    """
    configs = list({id(c): c for c in (unwrap(chunk).config for chunk in chunks)}.values())
    saved = [{name: getattr(c, name) for name in settings} for c in configs]
    for config in configs:
        for name, value in settings.items():
            setattr(config, name, value)
    try:
        yield
    finally:
        for config, values in zip(configs, saved):
            for name, value in values.items():
                setattr(config, name, value)


def model_vocab_size(chunks: Sequence[torch.nn.Module]) -> int | None:
    """The real vocabulary size recorded by the model builder (None: no padded columns to hide)."""
    info = getattr(unwrap(chunks[0]), "verl_model_info", None)
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

    def __init__(
        self,
        runtime: Runtime,
        chunks: list[torch.nn.Module],
        *,
        use_remove_padding: bool,
        merges_cp: bool = False,
        select_output_rows: bool = False,
        share_prefix: bool = False,
        route_replay: TrainingRoutes | None = None,
        batch_invariance: BatchInvariance | None = None,
        group_by_length: bool = False,
    ) -> None:
        self.cp = runtime.layout.cp
        # Micro-batches of rows of similar length (batching.length_grouped_partition).
        self.group_by_length = group_by_length
        if self.cp > 1:
            _check_context_parallel(
                chunks, self.cp, use_remove_padding=use_remove_padding, merges_cp=merges_cp
            )
        self.runtime = runtime
        self.chunks = chunks
        self.pack = use_remove_padding
        self.thd = uses_transformer_engine(chunks)
        config = unwrap(chunks[0]).config
        if self.thd and not self.pack:
            raise ValueError(
                "Transformer Engine attention applies only the causal mask, so padded rows cannot be "
                "told apart from tokens: set use_remove_padding=True (packed THD sequences)"
            )
        if getattr(config, "calculate_per_token_loss", False):
            raise ValueError("TransformerConfig.calculate_per_token_loss must be False for the PPO losses")
        self.align = runtime.layout.tp if getattr(config, "sequence_parallel", False) else 1
        self.vocab_size = model_vocab_size(chunks)
        # Step functions that read the output only through mb.inputs.gather: the LM head then
        # runs at those positions alone (workers/output_rows.py).
        selector = OutputRowSelector(chunks) if select_output_rows else None
        self.row_selector = selector if selector is not None and selector.active else None
        self.moe = moe.is_moe(chunks)
        self.moe_stats = moe.MoEStats(runtime, chunks) if self.moe else None  # empties megatron's tracker
        # MoE routing replay (workers/routes.py): the recorded routes each forward replays.
        self.route_replay = route_replay
        # The bitwise parity mode the chunks were switched to (models/batch_invariant.py).
        self.batch_invariance = batch_invariance
        # Rows sharing a prompt run it once (workers/shared_prefix.py) where the model allows;
        # never under the parity kernels, whose attention takes each sequence alone.
        self.prefix_sharing = None
        if share_prefix and self._prefix_sharing_applies(chunks):
            self.prefix_sharing = shared_prefix.PrefixSharing()

    def _prefix_sharing_applies(self, chunks: list[torch.nn.Module]) -> bool:
        reason = (
            "Transformer Engine attention, context or sequence parallelism"
            if self.thd or self.cp > 1 or self.align > 1
            else shared_prefix.unsupported_reason(chunks)
        )
        if reason is not None:
            _LOG.info(
                "share_prompt_prefix does not apply to this model (%s): rows keep their own prompt", reason
            )
        return reason is None and self.batch_invariance is None

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
        """Micro-batches of ``batch`` (this rank's rows) by count or by token budget.

        ``max_token_len`` is per GPU: under cp a rank holds 1/cp of each micro-batch's
        tokens, so a micro-batch may hold cp times as many (as in verl).
        """
        num_rows = batch["input_ids"].shape[0]
        if not use_dynamic_bsz and not micro_batch_size:
            raise ValueError("a micro-batch size is needed when use_dynamic_bsz is false")
        if self.group_by_length:
            groups = length_grouped_partition(
                batch["attention_mask"].sum(dim=-1).tolist(),
                None if use_dynamic_bsz else micro_batch_size,
                max_token_len * self.cp if use_dynamic_bsz else None,
                self.runtime.dp_group(),
            )
        elif use_dynamic_bsz:
            lengths = batch["attention_mask"].sum(dim=-1).tolist()
            groups = balanced_token_partition(lengths, max_token_len * self.cp, self.runtime.dp_group())
        else:
            groups = fixed_size_partition(num_rows, micro_batch_size)
        micro_batches = build_micro_batches(
            batch,
            groups,
            pack=self.pack,
            thd=self.thd,
            align=self.align,
            uniform=self.runtime.layout.pp > 1,
            tensor_keys=tensor_keys,
            cp_size=self.cp,
            share_prefix=self.prefix_sharing is not None,
        )
        if self.cp > 1:
            rank, group = self.runtime.cp_rank, self.runtime.cp_group()
            for mb in micro_batches:
                mb.inputs = context_parallel.slice_inputs(mb.inputs, self.cp, rank, group)
        return micro_batches

    def mini_batches(
        self,
        batch: dict[str, torch.Tensor],
        *,
        mini_batch_size: int,
        epochs: int,
        shuffle: bool,
        seed: int,
        late: LateRows | None = None,
    ) -> Iterator[tuple[dict[str, torch.Tensor], dict[str, int]]]:
        """For each epoch and global mini-batch: (this dp rank's rows of ``batch``, global counts).

        The counts are agg_loss's global-count arguments for the whole mini-batch over
        all dp ranks: dp_size, batch_num_tokens (response_mask tokens) and
        global_batch_size (sequences with at least one such token). ``late``'s rows are fetched
        when the first mini-batch holding one is cut: the ones before it run while they arrive.
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
                if late is not None and late.due(all_rows):
                    batch, late = late.fill(batch), None
                mask = batch["response_mask"][all_rows]
                counts = {
                    "dp_size": dp,
                    "batch_num_tokens": int(mask.sum()),
                    "global_batch_size": int((mask.sum(dim=-1) > 0).sum()),
                }
                yield {k: v[local_rows] for k, v in batch.items()}, counts

    # ------------------------------------------------------------------ schedule
    def run(
        self,
        micro_batches: list[MicroBatch],
        step_fn: StepFn,
        *,
        forward_only: bool,
        defer_head: bool = False,
    ) -> list[StepResult]:
        """Forward (and backward) every micro-batch; step results on the last stage, [] elsewhere.

        ``defer_head`` (forward only): where the output rows are selected, the step function gets
        a :class:`DeferredHead` instead of the logits and runs the LM head itself, chunk by chunk.

        The interleaved (vpp) schedule needs at least pp micro-batches: missing ones are
        padding (a repeat of the last one with zero loss, no step result), and real losses
        are scaled so that the step functions' ``megatron_microbatch_loss(loss,
        len(micro_batches))`` keeps its meaning.
        """
        from megatron.core.pipeline_parallel import get_forward_backward_func

        results: list[StepResult] = []
        queue, settings = self._schedule_queue(micro_batches)
        loss_scale = len(queue) / len(micro_batches)

        replay = self.route_replay
        if replay is not None:
            replay.prepare(micro_batches, forward_only)

        def forward_step(data_iterator, model):
            mb, real = next(data_iterator)
            if replay is not None:
                replay.before_forward(mb, model, count=real)
            inputs = mb.inputs
            if self.row_selector is not None:
                mb = dataclasses.replace(mb, inputs=self.row_selector.prepare(inputs))
            head = DeferredHead() if defer_head and self.row_selector is not None else None
            if self.moe_stats is not None:  # a padding repeat counts in no MoE metric
                self.moe_stats.before_forward(real)
            output = self._forward(model, inputs, head)
            if self.moe_stats is not None:  # the aux loss gets the policy loss's factor: cp / real mbs
                scale = self.cp / len(micro_batches) if real else 0.0
                self.moe_stats.before_backward(output, real, scale, unwrap(model).config)

            def loss_func(output_tensor):
                if not real:
                    # Connected to the graph so the backward runs, with a zero gradient.
                    return (output_tensor * 0).sum(), {}
                result = step_fn(mb, output_tensor if head is None or head.layer is None else head)
                results.append(result)
                if result.loss is None:
                    return output_tensor.new_zeros(()), {}
                return result.loss * loss_scale, {}

            return output, loss_func

        iterators = [iter(queue) for _ in self.chunks]
        shape = micro_batches[0].inputs.input_ids.shape
        for chunk in self.chunks:
            chunk.train(not forward_only)
        with (
            torch.set_grad_enabled(not forward_only),
            _schedule_settings(self.chunks, **settings),
            replay.running() if replay is not None else contextlib.nullcontext(),
        ):
            get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iterators if len(self.chunks) > 1 else iterators[0],
                model=self.chunks if len(self.chunks) > 1 else self.chunks[0],
                num_microbatches=len(queue),
                # The whole sequence: megatron divides by cp (and by tp with sequence parallelism).
                seq_length=int(shape[1]) * self.cp,
                micro_batch_size=int(shape[0]),
                forward_only=forward_only,
            )
        return results

    def _schedule_queue(
        self, micro_batches: list[MicroBatch]
    ) -> tuple[list[tuple[MicroBatch, bool]], dict[str, object]]:
        """(micro-batches to run, each with whether it is real, TransformerConfig settings for the call)."""
        settings: dict[str, object] = {
            # Every micro-batch of one call has the shape passed below (``uniform`` in split), so
            # stages need not exchange shapes. megatron sends that exchange as one batched p2p
            # call, which gloo mismatches under the interleaved schedule with pp=2 (the
            # previous and next stage are the same peer).
            "variable_seq_lengths": False
        }
        queue = [(mb, True) for mb in micro_batches]
        if len(self.chunks) > 1:
            padding, group = _interleaving_plan(len(micro_batches), self.runtime.layout.pp)
            queue += [(micro_batches[-1], False)] * padding
            settings["microbatch_group_size_per_vp_stage"] = group
        return queue, settings

    def _forward(
        self, model: torch.nn.Module, inputs: ModelInputs, head: DeferredHead | None = None
    ) -> torch.Tensor:
        """One micro-batch through one chunk; the layout's features go in as explicit arguments
        (the shared-prompt layout as ``packed_seq_params``; rotary positions and the output rows
        to compute for this call only)."""
        device = self.runtime.device
        selecting = (
            self.row_selector.selecting(inputs, head) if self.row_selector else contextlib.nullcontext()
        )
        with rotary_positions(model, self._rotary_index(inputs)), selecting:
            return model(
                inputs.input_ids.to(device),
                inputs.position_ids.to(device),
                None if inputs.attention_mask is None else inputs.attention_mask.to(device),
                packed_seq_params=_packed_params(inputs, device),
                **(moe.model_kwargs(inputs, device) if self.moe else {}),
                **vl_inputs.model_kwargs(inputs, device),
            )

    def _rotary_index(self, inputs: ModelInputs) -> torch.Tensor | None:
        """[S] rotary position of each model column where it is not the column index, else None."""
        if self.prefix_sharing is not None and inputs.shared_prefix is not None:
            return self.prefix_sharing.rotary_index(inputs)
        if self.batch_invariance is not None:
            return self.batch_invariance.rotary_positions(inputs.position_ids)
        return None

    def train_step(
        self, optimizer, micro_batches: list[MicroBatch], step_fn: StepFn
    ) -> tuple[list[StepResult], float, bool]:
        """One optimizer step over the micro-batches: (step results, grad norm, stepped).

        A non-finite gradient norm skips the update (gradients are zeroed) and returns
        stepped=False; every rank sees the same norm, so all ranks skip together.
        """
        zero_grads(self.chunks, optimizer)
        results = self.run(micro_batches, step_fn, forward_only=False)
        # megatron's optimizer.step() would prepare the grads and compute the norm again:
        # its pieces are called here once each.
        found_inf = optimizer.prepare_grads()
        grad_norm = float("nan") if found_inf else float(optimizer.get_grad_norm())
        if not math.isfinite(grad_norm):
            zero_grads(self.chunks, optimizer)
            return results, grad_norm, False
        clip_by_norm(optimizer, grad_norm)
        stepped = optimizer.step_with_ready_grads()
        return results, grad_norm, bool(stepped)

    def gather_params(self) -> None:
        """Collective over dp: complete the last update's parameter all-gather (distributed
        optimizer with overlap_param_gather) before whole parameters are read outside a forward."""
        gather_updated_params(self.chunks)

    # ------------------------------------------------------------------ moving results
    def _last_stage_rank(self) -> int:
        return self.runtime.pp_peer_rank("last")

    def _broadcast_pp(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.runtime.layout.pp == 1:
            return tensor
        on_device = tensor.to(self.runtime.device)
        dist.broadcast(on_device, src=self._last_stage_rank(), group=self.runtime.pp_group())
        return on_device.cpu()

    def collect_outputs(
        self,
        results: list[StepResult],
        micro_batches: list[MicroBatch],
        key: str,
        shape: tuple[int, ...],
        dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        """Per-token outputs ``key`` of this rank's micro-batches as [rows, Tr, ...] in ``dtype``, in
        row order, on every stage."""
        out = torch.zeros(shape, dtype=dtype)
        if self.runtime.is_pp_last:
            for mb, result in zip(micro_batches, results):
                out[mb.rows] = result.outputs[key].detach().to(dtype).cpu()
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

    def ppo_epochs(
        self,
        batch: dict[str, torch.Tensor],
        optimizer,
        *,
        cfg,
        seed: int,
        tensor_keys: Sequence[str],
        loss_step: Callable[..., StepResult],
        metric_names: Sequence[str],
        prefix: str,
        late: LateRows | None = None,
    ) -> tuple[dict[str, list[float]], int]:
        """PPO epochs over mini-batches, one optimizer step each: the loop the actor and critic share.

        ``cfg`` supplies verl's batching fields (ppo_mini_batch_size, rollout_n, ppo_epochs,
        shuffle, ppo_micro_batch_size_per_gpu, use_dynamic_bsz, ppo_max_token_len_per_gpu,
        loss_scale_factor). ``loss_step(mb, output, counts=, num_micro=)`` returns a micro-batch's
        loss and metric partial sums. Returns ``{prefix}/<metric>`` and ``{prefix}/grad_norm``
        lists (one value per optimizer step) and the number of steps skipped for a non-finite
        gradient norm. ``late``: rows whose values arrive during the update (``mini_batches``).
        """
        history: dict[str, list[float]] = {f"{prefix}/{n}": [] for n in (*metric_names, "grad_norm")}
        skipped = 0
        mini_batches = self.mini_batches(
            batch,
            mini_batch_size=cfg.ppo_mini_batch_size * cfg.rollout_n,
            epochs=cfg.ppo_epochs,
            shuffle=cfg.shuffle,
            seed=seed,
            late=late,
        )
        for local, counts in mini_batches:
            counts["loss_scale_factor"] = cfg.loss_scale_factor
            mbs = self.split(
                local,
                micro_batch_size=cfg.ppo_micro_batch_size_per_gpu,
                use_dynamic_bsz=cfg.use_dynamic_bsz,
                max_token_len=cfg.ppo_max_token_len_per_gpu,
                tensor_keys=tensor_keys,
            )
            step = functools.partial(loss_step, counts=counts, num_micro=len(mbs))
            results, grad_norm, stepped = self.train_step(optimizer, mbs, step)
            skipped += 0 if stepped else 1
            for name, value in self.reduce_metrics(results, metric_names).items():
                history[f"{prefix}/{name}"].append(value)
            history[f"{prefix}/grad_norm"].append(grad_norm)
        return history, skipped

    def reduce_metrics(self, results: list[StepResult], names: Sequence[str]) -> dict[str, float]:
        """Sum the named metric partial sums over micro-batches and dp ranks; same on every rank."""
        totals = torch.zeros(len(names), dtype=torch.float64)
        if self.runtime.is_pp_last and results:
            # Summed where the metrics live, moved to the host once (not once per micro-batch).
            zero = torch.zeros((), dtype=torch.float64)
            per_name = [
                torch.stack(
                    [torch.as_tensor(r.metrics[name]).detach().double() for r in results if name in r.metrics]
                    or [zero]
                ).sum()
                for name in names
            ]
            totals = torch.stack([t.to(per_name[0].device) for t in per_name]).cpu()
        if self.runtime.layout.dp > 1:
            totals = totals.to(self.runtime.device)
            dist.all_reduce(totals, group=self.runtime.dp_group())
            totals = totals.cpu()
        totals = self._broadcast_pp(totals)
        return dict(zip(names, totals.tolist()))


def clip_by_norm(optimizer, grad_norm: float) -> None:
    """Clip every (sub-)optimizer's main grads to its ``clip_grad`` with the global norm computed once."""
    from megatron.core.optimizer import optimizer as mcore_optimizer

    for sub in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        params = sub.get_parameters()
        if sub.config.clip_grad > 0.0 and params:
            # Looked up on the module at call time: the CPU layer replaces it.
            mcore_optimizer.clip_grad_by_total_norm_fp32(
                params,
                max_norm=sub.config.clip_grad,
                total_norm=grad_norm,
                use_decoupled_grad=sub.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8,
            )


def _packed_params(inputs: ModelInputs, device: torch.device):
    """The model call's ``packed_seq_params``: the shared-prompt layout (read by the SDPA core
    attention), THD boundaries moved to ``device``, or None."""
    if inputs.shared_prefix is not None:
        return SharedPrefixParams.of(inputs.shared_prefix)
    packed = inputs.packed_seq_params
    if packed is None or device.type == "cpu":
        return packed
    names = ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded")
    moved = {n: v.to(device) for n in names if isinstance(v := getattr(packed, n, None), torch.Tensor)}
    # A moved copy: the batch's own parameters stay as they were.
    return dataclasses.replace(packed, **moved)
