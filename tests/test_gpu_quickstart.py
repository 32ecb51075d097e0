"""configs/gpu_quickstart.yaml: the quickstart on one GPU with torch + megatron-core only.

No GPU here: the recipe is checked for what decides whether it starts on a stock GPU machine
(Transformer Engine's choice on a simulated GPU without it), that it is the quickstart's job
(only the intended keys differ), and it runs one step on CPU as written (no key of it is
GPU-only), with sizes made small.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from verl_megatron.distributed.parallel import ParallelLayout
from verl_megatron.errors import ModelConfigError
from verl_megatron.models import config as model_config
from verl_megatron.trainer.config import load_config, to_dict, validate_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU_QUICKSTART = os.path.join(ROOT, "configs", "gpu_quickstart.yaml")
QUICKSTART = os.path.join(ROOT, "configs", "quickstart.yaml")
# What may differ from configs/quickstart.yaml: the layer spec, the dtype, where it writes, and
# the micro-batch size (a GPU's memory, not the job).
INTENDED = {
    "model.use_te",
    "model.dtype",
    "trainer.project_name",
    "trainer.default_local_dir",
    "actor.ppo_micro_batch_size_per_gpu",
}


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def test_gpu_quickstart_validates_and_is_the_quickstarts_job():
    config = load_config(GPU_QUICKSTART)
    assert validate_config(config, 1) == ParallelLayout(tp=1, pp=1, vpp=None, cp=1, ep=1, dp=1)
    assert (config.model.use_te, config.model.dtype, config.rollout.name) == (False, "bfloat16", "native")
    assert config.quickstart.enable
    gpu, cpu = _flat(to_dict(config)), _flat(to_dict(load_config(QUICKSTART)))
    differ = {key for key in gpu if gpu[key] != cpu.get(key)}
    assert {"model.use_te", "model.dtype"} <= differ <= INTENDED, sorted(differ - INTENDED)


def test_on_a_gpu_without_transformer_engine_only_the_gpu_quickstart_starts(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(model_config, "transformer_engine_available", lambda: False)
    assert load_config(GPU_QUICKSTART).model.resolve_use_te() is False  # megatron's local spec
    with pytest.raises(ModelConfigError, match=r"model.use_te is auto.*set model.use_te=false"):
        load_config(QUICKSTART).model.resolve_use_te()
    # The one override the README documents for any other recipe.
    assert load_config(QUICKSTART, ["model.use_te=false"]).model.resolve_use_te() is False


def gpu_quickstart_step(out_dir: str) -> dict:
    """One training step of the recipe as written, small sizes (a pool worker)."""
    from verl_megatron.train import run
    from verl_megatron.trainer.tracking import read_jsonl_metrics

    small = ["trainer.total_training_steps=1", "data.train_batch_size=8", "actor.ppo_mini_batch_size=8"]
    small += ["actor.ppo_micro_batch_size_per_gpu=64", "trainer.val_before_train=false"]
    run(GPU_QUICKSTART, [f"trainer.default_local_dir={out_dir}", *small])
    with open(os.path.join(out_dir, "config.json")) as f:
        config = json.load(f)
    return {"rows": read_jsonl_metrics(os.path.join(out_dir, "metrics.jsonl")), "config": config}


def test_gpu_quickstart_runs_a_step_on_cpu(pool1, tmp_path):
    (result,) = pool1.run(f"{__name__}:gpu_quickstart_step", out_dir=str(tmp_path / "gpu_quickstart"))
    step = {k: v for row in result["rows"] if row["step"] == 1 for k, v in row.items()}
    assert result["config"]["model"]["dtype"] == "bfloat16" and result["config"]["model"]["use_te"] is False
    assert math.isfinite(step["actor/pg_loss"]) and step["actor/grad_norm"] > 0.0
    assert 1.0 <= step["response_length/mean"] <= 4.0
