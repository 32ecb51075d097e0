"""The planner's activation model against the measured peak of live tensors on CPU.

One micro-batch's forward, log-probs (``vocab_parallel_log_probs``, the actor's function) and
backward run under a dispatch-mode counter that adds each new tensor storage's bytes when an op
creates it and subtracts them when the storage is freed; the peak above the starting point is
the micro-batch's activation memory (the DDP gradient buffers exist before, so parameter
gradients land in them). Over a grid of sequence lengths, micro-batch sizes, recomputation and
packing, for two shapes (logits-bound, and MLP-bound with a small vocabulary so the recomputed
layer sets the peak), the model must be within 10% of the measurement.
"""

from __future__ import annotations

import itertools
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from verl_megatron.planner.activations import ActivationShape, activation_bytes

SHAPES = {
    "logits_bound": dict(hidden_size=128, intermediate_size=352, vocab_size=1024, num_layers=2),
    "mlp_bound": dict(hidden_size=128, intermediate_size=512, vocab_size=256, num_layers=4),
}
GRID = list(itertools.product((64, 256), (1, 4), (False, True), (False, True)))  # T, B, recompute, packed


class LiveBytes(TorchDispatchMode):
    """Bytes of the tensor storages created inside the mode and still alive; and their peak."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = 0
        self.peak = 0

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            a.untyped_storage().data_ptr() for a in tree_flatten((args, kwargs))[0] if torch.is_tensor(a)
        }
        for tensor in tree_flatten(out)[0]:
            if not torch.is_tensor(tensor):
                continue
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            if key and key not in self.live and key not in inputs:  # views and in-place ops add nothing
                self.live[key] = storage.nbytes()
                self.current += storage.nbytes()
                self.peak = max(self.peak, self.current)
                weakref.finalize(storage, self._free, key)
        return out


def _inputs(rows: int, length: int, vocab: int, packed: bool):
    generator = torch.Generator().manual_seed(rows * length)
    ids = torch.randint(0, vocab, (rows, length), generator=generator)
    positions = torch.arange(length).expand(rows, length)
    if not packed:
        return ids, positions, None
    # One row of `rows` sequences; True = masked: another sequence, or a later position.
    seq = torch.arange(rows * length) // length
    mask = (seq[:, None] != seq[None, :]) | torch.ones(rows * length, rows * length, dtype=torch.bool).triu(1)
    return ids.reshape(1, -1), positions.reshape(1, -1), mask[None, None]


def measure_job(path: str, grid: list) -> list[int]:
    """Peak live bytes of each grid point's micro-batch (forward + log-probs + backward)."""
    from verl_megatron.distributed.parallel import ParallelLayout, init_runtime
    from verl_megatron.models.builder import build_gpt_chunks
    from verl_megatron.models.config import ModelConfig, load_hf_config
    from verl_megatron.models.logprobs import vocab_parallel_log_probs
    from verl_megatron.models.megatron_model import OptimSettings, wrap_ddp

    runtime = init_runtime(ParallelLayout())
    hf_config = load_hf_config(path)
    peaks = []
    for recompute in (False, True):
        model = ModelConfig(dtype="float32", use_te=False, enable_gradient_checkpointing=recompute)
        chunk = wrap_ddp(build_gpt_chunks(hf_config, runtime, model), OptimSettings())[0]
        for length, rows, rec, packed in grid:
            if rec != recompute:
                continue
            ids, positions, mask = _inputs(rows, length, hf_config.vocab_size, packed)
            with LiveBytes() as counter:
                start = counter.current
                logits = chunk(ids, positions, mask)
                log_probs, _ = vocab_parallel_log_probs(logits, ids, vocab_size=hf_config.vocab_size)
                log_probs.sum().backward()
                del logits, log_probs
            peaks.append((length, rows, rec, packed, counter.peak - start))
    return [p for *key, p in sorted(peaks, key=lambda e: grid.index(tuple(e[:4])))]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    from verl_megatron.utils.local_assets import build_tiny_hf_model

    paths = {}
    for name, sizes in SHAPES.items():
        paths[name] = str(tmp_path_factory.mktemp(name))
        build_tiny_hf_model(paths[name], "llama", num_heads=4, num_kv_heads=2, seed=5, **sizes)
    return paths


@pytest.mark.parametrize("name", list(SHAPES))
def test_activation_model_within_10_percent_of_measured_peak(pool1, models, name):
    sizes = SHAPES[name]
    (measured,) = [pool1.run(f"{__name__}:measure_job", path=models[name], grid=GRID)[0]]
    hidden = sizes["hidden_size"]
    shape = ActivationShape(
        hidden=hidden, query=hidden, kv=hidden // 2, ffn=sizes["intermediate_size"], layers=sizes["num_layers"],
        padded_vocab=sizes["vocab_size"], head_dim=hidden // 4, dtype_bytes=4,
    )  # fmt: skip
    worst = (0.0, None)
    for (length, rows, recompute, packed), peak in zip(GRID, measured):
        tokens = rows * length
        predicted = activation_bytes(
            shape, tokens, recompute, positions=tokens if packed else length, dense_mask=packed
        )
        error = abs(predicted / peak - 1)
        worst = max(worst, (error, (length, rows, recompute, packed, predicted, peak)), key=lambda w: w[0])
    assert worst[0] < 0.10, (
        f"{name}: worst relative error {worst[0]:.3f} at (T, B, recompute, packed, predicted, measured) = {worst[1]}"
    )
