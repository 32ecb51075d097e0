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
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator, Sequence

import torch

from verl_megatron.distributed.modules import unwrap
from verl_megatron.workers.model_inputs import ModelInputs

__all__ = ["OutputRowSelector"]


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


def _select_rows(flat: torch.Tensor, module, args, kwargs):
    """Forward pre-hook: the output layer's input [S, b, h] -> the rows ``flat`` names, [K, 1, h]."""
    hidden = args[0]  # position (row i, column j) of gather_index's flat i * S + j
    s, b = hidden.shape[0], hidden.shape[1]
    flat = flat.to(hidden.device)
    rows = (flat % s) * b + torch.div(flat, s, rounding_mode="floor")
    picked = hidden.reshape(s * b, *hidden.shape[2:]).index_select(0, rows).unsqueeze(1)
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
    def selecting(self, inputs: ModelInputs) -> Iterator[None]:
        """For one model call: the output layers see only the rows of ``inputs.gather_index``.
        The hooks are removed on exit, so no micro-batch's rows outlive its call."""
        select = functools.partial(_select_rows, inputs.gather_index.reshape(-1))
        handles = [layer.register_forward_pre_hook(select, with_kwargs=True) for layer in self.layers or []]
        handles += [layer.register_forward_hook(_foldable_grad) for layer in self.layers or []]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
