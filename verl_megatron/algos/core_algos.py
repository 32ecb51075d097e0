"""PPO-family RL math with verl 0.9's names and signatures: pure functions on tensors.

- loss aggregation: `agg_loss` (global counts for dp), `megatron_microbatch_loss`
- policy losses: `compute_policy_loss`, registry `register_policy_loss` / `get_policy_loss_fn`
  with vanilla, dppo_tv, dppo_kl, gspo, sapo, gpg, clip_cov, kl_cov, geo_mean, dro, cispo,
  bypass_mode; `compute_policy_loss_reinforce` (bypass mode's REINFORCE)
- advantage estimators: `AdvantageEstimator`, `register_adv_est` / `get_adv_estimator_fn`
  with gae, grpo, grpo_vectorized, grpo_passk, gdpo, rloo, rloo_vectorized,
  reinforce_plus_plus(_baseline), remax, opo, gpg, optimal_token_baseline,
  tir_optimal_token_baseline
- PF-PPO resampling: `compute_pf_ppo_reweight_data`

The registries are looked up through this module's attributes: rebinding e.g.
``core_algos.POLICY_LOSS_REGISTRY`` to another dict (as verl's tests do) switches both
registration and lookup to it.
- KL: `kl_penalty`, `FixedKLController`, `AdaptiveKLController`, `get_kl_controller`,
  `compute_rewards`, `apply_kl_penalty_to_rewards`
- value and entropy: `compute_value_loss`, `compute_entropy_loss`, `entropy_from_logits`

Every function defaults to verl 0.9.1's numbers, edge cases included. The project's
trainer asks for its deliberate differences explicitly: `robust=True` for `agg_loss`,
`compute_value_loss`, `compute_entropy_loss` and (as ``global_batch_info["robust"]``) the
policy losses; `compute_gae_advantage_return(..., zero_masked=True)`; and
``policy_loss.geo_mean_valid_rows`` for geo_mean.
"""

from verl_megatron.algos.advantages import (
    ADV_ESTIMATOR_REGISTRY,
    AdvantageEstimator,
    compute_gae_advantage_return,
    compute_gdpo_outcome_advantage,
    compute_gpg_outcome_advantage,
    compute_grpo_outcome_advantage,
    compute_grpo_passk_outcome_advantage,
    compute_grpo_vectorized_outcome_advantage,
    compute_opo_outcome_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_remax_outcome_advantage,
    compute_rloo_outcome_advantage,
    compute_rloo_vectorized_outcome_advantage,
    get_adv_estimator_fn,
    register_adv_est,
)
from verl_megatron.algos.aggregation import LOSS_AGG_MODES, agg_loss, megatron_microbatch_loss
from verl_megatron.algos.bypass_losses import (
    compute_policy_loss_bypass_mode,
    compute_policy_loss_reinforce,
)
from verl_megatron.algos.cov_losses import (
    compute_policy_loss_clip_cov,
    compute_policy_loss_kl_cov,
)
from verl_megatron.algos.dppo_losses import (
    compute_policy_loss_dppo_kl,
    compute_policy_loss_dppo_tv,
    compute_policy_loss_dro,
)
from verl_megatron.algos.kl import (
    KL_PENALTY_NAMES,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty_to_rewards,
    compute_rewards,
    get_kl_controller,
    kl_penalty,
    kl_penalty_forward,
)
from verl_megatron.algos.losses import compute_entropy_loss, compute_value_loss
from verl_megatron.algos.pf_ppo import compute_pf_ppo_reweight_data
from verl_megatron.algos.policy_losses import (
    POLICY_LOSS_REGISTRY,
    PolicyLossFn,
    compute_policy_loss,
    compute_policy_loss_cispo,
    compute_policy_loss_geo_mean,
    compute_policy_loss_gpg,
    compute_policy_loss_gspo,
    compute_policy_loss_sapo,
    compute_policy_loss_vanilla,
    get_policy_loss_fn,
    register_policy_loss,
)
from verl_megatron.algos.token_baselines import (
    compute_multi_turn_optimal_token_baseline_advantage,
    compute_optimal_token_baseline_advantage,
)
from verl_megatron.utils.torch_functional import (
    entropy_from_logits,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)

__all__ = [
    "ADV_ESTIMATOR_REGISTRY",
    "KL_PENALTY_NAMES",
    "LOSS_AGG_MODES",
    "POLICY_LOSS_REGISTRY",
    "AdaptiveKLController",
    "AdvantageEstimator",
    "FixedKLController",
    "PolicyLossFn",
    "agg_loss",
    "apply_kl_penalty_to_rewards",
    "compute_entropy_loss",
    "compute_gae_advantage_return",
    "compute_gdpo_outcome_advantage",
    "compute_gpg_outcome_advantage",
    "compute_grpo_outcome_advantage",
    "compute_grpo_passk_outcome_advantage",
    "compute_grpo_vectorized_outcome_advantage",
    "compute_multi_turn_optimal_token_baseline_advantage",
    "compute_opo_outcome_advantage",
    "compute_optimal_token_baseline_advantage",
    "compute_pf_ppo_reweight_data",
    "compute_policy_loss",
    "compute_policy_loss_bypass_mode",
    "compute_policy_loss_cispo",
    "compute_policy_loss_clip_cov",
    "compute_policy_loss_dppo_kl",
    "compute_policy_loss_dppo_tv",
    "compute_policy_loss_dro",
    "compute_policy_loss_geo_mean",
    "compute_policy_loss_gpg",
    "compute_policy_loss_gspo",
    "compute_policy_loss_kl_cov",
    "compute_policy_loss_reinforce",
    "compute_policy_loss_sapo",
    "compute_policy_loss_vanilla",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_remax_outcome_advantage",
    "compute_rewards",
    "compute_rloo_outcome_advantage",
    "compute_rloo_vectorized_outcome_advantage",
    "compute_value_loss",
    "entropy_from_logits",
    "get_adv_estimator_fn",
    "get_kl_controller",
    "get_policy_loss_fn",
    "kl_penalty",
    "kl_penalty_forward",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "megatron_microbatch_loss",
    "register_adv_est",
    "register_policy_loss",
]
