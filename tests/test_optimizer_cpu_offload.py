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


def precision_aware_job(path: str) -> dict:
    """bf16 + distributed optimizer + CPU step + precision-aware, built by megatron (its
    OptimizerConfig reads Transformer Engine's version: stubbed here, restored after), beside
    the planner's count of the plain build; and the first step on this machine."""
    import megatron.core.optimizer.optimizer_config as mcore_config
    import torch
    from megatron.core.optimizer import get_megatron_optimizer

    from verl_megatron.distributed.parallel import ParallelLayout, init_runtime
    from verl_megatron.models.builder import build_gpt_chunks
    from verl_megatron.models.config import ModelConfig, load_hf_config
    from verl_megatron.models.megatron_model import optimizer_config, wrap_ddp
    from verl_megatron.planner.shards import count_state
    from verl_megatron.workers.lr_schedule import optim_settings

    runtime = init_runtime(ParallelLayout(tp=1, pp=1), seed=5)
    optim = dataclasses.replace(
        kl_actor_config().optim,
        use_distributed_optimizer=True,
        optimizer_cpu_offload=True,
        use_precision_aware_optimizer=True,
    )
    planned = {}
    for aware in (True, False):
        chunks = build_gpt_chunks(
            load_hf_config(path), runtime, ModelConfig(path=path, dtype="bfloat16", use_te=False)
        )
        settings = optim_settings(dataclasses.replace(optim, use_precision_aware_optimizer=aware), bf16=True)
        chunks = wrap_ddp(chunks, settings)
        if not aware:  # the planner's plain build, counted as the precision-aware CPU step
            plain = optim_settings(
                dataclasses.replace(optim, optimizer_cpu_offload=False, use_precision_aware_optimizer=False),
                bf16=True,
            )
            opt = get_megatron_optimizer(optimizer_config(plain), chunks)
            planned = {f: vars(count_state(chunks, opt, f, True)) for f in (0.0, 1.0)}
            continue
        stub, mcore_config.is_te_min_version = mcore_config.is_te_min_version, lambda *a, **k: False
        try:
            (dist,) = get_megatron_optimizer(optimizer_config(settings), chunks).chained_optimizers
        finally:
            mcore_config.is_te_min_version = stub
    hybrid = dist.optimizer
    stepped = [p for g in hybrid.param_groups for p in g["params"]]
    for p in stepped:
        p.decoupled_grad = torch.zeros_like(p)
    try:
        hybrid.step()
        step = "ran"
    except KeyError:
        step = "KeyError"
    copies = list(hybrid.param_to_fp32_param.values())
    return {
        "no masters": all(p is None for g in dist.shard_fp32_from_float16_groups for p in g),
        "stepped dtypes": sorted({str(p.dtype) for p in stepped}),
        "copies": (len(copies), len(stepped), sorted({str(c.dtype) for c in copies})),
        "copy elements": sum(c.numel() for c in copies),
        "step": step,
        "planned": planned,
    }


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


def test_precision_aware_keys_are_checked():
    from verl_megatron.errors import WorkerConfigError
    from verl_megatron.models.megatron_model import check_precision_aware_support
    from verl_megatron.workers.config import ActorConfig, OptimConfig

    aware = dict(
        use_precision_aware_optimizer=True, optimizer_cpu_offload=True, use_distributed_optimizer=True
    )
    for wrong, needs in (
        ({"optimizer_cpu_offload": False}, r"needs optim\.optimizer_cpu_offload=true"),
        ({"use_distributed_optimizer": False}, r"needs optim\.use_distributed_optimizer=true .* got False"),
        ({"optimizer": "sgd"}, r"needs .* got True and 'sgd'"),
    ):
        with pytest.raises(WorkerConfigError, match=rf"^optim\.use_precision_aware_optimizer=true {needs}"):
            OptimConfig(**{**aware, **wrong})
    # This machine: no CUDA (refused by the CPU step first), no Transformer Engine.
    worker = ActorConfig(optim=OptimConfig(**aware), ppo_micro_batch_size_per_gpu=1)
    with pytest.raises(WorkerConfigError, match=r"^actor\.optim\.optimizer_cpu_offload=true needs CUDA"):
        worker.validate()
    with pytest.raises(
        WorkerConfigError, match=r"^critic\.optim\.use_precision_aware_optimizer=true needs Transformer"
    ):
        check_precision_aware_support("critic.optim")


def test_planned_masters_with_precision_aware_by_hand():
    """A float32 parameter (no master) of 5 elements, then masters of 10, 30 and 60: at fraction
    0.25 (threshold 26.25) the first three are offloaded, so only the 60-element master (240 B)
    stays on the GPU with the precision-aware optimizer; all 100 (400 B) without it; none at 1."""
    from types import SimpleNamespace

    import torch

    from verl_megatron.planner.shards import _gpu_master_bytes

    own, *masters = (torch.zeros(n) for n in (5, 10, 30, 60))
    inner = SimpleNamespace(
        optimizer=torch.optim.AdamW([own, *masters]), shard_fp32_from_float16_groups=[masters]
    )
    assert _gpu_master_bytes(inner, 0.25, True) == 4 * 60
    assert _gpu_master_bytes(inner, 0.25, False) == 4 * 100 == _gpu_master_bytes(inner, 0.0, True)
    assert _gpu_master_bytes(inner, 1.0, True) == 0


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


def test_precision_aware_has_no_gpu_masters_as_planned(pool1, model_path):
    """megatron 0.16.1 with use_precision_aware_optimizer: the distributed optimizer keeps no fp32
    masters, it hands the bf16 shards (gradients as ``decoupled_grad``) to the hybrid optimizer,
    which makes one float32 copy of each (host memory for the offloaded ones on a GPU); its first
    step on host parameters raises KeyError here. The planner, from the plain build: at fraction 1
    no master on the GPU and 16 B an element + a 4-byte step in host memory (moments 8, the copy
    4, its gradient 4), the copies megatron made; at fraction 0 the plain masters, 4 B each."""
    (aware,) = pool1.run(f"{__name__}:precision_aware_job", path=model_path)
    n, stepped, dtypes = aware["copies"]
    assert aware["no masters"] and aware["stepped dtypes"] == ["torch.bfloat16"], aware
    assert n == stepped > 0 and dtypes == ["torch.float32"] and aware["step"] == "KeyError", aware
    elements = aware["copy elements"]
    full, none = aware["planned"][1.0], aware["planned"][0.0]
    assert full["master"] == 0 and full["moments"] == 0, full
    assert full["host"] == 16 * elements + 4 * n, (full, elements, n)
    assert none["master"] == 4 * elements and none["host"] == 0 and none["moments"] == 8 * elements + 4 * n, (
        none
    )
