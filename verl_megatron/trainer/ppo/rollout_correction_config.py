"""``algorithm.rollout_correction``: verl 0.9.1's rollout-correction settings, checked at start-up.

The math lives in ``rollout_corr_helper``; ``rollout_correction.apply_rollout_correction``
runs it in the trainer's step. Field names, meanings and the YAML defaults are verl's
(``verl/trainer/config/algorithm/rollout_correction.yaml``): everything off until
``rollout_is`` or ``rollout_rs`` is set. verl's presets are classmethods
(``RolloutCorrectionConfig.decoupled_token_icepop()``, ``bypass_pg_geo_rs()``...).

verl's own import path, ``trainer.config.algorithm.RolloutCorrectionConfig``, is
`VerlRolloutCorrectionConfig`: verl's Python defaults (sequence-level IS on) and verl's
leniency at construction (a rejection option without its threshold fails where it is used,
not when the object is built); the trainer's config keeps the checks at load.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from verl_megatron.errors import UserInputError

__all__ = [
    "RolloutCorrectionConfig",
    "RolloutCorrectionConfigError",
    "VerlRolloutCorrectionConfig",
    "check_rollout_correction",
]

_WHERE = "algorithm.rollout_correction"
_LOSS_TYPES = ("ppo_clip", "reinforce")
# verl's default bounds of the geometric-mean ratio for sequence rejection (+-0.1%).
_GEO_BOUNDS = "0.999_1.001"


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

    # verl's presets. "decoupled": old_log_probs recomputed by the actor, the rollout's used for
    # the IS weights / rejection; "bypass": the rollout's log-probs are the old ones. Geometric
    # rejection (seq_mean_k1) bounds the per-token mean log-ratio; k3 rejection its mean KL.

    @classmethod
    def decoupled_token_is(cls, threshold: float = 2.0) -> RolloutCorrectionConfig:
        return cls(rollout_is="token", rollout_is_threshold=threshold, rollout_rs=None)

    @classmethod
    def decoupled_seq_is(cls, threshold: float = 2.0) -> RolloutCorrectionConfig:
        return cls(rollout_is="sequence", rollout_is_threshold=threshold, rollout_rs=None)

    @classmethod
    def decoupled_token_icepop(
        cls, threshold: float = 5.0, threshold_lower: float = 0.5
    ) -> RolloutCorrectionConfig:
        """Token IS weights zeroed outside [threshold_lower, threshold] (IcePop)."""
        return cls(rollout_is="token", rollout_is_threshold=f"{threshold_lower}_{threshold}", rollout_rs=None)

    @classmethod
    def decoupled_seq_is_rs(
        cls, is_threshold: float = 2.0, rs_threshold: str | float | None = "0.5_2.0"
    ) -> RolloutCorrectionConfig:
        return cls._preset("sequence", is_threshold, "seq_sum_k1", rs_threshold)

    @classmethod
    def decoupled_geo_rs(cls, rs_threshold: str | float | None = _GEO_BOUNDS) -> RolloutCorrectionConfig:
        return cls._preset(None, 2.0, "seq_mean_k1", rs_threshold)

    @classmethod
    def decoupled_geo_rs_seq_tis(
        cls, is_threshold: float = 2.0, rs_threshold: str | float | None = _GEO_BOUNDS
    ) -> RolloutCorrectionConfig:
        return cls._preset("sequence", is_threshold, "seq_mean_k1", rs_threshold)

    @classmethod
    def decoupled_geo_rs_token_tis(
        cls, is_threshold: float = 2.0, rs_threshold: str | float | None = _GEO_BOUNDS
    ) -> RolloutCorrectionConfig:
        return cls._preset("token", is_threshold, "seq_mean_k1", rs_threshold)

    @classmethod
    def decoupled_k3_rs(cls, rs_threshold: float = 0.01) -> RolloutCorrectionConfig:
        return cls._preset(None, 2.0, "seq_mean_k3", rs_threshold)

    @classmethod
    def decoupled_k3_rs_seq_tis(
        cls, is_threshold: float = 2.0, rs_threshold: float = 0.01
    ) -> RolloutCorrectionConfig:
        return cls._preset("sequence", is_threshold, "seq_mean_k3", rs_threshold)

    @classmethod
    def decoupled_k3_rs_token_tis(
        cls, is_threshold: float = 2.0, rs_threshold: float = 0.01
    ) -> RolloutCorrectionConfig:
        return cls._preset("token", is_threshold, "seq_mean_k3", rs_threshold)

    @classmethod
    def bypass_ppo_clip(cls) -> RolloutCorrectionConfig:
        return cls._preset(None, 2.0, None, None, loss_type="ppo_clip")

    @classmethod
    def bypass_ppo_clip_geo_rs(
        cls, rs_threshold: str | float | None = _GEO_BOUNDS
    ) -> RolloutCorrectionConfig:
        return cls._preset(None, 2.0, "seq_mean_k1", rs_threshold, loss_type="ppo_clip")

    @classmethod
    def bypass_ppo_clip_k3_rs(cls, rs_threshold: float = 0.01) -> RolloutCorrectionConfig:
        return cls._preset(None, 2.0, "seq_mean_k3", rs_threshold, loss_type="ppo_clip")

    @classmethod
    def bypass_pg_is(cls, threshold: float = 2.0) -> RolloutCorrectionConfig:
        return cls._preset("sequence", threshold, None, None, loss_type="reinforce")

    @classmethod
    def bypass_pg_token_icepop(
        cls, threshold: float = 5.0, threshold_lower: float = 0.5
    ) -> RolloutCorrectionConfig:
        return cls._preset("token", f"{threshold_lower}_{threshold}", None, None, loss_type="reinforce")

    @classmethod
    def bypass_pg_geo_rs(cls, rs_threshold: str | float | None = _GEO_BOUNDS) -> RolloutCorrectionConfig:
        return cls._preset(None, 2.0, "seq_mean_k1", rs_threshold, loss_type="reinforce")

    @classmethod
    def bypass_pg_geo_rs_seq_tis(
        cls, is_threshold: float = 2.0, rs_threshold: str | float | None = _GEO_BOUNDS
    ) -> RolloutCorrectionConfig:
        return cls._preset("sequence", is_threshold, "seq_mean_k1", rs_threshold, loss_type="reinforce")

    @classmethod
    def bypass_pg_geo_rs_token_tis(
        cls, is_threshold: float = 2.0, rs_threshold: str | float | None = _GEO_BOUNDS
    ) -> RolloutCorrectionConfig:
        return cls._preset("token", is_threshold, "seq_mean_k1", rs_threshold, loss_type="reinforce")

    @classmethod
    def disabled(cls) -> RolloutCorrectionConfig:
        return cls(rollout_is=None, rollout_rs=None)

    @classmethod
    def _preset(
        cls,
        rollout_is: str | None,
        is_threshold: float | str,
        rollout_rs: str | None,
        rs_threshold: str | float | None,
        loss_type: str | None = None,
    ) -> RolloutCorrectionConfig:
        """A decoupled preset, or a bypass one when `loss_type` is given."""
        bypass = {} if loss_type is None else {"bypass_mode": True, "loss_type": loss_type}
        return cls(
            rollout_is=rollout_is,
            rollout_is_threshold=is_threshold,
            rollout_rs=rollout_rs,
            rollout_rs_threshold=rs_threshold,
            **bypass,
        )

    @property
    def enabled(self) -> bool:
        """Whether the trainer computes IS weights or a rejection mask."""
        return self.rollout_is is not None or self.rollout_rs is not None

    def validate(self, require_rs_threshold: bool = True) -> None:
        """Raise RolloutCorrectionConfigError naming the key of the first bad value (a rejection
        option without a threshold only when `require_rs_threshold`)."""
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
            if self.rollout_rs_threshold is None and require_rs_threshold:
                raise RolloutCorrectionConfigError(
                    f"{_WHERE}.rollout_rs={self.rollout_rs!r} needs {_WHERE}.rollout_rs_threshold"
                )
            try:
                if self.rollout_rs_threshold is not None:
                    helper.parse_rollout_rs_thresholds(options, self.rollout_rs_threshold)
            except (TypeError, ValueError) as err:
                raise RolloutCorrectionConfigError(f"{_WHERE}.rollout_rs_threshold: {err}") from None
        if self.loss_type not in _LOSS_TYPES:
            raise RolloutCorrectionConfigError(
                f"{_WHERE}.loss_type must be one of {list(_LOSS_TYPES)}, got {self.loss_type!r}"
            )


@dataclass
class VerlRolloutCorrectionConfig(RolloutCorrectionConfig):
    """verl's ``RolloutCorrectionConfig`` as constructed in Python: sequence-level IS on by
    default, and a rejection option may be built without its threshold (verl fails when it is
    used). The trainer's own config (the YAML path) stays `RolloutCorrectionConfig`."""

    rollout_is: str | None = "sequence"

    def __post_init__(self) -> None:
        self.validate(require_rs_threshold=False)


def check_rollout_correction(config: Any) -> None:
    """Start-up check of a PPOConfig: rollout correction needs the rollout's log-probs. Here, not in
    ``rollout_correction.py``, so that validating a config does not import the protocol (tensordict)."""
    corr = config.algorithm.rollout_correction
    if corr.enabled and config.rollout.name != "native" and not config.rollout.calculate_log_probs:
        raise RolloutCorrectionConfigError(
            f"algorithm.rollout_correction needs the rollout's log-probs: set rollout.calculate_log_probs=true "
            f"(rollout.name={config.rollout.name!r} does not return them otherwise)"
        )
