"""benchmarks/gpu/gpu_check.py on CPU: its argument handling, and its CPU fallback end to end on
the tiny size (the GPU run itself has not happened on this machine)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu" / "gpu_check.py"


def _script():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("argv", "message"), [
    (["--device", "cuda"], "--device cuda: no CUDA device is visible"),
    (["--size", "0.5b"], "--size 0.5b on CPU would take hours"),
    (["--prompts", "0"], "--prompts must be >= 1"),
    (["--prompts", "3", "--group", "3", "--micro-batch", "2"], "--micro-batch 2 must divide prompts x group = 9"),
])  # fmt: skip
def test_bad_arguments_are_one_line_errors(argv, message, capsys):
    assert _script().main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_dp_ranks_must_divide_the_batch(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert _script().main(["--prompts", "6", "--group", "2", "--micro-batch", "3"]) == 2  # 12 / (3 x 3)
    assert "dp=3 ranks must divide --prompts 6 and, in micro-batches of 3, prompts x group = 12" in (
        capsys.readouterr().err
    )


# The tiny size: h=64, 2 layers, kv width 64 * 2 / 4 = 32, gated MLP of 128, vocab 1000.
_H, _LAYERS, _KV, _FFN, _VOCAB = 64, 2, 32, 128, 1000
_BODY = 2 * _LAYERS * (2 * _H * _H + 2 * _H * _KV + 3 * _H * _FFN)  # forward FLOPs a token
_HEAD, _PAIR = 2 * _H * _VOCAB, 4 * _LAYERS * _H  # a token's logits; a query-key pair


def _by_hand(shared: bool = False, model: bool = False) -> int:
    """Forward + backward FLOPs of the CPU fallback's update: 2 prompts of 6 tokens, 2 responses of
    5 each. Model count: 4 sequences of 11, the head everywhere. Spent, shared: a prompt once per
    group (6 + 2 x 5 positions), scores 6 x 6 + 2 x 5 x 11, the head at the 20 response tokens."""
    if model:
        return 3 * (44 * (_BODY + _HEAD) + 4 * 11 * 11 * _PAIR)
    if shared:
        return 3 * (2 * 16 * _BODY + 20 * _HEAD + 2 * (36 + 2 * 5 * 11) * _PAIR)
    return 3 * (44 * _BODY + 20 * _HEAD + 4 * 11 * 11 * _PAIR)


def test_update_flops_counts_the_layout_each_micro_batch_runs():
    import numpy as np
    import torch

    from verl_megatron.protocol import DataProto

    ids = torch.randint(3, _VOCAB, (4, 11), generator=torch.Generator().manual_seed(0))
    ids[1, :6], ids[3, :6] = ids[0, :6], ids[2, :6]  # two groups of two responses to one prompt
    batch = DataProto.from_dict(
        {"input_ids": ids, "attention_mask": torch.ones_like(ids), "responses": ids[:, 6:],
         "response_mask": torch.ones(4, 5, dtype=torch.long)},
        non_tensors={"uid": np.array(["a", "a", "b", "b"], dtype=object)},
    )  # fmt: skip
    sizes = dict(hidden_size=_H, num_layers=_LAYERS, ffn_hidden_size=_FFN, num_attention_heads=4,
                 num_query_groups=2, vocab_size=_VOCAB)  # fmt: skip
    update_flops = _script().update_flops
    unshared = update_flops(batch, sizes, micro_batch=2, shares_prompts=False)  # only the head is saved
    assert unshared == {"model": _by_hand(model=True), "spent": _by_hand(), "shared_prompt_micro_batches": 0,
                        "model_over_spent": _by_hand(model=True) / _by_hand()}  # fmt: skip
    assert update_flops(batch, sizes, micro_batch=2, shares_prompts=True)["spent"] == _by_hand(shared=True)
    # Group "a"'s rows no longer share a prompt: its micro-batch runs unshared, "b"'s still shared.
    ids[1, 0] = ids[0, 0] + 1
    mixed = update_flops(batch, sizes, micro_batch=2, shares_prompts=True)
    assert mixed["shared_prompt_micro_batches"] == 1
    assert mixed["spent"] == 3 * ((22 + 16) * _BODY + 20 * _HEAD + (2 * 121 + 146) * _PAIR)


def test_defaults_on_a_cpu_machine():
    args = _script().parse_args([])
    assert (args.device, args.size) == ("cpu", "tiny")


SMALL = ["--prompts", "2", "--group", "2", "--prompt-len", "6", "--response-len", "5", "--micro-batch", "2"]


def cpu_fallback_job(out: str, workdir: str) -> int:
    return _script().main([*SMALL, "--workdir", workdir, "--out", out])


@pytest.fixture(scope="module")
def dp1_run(pool1, tmp_path_factory) -> tuple[int, dict]:
    tmp = tmp_path_factory.mktemp("dp1")
    (status,) = pool1.run(
        f"{__name__}:cpu_fallback_job", out=str(tmp / "summary.json"), workdir=str(tmp / "work")
    )
    return status, json.loads((tmp / "summary.json").read_text())


def test_cpu_fallback_runs_every_stage(dp1_run):
    status, summary = dp1_run
    assert status == 0, summary["checks"]
    assert summary["device"] == "cpu" and summary["spec"] == "local"
    assert summary["optimizer"] == ["DistributedOptimizer"]
    assert summary["generation_tokens_per_s"] > 0 and summary["update_tokens_per_s"] > 0
    assert summary["actor_mfu"] == {"spent": None, "model": None}  # no peak FLOP/s known for a CPU
    assert summary["dp"] == 1
    # Both micro-batches (one group each) ran shared; the counts are the hand-derived ones below.
    flops = summary["update_flops"]
    assert flops["shared_prompt_micro_batches"] == 2
    assert flops["spent"] == _by_hand(shared=True) and flops["model"] == _by_hand(model=True)
    assert flops["model_over_spent"] == pytest.approx(37_103_616 / 22_284_288, rel=1e-12)
    assert 0 < summary["logprob_vs_fp32"]["max_abs"] < 0.5  # bf16 vs float32: close, not equal
    assert summary["offload"]["weights_exact"] and set(summary["checks"]) == {
        "update_finite", "logprobs_close_to_fp32", "distributed_optimizer", "offload_weights_exact",
    }  # fmt: skip


def test_under_torchrun_each_rank_is_a_dp_rank_and_the_update_is_the_same(dp1_run, tmp_path):
    """dp=2 (gloo here, NCCL on 2 GPUs): the distributed optimizer sharded over two ranks, the
    prompts generated half per rank with per-prompt seeds: the same batch and the same update.
    torch's launcher is real; its ranks are forked from a warm process (tests/warm_script.py) and
    run the script as ``python SCRIPT`` would, starting their own process group."""
    import os
    import subprocess
    import sys

    from tests.inprocess_launch import ROOT, warm_ranks

    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(SCRIPT),
               *SMALL, "--workdir", str(tmp_path / "work"), "--out", str(tmp_path / "summary.json")]  # fmt: skip
    with warm_ranks(str(tmp_path), "-m", "tests.warm_script") as warm:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, **warm}
        result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    dp2, dp1 = json.loads((tmp_path / "summary.json").read_text()), dp1_run[1]
    assert dp2["dp"] == 2 and dp2["optimizer"] == ["DistributedOptimizer"] and all(dp2["checks"].values())
    assert dp2["update_flops"] == dp1["update_flops"]
    # Same batch, same float32 master weights; gradients summed over 2 ranks: float32 summation
    # order is the only difference allowed (1e-6 relative; measured here: equal).
    assert dp2["grad_norm"] == pytest.approx(dp1["grad_norm"], rel=1e-6)
    assert dp2["logprob_vs_fp32"] == pytest.approx(dp1["logprob_vs_fp32"], rel=1e-6)
