"""Validation metrics with verl's names and numbers (verl's ``trainer.ppo.metric_utils``).

Per data source and per prompt (uid) group of N samples, for every numeric variable
(the summed ``reward`` and each reward_extra_info column): mean@N, std@N and, for
n = 2, 4, ... < N and n = N, bootstrap estimates (1000 draws of n samples with
replacement, numpy seed 42) of the best, worst and majority-vote value (majority over
the ``pred`` column when there is one): best@n/mean, best@n/std, worst@n/..., maj@n/....
Each statistic is then averaged over the prompts of the data source.
`validation_metric_dict` names them ``val-core/<source>/<var>/<stat>`` for the headline
variable (``acc`` if present, else ``reward``: its mean/best/maj at the largest n) and
``val-aux/<source>/<var>/<stat>`` for the rest, as verl's trainer logs them.

Per step, with verl's signatures: `compute_data_metrics` (scores, rewards, advantages,
lengths), `compute_timing_metrics`, `compute_throughout_metrics` (verl's spelling), and
the rollout's MoE load balance (`RolloutMoELoadBalanceMetricsAccumulator`): per layer, each
expert's share of the routed (token, top-k) slots of the response tokens, as a violation
``share * num_experts - 1`` (0 is perfectly balanced; the max, min and mean |.| over experts).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from transformers import AutoConfig, PretrainedConfig

from verl_megatron.protocol import DataProto
from verl_megatron.trainer.moe_load_balance import load_balance_metrics, moe_load_counts

logger = logging.getLogger(__name__)

__all__ = [
    "RolloutMoELoadBalanceMetricsAccumulator",
    "bootstrap_metric",
    "calc_maj_val",
    "compute_data_metrics",
    "compute_moe_lb_metrics",
    "compute_rollout_moe_load_balance_metrics",
    "compute_throughout_metrics",
    "compute_timing_metrics",
    "get_hf_config_override_kwargs",
    "get_metric_data_with_optional_routed_experts",
    "infer_moe_num_experts",
    "infer_rollout_moe_num_experts",
    "process_validation_metrics",
    "validation_metric_dict",
]

_N_BOOTSTRAP = 1000
_HEADLINE_STATS = ("mean", "maj", "best")
# Reductions applied to all draws at once (same numbers as one call per draw).
_ROWWISE = {np.max: np.max, np.min: np.min, np.mean: np.mean}


def bootstrap_metric(
    data: Sequence[Any],
    subset_size: int,
    reduce_fns: Sequence[Callable[[np.ndarray], float]],
    n_bootstrap: int = _N_BOOTSTRAP,
    seed: int = 42,
) -> list[tuple[float, float]]:
    """(mean, std) over `n_bootstrap` draws of `subset_size` items (with replacement) of
    each reduce_fn's value. The draws are those of ``np.random.seed(seed)`` followed by
    ``np.random.choice``, from a private generator (the global one is left alone)."""
    picks = np.random.RandomState(seed).choice(len(data), size=(n_bootstrap, subset_size), replace=True)
    items = np.array(data, dtype=object)
    numeric = all(isinstance(x, (int, float, np.number)) for x in data)
    results = []
    for reduce_fn in reduce_fns:
        if numeric and reduce_fn in _ROWWISE:
            values = _ROWWISE[reduce_fn](items[picks].astype(np.float64), axis=1)
        else:
            values = np.array([reduce_fn(items[row]) for row in picks], dtype=np.float64)
        results.append((float(np.mean(values)), float(np.std(values))))
    return results


def calc_maj_val(data: Sequence[Mapping[str, Any]], vote_key: str, val_key: str) -> float:
    """`val_key` of the first item voting for the most frequent `vote_key` value (ties: the
    value seen first)."""
    votes: dict[Any, list[Any]] = {}
    for item in data:
        votes.setdefault(item[vote_key], []).append(item[val_key])
    winner = max(votes, key=lambda vote: len(votes[vote]))
    return votes[winner][0]


def _subset_sizes(n_resps: int) -> list[int]:
    """2, 4, 8, ... below n_resps, then n_resps itself; none for a single sample."""
    if n_resps <= 1:
        return []
    sizes, n = [], 2
    while n < n_resps:
        sizes.append(n)
        n *= 2
    return [*sizes, n_resps]


def _group_stats(values: list[Any], preds: list[Any] | None, seed: int) -> dict[str, float]:
    n_resps = len(values)
    stats = {f"mean@{n_resps}": float(np.mean(values))}
    if n_resps == 1:
        return stats
    stats[f"std@{n_resps}"] = float(np.std(values))
    voting = preds is not None and len(preds) == n_resps and all(p is not None for p in preds)
    for n in _subset_sizes(n_resps):
        (best, best_std), (worst, worst_std) = bootstrap_metric(values, n, [np.max, np.min], seed=seed)
        stats.update({f"best@{n}/mean": best, f"best@{n}/std": best_std})
        stats.update({f"worst@{n}/mean": worst, f"worst@{n}/std": worst_std})
        if voting:
            ballots = [{"val": v, "pred": p} for v, p in zip(values, preds, strict=True)]
            [(maj, maj_std)] = bootstrap_metric(
                ballots, n, [lambda rows: calc_maj_val(rows, vote_key="pred", val_key="val")], seed=seed
            )
            stats.update({f"maj@{n}/mean": maj, f"maj@{n}/std": maj_std})
    return stats


def process_validation_metrics(
    data_sources: Sequence[str],
    sample_uids: Sequence[str],
    infos_dict: Mapping[str, Sequence[Any]],
    seed: int = 42,
    expected_acc_counts: Mapping[tuple[str, str], int] | None = None,
) -> dict[str, dict[str, dict[str, float]]]:
    """{data_source: {variable: {statistic: value}}}, see the module docstring. Variables
    whose values are strings (or all None) are skipped; None values are dropped.

    `expected_acc_counts` {(data_source, uid): sessions expected}: for data sources that
    report ``acc``, sessions that produced no sample count as acc 0 (a prompt with none
    at all too); ``acc_success_only`` keeps the acc of the sessions that did.
    """
    grouped: dict[str, dict[Any, dict[str, list[Any]]]] = defaultdict(
        lambda: defaultdict(lambda: defaultdict(list))
    )
    for i, source in enumerate(data_sources):
        for name, values in infos_dict.items():
            grouped[source][sample_uids[i]][name].append(values[i])
    _count_missing_sessions(grouped, expected_acc_counts or {})
    per_source: dict[str, dict[str, dict[str, list[float]]]] = {}
    for source, by_uid in grouped.items():
        collected = per_source.setdefault(source, defaultdict(lambda: defaultdict(list)))
        for variables in by_uid.values():
            preds = variables.get("pred")
            for name, raw in variables.items():
                values = [v for v in raw if v is not None]
                if not values or isinstance(values[0], str):
                    continue
                for stat, value in _group_stats(values, preds, seed).items():
                    collected[name][stat].append(value)
    return {
        source: {
            name: {stat: float(np.mean(vals)) for stat, vals in stats.items()}
            for name, stats in variables.items()
        }
        for source, variables in per_source.items()
    }


def _count_missing_sessions(grouped: dict, expected: Mapping[tuple[str, str], int]) -> None:
    acc_sources = {
        source
        for source, by_uid in grouped.items()
        if any(v is not None for variables in by_uid.values() for v in variables.get("acc", []))
    }
    for (source, uid), count in expected.items():
        if source not in acc_sources:
            continue  # a reward-only source gets no synthetic acc
        variables = grouped[source][uid]
        observed = [v for v in variables.get("acc", []) if v is not None]
        variables["acc_success_only"] = observed
        variables["acc"] = observed + [0.0] * max(count - len(observed), 0)


def validation_metric_dict(
    data_sources: Sequence[str], sample_uids: Sequence[str], infos_dict: Mapping[str, Sequence[Any]]
) -> dict[str, float]:
    """Flat ``val-core/...`` and ``val-aux/...`` metrics as verl's trainer logs them."""
    out: dict[str, float] = {}
    for source, variables in process_validation_metrics(data_sources, sample_uids, infos_dict).items():
        core = "acc" if "acc" in variables else "reward"
        for name, stats in variables.items():
            n_max = max(int(stat.split("@")[-1].split("/")[0]) for stat in stats)
            for stat, value in stats.items():
                headline = name == core and stat.startswith(_HEADLINE_STATS) and f"@{n_max}" in stat
                out[f"{'val-core' if headline else 'val-aux'}/{source}/{name}/{stat}"] = value
    return out


