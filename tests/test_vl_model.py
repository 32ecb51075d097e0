"""Qwen2.5-VL on megatron: 3-D rotary ids, the vision tower and the logits equal transformers'.

A tiny random Qwen2.5-VL (``utils/local_vl_assets.py``: vision tower of 2 blocks, window
attention with 2 x 2-token windows then full attention; a 2-layer Qwen2 decoder with mrope
[2, 3, 3]) and the prompts of ``check-hf`` (``tools/check_hf_vl.py``): one image of 112 x 84
pixels (3 x 4 merged tokens: whole and cut windows) and a prompt with two images. float32 logits
must equal transformers' within 1e-4 at tp=1 (through ``check-hf``), tp=2 and pp=2 (the family
tests' bound); the tp=2 export equals the checkpoint bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import saved_model
from verl_megatron.tools.check_hf_vl import hf_vl_logits, vl_check_samples
from verl_megatron.utils.local_vl_assets import build_tiny_qwen2_5_vl, shape_image
from verl_megatron.utils.mrope import mrope_position_ids_batch

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def vl_path(tmp_path_factory) -> str:
    return saved_model(tmp_path_factory, "tiny_qwen2_5_vl", build_tiny_qwen2_5_vl)


@pytest.fixture(scope="module")
def hf_model(vl_path):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(
        vl_path, dtype=torch.float32, local_files_only=True
    ).eval()


@pytest.fixture(scope="module")
def samples(vl_path, hf_model):
    return vl_check_samples(vl_path, hf_model.config)


def _assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    diff = (got - want).abs()
    worst = divmod(int(diff.argmax()), want.shape[-1])
    assert float(diff.max()) <= TOLERANCE, f"{what}: max |diff| {float(diff.max()):.3e} at (row, col) {worst}"


def test_mrope_positions_match_get_rope_index(samples, hf_model):
    """One padded batch of both prompts (left padding), as transformers numbers it."""
    image_token = hf_model.config.image_token_id
    width = max(len(s.input_ids) for s in samples)
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, s in enumerate(samples):
        ids[row, width - len(s.input_ids) :] = s.input_ids
        mask[row, width - len(s.input_ids) :] = 1
    grids = [s.image_grid_thw for s in samples]
    mine = mrope_position_ids_batch(ids, mask, grids, image_token_id=image_token, spatial_merge_size=2)
    want, _ = hf_model.model.get_rope_index(
        ids,
        mm_token_type_ids=(ids == image_token).int(),
        image_grid_thw=torch.cat(grids),
        attention_mask=mask,
    )
    assert torch.equal(mine, want), f"first difference at {(mine != want).nonzero()[:1].tolist()}"
    assert int(mine.max()) < width  # images take fewer positions than tokens: a real 3-D layout


def test_vision_tower_matches_transformers(samples, hf_model):
    from verl_megatron.models.config import read_hf_architecture
    from verl_megatron.models.families.qwen2_vl_vision import VisionTower

    tower = VisionTower(read_hf_architecture(hf_model.config).vl.vision, torch.float32)
    prefix = "model.visual."
    weights = {k.removeprefix(prefix): v for k, v in hf_model.state_dict().items() if k.startswith(prefix)}
    tower.load_state_dict(weights, strict=True)
    with torch.no_grad():
        for i, s in enumerate(samples):
            want = hf_model.model.visual(s.pixel_values, grid_thw=s.image_grid_thw).pooler_output
            assert want.abs().max() > 1.0
            _assert_close(tower(s.pixel_values, s.image_grid_thw), want, f"prompt {i} image features")


def test_logits_depend_on_the_image(vl_path, samples, hf_model):
    """The tiny model is sensitive enough for the 1e-4 check to see a wrong image path."""
    from verl_megatron.data.multimodal import encode_multimodal_prompt, load_image_text_processor
    from verl_megatron.tools.check_hf_vl import VLSample

    first = samples[0]
    other = encode_multimodal_prompt(
        [{"role": "user", "content": "<image>What colour is the square?"}],
        [shape_image((112, 84), "blue")],
        load_image_text_processor(vl_path),
    )
    assert other.input_ids == first.input_ids.tolist()
    blue = VLSample(first.input_ids, first.position_ids, other.pixel_values, other.image_grid_thw)
    red_logits, blue_logits = hf_vl_logits(vl_path, [first, blue], hf_model.config.image_token_id)
    assert float((red_logits - blue_logits).abs().max()) > 0.1


def vl_logits_job(path: str, layout: dict, export_dir: str | None = None) -> list[torch.Tensor] | None:
    """On every rank: build + load the checkpoint under ``layout``; the check's logits (last stage);
    with ``export_dir``, the model exported there in Hugging Face format."""
    from verl_megatron.distributed.parallel import ParallelLayout, init_runtime
    from verl_megatron.models.builder import build_gpt_chunks
    from verl_megatron.models.config import ModelConfig, load_hf_config
    from verl_megatron.models.convert import export_hf_weights, load_hf_weights
    from verl_megatron.tools.check_hf_vl import megatron_vl_logits

    runtime = init_runtime(ParallelLayout(**layout))
    hf_config = load_hf_config(path)
    chunks = build_gpt_chunks(hf_config, runtime, ModelConfig(path=path, dtype="float32"))
    load_hf_weights(chunks, path, runtime)
    logits = megatron_vl_logits(chunks, runtime, vl_check_samples(path, hf_config))
    if export_dir:
        export_hf_weights(chunks, runtime, export_dir, hf_config)
    return logits


@pytest.fixture(scope="module")
def reference(vl_path, samples, hf_model):
    return hf_vl_logits(vl_path, samples, hf_model.config.image_token_id)


def test_check_hf_vl_one_process(pool1, vl_path):
    """``verl-megatron check-hf DIR`` on a Qwen2.5-VL folder takes the image + text path (tolerance 1e-4)."""
    import argparse

    args = argparse.Namespace(
        path=vl_path, tp=1, pp=1, vpp=None, ep=1, etp=None, dtype="float32", tolerance=TOLERANCE, seed=0
    )
    (status,) = pool1.run("verl_megatron.tools.check_hf:run_check", args=args)
    assert status == 0  # the worker printed the max |logit diff| above


@pytest.mark.parametrize("layout", [dict(tp=2), dict(pp=2)], ids=["tp2", "pp2"])
def test_vl_logits_match_transformers_two_processes(pool2, vl_path, reference, layout, tmp_path):
    """tp=2 also exports: every tensor of the export equals the checkpoint's, bit for bit."""
    from safetensors.torch import load_file

    export = str(tmp_path / "export") if "tp" in layout else None
    ranks = pool2.run(f"{__name__}:vl_logits_job", path=vl_path, layout=layout, export_dir=export)
    holders = [r for r in ranks if r is not None]
    assert len(holders) == (2 if "tp" in layout else 1)
    for logits in holders:
        for i, (got, want) in enumerate(zip(logits, reference, strict=True)):
            _assert_close(got, want, f"{layout} prompt {i}")
    if export:
        original, exported = (load_file(f"{d}/model.safetensors") for d in (vl_path, export))
        assert sorted(exported) == sorted(original)
        assert all(torch.equal(exported[name], tensor) for name, tensor in original.items())


