"""Offloading parameters, gradients and optimizer state between stages.

On this CPU-only machine the public functions must move nothing and say so.
The GPU path's bookkeeping runs here with host copies standing in for
device transfers (``host=cpu`` with copies): every tensor it should move gets
a new storage, gradient buffers are released, and after loading back the
next training step is bit-identical to a step without any offloading.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from verl_megatron.models import offload

# The tiny SwiGLU GPT of tests/test_checkpoint.py, counted by hand:
# embedding 64*32 + 4 layers * (norm 32 + qkv (32+2*2*8)*32 + proj 32*32 + norm 32
# + fc1 2*48*32 + fc2 32*48) + final norm 32 + output 64*32.
PARAMS = 64 * 32 + 4 * (32 + 64 * 32 + 32 * 32 + 32 + 2 * 48 * 32 + 32 * 48) + 32 + 64 * 32
assert PARAMS == 35104


def offload_job(mode: str) -> dict:
    """Train a step, offload + load (``mode``: none | public | moved), train another; report."""
    from tests.test_checkpoint import _setup, _train_step
    from verl_megatron.models.sharding import gather_full_state

    runtime, chunks, optimizer, scheduler = _setup(1, 1, None, init_seed=3)
    _train_step(runtime, chunks, optimizer, scheduler, 0)
    params = [p for c in chunks for p in c.module.parameters()]
    moments = [t for c, k in offload.optimizer_tensors(optimizer) for t in [c[k]]]
    grad_buffers = [b.grad_data for b in chunks[0].buffers]
    before = {
        "params": [p.detach().clone() for p in params],
        "param_ptrs": [p.data_ptr() for p in params],
        "moment_ptrs": [t.data_ptr() for t in moments],
    }
    out: dict = {}
    offloader = offload.Offloader()
    if mode == "public":
        out["reports"] = [
            offloader.offload_model(chunks),
            offloader.offload_optimizer(optimizer),
            offloader.load_model(chunks),
            offloader.load_optimizer(optimizer),
        ]
        out["untouched"] = before["param_ptrs"] == [p.data_ptr() for p in params] and before[
            "moment_ptrs"
        ] == [c[k].data_ptr() for c, k in offload.optimizer_tensors(optimizer)]
    elif mode == "moved":
        cpu = torch.device("cpu")
        out["reports"] = [
            offloader._offload_model(chunks, True, cpu),
            offloader._offload_optimizer(optimizer, cpu),
        ]
        out["while_offloaded"] = {
            "params_moved": all(p.data_ptr() != ptr for p, ptr in zip(params, before["param_ptrs"])),
            "moments_moved": all(
                c[k].data_ptr() != ptr
                for (c, k), ptr in zip(offload.optimizer_tensors(optimizer), before["moment_ptrs"])
            ),
            "grad_storage": [g.untyped_storage().size() for g in grad_buffers],
            "main_grad_storage": {p.main_grad.untyped_storage().size() for p in params},
        }
        out["again"] = [
            offloader._offload_model(chunks, True, cpu),
            offloader._offload_optimizer(optimizer, cpu),
        ]
        host_ptrs = [p.data_ptr() for p in params] + [
            c[k].data_ptr() for c, k in offload.optimizer_tensors(optimizer)
        ]
        out["reports"] += [offloader._load_model(chunks), offloader._load_optimizer(optimizer)]
        out["again"] += [offloader._load_model(chunks), offloader._load_optimizer(optimizer)]
        # A second round trip writes into the same host memory: no new (pinned) buffers.
        offloader._offload_model(chunks, True, cpu), offloader._offload_optimizer(optimizer, cpu)
        out["host_reused"] = host_ptrs == [p.data_ptr() for p in params] + [
            c[k].data_ptr() for c, k in offload.optimizer_tensors(optimizer)
        ]
        offloader._load_model(chunks), offloader._load_optimizer(optimizer)
        out["restored"] = all(torch.equal(p, q) for p, q in zip(params, before["params"]))
        out["grads_zero"] = all(g.untyped_storage().size() > 0 and not g.any() for g in grad_buffers)
    out["grad_bytes"] = sum(g.numel() * g.element_size() for g in grad_buffers)
    _train_step(runtime, chunks, optimizer, scheduler, 1)
    out["weights"] = gather_full_state(chunks)
    return out


@pytest.fixture(scope="module")
def reference(pool1) -> dict:
    return pool1.run(f"{__name__}:offload_job", mode="none")[0]


def _same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name, tensor in a.items():
        assert torch.equal(tensor, b[name]), name


def test_on_cpu_the_public_functions_move_nothing_and_training_is_unchanged(pool1, reference):
    run = pool1.run(f"{__name__}:offload_job", mode="public")[0]
    assert run["untouched"]
    for report in run["reports"]:
        assert (report.moved_bytes, report.freed_bytes, report.tensors) == (0, 0, 0)
        assert "already lives in host memory" in report.skipped
    _same_weights(run["weights"], reference["weights"])


def test_gpu_path_moves_every_tensor_and_brings_it_back_exactly(pool1, reference):
    run = pool1.run(f"{__name__}:offload_job", mode="moved")[0]
    model, optim, load_model, load_optim = run["reports"]
    # Parameters copied out, the fp32 gradient buffer released without a copy.
    assert model.moved_bytes == PARAMS * 4
    assert model.freed_bytes == run["grad_bytes"] >= PARAMS * 4
    # Adam's two moments per parameter element (FP32Optimizer: no master copies).
    assert optim.moved_bytes == 2 * PARAMS * 4
    assert (load_model.moved_bytes, load_model.freed_bytes) == (model.moved_bytes, model.freed_bytes)
    assert load_optim.moved_bytes == optim.moved_bytes
    offloaded = run["while_offloaded"]
    assert offloaded["params_moved"] and offloaded["moments_moved"]
    assert offloaded["grad_storage"] == [0] and offloaded["main_grad_storage"] == {0}
    # A second offload (or load) finds nothing to do.
    assert [r.skipped for r in run["again"]] == [
        "already offloaded",
        "already offloaded",
        "nothing was offloaded",
        "nothing was offloaded",
    ]
    assert run["restored"] and run["grads_zero"] and run["host_reused"]
    _same_weights(run["weights"], reference["weights"])


class _FakeDDP(torch.nn.Module):
    """A chunk whose parameters are views of one buffer, as megatron DDP makes them for the distributed optimizer."""

    def __init__(self) -> None:
        super().__init__()
        self.module = torch.nn.Module()
        storage = torch.arange(10, dtype=torch.float32)
        self.module.w = torch.nn.Parameter(torch.empty(0))
        self.module.b = torch.nn.Parameter(torch.empty(0))
        self.module.w.data = storage[:6].view(2, 3)
        self.module.b.data = storage[6:]
        self.buffers = [_FakeBuffer(storage, torch.ones(10), [self.module.w, self.module.b])]


class _FakeBuffer(SimpleNamespace):
    """megatron's parameter/gradient buffer: its data, and its own grad release / reload."""

    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBuffer

    offload_to_cpu = _ParamAndGradBuffer.offload_to_cpu
    reload_from_cpu = _ParamAndGradBuffer.reload_from_cpu

    def __init__(self, param_data, grad_data, params) -> None:
        super().__init__(param_data=param_data, grad_data=grad_data, params=params, param_data_cpu=None,
                         grad_data_size=0)  # fmt: skip


