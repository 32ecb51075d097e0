"""Run the LM head only at the positions a policy step reads (issue 19).

The actor and the reference read the logits at the response positions only (about
Tr / T of a micro-batch's positions). megatron's GPTModel computes the [S, b, V] logits
of every position and then copies them to [b, S, V]; at a large vocabulary that head
matmul, the copy and their gradients are a large part of an update and the largest
tensor of the log-prob stage. With this selector the output layer receives the hidden
states of the response positions only, [K, 1, h] in ``gather_index`` order, so the
model returns [1, K, V] (already contiguous: no copy) and ``ModelInputs.gather`` turns
it into [r, Tr, V] as a view.

Each selected row is the same row-wise product as before (each logit row depends only
on its own hidden row); the head's weight gradient sums over the selected rows instead
of all rows, whose other rows contributed exact zeros.

It applies where the output layer sees whole sequences: not with sequence parallelism
(the layer gathers the sequence itself) and not with multi-token prediction.

Forward only (log-probs), the head can also be deferred (:class:`DeferredHead`): the output
layer runs on none of the rows inside the model call, and the step function runs the same layer
on chunks of the selected rows afterwards, so no [K, V] float32 logits tensor exists at once. At
Qwen2.5-0.5B's vocabulary (151936) one micro-batch of 96 response rows is 55.6 MiB of logits;
a 16 MiB chunk is 27 rows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator, Sequence

import torch

from verl_megatron.distributed.modules import unwrap
from verl_megatron.models.logprobs import rows_per_chunk, vocab_parallel_log_probs
from verl_megatron.workers.model_inputs import ModelInputs

__all__ = ["DeferredHead", "OutputRowSelector", "head_log_probs"]


def _output_layers(chunks: Sequence[torch.nn.Module]) -> list[torch.nn.Module] | None:
    """The output layers of this rank's last-stage chunks ([] on other stages); None where
    selecting rows before them would be wrong."""
    layers = []
    for chunk in chunks:
        model = unwrap(chunk)
        if not getattr(model, "post_process", False):
            continue
        layer = getattr(model, "output_layer", None)
        config = getattr(model, "config", None)
        if (
            layer is None
            or getattr(layer, "sequence_parallel", False)
            or getattr(config, "mtp_num_layers", None)
        ):
            return None
        layers.append(layer)
    return layers


class _FoldableGrad(torch.autograd.Function):
    """Identity on the selected rows' logits [K, 1, V] whose backward re-strides the gradient.

    The gradient comes back through megatron's [K, 1, V] -> [1, K, V] transpose with strides
    (V, K*V, 1): contiguous by torch's rules (dimension 1 has size 1), so ``contiguous()`` keeps it,
    but ``torch.matmul`` only folds a 3-d operand into one matrix product when its strides chain.
    A frozen output layer (LoRA) computes its input gradient as ``grad_output.matmul(weight)``,
    which for that gradient became K batched vector products over the whole [V, h] weight: 2.2 s
    instead of ~0.05 s per micro-batch at V=32000, h=512, K=768.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor) -> torch.Tensor:
        return logits.view_as(logits)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.reshape(-1, grad.shape[-1]).view(grad.shape)


def _foldable_grad(module, args, output):
    logits, bias = output
    if torch.is_grad_enabled() and logits.requires_grad:
        logits = _FoldableGrad.apply(logits)
    return logits, bias


@dataclasses.dataclass
class DeferredHead:
    """One micro-batch's LM head, not yet run (forward only): the output layer, its input rows
    [K, 1, h] in ``gather_index`` order and the keyword arguments of its call (the tied weight)."""

    layer: torch.nn.Module | None = None
    hidden: torch.Tensor | None = None
    kwargs: dict = dataclasses.field(default_factory=dict)

    @property
    def rows(self) -> int:
        return 0 if self.hidden is None else self.hidden.shape[0]

    @property
    def local_vocab(self) -> int:
        """Columns of this rank's logits: rows of the weight the layer is called with."""
        weight = self.kwargs.get("weight")
        return (weight if weight is not None else self.layer.weight).shape[0]

    def logits(self, start: int, stop: int) -> torch.Tensor:
        """[stop - start, Vl] logits of the selected rows ``start:stop``: the output layer itself
        on those rows (each logit row depends on its own hidden row alone)."""
        if self.layer is None or self.hidden is None:
            raise RuntimeError("DeferredHead.logits: the output layer has not run in this model call")
        out, _ = self.layer(self.hidden[start:stop], **self.kwargs)
        return out.reshape(stop - start, out.shape[-1])