# ---------------------------------------------------------------- per-step batch metrics


def _compute_response_info(batch: DataProto) -> dict[str, torch.Tensor]:
    """``prompt_length`` and ``response_length`` [B] (float): the batch's own columns when it
    carries them, else counted from ``attention_mask`` [B, Tp+Tr] split at ``responses``' width."""
    tensors = batch.batch
    if "prompt_length" in tensors and "response_length" in tensors:
        return {"prompt_length": tensors["prompt_length"], "response_length": tensors["response_length"]}
    width = tensors["responses"].shape[-1]
    mask = tensors["attention_mask"]
    return {
        "prompt_length": mask[:, :-width].sum(-1).float(),
        "response_length": mask[:, -width:].sum(-1).float(),
    }


def _extremes(prefix: str, values: torch.Tensor) -> dict[str, float]:
    """``<prefix>/{mean,max,min}`` of a 1-D tensor; NaN when it is empty (verl's convention)."""
    if values.numel() == 0:
        return dict.fromkeys((f"{prefix}/mean", f"{prefix}/max", f"{prefix}/min"), float("nan"))
    values = values.detach().float()
    return {
        f"{prefix}/mean": values.mean().item(),
        f"{prefix}/max": values.max().item(),
        f"{prefix}/min": values.min().item(),
    }