def test_parameter_buffer_moves_as_one_tensor_and_views_survive():
    chunk = _FakeDDP()
    buffer = chunk.buffers[0]
    buffers, loose = offload.model_tensors([chunk])
    assert buffers == [buffer] and loose == []
    offloader = offload.Offloader()
    attributes = [set(vars(t)) for t in (buffer, chunk.module.w, chunk.module.b)]
    report = offloader._offload_model([chunk], True, torch.device("cpu"))
    # The bookkeeping is the offloader's: nothing is written on the buffer or the parameters.
    assert [set(vars(t)) for t in (buffer, chunk.module.w, chunk.module.b)] == attributes
    assert (report.moved_bytes, report.freed_bytes, report.tensors) == (40, 40, 2)
    assert buffer.param_data.untyped_storage().size() == 0
    assert chunk.module.w.untyped_storage().size() == 0  # the views lost their memory too
    offloader._load_model([chunk])
    assert torch.equal(chunk.module.w, torch.tensor([[0.0, 1, 2], [3, 4, 5]]))
    assert torch.equal(chunk.module.b, torch.tensor([6.0, 7, 8, 9]))
    # Still views of the buffer: an update through the buffer reaches the parameter.
    buffer.param_data.add_(1)
    assert chunk.module.b[0].item() == 7.0
    assert torch.equal(buffer.grad_data, torch.zeros(10))


def test_plain_module_on_cpu_is_left_alone():
    linear = torch.nn.Linear(3, 2)
    linear(torch.ones(1, 3)).sum().backward()
    ptr, grad = linear.weight.data_ptr(), linear.weight.grad.clone()
    report = offload.Offloader().offload_model([linear])
    assert report.skipped and report.tensors == 0
    assert linear.weight.data_ptr() == ptr and torch.equal(linear.weight.grad, grad)
    assert offload.device_memory_gb() == {"allocated_gb": 0.0, "reserved_gb": 0.0}


def test_actor_param_offload_with_the_native_engine_is_a_config_error():
    from tests.test_config import QUICKSTART
    from verl_megatron.errors import ConfigError
    from verl_megatron.trainer.config import load_config, validate_config

    config = load_config(QUICKSTART, ["actor.megatron.param_offload=true"])
    with pytest.raises(
        ConfigError, match=r"actor.megatron.param_offload=true cannot apply with rollout.name='native'"
    ):
        validate_config(config, 1)
    validate_config(load_config(QUICKSTART, ["actor.megatron.optimizer_offload=true"]), 1)
