"""The PPO critic (value model) on megatron model chunks ending in a value head.

Called like the actor (see ``verl_megatron.workers.actor``): every rank passes the same
global batch and gets whole results back. The value of response position t is the
model output at the position before response token t, i.e. the value of the state
from which token t was generated (verl's convention). Values are 0 where
``response_mask`` is 0.

Batch keys: ``input_ids``/``attention_mask`` [B, Tp+Tr], ``responses``/``response_mask``
[B, Tr]; for ``update_critic`` also ``values`` (the old values) and ``returns``.
"""

from __future__ import annotations

import torch

from verl_megatron.algos import core_algos
from verl_megatron.distributed.parallel import Runtime
from verl_megatron.models.matmul_route import MatmulRoute
from verl_megatron.models.megatron_model import attach_schedule_hooks
from verl_megatron.protocol import DataProto
from verl_megatron.workers.actor import batch_tensors
from verl_megatron.workers.batching import MicroBatch
from verl_megatron.workers.config import CriticConfig
from verl_megatron.workers.model_runner import ModelRunner, StepResult, dp_share
from verl_megatron.workers.ppo_updates import PPOUpdates

__all__ = ["MegatronCritic"]

_MODEL_KEYS = ("input_ids", "attention_mask", "responses", "response_mask")
_CRITIC_METRICS = ("vf_loss", "vf_clipfrac", "vpred_mean")


class MegatronCritic(PPOUpdates):
    """Value model: values for the batch and clipped value-loss updates.

    ``chunks`` are DDP-wrapped chunks whose last stage outputs [b, S, 1] values (built with
    ``build_gpt_chunks(..., value_head=True)``); ``optimizer`` and ``scheduler`` as for
    :class:`~verl_megatron.workers.actor.MegatronActor`. All stay reachable as attributes.
    ``route``: the ``MatmulRoute`` the chunks were built with, on during updates (see ``PPOUpdates``).
    """

    def __init__(
        self, runtime: Runtime, config: CriticConfig, chunks: list[torch.nn.Module], optimizer, scheduler,
        route: MatmulRoute | None = None,
    ) -> None:  # fmt: skip
        if not all(hasattr(c, "no_sync") for c in chunks):
            raise ValueError(
                "MegatronCritic needs DDP-wrapped chunks (verl_megatron.models.megatron_model.wrap_ddp)"
            )
        self.runtime = runtime
        config.validate()
        self.config = config
        self.chunks = chunks
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.route = route
        self.runner = ModelRunner(
            runtime,
            chunks,
            use_remove_padding=config.use_remove_padding,
            merges_cp=True,
            share_prefix=config.share_prompt_prefix,
            group_by_length=config.group_by_length,
        )
        self.update_calls = 0
        attach_schedule_hooks(chunks)

    @staticmethod
    def _values(mb: MicroBatch, output: torch.Tensor) -> torch.Tensor:
        """[r, Tr] float32 values of mb's response positions, 0 where response_mask is 0."""
        if output.shape[-1] != 1:
            raise ValueError(
                f"the critic model must output one value per position ([b, S, 1]), got {tuple(output.shape)}; "
                "build it with value_head=True"
            )
        values = mb.inputs.merge_cp(mb.inputs.gather(output)[..., 0].float())
        mask = mb.tensors["response_mask"].to(values.device).bool()
        mask &= mb.inputs.response_valid.to(values.device)
        return torch.where(mask, values, torch.zeros_like(values))

    def compute_values(self, data: DataProto) -> torch.Tensor:
        """Values [B, Tr] of the states before each response token; forward only."""
        batch = batch_tensors(data, _MODEL_KEYS, "MegatronCritic.compute_values")
        cfg = self.config
        meta = data.meta_info
        size, width = batch["responses"].shape
        rows = dp_share(size, self.runtime.layout.dp, self.runtime.dp_rank)
        mbs = self.runner.split(
            {k: v[rows] for k, v in batch.items()},
            micro_batch_size=meta.get("micro_batch_size", cfg.infer_micro_batch_size),
            use_dynamic_bsz=meta.get("use_dynamic_bsz", cfg.use_dynamic_bsz),
            max_token_len=meta.get("max_token_len", cfg.ppo_infer_max_token_len_per_gpu),
            tensor_keys=("response_mask",),
        )

        def step(mb: MicroBatch, output: torch.Tensor) -> StepResult:
            return StepResult(outputs={"values": self._values(mb, output)})

        with torch.no_grad():
            results = self.runner.run(mbs, step, forward_only=True)
        local = self.runner.collect_outputs(results, mbs, "values", (len(rows), width))
        return self.runner.gather_dp(local, size)

    def update_critic(self, data: DataProto) -> dict[str, float | list[float]]:
        """PPO epochs of clipped value-loss steps over mini-batches; one optimizer step each.

        Returns per-step lists critic/vf_loss, critic/vf_clipfrac, critic/vpred_mean (each
        over the whole mini-batch) and critic/grad_norm, plus critic/lr and
        critic/skipped_steps (steps dropped for a non-finite gradient norm).
        """
        batch = batch_tensors(data, (*_MODEL_KEYS, "values", "returns"), "MegatronCritic.update_critic")
        return self._ppo_update(
            batch,
            prefix="critic",
            tensor_keys=("response_mask", "values", "returns"),
            loss_step=self._value_step,
            metric_names=_CRITIC_METRICS,
        )

    def _value_step(
        self, mb: MicroBatch, output: torch.Tensor, *, counts: dict, num_micro: int
    ) -> StepResult:
        """Clipped value loss of one micro-batch with global counts, and its metric partial sums."""
        device = output.device
        t = {k: v.to(device) for k, v in mb.tensors.items()}
        vpreds = self._values(mb, output)
        mask = t["response_mask"].float() * mb.inputs.response_valid.to(device)
        vf_loss, vf_clipfrac = core_algos.compute_value_loss(
            vpreds,
            t["returns"].float(),
            t["values"].float(),
            mask,
            self.config.cliprange_value,
            self.config.loss_agg_mode,
            **counts,
            robust=True,  # empty mini-batch -> 0 (verl: NaN); padding never leaks; float32 sums
        )
        share = mask.sum() / max(counts["batch_num_tokens"], 1)  # stays on the device: no sync
        metrics = {
            "vf_loss": vf_loss.detach() / counts["dp_size"],
            "vf_clipfrac": vf_clipfrac.detach() * share,
            "vpred_mean": (vpreds.detach() * mask).sum() / max(counts["batch_num_tokens"], 1),
        }
        return StepResult(loss=core_algos.megatron_microbatch_loss(vf_loss, num_micro), metrics=metrics)