def _clip_ratio(lengths: torch.Tensor, width: int) -> float:
    """Share of rows whose length is the full width (truncated); NaN for no rows."""
    return (lengths == width).float().mean().item() if lengths.numel() else float("nan")


def compute_data_metrics(batch: DataProto, use_critic: bool = True) -> dict[str, Any]:
    """verl's per-step batch statistics. Needs ``token_level_scores``, ``token_level_rewards``,
    ``advantages``, ``returns`` (and ``values`` with `use_critic`), ``response_mask`` [B, Tr],
    ``prompts`` [B, Tp], ``responses`` [B, Tr], ``attention_mask`` [B, Tp+Tr].

    ``critic/score`` and ``critic/rewards`` are per-row sums over rows with a response (an
    aborted row, of length 0, is left out); advantages/returns/values are over response tokens.
    ``vf_explained_var`` = 1 - Var(returns - values) / (Var(returns) + 1e-5), unbiased variances.
    """
    tensors = batch.batch
    info = _compute_response_info(batch)
    prompt_length, response_length = info["prompt_length"], info["response_length"]
    mask = tensors["response_mask"].bool()
    kept = response_length != 0
    returns = tensors["returns"][mask]
    metrics = {
        **_extremes("critic/score", tensors["token_level_scores"].sum(-1)[kept]),
        **_extremes("critic/rewards", tensors["token_level_rewards"].sum(-1)[kept]),
        **_extremes("critic/advantages", tensors["advantages"][mask]),
        **_extremes("critic/returns", returns),
    }
    if use_critic:
        values = tensors["values"][mask]
        metrics.update(_extremes("critic/values", values))
        explained = float("nan")
        if values.numel() and returns.numel():
            explained = (1.0 - (returns - values).var() / (returns.var() + 1e-5)).item()
        metrics["critic/vf_explained_var"] = explained
    response_width, prompt_width = tensors["responses"].shape[-1], tensors["prompts"].shape[-1]
    metrics.update(_extremes("response_length", response_length))
    metrics["response_length/clip_ratio"] = _clip_ratio(response_length, response_width)
    metrics.update(_extremes("response_length_non_aborted", response_length[kept]))
    metrics["response_length_non_aborted/clip_ratio"] = _clip_ratio(response_length[kept], response_width)
    metrics["response/aborted_ratio"] = (~kept).float().mean().item()
    metrics.update(_extremes("prompt_length", prompt_length))
    metrics["prompt_length/clip_ratio"] = _clip_ratio(prompt_length, prompt_width)
    for key, name in (("__num_turns__", "num_turns"), ("tool_call_counts", "tool_call_counts")):
        if key in batch.non_tensor_batch:
            counts = np.asarray(batch.non_tensor_batch[key])
            metrics.update(
                {f"{name}/min": counts.min(), f"{name}/max": counts.max(), f"{name}/mean": counts.mean()}
            )
    return metrics


