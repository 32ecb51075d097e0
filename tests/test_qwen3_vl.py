"""Qwen3-VL on megatron: interleaved 3-D rope, the vision tower with DeepStack, logits, export and
log-probs equal transformers' / one process's.

A tiny random Qwen3-VL (``utils/local_vl_assets.build_tiny_qwen3_vl``: vision tower of 3 blocks,
patches of 16 pixels, a 4 x 4 learned position grid interpolated to each image, blocks 0 and 1
feeding DeepStack; a 4-layer Qwen3 decoder, head 32, interleaved mrope [6, 5, 5]) and the prompts
of ``check-hf`` (one image of 6 x 8 patches, then two images). float32 logits must equal
transformers' within 1e-4 at tp=1 (through ``check-hf``), tp=2 (plus a bit-exact export) and
pp=2 (DeepStack layers 0 and 1 on stage 0; pp=4 would put layer 1 on stage 1: refused by name).
Log-probs and every gradient of a padded image + text batch at tp=2 equal one process within 1e-5
(``tests/test_vl_logprobs.py``'s job and bound).
"""

from __future__ import annotations

import pytest
import torch

import tests.test_vl_model as qwen2_5_vl_tests
from tests.helpers import saved_model
from verl_megatron.utils.local_vl_assets import build_tiny_qwen3_vl
from verl_megatron.utils.mrope import mrope_position_ids

# transformers' model, the check-hf prompts and their reference logits: test_vl_model's fixtures,
# here over this module's ``vl_path`` (the Qwen3-VL folder).
hf_model, samples, reference = qwen2_5_vl_tests.hf_model, qwen2_5_vl_tests.samples, qwen2_5_vl_tests.reference
TOLERANCE = 1e-4
GRAD_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def vl_path(tmp_path_factory) -> str:
    return saved_model(tmp_path_factory, "tiny_qwen3_vl", build_tiny_qwen3_vl)


def _assert_close(got: torch.Tensor, want: torch.Tensor, what: str, bound: float = TOLERANCE) -> None:
    diff = (got - want).abs()
    assert float(diff.max()) <= bound, (
        f"{what}: max |diff| {float(diff.max()):.3e} at flat {int(diff.argmax())}"
    )


def test_interleaved_rotary_and_positions_match_transformers(samples, hf_model):
    """3-D ids of a padded batch == get_rope_index's (test_vl_model's check); our rotary angles of
    the two-image prompt's ids give transformers' cos/sin."""
    from verl_megatron.models.families.qwen3_vl_model import InterleavedMropeRotary

    qwen2_5_vl_tests.test_mrope_positions_match_get_rope_index(samples, hf_model)
    sample = samples[1]
    ids = mrope_position_ids(
        sample.input_ids,
        sample.image_grid_thw,
        image_token_id=hf_model.config.image_token_id,
        spatial_merge_size=2,
    ).unsqueeze(1)  # [3, 1, T]
    assert (ids[1] != ids[2]).any()  # height and width ids differ: the layout is exercised
    rotary = hf_model.model.language_model.rotary_emb
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), ids)  # [1, T, R]
    angles = InterleavedMropeRotary(rotary.inv_freq, (6, 5, 5))(ids)[:, :, 0].transpose(0, 1)
    _assert_close(angles.cos(), cos, "cos", 1e-6)
    _assert_close(angles.sin(), sin, "sin", 1e-6)


def test_vision_tower_and_deepstack_match_transformers(samples, hf_model):
    from verl_megatron.models.config import read_hf_architecture
    from verl_megatron.models.families.qwen3_vl_vision import Qwen3VisionTower

    tower = Qwen3VisionTower(read_hf_architecture(hf_model.config).vl.vision, torch.float32)
    prefix = "model.visual."
    tower.load_state_dict(
        {k.removeprefix(prefix): v for k, v in hf_model.state_dict().items() if k.startswith(prefix)}
    )
    with torch.no_grad():
        for i, s in enumerate(samples):
            want = hf_model.model.visual(s.pixel_values, grid_thw=s.image_grid_thw)
            features, deepstack = tower(s.pixel_values, s.image_grid_thw)
            assert want.pooler_output.abs().max() > 1.0 and len(deepstack) == 2
            _assert_close(features, want.pooler_output, f"prompt {i} image features")
            for k, (got, ref) in enumerate(zip(deepstack, want.deepstack_features, strict=True)):
                _assert_close(got, ref, f"prompt {i} DeepStack feature {k}")


