"""Start-up refusal of ``rollout.bitwise_parity=true`` for both vision-language families.

Bitwise parity with image rows is not built: the parity decoder keys its cache columns by 1-D
positions (3-D ids after an image are not column numbers), the actor's parity rotary restarts
1-D positions per packed segment, and the vision tower (and Qwen3-VL's DeepStack mergers) have
no batch-invariant kernels, so the rollout's tower call over a batch's prompts and the actor's
over a micro-batch's rows differ in the last bits. ``validate_config`` must refuse it by name,
in one line with that reason, before any process group starts.
"""

from __future__ import annotations

import pytest

from tests.helpers import saved_model
from verl_megatron.utils.local_vl_assets import build_tiny_qwen2_5_vl, build_tiny_qwen3_vl

BUILDERS = {"qwen2_5_vl": build_tiny_qwen2_5_vl, "qwen3_vl": build_tiny_qwen3_vl}


@pytest.mark.parametrize("family", list(BUILDERS))
def test_bitwise_parity_is_refused_by_name_for_image_checkpoints(tmp_path_factory, no_runtime, family):
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
    validate_config(load_config(None, overrides), world_size=1)  # the same config without parity passes
    with pytest.raises(ModelConfigError) as caught:
        validate_config(load_config(None, [*overrides, "rollout.bitwise_parity=true"]), world_size=1)
    message = str(caught.value)
    assert message.startswith(f"rollout.bitwise_parity=true is not supported for {family} (vision-language)")
    assert "\n" not in message and "1-D positions" in message and "vision tower" in message, message
