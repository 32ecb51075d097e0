"""Bitwise rollout/training parity: the native engine's log-probs ARE the actor's old_log_probs.

A tiny Llama generates with the native engine on the actor's own (DDP-wrapped) chunks, with
sampling, EOS (so rows stop at different steps and the decoder compacts its batch) and n=2;
the actor then recomputes ``old_log_probs`` with ``compute_log_prob``. With
``rollout.bitwise_parity`` (``models/batch_invariant.py`` switched on) the two must be equal to
the last bit at tp=1, tp=2, pp=2 and with packed rows + dynamic micro-batches; without it they
differ by float rounding (the test shows that too). Also: the batch-invariant matmul really is
invariant (a row's result does not depend on the other rows, at several thread counts), and
an update with bypass (rollout log-probs as old_log_probs) gives the losses of the ordinary one.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

VOCAB, PAD, EOS = 80, 0, 1
PROMPT_LENGTHS = [5, 2, 7, 3, 6, 4]
PROMPT_LENGTH, RESPONSE_LENGTH, N = 8, 10, 2
TEMPERATURE = 0.9

# Micro-batching of compute_log_prob: padded rows of 3, or packed rows under a token budget.
LAYOUTS = {
    "padded": {"use_remove_padding": False, "ppo_infer_micro_batch_size_per_gpu": 3},
    "packed_dynamic": {
        "use_remove_padding": True,
        "use_dynamic_bsz": True,
        "ppo_infer_max_token_len_per_gpu": 40,
    },
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from verl_megatron.utils.local_assets import build_tiny_hf_model

    path = tmp_path_factory.mktemp("parity_llama")
    build_tiny_hf_model(
        path, "llama", vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
        intermediate_size=64, seed=7, initializer_range=0.1, bos_token_id=None, eos_token_id=EOS,
        pad_token_id=PAD,
    )  # fmt: skip
    return str(path)


def _prompts(seed: int = 0):
    from verl_megatron.protocol import DataProto

    g = torch.Generator().manual_seed(seed)
    ids = torch.full((len(PROMPT_LENGTHS), PROMPT_LENGTH), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(PROMPT_LENGTHS):
        ids[i, PROMPT_LENGTH - n :] = torch.randint(2, VOCAB, (n,), generator=g)
        mask[i, PROMPT_LENGTH - n :] = 1
    return DataProto.from_dict(
        {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)},
        non_tensors={"uid": np.array([f"p{i}" for i in range(len(PROMPT_LENGTHS))], dtype=object)},
    )


def _actor(runtime, model_dir: str, layout: str, parity: bool):
    from tests.test_actor_update import build_model
    from verl_megatron.models import batch_invariant
    from verl_megatron.models.megatron_model import build_optimizer
    from verl_megatron.workers.actor import MegatronActor
    from verl_megatron.workers.config import ActorConfig, OptimConfig
    from verl_megatron.workers.lr_schedule import build_lr_scheduler, optim_settings

    cfg = ActorConfig(
        ppo_mini_batch_size=3, ppo_micro_batch_size_per_gpu=2, rollout_n=N, ppo_max_token_len_per_gpu=40,
        optim=OptimConfig(lr=1e-2, weight_decay=0.0, clip_grad=1.0), **LAYOUTS[layout],
    )  # fmt: skip
    chunks = build_model(runtime, model_dir)
    if parity:
        batch_invariant.enable(chunks, PROMPT_LENGTH + RESPONSE_LENGTH)
    optimizer = build_optimizer(chunks, optim_settings(cfg.optim))
    return MegatronActor(runtime, cfg, chunks, optimizer, build_lr_scheduler(optimizer, cfg.optim))


def _rollout(runtime, actor, model_dir: str, parity: bool):
    from verl_megatron.models.config import load_hf_config
    from verl_megatron.rollout import RolloutConfig, build_rollout

    config = RolloutConfig(
        prompt_length=PROMPT_LENGTH, response_length=RESPONSE_LENGTH, n=N, temperature=TEMPERATURE, seed=3,
        bitwise_parity=parity,
    )  # fmt: skip
    tokenizer = SimpleNamespace(pad_token_id=PAD, eos_token_id=EOS)
    return build_rollout(config, runtime, actor.chunks, tokenizer, load_hf_config(model_dir))


def parity_job(model_dir: str, tp: int, pp: int, layouts: list[str], parity: bool) -> dict:
    """Per layout: rollout log-probs, old_log_probs and the response mask of one generated batch."""
    from verl_megatron.distributed.parallel import ParallelLayout, init_runtime

    runtime = init_runtime(ParallelLayout(tp=tp, pp=pp), seed=5)
    out = {}
    for layout in layouts:
        actor = _actor(runtime, model_dir, layout, parity)
        batch = _rollout(runtime, actor, model_dir, parity).generate_sequences(_prompts())
        batch.meta_info["temperature"] = TEMPERATURE
        old_log_probs, _ = actor.compute_log_prob(batch)
        out[layout] = {
            "rollout": batch.batch["rollout_log_probs"].clone(),
            "old": old_log_probs.clone(),
            "mask": batch.batch["response_mask"].clone(),
        }
    return out


def parity_report(result: dict) -> tuple[float, str]:
    """(max |rollout - old| over response tokens, where it is and how many tokens differ)."""
    mask = result["mask"].bool()
    diff = torch.where(mask, (result["rollout"] - result["old"]).abs(), torch.zeros(()))
    worst = float(diff.max())
    row, col = (int(i) for i in torch.unravel_index(diff.argmax(), diff.shape))
    where = (
        f"max |rollout_log_probs - old_log_probs| = {worst:.3g} at [{row}, {col}] "
        f"(rollout {float(result['rollout'][row, col]):.9g}, old {float(result['old'][row, col]):.9g}); "
        f"{int((diff > 0).sum())} of {int(mask.sum())} response tokens differ"
    )
    return worst, where


# ------------------------------------------------------------------ the trainer: metrics and bypass

QUICKSTART_PARITY = [
    "quickstart.num_digits=2",
    "data.train_batch_size=4",
    "data.max_response_length=3",
    "rollout.n=4",
    "rollout.bitwise_parity=true",
    "actor.ppo_mini_batch_size=2",  # two optimizer steps per training step
    "actor.ppo_micro_batch_size_per_gpu=4",
    "actor.use_remove_padding=true",
    "actor.use_dynamic_bsz=true",
    "actor.ppo_max_token_len_per_gpu=24",
    "actor.ppo_infer_max_token_len_per_gpu=24",
    "trainer.total_training_steps=2",
    "trainer.val_before_train=false",
    "trainer.test_freq=-1",
    "trainer.save_freq=-1",
    "trainer.export_hf=false",
    "trainer.resume_mode=disable",
    "trainer.logger=[console]",
]


def trainer_job(out_dir: str, overrides: list[str]) -> dict:
    """A short quickstart run (on every rank of a pool); its metrics and how often the actor
    recomputed log-probs (rank 0)."""
    import os

    import torch.distributed as dist

    from tests.test_e2e import QUICKSTART
    from verl_megatron.train import run
    from verl_megatron.trainer.tracking import read_jsonl_metrics
    from verl_megatron.workers.actor import MegatronActor

    calls = []
    original = MegatronActor.compute_log_prob

    def counted(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    MegatronActor.compute_log_prob = counted
    try:
        run(QUICKSTART, [f"trainer.default_local_dir={out_dir}", *QUICKSTART_PARITY, *overrides])
    finally:
        MegatronActor.compute_log_prob = original
    if dist.get_rank() != 0:
        return {}
    rows = read_jsonl_metrics(os.path.join(out_dir, "metrics.jsonl"))
    return {"rows": [r for r in rows if r.get("step", 0) > 0], "log_prob_calls": len(calls)}
