"""SFT on the megatron actor: per-token losses and gradients equal a float64 transformers forward
with the same mask, under every layout, micro-batching and ``loss_agg_mode``.

One SFT batch (rows of different lengths, loss masks with several assistant spans and gaps, like
a multi-turn chat) is trained for one step with plain SGD at lr=1 and no clipping, so the change
of every weight is minus its gradient. The reference is transformers in float64 on the same
batch: -log p of each target token and the gradient of the aggregated loss. The bound for each
tensor is 3x the error of the same transformers computation in float32 (plus the rounding of
``w - g`` in float32), so it is a float32-rounding bound that holds on any CPU.
"""

from __future__ import annotations

import pytest
import torch

from tests.test_actor_update import full_weights

ROWS, WIDTH = 6, 9
MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "token-sum", "seq-mean-token-sum-norm")
# name -> actor settings; each runs one optimizer step over the whole batch
VARIANTS = {
    "padded": {"use_remove_padding": False, "ppo_micro_batch_size_per_gpu": 1},
    "packed": {"use_remove_padding": True, "ppo_micro_batch_size_per_gpu": 3},
    "dynamic": {"use_remove_padding": True, "use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": 12},
    **{f"agg:{mode}": {"loss_agg_mode": mode, "ppo_micro_batch_size_per_gpu": 3} for mode in MODES[1:]},
}


def sft_items():
    """Rows of lengths 9..4 with trained spans [start, end) like assistant turns of a chat."""
    from verl_megatron.data.sft_dataset import SFTItem

    g = torch.Generator().manual_seed(7)
    lengths = [9, 7, 8, 4, 6, 5]
    spans = [[(2, 5), (7, 9)], [(3, 7)], [(1, 3), (4, 6), (7, 8)], [(2, 4)], [(5, 6)], [(1, 5)]]
    items = []
    for n, row_spans in zip(lengths, spans):
        mask = [0] * n
        for start, end in row_spans:
            mask[start:end] = [1] * (end - start)
        items.append(SFTItem(torch.randint(1, 63, (n,), generator=g).tolist(), mask))
    return items


def sft_batch():
    from verl_megatron.data.sft_dataset import collate_sft

    return collate_sft(sft_items(), pad_token_id=0)


def sgd_config(**settings):
    from verl_megatron.workers.config import ActorConfig, OptimConfig

    optim = OptimConfig(optimizer="sgd", lr=1.0, weight_decay=0.0, clip_grad=0.0)
    return ActorConfig(ppo_mini_batch_size=ROWS, share_prompt_prefix=False, optim=optim, **settings)


def sft_job(path: str, variants: list[str], **layout) -> dict:
    """Per variant: the token log-probs before the step, the step's loss and grad norm, and the
    gradient (weights before - after, HF names), under ``ParallelLayout(**layout)``."""
    from tests.test_actor_update import build_model
    from verl_megatron.distributed.parallel import ParallelLayout, init_runtime
    from verl_megatron.models.megatron_model import build_optimizer
    from verl_megatron.workers.lr_schedule import build_lr_scheduler, optim_settings
    from verl_megatron.workers.sft import SFTActor

    runtime = init_runtime(ParallelLayout(**layout), seed=5)
    out = {}
    for variant in variants:
        cfg = sgd_config(**VARIANTS[variant])
        chunks = build_model(runtime, path)
        optimizer = build_optimizer(chunks, optim_settings(cfg.optim))
        actor = SFTActor(runtime, cfg, chunks, optimizer, build_lr_scheduler(optimizer, cfg.optim))
        before = full_weights(chunks, runtime)
        data = sft_batch()
        log_probs, _ = actor.compute_log_prob(data)
        metrics = actor.sft_update(data)
        after = full_weights(chunks, runtime)
        out[variant] = {
            "log_probs": log_probs,
            "loss": metrics["actor/sft_loss"][0],
            "grad_norm": metrics["actor/grad_norm"][0],
            "grads": {k: before[k].double() - after[k].double() for k in before},
            "weights": before,
        }
    return out


