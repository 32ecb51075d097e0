"""LoRA vs full-parameter training of the same actor: what the optimizer holds, and one update.

The same checkpoint and PPO batch as ``bench_update.py`` go through ``MegatronActor.update_policy``
twice: every weight trainable, then ``model.lora_rank`` adapters on every projection (base
frozen). After one update each side reports its trainable parameters, the bytes of its
optimizer state (Adam's two moments, plus fp32 master copies under bf16: none here, float32),
the bytes of its gradient buffers, and the update's time. Adam keeps 8 bytes per trainable
float32 parameter, so the state must shrink exactly with the trainable count.

Run alone: ``python benchmarks/bench_lora.py [--quick]``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from bench_update import FULL as UPDATE_FULL
from bench_update import QUICK as UPDATE_QUICK
from bench_update import UpdateBenchConfig, build_update_actor, make_update_batch, update_policy
from common import Section, build_assets, error_text, ratio, run_alone, shape_text, time_interleaved


@dataclass(frozen=True)
class LoraBenchConfig:
    """The update benchmark's sizes plus the adapters' rank and alpha."""

    update: UpdateBenchConfig
    rank: int = 16
    alpha: float = 32.0


FULL = LoraBenchConfig(update=replace(UPDATE_FULL, repeats=2))
QUICK = LoraBenchConfig(update=UPDATE_QUICK, rank=4, alpha=8.0)


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))


def optimizer_state_bytes(optimizer) -> int:
    """Bytes of every tensor a megatron optimizer keeps per parameter (moments, master copies)."""
    total = 0
    for sub in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        for state in sub.optimizer.state.values():
            total += _tensor_bytes(state.values())
        for group in getattr(sub, "shard_fp32_from_float16_groups", None) or []:
            total += _tensor_bytes(group)
        for group in getattr(sub, "fp32_from_float16_groups", None) or []:
            total += _tensor_bytes(group)
    return total


def measure(actor, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    """One update (so Adam's moments exist), then the sizes of what training holds."""
    update_policy(actor, batch)
    params = [p for c in actor.chunks for p in c.module.parameters()]
    trainable = sum(p.numel() for p in params if p.requires_grad)
    grad_bytes = sum(
        _tensor_bytes([b.grad_data]) for c in actor.chunks for b in c.buffers if hasattr(b, "grad_data")
    )
    return {
        "trainable params": trainable,
        "all params": sum(p.numel() for p in params),
        "optimizer state MiB": optimizer_state_bytes(actor.optimizer) / 2**20,
        "state bytes / trainable param": optimizer_state_bytes(actor.optimizer) / trainable,
        "grad buffer MiB": grad_bytes / 2**20,
    }


def run(cfg: LoraBenchConfig, workdir: Path) -> Section:
    """Full vs LoRA: trainable parameters, optimizer-state and gradient-buffer bytes, update time."""
    upd = cfg.update
    model_dir, _ = build_assets(workdir / "lora_model", upd.shape, upd.seed)
    batch = make_update_batch(upd)
    section = Section(
        name="lora",
        title="LoRA vs full training: optimizer state, gradient buffers, update time (same actor, same batch)",
        columns=[
            "impl",
            "trainable params",
            "optimizer state MiB",
            "state bytes / trainable param",
            "grad buffer MiB",
            "update_s (best)",
        ],
        config={
            "model": shape_text(upd.shape),
            "batch": upd.batch,
            "seq_len": f"{upd.prompt_len}+{upd.response_len}",
            "lora": f"rank {cfg.rank}, alpha {cfg.alpha:g}, all-linear",
            "threads": torch.get_num_threads(),
            "repeats": upd.repeats,
        },
    )
    updates = {}
    for impl, lora in (("full", None), (f"LoRA r={cfg.rank}", (cfg.rank, cfg.alpha))):
        try:
            actor = build_update_actor(model_dir, upd, lora)
            row = {"impl": impl, **measure(actor, batch)}
        except Exception as exc:
            section.errors[impl] = error_text(exc)
            continue
        section.rows.append(row)
        updates[impl] = lambda actor=actor: update_policy(actor, batch)
    timings = time_interleaved(updates, upd.repeats, warmup=0) if updates else {}
    for row in section.rows:
        if row["impl"] in timings:
            row["update_s (best)"] = timings[row["impl"]].best
    rows = {r["impl"]: r for r in section.rows}
    full, lora = rows.get("full", {}), rows.get(f"LoRA r={cfg.rank}", {})
    section.ratios["optimizer state LoRA / full"] = ratio(
        lora.get("optimizer state MiB"), full.get("optimizer state MiB")
    )
    section.ratios["trainable params LoRA / full"] = ratio(
        lora.get("trainable params"), full.get("trainable params")
    )
    section.ratios["update time LoRA / full (best)"] = ratio(
        lora.get("update_s (best)"), full.get("update_s (best)")
    )
    section.notes.append(
        "Adam holds two float32 moments per trainable parameter (8 bytes); megatron's optimizer and DDP "
        "skip frozen (requires_grad=False) weights, so LoRA's state and gradient buffers cover the adapters only"
    )
    return section


def main() -> None:
    run_alone(__doc__, run, FULL, QUICK)


if __name__ == "__main__":
    main()
