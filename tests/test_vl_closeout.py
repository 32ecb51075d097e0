"""Start-up checks of the vision-language families: ``rollout.bitwise_parity=true`` is accepted, the
features that still lack an image path are refused by name.

Bitwise parity with image rows works (``tests/test_vl_parity.py``: the vision tower's matmuls use the
batch-invariant kernels, the parity decoder keys cache columns by each token's index in its sequence,
not by its 3-D rotary ids), so ``validate_config`` lets it through for Qwen2.5-VL and Qwen3-VL. LoRA
on a VL checkpoint is still refused by name, in one line with its reason, before any process group starts.
"""

from __future__ import annotations

import pytest

from tests.helpers import saved_model
from verl_megatron.utils.local_vl_assets import build_tiny_qwen2_5_vl, build_tiny_qwen3_vl

BUILDERS = {"qwen2_5_vl": build_tiny_qwen2_5_vl, "qwen3_vl": build_tiny_qwen3_vl}


@pytest.mark.parametrize("family", list(BUILDERS))
def test_bitwise_parity_passes_and_lora_is_refused_by_name_for_image_checkpoints(
    tmp_path_factory, no_runtime, family
):
    from verl_megatron.errors import ModelConfigError
    from verl_megatron.trainer.config import load_config
    from verl_megatron.trainer.validate import validate_config

    path = saved_model(tmp_path_factory, f"tiny_{family}_parity", BUILDERS[family])
    overrides = [
        f"model.path={path}",
        "model.dtype=float32",
        "model.use_te=false",
        f"data.train_files=[{path}/rows.jsonl]",
    ]
    validate_config(load_config(None, [*overrides, "rollout.bitwise_parity=true"]), world_size=1)
    with pytest.raises(ModelConfigError) as caught:
        validate_config(load_config(None, [*overrides, "model.lora_rank=8"]), world_size=1)
    message = str(caught.value)
    assert message.startswith(f"model.lora_rank=8 is not supported for {family} (vision-language)"), message
    assert "\n" not in message and "vision tower" in message, message
