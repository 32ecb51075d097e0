"""``algorithm.rollout_correction``: verl 0.9.1's rollout-correction settings, checked at start-up.

The math lives in ``rollout_corr_helper``; ``rollout_correction.apply_rollout_correction``
runs it in the trainer's step. Field names, meanings and the YAML defaults are verl's
(``verl/trainer/config/algorithm/rollout_correction.yaml``): everything off until
``rollout_is`` or ``rollout_rs`` is set.
"""

from __future__ import annotations

from dataclasses import dataclass

from verl_megatron.errors import UserInputError

__all__ = ["RolloutCorrectionConfig", "RolloutCorrectionConfigError"]

_WHERE = "algorithm.rollout_correction"
_LOSS_TYPES = ("ppo_clip", "reinforce")


class RolloutCorrectionConfigError(UserInputError):
    """A rollout-correction setting that cannot work; the message names the key."""


@dataclass
class RolloutCorrectionConfig:
    """Importance sampling and rejection of tokens/sequences whose rollout policy differs
    from the training policy (another engine's numerics, or stale weights in async training)."""

    bypass_mode: bool = False
    """Skip the actor's old-log-prob forward pass and train against the rollout's own log-probs
    (``old_log_probs := rollout_log_probs``), saving one forward pass per step. Accepted only
    where the two are equal bit for bit: ``rollout.name=native`` with ``rollout.bitwise_parity=true``
    (otherwise the run stops at start-up). The ``rollout/logprob_diff/*`` metrics are then not
    computed (there is no recomputation to compare with); the parity tests check them instead."""
    rollout_is: str | None = None
    """IS weight level: null (no weights, metrics only), ``token`` (per-token ratio) or
    ``sequence`` (product of the row's token ratios)."""
    rollout_is_threshold: float | int | str = 2.0
    """A number: truncate the weights at it (TIS). A ``"lower_upper"`` string such as
    ``"0.5_5.0"``: zero the weights outside [lower, upper] (IcePop). Write both bounds with a
    decimal point: YAML reads ``0.5_5`` as the number 0.55."""
    rollout_is_batch_normalize: bool = False
    """Divide the IS weights by their batch mean (tokens, or rows at sequence level)."""
    rollout_rs: str | None = None
    """Rejection (comma separated, a token is kept only if every option keeps it): token_k1,
    token_k2, token_k3, seq_{sum,mean}_{k1,k2,k3}, seq_max_{k2,k3}. Rejected tokens (or whole
    sequences) leave the response mask."""
    rollout_rs_threshold: float | int | str | None = None
    """One value shared by the rs options, or one per option (comma separated). k1 options take
    ratio bounds ``"lower_upper"`` (a single value u means [1/u, u]); k2/k3 an upper bound."""
    loss_type: str = "ppo_clip"
    """Policy loss in bypass mode: ``ppo_clip`` (the ratio corrects) or ``reinforce`` (IS weights)."""

    def __post_init__(self) -> None:
        self.validate()

    @property
    def enabled(self) -> bool:
        """Whether the trainer computes IS weights or a rejection mask."""
        return self.rollout_is is not None or self.rollout_rs is not None

    def validate(self) -> None:
        """Raise RolloutCorrectionConfigError naming the key of the first bad value."""
        from verl_megatron.algos import rollout_corr_helper as helper

        if self.rollout_is is not None and self.rollout_is not in helper.IS_LEVELS:
            raise RolloutCorrectionConfigError(
                f"{_WHERE}.rollout_is must be null, 'token' or 'sequence', got {self.rollout_is!r}"
            )
        try:
            helper.parse_rollout_is_threshold(self.rollout_is_threshold)
        except (TypeError, ValueError) as err:
            raise RolloutCorrectionConfigError(f"{_WHERE}.rollout_is_threshold: {err}") from None
        if self.rollout_rs is not None:
            try:
                options = helper._rs_options(self.rollout_rs)
            except ValueError as err:
                raise RolloutCorrectionConfigError(f"{_WHERE}.rollout_rs: {err}") from None
            if self.rollout_rs_threshold is None:
                raise RolloutCorrectionConfigError(
                    f"{_WHERE}.rollout_rs={self.rollout_rs!r} needs {_WHERE}.rollout_rs_threshold"
                )
            try:
                helper.parse_rollout_rs_thresholds(options, self.rollout_rs_threshold)
            except (TypeError, ValueError) as err:
                raise RolloutCorrectionConfigError(f"{_WHERE}.rollout_rs_threshold: {err}") from None
        if self.loss_type not in _LOSS_TYPES:
            raise RolloutCorrectionConfigError(
                f"{_WHERE}.loss_type must be one of {list(_LOSS_TYPES)}, got {self.loss_type!r}"
            )
