"""Per-step metrics with verl's names: batch statistics, stage timings, throughput and MFU.

Every function takes tensors or a ``DataProto`` and returns a flat ``{name: float}`` dict;
the trainer merges them into one dict per step. Names follow verl's ``metric_utils``:
``critic/score/mean``, ``response_length/clip_ratio``, ``timing_s/gen``, ``perf/throughput``...
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from verl_megatron.protocol import DataProto
from verl_megatron.trainer.ppo.metric_utils import validation_metric_dict

__all__ = [
    "VerlValidationMetrics",
    "actor_mfu",
    "compute_data_metrics",
    "compute_mfu",
    "compute_throughput_metrics",
    "compute_timing_metrics",
    "device_peak_flops",
    "multi_turn_metrics",
    "reduce_metrics",
    "rollout_probs_diff_metrics",
    "timed",
    "training_flops",
    "validation_metrics",
]


@contextlib.contextmanager
def timed(name: str, timing: dict[str, float]) -> Iterator[None]:
    """Add the wall time of the ``with`` block to ``timing[name]`` (seconds)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        timing[name] = timing.get(name, 0.0) + time.perf_counter() - start


def _stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    if values.numel() == 0:
        return {f"{prefix}/mean": 0.0, f"{prefix}/max": 0.0, f"{prefix}/min": 0.0}
    values = values.float()
    return {
        f"{prefix}/mean": values.mean().item(),
        f"{prefix}/max": values.max().item(),
        f"{prefix}/min": values.min().item(),
    }


def _lengths(batch: DataProto) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """(prompt_length [B], response_length [B], max prompt width, max response width)."""
    prompt_width = batch.batch["prompts"].shape[-1]
    response_mask = batch.batch["response_mask"]
    prompt_length = batch.batch["attention_mask"][:, :prompt_width].sum(-1).float()
    response_length = response_mask.sum(-1).float()
    return prompt_length, response_length, prompt_width, response_mask.shape[-1]


def compute_data_metrics(batch: DataProto, use_critic: bool, max_response_length: int) -> dict[str, float]:
    """Scores, rewards, advantages, returns (and values), prompt and response lengths.

    ``critic/score`` is the per-sequence sum of ``token_level_scores``,
    ``critic/rewards`` of ``token_level_rewards`` (after any KL penalty);
    advantages/returns/values are taken over response tokens only.
    ``response_length/clip_ratio`` is the share of responses that hit ``max_response_length``.
    """
    tensors = batch.batch
    mask = tensors["response_mask"].bool()
    prompt_length, response_length, prompt_width, _ = _lengths(batch)
    metrics = {
        **_stats("critic/score", tensors["token_level_scores"].sum(-1)),
        **_stats("critic/rewards", tensors["token_level_rewards"].sum(-1)),
        **_stats("critic/advantages", tensors["advantages"][mask]),
        **_stats("critic/returns", tensors["returns"][mask]),
        **_stats("response_length", response_length),
        "response_length/clip_ratio": (response_length >= max_response_length).float().mean().item(),
        **_stats("prompt_length", prompt_length),
        "prompt_length/clip_ratio": (prompt_length >= prompt_width).float().mean().item(),
    }
    if "multi_turn_turns" in batch.non_tensor_batch:
        metrics.update(multi_turn_metrics(batch.non_tensor_batch))
    if use_critic:
        values, returns = tensors["values"][mask], tensors["returns"][mask]
        metrics.update(_stats("critic/values", values))
        # Share of the returns' variance that the value function explains (1 is perfect).
        var_returns = returns.var(unbiased=False) if returns.numel() else torch.tensor(0.0)
        resid = (returns - values).var(unbiased=False) if returns.numel() else torch.tensor(0.0)
        metrics["critic/vf_explained_var"] = (1.0 - resid / (var_returns + 1e-5)).item()
    return metrics


def multi_turn_metrics(columns: Mapping[str, Any]) -> dict[str, float]:
    """Batch sums of a ``rollout.multi_turn`` rollout's per-sample columns (rollout/multiturn.py):
    policy turns, environment turns, seconds in the environment, truncated conversations, and
    those of them that their environment's failure ended, per cause."""
    from verl_megatron.rollout.multiturn import ENV_FAILURES

    return {
        "multi_turn/turns_count": float(sum(columns["multi_turn_turns"])),
        "multi_turn/env_turns_count": float(sum(columns["multi_turn_env_turns"])),
        "multi_turn/env_seconds_count": float(sum(columns["multi_turn_env_seconds"])),
        "multi_turn/truncated_count": float(sum(bool(t) for t in columns["multi_turn_truncated"])),
        **{
            f"multi_turn/{cause}_count": float(sum(t == cause for t in columns["multi_turn_truncated"]))
            for cause in ENV_FAILURES
        },
    }


