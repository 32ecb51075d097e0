"""Split a batch into micro-batches and lay out their tokens for the megatron model.

Two choices, both optional by config:

- *how rows are grouped*: a fixed number of sequences per micro-batch, or a token
  budget per micro-batch (``use_dynamic_bsz``) with a balanced partition that gives
  every data-parallel rank the same number of micro-batches; either of them can first
  sort the rows by length (``group_by_length``, :func:`length_grouped_partition`), so a
  padded micro-batch holds rows of similar lengths instead of padding short rows to a
  long one (a long-tailed batch then runs a fraction of the padded positions);
- *how a micro-batch's tokens are laid out*: padded rows [b, S] or one packed row
  without padding (``use_remove_padding``); rows that share a prompt can instead share one
  row with the prompt once (``share_prompt_prefix``, ``workers.shared_prefix``).

Either way only the valid tokens (``attention_mask == 1``) enter the model, moved to
the front of their row or of their packed segment, so every sequence starts at
rotary position 0 exactly as in Hugging Face (megatron's rotary embedding ignores
``position_ids`` and uses the column index). Padded rows are then right-padded and
need nothing but the causal mask. Packed rows use THD ``PackedSeqParams`` with
Transformer Engine attention; megatron's local attention (the CPU path) does not
accept them, so there the segments are kept apart by an explicit block-diagonal
causal mask instead (rotary positions then continue across segments, which does not
change attention scores: rotary attention only depends on relative positions). That
fallback scores all N x N token pairs of the packed row, so on CPU padded rows are the
cheaper layout for long micro-batches.

With context parallelism every packed sequence takes a slot rounded up to a multiple of
2*cp tokens (``cp_size``), so each cp rank can take two equal chunks of it
(``verl_megatron.workers.context_parallel``).

Each micro-batch records where the model output for every response token is
(``gather_index``: a flat index into the output's positions, the position *before*
the token, which predicts it), so the loss code works on [b, Tr] tensors whatever
the layout.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from verl_megatron.workers import shared_prefix
from verl_megatron.workers.model_inputs import PAD_ID, ModelInputs, response_columns
from verl_megatron.workers.vl_inputs import ROW_IMAGES, attach_images

__all__ = [
    "LateRows",
    "MicroBatch",
    "ModelInputs",
    "balanced_token_partition",
    "build_micro_batches",
    "fixed_size_partition",
    "length_grouped_partition",
    "mini_batch_rows",
]


@dataclass
class MicroBatch:
    """Rows of the caller's batch, their model inputs and their per-token training tensors.

    ``rows`` [r] index the caller's batch; ``tensors`` hold [r, Tr] values such as
    ``old_log_probs``, ``advantages``, ``response_mask``.
    """

    rows: torch.Tensor
    inputs: ModelInputs
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def num_rows(self) -> int:
        return int(self.rows.numel())


def mini_batch_rows(
    batch_size: int,
    mini_batch_size: int,
    *,
    dp_size: int,
    dp_rank: int,
    shuffle: bool,
    seed: int,
    epoch: int,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Global mini-batches of one epoch and this dp rank's share of each.

    Returns a list of (all_rows [M], local_rows [M / dp]) index tensors into the
    global batch. The permutation depends only on (seed, epoch), never on the
    layout, so every layout trains on the same mini-batches.
    """
    if mini_batch_size < 1 or batch_size % mini_batch_size != 0:
        raise ValueError(
            f"batch of {batch_size} sequences does not split into mini-batches of {mini_batch_size} "
            "(ppo_mini_batch_size * rollout_n must divide the batch size)"
        )
    if mini_batch_size % dp_size != 0:
        raise ValueError(
            f"mini-batch of {mini_batch_size} sequences does not split over dp={dp_size} ranks "
            "(ppo_mini_batch_size * rollout_n must be a multiple of the data-parallel size)"
        )
    if shuffle:
        generator = torch.Generator().manual_seed(int(seed) * 1_000_003 + epoch)
        order = torch.randperm(batch_size, generator=generator)
    else:
        order = torch.arange(batch_size)
    share = mini_batch_size // dp_size
    out = []
    for start in range(0, batch_size, mini_batch_size):
        rows = order[start : start + mini_batch_size]
        out.append((rows, rows[dp_rank * share : (dp_rank + 1) * share]))
    return out