def head_log_probs(
    head: DeferredHead, labels: torch.Tensor, settings: dict, rows: int | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``vocab_parallel_log_probs(logits, labels, **settings)`` of the deferred head's rows, shaped
    like ``labels``, with one chunk of ``CHUNK_BYTES`` of float32 logits alive at a time (the log-prob
    function's own chunk, so each call is one of its chunks; ``rows`` overrides it). Every tp rank
    holds the same rows, so the chunks' collectives match."""
    device = head.hidden.device
    flat = labels.reshape(-1).to(device)
    if flat.numel() != head.rows:
        raise ValueError(f"head_log_probs: {flat.numel()} labels for {head.rows} selected rows")
    rows = rows_per_chunk(head.local_vocab, rows)
    # Each chunk's logits are a temporary of its call: freed before the next chunk's are made.
    parts = [
        vocab_parallel_log_probs(
            head.logits(start, min(start + rows, head.rows)),
            flat[start : start + rows],
            chunk_rows=rows,
            **settings,
        )
        for start in range(0, head.rows, rows)
    ]
    empty = torch.zeros(0, dtype=torch.float32, device=device)
    log_probs = torch.cat([p[0] for p in parts]) if parts else empty
    entropy = None
    if settings.get("calculate_entropy"):
        entropy = (torch.cat([p[1] for p in parts]) if parts else empty).view(labels.shape)
    return log_probs.view(labels.shape), entropy


def _select_rows(flat: torch.Tensor, defer: DeferredHead | None, module, args, kwargs):
    """Forward pre-hook: the output layer's input [S, b, h] -> the rows ``flat`` names, [K, 1, h].
    With ``defer``, the rows (and the call's arguments) go there and the layer gets none of them."""
    hidden = args[0]  # position (row i, column j) of gather_index's flat i * S + j
    s, b = hidden.shape[0], hidden.shape[1]
    flat = flat.to(hidden.device)
    rows = (flat % s) * b + torch.div(flat, s, rounding_mode="floor")
    picked = hidden.reshape(s * b, *hidden.shape[2:]).index_select(0, rows).unsqueeze(1)
    if defer is not None:
        defer.layer, defer.hidden, defer.kwargs = module, picked, dict(kwargs)
        picked = picked[:0]
    return (picked, *args[1:]), kwargs


class OutputRowSelector:
    """Forward pre-hooks on the output layers that keep only one micro-batch's rows, for its call."""

    def __init__(self, chunks: Sequence[torch.nn.Module]) -> None:
        self.layers = _output_layers(chunks)

    @property
    def active(self) -> bool:
        return self.layers is not None

    def prepare(self, inputs: ModelInputs) -> ModelInputs:
        """The inputs a micro-batch's step function must use when its call ran :meth:`selecting`."""
        return dataclasses.replace(inputs, output_rows_selected=True)

    @contextlib.contextmanager
    def selecting(self, inputs: ModelInputs, defer: DeferredHead | None = None) -> Iterator[None]:
        """For one model call: the output layers see only the rows of ``inputs.gather_index``.
        The hooks are removed on exit, so no micro-batch's rows outlive its call. With ``defer``
        (forward only) they see none: the rows land in ``defer`` for the step function."""
        if defer is not None and torch.is_grad_enabled():
            raise RuntimeError("OutputRowSelector: the LM head is deferred in forward-only calls only")
        select = functools.partial(_select_rows, inputs.gather_index.reshape(-1), defer)
        handles = [layer.register_forward_pre_hook(select, with_kwargs=True) for layer in self.layers or []]
        handles += [layer.register_forward_hook(_foldable_grad) for layer in self.layers or []]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
