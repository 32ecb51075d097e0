"""Native rollout of image + text prompts on the tiny Qwen2.5-VL: the actor's log-probs, one vision pass.

Three prompts (the ``check-hf`` prompts with one and with two images, and a text-only prompt,
collated by ``collate_multimodal_prompts``: left-padded, ``position_ids`` [B, 3, Tp], per-row
``multi_modal_inputs``) sample n=2 responses each. The engine's output goes to the actor as it is
(its ``position_ids`` [B*n, 3, T] continue each prompt's 3-D ids, its image column is repeated
per sample): the actor's ``compute_log_prob`` must give the rollout's log-probs within 1e-4
(float32; the rollout's cache and fused rotary sum in another order; measured 9.5e-7 at tp=1
and at tp=2), at tp=1 and tp=2. The vision tower runs once per call, on the three prompts' three images (not once per
sample): a forward hook counts its calls and the grids it sees.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.closeness import assert_close_report
from tests.test_vl_actor import collated_prompts, vl_path  # noqa: F401  (fixture)

N = 2
TR = 6
ATOL = 1e-4


def vl_prompts(path: str, hf_config):
    """DataProto of the three prompts (verl's prompt batch of image rows)."""
    from verl_megatron.protocol import DataProto

    batch, images = collated_prompts(path, hf_config, [0, 1, 2])
    column = np.empty(len(images), dtype=object)
    column[:] = images
    return DataProto.from_dict(dict(batch), {"multi_modal_inputs": column}, {"temperature": 1.0})


def vl_rollout_job(path: str, tp: int, parity: bool = False) -> dict:
    """Rollout output, the actor's log-probs of it, and the vision tower's calls (grid rows per call);
    ``parity``: rollout.bitwise_parity (the batch-invariant kernels, ``tests/test_vl_parity.py``)."""
    from tests.test_actor_update import kl_actor_config
    from verl_megatron.distributed.modules import unwrap
    from verl_megatron.distributed.parallel import ParallelLayout, init_runtime
    from verl_megatron.models import batch_invariant
    from verl_megatron.models.builder import build_gpt_chunks
    from verl_megatron.models.config import ModelConfig, load_hf_config
    from verl_megatron.models.convert import load_hf_weights
    from verl_megatron.models.matmul_route import MatmulRoute
    from verl_megatron.models.megatron_model import build_optimizer, wrap_ddp
    from verl_megatron.rollout import RolloutConfig, build_rollout
    from verl_megatron.workers.actor import MegatronActor
    from verl_megatron.workers.lr_schedule import build_lr_scheduler, optim_settings

    runtime = init_runtime(ParallelLayout(tp=tp), seed=5)
    hf_config = load_hf_config(path)
    prompts = vl_prompts(path, hf_config)
    model_cfg = ModelConfig(path=path, dtype="float32", use_te=False)
    # parity's batch-invariant kernels run through the linears' matmul route (models/matmul_route.py)
    chunks = build_gpt_chunks(hf_config, runtime, model_cfg, route=MatmulRoute() if parity else None)
    load_hf_weights(chunks, path, runtime, model_cfg)
    chunks = wrap_ddp(chunks)
    length = prompts.batch["input_ids"].shape[1]
    invariance = batch_invariant.enable(chunks, length + TR) if parity else None
    cfg = kl_actor_config(ppo_micro_batch_size_per_gpu=2)
    optimizer = build_optimizer(chunks, optim_settings(cfg.optim))
    scheduler = build_lr_scheduler(optimizer, cfg.optim)
    actor = MegatronActor(runtime, cfg, chunks, optimizer, scheduler, batch_invariance=invariance)
    calls: list[int] = []
    unwrap(chunks[0]).vision.register_forward_hook(lambda m, args, out: calls.append(int(args[1].shape[0])))
    config = RolloutConfig(
        prompt_length=length, response_length=TR, n=N, ignore_eos=True, seed=3, bitwise_parity=parity
    )
    tokenizer = SimpleNamespace(pad_token_id=0, eos_token_id=None)
    out = build_rollout(config, runtime, chunks, tokenizer, hf_config).generate_sequences(prompts)
    rollout_calls = list(calls)
    out.meta_info["temperature"] = 1.0
    log_probs = actor.compute_log_prob(out)[0]
    return {
        "rollout": out.batch["rollout_log_probs"].clone(),
        "actor": log_probs.clone(),
        "mask": out.batch["response_mask"].clone(),
        "positions": out.batch["position_ids"].clone(),
        "prompt_positions": prompts.batch["position_ids"].clone(),
        "images_per_row": [
            len(r["image_grid_thw"]) if r else 0 for r in out.non_tensor_batch["multi_modal_inputs"]
        ],
        "vision_calls": rollout_calls,
    }


def _check(run: dict, where: str) -> None:
    from verl_megatron.workers.vl_inputs import with_response_positions

    mask = run["mask"].bool()
    assert mask.shape == (3 * N, TR) and bool(mask.all()), f"{where}: ignore_eos rows must be full: {mask}"
    assert_close_report(
        run["rollout"][mask], run["actor"][mask], atol=ATOL, rtol=0, what=f"{where} log-probs"
    )
    assert run["vision_calls"] == [3], f"{where}: vision tower calls (grid rows each): {run['vision_calls']}"
    assert run["images_per_row"] == [1, 1, 2, 2, 0, 0], run["images_per_row"]
    expected = with_response_positions(run["prompt_positions"], TR).repeat_interleave(N, dim=0)
    assert torch.equal(run["positions"], expected), f"{where}: response positions"


@pytest.fixture(scope="module")
def single(pool1, vl_path):  # noqa: F811
    (run,) = pool1.run(f"{__name__}:vl_rollout_job", path=vl_path, tp=1)
    return run


def test_native_rollout_of_image_prompts_matches_the_actor(single):
    _check(single, "tp=1")


def test_native_rollout_of_image_prompts_at_tp2(pool2, vl_path, single):  # noqa: F811
    ranks = pool2.run(f"{__name__}:vl_rollout_job", path=vl_path, tp=2)
    for rank, run in enumerate(ranks):
        _check(run, f"tp=2 rank {rank}")
    # Same seed, same tokens' log-probs: tp=2 samples what one process samples.
    assert_close_report(ranks[0]["rollout"], single["rollout"], atol=ATOL, rtol=0, what="tp=2 vs tp=1")
