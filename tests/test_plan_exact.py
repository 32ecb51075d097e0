"""``verl-megatron plan``'s model-state bytes equal what a real CPU job allocates, rank by rank.

Each case builds the actor as the trainer does (megatron model, LoRA, DDP, optimizer, one
optimizer step so Adam's state exists) in the 2-process pool and sums the storages of its
tensors by category; the planner builds the same rank on the meta device under a fake process
group of world size 2 in this process. Parameters, gradient buffers, master weights and
optimizer moments must be equal to the byte.
"""

from __future__ import annotations

import pytest
import torch

from verl_megatron.distributed.parallel import ParallelLayout
from verl_megatron.models.config import ModelConfig, load_hf_config
from verl_megatron.planner.shards import RoleSpec, StateBytes, build_role_state
from verl_megatron.workers.config import OptimConfig

CASES = {
    "tp2": dict(layout=dict(tp=2), distopt=False, lora=0, moe=False),
    "pp2": dict(layout=dict(pp=2), distopt=False, lora=0, moe=False),
    "dp2_distopt": dict(layout=dict(), distopt=True, lora=0, moe=False),
    "ep2_distopt": dict(layout=dict(ep=2), distopt=True, lora=0, moe=True),
    "lora_tp2": dict(layout=dict(tp=2), distopt=False, lora=4, moe=False),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[bool, str]:
    from verl_megatron.utils.local_assets import build_tiny_hf_model

    paths = {}
    for moe, family in ((False, "llama"), (True, "qwen3_moe")):
        path = str(tmp_path_factory.mktemp(family))
        # 131 rows: the vocabulary is padded (to 256), as real vocabularies are.
        build_tiny_hf_model(path, family, vocab_size=131, hidden_size=32, num_layers=2, num_heads=4,
                            num_kv_heads=2, intermediate_size=64, seed=3)  # fmt: skip
        paths[moe] = path
    return paths


def _model_config(lora: int) -> ModelConfig:
    return ModelConfig(dtype="bfloat16", use_te=False, lora_rank=lora, lora_alpha=8)


def _storages(tensors) -> dict[int, int]:
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}


def real_state_job(path: str, layout: dict, distopt: bool, lora: int) -> dict[str, int]:
    """Build the actor on this rank as the trainer does, step once, and sum its tensors' storages."""
    from verl_megatron.distributed.modules import unwrap
    from verl_megatron.distributed.parallel import init_runtime
    from verl_megatron.models.builder import build_gpt_chunks
    from verl_megatron.models.lora import apply_configured_lora
    from verl_megatron.models.megatron_model import build_optimizer, wrap_ddp, zero_grads
    from verl_megatron.workers.lr_schedule import optim_settings

    runtime = init_runtime(ParallelLayout(**layout))
    model = _model_config(lora)
    chunks = apply_configured_lora(
        build_gpt_chunks(load_hf_config(path), runtime, model), model, runtime.seed
    )
    settings = optim_settings(OptimConfig(use_distributed_optimizer=distopt), bf16=True)
    chunks = wrap_ddp(chunks, settings)
    optimizer = build_optimizer(chunks, settings)
    zero_grads(chunks, optimizer)
    optimizer.step()
    params = [p for c in chunks for p in unwrap(c).parameters()]
    param_storages = _storages(params)
    grad_storages = _storages(p.main_grad for p in params if getattr(p, "main_grad", None) is not None)
    inners = list(getattr(optimizer, "chained_optimizers", None) or [optimizer])
    stepped = [p for o in inners for g in o.optimizer.param_groups for p in g["params"]]
    master = {
        k: v for k, v in _storages(stepped).items() if k not in param_storages and k not in grad_storages
    }
    state = [t for o in inners for s in o.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    return {
        "params": sum(param_storages.values()),
        "grads": sum(grad_storages.values()),
        "master": sum(master.values()),
        "moments": sum(_storages(state).values()),
    }


@pytest.mark.parametrize("case", list(CASES))
def test_planned_state_bytes_equal_the_real_jobs_tensors(pool2, models, case):
    spec = CASES[case]
    path = models[spec["moe"]]
    real = pool2.run(
        f"{__name__}:real_state_job",
        path=path,
        layout=spec["layout"],
        distopt=spec["distopt"],
        lora=spec["lora"],
    )
    role = RoleSpec(
        "actor",
        load_hf_config(path),
        _model_config(spec["lora"]),
        ParallelLayout(**spec["layout"]),
        optim=OptimConfig(use_distributed_optimizer=spec["distopt"]),
        lora=spec["lora"] > 0,
    )
    for rank in (0, 1):
        _, states = build_role_state(role, 2, rank)
        assert states[None] == StateBytes(**real[rank]), (
            f"{case} rank {rank}: planned {states[None]} != allocated {real[rank]}"
        )
        assert states[None].master > 0 and states[None].moments > 0, states[None]


def test_distributed_optimizer_halves_optimizer_state_at_dp2(models):
    role = RoleSpec("actor", load_hf_config(models[False]), _model_config(0), ParallelLayout(),
                    optim=OptimConfig(use_distributed_optimizer=False))  # fmt: skip
    _, states = build_role_state(role, 2, 0, (True,))
    plain, sharded = states[None], states[True]
    # The parameter buffer adds megatron's alignment padding (64-element parameter starts).
    assert plain.params < sharded.params < 1.01 * plain.params, (sharded, plain)
    # Master weights and moments of half the (padded) parameters on each dp rank.
    assert abs(sharded.master / plain.master - 0.5) < 0.01, (sharded, plain)
    assert abs(sharded.moments / plain.moments - 0.5) < 0.01, (sharded, plain)
