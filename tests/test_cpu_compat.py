"""The CPU compatibility layer: what megatron-core asks of CUDA is answered on the CPU.

The layer patches process-wide state, so these checks run inside a pool
worker (which installed it through init_runtime) or a fresh interpreter.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap


def compat_job() -> dict:
    import torch
    from megatron.core import tensor_parallel
    from megatron.core.optimizer import optimizer as mcore_optimizer
    from megatron.core.optimizer.clip_grads import get_grad_norm_fp32

    from verl_megatron.distributed import cpu_compat
    from verl_megatron.distributed.parallel import ParallelLayout, init_runtime

    runtime = init_runtime(ParallelLayout(), seed=11)
    out: dict = {"installed": cpu_compat.is_installed(), "runtime_flag": runtime.cpu_compat}
    # Device arguments megatron passes are mapped to the CPU.
    out["devices"] = [
        torch.zeros(2, device="cuda").device.type,
        torch.empty(3, device=torch.cuda.current_device()).device.type,
        torch.ones(1).cuda().device.type,
        torch.ones(1).to("cuda").device.type,
        torch.tensor([1.0], device="cuda:0", pin_memory=True).device.type,
        torch.ones(1).new_empty(2, 3, device="cuda").device.type,
    ]
    # new_empty's positional ints are sizes, not a device index (transformers' DeepSeek-V3 calls it so).
    out["new_empty_shape"] = list(torch.ones(1).new_empty(2, 3, 4).shape)
    # CUDA RNG functions drive the CPU generator: restoring a state replays numbers.
    state = torch.cuda.get_rng_state()
    first = torch.rand(4)
    torch.cuda.set_rng_state(state)
    out["rng_replay"] = bool(torch.equal(first, torch.rand(4)))
    # The tensor-parallel RNG tracker forks a separate, reproducible stream and restores the default one.
    tracker = tensor_parallel.get_cuda_rng_tracker()
    before = torch.get_rng_state()
    with tracker.fork():
        forked = torch.rand(3)
    out["tracker_restores_default"] = bool(torch.equal(before, torch.get_rng_state()))
    tensor_parallel.model_parallel_cuda_manual_seed(11, force_reset_rng=True)
    with tensor_parallel.get_cuda_rng_tracker().fork():
        out["tracker_reproducible"] = bool(torch.equal(forked, torch.rand(3)))
    # Streams and events are inert stand-ins.
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        stream.wait_stream(torch.cuda.current_stream())
    torch.cuda.synchronize()
    # Gradient clipping: norm of [3, 4] and [0, 12] is 13; clip to 1.3 scales by 0.1.
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    a.grad, b.grad = torch.tensor([3.0, 4.0]), torch.tensor([0.0, 12.0])
    out["grad_norm"] = get_grad_norm_fp32([a.grad, b.grad], grad_stats_parallel_group=None)
    mcore_optimizer.clip_grad_by_total_norm_fp32([a, b], max_norm=1.3, total_norm=out["grad_norm"])
    out["clipped"] = torch.cat([a.grad, b.grad]).tolist()
    # Below the threshold nothing changes.
    mcore_optimizer.clip_grad_by_total_norm_fp32([a, b], max_norm=100.0, total_norm=1.3)
    out["unclipped"] = torch.cat([a.grad, b.grad]).tolist()
    # CPU tensors are named by their CUDA type only inside the mixed-precision optimizer's constructor.
    out["type_names"] = [torch.zeros(1, dtype=d).type() for d in (torch.bfloat16, torch.float32)]
    return out


def test_layer_answers_megatron_cuda_calls_on_cpu(pool1):
    (out,) = pool1.run(f"{__name__}:compat_job")
    assert out["installed"] and out["runtime_flag"]
    assert out["devices"] == ["cpu"] * 6
    assert out["new_empty_shape"] == [2, 3, 4]
    assert out["rng_replay"]
    assert out["tracker_restores_default"] and out["tracker_reproducible"]
    assert abs(out["grad_norm"] - 13.0) < 1e-6
    expected = [0.3, 0.4, 0.0, 1.2]
    assert all(abs(x - y) < 1e-6 for x, y in zip(out["clipped"], expected))
    assert all(abs(x - y) < 1e-6 for x, y in zip(out["unclipped"], expected))
    assert out["type_names"] == ["torch.BFloat16Tensor", "torch.FloatTensor"]


def test_layer_stays_out_of_the_way_when_cuda_exists():
    code = textwrap.dedent(
        """
        import torch
        torch.cuda.is_available = lambda: True
        from verl_megatron.distributed import cpu_compat
        original = torch.cuda.current_device
        assert cpu_compat.install() is False
        assert not cpu_compat.is_installed()
        assert torch.cuda.current_device is original
        from torch.overrides import _get_current_function_mode_stack
        assert not _get_current_function_mode_stack()
        from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params
        assert not hasattr(Float16OptimizerWithFloat16Params.__init__, "__wrapped__")
        print("untouched")
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "untouched"


def recompute_job() -> dict:
    """Gradients with full activation recomputation equal those without (recompute runs in backward)."""
    import torch

    from tests.test_layout_equality import GLOBAL_BATCH, SEQ, _global_batch, _make_gpt
    from verl_megatron.distributed.parallel import ParallelLayout, init_runtime
    from verl_megatron.models.megatron_model import build_chunks
    from verl_megatron.models.sharding import load_full_state, seeded_tensor

    runtime = init_runtime(ParallelLayout(), seed=5)
    grads = []
    for recompute in (False, True):
        (chunk,) = build_chunks(runtime, _make_gpt)
        if recompute:
            chunk.config.recompute_granularity = "full"
            chunk.config.recompute_method = "uniform"
            chunk.config.recompute_num_layers = 1
            chunk.decoder.config = chunk.config
        load_full_state([chunk], lambda name, shape: seeded_tensor(name, shape, seed=3))
        batch = _global_batch()
        positions = torch.arange(SEQ).unsqueeze(0).expand(GLOBAL_BATCH, -1)
        loss = (chunk(batch["input_ids"], positions, None, labels=batch["labels"]) * batch["loss_mask"]).sum()
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in chunk.named_parameters()})
    return {"plain": grads[0], "recomputed": grads[1]}


def test_activation_recomputation_gives_the_same_gradients(pool1):
    import torch

    (out,) = pool1.run(f"{__name__}:recompute_job")
    assert out["plain"].keys() == out["recomputed"].keys()
    for name, grad in out["plain"].items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(out["recomputed"][name], grad, rtol=1e-6, atol=1e-7, msg=f"grad of {name}")