# Stages whose time scales with the response tokens alone, and with every token.
_RESPONSE_STAGES = ("gen",)
_ALL_TOKEN_STAGES = ("ref", "values", "adv", "update_critic", "update_actor")


def compute_timing_metrics(batch: DataProto, timing_raw: Mapping[str, float]) -> dict[str, Any]:
    """``timing_s/<stage>`` for every stage, and ``timing_per_token_ms/<stage>`` for ``gen``
    (per response token) and ref/values/adv/update_critic/update_actor (per prompt+response
    token); 0.0 when the batch holds no tokens."""
    info = _compute_response_info(batch)
    response_tokens = info["response_length"].sum().item()
    tokens = dict.fromkeys(_RESPONSE_STAGES, response_tokens)
    tokens.update(dict.fromkeys(_ALL_TOKEN_STAGES, response_tokens + info["prompt_length"].sum().item()))
    metrics: dict[str, Any] = {f"timing_s/{stage}": seconds for stage, seconds in timing_raw.items()}
    for stage in tokens.keys() & timing_raw.keys():
        count = tokens[stage]
        metrics[f"timing_per_token_ms/{stage}"] = timing_raw[stage] * 1000 / count if count > 0 else 0.0
    return metrics


def compute_throughout_metrics(
    batch: DataProto, timing_raw: Mapping[str, float], n_gpus: int
) -> dict[str, Any]:
    """Tokens of the step (``meta_info["global_token_num"]``, one count per sequence), the step's
    seconds (``timing_raw["step"]``) and tokens per second per GPU."""
    total = sum(batch.meta_info["global_token_num"])
    seconds = timing_raw["step"]
    return {
        "perf/total_num_tokens": total,
        "perf/time_per_step": seconds,
        "perf/throughput": total / (seconds * n_gpus),
    }


# ---------------------------------------------------------------- rollout MoE load balance

# Families whose ``num_local_experts`` is the global expert count (elsewhere it may be per rank).
_NUM_LOCAL_EXPERTS_MODEL_TYPES = ("gpt_oss", "mixtral")


def _field(config: Any, name: str, default: Any = None) -> Any:
    """``config[name]`` for mappings (DictConfig included), else the attribute."""
    return config.get(name, default) if hasattr(config, "get") else getattr(config, name, default)


def copy_to_local(path: str, use_shm: bool = False) -> str:
    """The path a Hugging Face config loads from: local paths and hub ids pass through (this
    project reads no remote file systems); `use_shm` is accepted for verl's signature."""
    del use_shm
    return path


def update_model_config(config: PretrainedConfig, override_config: Mapping[str, Any]) -> None:
    """Apply the overrides to an HF config in place through its own ``update`` (nested mappings go
    into sub-configs the same way)."""
    direct = {}
    for key, value in override_config.items():
        current = getattr(config, key, None)
        if isinstance(value, Mapping) and isinstance(current, PretrainedConfig):
            update_model_config(current, value)
        else:
            direct[key] = value
    config.update(direct)


def get_hf_config_override_kwargs(override_config: Any) -> dict[str, Any]:
    """The HF-config overrides of a model section's ``override_config`` (its ``model_config``
    entry when it has one), as a plain dict."""
    if hasattr(override_config, "_metadata"):  # an OmegaConf node
        from omegaconf import OmegaConf

        override_config = OmegaConf.to_container(override_config, resolve=True)
    if not override_config:
        return {}
    return dict(override_config.get("model_config", override_config))


