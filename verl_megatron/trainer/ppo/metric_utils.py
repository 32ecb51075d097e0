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
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

__all__ = [
    "bootstrap_metric",
    "calc_maj_val",
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