def test_deepstack_moves_the_reference_logits(samples, hf_model):
    """Without the DeepStack features transformers' logits move by > 0.1: the 1e-4 checks see them."""
    sample = samples[0]
    ids = sample.input_ids.unsqueeze(0)
    inputs = dict(input_ids=ids, pixel_values=sample.pixel_values, image_grid_thw=sample.image_grid_thw)
    with torch.no_grad():
        full = hf_model(**inputs, mm_token_type_ids=(ids == hf_model.config.image_token_id).int()).logits
        image = hf_model.model.get_image_features(sample.pixel_values, sample.image_grid_thw)
        embeds = hf_model.model.get_input_embeddings()(ids)
        mask = ids == hf_model.config.image_token_id
        embeds[mask] = torch.cat(image.pooler_output)
        positions = hf_model.model.get_rope_index(ids, mask.int(), sample.image_grid_thw)[0]
        hidden = hf_model.model.language_model(inputs_embeds=embeds, position_ids=positions).last_hidden_state
    assert float((hf_model.lm_head(hidden) - full).abs().max().detach()) > 0.1


def test_check_hf_qwen3_vl_one_process(pool1, vl_path):
    """``verl-megatron check-hf DIR`` on a Qwen3-VL folder: image + text logits within 1e-4."""
    qwen2_5_vl_tests.test_check_hf_vl_one_process(pool1, vl_path)


@pytest.mark.parametrize("layout", [dict(tp=2), dict(pp=2)], ids=["tp2", "pp2"])
def test_qwen3_vl_logits_match_transformers_two_processes(pool2, vl_path, reference, layout, tmp_path):
    """test_vl_model's check on this folder: logits within 1e-4; tp=2 also exports, bit for bit."""
    qwen2_5_vl_tests.test_vl_logits_match_transformers_two_processes(
        pool2, vl_path, reference, layout, tmp_path
    )


def test_deepstack_layers_off_the_first_stage_are_refused():
    from verl_megatron.errors import ModelConfigError
    from verl_megatron.models.families.qwen3_vl import check_deepstack_layout

    check_deepstack_layout(2, 2, pp=2, vpp=1)
    with pytest.raises(
        ModelConfigError, match=r"parallel\.pp=4 \(vpp=1\) puts 1 decoder layers on the first"
    ):
        check_deepstack_layout(2, 1, pp=4, vpp=1)


def test_qwen3_vl_log_probs_and_grads_at_tp2_equal_one_process(pool1, pool2, vl_path):
    job = "tests.test_vl_logprobs:vl_logprob_job"
    (single,) = pool1.run(job, path=vl_path, layout={}, freeze=False)
    assert single["log_probs"].abs().max() > 1.0
    deepstack = [n for n, g in single["grads"].items() if "deepstack_merger_list" in n]
    assert len(deepstack) == 12 and min(float(single["grads"][n].abs().max()) for n in deepstack) > 1e-4
    ranks = pool2.run(job, path=vl_path, layout=dict(tp=2), freeze=False)
    # q/k norms see their rank's heads only: megatron's finalize_model_grads sums them over tp.
    summed = {
        n: sum(r["grads"][n] for r in ranks) for n in single["grads"] if "self_attn" in n and "_norm." in n
    }
    want = {**single["grads"], "log-probs": single["log_probs"] * single["mask"]}
    for rank, result in enumerate(ranks):
        got = {**result["grads"], **summed, "log-probs": result["log_probs"] * result["mask"]}
        assert got.keys() == want.keys()
        for name, tensor in want.items():
            _assert_close(got[name], tensor, f"rank {rank} {name}", GRAD_TOLERANCE)


def test_a_qwen3_vl_checkpoint_passes_the_start_up_checks(vl_path, no_runtime):
    """The trainer's start-up checks take a Qwen3-VL folder as they take a Qwen2.5-VL one."""
    qwen2_5_vl_tests.test_a_vl_checkpoint_passes_the_start_up_checks_with_the_native_rollout(
        vl_path, no_runtime
    )