def infer_moe_num_experts(model_config: Any) -> int | None:
    """The global routed-expert count named in a config-like object or the configs nested in
    it (``hf_config`` and its ``text_config``, ``text_config``, ``override_config`` and its
    ``model_config``/``text_config``): ``num_experts`` or ``n_routed_experts``, or
    ``num_local_experts`` for mixtral/gpt_oss; None when none says."""
    candidates = [model_config]
    for name, inner in (
        ("hf_config", ("text_config",)),
        ("text_config", ()),
        ("override_config", ("model_config", "text_config")),
    ):
        nested = _field(model_config, name)
        if nested is not None:
            candidates.append(nested)
            candidates.extend(c for c in (_field(nested, key) for key in inner) if c is not None)
    for candidate in candidates:
        for key in ("num_experts", "n_routed_experts"):
            if _field(candidate, key) is not None:
                return int(_field(candidate, key))
        local = _field(candidate, "num_local_experts")
        if local is not None and _field(candidate, "model_type") in _NUM_LOCAL_EXPERTS_MODEL_TYPES:
            return int(local)
    return None


def infer_rollout_moe_num_experts(model_config: Any) -> int | None:
    """`infer_moe_num_experts` of the model section, else of its Hugging Face config (loaded
    from ``local_hf_config_path``/``hf_config_path``/``path``, with ``override_config`` applied)."""
    found = infer_moe_num_experts(model_config)
    if found is not None:
        return found
    path = next(
        (
            p
            for p in (_field(model_config, k) for k in ("local_hf_config_path", "hf_config_path", "path"))
            if p
        ),
        None,
    )
    if path is None:
        return None
    local = copy_to_local(path, use_shm=_field(model_config, "use_shm", False))
    hf_config = AutoConfig.from_pretrained(
        local, trust_remote_code=_field(model_config, "trust_remote_code", False)
    )
    overrides = get_hf_config_override_kwargs(_field(model_config, "override_config", {}))
    if overrides:
        update_model_config(hf_config, overrides)
    return infer_moe_num_experts(hf_config)


# verl's private name, which its tests reach.
_compute_rollout_moe_load_counts = moe_load_counts


def compute_rollout_moe_load_balance_metrics(
    routed_experts: torch.Tensor | None,
    response_mask: torch.Tensor | None,
    num_experts: int | None,
    prefix: str = "rollout/moe",
) -> dict[str, Any]:
    """Load-balance metrics of one batch's routed expert ids (see :mod:`..moe_load_balance`)."""
    return load_balance_metrics(moe_load_counts(routed_experts, response_mask, num_experts), prefix)