def rollout_probs_diff_metrics(
    rollout_log_probs: torch.Tensor, old_log_probs: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, float]:
    """How far the sampler's token probabilities are from the trainer's, all [B, Tr].

    ``training/rollout_probs_diff_{max,mean,std}``: ``|exp(rollout_log_probs) - exp(old_log_probs)|``
    over response tokens. ``rollout/logprob_diff/{max,mean}``: ``|rollout_log_probs - old_log_probs|``,
    and ``rollout/logprob_diff/frac_diff`` the fraction of response tokens whose log-probs differ
    at all (0 with ``rollout.bitwise_parity``). Near 0 means the rollout engine and the megatron
    forward agree.
    """
    mask = response_mask.bool()
    diff = (rollout_log_probs.float().exp() - old_log_probs.float().exp()).abs()[mask]
    if diff.numel() == 0:
        return {
            **{f"training/rollout_probs_diff_{k}": 0.0 for k in ("max", "mean", "std")},
            **{f"rollout/logprob_diff/{k}": 0.0 for k in ("max", "mean", "frac_diff")},
        }
    log_diff = (rollout_log_probs.float() - old_log_probs.float()).abs()[mask]
    return {
        "training/rollout_probs_diff_max": diff.max().item(),
        "training/rollout_probs_diff_mean": diff.mean().item(),
        "training/rollout_probs_diff_std": diff.std(unbiased=False).item(),
        "rollout/logprob_diff/max": log_diff.max().item(),
        "rollout/logprob_diff/mean": log_diff.mean().item(),
        "rollout/logprob_diff/frac_diff": (log_diff > 0).float().mean().item(),
    }


def compute_timing_metrics(batch: DataProto, timing: Mapping[str, float]) -> dict[str, float]:
    """``timing_s/<stage>`` and, for stages whose cost scales with tokens,
    ``timing_per_token_ms/<stage>``."""
    _, response_length, _, _ = _lengths(batch)
    num_response = response_length.sum().item()
    num_overall = batch.batch["attention_mask"].sum().item()
    per_token_stage = {"gen": num_response, "ref": num_overall, "values": num_overall}
    per_token_stage.update({"old_log_prob": num_overall, "update_critic": num_overall})
    per_token_stage["update_actor"] = num_overall
    metrics = {f"timing_s/{name}": float(seconds) for name, seconds in timing.items()}
    for name, tokens in per_token_stage.items():
        if name in timing and tokens > 0:
            metrics[f"timing_per_token_ms/{name}"] = timing[name] * 1000.0 / tokens
    return metrics


def compute_throughput_metrics(batch: DataProto, step_seconds: float, num_devices: int) -> dict[str, float]:
    """Tokens (prompt + response) processed per second per device in this step."""
    total_tokens = float(batch.batch["attention_mask"].sum().item())
    return {
        "perf/total_num_tokens": total_tokens,
        "perf/time_per_step": step_seconds,
        "perf/throughput": total_tokens / (step_seconds * num_devices) if step_seconds > 0 else 0.0,
    }


def training_flops(
    seq_lengths: Sequence[int],
    *,
    hidden_size: int,
    num_layers: int,
    ffn_hidden_size: int,
    num_attention_heads: int,
    num_query_groups: int,
    vocab_size: int,
    gated_mlp: bool = True,
) -> float:
    """FLOPs of one forward + backward pass over sequences of the given lengths.

    Dense matmuls cost 2 FLOPs per weight per token in the forward pass (q and o:
    h*h each, k and v: h*h*groups/heads each, MLP: 3 (gated) or 2 matrices of
    h*ffn, LM head: h*V). Attention scores and the weighted sum cost 4*L^2*h
    per layer for a sequence of length L (the full square, as Megatron's and
    verl's estimators count it). Backward costs twice the forward: 3x in total.
    """
    h, kv = hidden_size, hidden_size * num_query_groups // num_attention_heads
    mlp_mats = 3 if gated_mlp else 2
    weights_per_layer = h * h * 2 + h * kv * 2 + mlp_mats * h * ffn_hidden_size
    dense_per_token = 2 * (num_layers * weights_per_layer + h * vocab_size)
    tokens = float(sum(seq_lengths))
    attention = sum(2 * 2 * num_layers * h * float(length) * float(length) for length in seq_lengths)
    return 3.0 * (dense_per_token * tokens + attention)


# Dense bf16 peak (FLOP/s) of common accelerators, from their vendors' data sheets.
_PEAK_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "H800": 989e12,
    "H20": 148e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "L40": 181e12,
    "A10": 125e12,
    "B200": 2250e12,
    "MI300X": 1307e12,
}