def hf_reference(path: str, dtype: torch.dtype, mode: str, **load) -> dict:
    """transformers in ``dtype``: target log-probs [B, L-1], the aggregated loss and its gradients
    (``load``: more from_pretrained arguments)."""
    from transformers import AutoModelForCausalLM

    from verl_megatron.algos.distill import sft_loss

    batch = sft_batch().batch
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True, **load)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    log_probs = torch.log_softmax(logits, -1).gather(-1, batch["responses"][..., None])[..., 0]
    mask = batch["response_mask"].to(dtype)
    loss = sft_loss(log_probs, mask, mode, loss_scale_factor=None)
    loss.backward()
    valid = batch["attention_mask"][:, 1:].bool()
    return {
        "log_probs": torch.where(valid, log_probs.detach(), 0.0).double(),
        "loss": float(loss.detach()),
        "grads": {n: p.grad.double() for n, p in model.named_parameters()},
    }


def float32_error(exact: dict, single: dict) -> dict:
    """How far a float32 reference's log-probs and gradients are from the float64 one's."""
    return {
        "log_probs": float((single["log_probs"] - exact["log_probs"]).abs().max()),
        "grads": {n: float((single["grads"][n] - exact["grads"][n]).abs().max()) for n in exact["grads"]},
    }


def hf_references(path: str, modes: tuple[str, ...] = MODES, **load) -> dict:
    """Per aggregation mode: transformers' float64 reference and its float32 error."""
    out = {}
    for mode in modes:
        exact = hf_reference(path, torch.float64, mode, **load)
        out[mode] = (exact, float32_error(exact, hf_reference(path, torch.float32, mode, **load)))
    return out


@pytest.fixture(scope="module")
def references(model_path) -> dict:
    return hf_references(model_path)


def _mode(variant: str) -> str:
    return variant.split(":", 1)[1] if variant.startswith("agg:") else "token-mean"


def assert_matches_float64(run: dict, variant: str, references: dict) -> None:
    exact, error = references[_mode(variant)]
    lp_diff = float((run["log_probs"].double() - exact["log_probs"]).abs().max())
    assert lp_diff <= 3 * error["log_probs"] + 1e-7, f"{variant}: log-probs off by {lp_diff:.3g}"
    assert abs(run["loss"] - exact["loss"]) <= 1e-5 * max(1.0, abs(exact["loss"])), (
        variant,
        run["loss"],
        exact["loss"],
    )
    worst = []
    for name, grad in exact["grads"].items():
        got = run["grads"][name]
        # w - g in float32 rounds to half an ulp of the larger of the two.
        rounding = float(torch.finfo(torch.float32).eps) * float(
            run["weights"][name].abs().max() + grad.abs().max()
        )
        bound = 3 * error["grads"][name] + rounding
        diff = (got - grad).abs()
        if float(diff.max()) > bound:
            index = [int(i) for i in torch.unravel_index(diff.argmax(), diff.shape)]
            worst.append(f"{name}: max diff {float(diff.max()):.3g} at {index} > bound {bound:.3g}")
    assert not worst, f"{variant}: gradients differ from float64 transformers:\n" + "\n".join(worst)
    norm = float(torch.sqrt(sum((g**2).sum() for g in exact["grads"].values())))
    assert abs(run["grad_norm"] - norm) <= 1e-5 * norm, (variant, run["grad_norm"], norm)


@pytest.fixture(scope="module")
def single(pool1, model_path) -> dict:
    return pool1.run(f"{__name__}:sft_job", path=model_path, tp=1, pp=1, variants=list(VARIANTS))[0]


def test_sft_loss_and_gradients_equal_float64_transformers(single, references):
    for variant, run in single.items():
        assert_matches_float64(run, variant, references)
    # The modes are different losses: their gradients differ.
    a, b = single["packed"]["grads"], single["agg:seq-mean-token-sum"]["grads"]
    assert float((a["model.norm.weight"] - b["model.norm.weight"]).abs().max()) > 1e-4


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1), (1, 2)], ids=["dp2", "tp2", "pp2"])
def test_sft_layouts_equal_one_process(pool2, model_path, references, single, tp, pp):
    variants = ["packed", "dynamic", "agg:seq-mean-token-mean"]
    run = pool2.run(f"{__name__}:sft_job", path=model_path, tp=tp, pp=pp, variants=variants)[
        0
    ]  # rank 0: whole weights
    for variant in variants:
        assert_matches_float64(run[variant], variant, references)
        diff = abs(run[variant]["loss"] - single[variant]["loss"])
        assert diff <= 1e-6 * max(1.0, abs(single[variant]["loss"])), f"{variant}: loss differs by {diff:.3g}"
