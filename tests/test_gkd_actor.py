"""GKD distillation through the actor's megatron loss path (``algorithm.distill.loss: gkd_jsd``).

One actor update on make_batch() with the teacher's logits in the batch and zero advantages, so
the loss is the generalized JSD alone, aggregated like the policy loss over micro-batches of 3
rows (plain SGD at lr=1, no clipping: the change of every weight is minus its gradient). The
reference is TRL's ``GKDTrainer.generalized_jsd_loss`` on transformers' logits in float64 at the
same response positions (labels -100 where response_mask is 0): the logged ``actor/gkd_jsd``, the
gradients and the grad norm must match it within 3x the error of the same computation in float32
(``tests/test_sft.assert_matches_float64``), at tp=1, tp=2 (the vocabulary split over ranks,
padded columns dropped) and pp=2, and the loss must equal one process's.
"""

from __future__ import annotations

import pytest
import torch

from tests.test_actor_update import BATCH, TEMPERATURE, TP_LEN, TR_LEN, VOCAB, full_weights, make_batch
from tests.test_distill_math import _trl_jsd
from tests.test_sft import assert_matches_float64, float32_error, sgd_config

BETA, JSD_TEMPERATURE = 0.3, 0.9


def teacher_logits() -> torch.Tensor:
    """[B, Tr, V] logits of a made-up teacher (sharper than the tiny student)."""
    return torch.randn(BATCH, TR_LEN, VOCAB, generator=torch.Generator().manual_seed(3)) * 3


def gkd_job(path: str, tp: int, pp: int) -> dict:
    """Student log-probs, then one update with the JSD loss: loss, grad norm, gradients (HF names)."""
    from tests.test_actor_update import build_actor
    from verl_megatron.distributed.parallel import ParallelLayout, init_runtime
    from verl_megatron.protocol import DataProto

    runtime = init_runtime(ParallelLayout(tp=tp, pp=pp), seed=5)
    cfg = sgd_config(ppo_micro_batch_size_per_gpu=3, use_remove_padding=True)
    cfg.ppo_mini_batch_size = BATCH
    chunks, actor = build_actor(runtime, path, cfg)
    batch = make_batch()
    batch["advantages"] = torch.zeros_like(batch["advantages"])  # the JSD is the whole loss
    batch["teacher_logits"] = teacher_logits()
    meta = {"temperature": TEMPERATURE, "distill_jsd": {"beta": BETA, "temperature": JSD_TEMPERATURE}}
    data = DataProto.from_dict(batch, meta_info=meta)
    before = full_weights(chunks, runtime)
    data.batch["old_log_probs"], _ = actor.compute_log_prob(data)
    metrics = actor.update_policy(data)
    after = full_weights(chunks, runtime)
    return {
        "log_probs": data.batch["old_log_probs"],
        "loss": metrics["actor/gkd_jsd"][0],
        "pg_loss": metrics["actor/pg_loss"][0],
        "grad_norm": metrics["actor/grad_norm"][0],
        "grads": {k: before[k].double() - after[k].double() for k in before},
        "weights": before,
    }


def hf_reference(path: str, dtype: torch.dtype) -> dict:
    """TRL's JSD (batchmean over the trained response tokens) of transformers' logits in ``dtype``."""
    from transformers import AutoModelForCausalLM

    batch = make_batch()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    logits = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        position_ids=batch["position_ids"],
    ).logits[:, TP_LEN - 1 : -1]
    labels = torch.where(batch["response_mask"].bool(), batch["responses"], -100)
    loss = _trl_jsd()(
        logits, teacher_logits().to(dtype), labels=labels, beta=BETA, temperature=JSD_TEMPERATURE
    )
    loss.backward()
    log_probs = torch.log_softmax(logits.detach() / TEMPERATURE, -1).gather(-1, batch["responses"][..., None])
    valid = batch["attention_mask"][:, TP_LEN:].bool()
    return {
        "log_probs": torch.where(valid, log_probs[..., 0], 0.0).double(),
        "loss": float(loss.detach()),
        "grads": {n: p.grad.double() for n, p in model.named_parameters()},
        "logits": logits.detach(),
    }


@pytest.fixture(scope="module")
def references(model_path) -> dict:
    exact = hf_reference(model_path, torch.float64)
    return {"token-mean": (exact, float32_error(exact, hf_reference(model_path, torch.float32)))}


@pytest.fixture(scope="module")
def single(pool1, model_path) -> dict:
    return pool1.run(f"{__name__}:gkd_job", path=model_path, tp=1, pp=1)[0]


def test_gkd_loss_through_the_actor_equals_trl(single, references):
    from verl_megatron.algos.gkd import generalized_jsd_loss

    assert single["pg_loss"] == 0.0 and single["loss"] > 0.05
    assert_matches_float64(single, "gkd:tp1", references)
    # algos/gkd.py (float32 chunks) on the same logits gives the reference loss to float32 rounding.
    exact = references["token-mean"][0]
    batch = make_batch()
    labels = torch.where(batch["response_mask"].bool(), batch["responses"], -100)
    logits = exact["logits"]
    ours = float(generalized_jsd_loss(logits, teacher_logits().double(), labels, BETA, JSD_TEMPERATURE))
    assert abs(ours - exact["loss"]) <= 1e-6 * max(1.0, exact["loss"]), (ours, exact["loss"])


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_gkd_update_under_tp_and_pp_equals_one_process(pool2, model_path, references, single, tp, pp):
    run = pool2.run(f"{__name__}:gkd_job", path=model_path, tp=tp, pp=pp)[0]  # rank 0: whole weights
    assert_matches_float64(run, f"gkd:tp{tp}pp{pp}", references)
    diff = abs(run["loss"] - single["loss"])
    assert diff <= 1e-6 * single["loss"], f"tp={tp} pp={pp}: JSD loss differs from one process by {diff:.3g}"