@dataclass(frozen=True)
class LateRows:
    """Values of a batch's rows ``first_row``.. that arrive while its update runs (the old log-probs
    a rollout rank computes during the first mini-batch, ``trainer/async_trainer.py``).

    ``fetch()`` waits for them and returns, per tensor key, the [B - first_row, ...] values of
    those rows; it is called once, on every rank alike, before the first mini-batch that holds
    one of those rows is cut. The batch's values of those rows are placeholders until then.
    """

    first_row: int
    fetch: Callable[[], dict[str, torch.Tensor]]

    def due(self, all_rows: torch.Tensor) -> bool:
        """Whether a mini-batch of these global rows needs the late values."""
        return bool((all_rows >= self.first_row).any())

    def fill(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``batch`` with the fetched rows in place of the placeholders (new tensors, ``batch``
        itself unchanged)."""
        filled = dict(batch)
        for key, rows in self.fetch().items():
            head = batch[key][: self.first_row]
            filled[key] = torch.cat([head, rows.to(head.device, head.dtype)])
        return filled


def fixed_size_partition(num_rows: int, micro_batch_size: int) -> list[list[int]]:
    """Consecutive groups of ``micro_batch_size`` row positions (the last one may be shorter)."""
    if micro_batch_size < 1:
        raise ValueError(f"micro batch size must be >= 1, got {micro_batch_size}")
    return [list(range(s, min(s + micro_batch_size, num_rows))) for s in range(0, num_rows, micro_batch_size)]


def _greedy_bins(lengths: Sequence[int], num_bins: int) -> tuple[list[list[int]], int]:
    """Longest-first greedy partition into ``num_bins`` bins; returns (bins, largest load)."""
    loads = [0] * num_bins
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        target = min(range(num_bins), key=lambda b: (loads[b], b))
        bins[target].append(i)
        loads[target] += lengths[i]
    return [sorted(b) for b in bins], max(loads)


def _fewest_bins(lengths: Sequence[int], max_tokens: int, start: int) -> int:
    for k in range(max(start, 1), len(lengths) + 1):
        if _greedy_bins(lengths, k)[1] <= max_tokens:
            return k
    return len(lengths)


def _all_reduce_max(value: int, group) -> int:
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return value
    # NCCL only moves GPU tensors.
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else None
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())


def balanced_token_partition(lengths: Sequence[int], max_tokens: int, dp_group=None) -> list[list[int]]:
    """Partition row positions into micro-batches of at most ``max_tokens`` tokens each.

    Uses the fewest micro-batches that a longest-first greedy balancing can fit,
    agreed over ``dp_group`` (the maximum over ranks), so every data-parallel rank
    runs the same number of micro-batches in one schedule call. Each micro-batch
    lists its positions in ascending order. Every rank must hold the same number of
    rows (as mini-batch shares do), so no micro-batch is empty.
    """
    lengths = [int(n) for n in lengths]
    if not lengths:
        raise ValueError("balanced_token_partition: no rows to partition")
    longest = max(lengths)
    if longest > max_tokens:
        raise ValueError(
            f"a sequence of {longest} tokens exceeds the micro-batch token budget {max_tokens} "
            "(raise ppo_max_token_len_per_gpu / log_prob_max_token_len_per_gpu)"
        )
    k = _fewest_bins(lengths, max_tokens, math.ceil(sum(lengths) / max_tokens))
    while True:
        agreed = _all_reduce_max(k, dp_group)
        k = _fewest_bins(lengths, max_tokens, agreed)
        if _all_reduce_max(k, dp_group) == agreed:
            break
    return _greedy_bins(lengths, agreed)[0]


def _cut_sorted(lengths: list[int], order: list[int], max_tokens: int) -> list[list[int]]:
    """Consecutive runs of ``order`` (rows by ascending length) of at most ``max_tokens``
    padded positions each (rows x the run's longest row)."""
    groups: list[list[int]] = [[]]
    for i in order:
        if groups[-1] and (len(groups[-1]) + 1) * lengths[i] > max_tokens:
            groups.append([])
        groups[-1].append(i)
    return groups


def _split_costliest(groups: list[list[int]], lengths: list[int], count: int) -> list[list[int]]:
    """Halve the group with the most padded positions until there are ``count`` groups."""
    groups = [list(g) for g in groups]
    while len(groups) < count:
        cost = [len(g) * max(lengths[i] for i in g) if len(g) > 1 else -1 for g in groups]
        k = max(range(len(groups)), key=lambda j: (cost[j], -j))
        if cost[k] < 0:
            raise ValueError(f"cannot make {count} micro-batches of {sum(map(len, groups))} rows")
        half = len(groups[k]) // 2
        groups[k : k + 1] = [groups[k][:half], groups[k][half:]]
    return groups


def length_grouped_partition(
    lengths: Sequence[int], micro_batch_size: int | None = None, max_tokens: int | None = None, dp_group=None
) -> list[list[int]]:
    """Micro-batches of rows of similar length: the rows sorted by length (stable), then cut into
    runs of ``micro_batch_size`` rows, or (``max_tokens``) into the fewest runs of at most
    ``max_tokens`` *padded* positions each (rows x longest row: what a padded micro-batch runs),
    the count agreed over ``dp_group`` (ranks with fewer runs halve their costliest ones).

    Which rows train together changes, never the result: the losses are normalised by global
    counts (``ModelRunner.mini_batches``) and outputs go back to their rows (``MicroBatch.rows``).
    Micro-batches come shortest first; each lists its positions in ascending order.
    """
    lengths = [int(n) for n in lengths]
    if not lengths:
        raise ValueError("length_grouped_partition: no rows to partition")
    if (micro_batch_size is None) == (max_tokens is None):
        raise ValueError("length_grouped_partition: give micro_batch_size or max_tokens, not both")
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    if micro_batch_size is not None:
        if micro_batch_size < 1:
            raise ValueError(f"micro batch size must be >= 1, got {micro_batch_size}")
        groups = [order[s : s + micro_batch_size] for s in range(0, len(order), micro_batch_size)]
    else:
        if max(lengths) > max_tokens:
            raise ValueError(
                f"a sequence of {max(lengths)} tokens exceeds the micro-batch token budget {max_tokens} "
                "(raise ppo_max_token_len_per_gpu / log_prob_max_token_len_per_gpu)"
            )
        groups = _cut_sorted(lengths, order, max_tokens)
        groups = _split_costliest(groups, lengths, _all_reduce_max(len(groups), dp_group))
    return [sorted(g) for g in groups]


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _padded_inputs(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, responses: torch.Tensor, shape: tuple[int, int]
) -> ModelInputs:
    rows, width = shape
    columns, resp_cols, resp_valid = response_columns(attention_mask, responses.shape[1])
    valid = attention_mask.bool()
    ids = torch.full((rows, width), PAD_ID, dtype=input_ids.dtype)
    row_of = torch.arange(input_ids.shape[0]).unsqueeze(-1).expand_as(input_ids)
    ids[row_of[valid], columns[valid]] = input_ids[valid]
    padding = torch.ones((rows, width), dtype=torch.bool)
    padding[row_of[valid], columns[valid]] = False
    gather = torch.arange(input_ids.shape[0]).unsqueeze(-1) * width + resp_cols - 1
    positions = torch.arange(width).unsqueeze(0).expand(rows, -1).contiguous()
    return ModelInputs.laid_out(ids, positions, padding, gather, resp_valid, responses)


def _block_causal_mask(lengths: list[int]) -> torch.Tensor:
    """[1, 1, N, N] bool, True where a query may NOT attend to a key (other segment or future)."""
    segment = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    n = segment.numel()
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    allowed = causal & (segment.unsqueeze(0) == segment.unsqueeze(1))
    return (~allowed).view(1, 1, n, n)


def _slot_lengths(lengths: torch.Tensor, cp_size: int) -> torch.Tensor:
    """[b] tokens each sequence occupies in a packed row: its length, rounded up to a
    multiple of 2 * cp_size under context parallelism (every cp rank takes 2 equal chunks)."""
    if cp_size == 1:
        return lengths
    multiple = 2 * cp_size
    return (lengths + multiple - 1) // multiple * multiple


def _thd_params(segments: list[int], cp_size: int):
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.zeros(len(segments) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(segments, dtype=torch.int32).cumsum(0)
    longest = max(segments)
    # Under cp the slots hold trailing padding; like verl, the padded boundaries serve as the
    # sequence boundaries too: a sequence's pad tokens come after it and, under the causal
    # mask, never reach its real tokens.
    padded = cu if cp_size > 1 else None
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=padded,
        cu_seqlens_kv_padded=padded,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
    )


def _packed_inputs(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    responses: torch.Tensor,
    total: int,
    thd: bool,
    cp_size: int = 1,
) -> ModelInputs:
    columns, resp_cols, resp_valid = response_columns(attention_mask, responses.shape[1])
    valid = attention_mask.bool()
    lengths = valid.sum(dim=-1)
    slots = _slot_lengths(lengths, cp_size)
    offsets = slots.cumsum(0) - slots
    used = int(slots.sum())
    ids = torch.full((1, total), PAD_ID, dtype=input_ids.dtype)
    positions = torch.zeros((1, total), dtype=torch.long)
    # Where each valid token goes: its sequence's offset plus its column within the sequence.
    row_of = torch.arange(input_ids.shape[0]).unsqueeze(-1).expand_as(input_ids)
    target = offsets[row_of[valid]] + columns[valid]
    ids[0, target] = input_ids[valid]
    positions[0, target] = columns[valid]
    padding = torch.ones((1, total), dtype=torch.bool)
    padding[0, target] = False
    # Padding at the end forms its own segment so it never mixes with a real sequence.
    segments = [int(n) for n in slots] + ([total - used] if total > used else [])
    gather = offsets.unsqueeze(-1) + resp_cols - 1
    # THD boundaries for Transformer Engine, else a block-causal mask keeps the segments apart.
    layout = (
        {"packed_seq_params": _thd_params(segments, cp_size)}
        if thd
        else {"attention_mask": _block_causal_mask(segments)}
    )
    return ModelInputs.laid_out(ids, positions, padding, gather, resp_valid, responses, **layout)


def _model_shape(attention_mask: torch.Tensor, pack: bool, align: int, cp_size: int) -> tuple[int, int]:
    lengths = attention_mask.sum(dim=-1)
    if pack:
        # Under cp the trailing padding segment is split into 2*cp chunks like any sequence.
        multiple = align * 2 * cp_size if cp_size > 1 else align
        return 1, _round_up(max(int(_slot_lengths(lengths, cp_size).sum()), 1), multiple)
    return attention_mask.shape[0], _round_up(max(int(lengths.max()), 1), align)


def build_micro_batches(
    batch: dict[str, torch.Tensor],
    groups: list[list[int]],
    *,
    pack: bool,
    thd: bool = False,
    align: int = 1,
    uniform: bool = False,
    tensor_keys: Sequence[str] = (),
    cp_size: int = 1,
    share_prefix: bool = False,
) -> list[MicroBatch]:
    """Model inputs for each group of row positions of ``batch``.

    Args:
        batch: ``input_ids`` [B, T], ``attention_mask`` [B, T], ``responses`` [B, Tr] and
            the [B, Tr] ``tensor_keys``; T ends with the Tr response columns.
        groups: row positions of each micro-batch.
        pack: one packed row per micro-batch instead of padded rows.
        thd: packed rows carry THD PackedSeqParams (Transformer Engine) instead of a mask.
        align: the model's sequence dimension is rounded up to a multiple of this
            (tp with sequence parallelism).
        uniform: give every micro-batch the same [b, S] shape (pipeline parallelism
            sends activations of a fixed shape between stages).
        tensor_keys: per-token tensors copied into ``MicroBatch.tensors``.
        cp_size: context-parallel size; > 1 pads every packed sequence to a multiple of
            2 * cp_size tokens (the whole micro-batch; ``context_parallel.slice_inputs``
            then takes each rank's share). Needs ``pack`` and ``thd``.
        share_prefix: lay out rows that share a prompt as one model row with the prompt once
            (``workers.shared_prefix``) where that saves positions; the caller checks that the
            model's attention and rotary embedding take that layout.

    ``batch[ROW_IMAGES]`` (``workers.vl_inputs.RowImages``), where present, gives each
    micro-batch its rows' images and 3-D positions.
    """
    if cp_size > 1 and not (pack and thd):
        raise ValueError(
            f"context parallelism (cp={cp_size}) needs packed THD micro-batches: use_remove_padding=True "
            "with Transformer Engine attention"
        )
    for key in ("input_ids", "attention_mask", "responses"):
        if key not in batch:
            raise KeyError(f"batch needs '{key}' to build model inputs; it has {sorted(batch)}")
    index = [torch.tensor(g, dtype=torch.long) for g in groups]
    shapes = [_model_shape(batch["attention_mask"][rows], pack, align, cp_size) for rows in index]
    if uniform:
        common = (max(s[0] for s in shapes), max(s[1] for s in shapes))
        shapes = [common] * len(shapes)
    out = []
    for rows, (num, width) in zip(index, shapes):
        ids, mask, resp = (batch[k][rows] for k in ("input_ids", "attention_mask", "responses"))
        inputs = None
        if share_prefix and not uniform and not thd and cp_size == 1 and align == 1:
            inputs = shared_prefix.shared_prefix_inputs(ids, mask, resp, alternative_positions=num * width)
        if inputs is None and pack:
            inputs = _packed_inputs(ids, mask, resp, width, thd, cp_size)
        elif inputs is None:
            inputs = _padded_inputs(ids, mask, resp, (num, width))
        if ROW_IMAGES in batch:  # image rows: their images and 3-D positions go with them
            images, width = batch[ROW_IMAGES][rows], resp.shape[1]
            inputs = attach_images(inputs, images, ids, mask, thd=thd, cp_size=cp_size, response_length=width)
        tensors = {key: batch[key][rows] for key in tensor_keys}
        out.append(MicroBatch(rows=rows, inputs=inputs, tensors=tensors))
    return out
