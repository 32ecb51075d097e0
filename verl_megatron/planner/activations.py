"""Activation memory of one micro-batch's forward and backward, per rank.

The model follows megatron's activation accounting (Korthikanti et al., "Reducing Activation
Recomputation in Large Transformer Models": the tensors each layer keeps for its backward, per
token), written out for the layers this project builds (RMSNorm, grouped-query attention through
a fused attention kernel that keeps no [s, s] scores, SwiGLU MLP, optional routed experts):

- per layer and token, in elements: the residual stream and the two norms (6 h: each norm
  keeps its input, its normalised input and its output; h / tp with sequence parallelism);
  the fused QKV output, query and key after rotary and the attention output (3 q + 3 kv);
  the MLP's fused gate/up output, the activation, the gated product and their backward
  inputs (5 f); tensor-parallel pieces divided by tp. These are the tensors megatron's local
  spec keeps on CPU (torch norms, SDPA); Transformer Engine's fused norms keep fewer, so the
  model is an upper bound there;
- with full recomputation a layer keeps only its input (h), and the backward rebuilds one
  layer at a time (its activations plus about 2 h + 2 f of gradients);
- the output: the last stage's logits ([tokens, V / tp], in the activation dtype) and, at the
  start of the backward, their gradient, plus three float32 chunk-sized tensors of the
  log-prob function (``models/logprobs.py`` chunks rows to ``CHUNK_BYTES``);
- float32 rotary tables, and with packing on the local spec a [tokens, tokens] float mask
  per layer (Transformer Engine packs with THD offsets: no mask);
- 1F1B keeps up to ``pp - pp_rank`` micro-batches in flight on a stage.

``tests/test_plan_activations.py`` measures the peak of live tensors on CPU over a grid of
sequence lengths, micro-batch sizes, recomputation and packing and holds this model to 10% of it.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ActivationShape", "activation_bytes", "forward_bytes", "logits_bytes"]


@dataclass(frozen=True)
class ActivationShape:
    """The sizes one rank's activations depend on (per pipeline stage)."""

    hidden: int
    query: int  # heads * head_dim
    kv: int  # query groups * head_dim
    ffn: int  # per token through the MLP: intermediate size, or top_k * expert size (+ shared)
    layers: int  # transformer layers on this stage
    padded_vocab: int
    head_dim: int = 128
    tp: int = 1
    cp: int = 1
    sequence_parallel: bool = False
    dtype_bytes: int = 2
    last_stage: bool = True
    first_stage: bool = True
    logits_chunk_bytes: int = 16 * 2**20  # models/logprobs.py CHUNK_BYTES


def _layer_elements(shape: ActivationShape) -> float:
    """Elements a layer keeps per token for its backward (no recomputation)."""
    sharded_hidden = shape.hidden / (shape.tp if shape.sequence_parallel else 1)
    split = (3 * shape.query + 3 * shape.kv + 5 * shape.ffn) / shape.tp
    return 6 * sharded_hidden + split


def activation_bytes(
    shape: ActivationShape,
    tokens: int,
    recompute: bool,
    *,
    positions: int | None = None,
    dense_mask: bool = False,
    in_flight: int = 1,
) -> int:
    """Peak activation bytes of forward + backward of micro-batches of ``tokens`` tokens each.

    ``tokens`` is what one micro-batch feeds the model (rows x padded length, or the packed
    token count / dynamic-batch budget); context parallelism divides it. ``positions``: the
    rotary table's length (the padded row length; the token count when packed). ``dense_mask``:
    packed rows attend through a [tokens, tokens] mask (megatron's local spec; Transformer
    Engine packs with THD offsets instead). ``in_flight``: micro-batches the pipeline schedule
    keeps alive on this stage at once.
    """
    tokens = -(-tokens // shape.cp)
    d = shape.dtype_bytes
    hidden = shape.hidden / (shape.tp if shape.sequence_parallel else 1) * d
    per_layer = _layer_elements(shape) * d
    if recompute:
        # Each layer keeps its input; the backward rebuilds one layer at a time and runs its
        # backward (the MLP's gradients: about two ffn-sized temporaries).
        stored, rebuild = shape.layers * hidden, per_layer + 2 * hidden + 2 * shape.ffn / shape.tp * d
    else:
        stored, rebuild = shape.layers * per_layer, 0.0
    # The embedding's output (first stage) and the final norm's input and output (last stage).
    ends = hidden * (shape.first_stage + 2 * shape.last_stage)
    rotary = 8 * shape.head_dim * 4 * (positions or tokens)  # float32 cos / sin tables and their uses
    # The additive float32 copy of a dense mask, kept by every layer that keeps its activations.
    mask = tokens * tokens * 4 if dense_mask else 0
    output = _output(shape, tokens, backward=True)
    kept = tokens * (in_flight * stored + ends)
    if recompute:  # tables and mask live only while a layer runs
        peak = kept + max(output, tokens * rebuild + rotary + mask)
    else:
        peak = kept + in_flight * (rotary + shape.layers * mask) + output
    return int(peak)


def forward_bytes(shape: ActivationShape, tokens: int) -> int:
    """Peak bytes of a forward-only micro-batch (log-probs, values): nothing is kept for a
    backward, so one layer's tensors at a time, the logits and one float32 chunk's softmax."""
    tokens = -(-tokens // shape.cp)
    d = shape.dtype_bytes
    hidden = shape.hidden / (shape.tp if shape.sequence_parallel else 1) * d
    peak = tokens * (_layer_elements(shape) * d + 3 * hidden) + _output(shape, tokens, backward=False)
    return int(peak)


def _output(shape: ActivationShape, tokens: int, backward: bool) -> float:
    """The last stage's logits and the log-prob function's float32 chunk (``tokens`` per cp rank).
    Training: the logits and their gradient meet at the start of the backward, with one chunk's
    log-softmax, gradient and scatter; forward only: the logits, one chunk's log-softmax and gather."""
    if not shape.last_stage:
        return 0.0
    vocab = shape.padded_vocab / shape.tp
    chunk_rows = min(tokens, max(1, shape.logits_chunk_bytes // int(vocab * 4)))
    copies, chunks = (2, 3) if backward else (1, 2)
    return copies * tokens * vocab * shape.dtype_bytes + chunks * chunk_rows * vocab * 4


def logits_bytes(shape: ActivationShape, tokens: int, backward: bool = True) -> int:
    """The part of ``activation_bytes`` (``backward``) or ``forward_bytes`` that is the logits
    and the log-prob chunk, for a micro-batch of ``tokens`` tokens."""
    return int(_output(shape, -(-tokens // shape.cp), backward))