def device_peak_flops(override_tflops: float | None = None) -> float | None:
    """Peak FLOP/s of one device: ``override_tflops`` when set, else looked up by the CUDA
    device name; None when unknown (e.g. CPU), in which case MFU is not reported."""
    if override_tflops is not None:
        return override_tflops * 1e12
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name().upper()
    for key in sorted(_PEAK_FLOPS, key=len, reverse=True):  # "H200" before "H20"
        if key in name:
            return _PEAK_FLOPS[key]
    return None


def compute_mfu(flops: float, seconds: float, num_devices: int, peak_flops: float | None) -> float | None:
    """Model FLOPs utilisation: achieved FLOP/s over the devices' peak, or None if unknown."""
    if peak_flops is None or seconds <= 0 or num_devices <= 0:
        return None
    return flops / (seconds * num_devices * peak_flops)


# training_flops's size arguments and the HF architecture fields they are read from.
_FLOPS_SIZES = {
    "hidden_size": "hidden_size",
    "num_layers": "num_layers",
    "ffn_hidden_size": "intermediate_size",
    "num_attention_heads": "num_attention_heads",
    "num_query_groups": "num_key_value_heads",
    "vocab_size": "vocab_size",
}


def actor_mfu(
    batch: DataProto,
    hf_config: Any,
    ppo_epochs: int,
    seconds: float,
    num_devices: int,
    peak_flops: float | None,
) -> dict[str, float]:
    """``perf/mfu/actor``: the actor update's ``ppo_epochs`` passes over the batch's sequences in
    ``seconds`` (empty when the peak is unknown)."""
    from verl_megatron.models.config import read_hf_architecture

    arch = read_hf_architecture(hf_config)
    lengths = batch.batch["attention_mask"].sum(-1).tolist()
    sizes = {arg: getattr(arch, field) for arg, field in _FLOPS_SIZES.items()}
    mfu = compute_mfu(ppo_epochs * training_flops(lengths, **sizes), seconds, num_devices, peak_flops)
    return {} if mfu is None else {"perf/mfu/actor": mfu}


def reduce_metrics(metrics: Mapping[str, Sequence[float] | float]) -> dict[str, float]:
    """Mean of every list of values (e.g. per micro-batch losses); scalars pass through."""
    out = {}
    for name, value in metrics.items():
        if isinstance(value, (list, tuple, np.ndarray)):
            out[name] = float(np.mean(value)) if len(value) else 0.0
        else:
            out[name] = float(value)
    return out


def validation_metrics(data_sources: Sequence[str], scores: Sequence[float]) -> dict[str, float]:
    """``val/test_score/<data_source>``: mean score per data source."""
    by_source: dict[str, list[float]] = defaultdict(list)
    for source, score in zip(data_sources, scores, strict=True):
        by_source[str(source)].append(float(score))
    return {f"val/test_score/{source}": float(np.mean(values)) for source, values in by_source.items()}


def is_finite_metrics(metrics: Mapping[str, Any], keys: Sequence[str]) -> bool:
    """True when every present key in ``keys`` holds a finite number."""
    return all(math.isfinite(float(metrics[k])) for k in keys if k in metrics)


class VerlValidationMetrics:
    """Collects a validation pass for verl's metric names (``val-core/<source>/reward/mean@N``,
    ``val-aux/...``; see ``trainer.ppo.metric_utils``): the summed reward and every numeric
    per-sample reward_extra_info column, grouped by prompt (uid) and data source."""

    def __init__(self) -> None:
        self.sources: list[str] = []
        self.uids: list[Any] = []
        self.infos: dict[str, list[Any]] = defaultdict(list)

    @staticmethod
    def tag_prompts(prompts: DataProto, batch_index: int) -> None:
        """Give each prompt of a validation batch a uid (kept if it has one): samples of the
        same prompt form one group."""
        if "uid" not in prompts.non_tensor_batch:
            uids = [f"val-{batch_index}-{i}" for i in range(len(prompts))]
            prompts.non_tensor_batch["uid"] = np.array(uids, dtype=object)

    def add(
        self, output: DataProto, reward: torch.Tensor, extra: Mapping[str, Sequence[Any]], source_key: str
    ) -> None:
        size = len(output)
        before = len(self.sources)
        self.sources.extend(str(s) for s in output.non_tensor_batch[source_key])
        self.uids.extend(output.non_tensor_batch["uid"])
        self.infos["reward"].extend(reward.sum(-1).tolist())
        for key, values in extra.items():
            # the project's namespaced counters (reward/error_count, ...) are not sample values
            if "/" in key or len(values) != size:
                continue
            column = self.infos[key]
            column.extend([None] * (before - len(column)))  # a key missing in earlier batches
            column.extend(values.tolist() if isinstance(values, np.ndarray) else list(values))

    def metrics(self) -> dict[str, float]:
        total = len(self.sources)
        infos = {key: [*column, *([None] * (total - len(column)))] for key, column in self.infos.items()}
        return validation_metric_dict(self.sources, self.uids, infos) if total else {}
