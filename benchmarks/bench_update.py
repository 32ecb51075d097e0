"""Actor update throughput: our Megatron PPO update vs the same update in plain PyTorch on the HF model.

One PPO mini-batch (the whole batch, one epoch) of ``batch`` sequences of ``prompt_len +
response_len`` tokens, no padding, in micro-batches of ``micro_batch``: forward, vanilla clipped
policy loss aggregated token-mean over the batch, backward, gradient clipping at 1.0 and one AdamW
step (lr 1e-6, weight decay 0.01), all in float32.

- ours: ``MegatronActor.update_policy`` (megatron-core GPTModel, tp=1, one process, megatron's
  schedule and optimizer, log-probs from vocabulary-parallel logits; weight gradients added
  straight into DDP's buffer, ``models/grad_accumulation.py``).
- peer: ``AutoModelForCausalLM`` + ``torch.optim.AdamW``; the LM head only at the positions that
  predict response tokens (transformers' ``logits_to_keep``, as TRL does), log-probs as a user
  would write them, ``log_softmax(logits).gather(labels)``; the same ``compute_policy_loss``.

Reported: tokens/s (all B * T tokens), achieved FLOP/s and its fraction of this machine's dense
matmul peak measured at the model's own GEMM shapes with the same thread count (the CPU MFU), on
model FLOPs and on the FLOPs each side spends (its LM head rows).

Run alone: ``python benchmarks/bench_update.py [--quick]``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from common import (
    FLOPS_FORMULA_TRAIN,
    FLOPS_MODEL_SPENT_NOTE,
    MEDIUM_SHAPE,
    MFU_MODEL,
    MFU_SPENT,
    QUICK_SHAPE,
    SHARED_HEAP_NOTE,
    BatchSizes,
    Section,
    Timing,
    best_peak,
    build_assets,
    error_text,
    forward_flops,
    full_length_batch,
    measure_matmul_peak,
    mfu_columns,
    ratio,
    run_alone,
    shape_text,
    time_interleaved,
    train_flops_per_token,
)

from verl_megatron.algos.core_algos import compute_policy_loss


@dataclass(frozen=True)
class UpdateBenchConfig(BatchSizes):
    """Sizes of the benchmarked PPO update, its learning rate and clip range, and timed repeats."""

    lr: float = 1e-6
    clip_ratio: float = 0.2
    repeats: int = 3


FULL = UpdateBenchConfig(shape=MEDIUM_SHAPE, batch=16, prompt_len=64, response_len=192, micro_batch=4)
QUICK = UpdateBenchConfig(shape=QUICK_SHAPE, batch=4, prompt_len=8, response_len=8, micro_batch=2, repeats=1)


def make_update_batch(cfg: UpdateBenchConfig) -> dict[str, torch.Tensor]:
    """A PPO batch in verl's keys, every row full length (no padding), fixed by ``cfg.seed``.

    old_log_probs sit near log(1/V) (a random-init model's level), so ratios stay near 1 and some
    tokens clip; advantages are standard normal per sequence, as GRPO's are.
    """
    gen = torch.Generator().manual_seed(cfg.seed)
    b, tr, v = cfg.batch, cfg.response_len, cfg.shape.vocab_size
    batch = full_length_batch(cfg, gen)
    advantages = torch.randn(b, 1, generator=gen).expand(b, tr).contiguous()
    old = torch.full((b, tr), -torch.log(torch.tensor(float(v))).item()) + 0.05 * torch.randn(
        b, tr, generator=gen
    )
    return {**batch, "old_log_probs": old, "advantages": advantages}


# ----------------------------------------------------------------------------- peer


class HFPPOUpdate:
    """The same PPO update written in plain PyTorch on a Hugging Face model."""

    def __init__(self, model_dir: str, cfg: UpdateBenchConfig) -> None:
        from transformers import AutoModelForCausalLM

        self.cfg = cfg
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model.train()
        # fused: torch's one-pass kernel (its default on the CPU is ~7 elementwise passes per
        # tensor); ours steps megatron's AdamW in the same kernel (models/megatron_model.py).
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=cfg.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, fused=True
        )
        # bench_profile.py sets a StageClock here to time the stages; None: no timing.
        self.clock = None

    def _stage(self, name: str):
        return contextlib.nullcontext() if self.clock is None else self.clock.stage(name)

    def __call__(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        cfg = self.cfg
        total_tokens = batch["response_mask"].sum()
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for start in range(0, cfg.batch, cfg.micro_batch):
            mb = {k: t[start : start + cfg.micro_batch] for k, t in batch.items()}
            with self._stage("forward (model)"):
                # The logit at position t predicts token t + 1: responses are predicted from
                # Tp-1 .. T-2, so the head runs at the last Tr + 1 positions only (TRL's way).
                logits = self.model(
                    input_ids=mb["input_ids"],
                    attention_mask=mb["attention_mask"],
                    position_ids=mb["position_ids"],
                    logits_to_keep=PEER_HEAD_EXTRA + cfg.response_len,
                ).logits
            with self._stage("log-probs + loss"):
                logits = logits[:, :-1]
                log_probs = (
                    torch.log_softmax(logits.float(), dim=-1)
                    .gather(-1, mb["responses"].unsqueeze(-1))
                    .squeeze(-1)
                )
                pg_loss, _, _, _ = compute_policy_loss(
                    mb["old_log_probs"],
                    log_probs,
                    mb["advantages"],
                    mb["response_mask"],
                    cliprange=cfg.clip_ratio,
                )
                # token-mean over the whole mini-batch = sum over micro-batches of mean * share of tokens
                loss = pg_loss * (mb["response_mask"].sum() / total_tokens)
            with self._stage("backward"):
                loss.backward()
            loss_sum += loss.detach().item()
        with self._stage("optimizer (clip, step, zero)"):
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.optimizer.step()
        return {"actor/pg_loss": loss_sum, "actor/grad_norm": float(grad_norm)}


# ----------------------------------------------------------------------------- ours


def build_actor(
    model_dir: str,
    *,
    mini_batch: int,
    micro_batch: int,
    lr: float = 1e-6,
    clip_ratio: float = 0.2,
    seed: int = 0,
    lora: tuple[int, float] | None = None,
):
    """``MegatronActor`` on the HF checkpoint, tp=1 in this process, float32, local layer spec;
    with ``lora`` = (rank, alpha), adapters on every projection and the base weights frozen.

    Padded micro-batches (``use_remove_padding=False``): on CPU the local spec would pack rows
    behind a block-causal mask over all tokens of a micro-batch, and these rows carry no padding.
    """
    from verl_megatron.distributed.parallel import ParallelLayout, init_runtime
    from verl_megatron.models.builder import build_gpt_chunks
    from verl_megatron.models.config import ModelConfig, load_hf_config
    from verl_megatron.models.convert import load_hf_weights
    from verl_megatron.models.lora import apply_configured_lora
    from verl_megatron.models.matmul_route import MatmulRoute
    from verl_megatron.models.megatron_model import build_optimizer, wrap_ddp
    from verl_megatron.workers.actor import MegatronActor
    from verl_megatron.workers.config import ActorConfig, OptimConfig
    from verl_megatron.workers.lr_schedule import build_lr_scheduler, optim_settings

    runtime = init_runtime(ParallelLayout(), seed)
    rank, alpha = lora or (0, 16.0)  # rank 0: no adapters (ModelConfig's defaults)
    model_cfg = ModelConfig(path=model_dir, dtype="float32", use_te=False, lora_rank=rank, lora_alpha=alpha)
    route = MatmulRoute()  # the trainer's update path (models/matmul_route.py)
    chunks = build_gpt_chunks(load_hf_config(model_dir), runtime, model_cfg, route=route)
    load_hf_weights(chunks, model_dir, runtime)
    chunks = wrap_ddp(apply_configured_lora(chunks, model_cfg, seed))
    optim = OptimConfig(lr=lr, weight_decay=0.01, clip_grad=1.0)
    optimizer = build_optimizer(chunks, optim_settings(optim))
    config = ActorConfig(
        ppo_mini_batch_size=mini_batch,
        ppo_micro_batch_size_per_gpu=micro_batch,
        use_remove_padding=False,
        clip_ratio=clip_ratio,
        clip_ratio_low=clip_ratio,
        clip_ratio_high=clip_ratio,
        optim=optim,
    )
    return MegatronActor(
        runtime, config, chunks, optimizer, build_lr_scheduler(optimizer, optim), route=route
    )


def build_update_actor(model_dir: str, cfg: UpdateBenchConfig, lora: tuple[int, float] | None = None):
    """:func:`build_actor` with the benchmark's sizes, learning rate, clip range and seed."""
    return build_actor(
        model_dir,
        mini_batch=cfg.batch,
        micro_batch=cfg.micro_batch,
        lr=cfg.lr,
        clip_ratio=cfg.clip_ratio,
        seed=cfg.seed,
        lora=lora,
    )


def update_policy(actor, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    """One ``actor.update_policy`` on ``batch`` (a dict of tensors in verl's keys), at temperature 1."""
    from verl_megatron.protocol import DataProto

    return actor.update_policy(DataProto.from_dict(tensors=batch, meta_info={"temperature": 1.0}))


def build_ours(model_dir: str, cfg: UpdateBenchConfig) -> Callable[[dict], Any]:
    """Our actor's ``update_policy`` on the same checkpoint and batch."""
    actor = build_update_actor(model_dir, cfg)
    return lambda batch: update_policy(actor, batch)


# ----------------------------------------------------------------------------- section


def update_section_config(cfg: UpdateBenchConfig) -> dict[str, Any]:
    """What a result table of this update states about its run: model, sizes, threads, repeats."""
    return {
        "model": shape_text(cfg.shape),
        "batch": cfg.batch,
        "seq_len": f"{cfg.prompt_len}+{cfg.response_len}",
        "micro_batch": cfg.micro_batch,
        "threads": torch.get_num_threads(),
        "repeats": cfg.repeats,
    }


OURS, PEER = "verl-megatron", "HF + torch.optim.AdamW"
# The peer's LM head runs at Tr + 1 positions (logits_to_keep keeps the last ones; the last
# position predicts nothing and is dropped), ours at the Tr response rows.
PEER_HEAD_EXTRA = 1


def update_flops(cfg: UpdateBenchConfig) -> dict[str, dict[str, float]]:
    """Model and spent FLOPs of one update per side (forward + backward = 3 x forward)."""
    b, t, tr = cfg.batch, cfg.seq_len, cfg.response_len
    model = b * t * train_flops_per_token(cfg.shape, t)
    spent = {
        impl: 3 * forward_flops(cfg.shape, b * t, b * rows, b * t * t)
        for impl, rows in ((OURS, tr), (PEER, tr + PEER_HEAD_EXTRA))
    }
    return {impl: {"model": model, "spent": flops} for impl, flops in spent.items()}


def update_rows(
    cfg: UpdateBenchConfig, timings: dict[str, Timing], peak_gflops: float
) -> list[dict[str, Any]]:
    """A table row per side: tokens/s, achieved GFLOP/s (model FLOPs) and both MFUs."""
    tokens, flops, rows = cfg.batch * cfg.seq_len, update_flops(cfg), []
    for impl, timing in timings.items():
        rows.append(
            {
                "impl": impl,
                "tokens/s (best)": tokens / timing.best,
                "tokens/s (median)": tokens / timing.median,
                "step_s (best)": timing.best,
                "GFLOP/s": flops[impl]["model"] / timing.best / 1e9,
                **mfu_columns(flops[impl], timing.best, peak_gflops),
            }
        )
    return rows


UPDATE_COLUMNS = [
    "impl",
    "tokens/s (best)",
    "tokens/s (median)",
    "step_s (best)",
    "GFLOP/s",
    MFU_MODEL,
    MFU_SPENT,
]


def peak_note(cfg: UpdateBenchConfig, peak: dict[str, Any]) -> str:
    """How the update's matmul peak was measured, and what each MFU counts."""
    return (
        f"matmul peak {peak['peak_gflops']:.1f} GFLOP/s: best torch.matmul rate over the model's GEMM shapes "
        f"(M = micro_batch * T = {cfg.micro_batch * cfg.seq_len}), {peak['threads']} threads, float32, "
        f"measured before and after the updates. {FLOPS_MODEL_SPENT_NOTE}"
    )


def run(cfg: UpdateBenchConfig, workdir: Path) -> Section:
    """Time both updates interleaved on one batch; tokens/s, FLOP/s and CPU MFU per side."""
    model_dir, _ = build_assets(workdir / "update_model", cfg.shape, cfg.seed)
    batch = make_update_batch(cfg)
    flops_per_token = train_flops_per_token(cfg.shape, cfg.seq_len)
    gemms = cfg.shape.gemm_shapes(cfg.micro_batch * cfg.seq_len)
    peak_before = measure_matmul_peak(gemms)
    section = Section(
        name="update",
        title="Actor update (forward + backward + AdamW): verl-megatron vs plain PyTorch on the HF model",
        columns=UPDATE_COLUMNS,
        config={
            "model": shape_text(cfg.shape),  # first, as in update_section_config (it is set again there)
            "matmul params": cfg.shape.matmul_params,
            **update_section_config(cfg),
        },
    )
    section.notes.append(SHARED_HEAP_NOTE)
    section.notes.append(f"model FLOPs per token = {FLOPS_FORMULA_TRAIN} = {flops_per_token / 1e6:.1f} MFLOP")
    updates: dict[str, Callable[[], Any]] = {}
    for impl, build in (
        (OURS, lambda: build_ours(model_dir, cfg)),
        (PEER, lambda: HFPPOUpdate(model_dir, cfg)),
    ):
        try:
            update = build()
            update(batch)  # one call to surface errors before timing
        except Exception as exc:
            section.errors[impl] = error_text(exc)
            continue
        updates[impl] = lambda update=update: update(batch)
    timings = time_interleaved(updates, cfg.repeats, warmup=0) if updates else {}
    # Measured before and after the updates, best of both: the same conditions the best update saw.
    peak = best_peak(peak_before, measure_matmul_peak(gemms))
    section.rows = update_rows(cfg, timings, peak["peak_gflops"])
    section.notes.append(peak_note(cfg, peak))
    section.ratios.update(update_ratios(section.rows))
    section.extra = {
        "matmul_peak": peak,
        "flops_per_token": flops_per_token,
        "flops_formula": FLOPS_FORMULA_TRAIN,
        "flops": update_flops(cfg),
        "timings": {impl: t.as_dict() for impl, t in timings.items()},
        "config": asdict(cfg),
    }
    return section


def update_ratios(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    """tokens/s ours / peer and our MFU on model and on spent FLOPs (fractions of the peak)."""
    by_impl = {row["impl"]: row for row in rows}
    ours = by_impl.get(OURS, {})
    ratios = {
        "tokens/s ours / HF (best)": ratio(
            ours.get("tokens/s (best)"), by_impl.get(PEER, {}).get("tokens/s (best)")
        )
    }
    for key, column in (("", MFU_MODEL), (", spent FLOPs", MFU_SPENT)):
        mfu = ours.get(column)
        ratios[f"CPU MFU ours{key} (fraction of matmul peak)"] = None if mfu is None else mfu / 100
    return ratios


def main() -> None:
    run_alone(__doc__, run, FULL, QUICK)


if __name__ == "__main__":
    main()
