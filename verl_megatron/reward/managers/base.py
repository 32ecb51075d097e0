"""What every reward manager shares: decode the batch, score each response,
write the reward at its last valid token, and report failures.

Containment holds by default. A user's scorer (anything but the project's
built-in rule-based scorers) runs in a worker process with a hard time limit
per call (``compute_score_timeout``, default 30 s; None: no limit), so an
exception, ``sys.exit``, ``os._exit``, a segfault, a hang or a NaN scores 0
and is counted, and training goes on. ``isolation``: "auto" (the default:
user scorers in a worker, built-ins in this process, where they are 10-100x
faster and bounded by their own parse/verify limits), "process" (always a
worker) or "none" (always in this process: only exceptions and bad values
are contained, the time limit is not enforced).

``__call__(data, return_dict=False)`` returns the reward tensor, float32
[B, T_resp] with the reward at each response's last valid token and zeros
elsewhere, or with ``return_dict=True``::

    {"reward_tensor": [B, T_resp],
     "reward_extra_info": {key: list of B values},
     "reward_metrics": {"reward/timeout_count": int, "reward/error_count": int,
                        "reward/invalid_count": int}}

``reward_extra_info`` holds every key of dict-valued scores (a sample whose
scorer failed gets 0.0 in numeric columns and None in others) and the
per-sample failure counts (0 or 1) under the ``reward/*_count`` names, so the
batch's count is their sum and every list has one entry per sample, as
verl's trainer expects.
"""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from verl_megatron.reward.managers.scoring import (
    DEFAULT_TIMEOUT_S,
    ERROR,
    INVALID,
    TIMEOUT,
    ScoreOutcome,
    ScorerPool,
    ScoreTask,
    call_contained,
)
from verl_megatron.reward.scorers import default_compute_score, is_builtin_scorer
from verl_megatron.reward.scorers.code_exec import map_side_by_side

FAILURE_METRICS = {
    TIMEOUT: "reward/timeout_count",
    ERROR: "reward/error_count",
    INVALID: "reward/invalid_count",
}
ISOLATION_MODES = ("auto", "process", "none")


@dataclass
class Sample:
    """One response to score, decoded."""

    index: int
    data_source: Any
    response_str: str
    ground_truth: Any
    extra_info: Any
    valid_response_length: int


def _column(non_tensor_batch: dict[str, Any], key: str, size: int) -> Sequence[Any]:
    if key not in non_tensor_batch:
        raise KeyError(
            f"reward manager: non_tensor_batch has no {key!r} (available: {sorted(non_tensor_batch)})"
        )
    column = non_tensor_batch[key]
    if len(column) != size:
        raise ValueError(
            f"reward manager: non_tensor_batch[{key!r}] has {len(column)} entries for {size} samples"
        )
    return column


def _ground_truth(reward_model: Any, index: int) -> Any:
    if not isinstance(reward_model, dict) or "ground_truth" not in reward_model:
        raise KeyError(
            f"reward manager: sample {index} has reward_model={reward_model!r}; expected a dict with 'ground_truth'"
        )
    return reward_model["ground_truth"]


