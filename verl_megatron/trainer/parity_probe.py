"""A cheap check of bitwise parity where bypass mode would otherwise trust it blindly.

``algorithm.rollout_correction.bypass_mode`` trains on the rollout's log-probs as
``old_log_probs`` and so skips the actor's recomputation and the log-prob diff metric: exact
only while ``rollout.bitwise_parity`` holds. If parity broke (a kernel, a driver, a layout the
batch-invariant path does not cover), the run would go on silently off-policy. Every
``rollout.parity_probe_interval`` steps the actor recomputes the log-probs of one micro-batch
per dp rank (a small fraction of a step), logs ``rollout/parity_probe/max_diff`` and, with
bitwise parity on, stops the run unless that is exactly 0. In async training only rows generated
wholly with the weights being trained are probed (older ones differ by design).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from verl_megatron.protocol import DataProto
from verl_megatron.rollout.config import RolloutConfig
from verl_megatron.trainer.metrics import timed

__all__ = ["METRIC", "ParityProbeError", "current_rows", "max_log_prob_diff", "parity_probe", "probe_rows"]

METRIC = "rollout/parity_probe/max_diff"


class ParityProbeError(RuntimeError):
    """The actor's recomputed log-probs differ from the rollout's under bitwise parity."""


def probe_rows(batch_size: int, dp: int, micro_batch_size: int | None) -> int:
    """Rows the probe recomputes: one micro-batch per dp rank (one row per rank where micro-batches
    are formed by a token budget, ``micro_batch_size`` None), at most the batch."""
    return min(batch_size, dp * max(1, micro_batch_size or 1))


def current_rows(batch: DataProto, step: int) -> np.ndarray:
    """Indices of the rows generated wholly with the weights step ``step`` trains (all of them,
    except in async training, where ``rollout_versions`` [B, Tr] records each token's weight
    version, -1 at padding, and a row lagging behind ``step - 1`` differs by design, not by parity)."""
    if "rollout_versions" not in batch.batch.keys():  # noqa: SIM118 (a TensorDict)
        return np.arange(len(batch))
    versions = batch.batch["rollout_versions"]
    return np.flatnonzero(((versions == step - 1) | (versions < 0)).all(-1).numpy())


def max_log_prob_diff(rollout: torch.Tensor, recomputed: torch.Tensor, response_mask: torch.Tensor) -> float:
    """max |rollout - recomputed| over response tokens, all [B, Tr]; 0.0 when no token is valid."""
    diff = (rollout.double() - recomputed.to(rollout.device).double()).abs()[
        response_mask.bool().to(rollout.device)
    ]
    return float(diff.max()) if diff.numel() else 0.0


def parity_probe(
    actor: Any, batch: DataProto, step: int, rollout: RolloutConfig, timing: dict[str, float]
) -> dict[str, float]:
    """``{METRIC: max diff}`` at steps that are multiples of ``rollout.parity_probe_interval`` (else
    ``{}``; the probe's time goes to ``timing["parity_probe"]``).

    ``actor`` is the MegatronActor (its ``compute_log_prob`` is collective over dp, and every rank
    holds the same ``batch``, so every rank probes the same rows). Raises ParityProbeError with
    ``rollout.bitwise_parity`` when the diff is not exactly 0.
    """
    interval = rollout.parity_probe_interval
    if interval <= 0 or step % interval != 0:
        return {}
    cfg = actor.config
    micro = cfg.ppo_infer_micro_batch_size_per_gpu or cfg.ppo_micro_batch_size_per_gpu
    if cfg.use_dynamic_bsz:
        micro = None
    current = current_rows(batch, step)
    if current.size == 0:
        return {}  # every sample is off-policy (async staleness): nothing parity can be held to
    rows = batch.select_idxs(current[: probe_rows(current.size, actor.runtime.layout.dp, micro)])
    with timed("parity_probe", timing):
        recomputed, _ = actor.compute_log_prob(rows)
    worst = max_log_prob_diff(rows.batch["rollout_log_probs"], recomputed, rows.batch["response_mask"])
    if rollout.bitwise_parity and worst != 0.0:
        raise ParityProbeError(
            f"step {step}: bitwise parity broken, the actor's recomputed log-probs differ from the rollout's "
            f"by up to {worst:.3e} on {len(rows)} probed row(s) (bypass_mode trains on the rollout's)"
        )
    return {METRIC: worst}
