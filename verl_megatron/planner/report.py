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
            f"(master {_gib(s.master)} + moments {_gib(s.moments)}"
            + (f"; CPU step's state in host memory {_gib(s.host)}" if s.host else "")
            + f")  activations train {_gib(m.train_activations)}"
            f" / forward {_gib(m.infer_activations)} (logits + log-prob chunk {_gib(m.train_logits)} / "
            f"{_gib(m.infer_logits)}){other}"
        )
    for name, value in p.engine.items():
        lines.append(f"  {'rollout':<13} {name} {_gib(value)}")
    for moved in p.offload:
        back = ", ".join(moved["on_gpu_in"]) or "never (not used)"
        lines.append(
            f"  offload       {moved['role']} {moved['part']} {_gib(moved['bytes'])} in host memory; on the GPU in: {back}"
        )
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
    worst, phase = plan.worst, plan.peak_phase
    margin = plan.gpu_bytes - plan.peak
    verdict = "FITS" if plan.fits else "DOES NOT FIT"
    lines.append(
        f"verdict: {verdict}: peak {_gib(plan.peak)} GiB on {worst.position.label()} in {phase}; "
        f"margin {_gib(margin)} GiB"
    )
    for change, saved in plan.savings:
        after = plan.peak - saved
        then = "fits" if after <= plan.gpu_bytes else "still too big"
        lines.append(f"  saves {_gib(saved)} GiB: {change} (peak {_gib(after)} GiB: {then})")
    return "\n".join(lines)


def plan_dict(plan: MemoryPlan) -> dict[str, Any]:
    """Everything in bytes, for ``--json``."""
    return {
        "world_size": plan.world_size,
        "gpu_bytes": plan.gpu_bytes,
        "layout": {k: getattr(plan.layout, k) for k in ("tp", "pp", "cp", "ep", "dp", "vpp", "etp")},
        "fits": plan.fits,
        "peak_bytes": plan.peak,
        "peak_rank": plan.worst.position.rank,
        "peak_phase": plan.peak_phase,
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
                        "optimizer_host": m.state.host,
                        "other_distributed_optimizer": None
                        if m.state_other_optimizer is None
                        else vars(m.state_other_optimizer),
                        "train_activations": m.train_activations,
                        "forward_activations": m.infer_activations,
                        "train_logits": m.train_logits,
                        "forward_logits": m.infer_logits,
                    }
                    for name, m in p.roles.items()
                },
                "engine": p.engine,
                "offload": p.offload,
                "phases": p.phases,
                "peak_bytes": p.peak,
            }
            for p in plan.positions
        ],
    }
