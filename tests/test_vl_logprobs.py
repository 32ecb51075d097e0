"""Qwen2.5-VL at tp=2: log-probs and gradients of a padded image + text batch equal one process,
and ``model.freeze_vision_tower`` keeps the tower out of the gradients.

One micro-batch of two rows (the ``check-hf`` prompts: one image, then two images; each followed
by a 5-token response, right-padded to one length), called directly (pp=1). Log-probs of every
next token come from the vocabulary-parallel logits (``models/logprobs.py``); the loss is their
masked sum. At tp=2 the log-probs and every gradient (the replicated vision tower's on both tp
ranks, the language model's gathered whole) must equal one process's: float32 sums of the same
terms in another order, within 1e-5 (logits about 3, log-probs about 6, gradient entries below 5).
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import saved_model
from verl_megatron.utils.local_vl_assets import build_tiny_qwen2_5_vl

TOLERANCE = 1e-5
RESPONSE = [5, 17, 33, 8, 2]


@pytest.fixture(scope="module")
def vl_path(tmp_path_factory) -> str:
    return saved_model(tmp_path_factory, "tiny_qwen2_5_vl_logprobs", build_tiny_qwen2_5_vl)


def _batch(path: str, hf_config):
    """(input_ids [2, T], position_ids [3, 2, T], loss mask [2, T-1], pixel_values, image_grid_thw)."""
    from verl_megatron.tools.check_hf_vl import vl_check_samples
    from verl_megatron.utils.mrope import mrope_position_ids

    samples = vl_check_samples(path, hf_config)
    rows = [torch.cat([s.input_ids, torch.tensor(RESPONSE)]) for s in samples]
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    positions = torch.zeros(3, len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width - 1)
    for i, (row, sample) in enumerate(zip(rows, samples)):
        ids[i, : len(row)] = row
        positions[:, i, : len(row)] = mrope_position_ids(
            row, sample.image_grid_thw, image_token_id=hf_config.image_token_id, spatial_merge_size=2
        )
        mask[i, len(row) - 1 - len(RESPONSE) : len(row) - 1] = 1  # the response tokens' predictions
    pixels = torch.cat([s.pixel_values for s in samples])
    grids = torch.cat([s.image_grid_thw for s in samples])
    return ids, positions, mask, pixels, grids


def vl_logprob_job(path: str, layout: dict, freeze: bool) -> dict:
    """log-probs [2, T-1], the masked-sum loss's gradients by global name, and which parameters
    have requires_grad."""
    from verl_megatron.distributed.parallel import ParallelLayout, init_runtime
    from verl_megatron.models.builder import build_gpt_chunks, model_info
    from verl_megatron.models.config import ModelConfig, load_hf_config
    from verl_megatron.models.convert import load_hf_weights
    from verl_megatron.models.logprobs import vocab_parallel_log_probs
    from verl_megatron.models.sharding import gather_full_state, named_global_parameters

    runtime = init_runtime(ParallelLayout(**layout))
    hf_config = load_hf_config(path)
    model_cfg = ModelConfig(path=path, dtype="float32", freeze_vision_tower=freeze)
    chunks = build_gpt_chunks(hf_config, runtime, model_cfg)
    load_hf_weights(chunks, path, runtime)
    ids, positions, mask, pixels, grids = _batch(path, hf_config)
    logits = chunks[0](ids, positions, None, pixel_values=pixels, image_grid_thw=grids)
    log_probs, _ = vocab_parallel_log_probs(
        logits[:, :-1],
        ids[:, 1:],
        vocab_size=model_info(chunks).vocab_size,
        tp_group=runtime.tp_group() if runtime.layout.tp > 1 else None,
    )
    (log_probs * mask).sum().backward()
    trainable = {name for name, p in named_global_parameters(chunks) if p.requires_grad}
    vision_grads = {
        name: p.grad.clone()
        for name, p in named_global_parameters(chunks)
        if name.startswith("vision.") and p.grad is not None
    }
    return {
        "log_probs": log_probs.detach(),
        "mask": mask,
        "grads": _hf_named(
            gather_full_state(chunks, grads=True, only_tp_rank0=False), model_info(chunks), runtime
        ),
        "vision_grads": vision_grads,
        "trainable": trainable,
    }


def _hf_named(whole: dict[str, torch.Tensor], info, runtime) -> dict[str, torch.Tensor]:
    """Whole megatron tensors by HF name (fused gate/up and q/k/v depend on tp in megatron's form)."""
    from verl_megatron.models.convert import hf_mapping, to_hf

    out = {}
    for name, tensor in whole.items():
        mapping = hf_mapping(name, info)
        out.update(zip(mapping.hf_names, to_hf(mapping, tensor, info, runtime.layout.tp)))
    return out


def _assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    diff = (got - want).abs()
    assert float(diff.max()) <= TOLERANCE, (
        f"{what}: max |diff| {float(diff.max()):.3e} at flat {int(diff.argmax())}"
    )


def test_vl_log_probs_and_grads_at_tp2_equal_one_process(pool1, pool2, vl_path):
    (single,) = pool1.run(f"{__name__}:vl_logprob_job", path=vl_path, layout={}, freeze=False)
    assert single["log_probs"].abs().max() > 1.0 and len(single["vision_grads"]) > 10
    assert max(float(g.abs().max()) for g in single["vision_grads"].values()) > 1e-3  # images get gradient
    ranks = pool2.run(f"{__name__}:vl_logprob_job", path=vl_path, layout=dict(tp=2), freeze=False)
    for rank, result in enumerate(ranks):
        _assert_close(
            result["log_probs"] * result["mask"],
            single["log_probs"] * single["mask"],
            f"rank {rank} log-probs",
        )
        assert set(result["vision_grads"]) == set(single["vision_grads"])
        for name, grad in single["vision_grads"].items():  # replicated: whole on every tp rank
            _assert_close(result["vision_grads"][name], grad, f"rank {rank} {name}")
        for name, grad in single["grads"].items():
            _assert_close(result["grads"][name], grad, f"rank {rank} {name}")


def test_freeze_vision_tower_trains_only_the_language_model(pool1, vl_path):
    (frozen,) = pool1.run(f"{__name__}:vl_logprob_job", path=vl_path, layout={}, freeze=True)
    vision = [name for name in frozen["grads"] if name.startswith("visual.")]
    assert len(vision) > 10 and all(float(frozen["grads"][name].abs().max()) == 0 for name in vision)
    assert (
        not any(name.startswith("vision.") for name in frozen["trainable"]) and frozen["vision_grads"] == {}
    )
    assert "embedding.word_embeddings.weight" in frozen["trainable"]
    assert float(frozen["grads"]["model.layers.0.self_attn.q_proj.weight"].abs().max()) > 0


def test_freeze_vision_tower_refused_for_a_text_model():
    from verl_megatron.errors import ModelConfigError
    from verl_megatron.models.families.qwen2_vl import check_vl_settings

    with pytest.raises(ModelConfigError, match=r"model\.freeze_vision_tower=true but the checkpoint is not"):
        check_vl_settings(None, sequence_parallel=False, freeze=True)
