"""The memory plan as text (one block per distinct rank position) and as a JSON-ready dict."""

from __future__ import annotations

from typing import Any

from verl_megatron.planner.plan import MemoryPlan, PositionPlan

__all__ = ["plan_dict", "render"]

GiB = 2**30


def _gib(n: float) -> str:
    return f"{n / GiB:.2f}"


def _position_lines(p: PositionPlan) -> list[str]:
    lines = [p.position.label()]
    for name, m in p.roles.items():
        s = m.state
        other = ""
        if m.state_other_optimizer is not None:
            o = m.state_other_optimizer
            other = f" | other dist. optimizer setting: grads {_gib(o.grads)} optimizer {_gib(o.optimizer)}"
        lines.append(
            f"  {name:<13} params {_gib(s.params)}  grads {_gib(s.grads)}  optimizer {_gib(s.optimizer)} "
            f"(master {_gib(s.master)} + moments {_gib(s.moments)})  activations train {_gib(m.train_activations)}"
            f" / forward {_gib(m.infer_activations)}{other}"
        )
    for name, value in p.engine.items():
        lines.append(f"  {'rollout':<13} {name} {_gib(value)}")
    lines.append("  phases (GiB): " + "  ".join(f"{k} {_gib(v)}" for k, v in p.phases.items()))
    return lines


def render(plan: MemoryPlan) -> str:
    """The plan for a terminal: every rank position, then the verdict and the savings."""
    layout = plan.layout
    lines = [
        f"memory plan: {plan.world_size} GPUs of {_gib(plan.gpu_bytes)} GiB; tp={layout.tp} pp={layout.pp} "
        f"cp={layout.cp} ep={layout.ep} dp={layout.dp} (GiB = 2^30 bytes; model state exact, activations modelled)",
    ]
    for p in plan.positions:
        lines.extend(_position_lines(p))
    worst = max(plan.positions, key=lambda p: p.peak)
    phase = max(worst.phases, key=worst.phases.get)
    margin = plan.gpu_bytes - plan.peak
    verdict = "FITS" if plan.fits else "DOES NOT FIT"
    lines.append(
        f"verdict: {verdict}: peak {_gib(plan.peak)} GiB on {worst.position.label()} in {phase}; "
        f"margin {_gib(margin)} GiB"
    )
    for change, saved in plan.savings:
        lines.append(f"  saves {_gib(saved)} GiB: {change}")
    return "\n".join(lines)


def plan_dict(plan: MemoryPlan) -> dict[str, Any]:
    """Everything in bytes, for ``--json``."""
    return {
        "world_size": plan.world_size,
        "gpu_bytes": plan.gpu_bytes,
        "layout": {k: getattr(plan.layout, k) for k in ("tp", "pp", "cp", "ep", "dp", "vpp", "etp")},
        "fits": plan.fits,
        "peak_bytes": plan.peak,
        "margin_bytes": plan.gpu_bytes - plan.peak,
        "savings": [{"change": c, "saved_bytes": s} for c, s in plan.savings],
        "positions": [
            {
                "position": vars(p.position),
                "roles": {
                    name: {
                        "params": m.state.params,
                        "grads": m.state.grads,
                        "optimizer_master": m.state.master,
                        "optimizer_moments": m.state.moments,
                        "other_distributed_optimizer": None
                        if m.state_other_optimizer is None
                        else vars(m.state_other_optimizer),
                        "train_activations": m.train_activations,
                        "forward_activations": m.infer_activations,
                    }
                    for name, m in p.roles.items()
                },
                "engine": p.engine,
                "phases": p.phases,
            }
            for p in plan.positions
        ],
    }
