"""Where the actor update's time goes: a per-stage profile, ours next to the plain PyTorch peer.

The update of ``bench_update`` (same model, batch and micro-batches) runs ``repeats`` times on
each side, interleaved, with a stage clock attached; the table reports the seconds of each
stage in the fastest repeat and its share of that update. Stages are exclusive (time inside a
nested stage is counted there only):

- forward (model): the model's forward (megatron chunk / HF model);
- log-probs + loss: log-probs of the response tokens and the policy loss (ours: the actor's
  step function, which also reports the entropy and metrics);
- backward: autograd's backward (ours: megatron's ``backward_step``);
- communication: the gradient finalisation (megatron's ``finalize_model_grads``: the
  data-parallel all-reduce and tied-embedding sync) and any ``torch.distributed`` collective;
- optimizer: zeroing grads, gradient norm, clipping and the Adam step;
- host syncs: ``Tensor.item`` / ``tolist`` / ``float()`` / ``int()`` / ``bool()`` calls
  (free on a CPU, each a device wait on a GPU); the count is reported too;
- other: the rest of the update (micro-batch building, the schedule, Python).

Run alone: ``python benchmarks/bench_profile.py [--quick]``.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from bench_update import (
    FULL,
    QUICK,
    HFPPOUpdate,
    UpdateBenchConfig,
    build_update_actor,
    make_update_batch,
    update_policy,
    update_section_config,
)
from common import Section, build_assets, run_alone

SIDES = ("ours", "peer")
STAGES = (
    "forward (model)",
    "log-probs + loss",
    "backward",
    "communication",
    "optimizer (clip, step, zero)",
    "host syncs",
    "other",
)
_SYNCS = ("item", "tolist", "__float__", "__int__", "__bool__")
_COLLECTIVES = ("all_reduce", "all_gather", "broadcast", "reduce_scatter_tensor", "all_gather_into_tensor")


class StageClock:
    """Exclusive wall time per named stage: entering a stage pauses the enclosing one; ``cpu``
    holds the process CPU seconds (all threads) of the same intervals, which a loaded machine
    inflates far less than the wall time."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)
        self.calls: Counter = Counter()
        self._stack: list[list[Any]] = []

    def reset(self) -> None:
        self.seconds.clear()
        self.cpu.clear()
        self.calls.clear()

    def _charge(self, now: tuple[float, float]) -> None:
        name, wall, cpu = self._stack[-1]
        self.seconds[name] += now[0] - wall
        self.cpu[name] += now[1] - cpu

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        now = (time.perf_counter(), time.process_time())
        if self._stack:
            self._charge(now)
        self._stack.append([name, *now])
        try:
            yield
        finally:
            now = (time.perf_counter(), time.process_time())
            self._charge(now)
            self.calls[self._stack.pop()[0]] += 1
            if self._stack:
                self._stack[-1][1:] = now

    def wrap(self, fn: Callable, name: str) -> Callable:
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            with self.stage(name):
                return fn(*args, **kwargs)

        return timed


@contextlib.contextmanager
def _patched(owner: Any, name: str, clock: StageClock, stage: str) -> Iterator[None]:
    own = name in getattr(owner, "__dict__", {})
    original = getattr(owner, name)
    setattr(owner, name, clock.wrap(original, stage))
    try:
        yield
    finally:
        if own:
            setattr(owner, name, original)
        else:  # a method found on the class: drop the instance attribute again
            delattr(owner, name)


@contextlib.contextmanager
def _common_patches(clock: StageClock) -> Iterator[None]:
    """Host syncs and collectives, on both sides."""
    import torch.distributed as dist

    with contextlib.ExitStack() as stack:
        for name in _SYNCS:
            stack.enter_context(_patched(torch.Tensor, name, clock, "host syncs"))
        for name in _COLLECTIVES:
            if hasattr(dist, name):
                stack.enter_context(_patched(dist, name, clock, "communication"))
        yield


@contextlib.contextmanager
def _ours_patches(actor, clock: StageClock) -> Iterator[None]:
    from megatron.core.pipeline_parallel import schedules

    from verl_megatron.distributed.modules import unwrap
    from verl_megatron.workers import model_runner as engine

    config = unwrap(actor.chunks[0]).config
    with contextlib.ExitStack() as stack:
        for chunk in actor.chunks:
            stack.enter_context(_patched(chunk, "forward", clock, "forward (model)"))
        stack.enter_context(_patched(actor, "_policy_step", clock, "log-probs + loss"))
        stack.enter_context(_patched(schedules, "backward_step", clock, "backward"))
        stack.enter_context(_patched(config, "finalize_model_grads_func", clock, "communication"))
        for name in ("prepare_grads", "get_grad_norm", "step_with_ready_grads"):
            stack.enter_context(_patched(actor.optimizer, name, clock, "optimizer (clip, step, zero)"))
        for name in ("clip_by_norm", "zero_grads"):
            stack.enter_context(_patched(engine, name, clock, "optimizer (clip, step, zero)"))
        stack.enter_context(_common_patches(clock))
        yield


