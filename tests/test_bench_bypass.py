"""benchmarks/bench_bypass.py's arithmetic: a bypass step that probed stays out of the step medians,
the probe is reported on its own and charged per step at the default interval, and the bound is the
parity step less its old-log-prob pass plus that charge; the stage timer stands in for the actor
without setting anything on it."""

from __future__ import annotations

import pytest

from tests.bench_modules import bench_module


def _bench():
    return bench_module("bench_bypass")


def _step(cpu: float, old_log_prob: float = 0.0, probe: float = 0.0, diff: float | None = None) -> dict:
    return {
        "wall": cpu / 2, "cpu": cpu, "gen": 0.5 * cpu, "old_log_prob": old_log_prob, "update_actor": 0.25,
        "probe": probe, "logprob_diff_max": diff,
    }  # fmt: skip


def test_bound_is_the_step_without_its_old_log_prob_stage_plus_the_probe():
    bench = _bench()
    assert bench.bypass_bound(0.5, 0.055) == (0.5 - 0.055) / 0.5  # 0.89: the stage's 11% share
    assert bench.bypass_bound(0.5, 0.055, probe_per_step=0.002) == (0.5 - 0.055 + 0.002) / 0.5
    assert bench.bypass_bound(None, 0.1) is None and bench.bypass_bound(0.5, None) is None
    # 8 timed steps a round, 3 rounds, alternating; one thread: CPU seconds are work, not spinning.
    assert (bench.FULL.steps, bench.FULL.rounds, bench.THREADS) == (8, 3, 1)
    assert bench.QUICK.total_steps >= 2  # quick mode still has a bypass step that does not probe


def test_probe_steps_leave_the_medians_and_are_charged_per_step():
    bench = _bench()
    bypass = bench.variant_row("parity+bypass", [_step(0.9), _step(1.2, probe=0.04), _step(0.8), _step(1.0)])
    # Medians of the 3 plain steps (0.8, 0.9, 1.0); the probe step's 1.2 is not among them.
    assert bypass["step_cpu_s (median)"] == 0.9 and bypass["step_s (median)"] == 0.45
    assert bypass["old_log_prob_cpu_s"] == 0.0 and bypass["probe_cpu_s"] == 0.04
    parity = bench.variant_row("parity", [_step(1.0, 0.1, diff=0.0), _step(1.1, 0.12, diff=0.0)])
    assert parity["step_cpu_s (median)"] == 1.1 and parity["probe_cpu_s"] is None
    assert parity["logprob diff max"] == 0.0
    off = bench.variant_row("off", [_step(0.5, 0.05)])
    ratios = bench.bypass_ratios({r["variant"]: r for r in (off, parity, bypass)}, interval=10)
    assert ratios[
        "step cpu, parity+bypass / parity (bypass saving, its probe every 10 steps included)"
    ] == pytest.approx((0.9 + 0.004) / 1.1, rel=1e-12)
    assert ratios["bound: (parity step - its old_log_prob + probe / 10) / parity step"] == pytest.approx(
        (1.1 - 0.12 + 0.004) / 1.1, rel=1e-12
    )
    assert ratios["step cpu, parity+bypass without its probe / parity"] == pytest.approx(0.9 / 1.1, rel=1e-12)
    assert ratios["probe cpu / parity old_log_prob cpu"] == pytest.approx(0.04 / 0.12, rel=1e-12)
    assert ratios["step cpu, parity / off"] == pytest.approx(1.1 / 0.5, rel=1e-12)
    # A variant that failed has no row: its ratios are None, the others stay.
    partial = bench.bypass_ratios({"parity": parity}, interval=10)
    assert partial["step cpu, parity+bypass without its probe / parity"] is None
    assert partial["bound: (parity step - its old_log_prob + probe / 10) / parity step"] is not None


class _Actor:
    def __init__(self) -> None:
        self.chunks, self.seen = ["chunk"], []

    def compute_log_prob(self, data: int) -> int:
        self.seen.append(data)
        return 2 * data

    def update_policy(self, data: int) -> None:
        raise ValueError("diverged")


def test_stage_timer_adds_each_call_to_its_stage_and_leaves_the_actor_alone():
    bench = _bench()
    actor, totals = _Actor(), {}
    ticks = iter([1.0, 1.25, 10.0, 10.5, 20.0, 21.0])  # (start, end) of each timed call
    stages = {"compute_log_prob": "old_log_prob", "update_policy": "update_actor"}
    timed = bench.TimedCalls(actor, stages, totals, clock=lambda: next(ticks))
    assert timed.chunks is actor.chunks  # other attributes are the actor's own
    assert timed.compute_log_prob(3) == 6 and timed.compute_log_prob(4) == 8 and actor.seen == [3, 4]
    with pytest.raises(ValueError, match="diverged"):
        timed.update_policy(0)
    # Both log-prob calls in one stage (0.25 + 0.5 s); a call that raised is still counted.
    assert totals == {"old_log_prob": 0.75, "update_actor": 1.0}, totals
    assert set(vars(actor)) == {"chunks", "seen"} and "compute_log_prob" not in vars(actor)
