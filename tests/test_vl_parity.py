"""Bitwise parity (``rollout.bitwise_parity``) with image + text rows: tiny Qwen2.5-VL at tp=1, Qwen3-VL at tp=2.

test_vl_rollout's job with the batch-invariant kernels switched on (``models/batch_invariant.py``):
three prompts (one image, two images, text only; left-padded, 3-D rotary ids) sample n=2 responses
each, and the actor's ``compute_log_prob`` of the engine's output must equal the rollout's log-probs
bit for bit (max |diff| exactly 0). What makes it hold for image rows: the vision tower's linears and
patch embedding use the tiled matmul (the rollout runs the tower once on the batch's three images,
the actor on a micro-batch's), the decoder keys cache columns by each token's index in its sequence
(3-D ids jump after an image), and the actor's multimodal rotary turns each token by its own ids.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import saved_model
from tests.test_vl_actor import vl_path  # noqa: F401  (fixture)
from verl_megatron.utils.local_vl_assets import build_tiny_qwen2_5_vl, build_tiny_qwen3_vl

BUILDERS = {"qwen2_5_vl": build_tiny_qwen2_5_vl, "qwen3_vl": build_tiny_qwen3_vl}
GRIDS = ([1, 8, 12], [1, 4, 4], [1, 16, 20])  # image 1 alone, and between two larger ones


def _tower_gap(tower, patches: list[torch.Tensor]) -> float:
    """max |features of image 1 alone - its features in one call on all three| (DeepStack too)."""
    grids = torch.tensor(GRIDS)
    start = GRIDS[0][1] * GRIDS[0][2] // tower.arch.merge_unit
    stop = start + GRIDS[1][1] * GRIDS[1][2] // tower.arch.merge_unit
    with torch.no_grad():
        alone, mixed = tower(patches[1], grids[1:2]), tower(torch.cat(patches), grids)
    alone, mixed = (out if isinstance(out, tuple) else (out, []) for out in (alone, mixed))
    pairs = [(alone[0], mixed[0]), *zip(alone[1], mixed[1], strict=True)]
    return max(float((a - m[start:stop]).abs().max()) for a, m in pairs)


@pytest.mark.parametrize("family", list(BUILDERS))
def test_vision_tower_features_do_not_depend_on_the_other_images(tmp_path_factory, family):
    from verl_megatron.models import batch_invariant
    from verl_megatron.models.config import load_hf_config, read_hf_architecture
    from verl_megatron.models.families.qwen2_vl_vision import MatmulSite, VisionTower
    from verl_megatron.models.families.qwen3_vl_vision import Qwen3VisionTower

    path = saved_model(tmp_path_factory, f"tiny_{family}_tower", BUILDERS[family])
    arch = read_hf_architecture(load_hf_config(path)).vl.vision
    torch.manual_seed(0)
    tower = (Qwen3VisionTower if family == "qwen3_vl" else VisionTower)(arch, torch.float32)
    for parameter in tower.parameters():
        parameter.data.normal_(0.0, 0.3)
    width = arch.in_channels * arch.temporal_patch_size * arch.patch_size**2
    patches = [torch.randn(t * h * w, width) for t, h, w in GRIDS]
    plain = _tower_gap(tower, patches)
    # Whether the plain tower moves depends on the CPU's BLAS (it did on an Intel Xeon; MKL on an
    # AMD EPYC gives the same bits at these shapes), so what shows the switch took effect is that
    # every matmul of the tiled pass went through the batch-invariant kernel.
    calls: list[int] = []

    def counted(x, weight, bias=None):
        calls.append(x.shape[0])
        return batch_invariant.linear(x, weight, bias)

    sites = [m for m in tower.modules() if isinstance(m, MatmulSite)]
    for module in sites:  # what BatchInvariance.switch does to the tower of a model chunk
        module.use_matmul(counted)
    tiled = _tower_gap(tower, patches)
    assert sites and len(calls) == 2 * len(sites), (family, len(calls), len(sites))
    assert tiled == 0.0, (
        f"{family}: batch-invariant tower: image 1's features move by {tiled:.3g} with the others "
        f"(plain tower: {plain:.3g})"
    )


def _worst(run: dict) -> tuple[float, str]:
    mask = run["mask"].bool()
    diff = torch.where(mask, (run["rollout"] - run["actor"]).abs(), torch.zeros(()))
    row, col = (int(i) for i in torch.unravel_index(diff.argmax(), diff.shape))
    return float(diff.max()), f"at [{row}, {col}], {int((diff > 0).sum())} of {int(mask.sum())} tokens differ"


def test_qwen2_5_vl_parity_rollout_log_probs_equal_the_actors_bitwise(pool1, vl_path):  # noqa: F811
    (run,) = pool1.run("tests.test_vl_rollout:vl_rollout_job", path=vl_path, tp=1, parity=True)
    worst, where = _worst(run)
    assert run["mask"].bool().all() and run["images_per_row"] == [1, 1, 2, 2, 0, 0]
    assert run["vision_calls"] == [3]
    assert worst == 0.0, f"tp=1 parity: max |rollout - actor| = {worst:.3g} {where}"


def test_qwen3_vl_parity_at_tp2_with_deepstack(pool2, tmp_path_factory):
    path = saved_model(tmp_path_factory, "tiny_qwen3_vl_parity", build_tiny_qwen3_vl)
    for rank, run in enumerate(
        pool2.run("tests.test_vl_rollout:vl_rollout_job", path=path, tp=2, parity=True)
    ):
        worst, where = _worst(run)
        assert run["mask"].bool().all() and run["vision_calls"] == [3]
        assert worst == 0.0, f"Qwen3-VL tp=2 rank {rank} parity: max |rollout - actor| = {worst:.3g} {where}"


def test_quickstart_vl_trainer_logs_zero_logprob_diff_with_parity_across_an_update(pool1, tmp_path):
    """configs/quickstart_vl.yaml as written (bf16, the trainer's image dataset) for two steps: the
    second step's rollout runs on the weights the first update changed (tower included)."""
    overrides = ["trainer.total_training_steps=2", "data.train_batch_size=4", "actor.ppo_mini_batch_size=4"]
    overrides += ["trainer.val_before_train=false", "trainer.test_freq=-1", "rollout.bitwise_parity=true"]
    out = str(tmp_path / "run")
    (result,) = pool1.run(
        "tests.test_recipes:recipe_job", recipe="quickstart_vl", out_dir=out, overrides=overrides
    )
    rows = [row for row in result["rows"] if "rollout/logprob_diff/max" in row]
    assert [row["step"] for row in rows] == [1, 2], rows
    for row in rows:
        diffs = {k: v for k, v in row.items() if "logprob_diff" in k or "probs_diff" in k}
        assert len(diffs) == 6 and set(diffs.values()) == {0.0}, f"step {row['step']}: {diffs}"
