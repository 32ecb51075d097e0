"""Mixture-of-experts pieces of a training step: padding-aware routing, aux-loss scaling, metrics.

The load-balancing (aux) loss is not returned by the model: each router attaches its gradient
to the activations through megatron's ``MoEAuxLossAutoScaler``, scaled in backward by one
process-wide factor that megatron's schedule sets to ``cp / num_microbatches`` after every
forward. The runner scales each micro-batch's policy loss itself (see ``ModelRunner.run``):
real micro-batches by ``cp / len(micro_batches)`` and the interleaved schedule's padding
micro-batches by 0. :func:`scale_aux_loss` gives the aux loss exactly those factors: a hook on
the chunk's output sets the factor when that micro-batch's backward starts (the output's
gradient is the first one its backward computes), so no other micro-batch's value is in force.

Padding positions of a micro-batch are routed like tokens, but :func:`model_kwargs` passes
them to megatron as ``padding_mask`` so they count neither in the aux loss nor in the expert
load, and a micro-batch's aux loss does not depend on how much padding a layout adds.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from verl_megatron.distributed.modules import unwrap
from verl_megatron.distributed.parallel import Runtime
from verl_megatron.workers.model_inputs import ModelInputs


def is_moe(chunks: Sequence[torch.nn.Module]) -> bool:
    """Whether the chunks are a mixture-of-experts model (megatron's ``num_moe_experts`` set)."""
    return getattr(unwrap(chunks[0]).config, "num_moe_experts", None) is not None


def model_kwargs(inputs: ModelInputs, device: torch.device) -> dict[str, torch.Tensor]:
    """Extra GPTModel arguments of an MoE micro-batch: the padding mask [b, S], True = filler."""
    if inputs.padding is None:
        return {}
    return {"padding_mask": inputs.padding.to(device)}


def scale_aux_loss(output: torch.Tensor, scale: float, config) -> None:
    """Give this micro-batch's aux-loss gradient the factor ``scale`` (times megatron's
    ``grad_scale_func`` loss scale when one is set, as megatron does)."""
    if not output.requires_grad:
        return
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    device = output.device
    grad_scale = getattr(config, "grad_scale_func", None)

    def start_of_backward(grad: torch.Tensor) -> None:
        one = torch.ones(1, device=device)
        base = grad_scale(one) if grad_scale is not None else one
        # A fresh tensor: megatron keeps the first one it is given and copies later values into it.
        MoEAuxLossAutoScaler.set_loss_scale((base * scale).detach().clone())

    output.register_hook(start_of_backward)


def reset_aux_loss_tracker() -> None:
    """Empty megatron's process-wide per-layer aux-loss tracker.

    Entries are dropped rather than zeroed (megatron's ``clear_aux_losses_tracker``): an entry is
    sized by the layer count of the model that first logged into it, so a later model with more
    layers in the same process would index past its end.
    """
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    get_moe_layer_wise_logging_tracker().clear()


# A router's own per-step counts (megatron's expert-bias update reads them after the step).
_ROUTER_COUNTS = ("local_tokens_per_expert",)


def _tracker_values() -> dict[str, torch.Tensor]:
    """Name -> [layers] sums of megatron's process-wide per-layer aux-loss tracker."""
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    return {name: entry["values"] for name, entry in get_moe_layer_wise_logging_tracker().items()}


def _router_counts(router) -> list[str]:
    """Names of the per-step counts ``router`` keeps (megatron leaves them None where the feature is off)."""
    return [name for name in _ROUTER_COUNTS if isinstance(getattr(router, name, None), torch.Tensor)]


class MoEStats:
    """Expert load and aux loss per MoE layer over the training forwards since the last collect.

    Load: tokens (padding excluded) routed to each expert, counted by a forward hook on every
    router while training with gradients. Aux loss: megatron's per-layer tracker (filled when
    ``moe_router_load_balancing_type`` has a loss), averaged over micro-batches.

    The interleaved schedule's padding micro-batches (repeats with no loss) count nowhere: the
    runner says which micro-batch is one (:meth:`before_forward`, :meth:`before_backward`), and
    around such a router call the hooks put back what the router added to megatron's aux-loss
    tracker and to its own per-step counts (the expert-bias update's), so every layout reports
    the real tokens once. The router itself runs as usual: its aux loss is unchanged (the
    runner scales that micro-batch's by 0).
    """

    def __init__(self, runtime: Runtime, chunks: Sequence[torch.nn.Module]) -> None:
        from megatron.core.transformer.moe.router import Router

        self.runtime = runtime
        self.config = unwrap(chunks[0]).config
        self.num_layers = self.config.num_layers
        # On the device, so counting a micro-batch waits for nothing; calls are host counts.
        self.counts = torch.zeros(
            self.num_layers, self.config.num_moe_experts, dtype=torch.float64, device=runtime.device
        )
        self.calls = torch.zeros(self.num_layers, dtype=torch.float64)
        self.moe_layers: set[int] = set()
        self.counted = True  # whether the routers' next training forwards are a real micro-batch
        # layer -> (tracker values, router counts) before a padding call
        self._saved: dict[int, tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = {}
        for chunk in chunks:
            for module in unwrap(chunk).modules():
                if isinstance(module, Router):
                    self.moe_layers.add(module.layer_number - 1)
                    module.register_forward_pre_hook(self._save)
                    module.register_forward_hook(self._count, with_kwargs=True)
        self._clear_tracker()

    def before_forward(self, counted: bool) -> None:
        """The next micro-batch's forward is real (``counted``) or a schedule padding repeat."""
        self.counted = counted

    def before_backward(self, output: torch.Tensor, counted: bool, aux_scale: float, config) -> None:
        """After the forward of ``output``'s micro-batch: its aux loss gets the factor ``aux_scale``
        (:func:`scale_aux_loss`), and its flag holds again from the start of its backward, where
        recomputed layers (activation checkpointing) run their routers again."""
        scale_aux_loss(output, aux_scale, config)
        if output.requires_grad:
            output.register_hook(lambda grad: self.before_forward(counted))

    def _save(self, router, args) -> None:
        if self.counted or not (router.training and torch.is_grad_enabled()):
            return
        layer = router.layer_number - 1
        tracker = {name: values[layer].clone() for name, values in _tracker_values().items()}
        counts = {name: getattr(router, name).clone() for name in _router_counts(router)}
        self._saved[layer] = (tracker, counts)

    def _restore(self, router, layer: int) -> None:
        """Undo a padding call's additions to the tracker and the router's counts (device copies)."""
        tracker, counts = self._saved.pop(layer)
        for name, values in _tracker_values().items():
            if name in tracker:
                values[layer].copy_(tracker[name])
            else:  # the entry was created by this call: nothing was there before
                values[layer].zero_()
        for name, count in counts.items():
            getattr(router, name).copy_(count)

    def _count(self, router, args, kwargs, output) -> None:
        if not (router.training and torch.is_grad_enabled()):
            return
        layer = router.layer_number - 1
        if not self.counted:
            self._restore(router, layer)
            return
        _, routing_map = output
        padding = args[1] if len(args) > 1 else kwargs.get("padding_mask")
        routed = routing_map.detach().to(torch.float64)
        if padding is not None:
            routed = routed * (~padding.reshape(-1, 1)).to(routed.device, torch.float64)
        self.counts[layer] += routed.sum(dim=0).to(self.counts.device)
        self.calls[layer] += 1

    @staticmethod
    def _clear_tracker() -> None:
        reset_aux_loss_tracker()

    def begin(self) -> None:
        """Start an update: drop what other models logged into megatron's process-wide aux-loss
        tracker since the last collect (an MoE critic's update runs between two actor updates)."""
        self._clear_tracker()

    def _aux_losses(self) -> torch.Tensor:
        """[num_layers] sum over micro-batches of each layer's raw load-balancing loss (no coefficient)."""
        values = _tracker_values().get("load_balancing_loss")
        if values is None:
            return torch.zeros(self.num_layers, dtype=torch.float64, device=self.runtime.device)
        return values.detach()[: self.num_layers].to(self.runtime.device, torch.float64)

    def collect(self, prefix: str) -> dict[str, float]:
        """Per-layer metrics of everything counted since the previous call (same on every rank).

        ``{prefix}/moe/tokens_per_expert_max/layer_<i>`` and ``.../tokens_per_expert_mean/layer_<i>``
        (tokens of the whole batch, all dp ranks), ``{prefix}/moe/load_imbalance`` (the largest
        max/mean over layers, 1 = balanced), ``.../load_balancing_loss/layer_<i>`` (megatron's
        per-micro-batch loss before its coefficient) and ``{prefix}/moe/aux_loss`` (coefficient
        times the loss, summed over layers: what each micro-batch's loss gained).
        """
        runtime = self.runtime
        # counts, per-layer call counts, aux losses: one reduction for all three
        packed = torch.cat([self.counts.reshape(-1), self.calls.to(runtime.device), self._aux_losses()])
        if runtime.layout.dp * runtime.layout.cp > 1:
            dist.all_reduce(packed, group=runtime.dp_group(with_cp=True))
        if runtime.layout.pp > 1:
            dist.all_reduce(packed, group=runtime.pp_group())
        experts = self.config.num_moe_experts
        counts = packed[: self.num_layers * experts].reshape(self.num_layers, experts)
        if self.config.sequence_parallel:
            dist.all_reduce(counts, group=runtime.tp_group())  # each tp rank routed a slice of the tokens
        packed = packed.cpu()
        counts = packed[: self.num_layers * experts].reshape(self.num_layers, experts)
        calls = packed[self.num_layers * experts : self.num_layers * (experts + 1)]
        aux = packed[self.num_layers * (experts + 1) :]
        self.counts.zero_()
        self.calls.zero_()
        self._clear_tracker()
        metrics: dict[str, float] = {}
        coeff = float(self.config.moe_aux_loss_coeff)
        total_aux, imbalance = 0.0, 0.0
        for layer in sorted(self.moe_layers_all()):
            mean = float(counts[layer].mean())
            metrics[f"{prefix}/moe/tokens_per_expert_max/layer_{layer}"] = float(counts[layer].max())
            metrics[f"{prefix}/moe/tokens_per_expert_mean/layer_{layer}"] = mean
            if mean > 0:
                imbalance = max(imbalance, float(counts[layer].max()) / mean)
            if calls[layer] > 0:
                # calls and aux were summed over dp ranks alike: their ratio is the dp mean.
                layer_aux = float(aux[layer] / calls[layer])
                metrics[f"{prefix}/moe/load_balancing_loss/layer_{layer}"] = layer_aux
                total_aux += coeff * layer_aux
        metrics[f"{prefix}/moe/load_imbalance"] = imbalance
        metrics[f"{prefix}/moe/aux_loss"] = total_aux
        return metrics

    def moe_layers_all(self) -> list[int]:
        """Global indices of every MoE layer of the model (all pipeline stages)."""
        pattern = self.config.moe_layer_freq
        if isinstance(pattern, int):
            return [i for i in range(self.num_layers) if i % pattern == 0]
        return [i for i, is_moe_layer in enumerate(pattern) if is_moe_layer]
