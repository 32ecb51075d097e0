"""One optimizer step prepares the gradients and computes their norm once (issue 18 item 10).

megatron's ``optimizer.step()`` runs ``prepare_grads`` and the norm again; ``ModelRunner.train_step``
calls its pieces itself. A recording fake stands in for megatron's optimizer (the calls below are
the public methods of ``megatron.core.optimizer.MegatronOptimizer``).
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from verl_megatron.workers import model_runner as engine
from verl_megatron.workers.model_runner import ModelRunner


class RecordingOptimizer:
    def __init__(self, norm: float, clip: float = 1.0) -> None:
        self.calls: list[str] = []
        self.norm = norm
        self.config = SimpleNamespace(clip_grad=clip, use_precision_aware_optimizer_no_fp8_or_ds_fp8=False)
        self.grad = torch.full((4,), 2.0)
        self.param = SimpleNamespace(grad=self.grad)

    def zero_grad(self):
        self.calls.append("zero_grad")

    def prepare_grads(self):
        self.calls.append("prepare_grads")
        return False

    def get_grad_norm(self):
        self.calls.append("get_grad_norm")
        return self.norm

    def get_parameters(self):
        return [self.param]

    def step_with_ready_grads(self):
        self.calls.append("step_with_ready_grads")
        return True

    def step(self):  # would prepare and norm again
        raise AssertionError("optimizer.step() recomputes prepare_grads and the grad norm")


def _runner():
    return SimpleNamespace(chunks=[], run=lambda micro_batches, step_fn, forward_only: ["result"])


@pytest.mark.parametrize(("norm", "clipped"), [(4.0, 0.25), (0.5, 1.0)])
def test_train_step_prepares_and_norms_once_and_clips_with_that_norm(monkeypatch, norm, clipped):
    from megatron.core.optimizer import optimizer as mcore_optimizer

    from verl_megatron.distributed.cpu_compat import cpu_clip_grad_by_total_norm_fp32

    monkeypatch.setattr(mcore_optimizer, "clip_grad_by_total_norm_fp32", cpu_clip_grad_by_total_norm_fp32)
    optimizer = RecordingOptimizer(norm)
    results, grad_norm, stepped = ModelRunner.train_step(_runner(), optimizer, [], None)
    assert (results, grad_norm, stepped) == (["result"], norm, True)
    assert optimizer.calls == ["zero_grad", "prepare_grads", "get_grad_norm", "step_with_ready_grads"]
    torch.testing.assert_close(optimizer.grad, torch.full((4,), 2.0 * clipped), rtol=1e-5, atol=0)


def test_non_finite_norm_skips_the_step():
    optimizer = RecordingOptimizer(float("inf"))
    _, grad_norm, stepped = ModelRunner.train_step(_runner(), optimizer, [], None)
    assert not stepped and grad_norm == float("inf")
    assert optimizer.calls == ["zero_grad", "prepare_grads", "get_grad_norm", "zero_grad"]


def test_metrics_reach_the_host_once_per_reduction(monkeypatch):
    """reduce_metrics sums micro-batch partial sums where they live and moves one tensor."""
    moves = []
    real_cpu = torch.Tensor.cpu
    caller = threading.get_ident()

    depth = [0]

    def counting_cpu(self, *a, **k):
        # Count the outermost call of this thread only: a torch function mode (the CPU layer for
        # megatron, once installed in this worker) dispatches the patched method a second time.
        if threading.get_ident() == caller and depth[0] == 0:
            moves.append(tuple(self.shape))
        depth[0] += 1
        try:
            return real_cpu(self, *a, **k)
        finally:
            depth[0] -= 1

    runner = SimpleNamespace(
        runtime=SimpleNamespace(is_pp_last=True, layout=SimpleNamespace(dp=1, pp=1)),
        _broadcast_pp=lambda t: t,
    )
    results = [
        engine.StepResult(metrics={"a": torch.tensor(float(i)), "b": torch.tensor(1.0)}) for i in range(5)
    ]
    monkeypatch.setattr(torch.Tensor, "cpu", counting_cpu)
    reduced = ModelRunner.reduce_metrics(runner, results, ["a", "b", "missing"])
    assert reduced == {"a": 10.0, "b": 5.0, "missing": 0.0}
    assert moves == [(3,)]
