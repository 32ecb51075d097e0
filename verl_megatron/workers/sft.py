"""Supervised fine-tuning on the megatron actor: the same forward, backward and optimizer step.

An SFT batch (``data/sft_dataset.collate_sft``) is laid out as the actor's rows: a one-token
prompt and the rest of the conversation as the "response", ``response_mask`` 1 on the assistant's
tokens. ``SFTActor.sft_update`` runs the actor's mini-batch loop (``PPOUpdates._ppo_update``:
packing, dynamic batch size, any tp/pp/vpp/dp layout, LoRA, the skip of non-finite steps) with
the negative log-likelihood (``algos/distill.sft_loss``) in place of the policy loss; the loss is
aggregated with ``actor.loss_agg_mode`` and global counts, as in RL, so every layout gives the
same gradient. Log-probs are taken at temperature 1.
"""

from __future__ import annotations

import torch

from verl_megatron.algos import core_algos
from verl_megatron.algos.distill import sft_loss
from verl_megatron.protocol import DataProto
from verl_megatron.workers.actor import MegatronActor, batch_tensors
from verl_megatron.workers.batching import MicroBatch
from verl_megatron.workers.model_runner import StepResult

__all__ = ["SFT_KEYS", "SFTActor"]

SFT_KEYS = ("input_ids", "attention_mask", "responses", "response_mask")


class SFTActor(MegatronActor):
    """The actor with one more update: :meth:`sft_update` (built exactly like ``MegatronActor``)."""

    def sft_update(self, data: DataProto) -> dict[str, float | list[float]]:
        """One optimizer step per mini-batch (``actor.ppo_mini_batch_size`` rows) of ``data``.

        Returns per-step lists ``actor/sft_loss`` (the aggregated loss over the whole mini-batch,
        all dp ranks) and ``actor/grad_norm``, plus ``actor/lr`` and ``actor/skipped_steps``.
        """
        batch = batch_tensors(data, SFT_KEYS, "SFTActor.sft_update")
        return self._ppo_update(
            batch,
            prefix="actor",
            tensor_keys=["response_mask"],
            loss_step=self._sft_step,
            metric_names=("sft_loss",),
        )

    def _sft_step(self, mb: MicroBatch, logits: torch.Tensor, *, counts: dict, num_micro: int) -> StepResult:
        device = logits.device
        log_probs, _ = self._log_probs(mb, logits, 1.0, calculate_entropy=False)
        # A target the attention mask hides (padding) is never trained on.
        mask = mb.tensors["response_mask"].to(device).to(log_probs.dtype) * mb.inputs.response_valid.to(
            device
        )
        agg = {
            k: counts[k] for k in ("dp_size", "batch_num_tokens", "global_batch_size", "loss_scale_factor")
        }
        loss = sft_loss(log_probs, mask, self.config.loss_agg_mode, robust=True, **agg)
        # Summed over micro-batches and dp ranks, loss / dp is the mini-batch's loss.
        metrics = {"sft_loss": loss.detach() / counts["dp_size"]}
        return StepResult(loss=core_algos.megatron_microbatch_loss(loss, num_micro), metrics=metrics)
