"""A trained vision-language model's export loads in transformers and gives megatron's logits.

For the tiny Qwen2.5-VL and the tiny Qwen3-VL at pp=2 (vision tower, and Qwen3-VL's DeepStack
layers, on stage 0; the LM head on stage 1): load the checkpoint, move every parameter by its own
constant (a stand-in for training that keeps tp/pp shards consistent: the constant comes from the
parameter's global name), take megatron's logits on ``check-hf``'s two image + text prompts, and
export. transformers' ``from_pretrained`` of the export must give those logits within 1e-4
(float32, ``check-hf``'s bound), and they must differ from the untouched checkpoint's by > 1e-2
(the export carries the moved weights, not the original ones). Measured: export vs megatron
3.7e-6 / 2.6e-6 (Qwen2.5-VL), 4.2e-6 / 4.4e-6 (Qwen3-VL); moved by 1.3 to 2.7.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import pytest
import torch

from tests.helpers import saved_model
from verl_megatron.utils.local_vl_assets import build_tiny_qwen2_5_vl, build_tiny_qwen3_vl

TOLERANCE = 1e-4
BUILDERS = {"qwen2_5_vl": build_tiny_qwen2_5_vl, "qwen3_vl": build_tiny_qwen3_vl}


def _shift(name: str) -> float:
    """The constant parameter ``name`` moves by: never 0, within [-5.5e-3, 5.5e-3]."""
    return ((zlib.crc32(name.encode()) % 12) - 5.5) * 1e-3


def vl_export_job(path: str, layout: dict, export_dir: str) -> list[torch.Tensor] | None:
    """Build + load under ``layout``, shift every parameter, export; the logits (last stage)."""
    from verl_megatron.distributed.parallel import ParallelLayout, init_runtime
    from verl_megatron.models.builder import build_gpt_chunks
    from verl_megatron.models.config import ModelConfig, load_hf_config
    from verl_megatron.models.convert import export_hf_weights, load_hf_weights
    from verl_megatron.models.sharding import named_global_parameters
    from verl_megatron.tools.check_hf_vl import megatron_vl_logits, vl_check_samples

    runtime = init_runtime(ParallelLayout(**layout))
    hf_config = load_hf_config(path)
    chunks = build_gpt_chunks(hf_config, runtime, ModelConfig(path=path, dtype="float32"))
    load_hf_weights(chunks, path, runtime)
    with torch.no_grad():
        for name, param in named_global_parameters(chunks):
            param.add_(_shift(name))
    logits = megatron_vl_logits(chunks, runtime, vl_check_samples(path, hf_config))
    export_hf_weights(chunks, runtime, export_dir, hf_config)
    return logits


@pytest.mark.parametrize("family", list(BUILDERS))
def test_export_after_training_loads_in_transformers_and_matches(pool2, tmp_path_factory, family):
    from safetensors.torch import load_file

    from verl_megatron.models.config import load_hf_config
    from verl_megatron.tools.check_hf_vl import hf_vl_logits, vl_check_samples

    path = saved_model(tmp_path_factory, f"tiny_{family}_export", BUILDERS[family])
    export = str(tmp_path_factory.mktemp(f"{family}_export") / "hf")
    ranks = pool2.run(f"{__name__}:vl_export_job", path=path, layout=dict(pp=2), export_dir=export)
    assert ranks[0] is None  # the logits live on the last stage
    got = ranks[1]
    hf_config = load_hf_config(path)
    samples = vl_check_samples(path, hf_config)
    image_token = int(hf_config.image_token_id)
    exported, original = hf_vl_logits(export, samples, image_token), hf_vl_logits(path, samples, image_token)
    weights, before = load_file(f"{export}/model.safetensors"), load_file(f"{path}/model.safetensors")
    assert sorted(weights) == sorted(before)
    still = [n for n in before if torch.equal(weights[n], before[n])]
    assert not still, f"exported unchanged: {still}"
    for i, (mine, theirs, old) in enumerate(zip(got, exported, original, strict=True)):
        diff, moved = (mine - theirs).abs(), float((theirs - old).abs().max())
        where = divmod(int(diff.argmax()), theirs.shape[-1])
        print(f"{family} prompt {i}: export vs megatron {float(diff.max()):.3e}, moved {moved:.3e}")
        assert float(diff.max()) <= TOLERANCE, (
            f"{family} prompt {i}: max |diff| {float(diff.max()):.3e} at {where}"
        )
        assert moved > 1e-2, f"{family} prompt {i}: the export's logits moved by {moved:.3e} only"


def vl_final_export_job(path: str, out_root: str) -> str:
    """The trainer's end-of-run export (``export_final_model``) of the untouched checkpoint."""
    from verl_megatron.distributed.parallel import ParallelLayout, init_runtime
    from verl_megatron.models.builder import build_gpt_chunks
    from verl_megatron.models.config import ModelConfig, load_hf_config
    from verl_megatron.models.convert import load_hf_weights
    from verl_megatron.trainer.final_export import export_final_model
    from verl_megatron.utils.tokenizer import hf_tokenizer

    runtime = init_runtime(ParallelLayout())
    hf_config, model_cfg = load_hf_config(path), ModelConfig(path=path, dtype="float32")
    chunks = build_gpt_chunks(hf_config, runtime, model_cfg)
    load_hf_weights(chunks, path, runtime)
    return export_final_model(chunks, runtime, out_root, hf_config, hf_tokenizer(path), model_cfg)


def test_final_export_keeps_the_image_processor(pool1, tmp_path_factory, tmp_path):
    """The export of a VL model takes image prompts: it carries the source's image processor
    (preprocessor_config.json) and chat template, so verl_megatron's processor loads from it and
    encodes an image prompt to the source's ids and pixel values."""
    from transformers import AutoImageProcessor

    from verl_megatron.data.multimodal import encode_multimodal_prompt, image_processor_for
    from verl_megatron.utils.local_vl_assets import shape_image

    path = saved_model(tmp_path_factory, "tiny_qwen2_5_vl_final_export", build_tiny_qwen2_5_vl)
    (export,) = pool1.run(f"{__name__}:vl_final_export_job", path=path, out_root=str(tmp_path))
    assert export == str(tmp_path / "hf_export")
    for name in ("preprocessor_config.json", "chat_template.jinja"):
        assert (tmp_path / "hf_export" / name).read_bytes() == Path(path, name).read_bytes(), name
    loaded = AutoImageProcessor.from_pretrained(export, local_files_only=True)
    assert loaded.to_dict() == AutoImageProcessor.from_pretrained(path, local_files_only=True).to_dict()
    processor, source = image_processor_for(export), image_processor_for(path)
    assert processor is not None
    messages = [{"role": "user", "content": "<image>What colour?"}]
    images = [shape_image((56, 84), "red")]
    mine, theirs = (encode_multimodal_prompt(messages, images, p) for p in (processor, source))
    assert mine.input_ids == theirs.input_ids and mine.input_ids.count(processor.image_token_id) == 6
    assert torch.equal(mine.pixel_values, theirs.pixel_values) and mine.image_grid_thw.tolist() == [[1, 6, 4]]
