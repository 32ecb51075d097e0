"""``actor.optim.optimizer_cpu_offload``: megatron's HybridDeviceOptimizer, a GPU-only path.

megatron-core 0.16.1's hybrid optimizer copies the first ``optimizer_offload_fraction`` of the
CUDA parameters (by element count) to the host and steps those copies there; parameters that
are on the host already get no copy, and its first step raises ``KeyError`` looking one up
(``_set_sub_optimizer_grads``). On this CPU-only machine the key is therefore refused, by
name, at start-up (``validate``) and in ``build_optimizer``. What runs here: the config keys'
checks, and megatron building the hybrid optimizer from the OptimizerConfig this project
passes, inside its fp32, mixed-precision and distributed optimizers (construction needs no
CUDA), with the fraction, the per-parameter CPU optimizers and AdamW's settings it was given.
"""

from __future__ import annotations

import dataclasses

import pytest

from tests.test_actor_update import kl_actor_config


def build_job(path: str) -> dict:
    """megatron's optimizer from ``optimizer_config`` for fp32 and bf16 + distributed optimizer;
    and ``build_optimizer``'s refusal on this machine."""
    from megatron.core.optimizer import get_megatron_optimizer

    from verl_megatron.distributed.parallel import ParallelLayout, init_runtime
    from verl_megatron.errors import WorkerConfigError
    from verl_megatron.models.builder import build_gpt_chunks
    from verl_megatron.models.config import ModelConfig, load_hf_config
    from verl_megatron.models.megatron_model import build_optimizer, optimizer_config, wrap_ddp
    from verl_megatron.workers.lr_schedule import optim_settings

    runtime = init_runtime(ParallelLayout(tp=1, pp=1), seed=5)
    out = {}
    for dtype, distributed in (("float32", False), ("bfloat16", True)):
        model_cfg = ModelConfig(path=path, dtype=dtype, use_te=False)
        chunks = build_gpt_chunks(load_hf_config(path), runtime, model_cfg)
        optim = dataclasses.replace(
            kl_actor_config().optim,
            use_distributed_optimizer=distributed,
            optimizer_cpu_offload=True,
            optimizer_offload_fraction=0.25,
        )
        settings = optim_settings(optim, bf16=dtype == "bfloat16")
        chunks = wrap_ddp(chunks, settings)
        try:
            build_optimizer(chunks, settings)
            out[f"{dtype} refused"] = None
        except WorkerConfigError as err:
            out[f"{dtype} refused"] = str(err)
        hybrid = get_megatron_optimizer(optimizer_config(settings), chunks).optimizer
        cpu = hybrid.cpu_optimizers
        out[dtype] = {
            "wrapper": type(hybrid).__name__,
            "fraction": hybrid.offload_fraction,
            "fp32_update": hybrid.param_update_in_fp32,
            "cpu_optimizers": len(cpu),
            "stepped": sum(len(g["params"]) for g in hybrid.param_groups),
            "cpu_class": sorted({type(o).__name__ for o in cpu}),
            "lr": {g["lr"] for o in cpu for g in o.param_groups},
            "dtypes": sorted({str(p.dtype) for o in cpu for g in o.param_groups for p in g["params"]}),
        }
    return out


def test_megatron_builds_the_hybrid_optimizer_and_the_cpu_refuses_it(pool1, model_path):
    (out,) = pool1.run(f"{__name__}:build_job", path=model_path)
    for dtype in ("float32", "bfloat16"):
        assert out[f"{dtype} refused"] is not None and out[f"{dtype} refused"].startswith(
            "optim.optimizer_cpu_offload=true needs CUDA parameters"
        ), out[f"{dtype} refused"]
        built = out[dtype]
        # Every parameter here is on the host: all of them go to the CPU optimizers, one each
        # (overlap_cpu_optimizer_d2h_h2d), stepping the fp32 masters (bf16: the distributed
        # optimizer's main shards).
        assert built["wrapper"] == "HybridDeviceOptimizer" and built["fraction"] == 0.25, built
        assert built["fp32_update"] and built["cpu_class"] == ["AdamW"], built
        assert built["cpu_optimizers"] == built["stepped"] > 0 and built["dtypes"] == ["torch.float32"], built
        assert built["lr"] == {kl_actor_config().optim.lr}, built


def test_offload_keys_are_checked():
    from verl_megatron.errors import WorkerConfigError
    from verl_megatron.workers.config import ActorConfig, CriticConfig, OffloadConfig, OptimConfig

    with pytest.raises(
        WorkerConfigError, match=r"optim\.optimizer_offload_fraction must be in \[0, 1\], got 1\.5"
    ):
        OptimConfig(optimizer_cpu_offload=True, optimizer_offload_fraction=1.5)
    for config, role in ((ActorConfig, "actor"), (CriticConfig, "critic")):
        with pytest.raises(WorkerConfigError, match=rf"set {role}\.megatron\.optimizer_offload=false"):
            config(
                optim=OptimConfig(optimizer_cpu_offload=True), megatron=OffloadConfig(optimizer_offload=True)
            )
        worker = config(optim=OptimConfig(optimizer_cpu_offload=True), ppo_micro_batch_size_per_gpu=1)
        with pytest.raises(
            WorkerConfigError, match=rf"^{role}\.optim\.optimizer_cpu_offload=true needs CUDA"
        ):
            worker.validate()


def test_planned_split_follows_megatrons_order_and_fraction():
    """``planner.shards`` puts the first ``optimizer_offload_fraction`` of the parameters (by
    element count, while the offloaded count is below the threshold) in host memory, as
    HybridDeviceOptimizer picks them: 10 + 30 of 100 elements at fraction 0.25 (threshold 25)."""
    from types import SimpleNamespace

    import torch

    from verl_megatron.planner.shards import _moment_bytes

    params = [torch.nn.Parameter(torch.zeros(n)) for n in (10, 30, 60)]
    inner = SimpleNamespace(optimizer=torch.optim.AdamW(params))

    def adam(n: int) -> int:  # exp_avg + exp_avg_sq (float32) + a float32 step
        return 8 * n + 4

    assert _moment_bytes(inner, 0.0) == (adam(10) + adam(30) + adam(60), 0)
    host = adam(10) + adam(30) + 8 * (10 + 30)  # + float32 param and gradient copies
    assert _moment_bytes(inner, 0.25) == (adam(60), host)
    assert _moment_bytes(inner, 1.0) == (0, host + adam(60) + 8 * 60)