def _profile_rows(clock: StageClock, total: float, cpu: bool = False) -> dict[str, float]:
    seconds = clock.cpu if cpu else clock.seconds
    stages = {name: seconds.get(name, 0.0) for name in STAGES if name != "other"}
    stages["other"] = max(total - sum(stages.values()), 0.0)
    return stages


@contextlib.contextmanager
def _side(
    side: str, model_dir: str, cfg: UpdateBenchConfig, clock: StageClock
) -> Iterator[Callable[[], None]]:
    """One side's update on the benchmark batch, with ``clock`` attached while the context is open."""
    batch = make_update_batch(cfg)
    if side == "ours":
        actor = build_update_actor(model_dir, cfg)
        with _ours_patches(actor, clock):
            yield lambda: update_policy(actor, batch)
        return
    peer = HFPPOUpdate(model_dir, cfg)
    peer.clock = clock

    def peer_update() -> None:
        with _common_patches(clock):
            peer(batch)

    yield peer_update


def profile_sides(cfg: UpdateBenchConfig, model_dir: str, together: bool = True) -> dict[str, dict[str, Any]]:
    """Each side's update, one warm-up and ``cfg.repeats`` timed calls with a stage clock.

    ``together``: both sides built at once and run interleaved (A, B, A, B); otherwise one side
    after the other, the first freed before the second is built (two 0.5B models with their
    gradients and Adam moments are ~16 GB). Returns per side: ``seconds`` of every repeat and,
    for the fastest, its ``best`` total, ``stages`` (exclusive seconds) and host ``syncs``; and
    the process CPU seconds of every repeat (``cpu_seconds``) and of the repeat with the least,
    ``best_cpu`` and ``cpu_stages``.
    """
    clocks = {side: StageClock() for side in SIDES}
    results: dict[str, dict[str, Any]] = {side: {"seconds": [], "cpu_seconds": []} for side in SIDES}

    def timed(side: str, fn: Callable[[], None]) -> None:
        clock, result = clocks[side], results[side]
        clock.reset()
        start, cpu_start = time.perf_counter(), time.process_time()
        fn()
        total, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        result["seconds"].append(total)
        result["cpu_seconds"].append(cpu)
        if cpu <= min(result["cpu_seconds"]):
            result.update(best_cpu=cpu, cpu_stages=_profile_rows(clock, cpu, cpu=True))
        if total <= min(result["seconds"]):
            result.update(
                best=total, stages=_profile_rows(clock, total), syncs=clock.calls.get("host syncs", 0)
            )

    def run_group(group: tuple[str, ...]) -> None:
        with contextlib.ExitStack() as stack:
            fns = {side: stack.enter_context(_side(side, model_dir, cfg, clocks[side])) for side in group}
            for fn in fns.values():
                fn()  # warm-up
            for _ in range(cfg.repeats):
                for side, fn in fns.items():
                    timed(side, fn)

    for group in [SIDES] if together else [(side,) for side in SIDES]:
        run_group(group)
        gc.collect()  # the side's model, gradients and optimizer are garbage in reference cycles
    return results


def run(cfg: UpdateBenchConfig, workdir: Path) -> Section:
    """Profile both updates; a row per stage with seconds and share of the update."""
    model_dir, _ = build_assets(workdir / "profile_model", cfg.shape, cfg.seed)
    return profile_section(cfg, profile_sides(cfg, model_dir))


def profile_section(cfg: UpdateBenchConfig, results: dict[str, dict[str, Any]]) -> Section:
    """The stage table of :func:`profile_sides`' results."""
    section = Section(
        name="profile",
        title="Update profile: seconds per stage (fastest repeat), verl-megatron vs plain PyTorch",
        columns=["stage", "ours s", "ours %", "peer s", "peer %"],
        config=update_section_config(cfg),
    )
    ours_total, ours, ours_syncs = (results["ours"][k] for k in ("best", "stages", "syncs"))
    peer_total, theirs, peer_syncs = (results["peer"][k] for k in ("best", "stages", "syncs"))
    for stage in STAGES:
        section.rows.append(
            {
                "stage": stage,
                "ours s": ours[stage],
                "ours %": 100 * ours[stage] / ours_total,
                "peer s": theirs[stage],
                "peer %": 100 * theirs[stage] / peer_total,
            }
        )
    section.rows.append(
        {"stage": "total", "ours s": ours_total, "ours %": 100.0, "peer s": peer_total, "peer %": 100.0}
    )
    section.notes.append(
        f"host syncs per update: ours {ours_syncs}, peer {peer_syncs} (counted outside nested calls)"
    )
    section.notes.append(
        "stages are exclusive wall time of the fastest repeat; 'other' = the update minus the named stages"
    )
    section.extra = {"host_syncs": {"ours": ours_syncs, "peer": peer_syncs}}
    return section


def main() -> None:
    run_alone(__doc__, run, FULL, QUICK)


if __name__ == "__main__":
    main()