class RolloutMoELoadBalanceMetricsAccumulator:
    """Routed-expert counts summed over the steps of a logging interval.

    `model_config` (the actor's model section) gives the expert count when `update` is not
    told it. Warnings about skipped metrics are printed once per key.
    """

    def __init__(self, model_config: Any | None = None) -> None:
        self.model_config = model_config
        self.load_counts: torch.Tensor | None = None
        self.num_experts: int | None = None
        self.num_experts_initialized = False
        self.routed_experts_retry_after_step = 0
        self.warned_skip_keys: set[str] = set()

    def should_request_routed_experts(self, global_steps: int) -> bool:
        return global_steps >= self.routed_experts_retry_after_step

    def defer_routed_experts_retry(self, global_steps: int, interval: int) -> None:
        """Ask for routed experts again only after another logging interval."""
        self.routed_experts_retry_after_step = global_steps + max(interval, 1)

    def warn_skip_once(self, key: str, message: str) -> None:
        if key not in self.warned_skip_keys:
            logger.warning(message)
            self.warned_skip_keys.add(key)

    def _infer_num_experts(self) -> int | None:
        if not self.num_experts_initialized:
            self.num_experts_initialized = True
            if self.model_config is not None:
                try:
                    self.num_experts = infer_rollout_moe_num_experts(self.model_config)
                except Exception as exc:  # a missing or unreadable HF config only costs the metric
                    self.warn_skip_once(
                        "num_experts_exception", f"Cannot infer rollout MoE num_experts: {exc}"
                    )
            if self.num_experts is None:
                self.warn_skip_once(
                    "num_experts_missing",
                    "Skipping rollout MoE load-balance metrics: num_experts is not in the model config "
                    "or its Hugging Face config.",
                )
        return self.num_experts

    def update(
        self,
        routed_experts: torch.Tensor | None,
        response_mask: torch.Tensor | None,
        num_experts: int | None = None,
    ) -> bool:
        """Add one batch's counts; False when it had none to add."""
        counts = moe_load_counts(
            routed_experts,
            response_mask,
            num_experts if num_experts is not None else self._infer_num_experts(),
        )
        if counts is None:
            return False
        if self.load_counts is not None and self.load_counts.shape == counts.shape:
            self.load_counts += counts
        else:
            if self.load_counts is not None:
                logger.warning(
                    "rollout MoE metrics: count shape changed %s -> %s; restarting",
                    tuple(self.load_counts.shape),
                    tuple(counts.shape),
                )
            self.load_counts = counts
        return True

    def compute(self, prefix: str = "rollout/moe") -> dict[str, Any]:
        return load_balance_metrics(self.load_counts, prefix)

    def total_assignments(self) -> int:
        return 0 if self.load_counts is None else int(self.load_counts.sum().item())

    def reset(self) -> None:
        self.load_counts = None

    def pop_metrics(self, prefix: str = "rollout/moe") -> dict[str, Any]:
        """The metrics of the interval so far, then start a new interval."""
        metrics = self.compute(prefix)
        self.reset()
        return metrics


def get_metric_data_with_optional_routed_experts(
    keys: list[str],
    partition_id: str,
    fields: list[str],
    moe_lb_metrics_interval: int,
    global_steps: int,
    accumulator: RolloutMoELoadBalanceMetricsAccumulator,
    kv_batch_get: Callable[..., Any],
) -> Any:
    """`kv_batch_get` of `fields`, plus ``routed_experts`` while the metric is on; when the
    store has no routed experts (a ValueError naming them), fetch without and ask again only
    after the next interval."""
    if moe_lb_metrics_interval > 0 and accumulator.should_request_routed_experts(global_steps):
        try:
            return kv_batch_get(
                keys=keys, partition_id=partition_id, select_fields=[*fields, "routed_experts"]
            )
        except ValueError as exc:
            if "routed_experts" not in str(exc):
                raise
            accumulator.defer_routed_experts_retry(global_steps, moe_lb_metrics_interval)
            accumulator.warn_skip_once(
                "missing_routed_experts", f"Skipping rollout MoE load-balance metrics: {exc}"
            )
    return kv_batch_get(keys=keys, partition_id=partition_id, select_fields=fields)


def compute_moe_lb_metrics(
    metrics_batch: DataProto,
    moe_lb_metrics_interval: int,
    global_steps: int,
    accumulator: RolloutMoELoadBalanceMetricsAccumulator,
) -> dict[str, Any]:
    """Accumulate the batch's counts; every `moe_lb_metrics_interval` steps return the
    interval's metrics with ``routed_experts_found`` and ``routed_expert_assignments``."""
    if moe_lb_metrics_interval <= 0:
        return {}
    tensors = metrics_batch.batch
    updated = accumulator.update(tensors.get("routed_experts", None), tensors.get("response_mask", None))
    if global_steps % moe_lb_metrics_interval != 0:
        return {}
    assignments = accumulator.total_assignments()
    metrics = accumulator.pop_metrics()
    metrics["rollout/moe/routed_experts_found"] = float(assignments > 0)
    metrics["rollout/moe/routed_expert_assignments"] = assignments
    if not updated and assignments == 0:
        accumulator.warn_skip_once(
            "no_routed_expert_counts", "Skipping rollout MoE load-balance metrics: no routed expert counts."
        )
    return metrics
