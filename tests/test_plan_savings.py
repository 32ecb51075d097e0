"""``verl-megatron plan``'s "changes that save the most": every candidate (distributed optimizer,
offload, recomputation, halved micro-batches, tp/pp/ep doubled with dp shrinking) is the changed
job planned by the same code, so a listed saving is the original peak minus the changed job's
own peak, to the byte; the layouts offered are only those the model and world size admit."""

from __future__ import annotations

import json
import warnings

import pytest

from tests.test_plan_cli import LLAMA
from verl_megatron.planner.command import plan_config
from verl_megatron.planner.savings import candidate_changes
from verl_megatron.trainer.config import load_config

GiB = 2**30


@pytest.fixture(scope="module")
def config_only(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("config_only")
    (path / "config.json").write_text(json.dumps(LLAMA))
    return str(path)


def _plan(path: str, overrides: list[str], gpus: int, savings: bool = True):
    config = load_config("configs/grpo.yaml", [f"model.path={path}", *overrides])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return plan_config(config, gpus, 64 * 2**20, savings=savings)


def test_doubling_tp_is_the_top_saving_and_every_saving_is_exact(config_only):
    # 4 GPUs, tp=1 (dp=4), distributed optimizer: model state is sharded by tp (and the
    # vocabulary-wide logits too), so doubling tp (dp 4 -> 2) lowers the peak the most.
    overrides = ["actor.optim.use_distributed_optimizer=true"]
    before = _plan(config_only, overrides, 4)
    assert before.savings[0][0] == "parallel.tp=2", before.savings
    assert [s for _, s in before.savings] == sorted((s for _, s in before.savings), reverse=True)
    for change, saved in before.savings:  # each equals planning the changed job from scratch
        after = _plan(config_only, [*overrides, *change.split()], 4, savings=False)
        assert saved == before.peak - after.peak > 0, (change, saved, before.peak - after.peak)
        if change == "parallel.tp=2":
            assert after.layout.dp == 2  # dp shrinks to keep the world size


def test_only_layouts_the_model_and_world_admit_are_offered(config_only):
    from verl_megatron.models.config import load_hf_config

    hf = load_hf_config(config_only)  # 4 heads, 2 key/value heads, 4 layers, dense
    roles = {"actor", "reference"}

    def offered(overrides: list[str], gpus: int) -> set[str]:
        config = load_config("configs/grpo.yaml", [f"model.path={config_only}", *overrides])
        return {c for c, _ in candidate_changes(config, hf, gpus, roles) if c.startswith("parallel.")}

    assert offered([], 4) == {"parallel.tp=2", "parallel.pp=2"}  # no ep: not a MoE model
    assert offered(["parallel.tp=2"], 4) == {"parallel.pp=2"}  # tp=4 splits 2 key/value heads
    assert offered(["parallel.pp=4"], 4) == set()  # 8 stages of 4 layers; tp=2 needs 8 GPUs
    assert offered([], 2) == {"parallel.tp=2", "parallel.pp=2"}  # dp 2 -> 1
    assert offered([], 1) == set()  # nothing divides one GPU
