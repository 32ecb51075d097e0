"""A checkpoint of a model with an odd vocabulary, saved at tp=2, loads at tp=1 (issue 18 item 9).

The embedding and output tables are padded to a multiple of ``model.make_vocab_size_divisible_by``
(and of tp): the same padded size at every tp, so the saved global shapes match.
"""

from __future__ import annotations

import pytest
import torch

VOCAB = 131  # odd: a multiple-of-tp padding gives 132 rows at tp=2 and 131 at tp=1


def round_trip_job(model_dir: str, root: str, tp: int, save: bool) -> dict:
    """Build at ``tp``; save the checkpoint-loaded weights (``save``) or load them into a fresh model."""
    from verl_megatron.checkpoint import load_checkpoint, save_checkpoint
    from verl_megatron.distributed.parallel import ParallelLayout, init_runtime
    from verl_megatron.models.builder import build_gpt_chunks, model_info
    from verl_megatron.models.config import ModelConfig, load_hf_config
    from verl_megatron.models.convert import iter_hf_weights, load_hf_weights
    from verl_megatron.models.megatron_model import build_optimizer, wrap_ddp
    from verl_megatron.workers.config import OptimConfig
    from verl_megatron.workers.lr_schedule import build_lr_scheduler, optim_settings

    runtime = init_runtime(ParallelLayout(tp=tp), seed=3)
    hf_config = load_hf_config(model_dir)
    chunks = build_gpt_chunks(hf_config, runtime, ModelConfig(path=model_dir, dtype="float32"))
    if save:
        load_hf_weights(chunks, model_dir, runtime)
    chunks = wrap_ddp(chunks)
    optimizer = build_optimizer(chunks, optim_settings(OptimConfig()))
    scheduler = build_lr_scheduler(optimizer, OptimConfig())
    if save:
        save_checkpoint(root, 1, chunks=chunks, optimizer=optimizer, scheduler=scheduler, runtime=runtime)
    else:
        load_checkpoint(root, chunks=chunks, optimizer=optimizer, scheduler=scheduler, runtime=runtime)
    weights = {name: t.clone() for name, t in iter_hf_weights(chunks, runtime, hf_config)}
    return {"padded": model_info(chunks).padded_vocab_size, "weights": weights}


@pytest.fixture(scope="module")
def odd_vocab_model(tmp_path_factory) -> str:
    from verl_megatron.utils.local_assets import build_tiny_hf_model

    path = tmp_path_factory.mktemp("odd_vocab")
    build_tiny_hf_model(path, "llama", vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4,
                        num_kv_heads=2, intermediate_size=64, seed=5)  # fmt: skip
    return str(path)


def test_tp2_checkpoint_of_an_odd_vocabulary_loads_at_tp1(pool1, pool2, odd_vocab_model, tmp_path):
    from safetensors.torch import load_file

    saved = pool2.run(
        f"{__name__}:round_trip_job", model_dir=odd_vocab_model, root=str(tmp_path), tp=2, save=True
    )
    (loaded,) = pool1.run(f"{__name__}:round_trip_job", model_dir=odd_vocab_model, root=str(tmp_path), tp=1,
                          save=False)  # fmt: skip
    assert saved[0]["padded"] == loaded["padded"] == 256
    expected = load_file(f"{odd_vocab_model}/model.safetensors")
    assert loaded["weights"].keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(saved[0]["weights"][name], tensor), f"tp=2 save: {name} differs"
        diff = (loaded["weights"][name] - tensor).abs().max()
        assert diff == 0, f"tp=1 load: {name} differs by {diff}"