def test_a_vl_checkpoint_passes_the_start_up_checks_with_the_native_rollout(vl_path, no_runtime):
    """Image rows train end to end (tests/test_vl_train.py); other engines: check_vl_rollout."""
    from verl_megatron.trainer.config import load_config
    from verl_megatron.trainer.validate import validate_config

    overrides = [f"model.path={vl_path}", "model.dtype=float32", f"data.train_files=[{vl_path}/rows.jsonl]"]
    validate_config(load_config(None, overrides), world_size=1)


TEXT_IDS = [1, 40, 77, 101, 9, 250, 33, 2]


def vl_text_logits_job(path: str) -> torch.Tensor:
    """One process: logits [T, V] of a text-only prompt with [B, T] positions (no images)."""
    from verl_megatron.distributed.parallel import ParallelLayout, init_runtime
    from verl_megatron.models.builder import build_gpt_chunks, model_info
    from verl_megatron.models.config import ModelConfig, load_hf_config
    from verl_megatron.models.convert import load_hf_weights

    runtime = init_runtime(ParallelLayout())
    chunks = build_gpt_chunks(load_hf_config(path), runtime, ModelConfig(path=path, dtype="float32"))
    load_hf_weights(chunks, path, runtime)
    ids = torch.tensor([TEXT_IDS])
    with torch.no_grad():
        logits = chunks[0](ids, torch.arange(len(TEXT_IDS)).unsqueeze(0), None)
    return logits[0, :, : model_info(chunks).vocab_size]


def test_text_only_prompt_with_1d_positions_matches_transformers(pool1, vl_path, hf_model):
    (got,) = pool1.run(f"{__name__}:vl_text_logits_job", path=vl_path)
    with torch.no_grad():
        want = hf_model(input_ids=torch.tensor([TEXT_IDS])).logits[0]
    assert want.abs().max() > 1.0
    _assert_close(got, want, "text-only prompt")