class RewardManagerBase:
    """Shared driver; subclasses choose how scores are computed (``_score``)
    and may adjust each reward (``_adjust``)."""

    def __init__(
        self,
        tokenizer: Any,
        num_examine: int,
        compute_score: Callable[..., Any] | None = None,
        reward_fn_key: str = "data_source",
        compute_score_timeout: float | None = DEFAULT_TIMEOUT_S,
        isolation: str = "auto",
    ) -> None:
        if compute_score_timeout is not None and not (
            isinstance(compute_score_timeout, (int, float)) and compute_score_timeout > 0
        ):
            raise ValueError(
                f"{type(self).__name__}: compute_score_timeout must be a positive number of seconds "
                f"or None, got {compute_score_timeout!r}"
            )
        if isolation not in ISOLATION_MODES:
            raise ValueError(
                f"{type(self).__name__}: isolation must be one of {ISOLATION_MODES}, got {isolation!r}"
            )
        self.tokenizer = tokenizer
        self.num_examine = num_examine  # decoded samples printed per data source and call
        self.compute_score = compute_score or default_compute_score
        self.reward_fn_key = reward_fn_key
        self.compute_score_timeout = compute_score_timeout
        self.isolation = isolation
        self.last_metrics: dict[str, int] = {}
        self._pool: ScorerPool | None = None

    # ---- scoring strategies -------------------------------------------------

    @property
    def isolated(self) -> bool:
        """Whether scorer calls run in killable worker processes (see the module docstring)."""
        if self.isolation == "auto":
            return not is_builtin_scorer(self.compute_score)
        return self.isolation == "process"

    def _score(self, samples: list[Sample]) -> list[ScoreOutcome]:
        """One outcome per sample: one worker process (more only past hung calls) or this process."""
        tasks = [self._task(sample) for sample in samples]
        if not self.isolated:  # code data sources: their sandboxes side by side
            return map_side_by_side(self.compute_score, [task.kwargs for task in tasks], call_contained)
        return self._get_pool(num_workers=1).map(tasks)

    def _task(self, sample: Sample) -> ScoreTask:
        return ScoreTask(
            {
                "data_source": sample.data_source,
                "solution_str": sample.response_str,
                "ground_truth": sample.ground_truth,
                "extra_info": sample.extra_info,
            }
        )

    def _get_pool(self, num_workers: int, start_method: str | None = None) -> ScorerPool:
        if self._pool is None:
            self._pool = ScorerPool(self.compute_score, num_workers, self.compute_score_timeout, start_method)
        return self._pool

    def _adjust(self, sample: Sample, score: float) -> tuple[float, dict[str, Any]]:
        """Final reward from the score, plus extra per-sample values to log."""
        return score, {}

    # ---- the driver ---------------------------------------------------------

    def __call__(self, data: Any, return_dict: bool = False) -> torch.Tensor | dict[str, Any]:
        """Score ``data`` (a DataProto); see the module docstring for the result."""
        if "rm_scores" in data.batch:
            # A model-based reward was computed upstream: pass it through, as verl does.
            rm_scores = data.batch["rm_scores"]
            if not return_dict:
                return rm_scores
            keys = data.meta_info.get("reward_extra_keys", [])
            return {
                "reward_tensor": rm_scores,
                "reward_extra_info": {k: data.non_tensor_batch[k] for k in keys},
            }
        samples = self._decode(data)
        outcomes = self._score(samples)
        reward_tensor = torch.zeros_like(data.batch["responses"], dtype=torch.float32)
        extras: list[dict[str, Any]] = []
        for sample, outcome in zip(samples, outcomes):
            reward, logged = self._adjust(sample, outcome.score)
            if sample.valid_response_length > 0:  # an empty response has no token to carry it
                reward_tensor[sample.index, sample.valid_response_length - 1] = reward
            extras.append({**(outcome.info or {}), **logged})
        self.last_metrics = self._report_failures(samples, outcomes)
        self._print_examples(data, samples, outcomes)
        if not return_dict:
            return reward_tensor
        extra_info = _columns(extras)
        for status, key in FAILURE_METRICS.items():
            extra_info[key] = [int(outcome.status == status) for outcome in outcomes]
        return {
            "reward_tensor": reward_tensor,
            "reward_extra_info": extra_info,
            "reward_metrics": dict(self.last_metrics),
        }

    def _decode(self, data: Any) -> list[Sample]:
        batch = data.batch
        for key in ("prompts", "responses", "attention_mask"):
            if key not in batch:
                raise KeyError(
                    f"reward manager: data.batch has no {key!r} (available: {sorted(batch.keys())})"
                )
        prompt_len = batch["prompts"].shape[-1]
        response_len = batch["responses"].shape[-1]
        mask = batch["attention_mask"]
        if mask.shape[-1] != prompt_len + response_len:
            raise ValueError(
                f"reward manager: attention_mask has {mask.shape[-1]} columns, expected prompts ({prompt_len}) "
                f"+ responses ({response_len}) = {prompt_len + response_len}"
            )
        lengths = mask[:, prompt_len:].sum(dim=-1).tolist()
        responses = batch["responses"]
        # Each row's valid ids only: converting the padded [B, Tr] whole to lists cost ~8x more.
        response_ids = [responses[i, :length].tolist() for i, length in enumerate(lengths)]
        texts = self._decode_many(response_ids)
        size = len(response_ids)
        sources = _column(data.non_tensor_batch, self.reward_fn_key, size)
        reward_models = _column(data.non_tensor_batch, "reward_model", size)
        extra_infos = data.non_tensor_batch.get("extra_info")
        return [
            Sample(
                index=i,
                data_source=sources[i],
                response_str=texts[i],
                ground_truth=_ground_truth(reward_models[i], i),
                extra_info=None if extra_infos is None else extra_infos[i],
                valid_response_length=int(lengths[i]),
            )
            for i in range(size)
        ]

    def _decode_many(self, id_lists: list[list[int]]) -> list[str]:
        if hasattr(self.tokenizer, "batch_decode"):
            return list(self.tokenizer.batch_decode(id_lists, skip_special_tokens=True))
        return [self.tokenizer.decode(ids, skip_special_tokens=True) for ids in id_lists]

    def _report_failures(self, samples: list[Sample], outcomes: list[ScoreOutcome]) -> dict[str, int]:
        """Count failures per kind and warn once per kind with the first one."""
        metrics = {key: 0 for key in FAILURE_METRICS.values()}
        first: dict[str, tuple[Sample, ScoreOutcome]] = {}
        for sample, outcome in zip(samples, outcomes):
            if outcome.status in FAILURE_METRICS:
                metrics[FAILURE_METRICS[outcome.status]] += 1
                first.setdefault(outcome.status, (sample, outcome))
        for status, (sample, outcome) in first.items():
            count = metrics[FAILURE_METRICS[status]]
            warnings.warn(
                f"{type(self).__name__}: {count} of {len(samples)} sample(s) scored 0 because compute_score "
                f"{'timed out' if status == TIMEOUT else status}; first: sample {sample.index}, "
                f"data_source={sample.data_source!r}: {outcome.message}",
                RuntimeWarning,
                stacklevel=3,
            )
        return metrics

    def _print_examples(self, data: Any, samples: list[Sample], outcomes: list[ScoreOutcome]) -> None:
        if self.num_examine <= 0:
            return
        printed: dict[Any, int] = {}
        prompt_len = data.batch["prompts"].shape[-1]
        for sample, outcome in zip(samples, outcomes):
            if printed.get(sample.data_source, 0) >= self.num_examine:
                continue
            printed[sample.data_source] = printed.get(sample.data_source, 0) + 1
            prompt_valid = int(data.batch["attention_mask"][sample.index, :prompt_len].sum())
            prompt_ids = data.batch["prompts"][sample.index, prompt_len - prompt_valid :].tolist()
            print("[prompt]", self.tokenizer.decode(prompt_ids, skip_special_tokens=True))
            print("[response]", sample.response_str)
            print("[ground_truth]", sample.ground_truth)
            print("[score]", outcome.score)
            for key, value in (outcome.info or {}).items():
                if key != "score":
                    print(f"[{key}]", value)
            if outcome.status in FAILURE_METRICS:
                print(f"[{outcome.status}]", outcome.message)

    # ---- lifecycle ----------------------------------------------------------

    def close(self) -> None:
        """Stop scorer worker processes (also done when the manager is garbage collected,
        and by the kernel when this process dies)."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def __getstate__(self) -> dict[str, Any]:
        # Worker processes and pipes do not pickle; a copy starts its own.
        state = dict(self.__dict__)
        state["_pool"] = None
        return state


def _columns(extras: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """Per-sample dicts -> one list per key, with one entry for every sample."""
    keys: dict[str, None] = {}
    for extra in extras:
        keys.update(dict.fromkeys(extra))
    columns: dict[str, list[Any]] = {}
    for key in keys:
        present = [extra[key] for extra in extras if key in extra]
        numeric = all(isinstance(v, numbers.Real) for v in present)
        fill = 0.0 if numeric else None
        columns[key] = [extra.get(key, fill) for extra in extras]
    return columns
